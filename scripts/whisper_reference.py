"""The independent reference for imported Whisper folders: CTranslate2 and faster-whisper on the same model.bin.

Runs in its own venv (scripts/requirements-whisper-reference.txt), never next to the runtime:

    .venv-wyoming/bin/python scripts/whisper_reference.py CT2_DIR IN.npz OUT.npz

IN.npz holds ``features`` float32 [N, mels, 3000] (log-mel computed by the agent) and ``wavs`` (paths of
16 kHz mono WAVs). OUT.npz gets, from CTranslate2's own Whisper at compute_type float32:

- ``encoder`` [N, 1500, d]: ``Whisper.encode`` of each feature row;
- ``greedy_ids_<n>``: greedy ids (beam 1, faster-whisper's suppression) after the English prompt
  ``<|startoftranscript|><|en|><|transcribe|><|notimestamps|>``;
- ``step_logits_<n>`` [steps, V]: the logits CTranslate2 computed at each of those steps
  (``return_logits_vocab``), suppressed entries included as it returns them;

and, for the ``wavs``: ``fw_features`` [N, mels, 3000], faster-whisper's own log-mel of each WAV as its
``transcribe`` feeds the model (``FeatureExtractor``, the last frame dropped, zeros to 3000 frames), and
``texts``, its ``WhisperModel.transcribe`` of each (greedy: beam 1, temperature 0, no timestamps, no VAD
filter, not conditioned on previous text, language en).
"""

from __future__ import annotations

import sys

import ctranslate2
import numpy as np
from faster_whisper import WhisperModel
from faster_whisper.audio import decode_audio, pad_or_trim
from faster_whisper.feature_extractor import FeatureExtractor


def main() -> int:
    ct2_dir, src, dst = sys.argv[1:4]
    data = np.load(src, allow_pickle=False)
    feats, wavs = data["features"], [str(w) for w in data["wavs"]]
    model = ctranslate2.models.Whisper(ct2_dir, device="cpu", compute_type="float32", intra_threads=2)
    out: dict[str, np.ndarray] = {}
    enc = []
    for i in range(feats.shape[0]):
        sv = model.encode(ctranslate2.StorageView.from_array(np.ascontiguousarray(feats[i : i + 1])), to_cpu=True)
        enc.append(np.array(sv)[0])
        prompt = ["<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>"]
        res = model.generate(
            ctranslate2.StorageView.from_array(np.ascontiguousarray(feats[i : i + 1])),
            [prompt],
            beam_size=1,
            return_logits_vocab=True,
            max_length=448,
        )[0]
        out[f"greedy_ids_{i}"] = np.asarray(res.sequences_ids[0], np.int64)
        out[f"step_logits_{i}"] = np.stack([np.array(x).reshape(-1) for x in res.logits[0]]).astype(np.float32)
    out["encoder"] = np.stack(enc).astype(np.float32)
    extractor = FeatureExtractor(feature_size=feats.shape[1])
    fw_feats = []
    for w in wavs:
        f = extractor(decode_audio(w))
        fw_feats.append(pad_or_trim(f[:, : f.shape[-1] - 1]))
    out["fw_features"] = np.stack(fw_feats).astype(np.float32) if fw_feats else np.zeros((0,), np.float32)
    texts = []
    fw = WhisperModel(ct2_dir, device="cpu", compute_type="float32", cpu_threads=2) if wavs else None
    for w in wavs:
        assert fw is not None
        segments, _ = fw.transcribe(
            w,
            beam_size=1,
            temperature=0.0,
            without_timestamps=True,
            condition_on_previous_text=False,
            vad_filter=False,
            language="en",
        )
        texts.append(" ".join(s.text.strip() for s in segments).strip())
    out["texts"] = np.array(texts)
    np.savez(dst, **out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
