"""``edge-agent bench voice``: the voice turn end to end, with its latency features on and off.

Spoken commands are synthesised with espeak-ng (several voices and speeds; some with a 300 ms pause
inside the sentence, "turn on the" … "kitchen lights") and replayed in real time, in ``[audio]
block_ms`` blocks on a clock as a microphone delivers them, through the configured ASR tier's streaming
service (endpointing, partials, final; the early end of turn as ``[audio]`` sets it) into a ``VoiceTurn``
(``serving/doors/voice/turn.py``: partials prefilled ahead, the final's reply) on the top configured LLM tier
with the home tools (``demo_models/home-tools.json``, a tool call required), until the call is complete.
Both tiers are loaded in this process, as ``listen --respond --tools`` does.

Two sides run the same utterances, interleaved per utterance (default first in even rounds, baseline
first in odd ones) so that machine load hits both alike:

- **default**: the settings as configured;
- **baseline**: a copy with the prefix cache, prefill-ahead, the reply ahead on a pause, the early end of
  turn and jump-forward decoding of the call's forced tokens off: the turn as it was without them (each
  toggle the configuration does not have yet is listed under ``missing`` in the report).

Per run, from the end of speech (when the audio block holding the last voiced sample was fed):
``endpoint_ms`` to the end-of-turn decision, ``turn_first_token_ms`` to the LLM's first token,
``turn_complete_ms`` to the complete tool call. ``false_cuts``: runs of an utterance with a pause whose
turn ended inside the sentence (the endpointer cut it in two, or decided before the speech ended);
``duplicated_calls``: complete calls beyond one per utterance; ``hit_tokens``: prompt tokens of the
turns' requests whose KV came from the prefix cache. Percentiles are taken per round and the medians of
the rounds reported; counts are totals over all rounds. Each round starts with fresh schedulers (an
empty prefix cache) and one unmeasured warm-up command, so a command repeated in a later round is not
served from what the cache kept of it earlier.
"""

from __future__ import annotations

import json
import queue
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..demo_models.home_commands import heat, judge, light, timer
from ..engines import voices
from ..engines.voices import Voice
from ..errors import InputError
from ..serving.doors.voice.command_check import command_check
from .options import VoiceOptions

RATE = 16000
PAUSE_S = 0.3
HOME_TOOLS = Path(__file__).resolve().parent.parent / "demo_models" / "home-tools.json"


@dataclass(frozen=True)
class Utterance:
    """One spoken command: its parts (a pause of ``PAUSE_S`` between two parts), voice and speed."""

    parts: tuple[str, ...]
    voice: str  # espeak-ng -v; a variant by its FILE name (``en+max``, ``en+Annie``): a wrong case is silently ignored
    wpm: int
    call: dict | None = None  # the call it must become (None: no tool fits)

    @property
    def text(self) -> str:
        return " ".join(self.parts)

    @property
    def pause(self) -> bool:
        return len(self.parts) > 1


UTTERANCES = (
    Utterance(("turn on the", "kitchen lights"), "en-us+max", 160, light("kitchen", True)),
    Utterance(("set a timer for ten minutes",), "en+Annie", 150, timer(10)),
    Utterance(("set the bedroom temperature to twenty one degrees",), "en-gb-x-rp+m3", 170, heat("bedroom", 21)),
    Utterance(("switch off the", "living room light"), "en+f2", 145, light("living room", False)),
    Utterance(("dim the hallway light to thirty percent",), "en-us+Andy", 175, light("hallway", True, brightness=30)),
    Utterance(("set a timer for", "five minutes"), "en+steph", 155, timer(5)),
    Utterance(("turn off the bathroom light",), "en-us", 185, light("bathroom", False)),
    Utterance(("make the kitchen", "twenty degrees"), "en+klatt", 150, heat("kitchen", 20)),
    Utterance(("turn the bedroom light on",), "en+m3", 165, light("bedroom", True)),
    Utterance(("start a timer for twenty minutes",), "en-us+Annie", 140, timer(20)),
    Utterance(("set the living room to twenty two degrees",), "en+Andy", 180, heat("living room", 22)),
    Utterance(("turn on the hallway light",), "en+f2", 190, light("hallway", True)),
)
WARMUP = Utterance(("what time is it",), "en-us", 160)


@dataclass
class Clip:
    """An utterance's samples (16 kHz float32, silence around it) and where its speech ends."""

    utterance: Utterance
    samples: np.ndarray
    speech_end: int  # samples: the last voiced sample + 1
    voice: str = ""  # who spoke it (``Voice.label``); "" for espeak-ng in the utterance's own voice


# -- speech ---------------------------------------------------------------------------------------


def _espeak(text: str, voice: str, wpm: int) -> np.ndarray:
    """espeak-ng speech resampled to 16 kHz by sox (no dither: the same samples every run), trimmed of
    the silence espeak-ng puts around it, peak 0.5."""
    speak = subprocess.run(
        ["espeak-ng", "-v", voice, "-s", str(wpm), "--stdout", text], capture_output=True, check=True, timeout=30
    )
    sox = subprocess.run(
        ["sox", "-q", "-D", "-t", "wav", "-", "-t", "raw", "-r", str(RATE), "-e", "signed", "-b", "16", "-c", "1", "-"],
        input=speak.stdout,
        capture_output=True,
        check=True,
        timeout=30,
    )
    x = np.frombuffer(sox.stdout, dtype="<i2").astype(np.float32) / 32768.0
    voiced = np.flatnonzero(np.abs(x) > 0.01 * max(float(np.max(np.abs(x), initial=0.0)), 1e-6))
    if voiced.size == 0:
        raise InputError(f"espeak-ng gave no speech for {text!r} with voice {voice!r}")
    x = x[voiced[0] : voiced[-1] + 1]
    return (x * (0.5 / float(np.max(np.abs(x))))).astype(np.float32)


def synthesize(utterance: Utterance, lead_s: float, tail_s: float, voice: Voice | None = None) -> Clip:
    """The utterance with ``lead_s`` of silence before it, ``tail_s`` after, and ``PAUSE_S`` between its parts;
    spoken by ``voice`` (``engines/voices.py``: Piper, flite, espeak-ng), else by espeak-ng in its own voice."""
    pieces: list[np.ndarray] = [np.zeros(int(lead_s * RATE), np.float32)]
    spoken = (
        voices.synthesize([(part, voice) for part in utterance.parts])
        if voice is not None
        else [_espeak(part, utterance.voice, utterance.wpm) for part in utterance.parts]
    )
    for k, part in enumerate(spoken):
        if k:
            pieces.append(np.zeros(int(PAUSE_S * RATE), np.float32))
        pieces.append(part)
    speech_end = sum(p.size for p in pieces)
    pieces.append(np.zeros(int(tail_s * RATE), np.float32))
    return Clip(utterance, np.concatenate(pieces), speech_end, voice.label if voice is not None else "")


def require_tools() -> None:
    missing = [t for t in ("espeak-ng", "sox") if shutil.which(t) is None]
    if missing:
        raise InputError(
            f"bench voice synthesises its commands with espeak-ng and sox: install {' and '.join(missing)}"
        )


# -- one side: its settings, ASR service and LLM scheduler ----------------------------------------

# (section, field) turned off for the baseline; a name the configuration lacks is reported missing.
TOGGLES = (
    ("prefix_cache", "enabled"),
    ("audio", "prefill_ahead"),
    ("audio", "respond_ahead"),
    ("audio", "early_end"),
    ("batching", "jump_forward"),
)


def baseline_settings(settings) -> tuple[Any, dict[str, bool], list[str]]:
    """A copy of ``settings`` with every toggle of ``TOGGLES`` off: (copy, each toggle's default value, missing)."""
    defaults: dict[str, bool] = {}
    missing: list[str] = []
    updates: dict[str, Any] = {}
    for section, name in TOGGLES:
        part = getattr(settings, section, None)
        if part is None or name not in type(part).model_fields:
            missing.append(f"{section}.{name}")
            continue
        defaults[f"{section}.{name}"] = bool(getattr(part, name))
        updates[section] = (updates.get(section) or part).model_copy(update={name: False})
    return settings.model_copy(update=updates), defaults, missing


@dataclass
class Side:
    """What one configuration runs on: its settings, ASR service and (per round) LLM scheduler."""

    name: str
    settings: Any
    service: Any
    scheduler: Any = None

    def limits(self):
        from ..serving.doors.voice.turn import turn_limits

        return turn_limits(self.settings)  # the voice turn's own scheduler, as ``listen --respond`` makes it

    @property
    def pause_ms(self) -> int | None:
        """The streams' pause partials (``[audio] pause_ms``) when this side starts replies ahead on them."""
        from ..serving.doors.voice.turn import turn_pause_ms

        return turn_pause_ms(self.settings.audio)

    def voice_turn(self, llm: Llm):
        """A ``VoiceTurn`` for one stream, with this side's prefill-ahead settings."""
        from ..serving.doors.voice.turn import VoiceTurn, chat_submit, turn_options

        options = turn_options(self.settings.audio)
        submit = chat_submit(self.scheduler, llm.lm.tokenizer)
        return VoiceTurn(submit, llm.tools, tool_choice=llm.tool_choice, max_new_tokens=llm.max_new_tokens, **options)


class Llm:
    """The top LLM tier (or ``--llm-model``), opened as ``listen --respond`` opens it, and the tools."""

    def __init__(self, opts: VoiceOptions, settings, tools: list[dict]) -> None:
        from ..backends import SessionOptions
        from ..models.catalog import resolve_model
        from ..models.llm import DecoderLM

        tier = settings.models.llm[0]
        ref = resolve_model(opts.llm_model or tier.model, settings.models.cache_dir)
        self.backend = tier.backend if not opts.llm_model else "onnxruntime"
        options = SessionOptions(
            device=tier.device if not opts.llm_model else "cpu",
            threads=settings.device.threads,
            cache_dir=settings.engines.cache_dir,
        )
        self.lm = DecoderLM.open(ref, self.backend, options)
        self.name = ref.name
        self.tools = tools
        self.max_new_tokens = opts.max_new_tokens
        self.tool_choice = opts.tool_choice


# -- one run: an utterance replayed on one side --------------------------------------------------


@dataclass
class RunResult:
    """One utterance replayed on one side: the end of speech, each final's turn, what the turn counted."""

    speech_end_s: float
    turns: list[tuple[Any, Any]] = field(default_factory=list)  # (final event, TurnResult)
    asr_utterances: int = 0
    false_cuts: int = 0  # VoiceTurn's own count: an early reply delivered, then the speech resumed
    cancelled: int = 0
    repeats: int = 0  # after a false cut, the whole utterance's same call, not delivered again


def _respond(turn, finals: queue.SimpleQueue, out: list) -> None:
    """Turn worker: each final with text → ``VoiceTurn.on_final`` (blocks for the reply); ``None`` ends it."""
    while (event := finals.get()) is not None:
        try:
            out.append((event, turn.on_final(event)))  # times from the decision; re-based in ``record``
        except Exception as exc:  # a failed turn is reported, not fatal to the benchmark
            out.append((event, exc))


def replay(side: Side, llm: Llm, clip: Clip, block_ms: int) -> RunResult:
    """``clip`` fed in real time to a new stream of ``side``'s ASR service, its events to a ``VoiceTurn``."""
    finals: queue.SimpleQueue = queue.SimpleQueue()
    turns: list = []
    counts = {"utterances": 0}
    turn = side.voice_turn(llm)

    def on_event(event) -> None:
        turn.on_event(event)
        if event.kind in ("final", "error"):
            counts["utterances"] += 1
        if event.kind == "final" and event.text.strip():
            finals.put(event)

    worker = threading.Thread(target=_respond, args=(turn, finals, turns), daemon=True)
    worker.start()
    stream = side.service.open_stream(
        on_event=on_event, pause_ms=side.pause_ms, early_end=True, complete=command_check(llm.tools)
    )
    stream.set_context(llm.tools)  # the recogniser told the tools' words, as a voice turn's stream is
    block = max(1, block_ms * RATE // 1000)
    speech_end_s = None
    start = time.monotonic()
    try:
        for i in range(0, clip.samples.size, block):
            delay = start + (i + block) / RATE - time.monotonic()  # a block is delivered once it is captured
            if delay > 0:
                time.sleep(delay)
            stream.feed(clip.samples[i : i + block])
            if speech_end_s is None and i + block >= clip.speech_end:
                speech_end_s = time.monotonic()
    finally:
        stream.close()
        stream.wait(120.0)
        finals.put(None)
        worker.join(600.0)
        turn.close()
    assert speech_end_s is not None
    return RunResult(speech_end_s, turns, counts["utterances"], turn.false_cuts, turn.cancelled, turn.repeats)


def record(result: RunResult, clip: Clip, side: str, round_: int, index: int) -> dict:
    """One run's row of the report: times in ms from the end of speech, of the last delivered turn."""
    end = result.speech_end_s
    delivered, errors = [], []
    for event, turn in result.turns:
        if isinstance(turn, Exception):
            errors.append(str(turn))
        elif turn.delivered:
            delivered.append((event, turn))

    def since_end(event, ms: float | None) -> float | None:  # ms from the decision → ms from the end of speech
        decided = event.speech_end_at_s
        return None if ms is None or decided is None else round(ms + (decided - end) * 1e3, 1)

    last_event, last = delivered[-1] if delivered else (None, None)
    decided_early = any(e.speech_end_at_s is not None and e.speech_end_at_s < end for e, _ in delivered)
    calls = [t.call for _, t in delivered if t.call is not None]
    u = clip.utterance
    # right: the one delivered turn made exactly the expected call (or no call when none is due)
    right = len(delivered) == 1 and not errors and judge(u.call, delivered[0][1].call)
    return {
        "round": round_,
        "utterance": index,
        "side": side,
        "said": u.text,
        "voice": clip.voice or f"espeak-ng {u.voice}",
        "wpm": u.wpm,
        "pause": u.pause,
        "heard": [t.text for _, t in delivered],
        "calls": calls,
        "expected": u.call,
        "right": right,
        "endpoint_ms": since_end(last_event, 0.0) if last else None,
        "turn_first_token_ms": since_end(last_event, last.turn_first_token_ms) if last else None,
        "turn_complete_ms": since_end(last_event, last.turn_complete_ms) if last else None,
        "early_end": bool(last and last.early_end),
        # a turn delivered inside the sentence: before the speech ended, or one of several
        "cut": len(delivered) > 1 or decided_early or result.false_cuts > 0,
        "duplicated_calls": max(0, len(calls) - 1),
        "hit_tokens": sum(t.cached_tokens for _, t in delivered),
        "prompt_tokens": sum(t.prompt_tokens for _, t in delivered),
        "prefill_ahead": sum(t.prefill_ahead for _, t in delivered),
        "prefill_wasted": sum(t.prefill_wasted for _, t in delivered),
        "reply_ahead": sum(t.reply_ahead for _, t in delivered),
        "cancelled": result.cancelled,
        "repeats_withheld": result.repeats,
        "asr_utterances": result.asr_utterances,
        "errors": errors,
    }


# -- the command ----------------------------------------------------------------------------------


def run(opts: VoiceOptions) -> int:
    """Both sides over the utterances, interleaved, for ``rounds`` rounds; the table printed (JSON, plot)."""
    from ..config import load_settings
    from ..models.asr import open_configured
    from ..serving.asr.factory import make_service
    from ..serving.doors.openai.output import load_tools
    from .voice_report import build_report, format_table, plot_report

    if opts.rounds < 1:
        raise InputError("--rounds must be at least 1")
    count = len(UTTERANCES) if opts.utterances is None else opts.utterances
    if not 1 <= count <= len(UTTERANCES):
        raise InputError(f"--utterances must lie in 1..{len(UTTERANCES)}")
    require_tools()
    who = None if opts.voices == "own" else voices.parse_voices(opts.voices)
    if who is not None:
        voices.require(who)
    tools = load_tools(opts.tools or HOME_TOOLS)
    settings = load_settings(opts.config)
    base, toggles, missing = baseline_settings(settings)
    tail_s = max(1.2, settings.audio.trailing_silence_ms / 1e3 + 0.7)  # every turn ends by silence
    clips = [synthesize(u, 0.4, tail_s, who[k % len(who)] if who else None) for k, u in enumerate(UTTERANCES[:count])]
    warmup = synthesize(WARMUP, 0.4, tail_s, who[0] if who else None)
    engine = open_configured(settings, opts.asr_model)
    llm = Llm(opts, settings, tools)
    sides = [
        Side(name, s, make_service(engine, s.audio, s.batching, early_end=True).start())
        for name, s in (("default", settings), ("baseline", base))
    ]
    for side in sides:
        side.service.prompt_words = tuple(side.settings.asr.prompt_words)
        side.service.tool_context = side.settings.asr.tool_context
    rows: list[dict] = []
    try:
        rows = _rounds(opts, sides, llm, clips, warmup, settings.audio.block_ms)
    finally:
        for side in sides:
            side.service.stop()
            if side.scheduler is not None:
                side.scheduler.stop()
        engine.close()
        llm.lm.close()
    report = build_report(
        rows,
        meta={
            "asr_model": engine.name,
            "voices": [v.label for v in who] if who else ["espeak-ng (each command's own voice)"],
            "llm_model": llm.name,
            "llm_backend": llm.backend,
            "rounds": opts.rounds,
            "utterances": len(clips),
            "with_pause": sum(c.utterance.pause for c in clips),
            "pause_ms": PAUSE_S * 1e3,
            "block_ms": settings.audio.block_ms,
            "toggles": toggles,
            "missing": missing,
        },
    )
    print(format_table(report))
    if opts.json_out:
        Path(opts.json_out).write_text(json.dumps(report, indent=2) + "\n")
    if opts.plot:
        plot_report(report, Path(opts.plot))
    return 0


def _rounds(
    opts: VoiceOptions, sides: list[Side], llm: Llm, clips: list[Clip], warmup: Clip, block_ms: int
) -> list[dict]:
    from ..progress import Progress
    from ..serving.llm.scheduler import LLMScheduler

    rows: list[dict] = []
    total = opts.rounds * len(clips)
    with Progress("bench voice", "utterances", enabled=not opts.quiet, min_interval_s=0.0) as bar:
        for r in range(opts.rounds):
            for side in sides:  # an empty prefix cache each round, primed by one command as a running daemon's is
                if side.scheduler is not None:
                    side.scheduler.stop()
                side.scheduler = LLMScheduler(llm.lm, side.limits()).start()
                replay(side, llm, warmup, block_ms)
            order = sides if r % 2 == 0 else sides[::-1]
            for k, clip in enumerate(clips):
                for side in order:
                    rows.append(record(replay(side, llm, clip, block_ms), clip, side.name, r, k))
                bar.label = f"bench voice round {r + 1}/{opts.rounds}: {clip.utterance.text!r}"
                bar.update(r * len(clips) + k + 1, total)
    return rows
