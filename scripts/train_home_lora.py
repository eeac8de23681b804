"""Train the home-commands LoRA adapter of Gemma 3 270M (run through scripts/train-home-lora).

The base model is transformers' Gemma 3 loaded from the same GGUF the agent imports (float32, CPU).
Every linear layer of the 18 blocks (q, k, v, o, gate, up, down) gets a rank-``r`` adapter
(``W + (alpha / r) · B A``, B zero at the start); embeddings, norms and the tied head stay frozen. The
data (scripts/home_commands.py) is the agent's own voice-turn prompt: a long shared prefix (the tools
described) and a short tail (the user's words, the model's turn). Each step runs the prefix once without
gradients under the current weights and feeds its KV cache to the batch of tails, and the loss covers
only the reply (the call's JSON, or the no-action words, and the end-of-turn token). Plain questions
without tools (about one batch in eight) are trained towards the base model's own greedy replies, taken
before training: the adapter is for tool calls and leaves chat as it was. So a step costs
the tails, not the whole prompt, and what is trained is what the agent then serves (prefix included).

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

CHAT_SHARE = 0.3  # of the steps, batches of plain chat (kept as the base model answers it)
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
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prefix-every", type=int, default=8, help="steps between recomputing a mode's prefix KV")
    p.add_argument("--save-every", type=int, default=25, help="steps between writing the adapter so far")
    p.add_argument("--chat-tokens", type=int, default=32, help="tokens of the base model's reply kept per chat prompt")
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
    eos = model.generation_config.eos_token_id
    end_ids = {1, 106} | set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    t1 = time.monotonic()
    for r in rows:  # plain chat: the base model's own greedy reply is the target (adapters still zero)
        if "prefix" not in r and "target" not in r:
            ids = torch.tensor([prefixes[r["mode"]] + r["suffix"]])
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=args.chat_tokens, do_sample=False)[0, ids.shape[1] :]
            reply = out.tolist()
            cut = next((i for i, t in enumerate(reply) if t in end_ids), None)
            r["target"] = reply[: cut + 1] if cut is not None else reply
    print(f"base replies to the chat prompts in {time.monotonic() - t1:.0f} s", flush=True)
    by_mode: dict[str, list[dict]] = {m: [r for r in rows if "target" in r and r["mode"] == m] for m in prefixes}
    rng = random.Random(args.seed)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10) * max(0.05, 1 - s / args.steps))
    losses: list[float] = []
    kept: dict[str, tuple[int, object]] = {}
    out = Path(args.out)
    t0 = time.monotonic()
    for step in range(args.steps):
        weights = [len(by_mode[m]) if m != "chat" else CHAT_SHARE * len(rows) for m in by_mode]
        mode = rng.choices(list(by_mode), weights)[0]
        pool = by_mode[mode]
        batch = rng.sample(pool, args.batch) if len(pool) >= args.batch else rng.choices(pool, k=args.batch)
        prefix = torch.tensor([prefixes[mode]])
        if mode not in kept or step - kept[mode][0] >= args.prefix_every:
            with torch.no_grad():  # the prefix's KV under the current weights, a few steps old at most
                kept[mode] = (step, model(input_ids=prefix, use_cache=True).past_key_values)
        cache = copy.deepcopy(kept[mode][1])
        cache.batch_repeat_interleave(args.batch)
        seqs = [r["suffix"] + r["target"] for r in batch]
        width = max(len(s) for s in seqs)
        ids = torch.zeros(args.batch, width, dtype=torch.long)
        labels = torch.full((args.batch, width), -100, dtype=torch.long)
        for b, (r, s) in enumerate(zip(batch, seqs, strict=True)):
            ids[b, : len(s)] = torch.tensor(s)
            start = len(r["suffix"])  # position start - 1 predicts the first reply token
            labels[b, start - 1 : len(s) - 1] = torch.tensor(r["target"])
        n_prefix = prefix.shape[1]
        hidden = model.model(
            input_ids=ids,
            attention_mask=torch.ones(args.batch, n_prefix + width, dtype=torch.long),
            position_ids=torch.arange(n_prefix, n_prefix + width).expand(args.batch, -1),
            past_key_values=cache,
            use_cache=True,
        ).last_hidden_state
        keep = labels != -100
        logits = model.lm_head(hidden[keep])  # only the reply's positions meet the 262k-row head
        loss = nn.functional.cross_entropy(logits.float(), labels[keep])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:4d} loss {np.mean(losses[-10:]):.4f} ({time.monotonic() - t0:.0f} s)", flush=True)
        if (step + 1) % args.save_every == 0 or step == args.steps - 1:
            save(
                out,
                adapters,
                args,
                gguf,
                sum(len(v) for v in by_mode.values()),
                step + 1,
                losses,
                time.monotonic() - t0,
            )


def save(
    out: Path, adapters: dict, args: argparse.Namespace, gguf: Path, examples: int, steps: int, losses, seconds
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
            "data": {"generator": "scripts/home_commands.py", "examples": examples},
            "steps": steps,
            "batch": args.batch,
            "lr": args.lr,
            "seed": args.seed,
            "threads": args.threads,
            "seconds": round(seconds),
            "final_loss": round(float(np.mean(losses[-10:])), 4),
            "torch": torch.__version__,
        },
        "sha256": sha256(out / "adapter.npz"),
    }
    (out / "adapter.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"wrote {out / 'adapter.npz'} ({(out / 'adapter.npz').stat().st_size:,} bytes)", flush=True)


if __name__ == "__main__":
    main()
