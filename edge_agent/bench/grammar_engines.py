"""The grammar engines ``bench grammar`` compares, behind one small interface.

Each engine turns a JSON schema into a compiled grammar, makes matchers from it, writes the next-token masks
of a batch of matchers into one int32 bitmask (``[rows, ceil(n_logits / 32)]``, bit ``t % 32`` of word
``t // 32`` set when token ``t`` is allowed) and advances a matcher by one token. ``load`` imports one by name
and builds its view of the tokenizer, timing both; an engine whose package is missing comes back as the
reason it was skipped. Engines: llguidance (the agent's own), outlines-core (a regex from the schema, then a
token-level DFA index) and xgrammar (a pushdown automaton with precomputed token masks; it imports torch).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import EdgeAgentError
from .vocab32k import token_bytes

# llguidance-loop: llguidance with a batch filled row by row, to show what the parallel fill buys here
ENGINES = ("llguidance", "llguidance-loop", "outlines-core", "xgrammar")


class TokenRejected(EdgeAgentError):
    """An engine refused a token of a schema-valid document (its mask left it out, or consuming it failed)."""


@dataclass
class TokenizerSpec:
    """The tokenizer every engine is built on: ``tokenizer.json`` text, the model's logit count, its EOS id."""

    json_text: str
    n_logits: int
    eos: int


@dataclass
class Loaded:
    """An engine ready to compile grammars, with what loading it cost."""

    name: str
    engine: Any
    version: str
    import_ms: float
    rss_mb: float
    vocab_ms: float
    notes: list[str] = field(default_factory=list)


def _rss_mb() -> float:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "?"


def _row_ptrs(bitmask: np.ndarray) -> list[int]:
    return [bitmask.ctypes.data + i * bitmask.strides[0] for i in range(bitmask.shape[0])]


class LlguidanceEngine:
    """llguidance: an ``LLMatcher`` compiled from the schema, deep-copied per request; a batch's masks in one
    parallel call through ``LLExecutor`` (or row by row with ``parallel=False``)."""

    def __init__(self, spec: TokenizerSpec, threads: int | None, parallel: bool = True) -> None:
        import llguidance

        self.llg = llguidance
        self.parallel = parallel
        self.tok = llguidance.LLTokenizer(spec.json_text, n_vocab=spec.n_logits, eos_token=spec.eos)
        self.executor = llguidance.LLExecutor(num_threads=threads)

    def compile(self, schema: dict[str, Any]) -> Any:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema)
        matcher = self.llg.LLMatcher(self.tok, grammar)
        if matcher.is_error():
            raise TokenRejected(f"llguidance refused the schema: {matcher.get_error()}")
        return matcher

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, matchers: list[Any], bitmask: np.ndarray) -> None:
        from llguidance.numpy import fill_next_token_bitmask, fill_next_token_bitmask_par

        if len(matchers) == 1 or not self.parallel:
            for i, m in enumerate(matchers):
                fill_next_token_bitmask(m, bitmask, i)
        else:
            fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def consume(self, matcher: Any, token: int) -> None:
        if not matcher.consume_token(token):
            raise TokenRejected(f"llguidance: consume_token({token}) failed: {matcher.get_error()}")


class OutlinesEngine:
    """outlines-core: a regex built from the schema, compiled with the vocabulary into an ``Index`` (a DFA
    over tokens); a ``Guide`` per request; a batch is a loop over its rows."""

    def __init__(self, spec: TokenizerSpec) -> None:
        import outlines_core

        self.oc = outlines_core
        by_bytes: dict[bytes, list[int]] = {}
        for i, b in token_bytes(spec.json_text).items():
            if i != spec.eos and b:
                by_bytes.setdefault(b, []).append(i)
        self.vocab = outlines_core.Vocabulary(spec.eos, by_bytes)

    def compile(self, schema: dict[str, Any]) -> Any:
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema))
        return self.oc.Index(regex, self.vocab)

    def matcher(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)

    def fill(self, matchers: list[Any], bitmask: np.ndarray) -> None:
        words = bitmask.shape[1]
        for guide, ptr in zip(matchers, _row_ptrs(bitmask)):
            guide.write_mask_into(ptr, words, 4)

    def consume(self, matcher: Any, token: int) -> None:
        try:
            matcher.advance(token, False)
        except ValueError as exc:
            raise TokenRejected(f"outlines-core: advance({token}) failed: {exc}") from exc


class XgrammarEngine:
    """xgrammar: ``GrammarCompiler.compile_json_schema`` (its cache off, so every compile is a cold one); a
    ``GrammarMatcher`` per request; a batch is a loop over its rows."""

    def __init__(self, spec: TokenizerSpec, threads: int | None) -> None:
        import xgrammar

        self.xgr = xgrammar
        data = json.loads(spec.json_text)
        vocab = [""] * spec.n_logits
        for text, i in data["model"]["vocab"].items():
            vocab[i] = text
        for added in data.get("added_tokens", []):
            vocab[added["id"]] = added["content"]
        # the same detection from_huggingface runs on the tokenizer's JSON (byte fallback, prefix space)
        meta = xgrammar.TokenizerInfo._detect_metadata_from_hf(spec.json_text)
        info = xgrammar.TokenizerInfo(
            vocab,
            meta["vocab_type"],
            vocab_size=spec.n_logits,
            stop_token_ids=[spec.eos],
            add_prefix_space=meta["add_prefix_space"],
        )
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=threads or 8, cache_enabled=False)

    def compile(self, schema: dict[str, Any]) -> Any:
        return self.compiler.compile_json_schema(json.dumps(schema))

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers: list[Any], bitmask: np.ndarray) -> None:
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)

    def consume(self, matcher: Any, token: int) -> None:
        if not matcher.accept_token(token):
            raise TokenRejected(f"xgrammar: accept_token({token}) failed")


_PACKAGES = {
    "llguidance": "llguidance",
    "llguidance-loop": "llguidance",
    "outlines-core": "outlines_core",
    "xgrammar": "xgrammar",
}


def load(name: str, spec: TokenizerSpec, threads: int | None) -> Loaded | str:
    """The engine ``name`` built on ``spec``, or why it is skipped (its package not importable)."""
    if name not in _PACKAGES:
        raise ValueError(f"unknown grammar engine {name!r}; known: {', '.join(ENGINES)}")
    import importlib

    rss0 = _rss_mb()
    t0 = time.perf_counter()
    try:
        importlib.import_module(_PACKAGES[name])
    except Exception as exc:  # any failure to import (missing package, broken torch) means "skipped"
        return f"{_PACKAGES[name]} not importable: {type(exc).__name__}: {exc}".splitlines()[0]
    t1 = time.perf_counter()
    engine: Any
    if name.startswith("llguidance"):
        engine = LlguidanceEngine(spec, threads, parallel=name == "llguidance")
    elif name == "outlines-core":
        engine = OutlinesEngine(spec)
    else:
        engine = XgrammarEngine(spec, threads)
    t2 = time.perf_counter()
    notes = [f"LLExecutor parallel fill, {threads} threads" if name == "llguidance" else "a loop over rows"]
    if name == "llguidance-loop":
        notes.append("import and RSS: already counted for llguidance")
    return Loaded(
        name,
        engine,
        _version(_PACKAGES[name].replace("_", "-")),
        import_ms=(t1 - t0) * 1e3,
        rss_mb=max(0.0, _rss_mb() - rss0),  # a collection during the import can make it negative
        vocab_ms=(t2 - t1) * 1e3,
        notes=notes,
    )
