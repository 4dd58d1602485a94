"""The algorithms of the quantized kernels (TE computes, no schedule):

    W[n, k] = dequant(parts, n, k)                 float32, rounded as GGML's dequantizers
    Y[t, n] = sum_k X[t, k] * W[n, k]              X float32 [T, K], Y float32 [T, N]   (matmul_algorithm)
    E[i, k] = dequant(parts, ids[i], k)            ids int32 [I], E float32 [I, K]      (take_algorithm)
    W[n, k] = dequant(parts, n, k)                 W [N, K] in the activations' dtype   (dequantize_algorithm)

and, for one token, Y in block-factored form (`gemv_algorithm`: W = scale * q + offset per
sub-block, the scale and offset applied once per sub-block and lane, not per weight). The parts
and their shapes: config.py.
"""

from __future__ import annotations

from tvm import te, tirx

from ..weights.quant import BLOCK, SUPER_BLOCK
from .config import QuantMatmulConfig


def _bits(byte, shift, mask: int):
    """(byte >> shift) & mask, uint8."""
    return (byte >> shift.astype("uint8")) & tirx.const(mask, "uint8")


def _dequant(fmt: str, parts: dict[str, te.Tensor], row, col):
    """The float32 value of W[row, col] from the block arrays (rounded as GGML's dequantizers)."""
    f32 = "float32"
    if fmt == "Q4_K":  # (d * sc) * q - dmin * m: both products exact in float32
        sub, sup = col // BLOCK, col // SUPER_BLOCK
        q = _bits(parts["qs"][row, col // 64 * 32 + col % 32], sub % 2 * 4, 15).astype(f32)
        return (parts["d"][row, sup].astype(f32) * parts["sc"][row, sub].astype(f32) * q
                - parts["dmin"][row, sup].astype(f32) * parts["mn"][row, sub].astype(f32))
    if fmt == "Q6_K":  # (d * sc) * (q - 32)
        half, quarter, lane = col // 128, col % 128 // 32, col % 32
        low = _bits(parts["ql"][row, half * 64 + quarter % 2 * 32 + lane], quarter // 2 * 4, 15)
        high = _bits(parts["qh"][row, half * 32 + lane], quarter * 2, 3)
        q = (low | (high << tirx.const(4, "uint8"))).astype(f32) - tirx.const(32.0, f32)
        return parts["d"][row, col // SUPER_BLOCK].astype(f32) * parts["sc"][row, col // 16].astype(f32) * q
    blk = col // BLOCK
    d = parts["d"][row, blk].astype("float32")
    if fmt == "Q5_0":  # d * (q - 16), q - 16 exact
        return d * (_q5(parts, row, col) - tirx.const(16.0, f32))
    if fmt == "Q8_0":
        return d * parts["qs"][row, col].astype("float32")
    byte = parts["qs"][row, blk * (BLOCK // 2) + col % (BLOCK // 2)]
    shift = ((col % BLOCK) // (BLOCK // 2) * 4).astype("uint8")
    q = ((byte >> shift) & tirx.const(15, "uint8")).astype("float32")
    if fmt == "Q4_0":
        return d * (q - tirx.const(8.0, "float32"))
    return d * q + parts["m"][row, blk].astype("float32")


def _q5(parts: dict[str, te.Tensor], row, col):
    """The 5-bit quant (0..31, float32) of Q5_0's W[row, col]: low nibble from qs, 5th bit from qh."""
    blk, j = col // BLOCK, col % BLOCK
    low = _bits(parts["qs"][row, blk * 16 + j % 16], j // 16 * 4, 15)
    high = _bits(parts["qh"][row, blk * 4 + j // 8], j % 8, 1)
    return (low | (high << tirx.const(4, "uint8"))).astype("float32")


def i64(value: int) -> tirx.IntImm:
    """`value` as an int64 immediate."""
    return tirx.IntImm("int64", value)  # Relax passes int64 shapes: every index is int64


def _placeholders(config: QuantMatmulConfig) -> dict[str, te.Tensor]:
    return {name: te.placeholder(tuple(i64(d) for d in shape), dtype, name=f"w_{name}")
            for name, dtype, shape in config.part_shapes()}


def matmul_algorithm(config: QuantMatmulConfig) -> tirx.PrimFunc:
    """Y[t, n] = sum_k X[t, k] * dequant(W)[n, k]: arguments (X [T, K], *parts, Y [T, N]) in
    config.dtype; the sum in float32 (a float16 Y is the sum's rounding, block `cast`)."""
    parts = _placeholders(config)
    tokens = i64(config.tokens) if config.tokens is not None else tirx.Var("n_tokens", "int64")
    n, k = i64(config.n), i64(config.k)
    x = te.placeholder((tokens, k), config.dtype, name="x")
    w = te.compute((n, k), lambda r, c: _dequant(config.fmt, parts, r, c), name="dequant")
    red = te.reduce_axis((i64(0), k), name="k")
    y = te.compute((tokens, n), lambda t, r: te.sum(x[t, red].astype("float32") * w[r, red], axis=red),
                   name="matmul")
    if config.dtype != "float32":
        y = te.compute((tokens, n), lambda t, r: y[t, r].astype(config.dtype), name="cast")
    return te.create_prim_func([x, *parts.values(), y])


def _block_terms(fmt: str, parts: dict[str, te.Tensor]):
    """(SB, q, scale, offset): W[n, c] = scale(n, s) * q(n, c) + offset(n, s) for c in sub-block
    s = c // SB, with q integer-valued (float32) and the sub-block's scale and offset float32."""
    f32 = "float32"

    def half(name):
        return lambda n, s: parts[name][n, s].astype(f32)

    if fmt == "Q8_0":
        return BLOCK, lambda n, c: parts["qs"][n, c].astype(f32), half("d"), None
    if fmt == "Q5_0":
        return (BLOCK, lambda n, c: _q5(parts, n, c), half("d"),
                lambda n, s: parts["d"][n, s].astype(f32) * tirx.const(-16.0, f32))
    if fmt in ("Q4_0", "Q4_1"):
        def q(n, c):
            return _bits(parts["qs"][n, c // BLOCK * 16 + c % 16], c % BLOCK // 16 * 4, 15).astype(f32)
        if fmt == "Q4_0":
            return BLOCK, q, half("d"), lambda n, s: parts["d"][n, s].astype(f32) * tirx.const(-8.0, f32)
        return BLOCK, q, half("d"), half("m")
    if fmt == "Q4_K":
        def q(n, c):
            return _bits(parts["qs"][n, c // 64 * 32 + c % 32], c // BLOCK % 2 * 4, 15).astype(f32)

        def scale(n, s):
            return parts["d"][n, s // 8].astype(f32) * parts["sc"][n, s].astype(f32)

        def offset(n, s):
            return tirx.const(0.0, f32) - parts["dmin"][n, s // 8].astype(f32) * parts["mn"][n, s].astype(f32)

        return BLOCK, q, scale, offset

    def q6(n, c):  # Q6_K: 6-bit q - 32, sub-blocks of 16
        half_, quarter, lane = c // 128, c % 128 // 32, c % 32
        low = _bits(parts["ql"][n, half_ * 64 + quarter % 2 * 32 + lane], quarter // 2 * 4, 15)
        high = _bits(parts["qh"][n, half_ * 32 + lane], quarter * 2, 3)
        return (low | (high << tirx.const(4, "uint8"))).astype(f32) - tirx.const(32.0, f32)

    def scale6(n, s):
        return parts["d"][n, s // 16].astype(f32) * parts["sc"][n, s].astype(f32)

    return 16, q6, scale6, None


def gemv_algorithm(config: QuantMatmulConfig, lanes: int) -> tirx.PrimFunc:
    """The one-token product in block-factored form (same arguments as matmul_algorithm):

        P[n, s, v]  = sum_h q(n, s*SB + h*V + v) * X[s*SB + h*V + v]     (V = lanes, SB = sub-block)
        XS[s, v]    = sum_h X[s*SB + h*V + v]                             (formats with offsets)
        A[n, v]     = sum_s scale(n, s) * P[n, s, v] + offset(n, s) * XS[s, v]   (scale, offset: float32 stages)
        Y[n]        = sum_v A[n, v]

    so the scales multiply once per sub-block and lane instead of once per weight (the sums are
    dequantize-then-matmul's, associated differently: float32 rounding differs, not the values)."""
    fmt = config.fmt
    parts = _placeholders(config)
    sb, q, scale, offset = _block_terms(fmt, parts)
    if sb % lanes:
        raise ValueError(f"lanes={lanes} must divide the {fmt} sub-block of {sb}")
    one, n, k, v_ = i64(1), i64(config.n), i64(config.k), i64(lanes)
    nsb = i64(config.k // sb)
    x = te.placeholder((one, k), "float32", name="x")
    h = te.reduce_axis((i64(0), i64(sb // lanes)), name="h")
    part = te.compute((one, n, nsb, v_), lambda t, r, s, v: te.sum(
        q(r, s * sb + h * lanes + v) * x[t, s * sb + h * lanes + v], axis=h), name="block_dot")
    s2 = te.reduce_axis((i64(0), nsb), name="s")
    scales = te.compute((n, nsb), scale, name="scales")  # float32, converted once per row tile
    if offset is None:
        acc = te.compute((one, n, v_), lambda t, r, v: te.sum(scales[r, s2] * part[t, r, s2, v], axis=s2),
                         name="scaled")
    else:
        offsets = te.compute((n, nsb), offset, name="offsets")
        h2 = te.reduce_axis((i64(0), i64(sb // lanes)), name="h2")
        xs = te.compute((one, nsb, v_), lambda t, s, v: te.sum(x[t, s * sb + h2 * lanes + v], axis=h2),
                        name="x_block_sum")
        acc = te.compute((one, n, v_), lambda t, r, v: te.sum(
            scales[r, s2] * part[t, r, s2, v] + offsets[r, s2] * xs[t, s2, v], axis=s2), name="scaled")
    w = te.reduce_axis((i64(0), v_), name="w")
    y = te.compute((one, n), lambda t, r: te.sum(acc[t, r, w], axis=w), name="matmul")
    return te.create_prim_func([x, *parts.values(), y])


def take_algorithm(config: QuantMatmulConfig) -> tirx.PrimFunc:
    """E[i, k] = dequant(W)[ids[i], k]: arguments (ids int32 [I] (I symbolic), *parts, E [I, K] in
    config.dtype).

    An id outside [0, N) reads out of bounds: the caller checks ids (tvmattn.generate does)."""
    parts = _placeholders(config)
    ids = te.placeholder((tirx.Var("n_ids", "int64"),), "int32", name="ids")
    out = te.compute((ids.shape[0], i64(config.k)),
                     lambda i, c: _dequant(config.fmt, parts, ids[i].astype("int64"), c).astype(config.dtype),
                     name="take")
    return te.create_prim_func([ids, *parts.values(), out])


def dequantize_algorithm(config: QuantMatmulConfig) -> tirx.PrimFunc:
    """W[n, k] = dequant(W)[n, k]: arguments (*parts, W [N, K] in config.dtype)."""
    parts = _placeholders(config)
    out = te.compute((i64(config.n), i64(config.k)),
                     lambda n, c: _dequant(config.fmt, parts, n, c).astype(config.dtype), name="dequantize")
    return te.create_prim_func([*parts.values(), out])
