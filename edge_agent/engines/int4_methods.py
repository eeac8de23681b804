"""Block quantizers for weight-only 4-bit (and 8-bit) weights, in numpy, in ONNX Runtime's MatMulNBits layout.

A ``[K, N]`` MatMul weight is cut along K into blocks of ``block_size``; each output column's block gets a
float scale ``s`` and an integer zero point ``z`` (uint8, 0..2^bits - 1), and its values are stored as codes
``q`` with ``w ≈ s * (q - z)``. Integer zero points are what ONNX Runtime's fast integer kernels take
(accuracy_level 4); float zero points would drop it to a dequantize-every-call path.

Methods (``quantize``):

``rtn``       symmetric round to nearest: ``s = max|w| / 2^(bits-1)``, ``z = 2^(bits-1)`` (ONNX Runtime's default).
``rtn_asym``  asymmetric round to nearest over ``[min, max]``.
``kquant``    asymmetric with a searched scale and zero point (llama.cpp's k-quant search, ``make_qkx`` style):
              for 12 candidate ranges (``max - min`` over 0.6 .. 1.1) the codes are rounded, the best
              ``(s, m)`` refitted by weighted least squares, the zero point rounded to an integer and ``s``
              refitted once more; the best one's zero point's neighbours are tried too; the least weighted
              squared error wins. The weight of
              a value is ``importance[k] * sqrt(mean(block²) + w²)``: ``importance`` is the mean square of
              the activations that multiply input ``k`` on calibration text (an importance matrix, as
              llama.cpp's imatrix), or 1 without calibration.
``hqq``       HQQ (Badri & Shaji 2023, half-quadratic quantization), data-free: the scale is the block's
              ``(max - min) / (2^bits - 1)``, the zero point is optimised for the l_p error (p = 0.7: a few large
              errors cost less than many small ones) by HQQ's half-quadratic split: the error ``W_e`` is the
              generalised soft-threshold (``shrink_lp``) of ``W - s (q - z)``, then the zero point is the
              closed-form minimiser ``mean(q - (W - W_e) / s)`` of the quadratic term, ``beta`` grows by ``kappa``
              each step (``hqq_zero``). HQQ's zero point is a float; MatMulNBits at accuracy_level 4 takes integer
              ones, so the split goes on with the zero point rounded and the scale in the quadratic step as well
              (least squares of ``W - W_e`` on ``q - z``), keeping each block's best l_p error (``hqq_integer``).
``gptq``      GPTQ (Frantar et al. 2022) with blocks: columns of K are quantized in order (each block's scale
              and zero point found by the ``kquant`` search on the weights as updated so far), and each
              column's rounding error is spread over the columns not yet quantized through the inverse
              Hessian ``H = X^T X`` of the calibration activations, so the layer's output on them moves least.

``search_error`` is the objective ``kquant`` minimises, exposed so tests can check it against a brute-force
search over every integer zero point and a fine grid of scales on small blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import InputError

METHODS = ("rtn", "rtn_asym", "kquant", "hqq", "gptq")
NEEDS_CALIBRATION = ("gptq",)


@dataclass(frozen=True, slots=True)
class Blocks:
    """A quantized ``[K, N]`` weight: ``codes`` [N, blocks, block_size] (uint8, padding rows 0 weight),
    ``scales`` [N, blocks] float32, ``zero_points`` [N, blocks] uint8."""

    codes: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray
    bits: int
    block_size: int
    rows: int  # K

    def dequantize(self) -> np.ndarray:
        """The float ``[K, N]`` weight these blocks stand for (what MatMulNBits multiplies by)."""
        w = self.scales[..., None] * (self.codes.astype(np.float32) - self.zero_points[..., None].astype(np.float32))
        return np.ascontiguousarray(w.reshape(w.shape[0], -1)[:, : self.rows].T)

    def pack(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """MatMulNBits' initializers: B [N, blocks, block_size * bits / 8] (the first code of a byte in its low
        bits), scales [N, blocks] float32, zero points [N, ceil(blocks * bits / 8)] packed the same way."""
        n, nblk, bs = self.codes.shape
        if self.bits == 8:
            return self.codes, self.scales.astype(np.float32), self.zero_points
        c = self.codes.reshape(n, nblk, bs // 2, 2)
        packed = (c[..., 0] | (c[..., 1] << 4)).astype(np.uint8)
        z = self.zero_points
        if nblk % 2:
            z = np.concatenate([z, np.zeros((n, 1), np.uint8)], axis=1)
        zp = (z[:, 0::2] | (z[:, 1::2] << 4)).astype(np.uint8)
        return packed, self.scales.astype(np.float32), zp


def _blocks(weight: np.ndarray, block_size: int) -> np.ndarray:
    """``[K, N]`` -> ``[N, blocks, block_size]`` (K padded with zeros to whole blocks)."""
    rows, cols = weight.shape
    nblk = -(-rows // block_size)
    pad = nblk * block_size - rows
    w = np.pad(weight, ((0, pad), (0, 0))) if pad else weight
    return np.ascontiguousarray(w.T.reshape(cols, nblk, block_size), dtype=np.float32)


def search_error(x: np.ndarray, weights: np.ndarray, scale: np.ndarray, zero: np.ndarray, bits: int) -> np.ndarray:
    """Weighted squared error of blocks ``x`` [..., bs] stored with ``scale`` / integer ``zero`` [..., 1]."""
    maxq = (1 << bits) - 1
    q = np.clip(np.rint(x / scale) + zero, 0, maxq)
    return np.sum(weights * (scale * (q - zero) - x) ** 2, axis=-1, keepdims=True)


def _refit(x: np.ndarray, weights: np.ndarray, s: np.ndarray, z: np.ndarray, bits: int) -> np.ndarray:
    """With the zero point an integer: the codes, then the least-squares scale for them, twice."""
    maxq = (1 << bits) - 1
    for _ in range(2):
        q = np.clip(np.rint(x / s) + z, 0, maxq) - z
        den = (weights * q * q).sum(1, keepdims=True)
        s_new = (weights * q * x).sum(1, keepdims=True) / np.where(den > 0, den, 1.0)
        s = np.where((den > 0) & (s_new > 1e-12), s_new, s)
    return s


def _search(x: np.ndarray, weights: np.ndarray, bits: int, steps: int = 12) -> tuple[np.ndarray, np.ndarray]:
    """The ``kquant`` search over blocks ``x`` [M, bs] with per-value ``weights``: (scale, zero) [M, 1]."""
    maxq = (1 << bits) - 1
    lo = np.minimum(x.min(axis=1, keepdims=True), 0.0)
    hi = np.maximum(x.max(axis=1, keepdims=True), 0.0)
    span = np.where(hi > lo, hi - lo, 1.0)
    best_s = span / maxq
    best_z = np.clip(np.rint(-lo / best_s), 0, maxq)
    best_e = search_error(x, weights, best_s, best_z, bits)
    sw = weights.sum(axis=1, keepdims=True)
    swx = (weights * x).sum(axis=1, keepdims=True)

    def keep(s: np.ndarray, z: np.ndarray) -> None:
        nonlocal best_s, best_z, best_e
        e = search_error(x, weights, s, z, bits)
        better = e < best_e
        best_s, best_z, best_e = np.where(better, s, best_s), np.where(better, z, best_z), np.where(better, e, best_e)

    for factor in np.linspace(
        0.6, 1.1, steps
    ).tolist():  # codes over [min, min + span / factor]: clipping the tail, or not
        q = np.clip(np.rint(maxq * factor / span * (x - lo)), 0, maxq)
        wq = weights * q
        sl, sl2, sxl = wq.sum(1, keepdims=True), (wq * q).sum(1, keepdims=True), (wq * x).sum(1, keepdims=True)
        det = sw * sl2 - sl * sl
        ok = det > 0
        s = np.where(ok, (sw * sxl - swx * sl) / np.where(ok, det, 1.0), best_s)
        m = np.where(ok, (sl2 * swx - sl * sxl) / np.where(ok, det, 1.0), lo)
        s = np.where(s > 1e-12, s, best_s)
        z = np.clip(np.rint(-m / s), 0, maxq)
        keep(_refit(x, weights, s, z, bits), z)
    s0, z0 = best_s, best_z
    for shift in (-1.0, 1.0):  # the best zero point's neighbours, the scale refitted for each
        z = np.clip(z0 + shift, 0, maxq)
        keep(_refit(x, weights, s0, z, bits), z)
    return best_s.astype(np.float32), best_z


# HQQ's published defaults: l_p norm, the penalty's start, its growth per step, the number of steps.
HQQ_P, HQQ_BETA, HQQ_KAPPA, HQQ_ITERS = 0.7, 10.0, 1.01, 20


def shrink_lp(x: np.ndarray, beta: float, p: float = HQQ_P) -> np.ndarray:
    """HQQ's generalised soft-thresholding: the proximal step of ``|x|^p`` at penalty ``beta``."""
    ax = np.abs(x)
    return np.sign(x) * np.maximum(ax - np.power(ax + 1e-8, p - 1) / beta, 0.0)


def hqq_zero(
    x: np.ndarray,
    scale: np.ndarray,
    zero: np.ndarray,
    bits: int,
    iters: int = HQQ_ITERS,
    p: float = HQQ_P,
    beta: float = HQQ_BETA,
    kappa: float = HQQ_KAPPA,
    keep_best: bool = True,
) -> np.ndarray:
    """HQQ's zero-point solver for blocks ``x`` [M, bs] with ``scale`` [M, 1] fixed, from ``zero`` [M, 1]: per
    step ``q = clip(round(x / s + z))``, ``W_e = shrink_lp(x - s (q - z), beta)``, ``z = mean(q - (x - W_e) / s)``,
    ``beta *= kappa``. ``keep_best``: each block's zero point of least mean |error| seen (HQQ stops when the
    error grows; per block here, as blocks are independent problems), else the last step's. Float zero points."""
    maxq = (1 << bits) - 1
    best_z, best_e = zero, np.full(zero.shape, np.inf, dtype=x.dtype)

    def keep(z: np.ndarray, err: np.ndarray) -> None:
        nonlocal best_z, best_e
        e = np.mean(np.abs(err), axis=1, keepdims=True)
        better = e < best_e
        best_z, best_e = np.where(better, z, best_z), np.where(better, e, best_e)

    for _ in range(iters):
        q = np.clip(np.rint(x / scale + zero), 0, maxq)
        err = x - scale * (q - zero)
        if keep_best:
            keep(zero, err)
        w_e = shrink_lp(err, beta, p)
        zero = np.mean(q - (x - w_e) / scale, axis=1, keepdims=True)
        beta *= kappa
    if not keep_best:
        return zero
    keep(zero, x - scale * (np.clip(np.rint(x / scale + zero), 0, maxq) - zero))
    return best_z


def hqq_integer(
    x: np.ndarray,
    scale: np.ndarray,
    zero: np.ndarray,
    bits: int,
    iters: int = HQQ_ITERS,
    p: float = HQQ_P,
    beta: float = HQQ_BETA,
    kappa: float = HQQ_KAPPA,
) -> tuple[np.ndarray, np.ndarray]:
    """HQQ's split with an integer zero point (what MatMulNBits stores), from a float ``zero``: per step the
    error's shrinkage ``W_e`` as in ``hqq_zero``, then the quadratic step solved for the scale (least squares of
    ``x - W_e`` on ``q - z``) and for the zero point, rounded. Each block keeps the (scale, zero) of least
    ``sum |error|^p`` seen, the rounded start included. Returns (scale, zero) [M, 1]."""
    maxq = (1 << bits) - 1
    z = np.clip(np.rint(zero), 0, maxq)
    s = scale

    def step(s: np.ndarray, z: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        q = np.clip(np.rint(x / s + z), 0, maxq)
        err = x - s * (q - z)
        return q, err, np.sum(np.power(np.abs(err), p), axis=1, keepdims=True)

    q, err, best_e = step(s, z)
    best_s, best_z = s, z
    for _ in range(iters):
        target = x - shrink_lp(err, beta, p)
        d = q - z
        den = np.sum(d * d, axis=1, keepdims=True)
        fit = np.sum(d * target, axis=1, keepdims=True) / np.where(den > 0, den, 1.0)
        s = np.where((den > 0) & (fit > 1e-12), fit, s)
        z = np.clip(np.rint(np.mean(q - target / s, axis=1, keepdims=True)), 0, maxq)
        q, err, e = step(s, z)
        better = e < best_e
        best_s, best_z, best_e = np.where(better, s, best_s), np.where(better, z, best_z), np.where(better, e, best_e)
        beta *= kappa
    return best_s.astype(np.float32), best_z


def _hqq(x: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """HQQ over blocks ``x`` [M, bs]: the min-max start, ``hqq_zero``, then ``hqq_integer``."""
    maxq = (1 << bits) - 1
    lo, hi = x.min(axis=1, keepdims=True), x.max(axis=1, keepdims=True)
    scale = np.where(hi > lo, (hi - lo) / maxq, 1.0).astype(x.dtype)
    zero = hqq_zero(x, scale, np.rint(-lo / scale), bits)
    return hqq_integer(x, scale, zero, bits)


def _codes(x: np.ndarray, scale: np.ndarray, zero: np.ndarray, bits: int) -> np.ndarray:
    return np.clip(np.rint(x / scale) + zero, 0, (1 << bits) - 1).astype(np.uint8)


def _value_weights(x: np.ndarray, importance: np.ndarray | None) -> np.ndarray:
    """Per-value weights of blocks ``x`` [M, bs]: ``importance`` (broadcast [M, bs] or [bs]) x sqrt(σ² + x²)."""
    sigma2 = np.mean(x * x, axis=1, keepdims=True)
    w = np.sqrt(sigma2 + x * x)
    return w * importance if importance is not None else w


def quantize(
    weight: np.ndarray,
    bits: int = 4,
    block_size: int = 32,
    method: str = "kquant",
    importance: np.ndarray | None = None,
    hessian: np.ndarray | None = None,
    damp: float = 0.01,
) -> Blocks:
    """Quantize a ``[K, N]`` float weight by ``method`` (see the module doc). ``importance`` [K]: mean square
    of the activations per input (``kquant``, ``gptq``'s block search; ``hqq`` is data-free); ``hessian``
    [K, K]: ``X^T X`` (``gptq``)."""
    if method not in METHODS:
        raise InputError(f"weight_only.algorithm {method!r}: choose one of {', '.join(METHODS)}")
    if bits not in (4, 8):
        raise InputError(f"weight-only quantization takes 4 or 8 bits, not {bits}")
    rows = weight.shape[0]
    weight = np.asarray(weight, dtype=np.float32)
    if method == "gptq":
        if hessian is None:
            raise InputError("weight_only.algorithm 'gptq' needs calibration activations (weight_only.calibration)")
        return _gptq(weight, bits, block_size, hessian, damp)
    x = _blocks(weight, block_size)  # [N, nblk, bs]
    n, nblk, bs = x.shape
    maxq = (1 << bits) - 1
    if method == "rtn":
        half = 1 << (bits - 1)
        amax = np.abs(x).max(axis=2, keepdims=True)
        # ONNX Runtime's symmetric blocks: the value of largest magnitude maps to -2^(bits-1) exactly
        signed = np.take_along_axis(x, np.abs(x).argmax(axis=2)[..., None], axis=2)
        scale = np.where(amax > 0, signed / -half, 1.0).astype(np.float32)
        zero = np.full_like(scale, half)
        codes = _codes(x, scale, zero, bits)
        return Blocks(codes, scale[..., 0], zero[..., 0].astype(np.uint8), bits, block_size, rows)
    if method == "rtn_asym":
        lo = np.minimum(x.min(axis=2, keepdims=True), 0.0)
        hi = np.maximum(x.max(axis=2, keepdims=True), 0.0)
        scale = np.where(hi > lo, (hi - lo) / maxq, 1.0).astype(np.float32)
        zero = np.clip(np.rint(-lo / scale), 0, maxq)
        return Blocks(
            _codes(x, scale, zero, bits), scale[..., 0], zero[..., 0].astype(np.uint8), bits, block_size, rows
        )
    imp: np.ndarray | None = None
    if importance is not None:
        padded = np.pad(np.asarray(importance, np.float32), (0, nblk * bs - rows)).reshape(1, nblk, bs)
        imp = np.broadcast_to(padded, x.shape).reshape(-1, bs)
    flat = x.reshape(-1, bs)
    scale = np.empty((flat.shape[0], 1), np.float32)
    zero = np.empty((flat.shape[0], 1), np.float64)
    step = 1 << 16
    for a in range(0, flat.shape[0], step):  # bounded temporaries for the head's 8 M blocks
        part = flat[a : a + step]
        if method == "hqq":  # data-free: no importance
            scale[a : a + step], zero[a : a + step] = _hqq(part, bits)
            continue
        scale[a : a + step], zero[a : a + step] = _search(
            part, _value_weights(part, None if imp is None else imp[a : a + step]), bits
        )
    codes = _codes(flat, scale, zero, bits).reshape(n, nblk, bs)
    return Blocks(codes, scale.reshape(n, nblk), zero.reshape(n, nblk).astype(np.uint8), bits, block_size, rows)


def _gptq(weight: np.ndarray, bits: int, block_size: int, hessian: np.ndarray, damp: float) -> Blocks:
    rows, cols = weight.shape
    if hessian.shape != (rows, rows):
        raise InputError(f"gptq: Hessian {hessian.shape} does not match the weight's {rows} inputs")
    if rows % block_size:
        raise InputError(f"gptq: K = {rows} is not a multiple of block_size {block_size}")
    h = np.array(hessian, dtype=np.float64)
    dead = np.diag(h) <= 0
    h[dead, dead] = 1.0
    h += damp * np.mean(np.diag(h)) * np.eye(rows)
    # the upper Cholesky factor of H^-1: row i holds how column i's error spreads over the later columns
    hinv = np.linalg.cholesky(np.linalg.inv(h)).T
    importance = np.diag(h).astype(np.float32)
    nblk = rows // block_size
    codes = np.empty((cols, nblk, block_size), np.uint8)
    scales = np.empty((cols, nblk), np.float32)
    zeros = np.empty((cols, nblk), np.uint8)
    maxq = (1 << bits) - 1
    chunk = 32768  # output columns are independent: bounded memory for the head
    for c0 in range(0, cols, chunk):
        w = np.array(weight[:, c0 : c0 + chunk].T, dtype=np.float32)  # [n, K]
        w[:, dead] = 0.0
        for b in range(nblk):
            a, e = b * block_size, (b + 1) * block_size
            blk = w[:, a:e]
            s, z = _search(blk, _value_weights(blk, importance[a:e][None, :]), bits)
            err = np.empty_like(blk)
            for i in range(block_size):
                col = blk[:, i]
                q = np.clip(np.rint(col / s[:, 0]) + z[:, 0], 0, maxq)
                codes[c0 : c0 + chunk, b, i] = q.astype(np.uint8)
                dq = s[:, 0] * (q - z[:, 0])
                err[:, i] = (col - dq) / hinv[a + i, a + i]
                if i + 1 < block_size:
                    blk[:, i + 1 :] -= np.outer(err[:, i], hinv[a + i, a + i + 1 : e]).astype(np.float32)
            if e < rows:
                w[:, e:] -= (err @ hinv[a:e, e:].astype(np.float32)).astype(np.float32)
            scales[c0 : c0 + chunk, b] = s[:, 0]
            zeros[c0 : c0 + chunk, b] = z[:, 0].astype(np.uint8)
    return Blocks(codes, scales, zeros, bits, block_size, rows)


def relative_error(weight: np.ndarray, blocks: Blocks, importance: np.ndarray | None = None) -> float:
    """||W - dequantize|| / ||W|| (rows weighted by ``importance`` [K] when given: the output error's proxy)."""
    d = (weight - blocks.dequantize()) ** 2
    w2 = weight.astype(np.float64) ** 2
    if importance is not None:
        d, w2 = d * importance[:, None], w2 * importance[:, None]
    return float(np.sqrt(d.sum() / max(w2.sum(), 1e-30)))
