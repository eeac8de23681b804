"""OpenVINO INT4 with NNCF's data-aware options: the recipe's ``[weight_only.openvino]`` keys reach
``nncf.compress_weights`` (with prefills of the calibration text as its dataset), and the compressed IR runs
on OpenVINO's CPU plugin with logits close to the FP32 model's (ONNX Runtime on the source graph)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("openvino")
nncf = pytest.importorskip("nncf")

from edge_agent.engines import int4_sensitivity as sv  # noqa: E402
from edge_agent.engines import quantize_openvino as qov  # noqa: E402
from edge_agent.engines.recipes import load_recipe  # noqa: E402
from edge_agent.errors import ConfigError, InputError  # noqa: E402
from edge_agent.models.catalog import inspect_folder  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests/data/phi3-optimum-tiny"  # Phi-3 layout, 2 layers, hidden 64, vocabulary 1,024
TEXT = ROOT / "calibration/llm/text/python-reference.txt"

RECIPE = """
name = "tiny-ov"
model = "{model}"
workload = "llm"
targets = ["cpu"]
precisions = ["fp32", "int4"]

[weight_only]
block_size = 32
symmetric = false
calibration = "{text}"
calibration_tokens = 768
{openvino}
"""
OPTIONS = """
[weight_only.openvino]
awq = true
scale_estimation = true
gptq = true
ratio = 0.8
sensitivity_metric = "hessian_input_activation"
backup_mode = "int8_sym"
"""


def _recipe(tmp_path: Path, openvino: str, calibration: bool = True):
    text = RECIPE.format(model=TINY, text=TEXT, openvino=openvino)
    if not calibration:
        text = "\n".join(line for line in text.splitlines() if not line.startswith("calibration"))
    path = tmp_path / "r.toml"
    path.write_text(text)
    return load_recipe(path)


def _fp32_logits(ids: list[int]) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(str(TINY / "model.onnx"), providers=["CPUExecutionProvider"])
    return session.run(["logits"], sv._feeds(session, ids, inspect_folder(TINY).config))[0][0]


def _held_out_prompts() -> list[list[int]]:
    """Prompts of 64 tokens from the text past the calibration tokens (which are its first 768)."""
    ids, _ = sv.calibration_ids(inspect_folder(TINY), TEXT, 1000, 3072)
    return [ids[a : a + 64] for a in range(0, 3072, 256)]


def _ir_cosine(xml: Path, prompts: list[list[int]]) -> float:
    """Mean cosine of the IR's logits (OpenVINO CPU) with FP32's (ONNX Runtime) over every prompt position."""
    import openvino as ov

    core = ov.Core()
    model = core.read_model(str(xml))
    compiled = core.compile_model(model, "CPU")
    config = inspect_folder(TINY).config
    cos = []
    for ids in prompts:
        out = compiled(qov.llm_feeds(model, ids, config))[compiled.output("logits")][0].astype(np.float64)
        ref = _fp32_logits(ids).astype(np.float64)
        assert out.shape == ref.shape
        cos.append((out * ref).sum(-1) / (np.linalg.norm(out, axis=-1) * np.linalg.norm(ref, axis=-1)))
    return float(np.mean(cos))


def test_the_recipe_keys_reach_compress_weights_and_the_ir_runs_close_to_fp32(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:

    seen: list[dict] = []
    real = nncf.compress_weights

    def spy(model, **kwargs):
        seen.append(kwargs)
        return real(model, **kwargs)

    monkeypatch.setattr(nncf, "compress_weights", spy)
    recipe = _recipe(tmp_path, OPTIONS)
    ref = inspect_folder(TINY)
    info = qov.compress_weights_for(TINY / "model.onnx", tmp_path / "ir" / "model.xml", 4, recipe.weight_spec, ref)

    [kwargs] = seen
    ids, bos = sv.calibration_ids(ref, TEXT, 0, 768)
    windows = sv.calibration_windows(ids, bos, 512)
    assert kwargs["mode"] == nncf.CompressWeightsMode.INT4_ASYM and kwargs["group_size"] == 32
    assert kwargs["awq"] is kwargs["scale_estimation"] is kwargs["gptq"] is True
    assert kwargs["ratio"] == 0.8
    assert kwargs["sensitivity_metric"] == nncf.SensitivityMetric.HESSIAN_INPUT_ACTIVATION
    assert kwargs["backup_mode"] == nncf.BackupMode.INT8_SYM
    # the dataset: one prefill per window of the calibration text, BOS first
    items = list(kwargs["dataset"].get_inference_data())
    assert len(items) == len(windows) == kwargs["subset_size"] == info["calibration_windows"]
    assert [list(item["input_ids"][0]) for item in items] == windows
    assert info["calibration"]["tokens"] == len(ids) == 768
    assert info["matmuls_transposed"] > 0  # NNCF's data-aware algorithms take [N, K] weights

    xml = (tmp_path / "ir" / "model.xml").read_text()
    assert 'element_type="u4"' in xml and 'element_type="i8"' in xml  # INT4 groups, the rest at the backup
    # random weights at 4 bits (hidden size 64): data-free INT4 measured 0.91 here, INT8 0.999
    assert _ir_cosine(tmp_path / "ir" / "model.xml", _held_out_prompts()) > 0.85


def test_gptq_on_calibration_text_moves_the_logits_less_than_data_free_int4(tmp_path: Path) -> None:
    """GPTQ fits each layer's output on the calibration activations: on held-out prompts the IR's logits are
    closer to FP32's than data-free INT4's. Scale estimation alone stays near data-free (NNCF's estimate on
    ONNX-layout [K, N] weights, not transposed first, measured 0.41)."""
    ref = inspect_folder(TINY)
    prompts = _held_out_prompts()
    cos = {}
    for name, table in (("free", ""), ("gptq", "gptq = true"), ("scale", "scale_estimation = true")):
        folder = tmp_path / name
        folder.mkdir()
        spec = _recipe(folder, f"[weight_only.openvino]\n{table}" if table else "").weight_spec
        qov.compress_weights_for(TINY / "model.onnx", folder / "m.xml", 4, spec, ref)
        cos[name] = _ir_cosine(folder / "m.xml", prompts)
    assert cos["gptq"] > cos["free"], cos
    assert cos["scale"] > cos["free"] - 0.05, cos


def test_data_free_int4_sends_no_dataset_and_keeps_its_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[dict] = []
    monkeypatch.setattr(nncf, "compress_weights", lambda model, **kw: seen.append(kw) or model)
    spec = _recipe(tmp_path, "").weight_spec  # calibration text set, but no openvino table: as before
    info = qov.compress_weights_for(TINY / "model.onnx", tmp_path / "m.xml", 4, spec, inspect_folder(TINY))
    assert seen == [{"mode": nncf.CompressWeightsMode.INT4_ASYM, "group_size": 32, "ratio": 1.0}]
    assert info == {"tool": f"nncf {nncf.__version__} compress_weights", "mode": "INT4_ASYM", "group_size": 32,
                    "ratio": 1.0}  # fmt: skip
    seen.clear()
    ratio = _recipe(tmp_path, "[weight_only.openvino]\nratio = 0.5", calibration=False).weight_spec
    qov.compress_weights_for(TINY / "model.onnx", tmp_path / "m.xml", 4, ratio, inspect_folder(TINY))
    assert seen == [{"mode": nncf.CompressWeightsMode.INT4_ASYM, "group_size": 32, "ratio": 0.5}]  # data-free mix


def test_bad_openvino_options_are_one_line_naming_the_key(tmp_path: Path) -> None:
    for table, key in (
        ("[weight_only.openvino]\nawq = true", "openvino.awq needs a calibration text"),
        ("[weight_only.openvino]\ngptq = true", "openvino.gptq needs a calibration text"),
        ('[weight_only.openvino]\nsensitivity_metric = "mean_activation_variance"', "openvino.sensitivity_metric"),
        ("[weight_only.openvino]\nratio = 0", "weight_only.openvino.ratio"),
        ("[weight_only.openvino]\nratio = 1.5", "weight_only.openvino.ratio"),
        ("[weight_only.openvino]\nlora = true", "weight_only.openvino.lora"),
        ('[weight_only.openvino]\nbackup_mode = "int4"', "weight_only.openvino.backup_mode"),
    ):
        with pytest.raises(ConfigError) as info:
            _recipe(tmp_path, table, calibration=False)
        assert key in str(info.value) and "\n" not in str(info.value), str(info.value)
    with pytest.raises(InputError, match=r"weight_only\.openvino\.awq needs calibration text"):
        qov.compress_weights(TINY / "model.onnx", tmp_path / "m.xml", 4, 32, False, {"awq": True}, None)
    with pytest.raises(InputError, match="for int4, not 8-bit"):
        qov.compress_weights(TINY / "model.onnx", tmp_path / "m.xml", 8, 32, True, {"awq": True}, None)


def test_an_absent_openvino_table_keeps_the_cache_key(tmp_path: Path) -> None:
    plain = _recipe(tmp_path, "").weight_spec
    assert "openvino" not in plain.key() and "openvino" not in plain.ort_args("int4")
    mixed = _recipe(tmp_path, "[weight_only.openvino]\nratio = 0.8").weight_spec
    assert mixed.key()["openvino"]["ratio"] == 0.8 and "openvino" not in mixed.ort_args("int4")
