"""``[models]`` and ``[batching]``: what runs where, tier by tier, and how requests are batched."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, field_validator, model_validator

from .base import Backend, Precision, Section, default_cache_dir


class TierConfig(Section):
    """What every tier names, LLM or ASR: the model and the backend, device and precision it runs with."""

    name: str = Field(min_length=1)
    model: str = Field(min_length=1, description="demo model name or a model folder")
    backend: Backend = "onnxruntime"
    device: str = "cpu"
    precision: Precision = "auto"


class LLMTierConfig(TierConfig):
    """One tier of ``[[models.llm]]``: a tier, its reply cap, its batch and the recipe rung it serves."""

    max_new_tokens: int = Field(256, ge=1, le=32768)
    max_batch: int | None = Field(
        None, ge=1, le=128, description="rows decoded together on this tier; unset: [batching] max_batch"
    )
    rung: str | None = Field(
        None,
        pattern=r"^[a-z][a-z0-9_-]{0,31}$",
        description='with precision "auto": which of the recipe\'s rungs this tier serves ("lower": the '
        "fastest engine within [rungs.lower]'s budget); unset: the top rung, the recipe's [accuracy]. A rung no "
        "engine is within serves the top rung's choice",
    )

    def rows(self, batching: BatchingConfig) -> int:
        """The batch this tier serves: its own ``max_batch``, else ``[batching]``'s (the one value every
        consumer reads: the scheduler's limits, the policy's batch bound)."""
        return self.max_batch if self.max_batch is not None else batching.max_batch


class AsrTierConfig(TierConfig):
    """One tier of ``[[models.asr]]``: a tier and nothing LLM-only (a reply cap or a batch here is an error;
    speech batches by ``[batching]``)."""


DEFAULT_LLM_MODEL = "gemma-3-270m-home"  # `edge-agent models fetch gemma-3-270m-home` brings it


def default_llm_tiers() -> list[LLMTierConfig]:
    """The embedded default's LLM ladder, on real weights: Gemma 3 270M with the shipped home-commands
    adapter (the engine its recipe's gate chose for the top rung, else the FP32 folder) at the top, and
    below it the recipe's lower rung (the fastest engine within its looser budget; the top rung's engine
    while none is) with replies capped at 64 tokens (a whole tool call still fits) and batches of 8: more
    requests served per second under load, each token a little later."""
    return [
        LLMTierConfig(name="full", model=DEFAULT_LLM_MODEL, max_new_tokens=128),
        LLMTierConfig(name="short", model=DEFAULT_LLM_MODEL, max_new_tokens=64, max_batch=8, rung="lower"),
    ]


def random_llm_tiers() -> list[LLMTierConfig]:
    """The random-weight demo ladder (code paths and speed only, never answers): ``edge-agent demo
    --random-models``, tests and benchmarks."""
    return [LLMTierConfig(name="small", model="demo-phi3-small"), LLMTierConfig(name="tiny", model="demo-phi3")]


DEFAULT_ASR_MODEL = "whisper-base"  # `edge-agent models fetch whisper-base` brings it


def default_asr_tiers() -> list[AsrTierConfig]:
    """The embedded default's ASR ladder: OpenAI's Whisper base (real weights, fetched and pinned like the
    LLM), alone. demo-asr, trained on espeak-ng only, does not hear natural voices (WER 60-80 % on Piper
    and flite, docs/asr.md): it is no rung; a lighter Whisper rung joins only when it passes the WER gate
    of engines/whisper-base.toml."""
    return [AsrTierConfig(name="whisper-base", model=DEFAULT_ASR_MODEL)]


def demo_asr_tiers() -> list[AsrTierConfig]:
    """The small trained streaming model (espeak-ng speech only): tests and code paths that need no
    fetched weights (``edge-agent demo --random-models``)."""
    return [AsrTierConfig(name="ctc", model="demo-asr")]


class ModelsConfig(Section):
    """``[models]``: the LLM and ASR tiers, heaviest first, and the cache of generated demo weights."""

    # looked up at call time, so tests that exercise code paths can put the random ladder in its place
    llm: list[LLMTierConfig] = Field(default_factory=lambda: default_llm_tiers(), description="heaviest tier first")
    asr: list[AsrTierConfig] = Field(default_factory=lambda: default_asr_tiers(), description="heaviest tier first")
    cache_dir: Path = Field(default_factory=lambda: default_cache_dir() / "models")
    load_ahead: bool = Field(
        True,
        description="load the LLM tier below the serving one beside it when its weights differ (another "
        "engine), so a switch down loads nothing; its memory is held meanwhile. false: a switch loads it then",
    )

    @field_validator("llm", "asr")
    @classmethod
    def _unique_names(cls, tiers: list[Any]) -> list[Any]:
        names = [t.name for t in tiers]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"tier names must be unique; repeated: {dupes}")
        return tiers


class BatchingConfig(Section):
    """``[batching]``: dynamic batching and the admission queue's bounds."""

    max_batch: int = Field(4, ge=1, le=128)
    batch_timeout_ms: float = Field(80.0, ge=0, le=10_000)
    adaptive_wait: bool = Field(
        True,
        description="wait for batch-mates only when one is expected within the SLA's slack (the timeout "
        "bounds it); false: an incomplete batch on an idle device always waits batch_timeout_ms",
    )
    preferred_batch_sizes: list[int] = Field(default_factory=lambda: [2, 4])
    admission: bool = Field(
        True,
        description="refuse at once (HTTP 429 with Retry-After) a chat whose predicted first token misses the SLA "
        "in force on every tier sharing the loaded model, and refuse one that has not started within that "
        "budget; false: chats queue until max_queue or queue_timeout_ms",
    )
    max_queue: int = Field(64, ge=1)
    queue_timeout_ms: float = Field(30_000.0, gt=0)
    prefill_chunk_tokens: int = Field(
        256,
        ge=0,
        le=65536,
        description="prompt tokens prefilled per loop turn while other requests decode, so a long prompt "
        "enters over several turns and running streams keep their inter-token latency; 0: whole prompts",
    )

    prefill_together: bool | None = Field(
        None,
        description="whole prompts admitted in one turn are prefilled in one batched call (true) or one by one, "
        "each streaming its first token as soon as its prompt is in (false); unset: together on TensorRT "
        "tiers only (a GPU runs a batch of prompts for little more than one; a CPU's prefill is compute bound)",
    )

    jump_forward: bool = Field(
        True,
        description="a request with an output format (a tool call, a JSON schema) takes the tokens its format "
        "forces (key names, punctuation, the rest of a tool's name) in one pass with the token it picked, "
        "not one decode step each; off: a step per token, as without a format",
    )

    @model_validator(mode="after")
    def _preferred_within_max(self) -> BatchingConfig:
        bad = [b for b in self.preferred_batch_sizes if not 1 <= b <= self.max_batch]
        if bad:
            raise ValueError(f"preferred_batch_sizes {bad} must lie within 1..max_batch ({self.max_batch})")
        return self
