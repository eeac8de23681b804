"""Whisper on the NPU (OpenVINO's NPU plugin on the CPU, ``npu_emulation = "cpu"``), on a tiny random
Whisper written in CTranslate2's format and imported.

The reference is the CPU path on ONNX Runtime (the folder's dynamic graphs, themselves checked against
Whisper in numpy by ``test_ct2_whisper_import.py``): the NPU's decoder step, fed token by token into its
fixed cache, gives the logits of ``decoder_with_past_model.onnx`` at every step within 1e-4, and greedy
decoding the same token ids, in one pass and streamed (partials and finals, several streams in one
step). A decode that reaches the cache's capacity stops there and says so; a folder the NPU form
cannot be built from is refused, naming what to import instead.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from edge_agent.backends import SessionOptions, npu
from edge_agent.errors import InputError, ModelError
from edge_agent.models.asr import open_recognizer
from edge_agent.models.catalog import resolve_model
from tests import ct2_whisper_tiny as tiny

pytest.importorskip("openvino")
pytest.importorskip("onnxruntime")

NPU = SessionOptions(device="NPU")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from edge_agent.importers import import_model

    root = tmp_path_factory.mktemp("npu-whisper")
    tiny.write_folder(root / "src", "float16")
    result = import_model(root / "src", None, root / "cache")
    return resolve_model(result.name, root / "cache")


@pytest.fixture(scope="module")
def pair(folder):
    """The CPU recogniser (30 s partials, as on the NPU) and the emulated NPU's, on the same folder; plain
    greedy (no guards: the random weights repeat a token, which the repetition guard would cut short)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(npu.EMULATION_ENV, "cpu")
        cpu = open_recognizer(folder, "onnxruntime", language="en", partial_context_s=0, guards=False)
        on_npu = open_recognizer(folder, "openvino", NPU, language="en", guards=False)
        yield cpu, on_npu
        cpu.close()
        on_npu.close()


def _audio(seed: int, seconds: float) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(int(16000 * seconds)).astype(np.float32) * 0.05


def test_the_npu_form_is_static_and_fixed_size(pair) -> None:
    _, on_npu = pair
    assert type(on_npu).__name__ == "NpuWhisperRecognizer"
    assert on_npu.capacity == tiny.TGT and not on_npu.short_context
    assert on_npu.encoder.inputs[0].shape == (1, tiny.MELS, 3000)
    assert all(i.is_static for i in on_npu.step_session.inputs)
    cache = next(i for i in on_npu.step_session.inputs if i.name == "past_key_values.0.decoder.key")
    assert cache.shape == (1, tiny.HEADS, tiny.TGT, tiny.D // tiny.HEADS)


def test_step_logits_equal_the_decoder_with_past_at_every_step(pair) -> None:
    cpu, on_npu = pair
    hidden = cpu.encode([_audio(7, 2.0)])
    np.testing.assert_allclose(on_npu.encode([_audio(7, 2.0)]), hidden, atol=1e-4, rtol=0)
    ids = [*cpu.prompt("en"), 40, 41, 300, 7, 1000, 12, 99, 513]
    res = cpu.decoder.run({"input_ids": np.array([ids[:1]], np.int64), "encoder_hidden_states": hidden})
    past = {k.replace("present.", "past_key_values."): v for k, v in res.items() if k != "logits"}
    want = [res["logits"][0, -1]]
    for t in ids[1:]:
        res = cpu.decoder_past.run({"input_ids": np.array([[t]], np.int64), **past})
        past |= {k.replace("present.", "past_key_values."): v for k, v in res.items() if k != "logits"}
        want.append(res["logits"][0, -1])
    on_npu.start(hidden)
    for step, (t, ref) in enumerate(zip(ids, want)):
        got = on_npu.feed(t)
        assert got.shape == (tiny.VOCAB,)
        np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0, err_msg=f"step {step}")


def test_greedy_ids_equal_the_cpu_in_one_pass(pair) -> None:
    cpu, on_npu = pair
    for seed, seconds in ((0, 1.0), (1, 2.5), (2, 4.0)):
        x = _audio(seed, seconds)
        want, got = cpu.transcribe(x), on_npu.transcribe(x)
        assert len(want.token_ids) > 4
        assert got.token_ids == want.token_ids and got.text == want.text


def test_the_guards_on_the_npu_equal_the_cpus(pair, monkeypatch) -> None:
    """Nothing heard (judged on a lone <|startoftranscript|>, whose cache slot is then given back) and the
    repetition cut: the NPU's decodes equal the CPU's, with the threshold just above and just below the
    model's P(no speech) for the clip."""
    from edge_agent.models import whisper_decoding

    cpu, on_npu = pair
    monkeypatch.setattr(cpu, "guards", True)
    monkeypatch.setattr(on_npu, "guards", True)
    x = _audio(4, 2.0)
    logits = cpu.decoder.run({"input_ids": np.array([[cpu.sot]], np.int64), "encoder_hidden_states": cpu.encode([x])})[
        "logits"
    ][0, -1].astype(np.float64)
    p = float(np.exp(logits[cpu.no_speech_id] - logits.max()) / np.exp(logits - logits.max()).sum())
    prompt = cpu.prompt("en", cpu.context_ids("kitchen light"))

    def both():
        return [e.decode(e.encode([x]), [prompt], [[]], [30], guard=True)[0] for e in (cpu, on_npu)]

    monkeypatch.setattr(whisper_decoding, "NO_SPEECH", p * 1.01)
    want, got = both()
    plain = cpu.decode(cpu.encode([x]), [prompt], [[]], [30])[0]
    assert want and len(want) < len(plain) == 30  # heard, its repetition cut
    assert got == want
    monkeypatch.setattr(whisper_decoding, "NO_SPEECH", p * 0.99)
    assert both() == [[], []]


def test_streamed_partials_and_finals_equal_the_cpu_with_streams_taking_turns(pair) -> None:
    cpu, on_npu = pair
    audio = [_audio(10, 2.0), _audio(11, 1.5)]

    def run(engine):
        streams = [engine.new_stream() for _ in audio]
        seen = []
        for start in range(0, 32000, 8000):
            for s, x in zip(streams, audio):
                s.add_audio(x[start : start + 8000])
            seen.append([(h.token_ids, h.stable_text, h.final) if h else None for h in engine.step(streams)])
        for s in streams:
            s.end()
        seen.append([(h.token_ids, h.stable_text, h.final) if h else None for h in engine.step(streams)])
        return seen

    want = run(cpu)
    assert want[-1][0][2] and want[-1][1][2]  # both ended in a final
    assert any(h is not None and not h[2] for row in want[:-1] for h in row)  # and partials before
    assert run(on_npu) == want


def test_a_decode_that_reaches_the_capacity_stops_there(folder, monkeypatch, caplog) -> None:
    from edge_agent.models import asr_whisper_npu

    monkeypatch.setenv(npu.EMULATION_ENV, "cpu")
    monkeypatch.setattr(asr_whisper_npu, "_INLINE_LIMIT", 0)  # and the graphs' weights in external data files
    small = open_recognizer(folder, "openvino", NPU, language="en", npu_capacity=8)
    try:
        assert small.capacity == small.max_positions == 8
        hidden = small.encode([_audio(3, 3.0)])
        prompt = small.prompt("en")
        with caplog.at_level(logging.WARNING):
            ids = small.decode(hidden, [prompt], [[]], [40], stop_at_eot=False)[0]
        assert len(prompt) + len(ids) == 8
        assert "the decoder's cache holds 8 positions" in caplog.text
        small.start(hidden)
        for t in prompt + ids:
            small.feed(t)
        with pytest.raises(InputError, match="cache holds 8 positions"):
            small.feed(ids[-1])
    finally:
        small.close()


def test_a_folder_not_made_by_models_import_is_refused_naming_the_way(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(npu.EMULATION_ENV, "cpu")
    ref = resolve_model("demo-whisper", tmp_path / "models")  # an optimum export: dynamic graphs only
    with pytest.raises(ModelError, match=r"not from `edge-agent models import`.*models import DIR"):
        open_recognizer(ref, "openvino", NPU)
