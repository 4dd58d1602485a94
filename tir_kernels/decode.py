"""Paged decode attention (one query token per request), MHA/GQA, with split-KV.

Algorithm: a block serves one request, one KV head and `heads_per_block` query heads of its
group, over one split of the request's visible KV tokens. Each thread keeps an online
softmax (running max, denominator, output) over the rows it reads; rows are combined in
shared memory, and splits (when more than one) are merged in FP32 by a second kernel.
The split count is computed at launch from the batch size, so small batches still fill
the GPU. On the CPU the same code runs with one thread per block and no split.
"""

from __future__ import annotations

from tvm.script import tirx as T

from .common import EMPTY_LSE, LOG2E, ceildiv, kv_chunk_len, length_info_shape, loop_kinds, paged_position, rope_value
from .config import AttentionConfig
from .schedules import DecodeSchedule, choose_decode_schedule


def _check(config: AttentionConfig) -> None:
    if config.v_head_dim != config.head_dim:
        raise ValueError(
            f"v_head_dim={config.v_head_dim} is not supported by paged_decode: expected head_dim={config.head_dim}"
        )


def paged_decode(config: AttentionConfig, schedule: DecodeSchedule | None = None):
    """Paged decode PrimFunc, arguments in the contract's order:

    q [B, Hq, D], pages [P, 2, Hkv, page_size, D], page_indptr [B+1] i32,
    page_indices [nnz] i32, length_info [B] (or [3, B] sliding) i32, k_rope_pos_offset [B] i32,
    q_rope_position [B] i32, o [B, Hq, D], lse [B, Hq] f32 (base 2), rotary_mode i32,
    rope_scale f32, rope_theta f32, sm_scale f32.
    A request with no visible token gets o = 0 and lse = EMPTY_LSE.
    """
    _check(config)
    sched = schedule or choose_decode_schedule(config)
    sched.check(config)
    L = loop_kinds(config)
    gpu = config.is_gpu

    dtype, ps, D = config.dtype, config.page_size, config.head_dim
    Hq, Hkv, G = config.num_qo_heads, config.num_kv_heads, config.group_size
    sliding, scaling = config.sliding_window, config.rope_scaling
    LANES, ROWS, RPT, HB = sched.lanes, sched.rows, sched.rows_per_thread, sched.heads_per_block
    LOG_LANES = LANES.bit_length() - 1
    EPL = D // LANES  # elements of a row held by one lane
    VEC = min(EPL, 16 // config.elem_bytes) if gpu else EPL  # elements per 16-byte load
    CHUNKS = G // HB  # blocks per KV head along the GQA group
    NTHREADS = LANES * ROWS
    TILE = ROWS * RPT  # KV rows a block consumes per step
    MAX_SPLITS, TARGET_BLOCKS = sched.max_splits, sched.target_blocks
    shared = "shared" if gpu else "local"

    def num_splits(batch):
        """Splits per request, chosen at launch so that batch * heads * splits fills the GPU."""
        if MAX_SPLITS == 1:
            return 1
        return T.min(T.max(ceildiv(TARGET_BLOCKS, batch * Hkv * CHUNKS), 1), MAX_SPLITS)

    @T.macro
    def lane_allreduce(buf_, idx_):
        """buf_[idx_] <- sum over the LANES threads that share a row (xor butterfly)."""
        for k_ in T.unroll(LOG_LANES):
            buf_[idx_] = buf_[idx_] + T.tvm_warp_shuffle_xor(
                T.tvm_warp_activemask(), buf_[idx_], T.shift_right(LANES, k_ + 1), LANES, 32
            )

    @T.macro
    def attend(q_, pages_, indptr_, indices_, length_info_, k_pos_, q_pos_, rotate_, rope_scale_,
               rope_theta_, sm_scale_, b_, hc_, split_, nsplit_, ty_, tx_, row_m_, row_d_, row_o_):
        """Online softmax of split `split_` of request b_ for one head chunk: each row group
        (ty_) leaves its max, denominator and unnormalised output in row_m_/row_d_/row_o_.
        rotate_ (a Python bool) applies RoPE to q and k: two kernels, no branch in the loop."""
        hkv = hc_ // CHUNKS
        h0 = hkv * G + (hc_ % CHUNKS) * HB
        q_loc = T.alloc_buffer((HB * EPL,), "float32", scope="local")
        o_loc = T.alloc_buffer((HB * EPL,), "float32", scope="local")
        m_loc = T.alloc_buffer((HB,), "float32", scope="local")
        d_loc = T.alloc_buffer((HB,), "float32", scope="local")
        m_old = T.alloc_buffer((1,), "float32", scope="local")
        s_loc = T.alloc_buffer((HB * RPT,), "float32", scope="local")
        k_loc = T.alloc_buffer((RPT * EPL,), dtype, scope="local")
        v_loc = T.alloc_buffer((RPT * EPL,), dtype, scope="local")
        page_loc = T.alloc_buffer((RPT,), "int32", scope="local")
        slot_loc = T.alloc_buffer((RPT,), "int32", scope="local")
        page_begin = indptr_[b_]
        kv_len = kv_chunk_len(indptr_[b_ + 1] - page_begin, ps, length_info_, b_, sliding)
        split_len = ceildiv(kv_len, nsplit_)
        j_begin = T.min(split_ * split_len, kv_len)
        j_end = T.min(j_begin + split_len, kv_len)
        for h in L.unroll(HB):
            m_loc[h] = T.float32(EMPTY_LSE)
            d_loc[h] = T.float32(0)
            for e in L.unroll(EPL):
                o_loc[h * EPL + e] = T.float32(0)
                if rotate_:
                    q_loc[h * EPL + e] = rope_value(
                        lambda i: q_[b_, h0 + h, i], tx_ * EPL + e, q_pos_[b_], D, rope_theta_, rope_scale_, scaling
                    ) * sm_scale_ * T.float32(LOG2E)
                else:
                    q_loc[h * EPL + e] = T.Cast("float32", q_[b_, h0 + h, tx_ * EPL + e]) * sm_scale_ * T.float32(LOG2E)
        for step in T.serial(ceildiv(j_end - j_begin, TILE)):
            # Issue every K and V load of the step before any arithmetic.
            for r in L.unroll(RPT):
                j = j_begin + step * TILE + r * ROWS + ty_
                if j < j_end:
                    pos = paged_position(j, length_info_, b_, sliding)
                    page_loc[r] = indices_[page_begin + pos // ps]
                    slot_loc[r] = pos % ps
                    if rotate_:
                        for e in L.unroll(EPL):
                            k_loc[r * EPL + e] = T.Cast(dtype, rope_value(
                                lambda i: pages_[page_loc[r], 0, hkv, slot_loc[r], i], tx_ * EPL + e,
                                k_pos_[b_] + j, D, rope_theta_, rope_scale_, scaling))
                    else:
                        for c in L.unroll(EPL // VEC):
                            for e in L.vector(VEC):
                                k_loc[r * EPL + c * VEC + e] = pages_[page_loc[r], 0, hkv, slot_loc[r], tx_ * EPL + c * VEC + e]
                    for c in L.unroll(EPL // VEC):
                        for e in L.vector(VEC):
                            v_loc[r * EPL + c * VEC + e] = pages_[page_loc[r], 1, hkv, slot_loc[r], tx_ * EPL + c * VEC + e]
                else:
                    # Rows past the end get weight 0; zero them so 0 * garbage cannot make NaN.
                    for e in L.unroll(EPL):
                        k_loc[r * EPL + e] = T.Cast(dtype, 0)
                        v_loc[r * EPL + e] = T.Cast(dtype, 0)
            for h in L.unroll(HB):
                for r in L.unroll(RPT):
                    s_loc[h * RPT + r] = T.float32(0)
                    for e in L.unroll(EPL):
                        s_loc[h * RPT + r] = s_loc[h * RPT + r] + q_loc[h * EPL + e] * T.Cast("float32", k_loc[r * EPL + e])
                    lane_allreduce(s_loc, h * RPT + r)
                    if j_begin + step * TILE + r * ROWS + ty_ >= j_end:
                        s_loc[h * RPT + r] = T.min_value("float32")
                m_old[0] = m_loc[h]
                for r in L.unroll(RPT):
                    m_loc[h] = T.max(m_loc[h], s_loc[h * RPT + r])
                d_loc[h] = d_loc[h] * T.exp2(m_old[0] - m_loc[h])
                for e in L.unroll(EPL):
                    o_loc[h * EPL + e] = o_loc[h * EPL + e] * T.exp2(m_old[0] - m_loc[h])
                for r in L.unroll(RPT):
                    s_loc[h * RPT + r] = T.exp2(s_loc[h * RPT + r] - m_loc[h])
                    d_loc[h] = d_loc[h] + s_loc[h * RPT + r]
                    for e in L.unroll(EPL):
                        o_loc[h * EPL + e] = o_loc[h * EPL + e] + s_loc[h * RPT + r] * T.Cast("float32", v_loc[r * EPL + e])
        for h in L.unroll(HB):
            if tx_ == 0:
                row_m_[ty_ * HB + h] = m_loc[h]
                row_d_[ty_ * HB + h] = d_loc[h]
            for e in L.unroll(EPL):
                row_o_[(ty_ * HB + h) * D + tx_ * EPL + e] = o_loc[h * EPL + e]

    @T.macro
    def combine_rows(row_m_, row_d_, row_o_, ty_, tx_, write_o, write_lse):
        """Merge the ROWS row-group states; write_o(h, e, value) and write_lse(h, value) store."""
        m_all = T.alloc_buffer((1,), "float32", scope="local")
        d_all = T.alloc_buffer((1,), "float32", scope="local")
        acc = T.alloc_buffer((1,), "float32", scope="local")
        for step in T.serial(ceildiv(HB * D, NTHREADS)):
            if step * NTHREADS + ty_ * LANES + tx_ < HB * D:
                h = (step * NTHREADS + ty_ * LANES + tx_) // D
                e = (step * NTHREADS + ty_ * LANES + tx_) % D
                m_all[0] = T.float32(EMPTY_LSE)
                for y in T.serial(ROWS):
                    m_all[0] = T.max(m_all[0], row_m_[y * HB + h])
                d_all[0] = T.float32(0)
                acc[0] = T.float32(0)
                for y in T.serial(ROWS):
                    d_all[0] = d_all[0] + row_d_[y * HB + h] * T.exp2(row_m_[y * HB + h] - m_all[0])
                    acc[0] = acc[0] + row_o_[(y * HB + h) * D + e] * T.exp2(row_m_[y * HB + h] - m_all[0])
                if d_all[0] > T.float32(0):
                    write_o(h, e, acc[0] / d_all[0])
                    if e == 0:
                        write_lse(h, m_all[0] + T.log2(d_all[0]))
                else:
                    write_o(h, e, T.float32(0))
                    if e == 0:
                        write_lse(h, T.float32(EMPTY_LSE))

    def head(hc, h):
        return (hc // CHUNKS) * G + (hc % CHUNKS) * HB + h

    @T.macro
    def split_kernel(q_, pages_, indptr_, indices_, length_info_, k_pos_, q_pos_, o_, lse_, o_part_, lse_part_,
                     rotate_, rope_scale_, rope_theta_, sm_scale_):
        """The attention kernel: one block per (request, head chunk, split)."""
        batch = q_.shape[0]
        for b in L.block(batch, "x", outer=True):
            for hc in L.block(Hkv * CHUNKS, "y"):
                for split in L.block(num_splits(batch), "z"):
                    for ty in L.thread(ROWS, "y"):
                        for tx in L.thread(LANES, "x"):
                            row_m = T.alloc_buffer((ROWS * HB,), "float32", scope=shared)
                            row_d = T.alloc_buffer((ROWS * HB,), "float32", scope=shared)
                            row_o = T.alloc_buffer((ROWS * HB * D,), "float32", scope=shared)
                            attend(q_, pages_, indptr_, indices_, length_info_, k_pos_, q_pos_,
                                   rotate_, rope_scale_, rope_theta_, sm_scale_,
                                   b, hc, split, num_splits(batch), ty, tx, row_m, row_d, row_o)
                            if gpu:
                                T.tvm_storage_sync("shared")
                            if num_splits(batch) == 1:
                                combine_rows(row_m, row_d, row_o, ty, tx,
                                             lambda h, e, val: T.buffer_store(o_, T.Cast(dtype, val), [b, head(hc, h), e]),
                                             lambda h, val: T.buffer_store(lse_, val, [b, head(hc, h)]))
                            else:
                                combine_rows(row_m, row_d, row_o, ty, tx,
                                             lambda h, e, val: T.buffer_store(o_part_, val, [((split * batch + b) * Hq + head(hc, h)) * D + e]),
                                             lambda h, val: T.buffer_store(lse_part_, val, [(split * batch + b) * Hq + head(hc, h)]))

    @T.prim_func
    def batch_decode_paged_kv(
        q_handle: T.handle,
        pages_handle: T.handle,
        page_indptr_handle: T.handle,
        page_indices_handle: T.handle,
        length_info_handle: T.handle,
        k_rope_pos_offset_handle: T.handle,
        q_rope_position_handle: T.handle,
        o_handle: T.handle,
        lse_handle: T.handle,
        rotary_mode: T.int32,
        rope_scale: T.float32,
        rope_theta: T.float32,
        sm_scale: T.float32,
    ):
        T.func_attr({"tirx.noalias": True})
        B = T.int32()
        num_pages = T.int64()
        nnz_pages = T.int32()
        indptr_offset = T.int32()
        indices_offset = T.int32()
        length_offset = T.int32()
        k_pos_offset = T.int32()
        q_pos_offset = T.int32()
        Q = T.match_buffer(q_handle, (B, Hq, D), dtype)
        # No elem_offset on pages: with one, TVM cannot prove 16-byte alignment and gathers.
        pages = T.match_buffer(pages_handle, (num_pages, 2, Hkv, ps, D), dtype)
        page_indptr = T.match_buffer(page_indptr_handle, (B + 1,), "int32", elem_offset=indptr_offset)
        page_indices = T.match_buffer(page_indices_handle, (nnz_pages,), "int32", elem_offset=indices_offset)
        length_info = T.match_buffer(length_info_handle, length_info_shape(B, sliding), "int32", elem_offset=length_offset)
        k_rope_pos_offset = T.match_buffer(k_rope_pos_offset_handle, (B,), "int32", elem_offset=k_pos_offset)
        q_rope_position = T.match_buffer(q_rope_position_handle, (B,), "int32", elem_offset=q_pos_offset)
        O = T.match_buffer(o_handle, (B, Hq, D), dtype)
        lse = T.match_buffer(lse_handle, (B, Hq), "float32")
        # Split partials: FP32 output and LSE per split (workspace; unused when one split).
        o_part = T.alloc_buffer((num_splits(B) * B * Hq * D,), "float32")
        lse_part = T.alloc_buffer((num_splits(B) * B * Hq,), "float32")

        if rotary_mode == 1:
            split_kernel(Q, pages, page_indptr, page_indices, length_info, k_rope_pos_offset, q_rope_position,
                         O, lse, o_part, lse_part, True, rope_scale, rope_theta, sm_scale)
        else:
            split_kernel(Q, pages, page_indptr, page_indices, length_info, k_rope_pos_offset, q_rope_position,
                         O, lse, o_part, lse_part, False, rope_scale, rope_theta, sm_scale)
        if num_splits(B) > 1:
            # Merge the splits of each (request, head) in FP32.
            for b in L.block(B, "x", outer=True):
                for h in L.block(Hq, "y"):
                    for e in L.thread(D, "x"):
                        m_all = T.alloc_buffer((1,), "float32", scope="local")
                        d_all = T.alloc_buffer((1,), "float32", scope="local")
                        acc = T.alloc_buffer((1,), "float32", scope="local")
                        m_all[0] = T.float32(EMPTY_LSE)
                        for s in T.serial(num_splits(B)):
                            m_all[0] = T.max(m_all[0], lse_part[(s * B + b) * Hq + h])
                        d_all[0] = T.float32(0)
                        acc[0] = T.float32(0)
                        for s in T.serial(num_splits(B)):
                            if lse_part[(s * B + b) * Hq + h] > T.float32(EMPTY_LSE):
                                d_all[0] = d_all[0] + T.exp2(lse_part[(s * B + b) * Hq + h] - m_all[0])
                                acc[0] = acc[0] + o_part[((s * B + b) * Hq + h) * D + e] * T.exp2(lse_part[(s * B + b) * Hq + h] - m_all[0])
                        if d_all[0] > T.float32(0):
                            O[b, h, e] = T.Cast(dtype, acc[0] / d_all[0])
                            if e == 0:
                                lse[b, h] = m_all[0] + T.log2(d_all[0])
                        else:
                            O[b, h, e] = T.Cast(dtype, T.float32(0))
                            if e == 0:
                                lse[b, h] = T.float32(EMPTY_LSE)

    return batch_decode_paged_kv.with_attr("global_symbol", "batch_decode_paged_kv")
