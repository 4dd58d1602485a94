"""A tensor-core GEMV for kept GGUF blocks over a decode batch (Q4_0, Q4_1, Q8_0; float16).

What it computes is gemv_cuda.gemv_kernel's product for a symbolic batch of tokens (decode_step's
2..256), Y[t, n] = sum_k X[t, k] * W[n, k] (+ R[t, n]), with the same arguments (`mma_gemv_kernel`
can replace gemv_kernel(fmt, n, k, None, "float16", ...)): X [n_tokens, K], qs, d [N, K/32]
(Q4_1: m [N, K/32] next, named e0), R [n_tokens, N] with `residual`, Y [n_tokens, N], all float16
but the quants (weights.quant's layout). Each weight is first made float16 (Q4_0: d (q - 8),
Q8_0: d q, each rounded once: exactly the float16 of algorithms.dequantize_algorithm; Q4_1: d q + m
in one fused rounding), the products and their sums are float32 (mma.sync m16n8k16 with float32
accumulators), the residual is added in float32 and Y rounded once to float16.

Why: gemv_cuda multiplies on CUDA cores, one FMA per weight and token, each quant made float32 once
per pass of 4 tokens: at 16 tokens it is 5x slower than float16 weights. Here a quant pair becomes
a float16 pair in 4 instructions, shared by the token tiles, and one MMA does 16 x 8 x 16
multiply-adds.

How, a thread block (threadIdx.x: the lane, threadIdx.y: warp w of `MMAGemvSchedule.warps`):
- blockIdx.x: `row_tiles` tiles of 16 output rows r0.. (the mma's M; rows past N compute row
  N-1, never stored), each multiplied by the same X registers; blockIdx.y: a tile of
  8 * token_tiles tokens t0.. (token tile i: the mma's N = 8 tokens t0 + 8 i..; tokens past
  n_tokens read token n_tokens - 1, never stored).
- K is walked in groups of GROUP = 4 consecutive blocks (128 weights, 8 mma steps of k16); warp w
  takes groups w, w + warps, ...; a group past the row's last block reads clamped blocks with
  scale 0 (and offset 0): the code stays branch-free (K = 576 is 18 blocks, 4.5 groups). The loop
  is unrolled by `MMAGemvSchedule.unroll` groups, so a warp has that many groups' loads in flight.
- Lane (g, c) = (lane // 4, lane % 4) owns block 4 j + c of group j: `real_k` maps the logical
  k positions it holds in step s (2c, 2c+1, 2c+8, 2c+9: the PTX ISA's m16n8k16 fragments) to four
  consecutive weights idx..idx+3 of that block (4-bit: word s % 4 of the block's 16 bytes, nibble
  half s // 4, idx = 16 (s // 4) + 4 (s % 4); Q8_0: idx = 4 s). A dot product is a sum, so
  permuting k alike in A (the weights) and B (X) leaves it unchanged, and the lane's registers
  come straight from its own loads: per group and row tile, rows r0 + g and r0 + g + 8 of its block (one
  16-byte load each; Q8_0: two), their scales (and offsets), and per token tile X[t0 + 8 i + g]
  over the block (four 16-byte loads, X read as 32-bit words of two float16).
- Step s: A registers R0 = (row g: weights idx, idx+1), R1 = (row g+8: idx, idx+1), R2 = (row g:
  idx+2, idx+3), R3 = (row g+8: idx+2, idx+3); B registers b0, b1 = X's words idx/2, idx/2 + 1.
  A weight pair becomes a half2 without conversion instructions (`DEQUANT_SRC`): one byte
  permute puts quants q_e, q_e+1 (bytes e, e+1 of the nibbles (word >> 4h) & 0x0F0F0F0F; Q8_0:
  of the word ^ 0x80808080, q + 128) in the low mantissa bits of the float16 1024, giving
  (1024 + q_e, 1024 + q_e+1) exactly; subtracting 1024 + z (z = 8, 0, 128) is exact, then one
  __hmul2 by (d, d) (Q4_1: __hfma2 with (m, m)) rounds once.
- The accumulators, 4 floats a lane per row tile and token tile: (row g, tokens 2c, 2c+1), (row
  g+8, same).
  After the K loop the warps' partial sums meet in shared memory: each warp writes its tiles, one
  barrier, then each thread sums the warps' values of a few (token, row) outputs (rows fastest),
  adds the residual and stores Y where token < n_tokens and row < N.
"""

from __future__ import annotations

import dataclasses

from tvm import tirx
from tvm.script import tirx as T

from tir_kernels.mma import mma_name

from .gemv_cuda import BLOCK, block_gemv_params, nibble_bytes
from .signature import prim_func

MMA_GEMV_FORMATS = ("Q4_0", "Q4_1", "Q8_0")
ROWS = 16  # output rows per thread block: the mma's M
TOKENS = 8  # tokens per token tile: the mma's N
K_STEP = 16  # weights per mma step: the mma's K
GROUP = 4  # blocks per group: lane c takes block 4 j + c of group j
STEPS = GROUP * BLOCK // K_STEP  # mma steps per group
WARP = 32
# groups a warp's K loop unrolls: their loads issue before the first group's MMAs wait on them
GROUP_UNROLL = 4
# the float16 pair (1024 + z, 1024 + z): what leaves q - z of a magic pair (1024 + q); z is the
# format's zero point (Q4_0: 8; Q8_0: 128, its signed byte read with the top bit flipped)
ZERO_PAIR = {"Q4_0": 0x64086408, "Q4_1": 0x64006400, "Q8_0": 0x64806480}
# rows from which a thread block takes two 16-row tiles (choose_mma_gemv_schedule): an LM head
# or a 1B model's gate_up, whose blocks read X again for every 16 rows
ROW_TILES_FROM_N = 16384
# tokens from which a batch of fewer than ROW_TILES_FROM_N rows runs the wide layout
# (choose_mma_gemv_schedule; the kernel branches on its token count at launch): 4 token tiles and
# 2 row tiles, so a dequantized weight pair serves four MMAs and X is read once per 32 rows
WIDE_FROM_TOKENS = 32
# accumulator floats between consecutive tokens of the shared tile: 16 per row tile and 4 more,
# which puts the 32 lanes' stores of one register (row g, token 2c) in 32 distinct banks: 8 c + g
RED_PAD = 4

# TVM writes a helper's source into the module once per function name: the two dequantizers have
# a source each, and the union both use is guarded, so a module holding Q4_1 beside Q4_0 or Q8_0
# kernels defines everything once
_HALF2_BITS_SRC = """
#ifndef TVMATTN_HALF2_BITS
#define TVMATTN_HALF2_BITS
union tvmattn_half2_bits { unsigned int u; __half2 h; };
#endif
"""
DEQUANT, DEQUANT_SRC = "tvmattn_dequant_pair", _HALF2_BITS_SRC + """
// Two weights of a GGUF block as a half2 (returned as its 32 bits): the quants in bytes of
// `bytes` (each below 256) that `sel` picks go into the low mantissa bits of the float16 1024
// (0x64 above each: 1024 + q exactly), `zero2` (1024 + z, twice) is subtracted (exact) and the
// result multiplied by the scales `d2`, rounded once.
__device__ __forceinline__ unsigned int tvmattn_dequant_pair(unsigned int bytes, unsigned int sel,
                                                             unsigned int zero2, unsigned int d2) {
  tvmattn_half2_bits q, z, d;
  q.u = __byte_perm(bytes, 0x64646464u, sel);
  z.u = zero2;
  d.u = d2;
  q.h = __hmul2(__hsub2(q.h, z.h), d.h);
  return q.u;
}
"""
DEQUANT_OFFSET, DEQUANT_OFFSET_SRC = "tvmattn_dequant_pair_offset", _HALF2_BITS_SRC + """
// tvmattn_dequant_pair's pair with the offsets `m2` added (Q4_1), in the same rounding.
__device__ __forceinline__ unsigned int tvmattn_dequant_pair_offset(unsigned int bytes, unsigned int sel,
                                                                    unsigned int zero2, unsigned int d2,
                                                                    unsigned int m2) {
  tvmattn_half2_bits q, z, d, m;
  q.u = __byte_perm(bytes, 0x64646464u, sel);
  z.u = zero2;
  d.u = d2;
  m.u = m2;
  q.h = __hfma2(__hsub2(q.h, z.h), d.h, m.h);
  return q.u;
}
"""


def real_k(c: int, s: int, fmt: str) -> list[int]:
    """The weights (offsets in a group of GROUP blocks, 0..127) that lane c's logical k positions
    2c, 2c+1, 2c+8, 2c+9 of mma step s (0..STEPS-1) stand for: idx..idx+3 of block c, idx = 16 h
    + 4 i for the 4-bit formats (word i = s % 4 of the block's 16 bytes, nibble half h = s // 4:
    byte 4 i + e holds weight 4 i + e low and 4 i + e + 16 high) and 4 s for Q8_0 (word s). Also
    takes TIR expressions for c and s (the kernel's unrolled step)."""
    idx = 4 * s if fmt == "Q8_0" else 16 * (s // 4) + 4 * (s % 4)
    return [BLOCK * c + idx + e for e in range(4)]


def pair_selector(e: int) -> int:
    """The __byte_perm selector of a magic pair: byte e of the quants (x), 0x64 (y's byte 0),
    byte e + 1, 0x64: the half2 (1024 + q_e, 1024 + q_e+1), q_e in the low half."""
    return e | 4 << 4 | (e + 1) << 8 | 4 << 12


@dataclasses.dataclass(frozen=True)
class MMAGemvSchedule:
    """How the tensor-core GEMV is laid out (never what it computes).

    warps: warps per thread block (1, 2, 4 or 8), each taking every warps-th group of 4 blocks of
    the 16 rows' K; token_tiles: tiles of 8 tokens per warp (1, 2 or 4), so a thread block covers
    8 * token_tiles tokens and each dequantized A fragment serves token_tiles MMAs; unroll: groups
    of a warp's K loop unrolled (1, 2 or 4; at most the groups it walks); row_tiles: tiles of 16
    rows per thread block (1, 2 or 4), each warp multiplying its X fragments with every one, so X
    is read once per row_tiles * 16 rows (X, read again by every row tile's block, is most of
    what a block reads from L2 at 16 tokens and more)."""

    warps: int = 4
    token_tiles: int = 2
    unroll: int = GROUP_UNROLL
    row_tiles: int = 1

    def __post_init__(self):
        for name, allowed in (("warps", (1, 2, 4, 8)), ("token_tiles", (1, 2, 4)), ("unroll", (1, 2, 4)),
                              ("row_tiles", (1, 2, 4))):
            value = getattr(self, name)
            if type(value) is not int or value not in allowed:
                raise ValueError(f"{name}={value!r}: expected an int in {allowed}")


def choose_mma_gemv_schedule(n: int, k: int, tokens: int = 1) -> MMAGemvSchedule:
    """The layout of a batch of `tokens` tokens. 8 warps where K has at least 4 groups (a block of
    256 threads), fewer where it has fewer (the largest power of 2 up to the count): a warp's
    groups run one after another, so the more warps split K the shorter that chain; at 4.5
    groups (K = 576) 8 warps measured faster than 4 although three of them only read clamped
    blocks (docs/performance.md). Below WIDE_FROM_TOKENS: 2 token tiles (a batch of 16 tokens is
    one row of thread blocks, and each dequantized pair serves two MMAs), and two row tiles from
    ROW_TILES_FROM_N rows, where X read again by every block costs more than the second tile's
    registers and shared memory (one tile was faster below it at up to 16 tokens). From
    WIDE_FROM_TOKENS below ROW_TILES_FROM_N rows: 4 token tiles and 2 row tiles, faster there at 64
    tokens; from ROW_TILES_FROM_N rows 4 token tiles were level or slower (docs/performance.md)."""
    groups = (k // BLOCK + GROUP - 1) // GROUP
    warps = 8 if groups >= 4 else 2 if groups >= 2 else 1
    if n >= ROW_TILES_FROM_N:
        return MMAGemvSchedule(warps=warps, token_tiles=2, row_tiles=2)
    if tokens >= WIDE_FROM_TOKENS:
        return MMAGemvSchedule(warps=warps, token_tiles=4, row_tiles=2)
    return MMAGemvSchedule(warps=warps, token_tiles=2, row_tiles=1)


def choose_mma_gemv_layouts(n: int, k: int) -> tuple[MMAGemvSchedule, MMAGemvSchedule | None]:
    """(plan, wide): `mma_gemv_kernel`'s layouts for a decode batch of any size; wide (batches of
    WIDE_FROM_TOKENS or more) is None where the choice does not change with the count."""
    plan, wide = choose_mma_gemv_schedule(n, k), choose_mma_gemv_schedule(n, k, WIDE_FROM_TOKENS)
    return plan, None if wide == plan else wide


@dataclasses.dataclass(frozen=True)
class _Layout:
    """One mma_gemv_kernel build: the sizes and flags its macro reads."""
    fmt: str
    N: int
    K: int
    NB: int  # blocks per row
    W: int  # warps
    TT: int  # token tiles
    TB: int  # tokens per thread block
    GPW: int  # groups a warp walks (the last may be past the row's blocks)
    WORDS: int  # 32-bit words of quants per block
    HAS_M: bool
    Q8: bool
    RES: bool
    UNROLL: int  # groups a warp's K loop unrolls
    RT: int  # row tiles per thread block
    BR: int  # rows per thread block (RT x ROWS)
    NT: int  # threads per block
    OUTS: int  # outputs per thread block (TB tokens x BR rows)
    OPT: int  # outputs a thread sums and stores


def _layout(fmt: str, n: int, k: int, dtype: str, plan: MMAGemvSchedule, residual: bool) -> _Layout:
    """mma_gemv_kernel's arguments checked, and the sizes its macro reads."""
    if fmt not in MMA_GEMV_FORMATS:
        raise ValueError(f"fmt={fmt!r}: the tensor-core GEMV takes {MMA_GEMV_FORMATS}")
    if dtype != "float16":
        raise ValueError(f"dtype={dtype!r}: the tensor-core GEMV takes float16 activations")
    if k <= 0 or k % BLOCK:
        raise ValueError(f"k={k}: expected a positive multiple of {BLOCK}")
    if n <= 0:
        raise ValueError(f"n={n}: expected a positive row count")
    NB = k // BLOCK
    W, TT = plan.warps, plan.token_tiles
    NT, TB = W * WARP, TOKENS * TT
    OUTS = TB * ROWS * plan.row_tiles
    return _Layout(fmt=fmt, N=n, K=k, NB=NB, W=W, TT=TT, TB=TB, GPW=((NB + GROUP - 1) // GROUP + W - 1) // W,
                   WORDS=8 if fmt == "Q8_0" else 4, HAS_M=fmt == "Q4_1", Q8=fmt == "Q8_0", RES=residual,
                   UNROLL=plan.unroll, RT=plan.row_tiles, BR=ROWS * plan.row_tiles, NT=NT, OUTS=OUTS,
                   OPT=(OUTS + NT - 1) // NT)


def _dequantize_pair(lay: _Layout, bytes_, e: int, d2, m2):
    """The half2 bits of weights (idx + e, idx + e + 1) from `bytes_` (a word's quants, one a
    byte: the nibbles, or Q8_0's bytes + 128), scales d2 and (Q4_1) offsets m2 (half2 bits)."""
    sel, zero = T.uint32(pair_selector(e)), T.uint32(ZERO_PAIR[lay.fmt])
    if lay.HAS_M:
        return T.cuda.func_call(DEQUANT_OFFSET, bytes_, sel, zero, d2, m2, source_code=DEQUANT_OFFSET_SRC,
                                return_type="uint32")
    return T.cuda.func_call(DEQUANT, bytes_, sel, zero, d2, source_code=DEQUANT_SRC, return_type="uint32")


def _step_bytes(lay: _Layout, quants, u: int, idx):
    """The word of row u's (2 rt + 0: row tile rt's row g, 2 rt + 1: its row g + 8) quants that
    holds weights idx..idx+3, a quant a byte (4-bit: its nibble half; Q8_0: q + 128, the signed
    byte's top bit flipped)."""
    if lay.Q8:
        return T.bitwise_xor(quants[u * lay.WORDS + idx // 4], T.uint32(0x80808080))
    return nibble_bytes(quants[u * lay.WORDS + idx % 16 // 4], idx // 16)


def _pair(scales, u):
    """The half2 bits (v, v) of the float16 bits `scales[u]` (uint32 holding a uint16)."""
    return T.bitwise_or(scales[u], T.shift_left(scales[u], T.uint32(16)))


def _body_macro(lay: _Layout):
    """The kernel's body over its buffers (the module docstring's "How")."""
    fmt, N, K, NB, W, TT, TB, GPW, WORDS = lay.fmt, lay.N, lay.K, lay.NB, lay.W, lay.TT, lay.TB, lay.GPW, lay.WORDS
    HAS_M, RES, NT, OUTS, OPT = lay.HAS_M, lay.RES, lay.NT, lay.OUTS, lay.OPT
    MMA, f32, XW = mma_name("float16"), "float32", K // 2  # X's 32-bit words per token
    RT, BR = lay.RT, lay.BR
    BLOCK_ROWS = (N + BR - 1) // BR
    RED_STRIDE = BR + RED_PAD
    UNROLL = min(lay.UNROLL, GPW)

    @T.macro
    def body(x, qs, d, m, r, y, n_tokens):
        xw = T.decl_buffer((n_tokens * T.int64(XW),), "uint32", data=x.data)
        qw = T.decl_buffer((T.int64(N * NB * WORDS),), "uint32", data=qs.data)
        dw = T.decl_buffer((T.int64(N * NB),), "uint16", data=d.data)
        if HAS_M:
            mw = T.decl_buffer((T.int64(N * NB),), "uint16", data=m.data)
        else:
            mw = T.meta_var(None)
        for bx in T.thread_binding(BLOCK_ROWS, thread="blockIdx.x"):
            for by in T.thread_binding((n_tokens + TB - 1) // TB, thread="blockIdx.y"):
                for w in T.thread_binding(W, thread="threadIdx.y"):
                    for lane in T.thread_binding(WARP, thread="threadIdx.x"):
                        red = T.alloc_shared((W * TB * RED_STRIDE,), f32)  # warp w's tiles, [token][row]
                        # row tile rt, token tile i at 4 (rt TT + i): (g, 2c), (g, 2c+1), (g+8, 2c), (g+8, 2c+1)
                        acc = T.alloc_local((4 * TT * RT,), f32)
                        # the lane's block of each row tile's rows g, g + 8
                        quants = T.alloc_local((2 * RT * WORDS,), "uint32")
                        scales = T.alloc_local((2 * RT,), "uint32")  # their d as float16 bits (0: a group past K)
                        offsets = T.alloc_local((2 * RT,), "uint32")  # Q4_1's m likewise
                        xr = T.alloc_local((TT * BLOCK // 2,), "uint32")  # tile i's token over the block
                        frag = T.alloc_local((4,), "uint32")  # the step's A registers
                        total = T.alloc_local((1,), f32)
                        g = T.meta_var(lane // 4)
                        c = T.meta_var(lane % 4)
                        for a in T.unroll(4 * TT * RT):
                            acc[a] = T.float32(0.0)
                        for it0 in T.serial((GPW + UNROLL - 1) // UNROLL):
                            for iu in T.unroll(UNROLL):  # unrolled: later groups' loads issue before this one's MMAs
                                it = it0 * UNROLL + iu
                                blk = (it * W + w) * GROUP + c
                                live = blk < NB
                                bc = T.Cast("int64", T.min(blk, NB - 1))
                                for u in T.unroll(2 * RT):  # rows past N compute row N - 1, never stored
                                    row = T.min(T.Cast("int64", bx * BR + u // 2 * ROWS + g + u % 2 * 8),
                                                T.int64(N - 1))
                                    for h in T.unroll(WORDS // 4):
                                        for v in T.vectorized(4):
                                            quants[u * WORDS + h * 4 + v] = qw[(row * NB + bc) * WORDS + h * 4 + v]
                                    scales[u] = T.if_then_else(live, T.Cast("uint32", dw[row * NB + bc]), T.uint32(0))
                                    if HAS_M:
                                        offsets[u] = T.if_then_else(live, T.Cast("uint32", mw[row * NB + bc]),
                                                                    T.uint32(0))
                                for i in T.unroll(TT):
                                    tok = T.min(T.Cast("int64", by * TB + i * TOKENS + g), n_tokens - 1)
                                    for h in T.unroll(BLOCK // 8):  # 16-byte loads: 8 values of X
                                        for v in T.vectorized(4):
                                            xr[i * (BLOCK // 2) + h * 4 + v] = \
                                                xw[tok * XW + bc * (BLOCK // 2) + h * 4 + v]
                                for s in T.unroll(STEPS):
                                    idx = T.meta_var(real_k(0, s, fmt)[0])  # the same offset in every lane's block
                                    for rt in T.unroll(RT):  # every row tile multiplies the same X registers
                                        for e in T.unroll(2):  # R0, R1: weights idx, idx+1; R2, R3: idx+2, idx+3
                                            for u in T.unroll(2):
                                                frag[e * 2 + u] = _dequantize_pair(
                                                    lay, _step_bytes(lay, quants, 2 * rt + u, idx), 2 * e,
                                                    _pair(scales, 2 * rt + u),
                                                    _pair(offsets, 2 * rt + u) if HAS_M else None)
                                        for i in T.unroll(TT):
                                            base = T.meta_var(i * (BLOCK // 2) + idx // 2)
                                            a0 = T.meta_var(4 * (rt * TT + i))
                                            T.ptx[MMA](acc[a0], acc[a0 + 1], acc[a0 + 2], acc[a0 + 3],
                                                       frag[0], frag[1], frag[2], frag[3], xr[base], xr[base + 1],
                                                       acc[a0], acc[a0 + 1], acc[a0 + 2], acc[a0 + 3])
                        for rt in T.unroll(RT):
                            for i in T.unroll(TT):
                                for a in T.unroll(4):  # (row 16 rt + g + 8 (a // 2), token 8 i + 2c + a % 2)
                                    red[(w * TB + i * TOKENS + 2 * c + a % 2) * RED_STRIDE + rt * ROWS + g
                                        + a // 2 * 8] = acc[4 * (rt * TT + i) + a]
                        T.tvm_storage_sync("shared")
                        for o in T.unroll(OPT):
                            out = T.meta_var(o * NT + w * WARP + lane)  # (token out // BR, row out % BR)
                            if out < OUTS:
                                total[0] = T.float32(0.0)
                                for v in T.unroll(W):
                                    total[0] = total[0] + red[(v * TB + out // BR) * RED_STRIDE + out % BR]
                                tok = T.meta_var(by * TB + out // BR)
                                row = T.meta_var(bx * BR + out % BR)
                                if tok < n_tokens and row < N:
                                    if RES:
                                        y[tok, row] = T.Cast("float16", total[0] + T.Cast(f32, r[tok, row]))
                                    else:
                                        y[tok, row] = T.Cast("float16", total[0])

    return body


def mma_gemv_kernel(fmt: str, n: int, k: int, dtype: str, plan: MMAGemvSchedule,
                    residual: bool = False, wide: MMAGemvSchedule | None = None) -> tirx.PrimFunc:
    """The PrimFunc (x [n_tokens, K], qs, d [N, K/32][, e0 = m [N, K/32] (Q4_1)][, r [n_tokens, N]
    (residual)], y [n_tokens, N]) of the module docstring, float16 but the quants (qs: uint8
    [N, K/2] for Q4_0 / Q4_1, int8 [N, K] for Q8_0), n_tokens symbolic: the parameters of
    gemv_cuda.gemv_kernel(fmt, n, k, None, dtype, ..., residual=residual). wide: a second layout,
    which the host launches instead of `plan` where n_tokens >= WIDE_FROM_TOKENS (two kernels in
    one function; None: `plan` at every count)."""
    params, route = block_gemv_params(fmt, n, k, None, dtype, residual=residual)

    def offsets_residual(bufs):
        """The macro's (m, r) from the buffers between d and Y (gemv_cuda's route, without G)."""
        m, _, r = route(bufs)
        return m, r

    def with_args(layout: MMAGemvSchedule):
        """The macro (buffers, n_tokens) running `layout`'s kernel body over the arguments."""
        body = _body_macro(_layout(fmt, n, k, dtype, layout, residual))

        @T.macro
        def run(bufs, n_tokens):
            body(bufs[0], bufs[1], bufs[2], *offsets_residual(bufs[3:-1]), bufs[-1], n_tokens)

        return run

    if wide is None:
        return prim_func(params, with_args(plan))
    run_plan, run_wide = with_args(plan), with_args(wide)

    @T.macro
    def by_count(bufs, n_tokens):
        # thread-invariant: ThreadSync places barriers in a kernel under no other kind of branch
        if T.tvm_thread_invariant(n_tokens >= WIDE_FROM_TOKENS):
            run_wide(bufs, n_tokens)
        else:
            run_plan(bufs, n_tokens)

    return prim_func(params, by_count)
