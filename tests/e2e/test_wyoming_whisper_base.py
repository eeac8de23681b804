"""The real Whisper base as a daemon's ASR tier behind its Wyoming server (slow lane): spoken sentences sent
as a Wyoming client sends them come back as faster-whisper, run on the same CTranslate2 weights in its own
venv, transcribes them (word error rate between the two at most 10 % over the set), and close to what was
said (at most 25 %)."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess

import pytest

from tests import whisper_base
from tests.daemon_proc import Daemon, free_port
from tests.mqtt_broker import Broker

pytest.importorskip("wyoming")
from wyoming.asr import Transcribe, Transcript
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncTcpClient

pytestmark = pytest.mark.slow
SENTENCES = whisper_base.SENTENCES[:4]
FASTER_WHISPER = """
import json, sys
from faster_whisper import WhisperModel
m = WhisperModel(sys.argv[1], device="cpu", compute_type="float32", cpu_threads=2)
out = []
for w in sys.argv[2:]:
    segs, _ = m.transcribe(w, beam_size=1, temperature=0.0, without_timestamps=True,
                           condition_on_previous_text=False, vad_filter=False, language="en")
    out.append(" ".join(s.text.strip() for s in segs))
print(json.dumps(out))
"""


def _words(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9' ]", " ", text.lower()).split()


def _wer(hyp: str, ref: str) -> float:
    h, r = _words(hyp), _words(ref)
    d = list(range(len(h) + 1))
    for i, rw in enumerate(r, 1):
        prev, d[0] = d[0], i
        for j, hw in enumerate(h, 1):
            prev, d[j] = d[j], min(d[j] + 1, d[j - 1] + 1, prev + (rw != hw))
    return d[len(h)] / max(1, len(r))


async def _transcribe(port: int, pcm: bytes) -> str:
    client = AsyncTcpClient("127.0.0.1", port)
    await client.connect()
    try:
        await client.write_event(Transcribe(language="en").event())
        await client.write_event(AudioStart(rate=16000, width=2, channels=1).event())
        for i in range(0, len(pcm), 2048):
            await client.write_event(AudioChunk(rate=16000, width=2, channels=1, audio=pcm[i : i + 2048]).event())
        await client.write_event(AudioStop().event())
        while True:
            event = await asyncio.wait_for(client.read_event(), 120)
            assert event is not None
            if Transcript.is_type(event.type):
                return Transcript.from_event(event).text
    finally:
        await client.disconnect()


def test_whisper_base_tier_over_wyoming_transcribes_as_faster_whisper(tmp_path):
    import soundfile as sf

    folder = whisper_base.imported_folder(tmp_path)
    python = whisper_base.reference_python()
    speech = whisper_base.speech_set(tmp_path, SENTENCES)
    wavs = [str(w) for w, _ in speech]
    ref = subprocess.run(
        [str(python), "-c", FASTER_WHISPER, str(whisper_base.ct2_folder()), *wavs],
        check=True,
        capture_output=True,
        text=True,
    )
    theirs = json.loads(ref.stdout.strip().splitlines()[-1])
    broker = Broker(tmp_path).start()
    port = free_port()
    d = Daemon(
        tmp_path / "agent",
        broker_port=broker.port,
        extra=f"""
[wyoming]
enabled = true
port = {port}
""",
    )
    d.cfg.write_text(
        d.cfg.read_text().replace("asr = []\n", "") + f'\n[[models.asr]]\nname = "whisper-base"\nmodel = "{folder}"\n'
    )
    try:
        d.start(timeout_s=300)
        ours = [asyncio.run(_transcribe(port, sf.read(str(w), dtype="int16")[0].tobytes())) for w in wavs]
        said = [text for _, text in speech]
        assert _wer(" ".join(ours), " ".join(theirs)) <= 0.10, list(zip(ours, theirs))
        assert _wer(" ".join(ours), " ".join(said)) <= 0.25, list(zip(ours, said))
    finally:
        d.close()
        broker.stop()
