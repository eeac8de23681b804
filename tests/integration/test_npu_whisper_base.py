"""The real Whisper base (fetched and imported as ``models fetch whisper-base`` does) on the emulated NPU
(``npu_emulation = "cpu"``) against the CPU path (ONNX Runtime on the folder's dynamic graphs, which
``test_whisper_base_reference.py`` checks against CTranslate2): on spoken sentences (espeak-ng, several
voices and speeds) the NPU's transcripts and token ids equal the CPU's, in one pass and streamed."""

from __future__ import annotations

import pytest

from edge_agent.backends import SessionOptions, npu
from tests import whisper_base

pytestmark = pytest.mark.slow
pytest.importorskip("openvino")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import soundfile as sf

    from edge_agent.models.asr import open_recognizer
    from edge_agent.models.catalog import inspect_folder

    tmp = tmp_path_factory.mktemp("npu-whisper-base")
    ref = inspect_folder(whisper_base.imported_folder(tmp))
    speech = whisper_base.speech_set(tmp, whisper_base.SENTENCES[:4])
    audio = [(sf.read(str(w), dtype="float32")[0], text) for w, text in speech]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(npu.EMULATION_ENV, "cpu")
        cpu = open_recognizer(ref, "onnxruntime", language="en", partial_context_s=0)  # 30 s partials too
        on_npu = open_recognizer(ref, "openvino", SessionOptions(device="NPU"), language="en")
        yield cpu, on_npu, audio
        cpu.close()
        on_npu.close()


def test_transcripts_on_the_emulated_npu_equal_the_cpu(setup) -> None:
    cpu, on_npu, audio = setup
    for x, text in audio:
        want, got = cpu.transcribe(x), on_npu.transcribe(x)
        assert got.token_ids == want.token_ids, (text, want.text, got.text)
        assert got.text == want.text
    # the model hears them: the transcripts are the sentences (not an empty or looping decode)
    assert [cpu.transcribe(x).text.lower().strip(".?") for x, _ in audio[:2]] == [t for _, t in audio[:2]]


def test_a_streamed_utterance_on_the_emulated_npu_equals_the_cpu(setup) -> None:
    cpu, on_npu, audio = setup
    x = audio[1][0]

    def run(engine):
        s = engine.new_stream()
        seen = []
        for start in range(0, x.size, 8000):
            s.add_audio(x[start : start + 8000])
            h = engine.step([s])[0]
            seen.append(None if h is None else (h.token_ids, h.stable_text, h.final))
        s.end()
        h = engine.step([s])[0]
        seen.append((h.token_ids, h.stable_text, h.final))
        return seen

    want = run(cpu)
    assert want[-1][2] and any(h is not None and not h[2] for h in want[:-1])
    assert run(on_npu) == want
    assert on_npu.capacity == 448  # the model's max_target_positions: no shorter cache by default
