"""Prefill attention on Hopper tensor cores (sm_90a): paged and ragged K/V, fp16 and bf16.

Same contract, grid and work split as the CUDA-core kernels in `prefill_simt.py` (a CTA owns one
KV head and a tile of 128 packed query rows of one request, packed row p = query p // G,
head kv_head * G + p % G; tiles of a request are numbered from the last, so the longest
causal rows start first), on a different machine model:

  warpgroup 0, the producer: gathers the K and V rows of each step through the page table
    (or the ragged index) with 16-byte `cp.async` copies into a ring of `stages` shared
    buffers in the 128B-swizzled layout wgmma reads (rows past the visible end are zero
    filled, so junk in unowned page slots never reaches the math), and signals each buffer
    full on an mbarrier; it waits on a second mbarrier until both consumers emptied it.
  warpgroups 1 and 2, the consumers: 64 query rows each. Q is copied once (cp.async). Per
    step: S = Q K^T by `wgmma` (both operands in shared memory), the causal / end mask on
    the steps that cross it (with a token tree, masks.TreeMask: also the tree's test on the
    steps past the request's history, the row's node's DFS begin read once before the loop
    and each key's interval once per masked step), online softmax in base 2 in registers, P packed to 16-bit
    registers in the layout of wgmma's A operand, O += P V by `wgmma` (V read MN-major).
    The epilogue writes o = O / l and lse = m + log2(l) (EMPTY_LSE and o = 0 for a row that
    saw no key).

Inline RoPE (rotary_mode == 1, chosen at run time) rotates Q as the consumers store it and K
as the producer does (plain loads and shared-memory stores instead of cp.async): correct, and
slower than the default mode where keys are cached rotated.
"""

from __future__ import annotations

from typing import NamedTuple

import tvm
from tvm import tirx
from tvm.script import tirx as T

from .build import TIRX_ATTR
from .common import EMPTY_LSE, LOG2E, ceildiv, kv_chunk_len, paged_position, rope_value
from .config import AttentionConfig
from .hopper import (
    CHUNK,
    PANEL,
    ring_barriers,
    ring_producer,
    row_softmax,
    swizzled,
    wgmma_accumulate,
    wgmma_name,
    wgmma_scores,
)
from .masks import is_tree, mask_of_request
from .prefill_contract import (
    paged_prefill_func,
    ragged_prefill_func,
    tree_paged_prefill_func,
    tree_ragged_prefill_func,
)
from .schedules import WgmmaPrefillSchedule, choose_wgmma_prefill_schedule
from .softmax import finalize_lse, finalize_scale
from .support import TENSOR_CORE_DTYPES, WGMMA_ARCHS

WARPGROUP = 128
CONSUMERS = 2
ROWS_PER_CONSUMER = 64  # rows of one wgmma m64 tile
TURN_BARRIER = 3  # named barriers 3 and 4: the consumers' turns (1 and 2 guard their Q tiles)
MASKED = -1.0e30  # score of a masked key (finite: exp2 of it minus any running max is 0)


def wgmma_problem(config: AttentionConfig) -> str | None:
    """Why the tensor-core prefill cannot serve `config`, or None when it can."""
    if not config.is_gpu or config.cuda_arch not in WGMMA_ARCHS:
        return f"target {config.target!r} is not a Hopper GPU (sm_90)"
    if config.dtype not in TENSOR_CORE_DTYPES:
        return f"dtype={config.dtype!r} (tensor cores serve {' and '.join(TENSOR_CORE_DTYPES)})"
    for field in ("head_dim", "v_head_dim"):
        value = getattr(config, field)
        if value % PANEL or value > 256:
            return f"{field}={value} (tensor cores serve multiples of {PANEL} up to 256)"
    return None


class _Layout:
    """Compile-time sizes of one wgmma prefill kernel (its config and schedule), the regions of
    its shared buffer, and the grid's and masks' index arithmetic. Every name __init__ binds is
    an attribute; the macro factories below unpack the ones their macros read."""

    def __init__(self, config: AttentionConfig, sched: WgmmaPrefillSchedule):
        dtype, G, scaling = config.dtype, config.group_size, config.rope_scaling
        D_QK, D_V = config.head_dim, config.v_head_dim
        BM, BN, ST = sched.tile_q, sched.tile_kv, sched.stages
        Q_ELEMS, K_ELEMS, V_ELEMS = BM * D_QK, BN * D_QK, BN * D_V
        K_OFF = Q_ELEMS
        V_OFF = K_OFF + ST * K_ELEMS
        SMEM_ELEMS = V_OFF + ST * V_ELEMS
        WG_S = wgmma_name(f"m64n{BN}k16", dtype)  # S = Q K^T, both operands K-major in shared memory
        WG_O = wgmma_name(f"m64n{D_V}k16", dtype)  # O += P V, P from registers, V MN-major
        NS, NO, NP = BN // 2, D_V // 2, BN // 4  # registers per thread: S, O (fp32) and P (16-bit pairs)
        PINGPONG = sched.pingpong
        vars(self).update((name, value) for name, value in locals().items() if name != "self")

    def row_tiles(self, qo_indptr, b):
        return ceildiv((qo_indptr[b + 1] - qo_indptr[b]) * self.G, self.BM)

    def num_slots(self, total_q, batch):
        """Upper bound of the number of row tiles over all requests."""
        return ceildiv(total_q * self.G, self.BM) + batch

    def visible_end(self, kv_len, qo_len, p, causal):
        """Number of leading keys packed row p may see (all of them when not causal). `causal`
        is the causal flag or a token tree's `masks.TreeMask` (within the causal bound)."""
        last = kv_len - qo_len + T.min(p // self.G, qo_len - 1) + 1
        if is_tree(causal):
            return T.max(T.min(last, kv_len), 0)
        return T.if_then_else(causal != 0, T.max(T.min(last, kv_len), 0), kv_len)

    def unmasked_end(self, kv_len, qo_len, p0, causal):
        """Keys every row of the tile from packed row p0 on sees: no mask is needed below (a
        token tree's history at most)."""
        if is_tree(causal):
            return T.min(self.visible_end(kv_len, qo_len, p0, causal), causal.history(kv_len))
        return self.visible_end(kv_len, qo_len, p0, causal)


def _producer_macros(lay: _Layout):
    """The producer warpgroup: copy_rows and rope_rows (rows -> a swizzled tile, the latter
    rotated), and produce (the ring of K/V steps)."""
    BN, D_QK, D_V, K_ELEMS, K_OFF, ST = lay.BN, lay.D_QK, lay.D_V, lay.K_ELEMS, lay.K_OFF, lay.ST
    V_ELEMS, V_OFF, dtype, scaling = lay.V_ELEMS, lay.V_OFF, lay.dtype, lay.scaling
    produce_steps = ring_producer(ST)

    @T.macro
    def copy_rows(smem_, base_, rows_, tile_rows_, width_, tid_, src_, valid_):
        """cp.async rows 0..rows_ of width_ elements into the swizzled tile of tile_rows_ rows at
        smem_[base_] (WARPGROUP threads, 16 bytes each per step; consecutive threads copy
        consecutive chunks of a row). src_(r, c): address of element c of row r; valid_(r)
        False: zeros."""
        for it in T.unroll(ceildiv(rows_ * (width_ // CHUNK), WARPGROUP)):
            idx = T.meta_var(it * WARPGROUP + tid_)
            r = T.meta_var(idx // (width_ // CHUNK))
            c = T.meta_var(idx % (width_ // CHUNK) * CHUNK)
            if rows_ * (width_ // CHUNK) % WARPGROUP == 0 or idx < rows_ * (width_ // CHUNK):
                T.ptx["cp.async.cg.shared.global"](
                    smem_.ptr_to([base_ + swizzled(tile_rows_, r, c)]), src_(r, c), 16,
                    T.Cast("uint32", T.if_then_else(valid_(r), 16, 0)))

    @T.macro
    def rope_rows(smem_, base_, rows_, tile_rows_, tid_, at_, pos_, valid_, rope_):
        """Inline RoPE (rotary_mode 1): rows 0..rows_ of D_QK elements, rotated at position
        pos_(r), stored (st.shared) into the swizzled tile of tile_rows_ rows at smem_[base_];
        zeros where valid_(r) is False. at_(r, d): element d of row r (r clamped by the caller)."""
        for it in T.serial(ceildiv(rows_ * (D_QK // CHUNK), WARPGROUP)):
            idx = T.meta_var(it * WARPGROUP + tid_)
            r = T.meta_var(idx // (D_QK // CHUNK))
            c = T.meta_var(idx % (D_QK // CHUNK) * CHUNK)
            if idx < rows_ * (D_QK // CHUNK):
                for e in T.serial(CHUNK):  # not unrolled: few registers live (the producer has 40)
                    smem_[base_ + swizzled(tile_rows_, r, c) + e] = T.if_then_else(
                        valid_(r), T.Cast(dtype, rope_value(lambda i: at_(r, i), c + e, pos_(r), D_QK, rope_.theta,
                                                            rope_.scale, scaling)), T.Cast(dtype, 0))

    @T.macro
    def copy_kv(smem_, s_, t_, kv_end_, tid_, kv_row_, k_ptr_, v_ptr_):
        """Step t_'s K and V rows -> buffer s_ (cp.async; rows past kv_end_ zero-filled). When K
        and V rows are equally wide, one lookup of a key's slot serves both copies."""
        if D_QK == D_V:
            slot = T.alloc_local((1,), "int32")
            for it in T.unroll(ceildiv(BN * (D_QK // CHUNK), WARPGROUP)):
                idx = T.meta_var(it * WARPGROUP + tid_)
                r = T.meta_var(idx // (D_QK // CHUNK))
                c = T.meta_var(idx % (D_QK // CHUNK) * CHUNK)
                if BN * (D_QK // CHUNK) % WARPGROUP == 0 or idx < BN * (D_QK // CHUNK):
                    slot[0] = kv_row_(T.min(t_ * BN + r, kv_end_ - 1))
                    T.ptx["cp.async.cg.shared.global"](
                        smem_.ptr_to([K_OFF + s_ * K_ELEMS + swizzled(BN, r, c)]), k_ptr_(slot[0], c), 16,
                        T.Cast("uint32", T.if_then_else(t_ * BN + r < kv_end_, 16, 0)))
                    T.ptx["cp.async.cg.shared.global"](
                        smem_.ptr_to([V_OFF + s_ * V_ELEMS + swizzled(BN, r, c)]), v_ptr_(slot[0], c), 16,
                        T.Cast("uint32", T.if_then_else(t_ * BN + r < kv_end_, 16, 0)))
        else:
            copy_rows(smem_, K_OFF + s_ * K_ELEMS, BN, BN, D_QK, tid_,
                      lambda r, c: k_ptr_(kv_row_(T.min(t_ * BN + r, kv_end_ - 1)), c),
                      lambda r: t_ * BN + r < kv_end_)
            copy_rows(smem_, V_OFF + s_ * V_ELEMS, BN, BN, D_V, tid_,
                      lambda r, c: v_ptr_(kv_row_(T.min(t_ * BN + r, kv_end_ - 1)), c),
                      lambda r: t_ * BN + r < kv_end_)

    @T.macro
    def rope_kv_step(smem_, t_, kv_end_, tid_, kv_row_, v_ptr_, k_at_, k_pos_base_, rope_):
        """Step t_ with inline RoPE: rotated keys stored, values copied (cp.async)."""
        rope_rows(smem_, K_OFF + (t_ % ST) * K_ELEMS, BN, BN, tid_,
                  lambda r, d: k_at_(kv_row_(T.min(t_ * BN + r, kv_end_ - 1)), d),
                  lambda r: k_pos_base_ + t_ * BN + r, lambda r: t_ * BN + r < kv_end_, rope_)
        copy_rows(smem_, V_OFF + (t_ % ST) * V_ELEMS, BN, BN, D_V, tid_,
                  lambda r, c: v_ptr_(kv_row_(T.min(t_ * BN + r, kv_end_ - 1)), c),
                  lambda r: t_ * BN + r < kv_end_)

    @T.macro
    def produce(smem_, full_, empty_, nkv_, kv_end_, tid_, kv_row_, k_ptr_, v_ptr_, k_at_, k_pos_base_, rope_):
        """Producer warpgroup: K/V rows of steps 0..nkv_ into the ring. With inline RoPE the keys
        are rotated on the way (k_at_(row, d): element d of a key) in a loop of its own, so that
        the plain loop keeps its registers."""
        if rope_.mode == 1:
            produce_steps(full_, empty_, nkv_, lambda t: rope_kv_step(
                smem_, t, kv_end_, tid_, kv_row_, v_ptr_, k_at_, k_pos_base_, rope_))
        else:
            produce_steps(full_, empty_, nkv_, lambda t: copy_kv(
                smem_, t % ST, t, kv_end_, tid_, kv_row_, k_ptr_, v_ptr_))

    return copy_rows, rope_rows, produce


def _step_macros(lay: _Layout):
    """A consumer's step: s_mma (S = Q K^T), pv_mma (O += P V), mask, tree_rows and tree_mask
    (token trees), and store (o = O / l, lse)."""
    BM, BN, D_QK, G, K_ELEMS, K_OFF, NO, NP = lay.BM, lay.BN, lay.D_QK, lay.G, lay.K_ELEMS, lay.K_OFF, lay.NO, lay.NP
    NS, V_ELEMS, V_OFF, WG_O, WG_S, dtype = lay.NS, lay.V_ELEMS, lay.V_OFF, lay.WG_O, lay.WG_S, lay.dtype
    scores = wgmma_scores(WG_S, NS, D_QK // 16)
    accumulate = wgmma_accumulate(WG_O, NO, NP, BN // 16, BN)
    quad_reduce, _ = row_softmax(NS, NO, NP, dtype)

    @T.macro
    def s_mma(smem_, sacc_, cw_, s_):
        """sacc_ <- Q (this consumer's 64 rows) K^T of buffer s_, on tensor cores."""
        scores(smem_, sacc_,
               lambda kk: (kk * 16 // PANEL) * BM * PANEL + cw_ * ROWS_PER_CONSUMER * PANEL + kk * 16 % PANEL,
               lambda kk: K_OFF + s_ * K_ELEMS + (kk * 16 // PANEL) * BN * PANEL + kk * 16 % PANEL)

    @T.macro
    def pv_mma(smem_, oacc_, preg_, s_):
        """oacc_ += P V of buffer s_ (P from registers; V rows are the reduction axis): keys
        16kk..16kk+15 are 16 rows further."""
        accumulate(smem_, oacc_, preg_, lambda kk: V_OFF + s_ * V_ELEMS + kk * 16 * PANEL)

    @T.macro
    def mask(sacc_, kv_start_, vis_end_, lane_):
        """Scores of keys at or past a row's visible end -> MASKED. Accumulator element
        i * 4 + e of a thread is (row r0 + 8 (e // 2), key 8 i + 2 (lane % 4) + e % 2)."""
        for i in T.unroll(NS // 4):
            for e in T.unroll(4):
                sacc_[i * 4 + e] = T.if_then_else(
                    kv_start_ + i * 8 + (lane_ % 4) * 2 + e % 2 >= vis_end_[e // 2], T.float32(MASKED),
                    sacc_[i * 4 + e])

    @T.macro
    def tree_rows(tree_, kv_len_, qo_len_, p_, q_begin_, keys_):
        """Per-row and per-block values of the tree mask, hoisted out of the KV loop:
        q_begin_[r] <- DFS begin of the node of packed row p_ + 8 r; keys_ <- [history, node of
        key 0]."""
        keys_[0] = tree_.history(kv_len_)
        keys_[1] = tree_.key0_node(kv_len_)
        for r in T.unroll(2):
            q_begin_[r] = 0
            if tree_.tree_len() > 0:
                q_begin_[r] = tree_.key_span(tree_.query_node((p_ + r * 8) // G, qo_len_), 0)

    @T.macro
    def tree_mask(sacc_, kv_start_, vis_end_, tree_, q_begin_, keys_, lane_):
        """`mask`, and keys past the history that are not the row's node or an ancestor of it
        (the row's node's DFS begin is outside the key's interval) -> MASKED. The interval of
        each of the thread's key columns is read once for both its rows."""
        span = T.alloc_local((2,), "int32")
        for i in T.unroll(NS // 4):
            for c in T.unroll(2):
                j = T.meta_var(kv_start_ + i * 8 + (lane_ % 4) * 2 + c)
                span[0] = T.int32(-2147483647)  # keys of the history: an interval holding every node
                span[1] = T.int32(2147483647)
                if j >= keys_[0] and j < vis_end_[1]:
                    span[0] = tree_.key_span(keys_[1] + j, 0)
                    span[1] = tree_.key_span(keys_[1] + j, 1)
                for h in T.unroll(2):
                    sacc_[i * 4 + h * 2 + c] = T.if_then_else(
                        tirx.any(j >= vis_end_[h], q_begin_[h] < span[0], q_begin_[h] >= span[1]), T.float32(MASKED),
                        sacc_[i * 4 + h * 2 + c])

    @T.macro
    def store(oacc_, m_, l_, rows_, row0_, lane_, write_o_, write_lse_):
        """o = O / l and lse = m + log2(l) of the thread's rows row0_ and row0_ + 8 that exist."""
        for r in T.unroll(2):
            quad_reduce(l_, r, lambda a, b: a + b)
        for i in T.unroll(NO // 4):
            for e in T.unroll(4):
                if row0_ + (e // 2) * 8 < rows_:
                    write_o_(row0_ + (e // 2) * 8, i * 8 + (lane_ % 4) * 2 + e % 2,
                             oacc_[i * 4 + e] * finalize_scale(l_[e // 2]))
        if lane_ % 4 == 0:
            for r in T.unroll(2):
                if row0_ + r * 8 < rows_:
                    write_lse_(row0_ + r * 8, finalize_lse(m_[r], l_[r]))

    return s_mma, pv_mma, mask, tree_rows, tree_mask, store


def _consume_macro(lay: _Layout):
    """consume: a consumer warpgroup's loop over the steps (module docstring)."""
    BM, BN, D_QK, NO, NP, NS, PINGPONG, ST = lay.BM, lay.BN, lay.D_QK, lay.NO, lay.NP, lay.NS, lay.PINGPONG, lay.ST
    dtype, visible_end = lay.dtype, lay.visible_end
    copy_rows, rope_rows, _ = _producer_macros(lay)
    s_mma, pv_mma, mask, tree_rows, tree_mask, store = _step_macros(lay)
    _, softmax = row_softmax(NS, NO, NP, dtype)

    @T.macro
    def consume(smem_, full_, empty_, nkv_, free_end_, kv_len_, qo_len_, p0_, rows_, causal_, scale_, cw_, tid_,
                q_ptr_, q_at_, q_pos_, rope_, write_o_, write_lse_):
        """Consumer warpgroup cw_: rows p0_ + 64 cw_ .. of the tile, over steps 0..nkv_. causal_:
        the causal flag or request b's `masks.TreeMask`."""
        sacc = T.alloc_local((NS,), "float32")
        oacc = T.alloc_local((NO,), "float32")
        preg = T.alloc_local((NP,), "uint32")
        m = T.alloc_local((2,), "float32")
        lsum = T.alloc_local((2,), "float32")
        vis_end = T.alloc_local((2,), "int32")
        if is_tree(causal_):
            q_begin = T.alloc_local((2,), "int32")
            tree_keys = T.alloc_local((2,), "int32")
        warp = T.meta_var(tid_ // 32)
        lane = T.meta_var(tid_ % 32)
        row0 = T.meta_var(cw_ * ROWS_PER_CONSUMER + warp * 16 + lane // 4)  # the thread's first row in the tile
        # Q rows of this consumer -> shared memory (zeros past the tile's rows)
        if rope_.mode == 1:
            rope_rows(smem_, cw_ * ROWS_PER_CONSUMER * PANEL, ROWS_PER_CONSUMER, BM, tid_,
                      lambda r, d: q_at_(T.min(p0_ + cw_ * ROWS_PER_CONSUMER + r, T.max(rows_ - 1, 0)), d),
                      lambda r: q_pos_(T.min(p0_ + cw_ * ROWS_PER_CONSUMER + r, T.max(rows_ - 1, 0))),
                      lambda r: p0_ + cw_ * ROWS_PER_CONSUMER + r < rows_, rope_)
        else:
            copy_rows(smem_, cw_ * ROWS_PER_CONSUMER * PANEL, ROWS_PER_CONSUMER, BM, D_QK, tid_,
                      lambda r, c: q_ptr_(T.min(p0_ + cw_ * ROWS_PER_CONSUMER + r, T.max(rows_ - 1, 0)), c),
                      lambda r: p0_ + cw_ * ROWS_PER_CONSUMER + r < rows_)
        T.ptx["cp.async.commit_group"]()
        T.ptx["cp.async.wait_group"](0)
        T.ptx["fence.proxy.async.shared::cta"]()
        T.ptx["bar.sync"](T.uint32(1) + T.Cast("uint32", cw_), T.uint32(WARPGROUP))
        for i in T.unroll(NO):
            oacc[i] = T.float32(0)
        for r in T.unroll(2):
            m[r] = T.float32(EMPTY_LSE)
            lsum[r] = T.float32(0)
            vis_end[r] = visible_end(kv_len_, qo_len_, p0_ + row0 + r * 8, causal_)
        if is_tree(causal_):
            tree_rows(causal_, kv_len_, qo_len_, p0_ + row0, q_begin, tree_keys)
        if PINGPONG:
            if cw_ == 1 and nkv_ > 0:
                T.ptx["bar.arrive"](T.uint32(TURN_BARRIER), T.uint32(2 * WARPGROUP))  # consumer 0 goes first
        for t in T.serial(nkv_):
            s = T.meta_var(t % ST)
            T.cuda.mbarrier_wait(full_.ptr_to([s]), (t // ST) % 2)
            if PINGPONG:
                # the two consumers take turns on the tensor cores, so that one's softmax runs
                # while the other's S = QK^T does
                T.ptx["bar.sync"](T.uint32(TURN_BARRIER) + T.Cast("uint32", cw_), T.uint32(2 * WARPGROUP))
            s_mma(smem_, sacc, cw_, s)
            if PINGPONG:
                if cw_ == 0 or t + 1 < nkv_:
                    T.ptx["bar.arrive"](T.uint32(TURN_BARRIER + 1) - T.Cast("uint32", cw_), T.uint32(2 * WARPGROUP))
            if (t + 1) * BN > free_end_:
                if is_tree(causal_):
                    tree_mask(sacc, t * BN, vis_end, causal_, q_begin, tree_keys, lane)
                else:
                    mask(sacc, t * BN, vis_end, lane)
            softmax(sacc, preg, oacc, m, lsum, scale_)
            pv_mma(smem_, oacc, preg, s)
            if tid_ == 0:
                T.ptx.mbarrier.arrive.shared.b64(empty_.ptr_to([s]))
        store(oacc, m, lsum, rows_, p0_ + row0, lane, write_o_, write_lse_)

    return consume


def _kernel_macro(lay: _Layout):
    """kernel: the device part, one CTA per (tile slot, KV head) (its docstring)."""
    sched, BM, BN, G, SMEM_ELEMS, ST, dtype = lay.sched, lay.BM, lay.BN, lay.G, lay.SMEM_ELEMS, lay.ST, lay.dtype
    num_slots, row_tiles, unmasked_end, visible_end = lay.num_slots, lay.row_tiles, lay.unmasked_end, lay.visible_end
    init_ring = ring_barriers(ST, WARPGROUP, CONSUMERS)
    produce = _producer_macros(lay)[2]
    consume = _consume_macro(lay)

    @T.macro
    def find_tile(qo_indptr_, batch_, slot_, req_, tile_):
        """req_[0] <- request of tile slot slot_, tile_[0] <- its row tile (-1: the slot has none)."""
        walk = T.alloc_local((2,), "int32")  # request, first slot of that request
        walk[0] = 0
        walk[1] = 0
        req_[0] = 0
        tile_[0] = -1
        while walk[0] < batch_:
            if slot_ < walk[1] + row_tiles(qo_indptr_, walk[0]):
                req_[0] = walk[0]
                tile_[0] = walk[1] + row_tiles(qo_indptr_, walk[0]) - 1 - slot_
                walk[0] = batch_
            else:
                walk[1] = walk[1] + row_tiles(qo_indptr_, walk[0])
                walk[0] = walk[0] + 1

    @T.macro
    def kernel(qo_indptr_, batch_, total_q_, Hkv_, causal_, sm_scale_, rope_, q_ptr_, q_at_, q_pos_, kv_len_, kv_row_,
               k_ptr_, v_ptr_, k_at_, k_pos_, write_o_, write_lse_):
        """The device part: one CTA per (tile slot, KV head), 3 warpgroups.

        Accessors of request b and KV head hkv: q_ptr_(b, hkv, p, c) address of element c of
        packed row p's query; kv_len_(b) visible keys; kv_row_(b, j) where key j lives (an
        int32 handle); k_ptr_(hkv, row, c) / v_ptr_(hkv, row, c) addresses of element c of
        that key / value; write_o_(b, hkv, p, c, value), write_lse_(b, hkv, p, value).
        Inline RoPE (rope_.mode == 1) also reads q_at_(b, hkv, p, d) / k_at_(hkv, row, d) (element
        values), q_pos_(b, p) and k_pos_(b) (positions of packed row p and of key 0).
        """
        T.device_entry()
        bx = T.cta_id([num_slots(total_q_, batch_) * Hkv_])
        wg = T.warpgroup_id([CONSUMERS + 1])
        tid = T.thread_id_in_wg([WARPGROUP])
        smem = T.alloc_buffer((SMEM_ELEMS,), dtype, scope="shared.dyn", align=1024)
        full = T.alloc_shared((ST,), "uint64")
        empty = T.alloc_shared((ST,), "uint64")
        req = T.alloc_local((1,), "int32")
        tile = T.alloc_local((1,), "int32")
        init_ring(full, empty, wg, tid)
        find_tile(qo_indptr_, batch_, bx // Hkv_, req, tile)
        b: T.let[T.int32] = req[0]
        hkv: T.let[T.int32] = bx % Hkv_
        req_mask = T.meta_var(mask_of_request(causal_, b))  # the flag, or request b's tree
        qo_len: T.let[T.int32] = qo_indptr_[b + 1] - qo_indptr_[b]
        kv_len_v: T.let[T.int32] = kv_len_(b)
        rows: T.let[T.int32] = T.if_then_else(tile[0] >= 0, qo_len * G, 0)
        p0: T.let[T.int32] = T.max(tile[0], 0) * BM
        # keys every row of the tile sees (no mask below) and keys its last row sees
        free_end: T.let[T.int32] = unmasked_end(kv_len_v, qo_len, p0, req_mask)
        kv_end: T.let[T.int32] = T.if_then_else(rows > 0, visible_end(kv_len_v, qo_len, p0 + BM - 1, req_mask), 0)
        nkv: T.let[T.int32] = ceildiv(kv_end, BN)
        if wg == 0:
            T.ptx["setmaxnreg.dec.sync.aligned.u32"](sched.producer_regs)
            produce(smem, full, empty, nkv, kv_end, tid, lambda j: kv_row_(b, j), lambda row, c: k_ptr_(hkv, row, c),
                    lambda row, c: v_ptr_(hkv, row, c), lambda row, d: k_at_(hkv, row, d), k_pos_(b), rope_)
        else:
            T.ptx["setmaxnreg.inc.sync.aligned.u32"](sched.consumer_regs)
            consume(smem, full, empty, nkv, free_end, kv_len_v, qo_len, p0, rows, req_mask,
                    sm_scale_ * T.float32(LOG2E), wg - 1, tid, lambda p, c: q_ptr_(b, hkv, p, c),
                    lambda p, d: q_at_(b, hkv, p, d), lambda p: q_pos_(b, p), rope_,
                    lambda p, c, val: write_o_(b, hkv, p, c, val), lambda p, val: write_lse_(b, hkv, p, val))

    return kernel


def _macros(config: AttentionConfig, sched: WgmmaPrefillSchedule):
    """The kernel macro of `config` and `sched` (`_kernel_macro`)."""
    return _kernel_macro(_Layout(config, sched))


class Rope(NamedTuple):
    """The kernel's run-time RoPE arguments: mode (rotary_mode; 1 = rotate q and k inside),
    scale and theta."""

    mode: object
    scale: object
    theta: object


def _finish(func):
    """Route the kernel through the TIRx pipeline and build it for sm_90a."""
    return func.with_attr(TIRX_ATTR, True).with_attr(
        "target", tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}, host="llvm"))


def _schedule_for(config: AttentionConfig, schedule: WgmmaPrefillSchedule | None) -> WgmmaPrefillSchedule:
    problem = wgmma_problem(config)
    if problem:
        raise ValueError(f"the tensor-core prefill does not serve {problem}")
    sched = schedule or choose_wgmma_prefill_schedule(config)
    sched.check(config)
    return sched


def _paged_macro(config: AttentionConfig, schedule: WgmmaPrefillSchedule | None):
    """The paged kernel macro (prefill_contract's paged argument order)."""
    sched = _schedule_for(config, schedule)
    kernel = _macros(config, sched)
    dtype, ps, Hkv, G = config.dtype, config.page_size, config.num_kv_heads, config.group_size
    sliding = config.sliding_window

    @T.macro
    def paged(Q, qo_indptr, pages, page_indptr, page_indices, length_info, k_rope_pos_offset, q_rope_position, O, lse,
              causal, rotary_mode, rope_scale, rope_theta, sm_scale):
        kernel(qo_indptr, k_rope_pos_offset.shape[0], Q.shape[0], Hkv, causal, sm_scale,
               Rope(rotary_mode, rope_scale, rope_theta),
               lambda b, hkv, p, c: Q.ptr_to([qo_indptr[b] + p // G, hkv * G + p % G, c]),
               lambda b, hkv, p, d: Q[qo_indptr[b] + p // G, hkv * G + p % G, d],
               lambda b, p: q_rope_position[qo_indptr[b] + p // G],
               lambda b: kv_chunk_len(page_indptr[b + 1] - page_indptr[b], ps, length_info, b, sliding),
               # a key's slot in the page pool: page id * page_size + offset
               lambda b, j: page_indices[page_indptr[b] + paged_position(j, length_info, b, sliding) // ps] * ps
               + paged_position(j, length_info, b, sliding) % ps,
               lambda hkv, slot, c: pages.ptr_to([slot // ps, 0, hkv, slot % ps, c]),
               lambda hkv, slot, c: pages.ptr_to([slot // ps, 1, hkv, slot % ps, c]),
               lambda hkv, slot, d: pages[slot // ps, 0, hkv, slot % ps, d],
               lambda b: k_rope_pos_offset[b],
               lambda b, hkv, p, c, val: T.buffer_store(O, T.Cast(dtype, val),
                                                        [qo_indptr[b] + p // G, hkv * G + p % G, c]),
               lambda b, hkv, p, val: T.buffer_store(lse, val, [qo_indptr[b] + p // G, hkv * G + p % G]))

    return paged


def _ragged_macro(config: AttentionConfig, schedule: WgmmaPrefillSchedule | None):
    """The ragged kernel macro (prefill_contract's ragged argument order)."""
    sched = _schedule_for(config, schedule)
    kernel = _macros(config, sched)
    dtype, Hkv, G = config.dtype, config.num_kv_heads, config.group_size

    @T.macro
    def ragged(Q, qo_indptr, K, V, kv_indptr, q_rope_position, k_rope_pos_offset, O, lse, causal, rotary_mode,
               rope_scale, rope_theta, sm_scale):
        kernel(qo_indptr, k_rope_pos_offset.shape[0], Q.shape[0], Hkv, causal, sm_scale,
               Rope(rotary_mode, rope_scale, rope_theta),
               lambda b, hkv, p, c: Q.ptr_to([qo_indptr[b] + p // G, hkv * G + p % G, c]),
               lambda b, hkv, p, d: Q[qo_indptr[b] + p // G, hkv * G + p % G, d],
               lambda b, p: q_rope_position[qo_indptr[b] + p // G],
               lambda b: kv_indptr[b + 1] - kv_indptr[b],
               lambda b, j: kv_indptr[b] + j,
               lambda hkv, row, c: K.ptr_to([row, hkv, c]),
               lambda hkv, row, c: V.ptr_to([row, hkv, c]),
               lambda hkv, row, d: K[row, hkv, d],
               lambda b: k_rope_pos_offset[b],
               lambda b, hkv, p, c, val: T.buffer_store(O, T.Cast(dtype, val),
                                                        [qo_indptr[b] + p // G, hkv * G + p % G, c]),
               lambda b, hkv, p, val: T.buffer_store(lse, val, [qo_indptr[b] + p // G, hkv * G + p % G]))

    return ragged


def paged_prefill_wgmma(config: AttentionConfig, schedule: WgmmaPrefillSchedule | None = None):
    """Tensor-core body of `prefill.paged_prefill` (same arguments and semantics)."""
    return _finish(paged_prefill_func(config, _paged_macro(config, schedule), rope_on_host=False, align=16))


def ragged_prefill_wgmma(config: AttentionConfig, schedule: WgmmaPrefillSchedule | None = None):
    """Tensor-core body of `prefill.ragged_prefill` (same arguments and semantics)."""
    return _finish(ragged_prefill_func(config, _ragged_macro(config, schedule), rope_on_host=False, align=16))


def tree_paged_prefill_wgmma(config: AttentionConfig, schedule: WgmmaPrefillSchedule | None = None):
    """Tensor-core body of `prefill.tree_mask_paged_prefill` (TVM's `tree_attn_paged_kv`
    arguments): the paged kernel with the token-tree mask in place of the causal one; keys are
    cached rotated (rotary_mode must be 0, asserted by the PrimFunc)."""
    return _finish(tree_paged_prefill_func(config, _paged_macro(config, schedule)))


def tree_ragged_prefill_wgmma(config: AttentionConfig, schedule: WgmmaPrefillSchedule | None = None):
    """Tensor-core body of `prefill.tree_mask_ragged_prefill` (TVM's `batch_tree_attn` arguments)."""
    return _finish(tree_ragged_prefill_func(config, _ragged_macro(config, schedule)))
