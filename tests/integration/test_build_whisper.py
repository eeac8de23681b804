"""The Whisper build path (engines/whisper_engine.py) on a tiny random Whisper imported from CTranslate2's
format: engines/whisper-base.toml's graphs built into one engine folder, gated by the recogniser's WER.

Random weights say nothing about accuracy (the real Whisper base is judged by the recipe itself); these
tests check the build: every graph converted (MatMulNBits in each int8w graph, float weights gone),
the engine folder opens as a Whisper folder, the FP32 engine's greedy ids are the source folder's, the
gate's WER is the one computed from the transcripts it reports, and the INT8 encoder keeps FP32 the
products its state budget needs (measured again here on the built engine, and one fewer is over budget)."""

from __future__ import annotations

import json
import re
import wave
from pathlib import Path

import numpy as np
import pytest

from edge_agent.engines.cache import EngineCache
from edge_agent.engines.pipeline import BuildRequest, Heartbeat, Pipeline
from edge_agent.engines.recipes import load_recipe
from edge_agent.systemd import Notifier
from tests import ct2_whisper_tiny as tiny

pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
ROOT = Path(__file__).resolve().parents[2]
GRAPHS = ("encoder_model.onnx", "decoder_model.onnx", "decoder_with_past_model.onnx")


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    from edge_agent.importers import import_model

    root = tmp_path_factory.mktemp("whisper-build")
    tiny.write_folder(root / "src", "float32")
    folder = import_model(root / "src", root / "models" / "imported" / "tiny-whisper", root / "models").path
    rng = np.random.default_rng(4)
    lines = []
    for i in range(2):
        pcm = (rng.standard_normal(16000) * 3000).astype(np.int16)
        with wave.open(str(root / f"u{i}.wav"), "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(16000)
            w.writeframes(pcm.tobytes())
        lines.append(json.dumps({"audio": f"u{i}.wav", "text": "turn on the light"}))
    (root / "heldout.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def pipeline(source: Path, tmp_path: Path) -> Pipeline:
    text = (ROOT / "engines" / "whisper-base.toml").read_text()
    text = text.replace('model = "whisper-base"', f'model = "{source}"')
    for manifest in ("voices-heldout.jsonl", "voices-calib.jsonl"):
        text = text.replace(f'"../calibration/asr/{manifest}"', f'"{source.parent.parent.parent / "heldout.jsonl"}"')
    text = re.sub(r"samples = \d+", "samples = 2", text)
    text = re.sub(r"max_wer_delta = [0-9.]+", "max_wer_delta = 1.0", text)
    path = tmp_path / "whisper.toml"
    path.write_text(text)
    return Pipeline(
        load_recipe(path),
        EngineCache(tmp_path / "engines", 1 << 30),
        tmp_path / "models",
        threads=1,
        heartbeat=Heartbeat(enabled=False, notifier=Notifier({})),
    )


def test_int8w_builds_every_graph_and_is_scored_by_wer(source: Path, tmp_path: Path) -> None:
    from edge_agent.engines.gate import asr_metrics

    p = pipeline(source, tmp_path)  # every graph at int8w (the shipped recipe keeps its decoders FP32)
    p.recipe = p.recipe.model_copy(update={"precisions": [*p.recipe.precisions, "int8w"], "float_graphs": []})
    report = p.build(BuildRequest("cpu", "int8w"))
    folder = Path(report["path"]) / "model"
    for name in GRAPHS:
        ops = {n.op_type for n in onnx.load(str(folder / name)).graph.node}
        assert "MatMulNBits" in ops, name
    assert {"config.json", "tokenizer.json", "preprocessor_config.json", "generation_config.json"} <= {
        p.name for p in folder.iterdir()
    }
    acc = report["accuracy"]
    manifest = json.loads((Path(report["path"]) / "manifest.json").read_text())
    assert manifest["graph"] == "model/encoder_model.onnx"
    m = acc["metrics"]
    assert m["utterances"] == 2 and acc["passed"]
    assert set(report["conversion"]["graphs"]) == set(GRAPHS)
    # the gate's numbers are those of the texts: recompute WER from a fresh run of both folders
    from edge_agent.engines.datasets import read_audio_manifest
    from edge_agent.engines.whisper_engine import WhisperProbe
    from edge_agent.models.catalog import inspect_folder

    probe = WhisperProbe(inspect_folder(source))
    samples = read_audio_manifest(source.parent.parent.parent / "heldout.jsonl", 2, need_text=True)
    texts = {}
    for which, path in (("fp32", source), ("int8w", folder)):
        rec = probe.runner(path)
        texts[which] = probe.run(rec, samples)[1]
        rec.close()
    want = asr_metrics([s.text for s in samples], texts["fp32"], texts["int8w"])
    assert m["wer"] == pytest.approx(want["wer"]) and m["wer_fp32"] == pytest.approx(want["wer_fp32"])


def test_fp32_engine_decodes_as_the_source_folder(source: Path, tmp_path: Path) -> None:
    from edge_agent.engines.whisper_engine import WhisperProbe
    from edge_agent.models.catalog import inspect_folder

    report = pipeline(source, tmp_path).build(BuildRequest("cpu", "fp32"))
    probe = WhisperProbe(inspect_folder(source))
    x = np.random.default_rng(5).standard_normal(16000).astype(np.float32) * 0.05
    ids = []
    for path in (source, Path(report["path"]) / "model"):
        rec = probe.runner(path)
        rec.guards = False  # plain greedy: the random tiny model "hears" nothing in noise with its guards on
        ids.append(rec.transcribe(x).token_ids)
        rec.close()
    assert ids[0] == ids[1] and len(ids[0]) > 0


def test_a_whisper_recipe_lists_its_graphs() -> None:
    from edge_agent.engines.recipes import Recipe

    recipe = load_recipe(ROOT / "engines" / "whisper-base.toml")
    assert recipe.graphs == list(GRAPHS) and "int8" in recipe.precisions
    assert recipe.float_graphs == list(GRAPHS[1:])  # its INT8 engine quantizes the encoder alone
    with pytest.raises(ValueError, match="weight-only"):
        Recipe(name="x", model="x", workload="asr", targets=["cpu"], precisions=["int8w"])
    with pytest.raises(ValueError, match="graphs"):
        Recipe(name="x", model="x", workload="llm", targets=["cpu"], precisions=["fp32"], graphs=["a.onnx"])


def test_float_graphs_stay_as_exported_while_the_encoder_is_quantized(source: Path, tmp_path: Path) -> None:
    # an INT8 engine of the encoder alone: the decoders (small per call, and where words are chosen) stay FP32
    p = pipeline(source, tmp_path)
    p.recipe = p.recipe.model_copy(update={"float_graphs": list(GRAPHS[1:])})
    report = p.build(BuildRequest("cpu", "int8"))
    folder = Path(report["path"]) / "model"
    encoder = onnx.load(str(folder / GRAPHS[0])).graph
    int8 = [n for n in encoder.node if n.op_type in ("MatMulInteger", "DynamicQuantizeMatMul")]
    source = onnx.load(str(source / GRAPHS[0])).graph
    weights = {i.name for i in source.initializer}
    products = [n for n in source.node if n.op_type in ("MatMul", "Gemm")]
    with_weight = [n for n in products if n.input[1] in weights]
    assert len(int8) == len(with_weight) > 0
    # attention's query-key and probability-value products (two activations) stay float
    assert sum(n.op_type == "MatMul" for n in encoder.node) == len(products) - len(with_weight) > 0
    for name in GRAPHS[1:]:
        graph = onnx.load(str(folder / name)).graph
        assert not {n.op_type for n in graph.node} & {"MatMulInteger", "DynamicQuantizeMatMul", "MatMulNBits"}
        floats = {i.data_type for i in graph.initializer if len(i.dims) == 2}
        assert floats == {onnx.TensorProto.FLOAT}, name
    assert "kept FP32" in report["conversion"]["graphs"][GRAPHS[1]]["tool"]
    assert report["accuracy"]["metrics"]["utterances"] == 2


def _states(encoder: Path, feats) -> list[np.ndarray]:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(encoder), providers=["CPUExecutionProvider"])
    return [sess.run(["last_hidden_state"], {"input_features": f})[0] for f in feats]


def _error(encoder: Path, ref: list[np.ndarray], feats) -> float:
    return float(np.mean([np.linalg.norm(a - b) / np.linalg.norm(b) for a, b in zip(_states(encoder, feats), ref)]))


def test_the_int8_encoder_keeps_its_costliest_matmuls_fp32_until_its_states_are_within_budget(
    source: Path, tmp_path: Path
) -> None:
    from edge_agent.engines.quantize_ort import quantize_weights_dynamic
    from edge_agent.engines.recipes import DynamicInt8Spec
    from edge_agent.engines.stages import BuildRequest as Req
    from edge_agent.engines.stages import calibration_path
    from edge_agent.engines.whisper_engine import WHISPER_INT8_OPS, calibration_features

    p = pipeline(source, tmp_path)
    assert p.recipe.dynamic is not None and p.recipe.dynamic.max_state_error > 0  # the shipped recipe uses it
    loose = p.recipe.model_copy(update={"dynamic": DynamicInt8Spec(max_state_error=1.0)})
    p.recipe = loose
    first = p.build(BuildRequest("cpu", "int8"))["conversion"]["graphs"][GRAPHS[0]]
    e0 = first["sensitivity"]["error_all_int8"]
    assert e0 > 0 and "nodes" not in first["sensitivity"] and "excluded_nodes" not in first

    budget = e0 / 3
    (tmp_path / "tight").mkdir()
    p = pipeline(source, tmp_path / "tight")
    p.recipe = p.recipe.model_copy(update={"dynamic": DynamicInt8Spec(max_state_error=budget)})
    report = p.build(BuildRequest("cpu", "int8"))
    sens = report["conversion"]["graphs"][GRAPHS[0]]["sensitivity"]
    kept = sens["nodes"]
    assert 0 < len(kept) < sens["of"] and sens["error"] <= budget
    # measured again here, on the built engine's encoder (optimized) against the FP32 source's states
    feats = calibration_features(p.stage_context(), calibration_path(p.recipe, Req("cpu", "int8")))
    ref = _states(source / GRAPHS[0], feats)
    built = Path(report["path"]) / "model" / GRAPHS[0]
    assert _error(built, ref, feats) == pytest.approx(sens["error"], rel=0.05, abs=1e-4)
    graph = onnx.load(str(built)).graph
    assert sum(n.op_type == "DynamicQuantizeMatMul" for n in graph.node) == sens["of"] - len(kept)
    # the pass stopped at the first of its ranked matmuls that brings the error within budget
    shorter = tmp_path / "shorter.onnx"
    quantize_weights_dynamic(source / GRAPHS[0], shorter, WHISPER_INT8_OPS, kept[:-1])
    assert _error(shorter, ref, feats) > budget


def test_dynamic_needs_a_whisper_int8_build_and_calibration_audio() -> None:
    from edge_agent.engines.recipes import Recipe

    base = dict(name="x", model="x", workload="asr", targets=["cpu"], onnx_file=GRAPHS[0], graphs=list(GRAPHS))
    with pytest.raises(ValueError, match=r"max_state_error needs \[calibration\]"):
        Recipe(**base, precisions=["int8"], dynamic={"max_state_error": 0.05})
    with pytest.raises(ValueError, match="does not build"):
        Recipe(**base, precisions=["fp32"], dynamic={"max_state_error": 0.05}, calibration={"data": "c.jsonl"})
    ok = Recipe(**base, precisions=["int8"], dynamic={"max_state_error": 0.05}, calibration={"data": "c.jsonl"})
    assert ok.fingerprint()["dynamic"] == {"max_state_error": 0.05}
    assert "dynamic" not in Recipe(**base, precisions=["int8"]).fingerprint()  # older keys unchanged


def test_float_graphs_must_name_some_of_graphs() -> None:
    from edge_agent.engines.recipes import Recipe

    base = dict(name="x", model="x", workload="asr", targets=["cpu"], precisions=["int8"], onnx_file=GRAPHS[0])
    with pytest.raises(ValueError, match=r"float_graphs: 'decoder\.onnx' is not one of graphs"):
        Recipe(**base, graphs=list(GRAPHS), float_graphs=["decoder.onnx"])
    with pytest.raises(ValueError, match="keeps every graph FP32"):
        Recipe(**base, graphs=list(GRAPHS), float_graphs=list(GRAPHS))
    assert Recipe(**base, graphs=list(GRAPHS), float_graphs=list(GRAPHS[1:])).float_graphs == list(GRAPHS[1:])
