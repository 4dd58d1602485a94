"""The CUDA-core (SIMT) steps of a tiled online-softmax attention block, shared by the
CUDA-core prefill (prefill_simt.py) and the MLA kernels (mla_simt.py), on CUDA and on the CPU.

`dims` describes the tiling: TY x TX threads; a thread holds TM x TN scores (rows ty + TY m,
columns tx + TX n of the tile) and TM x OC outputs (columns `out_col(TX, tx, c)`); operands
sit in shared memory as fp32 rows of stride QS (queries), KS (keys), VS (values) and PS
(probabilities); D_QK is the dot-product length and BK the keys of a tile.

- `gemm_macros`: s_gemm (S = Q K^T) and o_gemm (O += P V) on register micro-tiles.
- `tile_softmax_macros`: init, mask, softmax (online: softmax.py's update) and store
  (softmax.py's finalize); a row's TX threads agree on its max by warp shuffles and sum their
  parts of l at the end.
- `load_macros`: load_q, stage_kv, commit_kv (global -> registers -> shared fp32, RoPE optional).
- `find_tile_macro`: which request and row tile a block's tile slot holds (prefill grids).
"""

from __future__ import annotations

from tvm.script import tirx as T

from .common import rope_value
from .softmax import prob, softmax_macros

SMEM_VEC = 4  # fp32 elements per shared-memory vector access (16 bytes)
# Shuffle mask: every lane of a block's warps takes part (threads per block are a multiple
# of 32, and the reductions are reached in uniform control flow).
FULL_WARP = 0xFFFFFFFF


def out_col(TX: int, tx, c):
    """Output column of thread tx's c-th output register: SMEM_VEC-wide groups, interleaved."""
    return tx * SMEM_VEC + (c // SMEM_VEC) * TX * SMEM_VEC + c % SMEM_VEC


def gemm_macros(dims, L):
    """s_gemm and o_gemm on register micro-tiles, operands from shared memory (fp32)."""
    D_QK, TY, TX, TM, TN, BK = dims.D_QK, dims.TY, dims.TX, dims.TM, dims.TN, dims.BK
    QS, KS, VS, PS, OC = dims.QS, dims.KS, dims.VS, dims.PS, dims.OC

    @T.macro
    def s_gemm(qs_, ks_, s_, ty_, tx_):
        """s_[m, n] <- q row (ty_ + TY m) . k row (tx_ + TX n)."""
        qf = T.alloc_buffer((TM * SMEM_VEC,), "float32", scope="local")
        kf = T.alloc_buffer((TN * SMEM_VEC,), "float32", scope="local")
        for i in L.unroll(TM * TN):
            s_[i] = T.float32(0)
        for dk in T.serial(D_QK // SMEM_VEC):
            for m in L.unroll(TM):
                for e in L.vector(SMEM_VEC):
                    qf[m * SMEM_VEC + e] = qs_[(ty_ + TY * m) * QS + dk * SMEM_VEC + e]
            for n in L.unroll(TN):
                for e in L.vector(SMEM_VEC):
                    kf[n * SMEM_VEC + e] = ks_[(tx_ + TX * n) * KS + dk * SMEM_VEC + e]
            for m in L.unroll(TM):
                for n in L.unroll(TN):
                    for e in L.unroll(SMEM_VEC):
                        s_[m * TN + n] = s_[m * TN + n] + qf[m * SMEM_VEC + e] * kf[n * SMEM_VEC + e]

    @T.macro
    def o_gemm(ps_, vs_, o_, ty_, tx_):
        """o_[m, c] += sum_j P[row m, j] V[j, out_col(c)] (V: rows of stride VS in vs_)."""
        pf = T.alloc_buffer((TM * SMEM_VEC,), "float32", scope="local")
        vf = T.alloc_buffer((OC,), "float32", scope="local")
        for jc in T.serial(BK // SMEM_VEC):
            for m in L.unroll(TM):
                for e in L.vector(SMEM_VEC):
                    pf[m * SMEM_VEC + e] = ps_[(ty_ + TY * m) * PS + jc * SMEM_VEC + e]
            for e in L.unroll(SMEM_VEC):
                for g in L.unroll(OC // SMEM_VEC):
                    for e2 in L.vector(SMEM_VEC):
                        vf[g * SMEM_VEC + e2] = vs_[(jc * SMEM_VEC + e) * VS + out_col(TX, tx_, g * SMEM_VEC + e2)]
                for m in L.unroll(TM):
                    for c in L.unroll(OC):
                        o_[m * OC + c] = o_[m * OC + c] + pf[m * SMEM_VEC + e] * vf[c]

    return s_gemm, o_gemm


def tile_softmax_macros(dims, L):
    """init, mask, softmax and store: the per-row online softmax of a score tile."""
    TY, TX, TM, TN, PS, OC = dims.TY, dims.TX, dims.TM, dims.TN, dims.PS, dims.OC
    LOG_TX = TX.bit_length() - 1
    sm = softmax_macros(L)

    @T.macro
    def row_allreduce(buf_, idx_, op_):
        """buf_[idx_] <- op_ over the TX threads of a row (xor butterfly)."""
        for k_ in L.unroll(LOG_TX):
            buf_[idx_] = op_(
                buf_[idx_],
                T.tvm_warp_shuffle_xor(T.uint32(FULL_WARP), buf_[idx_], T.shift_right(TX, k_ + 1), TX, 32),
            )

    @T.macro
    def mask(s_, hidden_, p0_, ty_, tx_):
        """Scores whose key is hidden from their row -> the lowest float: hidden_(row, column)
        with row p0_ + ty_ + TY m and column tx_ + TX n of the tile."""
        for m in L.unroll(TM):
            for n in L.unroll(TN):
                if hidden_(p0_ + ty_ + TY * m, tx_ + TX * n):
                    s_[m * TN + n] = T.min_value("float32")

    @T.macro
    def softmax(s_, ps_, o_, m_run_, l_run_, ty_, tx_):
        """Move each row's state to its new max (softmax.update), then s_ -> P = exp2(s - m)
        (into ps_) and l += this thread's part of the row sum of P."""
        m_new = T.alloc_buffer((1,), "float32", scope="local")
        for m in L.unroll(TM):
            m_new[0] = m_run_[m]
            for n in L.unroll(TN):
                m_new[0] = T.max(m_new[0], s_[m * TN + n])
            row_allreduce(m_new, 0, T.max)
            sm.update(m_run_, l_run_, o_, m, OC, m_new[0])
            for n in L.unroll(TN):
                s_[m * TN + n] = prob(s_[m * TN + n], m_new[0])
                l_run_[m] = l_run_[m] + s_[m * TN + n]
                ps_[(ty_ + TY * m) * PS + tx_ + TX * n] = s_[m * TN + n]

    @T.macro
    def store(o_, m_run_, l_run_, rows_, p0_, ty_, tx_, write_o_, write_lse_):
        """Finish each row (softmax.finalize: o / l, lse = m + log2(l); o = 0 and EMPTY_LSE for
        a row that saw no key) and write the rows below rows_: write_o_(row, column, value),
        write_lse_(row, value)."""
        for m in L.unroll(TM):
            row_allreduce(l_run_, m, lambda a, b: a + b)
            if p0_ + ty_ + TY * m < rows_:
                sm.finalize(m_run_, l_run_, o_, m, OC)
                for g in L.unroll(OC // SMEM_VEC):
                    for e in L.vector(SMEM_VEC):
                        write_o_(p0_ + ty_ + TY * m, out_col(TX, tx_, g * SMEM_VEC + e), o_[m * OC + g * SMEM_VEC + e])
                if tx_ == 0:
                    write_lse_(p0_ + ty_ + TY * m, m_run_[m])

    return sm.init, mask, softmax, store


def find_tile_macro(row_tiles):
    """find_tile(qo_indptr_, batch_, slot_, req_, tile_): req_[0] <- the request of tile slot
    slot_ and tile_[0] <- its row tile, numbered from the request's last (the rows that see
    most keys start first); tile_[0] = -1 (req_[0] = 0) when the slot has no tile.
    row_tiles(qo_indptr, b): the row tiles of request b."""

    @T.macro
    def find_tile(qo_indptr_, batch_, slot_, req_, tile_):
        cur = T.alloc_buffer((1,), "int32", scope="local")
        first = T.alloc_buffer((1,), "int32", scope="local")
        cur[0] = 0
        first[0] = 0
        req_[0] = 0
        tile_[0] = -1
        while cur[0] < batch_:
            if slot_ < first[0] + row_tiles(qo_indptr_, cur[0]):
                req_[0] = cur[0]
                tile_[0] = first[0] + row_tiles(qo_indptr_, cur[0]) - 1 - slot_
                cur[0] = batch_
            else:
                first[0] = first[0] + row_tiles(qo_indptr_, cur[0])
                cur[0] = cur[0] + 1

    return find_tile


def load_macros(dims, L):
    """load_q (Q_load) and stage_kv / commit_kv (KV_load): global memory (16-byte loads, RoPE'd
    when asked) -> registers -> shared fp32. dims.scaling: the RoPE frequency scaling (or None)."""
    dtype, scaling, D_QK, QS = dims.dtype, dims.scaling, dims.D_QK, dims.QS
    BQ, BK, NT, VEC = dims.BQ, dims.BK, dims.NT, dims.VEC
    chunks, load_iters = dims.chunks, dims.load_iters
    # K/V staged element by element where they are FP8 codes (dims.KV_FP8: widened in TIR
    # arithmetic that CUDA has no vector lanes of)
    kv_loop = L.unroll if getattr(dims, "KV_FP8", False) else L.vector

    @T.macro
    def store_fp32(dst_, base_, src_, src_base_, scale_):
        """dst_[base_ + e] <- float32(src_[src_base_ + e]) * scale_ for e < VEC, 16 bytes at a time."""
        for g in L.unroll(VEC // SMEM_VEC):
            for e in L.vector(SMEM_VEC):
                dst_[base_ + g * SMEM_VEC + e] = T.Cast("float32", src_[src_base_ + g * SMEM_VEC + e]) * scale_

    @T.macro
    def load_q(at_, pos_at_, qs_, rows_, p0_, tid_, rotate_, rope_scale_, rope_theta_, qscale_):
        """Q_load: qs_[r, :] <- q of packed row p0_ + r (RoPE'd when rotate_) * qscale_; zero past the rows."""
        stage = T.alloc_buffer((VEC,), dtype, scope="local")
        for it in L.unroll(load_iters(BQ, D_QK)):
            c = T.meta_var(it * NT + tid_)
            r = c // chunks(D_QK)
            c0 = T.meta_var(c % chunks(D_QK) * VEC)  # inline, so 16-byte alignment stays provable
            if c < BQ * chunks(D_QK):
                if rotate_:
                    for e in L.unroll(VEC):
                        qs_[r * QS + c0 + e] = T.if_then_else(p0_ + r < rows_, qscale_ * rope_value(
                            lambda i: at_(p0_ + r, i), c0 + e, pos_at_(p0_ + r), D_QK, rope_theta_, rope_scale_, scaling
                        ), T.float32(0))
                else:
                    if p0_ + r < rows_:
                        for e in L.vector(VEC):
                            stage[e] = at_(p0_ + r, c0 + e)
                    else:
                        for e in L.vector(VEC):
                            stage[e] = T.Cast(dtype, 0)
                    store_fp32(qs_, r * QS + c0, stage, 0, qscale_)

    @T.macro
    def stage_kv(stage_, row_of_, at_, width_, kv_start_, kv_end_, tid_, rotate_, pos_base_, rope_scale_, rope_theta_):
        """KV_load, step 1: keys / values kv_start_.. (width_ wide, RoPE'd when rotate_) -> registers;
        zero from kv_end_ on."""
        row = T.alloc_buffer((1,), "int32", scope="local")
        for it in L.unroll(load_iters(BK, width_)):
            c = T.meta_var(it * NT + tid_)
            j = kv_start_ + c // chunks(width_)
            c0 = T.meta_var(c % chunks(width_) * VEC)  # inline, so 16-byte alignment stays provable
            if c < BK * chunks(width_) and j < kv_end_:
                row[0] = row_of_(j)
                if rotate_:
                    for e in L.unroll(VEC):
                        stage_[it * VEC + e] = T.Cast(dtype, rope_value(
                            lambda i: at_(row[0], i), c0 + e, pos_base_ + j, width_, rope_theta_, rope_scale_, scaling))
                else:
                    for e in kv_loop(VEC):
                        stage_[it * VEC + e] = at_(row[0], c0 + e)
            else:
                for e in L.vector(VEC):
                    stage_[it * VEC + e] = T.Cast(dtype, 0)

    @T.macro
    def commit_kv(stage_, smem_, width_, stride_, tid_):
        """KV_load, step 2: the staged rows -> shared memory in fp32."""
        for it in L.unroll(load_iters(BK, width_)):
            c = T.meta_var(it * NT + tid_)
            if c < BK * chunks(width_):
                store_fp32(smem_, c // chunks(width_) * stride_ + c % chunks(width_) * VEC, stage_, it * VEC,
                           T.float32(1))

    return load_q, stage_kv, commit_kv
