"""Fused dequantize + matmul (and embedding lookup) over GGUF block-quantized weights.

Weights W [N, K] (N output features, K input features, a multiple of 32) arrive as the separate
arrays of tvmattn.weights.quant.PACKED, rows first:
  Q4_0: qs uint8 [N, K/2], d float16 [N, K/32]                 w = d * (q - 8)
  Q4_1: qs uint8 [N, K/2], d float16 [N, K/32], m float16 [.]  w = d * q + m
  Q8_0: qs int8 [N, K],    d float16 [N, K/32]                 w = d * q
  (4-bit: byte b of block kb holds element kb*32 + b in its low nibble, kb*32 + 16 + b in its high one.)

The algorithm is written once (`matmul_algorithm`, `take_algorithm`: TE computes, no schedule):

    W[n, k] = dequant(parts, n, k)                 float32
    Y[t, n] = sum_k X[t, k] * W[n, k]              X float32 [T, K], Y float32 [T, N]
    E[i, k] = dequant(parts, ids[i], k)            ids int32 [I], E float32 [I, K]

and scheduled per target (`schedule`). On llvm (`_schedule_gemv`, `_schedule_gemm`, for the
vector width of the host's CPU; compile for `host_target()`):
- GEMV (T statically 1, decode): the dequantization inlined into the dot products; parallel over
  chunks of rows; per row tile of NR rows, K in blocks of 32 read as 32 / V vectors of V lanes
  (V = the host's float lanes), NR x 32 accumulators in registers, summed at the end.
- GEMM (T symbolic, prefill): per parallel chunk of NB rows, the chunk of W is dequantized once
  into an f32 scratch tile [NB, K], which every token tile then multiplies as CPUMatmul does
  (tokens padded to MR, MR x NR x V register tile of lanes along K).
- take: parallel over ids, vectorized over K.
Only llvm is scheduled today; a CUDA schedule of the same algorithm is the next step.
"""

from __future__ import annotations

import dataclasses
import functools

import tvm
from tvm import s_tir, te, tirx

from ..weights.quant import BLOCK, PACKED, QUANT_TYPES

OPS = ("matmul", "take")


@functools.lru_cache(maxsize=1)
def host_cpu() -> tuple[str, int]:
    """(LLVM name of this machine's CPU, float32 lanes of the vectors we compile for: 8 with AVX2, else 4)."""
    from tvm.target import codegen

    cpu = codegen.llvm_get_system_cpu()
    features = codegen.llvm_get_cpu_features(tvm.target.Target({"kind": "llvm", "mcpu": cpu}))
    return cpu, 8 if "avx2" in features else 4


def host_target() -> tvm.target.Target:
    """The llvm target of this machine's CPU (its instructions, 256-bit vectors at most).

    AVX-512 is switched off: with it, LLVM takes minutes instead of seconds on the float matmuls
    dlight schedules in the same library (a 2-layer SmolLM2 with float weights: 164 s against 47 s
    for plain llvm and 25 s without AVX-512), and on Zen 4, which runs 512-bit operations as two
    256-bit halves, the fused kernels gain little from it (GEMV 3072 x 576 Q4_1: 0.15 against
    0.17 ms)."""
    return tvm.target.Target({"kind": "llvm", "mcpu": host_cpu()[0], "mattr": ["-avx512f"]})


@dataclasses.dataclass(frozen=True)
class QuantMatmulConfig:
    """What a kernel computes.

    fmt: block type (QUANT_TYPES); n: output features (rows of W; for take, rows of the table);
    k: input features (a multiple of 32); tokens: for matmul, the static token count T, or None
    for a symbolic one (`n_tokens`, int64); op: "matmul" or "take"; target: "llvm".
    """

    fmt: str
    n: int
    k: int
    tokens: int | None = None
    op: str = "matmul"
    target: str = "llvm"

    def __post_init__(self):
        if self.fmt not in QUANT_TYPES:
            raise ValueError(f"fmt={self.fmt!r}: expected one of {QUANT_TYPES}")
        for name in ("n", "k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r}: expected a positive integer")
        if self.k % BLOCK:
            raise ValueError(f"k={self.k}: expected a multiple of {BLOCK} (whole blocks)")
        if self.tokens is not None and (not isinstance(self.tokens, int) or self.tokens <= 0):
            raise ValueError(f"tokens={self.tokens!r}: expected None (symbolic) or a positive integer")
        if self.op not in OPS:
            raise ValueError(f"op={self.op!r}: expected one of {OPS}")
        if self.target != "llvm":
            raise ValueError(f"target={self.target!r}: only 'llvm' is scheduled (CUDA: not yet)")

    @property
    def name(self) -> str:
        """A symbol naming the kernel, e.g. quant_matmul_q4_1_3072x576_n (n: symbolic tokens)."""
        tokens = "" if self.op == "take" else f"_{self.tokens or 'n'}"
        return f"quant_{self.op}_{self.fmt.lower()}_{self.n}x{self.k}{tokens}"

    def part_shapes(self) -> list[tuple[str, str, tuple[int, int]]]:
        """(name, dtype, shape) of each weight array, in argument order."""
        return [(name, dtype, (self.n, self.k // BLOCK * per_block)) for name, dtype, per_block in PACKED[self.fmt]]


# ---------------------------------------------------------------------------- algorithm


def _dequant(fmt: str, parts: dict[str, te.Tensor], row, col):
    """The float32 value of W[row, col] from the block arrays."""
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
    """Y[t, n] = sum_k X[t, k] * dequant(W)[n, k]: arguments (X f32 [T, K], *parts, Y f32 [T, N])."""
    parts = _placeholders(config)
    tokens = _i64(config.tokens) if config.tokens is not None else tirx.Var("n_tokens", "int64")
    n, k = _i64(config.n), _i64(config.k)
    x = te.placeholder((tokens, k), "float32", name="x")
    w = te.compute((n, k), lambda r, c: _dequant(config.fmt, parts, r, c), name="dequant")
    red = te.reduce_axis((_i64(0), k), name="k")
    y = te.compute((tokens, n), lambda t, r: te.sum(x[t, red] * w[r, red], axis=red), name="matmul")
    return te.create_prim_func([x, *parts.values(), y])


def take_algorithm(config: QuantMatmulConfig) -> tirx.PrimFunc:
    """E[i, k] = dequant(W)[ids[i], k]: arguments (ids int32 [I] (I symbolic), *parts, E f32 [I, K]).

    An id outside [0, N) reads out of bounds: the caller checks ids (tvmattn.generate does)."""
    parts = _placeholders(config)
    ids = te.placeholder((tirx.Var("n_ids", "int64"),), "int32", name="ids")
    out = te.compute((ids.shape[0], _i64(config.k)),
                     lambda i, c: _dequant(config.fmt, parts, ids[i].astype("int64"), c), name="take")
    return te.create_prim_func([ids, *parts.values(), out])


# ---------------------------------------------------------------------------- schedules


@dataclasses.dataclass(frozen=True)
class CPUSchedule:
    """How an llvm kernel is tiled (never what it computes).

    lanes: V, float32 vector lanes (a divisor of 32); rows: NR, rows per register tile;
    token_tile: MR (GEMM); chunk: NB, rows per parallel task (a multiple of NR; GEMV and GEMM
    round it down to a divisor of N).
    """

    lanes: int = 16
    rows: int = 4
    token_tile: int = 4
    chunk: int = 32

    def __post_init__(self):
        if self.lanes not in (4, 8, 16, 32):
            raise ValueError(f"lanes={self.lanes!r}: expected 4, 8, 16 or 32")
        for name in ("rows", "token_tile", "chunk"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r}: expected a positive integer")
        if self.chunk % self.rows:
            raise ValueError(f"chunk={self.chunk} must be a multiple of rows={self.rows}")


def choose_schedule(config: QuantMatmulConfig) -> CPUSchedule:
    """The schedule of `config` on this host: its vector width; GEMV row tiles of 4 rows for 4-bit
    blocks (compute-bound: independent accumulators) and of 1 row for Q8_0 (memory-bound: each row
    tile is a stream of its own; SmolLM2's 49152 x 576 head: 2.4 ms with 1 row, 4.7-5.4 ms with
    2-8 on 2 Zen 4 cores); 2 rows x 4 tokens for the GEMM."""
    lanes = host_cpu()[1]
    if config.op == "matmul" and config.tokens != 1:
        return CPUSchedule(lanes=lanes, rows=2, token_tile=4, chunk=32)
    return CPUSchedule(lanes=lanes, rows=1 if config.fmt == "Q8_0" else 4, chunk=64)


def _divisor_at_most(n: int, limit: int, multiple_of: int = 1) -> int:
    return next((c for c in range(min(limit, n), 0, -1) if n % c == 0 and c % multiple_of == 0), 1)


def _schedule_gemv(sch: s_tir.Schedule, config: QuantMatmulConfig, plan: CPUSchedule) -> None:
    mm = sch.get_sblock("matmul")
    sch.compute_inline(sch.get_sblock("dequant"))
    t, r, k = sch.get_loops(mm)
    ko, kh, kv = sch.split(k, factors=[None, BLOCK // plan.lanes, plan.lanes])
    rf = sch.rfactor(kv, factor_axis=2)  # rf[t, n, V]: V accumulator lanes per row
    nr = _divisor_at_most(config.n, plan.rows)
    nb = _divisor_at_most(config.n, plan.chunk, nr)
    t, r, ko, kh, kv = sch.get_loops(rf)
    rp, rm, ri = sch.split(r, factors=[None, nb // nr, nr])
    sch.reorder(rp, rm, t, ko, kh, ri, kv)
    sch.parallel(rp)
    sch.unroll(kh)
    sch.unroll(ri)
    sch.vectorize(kv)
    init = sch.decompose_reduction(rf, ko)
    ii = sch.get_loops(init)
    sch.unroll(ii[-2])
    sch.vectorize(ii[-1])
    sch.set_scope(rf, 0, "local")
    sch.reverse_compute_at(mm, rm, preserve_unit_loops=True)
    lanes, _, rows = sch.get_loops(mm)[-3:]
    sch.reorder(rows, lanes)
    sch.unroll(rows)
    sch.unroll(lanes)


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
    # the accumulators [T, N, V] and the tile's sums [T, N] are local; split [T // MR, MR] so a
    # tile's region has static extents and compacts to a few registers
    for block in (rf, mm) if last is not None else (rf,):
        sch.set_scope(block, 0, "local")
        sch.transform_layout(block, ("write", 0), lambda i, *rest: (i // mr, i % mr, *rest))


def _schedule_take(sch: s_tir.Schedule, config: QuantMatmulConfig, plan: CPUSchedule) -> None:
    block = sch.get_sblock("take")
    i, c = sch.get_loops(block)
    sch.parallel(i)
    _, cv = sch.split(c, factors=[None, plan.lanes])
    sch.vectorize(cv)


def schedule(func: tirx.PrimFunc, config: QuantMatmulConfig, plan: CPUSchedule | None = None) -> tirx.PrimFunc:
    """`func` (from matmul_algorithm / take_algorithm of `config`) scheduled for config.target,
    marked scheduled (the model pipeline's dlight rules leave it alone) and opaque (never fused).
    Compile it for `host_target()`: LLVM generates code for the target's CPU (a plain "llvm"
    target is SSE2, which splits every vector into 4-lane pieces)."""
    plan = plan or choose_schedule(config)
    sch = s_tir.Schedule(func)
    if config.op == "take":
        _schedule_take(sch, config, plan)
    elif config.tokens == 1:
        _schedule_gemv(sch, config, plan)
    else:
        _schedule_gemm(sch, config, plan)
    return sch.mod["main"].with_attr("tirx.is_scheduled", True).with_attr("op_pattern", 8)


def kernel(config: QuantMatmulConfig, plan: CPUSchedule | None = None) -> tirx.PrimFunc:
    """The scheduled PrimFunc of `config` (see the module docstring for its arguments)."""
    func = matmul_algorithm(config) if config.op == "matmul" else take_algorithm(config)
    return schedule(func, config, plan).with_attr("global_symbol", config.name)
