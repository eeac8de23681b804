"""``edge-agent bench overload``: the daemon on its default tiers under open-loop overload, and llama.cpp's
server on the same GGUF beside it.

1. A daemon: ``edge-agent run`` as a child process on the embedded default's tiers (``full`` and ``short`` on
   ``gemma-3-270m-home``; the ASR tier for the spoken commands), the API on a free port, telemetry into a
   private mosquitto, state under a temporary folder, no engine built meanwhile (``[engines]
   build_on_start = false``: whatever is already built is served). Its capacity is measured first as the
   demo does (chats completed per second with four always in flight, under an SLA no queue breaks), with
   the spoken commands running meanwhile as they do in the levels (the capacity of the mix offered, not of
   chats alone), then a SIGHUP puts the default SLA (387 ms TTFT P95) in force. ``--capacity`` skips the
   probe.
2. Per round and load level (0.5x, 1x, 1.5x, 2x, 3x that capacity): seeded Poisson arrivals for
   ``--seconds``, whatever is in flight (open loop). Each chat is streamed; a level waits for every
   request it sent (at most ``--drain-s``, after which the rest are cancelled and counted as such) and for
   the server to be idle before the next. Spoken commands (the demo's, in natural voices by
   ``engines.voices``) are streamed in real time through the speech WebSocket with ``respond=true``
   meanwhile, one after another.
3. The same arrival times against llama.cpp's server (``llama-server --parallel 4``: four slots, its queue
   unbounded) on the GGUF the home model was imported from (the base model's: the adapter is merged only
   into the import). Chats only: it has no voice route.

Every request is accounted: sent = completed + refused (HTTP 429/503, timed to the answer, ``Retry-After``
noted) + cancelled + failed (any other status, an error inside a 200 stream, a broken connection).
Goodput: completed chats whose client-side TTFT (request sent → first content chunk, or the end of an empty
reply) was within the SLA, per second of the level. Percentiles are nearest-rank per round; the report
gives each figure's median over the rounds with its min–max.
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from pathlib import Path

import numpy as np

from ..demo_models.home_commands import CHAT_PROMPTS
from ..errors import EdgeAgentError, InputError
from ..metrics.window import percentile
from ..progress import Progress
from .options import OverloadOptions
from .overload_report import EDGE, LLAMA, check_targets, format_report, plot

LEVELS = (0.5, 1.0, 1.5, 2.0, 3.0)  # offered load, as multiples of the measured capacity
PROBE_TARGET_MS = 600_000.0  # the SLA while the capacity probe queues requests on purpose: no switch on them
PROBE_REQUESTS = 12  # completions the capacity is measured over, after the cold ones
PROBE_CONCURRENCY = 4  # the top tier's max_batch, and llama.cpp's slots
MAX_TOKENS = 48


# -- the pure parts: schedule, accounting, figures --------------------------------------------------


def poisson_schedule(rate: float, seconds: float, seed: int) -> list[float]:
    """Arrival times in [0, seconds) of a Poisson process of ``rate``/s (exponential gaps), seeded."""
    if rate <= 0 or seconds <= 0:
        raise InputError(f"a Poisson schedule needs rate > 0 and seconds > 0, got {rate} and {seconds}")
    rng = np.random.default_rng(seed)
    out: list[float] = []
    t = float(rng.exponential(1.0 / rate))
    while t < seconds:
        out.append(t)
        t += float(rng.exponential(1.0 / rate))
    return out


def level_seed(seed: int, round_: int, level: int) -> int:
    """One schedule per (round, level), the same for every system."""
    return seed + 1000 * round_ + level


@dataclass
class Outcome:
    """One chat as the client saw it. ``kind``: completed, refused, cancelled or failed."""

    t_s: float  # scheduled arrival, from the level's start
    kind: str
    ttft_ms: float | None = None  # completed: to the first content chunk (or the end of an empty reply)
    e2e_ms: float | None = None
    answered_ms: float | None = None  # refused: to the refusal
    status: int | None = None
    code: str = ""  # the error body's code (refused) or what failed
    retry_after: str | None = None
    model: str = ""  # the tier (or model) that served it
    message: str = ""  # refused or failed: the error body's message (the reason)
    tokens_out: int | None = None


@dataclass
class VoiceTurn:
    """One spoken command: its reply's ``complete_ms`` (the agent's end of speech → complete reply) or why not,
    and where that time went: ``final_ms`` (end of speech → the final transcript), ``endpoint_ms`` (→ the
    end-of-turn decision), ``first_token_ms`` (→ the reply's first token), ``reply_ahead`` (the reply was the
    one started on a pause)."""

    t_s: float
    said: str
    complete_ms: float | None = None
    final_ms: float | None = None
    endpoint_ms: float | None = None
    first_token_ms: float | None = None
    reply_ahead: bool = False
    refused: bool = False
    right: bool = False
    error: str = ""


KINDS = ("completed", "refused", "cancelled", "failed")


def account(outcomes: Sequence[Outcome]) -> dict[str, int]:
    """sent and each kind's count; ``accounted`` is 1 when sent equals their sum and every kind is known."""
    counts = {k: sum(1 for o in outcomes if o.kind == k) for k in KINDS}
    return {"sent": len(outcomes), **counts, "accounted": int(sum(counts.values()) == len(outcomes))}


def goodput(outcomes: Sequence[Outcome], seconds: float, sla_ms: float) -> float:
    """Completed chats with client-side TTFT <= ``sla_ms``, per second of the level."""
    good = sum(1 for o in outcomes if o.kind == "completed" and o.ttft_ms is not None and o.ttft_ms <= sla_ms)
    return good / seconds


def level_figures(outcomes: Sequence[Outcome], seconds: float, sla_ms: float, voice: Sequence[VoiceTurn] = ()) -> dict:
    """One level's figures: accounting, goodput, admitted TTFT, refusals and their latency, voice turns."""
    acc = account(outcomes)
    ttft = [o.ttft_ms for o in outcomes if o.kind == "completed" and o.ttft_ms is not None]
    answered = [o.answered_ms for o in outcomes if o.kind == "refused" and o.answered_ms is not None]
    turns = [v.complete_ms for v in voice if v.complete_ms is not None]
    served: dict[str, int] = {}
    for o in outcomes:
        if o.kind == "completed":
            served[o.model or "?"] = served.get(o.model or "?", 0) + 1
    reasons: dict[str, int] = {}
    for o in outcomes:
        if o.kind in ("refused", "failed"):
            key = f"{o.kind} {o.status or ''} {o.code}".replace("  ", " ").strip()
            reasons[key] = reasons.get(key, 0) + 1
    tokens = [o.tokens_out for o in outcomes if o.kind == "completed" and o.tokens_out is not None]
    return {
        **acc,
        "goodput_per_s": goodput(outcomes, seconds, sla_ms),
        "completed_per_s": acc["completed"] / seconds,
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p95_ms": percentile(ttft, 95),
        "ttft_p99_ms": percentile(ttft, 99),
        "refused_share": acc["refused"] / acc["sent"] if acc["sent"] else None,  # nothing sent: no share
        "refusal_p50_ms": percentile(answered, 50),
        "refusal_p95_ms": percentile(answered, 95),
        "refused_without_retry_after": sum(1 for o in outcomes if o.kind == "refused" and not o.retry_after),
        "tokens_out_mean": float(np.mean(tokens)) if tokens else None,
        "voice_turns": len(voice),
        "voice_p50_ms": percentile(turns, 50),
        "voice_p95_ms": percentile(turns, 95),
        "voice_final_p95_ms": percentile([v.final_ms for v in voice if v.final_ms is not None], 95),
        "voice_first_token_p95_ms": percentile([v.first_token_ms for v in voice if v.first_token_ms is not None], 95),
        "voice_replies_ahead": sum(1 for v in voice if v.reply_ahead),
        "voice_refused": sum(1 for v in voice if v.refused),
        "voice_right": sum(1 for v in voice if v.right),
        "served_by": served,
        "not_completed": reasons,
    }


def switches(log_text: str, start_wall: float, end_wall: float) -> list[dict]:
    """The daemon's LLM tier switches logged between ``start_wall`` and ``end_wall`` (epoch seconds), each as
    ``{"t_s"`` (from ``start_wall``), ``"from"``, ``"to"``, ``"action"}``, from its ``event tier_switch``
    lines (the log's local-time stamps)."""
    out = []
    for line in log_text.splitlines():
        if "event tier_switch: " not in line:
            continue
        try:
            stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            event = ast.literal_eval(line.split("event tier_switch: ", 1)[1])
        except (ValueError, SyntaxError):
            continue
        if start_wall <= stamp <= end_wall and event.get("workload") == "llm":
            out.append({"t_s": round(stamp - start_wall, 3), "from": event.get("from"), "to": event.get("to"),
                        "action": event.get("action")})  # fmt: skip
    return out


def switch_delay_s(outcomes: Sequence[Outcome], level_switches: Sequence[dict]) -> float | None:
    """Seconds from the level's first refusal (an arrival predicted over budget: the default tiers share no
    weights, so none is admitted on a lighter tier's settings instead) to the first switch down after it;
    None without both."""
    refused = [o.t_s for o in outcomes if o.kind == "refused"]
    if not refused:
        return None
    downs = [sw["t_s"] for sw in level_switches if sw["action"] == "downgrade" and sw["t_s"] >= min(refused)]
    return round(downs[0] - min(refused), 3) if downs else None


def spread(values: Sequence[float | None]) -> dict | None:
    """Median, min and max of the rounds' values that exist (None when none does)."""
    have = [float(v) for v in values if v is not None]
    if not have:
        return None
    return {"median": float(np.median(have)), "min": min(have), "max": max(have), "n": len(have)}


SUMMED = ("sent", "completed", "refused", "cancelled", "failed", "voice_turns", "voice_refused", "voice_right")


def combine(rounds: Sequence[Sequence[dict]]) -> list[dict]:
    """Per level over the rounds: each figure's spread; counts also as totals (``total_<name>``)."""
    out = []
    for per_level in zip(*rounds, strict=True):
        row: dict = {"load": per_level[0]["load"], "offered_per_s": per_level[0]["offered_per_s"]}
        numeric = {
            key
            for r in per_level
            for key, value in r.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)
        }  # a figure a round did not measure (no refusals: no refusal latency) is None there
        for key in sorted(numeric - {"load", "offered_per_s"}):
            row[key] = spread([r.get(key) for r in per_level])
        for key in SUMMED:
            row[f"total_{key}"] = sum(int(r.get(key) or 0) for r in per_level)
        row["accounted"] = all(r["accounted"] for r in per_level)
        out.append(row)
    return out


# -- the client ---------------------------------------------------------------------------------------


def chat_body(index: int, max_tokens: int = MAX_TOKENS) -> dict:
    return {
        "model": "edge-agent",
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "messages": [{"role": "user", "content": CHAT_PROMPTS[index % len(CHAT_PROMPTS)]}],
    }


async def send_chat(session, url: str, body: dict, t_s: float) -> Outcome:
    """One streamed chat; a refusal (429/503) is timed to its answer with its code and ``Retry-After``."""
    import aiohttp

    start = time.perf_counter()
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                answered = (time.perf_counter() - start) * 1e3
                text = await resp.text()
                try:
                    error = json.loads(text)["error"]
                    code, message = str(error.get("code") or "?"), str(error.get("message") or "")
                except (ValueError, KeyError, TypeError, AttributeError):
                    code, message = text[:60], ""
                kind = "refused" if resp.status in (429, 503) else "failed"
                retry = resp.headers.get("Retry-After")
                return Outcome(t_s, kind, answered_ms=answered, status=resp.status, code=code, retry_after=retry,
                               message=message[:200])  # fmt: skip
            ttft, model, tokens = None, "", None
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:  # an error inside a stream already answered 200: a failure
                    return Outcome(t_s, "failed", status=200, code=str(chunk["error"].get("code") or "in_stream"))
                model = chunk.get("model") or model
                if chunk.get("usage"):
                    tokens = chunk["usage"].get("completion_tokens")
                for choice in chunk.get("choices") or ():
                    if ttft is None and ((choice.get("delta") or {}).get("content") or choice.get("finish_reason")):
                        ttft = (time.perf_counter() - start) * 1e3
            else:
                return Outcome(t_s, "failed", status=200, code="truncated_stream")
            e2e = (time.perf_counter() - start) * 1e3
            return Outcome(t_s, "completed", ttft_ms=ttft if ttft is not None else e2e, e2e_ms=e2e, status=200,
                           model=model, tokens_out=tokens)  # fmt: skip
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        return Outcome(t_s, "failed", code=type(exc).__name__)


async def speak(session, url: str, pcm: bytes, settings: str, said: str, expected, t_s: float) -> VoiceTurn:
    """Stream one command's PCM in real time (100 ms blocks) and read its ``reply`` (or ``error``) event."""
    from ..demo_models.home_commands import judge

    ws_url = url.replace("http://", "ws://") + "/v1/audio/stream?respond=true"
    finals: dict[int, dict] = {}
    answers: dict[int, dict] = {}
    try:
        async with session.ws_connect(ws_url) as ws:
            await ws.send_str(settings)
            for i in range(0, len(pcm), 3200):
                await ws.send_bytes(pcm[i : i + 3200])
                await asyncio.sleep(0.1)
            await ws.send_str("end")
            async for msg in ws:  # closed by the server once every final and reply is out
                event = json.loads(msg.data)
                if event.get("kind") == "final":
                    finals[event["utterance"]] = event
                elif event.get("kind") in ("reply", "error") and "utterance" in event:
                    answers[event["utterance"]] = event
    except Exception as exc:  # one failed turn is a figure, not the end of the bench
        return VoiceTurn(t_s, said, error=f"{type(exc).__name__}: {exc}"[:120])
    spoken = [u for u, f in sorted(finals.items()) if f.get("text")]
    if not spoken:
        return VoiceTurn(t_s, said, error="nothing heard")
    reply = answers.get(spoken[-1])
    if reply is None:
        return VoiceTurn(t_s, said, error="no reply")
    if reply.get("kind") == "error":
        return VoiceTurn(t_s, said, refused=True, error=str(reply.get("message"))[:120])
    call = None
    for tc in (reply.get("tool_calls") or [])[:1]:
        try:
            call = {"name": tc["function"]["name"], "arguments": json.loads(tc["function"]["arguments"])}
        except (ValueError, KeyError, TypeError):
            call = None
    cut = call is not None and reply.get("finish_reason") != "tool_calls"  # a call cut short is never run
    right = not cut and judge(expected, call)
    return VoiceTurn(
        t_s,
        said,
        complete_ms=reply.get("complete_ms"),
        right=bool(right),
        final_ms=finals[spoken[-1]].get("final_ms"),
        endpoint_ms=reply.get("endpoint_ms"),
        first_token_ms=reply.get("first_token_ms"),
        reply_ahead=bool(reply.get("reply_ahead")),
    )


@dataclass
class Speech:
    """The spoken commands: PCM16 at 16 kHz, what was said and the call each must become; the voices."""

    clips: list[tuple[bytes, str, dict | None]] = field(default_factory=list)
    settings: str = ""
    voices: list[str] = field(default_factory=list)


def load_speech(workdir: Path) -> Speech:
    """The demo's commands, each in two of the natural voices (``engines.voices``: Piper, flite), with
    0.2 s of silence before and 0.6 s after; espeak-ng (``audio.spoken``) where those are not installed;
    none without either."""
    from ..demo_models.home_commands import DEMO
    from ..engines import voices as tts
    from .voice import HOME_TOOLS

    tools = json.loads(HOME_TOOLS.read_text())["tools"]
    settings = json.dumps({"tools": tools, "tool_choice": "auto", "max_tokens": 64})
    expected = {c.text: c.call for c in DEMO}
    natural = [v for v in tts.NATURAL if not tts.missing([v])]
    if natural:
        items = [(c.text, natural[(i + k * len(DEMO)) % len(natural)]) for k in range(2) for i, c in enumerate(DEMO)]
        spoken = tts.synthesize(items)
        clips = []
        for (text, _voice), samples in zip(items, spoken, strict=True):
            padded = tts.pad(samples, 0.2, 0.6)
            clips.append(((np.clip(padded, -1, 1) * 32767).astype("<i2").tobytes(), text, expected.get(text)))
        return Speech(clips, settings, sorted({v.label for _, v in items}))
    from ..audio.spoken import synthesize
    from ..audio.wav import read_audio

    out = []
    for path, said in synthesize(workdir, [(c.text, c.voice) for c in DEMO]):
        samples, _info = read_audio(path, 16000)
        out.append(((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes(), said, expected.get(said)))
    return Speech(out, settings, sorted({f"espeak-ng {c.voice}" for c in DEMO}) if out else [])


async def speak_meanwhile(
    session, url: str, speech: Speech | None, t0: float, until: Callable[[], float], turns: list[VoiceTurn]
) -> None:
    """The spoken commands one after another (a second apart) until ``until()`` (a perf_counter time), each
    turn appended to ``turns``: the voice mix a level and the capacity probe both run."""
    k = 0
    while speech and speech.clips and time.perf_counter() < until():
        pcm, said, expected = speech.clips[k % len(speech.clips)]
        k += 1
        turns.append(await speak(session, url, pcm, speech.settings, said, expected, time.perf_counter() - t0))
        await asyncio.sleep(1.0)


async def drive_level(
    url: str,
    schedule: Sequence[float],
    seconds: float,
    drain_s: float,
    speech: Speech | None,
    tick: Callable[[float, list[Outcome]], None] = lambda t, o: None,
) -> tuple[list[Outcome], list[VoiceTurn]]:
    """Send a chat at each scheduled time (open loop) and spoken commands one after another meanwhile; wait
    for every chat (at most ``drain_s`` after the level), cancelling the rest."""
    import aiohttp

    outcomes: list[Outcome] = []
    turns: list[VoiceTurn] = []
    tasks: dict[asyncio.Task, float] = {}
    timeout = aiohttp.ClientTimeout(total=None)
    connector = aiohttp.TCPConnector(limit=0, force_close=True)  # a connection per request (see capacity)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.perf_counter()

        async def ticker() -> None:
            while True:
                tick(time.perf_counter() - t0, outcomes)
                await asyncio.sleep(1.0)

        voice_task = asyncio.create_task(speak_meanwhile(session, url, speech, t0, lambda: t0 + seconds - 3, turns))
        tick_task = asyncio.create_task(ticker())
        for i, t in enumerate(schedule):
            await asyncio.sleep(max(0.0, t0 + t - time.perf_counter()))
            task = asyncio.create_task(send_chat(session, url, chat_body(i), t))
            task.add_done_callback(lambda done: outcomes.append(done.result()) if not done.cancelled() else None)
            tasks[task] = t
        await asyncio.sleep(max(0.0, t0 + seconds - time.perf_counter()))
        pending: set[asyncio.Task] = set()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=drain_s)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
        outcomes.extend(Outcome(tasks[task], "cancelled") for task in pending)
        await voice_task
        tick_task.cancel()
    outcomes.sort(key=lambda o: o.t_s)
    return outcomes, turns


async def capacity(
    url: str, concurrency: int = PROBE_CONCURRENCY, max_s: float = 60.0, speech: Speech | None = None
) -> float:
    """Chats completed per second with ``concurrency`` always in flight (closed loop), as the demo measures it:
    the first ``concurrency`` completions (cold) left out, the rate taken between completions from then on,
    over ``PROBE_REQUESTS`` more or ``max_s`` in all. With ``speech``, its spoken commands run meanwhile as
    in the levels: the capacity is then that of the mix the levels offer (Whisper's passes and the voice
    replies take the same cores from the chats), not of chats alone."""
    import aiohttp

    from .serve_client import Load, Target

    stamps: list[float] = []
    target = Target(url, timeout_s=max_s + 60)
    # a connection per request: llama-server closes idle keep-alive connections after 5 s, and a pooled one
    # it has closed fails the next request (ClientOSError)
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=max_s + 60)) as session:
        load = Load(
            session,
            target,
            chat_body,
            concurrency + PROBE_REQUESTS,
            max_s,
            on_done=lambda n: stamps.append(time.perf_counter()),
        )
        done = False
        t0 = time.perf_counter()
        voice = asyncio.create_task(speak_meanwhile(session, url, speech, t0, lambda: -1.0 if done else t0 + max_s, []))
        try:
            await load.closed(concurrency, ramp_s=1.0)
        finally:
            done = True
            await voice
    bad = [r.status for r in load.results if not r.ok]
    if bad:
        raise EdgeAgentError(f"the capacity probe at {url} got {len(bad)} failed chats (statuses {sorted(set(bad))})")
    measured = stamps[concurrency - 1 :]
    if len(measured) < 3:
        raise EdgeAgentError(f"the capacity probe at {url} completed only {len(stamps)} chats in {max_s:g} s")
    return (len(measured) - 1) / (measured[-1] - measured[0])


async def wait_idle(url: str, kind: str, limit_s: float = 120.0) -> float:
    """Wait until the server runs and queues nothing (the daemon's /health; llama-server's /slots), at most
    ``limit_s``; the seconds waited."""
    import aiohttp

    start = time.monotonic()
    async with aiohttp.ClientSession() as session:
        while time.monotonic() - start < limit_s:
            try:
                if kind == EDGE:
                    async with session.get(url + "/health") as r:
                        llm = (await r.json()).get("llm", {})
                    if not llm.get("waiting") and not llm.get("running"):
                        break
                else:
                    async with session.get(url + "/slots") as r:
                        if r.status != 200:
                            break
                        slots = await r.json()
                    if not any(s.get("is_processing") for s in slots):
                        break
            except (aiohttp.ClientError, ValueError):
                break
            await asyncio.sleep(0.5)
    return time.monotonic() - start


# -- the servers ----------------------------------------------------------------------------------------


def _listening(port: int) -> bool:
    import socket

    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _wait_port(proc: subprocess.Popen, port: int, log: Path, what: str, limit_s: float = 300.0) -> None:
    deadline = time.monotonic() + limit_s
    while not _listening(port):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise EdgeAgentError(f"{what} did not start; its log {log}:\n" + log.read_text()[-1500:])
        time.sleep(0.2)


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def daemon_config(workdir: Path, mqtt_port: int, api_port: int, target_ms: float | None) -> Path:
    """The default config (the embedded tiers, the default SLA) with what a bench must set: the API port, the
    private broker, state under ``workdir``, no engine build in the middle of the load; ``target_ms``: the
    capacity probe's SLA."""
    cfg = workdir / "agent.toml"
    sla = "" if target_ms is None else f"[sla]\ntarget_ms = {target_ms:g}\n"
    cfg.write_text(
        "# generated by edge-agent bench overload: the default config but for these lines\n"
        f'[mqtt]\nhost = "127.0.0.1"\nport = {mqtt_port}\ndevice_id = "bench-overload"\n'
        f'[telemetry]\nspool_path = "{workdir / "spool.sqlite"}"\nledger_path = "{workdir / "ledger.sqlite"}"\n'
        f'[api]\nhost = "127.0.0.1"\nport = {api_port}\n'
        "[engines]\nbuild_on_start = false\n" + sla
    )
    return cfg


class Daemon:
    """``edge-agent run`` on the default tiers with a private mosquitto; ``reload_default_sla`` after the probe."""

    def __init__(self, workdir: Path, say: Callable[[str], None]) -> None:
        from .netproxy import free_port
        from .telemetry import _Mosquitto

        self.workdir, self.say = workdir, say
        self.broker = _Mosquitto(None, workdir)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / "daemon.log"
        self.cfg = daemon_config(workdir, self.broker.port, self.port, PROBE_TARGET_MS)
        with open(self.log, "w") as out:
            self.proc: subprocess.Popen | None = subprocess.Popen(
                [sys.executable, "-m", "edge_agent", "run", "--config", str(self.cfg)], stdout=out, stderr=out
            )
        try:
            _wait_port(self.proc, self.port, self.log, "the daemon")
        except BaseException:
            self.stop()
            raise

    def serving(self) -> list[str]:
        """What the daemon said it serves: its ``serving:`` line and each tier's engine (or model folder)."""
        keep = ("edge_agent.daemon.app: serving:", "edge_agent.engines.resolve:")
        lines = self.log.read_text(errors="replace").splitlines()
        return [line.split(": ", 1)[1] if ": " in line else line for line in lines if any(k in line for k in keep)]

    def reload_default_sla(self) -> None:
        """SIGHUP onto the default SLA; waits (10 s at most) until the daemon says it applied it."""
        assert self.proc is not None
        daemon_config(self.workdir, self.broker.port, self.port, None)
        seen = self.log.read_text().count("reloaded: applied sla")
        self.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while self.log.read_text().count("reloaded: applied sla") == seen:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise EdgeAgentError(f"the daemon did not apply the default SLA; its log: {self.log}")
            time.sleep(0.1)

    def stop(self) -> None:
        _stop(self.proc)
        self.proc = None
        self.broker.stop()


class LlamaServer:
    """llama.cpp's ``llama-server`` with ``slots`` slots on ``gguf``, ``threads`` threads; or, with ``python``
    (an interpreter with ``llama-cpp-python[server]``), ``python -m llama_cpp.server``: one request at a time
    (it has no slots), queued requests never interrupting the one that runs."""

    def __init__(
        self, binary: str | None, gguf: Path, slots: int, threads: int, workdir: Path, python: str = ""
    ) -> None:
        from .netproxy import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / "llama-server.log"
        if binary:
            cmd = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port), "--parallel", str(slots),
                   "-c", str(1024 * slots), "--threads", str(threads), "--threads-batch", str(threads)]  # fmt: skip
            if "--kv-unified" in subprocess.run([binary, "--help"], capture_output=True, text=True).stdout:
                cmd.append("--kv-unified")  # one KV buffer for all slots (a split one is slow in multi-sequence decode)
            self.slots = slots
        else:
            cmd = [python, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1", "--port",
                   str(self.port), "--n_ctx", "1024", "--n_threads", str(threads), "--n_threads_batch", str(threads),
                   "--interrupt_requests", "False"]  # fmt: skip
            self.slots = 1
        self.cmd = cmd
        with open(self.log, "w") as out:
            self.proc: subprocess.Popen | None = subprocess.Popen(cmd, stdout=out, stderr=out)
        try:
            _wait_port(self.proc, self.port, self.log, "llama-server")
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        import urllib.error
        import urllib.request

        deadline = time.monotonic() + 120
        route = "/health" if self.slots > 1 or "llama_cpp.server" not in self.cmd else "/v1/models"
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + route, timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.3)
        raise EdgeAgentError(f"llama-server loaded no model within 120 s; its log {self.log}")

    def stop(self) -> None:
        _stop(self.proc)
        self.proc = None


def default_gguf() -> tuple[Path | None, str]:
    """The GGUF the default LLM model was imported from, and a note saying which it is."""
    from ..config import load_settings
    from ..config.tiers import DEFAULT_LLM_MODEL
    from ..importers.fetch import sources_dir
    from ..importers.result import imported_dir

    cache = load_settings(None).models.cache_dir
    meta_path = imported_dir(cache) / DEFAULT_LLM_MODEL / "import.json"
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        return None, f"{meta_path} unreadable: fetch the model (`edge-agent models fetch {DEFAULT_LLM_MODEL}`)"
    base = meta.get("base") or meta
    source = base.get("source") or {}
    if source.get("format") != "gguf":
        return None, f"{DEFAULT_LLM_MODEL} was not imported from a GGUF: pass --gguf"
    gguf = sources_dir(cache) / base.get("name", DEFAULT_LLM_MODEL) / source["file"]
    adapter = " (the adapter is merged only into the import: llama.cpp serves the base weights)"
    return gguf, f"{gguf.name}, {base.get('name')}'s GGUF{adapter if meta.get('adapter') else ''}"


# -- the command -------------------------------------------------------------------------------------


def _validate(opts: OverloadOptions) -> None:
    if opts.seconds < 5:
        raise InputError(f"--seconds must be at least 5, got {opts.seconds:g}")
    if opts.out.exists() and not opts.out.is_dir():
        raise InputError(f"--out {opts.out}: exists and is not a folder")
    if opts.resume is not None and not opts.resume.is_file():
        raise InputError(f"--resume {opts.resume}: no such file")
    if opts.gguf is not None and not opts.gguf.is_file():
        raise InputError(f"--gguf {opts.gguf}: no such file")


def machine() -> dict:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": model, "cores": os.cpu_count(), "load_avg_at_start": [round(v, 2) for v in os.getloadavg()],
            "python": platform.python_version()}  # fmt: skip


def _resume(opts: OverloadOptions, report: dict, say: Callable[[str], None]) -> tuple[OverloadOptions, dict]:
    """A previous report whose systems are kept: its capacity, seconds, rounds and seed are taken (the options
    returned carry them), so the systems run now get the same arrival times."""
    assert opts.resume is not None
    try:
        old = json.loads(opts.resume.read_text())
        report.update({k: old[k] for k in ("capacity_per_s", "capacity_measured_per_s", "capacity_source")})
        # fewer (or more) rounds may be asked for the systems run now: the same schedules
        opts = replace(opts, seconds=old["seconds"], seed=old["seed"], sla_ms=old["sla_ms"],
                       rounds=opts.rounds if opts.rounds is not None else old["rounds"])  # fmt: skip
        report["rounds_kept"] = old["rounds"]
        systems = old["systems"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"--resume {opts.resume}: not a bench overload report ({exc})") from exc
    report.update(seconds=opts.seconds, rounds=opts.rounds, seed=opts.seed, sla_ms=opts.sla_ms)
    report["machine_before"] = old.get("machine")
    say(f"keeping {', '.join(systems)} from {opts.resume}: {opts.rounds} round(s) of {opts.seconds:g} s, seed "
        f"{opts.seed}, capacity {report['capacity_per_s']:.2f}/s")  # fmt: skip
    return opts, old


def _write(out: Path, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "overload.json").write_text(json.dumps(report, indent=1) + "\n")


def run(opts: OverloadOptions) -> int:
    """The bench (see the module doc): the daemon's rounds, then llama.cpp's on the same schedules, then the
    report, its targets and its plot under ``opts.out``."""
    _validate(opts)
    bench = _Overload(opts)
    try:
        if EDGE not in bench.kept:
            bench.daemon_rounds()
        bench.llamacpp_rounds()
    except KeyboardInterrupt:
        bench.say("interrupted: reporting the rounds that finished")
    finally:
        if bench.daemon is not None:
            bench.daemon.stop()
    bench.finish()
    return 0


class _Overload:
    """One run's state: its options (as resumed), the report being built, the rounds measured, progress."""

    def __init__(self, opts: OverloadOptions) -> None:
        if opts.rounds is None and opts.resume is None:
            opts = replace(opts, rounds=3)
        self.say = (lambda text: None) if opts.quiet else (lambda text: print(f"overload: {text}", flush=True))
        self.workdir = Path(tempfile.mkdtemp(prefix="edge-agent-overload-"))
        self.report: dict = {
            "command": "edge-agent bench overload " + " ".join(sys.argv[3:]) if sys.argv[1:3] == ["bench", "overload"]
            else " ".join(sys.argv),
            "machine": machine(), "seconds": opts.seconds, "rounds": opts.rounds, "seed": opts.seed,
            "sla_ms": opts.sla_ms, "levels": list(LEVELS), "systems": {},
        }  # fmt: skip
        resumed = None
        if opts.resume is not None:
            opts, resumed = _resume(opts, self.report, self.say)
        self.opts = opts
        self.rounds_n: int = opts.rounds or 3
        self.kept: dict = resumed["systems"] if resumed else {}
        self.gguf, self.gguf_note = (opts.gguf, str(opts.gguf)) if opts.gguf else default_gguf()
        self.llama_bin, self.llama_py = self._llamacpp()
        self.speech = None if opts.no_speech or EDGE in self.kept else load_speech(self.workdir)  # no voice: llama
        if self.speech is not None and not self.speech.clips:
            self.say("no speech synthesiser installed (Piper or flite; espeak-ng and sox): no spoken commands")
        if self.speech is not None and self.speech.clips:
            self.report["voices"] = self.speech.voices
            self.say(f"{len(self.speech.clips)} spoken commands in {', '.join(self.speech.voices)}")
        systems = (0 if EDGE in self.kept else 1) + (1 if self.llama_bin or self.llama_py else 0)
        self.total_s = opts.seconds * len(LEVELS) * self.rounds_n * max(1, systems)
        self.progress = Progress("overload", "s of load", enabled=not opts.quiet, min_interval_s=None)
        self.done_s = 0.0
        self.rounds: dict[str, list[list[dict]]] = {EDGE: [], LLAMA: []}
        self.daemon: Daemon | None = None

    def _llamacpp(self) -> tuple[str | None, str | None]:
        """llama.cpp's server binary (or a Python with llama_cpp.server), None where it will not run."""
        opts = self.opts
        if opts.no_llamacpp:
            return None, None
        llama_bin = shutil.which(opts.llama_server)
        llama_py = None if llama_bin else opts.llamacpp_python
        if llama_bin is None and llama_py is None:
            self.say(f"no llama.cpp server yet ({opts.llama_server!r} not found, no --llamacpp-python): looked for "
                     "again later")  # fmt: skip
            llama_bin = opts.llama_server  # a server still being built may be there when the daemon's levels end
        if self.gguf is None or not self.gguf.is_file():
            self.say(f"no GGUF for llama.cpp ({self.gguf_note}): the daemon only")
            return None, None
        return llama_bin, llama_py

    def daemon_rounds(self) -> None:
        """The daemon: up, its capacity measured (the voice mix running), the default SLA put in force, then
        every round of every level."""
        say = self.say
        say(f"starting the daemon on the default tiers (log {self.workdir / 'daemon.log'})")
        self.daemon = daemon = Daemon(self.workdir, say)
        mix = "4 chats in flight" + (", the spoken commands meanwhile" if self.speech and self.speech.clips else "")
        say(f"daemon up; warming it and measuring its capacity ({mix})")
        measured = asyncio.run(capacity(daemon.url, speech=self.speech))
        cap = self.opts.capacity or measured
        self.report.update(daemon_serving=daemon.serving(), capacity_per_s=cap, capacity_measured_per_s=measured,
                           capacity_source="--capacity" if self.opts.capacity else "measured")  # fmt: skip
        say(f"capacity {measured:.2f} chats/s measured; levels from {cap:.2f}/s")
        time.sleep(31)  # the probe's completions leave the default SLA window (30 s) before the load
        daemon.reload_default_sla()
        for r in range(self.rounds_n):
            self.rounds[EDGE].append([self.level(EDGE, daemon.url, r, k, self.speech) for k in range(len(LEVELS))])
        daemon.stop()
        self.daemon = None

    def llamacpp_rounds(self) -> None:
        """llama.cpp's server on the same schedules, when there is one and a GGUF (the daemon's rounds are
        written first: kept whatever happens to this side)."""
        opts, say = self.opts, self.say
        llama_bin = shutil.which(self.llama_bin) if self.llama_bin else None
        if not opts.no_llamacpp and not llama_bin and not self.llama_py:
            say(f"no llama.cpp server ({opts.llama_server!r} not found, no --llamacpp-python): the daemon only")
        if not (llama_bin or self.llama_py) or self.gguf is None or LLAMA in self.kept:
            return
        if self.rounds[EDGE]:
            _write(opts.out, {**self.report, "systems": {EDGE: self._system(EDGE)}})
        server = LlamaServer(llama_bin, self.gguf, PROBE_CONCURRENCY, opts.threads, self.workdir, self.llama_py or "")
        try:
            measured = asyncio.run(capacity(server.url))
            self.report["llamacpp"] = {"command": " ".join(server.cmd), "gguf": self.gguf_note,
                                       "slots": server.slots, "capacity_per_s": measured}  # fmt: skip
            say(f"llama.cpp up: {self.report['llamacpp']['capacity_per_s']:.2f} chats/s ({server.slots} slot(s))")
            for r in range(self.rounds_n):
                self.rounds[LLAMA].append([self.level(LLAMA, server.url, r, k, None) for k in range(len(LEVELS))])
        except EdgeAgentError as exc:
            say(f"llama.cpp side stopped: {exc}")
        finally:
            server.stop()

    def level(self, system: str, url: str, round_: int, k: int, voice: Speech | None) -> dict:
        """One level of one round: its arrivals sent, its figures, the server idle again after it."""
        opts = self.opts
        rate = LEVELS[k] * self.report["capacity_per_s"]
        schedule = poisson_schedule(rate, opts.seconds, level_seed(opts.seed, round_, k))

        def tick(t: float, outs: list[Outcome]) -> None:
            if t > opts.seconds + 1:
                return  # draining: the level's line follows
            self.progress.label = (
                f"round {round_ + 1}/{self.rounds_n} {system} {LEVELS[k]:g}x ({rate:.2f}/s) "
                f"t={min(t, opts.seconds):.0f}s done {sum(o.kind == 'completed' for o in outs)} "
                f"refused {sum(o.kind == 'refused' for o in outs)}"
            )
            self.progress.update(self.done_s + min(t, opts.seconds), self.total_s)

        start_wall = time.time()
        outs, turns = asyncio.run(drive_level(url, schedule, opts.seconds, opts.drain_s, voice, tick))
        self.done_s += opts.seconds
        fig = {"load": LEVELS[k], "offered_per_s": rate, **level_figures(outs, opts.seconds, opts.sla_ms, turns)}
        fig["load_avg_1m"] = round(os.getloadavg()[0], 2)  # the machine is shared: what else ran
        fig["outcomes"] = [asdict(o) for o in outs]
        fig["voice"] = [asdict(v) for v in turns]
        if system == EDGE and self.daemon is not None:
            fig["switches"] = switches(self.daemon.log.read_text(errors="replace"), start_wall, time.time())
            fig["switch_delay_s"] = switch_delay_s(outs, fig["switches"])
        self.say(f"round {round_ + 1} {system} {LEVELS[k]:g}x: {level_line(fig, voice is not None)}")
        waited = asyncio.run(wait_idle(url, system))
        if waited > 1:
            self.say(f"{system} was busy {waited:.0f} s after the level")
        time.sleep(2.0)
        return fig

    def _system(self, system: str) -> dict:
        return {"rounds": self.rounds[system], "levels": combine(self.rounds[system])}

    def finish(self) -> None:
        """The report: kept and measured systems, the targets, overload.json, overload.md and the plot."""
        report, out = self.report, self.opts.out
        report["systems"].update(self.kept)
        for system, per_round in self.rounds.items():
            if per_round:
                report["systems"][system] = self._system(system)
        if EDGE not in report["systems"]:
            raise EdgeAgentError("no level finished")
        report["targets"] = check_targets(report)
        _write(out, report)
        text = format_report(report)
        (out / "overload.md").write_text(text + "\n")
        print(text)
        try:
            plot(report, out / "overload.png")
            self.say(f"wrote {out / 'overload.md'}, overload.json and overload.png")
        except InputError as exc:
            self.say(f"no plot ({exc})")


def level_line(fig: dict, voice: bool) -> str:
    """A level's figures in one line, as the bench prints them."""
    fmt = lambda v: "—" if v is None else f"{v:.0f}"  # noqa: E731
    line = (
        f"sent {fig['sent']} = {fig['completed']} completed + {fig['refused']} refused + {fig['cancelled']} "
        f"cancelled + {fig['failed']} failed; goodput {fig['goodput_per_s']:.2f}/s; TTFT P50/P95/P99 "
        f"{fmt(fig['ttft_p50_ms'])}/{fmt(fig['ttft_p95_ms'])}/{fmt(fig['ttft_p99_ms'])} ms; refusals P95 "
        f"{fmt(fig['refusal_p95_ms'])} ms"
    )
    if voice:
        line += (
            f"; voice P95 {fmt(fig['voice_p95_ms'])} ms (final {fmt(fig['voice_final_p95_ms'])}, first token "
            f"{fmt(fig['voice_first_token_p95_ms'])}; {fig['voice_turns']} turns)"
        )
    return line
