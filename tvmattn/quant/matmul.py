"""Fused dequantize + matmul (and embedding lookup) over GGUF block-quantized weights.

Weights W [N, K] (N output features, K input features, whole blocks) arrive as the separate
arrays of tvmattn.weights.quant.PACKED, rows first (shapes: quant.part_shapes):
  Q4_0: qs uint8 [N, K/2], d float16 [N, K/32]                 w = d * (q - 8)
  Q4_1: qs uint8 [N, K/2], d float16 [N, K/32], m float16 [.]  w = d * q + m
  Q8_0: qs int8 [N, K],    d float16 [N, K/32]                 w = d * q
  Q4_K: qs uint8 [N, K/2], sc, mn uint8 [N, K/32], d, dmin float16 [N, K/256]
                                                               w = (d * sc) * q - dmin * mn
  Q6_K: ql uint8 [N, K/2], qh uint8 [N, K/4], sc int8 [N, K/16], d float16 [N, K/256]
                                                               w = (d * sc) * (q - 32)
  (nibble and bit orders: tvmattn/weights/quant.py.)

The algorithms (TE computes, no schedule):

    W[n, k] = dequant(parts, n, k)                 float32, rounded as GGML's dequantizers
    Y[t, n] = sum_k X[t, k] * W[n, k]              X float32 [T, K], Y float32 [T, N]   (matmul_algorithm)
    E[i, k] = dequant(parts, ids[i], k)            ids int32 [I], E float32 [I, K]      (take_algorithm)

and, for one token, Y in block-factored form (`gemv_algorithm`: W = scale * q + offset per
sub-block, the scale and offset applied once per sub-block and lane, not per weight), scheduled
per target (`schedule`). On llvm (`_schedule_gemv`, `_schedule_gemm`, for the vector width of the
host's CPU; compile for `host_target()`, `host_target(avx512=True)` for the lookup GEMV):
- GEMV of Q4_0 / Q4_1 under an AVX-512 target (`table_gemv`): each block's 16 possible weights
  as one float32x16 table, indexed by the block's nibbles with vpermps; x in float32.
- GEMV (T statically 1, decode; the other formats, or no AVX-512): parallel over chunks of
  rows; per row tile of NR rows and sub-block, V-lane dot products of the integer quants with X
  in a register, scaled into NR x V accumulators, summed at the end. (The scale per weight made
  Q8_0's LM head latency-bound on one accumulator: 49152 x 576 on one core, 4.9 -> 1.7-2.0 ms.)
- GEMM (T symbolic, prefill): per parallel chunk of NB rows, the chunk of W is dequantized once
  into an f32 scratch tile [NB, K], which every token tile then multiplies as CPUMatmul does
  (tokens padded to MR, MR x NR x V register tile of lanes along K).
- take: one thread (a decode step looks up one row), vectorized over K.
On CUDA: the 32-weight block formats (Q4_0, Q4_1, Q8_0) for one token or a decode batch run
the GEMV of quant_gemv_cuda.py (`uses_cuda_gemv`); everything else, matmul_algorithm /
take_algorithm under dlight's rules (`_schedule_cuda`).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import tvm
from tvm import s_tir, te, tirx
from tvm.script import tirx as T

from tir_kernels.common import CPU_SCRATCH_SCOPE

from ..weights.quant import BLOCK, BLOCK_ELEMS, QUANT_TYPES, SUPER_BLOCK, part_shapes

OPS = ("matmul", "take")
PROLOGUES = ("none", "rms_norm", "swiglu")  # what a CUDA GEMV applies to X (QuantMatmulConfig.prologue)
TARGET_DTYPES = {"llvm": ("float32",), "cuda": ("float16", "float32")}  # activation dtypes per target


@functools.lru_cache(maxsize=1)
def host_cpu() -> tuple[str, int]:
    """(LLVM name of this machine's CPU, float32 lanes of the vectors we compile for: 8 with AVX2, else 4)."""
    from tvm.target import codegen

    cpu = codegen.llvm_get_system_cpu()
    features = codegen.llvm_get_cpu_features(tvm.target.Target({"kind": "llvm", "mcpu": cpu}))
    return cpu, 8 if "avx2" in features else 4


@functools.lru_cache(maxsize=1)
def host_has_avx512() -> bool:
    """Whether this machine's CPU has AVX-512F (the 16-entry vector lookup of `table_gemv`)."""
    return target_has_avx512(tvm.target.Target({"kind": "llvm", "mcpu": host_cpu()[0]}))


def host_target(avx512: bool = False) -> tvm.target.Target:
    """The llvm target of this machine's CPU (its instructions; 256-bit vectors at most unless
    `avx512` and the CPU has AVX-512).

    AVX-512 is for libraries whose every matrix is kept quantized (export.BuildOptions.host_avx512):
    it gives the 4-bit GEMV its 16-entry vector lookup (`table_gemv`), but LLVM takes minutes
    instead of seconds with it on dlight's float matmuls in the same library (a 2-layer SmolLM2
    with float weights: 164 s against 47 s for plain llvm and 25 s without AVX-512; tests/
    test_model.py's 2-layer tied model with one float projection: 29 s without, unfinished after
    219 s with).
    Kernels pick the lookup from the target in scope (`target_has_avx512`)."""
    if avx512 and host_has_avx512():
        return tvm.target.Target({"kind": "llvm", "mcpu": host_cpu()[0]})
    return tvm.target.Target({"kind": "llvm", "mcpu": host_cpu()[0], "mattr": ["-avx512f"]})


def target_has_avx512(target: tvm.target.Target | None) -> bool:
    """Whether an llvm `target` (None: the one in scope, if any) generates AVX-512F code."""
    from tvm.target import codegen

    target = target or tvm.target.Target.current(allow_none=True)
    if target is None or target.kind.name != "llvm":
        return False
    return "avx512f" in codegen.llvm_get_cpu_features(target)


@dataclasses.dataclass(frozen=True)
class QuantMatmulConfig:
    """What a kernel computes.

    fmt: block type (QUANT_TYPES); n: output features (rows of W; for take, rows of the table);
    k: input features (a multiple of 32); tokens: for matmul, the static token count T, or None
    for a symbolic one (`n_tokens`, int64); op: "matmul" or "take"; target: "llvm" or "cuda";
    dtype: the activations' (X, Y, E): float32 on llvm, float16 or float32 on cuda (products
    are summed in float32 either way); few_tokens: the symbolic token count is a decode batch
    (decode_step, batch_decode: a few rows), which CUDA runs as passes of its GEMV instead of
    dlight's Matmul tiles (llvm ignores it); residual: a matmul that also takes R [T, N] (dtype)
    and returns R + X W^T (only where `uses_cuda_gemv`: the model adds it separately elsewhere);
    prologue: what the CUDA GEMV applies to X first (only where `uses_cuda_gemv`, as residual):
    "rms_norm" (X -> X * rsqrt(mean(X^2) + eps) * G, taking G [K] after the parts; the layer's
    RMSNorm), "swiglu" (X [T, 2K] -> silu(X[:, :K]) * X[:, K:]; the MLP's gate), or "none".
    """

    fmt: str
    n: int
    k: int
    tokens: int | None = None
    op: str = "matmul"
    target: str = "llvm"
    dtype: str = "float32"
    few_tokens: bool = False
    residual: bool = False
    prologue: str = "none"
    eps: float = 1e-5

    def __post_init__(self):
        if self.fmt not in QUANT_TYPES:
            raise ValueError(f"fmt={self.fmt!r}: expected one of {QUANT_TYPES}")
        for name in ("n", "k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r}: expected a positive integer")
        if self.k % BLOCK_ELEMS[self.fmt]:
            raise ValueError(f"k={self.k}: expected a multiple of {BLOCK_ELEMS[self.fmt]} (whole {self.fmt} blocks)")
        if self.tokens is not None and (not isinstance(self.tokens, int) or self.tokens <= 0):
            raise ValueError(f"tokens={self.tokens!r}: expected None (symbolic) or a positive integer")
        if self.op not in OPS:
            raise ValueError(f"op={self.op!r}: expected one of {OPS}")
        if self.target not in TARGET_DTYPES:
            raise ValueError(f"target={self.target!r}: expected one of {tuple(TARGET_DTYPES)}")
        few_ok = not self.few_tokens or (self.tokens is None and self.op == "matmul")
        if not isinstance(self.few_tokens, bool) or not few_ok:
            raise ValueError(f"few_tokens={self.few_tokens!r}: expected a bool, True only for symbolic matmul tokens")
        if not isinstance(self.residual, bool) or self.residual and self.op != "matmul":
            raise ValueError(f"residual={self.residual!r}: expected a bool, True only for a matmul")
        if self.dtype not in TARGET_DTYPES[self.target]:
            raise ValueError(f"dtype={self.dtype!r}: on {self.target} expected one of {TARGET_DTYPES[self.target]}")
        if self.prologue not in PROLOGUES or self.prologue != "none" and self.op != "matmul":
            raise ValueError(f"prologue={self.prologue!r}: expected one of {PROLOGUES} ('none' for a take)")
        if not isinstance(self.eps, float) or not self.eps > 0:
            raise ValueError(f"eps={self.eps!r}: expected a positive float")

    @property
    def name(self) -> str:
        """A symbol naming the kernel, e.g. quant_matmul_q4_1_3072x576_n (n: symbolic tokens, b:
        a symbolic decode batch; float16 activations add _f16)."""
        tokens = "" if self.op == "take" else f"_{self.tokens or ('b' if self.few_tokens else 'n')}"
        dtype = "" if self.dtype == "float32" else "_f16"
        residual = "_res" if self.residual else ""
        prologue = {"none": "", "rms_norm": "_norm", "swiglu": "_swiglu"}[self.prologue]
        return f"quant_{self.op}_{self.fmt.lower()}_{self.n}x{self.k}{tokens}{dtype}{prologue}{residual}"

    def part_shapes(self) -> list[tuple[str, str, tuple[int, int]]]:
        """(name, dtype, shape) of each weight array, in argument order."""
        return part_shapes(self.fmt, self.n, self.k)


# ---------------------------------------------------------------------------- algorithm


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
    if fmt == "Q8_0":
        return d * parts["qs"][row, col].astype("float32")
    byte = parts["qs"][row, blk * (BLOCK // 2) + col % (BLOCK // 2)]
    shift = ((col % BLOCK) // (BLOCK // 2) * 4).astype("uint8")
    q = ((byte >> shift) & tirx.const(15, "uint8")).astype("float32")
    if fmt == "Q4_0":
        return d * (q - tirx.const(8.0, "float32"))
    return d * q + parts["m"][row, blk].astype("float32")


def _i64(value: int) -> tirx.IntImm:
    return tirx.IntImm("int64", value)  # Relax passes int64 shapes: every index is int64


def _placeholders(config: QuantMatmulConfig) -> dict[str, te.Tensor]:
    return {name: te.placeholder(tuple(_i64(d) for d in shape), dtype, name=f"w_{name}")
            for name, dtype, shape in config.part_shapes()}


def matmul_algorithm(config: QuantMatmulConfig) -> tirx.PrimFunc:
    """Y[t, n] = sum_k X[t, k] * dequant(W)[n, k]: arguments (X [T, K], *parts, Y [T, N]) in
    config.dtype; the sum in float32 (a float16 Y is the sum's rounding, block `cast`)."""
    parts = _placeholders(config)
    tokens = _i64(config.tokens) if config.tokens is not None else tirx.Var("n_tokens", "int64")
    n, k = _i64(config.n), _i64(config.k)
    x = te.placeholder((tokens, k), config.dtype, name="x")
    w = te.compute((n, k), lambda r, c: _dequant(config.fmt, parts, r, c), name="dequant")
    red = te.reduce_axis((_i64(0), k), name="k")
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
    one, n, k, v_ = _i64(1), _i64(config.n), _i64(config.k), _i64(lanes)
    nsb = _i64(config.k // sb)
    x = te.placeholder((one, k), "float32", name="x")
    h = te.reduce_axis((_i64(0), _i64(sb // lanes)), name="h")
    part = te.compute((one, n, nsb, v_), lambda t, r, s, v: te.sum(
        q(r, s * sb + h * lanes + v) * x[t, s * sb + h * lanes + v], axis=h), name="block_dot")
    s2 = te.reduce_axis((_i64(0), nsb), name="s")
    scales = te.compute((n, nsb), scale, name="scales")  # float32, converted once per row tile
    if offset is None:
        acc = te.compute((one, n, v_), lambda t, r, v: te.sum(scales[r, s2] * part[t, r, s2, v], axis=s2),
                         name="scaled")
    else:
        offsets = te.compute((n, nsb), offset, name="offsets")
        h2 = te.reduce_axis((_i64(0), _i64(sb // lanes)), name="h2")
        xs = te.compute((one, nsb, v_), lambda t, s, v: te.sum(x[t, s * sb + h2 * lanes + v], axis=h2),
                        name="x_block_sum")
        acc = te.compute((one, n, v_), lambda t, r, v: te.sum(
            scales[r, s2] * part[t, r, s2, v] + offsets[r, s2] * xs[t, s2, v], axis=s2), name="scaled")
    w = te.reduce_axis((_i64(0), v_), name="w")
    y = te.compute((one, n), lambda t, r: te.sum(acc[t, r, w], axis=w), name="matmul")
    return te.create_prim_func([x, *parts.values(), y])


# 4-bit formats whose one-token product `table_gemv` computes (w = table[q], one table a block)
TABLE_GEMV_FORMATS = ("Q4_0", "Q4_1")


def table_gemv(config: QuantMatmulConfig, plan: CPUSchedule) -> tirx.PrimFunc:
    """The one-token product of a 4-bit block format (TABLE_GEMV_FORMATS) by table lookup, for
    AVX-512 (same arguments as matmul_algorithm):

        table[n, s, i] = d[n, s] * i + m[n, s]          i = 0..15 (Q4_0: m = -8 d)
        Y[n]           = sum_s sum_c X[32 s + c] * table[n, s, q(n, 32 s + c)]

    A block's 16 possible weights are one float32x16 vector (one FMA on an iota vector: d * i is
    exact in float32, so every entry is dequantize-then-matmul's d * q + m). The block's 16
    bytes, zero-extended to 16 int32 lanes (vpmovzxbd), index it directly: vpermps reads the low
    4 bits of each lane, so the low nibbles need no mask and the high nibbles one shift; the two
    looked-up vectors multiply X's two halves of the block into 16-lane accumulators. Per block
    and row: about 8 vector instructions against the conversion path's ~23 (nibble unpack,
    int-to-float, scale and offset FMAs with 8 lanes). The lookups are LLVM's x86 intrinsic, not a
    schedule, so the loop nest is written out here; the plan gives its tiling: parallel chunks of
    NB rows (plan.chunk), row tiles of NR rows (plan.rows) sharing X's registers, the tile's
    scales converted to float32 before its blocks, each row's 16 lanes summed at the end."""
    fmt, n, k = config.fmt, config.n, config.k
    if fmt not in TABLE_GEMV_FORMATS or config.op != "matmul" or config.tokens != 1 or config.target != "llvm":
        raise ValueError(f"{config.name}: table_gemv computes one token of {TABLE_GEMV_FORMATS} on llvm")
    nr = _divisor_at_most(n, plan.rows)
    nb = _divisor_at_most(n, plan.chunk, nr)
    nsb, half = k // BLOCK, BLOCK // 2
    i64 = _i64
    f32x16 = "float32x16"
    permute = "llvm.x86.avx512.permvar.sf.512"  # (table float32x16, index int32x16): table[index & 15]
    q4_0 = fmt == "Q4_0"

    @T.macro
    def scales_q4_1(scale, offset, d, m, row):  # the tile's scales and offsets as float32
        for r in T.unroll(nr):
            for s in T.vectorized(nsb):
                scale[r, s] = T.Cast("float32", d[row + r, s])
                offset[r, s] = T.Cast("float32", m[row + r, s])

    @T.macro
    def scales_q4_0(scale, offset, d, m, row):  # m: None; w = d * q - 8 d
        for r in T.unroll(nr):
            for s in T.vectorized(nsb):
                scale[r, s] = T.Cast("float32", d[row + r, s])
                offset[r, s] = scale[r, s] * T.float32(-8.0)

    convert = scales_q4_0 if q4_0 else scales_q4_1

    def lookup(scale, offset, qs, row, r, s, shift):
        """The 16 weights of block s of `row` (tile row r) whose nibbles are (byte >> shift) & 15:
        the block's table (scale * i + offset, i < 16) permuted by the bytes. An expression, not
        TVMScript variables: a vector variable becomes a workspace allocation per parallel task."""
        table = T.broadcast(scale[r, s], 16) * T.Cast(f32x16, T.ramp(0, 1, 16)) + T.broadcast(offset[r, s], 16)
        q = T.Cast("int32x16", qs[row, T.ramp(s * half, 1, 16)])
        return T.call_llvm_pure_intrin(f32x16, permute, table, q >> T.broadcast(shift, 16) if shift else q)

    def accumulate(acc, low, high):
        """acc + the block's two halves. A tile of one row adds their sum (one dependent add a
        block; acc + low + high is two dependent FMAs, which bound a single row's loop); tiles of
        more rows have independent chains to overlap and add in turn (one instruction fewer)."""
        return acc + (low + high) if nr == 1 else acc + low + high

    @T.macro
    def body(x, qs, d, m, y):
        for chunk in T.parallel(i64(n // nb)):
            for tile in range(i64(nb // nr)):
                scale = T.alloc_buffer((nr, nsb), "float32")
                offset = T.alloc_buffer((nr, nsb), "float32")
                acc = T.alloc_buffer((nr, 16), "float32")  # (on the stack: CPU_SCRATCH_SCOPE)
                convert(scale, offset, d, m, chunk * nb + tile * nr)
                for r in T.unroll(nr):
                    acc[r, T.ramp(0, 1, 16)] = T.broadcast(T.float32(0.0), 16)
                for s in range(i64(nsb)):
                    for r in T.unroll(nr):
                        acc[r, T.ramp(0, 1, 16)] = accumulate(
                            acc[r, T.ramp(0, 1, 16)],
                            lookup(scale, offset, qs, chunk * nb + tile * nr + r, r, s, 0)
                            * x[0, T.ramp(s * BLOCK, 1, 16)],
                            lookup(scale, offset, qs, chunk * nb + tile * nr + r, r, s, 4)
                            * x[0, T.ramp(s * BLOCK + 16, 1, 16)])
                for r in T.unroll(nr):  # each row's 16 lanes summed as a tree of halves
                    acc[r, T.ramp(0, 1, 8)] = acc[r, T.ramp(0, 1, 8)] + acc[r, T.ramp(8, 1, 8)]
                    acc[r, T.ramp(0, 1, 4)] = acc[r, T.ramp(0, 1, 4)] + acc[r, T.ramp(4, 1, 4)]
                    acc[r, T.ramp(0, 1, 2)] = acc[r, T.ramp(0, 1, 2)] + acc[r, T.ramp(2, 1, 2)]
                    y[0, chunk * nb + tile * nr + r] = acc[r, 0] + acc[r, 1]

    x_t = T.Buffer((i64(1), i64(k)), "float32")
    qs_t = T.Buffer((i64(n), i64(k // 2)), "uint8")
    d_t = T.Buffer((i64(n), i64(nsb)), "float16")
    m_t = T.Buffer((i64(n), i64(nsb)), "float16")
    y_t = T.Buffer((i64(1), i64(n)), "float32")

    if q4_0:  # no m
        @T.prim_func(check_well_formed=False)
        def func(x: x_t, qs: qs_t, d: d_t, y: y_t):
            T.func_attr({"tirx.noalias": True})
            body(x, qs, d, None, y)
    else:
        @T.prim_func(check_well_formed=False)
        def func(x: x_t, qs: qs_t, d: d_t, m: m_t, y: y_t):
            T.func_attr({"tirx.noalias": True})
            body(x, qs, d, m, y)
    return func


def take_algorithm(config: QuantMatmulConfig) -> tirx.PrimFunc:
    """E[i, k] = dequant(W)[ids[i], k]: arguments (ids int32 [I] (I symbolic), *parts, E [I, K] in
    config.dtype).

    An id outside [0, N) reads out of bounds: the caller checks ids (tvmattn.generate does)."""
    parts = _placeholders(config)
    ids = te.placeholder((tirx.Var("n_ids", "int64"),), "int32", name="ids")
    out = te.compute((ids.shape[0], _i64(config.k)),
                     lambda i, c: _dequant(config.fmt, parts, ids[i].astype("int64"), c).astype(config.dtype),
                     name="take")
    return te.create_prim_func([ids, *parts.values(), out])


# ---------------------------------------------------------------------------- schedules


@dataclasses.dataclass(frozen=True)
class CPUSchedule:
    """How an llvm kernel is tiled (never what it computes).

    lanes: V, float32 vector lanes (a divisor of 32); rows: NR, rows per register tile;
    token_tile: MR (GEMM); chunk: NB, rows per parallel task (a multiple of NR; GEMV and GEMM
    round it down to a divisor of N); lookup: the GEMV of a 4-bit format by table lookup
    (`table_gemv`: AVX-512, 16 lanes) instead of gemv_algorithm's int-to-float conversions.
    """

    lanes: int = 16
    rows: int = 4
    token_tile: int = 4
    chunk: int = 32
    lookup: bool = False

    def __post_init__(self):
        if self.lanes not in (4, 8, 16, 32):
            raise ValueError(f"lanes={self.lanes!r}: expected 4, 8, 16 or 32")
        for name in ("rows", "token_tile", "chunk"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r}: expected a positive integer")
        if self.chunk % self.rows:
            raise ValueError(f"chunk={self.chunk} must be a multiple of rows={self.rows}")
        if not isinstance(self.lookup, bool) or self.lookup and self.lanes != 16:
            raise ValueError(f"lookup={self.lookup!r}: expected a bool, True only with lanes=16 (AVX-512)")


def choose_schedule(config: QuantMatmulConfig) -> CPUSchedule:
    """The schedule of `config` on this host: its vector width; GEMV row tiles of 4 rows for 4-bit
    blocks and of 1 row for Q8_0 (memory-bound: each row tile is a stream of its own; SmolLM2's
    49152 x 576 head on one Zen 4 core: 1.7-2.0 ms with 1 row, 4.4-5.1 ms with 2-4); GEMM register
    tiles of 3 rows x 4 tokens (12 accumulators; Q4_1 1536 x 576 x 120 tokens on one core: 1.6-2.2x
    the 2 x 4 tile's rate, 4 x 3 and 3 x 5 spill). Under an AVX-512 target scope
    (`host_target(avx512=True)`), the one-token product of Q4_0 and Q4_1 is `table_gemv` (lookup=True)."""
    lanes = host_cpu()[1]
    if config.op == "matmul" and config.tokens != 1:
        return CPUSchedule(lanes=lanes, rows=3, token_tile=4, chunk=48)
    if config.op == "matmul" and config.fmt in TABLE_GEMV_FORMATS and target_has_avx512(None):
        # the lookup GEMV: tiles of 4 rows for short rows, 1 row (one sequential stream) for rows
        # of 1024 weights and more (SmolLM2's 576 x 1536 down projection over 30 layers' weights on
        # one core: 77-81 us with 1 row, 92-98 with 2, 94-120 with 4; 3072 x 576: 4 or 2 rows best)
        return CPUSchedule(lanes=16, rows=1 if config.k >= 1024 else 4, chunk=32, lookup=True)
    # GEMV chunks of 32 rows: SmolLM2's 576- and 960-row projections then split into an even
    # number of tasks (18, 30; 9 and 15 with 64), balanced on 2 cores
    return CPUSchedule(lanes=lanes, rows=1 if config.fmt == "Q8_0" else 4, chunk=32)


def _divisor_at_most(n: int, limit: int, multiple_of: int = 1) -> int:
    return next((c for c in range(min(limit, n), 0, -1) if n % c == 0 and c % multiple_of == 0), 1)


def _schedule_gemv(sch: s_tir.Schedule, config: QuantMatmulConfig, plan: CPUSchedule) -> None:
    """gemv_algorithm's blocks: XS once per call (a few vectors); parallel chunks of rows; per row
    tile of NR rows, its scales and offsets converted to float32 first (a loop LLVM vectorizes:
    per sub-block and row they cost 5 instructions, about a fifth of the loop: Q4_1 1536 x 576 on
    one core 81-86 -> 66 us), then per sub-block the V-lane dot products P (h unrolled) in a
    register, scaled (and the offsets added) into NR x V accumulators; the lanes' sum once per
    row tile."""
    acc, part, lane_sum = (sch.get_sblock(name) for name in ("scaled", "block_dot", "matmul"))
    nr = _divisor_at_most(config.n, plan.rows)
    nb = _divisor_at_most(config.n, plan.chunk, nr)
    t, r, v, s = sch.get_loops(acc)
    rp, rm, ri = sch.split(r, factors=[None, nb // nr, nr])
    sch.reorder(rp, rm, t, s, ri, v)
    sch.parallel(rp)
    sch.compute_at(part, ri, preserve_unit_loops=True)
    pv, ph = sch.get_loops(part)[-2:]
    sch.reorder(ph, pv)
    sch.unroll(ph)
    sch.vectorize(pv)
    sch.set_scope(part, 0, CPU_SCRATCH_SCOPE)
    pinit = sch.decompose_reduction(part, ph)
    sch.vectorize(sch.get_loops(pinit)[-1])
    sch.unroll(ri)
    sch.vectorize(v)
    sch.set_scope(acc, 0, CPU_SCRATCH_SCOPE)
    init = sch.decompose_reduction(acc, s)
    ir, iv = sch.get_loops(init)[-2:]
    sch.unroll(ir)
    sch.vectorize(iv)
    sch.reverse_compute_at(lane_sum, rm, preserve_unit_loops=True)
    for loop in sch.get_loops(lane_sum)[-2:]:
        sch.unroll(loop)
    for name in ("scales", "offsets"):  # the tile's scales (and offsets) as float32, before its rows
        if name == "offsets" and config.fmt in ("Q8_0", "Q6_K"):
            continue
        block = sch.get_sblock(name)
        sch.compute_at(block, rm, preserve_unit_loops=True)


def _schedule_gemm(sch: s_tir.Schedule, config: QuantMatmulConfig, plan: CPUSchedule) -> None:
    mm = sch.get_sblock("matmul")
    deq = sch.get_sblock("dequant")
    mr, vec = plan.token_tile, plan.lanes
    nr = _divisor_at_most(config.n, plan.rows)
    nb = _divisor_at_most(config.n, plan.chunk, nr)
    last = None
    if config.tokens is None or config.tokens % mr:
        sch.pad_einsum(mm, [mr, 1, 1])
        last = sch.get_consumers(mm)[0]  # the crop of the padded result
    t, r, k = sch.get_loops(mm)
    ko, ki = sch.split(k, factors=[None, vec])
    rf = sch.rfactor(ki, factor_axis=2)  # rf[t, n, V]
    t, r, ko, ki = sch.get_loops(rf)
    to, ti = sch.split(t, factors=[None, mr])
    rp, rm, ri = sch.split(r, factors=[None, nb // nr, nr])
    sch.reorder(rp, to, rm, ko, ti, ri, ki)
    sch.parallel(rp)
    sch.unroll(ti)
    sch.unroll(ri)
    sch.vectorize(ki)
    init = sch.decompose_reduction(rf, ko)
    ii = sch.get_loops(init)
    sch.unroll(ii[-3])
    sch.unroll(ii[-2])
    sch.vectorize(ii[-1])
    sch.reverse_compute_at(mm, rm, preserve_unit_loops=True)
    for loop in sch.get_loops(mm)[-3:]:
        sch.unroll(loop)
    if last is not None:
        sch.reverse_compute_at(last, rm, preserve_unit_loops=True)
        for loop in sch.get_loops(last)[-2:]:
            sch.unroll(loop)
    # the chunk of W, dequantized once per parallel task into a scratch tile [NB, K]
    sch.compute_at(deq, rp, preserve_unit_loops=True)
    dr, dk = sch.get_loops(deq)[-2:]
    _, dv = sch.split(dk, factors=[None, vec])
    sch.vectorize(dv)
    # the accumulators [T, N, V] and the tile's sums [T, N] are stack scratch (CPU_SCRATCH_SCOPE);
    # split [T // MR, MR] so a tile's region has static extents and compacts to a few registers
    for block in (rf, mm) if last is not None else (rf,):
        sch.set_scope(block, 0, CPU_SCRATCH_SCOPE)
        sch.transform_layout(block, ("write", 0), lambda i, *rest: (i // mr, i % mr, *rest))


def _schedule_take(sch: s_tir.Schedule, config: QuantMatmulConfig, plan: CPUSchedule) -> None:
    """One thread, vectorized along the row: a decode step looks up one row (576 values for
    SmolLM2), which a parallel loop made wait for every worker of the pool (on a loaded 2-core
    machine, for a scheduler time slice: 5-7 ms against microseconds)."""
    block = sch.get_sblock("take")
    _, c = sch.get_loops(block)
    _, cv = sch.split(c, factors=[None, plan.lanes])
    sch.vectorize(cv)


def cuda_target() -> tvm.target.Target:
    """The CUDA target the schedules read their limits from (threads, shared memory): the
    current one when a CUDA target is in scope, else sm_90's."""
    current = tvm.target.Target.current(allow_none=True)
    if current is not None and current.kind.name == "cuda":
        return current
    return tvm.target.Target({"kind": "cuda", "arch": "sm_90", "max_shared_memory_per_block": 49152,
                              "max_threads_per_block": 1024, "thread_warp_size": 32})


def _schedule_cuda(func: tirx.PrimFunc, config: QuantMatmulConfig) -> tirx.PrimFunc:
    """matmul_algorithm / take_algorithm scheduled for CUDA. The dequantization is an injective
    producer of the product, the pattern dlight's GPU rules fuse (what MLC's q4f16 kernels
    rely on): one static token (decode) gets dlight's GEMV (each thread group walks whole rows of
    blocks, the weight dequantized in registers on its way into the dot product, the partial sums
    reduced across the threads); more tokens get dlight's Matmul (tiles of W dequantized into
    shared memory once per token tile); the embedding lookup a thread per element."""
    from tvm.s_tir import dlight as dl

    target = cuda_target()
    if config.op == "take":
        rules = [dl.gpu.Fallback()]
    elif config.tokens == 1:
        rules = [dl.gpu.GEMV(), dl.gpu.Fallback()]
    else:
        rules = [dl.gpu.Matmul(), dl.gpu.Fallback()]
    for rule in rules:
        scheduled = rule.apply(func, target, False)
        if isinstance(scheduled, list):
            scheduled = scheduled[0] if scheduled else None
        if scheduled is not None:
            return scheduled.mod["main"]
    raise ValueError(f"{config.name}: no CUDA schedule applies")


# a decode batch's GEMV passes keep each weight block in registers but re-read X per token and
# row: weights above this size (SmolLM2's 30 MB Q8_0 LM head) keep dlight's Matmul for a batch
CUDA_GEMV_MAX_BATCH_WEIGHT_BYTES = 16 << 20


def uses_cuda_gemv(config: QuantMatmulConfig) -> bool:
    """Whether `config` runs quant_gemv_cuda's kernel: a CUDA matmul of a 32-weight block format
    for one static token (decode; also a few static tokens) or a decode batch (`few_tokens`) whose
    weight is at most CUDA_GEMV_MAX_BATCH_WEIGHT_BYTES; else dlight's rules (`_schedule_cuda`)."""
    from .gemv_cuda import GEMV_FORMATS

    if config.target != "cuda" or config.op != "matmul" or config.fmt not in GEMV_FORMATS:
        return False
    if config.tokens is not None:
        return config.tokens <= 8
    weight_bytes = sum(np.prod(shape) * np.dtype(dtype).itemsize for _, dtype, shape in config.part_shapes())
    return config.few_tokens and weight_bytes <= CUDA_GEMV_MAX_BATCH_WEIGHT_BYTES


def _scheduled(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` marked scheduled (the model pipeline's dlight rules leave it alone) and opaque (never fused)."""
    return func.with_attr("tirx.is_scheduled", True).with_attr("op_pattern", 8)


def schedule(func: tirx.PrimFunc, config: QuantMatmulConfig, plan: CPUSchedule | None = None) -> tirx.PrimFunc:
    """`func` (from matmul_algorithm / take_algorithm of `config`) scheduled for config.target,
    marked scheduled (the model pipeline's dlight rules leave it alone) and opaque (never fused).
    Compile it for `host_target()`: LLVM generates code for the target's CPU (a plain "llvm"
    target is SSE2, which splits every vector into 4-lane pieces)."""
    if config.target == "cuda":
        return _scheduled(_schedule_cuda(func, config))
    plan = plan or choose_schedule(config)
    sch = s_tir.Schedule(func)
    if config.op == "take":
        _schedule_take(sch, config, plan)
    elif config.tokens == 1:
        _schedule_gemv(sch, config, plan)
    else:
        _schedule_gemm(sch, config, plan)
    return _scheduled(sch.mod["main"])


def algorithm(config: QuantMatmulConfig, plan: CPUSchedule | None) -> tirx.PrimFunc:
    """The unscheduled PrimFunc `schedule` expects for `config`: take_algorithm, on llvm
    gemv_algorithm (one static token, with the plan's lanes), else matmul_algorithm."""
    if config.op == "take":
        return take_algorithm(config)
    if config.target == "llvm" and config.tokens == 1:
        return gemv_algorithm(config, (plan or choose_schedule(config)).lanes)
    return matmul_algorithm(config)


def kernel(config: QuantMatmulConfig, plan: CPUSchedule | None = None) -> tirx.PrimFunc:
    """The scheduled PrimFunc of `config` (see the module docstring for its arguments)."""
    if config.residual and not uses_cuda_gemv(config):
        raise ValueError(f"{config.name}: residual=True needs the CUDA GEMV (uses_cuda_gemv)")
    if config.prologue != "none" and not uses_cuda_gemv(config):
        raise ValueError(f"{config.name}: prologue={config.prologue!r} needs the CUDA GEMV (uses_cuda_gemv)")
    if uses_cuda_gemv(config):
        from .gemv_cuda import choose_gemv_schedule, gemv_kernel

        func = gemv_kernel(config.fmt, config.n, config.k, config.tokens, config.dtype,
                           choose_gemv_schedule(config.n, config.k, config.tokens, config.prologue),
                           residual=config.residual, prologue=config.prologue, eps=config.eps)
        return _scheduled(func).with_attr("global_symbol", config.name)
    if config.target == "llvm":
        plan = plan or choose_schedule(config)
        if plan.lookup and config.op == "matmul" and config.tokens == 1:
            scope = tvm.target.Target.current(allow_none=True)
            if scope is not None and not target_has_avx512(scope):
                raise ValueError(f"{config.name}: plan.lookup needs an AVX-512 target, the scope's is {scope}")
            return _scheduled(table_gemv(config, plan)).with_attr("global_symbol", config.name)
    return schedule(algorithm(config, plan), config, plan).with_attr("global_symbol", config.name)
