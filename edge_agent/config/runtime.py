"""``[engines]``, ``[calibration]``, ``[audio]`` and ``[logging]``: the device-local machinery around serving."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from .base import Section, default_cache_dir


def _default_recipes_dir() -> Path:
    from ..shipped import default_recipes_dir

    return default_recipes_dir()


class EnginesConfig(Section):
    """``[engines]``: the engine cache, where recipes are found, and background builds."""

    cache_dir: Path = Field(default_factory=lambda: default_cache_dir() / "engines")
    max_bytes: int = Field(8 * 1024**3, ge=1024 * 1024)
    recipes_dir: Path = Field(
        default_factory=_default_recipes_dir,
        description="the user's recipes: `--recipe NAME` and background builds look for "
        "NAME.toml here first, then among the shipped recipes (default /etc/edge-agent/engines "
        "under systemd, ~/.config/edge-agent/engines otherwise)",
    )
    build_on_start: bool = Field(
        True,
        description="`edge-agent run`: build a tier's missing engine (when its model "
        "has a recipe) in the background while the model folder serves",
    )
    convert_plain_exports: bool = Field(
        True,
        description="a tier whose model is a plain Phi-3 / Gemma export that no recipe builds gets an FP32 "
        "engine with the KV cache in preallocated buffers (built like a recipe's, in the background); false: "
        "such exports are served as they are",
    )
    build_threads: int = Field(
        1, ge=1, le=256, description="intra-op threads of a background build (it shares the device with serving)"
    )


class CalibrationConfig(Section):
    """``[calibration]``: opt-in capture of a sample of real traffic as calibration manifests (off by default:
    captured prompts and voice are personal data; they stay on the device, bounded in count and bytes)."""

    capture_dir: Path | None = Field(
        None,
        description="where captured prompts and utterances go (llm.jsonl, asr.jsonl, asr/*.wav); unset: capture is off",
    )
    capture_rate: float = Field(
        0.05,
        gt=0,
        le=1,
        description="fraction of requests and utterances kept: every 1/rate-th one (0.05: one in twenty; 1.0: all)",
    )
    max_items: int = Field(
        500,
        ge=1,
        le=1_000_000,
        description="per workload; once reached, capture of that "
        "workload stops (the first items are kept, nothing is replaced)",
    )
    max_bytes: int = Field(
        256 * 1024**2,
        ge=1024 * 1024,
        description="total size of the capture directory; beyond it nothing more is written",
    )
    capture_llm: bool = Field(True, description="capture LLM prompts (chat messages or completion prompts)")
    capture_asr: bool = Field(True, description="capture speech utterances (16 kHz mono WAV + the final text)")

    def summary(self) -> str:
        """One line for the start-up summary and ``meta``: ``off``, or what is captured where and how much."""
        kinds = [k for k, on in (("llm", self.capture_llm), ("asr", self.capture_asr)) if on]
        if self.capture_dir is None or not kinds:
            return "off"
        return (
            f"on: {', '.join(kinds)} into {self.capture_dir}, rate {self.capture_rate:g}, "
            f"max {self.max_items} per workload, max {self.max_bytes} bytes"
        )


class AudioConfig(Section):
    """``[audio]``: capture, voice-activity detection and the ASR's streaming chunk."""

    device: str | int | None = Field(None, description="sounddevice input name or index; None = default")
    sample_rate: int = Field(16000, ge=8000, le=192000)
    block_ms: int = Field(20, ge=5, le=500)
    vad: Literal["energy", "webrtc", "silero"] = "energy"
    vad_model: Path | None = Field(None, description="silero_vad.onnx when vad = 'silero'")
    energy_threshold_db: float = Field(-50.0, ge=-100.0, le=0.0)
    min_speech_ms: int = Field(100, ge=10, le=5000)
    trailing_silence_ms: int = Field(500, ge=50, le=10_000)
    pre_roll_ms: int = Field(200, ge=0, le=2000)
    max_utterance_s: float = Field(28.0, gt=1.0, le=600.0)
    chunk_ms: int = Field(320, ge=20, le=5000, description="new audio per recogniser step (partial cadence)")
    early_end: bool = Field(
        True,
        description="voice turn: end an utterance before trailing_silence_ms when its words are complete "
        "(a whole command for the turn's tools: after command_end_silence_ms; without tools, the "
        "recogniser's word LM gives the sentence end >= early_end_min_prob: after early_end_silence_ms); "
        "speech that resumes within trailing_silence_ms continues it",
    )
    early_end_silence_ms: int = Field(
        200, ge=20, le=10_000, description="the silence before an early end on the language model alone (no tools)"
    )
    early_end_min_prob: float = Field(
        0.15, gt=0.0, le=1.0, description="P(end of sentence | the words) that makes them complete (no tools)"
    )
    command_end_silence_ms: int = Field(
        100, ge=20, le=10_000, description="the silence before an early end on a whole command for the turn's tools"
    )
    command_end_min_prob: float = Field(
        0.02, ge=0.0, le=1.0, description="a whole command ends early unless the word LM's P(end) is below this"
    )
    prefill_ahead: bool = Field(
        True, description="voice turn: prefill the prompt of a stable partial into the prefix cache while speaking"
    )
    prefill_stable_ms: int = Field(120, ge=0, le=5000, description="how long a partial must stay unchanged first")
    respond_ahead: bool = Field(
        True,
        description="voice turn: when the speaker pauses (pause_ms), generate the whole reply to the partial "
        "at once and keep it; the final's reply if its text is the same, cancelled otherwise",
    )
    pause_ms: int = Field(
        60, ge=20, le=5000, description="the silence inside an utterance that counts as a pause (respond_ahead)"
    )

    @model_validator(mode="after")
    def _silero_needs_model(self) -> AudioConfig:
        if self.vad == "silero" and self.vad_model is None:
            raise ValueError("vad = 'silero' needs vad_model (the path of silero_vad.onnx)")
        for name in ("early_end_silence_ms", "command_end_silence_ms"):
            if getattr(self, name) > self.trailing_silence_ms:
                raise ValueError(f"{name} must not exceed trailing_silence_ms (the full wait is the bound)")
        return self


class LoggingConfig(Section):
    """``[logging]``: the daemon's log level and format."""

    level: Literal["debug", "info", "warning", "error"] = Field("info", description="`edge-agent run`'s log level")
    format: Literal["text", "json"] = Field(
        "text", description="text, or one JSON object per line (time, level, logger, message) for journald/Loki"
    )
