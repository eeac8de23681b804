"""What the Wyoming server says it serves (``describe`` -> ``info``) and which requests it takes.

``info`` lists one ASR program, ``name`` from ``[wyoming]``, whose models are the ASR ladder's tiers (each
with the languages the active recogniser transcribes: Whisper set to ``auto`` lists every language it
knows) and ``supports_transcript_streaming``; and, when the LLM is offered, one ``handle`` program whose
models are the LLM ladder's tiers, ``supports_handled_streaming``. A ``transcribe`` may name the program,
``edge-agent`` or a tier (the active tier serves it, as on the HTTP API) and a language the tier transcribes
(``en``, ``en-US`` and ``en_GB`` are all English); anything else is refused naming what is served.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ....config import WyomingConfig
from ....errors import InputError
from ..ladders import LlmLadder, SpeechLadder
from .protocol import clip

URL = ""  # the attribution's address: the project names none


def _not_counted(kind: str, outcome: str) -> None:
    pass


@dataclass(frozen=True)
class Offer:
    """What a Wyoming server offers each of its connections: its settings (``[wyoming]``), the ladders (None:
    that one is not served), ``count(kind, outcome)`` for each request (``/metrics``) and the version ``info``
    names."""

    config: WyomingConfig
    asr: SpeechLadder | None = None
    llm: LlmLadder | None = None
    count: Callable[[str, str], None] = _not_counted
    version: str = ""


class RequestRefused(InputError):
    """A ``transcribe`` this server cannot honour; ``code`` is the Wyoming error's code."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


def asr_language(engine: Any) -> str:
    from ...asr.upload import model_language

    return model_language(engine) if engine is not None else "en"


def asr_languages(engine: Any) -> list[str]:
    lang = asr_language(engine)
    if lang == "auto":
        return sorted(getattr(engine, "lang_to_id", {}) or {}) or ["auto"]
    return [lang]


def check_request(request: Any, asr: SpeechLadder, language: str) -> None:
    """Refuse (``RequestRefused``) a ``Transcribe`` naming a model or a language that is not served."""
    if request is None:
        return
    names = ["edge-agent", *(t.name for t in asr.tiers)]
    if request.name and request.name not in names:
        raise RequestRefused(f"no ASR model {clip(request.name)} here; served: {', '.join(names)}", "model")
    if request.language and language != "auto":
        asked = request.language.replace("_", "-").split("-")[0].strip().lower()
        if asked != language.lower():
            raise RequestRefused(
                f"ASR tier {asr.active_tier!r} transcribes {language!r}, not {clip(request.language)}", "language"
            )


def server_info(offer: Offer) -> Any:
    """The ``info`` event's ``Info`` for what ``offer`` serves."""
    from wyoming.info import AsrModel, AsrProgram, Attribution, HandleModel, HandleProgram, Info

    attribution = Attribution(name="edge-agent", url=URL)
    name, version = offer.config.name, offer.version or None
    asr_programs, handle_programs = [], []
    if offer.asr is not None:
        engine = offer.asr.active_engine
        languages = asr_languages(engine)
        models = [
            AsrModel(
                name=tier.name,
                attribution=attribution,
                installed=True,
                description=f"ASR tier {tier.name}" + (" (active)" if tier.name == offer.asr.active_tier else ""),
                version=version,
                languages=languages,
            )
            for tier in offer.asr.tiers
        ]
        asr_programs.append(
            AsrProgram(
                name=name,
                attribution=attribution,
                installed=True,
                description="edge-agent speech recognition: the daemon's ASR tier ladder",
                version=version,
                models=models,
                supports_transcript_streaming=True,
            )
        )
    if offer.llm is not None and offer.config.handle:
        handle_programs.append(
            HandleProgram(
                name=name,
                attribution=attribution,
                installed=True,
                description="edge-agent conversation agent: the daemon's LLM tier ladder",
                version=version,
                models=[
                    HandleModel(
                        name=tier.name,
                        attribution=attribution,
                        installed=True,
                        description=f"LLM tier {tier.name}",
                        version=version,
                        languages=["en"],
                    )
                    for tier in offer.llm.tiers
                ],
                supports_handled_streaming=True,
            )
        )
    return Info(asr=asr_programs, handle=handle_programs)
