"""``edge-agent transcribe`` and ``edge-agent listen``: speech in, partial and final text out.

    edge-agent transcribe FILE [--model NAME|DIR] [--stream] [--json]
    edge-agent listen (--mic [DEVICE] | --file F | --stdin) [--respond [--tools FILE]] [--json]

``transcribe`` replays a file through the streaming service: unpaced by default (each chunk is
recognised before the next is fed, so partials appear at every chunk), in real time with
``--stream`` (latencies then mean what they would on a microphone). ``listen`` runs until the
source ends (or Ctrl-C, ``--duration``, ``--max-utterances``); with ``--respond`` each final
transcript goes to the LLM and ``turn_ms`` (end of speech → first LLM token) is reported; with
``--tools FILE`` (OpenAI function tools) each command becomes one tool call whose arguments follow
the tool's schema, and ``turn_ms`` runs from the end of speech to the complete call.
"""

from __future__ import annotations

import argparse
import json
import logging
import queue
import sys
import threading
import time
from typing import Any

from ..errors import InputError
from ..models.ctc_lexicon import DECODERS
from ..serving.doors.openai.output import load_tools
from ..serving.doors.voice.command_check import command_check
from .respond import Responder

log = logging.getLogger(__name__)


def add_commands(sub) -> None:
    p = sub.add_parser("transcribe", help="transcribe an audio file, streaming partials and the final text")
    _common(p)
    p.add_argument("file", help="WAV/FLAC file (any rate, channels and sample format; converted to 16 kHz mono)")
    p.add_argument("--stream", action="store_true", help="replay in real time, as a microphone would deliver it")
    p.add_argument("--no-vad", action="store_true", help="the whole file is one utterance (no endpointing)")
    p.set_defaults(func=cmd_transcribe)

    p = sub.add_parser("listen", help="live recognition from a microphone, a file or stdin; --respond talks back")
    _common(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--mic",
        nargs="?",
        const="",
        action="append",
        metavar="DEVICE",
        help="capture from a microphone (name or index; default: audio.device or the system "
        "default); repeat for several microphones, one stream each",
    )
    src.add_argument("--file", metavar="F", help="replay a WAV/FLAC file in real time")
    src.add_argument("--stdin", action="store_true", help="raw PCM on stdin (see --pcm-format, --pcm-rate)")
    p.add_argument("--pcm-format", default="s16le", choices=("s16le", "s32le", "f32le"))
    p.add_argument("--pcm-rate", type=int, default=16000)
    p.add_argument("--pcm-channels", type=int, default=1)
    p.add_argument("--respond", action="store_true", help="send each final transcript to the LLM, stream the reply")
    p.add_argument("--llm-model", help="LLM for --respond (default: the top configured LLM tier)")
    p.add_argument("--max-new-tokens", type=int, help="reply length for --respond (default 48, or 160 for a tool call)")
    p.add_argument(
        "--tools",
        metavar="FILE",
        help='with --respond: OpenAI function tools (JSON list or {"tools": [...]}); each command becomes a call',
    )
    p.add_argument(
        "--tool-choice",
        choices=("required", "auto"),
        default="required",
        help="with --tools: always call a tool (default), or let the model answer in words",
    )
    p.add_argument(
        "--no-early-end",
        action="store_true",
        help="always wait the full trailing_silence_ms (default: [audio] early_end)",
    )
    p.add_argument(
        "--no-prefill-ahead",
        action="store_true",
        help="with --respond: no prefill of stable partials (default: [audio] prefill_ahead)",
    )
    p.add_argument("--duration", type=float, help="stop after this many seconds")
    p.add_argument("--max-utterances", type=int, help="stop after this many final transcripts")
    p.set_defaults(func=cmd_listen)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML config (default /etc/edge-agent/agent.toml if present)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--model", help="ASR demo model name or model folder (default: the top configured ASR tier)")
    p.add_argument("--backend", choices=("onnxruntime", "openvino"), help="default: the tier's backend")
    p.add_argument(
        "--decoder",
        choices=DECODERS,
        default="auto",
        help="CTC decoding: auto (default) = lexicon + LM when the model folder ships them, else greedy",
    )
    p.add_argument("--beam-width", type=int, default=None, help="beam/lexicon/lm width (default 8, or lm_beam)")
    p.add_argument("--language", default="en", help="Whisper language code, or 'auto' (default en)")


def open_engine(args: argparse.Namespace, settings) -> Any:
    from ..models.asr import open_configured

    return open_configured(
        settings, args.model, args.backend, decoder=args.decoder, beam_width=args.beam_width, language=args.language
    )


def _r(v: float | None, digits: int = 1) -> float | None:
    return None if v is None else round(v, digits)


# -- transcribe -----------------------------------------------------------------------------------


def cmd_transcribe(args: argparse.Namespace) -> int:
    from ..audio.sources import FileSource
    from ..config import load_settings
    from ..errors import EdgeAgentError
    from ..serving.asr.factory import feed_lockstep, make_service

    settings = load_settings(args.config)
    source = FileSource(args.file, settings.audio.block_ms, paced=args.stream)  # bad files fail here, clearly
    engine = open_engine(args, settings)
    printer = _Printer(enabled=not args.json)
    service = make_service(engine, settings.audio, settings.batching).start()
    try:
        stream = service.open_stream(on_event=printer, vad=not args.no_vad)
        start = time.monotonic()
        if args.stream:
            for block in source.blocks():
                stream.feed(block)
            stream.close()
        else:
            feed_lockstep(stream, source.samples, service.chunk_samples)
        if not stream.wait(max(60.0, 10 * source.duration_s)):
            raise EdgeAgentError("recognition did not finish in time (the engine is stuck or overloaded)")
        wall_s = time.monotonic() - start
    finally:
        service.stop()
        engine.close()
    finals = [e for e in stream.finals]
    errors = [e.error for e in printer.events if e.kind == "error"]
    if errors and not finals:
        raise EdgeAgentError(f"recognition failed: {errors[0]}")
    timed = [(e, e.metrics) for e in finals if e.metrics is not None]  # every final carries its metrics
    metrics = [m for _, m in timed]
    compute_ms = sum(m.compute_ms for m in metrics)
    result = {
        "file": str(args.file),
        "model": engine.name,
        "kind": engine.kind,
        "text": " ".join(e.text for e in finals if e.text).strip(),
        "first_partial_ms": _r(metrics[0].first_partial_ms) if metrics else None,
        "final_ms": _r(metrics[-1].final_ms) if metrics else None,
        "rtf": _r(compute_ms / 1e3 / max(source.duration_s, 1e-9), 4),
        "audio_s": round(source.duration_s, 3),
        "wall_s": round(wall_s, 3),
        "paced": args.stream,
        "warnings": list(source.info.warnings),
        "utterances": [
            {
                "text": e.text,
                "end_s": round(e.audio_s, 2),
                "first_partial_ms": _r(m.first_partial_ms),
                "final_ms": _r(m.final_ms),
                "rtf": _r(m.rtf, 4),
                "audio_s": round(m.audio_s, 2),
                "reason": m.reason,
            }
            for e, m in timed
        ],
        "partials": [{"t_s": round(e.audio_s, 2), "text": e.text} for e in printer.events if e.kind == "partial"],
        "errors": errors,
    }
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        for w in source.info.warnings:
            print(f"warning: {w}", file=sys.stderr)
        print(result["text"])
        print(
            f"[{engine.name} · {engine.kind}] first partial {result['first_partial_ms']} ms · final "
            f"{result['final_ms']} ms · RTF {result['rtf']} · {len(finals)} utterance(s)",
            file=sys.stderr,
        )
    return 0


class _Printer:
    """Prints events as they come (from the engine thread); keeps them for the JSON report."""

    def __init__(self, enabled: bool, tag_streams: bool = False) -> None:
        self.enabled, self._lock = enabled, threading.Lock()
        self.events: list[Any] = []
        self.tag_streams = tag_streams

    def __call__(self, event) -> None:
        with self._lock:
            self.events.append(event)
            if not self.enabled:
                return
            tag = f"#{event.stream} " if self.tag_streams else ""
            if event.kind == "partial":
                print(f"[{tag}{event.audio_s:7.2f}s] … {event.text}", file=sys.stderr, flush=True)
            elif event.kind == "final":
                print(f"[{tag}{event.audio_s:7.2f}s] final: {event.text}", file=sys.stderr, flush=True)
            elif event.kind == "error":
                print(f"[utterance {event.utterance}] error: {event.error}", file=sys.stderr, flush=True)


# -- listen ---------------------------------------------------------------------------------------


def cmd_listen(args: argparse.Namespace) -> int:
    from ..config import load_settings
    from ..metrics.window import RollingWindow

    settings = load_settings(args.config)
    if args.tools and not args.respond:
        raise InputError("--tools needs --respond (the tools are what the LLM answers a command with)")
    tools = load_tools(args.tools) if args.tools else None  # a bad file is refused before any audio opens
    sources = _open_sources(args, settings)
    engine = open_engine(args, settings)
    responder = Responder(args, settings, tools) if args.respond else None
    finals: queue.SimpleQueue = queue.SimpleQueue()
    printer = _Printer(enabled=not args.json, tag_streams=len(sources) > 1)

    def on_event(event) -> None:
        printer(event)
        if event.kind == "final":
            finals.put(event)
        elif responder is not None:
            responder.turn(event.stream).on_event(event)  # partials prefilled ahead; a resumption cancels

    service, streams = _open_streams(args, settings, engine, len(sources), on_event, responder, tools)
    turns = RollingWindow(3600.0)
    records: list[dict] = []
    stop = threading.Event()
    by_id = {st.id: st for st in streams}
    worker = threading.Thread(target=_consume, args=(finals, responder, records, turns, stop, args, by_id), daemon=True)
    worker.start()
    feeders = [threading.Thread(target=_feed, args=(src, st, stop), daemon=True) for src, st in zip(sources, streams)]
    started = time.monotonic()
    for f in feeders:
        f.start()
    try:
        _listen_until_done(feeders, stop, started, args.duration)
    except KeyboardInterrupt:
        pass
    finally:
        stop.set()
        _close_listening(sources, feeders, streams, finals, worker, service, engine, responder)
    report = _listen_report(engine, service, turns, responder, records, sources)
    if args.json:
        json.dump(report, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    else:
        _print_listen_summary(report, args.respond)
    return 0


def _open_streams(args, settings, engine, n: int, on_event, responder, tools) -> tuple[Any, list]:
    """The started service and one stream per source. Several microphones are several streams on one
    engine: their steps batch together."""
    from ..serving.asr.factory import make_service

    early = not args.no_early_end
    service = make_service(engine, settings.audio, settings.batching, streams=n, early_end=early)
    service.start()
    pause_ms = responder.pause_ms if responder is not None else None
    check = command_check(tools) if responder is not None else None  # a whole command ends the turn early
    streams = [
        service.open_stream(on_event=on_event, pause_ms=pause_ms, early_end=early, complete=check) for _ in range(n)
    ]
    return service, streams


def _listen_until_done(
    feeders: list[threading.Thread], stop: threading.Event, started: float, duration: float | None
) -> None:
    """Return when every source has ended, the consumer asked to stop, or ``duration`` passed since ``started``."""
    while any(f.is_alive() for f in feeders) and not stop.is_set():
        if duration and time.monotonic() - started >= duration:
            break
        time.sleep(0.05)


def _close_listening(sources, feeders, streams, finals, worker, service, engine, responder) -> None:
    """Sources first, then each stream drained, the finals consumer, the service and engine, the responder."""
    for src in sources:
        src.close()
    for f in feeders:
        f.join(10.0)
    for st in streams:
        st.close()
        st.wait(60.0)
    finals.put(None)
    worker.join(300.0)
    service.stop()
    engine.close()
    if responder:
        responder.close()


def _listen_report(engine, service, turns, responder, records: list[dict], sources) -> dict[str, Any]:
    """The JSON report: the utterances, the service's and the turns' latency summary, each source."""
    snap = turns.snapshot()
    summary: dict[str, Any] = {**service.summary(), **{k: snap[k].as_dict() for k in TURN_METRICS}}
    if responder:
        summary["false_cuts"] = sum(vt.false_cuts for vt in responder._turns.values())
        summary["cancelled_replies"] = sum(vt.cancelled for vt in responder._turns.values())
    report = {
        "model": engine.name,
        "utterances": records,
        "summary": summary,
        "sources": [_source_report(src) for src in sources],
    }
    report["source"] = report["sources"][0]
    return report


def _print_listen_summary(report: dict[str, Any], respond: bool) -> None:
    """One line of latencies, and a line per microphone that overflowed, dropped or reconnected."""
    s = report["summary"]
    print(
        f"{len(report['utterances'])} utterance(s) · first partial p50 {_r(s['first_partial_ms']['p50'])} ms · "
        f"final p50 {_r(s['final_ms']['p50'])} ms · RTF p50 {_r(s['rtf']['p50'], 4)}"
        + (f" · turn p50 {_r(s['turn_ms']['p50'])} ms" if respond else ""),
        file=sys.stderr,
    )
    for src in report["sources"]:
        if "overflows" in src:
            print(
                f"{src['device']}: {src['overflows']} input overflow(s), {src['dropped_blocks']} dropped "
                f"block(s), {src['reconnects']} reconnect(s)",
                file=sys.stderr,
            )


def _feed(source, stream, stop: threading.Event) -> None:
    try:
        for block in source.blocks():
            if stop.is_set():
                return
            stream.feed(block)
    except Exception as exc:  # a failing source ends its own stream, not the others
        log.error("audio source %s failed: %s", type(source).__name__, exc)


def _source_report(source) -> dict:
    out: dict[str, Any] = {"kind": type(source).__name__}
    stats = getattr(source, "stats", None)
    if stats is not None:
        out.update(
            overflows=stats.overflows,
            dropped_blocks=stats.dropped_blocks,
            reconnects=stats.reconnects,
            device=stats.device_name,
            device_rate=stats.device_rate,
        )
    return out


def _open_sources(args, settings) -> list:
    from ..audio.sources import FileSource, StdinSource

    if args.file:
        return [FileSource(args.file, settings.audio.block_ms, paced=True)]
    if args.stdin:
        return [
            StdinSource(
                fmt=args.pcm_format, rate=args.pcm_rate, channels=args.pcm_channels, block_ms=settings.audio.block_ms
            )
        ]
    from ..audio.mic import MicSource

    sources = []
    try:
        for name in args.mic:
            device = name if name else settings.audio.device
            # audio.sample_rate is the rate asked of the device; recognition always gets 16 kHz.
            sources.append(MicSource(device, settings.audio.block_ms, capture_rate=settings.audio.sample_rate))
    except Exception:
        for src in sources:
            src.close()
        raise
    return sources


TURN_METRICS = ("turn_ms", "turn_first_token_ms", "turn_complete_ms", "endpoint_ms")


def _consume(finals, responder, records, turns, stop, args, streams) -> None:
    while True:
        event = finals.get()
        if event is None:
            return
        if args.max_utterances and _answered(records) >= args.max_utterances:
            continue  # finals of utterances cut short by the stop: not part of the report
        m = event.metrics
        record = {
            "stream": event.stream,
            "utterance": event.utterance,
            "text": event.text,
            "first_partial_ms": _r(m.first_partial_ms),
            "final_ms": _r(m.final_ms),
            "rtf": _r(m.rtf, 4),
            "audio_s": round(m.audio_s, 2),
            "reason": m.reason,
        }
        if responder and event.text.strip():
            stream = streams.get(event.stream)
            ends = stream.endpoint(event.utterance) if stream is not None else None
            r = responder.respond(event, ends[0] if ends else None, quiet=args.json)
            if not r.delivered:  # the early reply of an utterance that went on, a repeat, or a refused request
                record.update(cancelled=r.error is None and not r.repeated, early_end=r.early_end)
                if r.repeated:
                    record["repeated_call"] = r.call
                if r.error is not None:
                    record["error"] = r.error
                records.append(record)  # no call, no turn
                continue
            # turn_ms: to the first token, or with tools to the complete call (as before)
            turn_ms = r.turn_complete_ms if responder.tools else r.turn_first_token_ms
            record.update(response=r.reply, turn_ms=_r(turn_ms))
            record.update(
                {
                    k: (_r(v) if isinstance(v, float) else v)
                    for k, v in r.as_dict().items()
                    if k not in ("text", "reply", "call", "stream", "utterance", "delivered")
                }
            )
            if responder.tools is not None:
                record["tool_call"] = r.call
            values = {"turn_ms": turn_ms, "turn_first_token_ms": r.turn_first_token_ms}
            values.update(turn_complete_ms=r.turn_complete_ms, endpoint_ms=r.endpoint_ms)
            for name, value in values.items():
                if value is not None:
                    turns.record(name, value)
        records.append(record)
        if args.max_utterances and _answered(records) >= args.max_utterances:
            stop.set()


def _answered(records: list[dict]) -> int:
    return sum(1 for r in records if not r.get("cancelled"))
