"""``edge-agent bench calls``: how many home commands become exactly the right tool call, text and speech.

Each command of ``demo_models/home_commands.py`` (the demo's set; the two held-out sets, ``held-out`` and
``unseen``: other words for the same actions, numbers said as words, other voices, requests no tool
answers; the development set) goes
through the agent's own voice-turn request (``VoiceTurn.chat``: the user's words with the home tools
described, the model's chat template; greedy, the tool-or-text grammar of ``tool_choice: "auto"`` or the
call grammar of ``"required"``; the prefix cache and jump-forward on, as the daemon runs them) on one LLM
scheduler:

- **text**: the command's words as written;
- **speech** (``--speech``): the words spoken by the natural-voice set in turn (``--voices``, default
  ``standard``: Piper joe at three length/noise settings, flite slt/rms/awb/kal16, espeak-ng en-us as the
  stress voice; command i in voice i mod n, ``engines/voices.py``; ``--every-voice``: every command by every
  voice, which is what a rate on a set of a dozen commands needs), transcribed whole by the configured ASR
  tier (or ``--asr-model``) told the tools' words as its context (``--context on``; ``off``, or ``both``
  to score each way); the LLM gets what was heard.

A command is right when the reply makes exactly the expected call (name and arguments, numbers by
value) or, where no tool fits, makes none. Reported per set and input: right / of, the wrong ones
(said, heard, got, expected) and the time from the request to the complete reply (p50 / p95; the first
request of a run, which fills the prefix cache, is left out). End of speech → call under real-time
streaming is ``bench voice``'s to measure.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..demo_models.home_commands import DEMO, DEV, HELD_OUT, UNSEEN, Command, judge
from ..errors import InputError
from .options import CallsOptions

HOME_TOOLS = Path(__file__).resolve().parent.parent / "demo_models" / "home-tools.json"
SETS = {"demo": DEMO, "held-out": HELD_OUT, "unseen": UNSEEN, "dev": DEV}


def heard_by(recognizer: Any, speech: np.ndarray, context: str = "") -> str:
    """What ``recognizer`` hears in ``speech`` (16 kHz; silence added around it), told ``context``."""
    from ..engines.voices import RATE

    pad = np.zeros(int(0.4 * RATE), np.float32)
    audio = np.concatenate([pad, speech, pad, pad])
    if context and hasattr(recognizer, "context_ids"):
        return str(recognizer.transcribe(audio, context=context).text).strip()
    return str(recognizer.transcribe(audio).text).strip()


def spoken(commands, voices, every_voice: bool = False) -> tuple[list, list[np.ndarray], list[str]]:
    """Each command spoken by ``voices`` in turn (command i by voice i mod n), or by each of them
    (``every_voice``): the commands as said (a command once per voice that says it), audio, voice labels."""
    from ..engines.voices import synthesize

    if every_voice:
        pairs = [(c, v) for c in commands for v in voices]
    else:
        pairs = [(c, voices[i % len(voices)]) for i, c in enumerate(commands)]
    audio = synthesize([(c.text, v) for c, v in pairs])
    return [c for c, _ in pairs], audio, [v.label for _, v in pairs]


def score(
    scheduler: Any,
    tokenizer: Any,
    tools: list[dict],
    commands,
    heard: list[str],
    tool_choice: str,
    limit: int,
    voice_of: list[str] | None = None,
):
    """Each command's reply to what was heard (one request at a time): rows and the summary."""
    from ..models.sampling import SamplingParams
    from ..serving.doors.voice.turn import VoiceTurn, chat_submit

    turn = VoiceTurn(
        chat_submit(scheduler, tokenizer), tools, tool_choice=tool_choice, prefill_ahead=False, tick_s=None
    )
    submit = chat_submit(scheduler, tokenizer)
    rows = []
    for i, (command, text) in enumerate(zip(commands, heard, strict=True)):
        params = SamplingParams(max_new_tokens=limit, temperature=0.0, grammar=turn.grammar)
        start = time.monotonic()
        done = submit(turn.chat(text), params).result(120.0)
        ms = (time.monotonic() - start) * 1e3
        call = VoiceTurn.call_of(done.text) if done.finish_reason != "length" else None
        rows.append(
            {
                "said": command.text,
                "voice": voice_of[i] if voice_of else command.voice,
                "heard": text,
                "expected": command.call,
                "call": call,
                "reply": done.text if call is None else "",
                "right": judge(command.call, call),
                "reply_ms": round(ms, 1),
                "cached_tokens": done.timing.cached_tokens,
                "prompt_tokens": done.timing.tokens_in,
            }
        )
    turn.close()
    return rows


def summary(rows: list[dict]) -> dict:
    from ..metrics.window import nearest_rank

    times = sorted(r["reply_ms"] for r in rows[1:]) or sorted(r["reply_ms"] for r in rows)
    right = sum(r["right"] for r in rows)
    return {
        "right": right,
        "of": len(rows),
        "rate": round(right / len(rows), 4) if rows else None,
        "reply_ms": {"p50": nearest_rank(times, 50), "p95": nearest_rank(times, 95)},
        "wrong": [r for r in rows if not r["right"]],
    }


def run(opts: CallsOptions) -> int:
    """Score every command of the asked-for sets (text, and what the ASR heard); print the report (JSON)."""
    from ..backends import SessionOptions
    from ..config import load_settings
    from ..models.catalog import resolve_model
    from ..models.llm import DecoderLM
    from ..serving.doors.openai.output import load_tools
    from ..serving.doors.voice.turn import turn_limits
    from ..serving.llm.scheduler import LLMScheduler

    names = [s.strip() for s in opts.sets.split(",") if s.strip()]
    unknown = [s for s in names if s not in SETS]
    if unknown or not names:
        raise InputError(f"--sets: unknown {unknown or names}; known: {', '.join(SETS)}")
    settings = load_settings(opts.config)
    tools = load_tools(HOME_TOOLS)
    inputs: dict[str, dict[str, list[str]]] = {n: {"text": [c.text for c in SETS[n]]} for n in names}
    asr_name = None
    # per set, the commands as spoken (with --every-voice each once per voice) and who spoke each
    said: dict[str, Sequence[Command]] = {n: SETS[n] for n in names}
    voices_used: dict[str, list[str]] = {}
    if opts.speech:
        from ..engines.voices import parse_voices, require
        from ..models.asr import open_configured
        from ..models.asr_prompt import build_prompt

        voices = parse_voices(opts.voices)
        require(voices)
        context = build_prompt(tools if settings.asr.tool_context else None, settings.asr.prompt_words)
        ways = {"on": [("speech", context)], "off": [("speech", "")]}.get(opts.context)
        ways = ways or [("speech", context), ("speech/no-context", "")]
        recognizer = open_configured(settings, opts.asr_model)
        asr_name = recognizer.name if hasattr(recognizer, "name") else opts.asr_model
        try:
            for n in names:
                said[n], audio, voices_used[n] = spoken(SETS[n], voices, opts.every_voice)
                for kind, words in ways:
                    inputs[n][kind] = [heard_by(recognizer, x, words) for x in audio]
        finally:
            recognizer.close()
        report_voices = [v.label for v in voices]
        report_context = {kind: words for kind, words in ways}
    ref = resolve_model(opts.llm_model, settings.models.cache_dir)
    threads = opts.threads or settings.device.threads
    lm = DecoderLM.open(ref, opts.backend, SessionOptions(threads=threads, cache_dir=settings.engines.cache_dir))
    report: dict[str, Any] = {"llm_model": ref.name, "llm_path": str(ref.path), "backend": opts.backend}
    report.update(asr_model=asr_name, tool_choice=opts.tool_choice, threads=threads, results={})
    if opts.speech:
        report.update(voices=report_voices, every_voice=opts.every_voice, asr_context=report_context)
    try:
        scheduler = LLMScheduler(lm, turn_limits(settings)).start()
        try:
            for n in names:
                for kind, heard in inputs[n].items():
                    rows = score(
                        scheduler,
                        lm.tokenizer,
                        tools,
                        SETS[n] if kind == "text" else said[n],
                        heard,
                        opts.tool_choice,
                        opts.max_new_tokens,
                        voices_used.get(n) if kind != "text" else None,
                    )
                    report["results"][f"{n}/{kind}"] = {**summary(rows), "rows": rows}
        finally:
            scheduler.stop()
    finally:
        lm.close()
    print(format_report(report))
    if opts.json_out:
        Path(opts.json_out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _call_text(call: dict | None) -> str:
    return "no call" if call is None else f"{call['name']} {json.dumps(call['arguments'])}"


def format_report(report: dict) -> str:
    lines = [
        f"bench calls: {report['llm_model']} ({report['backend']}, {report['threads']} threads), tool_choice "
        f"{report['tool_choice']}" + (f", speech heard by {report['asr_model']}" if report.get("asr_model") else "")
    ]
    if report.get("voices"):
        how = "every command by each" if report.get("every_voice") else "in turn"
        lines.append(f"  voices ({how}): {', '.join(report['voices'])}")
        for kind, words in report.get("asr_context", {}).items():
            lines.append(f"  {kind}: ASR context {words[:100] + '…' if len(words) > 100 else words or 'none'!r}")
    for key, res in report["results"].items():
        t = res["reply_ms"]
        lines.append(
            f"  {key:<18} {res['right']:>3} of {res['of']:<3} right ({res['rate'] * 100:.0f} %) · request → complete "
            f"reply P50 {t['p50']:.0f} · P95 {t['p95']:.0f} ms"
        )
        for w in res["wrong"]:
            heard = "" if w["heard"] == w["said"] else f", heard {w['heard']!r} ({w['voice']})"
            got = _call_text(w["call"]) if w["call"] else f"no call ({w['reply'][:60]!r})"
            lines.append(f"      wrong: {w['said']!r}{heard} → {got}; expected {_call_text(w['expected'])}")
    return "\n".join(lines)
