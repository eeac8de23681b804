"""Choose the beam width, LM weight and word bonus of a streaming CTC folder on the calibration set.

    .venv/bin/python scripts/train_asr/tune_lm.py MODEL_DIR calibration/asr/calib.jsonl

Runs with the runtime environment (edge_agent, numpy, onnxruntime). The calibration set has
training-split sentences and training voices, so the held-out sets stay untouched by tuning. The
best triple (lowest WER; ties to the narrower beam, then the smaller weight) is written into
``config.json`` (``lm_beam``, ``lm_weight``, ``lm_word_bonus``).
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from edge_agent.audio.wav import read_audio  # noqa: E402
from edge_agent.bench.eval_asr import read_manifest  # noqa: E402
from edge_agent.metrics.wer import error_rates  # noqa: E402
from edge_agent.models.asr_streaming_ctc import StreamingCtcRunner  # noqa: E402

BEAMS = (24, 48, 96, 192)
WEIGHTS = (0.3, 0.5, 0.8, 1.2)
BONUSES = (0.0, 1.0, 2.0, 3.0, 4.0, 5.0)


def main() -> int:
    folder, manifest = Path(sys.argv[1]), Path(sys.argv[2])
    runner = StreamingCtcRunner(folder)
    spec = runner.spec
    assert spec.lm is not None and spec.lexicon is not None, "needs lm.arpa and lexicon.txt"
    items = read_manifest(manifest)
    lps = [runner.full(read_audio(u.audio)[0]) for u in items]
    results = []
    for beam in BEAMS:
        for w in WEIGHTS:
            for b in BONUSES:
                lm = replace(spec.lm, weight=w, word_bonus=b)
                hyps = [runner.decode(lp, "lm", beam=beam, lm=lm) for lp in lps]
                words, _ = error_rates(zip((u.text for u in items), hyps))
                results.append((round(words.rate, 6), beam, w, b))
                print(f"beam {beam} lm_weight {w} word_bonus {b}: WER {100 * words.rate:.2f}%", file=sys.stderr)
    rate, beam, w, b = min(results)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config.update({"lm_beam": beam, "lm_weight": w, "lm_word_bonus": b})
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    print(
        f"chose lm_beam {beam}, lm_weight {w}, lm_word_bonus {b} (calibration WER {100 * rate:.2f}%)", file=sys.stderr
    )
    runner.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
