"""Weight-only INT8 / INT4 engines: MatMulNBits against numpy, both ONNX layouts, and real builds of demo-phi3-small.

References: numpy (the unpacked blocks times the activations; the quantization step as a bound),
onnxruntime's own MatMulNBitsQuantizer (the kernel rewrite must write the same model), the FP32
model through the agent's own loader. No assertion on this CPU's speed or on an accuracy figure
beyond "the gate's verdict follows from its metrics and the recipe's budget".
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edge_agent.backends import SessionOptions
from edge_agent.engines.cache import EngineCache
from edge_agent.engines.pipeline import BuildRequest, GateRefused, Heartbeat, Pipeline
from edge_agent.engines.quantize_ort import copy_sidecars
from edge_agent.engines.quantize_weight_only import ort_quantizer_available, quantize_matmul_nbits
from edge_agent.engines.recipes import DataRef, load_recipe
from edge_agent.engines.weight_bytes import weight_bytes
from edge_agent.errors import ModelError
from edge_agent.models.catalog import inspect_folder
from edge_agent.models.llm import DecoderLM
from edge_agent.systemd import Notifier
from tests.gate_checks import assert_gate_decided

ROOT = Path(__file__).resolve().parents[2]
GENAI = ROOT / "tests/data/demo-phi3-genai"


def _matmul_model(path: Path, weight: np.ndarray, tied: bool = False) -> None:
    """y = x @ W (W an initializer), or, tied, y = x @ Transpose(T) with T also read by a Gather."""
    k, n = weight.shape
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", k])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", n])
    if tied:
        table = numpy_helper.from_array(np.ascontiguousarray(weight.T), "table")
        ids = helper.make_tensor_value_info("ids", TensorProto.INT64, ["b"])
        emb = helper.make_tensor_value_info("emb", TensorProto.FLOAT, ["b", k])
        nodes = [
            helper.make_node("Gather", ["table", "ids"], ["emb"], name="embed"),
            helper.make_node("Transpose", ["table"], ["table_t"], perm=[1, 0], name="tie"),
            helper.make_node("MatMul", ["x", "table_t"], ["y"], name="head"),
        ]
        graph = helper.make_graph(nodes, "tied", [x, ids], [y, emb], [table])
    else:
        graph = helper.make_graph(
            [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
            "mm",
            [x],
            [y],
            [numpy_helper.from_array(weight, "w")],
        )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def _unpack(model: onnx.ModelProto, bits: int, k: int, n: int, block: int) -> np.ndarray:
    """The dequantized [K, N] weight from MatMulNBits' documented layout, in numpy."""
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    node = next(nd for nd in model.graph.node if nd.op_type == "MatMulNBits")
    packed, scales = inits[node.input[1]], inits[node.input[2]].reshape(n, -1)
    blocks = scales.shape[1]
    if bits == 4:
        q = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(n, blocks, block)
    else:
        q = packed.reshape(n, blocks, block)
    if len(node.input) > 3 and node.input[3]:
        zp = inits[node.input[3]].reshape(n, -1)
        zp = np.stack([zp & 0x0F, zp >> 4], axis=-1).reshape(n, -1)[:, :blocks] if bits == 4 else zp[:, :blocks]
    else:
        zp = np.full((n, blocks), 1 << (bits - 1))
    deq = (q.astype(np.float64) - zp[..., None]) * scales[..., None]
    return deq.reshape(n, blocks * block)[:, :k].T


@pytest.mark.parametrize(("bits", "symmetric"), [(4, True), (4, False), (8, True), (8, False)])
def test_matmul_nbits_is_the_blockwise_weight_within_one_step(tmp_path: Path, bits: int, symmetric: bool) -> None:
    import onnxruntime as ort

    rng = np.random.default_rng(bits + symmetric)
    k, n, block = 96, 40, 32
    weight = rng.normal(size=(k, n)).astype(np.float32)
    x = rng.normal(size=(3, k)).astype(np.float32)
    _matmul_model(tmp_path / "w.onnx", weight)
    info = quantize_matmul_nbits(tmp_path / "w.onnx", tmp_path / "q.onnx", bits, block, symmetric, accuracy_level=0)
    assert info["matmuls_quantized"] == 1 and info["bits"] == bits
    model = onnx.load(str(tmp_path / "q.onnx"))
    assert [nd.op_type for nd in model.graph.node] == ["MatMulNBits"]
    deq = _unpack(model, bits, k, n, block)
    # Each weight moved by at most one step (half a step of rounding, or clipping at the edge of a
    # symmetric range); a step is at most the block's range / (2^bits - 2).
    blocks = np.abs(weight).reshape(k // block, block, n).max(axis=1)
    step = np.repeat(2 * blocks / (2**bits - 2), block, axis=0)
    assert np.all(np.abs(deq - weight) <= step + 1e-6)
    y = ort.InferenceSession(str(tmp_path / "q.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(y, x.astype(np.float64) @ deq, rtol=1e-4, atol=1e-4)


def test_a_tied_head_is_quantized_and_the_embedding_gather_stays_float(tmp_path: Path) -> None:
    import onnxruntime as ort

    rng = np.random.default_rng(7)
    weight = rng.normal(size=(64, 50)).astype(np.float32)  # [hidden, vocab]: the table is its transpose
    _matmul_model(tmp_path / "tied.onnx", weight, tied=True)
    info = quantize_matmul_nbits(tmp_path / "tied.onnx", tmp_path / "q.onnx", 4, 32, True, accuracy_level=0)
    assert info["tied_heads_untied"] == 1 and info["matmuls_quantized"] == 1
    model = onnx.load(str(tmp_path / "q.onnx"))
    assert sorted(nd.op_type for nd in model.graph.node) == ["Gather", "MatMulNBits"]
    x, ids = rng.normal(size=(2, 64)).astype(np.float32), np.array([3, 41])
    y, emb = ort.InferenceSession(str(tmp_path / "q.onnx"), providers=["CPUExecutionProvider"]).run(
        None, {"x": x, "ids": ids}
    )
    np.testing.assert_array_equal(emb, weight.T[ids])  # the Gather reads the float table, unchanged
    np.testing.assert_allclose(y, x.astype(np.float64) @ _unpack(model, 4, 64, 50, 32), rtol=1e-4, atol=1e-4)
    # per-token bytes: the head's 4-bit blocks and scales, not the table the Gather reads
    assert weight_bytes(tmp_path / "q.onnx") == 50 * 2 * 16 + 50 * 2 * 4


@pytest.mark.parametrize("width", [64, 48])
def test_embedding_bits_8_stores_a_large_table_as_8_bit_blocks(tmp_path: Path, width: int) -> None:
    """The 8-bit table read through GatherBlockQuantized equals numpy's own blockwise rounding of it
    (max |w| / 127 per 32 values), so each row is within half a step of the float row; a width the
    block does not divide (48) and a table under min_rows stay float."""
    import onnxruntime as ort

    rng = np.random.default_rng(11)
    weight = rng.normal(size=(width, 1500)).astype(np.float32)  # [hidden, vocab]: 1,500 rows >= min_rows
    weight[:, 7] = 0.0  # an all-zero row: scale 0, decoded as zeros
    _matmul_model(tmp_path / "tied.onnx", weight, tied=True)
    info = quantize_matmul_nbits(tmp_path / "tied.onnx", tmp_path / "q.onnx", 8, 32, True, embedding_bits=8)
    model = onnx.load(str(tmp_path / "q.onnx"))
    ops = sorted(nd.op_type for nd in model.graph.node)
    ids = np.array([3, 7, 1499, 3])
    x = rng.normal(size=(4, width)).astype(np.float32)
    _, emb = ort.InferenceSession(str(tmp_path / "q.onnx"), providers=["CPUExecutionProvider"]).run(
        None, {"x": x, "ids": ids}
    )
    table = weight.T.astype(np.float64)
    if width % 32:
        assert info["embedding_tables_8bit"] == 0 and ops == ["Gather", "MatMulNBits"]
        np.testing.assert_array_equal(emb, weight.T[ids])
        return
    assert info["embedding_tables_8bit"] == 1 and ops == ["GatherBlockQuantized", "MatMulNBits"]
    assert not any(i.name == "table" for i in model.graph.initializer)  # the float table is gone
    blocks = table.reshape(1500, width // 32, 32)
    step = np.abs(blocks).max(axis=2, keepdims=True) / 127
    expect = (np.rint(blocks / np.where(step > 0, step, 1)) * step).reshape(1500, width)
    np.testing.assert_allclose(emb, expect[ids], rtol=1e-6, atol=1e-7)
    assert np.all(np.abs(emb - table[ids]) <= np.repeat(step[ids, :, 0], 32, axis=1) / 2 + 1e-7)
    assert not emb[1].any()
    # per-token bytes: the head's 8-bit blocks and scales; the 8-bit table and its scales are read a row a token
    assert weight_bytes(tmp_path / "q.onnx") == 1500 * width + 1500 * (width // 32) * 4
    small = rng.normal(size=(64, 50)).astype(np.float32)
    _matmul_model(tmp_path / "small.onnx", small, tied=True)
    kept = quantize_matmul_nbits(tmp_path / "small.onnx", tmp_path / "s.onnx", 8, 32, True, embedding_bits=8)
    assert kept["embedding_tables_8bit"] == 0


def test_rotary_caches_are_read_a_row_a_position_and_left_out_of_the_bytes_per_token(tmp_path: Path) -> None:
    """An in-place graph's GroupQueryAttention and RotaryEmbedding read one row of their cos/sin caches per
    position: those tables are not counted; a table some other op also reads in full is."""
    f = TensorProto.FLOAT
    w = numpy_helper.from_array(np.zeros((8, 4), np.float32), "w")  # 128 bytes, a MatMul weight
    caches = [numpy_helper.from_array(np.zeros((64, 2), np.float32), n) for n in ("cos", "sin", "cos2", "sin2")]
    shared = numpy_helper.from_array(np.zeros((64, 2), np.float32), "shared")  # 512 bytes, also a MatMul's
    gqa = helper.make_node(
        "GroupQueryAttention",
        ["q", "k", "v", "pk", "pv", "seqlens", "total", "cos", "sin"],
        ["o", "ok", "ov"],
        domain="com.microsoft",
    )
    rope = helper.make_node("RotaryEmbedding", ["x2", "pos", "cos2", "sin2"], ["r"], domain="com.microsoft")
    rope_shared = helper.make_node("RotaryEmbedding", ["x3", "pos", "shared", "sin2"], ["r2"], domain="com.microsoft")
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["y"]),
            gqa,
            rope,
            rope_shared,
            helper.make_node("MatMul", ["z", "shared"], ["y2"]),
        ],
        "rows",
        [helper.make_tensor_value_info("x", f, [1, 8])],
        [helper.make_tensor_value_info("y", f, [1, 4])],
        [w, *caches, shared],
    )
    onnx.save(helper.make_model(graph), str(tmp_path / "rows.onnx"))
    assert weight_bytes(tmp_path / "rows.onnx") == 8 * 4 * 4 + 64 * 2 * 4


@pytest.mark.parametrize("ort_tool", [False, True])
def test_the_head_gets_its_own_bits_and_block_size_and_the_other_matmuls_keep_theirs(
    tmp_path: Path, ort_tool: bool
) -> None:
    """int4 with ``head_bits = 8, head_block_size = 64``: the matmul producing the logits reads 8-bit
    blocks of 64 (numpy's unpacking of its initializers gives its output), every other weight 4-bit
    blocks of 32."""
    import onnxruntime as ort

    if ort_tool and not ort_quantizer_available():
        pytest.skip("onnxruntime's MatMulNBitsQuantizer needs onnx-ir")
    src = GENAI / "model.onnx"
    info = quantize_matmul_nbits(
        src, tmp_path / "q.onnx", 4, 32, True, 0, head_bits=8, head_block_size=64, use_ort_quantizer=ort_tool
    )
    model = onnx.load(str(tmp_path / "q.onnx"))
    attrs = {nd.name: {a.name: a.i for a in nd.attribute} for nd in model.graph.node if nd.op_type == "MatMulNBits"}
    head = info["head"]["node"]
    producer = next(nd for nd in model.graph.node if "logits" in nd.output)
    assert producer.op_type == "MatMulNBits" and producer.name.startswith(head)
    assert (attrs[producer.name]["bits"], attrs[producer.name]["block_size"]) == (8, 64)
    others = [a for name, a in attrs.items() if name != producer.name]
    assert others and all((a["bits"], a["block_size"]) == (4, 32) for a in others)
    # The head's numbers: its own graph, fed the hidden states, against numpy's dequantized weight.
    k, n = attrs[producer.name]["K"], attrs[producer.name]["N"]
    inits = [i for i in model.graph.initializer if i.name in producer.input]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", k])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", n])
    alone = helper.make_node(
        "MatMulNBits", ["x", *producer.input[1:]], ["y"], domain="com.microsoft", **attrs[producer.name]
    )
    head_model = helper.make_model(
        helper.make_graph([alone], "head", [x], [y], inits),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
    )
    hidden = np.random.default_rng(5).normal(size=(2, k)).astype(np.float32)
    out = ort.InferenceSession(head_model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": hidden}
    )[0]
    np.testing.assert_allclose(out, hidden.astype(np.float64) @ _unpack(head_model, 8, k, n, 64), rtol=1e-4, atol=1e-4)


def test_head_bits_on_a_graph_whose_output_no_matmul_makes_is_refused_by_name(tmp_path: Path) -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 32])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 8])
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"), helper.make_node("Relu", ["h"], ["y"])]
    w = numpy_helper.from_array(np.ones((32, 8), np.float32), "w")
    graph = helper.make_graph(nodes, "relu", [x], [y], [w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "r.onnx"))
    with pytest.raises(ModelError, match=r"r\.onnx: head_bits / head_block_size set, but no MatMul produces"):
        quantize_matmul_nbits(tmp_path / "r.onnx", tmp_path / "q.onnx", 4, 32, True, head_bits=8)
    assert not (tmp_path / "q.onnx").exists()


@pytest.mark.skipif(not ort_quantizer_available(), reason="onnxruntime's MatMulNBitsQuantizer needs onnx-ir")
@pytest.mark.parametrize("bits", [4, 8])
def test_the_kernel_rewrite_writes_what_onnxruntimes_quantizer_writes(tmp_path: Path, bits: int) -> None:
    src = GENAI / "model.onnx"  # GroupQueryAttention layout: only the weight MatMuls change
    quantize_matmul_nbits(src, tmp_path / "ort.onnx", bits, 32, True, 4, use_ort_quantizer=True)
    quantize_matmul_nbits(src, tmp_path / "own.onnx", bits, 32, True, 4, use_ort_quantizer=False)
    a, b = onnx.load(str(tmp_path / "ort.onnx")), onnx.load(str(tmp_path / "own.onnx"))
    arrays = lambda m: {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}  # noqa: E731
    ia, ib = arrays(a), arrays(b)
    assert ia.keys() == ib.keys() and all(np.array_equal(ia[k], ib[k]) for k in ia)
    nodes = lambda m: [(nd.op_type, list(nd.input), list(nd.output), str(nd.attribute)) for nd in m.graph.node]  # noqa: E731
    assert nodes(a) == nodes(b)


def _prompt_logits(lm: DecoderLM, prompt: list[int], steps: int) -> tuple[np.ndarray, list[int]]:
    """The prompt's last logits and ``steps`` greedy tokens, through the serving adapter's batch path."""
    batch = lm.new_batch(1)
    logits = lm.join(batch, [0], [prompt])
    first = logits[0].copy()
    tokens = [int(np.argmax(logits[0]))]
    for _ in range(steps - 1):
        tokens.append(int(np.argmax(lm.decode(batch, [tokens[-1]])[0])))
    return first, tokens


def _close(reference: np.ndarray, candidate: np.ndarray) -> float:
    """Relative L2 distance of two logit vectors (numpy)."""
    return float(np.linalg.norm(candidate.astype(np.float64) - reference) / np.linalg.norm(reference))


@pytest.mark.parametrize("bits", [4, 8])
def test_a_genai_folder_quantized_serves_through_the_agent_loader(tmp_path: Path, bits: int) -> None:
    folder = tmp_path / "genai-q"
    copy_sidecars(GENAI, folder, "model.onnx")
    quantize_matmul_nbits(GENAI / "model.onnx", folder / "model.onnx", bits, 32, True, 4)
    options = SessionOptions(threads=1)
    fp32 = DecoderLM.open(inspect_folder(GENAI), "onnxruntime", options)
    quant = DecoderLM.open(inspect_folder(folder), "onnxruntime", options)
    try:
        assert quant.shared_kv  # the in-place KV layout (GroupQueryAttention) is kept
        prompt = [5, 17, 42, 99, 7, 3]
        ref_logits, _ = _prompt_logits(fp32, prompt, 1)
        logits, tokens = _prompt_logits(quant, prompt, 8)
    finally:
        fp32.close()
        quant.close()
    assert len(tokens) == 8 and all(0 <= t < ref_logits.shape[-1] for t in tokens)
    assert np.all(np.isfinite(logits)) and _close(ref_logits, logits) < 0.5


def _pipeline(tmp_path: Path) -> Pipeline:
    recipe = load_recipe("demo-phi3-small")
    assert {"int8w", "int4"} <= set(recipe.precisions)  # the shipped recipe lists the weight-only candidates
    assert recipe.heldout is not None
    recipe = recipe.model_copy(update={"heldout": DataRef(data=recipe.resolve(recipe.heldout.data), samples=4)})
    cache = EngineCache(tmp_path / "engines", 1 << 31)
    return Pipeline(recipe, cache, tmp_path / "models", 1, Heartbeat(enabled=False, notifier=Notifier({})))


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
def test_demo_phi3_small_weight_only_engines_build_gate_and_generate(tmp_path: Path, backend: str) -> None:
    if backend == "openvino":
        pytest.importorskip("openvino")
        pytest.importorskip("nncf")
    pipe = _pipeline(tmp_path)
    graph = "model.onnx" if backend == "onnxruntime" else "openvino_model.xml"
    ref = pipe.ref
    options = SessionOptions(device="cpu" if backend == "onnxruntime" else "CPU", threads=1)
    fp32 = DecoderLM.open(ref, "onnxruntime", SessionOptions(threads=1))
    prompt = fp32.tokenizer.encode("The capital of France is")
    ref_logits, _ = _prompt_logits(fp32, prompt, 1)
    fp32.close()
    sizes = {}
    for precision in ("int8w", "int4"):
        try:
            report = pipe.build(BuildRequest("cpu", precision, backend=backend))
            folder = Path(report["path"]) / "model"
        except GateRefused as exc:  # random weights at 4 bits: a refusal with its numbers is a right answer
            report = exc.report
            assert pipe.cache.lookup(report["key"]) is None, "a refused engine was cached"
            folder = pipe.cache.staging_dir / report["key"] / "model"
        acc = report["accuracy"]
        assert_gate_decided(acc, pipe.recipe.accuracy)
        assert acc["timing"] == "decode" and acc["decode_tok_s"] > 0 and acc["reference_decode_tok_s"] > 0
        assert acc["latency_ms"] == pytest.approx(1e3 / acc["decode_tok_s"])
        sizes[precision] = acc["weight_bytes"]
        assert acc["reference_weight_bytes"] == weight_bytes(ref.path / "model.onnx")
        if backend == "onnxruntime":
            model = onnx.load(str(folder / graph), load_external_data=False)
            nbits = {
                a.i for nd in model.graph.node if nd.op_type == "MatMulNBits" for a in nd.attribute if a.name == "bits"
            }
            assert nbits == {8 if precision == "int8w" else 4}
        else:
            assert report["conversion"]["mode"] == ("INT8_SYM" if precision == "int8w" else "INT4_SYM")
        lm = DecoderLM.open(inspect_folder(folder, name=f"{ref.name}-{precision}"), backend, options)
        try:
            logits, tokens = _prompt_logits(lm, prompt, 8)
        finally:
            lm.close()
        assert len(tokens) == 8
        assert np.all(np.isfinite(logits)) and _close(ref_logits, logits) < 0.5
    # bytes per token: 4-bit blocks below 8-bit ones below the FP32 weights (numbers from the graphs themselves)
    assert sizes["int4"] < sizes["int8w"] < weight_bytes(ref.path / "model.onnx")
