"""Train the home-commands LoRA adapter of Gemma 3 270M (run through scripts/train-home-lora).

The base model is transformers' Gemma 3 loaded from the same GGUF the agent imports (float32, CPU).
Every linear layer of the 18 blocks (q, k, v, o, gate, up, down) gets a rank-``r`` adapter
(``W + (alpha / r) · B A``, B zero at the start); embeddings, norms and the tied head stay frozen. The
data (scripts/home_commands.py) is the agent's own voice-turn prompt: a long shared prefix (the tools
described) and a short tail (the user's words, the model's turn). Each step runs the prefix once without
gradients under the current weights and feeds its KV cache to the batch of tails, and the loss covers
only the reply (the call's JSON, or the no-action words, and the end-of-turn token). So a step costs
the tails, not the whole prompt, and what is trained is what the agent then serves (prefix included).
A quarter of the steps (``TEXT_SHARE``) are plain English text instead, with the language model's own
loss on each window's last ``--text-scored`` tokens: the adapter is for tool calls, and the model must stay
the language model it was for running text (its perplexity, which the recipe's gate and the INT4 rung's
error both follow).

Output: ``adapter.npz`` (``<module>.lora_A`` [r, in] and ``<module>.lora_B`` [out, r], float16; modules
named as transformers names them, which the agent's imported graph names its weights after) and
``adapter.json`` (rank, alpha, the base file's sha256, the data and training settings, the loss, the
npz's sha256).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import random
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from transformers import AutoModelForCausalLM

TEXT_SHARE = 0.25  # of the steps, batches of plain English text (the language model's own loss)
TARGETS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
TARGETS += ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


class LoRA(nn.Module):
    def __init__(self, base: nn.Linear, rank: int, alpha: float, gen: torch.Generator) -> None:
        super().__init__()
        self.base, self.scale = base, alpha / rank
        self.lora_A = nn.Parameter(torch.randn(rank, base.in_features, generator=gen) / base.in_features**0.5)
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_A.T @ self.lora_B.T) * self.scale


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", required=True, help="gemma-3-270m-q4_k_m.gguf")
    p.add_argument("--data", required=True, help="scripts/home_commands.py's JSONL")
    p.add_argument("--out", required=True, help="folder for adapter.npz and adapter.json")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16.0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=240)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prefix-every", type=int, default=8, help="steps between recomputing a mode's prefix KV")
    p.add_argument("--save-every", type=int, default=25, help="steps between writing the adapter so far")
    p.add_argument("--text-scored", type=int, default=32, help="tokens scored at the end of each text window")
    args = p.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    gguf = Path(args.gguf)
    t0 = time.monotonic()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.eval()  # no dropout
    for param in model.parameters():
        param.requires_grad_(False)
    gen = torch.Generator().manual_seed(args.seed)
    adapters: dict[str, LoRA] = {}
    for i, layer in enumerate(model.model.layers):
        for target in TARGETS:
            owner_name, attr = target.split(".")
            owner = getattr(layer, owner_name)
            lora = LoRA(getattr(owner, attr), args.rank, args.alpha, gen)
            setattr(owner, attr, lora)
            adapters[f"model.layers.{i}.{target}"] = lora
    params = [q for a in adapters.values() for q in (a.lora_A, a.lora_B)]
    print(f"loaded in {time.monotonic() - t0:.0f} s; {sum(q.numel() for q in params):,} adapter parameters", flush=True)

    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines()]
    prefixes = {r["mode"]: r["prefix"] for r in rows if "prefix" in r}
    by_mode: dict[str, list[dict]] = {m: [r for r in rows if "target" in r and r["mode"] == m] for m in prefixes}
    texts = [r["ids"] for r in rows if r["mode"] == "text"]
    rng = random.Random(args.seed)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10) * max(0.05, 1 - s / args.steps))
    losses: list[float] = []  # the calls' batches
    text_losses: list[float] = []  # the plain text's
    kept: dict[str, tuple[int, object]] = {}
    out = Path(args.out)
    t0 = time.monotonic()
    for step in range(args.steps):
        if texts and rng.random() < TEXT_SHARE:
            picked = [texts[i] for i in rng.sample(range(len(texts)), min(args.batch, len(texts)))]
            loss, kind = text_loss(model, picked, args.text_scored), text_losses
        else:
            mode = rng.choices(list(by_mode), [len(v) for v in by_mode.values()])[0]
            pool = by_mode[mode]
            batch = rng.sample(pool, args.batch) if len(pool) >= args.batch else rng.choices(pool, k=args.batch)
            if mode not in kept or step - kept[mode][0] >= args.prefix_every:
                with torch.no_grad():  # the prefix's KV under the current weights, a few steps old at most
                    kept[mode] = (step, model(input_ids=torch.tensor([prefixes[mode]]), use_cache=True).past_key_values)
            loss, kind = call_loss(model, batch, len(prefixes[mode]), kept[mode][1]), losses
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        kind.append(float(loss.detach()))
        if step % 10 == 0 or step == args.steps - 1:
            said = f"step {step:4d} loss {np.mean(losses[-10:]) if losses else float('nan'):.4f}"
            said += f" text {np.mean(text_losses[-5:]):.3f}" if text_losses else ""
            print(f"{said} ({time.monotonic() - t0:.0f} s)", flush=True)
        if (step + 1) % args.save_every == 0 or step == args.steps - 1:
            examples = sum(len(v) for v in by_mode.values())
            save(out, adapters, args, gguf, examples, step + 1, losses, text_losses, time.monotonic() - t0)


def call_loss(model: nn.Module, batch: list[dict], n_prefix: int, prefix_kv) -> torch.Tensor:
    """The loss on the replies of ``batch`` (tails after a shared prefix whose KV cache is ``prefix_kv``)."""
    cache = copy.deepcopy(prefix_kv)
    cache.batch_repeat_interleave(len(batch))
    seqs = [r["suffix"] + r["target"] for r in batch]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    for b, (r, s) in enumerate(zip(batch, seqs, strict=True)):
        ids[b, : len(s)] = torch.tensor(s)
        start = len(r["suffix"])  # position start - 1 predicts the first reply token
        labels[b, start - 1 : len(s) - 1] = torch.tensor(r["target"])
    hidden = model.model(
        input_ids=ids,
        attention_mask=torch.ones(len(batch), n_prefix + width, dtype=torch.long),
        position_ids=torch.arange(n_prefix, n_prefix + width).expand(len(batch), -1),
        past_key_values=cache,
        use_cache=True,
    ).last_hidden_state
    keep = labels != -100
    logits = model.lm_head(hidden[keep])  # only the reply's positions meet the 262k-row head
    return nn.functional.cross_entropy(logits.float(), labels[keep])


def text_loss(model: nn.Module, windows: list[list[int]], scored: int) -> torch.Tensor:
    """The language model's loss on each window's last ``scored`` tokens (the rest is their context)."""
    ids = torch.tensor(windows)
    hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state[:, -scored - 1 : -1]
    logits = model.lm_head(hidden.reshape(-1, hidden.shape[-1]))  # only the scored positions meet the head
    return nn.functional.cross_entropy(logits.float(), ids[:, -scored:].reshape(-1))


def save(
    out: Path,
    adapters: dict,
    args: argparse.Namespace,
    gguf: Path,
    examples: int,
    steps: int,
    losses: list[float],
    text_losses: list[float],
    seconds: float,
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, a in adapters.items():
        tensors[f"{name}.lora_A"] = a.lora_A.detach().numpy().astype(np.float16)
        tensors[f"{name}.lora_B"] = a.lora_B.detach().numpy().astype(np.float16)
    np.savez(out / "adapter.npz", **tensors)
    meta = {
        "base": {"file": gguf.name, "sha256": sha256(gguf)},
        "rank": args.rank,
        "alpha": args.alpha,
        "targets": list(TARGETS),
        "layout": "W[out, in] += alpha / rank * B @ A (transformers' nn.Linear); float16",
        "training": {
            "data": {"generator": "scripts/home_commands.py", "examples": examples, "text_share": TEXT_SHARE},
            "steps": steps,
            "batch": args.batch,
            "lr": args.lr,
            "seed": args.seed,
            "threads": args.threads,
            "seconds": round(seconds),
            "final_loss": round(float(np.mean(losses[-10:])), 4),
            "final_text_loss": round(float(np.mean(text_losses[-5:])), 4) if text_losses else None,
            "torch": torch.__version__,
        },
        "sha256": sha256(out / "adapter.npz"),
    }
    (out / "adapter.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"wrote {out / 'adapter.npz'} ({(out / 'adapter.npz').stat().st_size:,} bytes)", flush=True)


if __name__ == "__main__":
    main()
