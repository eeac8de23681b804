"""Reference outputs of transformers' Gemma 3 (its own GGUF loader, PyTorch, float32) on a GGUF file.

What it writes (one .npz, committed as test data; the weights never are):
- tokenizer: ids of transformers' tokenizer built from the same GGUF, for texts with spaces, tabs,
  newlines, accents, CJK, emoji and Gemma's special tokens;
- logits: for prompts of 8 to ~1,200 tokens, the top-64 logits and the log-sum-exp at chosen
  positions (before, at and past the 512-token sliding window);
- greedy: 40 raw argmax tokens after several prompts (EOS not special), the longest decoding past
  the window;
- perplexity (with --perplexity TEXT): the same windows as ``edge-agent eval llm`` (window 1,024,
  stride 512, BOS first in every window, each token scored once with the most context available).

Run it through scripts/gguf-reference, which makes its environment.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

TOKENIZER_TEXTS = [
    "Hello world",
    "  two leading spaces, then  double  spaces   and three",
    "tabs\tbetween\twords\t\tand a double tab",
    "new\nlines\n\n\nblank ones\r\nand CRLF\n",
    "Café, naïve, façade, Ångström, Zürich, São Paulo, Łódź",
    "中文分词测试，日本語のテキスト、한국어 문장입니다.",  # noqa: RUF001  (full-width punctuation is the point)
    "emoji 😀🎉👍🏽 and a family 👨‍👩‍👧 in one",
    "<start_of_turn>user\nTurn on the kitchen light<end_of_turn>\n<start_of_turn>model\n",
    "<bos> inside text, <eos> and <pad> and <unk> too",
    "def f(x):\n    return x ** 2  # square\n\nprint(f(3))",
    "numbers 1234567890 3.14159 -42 1e-6",
    "   ",
    "",
]
TOP_K = 64


def prompts(text: str, tok) -> list[tuple[str, list[int]]]:
    ids = tok(text, add_special_tokens=False)["input_ids"]
    out = [
        ("water", tok("Water boils at a temperature of")["input_ids"]),
        ("capital", tok("The capital of France is Paris. The capital of Germany is")["input_ids"]),
    ]
    bos = [tok.bos_token_id]
    for n in (120, 600, 1200):
        out.append((f"text{n}", bos + ids[1000 : 1000 + n - 1]))
    return out


def check_positions(n: int) -> list[int]:
    wanted = {0, n // 2, n - 1} | ({100, 510, 511, 512, 513, 700, 1023, 1100} if n > 100 else set())
    return sorted(p for p in wanted if 0 <= p < n)


@torch.inference_mode()
def greedy(model, ids: list[int], n: int) -> list[int]:
    out = model(torch.tensor([ids]), use_cache=True)
    past, picked = out.past_key_values, []
    for _ in range(n):
        token = int(out.logits[0, -1].argmax())
        picked.append(token)
        out = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
    return picked


@torch.inference_mode()
def perplexity(model, ids: list[int], bos: int, window: int, stride: int) -> tuple[float, int]:
    nll, scored, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + window, len(ids))
        chunk = [bos, *ids[begin:end]]
        logits = model(torch.tensor([chunk])).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)
        targets = torch.tensor(chunk[1:])
        token_lp = logp[:-1].gather(1, targets[:, None])[:, 0]
        new = end - prev_end  # score only tokens no earlier window scored
        nll -= float(token_lp[-new:].double().sum())
        scored += new
        prev_end = end
        print(f"perplexity: {end}/{len(ids)} tokens, running ppl {math.exp(nll / scored):.4f}", flush=True)
        if end == len(ids):
            break
    return math.exp(nll / scored), scored


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    heldout = Path(__file__).resolve().parent.parent / "calibration/llm/text/python-reference.txt"
    ap.add_argument("--text", type=Path, default=heldout)
    ap.add_argument("--perplexity", action="store_true", help="also the perplexity of --text (minutes)")
    ap.add_argument("--max-tokens", type=int, default=0, help="perplexity of the text's first N tokens only")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    started = time.monotonic()
    folder, name = str(args.gguf.parent), args.gguf.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    print(f"loaded in {time.monotonic() - started:.0f} s: {type(model).__name__}", flush=True)
    data: dict[str, np.ndarray] = {}
    meta: dict = {"transformers": __import__("transformers").__version__, "torch": torch.__version__, "gguf": name}
    meta["tokenizer_texts"] = TOKENIZER_TEXTS
    for i, text in enumerate(TOKENIZER_TEXTS):
        data[f"tok_{i}"] = np.asarray(tok(text)["input_ids"], dtype=np.int64)
    text = args.text.read_text(encoding="utf-8")
    meta["prompts"] = []
    for label, ids in prompts(text, tok):
        with torch.inference_mode():
            logits = model(torch.tensor([ids])).logits[0].float()
        positions = check_positions(len(ids))
        rows = logits[positions]
        top = torch.topk(rows, TOP_K, dim=-1)
        data[f"{label}_ids"] = np.asarray(ids, dtype=np.int64)
        data[f"{label}_positions"] = np.asarray(positions, dtype=np.int64)
        data[f"{label}_top_ids"] = top.indices.numpy().astype(np.int64)
        data[f"{label}_top_logits"] = top.values.numpy().astype(np.float32)
        data[f"{label}_logsumexp"] = torch.logsumexp(rows, dim=-1).numpy().astype(np.float32)
        if len(ids) <= 700:
            data[f"{label}_greedy"] = np.asarray(greedy(model, ids, 40), dtype=np.int64)
        meta["prompts"].append({"label": label, "tokens": len(ids), "positions": positions})
        print(f"{label}: {len(ids)} tokens", flush=True)
    if args.perplexity:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        ids = ids[: args.max_tokens] if args.max_tokens else ids
        ppl, scored = perplexity(model, ids, tok.bos_token_id, 1024, 512)
        meta["perplexity"] = {
            "text": args.text.name,
            "value": ppl,
            "tokens": scored,
            "max_tokens": args.max_tokens or None,
            "window": 1024,
            "stride": 512,
        }
        print(f"perplexity {ppl:.4f} over {scored} tokens", flush=True)
    data["meta"] = np.asarray(json.dumps(meta))
    np.savez_compressed(args.out, **data)
    print(f"wrote {args.out} in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
