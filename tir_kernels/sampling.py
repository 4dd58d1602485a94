"""Token sampling on the device: a batched kernel that picks one token per row of logits, and
an in-place penalty kernel that runs before it.

`sample_tokens(config)` -> PrimFunc `tvmattn_sample(logits [rows, vocab], params [rows, 4] f32,
tokens [rows] i32)`; params[r] = (u, temperature, top_k, top_p): u a uniform draw in [0, 1) the
host takes from the request's own generator, top_k a whole number (0: off). rows and vocab are
symbolic. The semantics are tvmattn.sampling's (its docstring is the contract):

- a row holding a NaN or inf logit gets token NON_FINITE (-1), whatever its params: the caller
  reports broken logits without reading them back;
- temperature <= 0: the argmax, the lowest token id among equal maxima;
- otherwise w[v] = exp((z[v] - max z) / temperature) over the float32 logits z; the kept set is
  a prefix of the tokens ordered by decreasing logit, ties by increasing id (numpy's stable
  argsort): its first top_k tokens (top_k in 1..vocab-1), then the shortest prefix of those whose
  mass reaches top_p of theirs (top_p < 1, the mass compared with a relative slack of 1e-6 for
  float32 sums); the token is the first, in id order, whose cumulative kept weight exceeds
  u * (total kept weight): numpy's `Generator.choice(p=...)` inverse CDF, so a host draw u
  gives the host sampler's token up to float32 rounding at a boundary.

No sort: a prefix is (tau, n), every token whose logit key (the float's bits mapped to an
order-preserving integer) exceeds tau, plus the n lowest-id tokens whose key equals tau. tau is
found by a radix search from the top bits (`radix_bits` per pass over the row): the largest key
whose at-or-above aggregate (a count for top-k, the kept weight for top-p) reaches the target.
The draw scans per-thread chunks of the row in id order (tie ranks and weights), so it is the
same cumulative sum as the host's.

`feed_tokens(config)` -> PrimFunc `tvmattn_feed_tokens(tokens [rows] i32, ids [rows] i32)`: ids[r] =
tokens[r], NON_FINITE (and any negative token) as 0: a step's sampled tokens become the next
step's input ids on the device, and an embedding lookup never reads row -1 of its table.

`apply_penalties(config)` -> PrimFunc `tvmattn_apply_penalties(logits [rows, vocab] (in place),
token_ids [rows, m] i32, amounts [rows, m] f32)`: logits[r, token_ids[r, j]] -= amounts[r, j]
for token_ids >= 0 (-1 pads); the host gives each penalized token once per row, with amount
frequency_penalty * count + presence_penalty.

CUDA: the argmax (and NaN check) first runs over blocks of threads * ARGMAX_LOADS logits each
(`chunk_argmax`: a greedy row at batch 1 is not streamed through one SM), then one block of
`threads` threads per row reduces the partials and, for a sampled row, cuts and draws, with
block-wide reductions in shared memory. CPU: the same algorithm with one "thread" per row,
rows in parallel, the argmax in the row's own pass.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import tvm
from tvm.script import tirx as T

from .common import CPU_SCRATCH_SCOPE, LoopKinds, ceildiv, is_power_of_two
from .config import tvm_target
from .support import DTYPES, TargetName

PARAMS = 4  # u, temperature, top_k, top_p
NON_FINITE = -1  # the token of a row that holds a NaN or inf logit
TOP_P_SLACK = 1e-6  # relative: the host's float64 sampler uses 1e-12
_KEY_BITS = 32


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """dtype: the logits' element type (arithmetic is float32); target: "llvm", "cuda" or
    "cuda:sm_XY"."""

    dtype: str = "float32"
    target: str = "llvm"

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not supported: expected one of {DTYPES}")
        TargetName.parse(self.target)

    @property
    def is_gpu(self) -> bool:
        return TargetName.parse(self.target).is_cuda

    def tvm_target(self) -> tvm.target.Target:
        return tvm_target(self.target)


@dataclasses.dataclass(frozen=True)
class SamplingSchedule:
    """threads: threads per row (a power of two up to 1024; 1 on the CPU); radix_bits: key bits
    decided per pass of the top-k / top-p search (1, 2, 4 or 8: 32 / radix_bits passes, each
    keeping 2**radix_bits - 1 running sums per thread)."""

    threads: int
    radix_bits: int = 4

    def __post_init__(self):
        if not (isinstance(self.threads, int) and is_power_of_two(self.threads) and self.threads <= 1024):
            raise ValueError(f"invalid schedule: threads={self.threads!r} must be a power of two <= 1024")
        if self.radix_bits not in (1, 2, 4, 8):
            raise ValueError(f"invalid schedule: radix_bits={self.radix_bits!r} must be 1, 2, 4 or 8")

    @property
    def columns(self) -> int:
        """Running sums per thread: a radix pass's pivots, and at least the 3 of a statistics pass."""
        return max((1 << self.radix_bits) - 1, 3)


# CUDA: logits per block of the argmax pass (`chunk_argmax`), ARGMAX_LOADS per thread loaded at once
ARGMAX_LOADS = 16


def choose_sampling_schedule(config: SamplingConfig) -> SamplingSchedule:
    """256 threads per row on CUDA (15 sums x 256 threads of shared memory), one on the CPU."""
    return SamplingSchedule(256 if config.is_gpu else 1, 4)


def logit_key(z):
    """An int64 in [0, 2**32) that orders float32 values as the floats order (bit pattern for
    positive floats, its complement for negative)."""
    bits = T.reinterpret("int32", z)
    return T.if_then_else(bits >= 0, T.Cast("int64", bits) + T.int64(1 << 31), T.int64(-1) - T.Cast("int64", bits))


def not_finite(z):
    """Whether a float32 is NaN or inf, from its bits (all exponent bits set): a fast-math
    compiler may fold an isnan() away."""
    return T.bitwise_and(T.reinterpret("int32", z), T.int32(0x7F800000)) == T.int32(0x7F800000)


def key_logit(key):
    """The float32 whose `logit_key` is key."""
    bits = T.if_then_else(key >= T.int64(1 << 31), key - T.int64(1 << 31), T.int64(-1) - key)
    return T.reinterpret("float32", T.Cast("int32", bits))


def _weight(z, fz):
    """exp((z - max) / temperature) in float32 (fz: the row's max and temperature), as float64:
    the sums of weights are float64, so a 262,144-token row's cumulative sum stays exact enough
    for the host's inverse CDF."""
    return T.Cast("float64", T.exp((z - fz[0]) / fz[1]))


def sample_tokens(config: SamplingConfig, schedule: SamplingSchedule | None = None):
    """The sampling PrimFunc (module docstring): logits [rows, vocab] config.dtype, params
    [rows, 4] float32 -> tokens [rows] int32."""
    sched = schedule or choose_sampling_schedule(config)
    gpu = config.is_gpu
    if not gpu and sched.threads != 1:
        raise ValueError(f"invalid schedule: threads={sched.threads} on the CPU must be 1")
    L = LoopKinds(gpu)
    TH, BITS, NC, dtype = sched.threads, sched.radix_bits, sched.columns, config.dtype
    PASSES, RADIX = _KEY_BITS // BITS, (1 << BITS) - 1
    SHARED = "shared" if gpu else CPU_SCRATCH_SCOPE
    CHUNK = TH * ARGMAX_LOADS
    macros = _sampling_macros(L, TH, NC, BITS, PASSES, RADIX, gpu)

    @T.prim_func
    def tvmattn_sample(logits_handle: T.handle, params_handle: T.handle, tokens_handle: T.handle):
        T.func_attr({"tirx.noalias": True})
        rows, vocab = T.int32(), T.int32()
        logits = T.match_buffer(logits_handle, (rows, vocab), dtype)
        params = T.match_buffer(params_handle, (rows, PARAMS), "float32")
        tokens = T.match_buffer(tokens_handle, (rows,), "int32")
        if gpu:
            # the argmax pass spread over blocks of CHUNK logits (one block per row would stream
            # the row through one SM): each block's (max, lowest id, non-finite) to a partial
            chunks = T.meta_var(ceildiv(vocab, CHUNK))
            part_max = T.alloc_buffer((rows * chunks,), "float32")
            part_idx = T.alloc_buffer((rows * chunks,), "int32")
            part_bad = T.alloc_buffer((rows * chunks,), "int32")
            for row in L.block(rows, "x", outer=True):
                for ch in L.block(chunks, "y"):
                    for tx in L.thread(TH, "x"):
                        macros.chunk_argmax(logits, row, ch, vocab, tx, part_max, part_idx, part_bad)
        for row in L.block(rows, "x", outer=True):
            for tx in L.thread(TH, "x"):
                red = T.alloc_buffer((TH * NC,), "float64", scope=SHARED)
                red_i = T.alloc_buffer((TH,), "int64", scope=SHARED)
                fz = T.alloc_buffer((2,), "float32", scope=L.local)
                fl = T.alloc_buffer((8,), "float64", scope=L.local)
                il = T.alloc_buffer((16,), "int64", scope=L.local)
                acc = T.alloc_buffer((NC,), "float64", scope=L.local)
                if gpu:
                    macros.row_max_of_chunks(part_max, part_idx, part_bad, row, ceildiv(vocab, CHUNK), tx, red, red_i,
                                             fz, fl, il)
                else:
                    macros.row_max(logits, row, vocab, tx, red, red_i, fz, fl, il)
                # phases that synchronize the block run as loops of 0 or 1 trips, not under an
                # `if` (TVM inserts no barrier inside a condition); the trip count is the row's
                il[12] = T.if_then_else(params[row, 1] > T.float32(0) and il[15] == T.int64(0), T.int64(1), T.int64(0))
                for _ in T.serial(T.Cast("int32", il[12])):
                    macros.truncate(logits, params, row, vocab, tx, red, red_i, fz, fl, il, acc)
                    macros.draw(logits, params, tokens, row, vocab, tx, red, red_i, fz, fl, il)
                if tx == 0:
                    if il[15] > T.int64(0):  # a NaN or inf logit: no token (NON_FINITE)
                        tokens[row] = T.int32(NON_FINITE)
                    elif params[row, 1] <= T.float32(0):
                        tokens[row] = T.Cast("int32", il[0])

    return tvmattn_sample.with_attr("global_symbol", "tvmattn_sample")


class _Macros(NamedTuple):
    row_max: object
    chunk_argmax: object
    row_max_of_chunks: object
    truncate: object
    draw: object


def _sampling_macros(L: LoopKinds, TH: int, NC: int, BITS: int, PASSES: int, RADIX: int, gpu: bool):
    """The three phases of `sample_tokens` over one row (fl / il: the row's float / int scalars;
    fz[0] max logit, fz[1] temperature (float32); fl[2] kept mass, fl[3] target (float64); il[0] argmax, il[1] tau,
    il[2] n, il[3] top-k tau, il[4] top-k n, il[5] top-k ties, il[6..8] search state, il[9..11] scratch, il[12..14] trip counts of the
    phases that run or not (loops of 0 or 1 trips: a barrier may not sit under an `if`), il[15]: the
    row holds a NaN or inf)."""

    @T.macro
    def sync_():
        if gpu:
            T.tvm_storage_sync("shared")

    @T.macro
    def block_sum(red, acc, tx_, ncols_):
        """red[c] <- the sum over threads of red[tx * NC + c], c < ncols_ (acc: scratch). Each
        level reads, then (after a barrier) writes: TVM places no barrier under an `if`."""
        sync_()
        for lvl in T.serial((TH - 1).bit_length()):
            if tx_ < T.shift_right(TH, lvl + 1):
                for c in L.unroll(ncols_):
                    acc[c] = red[tx_ * NC + c] + red[(tx_ + T.shift_right(TH, lvl + 1)) * NC + c]
            sync_()
            if tx_ < T.shift_right(TH, lvl + 1):
                for c in L.unroll(ncols_):
                    red[tx_ * NC + c] = acc[c]
            sync_()

    @T.macro
    def reduce_candidates(tx, red, red_i, fz, fl, il):
        """The threads' candidates (fz[0], il[0]) and non-finite flags il[15] (0 or 1) -> the
        row's, in every thread (row_max's second half); the flags ride the same tree, in
        red[tx * NC + 1]."""
        red[tx * NC] = T.Cast("float64", fz[0])
        red[tx * NC + 1] = T.Cast("float64", il[15])
        red_i[tx] = il[0]
        sync_()
        for lvl in T.serial((TH - 1).bit_length()):
            if tx < T.shift_right(TH, lvl + 1):
                # the other thread's candidate wins when it is larger, or equal with a lower id
                il[9] = T.if_then_else(red_i[tx + T.shift_right(TH, lvl + 1)] >= 0 and (
                    red_i[tx] < 0 or red[(tx + T.shift_right(TH, lvl + 1)) * NC] > red[tx * NC]
                    or (red[(tx + T.shift_right(TH, lvl + 1)) * NC] == red[tx * NC]
                        and red_i[tx + T.shift_right(TH, lvl + 1)] < red_i[tx])), T.int64(1), T.int64(0))
                fl[7] = T.if_then_else(il[9] == T.int64(1), red[(tx + T.shift_right(TH, lvl + 1)) * NC], red[tx * NC])
                il[10] = T.if_then_else(il[9] == T.int64(1), red_i[tx + T.shift_right(TH, lvl + 1)], red_i[tx])
                fl[6] = T.max(red[tx * NC + 1], red[(tx + T.shift_right(TH, lvl + 1)) * NC + 1])
            sync_()
            if tx < T.shift_right(TH, lvl + 1):
                red[tx * NC] = fl[7]
                red_i[tx] = il[10]
                red[tx * NC + 1] = fl[6]
            sync_()
        fz[0] = T.Cast("float32", red[0])
        il[0] = red_i[0]
        il[15] = T.Cast("int64", red[1])
        sync_()

    @T.macro
    def row_max(logits, row, vocab, tx, red, red_i, fz, fl, il):
        """fz[0] <- the row's largest logit, il[0] <- its lowest token id; il[15] <- the count
        of the threads that read a NaN or inf logit (0: the row is finite)."""
        fz[0] = T.float32(0)
        il[0] = T.int64(-1)
        il[15] = T.int64(0)
        for j in T.serial(ceildiv(vocab, TH)):
            if j * TH + tx < vocab:
                if not_finite(T.Cast("float32", logits[row, j * TH + tx])):
                    il[15] = T.int64(1)
                if il[0] < 0 or T.Cast("float32", logits[row, j * TH + tx]) > fz[0]:
                    fz[0] = T.Cast("float32", logits[row, j * TH + tx])
                    il[0] = T.Cast("int64", j * TH + tx)
        reduce_candidates(tx, red, red_i, fz, fl, il)

    @T.macro
    def chunk_argmax(logits, row, ch, vocab, tx, part_max, part_idx, part_bad):
        """CUDA: the partial of logits ch * TH * ARGMAX_LOADS.. of the row (max, its lowest
        id, whether any is NaN or inf) -> part_*[row * chunks + ch]: each thread loads its
        ARGMAX_LOADS logits (TH apart) at once, then a tree over the block's threads."""
        vals = T.alloc_buffer((ARGMAX_LOADS,), "float32", scope="local")
        best = T.alloc_buffer((1,), "float32", scope="local")
        best_i = T.alloc_buffer((1,), "int32", scope="local")
        bad = T.alloc_buffer((1,), "int32", scope="local")
        other = T.alloc_buffer((1,), "int32", scope="local")
        cm = T.alloc_buffer((TH,), "float32", scope="shared")
        ci = T.alloc_buffer((TH,), "int32", scope="shared")
        cb = T.alloc_buffer((TH,), "int32", scope="shared")
        for u in T.unroll(ARGMAX_LOADS):
            vals[u] = T.float32(0)
            if (ch * ARGMAX_LOADS + u) * TH + tx < vocab:
                vals[u] = T.Cast("float32", logits[row, (ch * ARGMAX_LOADS + u) * TH + tx])
        best[0] = T.float32(0)
        best_i[0] = -1
        bad[0] = 0
        for u in T.unroll(ARGMAX_LOADS):  # ids rise with u: a strict > keeps the lowest of equal maxima
            if (ch * ARGMAX_LOADS + u) * TH + tx < vocab:
                if not_finite(vals[u]):
                    bad[0] = 1
                if best_i[0] < 0 or vals[u] > best[0]:
                    best[0] = vals[u]
                    best_i[0] = (ch * ARGMAX_LOADS + u) * TH + tx
        cm[tx] = best[0]
        ci[tx] = best_i[0]
        cb[tx] = bad[0]
        sync_()
        for lvl in T.serial((TH - 1).bit_length()):
            if tx < T.shift_right(TH, lvl + 1):
                # the other thread's candidate wins when it is larger, or equal with a lower id
                other[0] = T.if_then_else(ci[tx + T.shift_right(TH, lvl + 1)] >= 0 and (
                    ci[tx] < 0 or cm[tx + T.shift_right(TH, lvl + 1)] > cm[tx]
                    or (cm[tx + T.shift_right(TH, lvl + 1)] == cm[tx]
                        and ci[tx + T.shift_right(TH, lvl + 1)] < ci[tx])), 1, 0)
                best[0] = T.if_then_else(other[0] == 1, cm[tx + T.shift_right(TH, lvl + 1)], cm[tx])
                best_i[0] = T.if_then_else(other[0] == 1, ci[tx + T.shift_right(TH, lvl + 1)], ci[tx])
                bad[0] = T.max(cb[tx], cb[tx + T.shift_right(TH, lvl + 1)])
            sync_()
            if tx < T.shift_right(TH, lvl + 1):
                cm[tx] = best[0]
                ci[tx] = best_i[0]
                cb[tx] = bad[0]
            sync_()
        if tx == 0:
            part_max[row * ceildiv(vocab, TH * ARGMAX_LOADS) + ch] = cm[0]
            part_idx[row * ceildiv(vocab, TH * ARGMAX_LOADS) + ch] = ci[0]
            part_bad[row * ceildiv(vocab, TH * ARGMAX_LOADS) + ch] = cb[0]

    @T.macro
    def row_max_of_chunks(part_max, part_idx, part_bad, row, chunks, tx, red, red_i, fz, fl, il):
        """row_max from the row's chunk_argmax partials (CUDA)."""
        fz[0] = T.float32(0)
        il[0] = T.int64(-1)
        il[15] = T.int64(0)
        for j in T.serial(ceildiv(chunks, TH)):  # chunks rise with j: a strict > keeps the lowest id
            if j * TH + tx < chunks:
                if part_bad[row * chunks + j * TH + tx] != 0:
                    il[15] = T.int64(1)
                if part_idx[row * chunks + j * TH + tx] >= 0 and (
                        il[0] < 0 or part_max[row * chunks + j * TH + tx] > fz[0]):
                    fz[0] = part_max[row * chunks + j * TH + tx]
                    il[0] = T.Cast("int64", part_idx[row * chunks + j * TH + tx])
        reduce_candidates(tx, red, red_i, fz, fl, il)

    @T.macro
    def radix_search(logits, row, vocab, tx, red, il, acc, want, weight, out):
        """il[out] <- the largest key tau with sum(weight(z, key) over keys >= tau) >= want,
        decided RADIX bits a pass from the top (il[6]: the key so far, il[7]: its digit unit)."""
        il[6] = T.int64(0)
        for p in T.serial(PASSES):
            il[7] = T.shift_left(T.int64(1), T.Cast("int64", _KEY_BITS - (p + 1) * BITS))
            for c in L.unroll(NC):
                acc[c] = T.float64(0)
            for j in T.serial(ceildiv(vocab, TH)):
                if j * TH + tx < vocab:
                    z = T.Cast("float32", logits[row, j * TH + tx])
                    key = logit_key(z)
                    wz = weight(z, key)
                    for c in L.unroll(RADIX):
                        if key >= il[6] + T.Cast("int64", c + 1) * il[7]:
                            acc[c] = acc[c] + wz
            for c in L.unroll(RADIX):
                red[tx * NC + c] = acc[c]
            block_sum(red, acc, tx, RADIX)
            il[8] = T.int64(0)
            for c in T.serial(RADIX):  # the sums fall with the pivot: the last one still at want
                il[8] = T.if_then_else(red[c] >= want, T.Cast("int64", c + 1), il[8])
            sync_()
            il[6] = il[6] + il[8] * il[7]
        il[out] = il[6]

    @T.macro
    def stats(logits, row, vocab, tx, red, acc, tau, weight):
        """red[0] <- count of keys > tau, red[1] <- count of keys == tau, red[2] <- sum of
        weight over keys > tau."""
        for c in L.unroll(3):
            acc[c] = T.float64(0)
        for j in T.serial(ceildiv(vocab, TH)):
            if j * TH + tx < vocab:
                z = T.Cast("float32", logits[row, j * TH + tx])
                key = logit_key(z)
                if key > tau:
                    acc[0] = acc[0] + T.float64(1)
                    acc[2] = acc[2] + weight(z, key)
                elif key == tau:
                    acc[1] = acc[1] + T.float64(1)
        for c in L.unroll(3):
            red[tx * NC + c] = acc[c]
        block_sum(red, acc, tx, 3)

    return _truncate_and_draw(L, TH, NC, gpu, sync_, (row_max, chunk_argmax, row_max_of_chunks), radix_search, stats)


def _truncate_and_draw(L, TH, NC, gpu, sync_, maxima, radix_search, stats):
    """The top-k / top-p cut and the draw (see `_sampling_macros` for the scalars)."""

    def weight_of(fz):
        return lambda z, key: _weight(z, fz)

    def kept_weight_of(fz, il):  # top-k's prefix: every key above its tau, its first n ties
        return lambda z, key: T.if_then_else(
            key > il[3], _weight(z, fz),
            T.if_then_else(key == il[3], _weight(z, fz) * T.Cast("float64", il[4])
                           / T.Cast("float64", T.max(il[5], T.int64(1))), T.float64(0)))

    @T.macro
    def truncate(logits, params, row, vocab, tx, red, red_i, fz, fl, il, acc):
        """(il[1], il[2]) <- the kept prefix (tau, n) after top-k and top-p; fl[2] <- the mass
        top-p is measured against."""
        fz[1] = params[row, 1]
        il[3] = T.int64(-1)  # top-k off: every key (>= 0) is above tau
        il[4] = T.int64(0)
        il[5] = T.int64(0)
        il[13] = T.if_then_else(params[row, 2] >= T.float32(1) and params[row, 2] < T.Cast("float32", vocab),
                                T.int64(1), T.int64(0))
        for _ in T.serial(T.Cast("int32", il[13])):  # top-k (a loop, not an `if`: see sample_tokens)
            radix_search(logits, row, vocab, tx, red, il, acc, T.Cast("float64", params[row, 2]),
                         lambda z, key: T.float64(1), 3)
        stats(logits, row, vocab, tx, red, acc, il[3], weight_of(fz))
        if il[3] >= 0:
            il[4] = T.Cast("int64", params[row, 2]) - T.Cast("int64", red[0])
            il[5] = T.Cast("int64", red[1])
        fl[2] = red[2] + T.Cast("float64", il[4]) * _weight(key_logit(il[3]), fz)
        sync_()
        il[1] = il[3]
        il[2] = il[4]
        il[14] = T.if_then_else(params[row, 3] < T.float32(1), T.int64(1), T.int64(0))
        for _ in T.serial(T.Cast("int32", il[14])):  # top-p
            fl[3] = T.Cast("float64", params[row, 3]) * fl[2] * T.float64(1 - TOP_P_SLACK)
            radix_search(logits, row, vocab, tx, red, il, acc, fl[3], kept_weight_of(fz, il), 1)
            il[1] = T.max(il[1], il[3])
            stats(logits, row, vocab, tx, red, acc, il[1], kept_weight_of(fz, il))
            # ties at tau: as many as reach the target, at least one, at most those available
            il[2] = T.Cast("int64", T.ceil((fl[3] - red[2]) / _weight(key_logit(il[1]), fz)))
            il[9] = T.if_then_else(il[1] == il[3], il[4], T.Cast("int64", red[1]))
            il[2] = T.max(T.min(il[2], il[9]), T.int64(1))
            sync_()

    def kept(z_, il):  # in the prefix (tau, n) = (il[1], il[2]); il[9]: ties before this token
        key = logit_key(z_)
        return tvm.tirx.any(key > il[1], tvm.tirx.all(key == il[1], il[9] < il[2]))

    @T.macro
    def draw(logits, params, tokens, row, vocab, tx, red, red_i, fz, fl, il):
        """tokens[row] <- the first kept token, in id order, whose cumulative weight exceeds
        u * (total kept weight). Each thread holds a chunk of consecutive ids; every thread sums
        the chunks before its own in the same order, so the chunks' bounds agree bit for bit and
        never decrease (one chunk holds the target)."""
        chunk = ceildiv(vocab, TH)
        il[9] = T.int64(0)
        for i in T.serial(chunk):
            if tx * chunk + i < vocab:
                if logit_key(T.Cast("float32", logits[row, tx * chunk + i])) == il[1]:
                    il[9] = il[9] + T.int64(1)
        red_i[tx] = il[9]
        sync_()
        il[9] = T.int64(0)
        for t in T.serial(TH):  # ties before this chunk
            il[9] = il[9] + T.if_then_else(t < tx, red_i[t], T.int64(0))
        sync_()
        red_i[tx] = il[9]  # own slot: kept for the walk below
        fl[4] = T.float64(0)
        for i in T.serial(chunk):
            if tx * chunk + i < vocab:
                if kept(T.Cast("float32", logits[row, tx * chunk + i]), il):
                    fl[4] = fl[4] + _weight(T.Cast("float32", logits[row, tx * chunk + i]), fz)
                if logit_key(T.Cast("float32", logits[row, tx * chunk + i])) == il[1]:
                    il[9] = il[9] + T.int64(1)
        red[tx * NC] = fl[4]
        sync_()
        fl[6] = T.float64(0)  # kept weight before this chunk
        fl[7] = T.float64(0)  # through it
        fl[4] = T.float64(0)  # the running sum, then the total
        for t in T.serial(TH):
            fl[4] = fl[4] + red[t * NC]
            fl[6] = T.if_then_else(t + 1 == tx, fl[4], fl[6])
            fl[7] = T.if_then_else(t == tx, fl[4], fl[7])
        # target in [0, total): the chunk whose [before, through) interval holds it draws
        fl[5] = T.min(T.Cast("float64", params[row, 0]) * fl[4], T.nextafter(fl[4], T.float64(0)))
        if fl[6] <= fl[5] and fl[5] < fl[7]:
            il[9] = red_i[tx]
            il[10] = T.int64(-1)  # the token drawn
            il[11] = T.int64(-1)  # the last kept token of positive weight (rounding's fallback)
            fl[7] = T.float64(0)
            for i in T.serial(chunk):
                if tx * chunk + i < vocab:
                    if kept(T.Cast("float32", logits[row, tx * chunk + i]), il):
                        fl[7] = fl[7] + _weight(T.Cast("float32", logits[row, tx * chunk + i]), fz)
                        if _weight(T.Cast("float32", logits[row, tx * chunk + i]), fz) > T.float64(0):
                            il[11] = T.Cast("int64", tx * chunk + i)
                        if il[10] < 0 and fl[7] > fl[5] - fl[6]:
                            il[10] = T.Cast("int64", tx * chunk + i)
                    if logit_key(T.Cast("float32", logits[row, tx * chunk + i])) == il[1]:
                        il[9] = il[9] + T.int64(1)
            tokens[row] = T.Cast("int32", T.if_then_else(il[10] >= 0, il[10], il[11]))

    return _Macros(*maxima, truncate, draw)


def apply_penalties(config: SamplingConfig, schedule: SamplingSchedule | None = None):
    """The in-place penalty PrimFunc (module docstring): logits [rows, vocab] config.dtype,
    token_ids [rows, m] int32 (-1: none), amounts [rows, m] float32."""
    sched = schedule or choose_sampling_schedule(config)
    L = LoopKinds(config.is_gpu)
    TH, dtype = (min(sched.threads, 128) if config.is_gpu else 1), config.dtype

    @T.prim_func
    def tvmattn_apply_penalties(logits_handle: T.handle, token_ids_handle: T.handle, amounts_handle: T.handle):
        T.func_attr({"tirx.noalias": True})
        rows, vocab, m = T.int32(), T.int32(), T.int32()
        logits = T.match_buffer(logits_handle, (rows, vocab), dtype)
        token_ids = T.match_buffer(token_ids_handle, (rows, m), "int32")
        amounts = T.match_buffer(amounts_handle, (rows, m), "float32")
        for row in L.block(rows, "x", outer=True):
            for tx in L.thread(TH, "x"):
                for j in T.serial(ceildiv(m, TH)):
                    if j * TH + tx < m:
                        if token_ids[row, j * TH + tx] >= 0 and token_ids[row, j * TH + tx] < vocab:
                            logits[row, token_ids[row, j * TH + tx]] = T.Cast(
                                dtype, T.Cast("float32", logits[row, token_ids[row, j * TH + tx]])
                                - amounts[row, j * TH + tx])

    return tvmattn_apply_penalties.with_attr("global_symbol", "tvmattn_apply_penalties")


FEED_THREADS = 128  # CUDA threads per block of feed_tokens


def feed_tokens(config: SamplingConfig):
    """The token-feed PrimFunc (module docstring): tokens [rows] int32 -> ids [rows] int32 (written
    in place), negative tokens as 0."""
    L = LoopKinds(config.is_gpu)
    TH = FEED_THREADS if config.is_gpu else 1

    @T.prim_func
    def tvmattn_feed_tokens(tokens_handle: T.handle, ids_handle: T.handle):
        T.func_attr({"tirx.noalias": True})
        rows = T.int32()
        tokens = T.match_buffer(tokens_handle, (rows,), "int32")
        ids = T.match_buffer(ids_handle, (rows,), "int32")
        for block in L.block(ceildiv(rows, TH), "x", outer=True):
            for tx in L.thread(TH, "x"):
                if block * TH + tx < rows:
                    ids[block * TH + tx] = T.max(tokens[block * TH + tx], 0)

    return tvmattn_feed_tokens.with_attr("global_symbol", "tvmattn_feed_tokens")
