"""The numpy block quantizers (int4_methods) against numpy references: brute-force optima on small blocks,
the MatMulNBits op's output against numpy matmul on the dequantized weights, GPTQ's output error, HQQ's update
against a line-by-line re-statement of the published solver."""

from __future__ import annotations

import numpy as np
import pytest

from edge_agent.engines import int4_methods as im
from edge_agent.errors import InputError


def _brute_force(x: np.ndarray, weights: np.ndarray, bits: int) -> np.ndarray:
    """Per block [M, bs]: the least weighted error over every integer zero point and 400 scales."""
    maxq = (1 << bits) - 1
    span = np.maximum(x.max(1) - x.min(1), 1e-9)
    best = np.full(len(x), np.inf)
    for f in np.linspace(0.5, 1.6, 400):
        s = (span * f / maxq)[:, None]
        for z in range(maxq + 1):
            e = im.search_error(x, weights, s, np.full_like(s, z), bits)[:, 0]
            best = np.minimum(best, e)
    return best


def test_kquant_search_is_never_worse_than_round_to_nearest_and_near_the_brute_force_optimum() -> None:
    rng = np.random.default_rng(0)
    w = (rng.standard_t(4, size=(64, 48)) * 0.02).astype(np.float32)  # heavy tails, like trained weights
    imp = rng.uniform(0.1, 3.0, size=64).astype(np.float32)
    k = im.quantize(w, 4, 16, "kquant", importance=imp)
    a = im.quantize(w, 4, 16, "rtn_asym")
    x = im._blocks(w, 16).reshape(-1, 16)
    vw = im._value_weights(x, np.broadcast_to(imp.reshape(1, 4, 16), (48, 4, 16)).reshape(-1, 16))

    def err(b: im.Blocks) -> np.ndarray:
        return im.search_error(x, vw, b.scales.reshape(-1, 1), b.zero_points.reshape(-1, 1).astype(float), 4)[:, 0]

    ek, ea = err(k), err(a)
    assert np.all(ek <= ea * (1 + 1e-5))  # rtn_asym's (scale, zero) is the search's first candidate
    optimum = _brute_force(x, vw, 4)
    assert ek.sum() <= 1.05 * optimum.sum()  # the search lands within 5 % of the brute force over all blocks
    assert ek.sum() < 0.9 * ea.sum()  # and the search is worth having


@pytest.mark.parametrize("method", ["rtn", "rtn_asym", "kquant"])  # hqq clips tails by design (l_p, p < 1)
def test_every_value_is_within_one_step_and_codes_fit_the_bits(method: str) -> None:
    rng = np.random.default_rng(1)
    w = rng.normal(size=(96, 20)).astype(np.float32)
    b = im.quantize(w, 4, 32, method)
    assert b.codes.max() <= 15 and b.zero_points.max() <= 15
    step = np.repeat(np.abs(b.scales).T, 32, axis=0)  # [K, N]
    assert np.all(np.abs(b.dequantize() - w) <= step * 1.0001 + 1e-7)


def test_rtn_is_onnxruntimes_symmetric_kernel() -> None:
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits

    rng = np.random.default_rng(2)
    k, n, bs = 64, 24, 32
    w = rng.normal(size=(k, n)).astype(np.float32)
    packed = np.zeros((n, k // bs, bs // 2), np.uint8)
    scales = np.zeros((n, k // bs), np.float32)
    zps = np.zeros((n, 1), np.uint8)
    quantize_matmul_4bits(packed, w, scales, zps, bs, n, k, True)
    mine = im.quantize(w, 4, bs, "rtn")
    np.testing.assert_allclose(mine.scales, scales, rtol=1e-6)
    assert np.mean(mine.pack()[0] == packed) > 0.99  # rounding of exact ties may differ


@pytest.mark.parametrize(("bits", "k", "block"), [(4, 96, 32), (4, 160, 32), (8, 64, 16), (4, 64, 64)])
def test_matmul_nbits_with_packed_blocks_is_numpy_matmul_on_the_dequantized_weight(
    bits: int, k: int, block: int
) -> None:
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(bits + k)
    n = 40
    w = rng.normal(size=(k, n)).astype(np.float32)
    b = im.quantize(w, bits, block, "kquant" if bits == 4 else "rtn_asym")
    packed, scales, zps = b.pack()
    inits = [
        numpy_helper.from_array(packed, "q"),
        numpy_helper.from_array(scales, "s"),
        numpy_helper.from_array(zps, "z"),
    ]
    node = helper.make_node(
        "MatMulNBits", ["x", "q", "s", "z"], ["y"], domain="com.microsoft", K=k, N=n, bits=bits, block_size=block
    )
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, n])],
        inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    x = rng.normal(size=(3, k)).astype(np.float32)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    y = sess.run(None, {"x": x})[0]
    np.testing.assert_allclose(y, x.astype(np.float64) @ b.dequantize(), rtol=1e-4, atol=1e-4)
    onnx.checker.check_model(model)


def test_gptq_moves_the_layer_output_less_than_the_search_alone_on_correlated_inputs() -> None:
    rng = np.random.default_rng(3)
    k, n, tokens = 128, 48, 2000
    mix = rng.normal(size=(k, k)) / np.sqrt(k) + np.eye(k)
    x = (rng.normal(size=(tokens, k)) @ mix).astype(np.float32)  # correlated inputs, as activations are
    w = rng.normal(size=(k, n)).astype(np.float32) * 0.05
    h = x.astype(np.float64).T @ x
    imp = np.diag(h) / tokens
    g = im.quantize(w, 4, 32, "gptq", importance=imp, hessian=h)
    s = im.quantize(w, 4, 32, "kquant", importance=imp)
    out = x @ w

    def output_error(b: im.Blocks) -> float:
        return float(np.linalg.norm(x @ b.dequantize() - out))

    assert output_error(g) < 0.8 * output_error(s)
    # the weight itself moves more: GPTQ trades weight error for output error
    assert im.relative_error(w, g) > im.relative_error(w, s)


def _hqq_restated(w: np.ndarray, bits: int, iters: int, p: float = 0.7, beta: float = 10.0, kappa: float = 1.01):
    """HQQ's zero-point solver for one group, as published (the official code's form: the inverse scale,
    ``W_q = round(W * scale + z)``), line by line: every zero point it goes through and each one's mean |error|."""
    qmax = 2**bits - 1
    lo, hi = float(w.min()), float(w.max())
    scale = qmax / (hi - lo)
    z = float(np.round(-lo * scale))
    zeros, errors = [z], []
    for _ in range(iters):
        w_q = np.clip(np.round(w * scale + z), 0, qmax)
        w_r = (w_q - z) / scale
        errors.append(float(np.mean(np.abs(w - w_r))))
        d = w - w_r
        w_e = np.sign(d) * np.maximum(np.abs(d) - (1.0 / beta) * np.power(np.abs(d) + 1e-8, p - 1), 0.0)
        z = float(np.mean(w_q - (w - w_e) * scale))
        beta *= kappa
        zeros.append(z)
    w_q = np.clip(np.round(w * scale + zeros[-1]), 0, qmax)
    errors.append(float(np.mean(np.abs(w - (w_q - zeros[-1]) / scale))))
    return zeros, errors


def test_hqq_zero_is_the_published_update_and_keeps_each_blocks_best() -> None:
    rng = np.random.default_rng(7)
    x = (rng.standard_t(3, size=(6, 32)) * 0.03).astype(np.float64)
    lo, hi = x.min(axis=1, keepdims=True), x.max(axis=1, keepdims=True)
    scale = (hi - lo) / 15
    start = np.rint(-lo / scale)
    paths = [_hqq_restated(row, 4, 20) for row in x]
    for n in (1, 2, 5, 20):  # the update itself: the same zero points after n steps
        mine = im.hqq_zero(x, scale, start, 4, iters=n, keep_best=False)[:, 0]
        np.testing.assert_allclose(mine, [zs[n] for zs, _ in paths], rtol=1e-9, atol=1e-9)
    best = im.hqq_zero(x, scale, start, 4, iters=20)[:, 0]
    expect = [zs[int(np.argmin(errs))] for zs, errs in paths]  # the least mean |error| along the path
    np.testing.assert_allclose(best, expect, rtol=1e-9, atol=1e-9)
    assert any(abs(z - round(z)) > 0.05 for z in expect)  # the solver's zero points are floats


def _matrices():
    rng = np.random.default_rng(11)
    outliers = rng.normal(size=(256, 96)) * 0.02
    outliers[rng.random(outliers.shape) < 0.01] *= 12.0  # a few large weights per block, as trained layers have
    return {
        "normal": rng.normal(size=(256, 96)) * 0.02,
        "student-t(4)": rng.standard_t(4, size=(256, 96)) * 0.02,
        "outliers": outliers,
    }


def _lp(weight: np.ndarray, b: im.Blocks, p: float = 0.7) -> float:
    return float(np.sum(np.abs(weight.astype(np.float64) - b.dequantize()) ** p))


@pytest.mark.parametrize("block", [32, 64])
def test_hqq_reconstructs_better_than_round_to_nearest_and_is_compared_with_the_other_methods(block: int) -> None:
    """On random matrices HQQ's error, in l2 and in its own l_p, is at most round to nearest's (symmetric, and
    asymmetric over [min, max]); the table beside it (``pytest -s``) is what docs/engines.md quotes."""
    rng = np.random.default_rng(block)
    k = 256
    x = (rng.normal(size=(512, k)) @ (np.eye(k) + rng.normal(size=(k, k)) / np.sqrt(k))).astype(np.float32)
    h = x.astype(np.float64).T @ x
    imp = np.diag(h) / len(x)
    print(f"\nblock {block}: relative weight error / relative output error on correlated inputs")
    for name, w in _matrices().items():
        w = w.astype(np.float32)
        made = {m: im.quantize(w, 4, block, m, importance=imp, hessian=h) for m in im.METHODS}
        err = {m: im.relative_error(w, b) for m, b in made.items()}
        out = {m: float(np.linalg.norm(x @ b.dequantize() - x @ w) / np.linalg.norm(x @ w)) for m, b in made.items()}
        print(f"{name:13s} " + "  ".join(f"{m} {err[m]:.4f}/{out[m]:.4f}" for m in im.METHODS))
        assert err["hqq"] <= err["rtn_asym"] and err["hqq"] <= err["rtn"]
        assert _lp(w, made["hqq"]) <= _lp(w, made["rtn_asym"])
        assert out["hqq"] <= out["rtn"]


def test_hqq_integer_zero_points_keep_the_best_of_its_steps_the_rounded_start_included() -> None:
    rng = np.random.default_rng(12)
    x = rng.standard_t(4, size=(400, 32)) * 0.02
    lo, hi = x.min(axis=1, keepdims=True), x.max(axis=1, keepdims=True)
    scale = (hi - lo) / 15
    zero = im.hqq_zero(x, scale, np.rint(-lo / scale), 4)
    s, z = im.hqq_integer(x, scale, zero, 4)
    assert np.array_equal(z, np.rint(z)) and z.min() >= 0 and z.max() <= 15

    def lp(s: np.ndarray, z: np.ndarray) -> np.ndarray:
        q = np.clip(np.rint(x / s + z), 0, 15)
        return np.sum(np.abs(x - s * (q - z)) ** 0.7, axis=1)

    start = lp(scale, np.clip(np.rint(zero), 0, 15))
    assert np.all(lp(s.astype(np.float64), z) <= start * (1 + 1e-5))  # never worse than rounding HQQ's zero
    assert lp(s.astype(np.float64), z).sum() < 0.99 * start.sum()  # and the integer steps are worth having


def test_bad_input_names_the_key() -> None:
    w = np.ones((32, 4), np.float32)
    with pytest.raises(InputError, match="algorithm 'awq'"):
        im.quantize(w, 4, 32, "awq")
    with pytest.raises(InputError, match="calibration"):
        im.quantize(w, 4, 32, "gptq")
    with pytest.raises(InputError, match="4 or 8 bits, not 3"):
        im.quantize(w, 3, 32, "kquant")


class _FakeEvaluator:
    """Perplexity as a known function of which weights are overridden: each 4-bit group adds its cost, each
    8-bit group a tenth of it (so the greedy choice can be checked against every prefix by hand)."""

    def __init__(self, cost: dict[str, float]) -> None:
        self.cost, self.calls = cost, 0

    def perplexity(self, overrides: dict[str, np.ndarray]) -> float:
        self.calls += 1
        extra = sum(self.cost[name] * (0.1 if float(v.flat[0]) == 8.0 else 1.0) for name, v in overrides.items())
        return 10.0 * (1 + extra / 100)


def test_keep_8bit_keeps_the_shortest_most_sensitive_per_byte_prefix_that_fits() -> None:
    from edge_agent.engines import int4_sensitivity as sv

    shapes = {"a": (64, 64), "b": (64, 256), "c": (64, 64), "head": (64, 1024)}
    cost = {"a": 4.0, "b": 4.0, "c": 0.5, "head": 6.0}  # Δppl % alone at 4 bits
    sites = [sv.Site(f"n.{g}", g, "x", shapes[g], g) for g in shapes]

    def q4(site: sv.Site) -> np.ndarray:
        return np.full((1,), 4.0)

    def q8(site: sv.Site) -> np.ndarray:
        return np.full((1,), 8.0)

    ev = _FakeEvaluator(cost)
    choice = sv.keep_8bit(ev, sites, q4, 7.0, q8)  # type: ignore[arg-type]  # a stand-in evaluator
    # Δppl per byte 4 bits saves: a 4 / 2048 > b 4 / 8192 > c 0.5 / 2048 > head 6 / 32768
    assert choice.order == ["a", "b", "c", "head"]
    # prefixes by hand: 0 -> 14.5 %, 1 -> 10.9 %, 2 -> 7.3 %, 3 -> 6.85 % (the first within 7 %)
    assert choice.keep_8bit == ["a", "b", "c"] and choice.fits
    assert choice.mixed_ppl == pytest.approx(10 * (1 + (0.4 + 0.4 + 0.05 + 6.0) / 100))
    assert sv.keep_8bit(_FakeEvaluator(cost), sites, q4, 20.0, q8).keep_8bit == []  # all 4-bit fits  # type: ignore[arg-type]
    none = sv.keep_8bit(_FakeEvaluator(cost), sites, q4, 0.5, q8)  # type: ignore[arg-type]
    assert not none.fits and none.keep_8bit == ["a", "b", "c", "head"]  # nothing fits: all 8-bit, said so
