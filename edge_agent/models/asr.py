"""Opening a speech recogniser: the factory over the recogniser types (Whisper, CTC, streaming CTC).

The base module (``recognizer.py``) defines what every recogniser offers; this module picks and
opens the right one for a model folder, so the types never import their own base's factory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from ..backends import SessionOptions, npu
from ..errors import ModelError
from .catalog import ModelRef, resolve_model
from .recognizer import Recognizer

if TYPE_CHECKING:
    from ..config import Settings


def open_recognizer(
    ref: ModelRef, backend: str = "onnxruntime", options: SessionOptions | None = None, **kwargs
) -> Recognizer:
    """The engine for an ASR model folder: Whisper, stateless CTC or stateful streaming CTC.

    Each engine's ``step`` takes its own stream type (it is only fed the streams it made), which
    the ``Recognizer`` protocol spells as ``AudioStream``: hence the casts."""
    if ref.kind == "asr-whisper":
        if backend == "openvino" and options is not None and npu.is_npu(options.device):
            from .asr_whisper_npu import NpuWhisperRecognizer  # static graphs built from an imported folder

            return cast("Recognizer", NpuWhisperRecognizer.open(ref, backend, options, **kwargs))
        from .asr_whisper import WhisperRecognizer

        return cast("Recognizer", WhisperRecognizer.open(ref, backend, options, **kwargs))
    if ref.kind in ("asr-ctc", "asr-ctc-streaming") or ref.model_type == "streaming-ctc":
        from .asr_ctc import CtcRecognizer

        return cast("Recognizer", CtcRecognizer.open(ref, backend, options, **kwargs))
    raise ModelError(f"{ref.name} is a {ref.kind} model, not a speech recogniser (give a Whisper or CTC folder)")


def open_configured(
    settings: Settings,
    model: str | None = None,
    backend: str | None = None,
    decoder: str = "auto",
    beam_width: int | None = None,
    language: str = "en",
) -> Recognizer:
    """The top configured ASR tier's recogniser, or ``model`` (a demo name or folder) on ONNX Runtime's
    CPU (OpenVINO's with ``backend="openvino"``) when given."""
    tier = settings.models.asr[0]
    ref = resolve_model(model or tier.model, settings.models.cache_dir)
    backend = backend or (tier.backend if not model else "onnxruntime")
    device = tier.device if not model else ("CPU" if backend == "openvino" else "cpu")
    options = SessionOptions(device=device, threads=settings.device.threads, cache_dir=settings.engines.cache_dir)
    return open_recognizer(
        ref,
        backend,
        options,
        decoder=decoder,
        beam_width=beam_width,
        language=language,
        final_padding_s=settings.asr.final_padding_s,
    )
