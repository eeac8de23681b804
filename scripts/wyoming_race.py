"""The Wyoming STT race: the agent's Wyoming server against wyoming-faster-whisper on the same Whisper base.

    scripts/wyoming-race [--rounds 1] [--threads 2] [--openvino] [--work out/wyoming-race] [--write-docs]

1. Whisper base as ``edge-agent models fetch whisper-base`` leaves it in the agent's default caches: the
   CTranslate2 folder from the registry (pinned sha256s), its import, and the recipe's engines built and
   gated once (the agent serves the gate's choice, as its daemon does; the peer loads the CTranslate2 folder).
2. A corpus in wyoming-bench's format (``<stem>.wav`` + ``<stem>.txt``): 64 sentences of 1-8 s spoken by
   the natural-voice set in turn (edge_agent/engines/voices.py: Piper's joe at three length/noise settings,
   flite slt/rms/awb/kal16, espeak-ng en-us as the stress voice), 16 kHz mono PCM16.
3. Servers, all up at once: wyoming-faster-whisper on the CTranslate2 folder at float32 and at int8 (beam 1,
   language en, the same thread count), the agent's daemon with the Whisper base tier (ONNX Runtime; and
   OpenVINO with ``--openvino``) and a daemon with the ``demo-asr`` tier.
4. ``wyoming-bench stt`` on all of them in one run, both modes: non-streaming (audio sent at once; total =
   end of audio -> transcript) and streaming (audio paced in real time; time to the first transcript chunk).
5. Four streams at once on each server (this script's own client, the ``wyoming`` library): per-request
   total (end of audio -> transcript) against one stream at a time, transcripts lost, and the aggregate
   throughput of four at once (seconds of audio recognised per second of wall time).

Writes ``race.json``, ``bench.txt`` (wyoming-bench's own output) and ``wyoming-race.png`` under ``--work``;
``--write-docs`` puts the table and the plot into docs/benchmarks.md (between its wyoming-race markers).
Reference tools run from ``.venv-wyoming`` (scripts/requirements-whisper-reference.txt), never the runtime's venv.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
REF_VENV = REPO / ".venv-wyoming"
PAD_S = 0.15  # silence before and after each utterance
SENTENCES = (
    "turn on the lights",
    "what time is it",
    "stop the music",
    "good morning",
    "open the garage door",
    "turn off the kitchen light",
    "set a timer for ten minutes",
    "what is the weather like today",
    "play some jazz in the living room",
    "is the front door locked",
    "dim the bedroom lights to thirty percent",
    "remind me to water the plants tomorrow morning",
    "how long will it take to drive to the airport",
    "add milk eggs and bread to the shopping list",
    "set the thermostat to twenty one degrees",
    "close all the blinds on the ground floor",
    "what is on my calendar for this afternoon",
    "turn the volume down a little",
    "call my sister on her mobile phone",
    "start the robot vacuum in the hallway",
    "how many days are left until the end of the month",
    "the quick brown fox jumps over the lazy dog",
    "please read me the latest news headlines",
    "switch the porch light on at sunset every evening",
    "what was the score of last night's football game",
    "lock the back door and arm the alarm system",
    "how much energy did the solar panels produce yesterday",
    "wake me up at half past six on weekdays",
    "tell me a short story about a brave little mouse",
    "turn on the fan in the office and close the window",
    "the meeting has been moved to next thursday at three",
    "can you recommend a good recipe for vegetable soup",
    "set the oven to one hundred and eighty degrees",
    "I would like to listen to some classical music while I cook dinner",
    "show me the camera in the nursery",
    "water the garden for fifteen minutes",
    "pause the movie",
    "resume playback",
    "what is the capital of australia",
    "how far away is the moon",
    "the train to the city leaves from platform four every twenty minutes",
    "turn off every light in the house except the one in the hallway",
    "my favourite colour is green and my favourite animal is the otter",
    "remind me to take the rubbish out on tuesday night",
    "is it going to rain this weekend",
    "set the living room lights to a warm white",
    "how do you spell necessary",
    "the children are playing in the garden",
    "please turn the heating off when everyone has left the house",
    "what song is playing right now",
    "open the curtains in the bedroom",
    "next song please",
    "send a message to dad saying I will be late",
    "how many tablespoons are in a cup",
    "turn on the coffee machine",
    "the library closes at eight in the evening on fridays",
    "what is twelve multiplied by fifteen",
    "start a workout playlist",
    "is the washing machine finished yet",
    "let the dog out into the back garden",
    "the weather forecast says it will be sunny with a light breeze",
    "change the bathroom fan to high speed",
    "find my phone",
    "good night",
)


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, **kw)


def reference_venv() -> Path:
    python = REF_VENV / "bin" / "python"
    probe = "import ctranslate2, faster_whisper, wyoming_faster_whisper, wyoming_bench"
    if not (python.is_file() and subprocess.run([str(python), "-c", probe], capture_output=True).returncode == 0):
        print(f"building {REF_VENV} (scripts/requirements-whisper-reference.txt)", flush=True)
        run([sys.executable, "-m", "venv", str(REF_VENV)])
        run(
            [
                str(python),
                "-m",
                "pip",
                "install",
                "-q",
                "-r",
                str(REPO / "scripts" / "requirements-whisper-reference.txt"),
            ]
        )
    return REF_VENV / "bin"


def caches() -> tuple[Path, Path]:
    """The agent's default model and engine caches (where ``models fetch`` puts what it fetches and builds)."""
    sys.path.insert(0, str(REPO))
    from edge_agent.config import load_settings

    settings = load_settings(None)
    return Path(settings.models.cache_dir), Path(settings.engines.cache_dir)


def models(cache: Path) -> tuple[Path, str]:
    """Whisper base as ``models fetch whisper-base`` leaves it in the model cache ``cache``: the CTranslate2
    folder (pinned sha256s) the peer loads, its import and the recipe's engines (the gate's choice, cached)
    the agent serves; returns the CTranslate2 folder and what the agent serves."""
    from edge_agent.demo.real_models import fetch_and_build
    from edge_agent.importers.fetch import FETCHABLE, download_source

    error, decision, _ = fetch_and_build(
        "whisper-base", "encoder_model.onnx", "OpenAI's Whisper base", cache, lambda m: print(m, flush=True)
    )
    if error is not None:
        raise SystemExit(f"whisper-base: {error}")
    chosen = (decision or {}).get("chosen")
    served = f"its {chosen['precision']} engine" if chosen else "its FP32 folder"
    return download_source(FETCHABLE["whisper-base"], cache), served


def speaker(i: int):
    """The voice (``engines/voices.Voice``) of corpus utterance ``i``: the standard set in turn."""
    sys.path.insert(0, str(REPO))
    from edge_agent.engines.voices import STANDARD

    return STANDARD[i % len(STANDARD)]


def corpus(work: Path, n: int) -> Path:
    import soundfile as sf

    from edge_agent.engines.voices import pad, require, synthesize

    folder = work / f"corpus-voices-{n}"
    if folder.is_dir() and len(list(folder.glob("*.wav"))) == n:
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    who = [speaker(i) for i in range(n)]
    require(who)
    for i, (text, x) in enumerate(zip(SENTENCES[:n], synthesize(list(zip(SENTENCES[:n], who))))):
        sf.write(str(folder / f"u{i:02d}.wav"), pad(x, PAD_S, PAD_S), 16000, subtype="PCM_16")
        (folder / f"u{i:02d}.txt").write_text(text + "\n")
    return folder


def first_word_ends(work: Path, n: int) -> dict[str, float]:
    """Per utterance (its stem), when its first word has been heard: ms from the start of the audio (the
    corpus's 150 ms of padding, then the word as the same voice says it alone, to its last 10 ms above
    -40 dB of its peak). No streaming recogniser can send a word before it ends, so a transcript chunk's
    time is this plus the recogniser's own delay."""
    import numpy as np

    from edge_agent.engines.voices import synthesize

    words = synthesize([(text.split()[0], speaker(i)) for i, text in enumerate(SENTENCES[:n])])
    out = {}
    for i, x in enumerate(words):
        win = 160
        energy = np.convolve(x.astype(np.float64) ** 2, np.ones(win) / win, "same")
        voiced = np.nonzero(energy > energy.max() * 1e-4)[0]
        out[f"u{i:02d}"] = 1000.0 * PAD_S + 1000.0 * float(voiced[-1] + 1) / 16000
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"a server exited ({proc.args[:3]}): see its log")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"port {port} not listening after {timeout_s} s")


def agent_config(work: Path, name: str, port: int, asr_model: str, backend: str, threads: int) -> Path:
    cache, engines = caches()
    cfg = work / f"{name}.toml"
    cfg.write_text(
        f"""
[device]
threads = {threads}
[models]
cache_dir = "{cache}"
[[models.llm]]
name = "small"
model = "demo-phi3"
[[models.asr]]
name = "{name}"
model = "{asr_model}"
backend = "{backend}"
[mqtt]
host = "127.0.0.1"
port = 1
device_id = "{name}"
[telemetry]
spool_path = "{work / name / "spool.sqlite"}"
ledger_path = "{work / name / "ledger.sqlite"}"
[api]
host = "127.0.0.1"
port = {free_port()}
[engines]
build_on_start = false
cache_dir = "{engines}"
[wyoming]
enabled = true
port = {port}
"""
    )
    (work / name).mkdir(exist_ok=True)
    return cfg


def start_servers(args, work: Path, bin_dir: Path, ct2: Path) -> list[dict]:
    servers = []
    for compute in ("float32", "int8"):
        port = free_port()
        cmd = [
            str(bin_dir / "wyoming-faster-whisper"), "--uri", f"tcp://127.0.0.1:{port}", "--model", str(ct2),
            "--data-dir", str(work / "wfw"), "--compute-type", compute, "--beam-size", "1", "--language", "en",
            "--cpu-threads", str(args.threads), "--stt-library", "faster-whisper", "--local-files-only",
        ]  # fmt: skip
        servers.append({"name": f"wyoming-faster-whisper {compute}", "port": port, "cmd": cmd, "kind": "wfw"})
    agents = [("agent-whisper-base", "whisper-base", "onnxruntime")]
    if args.openvino:
        agents.append(("agent-whisper-base-ov", "whisper-base", "openvino"))
    agents.append(("agent-demo-asr", "demo-asr", "onnxruntime"))
    for name, model, backend in agents:
        port = free_port()
        cfg = agent_config(work, name, port, model, backend, args.threads)
        cmd = [str(REPO / ".venv" / "bin" / "edge-agent"), "run", "--config", str(cfg)]
        label = f"edge-agent {model}" + (" (OpenVINO)" if backend == "openvino" else "")
        servers.append({"name": label, "port": port, "cmd": cmd, "kind": "agent"})
    env = dict(os.environ, CACHE_DIRECTORY=str(work / "cache"), STATE_DIRECTORY=str(work / "state"))
    for s in servers:
        log = open(work / f"{s['name'].replace(' ', '_')}.log", "w")  # noqa: SIM115 - closed with the process
        s["proc"] = subprocess.Popen(s["cmd"], stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    for s in servers:
        wait_port(s["port"], s["proc"])
        print(f"up: {s['name']} on :{s['port']}", flush=True)
    return servers


def stop_servers(servers: list[dict]) -> None:
    for s in servers:
        proc = s.get("proc")
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for s in servers:
        proc = s.get("proc")
        if proc is not None:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


_LINE = re.compile(r"\[(\w+)\] r\d+ (\S+) total=(\d+)ms ttft=(\S+) WER=(\S+)% audio=([\d.]+)s")


def parse_bench(text: str, servers: list[dict]) -> dict:
    """wyoming-bench's -v lines per server: mode -> list of {id, total_ms, ttft_ms, wer, audio_s}."""
    by_port = {str(s["port"]): s["name"] for s in servers}
    out: dict[str, dict[str, list[dict]]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("=== "):
            port = re.search(r":(\d+)", line)
            current = by_port.get(port.group(1)) if port else None
            continue
        m = _LINE.search(line)
        if m and current:
            mode, sid, total, ttft, wer, audio = m.groups()
            row = {
                "id": sid,
                "total_ms": float(total),
                "ttft_ms": float(ttft[:-2]) if ttft.endswith("ms") else None,
                "wer": float(wer),
                "audio_s": float(audio),
            }
            out.setdefault(current, {}).setdefault(mode, []).append(row)
    # wyoming-bench's own accounting per server and mode: (S + I + D) / reference words
    edits: dict[str, dict[str, dict]] = {}
    current, mode = None, None
    for line in text.splitlines():
        if line.startswith("Server: "):
            port = re.search(r":(\d+)", line)
            current = by_port.get(port.group(1)) if port else None
        elif m := re.match(r"\[(\w+)\] ok=(\d+) fail=(\d+)", line):
            mode = m.group(1)
            if current:
                edits.setdefault(current, {})[mode] = {"ok": int(m.group(2)), "fail": int(m.group(3))}
        elif (m := re.search(r"edits S=(\d+) I=(\d+) D=(\d+)\s+\(ref words=(\d+)\)", line)) and current and mode:
            sub, ins, dele, ref = map(int, m.groups())
            edits[current][mode] |= {
                "S": sub,
                "I": ins,
                "D": dele,
                "ref_words": ref,
                "wer": 100 * (sub + ins + dele) / ref,
            }
    return {"rows": out, "edits": edits}


def pct(values: list[float], q: float) -> float:
    xs = sorted(values)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def summarize(rows: dict, edits: dict, words: dict[str, float]) -> dict:
    summary = {}
    for name, modes in rows.items():
        s: dict = {}
        for mode, ms in modes.items():
            totals = [r["total_ms"] for r in ms]
            s[mode] = {
                "n": len(ms),
                **edits.get(name, {}).get(mode, {}),
                "total_p50": statistics.median(totals),
                "total_p25": pct(totals, 0.25),
                "total_p75": pct(totals, 0.75),
                "total_p95": pct(totals, 0.95),
            }
            ttfts = [r["ttft_ms"] for r in ms if r["ttft_ms"] is not None]
            if ttfts:
                s[mode] |= {"ttft_p50": statistics.median(ttfts), "ttft_p95": pct(ttfts, 0.95), "ttft_n": len(ttfts)}
            after = [r["ttft_ms"] - words[r["id"]] for r in ms if r["ttft_ms"] is not None and r["id"] in words]
            if after:  # the recogniser's own delay: first chunk after the first word was heard
                s[mode] |= {"after_word_p50": statistics.median(after), "after_word_p95": pct(after, 0.95)}
        summary[name] = s
    return summary


async def _one(port: int, pcm: bytes) -> tuple[float, str | None]:
    from wyoming.asr import Transcribe, Transcript
    from wyoming.audio import AudioChunk, AudioStart, AudioStop
    from wyoming.client import AsyncTcpClient

    client = AsyncTcpClient("127.0.0.1", port)
    await client.connect()
    try:
        await client.write_event(Transcribe(language="en").event())
        await client.write_event(AudioStart(rate=16000, width=2, channels=1).event())
        for i in range(0, len(pcm), 2048):
            await client.write_event(AudioChunk(rate=16000, width=2, channels=1, audio=pcm[i : i + 2048]).event())
        await client.write_event(AudioStop().event())
        sent = time.perf_counter()
        while True:
            event = await asyncio.wait_for(client.read_event(), 120)
            if event is None:
                return time.perf_counter() - sent, None
            if Transcript.is_type(event.type):
                return time.perf_counter() - sent, Transcript.from_event(event).text
    finally:
        await client.disconnect()


def concurrency(servers: list[dict], folder: Path, n_utts: int) -> dict:
    """One stream at a time, then four at once, over the first ``n_utts`` utterances (in groups of four)."""
    import soundfile as sf

    pcms = []
    for wav in sorted(folder.glob("*.wav"))[:n_utts]:
        x, _ = sf.read(str(wav), dtype="int16")
        pcms.append(x.tobytes())
    out = {}
    for s in servers:
        port = s["port"]
        single = [asyncio.run(_one(port, p)) for p in pcms]

        async def four(group, port=port):
            return await asyncio.gather(*(_one(port, p) for p in group))

        multi = []
        started = time.perf_counter()
        for i in range(0, len(pcms), 4):
            multi += asyncio.run(four(pcms[i : i + 4]))
        wall_s = time.perf_counter() - started
        t1, t4 = [1000 * t for t, _ in single], [1000 * t for t, _ in multi]
        out[s["name"]] = {
            "n": len(pcms),
            "one_p50": statistics.median(t1),
            "one_p95": pct(t1, 0.95),
            "four_p50": statistics.median(t4),
            "four_p95": pct(t4, 0.95),
            # aggregate throughput: seconds of audio recognised per second of wall time, four at once
            "four_audio_s_per_s": sum(len(p) for p in pcms) / 32000 / wall_s,
            "lost": sum(1 for _, text in multi if text is None),
            "differ": sum(1 for (_, a), (_, b) in zip(single, multi) if a != b),
        }
        print(f"concurrency {s['name']}: {out[s['name']]}", flush=True)
    return out


def plot(summary: dict, conc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    ns = [summary[n].get("non_streaming", {}) for n in names]
    y = range(len(names))
    axes[0].barh(y, [s.get("wer", 0) for s in ns], color="tab:blue")
    axes[0].set_title("WER % (non-streaming, wyoming-bench)")
    p50 = [s.get("total_p50", 0) for s in ns]
    lo = [p - s.get("total_p25", 0) for p, s in zip(p50, ns)]
    hi = [s.get("total_p75", 0) - p for p, s in zip(p50, ns)]
    axes[1].barh(y, p50, xerr=[lo, hi], color="tab:orange", capsize=3)
    axes[1].set_title("non-streaming total, ms (median, p25-p75)")
    c1 = [conc.get(n, {}).get("one_p95", 0) for n in names]
    c4 = [conc.get(n, {}).get("four_p95", 0) for n in names]
    axes[2].barh([i - 0.2 for i in y], c1, height=0.4, label="1 stream")
    axes[2].barh([i + 0.2 for i in y], c4, height=0.4, label="4 streams")
    axes[2].set_title("total p95, ms: one stream vs four at once")
    axes[2].legend()
    for ax in axes:
        ax.set_yticks(list(y))
        ax.set_yticklabels(names if ax is axes[0] else [""] * len(names))
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(summary: dict, conc: dict, words: dict[str, float], served: str) -> str:
    lines = [
        "| server | WER % | total p50 [p25–p75] ms | total p95 ms | first chunk p50 / p95 ms (streaming) "
        "| 4 streams: p95 / 1 stream p95, lost | 4 streams: audio s per s |",
        "|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for name, s in summary.items():
        ns, st, c = s.get("non_streaming", {}), s.get("streaming", {}), conc.get(name, {})
        if "ttft_p50" in st:
            ttft = f"{st['ttft_p50']:.0f} / {st['ttft_p95']:.0f}"
            if "after_word_p50" in st:
                ttft += f" ({st['after_word_p50']:.0f} / {st['after_word_p95']:.0f} after the first word)"
        else:  # wyoming-faster-whisper does not stream; the others were not measured streaming (--mode)
            ttft = "no chunks (not streaming)" if name.startswith("wyoming-faster-whisper") else "not measured"
        cc = "– | –"
        if c:
            cc = f"{c['four_p95']:.0f} / {c['one_p95']:.0f} ms, {c['lost']} | {c['four_audio_s_per_s']:.2f}"
        if ns:
            spread = f"[{ns.get('total_p25', 0):.0f}–{ns.get('total_p75', 0):.0f}]"
            wer, total = f"{ns.get('wer', float('nan')):.1f}", f"{ns['total_p50']:.0f} {spread} | {ns['total_p95']:.0f}"
        else:  # not measured (--mode streaming)
            wer, total = "–", "– | –"
        lines.append(f"| {name} | {wer} | {total} | {ttft} | {cc} |")
    voices = sorted({speaker(i).label for i in range(len(words) or 8)})
    lines.append(f"\nSpoken by (in turn): {', '.join(voices)}. The agent's whisper-base tier served {served}.")
    if words:
        ends = list(words.values())
        lines.append(
            f"\nThe first word of an utterance ends {statistics.median(ends):.0f} ms (p50) / {pct(ends, 0.95):.0f} ms "
            f"(p95) after the start of its audio, {min(ends):.0f} ms at the earliest: no chunk holding it can "
            "come sooner when the audio is sent in real time."
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=REPO / "out" / "wyoming-race")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--openvino", action="store_true", help="also the Whisper base tier on OpenVINO")
    ap.add_argument("--utterances", type=int, default=len(SENTENCES), help=f"corpus size (at most {len(SENTENCES)})")
    ap.add_argument("--concurrency-utts", type=int, default=16, help="utterances for the 1-vs-4-streams part (0: none)")
    ap.add_argument("--mode", choices=("both", "non_streaming", "streaming"), default="both", help="wyoming-bench's")
    ap.add_argument("--write-docs", action="store_true", help="the table and plot into docs/benchmarks.md")
    args = ap.parse_args()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    bin_dir = reference_venv()
    ct2, served = models(caches()[0])
    folder = corpus(work, args.utterances)
    words = first_word_ends(work, args.utterances)
    servers = start_servers(args, work, bin_dir, ct2)
    try:
        bench = [
            str(bin_dir / "wyoming-bench"), "stt", "--corpus", str(folder), "--mode", args.mode,
            "--rounds", str(args.rounds), "--warmup", "1", "--chunk-samples", "1024", "--chunk-delay", "0.064",
            "--config", '{"language": "en"}', "-v", *(f"127.0.0.1:{s['port']}" for s in servers),
        ]  # fmt: skip
        print(" ".join(bench), flush=True)
        started = time.monotonic()
        text = subprocess.run(bench, capture_output=True, text=True).stdout
        (work / "bench.txt").write_text(text)
        print(f"wyoming-bench took {time.monotonic() - started:.0f} s", flush=True)
        parsed = parse_bench(text, servers)
        summary = summarize(parsed["rows"], parsed["edits"], words)
        conc = concurrency(servers, folder, args.concurrency_utts) if args.concurrency_utts > 0 else {}
    finally:
        stop_servers(servers)
    result = {
        "command": " ".join(sys.argv),
        "machine": f"{os.cpu_count()} CPUs, {args.threads} threads per server",
        "corpus": {
            "utterances": args.utterances,
            "voices": [speaker(i).label for i in range(min(args.utterances, 8))],
            "first_word_ms": words,
        },
        "agent_serves": served,
        "summary": summary,
        "concurrency": conc,
        "rows": parsed["rows"],
    }
    (work / "race.json").write_text(json.dumps(result, indent=2))
    plot(summary, conc, work / "wyoming-race.png")
    md = table(summary, conc, words, served)
    print(md)
    if args.write_docs:
        shutil.copyfile(work / "wyoming-race.png", REPO / "docs" / "wyoming-race.png")
        doc = REPO / "docs" / "benchmarks.md"
        body = doc.read_text()
        begin, end = "<!-- wyoming-race:begin -->", "<!-- wyoming-race:end -->"
        if begin in body and end in body:
            head, rest = body.split(begin, 1)
            body = head + begin + "\n" + md + "\n" + end + rest.split(end, 1)[1]
            doc.write_text(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
