"""The llvm schedules of the quantized kernels, for the vector width of the host's CPU (compile
for `compiler.targets.host_target()`, `host_target(avx512=True)` for the lookup GEMV):
- GEMV of Q4_0 / Q4_1 under an AVX-512 target (`table_gemv`): each block's 16 possible weights
  as one float32x16 table, indexed by the block's nibbles with vpermps; x in float32.
- GEMV (T statically 1, decode; the other formats, or no AVX-512): parallel over chunks of
  rows; per row tile of NR rows and sub-block, V-lane dot products of the integer quants with X
  in a register, scaled into NR x V accumulators, summed at the end (scaling per weight instead
  made Q8_0's LM head latency-bound on one accumulator; figures: docs/performance.md).
- GEMM (T symbolic, prefill): per parallel chunk of NB rows, the chunk of W is dequantized once
  into an f32 scratch tile [NB, K], which every token tile then multiplies as CPUMatmul does
  (tokens padded to MR, MR x NR x V register tile of lanes along K).
- take: one thread (a decode step looks up one row), vectorized over K.
"""

from __future__ import annotations

import dataclasses

from tvm import s_tir, tirx
from tvm.script import tirx as T

from tir_kernels.common import CPU_SCRATCH_SCOPE

from ..compiler.targets import host_cpu, target_has_avx512
from ..weights.quant import BLOCK
from .algorithms import i64
from .config import QuantMatmulConfig

# 4-bit formats whose one-token product `table_gemv` computes (w = table[q], one table a block)
TABLE_GEMV_FORMATS = ("Q4_0", "Q4_1")


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
    blocks and of 1 row for Q8_0 (memory-bound: each row of a tile is a stream of its own, and
    one stream is fastest on a long Q8_0 head); GEMM register tiles of 3 rows x 4 tokens (12
    accumulators: faster than 2 x 4, while 4 x 3 and 3 x 5 spill). Figures: docs/performance.md.
    Under an AVX-512 target scope (`compiler.targets.host_target(avx512=True)`), the one-token
    product of Q4_0 and Q4_1 is `table_gemv` (lookup=True)."""
    lanes = host_cpu()[1]
    if config.op == "matmul" and config.tokens != 1:
        return CPUSchedule(lanes=lanes, rows=3, token_tile=4, chunk=48)
    if config.op == "matmul" and config.fmt in TABLE_GEMV_FORMATS and target_has_avx512(None):
        # the lookup GEMV: tiles of 4 rows for short rows, 1 row (one sequential stream) for rows
        # of 1024 weights and more, where more rows per tile were slower (docs/performance.md)
        return CPUSchedule(lanes=16, rows=1 if config.k >= 1024 else 4, chunk=32, lookup=True)
    # GEMV chunks of 32 rows: SmolLM2's 576- and 960-row projections then split into an even
    # number of tasks (18, 30; 9 and 15 with 64), balanced on 2 cores
    return CPUSchedule(lanes=lanes, rows=1 if config.fmt == "Q8_0" else 4, chunk=32)


def _divisor_at_most(n: int, limit: int, multiple_of: int = 1) -> int:
    return next((c for c in range(min(limit, n), 0, -1) if n % c == 0 and c % multiple_of == 0), 1)


def _schedule_gemv(sch: s_tir.Schedule, config: QuantMatmulConfig, plan: CPUSchedule) -> None:
    """gemv_algorithm's blocks: XS once per call (a few vectors); parallel chunks of rows; per row
    tile of NR rows, its scales and offsets converted to float32 first (a loop LLVM vectorizes;
    inside the loop over sub-blocks they cost 5 instructions per sub-block and row, about a fifth
    of it), then per sub-block the V-lane dot products P (h unrolled) in a
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
    SmolLM2), which a parallel loop made wait for every worker of the pool (on a loaded machine,
    for a whole scheduler time slice against the microseconds of the lookup)."""
    block = sch.get_sblock("take")
    _, c = sch.get_loops(block)
    _, cv = sch.split(c, factors=[None, plan.lanes])
    sch.vectorize(cv)


def schedule_llvm(func: tirx.PrimFunc, config: QuantMatmulConfig, plan: CPUSchedule) -> tirx.PrimFunc:
    """`func` (take_algorithm; gemv_algorithm for one static token; else matmul_algorithm of
    `config`) scheduled by `plan` for llvm."""
    sch = s_tir.Schedule(func)
    if config.op == "take":
        _schedule_take(sch, config, plan)
    elif config.tokens == 1:
        _schedule_gemv(sch, config, plan)
    else:
        _schedule_gemm(sch, config, plan)
    return sch.mod["main"]


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

