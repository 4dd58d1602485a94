"""The llvm schedules of the quantized kernels, for the vector width of the host's CPU (compile
for `compiler.targets.host_target()`, `host_target(avx512=True)` for the lookup GEMV):
- GEMV of Q4_0 / Q4_1 under an AVX-512 target (`table_gemv`): each block's 16 possible weights
  as one float32x16 table, indexed by the block's nibbles with vpermps; x in float32.
- GEMV of Q8_0 / Q5_0 / Q4_K / Q6_K under an AVX-512 target (`unpack_gemv`): each 32 weights of a
  row unpacked from their quants as one vector (shifts, masks, a byte concatenation; Q5_0's fifth
  bits spread by one multiply), dequantized and multiplied with x in float32.
- (on request, CPUSchedule.dot: `dot_gemv`, the same products by int8 dot products under AVX-512
  VNNI, x rounded to one or two int8 digits per 32 columns; faster where the weights are in
  cache, not exact: see its docstring and docs/performance.md.)
- GEMV (T statically 1, decode; the other formats, or no AVX-512): parallel over chunks of
  rows; per row tile of NR rows and sub-block, V-lane dot products of the integer quants with X
  in a register, scaled into NR x V accumulators, summed at the end (scaling per weight instead
  made Q8_0's LM head latency-bound on one accumulator; figures: docs/performance.md).
- GEMM of Q8_0 / Q5_0 / Q4_K / Q6_K under an AVX-512 target (`unpack_gemm`): as the next, the
  chunk of W dequantized 32 weights a vector (the quants unpacked as `unpack_gemv` does).
- GEMM (T symbolic, prefill): per parallel chunk of NB rows, the chunk of W is dequantized once
  into an f32 scratch tile [NB, K], which every token tile then multiplies as CPUMatmul does
  (tokens padded to MR, MR x NR x V register tile of lanes along K).
- take: one thread (a decode step looks up one row), vectorized over K.
- dequantize (W whole, the CUDA prompt GEMM's first kernel; here for its tests): rows in
  parallel, vectorized over K.
"""

from __future__ import annotations

import dataclasses

import tvm
from tvm import s_tir, tirx
from tvm.script import tirx as T

from tir_kernels.common import CPU_SCRATCH_SCOPE

from ..compiler.targets import host_cpu, llvm_features, target_has_avx512
from ..weights.quant import BLOCK
from .algorithms import i64
from .config import QuantMatmulConfig
from .signature import prim_func

# 4-bit formats whose one-token product `table_gemv` computes (w = table[q], one table a block)
TABLE_GEMV_FORMATS = ("Q4_0", "Q4_1")
# formats whose products `unpack_gemv` / `unpack_gemm` (and `dot_gemv`) compute from the weights'
# quants as unsigned bytes u, 32 a vector, w = scale * (u - zero) (Q4_K: scale * u - dmin * mn)
UNPACK_FORMATS = ("Q8_0", "Q5_0", "Q4_K", "Q6_K")
# formats whose prompt GEMM `unpack_gemm` computes: UNPACK_FORMATS, and the 4-bit ones (their
# nibbles unpacked as Q5_0's low bits; chosen only with bfloat16 products, see choose_schedule)
GEMM_UNPACK_FORMATS = UNPACK_FORMATS + TABLE_GEMV_FORMATS
_QUANT_ZERO = {"Q8_0": 128, "Q5_0": 16, "Q4_K": 0, "Q6_K": 32}
_DOT_SUB_BLOCK = {"Q8_0": 32, "Q5_0": 32, "Q4_K": 32, "Q6_K": 16}  # weights sharing one scale
_GROUP_UNROLL = {"Q8_0": 1, "Q5_0": 1, "Q4_K": 2, "Q6_K": 4, "Q4_0": 1, "Q4_1": 1}  # 32-weight groups whose bit shifts differ


@dataclasses.dataclass(frozen=True)
class CPUSchedule:
    """How an llvm kernel is tiled (never what it computes).

    lanes: V, float32 vector lanes (a divisor of 32); rows: NR, rows per register tile;
    token_tile: MR (GEMM); chunk: NB, rows per parallel task (a multiple of NR; GEMV and GEMM
    round it down to a divisor of N); lookup: the GEMV of a 4-bit format by table lookup
    (`table_gemv`: AVX-512, 16 lanes) instead of gemv_algorithm's int-to-float conversions;
    dot: 0, or the GEMV of UNPACK_FORMATS by int8 dot products (`dot_gemv`: AVX-512 VNNI; its
    vector width is fixed, lanes is not read) with x rounded to `dot` int8 digits (1 or 2);
    unpack: the GEMV and GEMM of UNPACK_FORMATS in float32 from their quants unpacked 32 weights
    a vector (`unpack_gemv`, `unpack_gemm`: AVX-512, 16 lanes) instead of gemv_algorithm's and
    matmul_algorithm's per-weight gathers; bf16: `unpack_gemm`'s products in bfloat16 (X and the
    dequantized W tile rounded to bfloat16, pairs multiplied and summed into float32 by vdpbf16ps:
    AVX512-BF16; twice the float32 FMA's products an instruction, not exact: see unpack_gemm).
    """

    lanes: int = 16
    rows: int = 4
    token_tile: int = 4
    chunk: int = 32
    lookup: bool = False
    dot: int = 0
    unpack: bool = False
    bf16: bool = False

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
        if type(self.dot) is not int or self.dot not in (0, 1, 2) or self.dot and self.lookup:
            raise ValueError(f"dot={self.dot!r}: expected 0, 1 or 2 (int8 digits of x), 0 with lookup=True")
        if not isinstance(self.unpack, bool) or self.unpack and (self.lanes != 16 or self.lookup or self.dot):
            raise ValueError(f"unpack={self.unpack!r}: expected a bool, True only with lanes=16 (AVX-512), "
                             "without lookup or dot")
        if not isinstance(self.bf16, bool) or self.bf16 and not self.unpack:
            raise ValueError(f"bf16={self.bf16!r}: expected a bool, True only with unpack=True")


def choose_schedule(config: QuantMatmulConfig) -> CPUSchedule:
    """The schedule of `config` on this host: its vector width; GEMV row tiles of 4 rows for 4-bit
    blocks and of 1 row for Q8_0 (memory-bound: each row of a tile is a stream of its own, and
    one stream is fastest on a long Q8_0 head); GEMM register tiles of 3 rows x 4 tokens (12
    accumulators: faster than 2 x 4, while 4 x 3 and 3 x 5 spill). Figures: docs/performance.md.
    Under an AVX-512 target scope (`compiler.targets.host_target(avx512=True)`), the one-token
    product of Q4_0 and Q4_1 is `table_gemv` (lookup=True), and the products of UNPACK_FORMATS
    are `unpack_gemv` and `unpack_gemm` (unpack=True; `dot_gemv`, not exact, only on request);
    where the target also has AVX512-BF16, `unpack_gemm` multiplies in bfloat16 (bf16=True: twice
    the float32 rate, within its stated bound; a target without the feature, as
    `host_target(bf16=False)`, or config.bf16_products=False keeps float32 products)."""
    lanes = host_cpu()[1]
    if config.op == "matmul" and config.tokens != 1:
        if (config.bf16_products and config.fmt in GEMM_UNPACK_FORMATS and target_has_avx512(None)
                and target_has_bf16(None)):
            # products in bfloat16: 3 x 4 tiles at every K (4 x 4 spill)
            return CPUSchedule(lanes=16, rows=3, token_tile=4, chunk=48, unpack=True, bf16=True)
        if config.fmt in UNPACK_FORMATS and target_has_avx512(None):
            # 4 x 4 tiles of 32-row chunks for rows of more than 1024 weights (the smaller scratch
            # tile of a long row, and AVX-512's 32 registers), else 3 x 4 of 48 (figures:
            # docs/performance.md)
            if config.k > 1024:
                return CPUSchedule(lanes=16, rows=4, token_tile=4, chunk=32, unpack=True)
            return CPUSchedule(lanes=16, rows=3, token_tile=4, chunk=48, unpack=True)
        return CPUSchedule(lanes=lanes, rows=3, token_tile=4, chunk=48)
    if config.op == "matmul" and config.fmt in UNPACK_FORMATS and target_has_avx512(None):
        # tiles of 1 row (one sequential stream): as fast as 4 at Gemma 3's short projections,
        # faster at its long rows and at the LM heads (figures: docs/performance.md)
        return CPUSchedule(lanes=16, rows=1, chunk=32, unpack=True)
    if config.op == "matmul" and config.fmt in TABLE_GEMV_FORMATS and target_has_avx512(None):
        # the lookup GEMV: tiles of 4 rows for short rows, 1 row (one sequential stream) for rows
        # of 1024 weights and more, where more rows per tile were slower (docs/performance.md)
        return CPUSchedule(lanes=16, rows=1 if config.k >= 1024 else 4, chunk=32, lookup=True)
    # GEMV chunks of 32 rows: SmolLM2's 576- and 960-row projections then split into an even
    # number of tasks (18, 30; 9 and 15 with 64), balanced on 2 cores
    return CPUSchedule(lanes=lanes, rows=1 if config.fmt == "Q8_0" else 4, chunk=32)


def target_has_vnni(target: tvm.target.Target | None = None) -> bool:
    """Whether an llvm `target` (None: the one in scope, if any) has AVX-512 VNNI with 256-bit
    vectors (vpdpbusd on ymm: AVX512_VNNI and AVX512VL), what `dot_gemv` needs."""
    return {"avx512vnni", "avx512vl"} <= llvm_features(target)


def target_has_bf16(target: tvm.target.Target | None = None) -> bool:
    """Whether an llvm `target` (None: the one in scope, if any) has AVX512-BF16 (vdpbf16ps on
    zmm, what `unpack_gemm`'s bf16 products need)."""
    return "avx512bf16" in llvm_features(target)


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


def _schedule_dequantize(sch: s_tir.Schedule, plan: CPUSchedule) -> None:
    """Rows over the threads, each vectorized (the CUDA prompt GEMM's first kernel; on the CPU
    only for tests of it)."""
    block = sch.get_sblock("dequantize")
    n, c = sch.get_loops(block)
    sch.parallel(n)
    _, cv = sch.split(c, factors=[None, plan.lanes])
    sch.vectorize(cv)


def schedule_llvm(func: tirx.PrimFunc, config: QuantMatmulConfig, plan: CPUSchedule) -> tirx.PrimFunc:
    """`func` (take_algorithm; dequantize_algorithm; gemv_algorithm for one static token; else
    matmul_algorithm of `config`) scheduled by `plan` for llvm."""
    sch = s_tir.Schedule(func)
    if config.op == "take":
        _schedule_take(sch, config, plan)
    elif config.op == "dequantize":
        _schedule_dequantize(sch, plan)
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

    @T.macro
    def with_args(bufs, n_tokens):  # Q4_0: no m
        body(bufs[0], bufs[1], bufs[2], None if q4_0 else bufs[3], bufs[-1])

    params = [("x", T.Buffer((i64(1), i64(k)), "float32")), ("qs", T.Buffer((i64(n), i64(k // 2)), "uint8"))]
    params += [(name, T.Buffer((i64(n), i64(nsb)), "float16")) for name in (("d",) if q4_0 else ("d", "m"))]
    return prim_func(params + [("y", T.Buffer((i64(1), i64(n)), "float32"))], with_args, check_well_formed=False)


def _concat(low, high, lanes: int):
    """The vector low ++ high (`lanes` in all, low's first)."""
    return tirx.Shuffle([low, high], [tirx.IntImm("int32", i) for i in range(lanes)])


def _unsigned_quants(fmt: str, parts: dict, row, g, p: int):
    """The unsigned quants u (uint8x32) of the 32 weights of group g = 32-weight column block
    of `row` (p = g % _GROUP_UNROLL[fmt]), in column order."""
    u8, ramp = "uint8", T.ramp

    def bcast(value, lanes=32):
        return T.broadcast(tirx.const(value, u8), lanes)

    if fmt == "Q8_0":  # q + 128 = q ^ 0x80
        return T.reinterpret("uint8x32", parts["qs"][row, ramp(g * 32, 1, 32)]) ^ bcast(0x80)
    if fmt in TABLE_GEMV_FORMATS:  # low nibbles: columns 0-15, high: 16-31
        qs = parts["qs"][row, ramp(g * 16, 1, 16)]
        return _concat(qs & bcast(15, 16), qs >> bcast(4, 16), 32)
    if fmt == "Q5_0":  # low nibbles: columns 0-15, high: 16-31; qh bit j: column j's 5th bit
        qs = parts["qs"][row, ramp(g * 16, 1, 16)]
        bits = T.broadcast(T.reinterpret("uint32", parts["qh"][row, ramp(g * 4, 1, 4)]), 8)
        # lane l of 8 (bytes 4l..4l+3) takes bits 4l..4l+3 and spreads bit b to byte b: the
        # products x << 7b of a 4-bit x never overlap, so the multiply adds without carries
        nibble = (bits >> T.Cast("uint32x8", ramp(0, 4, 8))) & T.broadcast(T.uint32(15), 8)
        spread = (nibble * T.broadcast(T.uint32(0x204081), 8)) & T.broadcast(T.uint32(0x01010101), 8)
        fifth = T.reinterpret("uint8x32", spread << T.broadcast(T.uint32(4), 8))
        return _concat(qs & bcast(15, 16), qs >> bcast(4, 16), 32) | fifth
    def shift(amount):  # (p is an unrolled loop's variable: constant once unrolled)
        return T.broadcast(T.Cast(u8, amount), 32)

    if fmt == "Q4_K":  # groups 2j and 2j+1: the low and high nibbles of the same 32 bytes
        return (parts["qs"][row, ramp((g - p) * 16, 1, 32)] >> shift(4 * p)) & bcast(15)
    # Q6_K: group g = 4 h + p of the 128-column half h: low nibble from ql, 2 high bits from qh
    h = (g - p) // 4
    low = (parts["ql"][row, ramp(h * 64 + p % 2 * 32, 1, 32)] >> shift(p // 2 * 4)) & bcast(15)
    high = (parts["qh"][row, ramp(h * 32, 1, 32)] >> shift(2 * p)) & bcast(3)
    return low | (high << bcast(4))


def dot_gemv(config: QuantMatmulConfig, plan: CPUSchedule) -> tirx.PrimFunc:
    """The one-token product of UNPACK_FORMATS by int8 dot products, for AVX-512 VNNI (same
    arguments as matmul_algorithm), as llama.cpp's vec_dot with x quantized to Q8_0, here in
    plan.dot int8 digits (1 or 2; 256 = 2^8 the second digit's weight):

        dx[g] = max|X[32 g : 32 g + 32]| / 127,  t = X / dx[g]                (once per call)
        q1 = round(t),  q2 = clamp(round(256 (t - q1)), -127, 127),  x ~ dx (q1 + q2 / 256)
        D[n, j] = 256 sum_{c in j} (u(n, c) - zero) q1[c] + sum_{c in j} (u(n, c) - zero) q2[c]
        Y[n]  = sum_j scale(n, j) * dx[g] / 256 * D[n, j]          (+ Q4_K's mins; one digit: D's q1 sum)

    j: the weights' scale sub-blocks (32 columns; Q6_K's 16) of group g. Per group and row one
    vpdpbusd a digit (32 unsigned quant bytes u against 32 signed digits, 8 int32 lanes of 4
    products), the first starting at -zero * q1's 4-column sums (precomputed, so u - zero costs
    nothing), shifted by 8 bits and added -zero * q2's before the second; D converted to float32
    and scaled into 8 float32 accumulators. Q4_K's mins enter those accumulators first:
    -dmin * mn * (x's rounded block sums), 8 sub-blocks a vector.

    Accuracy: the integer dots are exact (|D| < 2^24, exact in float32 too); the rounding of x
    moves each term by at most |w| dx / 2 (one digit) or |w| dx / 512 (two), the bound
    tests/test_quant_matmul.py checks against a float64 reference.
    Tiling from the plan: parallel chunks of NB rows (plan.chunk), row tiles of NR rows
    (plan.rows) sharing xq's loads, the tile's scales (times dx) converted to float32 first."""
    fmt, n, k = config.fmt, config.n, config.k
    if fmt not in UNPACK_FORMATS or config.op != "matmul" or config.tokens != 1 or config.target != "llvm":
        raise ValueError(f"{config.name}: dot_gemv computes one token of {UNPACK_FORMATS} on llvm")
    if plan.dot not in (1, 2):
        raise ValueError(f"plan.dot={plan.dot!r}: dot_gemv rounds x to 1 or 2 int8 digits")
    two = plan.dot == 2
    nr = _divisor_at_most(n, plan.rows)
    nb = _divisor_at_most(n, plan.chunk, nr)
    ng, sub, unroll, zero = k // BLOCK, _DOT_SUB_BLOCK[fmt], _GROUP_UNROLL[fmt], _QUANT_ZERO[fmt]
    nsub = k // sub
    per_group = BLOCK // sub  # scale sub-blocks a group
    has_zero, q4_k, q6_k = zero != 0, fmt == "Q4_K", fmt == "Q6_K"  # (static branches in the macros)
    dpbusd = "llvm.x86.avx512.vpdpbusd.256"  # (int32x8 acc, uint8x32 u, int8x32 s): acc + 4-byte dots
    f32x8, i32x8 = "float32x8", "int32x8"

    def scale_vector(scale, r, g):
        if per_group == 1:
            return T.broadcast(scale[r, g], 8)
        return _concat(T.broadcast(scale[r, per_group * g], 4), T.broadcast(scale[r, per_group * g + 1], 4), 8)

    def scaled_x(x, amax, c):
        """x[c] * 127 / amax (0 for an all-zero block): an expression (a variable in a vectorized
        loop did not vectorize correctly)."""
        return x[0, c] * T.if_then_else(amax[0] > T.float32(0.0), T.float32(127.0) / amax[0], T.float32(0.0))

    def digits(xq, xc, u, g):
        """D of group g (int32x8): the first digit's dot, and with two digits 256 times it plus the second's."""
        def start(d):
            return xc[d, T.ramp(g * 8, 1, 8)] if has_zero else T.broadcast(T.int32(0), 8)

        first = T.call_llvm_pure_intrin(i32x8, dpbusd, start(0), u, xq[0, T.ramp(g * 32, 1, 32)])
        if not two:
            return first
        shifted = first << T.broadcast(T.int32(8), 8)
        return T.call_llvm_pure_intrin(i32x8, dpbusd, shifted + start(1) if has_zero else shifted, u,
                                       xq[1, T.ramp(g * 32, 1, 32)])

    @T.macro
    def quantize_x(x, xq, dx, dxs, xc, xsum):
        for g in range(i64(ng)):
            amax = T.alloc_buffer((1,), "float32", scope="local")
            isum = T.alloc_buffer((2,), "int32", scope="local")
            amax[0] = T.float32(0.0)
            for c in range(32):
                amax[0] = T.max(amax[0], T.fabs(x[0, g * 32 + c]))
            dx[g] = amax[0] / T.float32(127.0)
            for c in T.vectorized(32):  # (expressions, not variables: see scaled_x)
                xq[0, g * 32 + c] = T.Cast("int8", T.round(scaled_x(x, amax, g * 32 + c)))
                xq[1, g * 32 + c] = T.Cast("int8", T.max(T.min(T.round(
                    (scaled_x(x, amax, g * 32 + c) - T.round(scaled_x(x, amax, g * 32 + c))) * T.float32(256.0)),
                    T.float32(127.0)), T.float32(-127.0)))
            for j in range(per_group):
                dxs[g * per_group + j] = dx[g] * T.float32(1.0 / 256.0 if two else 1.0)
            for d in range(2):
                if has_zero:
                    for lane in range(8):
                        xc[d, g * 8 + lane] = T.int32(-zero) * (
                            T.Cast("int32", xq[d, g * 32 + lane * 4]) + T.Cast("int32", xq[d, g * 32 + lane * 4 + 1])
                            + T.Cast("int32", xq[d, g * 32 + lane * 4 + 2])
                            + T.Cast("int32", xq[d, g * 32 + lane * 4 + 3]))
                else:
                    isum[d] = 0
                    for c in range(32):
                        isum[d] = isum[d] + T.Cast("int32", xq[d, g * 32 + c])
            if not has_zero:
                xsum[g] = dx[g] * (T.Cast("float32", isum[0])
                                   + T.Cast("float32", isum[1]) * T.float32(1.0 / 256.0 if two else 0.0))

    @T.macro
    def tile_scales(scale, acc, parts, dxs, xsum, row):
        """scale[r, j] = the weights' scale of sub-block j times its dx; acc = Q4_K's mins term or 0."""
        for r in T.unroll(nr):
            acc[r, T.ramp(0, 1, 8)] = T.broadcast(T.float32(0.0), 8)
        if q4_k:  # 8 sub-blocks of 32 a super-block
            for r in T.unroll(nr):
                for b in range(i64(k // 256)):
                    scale[r, T.ramp(b * 8, 1, 8)] = (
                        T.broadcast(T.Cast("float32", parts["d"][row + r, b]), 8)
                        * T.Cast(f32x8, parts["sc"][row + r, T.ramp(b * 8, 1, 8)]) * dxs[T.ramp(b * 8, 1, 8)])
                    acc[r, T.ramp(0, 1, 8)] = acc[r, T.ramp(0, 1, 8)] - (
                        T.broadcast(T.Cast("float32", parts["dmin"][row + r, b]), 8)
                        * T.Cast(f32x8, parts["mn"][row + r, T.ramp(b * 8, 1, 8)]) * xsum[T.ramp(b * 8, 1, 8)])
        elif q6_k:  # 16 sub-blocks of 16 a super-block
            for r in T.unroll(nr):
                for b in range(i64(k // 256)):
                    scale[r, T.ramp(b * 16, 1, 16)] = (
                        T.broadcast(T.Cast("float32", parts["d"][row + r, b]), 16)
                        * T.Cast("float32x16", parts["sc"][row + r, T.ramp(b * 16, 1, 16)])
                        * dxs[T.ramp(b * 16, 1, 16)])
        else:
            for r in T.unroll(nr):
                for j in T.vectorized(nsub):
                    scale[r, j] = T.Cast("float32", parts["d"][row + r, j]) * dxs[j]

    @T.macro
    def body(x, parts, y):
        xq = T.alloc_buffer((i64(2), i64(k)), "int8")
        dx = T.alloc_buffer((i64(ng),), "float32")
        dxs = T.alloc_buffer((i64(nsub),), "float32")
        xc = T.alloc_buffer((i64(2), i64(ng * 8)), "int32")
        xsum = T.alloc_buffer((i64(ng),), "float32")
        quantize_x(x, xq, dx, dxs, xc, xsum)
        for chunk in T.parallel(i64(n // nb)):
            for tile in range(i64(nb // nr)):
                scale = T.alloc_buffer((nr, nsub), "float32")
                acc = T.alloc_buffer((nr, 8), "float32")  # (on the stack: CPU_SCRATCH_SCOPE)
                tile_scales(scale, acc, parts, dxs, xsum, chunk * nb + tile * nr)
                for go in range(i64(ng // unroll)):
                    for p in T.unroll(unroll):
                        for r in T.unroll(nr):
                            acc[r, T.ramp(0, 1, 8)] = acc[r, T.ramp(0, 1, 8)] + T.Cast(f32x8, digits(
                                xq, xc, _unsigned_quants(fmt, parts, chunk * nb + tile * nr + r, go * unroll + p, p),
                                go * unroll + p)) * scale_vector(scale, r, go * unroll + p)
                for r in T.unroll(nr):  # each row's 8 lanes summed as a tree of halves
                    acc[r, T.ramp(0, 1, 4)] = acc[r, T.ramp(0, 1, 4)] + acc[r, T.ramp(4, 1, 4)]
                    acc[r, T.ramp(0, 1, 2)] = acc[r, T.ramp(0, 1, 2)] + acc[r, T.ramp(2, 1, 2)]
                    y[0, chunk * nb + tile * nr + r] = acc[r, 0] + acc[r, 1]

    return _with_parts_signature(config, body, tokens=i64(1))


def _dequant_group(fmt: str, parts: dict, row, g, p):
    """The 32 float32 weights (float32x32) of group g (32 columns) of `row`, dequantized from the
    unsigned quants of _unsigned_quants (p = g % _GROUP_UNROLL[fmt]) as GGML's dequantizers round them:
    (u - zero) and the scale exact in float32, one rounding of their product (Q4_K: of each of
    d * sc * q and dmin * mn, then of the difference)."""
    f32, f32x32 = "float32", "float32x32"
    if fmt == "Q8_0":
        return T.Cast(f32x32, parts["qs"][row, T.ramp(g * 32, 1, 32)]) * T.broadcast(
            T.Cast(f32, parts["d"][row, g]), 32)
    u = T.Cast(f32x32, _unsigned_quants(fmt, parts, row, g, p))
    if fmt == "Q4_0":
        return T.broadcast(T.Cast(f32, parts["d"][row, g]), 32) * (u - T.broadcast(T.float32(8.0), 32))
    if fmt == "Q4_1":
        return (T.broadcast(T.Cast(f32, parts["d"][row, g]), 32) * u
                + T.broadcast(T.Cast(f32, parts["m"][row, g]), 32))
    if fmt == "Q5_0":
        return T.broadcast(T.Cast(f32, parts["d"][row, g]), 32) * (u - T.broadcast(T.float32(16.0), 32))
    if fmt == "Q4_K":
        b = g // 8
        scale = T.Cast(f32, parts["d"][row, b]) * T.Cast(f32, parts["sc"][row, g])
        offset = T.Cast(f32, parts["dmin"][row, b]) * T.Cast(f32, parts["mn"][row, g])
        return T.broadcast(scale, 32) * u - T.broadcast(offset, 32)
    d = T.Cast(f32, parts["d"][row, g // 8])  # Q6_K: sub-blocks 2g and 2g + 1 of 16
    scale = _concat(T.broadcast(d * T.Cast(f32, parts["sc"][row, 2 * g]), 16),
                    T.broadcast(d * T.Cast(f32, parts["sc"][row, 2 * g + 1]), 16), 32)
    return scale * (u - T.broadcast(T.float32(32.0), 32))


# LLVM IR that TVMScript cannot write: its bfloat16 values are float32 arithmetic on uint16 storage
# (BF16ComputeLegalize), and vdpbf16ps takes vectors of LLVM's bfloat. Imported into each function
# that calls it (`pragma_import_llvm`; linkonce_odr: one copy in a module), inlined.
_BF16_LLVM = """
define linkonce_odr <16 x float> @tvmattn_dot_bf16x32(<16 x float> %acc, ptr %x, ptr %w) alwaysinline {
  %a = load <32 x bfloat>, ptr %x, align 2
  %b = load <32 x bfloat>, ptr %w, align 2
  %r = call <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float> %acc, <32 x bfloat> %a, <32 x bfloat> %b)
  ret <16 x float> %r
}
define linkonce_odr void @tvmattn_store_bf16x32(ptr %dst, <32 x float> %v) alwaysinline {
  %b = fptrunc <32 x float> %v to <32 x bfloat>
  store <32 x bfloat> %b, ptr %dst, align 2
  ret void
}
declare <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float>, <32 x bfloat>, <32 x bfloat>)
"""


def _row_ptr(buffer, access: str, row, column, extent: int):
    """A pointer to buffer[row, column : column + extent] (2-D) for an extern call that reads
    ("r") or writes ("w") those elements; with its extent, unlike T.address_of's one element, so
    that TVM's buffer compaction keeps the whole span."""
    return buffer.access_ptr(access, offset=row * buffer.shape[1] + column, extent=extent)


def unpack_gemm(config: QuantMatmulConfig, plan: CPUSchedule) -> tirx.PrimFunc:
    """The product of GEMM_UNPACK_FORMATS for a symbolic token count (prefill), for AVX-512 (same
    arguments as matmul_algorithm):

        Y[t, n] = sum_k X[t, k] * dequant(W)[n, k]

    Per parallel chunk of NB rows (plan.chunk), the chunk of W is dequantized once into a
    scratch tile [NB, K], 32 weights a vector (the quants unpacked as in `unpack_gemv`, instead
    of a gather per weight); every tile of MR tokens (plan.token_tile) x NR rows (plan.rows)
    then multiplies it in MR x NR float32x16 accumulators along K, each summed at the end.
    Tokens past the last whole tile of MR run in tiles of one token.

    The products: float32 FMAs over a float32 tile (exact up to the order of the float32 sums),
    or with plan.bf16 (AVX512-BF16) vdpbf16ps over a bfloat16 tile and X rounded to bfloat16
    once per call (round to nearest even), each instruction summing 16 lane pairs into float32:
    every product then carries at most the two roundings, |error| <= (2^-8 + 2^-16) * sum_k
    |X[t, k] W[n, k]| besides the float32 sums', the bound tests/test_quant_matmul.py checks."""
    fmt, n, k = config.fmt, config.n, config.k
    if fmt not in GEMM_UNPACK_FORMATS or config.op != "matmul" or config.tokens == 1 or config.target != "llvm":
        raise ValueError(f"{config.name}: unpack_gemm computes several tokens of {GEMM_UNPACK_FORMATS} on llvm")
    nr = _divisor_at_most(n, plan.rows)
    nb = _divisor_at_most(n, plan.chunk, nr)
    mr, ng, unroll, v = plan.token_tile, k // BLOCK, _GROUP_UNROLL[fmt], 16
    bf16 = plan.bf16
    step = 2 * v if bf16 else v  # K columns an accumulator takes per instruction
    tile_dtype = "uint16" if bf16 else "float32"  # (bfloat16 bits: see _BF16_LLVM)

    def product(acc, a, w, t, token, r, kv, row):
        """acc[t, r] plus the lanes' products of a's row `token` and w's row `row` at column step kv."""
        if bf16:
            return T.call_extern("float32x16", "tvmattn_dot_bf16x32", acc[t, r, T.ramp(0, 1, v)],
                                 _row_ptr(a, "r", token, kv * step, step), _row_ptr(w, "r", row, kv * step, step))
        return acc[t, r, T.ramp(0, 1, v)] + a[token, T.ramp(kv * v, 1, v)] * w[row, T.ramp(kv * v, 1, v)]

    @T.macro
    def tile(a, w, acc, y, t0, mt, chunk, rt):
        """y[t0 : t0 + mt, rows of row tile rt of the chunk] from the dequantized chunk w; a: the
        tokens' rows (X, or its bfloat16 copy)."""
        for t in T.unroll(mt):
            for r in T.unroll(nr):
                acc[t, r, T.ramp(0, 1, v)] = T.broadcast(T.float32(0.0), v)
        for kv in range(i64(k // step)):
            for t in T.unroll(mt):
                for r in T.unroll(nr):
                    acc[t, r, T.ramp(0, 1, v)] = product(acc, a, w, t, t0 + t, r, kv, rt * nr + r)
        for t in T.unroll(mt):
            for r in T.unroll(nr):  # the 16 lanes summed as a tree of halves
                acc[t, r, T.ramp(0, 1, 8)] = acc[t, r, T.ramp(0, 1, 8)] + acc[t, r, T.ramp(8, 1, 8)]
                acc[t, r, T.ramp(0, 1, 4)] = acc[t, r, T.ramp(0, 1, 4)] + acc[t, r, T.ramp(4, 1, 4)]
                acc[t, r, T.ramp(0, 1, 2)] = acc[t, r, T.ramp(0, 1, 2)] + acc[t, r, T.ramp(2, 1, 2)]
                y[t0 + t, chunk * nb + rt * nr + r] = acc[t, r, 0] + acc[t, r, 1]

    @T.macro
    def store_group(w, r, g, values):
        """w[r, 32 g : 32 g + 32] = values (float32x32; rounded to bfloat16 in a bf16 tile)."""
        if bf16:
            T.evaluate(T.call_extern("void", "tvmattn_store_bf16x32", _row_ptr(w, "w", r, g * 32, 32), values))
        else:
            w[r, T.ramp(g * 32, 1, 32)] = values

    @T.macro
    def products(a, parts, y, tokens):
        for chunk in T.parallel(i64(n // nb)):
            w = T.alloc_buffer((i64(nb), i64(k)), tile_dtype)
            for r in range(i64(nb)):
                for go in range(i64(ng // unroll)):
                    for p in T.unroll(unroll):
                        store_group(w, r, go * unroll + p,
                                    _dequant_group(fmt, parts, chunk * nb + r, go * unroll + p, p))
            for tt in range(tokens // mr):
                for rt in range(i64(nb // nr)):
                    acc = T.alloc_buffer((mr, nr, v), "float32")  # (on the stack: CPU_SCRATCH_SCOPE)
                    tile(a, w, acc, y, tt * mr, mr, chunk, rt)
            for tl in range(tokens % mr):
                for rt in range(i64(nb // nr)):
                    acc1 = T.alloc_buffer((1, nr, v), "float32")
                    tile(a, w, acc1, y, tokens // mr * mr + tl, 1, chunk, rt)

    @T.macro
    def body(x, parts, y, tokens):
        if bf16:
            with T.attr(T.int32(0), "pragma_import_llvm", _BF16_LLVM):
                xb = T.alloc_buffer((tokens, i64(k)), "uint16")
                for t in range(tokens):
                    for g in range(i64(ng)):
                        T.evaluate(T.call_extern("void", "tvmattn_store_bf16x32", _row_ptr(xb, "w", t, g * 32, 32),
                                                 x[t, T.ramp(g * 32, 1, 32)]))
                products(xb, parts, y, tokens)
        else:
            products(x, parts, y, tokens)

    tokens = tirx.Var("n_tokens", "int64")

    @T.macro
    def with_tokens(x, parts, y):
        body(x, parts, y, tokens)

    return _with_parts_signature(config, with_tokens, tokens=tokens)


def unpack_gemv(config: QuantMatmulConfig, plan: CPUSchedule) -> tirx.PrimFunc:
    """The one-token product of UNPACK_FORMATS in float32, for AVX-512 (same arguments as
    matmul_algorithm): each 32 weights of a row dequantized as a float32x32 vector from their
    unpacked quants (`_dequant_group`: as GGML's dequantizers round them) and multiplied into
    32 float32 accumulators a row (two zmm registers), summed at the end; x in float32, so the
    result is dequantize-then-matmul's up to the order of the float32 sums. Tiling from the
    plan: parallel chunks of NB rows (plan.chunk), row tiles of NR rows (plan.rows) sharing x's
    loads."""
    fmt, n, k = config.fmt, config.n, config.k
    if fmt not in UNPACK_FORMATS or config.op != "matmul" or config.tokens != 1 or config.target != "llvm":
        raise ValueError(f"{config.name}: unpack_gemv computes one token of {UNPACK_FORMATS} on llvm")
    nr = _divisor_at_most(n, plan.rows)
    nb = _divisor_at_most(n, plan.chunk, nr)
    ng, unroll, v = k // BLOCK, _GROUP_UNROLL[fmt], 32

    @T.macro
    def body(x, parts, y):
        for chunk in T.parallel(i64(n // nb)):
            for tile in range(i64(nb // nr)):
                acc = T.alloc_buffer((nr, v), "float32")  # (on the stack: CPU_SCRATCH_SCOPE)
                for r in T.unroll(nr):
                    acc[r, T.ramp(0, 1, v)] = T.broadcast(T.float32(0.0), v)
                for go in range(i64(ng // unroll)):
                    for p in T.unroll(unroll):
                        for r in T.unroll(nr):
                            acc[r, T.ramp(0, 1, v)] = acc[r, T.ramp(0, 1, v)] + _dequant_group(
                                fmt, parts, chunk * nb + tile * nr + r, go * unroll + p, p) * x[
                                0, T.ramp((go * unroll + p) * 32, 1, 32)]
                for r in T.unroll(nr):  # each row's 32 lanes summed as a tree of halves
                    acc[r, T.ramp(0, 1, 16)] = acc[r, T.ramp(0, 1, 16)] + acc[r, T.ramp(16, 1, 16)]
                    acc[r, T.ramp(0, 1, 8)] = acc[r, T.ramp(0, 1, 8)] + acc[r, T.ramp(8, 1, 8)]
                    acc[r, T.ramp(0, 1, 4)] = acc[r, T.ramp(0, 1, 4)] + acc[r, T.ramp(4, 1, 4)]
                    acc[r, T.ramp(0, 1, 2)] = acc[r, T.ramp(0, 1, 2)] + acc[r, T.ramp(2, 1, 2)]
                    y[0, chunk * nb + tile * nr + r] = acc[r, 0] + acc[r, 1]

    return _with_parts_signature(config, body, tokens=i64(1))


def _with_parts_signature(config: QuantMatmulConfig, body, tokens) -> tirx.PrimFunc:
    """The PrimFunc (x [tokens, K], *parts, y [tokens, N]) whose body is the macro body(x, parts, y)
    (parts: name -> buffer; the arguments named p0, p1, ...)."""
    shapes = config.part_shapes()
    names = [name for name, _, _ in shapes]

    @T.macro
    def with_args(bufs, n_tokens):
        body(bufs[0], dict(zip(names, bufs[1:-1])), bufs[-1])

    params = [("x", T.Buffer((tokens, i64(config.k)), "float32"))]
    params += [(f"p{i}", T.Buffer(tuple(i64(d) for d in shape), dtype)) for i, (_, dtype, shape) in enumerate(shapes)]
    return prim_func(params + [("y", T.Buffer((tokens, i64(config.n)), "float32"))], with_args, check_well_formed=False)
