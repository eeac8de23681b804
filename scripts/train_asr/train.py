"""Train the demo streaming CTC model: synthesise the corpus, then a fixed number of seeded updates.

    python scripts/train_asr/train.py --work build/asr [--steps N] [--utterances N]

Stages, each skipped when its output is already there (so an interrupted run resumes):
1. ``prepare``: feature statistics from the first utterances, then every training utterance
   synthesised (``synth.py``, 2 processes) and turned into normalised log-mel frames with
   ``edge_agent/audio/features.py`` (the runtime's own code): ``WORK/data/``.
2. ``train``: length-bucketed batches, SpecAugment-light, AdamW with a one-cycle learning rate,
   CTC loss; a checkpoint every ``--ckpt-every`` updates (``WORK/ckpt/last.pt``), resumed on restart.
Progress with an ETA goes to stderr and ``WORK/train.log``.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

import corpus  # noqa: E402
import synth  # noqa: E402
from model import FLUSH_FRAMES, SUBSAMPLING, ModelConfig, StreamingCTC, count_parameters  # noqa: E402

from edge_agent.audio.features import LogMelConfig, log_mel  # noqa: E402

VOCAB = ["<pad>", "<unk>", "|", "'"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
BLANK_ID = 0
STAT_UTTERANCES = 600
NUM_MEL_BINS = 64


def encode(text: str) -> list[int]:
    ids = {t: i for i, t in enumerate(VOCAB)}
    return [ids.get(ch, 1) for ch in "|".join(text.split())]


def decode_greedy(ids: np.ndarray) -> str:
    out, prev = [], -1
    for i in ids:
        if i != prev and i != BLANK_ID:
            out.append(VOCAB[i])
        prev = i
    return " ".join("".join(out).replace("|", " ").split())


def _log(work: Path, text: str) -> None:
    line = time.strftime("%H:%M:%S ") + text
    print(line, file=sys.stderr, flush=True)
    with open(work / "train.log", "a") as f:
        f.write(line + "\n")


_WORKER_CFG: LogMelConfig | None = None


def _init_worker(cfg: LogMelConfig) -> None:
    global _WORKER_CFG
    _WORKER_CFG = cfg
    os.environ["OMP_NUM_THREADS"] = "1"


def _features(job: tuple[str, dict]) -> np.ndarray:
    text, recipe = job
    assert _WORKER_CFG is not None
    return log_mel(synth.render(text, synth.Recipe(**recipe)), _WORKER_CFG)


def _synth_features(
    jobs: list[tuple[str, dict]], cfg: LogMelConfig, procs: int, work: Path, what: str
) -> list[np.ndarray]:
    out: list[np.ndarray] = []
    start = time.time()
    with mp.get_context("fork").Pool(procs, initializer=_init_worker, initargs=(cfg,)) as pool:
        for i, feats in enumerate(pool.imap(_features, jobs, chunksize=16), 1):
            out.append(feats)
            if i % 2000 == 0 or i == len(jobs):
                el = time.time() - start
                _log(work, f"{what}: {i}/{len(jobs)} utterances, {el:.0f} s, ETA {el / i * (len(jobs) - i):.0f} s")
    return out


def prepare(work: Path, utterances: int, seed: int, procs: int) -> None:
    data = work / "data"
    if (data / "index.json").is_file():
        return
    data.mkdir(parents=True, exist_ok=True)
    r = random.Random(f"recipes:{seed}")
    texts = corpus.sentences("train", utterances, seed)
    recipes = [synth.random_recipe(r, "train").__dict__ for _ in texts]
    jobs = list(zip(texts, recipes))
    raw = _synth_features(jobs[:STAT_UTTERANCES], LogMelConfig(num_mel_bins=NUM_MEL_BINS), procs, work, "statistics")
    frames = np.concatenate(raw).astype(np.float64)
    mean, std = frames.mean(axis=0), np.maximum(frames.std(axis=0), 1e-3)
    cfg = LogMelConfig(
        num_mel_bins=NUM_MEL_BINS,
        mean=tuple(round(float(v), 6) for v in mean),
        std=tuple(round(float(v), 6) for v in std),
    )
    (data / "preprocessor_config.json").write_text(json.dumps(cfg.to_preprocessor(), indent=2) + "\n")
    feats = _synth_features(jobs, cfg, procs, work, "synthesis")
    lengths = [int(f.shape[0]) for f in feats]
    np.save(data / "features.npy", np.concatenate(feats))
    hours = sum(lengths) * cfg.hop_length / cfg.sampling_rate / 3600
    (data / "index.json").write_text(
        json.dumps(
            {
                "lengths": lengths,
                "texts": texts,
                "recipes": recipes,
                "hours": hours,
                "seed": seed,
            }
        )
    )
    _log(work, f"prepared {len(texts)} utterances, {hours:.2f} h of audio")


class Corpus:
    def __init__(self, data: Path) -> None:
        index = json.loads((data / "index.json").read_text())
        self.feats = np.load(data / "features.npy", mmap_mode="r")
        self.lengths = np.array(index["lengths"])
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)])
        self.labels = [encode(t) for t in index["texts"]]
        self.texts = index["texts"]
        self.hours = index["hours"]
        self.cfg = LogMelConfig.from_preprocessor(data / "preprocessor_config.json")

    def batches(self, epoch: int, seed: int, max_frames: int) -> list[list[int]]:
        """Length-bucketed batches (at most ``max_frames`` padded frames each), shuffled per epoch."""
        r = np.random.default_rng([seed, epoch])
        order = np.argsort(self.lengths + r.uniform(0, 30, len(self.lengths)), kind="stable")
        batches, cur, longest = [], [], 0
        for i in order:
            longest_new = max(longest, int(self.lengths[i]))
            if cur and longest_new * (len(cur) + 1) > max_frames:
                batches.append(cur)
                cur, longest_new = [], int(self.lengths[i])
            cur.append(int(i))
            longest = longest_new
        if cur:
            batches.append(cur)
        r.shuffle(batches)
        return batches

    def collate(self, ids: list[int], pad: float, gen: torch.Generator | None) -> tuple[torch.Tensor, ...]:
        """Features padded to a multiple of the subsampling plus the flush frames, and CTC targets."""
        longest = int(max(self.lengths[ids]))
        t_in = math.ceil(longest / SUBSAMPLING) * SUBSAMPLING + FLUSH_FRAMES
        x = torch.full((len(ids), t_in, self.feats.shape[1]), pad)
        in_lens, targets, tgt_lens = [], [], []
        for b, i in enumerate(ids):
            n = int(self.lengths[i])
            x[b, :n] = torch.from_numpy(np.array(self.feats[self.offsets[i] : self.offsets[i] + n]))
            if gen is not None:
                _spec_augment(x[b, :n], gen)
            in_lens.append((math.ceil(n / SUBSAMPLING) * SUBSAMPLING + FLUSH_FRAMES) // SUBSAMPLING)
            targets.extend(self.labels[i])
            tgt_lens.append(len(self.labels[i]))
        return x, torch.tensor(in_lens), torch.tensor(targets), torch.tensor(tgt_lens)


def _spec_augment(x: torch.Tensor, gen: torch.Generator) -> None:
    """Two frequency masks (≤ 8 bins) and one time mask (≤ 10 frames) per 1.5 s, filled with the mean (0)."""
    frames, bins = x.shape
    for _ in range(2):
        w = int(torch.randint(0, 9, (1,), generator=gen))
        f0 = int(torch.randint(0, bins - w + 1, (1,), generator=gen))
        x[:, f0 : f0 + w] = 0.0
    for _ in range(max(1, frames // 150)):
        w = int(torch.randint(0, 11, (1,), generator=gen))
        if frames > w:
            t0 = int(torch.randint(0, frames - w + 1, (1,), generator=gen))
            x[t0 : t0 + w] = 0.0


def dev_set(work: Path, seed: int, procs: int, cfg: LogMelConfig, count: int = 120) -> list[tuple[np.ndarray, str]]:
    """Training voices and sentences with fresh recipes: watches progress without touching the held-out set."""
    path = work / "data" / "dev.npz"
    r = random.Random(f"dev:{seed}")
    texts = corpus.sentences("train", count, seed + 1)
    if not path.is_file():
        jobs = [(t, synth.random_recipe(r, "train").__dict__) for t in texts]
        feats = _synth_features(jobs, cfg, procs, work, "dev set")
        np.savez(path, *feats)
    with np.load(path) as z:
        return [(z[f"arr_{i}"], t) for i, t in enumerate(texts)]


def word_errors(ref: str, hyp: str) -> int:
    a, b = ref.split(), hyp.split()
    d = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        prev, d[0] = d[0], i
        for j in range(1, len(b) + 1):
            prev, d[j] = d[j], min(d[j] + 1, d[j - 1] + 1, prev + (a[i - 1] != b[j - 1]))
    return d[len(b)]


@torch.no_grad()
def evaluate(model: StreamingCTC, dev: list[tuple[np.ndarray, str]], pad: float) -> float:
    model.eval()
    errors = words = 0
    for feats, text in dev:
        n = math.ceil(len(feats) / SUBSAMPLING) * SUBSAMPLING + FLUSH_FRAMES
        x = torch.full((1, n, feats.shape[1]), pad)
        x[0, : len(feats)] = torch.from_numpy(feats)
        lp = model(x, *model.initial_state(1))[0][0]
        errors += word_errors(text, decode_greedy(lp.argmax(-1).numpy()))
        words += len(text.split())
    model.train()
    return errors / max(words, 1)


def train(work: Path, args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    data = Corpus(work / "data")
    cfg = ModelConfig(num_mel_bins=data.feats.shape[1], vocab_size=len(VOCAB))
    model = StreamingCTC(cfg)
    with torch.no_grad():
        model.out.bias.zero_()
    if args.init_from is not None:  # a later phase starts from an earlier phase's weights
        model.load_state_dict(torch.load(args.init_from, weights_only=False)["model"])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=args.lr, total_steps=args.steps, pct_start=args.warmup, div_factor=20, final_div_factor=200
    )
    ckpt_dir = work / ("ckpt" if not args.run else f"ckpt-{args.run}")
    final = work / ("final.pt" if not args.run else f"final-{args.run}.pt")
    if final.is_file():
        _log(work, f"{final.name} exists: {args.run or 'phase 1'} already trained")
        return
    ckpt_dir.mkdir(exist_ok=True)
    step, epoch, pos, elapsed_before = 0, 0, 0, 0.0
    last = ckpt_dir / "last.pt"
    if last.is_file():
        state = torch.load(last, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        step, epoch, pos = state["step"], state["epoch"], state["pos"]
        elapsed_before = state.get("elapsed_s", 0.0)
        _log(work, f"resumed at update {step}")
    else:
        _log(
            work,
            f"{args.run or 'phase 1'}: model: {count_parameters(model):,} parameters; "
            f"data: {len(data.lengths)} utterances, {data.hours:.2f} h; "
            f"{args.steps} updates of ≤ {args.max_frames} frames, peak LR {args.lr}"
            + (f", from {args.init_from.name}" if args.init_from else ""),
        )
    dev = dev_set(work, args.seed, args.procs, data.cfg)
    pad = data.cfg.padding_value
    order_seed = args.seed + (1 if args.run else 0)
    batches = data.batches(epoch, order_seed, args.max_frames)
    start, start_step, loss_avg = time.time(), step, None
    stop = min(args.steps, args.stop_at or args.steps)
    while step < stop:
        if pos >= len(batches):
            epoch, pos = epoch + 1, 0
            batches = data.batches(epoch, order_seed, args.max_frames)
        gen = None if args.no_specaugment else torch.Generator().manual_seed(order_seed * 1_000_003 + step)
        x, in_lens, targets, tgt_lens = data.collate(batches[pos], pad, gen)
        pos += 1
        log_probs = model(x, *model.initial_state(x.shape[0]))[0]
        loss = F.ctc_loss(log_probs.transpose(0, 1), targets, in_lens, tgt_lens, blank=BLANK_ID, zero_infinity=True)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        opt.step()
        sched.step()
        step += 1
        value = float(loss.detach())
        loss_avg = value if loss_avg is None else 0.95 * loss_avg + 0.05 * value
        if step % 50 == 0 or step == args.steps:
            el = time.time() - start
            eta = el / (step - start_step) * (args.steps - step)
            _log(
                work,
                f"update {step}/{args.steps} epoch {epoch} loss {loss_avg:.3f} lr {sched.get_last_lr()[0]:.2e} "
                f"{el / (step - start_step):.2f} s/update ETA {eta / 60:.1f} min",
            )
        if step % args.ckpt_every == 0 or step == stop:
            tmp = ckpt_dir / "last.tmp"
            torch.save(
                {
                    "model": model.state_dict(),
                    "opt": opt.state_dict(),
                    "sched": sched.state_dict(),
                    "step": step,
                    "epoch": epoch,
                    "pos": pos,
                    "config": cfg.to_dict(),
                    "elapsed_s": elapsed_before + time.time() - start,
                },
                tmp,
            )
            tmp.replace(last)
        if step % args.eval_every == 0 or step == stop:
            _log(work, f"update {step}: dev greedy WER {100 * evaluate(model, dev, pad):.1f}%")
    minutes = round((elapsed_before + time.time() - start) / 60, 1)
    torch.save(
        {
            "model": model.state_dict(),
            "config": cfg.to_dict(),
            "steps": stop,
            "seed": args.seed,
            "minutes": minutes,
            "max_frames": args.max_frames,
            "lr": args.lr,
        },
        final,
    )
    _log(work, f"training done: {stop} updates in {minutes} min")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="train the demo streaming CTC model")
    p.add_argument("--work", type=Path, default=ROOT / "build" / "asr")
    p.add_argument("--utterances", type=int, default=24000)
    p.add_argument("--steps", type=int, default=1000, help="fixed number of updates (sets the run time)")
    p.add_argument("--max-frames", type=int, default=10000, help="padded feature frames per batch (100 = 1 s)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--procs", type=int, default=2, help="synthesis processes")
    p.add_argument("--ckpt-every", type=int, default=200)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--no-specaugment", action="store_true", help="no masking (a last phase, when underfitting)")
    p.add_argument("--stop-at", type=int, help="end after this many updates of the --steps schedule")
    p.add_argument("--warmup", type=float, default=0.08, help="fraction of the updates spent warming up the LR")
    p.add_argument("--run", default="", help="name of a later phase (its own checkpoints and final-RUN.pt)")
    p.add_argument("--init-from", type=Path, help="start from these weights (a previous phase's final.pt)")
    p.add_argument("--prepare-only", action="store_true")
    args = p.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    random.seed(args.seed)
    np.random.seed(args.seed)
    prepare(args.work, args.utterances, args.seed, args.procs)
    if not args.prepare_only:
        train(args.work, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
