"""The options of each ``edge-agent bench`` workload, as code passes them to its ``run``.

Each dataclass holds one workload's settings under the names of its command-line flags (``--max-new-tokens``
is ``max_new_tokens``, ``--json OUT`` is ``json_out``) with the same defaults, so a script measures what the
command measures: ``llm.run(LLMOptions(model="demo-phi3", requests=4))`` is ``edge-agent bench llm --model
demo-phi3 --requests 4``. ``None`` means what the flag's absence means (the config's value, or the
workload's own default). The command line (``edge_agent/cli/bench*.py``) parses the flags and builds these.
Options are frozen: a run fills in its defaults on a copy, never on the caller's object.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

from .grammar_docs import SCHEMAS
from .grammar_engines import ENGINES

# The broker conditions of ``bench telemetry``: no telemetry, broker up, unreachable, behind a slow proxy
CONDITIONS = ("off", "up", "down", "slow")

T = TypeVar("T")


def from_mapping(cls: type[T], values: Mapping[str, Any]) -> T:
    """``cls`` built from the entries of ``values`` named as its fields (others, such as a parser's own, ignored)."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]  # cls is one of the dataclasses below
    return cls(**{k: v for k, v in values.items() if k in names})


def as_json(opts: Any) -> dict[str, Any]:
    """The fields of ``opts`` as a JSON-ready dict (paths as strings), as a report records its settings."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(opts).items()}


@dataclasses.dataclass(frozen=True)
class LLMOptions:
    """``bench llm``: a configured LLM tier as the daemon serves it, against a bare runtime loop and its peers."""

    config: str | Path | None = None  # the daemon's config (default: installed, else embedded)
    tier: str | None = None  # the configured tier to measure (default: the top one)
    model: str | None = None  # another model on that tier's settings
    backend: str | None = None  # onnxruntime or openvino (default: the tier's)
    threads: int | None = None  # intra-op threads (default: device.threads)
    concurrency: int = 1  # closed-loop clients
    requests: int = 16  # per round
    rate: float | None = None  # Poisson arrivals per second instead of the closed loop
    prompt_tokens: int = 128
    max_new_tokens: int = 128
    sla_ms: float | None = None  # goodput's TTFT bound (default: the config's sla.target_ms)
    rounds: int = 3
    json_out: str | Path | None = None
    plot: str | Path | None = None
    no_baseline: bool = False
    prefix_cache: bool = False
    genai: str | None = None  # an onnxruntime-genai folder; 'none' skips it
    ov_genai: str | None = None  # a stateful IR folder for openvino-genai, 'auto' or 'none'
    ramp_s: float | None = None
    scaling: int | None = None  # also concurrency K in the same rounds
    cache_dir: str | Path | None = None  # the model cache (default: the configured one)
    quiet: bool = False


@dataclasses.dataclass(frozen=True)
class TiersOptions:
    """``bench tiers``: a rising, holding and falling load on a tier ladder, adaptive against the fixed top tier."""

    workload: Literal["llm", "asr"] = "llm"
    tiers: str | None = None  # the model ladder, heaviest first, comma-separated
    threads: int = 2
    duration_s: float | None = None  # seconds per run (default 60 for llm, 35 for asr)
    base_rate: float | None = None
    peak_rate: float | None = None
    max_new_tokens: int = 32
    max_batch: int = 4
    target_ms: float | None = None  # the P95 target (llm: TTFT, asr: first partial)
    window_s: float = 6.0
    evaluate_every_s: float = 1.0
    seed: int = 7
    json_out: str | Path | None = None
    plot: str | Path | None = None
    quiet: bool = False


@dataclasses.dataclass(frozen=True)
class AsrOptions:
    """``bench asr``: N streams in real time through the streaming service, against one-pass decoding."""

    streams: list[int] = dataclasses.field(default_factory=lambda: [1])  # one count, or several with compare
    compare: bool = False  # the fixed batching wait against the adaptive one, side by side
    model: str | None = None  # default: the top configured ASR tier
    backend: str = "onnxruntime"
    threads: int = 2
    rounds: int = 3
    audio: list[str] = dataclasses.field(default_factory=list)  # speech files to replay
    max_batch: int | None = None  # default: batching.max_batch
    batch_timeout_ms: float | None = None  # default: batching.batch_timeout_ms
    decoder: str = "auto"
    json_out: str | Path | None = None
    plot: str | Path | None = None
    config: str | Path | None = None


@dataclasses.dataclass(frozen=True)
class TelemetryOptions:
    """``bench telemetry``: inference latency with telemetry off and the broker up, down and slow."""

    model: str = "demo-phi3-small"
    threads: int = 2
    requests: int = 24  # per condition per round
    prompt_tokens: int = 64
    max_new_tokens: int = 32
    rounds: int = 3
    interval_s: float = 0.05  # the telemetry window interval
    delay_ms: float = 250.0  # the slow broker's proxy delay
    broker: str | None = None  # HOST:PORT (default: mosquitto started on a free port)
    mosquitto: str | None = None  # the mosquitto binary
    conditions: str = ",".join(CONDITIONS)  # a comma-separated subset that includes 'off'
    json_out: str | Path | None = None
    quiet: bool = False
    config: str | Path | None = None


@dataclasses.dataclass(frozen=True)
class FleetOptions:
    """``bench fleet``: simulated devices through a local broker into fleet export and fleet watch."""

    devices: str = "100,1000"  # device counts, comma-separated
    interval_s: float = 1.0
    duration_s: float = 20.0
    warmup_s: float = 5.0
    rounds: int = 1
    scrape_every_s: float = 10.0
    json_out: str | Path | None = None


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    """``bench serve``: a running daemon driven over HTTP, the clients' figures beside its own."""

    url: str | None = None
    unix_socket: str | None = None
    token: str | None = None
    config: str | Path | None = None
    mode: Literal["closed", "poisson", "sequential"] | None = None  # default closed (or as rate/gap imply)
    concurrency: list[int] = dataclasses.field(default_factory=lambda: [1])  # closed-loop levels
    rate: list[float] | None = None  # Poisson levels, requests/s
    sequential_gap_s: float | None = None
    requests: int | None = None  # per level (default 16 when duration_s is not given)
    duration_s: float | None = None  # per level
    prompt_tokens: int = 128
    max_tokens: int = 64
    temperature: float | None = None
    model: str | None = None
    sla_ms: float | None = None
    ramp_s: float | None = None
    warmup: int = 1
    timeout_s: float = 600.0
    mqtt: str | None = None  # HOST:PORT of the broker the daemon publishes its windows to
    device_id: str | None = None
    json_out: str | Path | None = None  # '-': the JSON on stdout, the table on stderr
    plot: str | Path | None = None
    quiet: bool = False


def _grammar_threads() -> int:
    return min(4, os.cpu_count() or 1)


@dataclasses.dataclass(frozen=True)
class GrammarOptions:
    """``bench grammar``: grammar engines' compile and per-token mask times on the same schemas."""

    rounds: int = 3
    tokens: int = 400  # mask steps per batch row per walk, at least
    batch: int = 4
    threads: int = dataclasses.field(default_factory=_grammar_threads)
    engines: str = ",".join(ENGINES)  # a comma-separated subset
    grammars: str = ",".join(SCHEMAS)  # a comma-separated subset
    tokenizer: Path | None = None  # a tokenizer.json or its folder (default: the trained 32k one)
    eos: str | None = None
    n_logits: int | None = None
    seed: int = 0
    plot: Path | None = None
    json: bool = False  # the JSON report on stdout instead of the table
    quiet: bool = False


@dataclasses.dataclass(frozen=True)
class VoiceOptions:
    """``bench voice``: the voice turn end to end, default settings against its latency features off."""

    rounds: int = 3
    utterances: int | None = None  # the first N commands (default all)
    asr_model: str | None = None
    llm_model: str | None = None
    tools: str | Path | None = None  # OpenAI function tools (default: the home tools)
    max_new_tokens: int = 160
    tool_choice: Literal["auto", "required"] = "required"
    voices: str = "standard"
    json_out: str | Path | None = None
    plot: str | Path | None = None
    config: str | Path | None = None
    quiet: bool = False


@dataclasses.dataclass(frozen=True)
class CallsOptions:
    """``bench calls``: home commands (text, and speech) to tool calls, scored against the expected calls."""

    llm_model: str = "gemma-3-270m-home"
    backend: str = "onnxruntime"
    sets: str = "demo,held-out,unseen,dev"  # comma-separated
    speech: bool = False
    asr_model: str | None = None
    voices: str = "standard"
    every_voice: bool = False  # every command by every voice (not in turn)
    context: Literal["on", "off", "both"] = "on"
    tool_choice: Literal["auto", "required"] = "auto"
    max_new_tokens: int = 64
    threads: int = 0  # 0: the configured device threads
    json_out: str | Path | None = None
    config: str | Path | None = None


# -- the workloads whose ``run`` returns a report: ``edge-agent bench <name>`` prints it, and writes it with --json


@dataclasses.dataclass(frozen=True)
class WeightOnlyOptions:
    """``bench weight-only``: batch-1 decode of a recipe's model at FP32, INT8 weight-only and INT4."""

    recipe: str | Path = "demo-phi3-small"  # a recipe file or name
    backend: Literal["onnxruntime", "openvino"] = "onnxruntime"
    rounds: int = 5  # interleaved rounds
    prompts: int = 4  # held-out prompts per round
    tokens: int = 64  # decoded tokens per prompt
    threads: int = 1
    # label -> a built ONNX Runtime engine folder, timed beside FP32 instead of making int8w and int4
    engines: dict[str, Path] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class PrefillOptions:
    """``bench prefill``: running streams' ITL while a long prompt prefills, chunked against whole."""

    model: str = "demo-phi3-small"
    genai: str | Path | None = None  # an onnxruntime-genai folder instead of the model
    cache_dir: str | Path | None = None  # where demo models are generated (default: [models] cache_dir)
    streams: int = 3
    long_prompt_tokens: int = 1024
    long_new_tokens: int = 8
    chunk: int = 256  # prefill_chunk_tokens when chunked
    rounds: int = 5
    threads: int = 2


@dataclasses.dataclass(frozen=True)
class PrefixCacheOptions:
    """``bench prefix-cache``: TTFT of a system prompt seen before against a fresh one of the same length."""

    model: str = "demo-phi3-small"
    cache_dir: str | Path | None = None
    system_tokens: int = 1600
    new_tokens: int = 4
    rounds: int = 5
    max_mb: float = 256.0  # the prefix cache's bound
    threads: int = 2
    inplace: bool = False  # also the in-place KV layout


@dataclasses.dataclass(frozen=True)
class PrefixSoakOptions:
    """``bench prefix-soak``: the prefix cache over a long run of rotating system prompts, memory sampled."""

    model: str = "demo-phi3"
    cache_dir: str | Path | None = None
    requests: int = 2000
    prompts: int = 40  # distinct system prompts, rotating
    system_tokens: int = 400
    new_tokens: int = 2
    max_mb: float = 4.0
    every: int = 100  # sample memory every N requests
    threads: int = 2


@dataclasses.dataclass(frozen=True)
class InplaceKvOptions:
    """``bench inplace-kv``: batch-1 decode of a plain export, its in-place KV conversion and onnxruntime-genai."""

    model: str = "demo-phi3-small"
    rounds: int = 5
    tokens: int = 64  # decoded tokens per prompt
    prompts: int = 3
    prompt_tokens: int = 32
    threads: int = 1
    genai: str | None = None  # an onnxruntime-genai builder folder of the same model ('none': skip)


@dataclasses.dataclass(frozen=True)
class OverloadOptions:
    """``bench overload``: the daemon on its default tiers under open-loop overload, llama.cpp's server beside it."""

    seconds: float = 30.0  # per level
    rounds: int | None = None  # rounds of all levels (default 3; with resume: the earlier report's)
    capacity: float | None = None  # chats/s the levels are multiples of (default: measured on the daemon)
    sla_ms: float = 387.0  # goodput's TTFT bound
    drain_s: float = 90.0  # after a level, wait at most this long for its chats, then cancel them
    seed: int = 42
    out: Path = Path("overload")  # overload.md, overload.json and overload.png go here
    llama_server: str = "llama-server"  # llama.cpp's server binary
    llamacpp_python: str | None = None  # without llama-server: this Python's llama_cpp.server
    gguf: Path | None = None  # llama.cpp's model (default: the GGUF the default model came from)
    threads: int = dataclasses.field(default_factory=lambda: os.cpu_count() or 1)  # llama-server's threads
    resume: Path | None = None  # keep the systems of this earlier overload.json, run the others on its schedule
    no_llamacpp: bool = False
    no_speech: bool = False
    quiet: bool = False
