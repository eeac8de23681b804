"""``edge-agent demo``: the daemon on real weights under a mixed load, watched live.

1. A broker: ``mqtt.host:port`` when something listens there, else a private mosquitto on a free
   port (when installed), else none (the agent spools its telemetry).
2. The daemon: ``edge-agent run`` as a child process with a generated config (two LLM tiers on
   ``gemma-3-270m-home``, fetched on first use; the random demo tiers without it or with
   ``--random-models``; the API on a free port, telemetry every 2 s, state under a temporary folder).
3. Load: the top tier's capacity measured first (chats completed per second with four in flight,
   under an SLA target no queue breaks; once the probe's requests have left the SLA window, SIGHUP
   reloads the config with the default 387 ms target), then chat requests through the
   OpenAI-compatible API (streamed, Poisson arrivals at 0.3x that capacity, 1.5x in the middle third:
   the top tier's SLA breaks on any CPU), and spoken commands
   synthesised with espeak-ng, streamed in real time through the ASR WebSocket with its respond option:
   each command's reply (a tool call, or words) comes back from the daemon's own voice turn and is
   judged against the command's expected call.
4. Live: every 2 s one line: chat TTFT P95 as clients see it, active tier, ASR final latency, and
   the fleet view's P95/P99 merged from the MQTT histograms.
5. At the end (``--duration-s`` or Ctrl-C): three greedy chat replies, a summary (voice → tool call N of M
   right with the wrong ones, the switches with the P95 that caused them) and a latency plot (PNG).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..config.tiers import default_llm_tiers, random_llm_tiers
from ..demo_models.home_commands import CHAT_PROMPTS, DEMO, Command
from ..errors import EdgeAgentError, InputError
from ..metrics.window import percentile
from .actions import action_of, home_tools, reply_settings
from .real_models import real_asr, real_model
from .report import Record, _fmt, format_summary, plot, summarize
from .speech import asr_toml
from .speech import clips as speech_clips

log = logging.getLogger(__name__)

BASE_LOAD, BURST_LOAD = 0.3, 1.5  # chat arrival rates as shares of the measured capacity
PROBE_REQUESTS = 12  # completions the capacity is measured over, after the cold ones
PROBE_MAX_S = 30.0  # at most this long
SLA_WINDOW_S = 10  # the demo daemon's SLA window
PROBE_TARGET_MS = 600_000.0  # the SLA target while the probe queues requests on purpose: no switch on them
SHOWN = (  # the chat replies printed at the end, greedy
    "What colour is the sky on a clear day?",
    "What is the capital of France?",
    "Give me a tip for sleeping well.",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def start_broker(host: str, port: int, workdir: Path) -> tuple[subprocess.Popen | None, str, int, str]:
    if _listening(host, port):
        return None, host, port, f"broker at {host}:{port}"
    exe = shutil.which("mosquitto") or ("/usr/sbin/mosquitto" if Path("/usr/sbin/mosquitto").exists() else None)
    if exe is None:
        return None, host, port, "no broker and no mosquitto installed: telemetry is spooled on disk"
    port = _free_port()
    conf = workdir / "mosquitto.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n")
    proc = subprocess.Popen([exe, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while not _listening("127.0.0.1", port):
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            return None, host, port, "mosquitto did not start: telemetry is spooled on disk"
        time.sleep(0.05)
    return proc, "127.0.0.1", port, f"private mosquitto on 127.0.0.1:{port}"


def llm_tiers(real: bool) -> str:
    """The demo's LLM tiers as TOML: the embedded default's ladder on real weights
    (``config.tiers.default_llm_tiers``), or the random demo ladder; written out, so the daemon's config
    file says what it serves."""
    tiers = default_llm_tiers() if real else random_llm_tiers()
    return "".join(
        f'[[models.llm]]\nname = "{t.name}"\nmodel = "{t.model}"\n'
        f"max_new_tokens = {t.max_new_tokens}\n"
        + (f"max_batch = {t.max_batch}\n" if t.max_batch is not None else "")
        + (f'rung = "{t.rung}"\n' if t.rung else "")
        for t in tiers
    )


def daemon_config(
    workdir: Path,
    mqtt: tuple[str, int],
    api_port: int,
    speech: bool,
    real: bool = False,
    target_ms: float | None = None,
    min_samples: int = 5,
    whisper: bool = False,
) -> Path:
    """The daemon's config; ``target_ms``: an SLA target other than the default 387 ms (the probe's);
    ``min_samples``: the SLA window's samples before any decision."""
    cfg = workdir / "agent.toml"
    cfg.write_text(f"""# generated by edge-agent demo
{asr_toml(speech, whisper)}
{llm_tiers(real)}
[mqtt]
host = "{mqtt[0]}"
port = {mqtt[1]}
device_id = "demo-device"
[telemetry]
interval_s = 2
spool_path = "{workdir / "spool.sqlite"}"
ledger_path = "{workdir / "ledger.sqlite"}"
[api]
host = "127.0.0.1"
port = {api_port}
[engines]
build_on_start = false  # engines already built (edge-agent build) are served; none is built mid-demo
[sla]
# a 10 s window; min_samples from the measured capacity once it is known (more than the base load puts
# in the window, fewer than an overloaded tier completes in it)
window_s = {SLA_WINDOW_S}
min_samples = {min_samples}{"" if target_ms is None else chr(10) + f"target_ms = {target_ms:g}"}
evaluate_every_s = 1
downgrade_after = 2
upgrade_after = 4
cooldown_s = 8
min_dwell_s = 3
# the demo shows tier switches; shedding at the lightest tier is left to outlast the burst
shed_after = 60
""")
    return cfg


async def chat_load(
    base: str, rec: Record, t0: float, duration: float, rate: float, burst_rate: float, stop: asyncio.Event
) -> None:
    import aiohttp

    rng = random.Random(11)

    async def one(session, prompt: str) -> None:
        start = time.monotonic()
        body = _chat_body(prompt)
        ttft, model = None, ""
        rec.sent += 1
        try:
            async with session.post(f"{base}/v1/chat/completions", json=body) as resp:
                if resp.status in (429, 503):  # refused at once, with a reason: accounted, not a failure
                    error = (await resp.json())["error"]
                    answered = (time.monotonic() - start) * 1e3
                    why = error.get("reason") or error.get("code") or "?"
                    rec.refused.append((start - t0, resp.status, why, answered))
                    return
                if resp.status != 200:
                    rec.failed.append(f"HTTP {resp.status}: {(await resp.json())['error']['message']}")
                    return
                async for line in resp.content:
                    if not line.startswith(b"data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:  # an error inside a stream already answered 200: a failure
                        rec.failed.append(f"in the stream: {chunk['error'].get('message')}")
                        return
                    model = chunk.get("model", model)
                    choice = (chunk.get("choices") or [{}])[0]
                    if ttft is None and (choice.get("delta", {}).get("content") or choice.get("finish_reason")):
                        ttft = (time.monotonic() - start) * 1e3  # its first token (or its end, when empty)
            rec.chats.append((start - t0, ttft if ttft is not None else 0.0, (time.monotonic() - start) * 1e3, model))
        except aiohttp.ClientError as exc:
            rec.failed.append(str(exc))
        except asyncio.CancelledError:
            rec.cancelled += 1
            raise

    async with aiohttp.ClientSession() as session:
        tasks = set()
        while not stop.is_set() and time.monotonic() - t0 < duration:
            t = time.monotonic() - t0
            burst = duration / 3 <= t < 2 * duration / 3
            await asyncio.sleep(rng.expovariate(burst_rate if burst else rate))
            task = asyncio.create_task(one(session, rng.choice(CHAT_PROMPTS)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=60)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)


def _chat_body(prompt: str, max_tokens: int = 48, temperature: float = 0.7, stream: bool = True) -> dict:
    return {
        "model": "edge-agent",
        "stream": stream,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "messages": [{"role": "user", "content": prompt}],
    }


async def capacity(base: str, concurrency: int, max_seconds: float = PROBE_MAX_S) -> float:
    """Chat requests per second the serving tier completes with ``concurrency`` of them always in flight
    (a closed loop): the rate the burst is sized from, on whatever CPU this is. The first ``concurrency``
    completions (cold caches) are left out; the rate is taken between completions from then on, over
    ``PROBE_REQUESTS`` more or ``max_seconds`` in all, whichever comes first."""
    import aiohttp

    done: list[float] = []  # completion times
    start = time.monotonic()
    wanted = concurrency + PROBE_REQUESTS

    async def worker(session, k: int) -> None:
        rng = random.Random(k)
        while len(done) < wanted and time.monotonic() - start < max_seconds:
            async with session.post(
                f"{base}/v1/chat/completions", json=_chat_body(rng.choice(CHAT_PROMPTS), stream=False)
            ) as r:
                await r.read()
                if r.status == 200:
                    done.append(time.monotonic())

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(worker(session, k) for k in range(concurrency)))
    measured = done[concurrency - 1 :]  # from the last cold completion on
    if len(measured) < 2:
        return len(done) / (time.monotonic() - start)
    return (len(measured) - 1) / (measured[-1] - measured[0])


async def chat_replies(base: str, prompts: tuple[str, ...]) -> list[tuple[str, str]]:
    """Greedy replies to ``prompts``, one at a time, shown at the end. Gemma 3 270M is a base model: it
    answers a question put as text to complete ("Question: … Answer:"), through the completions route."""
    import aiohttp

    out = []
    async with aiohttp.ClientSession() as session:
        for prompt in prompts:
            body = {
                "model": "edge-agent",
                "prompt": f"Question: {prompt}\nAnswer:",
                "max_tokens": 40,
                "temperature": 0.0,
                "stop": ["\n"],
            }
            async with session.post(f"{base}/v1/completions", json=body) as resp:
                data = await resp.json()
            if resp.status != 200:
                out.append((prompt, f"(HTTP {resp.status}: {data.get('error', {}).get('message')})"))
            else:
                out.append((prompt, " ".join(data["choices"][0].get("text", "").split())))
    return out


async def speech_load(
    base: str,
    clips: list[tuple[Path, str]],
    rec: Record,
    t0: float,
    duration: float,
    stop: asyncio.Event,
    expected: dict[str, Command],
) -> None:
    import aiohttp
    import numpy as np

    from ..audio.wav import read_audio

    ws_url = base.replace("http://", "ws://") + "/v1/audio/stream?respond=true"
    settings = reply_settings(home_tools(), "auto", 64)  # "what time is it" gets words, not a call
    k = 0
    async with aiohttp.ClientSession() as session:
        while not stop.is_set() and time.monotonic() - t0 < duration - 3:
            path, said = clips[k % len(clips)]
            k += 1
            samples, _info = read_audio(path, 16000)
            pcm = (np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes()
            start = time.monotonic()
            async with session.ws_connect(ws_url) as ws:
                await ws.send_str(settings)
                for i in range(0, len(pcm), 3200):  # 100 ms blocks, paced like a microphone
                    await ws.send_bytes(pcm[i : i + 3200])
                    await asyncio.sleep(0.1)
                await ws.send_str("end")
                finals: dict[int, dict] = {}
                answers: dict[int, dict] = {}
                async for msg in ws:  # the server closes the socket once every final and reply is out
                    event = json.loads(msg.data)
                    if event.get("kind") == "final":
                        finals[event["utterance"]] = event  # an early end that went on: the later final
                    elif event.get("kind") in ("reply", "error") and "utterance" in event:
                        answers[event["utterance"]] = event
                spoken = [f for f in finals.values() if f.get("text")]
                if spoken:
                    final_ms = spoken[-1].get("final_ms")  # end of speech -> final text, measured by the agent
                    if final_ms is not None:
                        rec.speech.append((start - t0, float(final_ms), " ".join(f["text"] for f in spoken), said))
                    want = expected[said].call if said in expected else None
                    rec.actions.extend(
                        {"t": round(start - t0, 2), **action_of(f, answers.get(f["utterance"]), said, want)}
                        for f in spoken
                    )
            await asyncio.sleep(1.0)


async def watch(base: str, rec: Record, t0: float, duration: float, stop: asyncio.Event, fleet) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        while not stop.is_set() and time.monotonic() - t0 < duration + 5:
            try:
                async with session.get(f"{base}/health") as resp:
                    tier = (await resp.json()).get("llm", {}).get("tier", "?")
            except aiohttp.ClientError:
                tier = "?"
            t = time.monotonic() - t0
            rec.tiers.append((t, tier))
            recent = [c[1] for c in rec.chats if c[0] > t - 6]
            finals = [s[1] for s in rec.speech if s[0] > t - 20]
            row = fleet.rows()["fleet"] if fleet else {}
            rec.fleet.append((t, row.get("p95_ms"), row.get("p99_ms")))
            print(
                f"[{t:5.1f}s] tier {tier:<6} chat TTFT P95 {_fmt(percentile(recent, 95))} ms "
                f"(n={len(recent)}) · ASR final P95 {_fmt(percentile(finals, 95))} ms · fleet TTFT "
                f"P95/P99 {_fmt(row.get('p95_ms'))}/{_fmt(row.get('p99_ms'))} ms · failed {len(rec.failed)}",
                flush=True,
            )
            await asyncio.sleep(2.0)


def subscribe_fleet(host: str, port: int, rec: Record, t0: float):
    """A FleetView fed by edge/v1/+/# (what `edge-agent fleet watch` shows), or None without a broker."""
    import paho.mqtt.client as mqtt

    from ..telemetry.fleet import FleetView

    view = FleetView(window_s=10.0)

    def on_message(_c, _u, msg) -> None:
        view.ingest(msg.topic, msg.payload)
        if msg.topic.endswith("/evt/tier_switch"):
            try:
                rec.switches.append({"t_s": round(time.monotonic() - t0, 1), **json.loads(msg.payload).get("data", {})})
            except (ValueError, AttributeError):
                pass

    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"demo-watch-{os.getpid()}", protocol=mqtt.MQTTv5)
    client.on_connect = lambda c, u, f, rc, p=None: c.subscribe("edge/v1/+/#", qos=1)
    client.on_message = on_message
    try:
        client.connect(host, port)
    except OSError:
        return None, None
    client.loop_start()
    return view, client


def run(args: argparse.Namespace) -> int:
    from ..config import load_settings

    if args.duration_s < 10:
        raise InputError(f"--duration-s must be at least 10, got {args.duration_s}")
    settings = load_settings(args.config)
    workdir = Path(tempfile.mkdtemp(prefix="edge-agent-demo-"))
    real, model_note = (
        (False, "random demo tiers (--random-models)")
        if args.random_models
        else (real_model(settings.models.cache_dir, lambda text: print(f"demo: {text}", flush=True)))
    )
    broker, host, port, broker_note = start_broker(settings.mqtt.host, settings.mqtt.port, workdir)
    whisper, asr_note = (
        (False, "")
        if args.no_speech or args.random_models
        else real_asr(settings.models.cache_dir, lambda text: print(f"demo: {text}", flush=True))
    )
    clips, voices_note = (
        ([], "") if args.no_speech else speech_clips(workdir, [(c.text, c.voice) for c in DEMO], whisper)
    )
    api_port = _free_port()
    # the capacity probe queues requests on purpose: no switch on them (the default SLA comes after it)
    cfg = daemon_config(
        workdir, (host, port), api_port, speech=bool(clips), real=real, target_ms=PROBE_TARGET_MS, whisper=whisper
    )
    print(f"demo: {broker_note}; {model_note}; daemon config {cfg}", flush=True)
    if clips:
        print(f"demo: {asr_note or 'ASR tier demo-asr'}; spoken by {voices_note}", flush=True)
    daemon = _start_daemon(cfg, workdir / "daemon.log")
    base = f"http://127.0.0.1:{api_port}"
    rec = Record()
    try:
        _wait_until_listening(daemon, api_port, workdir / "daemon.log")
        rates = _probe_rates(base, args, rec)
        daemon_config(
            workdir,
            (host, port),
            api_port,
            speech=bool(clips),
            real=real,
            min_samples=rates["min_samples"],
            whisper=whisper,
        )
        _reload_sla(daemon, workdir / "daemon.log")
        t0 = time.monotonic()
        view, _client = subscribe_fleet(host, port, rec, t0)  # the client must stay referenced
        print(
            f"demo: daemon serving at {base}; {args.duration_s:g} s of chat"
            f"{' and spoken commands' if clips else ''}; Ctrl-C ends early",
            flush=True,
        )
        asyncio.run(_drive(base, clips, rec, t0, args, view))
        rec.replies = asyncio.run(chat_replies(base, SHOWN))
    except KeyboardInterrupt:
        print("\ndemo: interrupted, summarising", flush=True)
    finally:
        _stop(daemon, broker)
    _report(rec, args)
    return 1 if rec.failed else 0


def _start_daemon(cfg: Path, log_path: Path) -> subprocess.Popen:
    """``edge-agent run`` on ``cfg``, its output into ``log_path``."""
    with open(log_path, "w") as daemon_log:  # the daemon writes through its own copy
        return subprocess.Popen(
            [sys.executable, "-m", "edge_agent", "run", "--config", str(cfg)],
            stdout=daemon_log,
            stderr=subprocess.STDOUT,
        )


def _wait_until_listening(daemon: subprocess.Popen, api_port: int, log_path: Path) -> None:
    """Wait (up to 300 s) for the daemon's API port; a daemon that exits or never listens ends the demo with
    the tail of its log."""
    deadline = time.monotonic() + 300
    while not _listening("127.0.0.1", api_port):
        if daemon.poll() is not None or time.monotonic() > deadline:
            raise EdgeAgentError(f"the daemon did not start; its log: {log_path}:\n" + log_path.read_text()[-2000:])
        time.sleep(0.2)


def _probe_rates(base: str, args: argparse.Namespace, rec: Record) -> dict:
    """The chat rates (``_rates``), recorded and said; after a capacity probe, a wait until its requests
    have left the SLA window."""
    rates = _rates(base, args)
    rec.load = rates
    print(
        f"demo: capacity {rates['capacity_per_s']:.2f} chats/s at concurrency {rates['concurrency']}: "
        f"{rates['rate_per_s']:.2f}/s, then a burst of {rates['burst_per_s']:.2f}/s in the middle third",
        flush=True,
    )
    if rates["concurrency"]:
        print(f"demo: letting the probe's requests leave the {SLA_WINDOW_S} s SLA window", flush=True)
        time.sleep(SLA_WINDOW_S + 1)
    return rates


def _stop(daemon: subprocess.Popen, broker: subprocess.Popen | None) -> None:
    """SIGTERM the daemon (killed after 60 s), then stop the private broker if the demo started one."""
    daemon.send_signal(signal.SIGTERM)
    try:
        daemon.wait(60)
    except subprocess.TimeoutExpired:
        daemon.kill()
    if broker is not None:
        broker.terminate()
        broker.wait(10)


def _report(rec: Record, args: argparse.Namespace) -> None:
    """The summary printed; the JSON report and the latency plot written when asked for."""
    summary = summarize(rec)
    print(format_summary(summary))
    if args.json_out:
        report = {
            "summary": summary,
            "switches": rec.switches,
            "load": rec.load,
            "chats": rec.chats,  # (t, ttft ms, e2e ms, tier) per admitted chat
            "refused": rec.refused,  # (t, status, reason, answered in ms)
            "spoken": rec.actions,  # each spoken command: said, heard, the call, turn_ms, judged
        }
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        try:
            plot(rec, Path(args.plot))
            print(f"demo: latency plot written to {args.plot}")
        except InputError as exc:
            print(f"demo: no plot ({exc})")


async def _drive(base: str, clips, rec: Record, t0: float, args, view) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, stop.set)
    tasks = [
        chat_load(base, rec, t0, args.duration_s, rec.load["rate_per_s"], rec.load["burst_per_s"], stop),
        watch(base, rec, t0, args.duration_s, stop, view),
    ]
    if clips:
        tasks.append(speech_load(base, clips, rec, t0, args.duration_s, stop, {c.text: c for c in DEMO}))
    await asyncio.gather(*tasks)


def _rates(base: str, args: argparse.Namespace) -> dict:
    """The chat rates: ``--chat-rate`` (the burst 4x it) when given; else sized from the serving tier's
    measured capacity, so the burst overloads it (and breaks its SLA) on a fast CPU as on a slow one."""
    if args.chat_rate is not None:
        return {
            "capacity_per_s": 0.0,
            "concurrency": 0,
            "rate_per_s": args.chat_rate,
            "burst_per_s": 4 * args.chat_rate,
            "min_samples": 5,
        }
    concurrency = 4  # the top tier's max_batch: its batches full
    cap = asyncio.run(capacity(base, concurrency))
    cap = max(cap, 0.2)
    return {
        "capacity_per_s": round(cap, 3),
        "concurrency": concurrency,
        "rate_per_s": round(BASE_LOAD * cap, 3),
        "burst_per_s": round(BURST_LOAD * cap, 3),
        # more than the base rate puts in the SLA window (a few slow chats there are noise, not a
        # breach) and fewer than an overloaded tier completes in it (capacity x window)
        "min_samples": max(5, round(2 * BASE_LOAD * cap * SLA_WINDOW_S)),
    }


def _reload_sla(daemon: subprocess.Popen, daemon_log: Path) -> None:
    """SIGHUP the daemon onto its config's default SLA and wait (up to 10 s) until it says it applied it."""
    seen = daemon_log.read_text().count("reloaded: applied sla")
    daemon.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while daemon_log.read_text().count("reloaded: applied sla") == seen:
        if daemon.poll() is not None or time.monotonic() > deadline:
            raise EdgeAgentError(f"the daemon did not apply the demo's SLA; its log: {daemon_log}")
        time.sleep(0.1)
