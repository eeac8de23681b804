"""Memory-bandwidth roofline for batch-1 decoding.

Decoding one token at batch 1 reads every weight once plus the KV cache at the current context, so
``bandwidth / bytes_per_token`` bounds decode tokens/s. Bandwidth is measured here, best of a few
passes, in one of two ways:

- ``onnxruntime-matmul`` (when ``onnx`` is installed): ONNX Runtime's own fp32 MatMul at batch 1,
  ``[1, K] x [K, N]`` with a weight several times larger than the last-level cache, on the same number
  of intra-op threads: the rate at which an fp32 decode step in this runtime can stream its weights, so
  an engine at a fraction near 1 has no headroom left in this runtime;
- ``numpy-sum``: numpy summing a large array from ``threads`` threads (numpy releases the GIL in
  reductions), a lower and rougher figure.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ..models.llm_contract import LlmContract

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int8": 1, "uint8": 1}


def measure_read_bandwidth_gb_s(threads: int = 1, size_mb: int = 256, repeats: int = 5) -> float:
    """Best-of-``repeats`` read bandwidth in GB/s (1e9 bytes) over a ``size_mb`` array."""
    threads = max(1, threads)
    data = np.ones(size_mb * 1024 * 1024 // 8, dtype=np.float64)
    chunks = np.array_split(data, threads)
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(np.sum, chunks))  # fault the pages in, warm the threads
        for _ in range(repeats):
            t0 = time.perf_counter()
            list(pool.map(np.sum, chunks))
            best = min(best, time.perf_counter() - t0)
    return data.nbytes / best / 1e9


def measure_matmul_bandwidth_gb_s(threads: int = 1, size_mb: int = 256, repeats: int = 7) -> float | None:
    """Best-of-``repeats`` rate (GB/s) at which ONNX Runtime's fp32 MatMul reads a ``size_mb`` weight at
    batch 1 on ``threads`` intra-op threads; None when ``onnx`` (to build the one-node graph) is missing."""
    try:
        from onnx import TensorProto, helper, numpy_helper
    except ImportError:
        return None
    import onnxruntime as ort

    k = 4096
    n = max(1, size_mb * 1024 * 1024 // 4 // k)
    weight = np.full((k, n), 0.5, dtype=np.float32)  # the values do not change the time
    # The weight goes in as a session initializer (no protobuf copy of it); the graph holds an empty
    # placeholder of the same name, and the output's width is left to the runtime
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "batch1_matmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "n"])],
        [numpy_helper.from_array(np.zeros((k, 0), dtype=np.float32), "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # what every supported ONNX Runtime reads
    options = ort.SessionOptions()
    options.intra_op_num_threads = max(1, threads)
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    value = ort.OrtValue.ortvalue_from_numpy(weight)  # the session reads it in place: keep it alive
    options.add_initializer("w", value)
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    x = np.ones((1, k), dtype=np.float32)
    session.run(None, {"x": x})  # first run: the weight is packed and faulted in
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        session.run(None, {"x": x})
        best = min(best, time.perf_counter() - t0)
    return k * n * 4 / best / 1e9


def measure_bandwidth(threads: int) -> tuple[float, str]:
    """(GB/s, method): ONNX Runtime's batch-1 MatMul when it can be built, else numpy's sum."""
    matmul = measure_matmul_bandwidth_gb_s(threads)
    if matmul is not None:
        return matmul, "onnxruntime-matmul"
    return measure_read_bandwidth_gb_s(threads), "numpy-sum"


def weight_bytes(model_dir: Path) -> int:
    """Bytes of the model's weights: ONNX initializers if ``onnx`` is installed, else file sizes."""
    model = Path(model_dir) / "model.onnx"
    if not model.is_file():  # OpenVINO IR: the .bin holds the weights
        return sum(p.stat().st_size for p in Path(model_dir).glob("*.bin"))
    try:
        import onnx
        from onnx import numpy_helper  # noqa: F401
    except ImportError:
        pass
    else:
        proto = onnx.load(str(model), load_external_data=False)
        total = 0
        for init in proto.graph.initializer:
            n = int(np.prod(init.dims)) if init.dims else 1
            total += n * np.dtype(onnx.helper.tensor_dtype_to_np_dtype(init.data_type)).itemsize
        return total
    # File sizes: the graph file plus its external-data file(s); the graph's own bytes are small.
    files = [model, *sorted(p for p in Path(model_dir).iterdir() if p.name.startswith("model.onnx") and p != model)]
    return sum(p.stat().st_size for p in files if p.is_file())


def embedding_gather_bytes(config: dict, weight_itemsize: int = 4) -> int:
    """Bytes of the input-embedding table that a decode step does NOT read (it gathers one row).

    Zero when the embeddings are tied to the LM head (the head reads the whole table every step).
    """
    vocab, hidden = config.get("vocab_size"), config.get("hidden_size")
    if not isinstance(vocab, int) or not isinstance(hidden, int) or config.get("tie_word_embeddings", False):
        return 0
    return (vocab - 1) * hidden * weight_itemsize


def kv_bytes_per_token_of_context(num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: str) -> int:
    """KV-cache bytes one token of context occupies (keys and values, every layer)."""
    try:
        size = np.dtype(str(kv_dtype)).itemsize
    except TypeError:
        size = _DTYPE_BYTES.get(str(kv_dtype), 4)
    return 2 * num_layers * num_kv_heads * head_dim * size


def roofline(
    bandwidth_gb_s: float,
    weight_bytes_: int,
    kv_bytes_per_ctx: int,
    mean_context: float,
    achieved_tokens_per_s: float | None,
) -> dict:
    bytes_per_token = int(weight_bytes_ + kv_bytes_per_ctx * mean_context)
    bound = bandwidth_gb_s * 1e9 / bytes_per_token
    return {
        "bandwidth_gb_s": round(bandwidth_gb_s, 2),
        "weight_bytes": int(weight_bytes_),
        "kv_bytes_at_mean_context": int(kv_bytes_per_ctx * mean_context),
        "mean_context": mean_context,
        "bytes_per_token": bytes_per_token,
        "bound_tokens_per_s": round(bound, 1),
        "achieved_tokens_per_s": None if achieved_tokens_per_s is None else round(achieved_tokens_per_s, 1),
        "fraction": None if achieved_tokens_per_s is None else round(achieved_tokens_per_s / bound, 3),
    }


def of_model(
    model_dir: Path,
    config: dict,
    contract: LlmContract,
    threads: int,
    mean_context: float,
    achieved_tokens_per_s: float | None,
) -> dict:
    """``roofline`` of a loaded decoder (its folder, config and KV contract), with the bandwidth measured here
    on ``threads`` threads and the method named (``bandwidth_method``)."""
    itemsize = {"float16": 2, "bfloat16": 2}.get(str(config.get("torch_dtype")), 4)
    read_weights = weight_bytes(model_dir) - embedding_gather_bytes(config, itemsize)
    kv = kv_bytes_per_token_of_context(contract.num_layers, contract.num_kv_heads, contract.head_dim, contract.kv_dtype)
    bandwidth, method = measure_bandwidth(threads)
    return {**roofline(bandwidth, read_weights, kv, mean_context, achieved_tokens_per_s), "bandwidth_method": method}
