"""Speech for the demo ASR model: espeak-ng voices, variants, speeds and pitches, then noise, gain and reverb.

Numpy and the ``espeak-ng`` and ``sox`` programs only (no torch), so the runtime environment can
regenerate the evaluation audio too:

    .venv/bin/python scripts/train_asr/synth.py regenerate calibration/asr/heldout.jsonl

Every utterance is described by a plain dict (``Recipe``), stored in the manifests under ``"synth"``:
the same recipe gives the same samples on the same espeak-ng version (1.51 here).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import wave
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

SAMPLE_RATE = 16000

# The gmw English accents; mbrola voices are not installed by the apt package. en-029 (Caribbean)
# is kept out of training and used only as an unseen-accent stress set.
TRAIN_ACCENTS = ["en", "en-us", "en-gb-scotland", "en-gb-x-rp", "en-gb-x-gbclan", "en-gb-x-gbcwmd", "en-us-nyc"]
UNSEEN_ACCENT = "en-029"
# Variant FILE names (espeak-ng --voices=variant, File column): case matters, a wrong name silently
# gives the base voice. Whispering variants are left out: they carry almost no voicing.
VARIANTS = sorted(
    """adam Alex Alicia Andrea Andy Annie antonio aunty belinda benjamin boris caleb david Denis
Diogo ed edward edward2 Gene Gene2 gustave announcer Henrique Hugo iven iven2 iven3 iven4 Jacky john kaukovalta
Lee linda marcelo Marco Mario max Michael michel miguel Mike Mr Nguyen pablo paul pedro quincy RicishayMax
RicishayMax2 RicishayMax3 rob robert robosoft robosoft2 robosoft3 robosoft4 robosoft5 robosoft6 robosoft7
robosoft8 steph steph2 steph3 Storm Tweaky UniRobot zac anika anikaRobot AnxiousAndy fast f2 f3 f4 f5 grandpa
klatt klatt2 klatt3 klatt4 klatt5 klatt6 m2 m3 m4 m5 m6 m7 norbert sandro shelby travis victor m8 f1 croak m1
grandma""".split(),
    key=str.lower,
)
# One variant in eight never occurs in training: the held-out set speaks with these.
HELDOUT_VARIANTS = VARIANTS[3::8]
TRAIN_VARIANTS = [v for v in VARIANTS if v not in HELDOUT_VARIANTS]


@dataclass(frozen=True)
class Recipe:
    voice: str  # espeak-ng -v, e.g. "en-us+max"
    speed_wpm: int
    pitch: int
    gain_db: float  # relative to a peak of 0.5
    lead_s: float
    tail_s: float
    noise: str  # "", "white", "pink", "brown", "babble"
    snr_db: float
    rt60_s: float  # 0 = dry
    seed: int


def random_recipe(r: random.Random, split: str) -> Recipe:
    accents = TRAIN_ACCENTS
    variants = HELDOUT_VARIANTS if split == "heldout" else TRAIN_VARIANTS
    variant = r.choice([*variants, ""] if split == "train" else variants)
    voice = r.choice(accents) + (f"+{variant}" if variant else "")
    noisy = r.random() < (0.6 if split == "train" else 0.5)
    low_snr = 5.0 if split == "train" else 10.0
    return Recipe(
        voice=voice,
        speed_wpm=r.randint(125, 200),
        pitch=r.randint(25, 75),
        gain_db=round(r.uniform(-24.0, 3.0), 2),
        lead_s=round(r.choice([0.0, r.uniform(0.0, 0.3), r.uniform(0.0, 1.2)]), 3),
        tail_s=round(r.uniform(0.05, 0.6), 3),
        noise=r.choice(["white", "pink", "brown", "babble"]) if noisy else "",
        snr_db=round(r.uniform(low_snr, 30.0), 1),
        rt60_s=round(r.uniform(0.1, 0.6), 2) if r.random() < 0.3 else 0.0,
        seed=r.getrandbits(31),
    )


def espeak(text: str, voice: str, speed_wpm: int, pitch: int) -> np.ndarray:
    """espeak-ng speech resampled to 16 kHz by sox: float32 in [-1, 1].

    ``-D``: sox dithers by default when it writes 16 bits after processing, with random noise, which
    would make the same recipe give different samples on every run.
    """
    speak = subprocess.Popen(
        ["espeak-ng", "-v", voice, "-s", str(speed_wpm), "-p", str(pitch), "--stdout", text],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    sox = subprocess.run(
        [
            "sox",
            "-q",
            "-D",
            "-t",
            "wav",
            "-",
            "-t",
            "raw",
            "-r",
            str(SAMPLE_RATE),
            "-e",
            "signed",
            "-b",
            "16",
            "-c",
            "1",
            "-",
        ],
        stdin=speak.stdout,
        capture_output=True,
        check=False,
    )
    speak.stdout.close()  # type: ignore[union-attr]
    if speak.wait() != 0 or sox.returncode != 0 or not sox.stdout:
        raise RuntimeError(f"espeak-ng/sox failed for voice {voice!r}: {sox.stderr.decode(errors='replace')[:200]}")
    return np.frombuffer(sox.stdout, dtype="<i2").astype(np.float32) / 32768.0


def _colored_noise(rng: np.random.Generator, n: int, kind: str) -> np.ndarray:
    white = rng.standard_normal(n)
    if kind == "white":
        return white
    spectrum = np.fft.rfft(white)
    f = np.maximum(np.arange(spectrum.shape[0]), 1.0)
    spectrum /= np.sqrt(f) if kind == "pink" else f
    return np.fft.irfft(spectrum, n)


def _babble(rng: np.random.Generator, n: int) -> np.ndarray:
    # Speech-shaped, syllable-rate modulated noise: a cheap stand-in for far-away talkers.
    base = _colored_noise(rng, n, "pink")
    t = np.arange(n) / SAMPLE_RATE
    env = np.ones(n)
    for _ in range(3):
        env += 0.8 * np.sin(2 * np.pi * rng.uniform(2.0, 6.0) * t + rng.uniform(0, 2 * np.pi))
    return base * np.maximum(env, 0.0)


def _reverb(rng: np.random.Generator, x: np.ndarray, rt60_s: float) -> np.ndarray:
    n = int(rt60_s * SAMPLE_RATE)
    t = np.arange(n) / SAMPLE_RATE
    ir = rng.standard_normal(n) * np.exp(-6.9 * t / rt60_s)  # -60 dB at rt60
    ir[0] = 1.0 / 0.3  # the direct path dominates
    wet = np.fft.irfft(np.fft.rfft(x, len(x) + n) * np.fft.rfft(ir, len(x) + n), len(x) + n)[: len(x)]
    return wet * (np.max(np.abs(x)) / max(np.max(np.abs(wet)), 1e-9))


def render(text: str, recipe: Recipe) -> np.ndarray:
    """The utterance's samples: float32, 16 kHz, in [-1, 1] (quantised to 16 bits, as a WAV would be)."""
    rng = np.random.default_rng(recipe.seed)
    speech = espeak(text, recipe.voice, recipe.speed_wpm, recipe.pitch).astype(np.float64)
    speech = speech * (0.5 / max(np.max(np.abs(speech)), 1e-6))
    if recipe.rt60_s > 0:
        speech = _reverb(rng, speech, recipe.rt60_s)
    x = np.concatenate([np.zeros(int(recipe.lead_s * SAMPLE_RATE)), speech, np.zeros(int(recipe.tail_s * SAMPLE_RATE))])
    if recipe.noise:
        noise = _babble(rng, len(x)) if recipe.noise == "babble" else _colored_noise(rng, len(x), recipe.noise)
        p_speech = np.mean(speech**2)
        noise *= np.sqrt(p_speech / max(np.mean(noise**2), 1e-12) / 10 ** (recipe.snr_db / 10))
        x = x + noise
    x = x * 10 ** (recipe.gain_db / 20)
    return (np.clip(np.round(x * 32767), -32768, 32767) / 32768.0).astype(np.float32)


def write_wav(path: Path, samples: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pcm = np.clip(np.round(samples * 32768.0), -32768, 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SAMPLE_RATE)
        w.writeframes(pcm.tobytes())


def recipe_from_dict(d: dict) -> Recipe:
    return Recipe(**d)


def regenerate(manifest: Path, only_missing: bool = False) -> int:
    """Write every WAV a manifest names, from the ``synth`` recipe on its line. Returns how many were written."""
    count = 0
    for number, line in enumerate(manifest.read_text().splitlines(), 1):
        if not line.strip():
            continue
        item = json.loads(line)
        if "synth" not in item:
            raise ValueError(f"{manifest}:{number}: no 'synth' recipe to regenerate {item.get('audio')!r} from")
        path = manifest.parent / item["audio"]
        if only_missing and path.is_file():
            continue
        write_wav(path, render(item["text"], recipe_from_dict(item["synth"])))
        count += 1
    return count


def make_manifest(path: Path, texts: list[str], split: str, seed: int, folder: str, accent: str | None = None) -> None:
    """A manifest of ``texts`` with fresh recipes (``accent`` forces one accent) and write its WAVs."""
    r = random.Random(f"manifest:{path.name}:{seed}")
    lines = []
    for i, text in enumerate(texts):
        recipe = random_recipe(r, split)
        if accent is not None:
            recipe = Recipe(
                **{
                    **asdict(recipe),
                    "voice": accent + recipe.voice[recipe.voice.find("+") :] if "+" in recipe.voice else accent,
                }
            )
        lines.append(json.dumps({"audio": f"{folder}/{i:04d}.wav", "text": text, "synth": asdict(recipe)}))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    regenerate(path)


def write_eval_manifests(out: Path) -> None:
    """The fixed evaluation sets (seeded; text from ``corpus``):

    - ``heldout.jsonl``: 200 held-out sentences, held-out voice variants of the training accents;
    - ``unseen-accent.jsonl``: 100 other held-out sentences in an accent absent from training;
    - ``calib.jsonl``: 100 training-split sentences in training voices with fresh recipes, for INT8
      calibration (never scored, and disjoint from the held-out sets).
    """
    import corpus

    held = corpus.unique_sentences("heldout", 300, seed=2024)
    make_manifest(out / "heldout.jsonl", held[:200], "heldout", 1, "heldout")
    make_manifest(out / "unseen-accent.jsonl", held[200:], "heldout", 2, "unseen-accent", accent=UNSEEN_ACCENT)
    make_manifest(out / "calib.jsonl", corpus.unique_sentences("train", 100, seed=77), "train", 3, "calib")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    q = sub.add_parser("regenerate", help="write the WAVs a manifest's synth recipes describe")
    q.add_argument("manifest", type=Path)
    q.add_argument("--only-missing", action="store_true")
    q = sub.add_parser("manifests", help="write the evaluation and calibration manifests (and their WAVs)")
    q.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[2] / "calibration" / "asr")
    q = sub.add_parser("say", help="synthesise one sentence to a WAV")
    q.add_argument("text")
    q.add_argument("out", type=Path)
    q.add_argument("--voice", default="en-us")
    args = p.parse_args(argv)
    if args.cmd == "manifests":
        write_eval_manifests(args.out)
    elif args.cmd == "regenerate":
        n = regenerate(args.manifest, args.only_missing)
        print(f"wrote {n} WAVs next to {args.manifest}", file=sys.stderr)
    else:
        write_wav(args.out, render(args.text, Recipe(args.voice, 160, 50, 0.0, 0.2, 0.2, "", 30.0, 0.0, 0)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
