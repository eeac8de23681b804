"""``bench grammar``: grammar engines for constrained decoding (JSON schema → per-token mask), side by side.

For each engine (llguidance, the agent's; outlines-core; xgrammar: each skipped with the reason when it is not
importable) and each grammar (``tool-call``, ``json_object``), every round measures the cold compile time of
the schema, the first mask of a fresh matcher, and the mask and consume times per token while matchers walk
schema-valid documents token by token at batch 1 and at batch ``--batch`` (llguidance fills a batch in one
parallel call; the others loop over rows). Every step checks that the document's next token is allowed by
the mask, so a wrong mask fails the run instead of flattering it. After one unmeasured warm-up walk each,
engines run in a rotating order; figures are medians over rounds, with each engine's ratio to llguidance.
The tokenizer is a Phi-3-sized BPE (32,000 tokens + Phi-3's chat tokens, 32,064 logits) trained once on
local text (``vocab32k``), or ``--tokenizer``.

    edge-agent bench grammar [--rounds N] [--tokens N] [--plot out.png] [--json]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from typing import Any

from ..errors import InputError
from ..metrics.window import percentile
from . import grammar_engines as ge
from .grammar_docs import SCHEMAS, documents
from .grammar_report import apply_cost, format_table, plot_report
from .grammar_walk import allocate, walk
from .options import GrammarOptions
from .vocab32k import N_LOGITS, load_or_train

EOS_CANDIDATES = ("<|end|>", "<|eot_id|>", "<|im_end|>", "<|endoftext|>", "</s>", "<eos>")


def _log(opts: GrammarOptions, msg: str) -> None:
    if not opts.quiet:
        print(f"bench grammar: {msg}", file=sys.stderr, flush=True)


def _choose(text: str, known: tuple[str, ...] | list[str], what: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise InputError(f"--{what}: unknown {', '.join(bad) or '(none given)'}; known: {', '.join(known)}")
    return names


def tokenizer_spec(opts: GrammarOptions) -> tuple[ge.TokenizerSpec, Any, str]:
    """The tokenizer spec, the ``tokenizers.Tokenizer`` and a line describing it (training it when needed)."""
    from tokenizers import Tokenizer

    if opts.tokenizer is None:
        text, path = load_or_train(log=lambda m: _log(opts, m))
        source = f"trained 32k Phi-3-style BPE ({path})"
    else:
        path = opts.tokenizer / "tokenizer.json" if opts.tokenizer.is_dir() else opts.tokenizer
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise InputError(f"--tokenizer {path}: {exc.strerror or exc}") from exc
        source = str(path)
    try:
        tok = Tokenizer.from_str(text)
    except Exception as exc:  # the tokenizers library raises its own Exception subclass
        raise InputError(f"--tokenizer {path}: not a tokenizers JSON file ({exc})") from exc
    size = tok.get_vocab_size(with_added_tokens=True)
    names = [opts.eos] if opts.eos else [n for n in EOS_CANDIDATES if tok.token_to_id(n) is not None][:1]
    eos = tok.token_to_id(names[0]) if names else None
    if eos is None:
        raise InputError(f"{path}: no EOS token {opts.eos or EOS_CANDIDATES}; name one with --eos")
    n_logits = opts.n_logits or (N_LOGITS if opts.tokenizer is None else -(-size // 64) * 64)
    if n_logits < size:
        raise InputError(f"--n-logits {n_logits} is below the tokenizer's {size} tokens")
    desc = f"{source}: {size} tokens, {n_logits} logits, EOS {names[0]!r} = {eos}"
    return ge.TokenizerSpec(text, n_logits, eos), tok, desc


def _median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _round_figures(loaded: ge.Loaded, grammar: str, docs: list[list[list[int]]], spec, batch: int) -> dict:
    import time

    engine = loaded.engine
    t0 = time.perf_counter()
    compiled = engine.compile(SCHEMAS[grammar])
    compile_ms = (time.perf_counter() - t0) * 1e3
    first = allocate(1, spec.n_logits)
    m = engine.matcher(compiled)
    t0 = time.perf_counter()
    engine.fill([m], first)
    first_mask_ms = (time.perf_counter() - t0) * 1e3
    label = f"{loaded.name} {grammar}"
    one = walk(engine, compiled, docs[:1], spec.n_logits, spec.eos, label=f"{label} batch 1")
    many = walk(engine, compiled, docs[:batch], spec.n_logits, spec.eos, label=f"{label} batch {batch}")
    return {
        "compile_ms": compile_ms,
        "first_mask_ms": first_mask_ms,
        "mask_us_b1_p50": percentile(one.mask_us, 50),
        "mask_us_b1_p95": percentile(one.mask_us, 95),
        "consume_us_b1_p50": percentile(one.consume_us, 50),
        "mask_us_bN_p50": percentile(many.mask_us, 50),
        "mask_us_bN_p95": percentile(many.mask_us, 95),
        "consume_us_bN_p50": percentile(many.consume_us, 50),
        "steps_b1": len(one.mask_us),
        "steps_bN": len(many.mask_us),
        "documents_b1": one.documents,
    }


def run(opts: GrammarOptions) -> dict[str, Any]:
    """Measure every engine on every grammar over ``opts.rounds`` rounds; the report as a dict."""
    names = _choose(opts.engines, ge.ENGINES, "engines")
    grammars = _choose(opts.grammars, list(SCHEMAS), "grammars")
    if opts.rounds < 1 or opts.tokens < 1 or opts.batch < 1:
        raise InputError("--rounds, --tokens and --batch must be at least 1")
    spec, tok, desc = tokenizer_spec(opts)
    _log(opts, f"tokenizer: {desc}")
    loaded: list[ge.Loaded] = []
    skipped: dict[str, str] = {}
    for name in names:
        got = ge.load(name, spec, opts.threads)
        if isinstance(got, str):
            skipped[name] = got
            _log(opts, f"{name}: skipped ({got})")
        else:
            loaded.append(got)
            _log(opts, f"{name} {got.version}: import {got.import_ms:.0f} ms, vocabulary {got.vocab_ms:.0f} ms")
    if not loaded:
        raise InputError(f"no grammar engine could be loaded: {skipped}")
    docs = {g: [documents(g, tok, opts.tokens, opts.seed + r) for r in range(max(1, opts.batch))] for g in grammars}
    g0 = grammars[0]
    for e in loaded:  # warm-up, not measured: first-use costs (thread pools, lazy tables) stay out of round 1
        compiled = e.engine.compile(SCHEMAS[g0])
        walk(e.engine, compiled, [row[:1] for row in docs[g0][: opts.batch]], spec.n_logits, spec.eos, e.name)
    samples: dict[str, dict[str, list[dict]]] = {e.name: {g: [] for g in grammars} for e in loaded}
    for rnd in range(opts.rounds):
        shift = rnd % len(loaded)
        for engine in loaded[shift:] + loaded[:shift]:
            for g in grammars:
                fig = _round_figures(engine, g, docs[g], spec, opts.batch)
                samples[engine.name][g].append(fig)
                _log(
                    opts,
                    f"round {rnd + 1}/{opts.rounds} {engine.name} {g}: compile {fig['compile_ms']:.1f} ms, "
                    f"mask p50 {fig['mask_us_b1_p50']:.1f} µs (batch 1), {fig['mask_us_bN_p50']:.1f} µs "
                    f"(batch {opts.batch}); {fig['steps_b1']} steps checked",
                )
    results: dict[str, dict[str, dict]] = {}
    for e in loaded:
        results[e.name] = {}
        for g in grammars:
            rounds = samples[e.name][g]
            results[e.name][g] = {k: _median([r[k] for r in rounds]) for k in rounds[0]}
    _log(opts, "applying masks to logits with numpy")
    sample_mask = allocate(opts.batch, spec.n_logits)
    sample_mask[:, ::3] = 0x0F0F0F0F  # any mixed pattern: the cost does not depend on which bits are set
    return {
        "tokenizer": desc,
        "n_logits": spec.n_logits,
        "rounds": opts.rounds,
        "tokens": opts.tokens,
        "batch": opts.batch,
        "threads": opts.threads,
        "cpu_count": os.cpu_count(),
        "engines": {
            e.name: {
                "version": e.version,
                "import_ms": e.import_ms,
                "rss_mb": e.rss_mb,
                "vocab_ms": e.vocab_ms,
                "notes": e.notes,
            }
            for e in loaded
        },
        "skipped": skipped,
        "results": results,
        "apply": apply_cost(sample_mask, spec.n_logits, rounds=opts.rounds),
    }


def main(opts: GrammarOptions) -> int:
    """Measure, then print the table (or the JSON report) and draw the plot when asked."""
    report = run(opts)
    if opts.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_table(report))
    if opts.plot:
        path = plot_report(report, opts.plot)
        _log(opts, f"plot written to {path}")
    return 0
