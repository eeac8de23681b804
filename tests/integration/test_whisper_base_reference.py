"""The imported Whisper base against CTranslate2 on the same model.bin (the reference faster-whisper runs on).

Same log-mel features into both: the encoder outputs agree within 5e-3 (absolute, on activations of
magnitude ~25: float32 sums in another order), the decoder's logits along CTranslate2's greedy path within
1e-3, and greedy decoding (same prompt, same suppression) gives the same token ids on every utterance of
a speech set of several voices and speeds. The features the tier serves with (padded as faster-whisper
pads them) equal faster-whisper's own within 2e-3, and its transcripts equal faster-whisper's greedy
``transcribe`` of the same WAVs, word for word.
"""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from tests import whisper_base

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("whisper-base")
    folder = whisper_base.imported_folder(tmp)
    python = whisper_base.reference_python()
    speech = whisper_base.speech_set(tmp)
    return tmp, folder, python, speech


def test_encoder_logits_and_greedy_ids_match_ctranslate2(setup):
    import soundfile as sf

    from edge_agent.models.asr import open_recognizer
    from edge_agent.models.catalog import inspect_folder
    from edge_agent.models.whisper_features import log_mel_spectrogram

    tmp, folder, python, speech = setup
    audio = [sf.read(str(w), dtype="float32")[0] for w, _ in speech]
    feats = np.stack([log_mel_spectrogram(x) for x in audio])
    np.savez(tmp / "in.npz", features=feats, wavs=np.array([str(w) for w, _ in speech]))
    script = whisper_base.REPO / "scripts" / "whisper_reference.py"
    subprocess.run(
        [str(python), str(script), str(whisper_base.ct2_folder()), str(tmp / "in.npz"), str(tmp / "ref.npz")],
        check=True,
    )
    ref = np.load(tmp / "ref.npz")
    rec = open_recognizer(inspect_folder(folder), language="en")
    # the imported folder pads its log-mel as faster-whisper does (preprocessor_config feature_padding)
    assert rec.features.feature_padding == "log_mel"
    served = np.stack([log_mel_spectrogram(x, rec.features) for x in audio])
    np.testing.assert_allclose(served, ref["fw_features"], atol=2e-3, rtol=0)
    for i, x in enumerate(audio):
        hidden = rec.encode_features(feats[i : i + 1])
        np.testing.assert_allclose(hidden[0], ref["encoder"][i], atol=5e-3, rtol=0)
        theirs = list(ref[f"greedy_ids_{i}"])
        prompt = rec.prompt("en")
        logits = rec.decoder.run({"input_ids": np.array([prompt + theirs], np.int64), "encoder_hidden_states": hidden})[
            "logits"
        ][0, len(prompt) - 1 :]
        want = ref[f"step_logits_{i}"]
        assert want.shape[0] == len(theirs) + 1  # each generated token, then the end of text
        finite = want > -1e30  # CTranslate2 returns suppressed entries at float32's lowest
        np.testing.assert_allclose(logits[finite], want[finite], atol=1e-3, rtol=0)
        # greedy ids on the same features (the default, silence-padded extractor's): CTranslate2's exactly
        ids = rec.decode(hidden, [prompt], [[]], [rec._budget(len(x) / 16000, 0)])[0]
        assert ids == theirs, (speech[i][1], rec.text(ids), rec.text(theirs))
    # and what the tier serves, end to end, is faster-whisper's transcribe of the same WAV
    served_texts = [rec.transcribe(x).text for x in audio]
    assert served_texts == [str(t) for t in ref["texts"]]
    rec.close()
