"""Batched prefill attention on CUDA cores and the CPU, MHA/GQA, over paged or ragged KV.

The kernels `prefill.paged_prefill` and the other prefills run where no tensor-core kernel
(prefill_sm80, prefill_sm90) serves a config, or a `PrefillSchedule` asks for them; prefill_sm80
also runs them for inline RoPE (rotary_mode 1).

One algorithm serves `paged_prefill` and `ragged_prefill` (they differ only in where key j
of a request lives: the functions `kv_row`, `k_at`, `v_at` passed to the shared macros) and
CPU and CUDA (the CPU runs the same code with one thread per block).

Work: a block owns one KV head and a tile of `tile_q` packed query rows of one request.
Packed row p of a request is query p // G, head kv_head * G + p % G (G = GQA group), so a
K/V tile is read once for all heads of the group.

Grid: blockIdx.x = tile slot * Hkv + kv head. Tile slots number the row tiles of all
requests in order; their count, ceil(total_q * G / tile_q) + B, bounds the real number of
tiles, and a block whose slot has no tile runs no step and writes nothing. A block finds
its request by walking qo_indptr (a loop of at most B steps). Within a request the tiles
are numbered from the last, so under causal masking the tiles that see the most keys
start first. (The grid size is an upper bound computed from shapes on the host; no plan
or workspace is needed.)

Per block:
  Q_load: the Q tile -> shared memory in fp32, scaled by sm_scale * log2(e) (RoPE'd when
    rotary_mode is 1), so scores are in the exp2 domain.
  for each K/V tile up to the last key the tile's last row may see:
    KV_load: K and V rows, staged in registers one tile ahead (16-byte loads), -> shared fp32
    S_gemm: S = Q K^T, a rows_per_thread x cols_per_thread register micro-tile per thread
    mask: only tiles that cross the causal diagonal or the end of the KV
    softmax: online softmax in fp32; row maxima over the threads_x threads of a row by warp
      shuffles; each thread keeps a partial denominator, summed at the end
    O_gemm: P (via shared memory) times V into per-thread fp32 output registers
  store: o = acc / l, lse = m + log2(l) (base 2); a row that saw no key gets o = 0 and
    lse = EMPTY_LSE.
The softmax state (init, update to a new max, finalize) is softmax.py's, shared with decode
and merge_state. rotary_mode selects one of two kernels on the host (with RoPE in Q_load and
KV_load, or without), so neither branches on it. The macros come from small factories, one
per phase, all in simt_tile.py (the MLA kernels share them): `load_macros` (Q_load, KV_load),
`find_tile_macro`,
`gemm_macros` (S_gemm, O_gemm) and `tile_softmax_macros` (mask, softmax, store);
`prefill_macros` composes them in `attend`. Sizes and index arithmetic are `_Tiling`'s.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from tvm import tirx
from tvm.script import tirx as T

from .common import CPU_SCRATCH_SCOPE, LOG2E, ceildiv, kv_chunk_len, loop_kinds, paged_position
from .config import AttentionConfig, RopeScaling
from .masks import is_tree, mask_of_request
from .prefill_contract import (
    paged_prefill_func,
    ragged_prefill_func,
    tree_paged_prefill_func,
    tree_ragged_prefill_func,
)
from .schedules import (
    CUDA_VECTOR_BYTES,
    PREFILL_P_ROW_PAD,
    PREFILL_ROW_PAD,
    PrefillSchedule,
    choose_prefill_schedule,
)
from .kv_quant import read_kv
from .prefill_cpu import cpu_attend_macro
from .simt_tile import find_tile_macro, gemm_macros, load_macros, out_col, tile_softmax_macros


class PrefillMacros(NamedTuple):
    """The shared algorithm: `find_tile` then `attend` (see the module docstring)."""

    num_slots: object
    find_tile: object
    attend: object


@dataclasses.dataclass(frozen=True)
class _Tiling:
    """Compile-time sizes of one CUDA-core prefill kernel (its config and schedule) and the
    index arithmetic on them."""

    gpu: bool
    dtype: str
    G: int  # GQA group size
    scaling: RopeScaling | None
    D_QK: int
    D_V: int
    TY: int  # threads along a tile's rows (threadIdx.y)
    TX: int  # threads along a row (threadIdx.x)
    TM: int  # query rows per thread
    TN: int  # keys (score columns) per thread
    BQ: int  # packed query rows per tile
    BK: int  # keys per K/V tile
    NT: int  # threads per block
    VEC: int  # elements per 16-byte global load
    QS: int  # shared-memory row strides of Q, K, V and P (padded)
    KS: int
    VS: int
    PS: int
    OC: int  # output columns per thread
    shared: str  # scope of the tiles: "shared.dyn" on CUDA
    KV_FP8: bool = False  # the pages hold FP8 codes (kv_quant), staged element by element
    VL: int = 0  # the schedule's vector_lanes (prefill_cpu.py), 0: the scalar tile
    SR: int = 1  # the schedule's score_rows (prefill_cpu.py)

    @classmethod
    def of(cls, config: AttentionConfig, sched: PrefillSchedule) -> "_Tiling":
        D_QK, D_V, BK = config.head_dim, config.v_head_dim, sched.tile_kv
        return cls(
            gpu=config.is_gpu, dtype=config.dtype, G=config.group_size, scaling=config.rope_scaling,
            D_QK=D_QK, D_V=D_V, TY=sched.threads_y, TX=sched.threads_x, TM=sched.rows_per_thread,
            TN=sched.cols_per_thread, BQ=sched.tile_q, BK=BK, NT=sched.num_threads,
            VEC=CUDA_VECTOR_BYTES // config.elem_bytes, QS=D_QK + PREFILL_ROW_PAD, KS=D_QK + PREFILL_ROW_PAD,
            VS=D_V + PREFILL_ROW_PAD, PS=BK + PREFILL_P_ROW_PAD, OC=D_V // sched.threads_x,
            shared="shared.dyn" if config.is_gpu else CPU_SCRATCH_SCOPE, KV_FP8=config.kv_fp8,
            VL=sched.vector_lanes, SR=sched.score_rows,
        )

    def row_tiles(self, qo_indptr, b):
        return ceildiv((qo_indptr[b + 1] - qo_indptr[b]) * self.G, self.BQ)

    def num_slots(self, total_q, batch):
        """Upper bound of the number of row tiles over all requests."""
        return ceildiv(total_q * self.G, self.BQ) + batch

    def chunks(self, width):
        """16-byte chunks of a row of `width` elements."""
        return width // self.VEC

    def load_iters(self, rows, width):
        """Steps for NT threads to load `rows` rows of `width` elements, a chunk each."""
        return ceildiv(rows * self.chunks(width), self.NT)

    def out_col(self, tx, c):
        """Output column of a thread's c-th output register."""
        return out_col(self.TX, tx, c)

    def visible_end(self, kv_len, qo_len, p, causal):
        """Number of leading keys packed row p may see (all of them when not causal). `causal`
        is the causal flag or a token tree's `TreeMask` (within the causal bound)."""
        last = kv_len - qo_len + T.min(p // self.G, qo_len - 1) + 1
        if is_tree(causal):
            return T.max(T.min(last, kv_len), 0)
        return T.if_then_else(causal != 0, T.max(T.min(last, kv_len), 0), kv_len)

    def unmasked_end(self, kv_len, qo_len, p0, causal):
        """Keys every row of the tile from packed row p0 on sees: no mask is needed below."""
        if is_tree(causal):
            return T.min(self.visible_end(kv_len, qo_len, p0, causal), causal.history(kv_len))
        return self.visible_end(kv_len, qo_len, p0, causal)

    def hidden(self, j, kv_len, qo_len, p, causal):
        """Whether key j is masked for packed row p."""
        if is_tree(causal):
            return tirx.any(j >= self.visible_end(kv_len, qo_len, p, causal),
                            causal.hides(j, p // self.G, kv_len, qo_len))
        return j >= self.visible_end(kv_len, qo_len, p, causal)


def prefill_macros(config: AttentionConfig, sched: PrefillSchedule) -> PrefillMacros:
    """The shared algorithm for `sched` (find_tile, attend; see the module docstring)."""
    dims = _Tiling.of(config, sched)
    L = loop_kinds(config)
    dtype, G, D_QK, D_V = dims.dtype, dims.G, dims.D_QK, dims.D_V
    TX, TM, TN, BQ, BK = dims.TX, dims.TM, dims.TN, dims.BQ, dims.BK
    QS, KS, VS, PS, OC, VEC, shared = dims.QS, dims.KS, dims.VS, dims.PS, dims.OC, dims.VEC, dims.shared
    load_q, stage_kv, commit_kv = load_macros(dims, L)
    s_gemm, o_gemm = gemm_macros(dims, L)
    init, mask, softmax, store = tile_softmax_macros(dims, L)

    @T.macro
    def sync_threads():
        """Block-wide barrier (CUDA only: the CPU runs one thread per block)."""
        if dims.gpu:
            T.tvm_storage_sync(shared)

    @T.macro
    def attend(q_at_, q_pos_at_, kv_row_, k_at_, v_at_, k_pos_base_, write_o_, write_lse_, qo_len_, kv_len_, tile_,
               causal_, rotate_, rope_scale_, rope_theta_, sm_scale_, ty_, tx_):
        """Attention of row tile tile_ of one request and KV head.

        q_at_(p, d): element d of packed row p's query; q_pos_at_(p): its RoPE position.
        kv_row_(j): where key j lives (an int32 handle); k_at_(row, d) / v_at_(row, d): element d
        of the key / value at that handle; key j is at RoPE position k_pos_base_ + j.
        write_o_(p, d, value) and write_lse_(p, value) store the results of packed row p.
        rotate_ (a Python bool) applies RoPE to q and k: two kernels, no branch in the loop.
        """
        qs = T.alloc_buffer((BQ * QS,), "float32", scope=shared)
        ks = T.alloc_buffer((BK * KS,), "float32", scope=shared)
        vs = T.alloc_buffer((BK * VS,), "float32", scope=shared)
        ps = T.alloc_buffer((BQ * PS,), "float32", scope=shared)
        k_stage = T.alloc_buffer((dims.load_iters(BK, D_QK) * VEC,), dtype, scope=L.local)
        v_stage = T.alloc_buffer((dims.load_iters(BK, D_V) * VEC,), dtype, scope=L.local)
        s = T.alloc_buffer((TM * TN,), "float32", scope=L.local)
        o = T.alloc_buffer((TM * OC,), "float32", scope=L.local)
        m_run = T.alloc_buffer((TM,), "float32", scope=L.local)
        l_run = T.alloc_buffer((TM,), "float32", scope=L.local)
        tid = T.meta_var(ty_ * TX + tx_)
        qo_len = qo_len_  # bound once: the arguments may be expressions that read memory
        kv_len = kv_len_
        k_pos_base = k_pos_base_
        # A block without a tile (tile_ < 0) runs no step and writes nothing: no branch
        # around the whole body, as TVM inserts no barrier inside a condition.
        rows = T.if_then_else(tile_ >= 0, qo_len * G, 0)
        p0 = T.max(tile_, 0) * BQ
        # Keys seen by every row of the tile (no mask needed below) and by its last row.
        free_end = dims.unmasked_end(kv_len, qo_len, p0, causal_)
        kv_end = T.if_then_else(tile_ >= 0, dims.visible_end(kv_len, qo_len, p0 + BQ - 1, causal_), 0)
        init(m_run, l_run, o, TM, OC)
        load_q(q_at_, q_pos_at_, qs, rows, p0, tid, rotate_, rope_scale_, rope_theta_, sm_scale_ * T.float32(LOG2E))
        stage_kv(k_stage, kv_row_, k_at_, D_QK, 0, kv_end, tid, rotate_, k_pos_base, rope_scale_, rope_theta_)
        stage_kv(v_stage, kv_row_, v_at_, D_V, 0, kv_end, tid, False, k_pos_base, rope_scale_, rope_theta_)
        for t in T.serial(ceildiv(kv_end, BK)):
            sync_threads()
            commit_kv(k_stage, ks, D_QK, KS, tid)
            commit_kv(v_stage, vs, D_V, VS, tid)
            sync_threads()
            if (t + 1) * BK < kv_end:
                stage_kv(k_stage, kv_row_, k_at_, D_QK, (t + 1) * BK, kv_end, tid, rotate_, k_pos_base,
                         rope_scale_, rope_theta_)
                stage_kv(v_stage, kv_row_, v_at_, D_V, (t + 1) * BK, kv_end, tid, False, k_pos_base,
                         rope_scale_, rope_theta_)
            s_gemm(qs, ks, s, ty_, tx_)
            # TVM's barrier planner sees the dynamic shared pool as one buffer, so it wants a
            # barrier between the S_gemm reads and the P writes; place it here explicitly.
            sync_threads()
            if (t + 1) * BK > free_end:
                mask(s, lambda p, j: dims.hidden(t * BK + j, kv_len, qo_len, p, causal_), p0, ty_, tx_)
            softmax(s, ps, o, m_run, l_run, ty_, tx_)
            sync_threads()
            o_gemm(ps, vs, o, ty_, tx_)
        store(o, m_run, l_run, rows, p0, ty_, tx_, write_o_, write_lse_)

    if dims.VL:
        attend = cpu_attend_macro(dims, L, attend)
    return PrefillMacros(dims.num_slots, find_tile_macro(dims.row_tiles), attend)


def schedule_for(config: AttentionConfig, schedule: PrefillSchedule | None) -> PrefillSchedule:
    """`schedule` (default: `schedules.choose_prefill_schedule`), checked against `config`."""
    sched = schedule or choose_prefill_schedule(config)
    sched.check(config)
    return sched


def paged_kernel(config: AttentionConfig, sched: PrefillSchedule):
    """The CUDA-core paged kernel macro (prefill_contract's paged argument order); its mask
    argument is the causal flag or `masks.TreeMasks`."""
    macros = prefill_macros(config, sched)
    L = loop_kinds(config)
    dtype, ps = config.dtype, config.page_size
    Hkv, G = config.num_kv_heads, config.group_size
    TY, TX, sliding = sched.threads_y, sched.threads_x, config.sliding_window

    @T.macro
    def kernel(Q_, qo_indptr_, pages_, page_indptr_, page_indices_, length_info_, k_pos_, q_pos_, O_, lse_, causal_,
               rotate_, rope_scale_, rope_theta_, sm_scale_):
        """One block per (tile slot, KV head); see the module docstring."""
        for blk in L.block(macros.num_slots(Q_.shape[0], k_pos_.shape[0]) * Hkv, "x", outer=True):
            for ty in L.thread(TY, "y"):
                for tx in L.thread(TX, "x"):
                    req = T.alloc_buffer((1,), "int32", scope=L.local)
                    tile = T.alloc_buffer((1,), "int32", scope=L.local)
                    macros.find_tile(qo_indptr_, k_pos_.shape[0], blk // Hkv, req, tile)
                    b = req[0]
                    hkv = blk % Hkv
                    q0 = qo_indptr_[b]
                    page0 = page_indptr_[b]
                    macros.attend(
                        lambda p, d: Q_[q0 + p // G, hkv * G + p % G, d],
                        lambda p: q_pos_[q0 + p // G],
                        # A key's handle is its slot in the page pool: page id * page_size + offset.
                        lambda j: page_indices_[page0 + paged_position(j, length_info_, b, sliding) // ps] * ps
                        + paged_position(j, length_info_, b, sliding) % ps,
                        lambda slot, d: read_kv(config, pages_, 0, hkv, slot // ps, slot % ps, d),
                        lambda slot, d: read_kv(config, pages_, 1, hkv, slot // ps, slot % ps, d),
                        k_pos_[b],
                        lambda p, d, val: T.buffer_store(O_, T.Cast(dtype, val), [q0 + p // G, hkv * G + p % G, d]),
                        lambda p, val: T.buffer_store(lse_, val, [q0 + p // G, hkv * G + p % G]),
                        qo_indptr_[b + 1] - q0,
                        kv_chunk_len(page_indptr_[b + 1] - page0, ps, length_info_, b, sliding),
                        tile[0], mask_of_request(causal_, b), rotate_, rope_scale_, rope_theta_, sm_scale_, ty, tx,
                    )

    return kernel


def ragged_kernel(config: AttentionConfig, sched: PrefillSchedule):
    """The CUDA-core ragged kernel macro (prefill_contract's ragged argument order); its mask
    argument is the causal flag or `masks.TreeMasks`."""
    macros = prefill_macros(config, sched)
    L = loop_kinds(config)
    dtype, Hkv, G = config.dtype, config.num_kv_heads, config.group_size
    TY, TX = sched.threads_y, sched.threads_x

    @T.macro
    def kernel(Q_, qo_indptr_, K_, V_, kv_indptr_, q_pos_, k_pos_, O_, lse_, causal_, rotate_, rope_scale_, rope_theta_,
               sm_scale_):
        """One block per (tile slot, KV head); see the module docstring."""
        for blk in L.block(macros.num_slots(Q_.shape[0], k_pos_.shape[0]) * Hkv, "x", outer=True):
            for ty in L.thread(TY, "y"):
                for tx in L.thread(TX, "x"):
                    req = T.alloc_buffer((1,), "int32", scope=L.local)
                    tile = T.alloc_buffer((1,), "int32", scope=L.local)
                    macros.find_tile(qo_indptr_, k_pos_.shape[0], blk // Hkv, req, tile)
                    b = req[0]
                    hkv = blk % Hkv
                    q0 = qo_indptr_[b]
                    kv0 = kv_indptr_[b]
                    macros.attend(
                        lambda p, d: Q_[q0 + p // G, hkv * G + p % G, d],
                        lambda p: q_pos_[q0 + p // G],
                        lambda j: kv0 + j,
                        lambda row, d: K_[row, hkv, d],
                        lambda row, d: V_[row, hkv, d],
                        k_pos_[b],
                        lambda p, d, val: T.buffer_store(O_, T.Cast(dtype, val), [q0 + p // G, hkv * G + p % G, d]),
                        lambda p, val: T.buffer_store(lse_, val, [q0 + p // G, hkv * G + p % G]),
                        qo_indptr_[b + 1] - q0,
                        kv_indptr_[b + 1] - kv0,
                        tile[0], mask_of_request(causal_, b), rotate_, rope_scale_, rope_theta_, sm_scale_, ty, tx,
                    )

    return kernel


def paged_prefill_simt(config: AttentionConfig, schedule: PrefillSchedule | None = None):
    """The CUDA-core (and CPU) body of `prefill.paged_prefill` (its arguments and symbol)."""
    if config.v_head_dim != config.head_dim:
        raise ValueError(
            f"v_head_dim={config.v_head_dim} is not supported by paged_prefill: expected head_dim={config.head_dim}"
        )
    return paged_prefill_func(config, paged_kernel(config, schedule_for(config, schedule)))


def ragged_prefill_simt(config: AttentionConfig, schedule: PrefillSchedule | None = None):
    """The CUDA-core (and CPU) body of `prefill.ragged_prefill` (its arguments and symbol)."""
    return ragged_prefill_func(config, ragged_kernel(config, schedule_for(config, schedule)))


def tree_paged_prefill_simt(config: AttentionConfig, schedule: PrefillSchedule | None = None):
    """The CUDA-core (and CPU) body of `prefill.tree_mask_paged_prefill` (TVM's `tree_attn_paged_kv`)."""
    return tree_paged_prefill_func(config, paged_kernel(config, schedule_for(config, schedule)))


def tree_ragged_prefill_simt(config: AttentionConfig, schedule: PrefillSchedule | None = None):
    """The CUDA-core (and CPU) body of `prefill.tree_mask_ragged_prefill` (TVM's `batch_tree_attn`)."""
    return tree_ragged_prefill_func(config, ragged_kernel(config, schedule_for(config, schedule)))
