"""Write the natural-voice speech manifests (calibration/asr/voices-*.jsonl): text and recipe, no audio.

    .venv/bin/python scripts/voice_manifests.py          # rewrites both manifests (deterministic)
    scripts/asr-eval-audio                               # then synthesises their WAVs

``voices-heldout.jsonl``: 48 sentences: the 31 spoken home commands (demo, development and held-out sets of
``demo_models/home_commands.py``) and the first 17 distinct sentences of the espeak-ng held-out set (the
voice-assistant domain), each spoken by 3 of the 8 standard voices in turn (``engines/voices.py``: Piper joe
at three length/noise settings, flite slt/rms/awb/kal16, espeak-ng en-us as the stress voice), so every
voice says 18 sentences. ``voices-calib.jsonl``: 48 sentences of the training split (``calib.jsonl``), the
same rotation: for calibration only, disjoint from the held-out sentences.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edge_agent.demo_models.home_commands import DEMO, DEV, HELD_OUT  # noqa: E402
from edge_agent.engines.voices import STANDARD, recipe  # noqa: E402

PER_SENTENCE = 3


def distinct(manifest: Path, count: int, skip: set[str]) -> list[str]:
    out: list[str] = []
    for line in manifest.read_text().splitlines():
        text = json.loads(line)["text"]
        if text not in skip and text not in out:
            out.append(text)
        if len(out) == count:
            break
    return out


def write(name: str, sentences: list[str], seed: int) -> None:
    rng = random.Random(seed)
    folder = ROOT / "calibration" / "asr"
    lines: list[dict] = []
    for k, text in enumerate(sentences):
        for j in range(PER_SENTENCE):
            voice = STANDARD[(PER_SENTENCE * k + j) % len(STANDARD)]
            synth = recipe(voice, round(rng.uniform(0.2, 0.6), 2), round(rng.uniform(0.4, 0.8), 2))
            lines.append({"audio": f"{name}/{len(lines):04d}.wav", "text": text, "voice": voice.label, "synth": synth})
    (folder / f"{name}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    print(f"{name}.jsonl: {len(lines)} utterances, {len(sentences)} sentences")


def main() -> None:
    asr = ROOT / "calibration" / "asr"
    commands = [c.text for c in (*DEMO, *DEV, *HELD_OUT)]
    write("voices-heldout", commands + distinct(asr / "heldout.jsonl", 48 - len(commands), set(commands)), 44)
    write("voices-calib", distinct(asr / "calib.jsonl", 48, set(commands)), 45)


if __name__ == "__main__":
    main()
