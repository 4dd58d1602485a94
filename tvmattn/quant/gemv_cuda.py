"""A CUDA dequantize + GEMV of our own for GGUF blocks (Q4_0, Q4_1, Q5_0, Q8_0, and Q4_K, Q6_K).

What it computes is algorithms.matmul_algorithm's product for a few tokens,
Y[t, n] = sum_k X[t, k] * W[n, k], in the block-factored form of algorithms.gemv_algorithm:
per block b of 32 weights, W = d * (q - z) + m (Q4_0: z = 8; Q5_0: z = 16, q's fifth bits from qh;
Q8_0: q the signed byte; Q4_1: z = 0 and an offset m), so

    Y[t, n] = sum_b d[n, b] * (sum_i (q - z)[n, 32b + i] * X[t, 32b + i]) + m[n, b] * (sum_i X[t, 32b + i])

with the products and sums in float32 and Y rounded once to the activations' dtype. A quant
becomes a float32 without a conversion instruction: one byte permute (PRMT) puts it in the low
bits of 0x4B000000, the float 2^23, whose mantissa then holds it (2^23 + q exactly), and one
float add takes off 2^23 + z (`dequantize_block`).

How (`CUDAGemvSchedule`): `lanes` threads of a warp share an output row; each takes whole
blocks (lane, lane + lanes, ...): one 16-byte load of a Q4 block's quants (two for Q8_0, the
quants read as 32-bit words of the same array), its scale (and offset) once, and X's 32 values
in 16-byte loads; the lanes' partial sums meet in a warp shuffle reduction. `rows` rows per
thread block (threadIdx.y), so a 576-row projection is 288 blocks of 64 threads for the H200's
132 SMs; with `rows_per_thread` = 2 (large single-token products) a thread computes two
consecutive rows from each X value it loads. Lanes past the row's blocks repeat its last block
with weight 0, so the code is branch-free and every load is issued up front. More tokens than
one (decode_step's symbolic batch) run in passes of `token_tile` tokens; the weight blocks stay
in the thread's registers, each block is made float32 once per pass, and X is re-read per token
(from L1 / L2).

The K-quants take whole units of their 256-weight super-blocks, laid out as GGUF's (config.py):
a Q4_K unit is 64 weights, the 32 bytes whose low nibbles are one 32-weight sub-block and whose
high nibbles the next (scale d * sc, offset -dmin * mn each); a Q6_K unit is 128 weights, half a
super-block: 64 bytes of ql and 32 of qh (eight 32-bit loads of quants and two of high bits),
eight 16-weight groups of scale d * sc, its quants less 32. Per group g of a unit,

    Y[t, n] += scale_g * (sum_i q_i * X[t, i]) + offset_g * (sum_i X[t, i])   (Q4_K)
    Y[t, n] += scale_g * (sum_i (q_i - 32) * X[t, i])                          (Q6_K)

A lane takes whole units as it takes blocks (their quants, scales and offsets in registers).

Arguments as algorithms.matmul_algorithm's: (X [T, K], *parts, Y [T, N]), shapes int64, T a
static count or the symbolic `n_tokens`; with `residual`, (X, *parts, R [T, N], Y) for
Y = R + X W^T (a decoder layer's residual add in the same kernel: one launch less per
projection).

A prologue (config.PROLOGUES) folds the op before the projection into the kernel, another
launch less each (per decoder layer: the two RMSNorms and the MLP's gate):
- "rms_norm": (X, *parts, G [K], Y): Y = (X * rsqrt(mean(X^2) + eps) * G) W^T, computed as
  rsqrt(...) * ((X G) W^T);
- "swiglu": X [T, 2K] holds gate then up; the product takes silu(gate) * up.
A prologue kernel has 512-thread blocks; for each pass of tokens the block first writes the
prologue's float32 output to shared memory once (X G, and each token's sum of squares by warp
shuffles and a sum over the warps; or silu(gate) * up; each thread a few 16-byte chunks of X,
every load issued before the arithmetic), and its rows read X from there. The
normalized X never exists in global memory (nor is it rounded to float16 as a separate RMSNorm
would round it).
"""

from __future__ import annotations

import dataclasses

from tvm.script import tirx as T

from ..weights.quant import part_shapes
from .config import PROLOGUES
from .signature import prim_func

GEMV_FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K")
BLOCK = 32
UNITS = {"Q4_K": 64, "Q6_K": 128}  # weights a lane takes at once (other formats: a BLOCK)
FULL_WARP = 0xFFFFFFFF
PAIRED_ROWS_MIN_BLOCKS = 264  # two thread blocks for each of an H100's / H200's 132 SMs
MAGIC, MAGIC_VALUE = 0x4B000000, 8388608.0  # the float32 2^23: OR-ing q < 2^23 into its mantissa adds q


def magic_byte(word, e: int):
    """The uint32 whose low byte is byte e of `word` and whose top byte is MAGIC's (0x4B), as one
    byte permute (PRMT; shifts and masks compile to two instructions): as a float32, 2^23 + that
    byte."""
    return T.call_pure_extern("uint32", "__byte_perm", word, T.uint32(MAGIC), T.uint32(0x7540 + e))


def magic_byte_by_shifts(word, e: int):
    """magic_byte's value by shifts and masks: for a CPU build of the kernel's arithmetic (tests)."""
    return T.bitwise_or(T.bitwise_and(T.shift_right(word, T.uint32(8 * e)), T.uint32(0xFF)), T.uint32(MAGIC))


def quant_value(bits, zero: int):
    """The float32 q - zero from `bits`, a magic_byte (2^23 + q as a float32; q < 2^23)."""
    return T.reinterpret("float32", bits) - T.float32(MAGIC_VALUE + zero)


def nibble_bytes(word, half: int):
    """The uint32 whose byte e is byte e of `word`'s low (half 0) or high (half 1) nibble."""
    return T.bitwise_and(T.shift_right(word, T.uint32(4 * half)), T.uint32(0x0F0F0F0F))


@dataclasses.dataclass(frozen=True)
class CUDAGemvSchedule:
    """How the CUDA GEMV is laid out (never what it computes).

    lanes: threads per output row (1, 2, 4, 8, 16 or 32: a warp's lanes reduce by shuffles);
    rows: thread rows per thread block (lanes * rows threads, at most 1024); token_tile: tokens
    per pass over the weight for symbolic token counts (a static count is one pass);
    rows_per_thread: consecutive output rows a thread row computes (each X value it loads serves
    them all), so a thread block covers rows * rows_per_thread output rows.
    """

    lanes: int = 16
    rows: int = 4
    token_tile: int = 4
    rows_per_thread: int = 1

    def __post_init__(self):
        if self.lanes not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"lanes={self.lanes!r}: expected a power of 2 up to 32")
        for name in ("rows", "token_tile", "rows_per_thread"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r}: expected a positive integer")
        if self.lanes * self.rows > 1024:
            raise ValueError(f"lanes * rows = {self.lanes * self.rows}: at most 1024 threads per block")


def choose_gemv_schedule(n: int, k: int, tokens: int | None, prologue: str = "none",
                         fmt: str | None = None) -> CUDAGemvSchedule:
    """lanes: the smallest power of 2 up to 32 covering the row's blocks, so a lane takes as few
    blocks as it can (each is about 100 dependent instructions: at one token the kernel is bound by
    that latency and by issue, not by bytes; SmolLM2's K of 576 and 1536 are 18 and 48 blocks: 1
    and 2 per lane); rows: 64 threads per block (576 rows: 288 blocks on 132 SMs); token tiles of
    4 (a static count: one pass). With a prologue, 512 threads a block: the prologue runs once per block and
    pass (staged in shared memory), so bigger blocks repeat it less; and passes of at most 4
    tokens (the staged X of SmolLM2's K = 1536 then fits the 48 KB of static shared memory).
    fmt: a K-quant's lanes cover its units (UNITS) instead of 32-weight blocks. rows_per_thread:
    see `paired` below."""
    blocks = k // UNITS.get(fmt, BLOCK)
    lanes = 1
    while lanes < min(blocks, 32):
        lanes *= 2
    threads = 64 if prologue == "none" else 512
    rows = max(1, threads // lanes)
    tile = 4 if tokens is None else tokens if prologue == "none" else min(tokens, 4)
    # two rows a thread halve its X loads (and their conversions) per weight, at a static token
    # count (a batch's passes would hold twice the dequantized blocks), where a lane holds at most
    # two blocks of each row and the grid keeps PAIRED_ROWS_MIN_BLOCKS thread blocks
    paired = (tokens is not None and fmt not in UNITS and (blocks + lanes - 1) // lanes <= 2
              and n // (2 * rows) >= PAIRED_ROWS_MIN_BLOCKS)
    return CUDAGemvSchedule(lanes=lanes, rows=rows, token_tile=tile, rows_per_thread=2 if paired else 1)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """One gemv_kernel build: its arguments and what `_layout` derives from them (sizes, format
    flags), the names the kernel's macros read."""
    dtype: str
    eps: float
    KQ: bool
    Q4K: bool
    Q6K: bool
    N: int
    K: int
    NB: int
    L: int
    R: int
    PT: int
    TR: int
    UNIT: int
    NU: int
    J: int
    GRID: int
    LOG_L: int
    VEC: int
    Q8: bool
    WORDS: int
    WPR: int
    G: int
    HW: int
    WORD: str
    HAS_M: bool
    Q5: bool
    RES: bool
    NORM: bool
    GLU: bool
    XK: int
    ZERO: int
    PRO: bool
    CHUNKS: int
    NT: int
    BP: int
    ITER: int


def _layout(fmt: str, n: int, k: int, tokens: int | None, dtype: str, plan: CUDAGemvSchedule,
            residual: bool, prologue: str, eps: float) -> _Layout:
    """gemv_kernel's arguments checked, and the sizes and flags its macros read."""
    if fmt not in GEMV_FORMATS:
        raise ValueError(f"fmt={fmt!r}: the CUDA GEMV takes {GEMV_FORMATS}")
    KQ, Q4K, Q6K = fmt in UNITS, fmt == "Q4_K", fmt == "Q6_K"  # K-quants: units of UNITS[fmt] weights
    if k % (256 if KQ else BLOCK):
        raise ValueError(f"k={k}: expected whole blocks of {256 if KQ else BLOCK}")
    if prologue not in PROLOGUES:
        raise ValueError(f"prologue={prologue!r}: expected one of {PROLOGUES}")
    N, K, NB = n, k, k // BLOCK
    L, R, PT = plan.lanes, plan.rows, plan.rows_per_thread
    TR = plan.token_tile if tokens is None else min(tokens, plan.token_tile)  # tokens per pass
    UNIT = UNITS.get(fmt, BLOCK)
    NU = K // UNIT  # units per row (a BLOCK each but for the K-quants)
    J = (NU + L - 1) // L  # units per lane
    GRID = (N + R * PT - 1) // (R * PT)
    LOG_L = L.bit_length() - 1
    VEC = 16 // (2 if dtype == "float16" else 4)  # activations per 16-byte load
    Q8 = fmt == "Q8_0"
    WORDS = {"Q8_0": 8, "Q4_K": 8, "Q6_K": 16}.get(fmt, 4)  # 32-bit words of quants per unit
    WPR = NU * WORDS  # words per row
    G = {"Q4_K": 2, "Q6_K": 8}.get(fmt, 1)  # groups of one scale and offset per unit
    HW = 8 if Q6K else 1  # 32-bit words of high bits per unit (Q5_0's qh, Q6_K's)
    WORD = "int32" if Q8 else "uint32"
    HAS_M = fmt == "Q4_1"
    Q5 = fmt == "Q5_0"  # the `m` slot holds qh, uint8 [N, 4 NB]: one 32-bit word of fifth bits a block
    RES = residual
    NORM, GLU = prologue == "rms_norm", prologue == "swiglu"
    XK = 2 * K if GLU else K  # X's columns
    ZERO = {"Q4_0": 8, "Q5_0": 16}.get(fmt, 0)  # the zero point dequantize_block takes off

    PRO = NORM or GLU
    CHUNKS = K // VEC  # 16-byte chunks of X a token's prologue stages
    NT = L * R  # threads per block
    BP = BLOCK + 4  # a staged block's floats: 4 of padding keep the lanes' 16-byte reads conflict-free
    if PRO and NT % 32:
        raise ValueError(f"lanes * rows = {NT}: a prologue needs whole warps")
    ITER = (CHUNKS + NT - 1) // NT  # chunks a thread stages per token
    names = locals()
    return _Layout(**{field.name: names[field.name] for field in dataclasses.fields(_Layout)})


def _unit_macros(lay: _Layout):
    """The macros that load a unit (a block, or a K-quant's unit) and multiply it: load_x,
    dequantize_block, load_unit, load_kquant, dot_kquant."""
    Q4K, Q5, Q8, PRO, NB, UNIT, NU, VEC = lay.Q4K, lay.Q5, lay.Q8, lay.PRO, lay.NB, lay.UNIT, lay.NU, lay.VEC
    WORDS, WPR, G, HW, ZERO, BP = lay.WORDS, lay.WPR, lay.G, lay.HW, lay.ZERO, lay.BP
    f32 = "float32"

    @T.macro
    def load_x(x, xv, xf, tok, b):
        """xf = X's UNIT values of unit b (a block but for the K-quants) for token `tok`, in float32
        (no prologue)."""
        for c in T.unroll(UNIT // VEC):
            for v in T.vectorized(VEC):
                xv[c * VEC + v] = x[tok, b * UNIT + c * VEC + v]
        for i in T.unroll(UNIT):
            xf[i] = T.Cast(f32, xv[i])

    @T.macro
    def dequantize_block(words, high, wq, j, base):
        """wq[base:base + 32] = block (slot) j's 32 quants as exact float32 integers, its format's
        zero point taken off (Q4_0: q - 8, Q5_0: q - 16, Q8_0: the signed byte; Q4_1: q, its offset
        m stays apart): each quant is put in the mantissa of MAGIC (2^23 + q exactly) and MAGIC +
        zero subtracted, a byte permute and a float add instead of a conversion instruction."""
        if Q8:
            for w in T.unroll(WORDS):  # a signed byte + 128 is the unsigned byte with its top bit flipped
                for e in T.unroll(4):
                    wq[base + w * 4 + e] = quant_value(magic_byte(T.bitwise_xor(
                        T.reinterpret("uint32", words[j * WORDS + w]), T.uint32(0x80808080)), e), 128)
        else:
            for w in T.unroll(WORDS):  # byte 4 w + e: weight 4 w + e in its low nibble, 4 w + e + 16 high
                for half in T.unroll(2):
                    nibbles = nibble_bytes(words[j * WORDS + w], half)
                    for e in T.unroll(4):
                        if Q5:  # the fifth bit: bit i of the block's qh word
                            wq[base + w * 4 + e + 16 * half] = quant_value(T.bitwise_or(
                                magic_byte(nibbles, e), T.shift_left(T.bitwise_and(T.shift_right(
                                    high[j], T.uint32(w * 4 + e + 16 * half)), T.uint32(1)), T.uint32(4))), ZERO)
                        else:
                            wq[base + w * 4 + e + 16 * half] = quant_value(magic_byte(nibbles, e), ZERO)

    @T.macro
    def load_unit(x, xv, xf, xs, t, tok, b):
        """xf = the UNIT values of X that unit b of a K-quant meets, float32 (staged or from X)."""
        if PRO:
            for c in T.unroll(UNIT // 4):
                for v in T.vectorized(4):
                    xf[c * 4 + v] = xs[t * NB * BP + (b * (UNIT // BLOCK) + c // 8) * BP + c % 8 * 4 + v]
        else:
            load_x(x, xv, xf, tok, b)

    @T.macro
    def load_kquant(qw, qhw, d, k1, k2, k3, words, high, scale, offset, rowc, j, b, live):
        """A K-quant unit's quants (16-byte loads), Q6_K's high bits, its groups' scales and offsets."""
        for h in T.unroll(WORDS // 4):
            for w in T.vectorized(4):
                words[j * WORDS + h * 4 + w] = qw[rowc * WPR + b * WORDS + h * 4 + w]
        if Q4K:  # k1, k2, k3 = sc, mn, dmin
            for g in T.unroll(2):
                scale[j * 2 + g] = T.Cast(f32, d[rowc, b // 4]) * T.Cast(f32, k1[rowc, b * 2 + g]) * live
                offset[j * 2 + g] = T.Cast(f32, k3[rowc, b // 4]) * T.Cast(f32, k2[rowc, b * 2 + g]) \
                    * T.float32(-1.0) * live
        else:  # Q6_K: k1, k2 = qh, sc
            for h in T.unroll(2):
                for w in T.vectorized(4):
                    high[j * HW + h * 4 + w] = qhw[rowc * (NU * HW) + b * HW + h * 4 + w]
            for g in T.unroll(8):
                scale[j * 8 + g] = T.Cast(f32, d[rowc, b // 2]) * T.Cast(f32, k2[rowc, b * 8 + g]) * live

    @T.macro
    def dot_kquant(words, high, scale, offset, xf, dot, acc, t, j):
        """acc[t] (t: a token and row's index) += unit (slot) j's groups: scale * (q . X) + offset *
        sum(X) (Q6_K: scale * ((q - 32) . X), its offset taken off the quants)."""
        for a in T.unroll(2 * G):
            dot[a] = T.float32(0.0)
        if Q4K:  # low nibbles: the unit's first 32 weights; high nibbles: the next 32
            for w in T.unroll(WORDS):
                for half in T.unroll(2):
                    nibbles = nibble_bytes(words[j * WORDS + w], half)
                    for e in T.unroll(4):
                        dot[half] = dot[half] + quant_value(magic_byte(nibbles, e), 0) * xf[w * 4 + e + 32 * half]
        else:  # Q6_K: byte l of ql's first and second 32 and of qh make weights l, l + 32, l + 64, l + 96
            for w in T.unroll(8):
                for part in T.unroll(4):  # weight part * 32 + 4 w + e, in group 2 part + w // 4
                    quants = T.bitwise_or(  # byte e: the weight's low 4 bits from ql, its top 2 from qh
                        nibble_bytes(words[j * WORDS + w + 8 * (part % 2)], part // 2),
                        T.shift_left(T.bitwise_and(T.shift_right(high[j * HW + w], T.uint32(2 * part)),
                                                   T.uint32(0x03030303)), T.uint32(4)))
                    for e in T.unroll(4):
                        dot[2 * part + w // 4] = dot[2 * part + w // 4] \
                            + quant_value(magic_byte(quants, e), 32) * xf[part * 32 + w * 4 + e]
        if Q4K:
            for g in T.unroll(G):
                for i in T.unroll(UNIT // G):
                    dot[G + g] = dot[G + g] + xf[g * (UNIT // G) + i]
            for g in T.unroll(G):
                acc[t] = acc[t] + scale[j * G + g] * dot[g] + offset[j * G + g] * dot[G + g]
        else:
            for g in T.unroll(G):
                acc[t] = acc[t] + scale[j * G + g] * dot[g]

    return load_x, dequantize_block, load_unit, load_kquant, dot_kquant


def _stage_macro(lay: _Layout):
    """The macro that stages a pass's tokens through the prologue into shared memory."""
    dtype, eps, NORM, GLU, K, NB, TR, VEC = lay.dtype, lay.eps, lay.NORM, lay.GLU, lay.K, lay.NB, lay.TR, lay.VEC
    CHUNKS, NT, BP, ITER = lay.CHUNKS, lay.NT, lay.BP, lay.ITER
    f32 = "float32"

    @T.macro
    def stage(x, g, xs, part, rstd, t0, n_tokens, lin):
        """The pass's tokens through the prologue into shared memory, once per thread block (not per
        row): xs[t, block, i] = silu(gate) * up, or X * G with rstd[t] = rsqrt(mean(X^2) + eps).
        Each thread takes 16-byte chunks (lin, lin + NT, ...) and issues all its loads before any
        arithmetic, so a thread waits on its loads once rather than once per element."""
        sq = T.alloc_local((TR,), f32)
        xa = T.alloc_local((ITER * VEC,), dtype)  # the chunks of X (the gate with SwiGLU)
        xb = T.alloc_local((ITER * VEC,), dtype)  # SwiGLU's up, or the norm's weight
        sv = T.alloc_local((VEC,), f32)
        T.tvm_storage_sync("shared")  # the previous pass's readers are done with xs
        for t in T.unroll(TR):
            tok = T.min(t0 * TR + t, n_tokens - 1)
            sq[t] = T.float32(0.0)
            for it in T.unroll(ITER):
                ch = T.min(lin + it * NT, CHUNKS - 1)  # threads past the chunks repeat the last (not stored)
                for v in T.vectorized(VEC):
                    xa[it * VEC + v] = x[tok, ch * VEC + v]
                if GLU:
                    for v in T.vectorized(VEC):
                        xb[it * VEC + v] = x[tok, T.int64(K) + ch * VEC + v]
                else:
                    for v in T.vectorized(VEC):
                        xb[it * VEC + v] = g[ch * VEC + v]
            for it in T.unroll(ITER):
                ch = T.min(lin + it * NT, CHUNKS - 1)
                for v in T.unroll(VEC):
                    if NORM:
                        sv[v] = T.Cast(f32, xa[it * VEC + v]) * T.Cast(f32, xb[it * VEC + v])
                        sq[t] = sq[t] + T.if_then_else(lin + it * NT < CHUNKS, T.float32(1.0), T.float32(0.0)) \
                            * T.Cast(f32, xa[it * VEC + v]) * T.Cast(f32, xa[it * VEC + v])
                    else:
                        sv[v] = T.Cast(f32, xa[it * VEC + v]) / (T.float32(1.0) + T.exp(-T.Cast(
                            f32, xa[it * VEC + v]))) * T.Cast(f32, xb[it * VEC + v])
                if lin + it * NT < CHUNKS:
                    for c4 in T.unroll(VEC // 4):
                        for v in T.vectorized(4):
                            xs[t * NB * BP + ch * VEC // BLOCK * BP + ch * VEC % BLOCK + c4 * 4 + v] = sv[c4 * 4 + v]
        if NORM:  # the block's sum of squares per token: warp shuffles, then across the warps
            for t in T.unroll(TR):
                for s in T.unroll(5):
                    sq[t] = sq[t] + T.tvm_warp_shuffle_xor(T.uint32(FULL_WARP), sq[t], T.shift_right(32, s + 1), 32, 32)
                if lin % 32 == 0:
                    part[lin // 32 * TR + t] = sq[t]
        T.tvm_storage_sync("shared")
        if NORM:
            for t in T.unroll(TR):
                sq[t] = T.float32(0.0)
                for w in T.unroll(NT // 32):
                    sq[t] = sq[t] + part[w * TR + t]
                rstd[t] = T.rsqrt(sq[t] / T.float32(K) + T.float32(eps))

    return stage


def _body_macro(lay: _Layout, load_x, dequantize_block, load_unit, load_kquant, dot_kquant, stage):
    """The kernel's body over its buffers (the module docstring's "How"), from the other macros."""
    dtype, KQ, Q6K, Q8, Q5, HAS_M, RES, NORM, PRO = (lay.dtype, lay.KQ, lay.Q6K, lay.Q8, lay.Q5, lay.HAS_M, lay.RES,
                                                     lay.NORM, lay.PRO)
    N, NB, L, R, PT, TR, UNIT, NU, J = lay.N, lay.NB, lay.L, lay.R, lay.PT, lay.TR, lay.UNIT, lay.NU, lay.J
    GRID, LOG_L, WORDS, WPR, G, HW, WORD, NT, BP = (lay.GRID, lay.LOG_L, lay.WORDS, lay.WPR, lay.G, lay.HW, lay.WORD,
                                                    lay.NT, lay.BP)
    f32 = "float32"

    @T.macro
    def body(x, qs, d, m, g, r, y, n_tokens, k1, k2, k3):
        qw = T.decl_buffer((T.int64(N * WPR),), WORD, data=qs.data)
        if Q5:
            qhw = T.decl_buffer((T.int64(N * NB),), "uint32", data=m.data)
        elif Q6K:
            qhw = T.decl_buffer((T.int64(N * NU * HW),), "uint32", data=k1.data)
        else:
            qhw = T.meta_var(None)
        for bx in T.thread_binding(GRID, thread="blockIdx.x"):
            for ty in T.thread_binding(R, thread="threadIdx.y"):
                for tx in T.thread_binding(L, thread="threadIdx.x"):
                    if PRO:  # the staged prologue (and the norm's per-warp sums of squares)
                        xs = T.alloc_shared((TR * NB * BP,), f32)
                        part = T.alloc_shared((NT // 32 * TR,), f32)
                    else:
                        xs = T.meta_var(None)
                        part = T.meta_var(None)
                    words = T.alloc_local((PT * J * WORDS,), WORD)  # slot u * J + j: row u's unit j
                    high = T.alloc_local((PT * J * HW,), "uint32")
                    scale = T.alloc_local((PT * J * G,), f32)
                    offset = T.alloc_local((PT * J * G,), f32)
                    xv = T.alloc_local((UNIT,), dtype)
                    xf = T.alloc_local((UNIT,), f32)
                    wq = T.alloc_local((PT * BLOCK,), f32)
                    acc = T.alloc_local((TR * PT,), f32)  # token t, row u: acc[t * PT + u]
                    rstd = T.alloc_local((TR,), f32)
                    dot = T.alloc_local((max(5, 2 * G),), f32)
                    row0 = T.Cast("int64", (bx * R + ty) * PT)  # the thread's rows: row0, ..., row0 + PT - 1
                    # the lane's blocks of each of its rows: quants (16-byte loads), scale and offset, once
                    for u in T.unroll(PT):
                        rowc = T.min(row0 + u, T.int64(N - 1))  # rows past N compute row N-1, never stored
                        for j in T.unroll(J):
                            b = T.min(T.Cast("int64", j * L + tx), T.int64(NU - 1))
                            slot = T.meta_var(u * J + j)
                            if KQ:
                                load_kquant(qw, qhw, d, k1, k2, k3, words, high, scale, offset, rowc, slot, b,
                                            T.if_then_else(j * L + tx < NU, T.float32(1.0), T.float32(0.0)))
                            else:
                                for w in T.vectorized(4):
                                    words[slot * WORDS + w] = qw[rowc * WPR + b * WORDS + w]
                                if Q8:
                                    for w in T.vectorized(4):
                                        words[slot * WORDS + 4 + w] = qw[rowc * WPR + b * WORDS + 4 + w]
                                # a lane past the row's blocks repeats the last one with weight 0: the
                                # code stays branch-free, so the compiler issues every load up front
                                live = T.if_then_else(j * L + tx < NB, T.float32(1.0), T.float32(0.0))
                                scale[slot] = T.Cast(f32, d[rowc, b]) * live
                                if HAS_M:
                                    offset[slot] = T.Cast(f32, m[rowc, b]) * live
                                elif Q5:
                                    high[slot] = qhw[rowc * NB + b]
                    for t0 in T.serial((n_tokens + TR - 1) // TR):
                        if PRO:
                            stage(x, g, xs, part, rstd, t0, n_tokens, ty * L + tx)
                        for a in T.unroll(TR * PT):
                            acc[a] = T.float32(0.0)
                        for j in T.unroll(J):
                            b = T.min(T.Cast("int64", j * L + tx), T.int64(NU - 1))
                            if not KQ:  # the rows' blocks once for the pass's tokens
                                for u in T.unroll(PT):
                                    dequantize_block(words, high, wq, u * J + j, u * BLOCK)
                            for t in T.unroll(TR):
                                tok = T.min(t0 * TR + t, n_tokens - 1)
                                if KQ:
                                    load_unit(x, xv, xf, xs, t, tok, b)
                                    for u in T.unroll(PT):
                                        dot_kquant(words, high, scale, offset, xf, dot, acc, t * PT + u, u * J + j)
                                else:
                                    if PRO:  # X once for the thread's rows
                                        for c in T.unroll(BLOCK // 4):
                                            for v in T.vectorized(4):
                                                xf[c * 4 + v] = xs[t * NB * BP + b * BP + c * 4 + v]
                                    else:
                                        load_x(x, xv, xf, tok, b)
                                    if HAS_M:
                                        dot[4] = T.float32(0.0)
                                        for i in T.unroll(BLOCK):
                                            dot[4] = dot[4] + xf[i]
                                    for u in T.unroll(PT):
                                        for a in T.unroll(4):
                                            dot[a] = T.float32(0.0)
                                        # four independent partial sums keep the FMA chains short
                                        for i in T.unroll(BLOCK):
                                            dot[i % 4] = dot[i % 4] + wq[u * BLOCK + i] * xf[i]
                                        acc[t * PT + u] = acc[t * PT + u] + scale[u * J + j] * (
                                            (dot[0] + dot[1]) + (dot[2] + dot[3]))
                                        if HAS_M:
                                            acc[t * PT + u] = acc[t * PT + u] + offset[u * J + j] * dot[4]
                        for t in T.unroll(TR):
                            for u in T.unroll(PT):
                                for s in T.unroll(LOG_L):
                                    acc[t * PT + u] = acc[t * PT + u] + T.tvm_warp_shuffle_xor(
                                        T.uint32(FULL_WARP), acc[t * PT + u], T.shift_right(L, s + 1), L, 32)
                                if NORM:  # (X * rstd * G) W^T = rstd * ((X G) W^T)
                                    acc[t * PT + u] = acc[t * PT + u] * rstd[t]
                        if tx == 0:
                            for u in T.unroll(PT):
                                if row0 + u < N:
                                    for t in T.unroll(TR):
                                        if t0 * TR + t < n_tokens:
                                            if RES:
                                                y[t0 * TR + t, row0 + u] = T.Cast(dtype, acc[t * PT + u] + T.Cast(
                                                    f32, r[t0 * TR + t, row0 + u]))
                                            else:
                                                y[t0 * TR + t, row0 + u] = T.Cast(dtype, acc[t * PT + u])

    return body


def block_gemv_params(fmt: str, n: int, k: int, tokens: int | None, dtype: str, residual: bool = False,
                      norm: bool = False, x_cols: int | None = None):
    """The parameters (`signature.prim_func`'s (name, type) list) of a GEMV of the 32-weight block
    format `fmt`, (X [T, x_cols or K], qs, d[, m | qh][, G [K]][, R [T, N]], Y [T, N]) with T =
    `tokens` or the symbolic count, the arguments after d named e0, e1, ...; and `route`, which
    maps the buffers between d and Y to (m | qh, G, R), None for those absent."""
    def rows(t):
        return t if tokens is None else T.int64(tokens)

    parts = part_shapes(fmt, n, k)  # qs, d[, m | qh]
    fixed = [(name, T.Buffer(tuple(T.int64(v) for v in shape), dt)) for name, dt, shape in parts[:2]]
    # the optional arguments between d and Y, in order: (name, (shape, dtype) of the token count)
    extras = [("m", lambda t, shape=shape, dt=dt: (tuple(T.int64(v) for v in shape), dt))
              for _, dt, shape in parts[2:]]
    extras += [("g", lambda t: ((T.int64(k),), dtype))] if norm else []
    extras += [("r", lambda t: ((rows(t), T.int64(n)), dtype))] if residual else []
    names = [name for name, _ in extras]

    def route(bufs):
        """(m | qh, G, R) from the extra buffers given, None for those absent."""
        got = dict(zip(names, bufs))
        return got.get("m"), got.get("g"), got.get("r")

    params = [("x", lambda t: ((rows(t), T.int64(x_cols or k)), dtype))] + fixed
    params += [(f"e{i}", spec) for i, (_, spec) in enumerate(extras)]
    return params + [("y", lambda t: ((rows(t), T.int64(n)), dtype))], route


def gemv_kernel(fmt: str, n: int, k: int, tokens: int | None, dtype: str, plan: CUDAGemvSchedule,
                residual: bool = False, prologue: str = "none", eps: float = 1e-5):
    """The PrimFunc (X, qs, d[, m | qh][, G][, R], Y) of the module docstring for `fmt` in GEMV_FORMATS;
    residual: Y = R + X W^T with R [T, N] in `dtype` (the sum rounded once); prologue: what the
    kernel applies to X before the product, in float32 (see PROLOGUES in the module docstring):
    "rms_norm" takes G [K] (`dtype`) and `eps`, "swiglu" takes X [T, 2K]. The arguments between d
    and Y are named e0, e1, ... in the PrimFunc (whichever of m or qh, G, R it takes, in that order)."""
    lay = _layout(fmt, n, k, tokens, dtype, plan, residual, prologue, eps)
    body = _body_macro(lay, *_unit_macros(lay), _stage_macro(lay))
    KQ, RES, NORM, N, K, XK = lay.KQ, lay.RES, lay.NORM, lay.N, lay.K, lay.XK

    def tok_rows(n_tokens):
        return n_tokens if tokens is None else T.int64(tokens)

    def xy(t, cols):  # X's or Y's (shape, dtype) for the token count t
        return (tok_rows(t), T.int64(cols)), dtype

    if KQ:
        return _kquant_func(fmt, N, K, XK, dtype, NORM, RES, tok_rows, xy, body)

    params, route = block_gemv_params(fmt, n, k, tokens, dtype, residual=RES, norm=NORM, x_cols=XK)

    @T.macro
    def with_args(bufs, n_tokens):
        body(bufs[0], bufs[1], bufs[2], *route(bufs[3:-1]), bufs[-1], tok_rows(n_tokens), None, None, None)

    return prim_func(params, with_args)



def _kquant_func(fmt: str, n: int, k: int, xk: int, dtype: str, norm: bool, residual: bool, tok_rows, xy, body):
    """The PrimFunc (X, *parts[, G][, R], Y) of a K-quant GEMV: its parts as config.py lists them
    (Q4_K: qs, sc, mn, d, dmin; Q6_K: ql, qh, sc, d), the arguments after them named h0, h1, ..."""
    N, K = T.int64(n), k
    parts = {"Q4_K": [((N, T.int64(K // 2)), "uint8"), ((N, T.int64(K // 32)), "uint8"),
                      ((N, T.int64(K // 32)), "uint8"), ((N, T.int64(K // 256)), "float16"),
                      ((N, T.int64(K // 256)), "float16")],
             "Q6_K": [((N, T.int64(K // 2)), "uint8"), ((N, T.int64(K // 4)), "uint8"),
                      ((N, T.int64(K // 16)), "int8"), ((N, T.int64(K // 256)), "float16")]}[fmt]
    specs = [lambda t, s=shape, d=dt: (s, d) for shape, dt in parts]
    if norm:
        specs.append(lambda t: ((T.int64(K),), dtype))
    if residual:
        specs.append(lambda t: ((tok_rows(t), N), dtype))

    def front(bufs):
        """body's (quants, d, m, g, r) from the matched buffers."""
        rest = list(bufs[len(parts):])
        g = rest.pop(0) if norm else None
        r = rest.pop(0) if residual else None
        return bufs[0], bufs[3], None, g, r

    def back(bufs):
        """body's (k1, k2, k3): Q4_K's sc, mn, dmin; Q6_K's qh, sc."""
        return (bufs[1], bufs[2], bufs[4]) if fmt == "Q4_K" else (bufs[1], bufs[2], None)

    @T.macro
    def with_args(bufs, n_tokens):
        body(bufs[0], *front(bufs[1:-1]), bufs[-1], tok_rows(n_tokens), *back(bufs[1:-1]))

    params = [("x", lambda t: xy(t, xk))] + [(f"h{i}", spec) for i, spec in enumerate(specs)]
    return prim_func(params + [("y", lambda t: xy(t, n))], with_args)
