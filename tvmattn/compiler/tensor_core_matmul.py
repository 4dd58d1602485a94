"""A tensor-core matmul for a few rows: decode_step's projections at batches of a few to a few hundred.

What it computes is the PrimFunc it replaces (`SmallBatchTensorCoreMatmul` recognizes it):

    Y[b, 0, n] = epilogue(sum_k X[b, 0, k] * W[n, k])    b < batch_size (symbolic), n < N

with the products summed in float32 and the sum rounded once to the activations' dtype, then
the epilogue: "none" (Y is the rounded sum), "add" (Y = R[b, 0, n] + sum, a decoder layer's
residual, in the activations' dtype as the separate add computes it), "cast" (Y float32, the
LM head's logits) or "swiglu" (W = [W_gate; W_up] of 2N rows, Y = silu(gate) * up of the two
float32 sums, rounded once: fused_decode.matmul_swiglu, the MLP's gate_up with its SiLU * mul).

Why: at these shapes a step streams each weight once, so the kernel should run at the memory's
speed. On CUDA cores (SmallBatchMatmul) each weight element costs batch multiply-adds, and from
batch 16 on the step waits on arithmetic, not on memory. One m16n8k16 MMA does 16 rows at once.

How (`SkinnyMatmulSchedule`): a thread block owns `16 * warps_n` output columns and a chunk of
up to 64 rows (four 16-row MMA tiles; blockIdx.x, the fastest index, walks the row chunks, so
the blocks that read one weight slice run together and the slice comes from memory once). Its
warps are `warps_n` column groups of 16 times `warps_k` slices of K: each stage of the
cp.async ring holds a tile of `16 * warps_k * k_steps` columns of K of the chunk's rows of X
and of the block's rows of W (16-byte copies into XOR-swizzled rows, mma.Tile), and warp
(n, k) multiplies its k_steps 16-wide slices of it (ldmatrix, then one MMA per 16-row tile and
8 columns). Rows past the batch are neither copied nor stored: a 16-row tile past the chunk's
last row is skipped, and inside the last tile the rows past the batch read the batch's last
row (valid memory; their sums are never stored). At the end the warps of a column group add
their float32 sums through shared memory and the block applies the epilogue, each thread
storing consecutive columns.
"""

from __future__ import annotations

import dataclasses
import functools

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.script import tirx as T

from tir_kernels.mma import CHUNK, CP_ASYNC, FULL_WARP, LDSM, MIN_ARCH as MMA_MIN_ARCH, ROWS_PER_MMA, Tile, mma_name
from tir_kernels.support import TENSOR_CORE_DTYPES, TargetName, sm_of

EPILOGUES = ("none", "add", "cast", "swiglu")  # of a plain projection
NORM_EPILOGUES = ("none", "bias", "swiglu")  # after the RMSNorm (fused_decode's ops)
DTYPES = TENSOR_CORE_DTYPES  # the operands' dtype (Y's in epilogues "none" and "add")
ROWS_PER_TILE = ROWS_PER_MMA  # the M of m16n8k16
MAX_TILES = 4  # 16-row MMA tiles per row chunk: 64 rows a block
MIN_ARCH = MMA_MIN_ARCH  # cp.async, ldmatrix and bf16 mma.sync
SMEM_LIMIT = 96 << 10  # bytes of dynamic shared memory a plain projection's schedule stays under
# norm_matmul's: the most every arch from sm_80 gives a block (sm_86 / sm_89 / sm_120: 99 KiB), so that g's
# slice in each stage does not cost a stage where the plain kernel's ring takes 96 KiB (Llama-1B's gate_up)
NORM_SMEM_LIMIT = 99 << 10

# Batches from which a replacement with a rule `below` (the CUDA-core kernel) runs on tensor
# cores: in a sweep of SmolLM2's projections on an H100 (docs/performance.md) the CUDA-core kernel
# was faster at every projection at batch 8 and the tensor-core kernel as fast or faster at 16.
TENSOR_CORES_FROM_BATCH = 16
TARGET_BLOCKS = 132  # about one block per SM of an H100 / H200: fewer column blocks than this use 16-column blocks


def smem_limit(norm: bool) -> int:
    """The shared memory a schedule stays under: norm_matmul's (norm) or a plain projection's."""
    return NORM_SMEM_LIMIT if norm else SMEM_LIMIT


@dataclasses.dataclass(frozen=True)
class SkinnyMatmulSchedule:
    """How the kernel is laid out (never what it computes): warps_n column groups of 16 columns
    and warps_k slices of K per block, k_steps 16-wide K steps per warp and stage, `stages`
    tiles in the cp.async ring, row_tiles 16-row MMA tiles per row chunk (a block's rows)."""

    warps_n: int = 1
    warps_k: int = 4
    k_steps: int = 1
    stages: int = 4
    row_tiles: int = MAX_TILES

    def __post_init__(self):
        for name in ("warps_n", "warps_k", "k_steps"):
            value = getattr(self, name)
            if value not in (1, 2, 4, 8):
                raise ValueError(f"{name}={value!r}: expected 1, 2, 4 or 8")
        if not isinstance(self.stages, int) or not 2 <= self.stages <= 8:
            raise ValueError(f"stages={self.stages!r}: expected an int from 2 to 8")
        if self.warps_n * self.warps_k > 16:
            raise ValueError(f"warps_n * warps_k = {self.warps_n * self.warps_k}: at most 16 warps (512 threads)")
        if self.row_tiles not in (1, 2, 4):
            raise ValueError(f"row_tiles={self.row_tiles!r}: expected 1, 2 or 4")

    @property
    def block_n(self) -> int:
        return ROWS_PER_TILE * self.warps_n

    @property
    def block_k(self) -> int:
        return ROWS_PER_TILE * self.warps_k * self.k_steps

    @property
    def block_m(self) -> int:
        return ROWS_PER_TILE * self.row_tiles

    def smem_bytes(self, halves: int = 1, norm: bool = False) -> int:
        """Dynamic shared memory: the ring, or the warps' sums at the end (the larger); halves: 2
        where each output column takes two weight rows (SwiGLU's gate and up); norm: each stage
        also holds the norm weight's block_k elements (norm_matmul)."""
        rows = (self.block_m + halves * self.block_n) * Tile(self.block_k).stride * 2
        ring = self.stages * (rows + (2 * self.block_k if norm else 0))
        sums = self.warps_k * self.block_m * (halves * self.block_n + 4) * 4
        return max(ring, sums)

    def check(self, n: int, k: int, halves: int = 1, norm: bool = False) -> None:
        """ValueError unless the schedule tiles an N x K weight (N output columns; halves * N
        weight rows) within SMEM_LIMIT bytes of shared memory (norm: norm_matmul's, within
        NORM_SMEM_LIMIT)."""
        if n % self.block_n:
            raise ValueError(f"N={n} is not a multiple of the block's {self.block_n} columns (warps_n={self.warps_n})")
        if k % self.block_k:
            raise ValueError(f"K={k} is not a multiple of a stage's {self.block_k} columns "
                             f"(warps_k={self.warps_k}, k_steps={self.k_steps})")
        used, limit = self.smem_bytes(halves, norm), smem_limit(norm)
        if used > limit:
            raise ValueError(f"{used} bytes of shared memory: over {limit}")


def choose_skinny_schedule(n: int, k: int, halves: int = 1, norm: bool = False) -> SkinnyMatmulSchedule | None:
    """The schedule of an N x K weight (halves * N rows: 2 for SwiGLU's gate and up; norm:
    norm_matmul's), or None where none tiles it (N or K not a multiple of 16).

    Column blocks: 64 columns where that still makes two blocks per SM, 32 where it makes one,
    else 16 (SmolLM2's 576-row projections: 36 blocks). K: 4 warps split each stage; a stage is
    128 columns where K allows it (the most bytes in flight per copy round), else 64, 32 or 16,
    with fewer warps. More stages where there are few blocks: each block then keeps more of its
    weight in flight."""
    if n % ROWS_PER_TILE or k % ROWS_PER_TILE:
        return None
    if n % 64 == 0 and n // 64 >= 2 * TARGET_BLOCKS:
        warps_n = 4
    else:
        warps_n = 2 if n % 32 == 0 and n // 32 >= TARGET_BLOCKS else 1
    for warps_k, k_steps in ((4, 2), (4, 1), (2, 1), (1, 1)):
        if k % (ROWS_PER_TILE * warps_k * k_steps) == 0:
            break
    stages = 4 if n // (ROWS_PER_TILE * warps_n) >= TARGET_BLOCKS else 6
    schedule = SkinnyMatmulSchedule(warps_n=warps_n, warps_k=warps_k, k_steps=k_steps, stages=stages)
    while schedule.smem_bytes(halves, norm) > smem_limit(norm) and schedule.stages > 2:
        schedule = dataclasses.replace(schedule, stages=schedule.stages - 1)
    return schedule


def skinny_matmul(n: int, k: int, dtype: str = "float16", epilogue: str = "none",
                  schedule: SkinnyMatmulSchedule | None = None) -> tirx.PrimFunc:
    """The PrimFunc (X [batch_size, 1, K], W [N, K][, R [batch_size, 1, N]], Y [batch_size, 1, N])
    of the module docstring; batch_size symbolic (int64), dtype float16 or bfloat16 (Y float32
    for epilogue "cast"). ValueError for what it does not take."""
    return _skinny_matmul(n, k, dtype, epilogue, schedule, None)


def skinny_matmul_body(n: int, k: int, dtype: str, epilogue: str, schedule: SkinnyMatmulSchedule | None,
                       x, w, r, y) -> tirx.Stmt:
    """skinny_matmul's kernel as a statement on another function's buffers x, w, r (None unless
    epilogue "add") and y, shaped and typed as skinny_matmul's parameters (x.shape[0] the
    batch); for a function that launches it on some batches and another kernel on others."""
    return _skinny_matmul(n, k, dtype, epilogue, schedule, (x, None, w, r, y))


def norm_matmul(n: int, k: int, dtype: str = "float16", epilogue: str = "none", eps: float = 1e-5,
                schedule: SkinnyMatmulSchedule | None = None) -> tirx.PrimFunc:
    """The kernel with fused_decode's RMSNorm in front: the PrimFunc (X [batch_size, 1, K],
    G [K], W [halves * N, K][, B [N]], Y [batch_size, 1, N]) computing, for h = rms_norm(X, G)
    (fused_decode's: float32 sum of squares, h rounded to dtype),
    "none": Y = h W^T; "bias": Y = h W^T + B (in float32, rounded once); "swiglu": Y =
    silu(h W_gate^T) * (h W_up^T), W = [W_gate; W_up] (halves 2, float32, rounded once).
    The norm costs no pass of its own: the product is summed over x * g (each X fragment scaled
    in registers, rounded to dtype, as it enters the MMA) while the fragments' squares add up,
    and the epilogue multiplies the float32 sums by the row's 1 / RMS. So h's rounding happens
    before the scale by 1 / RMS, not after (within a few units of the last place of dtype), and
    with float16 x * g must stay within its range (as the residual stream itself must).
    Schedules: choose_skinny_schedule's."""
    return _skinny_matmul(n, k, dtype, epilogue, schedule, None, float(eps))


def norm_matmul_body(n: int, k: int, dtype: str, epilogue: str, eps: float, schedule: SkinnyMatmulSchedule | None,
                     x, g, w, bias, y) -> tirx.Stmt:
    """norm_matmul's kernel as a statement on another function's buffers (bias None unless
    epilogue "bias"), as skinny_matmul_body."""
    return _skinny_matmul(n, k, dtype, epilogue, schedule, (x, g, w, bias, y), float(eps))


def word(elem):
    """The 32-bit word of the shared buffer that holds 16-bit element `elem`."""
    return elem // 2


def _norm_fragment_functions(dtype: str):
    """Names and CUDA sources of norm_matmul's operations on 32-bit words of two `dtype` elements:
    sumsq2(a) -> a's float32 sum of squares; scale2(a, g) -> a * g elementwise, rounded to dtype
    (__hmul2: a 16-bit product is exact in float32, so this is the float32 product rounded, in
    one instruction). TVM emits each source once per module, by its function's name."""
    pair, to_f2 = {"float16": ("__half2", "__half22float2"), "bfloat16": ("__nv_bfloat162", "__bfloat1622float2")}[dtype]
    sumsq, scale = f"tvmattn_sumsq2_{dtype}", f"tvmattn_scale2_{dtype}"
    sumsq_src = f"""
union {sumsq}_word {{ unsigned u; {pair} h; }};
__device__ __forceinline__ float {sumsq}(unsigned a) {{
  {sumsq}_word w;
  w.u = a;
  const float2 f = {to_f2}(w.h);
  return f.x * f.x + f.y * f.y;
}}
"""
    scale_src = f"""
union {scale}_word {{ unsigned u; {pair} h; }};
__device__ __forceinline__ unsigned {scale}(unsigned a, unsigned g) {{
  {scale}_word wa, wg;
  wa.u = a;
  wg.u = g;
  wa.h = __hmul2(wa.h, wg.h);
  return wa.u;
}}
"""
    return sumsq, sumsq_src, scale, scale_src


def _checked_schedule(n, k, dtype, epilogue, schedule, norm: bool) -> SkinnyMatmulSchedule:
    """The kernel's schedule (`schedule`, else the chooser's), ValueError for what it does not take."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {tuple(DTYPES)}")
    allowed = NORM_EPILOGUES if norm else EPILOGUES
    if epilogue not in allowed:
        raise ValueError(f"epilogue={epilogue!r}: expected one of {allowed}")
    halves = 2 if epilogue == "swiglu" else 1
    if schedule is None:
        schedule = choose_skinny_schedule(n, k, halves, norm)
    if schedule is None:
        raise ValueError(f"N={n}, K={k}: expected multiples of {ROWS_PER_TILE}")
    schedule.check(n, k, halves, norm)
    return schedule


def _skinny_matmul(n, k, dtype, epilogue, schedule, buffers, norm_eps=None):
    NORM = norm_eps is not None
    sched = _checked_schedule(n, k, dtype, epilogue, schedule, NORM)
    H = 2 if epilogue == "swiglu" else 1  # weight rows per output column
    WN, WK, KS, STAGES, RT = sched.warps_n, sched.warps_k, sched.k_steps, sched.stages, sched.row_tiles
    BN, BK, BM = sched.block_n, sched.block_k, sched.block_m
    NT = 32 * WN * WK
    KT = k // BK  # stage tiles along K
    TL = Tile(BK)
    X_WORDS = BM * TL.stride // 2  # a stage's X rows, in 32-bit words
    G_OFF = X_WORDS + H * BN * TL.stride // 2  # NORM: the stage's BK elements of g, after its W rows
    STAGE_WORDS = G_OFF + (BK // 2 if NORM else 0)
    G_COPIES = BK // CHUNK  # NORM: 16-byte copies of g per stage (the first threads')
    SUM_STRIDE = H * BN + 4  # floats per row of the warps' sums (padded against bank conflicts)
    SUM_WORDS = BM * SUM_STRIDE
    SMEM_WORDS = sched.smem_bytes(H, NORM) // 4
    X_COPIES = (BM * TL.chunks + NT - 1) // NT  # copy rounds of X per thread (rows past the batch skip)
    W_COPIES = (H * BN * TL.chunks + NT - 1) // NT
    OUT_ROUNDS = (BM * BN + NT - 1) // NT
    MT8 = RT * 8  # accumulators of one weight half
    MMA = mma_name(dtype)
    f32 = "float32"

    SUMSQ2, SUMSQ2_SRC, SCALE2, SCALE2_SRC = _norm_fragment_functions(dtype)
    SQ_COL = H * BN  # NORM: the padding column of the warps' sums that holds a row's sum of squares
    INV_K = 1.0 / k

    def w_row(r, n0):
        """The weight row of the block's stage row r (SwiGLU: gate rows, then up rows)."""
        return n0 + r if H == 1 else r // BN * n + n0 + r % BN

    @T.macro
    def issue(x_, g_, w_, smem_, rows_, m0_, n0_, kt_, tid_):
        """Stage tile kt_ (K columns kt_ * BK ..) of the chunk's X rows (from its 16-row tiles in
        use only), of the block's W rows and (NORM) of g -> ring stage kt_ % STAGES (cp.async)."""
        base = T.meta_var(kt_ % STAGES * STAGE_WORDS)
        if NORM:  # (g in the ring: read from global memory next to its MMAs, its latency would be each step's)
            if tid_ < G_COPIES:
                T.ptx[CP_ASYNC](smem_.ptr_to([base + G_OFF + tid_ * (CHUNK // 2)]),
                                T.address_of(g_[kt_ * BK + tid_ * CHUNK]), 16)
        for it in T.unroll(X_COPIES):
            c = T.meta_var(it * NT + tid_)
            r = T.meta_var(c // TL.chunks)
            ch = T.meta_var(c % TL.chunks)
            if (BM * TL.chunks % NT == 0 or c < BM * TL.chunks) and r < (rows_ + 15) // 16 * 16:
                T.ptx[CP_ASYNC](smem_.ptr_to([base + word(TL.offset(r, ch))]),
                                T.address_of(x_[T.min(m0_ + T.Cast("int64", r), x_.shape[0] - 1), 0,
                                                kt_ * BK + ch * CHUNK]), 16)
        for it in T.unroll(W_COPIES):
            c = T.meta_var(it * NT + tid_)
            r = T.meta_var(c // TL.chunks)
            ch = T.meta_var(c % TL.chunks)
            if H * BN * TL.chunks % NT == 0 or c < H * BN * TL.chunks:
                T.ptx[CP_ASYNC](smem_.ptr_to([base + X_WORDS + word(TL.offset(r, ch))]),
                                T.address_of(w_[w_row(r, n0_), kt_ * BK + ch * CHUNK]), 16)

    @T.macro
    def compute(smem_, acc_, af_, bf_, sq_, gf_, tiles_, kt_, wn_, wk_, lane_):
        """acc_ += the warp's k_steps slices of stage tile kt_: its 16 columns (of each weight
        half) against the chunk's 16-row tiles in use. NORM: each X fragment's squares first go
        to sq_ (rows lane / 4 and lane / 4 + 8 of each tile, this lane's columns), then the
        fragment is scaled by the norm's weight g (the stage's, its words at the fragment's columns in gf_),
        so the product is sum((x * g) w) and the epilogue multiplies it by 1 / RMS."""
        base = T.meta_var(kt_ % STAGES * STAGE_WORDS)
        for ks in T.unroll(KS):
            kk = T.meta_var(wk_ * KS + ks)  # the 16-wide slice of the stage tile
            if NORM:  # m16n8k16's A fragment: words 0, 2 row lane / 4, columns c and c + 8; 1, 3 row lane / 4 + 8
                for i in T.unroll(2):
                    gf_[i] = T.reinterpret("uint32", smem_[base + G_OFF + kk * 8 + lane_ % 4 + i * 4])
            for part in T.unroll(H):
                T.ptx[LDSM](bf_[part * 4], bf_[part * 4 + 1], bf_[part * 4 + 2], bf_[part * 4 + 3],
                            smem_.ptr_to([base + X_WORDS + word(TL.offset(
                                part * BN + wn_ * 16 + lane_ % 8 + lane_ // 16 * 8, kk * 2 + lane_ // 8 % 2))]))
            for mt in T.unroll(RT):
                if mt < tiles_:
                    T.ptx[LDSM](af_[0], af_[1], af_[2], af_[3], smem_.ptr_to([base + word(TL.offset(
                        mt * 16 + lane_ % 16, kk * 2 + lane_ // 16))]))
                    if NORM:
                        for i in T.unroll(4):
                            sq_[mt * 2 + i % 2] = sq_[mt * 2 + i % 2] + T.cuda.func_call(
                                SUMSQ2, af_[i], source_code=SUMSQ2_SRC, return_type=f32)
                            af_[i] = T.cuda.func_call(SCALE2, af_[i], gf_[i // 2], source_code=SCALE2_SRC,
                                                      return_type="uint32")
                    for part in T.unroll(H):
                        for h in T.unroll(2):
                            a = T.meta_var(part * MT8 + mt * 8 + h * 4)
                            T.ptx[MMA](acc_[a], acc_[a + 1], acc_[a + 2], acc_[a + 3], af_[0], af_[1], af_[2], af_[3],
                                       bf_[part * 4 + h * 2], bf_[part * 4 + h * 2 + 1],
                                       acc_[a], acc_[a + 1], acc_[a + 2], acc_[a + 3])

    @T.macro
    def store(y_, r_, sums_, total_, rows_, m0_, n0_, tid_):
        """Y of the chunk's rows: the warps' sums added (NORM: times the row's 1 / RMS), then the
        epilogue (rounded once)."""
        for it in T.unroll(OUT_ROUNDS):
            e = T.meta_var(it * NT + tid_)
            row = T.meta_var(e // BN)
            col = T.meta_var(e % BN)
            if (BM * BN % NT == 0 or e < BM * BN) and row < rows_:
                for part in T.unroll(H):
                    total_[part] = T.float32(0)
                    for w in T.unroll(WK):
                        total_[part] = total_[part] + sums_[w * SUM_WORDS + row * SUM_STRIDE + part * BN + col]
                if NORM:
                    total_[H] = T.float32(0)
                    for w in T.unroll(WK):
                        total_[H] = total_[H] + sums_[w * SUM_WORDS + row * SUM_STRIDE + SQ_COL]
                    total_[H] = T.rsqrt(total_[H] * T.float32(INV_K) + T.float32(norm_eps))
                    for part in T.unroll(H):
                        total_[part] = total_[part] * total_[H]
                rounded = T.meta_var(T.Cast(dtype, total_[0]))
                b = T.meta_var(m0_ + T.Cast("int64", row))
                if epilogue == "add":
                    y_[b, 0, n0_ + col] = r_[b, 0, n0_ + col] + rounded
                elif epilogue == "cast":
                    y_[b, 0, n0_ + col] = T.Cast(f32, rounded)
                elif epilogue == "bias":
                    y_[b, 0, n0_ + col] = T.Cast(dtype, total_[0] + T.Cast(f32, r_[n0_ + col]))
                elif epilogue == "swiglu":
                    y_[b, 0, n0_ + col] = T.Cast(dtype, total_[0] * T.sigmoid(total_[0]) * total_[1])
                else:
                    y_[b, 0, n0_ + col] = rounded

    @T.macro
    def body(x_, g_, w_, r_, y_):
        batch = x_.shape[0]
        for chunk in T.thread_binding((batch + BM - 1) // BM, thread="blockIdx.x"):
            for col_block in T.thread_binding(n // BN, thread="blockIdx.y"):
                for tid in T.thread_binding(NT, thread="threadIdx.x"):
                    # (its own name: a library's kernels share one CUDA source, where each dynamic
                    # shared buffer is an `extern __shared__` array named after it, typed as it is)
                    matmul_smem = T.alloc_buffer((SMEM_WORDS,), f32, scope="shared.dyn")
                    acc = T.alloc_buffer((H * MT8,), f32, scope="local")
                    af = T.alloc_buffer((4,), "uint32", scope="local")
                    bf = T.alloc_buffer((H * 4,), "uint32", scope="local")
                    total = T.alloc_buffer((H + 1,), f32, scope="local")  # (NORM: the row's 1 / RMS last)
                    sq = T.alloc_buffer((RT * 2,), f32, scope="local")  # NORM: sums of squares, this lane's
                    gf = T.alloc_buffer((2,), "uint32", scope="local")  # NORM: g's words at the fragment's columns
                    warp = tid // 32
                    lane = tid % 32
                    wn = warp % WN
                    wk = warp // WN
                    m0 = chunk * BM
                    n0 = col_block * BN
                    rows = T.Cast("int32", T.min(batch - m0, BM))  # rows of the chunk in the batch
                    tiles = (rows + 15) // 16
                    for i in T.unroll(H * MT8):
                        acc[i] = T.float32(0)
                    if NORM:
                        for i in T.unroll(RT * 2):
                            sq[i] = T.float32(0)
                    for s in T.unroll(STAGES - 1):
                        if s < KT:
                            issue(x_, g_, w_, matmul_smem, rows, m0, n0, s, tid)
                        T.ptx["cp.async.commit_group"]()  # (empty groups keep the count)
                    for kt in T.serial(KT):
                        T.ptx["cp.async.wait_group"](STAGES - 2)  # this thread's copies of tile kt have landed
                        T.tvm_storage_sync("shared")  # ... everyone's; no warp reads tile kt - 1 any more
                        if kt + STAGES - 1 < KT:
                            issue(x_, g_, w_, matmul_smem, rows, m0, n0, kt + STAGES - 1, tid)
                        T.ptx["cp.async.commit_group"]()
                        compute(matmul_smem, acc, af, bf, sq, gf, tiles, kt, wn, wk, lane)
                    T.ptx["cp.async.wait_group"](0)
                    T.tvm_storage_sync("shared")  # the ring is free: it holds the warps' sums now
                    for mt in T.unroll(RT):
                        if mt < tiles:
                            for pt in T.unroll(H):
                                for h in T.unroll(2):
                                    for half in T.unroll(2):
                                        for e in T.unroll(2):
                                            matmul_smem[wk * SUM_WORDS + (mt * 16 + lane // 4 + half * 8) * SUM_STRIDE
                                                        + pt * BN + wn * 16 + h * 8 + lane % 4 * 2 + e] = acc[
                                                pt * MT8 + mt * 8 + h * 4 + half * 2 + e]
                    if NORM:  # a row's squares: its quad's lanes added, then (in store) the K-slice warps'
                        for i in T.unroll(RT * 2):
                            for s in T.unroll(2):
                                sq[i] = sq[i] + T.tvm_warp_shuffle_xor(T.uint32(FULL_WARP), sq[i], 1 << s, 32, 32)
                        for mt in T.unroll(RT):
                            if mt < tiles and wn == 0 and lane % 4 == 0:
                                for half in T.unroll(2):
                                    matmul_smem[wk * SUM_WORDS + (mt * 16 + lane // 4 + half * 8) * SUM_STRIDE
                                                + SQ_COL] = sq[mt * 2 + half]
                    T.tvm_storage_sync("shared")
                    store(y_, r_, matmul_smem, total, rows, m0, n0, tid)

    return _as_function(body, n, k, dtype, epilogue, NORM, buffers)


def _as_function(body, n: int, k: int, dtype: str, epilogue: str, norm: bool, buffers):
    """The kernel macro `body` (x, g, w, r or bias, y) as skinny_matmul's / norm_matmul's PrimFunc,
    or with `buffers` as a statement on them (the *_body functions)."""
    H = 2 if epilogue == "swiglu" else 1
    out_dtype = "float32" if epilogue == "cast" else dtype
    N64, K64, NW64 = T.int64(n), T.int64(k), T.int64(H * n)
    if buffers is not None:
        x_b, g_b, w_b, r_b, y_b = buffers

        # (the caller's buffers are free here: the statement is checked where it lands)
        @T.prim_func(check_well_formed=False)
        def holder():
            body(x_b, g_b, w_b, r_b, y_b)

        return holder.body
    if norm and epilogue == "bias":
        @T.prim_func
        def func(x_h: T.handle, g: T.Buffer((K64,), dtype), w: T.Buffer((NW64, K64), dtype),
                 bias: T.Buffer((N64,), dtype), y_h: T.handle):
            T.func_attr({"tirx.noalias": True})
            batch_size = T.int64()
            x = T.match_buffer(x_h, (batch_size, T.int64(1), K64), dtype)
            y = T.match_buffer(y_h, (batch_size, T.int64(1), N64), dtype)
            body(x, g, w, bias, y)
    elif norm:
        @T.prim_func
        def func(x_h: T.handle, g: T.Buffer((K64,), dtype), w: T.Buffer((NW64, K64), dtype), y_h: T.handle):
            T.func_attr({"tirx.noalias": True})
            batch_size = T.int64()
            x = T.match_buffer(x_h, (batch_size, T.int64(1), K64), dtype)
            y = T.match_buffer(y_h, (batch_size, T.int64(1), N64), dtype)
            body(x, g, w, None, y)
    elif epilogue == "add":
        @T.prim_func
        def func(x_h: T.handle, w: T.Buffer((N64, K64), dtype), r_h: T.handle, y_h: T.handle):
            T.func_attr({"tirx.noalias": True})
            batch_size = T.int64()
            x = T.match_buffer(x_h, (batch_size, T.int64(1), K64), dtype)
            r = T.match_buffer(r_h, (batch_size, T.int64(1), N64), dtype)
            y = T.match_buffer(y_h, (batch_size, T.int64(1), N64), out_dtype)
            body(x, None, w, r, y)
    else:
        @T.prim_func
        def func(x_h: T.handle, w: T.Buffer((NW64, K64), dtype), y_h: T.handle):
            T.func_attr({"tirx.noalias": True})
            batch_size = T.int64()
            x = T.match_buffer(x_h, (batch_size, T.int64(1), K64), dtype)
            y = T.match_buffer(y_h, (batch_size, T.int64(1), N64), out_dtype)
            body(x, None, w, None, y)
    return func


@functools.lru_cache(maxsize=256)
def matmul_definition(n: int, k: int, dtype: str, epilogue: str) -> tirx.PrimFunc:
    """The unscheduled PrimFunc that `skinny_matmul(n, k, dtype, epilogue)` replaces, as a model
    library's pipeline writes it: a Relax function of x [batch_size, 1, k] times
    permute_dims(w [n, k]), then a residual add (residual + product) or a cast to float32, through
    FuseTransposeMatmul and TVM's CUDA legalization and fusion passes (NT_matmul summing in
    `dtype`, fused with its epilogue); what `SmallBatchTensorCoreMatmul` compares a function with."""
    from tvm import relax
    from tvm.relax.backend.cuda import pipeline as backend
    from tvm.script import relax as R

    batch = tirx.Var("batch_size", "int64")
    x = relax.Var("x", R.Tensor((batch, 1, k), dtype))
    w = relax.Var("w", R.Tensor((n, k), dtype))
    residual = relax.Var("residual", R.Tensor((batch, 1, n), dtype))
    builder = relax.BlockBuilder()
    with builder.function("main", [x, w, residual] if epilogue == "add" else [x, w]):
        with builder.dataflow():
            y = builder.emit(relax.op.matmul(x, relax.op.permute_dims(w)))
            if epilogue == "add":
                y = builder.emit(relax.op.add(residual, y))
            elif epilogue == "cast":
                y = builder.emit(relax.op.astype(y, "float32"))
            out = builder.emit_output(y)
        builder.emit_func_output(out)
    target = tvm.target.Target({"kind": "cuda", "arch": f"sm_{MIN_ARCH}"})
    with target:
        passes = [relax.transform.FuseTransposeMatmul()] + list(backend.legalize_passes(target))[:-1]
        mod = tvm.transform.Sequential(passes)(builder.get())
    (func,) = [f for f in mod.functions.values() if isinstance(f, tirx.PrimFunc)]
    return func


@functools.lru_cache(maxsize=64)
def swiglu_matmul_definition(n: int, k: int, dtype: str) -> tirx.PrimFunc:
    """The unscheduled PrimFunc that `skinny_matmul(n, k, dtype, "swiglu")` replaces: the op
    fused_decode.matmul_swiglu over x [batch_size, 1, k] and w [2 n, k], as the export writes it."""
    from tvm import relax
    from tvm.script import relax as R

    from .fused_decode import matmul_swiglu

    x = relax.Var("x", R.Tensor((tirx.Var("batch_size", "int64"), 1, k), dtype))
    w = relax.Var("w", R.Tensor((2 * n, k), dtype))
    builder = relax.BlockBuilder()
    with builder.function("main", [x, w]):
        with builder.dataflow():  # (as nn's tensor_expr_op emits it)
            out = builder.emit_output(builder.emit_te(matmul_swiglu, x, w))
        builder.emit_func_output(out)
    (func,) = [f for f in builder.get().functions.values() if isinstance(f, tirx.PrimFunc)]
    return func


def swiglu_matmul_takes(n: int, k: int, dtype: str) -> bool:
    """Whether skinny_matmul's "swiglu" kernel serves a gate_up weight of 2 n x k rows in dtype
    (what the export checks before it writes fused_decode.matmul_swiglu)."""
    schedule = choose_skinny_schedule(n, k, 2) if dtype in DTYPES else None
    if schedule is None:
        return False
    try:
        schedule.check(n, k, 2)
    except ValueError:
        return False
    return True


def tensor_core_matmul_problem(target: str, small_batch_matmul: bool = True) -> str | None:
    """None when a library for `target` (a target string, "cuda:sm_XY") can take the kernel, else why not."""
    if not TargetName.parse(target).is_cuda:
        return f"target {target!r}: the tensor-core matmul is a CUDA kernel"
    if sm_of(target) < MIN_ARCH:
        return f"target {target!r}: the tensor-core matmul needs sm_{MIN_ARCH} or newer (mma.sync, cp.async)"
    if not small_batch_matmul:
        return "it replaces small_batch_matmul's CUDA-core rule, which is off"
    return None


class SmallBatchTensorCoreMatmul(ScheduleRule):
    """Replaces a function that computes exactly `matmul_definition(N, K, dtype, epilogue)` (a
    decode_step / batch_decode projection over the symbolic batch_size, compared structurally)
    with `skinny_matmul`'s kernel, for CUDA sm_80 and newer. Anything else: None, for the next
    rule. The replacement keeps the function's attributes (its op pattern).

    below: the rule of batches under `from_batch` (the CUDA-core SmallBatchMatmul in a library's
    pipeline), None for tensor cores at every batch. Where it schedules the function, the
    replacement launches its kernel when batch_size < from_batch and the tensor-core kernel
    otherwise (one function, two kernels, the branch on the host); where it declines (a weight
    over its cap, the LM head), the tensor-core kernel runs at every batch.
    schedule_for(N, K), and schedule_for(N, K, 2) for matmul_swiglu's op (2 N weight rows): the
    kernel's schedule, None where none serves (default: choose_skinny_schedule; a sweep,
    scripts/bench_small_batch.py, passes others)."""

    def __init__(self, schedule_for=None, below: ScheduleRule | None = None, from_batch: int = TENSOR_CORES_FROM_BATCH):
        if not isinstance(from_batch, int) or from_batch < 1:
            raise ValueError(f"from_batch={from_batch!r}: expected an int of at least 1")
        self.schedule_for = schedule_for or choose_skinny_schedule
        self.below = below
        self.from_batch = from_batch

    def apply(self, func, target, tunable):
        if not isinstance(func, tirx.PrimFunc) or sm_of(target) < MIN_ARCH:
            return None
        if len(func.params) not in (3, 4):
            return None
        weight, out = func.params[1], func.params[-1]  # (TVM 0.27: parameters carry their shape and dtype)
        if len(getattr(weight, "shape", ())) != 2 or str(weight.dtype) not in DTYPES or not hasattr(out, "dtype"):
            return None
        if not all(isinstance(d, tirx.IntImm) for d in weight.shape):
            return None
        rows, k = (int(d) for d in weight.shape)
        dtype = str(weight.dtype)
        halves = 2 if swiglu_shaped(func) else 1
        epilogue = ("swiglu" if halves == 2 else "add" if len(func.params) == 4
                    else "cast" if str(out.dtype) == "float32" else "none")
        n = rows // halves
        schedule = self.schedule_for(n, k, halves) if halves == 2 else self.schedule_for(n, k)
        if schedule is None:
            return None
        try:
            schedule.check(n, k, halves)
        except ValueError:
            return None
        definition = (swiglu_matmul_definition(n, k, dtype) if epilogue == "swiglu"
                      else matmul_definition(n, k, dtype, epilogue))
        # (the parameters and the body; attributes such as the op pattern may differ)
        if not tvm_ffi.structural_equal([func.params, func.body], [definition.params, definition.body],
                                        map_free_vars=True):
            return None
        # (the CUDA-core rule declines SwiGLU's op: it runs on tensor cores at every batch)
        low = _scheduled_by(self.below, self.from_batch, func, target, tunable)
        if low is not None:
            x, w, *rest, y = low.params
            tensor_cores = skinny_matmul_body(n, k, dtype, epilogue, schedule, x, w, rest[0] if rest else None, y)
            return s_tir.Schedule(low.with_body(_branch_on_batch(x.shape[0], self.from_batch, low.body, tensor_cores)))
        kernel = skinny_matmul(n, k, dtype, epilogue, schedule)
        for key, value in (func.attrs or {}).items():
            kernel = kernel.with_attr(key, value)
        return s_tir.Schedule(kernel)

@functools.lru_cache(maxsize=256)
def norm_matmul_definition(n: int, k: int, dtype: str, epilogue: str, eps: float) -> tirx.PrimFunc:
    """The unscheduled PrimFunc that `norm_matmul(n, k, dtype, epilogue, eps)` replaces: the
    fused decode op (compiler.fused_decode) as a model library's export writes it, over x
    [batch_size, 1, k]; what `FusedNormTensorCoreMatmul` compares a function with."""
    from tvm import relax
    from tvm.script import relax as R

    from .fused_decode import rms_norm_matmul, rms_norm_matmul_swiglu

    rows = 2 * n if epilogue == "swiglu" else n
    x = relax.Var("x", R.Tensor((tirx.Var("batch_size", "int64"), 1, k), dtype))
    g = relax.Var("g", R.Tensor((k,), dtype))
    w = relax.Var("w", R.Tensor((rows, k), dtype))
    bias = relax.Var("bias", R.Tensor((n,), dtype))
    args = [x, g, w] + ([bias] if epilogue == "bias" else [])
    builder = relax.BlockBuilder()
    with builder.function("main", args):
        with builder.dataflow():  # (as nn's tensor_expr_op emits it)
            if epilogue == "swiglu":
                y = builder.emit_te(rms_norm_matmul_swiglu, x, g, w, eps=eps)
            else:
                y = builder.emit_te(rms_norm_matmul, *args, eps=eps)
            out = builder.emit_output(y)
        builder.emit_func_output(out)
    (func,) = [f for f in builder.get().functions.values() if isinstance(f, tirx.PrimFunc)]
    return func


def fused_op_params(func) -> tuple[float, bool] | None:
    """(epsilon, swiglu) of a fused decode op (fused_schedules.fused_op_schedule recognizes it):
    its RMSNorm's epsilon (the `rms_rstd` block: rsqrt(sumsq * (1 / K) + eps)) and whether it has
    SwiGLU's up half; None for any other function."""
    from .fused_schedules import fused_matmuls, fused_op_schedule

    sch = fused_op_schedule(func)
    if sch is None:
        return None
    try:
        eps = float(sch.get(sch.get_sblock("rms_rstd")).body.value.args[0].b.value)
    except (AttributeError, IndexError):  # (an rms_rstd block of another form)
        return None
    return eps, len(fused_matmuls(sch)) == 2


class FusedNormTensorCoreMatmul(ScheduleRule):
    """Replaces a fused decode op over the symbolic batch_size (compiler.fused_decode:
    rms_norm_matmul with or without a bias, rms_norm_matmul_swiglu; compared structurally with
    `norm_matmul_definition`) with `norm_matmul`'s kernel, for CUDA sm_80 and newer, where a
    schedule tiles the weight. Anything else (a static batch: `decode`'s): None.

    below: the rule of batches under `from_batch` (CUDAFusedDecodeGEMV in a library's
    pipeline), as SmallBatchTensorCoreMatmul's: one function, two kernels, the branch on the host.
    schedule_for(N, K, halves): the kernel's schedule (default: choose_skinny_schedule's, norm=True)."""

    def __init__(self, below: ScheduleRule | None = None, from_batch: int = TENSOR_CORES_FROM_BATCH,
                 schedule_for=None):
        if not isinstance(from_batch, int) or from_batch < 1:
            raise ValueError(f"from_batch={from_batch!r}: expected an int of at least 1")
        self.below = below
        self.from_batch = from_batch
        self.schedule_for = schedule_for or functools.partial(choose_skinny_schedule, norm=True)

    def apply(self, func, target, tunable):
        if not isinstance(func, tirx.PrimFunc) or sm_of(target) < MIN_ARCH or len(func.params) not in (4, 5):
            return None
        x, g, w = func.params[:3]
        if (len(getattr(x, "shape", ())) != 3 or isinstance(x.shape[0], tirx.IntImm)
                or len(getattr(w, "shape", ())) != 2 or str(getattr(w, "dtype", "")) not in DTYPES
                or not all(isinstance(d, tirx.IntImm) for d in w.shape)):
            return None
        fused = fused_op_params(func)
        if fused is None:
            return None
        eps, swiglu = fused
        rows, k = (int(d) for d in w.shape)
        dtype = str(w.dtype)
        epilogue = "swiglu" if swiglu else "bias" if len(func.params) == 5 else "none"
        n = rows // 2 if swiglu else rows
        halves = 2 if swiglu else 1
        schedule = self.schedule_for(n, k, halves)
        if schedule is None:
            return None
        try:
            schedule.check(n, k, halves, norm=True)
        except ValueError:
            return None
        definition = norm_matmul_definition(n, k, dtype, epilogue, eps)
        if not tvm_ffi.structural_equal([func.params, func.body], [definition.params, definition.body],
                                        map_free_vars=True):
            return None
        low = _scheduled_by(self.below, self.from_batch, func, target, tunable)
        if low is not None:
            x, g, w, *rest, y = low.params
            tensor_cores = norm_matmul_body(n, k, dtype, epilogue, eps, schedule, x, g, w,
                                            rest[0] if rest else None, y)
            return s_tir.Schedule(low.with_body(_branch_on_batch(x.shape[0], self.from_batch, low.body, tensor_cores)))
        kernel = norm_matmul(n, k, dtype, epilogue, eps, schedule)
        for key, value in (func.attrs or {}).items():
            kernel = kernel.with_attr(key, value)
        return s_tir.Schedule(kernel)


def swiglu_shaped(func) -> bool:
    """Whether func's parameters are (x, w, y) with y half as many columns as w has rows:
    matmul_swiglu's shape (gate and up halves), not a plain projection's."""
    if len(func.params) != 3:
        return False
    rows, cols = getattr(func.params[1], "shape", ()), getattr(func.params[2], "shape", ())
    if len(rows) != 2 or len(cols) != 3 or not all(isinstance(d, tirx.IntImm) for d in (rows[0], cols[-1])):
        return False
    return int(rows[0]) == 2 * int(cols[-1])


def _branch_on_batch(batch, from_batch: int, below: tirx.Stmt, tensor_cores: tirx.Stmt) -> tirx.Stmt:
    """`if batch < from_batch: below else tensor_cores`, the condition marked thread-invariant
    (tvm_thread_invariant): TVM's ThreadSync refuses to insert a barrier under any other
    condition, and the kernel below (a dlight-style schedule) may need one."""
    small = tirx.call_intrin("bool", "tirx.tvm_thread_invariant", batch < tirx.const(from_batch, "int64"))
    return tirx.IfThenElse(small, below, tensor_cores)


def _scheduled_by(rule, from_batch, func, target, tunable) -> tirx.PrimFunc | None:
    """`rule`'s scheduled func, None where there is none (no rule, from_batch 1, declined)."""
    if rule is None or from_batch == 1:
        return None
    scheduled = rule.apply(func, target, tunable)
    if isinstance(scheduled, list):
        scheduled = scheduled[0] if scheduled else None
    return None if scheduled is None else scheduled.mod["main"]
