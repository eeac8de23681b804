"""Export the trained model to the streaming CTC folder format (docs/asr-models.md) and write its card.

    python scripts/train_asr/export.py onnx --work build/asr --out edge_agent/demo_models/demo-asr
    python scripts/train_asr/export.py card --work build/asr --out edge_agent/demo_models/demo-asr

``onnx``: ``model.onnx`` (opset 18, standard ops: Conv, GRU, LayerNormalization, …) with
``features`` + ``state_in.{0..3}`` → ``log_probs`` + ``state_out.{0..3}``; checks on ONNX Runtime
that the graph matches PyTorch and that 32-frame chunks with the state carried equal one whole
call; writes ``config.json``, ``vocab.json``, ``preprocessor_config.json``, ``lexicon.txt``,
``io_contract.json``, ``generator.json`` and ``reference.npz`` (PyTorch outputs).
``card``: ``README.md`` from the training log and the ``eval-*.json`` reports in the work folder.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import platform
import shutil
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

import corpus  # noqa: E402
import synth  # noqa: E402
from model import FLUSH_FRAMES, SUBSAMPLING, ModelConfig, StreamingCTC, count_parameters  # noqa: E402
from train import BLANK_ID, VOCAB  # noqa: E402

from edge_agent.audio.features import LogMelConfig, log_mel  # noqa: E402

OPSET = 18
CHUNK_FRAMES = 32  # 320 ms: what the runtime feeds per step
NAME = "demo-asr"
LM_ORDER = 2  # chosen on calib.jsonl: the trigram was no better (10.9% vs 11.1% WER) and 5x larger


class Exported(torch.nn.Module):
    def __init__(self, model: StreamingCTC) -> None:
        super().__init__()
        self.model = model

    def forward(self, features, s0, s1, s2, s3):  # type: ignore[no-untyped-def]
        return self.model(features, s0, s1, s2, s3)


def _run(sess: ort.InferenceSession, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def _chunked(sess: ort.InferenceSession, feats: np.ndarray, states: dict[str, np.ndarray]) -> np.ndarray:
    out = []
    for i in range(0, feats.shape[1], CHUNK_FRAMES):
        r = _run(sess, {"features": feats[:, i : i + CHUNK_FRAMES], **states})
        states = {k: r[k.replace("state_in", "state_out")] for k in states}
        out.append(r["log_probs"])
    return np.concatenate(out, axis=1)


def _tail(feats: np.ndarray, pad: float) -> np.ndarray:
    total = math.ceil(len(feats) / SUBSAMPLING) * SUBSAMPLING + FLUSH_FRAMES
    out = np.full((total, feats.shape[1]), pad, np.float32)
    out[: len(feats)] = feats
    return out


def write_arpa(path: Path, sentences: list[str], order: int = 3, discount: float = 0.7, min_count: int = 2) -> None:
    """A word n-gram LM in ARPA format: interpolated absolute discounting over add-one unigrams.

    p_k(w | h) = max(c(h w) − D, 0) / c(h) + D · N(h) / c(h) · p_{k−1}(w | h[1:]), where N(h) is the
    number of distinct words seen after h. Listed n-grams carry that interpolated probability and a
    history's back-off weight is D · N(h) / c(h), which is exactly the mass the interpolation gives the
    lower order, so the model normalises. N-grams above the bigram seen fewer than ``min_count``
    times are dropped before estimating (count pruning keeps the file small).
    """
    from collections import Counter

    words = [*corpus.vocabulary(), "</s>", "<unk>"]
    counts: list[Counter[tuple[str, ...]]] = [Counter() for _ in range(order + 1)]
    for sentence in sentences:
        toks = ["<s>", *sentence.split(), "</s>"]
        for k in range(1, order + 1):
            counts[k].update(tuple(toks[i : i + k]) for i in range(len(toks) - k + 1) if k > 1 or toks[i] != "<s>")
    for k in range(3, order + 1):
        counts[k] = Counter({g: c for g, c in counts[k].items() if c >= min_count})
    total = sum(counts[1].values()) + len(words)
    p_uni = {w: (counts[1][(w,)] + 1) / total for w in words}
    hist_count: list[Counter[tuple[str, ...]]] = [Counter() for _ in range(order + 1)]
    followers: list[Counter[tuple[str, ...]]] = [Counter() for _ in range(order + 1)]
    for k in range(2, order + 1):
        for g, c in counts[k].items():
            hist_count[k][g[:-1]] += c
            followers[k][g[:-1]] += 1
    memo: dict[tuple[str, ...], float] = {}

    def prob(gram: tuple[str, ...]) -> float:
        """The model's probability of gram[-1] after gram[:-1] (listed or backed off)."""
        if len(gram) == 1:
            return p_uni.get(gram[0], p_uni["<unk>"])
        if gram in memo:
            return memo[gram]
        k, h = len(gram), gram[:-1]
        lower = prob(gram[1:])
        if hist_count[k][h] == 0:
            p = lower  # an unseen history: back-off weight 1
        else:
            alpha = discount * followers[k][h] / hist_count[k][h]
            p = max(counts[k][gram] - discount, 0.0) / hist_count[k][h] + alpha * lower
        memo[gram] = p
        return p

    def bow(h: tuple[str, ...]) -> float:
        k = len(h) + 1
        if k > order or hist_count[k][h] == 0:
            return 0.0
        return math.log10(discount * followers[k][h] / hist_count[k][h])

    sections = [[f"{-99.0 if w == '<s>' else math.log10(p_uni[w]):.6f}\t{w}\t{bow((w,)):.6f}" for w in ["<s>", *words]]]
    for k in range(2, order + 1):
        lines = []
        for g in sorted(counts[k]):
            line = f"{math.log10(prob(g)):.6f}\t{' '.join(g)}"
            lines.append(line + (f"\t{bow(g):.6f}" if k < order else ""))
        sections.append(lines)
    text = ["\\data\\", *(f"ngram {k}={len(lines)}" for k, lines in enumerate(sections, 1)), ""]
    for k, lines in enumerate(sections, 1):
        text += [f"\\{k}-grams:", *lines, ""]
    path.write_text("\n".join([*text, "\\end\\", ""]))


def export_onnx(work: Path, out: Path, checkpoint: Path | None = None) -> None:
    ckpt = torch.load(checkpoint or work / "final.pt", weights_only=False)
    if "steps" not in ckpt:  # an intermediate checkpoint (ckpt/last.pt)
        ckpt = {**ckpt, "steps": ckpt["step"], "minutes": round(ckpt.get("elapsed_s", 0) / 60, 1)}
    cfg = ModelConfig(**ckpt["config"])
    model = StreamingCTC(cfg).eval()
    model.load_state_dict(ckpt["model"])
    pre = LogMelConfig.from_preprocessor(work / "data" / "preprocessor_config.json")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)

    names_in = ["features"] + [f"state_in.{i}" for i in range(4)]
    names_out = ["log_probs"] + [f"state_out.{i}" for i in range(4)]
    axes = {"features": {0: "batch_size", 1: "num_frames"}, "log_probs": {0: "batch_size", 1: "num_out_frames"}}
    axes.update({n: {0: "batch_size"} for n in names_in[1:] + names_out[1:]})
    example = (torch.zeros(2, CHUNK_FRAMES, cfg.num_mel_bins), *model.initial_state(2))
    with torch.no_grad():
        torch.onnx.export(
            Exported(model),
            example,
            str(tmp / "model.onnx"),
            input_names=names_in,
            output_names=names_out,
            dynamic_axes=axes,
            opset_version=OPSET,
            dynamo=False,
            do_constant_folding=True,
        )
    graph = onnx.load(str(tmp / "model.onnx"))
    onnx.checker.check_model(graph)

    # A real held-out utterance for the reference and the checks.
    text = "set the kitchen light to forty percent"
    recipe = synth.Recipe("en-us+" + synth.HELDOUT_VARIANTS[0], 165, 50, -6.0, 0.3, 0.3, "pink", 20.0, 0.0, 7)
    samples = synth.render(text, recipe)
    feats = _tail(log_mel(samples, pre), pre.padding_value)[None]
    with torch.no_grad():
        ref = model(torch.from_numpy(feats), *model.initial_state(1))
    ref_lp = ref[0].numpy()
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(str(tmp / "model.onnx"), opts, providers=["CPUExecutionProvider"])
    zeros = {f"state_in.{i}": np.zeros((1, *s), np.float32) for i, s in enumerate(model.state_shapes())}
    whole = _run(sess, {"features": feats, **zeros})
    chunked = _chunked(sess, feats, zeros)
    d_torch = float(np.abs(whole["log_probs"] - ref_lp).max())
    d_chunk = float(np.abs(chunked - whole["log_probs"]).max())
    print(f"ONNX vs PyTorch max |Δ| {d_torch:.2e}; chunked vs whole max |Δ| {d_chunk:.2e}", file=sys.stderr)
    if d_torch > 1e-3 or d_chunk > 1e-3:
        raise SystemExit("export check failed: ONNX Runtime does not reproduce PyTorch / chunked != whole")
    batch = np.concatenate([feats, np.flip(feats, 1).copy()])
    with torch.no_grad():
        ref_b = model(torch.from_numpy(batch), *model.initial_state(2))
    np.savez_compressed(
        tmp / "reference.npz",
        samples=samples,
        text=np.array(text),
        features=feats[0],
        log_probs=ref_lp[0],
        state_out_0=ref[1].numpy()[0],
        state_out_1=ref[2].numpy()[0],
        state_out_2=ref[3].numpy()[0],
        state_out_3=ref[4].numpy()[0],
        batch_features=batch,
        batch_log_probs=ref_b[0].numpy(),
        greedy_ids=ref_lp[0].argmax(-1).astype(np.int64),
    )

    state_shapes = {f"state_in.{i}": list(s) for i, s in enumerate(model.state_shapes())}
    config = {
        "model_type": "streaming-ctc",
        "architectures": ["StreamingCTC"],
        "vocab_size": cfg.vocab_size,
        "subsampling": SUBSAMPLING,
        "chunk_frames": CHUNK_FRAMES,
        "flush_frames": FLUSH_FRAMES,
        "blank_id": BLANK_ID,
        "pad_token_id": BLANK_ID,
        "word_delimiter": "|",
        "state_shapes": state_shapes,
        "num_mel_bins": cfg.num_mel_bins,
        "conv_channels": cfg.conv_channels,
        "hidden_size": cfg.hidden,
        "num_layers": cfg.layers,
        "lookahead_ms": 80,
        "parameters": count_parameters(model),
    }
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (tmp / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(VOCAB)}, indent=2) + "\n")
    (tmp / "preprocessor_config.json").write_text(json.dumps(pre.to_preprocessor(), indent=2) + "\n")
    (tmp / "lexicon.txt").write_text("\n".join(corpus.vocabulary()) + "\n")
    write_arpa(tmp / "lm.arpa", corpus.sentences("train", 100_000, seed=99), order=LM_ORDER)
    dim = lambda d: d.dim_param if d.dim_param else d.dim_value  # noqa: E731
    io = {
        "model.onnx": {
            kind: [
                {"name": v.name, "dtype": "float32", "shape": [dim(d) for d in v.type.tensor_type.shape.dim]}
                for v in values
            ]
            for kind, values in (("inputs", graph.graph.input), ("outputs", graph.graph.output))
        }
    }
    (tmp / "io_contract.json").write_text(json.dumps(io, indent=2) + "\n")
    log_tail = (work / "train.log").read_text().splitlines() if (work / "train.log").is_file() else []
    generator = {
        "generator": "scripts/train-asr",
        "model": NAME,
        "seed": ckpt.get("seed"),
        "updates": ckpt.get("steps"),
        "parameters": count_parameters(model),
        "training_minutes": ckpt.get("minutes"),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "onnx": onnx.__version__,
            "onnxruntime": ort.__version__,
            "numpy": np.__version__,
        },
        "date": dt.date.today().isoformat(),
        "last_log_line": log_tail[-1] if log_tail else None,
    }
    (tmp / "generator.json").write_text(json.dumps(generator, indent=2) + "\n")
    keep = out / "README.md"
    if keep.is_file():
        shutil.copy(keep, tmp / "README.md")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(f"wrote {out} ({(out / 'model.onnx').stat().st_size / 1e6:.1f} MB model.onnx)", file=sys.stderr)


def _row(report: dict, key: str) -> str:
    r = report["results"].get(key)
    if r is None:
        return "–"
    return f"{100 * r['wer']['rate']:.1f} / {100 * r['cer']['rate']:.1f}"


def write_card(work: Path, out: Path) -> None:
    index = json.loads((work / "data" / "index.json").read_text())
    gen = json.loads((out / "generator.json").read_text())
    config = json.loads((out / "config.json").read_text())
    reports = {p.stem.removeprefix("eval-"): json.loads(p.read_text()) for p in sorted(work.glob("eval-*.json"))}
    rows = []
    for name, rep in reports.items():
        rows.append(
            f"| {name} | {rep['utterances']} | {rep['results']['stream/greedy']['wer']['ref_len']} | "
            f"{_row(rep, 'stream/greedy')} | {_row(rep, 'full/greedy')} | {_row(rep, 'stream/lexicon')} | "
            f"{_row(rep, 'full/lexicon')} | {_row(rep, 'stream/lm')} | {_row(rep, 'full/lm')} | "
            f"{_row(rep, 'service/lm')} |"
        )
    lat = next(iter(reports.values()))["latency"] if reports else {}
    log = (work / "train.log").read_text().splitlines() if (work / "train.log").is_file() else []
    devs = [line.split("dev greedy WER ")[1] for line in log if "dev greedy WER" in line]
    done = [line.split("training done: ")[1] for line in log if "training done: " in line]
    total_updates = sum(int(d.split()[0]) for d in done)
    total_minutes = sum(float(d.split(" in ")[1].split()[0]) for d in done)
    text = f"""# demo-asr: a small streaming speech recogniser for the voice-assistant demo

A stateful streaming CTC model ({config["parameters"]:,} parameters, characters) trained from scratch on
speech synthesised with espeak-ng, for the demo's spoken commands and for accuracy checks (INT8 engines
are judged against its WER). It knows one domain: a home voice assistant (lights, thermostat, timers,
alarms, dates and times, media, calls and messages, numbers and digits, short questions). It is not a
general English recogniser: real voices and other topics will do much worse than the table below.

Folder format: `docs/asr-models.md` (stateful streaming CTC). Design note: `docs/demo-asr.md`.
Rebuild: `scripts/train-asr` ({total_minutes:.0f} minutes of training here, on 2 shared CPU cores).

## Data
- Text: `scripts/train_asr/corpus.py`, {len(corpus.vocabulary())} words, {len(corpus._TEMPLATES)} templates with
  numbers as words ("forty percent", "seven oh five"); one sentence in eight (by a hash of its text)
  is held out and never used in training.
- Speech: `scripts/train_asr/synth.py`, espeak-ng 1.51, 7 English accents ({", ".join(synth.TRAIN_ACCENTS)}),
  {len(synth.TRAIN_VARIANTS)} voice variants (+ the base voices), 125–200 words/min, pitch 25–75; leading
  silence up to 1.2 s; 60% with white, pink, brown or babble noise at 5–30 dB SNR; 30% with a
  synthetic room reverb (RT60 0.1–0.6 s); gain −24 to +3 dB; 16-bit 16 kHz.
- Training set: {len(index["lengths"]):,} utterances, {index["hours"]:.1f} hours (seed {index["seed"]}).
- Held-out set (`calibration/asr/heldout.jsonl`): held-out sentences spoken by {len(synth.HELDOUT_VARIANTS)} variants never
  used in training ({", ".join(synth.HELDOUT_VARIANTS)}), 50% noisy at 10–30 dB SNR.
  Unseen-accent set (`calibration/asr/unseen-accent.jsonl`): the same kind of sentences in {synth.UNSEEN_ACCENT}
  (Caribbean English), an accent absent from training.

## Model and recipe
- Features: {config["num_mel_bins"]} log-mel bins (slaney), 25 ms window, 10 ms hop, `center` false, normalised
  per bin with training-set statistics (`preprocessor_config.json`); computed by
  `edge_agent/audio/features.py` in training and at run time alike.
- Network (`scripts/train_asr/model.py`): causal conv (k5, s2) ×2 → LayerNorm → GRU {config["num_layers"]}×{config["hidden_size"]}
  (one-way) → causal conv (k3) → linear → log-softmax over {config["vocab_size"]} tokens (`<pad>` = CTC blank,
  `|` word delimiter, `'`, a–z). 40 ms output frames; outputs may use 80 ms of look-ahead, delivered
  by emitting late; `flush_frames` {config["flush_frames"]} of padding end a stream.
- Streaming: `chunk_frames` {config["chunk_frames"]} (320 ms); state = two conv caches, the GRU state and the head
  conv cache (`state_shapes` in `config.json`). Chunked and whole-utterance outputs are equal.
- Training (`scripts/train_asr/train.py`, run by `scripts/train-asr`; seed {gen.get("seed")}, `torch.set_num_threads(2)`), five
  phases with fixed numbers of updates: (1) from scratch, batches of ≤ 10,000 padded frames (100 s of
  audio), 600 updates of a 1000-update one-cycle schedule peaking at 2e-3 (through the all-blank phase,
  stopped before annealing); (2) from (1), batches of ≤ 6,000 frames, 1400 updates, one-cycle peak
  2e-3; (3) from (2), 2600 updates, peak 1e-3, no SpecAugment (the model still underfits); (4) from
  (3), 1800 updates, peak 5e-4; (5) from (4), 3000 updates, peak 5e-4. All:
  length-bucketed batches, AdamW (β 0.9/0.98, weight decay 0.01), gradient clipping 5, CTC loss;
  SpecAugment-light in (1) and (2): 2 frequency masks ≤ 8 bins, a time mask ≤ 100 ms per 1.5 s. {total_updates} updates, {total_minutes:.0f} min of training on this shared
  2-core machine ({", ".join(done) if done else "n/a"}). Dev WER (greedy, 120 utterances of
  training voices and sentences) during training: {", ".join(devs) if devs else "n/a"}.

## Results (WER / CER %, normalised text; `edge-agent eval asr`)
| set | utterances | words | stream greedy | full greedy | stream lexicon | full lexicon | stream lm | full lm | service lm |
|---|---|---|---|---|---|---|---|---|---|
{chr(10).join(rows) if rows else "| (not evaluated yet) | | | | | | | | | |"}

"greedy": argmax, merge repeats, drop blanks (what the model alone does). "lexicon": CTC prefix beam
search (beam {config.get("lm_beam", 12)}) in which every word must be a word of `lexicon.txt` (the corpus vocabulary), no
language model. "lm": the same search plus the word bigram model `lm.arpa` (trained on 100,000
training-split sentences; beam {config.get("lm_beam", 12)}, `lm_weight` {config.get("lm_weight", 0.5)}, `lm_word_bonus` {config.get("lm_word_bonus", 1.0)}, chosen on
`calibration/asr/calib.jsonl` by `tune_lm.py`, never on a test set): the domain grammar a voice assistant would use,
and what the agent's ASR service decodes with by default. "stream": 100 ms audio pushes, 320 ms model chunks with
the state carried; "full": one call per utterance; "service": the daemon's path (the serving recogniser behind
`AsrService`, energy endpointing with 200 ms pre-roll, 100 ms pushes).
Latency (ONNX Runtime, 1 thread, this 2-core x86-64 machine): RTF {lat.get("rtf", float("nan")):.4f}, model call per
320 ms chunk P50 {lat.get("compute_per_chunk_ms_p50") or float("nan"):.2f} ms, flush + decode after the last audio P50
{lat.get("final_ms_p50") or float("nan"):.2f} ms.

## Files
`model.onnx` (opset {OPSET}), `config.json`, `vocab.json`, `preprocessor_config.json`, `lexicon.txt`,
`lm.arpa` (word bigram, ARPA), `io_contract.json`, `reference.npz` (a held-out-voice utterance: samples, features, PyTorch log-probs
and final states; a batch of two), `generator.json` (seed, versions, date).

## Limits
Synthetic speech only: espeak-ng's formant voices, one TTS engine. The vocabulary is closed; words
outside it are spelled by ear in greedy mode and cannot appear in lexicon mode.
"""
    (out / "README.md").write_text(text)
    print(f"wrote {out / 'README.md'}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="export the demo ASR model")
    p.add_argument("what", choices=["onnx", "card"])
    p.add_argument("--work", type=Path, default=ROOT / "build" / "asr")
    p.add_argument("--out", type=Path, default=ROOT / "edge_agent" / "demo_models" / NAME)
    p.add_argument("--checkpoint", type=Path, help="export this checkpoint instead of WORK/final.pt")
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    if args.what == "onnx":
        export_onnx(args.work, args.out, args.checkpoint)
    else:
        write_card(args.work, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
