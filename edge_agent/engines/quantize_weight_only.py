"""Weight-only INT4 / INT8 for ONNX Runtime: every MatMul with a constant weight becomes ``MatMulNBits``.

``MatMulNBits`` (ONNX Runtime's ``com.microsoft`` contrib op) keeps the weight as ``bits``-bit
integers in blocks of ``block_size`` along K, one float scale (and, asymmetric, one zero point) per
block, and dequantizes inside the matmul; activations stay float (``accuracy_level`` 0) or are
quantized to int8 per block at run time (``accuracy_level`` 4, ONNX Runtime's integer kernels).
Decode on a CPU is memory bound, so reading 4 or 8 bits per weight instead of 32 is the speed-up.

What is quantized: every MatMul whose B input is a 2-D initializer, the LM head included (for a
tied head, a ``Transpose`` of the embedding table, the transposed table becomes the head's own
initializer first, so the head reads 4-bit weights while the ``Gather`` keeps the float table).
The head may get its own bits and block size (``head_bits``, ``head_block_size``: the head of a large
vocabulary is the one matmul where 4 bits cost most, and the largest one a decode step reads).
Norms and attention stay float; embedding ``Gather``s too unless ``embedding_bits = 8``, which stores
large tables as 8-bit blocks read by ``GatherBlockQuantized`` (``quantize_embedding_gathers``).
Both export layouts work: plain optimum exports (``past_key_values.N.key/value`` with ``Concat``) and
onnxruntime-genai folders (``GroupQueryAttention`` with the KV buffer shared in place): only weight
initializers change, and the quantized matmuls that read the same activations (query, key and value; gate
and up) become one node and a ``Split`` (``fuse_matmuls``: the same outputs, fewer calls a step).

Tools: RTN is ONNX Runtime's own ``MatMulNBitsQuantizer`` (its default blockwise quantizer), which needs
the ``onnx-ir`` package; without it, RTN runs the same ONNX Runtime packing kernels
(``quantize_matmul_4bits`` / ``_8bits``) through the rewrite below, which writes the same nodes and
initializers. The other 4-bit methods (``rtn_asym``, ``kquant``, ``hqq``, ``gptq``) are ``int4_methods``,
numpy only (no torch).
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InputError, ModelError
from . import int4_methods
from .fuse_matmuls import fuse_sibling_matmuls
from .quantize_ort import _onnx, _quiet_tools, _save_external
from .quiet import folded

log = logging.getLogger(__name__)

ALGORITHMS = int4_methods.METHODS
# Written here in numpy (int4_methods); rtn by ONNX Runtime's quantizer or its kernels.
NUMPY_ALGORITHMS = tuple(m for m in ALGORITHMS if m != "rtn")
SENSITIVITY_WINDOW = 512  # tokens per window (BOS first) the sensitivity pass scores


def ort_quantizer_available() -> bool:
    """True when onnxruntime's ``MatMulNBitsQuantizer`` imports (it needs the ``onnx-ir`` package)."""
    try:
        import onnxruntime.quantization.matmul_nbits_quantizer  # noqa: F401  (import probe only)
    except ImportError:
        return False
    return True


def untie_transposed_weights(model: Any) -> int:
    """A MatMul whose B is ``Transpose(initializer)`` (a head tied to the embedding table) gets the
    transposed table as its own initializer, so it can be quantized; returns how many were untied."""
    onnx = _onnx()
    from onnx import numpy_helper

    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    producers = {out: n for n in graph.node for out in n.output}
    untied = 0
    for node in graph.node:
        if node.op_type != "MatMul" or node.input[1] in inits:
            continue
        t = producers.get(node.input[1])
        if t is None or t.op_type != "Transpose" or t.input[0] not in inits:
            continue
        perm = next((list(a.ints) for a in t.attribute if a.name == "perm"), [1, 0])
        weight = numpy_helper.to_array(inits[t.input[0]])
        if weight.ndim != 2 or perm != [1, 0]:
            continue
        name = f"{t.input[0]}.transposed_for_{node.name or untied}"
        graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(weight.T), name))
        node.input[1] = name
        untied += 1
    if untied:
        # A Transpose nobody reads any more is dropped (onnx.checker would accept it; the runtime would run it).
        used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
        keep = [n for n in graph.node if n.op_type != "Transpose" or any(o in used for o in n.output)]
        del graph.node[:]
        graph.node.extend(keep)
        onnx.checker.check_model(model, full_check=False)
    return untied


def _pack(weight: np.ndarray, bits: int, block_size: int, symmetric: bool):
    """ONNX Runtime's blockwise packing of a [K, N] weight: (packed [N, blocks, blob], scales, zero points)."""
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

    rows, cols = weight.shape
    per_byte = 8 // bits
    blocks = (rows + block_size - 1) // block_size
    padded = np.pad(weight, ((0, blocks * block_size - rows), (0, 0))) if blocks * block_size != rows else weight
    padded = np.ascontiguousarray(padded, dtype=np.float32)
    packed = np.zeros((cols, blocks, (block_size + per_byte - 1) // per_byte), dtype=np.uint8)
    zero_points = np.zeros((cols, (blocks + per_byte - 1) // per_byte), dtype=np.uint8)
    scales = np.zeros((cols, blocks), dtype=np.float32)
    kernel = quantize_matmul_8bits if bits == 8 else quantize_matmul_4bits
    kernel(packed, padded, scales, zero_points, block_size, cols, rows, symmetric)
    return packed, scales, zero_points


def head_matmul(model: Any) -> str | None:
    """The name of the MatMul whose product becomes the ``logits`` output (directly, or through the
    element-wise ops of a soft-cap or a cast), or None when the graph has no such head. An unnamed head
    is given a name (the quantizers pick nodes by name)."""
    producer = {out: node for node in model.graph.node for out in node.output}
    outputs = [o.name for o in model.graph.output]
    tensor = "logits" if "logits" in outputs else (outputs[0] if outputs else "")
    for _ in range(6):
        node = producer.get(tensor)
        if node is None:
            return None
        if node.op_type == "MatMul":
            node.name = node.name or "lm_head/MatMul"
            return str(node.name)
        if node.op_type not in ("Mul", "Div", "Tanh", "Cast", "Add"):
            return None
        tensor = node.input[0]
    return None


def _rewrite(
    model: Any,
    bits: int,
    block_size: int,
    symmetric: bool,
    accuracy_level: int,
    only: Collection[str] | None = None,
    skip: Collection[str] = (),
) -> None:
    """MatMul(A, const B) -> MatMulNBits, written the way MatMulNBitsQuantizer's QOperator path writes it.
    ``only``: these node names alone (None: all); ``skip``: never these."""
    onnx = _onnx()
    from onnx import helper, numpy_helper

    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    nodes = []
    replaced: set[str] = set()
    for node in graph.node:
        chosen = node.name not in skip and (only is None or node.name in only)
        b = inits.get(node.input[1]) if node.op_type == "MatMul" and chosen else None
        if b is None:
            nodes.append(node)
            continue
        weight = numpy_helper.to_array(b)
        if weight.ndim != 2 or weight.dtype != np.float32:
            nodes.append(node)
            continue
        packed, scales, zero_points = _pack(weight, bits, block_size, symmetric)
        q = numpy_helper.from_array(packed, f"{b.name}_Q{bits}")
        s = numpy_helper.from_array(scales, f"{b.name}_scales")
        graph.initializer.extend([q, s])
        names = [node.input[0], q.name, s.name]
        if not symmetric:
            zp = numpy_helper.from_array(zero_points, f"{b.name}_zero_points")
            graph.initializer.append(zp)
            names.append(zp.name)
        attrs: dict[str, Any] = {"K": weight.shape[0], "N": weight.shape[1], "bits": bits, "block_size": block_size}
        if accuracy_level:
            attrs["accuracy_level"] = accuracy_level
        nodes.append(
            helper.make_node(
                "MatMulNBits",
                names,
                list(node.output),
                name=f"{node.name}_Q{bits}" if node.name else "",
                domain="com.microsoft",
                **attrs,
            )
        )
        replaced.add(b.name)
    del graph.node[:]
    graph.node.extend(nodes)
    still_used = {i for n in graph.node for i in n.input}
    keep = [i for i in graph.initializer if i.name not in replaced or i.name in still_used]
    del graph.initializer[:]
    graph.initializer.extend(keep)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))


def _nbits_node(node: Any, name: str, blocks: int4_methods.Blocks, accuracy_level: int, graph: Any) -> Any:
    """``node`` (MatMul of ``name``) as MatMulNBits over ``blocks``, zero points stored (uint8, packed)."""
    from onnx import helper, numpy_helper

    packed, scales, zero_points = blocks.pack()
    bits = blocks.bits
    q = numpy_helper.from_array(packed, f"{name}_Q{bits}")
    s = numpy_helper.from_array(scales, f"{name}_scales")
    zp = numpy_helper.from_array(zero_points, f"{name}_zero_points")
    graph.initializer.extend([q, s, zp])
    attrs: dict[str, Any] = {"K": blocks.rows, "N": packed.shape[0], "bits": bits, "block_size": blocks.block_size}
    if accuracy_level:
        attrs["accuracy_level"] = accuracy_level
    return helper.make_node(
        "MatMulNBits",
        [node.input[0], q.name, s.name, zp.name],
        list(node.output),
        name=f"{node.name}_Q{bits}" if node.name else "",
        domain="com.microsoft",
        **attrs,
    )


def _rewrite_blocks(model: Any, chosen: dict[str, int4_methods.Blocks], accuracy_level: int) -> None:
    """Each MatMul named in ``chosen`` becomes MatMulNBits over its (already quantized) blocks."""
    onnx = _onnx()
    graph = model.graph
    nodes = []
    replaced: set[str] = set()
    for node in graph.node:
        blocks = chosen.get(node.name) if node.op_type == "MatMul" else None
        if blocks is None:
            nodes.append(node)
            continue
        nodes.append(_nbits_node(node, node.input[1], blocks, accuracy_level, graph))
        replaced.add(node.input[1])
    del graph.node[:]
    graph.node.extend(nodes)
    still_used = {i for n in graph.node for i in n.input}
    keep = [i for i in graph.initializer if i.name not in replaced or i.name in still_used]
    del graph.initializer[:]
    graph.initializer.extend(keep)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))


def quantize_embedding_gathers(model: Any, block_size: int, min_rows: int = 1024) -> int:
    """Gather(table, ids) over a float [rows, width] table becomes ``GatherBlockQuantized``: the table
    as 8-bit integers (uint8 around 128), one float scale per ``block_size`` values of a row
    (symmetric: max |w| / 127). Tables of fewer than ``min_rows`` rows (position tables, small
    vocabularies) and widths that ``block_size`` does not divide stay float. Returns how many changed.

    The ids pick rows, so a step reads one row per token either way; what changes is the table's size
    (Gemma 3's 262,144 x 640: 671 MB -> 168 MB + 5-21 MB of scales) and with it the memory its rows take
    once the tokens seen have paged them in."""
    onnx = _onnx()
    from onnx import helper, numpy_helper

    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    quantized = 0
    replaced: set[str] = set()
    nodes = []
    for node in graph.node:
        table = inits.get(node.input[0]) if node.op_type == "Gather" else None
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        if table is None or axis != 0 or len(table.dims) != 2 or table.data_type != onnx.TensorProto.FLOAT:
            nodes.append(node)
            continue
        rows, width = table.dims
        if rows < min_rows or width % block_size:
            nodes.append(node)
            continue
        weight = numpy_helper.to_array(table).reshape(rows, width // block_size, block_size)
        scales = np.abs(weight).max(axis=2) / 127.0
        safe = np.where(scales > 0, scales, 1.0)[..., None]
        codes = (np.clip(np.rint(weight / safe), -127, 127) + 128).astype(np.uint8).reshape(rows, width)
        q = numpy_helper.from_array(codes, f"{table.name}_Q8")
        s = numpy_helper.from_array(scales.astype(np.float32), f"{table.name}_scales")
        graph.initializer.extend([q, s])
        nodes.append(
            helper.make_node(
                "GatherBlockQuantized",
                [q.name, node.input[1], s.name],  # no zero points: 128 for 8-bit uint8 data
                list(node.output),
                name=f"{node.name}_Q8" if node.name else "",
                domain="com.microsoft",
                bits=8,
                block_size=block_size,
                gather_axis=0,
                quantize_axis=1,
            )
        )
        replaced.add(table.name)
        quantized += 1
    if not quantized:
        return 0
    del graph.node[:]
    graph.node.extend(nodes)
    still_used = {i for n in graph.node for i in n.input}
    keep = [i for i in graph.initializer if i.name not in replaced or i.name in still_used]
    del graph.initializer[:]
    graph.initializer.extend(keep)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    return quantized


@dataclass(frozen=True)
class _Settings:
    """What the weights get: ``bits`` in blocks of ``block_size``, the LM head its own (already defaulted to
    the rest's), ONNX Runtime's ``accuracy_level``, and 8-bit embedding tables or none (``embedding_bits``)."""

    bits: int
    block_size: int
    head_bits: int
    head_block_size: int
    accuracy_level: int
    embedding_bits: int

    def of(self, group: str) -> tuple[int, int]:
        """(bits, block size) of a weight in ``group`` (``int4_sensitivity``'s site groups: "head" or a layer's)."""
        return (self.head_bits, self.head_block_size) if group == "head" else (self.bits, self.block_size)


@dataclass(frozen=True)
class _Calibration:
    """The numpy methods' calibration: ``text`` (None: none), the tokens ``skip ..`` + ``count`` of it the
    method fits on, the ``sensitivity_tokens`` after them the mixed-precision pass scores within ``budget``
    (Δperplexity %, None: no pass), measured on ``source`` (the FP32 ``ModelRef``) with ``threads``."""

    text: str | Path | None
    skip: int
    count: int
    sensitivity_tokens: int
    budget: float | None
    source: Any
    threads: int


def quantize_matmul_nbits(
    src: Path,
    dst: Path,
    bits: int,
    block_size: int = 32,
    symmetric: bool = True,
    accuracy_level: int = 0,
    algorithm: str = "rtn",
    use_ort_quantizer: bool | None = None,
    embedding_bits: int = 0,
    head_bits: int = 0,
    head_block_size: int = 0,
    calibration: str | Path | None = None,
    calibration_skip_tokens: int = 0,
    calibration_tokens: int = 2048,
    sensitivity_tokens: int = 512,
    mixed_budget_pct: float | None = None,
    source: Any = None,
    threads: int = 0,
    progress: Any = None,
) -> dict:
    """Weight-only ``bits``-bit (4 or 8) MatMulNBits model of ``src`` at ``dst``; returns what was done.

    ``use_ort_quantizer``: None = onnxruntime's MatMulNBitsQuantizer when it imports, else the
    rewrite over the same kernels; True / False force one (tests compare the two).
    ``embedding_bits`` 8: embedding tables too (``quantize_embedding_gathers``); 0 keeps them float.
    ``head_bits`` / ``head_block_size``: the LM head's own (0: as the rest), RTN through the rewrite.

    ``algorithm`` ``rtn_asym`` / ``kquant`` / ``hqq`` / ``gptq`` run ``int4_methods`` here (asymmetric blocks, uint8
    zero points). ``calibration`` (a text file; tokens ``calibration_skip_tokens ..`` + ``calibration_tokens``
    of it) gives ``kquant`` its importance per input and ``gptq`` its Hessians, measured on ``source`` (the
    FP32 model's ``ModelRef``: its plain graph, tokenizer and config). ``mixed_budget_pct``: the 4-bit
    precision keeps the layers (and head) at 8 bits that ``int4_sensitivity.keep_8bit`` picks to stay within
    that Δperplexity on ``sensitivity_tokens`` of the calibration text, the tokens right after those the method
    fits on (no token in both); the choice is in the result."""
    if bits == 8 and algorithm in NUMPY_ALGORITHMS:  # the 4-bit methods: 8-bit weights stay as int8w has them
        algorithm, mixed_budget_pct = "rtn", None
    if bits == 8:
        mixed_budget_pct = None
    settings = _Settings(
        bits, block_size, head_bits or bits, head_block_size or block_size, accuracy_level, embedding_bits
    )
    if algorithm in NUMPY_ALGORITHMS or mixed_budget_pct is not None:
        _check_algorithm(algorithm)
        job = _Calibration(
            calibration,
            calibration_skip_tokens,
            calibration_tokens,
            sensitivity_tokens,
            mixed_budget_pct,
            source,
            threads,
        )
        return _quantize_numpy(src, dst, settings, algorithm, job, progress)
    return _quantize_rtn(src, dst, settings, symmetric, algorithm, use_ort_quantizer)


def _check_algorithm(algorithm: str) -> None:
    if algorithm not in ALGORITHMS:
        raise InputError(f"weight_only.algorithm {algorithm!r}: choose one of {', '.join(ALGORITHMS)}")


def _check_bits_and_blocks(s: _Settings, algorithm: str) -> None:
    """4 or 8 bits, a known method, block sizes MatMulNBits takes; each refusal one line naming the key."""
    for what, b in (("", s.bits), ("head_", s.head_bits)):
        if b not in (4, 8):
            raise InputError(f"weight-only quantization takes 4 or 8 bits, not {what}bits = {b}")
    _check_algorithm(algorithm)
    for what, size in (("block_size", s.block_size), ("head_block_size", s.head_block_size)):
        if size < 16 or size & (size - 1):
            raise InputError(f"weight_only.{what} {size}: MatMulNBits takes a power of two >= 16")


def _check_embedding_bits(s: _Settings) -> None:
    if s.embedding_bits not in (0, 8):
        raise InputError(f"weight_only.embedding_bits {s.embedding_bits}: 0 (float) or 8")


def _quantize_rtn(
    src: Path, dst: Path, s: _Settings, symmetric: bool, algorithm: str, use_ort_quantizer: bool | None
) -> dict:
    """RTN: every weight MatMul through onnxruntime's quantizer or the rewrite over its kernels, the head
    (when it has its own bits or block size) through the rewrite after them (see ``quantize_matmul_nbits``)."""
    _check_bits_and_blocks(s, algorithm)
    onnx = _onnx()
    model = onnx.load(str(src))  # external data pulled in from src's folder
    untied = untie_transposed_weights(model)
    head = _own_head(model, src, s)
    own_head = [head] if head else []
    ort_tool = ort_quantizer_available() if use_ort_quantizer is None else use_ort_quantizer
    if ort_tool:
        model = _ort_quantizer_pass(model, s, symmetric, own_head)
        tool = "onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer"
    else:
        _rewrite(model, s.bits, s.block_size, symmetric, s.accuracy_level, skip=own_head)
        tool = "onnxruntime quantize_matmul_nbits kernels (MatMulNBitsQuantizer's packing; onnx-ir not installed)"
    if head:
        _rewrite(model, s.head_bits, s.head_block_size, symmetric, s.accuracy_level, only=own_head)
    quantized = sum(1 for n in model.graph.node if n.op_type == "MatMulNBits")
    left = sum(1 for n in model.graph.node if n.op_type == "MatMul")
    if not quantized:
        raise ModelError(f"{src}: no MatMul with a constant 2-D weight to quantize (is it an LLM export?)")
    _check_embedding_bits(s)
    gathers = quantize_embedding_gathers(model, s.block_size) if s.embedding_bits else 0
    fused = fuse_sibling_matmuls(model)
    _save_external(model, dst)
    return _rtn_record(tool, s, symmetric, algorithm, (quantized, left, fused), untied, gathers, head)


def _own_head(model: Any, src: Path, s: _Settings) -> str | None:
    """The LM head's MatMul when it has bits or a block size of its own (None when it is quantized as the rest);
    refused when no MatMul makes the logits."""
    if (s.head_bits, s.head_block_size) == (s.bits, s.block_size):
        return None
    head = head_matmul(model)
    if head is None:
        raise ModelError(f"{src}: head_bits / head_block_size set, but no MatMul produces its logits output")
    return head


def _ort_quantizer_pass(model: Any, s: _Settings, symmetric: bool, exclude: list[str]) -> Any:
    """Every weight MatMul but those named in ``exclude`` through onnxruntime's ``MatMulNBitsQuantizer``
    (its default blockwise RTN); returns the model it writes."""
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        MatMulNBitsQuantizer,
    )

    config = DefaultWeightOnlyQuantConfig(
        block_size=s.block_size,
        is_symmetric=symmetric,
        accuracy_level=s.accuracy_level or None,
        op_types_to_quantize=("MatMul",),
        bits=s.bits,
    )
    quantizer = MatMulNBitsQuantizer(
        model, bits=s.bits, block_size=s.block_size, nodes_to_exclude=exclude, algo_config=config
    )
    with _quiet_tools(), folded("onnxruntime.quantization"):
        quantizer.process()
    return quantizer.model.model


def _rtn_record(
    tool: str,
    s: _Settings,
    symmetric: bool,
    algorithm: str,
    counts: tuple[int, int, int],
    untied: int,
    gathers: int,
    head: str | None,
) -> dict:
    """What the RTN path did, as ``quantize_matmul_nbits`` returns it; ``counts``: the matmuls quantized, left
    float and the groups fused (``fuse_matmuls``)."""
    quantized, left, fused = counts
    return {
        "tool": tool,
        "op": "com.microsoft.MatMulNBits",
        "bits": s.bits,
        "block_size": s.block_size,
        "symmetric": symmetric if algorithm == "rtn" else False,
        "algorithm": algorithm,
        "accuracy_level": s.accuracy_level,
        "matmuls_quantized": quantized,
        "matmuls_float": left,  # activation x activation (attention) MatMuls
        "matmul_groups_fused": fused,  # siblings sharing an input, now one MatMulNBits each
        "tied_heads_untied": untied,
        "embedding_tables_8bit": gathers,
        "head": {"node": head, "bits": s.head_bits, "block_size": s.head_block_size} if head else None,
    }


def _quantize_numpy(src: Path, dst: Path, s: _Settings, algorithm: str, job: _Calibration, progress: Any) -> dict:
    """The numpy methods' path (see ``quantize_matmul_nbits``)."""
    import time

    from . import int4_sensitivity as sv

    say = progress or (lambda m: log.info("%s", m))
    _check_numpy_args(s, algorithm, job)
    t0 = time.perf_counter()
    onnx = _onnx()
    model = onnx.load(str(src))
    untied = untie_transposed_weights(model)
    head = head_matmul(model)
    targets = sv.sites(model, head)
    if not targets:
        raise ModelError(f"{src}: no MatMul with a constant 2-D weight to quantize (is it an LLM export?)")
    cal = None
    text = None
    plain = model
    report: dict[str, Any] = {}
    if job.text is not None:
        plain, text, cal, report["calibration"] = _calibrate(src, model, job, say)
    blocks4 = _quantize_4bit(src, model, targets, s, algorithm, cal, say)
    keep: set[str] = {t.node for t in targets if t.node not in blocks4}  # 8-bit by the recipe
    if job.budget is not None and cal is not None and text is not None:
        choice = _mixed_precision(plain, targets, blocks4, s, text, job, say)
        report["mixed"] = choice.to_dict()
        groups = set(choice.keep_8bit)
        keep |= {t.node for t in targets if t.group in groups}
    chosen, eight, gathers, fused = _write_numpy_model(model, dst, targets, blocks4, keep, s)
    return {
        "tool": f"edge_agent.engines.int4_methods ({algorithm}), ONNX Runtime MatMulNBits with uint8 zero points",
        "op": "com.microsoft.MatMulNBits",
        "bits": s.bits,
        "block_size": s.block_size,
        "symmetric": False,
        "algorithm": algorithm,
        "accuracy_level": s.accuracy_level,
        "matmuls_quantized": len(targets),
        "matmuls_4bit": len(chosen),
        "matmuls_8bit": len(eight),
        "matmuls_8bit_names": sorted(t.weight for t in eight),
        "matmuls_float": sum(1 for n in model.graph.node if n.op_type == "MatMul"),
        "matmul_groups_fused": fused,
        "tied_heads_untied": untied,
        "embedding_tables_8bit": gathers,
        "head": {"node": head, "bits": 8 if head in keep else 4, "block_size": s.head_block_size} if head else None,
        "quantize_s": round(time.perf_counter() - t0, 1),
        **report,
    }


def _check_numpy_args(s: _Settings, algorithm: str, job: _Calibration) -> None:
    """The numpy path's refusals, before any work: bits and blocks, embedding bits, calibration it needs."""
    _check_bits_and_blocks(s, algorithm)
    _check_embedding_bits(s)
    if algorithm in int4_methods.NEEDS_CALIBRATION and job.text is None:
        raise InputError(f"weight_only.algorithm = {algorithm!r} needs weight_only.calibration (a text file)")
    if job.budget is not None and job.text is None:
        raise InputError(
            "weight_only.mixed_budget_pct (the sensitivity pass) needs weight_only.calibration (a text file)"
        )
    if job.text is not None and job.source is None:
        raise InputError("weight_only.calibration: the FP32 source model is needed to run it (source=)")


def _fp32_graph(src: Path, model: Any, source: Any) -> Any:
    """The FP32 graph the calibration runs on: ``source``'s graph of ``src``'s name (else its model.onnx),
    loaded and untied, or ``model`` itself when that graph is ``src``."""
    source_graph = Path(source.path) / "model.onnx"
    for candidate in (Path(source.path) / src.name, source_graph):
        if candidate.is_file():
            source_graph = candidate
            break
    if source_graph.resolve() == Path(src).resolve():
        return model
    plain = _onnx().load(str(source_graph))
    untie_transposed_weights(plain)
    return plain


def _calibration_text(job: _Calibration) -> tuple[Any, dict[str, Any]]:
    """The calibration text's tokens in their slices (fitted on; scored when there is a budget), and their record."""
    from . import int4_sensitivity as sv

    assert job.text is not None
    sensitivity = job.sensitivity_tokens if job.budget is not None else 0  # a budget of 0 % is a budget
    text = sv.calibration_text(job.source, Path(job.text), job.skip, job.count, sensitivity)
    record = {
        "text": str(job.text),
        "skip_tokens": job.skip,
        "tokens": len(text.fit),
        "fit_tokens": list(text.fit_range),
        **({"sensitivity_tokens": list(text.score_range)} if job.budget is not None else {}),
    }
    return text, record


def _calibrate(src: Path, model: Any, job: _Calibration, say: Any) -> tuple[Any, Any, Any, dict[str, Any]]:
    """The FP32 graph, the calibration text, the activation statistics measured on the fitted tokens
    (``int4_sensitivity.calibrate``), and the text's record."""
    from . import int4_sensitivity as sv

    plain = _fp32_graph(src, model, job.source)
    text, record = _calibration_text(job)
    cal = sv.calibrate(
        plain, head_matmul(plain), text.fit, text.bos, dict(job.source.config), threads=job.threads, progress=say
    )
    return plain, text, cal, record


def _quantize_4bit(
    src: Path, model: Any, targets: list[Any], s: _Settings, algorithm: str, cal: Any, say: Any
) -> dict[str, int4_methods.Blocks]:
    """Each weight the settings give 4 bits, quantized by ``algorithm`` (with the calibration's importance and
    Hessian when there is one), by MatMul node name."""
    from onnx import numpy_helper

    from . import int4_sensitivity as sv

    inits = {i.name: i for i in model.graph.initializer}
    blocks4: dict[str, int4_methods.Blocks] = {}
    for i, t in enumerate(targets):
        key = sv.site_key(t)
        w = numpy_helper.to_array(inits[t.weight])
        b, size = s.of(t.group)
        if b != 4:
            continue
        if cal is not None and algorithm == "gptq" and cal.hessian(key) is None:
            raise ModelError(f"{src}: no calibration activations for {t.weight} ({key}) in the FP32 source graph")
        blocks4[t.node] = int4_methods.quantize(
            w,
            4,
            size,
            algorithm,
            importance=cal.importance(key) if cal else None,
            hessian=cal.hessian(key) if cal else None,
        )
        say(f"{algorithm} {i + 1}/{len(targets)}: {t.weight}")
    return blocks4


def _mixed_precision(
    plain: Any,
    targets: list[Any],
    blocks4: dict[str, int4_methods.Blocks],
    s: _Settings,
    text: Any,
    job: _Calibration,
    say: Any,
) -> Any:
    """``int4_sensitivity.keep_8bit``'s choice of the groups kept at 8 bits within ``job.budget``, scored on
    the FP32 graph over the text's sensitivity tokens."""
    from onnx import numpy_helper

    from . import int4_sensitivity as sv

    assert job.budget is not None
    plain_sites = sv.sites(plain, head_matmul(plain))
    by_key = {sv.site_key(t): t for t in targets}
    plain_inits = {i.name: i for i in plain.graph.initializer}
    quantizable = [p for p in plain_sites if (by_key.get(sv.site_key(p)) or p).node in blocks4]

    def four_bit_of(site: Any) -> np.ndarray:
        return blocks4[by_key[sv.site_key(site)].node].dequantize()

    def eight_bit_of(site: Any) -> np.ndarray:
        _, size = s.of(site.group)
        w = numpy_helper.to_array(plain_inits[site.weight])
        return int4_methods.quantize(w, 8, size, "rtn").dequantize()

    evaluator = sv.Evaluator(
        plain,
        sv.calibration_windows(text.score, text.bos, SENSITIVITY_WINDOW),
        dict(job.source.config),
        job.threads,
        names=[p.weight for p in quantizable],
    )
    return sv.keep_8bit(evaluator, quantizable, four_bit_of, job.budget, eight_bit_of, progress=say)


def _write_numpy_model(
    model: Any,
    dst: Path,
    targets: list[Any],
    blocks4: dict[str, int4_methods.Blocks],
    keep: set[str],
    s: _Settings,
) -> tuple[dict[str, int4_methods.Blocks], list[Any], int, int]:
    """The 4-bit blocks not in ``keep`` as MatMulNBits, those in it as ONNX Runtime's 8-bit symmetric RTN (one
    rewrite per block size), the embedding tables when asked, siblings fused (``fuse_matmuls``), saved at
    ``dst``; returns (the 4-bit blocks by node, the 8-bit sites, the tables quantized, the groups fused)."""
    chosen = {n: b for n, b in blocks4.items() if n not in keep}
    _rewrite_blocks(model, chosen, s.accuracy_level)
    eight = [t for t in targets if t.node in keep]
    for size in sorted({s.of(t.group)[1] for t in eight}):
        only = [t.node for t in eight if s.of(t.group)[1] == size]
        _rewrite(model, 8, size, True, s.accuracy_level, only=only)
    gathers = quantize_embedding_gathers(model, s.block_size) if s.embedding_bits else 0
    fused = fuse_sibling_matmuls(model)
    _save_external(model, dst)
    return chosen, eight, gathers, fused
