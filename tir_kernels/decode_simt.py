"""Paged decode attention on CUDA cores and the CPU (one query token per request), MHA/GQA, split-KV.

`paged_decode_simt(config, schedule)` is the kernel `decode.paged_decode` runs where the
tensor-core kernel (decode_tc.py) does not serve a config, or a `DecodeSchedule` asks for it.

Algorithm: a block serves one request, one KV head and `heads_per_block` query heads of its
group, over one split of the request's visible KV tokens. Each thread keeps an online
softmax (running max, denominator, output) over the rows it reads; rows are combined in
shared memory, and splits (when more than one) are merged in FP32: on CUDA by the last of a
request's split blocks to finish (`fused_merge`, an arrival counter per request and head chunk),
else (the CPU, or a schedule without fused_merge) by a second kernel.
The grid's split slots per request are computed at launch from the batch size, so small
batches still fill the GPU; a request uses min(slots, ceil(kv_len / min_split_keys)) of
them (`request_splits`, read in the kernel from its length: a captured grid stays valid for
any lengths); a request of one split writes o / lse directly and the merge skips it.
On the CPU the same code runs with one thread per block: every (request, head chunk, split)
block is a task of one parallel loop (so batch 1 with few KV heads still splits its keys over
the cores), a thread reads rows_per_thread rows per step (and prefetches the next step's rows
into L2 meanwhile), and its element loops are vector loops (q . k in VL-lane partial sums,
added pairwise); the merge of the splits is a serial loop below CPU_PARALLEL_MERGE_ROWS
(request, head) rows (a small batch's merge costs less than the fork / join of the thread pool
that a parallel region is).

Per block (`split_kernel`): `attend` = `load_q`, then per step of TILE rows `load_kv`,
`scores` and `accumulate` (online softmax, softmax.py); then `combine_rows` merges the row
groups and finishes (o / l, lse) into o / lse, or into the split workspace that
`merge_splits` merges. Every merge and finish is the softmax.py arithmetic.
"""

from __future__ import annotations

import dataclasses

from tvm.script import tirx as T

from .common import (CPU_SCRATCH_SCOPE, EMPTY_LSE, LOG2E, ceildiv, exp2_vector, kv_chunk_len, loop_kinds,
                     paged_position, rope_value)
from .config import AttentionConfig, RopeScaling
from .cuda_funcs import LDCG, LDCG_SRC, arrival_counter
from .decode_contract import check_config, decode_func
from .kv_quant import read_kv
from .schedules import DecodeSchedule, choose_decode_schedule
from .softmax import (finalize_lse, finalize_scale, finished_l, prob, rescale_factor,
                      softmax_macros)

# CUDA fused merge: the splits whose partials a merging thread loads in one round
FUSED_MERGE_UNROLL = 8

# CPU: the split merge runs as a parallel loop from this many (request, query head) rows on
CPU_PARALLEL_MERGE_ROWS = 64

# CPU: each step asks for the next step's K/V rows with a software prefetch into L2 (LLVM's
# locality 2, x86 prefetcht1). Without it a thread's loads of a step wait behind its arithmetic
# (docs/performance.md); into L1 (locality 3) gains nothing over L2.
CPU_PREFETCH_LOCALITY = 2
CPU_PREFETCH_STEPS = 1  # how many steps ahead
CACHE_LINE_BYTES = 64

# CPU row tiles (`_attend_cpu_macro`): float32 lanes of a vector, which is also the rows of a
# step (one score vector a head: lane r is row r's q . k)
CPU_LANES = 16


def _halving_shuffles(width: int) -> tuple[list[int], list[int]]:
    """Shuffle indices that pair two vectors of CPU_LANES lanes holding rows of `width` lanes
    each (lanes 0..2 * CPU_LANES - 1 of their concatenation): the low and the high half of
    every row, so that their sum holds the same rows, in order, at width / 2 lanes each."""
    half = width // 2
    low = [start + i for start in range(0, 2 * CPU_LANES, width) for i in range(half)]
    return low, [i + half for i in low]


@dataclasses.dataclass(frozen=True)
class _Dims:
    """Compile-time sizes of one paged_decode kernel (its config and schedule)."""

    gpu: bool
    dtype: str
    ps: int  # page size
    D: int
    Hq: int
    Hkv: int
    G: int  # GQA group size
    sliding: bool
    scaling: RopeScaling | None
    LANES: int  # threads sharing one KV row (threadIdx.x)
    ROWS: int  # KV rows read side by side (threadIdx.y)
    RPT: int  # rows each thread reads per step
    HB: int  # query heads a block serves
    EPL: int  # elements of a row held by one lane
    VEC: int  # elements per 16-byte load
    MAX_SPLITS: int
    TARGET_BLOCKS: int
    MIN_SPLIT_KEYS: int
    FUSED: bool  # CUDA: the last split block of a (request, head chunk) merges the splits
    VL: int  # CPU: float lanes of the q . k partial sums (a power of two dividing EPL)
    ROW_LINES: int  # CPU: cache lines a K or V row spans (the prefetches per row)
    LINE_ELEMS: int  # CPU: elements per cache line
    config: AttentionConfig  # for kv_quant.read_kv (FP8 pages: dequantized as they are read)

    @classmethod
    def of(cls, config: AttentionConfig, sched: DecodeSchedule) -> "_Dims":
        epl = config.head_dim // sched.lanes
        page_bytes = 1 if config.kv_fp8 else config.elem_bytes
        return cls(
            gpu=config.is_gpu, dtype=config.dtype, ps=config.page_size, D=config.head_dim,
            Hq=config.num_qo_heads, Hkv=config.num_kv_heads, G=config.group_size,
            sliding=config.sliding_window, scaling=config.rope_scaling,
            LANES=sched.lanes, ROWS=sched.rows, RPT=sched.rows_per_thread, HB=sched.heads_per_block,
            EPL=epl, VEC=min(epl, 16 // config.elem_bytes) if config.is_gpu else epl,
            MAX_SPLITS=sched.max_splits, TARGET_BLOCKS=sched.target_blocks, MIN_SPLIT_KEYS=sched.min_split_keys,
            FUSED=config.is_gpu and sched.fused_merge and sched.max_splits > 1,
            VL=next(v for v in (8, 4, 2, 1) if epl % v == 0),
            ROW_LINES=ceildiv(config.head_dim * page_bytes, CACHE_LINE_BYTES),
            LINE_ELEMS=CACHE_LINE_BYTES // page_bytes, config=config,
        )

    @property
    def CHUNKS(self) -> int:  # blocks per KV head along the GQA group
        return self.G // self.HB

    @property
    def CPU_TILES(self) -> bool:
        """CPU: attend by row tiles (`_attend_cpu_macro`): head dims of whole vectors and steps of
        CPU_LANES rows (the CPU schedule's rows_per_thread; another count takes `attend`)."""
        return not self.gpu and self.D % CPU_LANES == 0 and self.RPT == CPU_LANES and self.ROWS == 1

    @property
    def TILE(self) -> int:  # KV rows a block consumes per step
        return self.ROWS * self.RPT

    @property
    def NTHREADS(self) -> int:
        return self.LANES * self.ROWS

    @property
    def shared(self) -> str:
        return "shared" if self.gpu else CPU_SCRATCH_SCOPE

    def num_splits(self, batch):
        """Split slots per request in the grid, chosen at launch so that batch * heads * splits
        fills the GPU."""
        if self.MAX_SPLITS == 1:
            return 1
        return T.min(T.max(ceildiv(self.TARGET_BLOCKS, batch * self.Hkv * self.CHUNKS), 1), self.MAX_SPLITS)

    def request_splits(self, batch, kv_len):
        """Splits a request of kv_len visible keys uses: at most the grid's slots, each of at
        least MIN_SPLIT_KEYS keys (a short request takes fewer, or one: then no merge)."""
        if self.MAX_SPLITS == 1:
            return 1
        return T.min(self.num_splits(batch), T.max(ceildiv(kv_len, self.MIN_SPLIT_KEYS), 1))

    def kv_len(self, indptr_, length_info_, b):
        """Visible keys of request b."""
        return kv_chunk_len(indptr_[b + 1] - indptr_[b], self.ps, length_info_, b, self.sliding)

    def head(self, hc, h):
        """Query head of the h-th head served by head chunk hc."""
        return (hc // self.CHUNKS) * self.G + (hc % self.CHUNKS) * self.HB + h


def _load_macros(dims: _Dims, L):
    """load_q and load_kv: one lane's slice of q and of a step's K/V rows, into registers;
    prefetch_kv and prefetch_row (CPU): a step's K/V rows, or one K or V row, into L2."""
    dtype, ps, D, sliding, scaling = dims.dtype, dims.ps, dims.D, dims.sliding, dims.scaling
    ROWS, RPT, HB, EPL, VEC = dims.ROWS, dims.RPT, dims.HB, dims.EPL, dims.VEC
    ROW_LINES, LINE_ELEMS, cfg = dims.ROW_LINES, dims.LINE_ELEMS, dims.config
    # FP8 codes are widened element by element (CUDA has no vector lanes of that arithmetic)
    kv_loop = L.unroll if cfg.kv_fp8 else L.vector

    @T.macro
    def load_q(q_, b_, h0_, tx_, q_pos_, rotate_, rope_scale_, rope_theta_, sm_scale_, q_loc_):
        """q_loc_ [HB * EPL] f32 <- elements tx_ * EPL.. of heads h0_.. of request b_'s query,
        RoPE'd when rotate_, times sm_scale_ * log2(e) (scores in the exp2 domain)."""
        for h in L.unroll(HB):
            for e in L.unroll(EPL):
                if rotate_:
                    q_loc_[h * EPL + e] = rope_value(
                        lambda i: q_[b_, h0_ + h, i], tx_ * EPL + e, q_pos_[b_], D, rope_theta_, rope_scale_, scaling
                    ) * sm_scale_ * T.float32(LOG2E)
                else:
                    q_loc_[h * EPL + e] = T.Cast("float32", q_[b_, h0_ + h, tx_ * EPL + e]) * sm_scale_ * T.float32(LOG2E)

    @T.macro
    def load_kv(pages_, indices_, length_info_, k_pos_, page_begin_, b_, hkv_, j0_, j_end_, ty_, tx_, rotate_,
                rope_scale_, rope_theta_, k_loc_, v_loc_):
        """k_loc_, v_loc_ [RPT * EPL] (dtype) <- this lane's elements of KV rows j0_ + r * ROWS + ty_,
        K RoPE'd when rotate_; zero from j_end_ on. Issues every load of a step before any arithmetic."""
        page_loc = T.alloc_buffer((RPT,), "int32", scope=L.local)
        slot_loc = T.alloc_buffer((RPT,), "int32", scope=L.local)
        for r in L.unroll(RPT):
            j = j0_ + r * ROWS + ty_
            if j < j_end_:
                pos = paged_position(j, length_info_, b_, sliding)
                page_loc[r] = indices_[page_begin_ + pos // ps]
                slot_loc[r] = pos % ps
                if rotate_:
                    for e in L.unroll(EPL):
                        k_loc_[r * EPL + e] = T.Cast(dtype, rope_value(
                            lambda i: read_kv(cfg, pages_, 0, hkv_, page_loc[r], slot_loc[r], i), tx_ * EPL + e,
                            k_pos_[b_] + j, D, rope_theta_, rope_scale_, scaling))
                else:
                    for c in L.unroll(EPL // VEC):
                        for e in kv_loop(VEC):
                            k_loc_[r * EPL + c * VEC + e] = read_kv(cfg, pages_, 0, hkv_, page_loc[r], slot_loc[r],
                                                                    tx_ * EPL + c * VEC + e)
                for c in L.unroll(EPL // VEC):
                    for e in kv_loop(VEC):
                        v_loc_[r * EPL + c * VEC + e] = read_kv(cfg, pages_, 1, hkv_, page_loc[r], slot_loc[r],
                                                                tx_ * EPL + c * VEC + e)
            else:
                # Rows past the end get weight 0; zero them so 0 * garbage cannot make NaN.
                for e in L.unroll(EPL):
                    k_loc_[r * EPL + e] = T.Cast(dtype, 0)
                    v_loc_[r * EPL + e] = T.Cast(dtype, 0)

    @T.macro
    def prefetch_row(pages_, indices_, length_info_, page_begin_, b_, hkv_, j_, j_end_, kv_):
        """CPU: ask for the K (kv_ = 0) or V (kv_ = 1) row j_ (if below j_end_) in L2
        (CPU_PREFETCH_LOCALITY), every cache line of it."""
        if j_ < j_end_:
            # bound once with a window (a select over length_info), inline without one
            pos = paged_position(j_, length_info_, b_, sliding) if sliding else T.meta_var(j_)
            for line in T.unroll(ROW_LINES):
                T.evaluate(T.call_llvm_intrin(
                    "void", "llvm.prefetch.p0",
                    T.address_of(pages_[indices_[page_begin_ + pos // ps], kv_, hkv_, pos % ps, line * LINE_ELEMS]),
                    0, CPU_PREFETCH_LOCALITY, 1))

    @T.macro
    def prefetch_kv(pages_, indices_, length_info_, page_begin_, b_, hkv_, j0_, j_end_, ty_):
        """CPU: the K and V rows j0_ + r * ROWS + ty_ (r < RPT) by prefetch_row: the next
        step's rows, fetched while this step computes."""
        for r in T.serial(RPT):
            for kv in T.unroll(2):
                prefetch_row(pages_, indices_, length_info_, page_begin_, b_, hkv_, j0_ + r * ROWS + ty_, j_end_, kv)

    return load_q, load_kv, prefetch_kv, prefetch_row


def _attend_macro(dims: _Dims, L):
    """attend: the online softmax of one block's rows over one split."""
    D, G = dims.D, dims.G
    LANES, ROWS, RPT, HB, EPL = dims.LANES, dims.ROWS, dims.RPT, dims.HB, dims.EPL
    CHUNKS, TILE, VL = dims.CHUNKS, dims.TILE, dims.VL
    LOG_LANES = LANES.bit_length() - 1
    elementwise = L.unroll if dims.gpu else T.vectorized  # o += p * v: vector loops on the CPU
    sm = softmax_macros(L)
    load_q, load_kv, prefetch_kv, _ = _load_macros(dims, L)

    @T.macro
    def lane_allreduce(buf_, idx_):
        """buf_[idx_] <- sum over the LANES threads that share a row (xor butterfly)."""
        for k_ in T.unroll(LOG_LANES):
            buf_[idx_] = buf_[idx_] + T.tvm_warp_shuffle_xor(
                T.tvm_warp_activemask(), buf_[idx_], T.shift_right(LANES, k_ + 1), LANES, 32
            )

    @T.macro
    def halve(part_, at_, width):
        """CPU: part_[at_ + v] += part_[at_ + v + width] for v < width (a step of the pairwise sum)."""
        for v in T.vectorized(width):
            part_[at_ + v] = part_[at_ + v] + part_[at_ + v + width]

    @T.macro
    def scores(q_loc_, k_loc_, s_loc_, h_, j0_, j_end_, ty_):
        """s_loc_[h_ * RPT + r] <- q . k of head h_ and row j0_ + r * ROWS + ty_ (base 2, summed
        over the lanes); the lowest float for rows from j_end_ on."""
        if dims.gpu:
            for r in L.unroll(RPT):
                s_loc_[h_ * RPT + r] = T.float32(0)
                for e in L.unroll(EPL):
                    s_loc_[h_ * RPT + r] = s_loc_[h_ * RPT + r] + q_loc_[h_ * EPL + e] * T.Cast("float32", k_loc_[r * EPL + e])
                lane_allreduce(s_loc_, h_ * RPT + r)
                if j0_ + r * ROWS + ty_ >= j_end_:
                    s_loc_[h_ * RPT + r] = T.min_value("float32")
        else:
            part = T.alloc_buffer((RPT * VL,), "float32", scope=L.local)
            for r in T.serial(RPT):
                for v in T.vectorized(VL):
                    part[r * VL + v] = T.float32(0)
                for c in T.serial(EPL // VL):
                    for v in T.vectorized(VL):
                        part[r * VL + v] = part[r * VL + v] + q_loc_[h_ * EPL + c * VL + v] * T.Cast(
                            "float32", k_loc_[r * EPL + c * VL + v])
                if VL >= 16:
                    halve(part, r * VL, 8)
                if VL >= 8:
                    halve(part, r * VL, 4)
                if VL >= 4:
                    halve(part, r * VL, 2)
                if VL >= 2:
                    halve(part, r * VL, 1)
                s_loc_[h_ * RPT + r] = T.if_then_else(j0_ + r * ROWS + ty_ >= j_end_, T.min_value("float32"),
                                                      part[r * VL])

    @T.macro
    def accumulate(s_loc_, v_loc_, m_loc_, d_loc_, o_loc_, h_):
        """Online-softmax step of head h_ over the step's RPT rows: move the state to the new
        max (softmax.update), then add p = exp2(s - m) to d and p * v to o."""
        m_new = T.alloc_buffer((1,), "float32", scope=L.local)
        m_new[0] = m_loc_[h_]
        for r in L.unroll(RPT):
            m_new[0] = T.max(m_new[0], s_loc_[h_ * RPT + r])
        sm.update(m_loc_, d_loc_, o_loc_, h_, EPL, m_new[0])
        if not dims.gpu:  # the step's probabilities as vectors (prob's arithmetic, exp2_vector)
            for r in T.vectorized(RPT):
                s_loc_[h_ * RPT + r] = exp2_vector(s_loc_[h_ * RPT + r] - m_loc_[h_])
        for r in L.unroll(RPT):
            if dims.gpu:
                s_loc_[h_ * RPT + r] = prob(s_loc_[h_ * RPT + r], m_loc_[h_])
            d_loc_[h_] = d_loc_[h_] + s_loc_[h_ * RPT + r]
            for e in elementwise(EPL):
                o_loc_[h_ * EPL + e] = o_loc_[h_ * EPL + e] + s_loc_[h_ * RPT + r] * T.Cast("float32", v_loc_[r * EPL + e])

    @T.macro
    def attend(q_, pages_, indptr_, indices_, length_info_, k_pos_, q_pos_, rotate_, rope_scale_,
               rope_theta_, sm_scale_, b_, hc_, kv_len, split_, nsplit_, ty_, tx_, row_m_, row_d_, row_o_):
        """Online softmax of split `split_` (of nsplit_) of request b_'s kv_len keys for head chunk hc_: row group ty_
        leaves its max, denominator and unnormalised output in row_m_/row_d_ [ROWS * HB] and
        row_o_ [ROWS * HB * D] (f32). rotate_ (a Python bool) applies RoPE to q and k."""
        hkv = hc_ // CHUNKS
        h0 = hkv * G + (hc_ % CHUNKS) * HB
        q_loc = T.alloc_buffer((HB * EPL,), "float32", scope=L.local)
        o_loc = T.alloc_buffer((HB * EPL,), "float32", scope=L.local)
        m_loc = T.alloc_buffer((HB,), "float32", scope=L.local)
        d_loc = T.alloc_buffer((HB,), "float32", scope=L.local)
        s_loc = T.alloc_buffer((HB * RPT,), "float32", scope=L.local)
        k_loc = T.alloc_buffer((RPT * EPL,), dims.dtype, scope=L.local)
        v_loc = T.alloc_buffer((RPT * EPL,), dims.dtype, scope=L.local)
        page_begin = indptr_[b_]
        split_len = ceildiv(kv_len, nsplit_)
        j_begin = T.min(split_ * split_len, kv_len)
        j_end = T.min(j_begin + split_len, kv_len)
        sm.init(m_loc, d_loc, o_loc, HB, EPL)
        load_q(q_, b_, h0, tx_, q_pos_, rotate_, rope_scale_, rope_theta_, sm_scale_, q_loc)
        for step in T.serial(ceildiv(j_end - j_begin, TILE)):
            if not dims.gpu:
                prefetch_kv(pages_, indices_, length_info_, page_begin, b_, hkv,
                            j_begin + (step + CPU_PREFETCH_STEPS) * TILE, j_end, ty_)
            load_kv(pages_, indices_, length_info_, k_pos_, page_begin, b_, hkv, j_begin + step * TILE, j_end,
                    ty_, tx_, rotate_, rope_scale_, rope_theta_, k_loc, v_loc)
            for h in L.unroll(HB):
                scores(q_loc, k_loc, s_loc, h, j_begin + step * TILE, j_end, ty_)
                accumulate(s_loc, v_loc, m_loc, d_loc, o_loc, h)
        for h in L.unroll(HB):
            if tx_ == 0:
                row_m_[ty_ * HB + h] = m_loc[h]
                row_d_[ty_ * HB + h] = d_loc[h]
            for e in L.unroll(EPL):
                row_o_[(ty_ * HB + h) * D + tx_ * EPL + e] = o_loc[h * EPL + e]

    return attend


def _attend_cpu_macro(dims: _Dims, L):
    """attend_cpu: `attend` on the CPU for a block's whole GQA group, by row tiles (dims.CPU_TILES;
    no inline RoPE). A step reads CPU_LANES = V rows in place from their pages (no copy) and, per
    head: the V rows' q . k as V-lane partial sums, reduced to one vector of V scores (lane r:
    row r) by a tree of shuffles (15 shuffle pairs for V rows, against a horizontal sum a row);
    the online softmax on that vector (one max and one exp2_vector for V rows); then o += p v
    with each V-lane slice of o a register accumulating the V rows. Rows past the end read the
    last visible row and get the lowest score (probability 0). The next step's rows are
    prefetched into L2 one by one beside the q . k of the current rows: K rows with the first
    head's, V rows with the last head's (spread over the step: one prefetch burst at the step's
    start would miss in the caches and hold up the step's own loads; docs/performance.md)."""
    D, G, HB, CHUNKS, ps, sliding = dims.D, dims.G, dims.HB, dims.CHUNKS, dims.ps, dims.sliding
    V = CPU_LANES
    fv = f"float32x{V}"
    sm = softmax_macros(L)
    load_q, _, _, prefetch_row = _load_macros(dims, L)
    low16, high16 = _halving_shuffles(16)
    low8, high8 = _halving_shuffles(8)
    low4, high4 = _halving_shuffles(4)
    low2, high2 = _halving_shuffles(2)
    rotate8, rotate4, rotate2, rotate1 = ([(i + n) % V for i in range(V)] for n in (8, 4, 2, 1))

    def lanes(buf, at):
        """buf[at : at + V] as a vector."""
        return buf[T.ramp(at, 1, V)]

    def kv_row(pages_, kv, page, slot, hkv, c):
        """Lanes c * V.. of the K (kv = 0) or V (kv = 1) row at (page, slot), as float32
        (FP8 pages: dequantized in registers)."""
        return read_kv(dims.config, pages_, kv, hkv, page, slot, T.ramp(c * V, 1, V), out_dtype="float32", lanes=V)

    def pair(buf, a, b, low, high):
        return T.Shuffle([lanes(buf, a), lanes(buf, b)], low) + T.Shuffle([lanes(buf, a), lanes(buf, b)], high)

    def dot_partials(q_loc, h, pages_, page, slot, hkv):
        """The V-lane partial sums of q(head h) . K(page, slot): sum over the row's D / V slices."""
        total = None
        for c in range(D // V):
            term = lanes(q_loc, h * D + c * V) * kv_row(pages_, 0, page, slot, hkv, c)
            total = term if total is None else total + term
        return total

    def weighted_rows(o_loc, p_loc, h, c, pages_, page_loc, slot_loc, hkv):
        """o(head h)[c * V : (c + 1) * V] + sum over the step's rows r of p[h, r] * V_r (in row order)."""
        total = lanes(o_loc, h * D + c * V)
        for r in range(V):
            total = total + T.broadcast(p_loc[h * V + r], V) * kv_row(pages_, 1, page_loc[r], slot_loc[r], hkv, c)
        return total

    @T.macro
    def reduce_rows(part_):
        """part_[0 : V] <- lane r: the sum of the V lanes of part_[r * V : (r + 1) * V]
        (a tree: the rows' widths halve at each of its 4 levels, in place)."""
        for i in T.unroll(8):
            part_[T.ramp(i * V, 1, V)] = pair(part_, 2 * i * V, (2 * i + 1) * V, low16, high16)
        for i in T.unroll(4):
            part_[T.ramp(i * V, 1, V)] = pair(part_, 2 * i * V, (2 * i + 1) * V, low8, high8)
        for i in T.unroll(2):
            part_[T.ramp(i * V, 1, V)] = pair(part_, 2 * i * V, (2 * i + 1) * V, low4, high4)
        part_[T.ramp(0, 1, V)] = pair(part_, 0, V, low2, high2)

    @T.macro
    def fold(buf_, op):
        """buf_[0] <- op over buf_[0 : V]: op with the vector's lanes rotated by 8, 4, 2, 1
        (whole-vector accesses of one small buffer, which LLVM keeps in a register)."""
        buf_[T.ramp(0, 1, V)] = op(lanes(buf_, 0), T.Shuffle([lanes(buf_, 0)], rotate8))
        buf_[T.ramp(0, 1, V)] = op(lanes(buf_, 0), T.Shuffle([lanes(buf_, 0)], rotate4))
        buf_[T.ramp(0, 1, V)] = op(lanes(buf_, 0), T.Shuffle([lanes(buf_, 0)], rotate2))
        buf_[T.ramp(0, 1, V)] = op(lanes(buf_, 0), T.Shuffle([lanes(buf_, 0)], rotate1))

    @T.macro
    def attend_cpu(q_, pages_, indptr_, indices_, length_info_, q_pos_, rope_scale_, rope_theta_, sm_scale_, b_,
                   hc_, kv_len, split_, nsplit_, row_m_, row_d_, row_o_):
        """`attend` (one row group) for dims.CPU_TILES, without RoPE."""
        hkv = hc_ // CHUNKS
        h0 = hkv * G + (hc_ % CHUNKS) * HB
        q_loc = T.alloc_buffer((HB * D,), "float32", scope=L.local)
        o_loc = T.alloc_buffer((HB * D,), "float32", scope=L.local)
        m_loc = T.alloc_buffer((HB,), "float32", scope=L.local)
        d_loc = T.alloc_buffer((HB,), "float32", scope=L.local)
        p_loc = T.alloc_buffer((HB * V,), "float32", scope=L.local)  # the step's probabilities
        part = T.alloc_buffer((V * V,), "float32", scope=L.local)  # one head's row partial sums
        red = T.alloc_buffer((V,), "float32", scope=L.local)
        alpha = T.alloc_buffer((1,), "float32", scope=L.local)
        page_loc = T.alloc_buffer((V,), "int32", scope=L.local)
        slot_loc = T.alloc_buffer((V,), "int32", scope=L.local)
        page_begin = indptr_[b_]
        split_len = ceildiv(kv_len, nsplit_)
        j_begin = T.min(split_ * split_len, kv_len)
        j_end = T.min(j_begin + split_len, kv_len)
        sm.init(m_loc, d_loc, o_loc, HB, D)
        load_q(q_, b_, h0, 0, q_pos_, False, rope_scale_, rope_theta_, sm_scale_, q_loc)
        for step in T.serial(ceildiv(j_end - j_begin, V)):
            for r in T.unroll(V):
                j = T.meta_var(T.min(j_begin + step * V + r, j_end - 1))
                pos = paged_position(j, length_info_, b_, sliding) if sliding else T.meta_var(j)
                page_loc[r] = indices_[page_begin + pos // ps]
                slot_loc[r] = pos % ps
            for h in T.serial(HB):
                for r in T.unroll(V):
                    part[T.ramp(r * V, 1, V)] = dot_partials(q_loc, h, pages_, page_loc[r], slot_loc[r], hkv)
                    if h == 0:
                        prefetch_row(pages_, indices_, length_info_, page_begin, b_, hkv,
                                     j_begin + (step + CPU_PREFETCH_STEPS) * V + r, j_end, 0)
                    if h == HB - 1:
                        prefetch_row(pages_, indices_, length_info_, page_begin, b_, hkv,
                                     j_begin + (step + CPU_PREFETCH_STEPS) * V + r, j_end, 1)
                reduce_rows(part)
                # base-2 scores; rows from j_end on: the lowest float
                part[T.ramp(0, 1, V)] = T.Select(
                    T.ramp(j_begin + step * V, 1, V) >= T.broadcast(j_end, V),
                    T.broadcast(T.min_value("float32"), V), lanes(part, 0))
                red[T.ramp(0, 1, V)] = lanes(part, 0)
                fold(red, T.max)
                # softmax.update with exp2_vector's arithmetic: alpha = exp2(m - m_new)
                alpha[0] = exp2_vector(m_loc[h] - T.max(m_loc[h], red[0]))
                m_loc[h] = T.max(m_loc[h], red[0])
                for r in T.vectorized(V):
                    p_loc[h * V + r] = exp2_vector(part[r] - m_loc[h])
                red[T.ramp(0, 1, V)] = lanes(p_loc, h * V)
                fold(red, lambda a, b: a + b)
                d_loc[h] = d_loc[h] * alpha[0] + red[0]
                for e in T.vectorized(D):
                    o_loc[h * D + e] = o_loc[h * D + e] * alpha[0]
            for h in T.serial(HB):
                for c in T.unroll(D // V):
                    o_loc[T.ramp(h * D + c * V, 1, V)] = weighted_rows(o_loc, p_loc, h, c, pages_, page_loc, slot_loc,
                                                                       hkv)
        for h in T.serial(HB):
            row_m_[h] = m_loc[h]
            row_d_[h] = d_loc[h]
            for e in T.vectorized(D):
                row_o_[h * D + e] = o_loc[h * D + e]

    return attend_cpu


def _merge_macros(dims: _Dims, L):
    """combine_rows (the row groups of a block), merge_splits(indptr_, length_info_, o_part_,
    lse_part_, O_, lse_) (the splits of each request that took more than one) and, on CUDA,
    fused_merge (the same merge by the last split block of a request and head chunk)."""
    dtype, D, Hq = dims.dtype, dims.D, dims.Hq
    LANES, ROWS, HB, NTHREADS = dims.LANES, dims.ROWS, dims.HB, dims.NTHREADS
    sm = softmax_macros(L)

    @T.macro
    def combine_rows(row_m_, row_d_, row_o_, ty_, tx_, write_o, write_lse):
        """Merge the ROWS row-group states of each served head and finish them;
        write_o(h, e, value) and write_lse(h, value) store (o = 0, EMPTY_LSE for no key)."""
        m_all = T.alloc_buffer((1,), "float32", scope=L.local)
        d_all = T.alloc_buffer((1,), "float32", scope=L.local)
        acc = T.alloc_buffer((1,), "float32", scope=L.local)
        if not dims.gpu and ROWS == 1:
            # CPU, one row group: its state is the block's (combining one state is exp2(0) = 1
            # times it); finish each head once, its row as a vector
            for h in T.serial(HB):
                d_all[0] = finalize_scale(row_d_[h])
                for e in T.vectorized(D):
                    write_o(h, e, row_o_[h * D + e] * d_all[0])
                write_lse(h, finalize_lse(row_m_[h], row_d_[h]))
        else:
            for step in T.serial(ceildiv(HB * D, NTHREADS)):
                if step * NTHREADS + ty_ * LANES + tx_ < HB * D:
                    h = (step * NTHREADS + ty_ * LANES + tx_) // D
                    e = (step * NTHREADS + ty_ * LANES + tx_) % D
                    sm.combine(ROWS, lambda y: row_m_[y * HB + h], lambda y: row_d_[y * HB + h],
                               lambda y: row_o_[(y * HB + h) * D + e], m_all, d_all, acc)
                    sm.finalize(m_all, d_all, acc, 0, 1)
                    write_o(h, e, acc[0])
                    if e == 0:
                        write_lse(h, m_all[0])

    @T.macro
    def merge_splits_gpu(indptr_, length_info_, o_part_, lse_part_, O_, lse_):
        """O_ [B, Hq, D], lse_ [B, Hq] <- the FP32 merge of the split states of each (request,
        head) whose request took more than one split (`request_splits`), o_part_ [slots * B * Hq
        * D], lse_part_ [slots * B * Hq]: one block per (request, head), a thread per column;
        split s's finished state (o, lse) is the state (m = lse, l = finished_l(lse), o * l)."""
        batch = O_.shape[0]
        for b in L.block(batch, "x", outer=True):
            for h in L.block(Hq, "y"):
                for e in L.thread(D, "x"):
                    m_all = T.alloc_buffer((1,), "float32", scope=L.local)
                    d_all = T.alloc_buffer((1,), "float32", scope=L.local)
                    acc = T.alloc_buffer((1,), "float32", scope=L.local)
                    nsplit = dims.request_splits(batch, dims.kv_len(indptr_, length_info_, b))
                    if nsplit > 1:
                        sm.combine(nsplit,
                                   lambda s: lse_part_[(s * batch + b) * Hq + h],
                                   lambda s: finished_l(lse_part_[(s * batch + b) * Hq + h]),
                                   lambda s: o_part_[((s * batch + b) * Hq + h) * D + e]
                                   * finished_l(lse_part_[(s * batch + b) * Hq + h]),
                                   m_all, d_all, acc)
                        sm.finalize(m_all, d_all, acc, 0, 1)
                        O_[b, h, e] = T.Cast(dtype, acc[0])
                        if e == 0:
                            lse_[b, h] = m_all[0]

    @T.macro
    def merge_row_cpu(indptr_, length_info_, o_part_, lse_part_, O_, lse_, batch, bh):
        """CPU: the merge of row bh = request * Hq + head (softmax.combine's arithmetic: weight
        finished_l(lse) * exp2(lse - max), computed once per split; the rows as vectors)."""
        m_all = T.alloc_buffer((1,), "float32", scope=L.local)
        d_all = T.alloc_buffer((1,), "float32", scope=L.local)
        w = T.alloc_buffer((1,), "float32", scope=L.local)
        o_acc = T.alloc_buffer((D,), "float32", scope=L.local)
        nsplit = dims.request_splits(batch, dims.kv_len(indptr_, length_info_, bh // Hq))
        m_all[0] = T.float32(EMPTY_LSE)
        if nsplit > 1:
            for s in T.serial(nsplit):
                m_all[0] = T.max(m_all[0], lse_part_[s * batch * Hq + bh])
            d_all[0] = T.float32(0)
            for e in T.vectorized(D):
                o_acc[e] = T.float32(0)
            for s in T.serial(nsplit):
                w[0] = finished_l(lse_part_[s * batch * Hq + bh]) * rescale_factor(lse_part_[s * batch * Hq + bh],
                                                                                  m_all[0])
                d_all[0] = d_all[0] + w[0]
                for e in T.vectorized(D):
                    o_acc[e] = o_acc[e] + o_part_[(s * batch * Hq + bh) * D + e] * w[0]
            w[0] = finalize_scale(d_all[0])
            for e in T.vectorized(D):
                O_[bh // Hq, bh % Hq, e] = T.Cast(dtype, o_acc[e] * w[0])
            lse_[bh // Hq, bh % Hq] = finalize_lse(m_all[0], d_all[0])

    @T.macro
    def merge_splits_cpu(indptr_, length_info_, o_part_, lse_part_, O_, lse_):
        """CPU: merge_splits, a row (request, head) per iteration; a parallel loop only from
        CPU_PARALLEL_MERGE_ROWS rows on (a parallel region costs a fork / join of the thread
        pool, more than a few rows' merge)."""
        batch = O_.shape[0]
        if batch * Hq >= CPU_PARALLEL_MERGE_ROWS:
            for bh in T.parallel(batch * Hq):
                merge_row_cpu(indptr_, length_info_, o_part_, lse_part_, O_, lse_, batch, bh)
        else:
            for bh in T.serial(batch * Hq):
                merge_row_cpu(indptr_, length_info_, o_part_, lse_part_, O_, lse_, batch, bh)

    # Arrival counters of the fused merge, a slot per (request, head chunk): a launch splits only
    # where batch * heads < TARGET_BLOCKS (`num_splits`), so slot b * heads + hc stays below it.
    ARRIVE, ARRIVE_SRC = arrival_counter(max(dims.TARGET_BLOCKS, 1), "_simt")

    @T.macro
    def fused_merge(o_part_, lse_part_, O_, lse_, batch, b, hc, nsplit, ty_, tx_):
        """After this block's split partial is written: the last of the request's nsplit split
        blocks of head chunk hc to arrive merges their partials into O_ / lse_ (merge_splits_gpu's
        arithmetic, FUSED_MERGE_UNROLL splits at a time; the partials read through L2, where the
        other blocks wrote them)."""
        flag = T.alloc_buffer((1,), "int32", scope="shared")
        last = T.alloc_buffer((1,), "int32", scope=L.local)
        m_all = T.alloc_buffer((1,), "float32", scope=L.local)
        d_all = T.alloc_buffer((1,), "float32", scope=L.local)
        acc = T.alloc_buffer((1,), "float32", scope=L.local)
        m_new = T.alloc_buffer((1,), "float32", scope=L.local)
        weight = T.alloc_buffer((1,), "float32", scope=L.local)
        lse_v = T.alloc_buffer((FUSED_MERGE_UNROLL,), "float32", scope=L.local)
        o_v = T.alloc_buffer((FUSED_MERGE_UNROLL,), "float32", scope=L.local)
        T.tvm_storage_sync("shared")  # every thread's share of the partial is written
        if ty_ * LANES + tx_ == 0:
            flag[0] = T.cuda.func_call(ARRIVE, b * (dims.Hkv * dims.CHUNKS) + hc, nsplit, source_code=ARRIVE_SRC,
                                       return_type="int32")
        T.tvm_storage_sync("shared")
        last[0] = flag[0]
        T.tvm_storage_sync("shared")  # (so that TVM needs no barrier inside the branch)
        if last[0] == 1:
            for step in T.serial(ceildiv(HB * D, NTHREADS)):
                if step * NTHREADS + ty_ * LANES + tx_ < HB * D:
                    h = dims.head(hc, (step * NTHREADS + ty_ * LANES + tx_) // D)
                    e = (step * NTHREADS + ty_ * LANES + tx_) % D
                    m_all[0] = T.float32(EMPTY_LSE)
                    d_all[0] = T.float32(0)
                    acc[0] = T.float32(0)
                    for chunk in T.serial(ceildiv(nsplit, FUSED_MERGE_UNROLL)):
                        # one round of independent loads per chunk of splits (a loop of dependent
                        # ones would wait an L2 round trip per split)
                        for u in T.unroll(FUSED_MERGE_UNROLL):
                            lse_v[u] = T.float32(EMPTY_LSE)
                            o_v[u] = T.float32(0)
                            if chunk * FUSED_MERGE_UNROLL + u < nsplit:
                                lse_v[u] = T.cuda.func_call(
                                    LDCG, T.address_of(
                                        lse_part_[((chunk * FUSED_MERGE_UNROLL + u) * batch + b) * Hq + h]),
                                    source_code=LDCG_SRC, return_type="float32")
                                o_v[u] = T.cuda.func_call(
                                    LDCG, T.address_of(
                                        o_part_[(((chunk * FUSED_MERGE_UNROLL + u) * batch + b) * Hq + h) * D + e]),
                                    source_code=LDCG_SRC, return_type="float32")
                        m_new[0] = m_all[0]
                        for u in T.unroll(FUSED_MERGE_UNROLL):
                            m_new[0] = T.max(m_new[0], lse_v[u])
                        # softmax.combine's arithmetic, a chunk at a time (the running state
                        # rescaled to the chunk's max)
                        d_all[0] = d_all[0] * rescale_factor(m_all[0], m_new[0])
                        acc[0] = acc[0] * rescale_factor(m_all[0], m_new[0])
                        m_all[0] = m_new[0]
                        for u in T.unroll(FUSED_MERGE_UNROLL):
                            weight[0] = finished_l(lse_v[u]) * rescale_factor(lse_v[u], m_all[0])
                            d_all[0] = d_all[0] + weight[0]
                            acc[0] = acc[0] + o_v[u] * weight[0]
                    sm.finalize(m_all, d_all, acc, 0, 1)
                    O_[b, h, e] = T.Cast(dtype, acc[0])
                    if e == 0:
                        lse_[b, h] = m_all[0]

    if dims.gpu:
        return combine_rows, merge_splits_gpu, fused_merge
    return combine_rows, merge_splits_cpu, None


def _split_kernel_macro(dims: _Dims, L):
    """split_kernel: one block per (request, head chunk, split), attend then combine_rows."""
    dtype, D, Hq, Hkv, shared = dims.dtype, dims.D, dims.Hq, dims.Hkv, dims.shared
    LANES, ROWS, HB = dims.LANES, dims.ROWS, dims.HB
    attend = _attend_macro(dims, L)
    attend_cpu = _attend_cpu_macro(dims, L)
    combine_rows, _, fused_merge = _merge_macros(dims, L)

    @T.macro
    def block(q_, pages_, indptr_, indices_, length_info_, k_pos_, q_pos_, o_, lse_, o_part_, lse_part_,
              rotate_, rope_scale_, rope_theta_, sm_scale_, batch, b, hc, split):
        """One block: request b, head chunk hc, split `split`."""
        for ty in L.thread(ROWS, "y"):
            for tx in L.thread(LANES, "x"):
                row_m = T.alloc_buffer((ROWS * HB,), "float32", scope=shared)
                row_d = T.alloc_buffer((ROWS * HB,), "float32", scope=shared)
                row_o = T.alloc_buffer((ROWS * HB * D,), "float32", scope=shared)
                kv_len = dims.kv_len(indptr_, length_info_, b)
                nsplit = dims.request_splits(batch, kv_len)
                if split < nsplit:  # (uniform over the block: its syncs stay whole)
                    if dims.CPU_TILES and not rotate_:
                        attend_cpu(q_, pages_, indptr_, indices_, length_info_, q_pos_, rope_scale_, rope_theta_,
                                   sm_scale_, b, hc, kv_len, split, nsplit, row_m, row_d, row_o)
                    else:
                        attend(q_, pages_, indptr_, indices_, length_info_, k_pos_, q_pos_,
                               rotate_, rope_scale_, rope_theta_, sm_scale_,
                               b, hc, kv_len, split, nsplit, ty, tx, row_m, row_d, row_o)
                    if dims.gpu:
                        T.tvm_storage_sync("shared")
                    if nsplit == 1:
                        combine_rows(row_m, row_d, row_o, ty, tx,
                                     lambda h, e, val: T.buffer_store(o_, T.Cast(dtype, val), [b, dims.head(hc, h), e]),
                                     lambda h, val: T.buffer_store(lse_, val, [b, dims.head(hc, h)]))
                    else:
                        combine_rows(row_m, row_d, row_o, ty, tx,
                                     lambda h, e, val: T.buffer_store(
                                         o_part_, val, [((split * batch + b) * Hq + dims.head(hc, h)) * D + e]),
                                     lambda h, val: T.buffer_store(
                                         lse_part_, val, [(split * batch + b) * Hq + dims.head(hc, h)]))
                        if dims.FUSED:
                            fused_merge(o_part_, lse_part_, o_, lse_, batch, b, hc, nsplit, ty, tx)

    @T.macro
    def split_kernel(q_, pages_, indptr_, indices_, length_info_, k_pos_, q_pos_, o_, lse_, o_part_, lse_part_,
                     rotate_, rope_scale_, rope_theta_, sm_scale_):
        """The attention kernel: a request of one split writes o_ / lse_, others the split partials."""
        batch = q_.shape[0]
        if dims.gpu:
            for b in L.block(batch, "x", outer=True):
                for hc in L.block(Hkv * dims.CHUNKS, "y"):
                    for split in L.block(dims.num_splits(batch), "z"):
                        block(q_, pages_, indptr_, indices_, length_info_, k_pos_, q_pos_, o_, lse_, o_part_,
                              lse_part_, rotate_, rope_scale_, rope_theta_, sm_scale_, batch, b, hc, split)
        else:
            # CPU: every (request, head chunk, split) block is a task of one parallel loop
            for task in T.parallel(batch * Hkv * dims.CHUNKS * dims.num_splits(batch)):
                block(q_, pages_, indptr_, indices_, length_info_, k_pos_, q_pos_, o_, lse_, o_part_, lse_part_,
                      rotate_, rope_scale_, rope_theta_, sm_scale_, batch,
                      task // (Hkv * dims.CHUNKS * dims.num_splits(batch)),
                      task // dims.num_splits(batch) % (Hkv * dims.CHUNKS), task % dims.num_splits(batch))

    return split_kernel


def paged_decode_simt(config: AttentionConfig, schedule: DecodeSchedule | None = None):
    """The CUDA-core (and CPU) paged decode PrimFunc of `schedule` (default:
    `schedules.choose_decode_schedule`); the contract's parameters (`decode.paged_decode`)."""
    check_config(config)
    sched = schedule or choose_decode_schedule(config)
    sched.check(config)
    dims = _Dims.of(config, sched)
    L = loop_kinds(config)
    split_kernel = _split_kernel_macro(dims, L)
    _, merge_splits, _ = _merge_macros(dims, L)
    Hq, D = dims.Hq, dims.D

    @T.macro
    def kernel(Q_, pages_, page_indptr_, page_indices_, length_info_, k_rope_pos_offset_, q_rope_position_, O_,
               lse_, rotary_mode_, rope_scale_, rope_theta_, sm_scale_):
        batch = Q_.shape[0]
        # Split partials: FP32 output and LSE per split (workspace; unused when one split).
        o_part = T.alloc_buffer((dims.num_splits(batch) * batch * Hq * D,), "float32")
        lse_part = T.alloc_buffer((dims.num_splits(batch) * batch * Hq,), "float32")
        if rotary_mode_ == 1:
            split_kernel(Q_, pages_, page_indptr_, page_indices_, length_info_, k_rope_pos_offset_, q_rope_position_,
                         O_, lse_, o_part, lse_part, True, rope_scale_, rope_theta_, sm_scale_)
        else:
            split_kernel(Q_, pages_, page_indptr_, page_indices_, length_info_, k_rope_pos_offset_, q_rope_position_,
                         O_, lse_, o_part, lse_part, False, rope_scale_, rope_theta_, sm_scale_)
        if dims.num_splits(batch) > 1 and not dims.FUSED:
            merge_splits(page_indptr_, length_info_, o_part, lse_part, O_, lse_)  # in FP32, per (request, head)

    return decode_func(config, kernel)
