"""Tensor-core prefill for sm_80..sm_89 (Ampere/Ada): paged and ragged, fp16 and bf16.

`paged_prefill_mma` / `ragged_prefill_mma` return PrimFuncs with exactly the parameters,
argument order, shapes, semantics and global symbols of `paged_prefill` / `ragged_prefill`
(tir_kernels/prefill.py; their docstrings are the contract), computed FlashAttention-2 style
with `mma.sync.aligned.m16n8k16` and fp32 accumulation. The code also runs on sm_90 (mma.sync
is valid there), which is how the GPU tests exercise it on the H200.

Work mapping and grid are prefill_simt.py's: blockIdx.x = tile slot * Hkv + kv head, the slot's
request and row tile found by `find_tile` (tiles of a request numbered from the last, so the
tiles that see most keys start first). A block of `warps` warps owns tile_q = warps *
rows_per_warp packed query rows (packed row p = query p // G, head kv_head * G + p % G) of one
request and one KV head; warp w owns rows_per_warp (16 or 32: one or two m16 MMA tiles)
consecutive rows from w * rows_per_warp.

Per block (all data movement 16-byte `cp.async`, into XOR-swizzled shared tiles):
  load_q: the Q tile -> shared (rows past the request zero-filled); with
    `q_in_registers`, each warp then keeps its A fragments in registers (ldmatrix).
  load_kv: K and V rows of one tile of tile_kv keys, gathered through `kv_row(j)` (the page
    table, or kv_indptr for ragged); rows past the last visible key are zero-filled, so junk
    (NaN) in unowned page slots never reaches the math. `stages` = 2: the next tile is loaded
    while this one is computed.
  s_mma: S = Q K^T per warp (rows_per_warp x tile_kv, fp32 accumulators; K fragments by
    ldmatrix, each used for every m16 tile of the warp).
  mask: scores past the end or above the causal diagonal -> lowest float, only on tiles that
    need it.
  softmax: online softmax in registers, scores scaled by sm_scale * log2(e) and exponentiated
    with exp2; each row lives in the 4 lanes of a quad, maxima by two shuffles.
  pv_mma: O += P V: the S accumulators of two adjacent 8-key blocks, packed to fp16/bf16
    pairs, are exactly the A fragment of one k16 step (P never leaves registers); V fragments
    by ldmatrix.trans.
  store: o = acc / l, lse = m + log2(l) (base 2); a row that sees no key gets o = 0 and
    lse = EMPTY_LSE.

rotary_mode == 1 (RoPE inside the kernel) is served by prefill_simt.py's CUDA-core kernel: the
PrimFunc holds both kernels and picks one on the host, as prefill_simt.py does for its variants.
"""


from __future__ import annotations

import dataclasses

from tvm import tirx
from tvm.script import tirx as T

from .common import EMPTY_LSE, LOG2E, ceildiv, kv_chunk_len, loop_kinds, paged_position
from .config import AttentionConfig
from .masks import is_tree, mask_of_request
from .mma import CHUNK, FULL_WARP, LDSM, LDSM_T, MIN_ARCH, MMA_DTYPES, ROWS_PER_MMA, Tile, mma_name, pack_name
from .prefill_contract import (
    paged_prefill_func,
    ragged_prefill_func,
    tree_paged_prefill_func,
    tree_ragged_prefill_func,
)
from .prefill_simt import prefill_macros, schedule_for
from .schedules import (
    CUDA_DEFAULT_SHARED_BYTES,
    CUDA_MAX_SHARED_BYTES,
    PrefillSchedule,
    choose_prefill_schedule,
)
from .softmax import finalize_lse, finalize_scale, prob, rescale_factor

# Registers per thread the S / O accumulators and Q fragments may take: the rest of the 255 a
# thread has holds addresses and the softmax state without spilling.
MAX_FRAGMENT_REGISTERS = 192


def _require(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(f"invalid schedule: {what}")


@dataclasses.dataclass(frozen=True)
class MmaPrefillSchedule:
    """Tiling of `paged_prefill_mma` / `ragged_prefill_mma`.

    warps: warps per block.
    rows_per_warp: packed query rows each warp owns, 16 or 32 (one or two m16 MMA tiles: 32
      reuses each K / V fragment for twice the MMAs, at twice the S and O registers);
      tile_q = rows_per_warp * warps.
    tile_kv: keys per step (a multiple of 16).
    stages: K/V tiles in shared memory (2: the next tile loads while this one is computed).
    q_in_registers: keep each warp's Q fragments in registers for the whole loop (fewer
      shared reads; 4 * head_dim / 16 registers per thread) instead of reading them per step.
    """

    warps: int = 4
    rows_per_warp: int = 16
    tile_kv: int = 64
    stages: int = 2
    q_in_registers: bool = True

    def __post_init__(self):
        _require(1 <= self.warps <= 16, f"warps={self.warps} must be 1..16")
        _require(self.rows_per_warp in (16, 32), f"rows_per_warp={self.rows_per_warp} must be 16 or 32")
        _require(self.tile_kv >= 16 and self.tile_kv % 16 == 0, f"tile_kv={self.tile_kv} must be a multiple of 16")
        _require(self.stages in (1, 2), f"stages={self.stages} must be 1 or 2")

    @property
    def tile_q(self) -> int:
        return self.rows_per_warp * self.warps

    @property
    def num_threads(self) -> int:
        return 32 * self.warps

    def shared_bytes(self, config: AttentionConfig) -> int:
        """Q tile plus `stages` K and V tiles, 16-bit elements, rows as laid out (see mma.Tile)."""
        q = self.tile_q * Tile(config.head_dim).stride
        kv = self.stages * self.tile_kv * (Tile(config.head_dim).stride + Tile(config.v_head_dim).stride)
        return 2 * (q + kv)

    def fragment_registers(self, config: AttentionConfig) -> int:
        """32-bit registers per thread held across the loop: the S and O accumulators (4 per
        m16n8 tile) and, with q_in_registers, the Q fragments (4 per m16k16 tile)."""
        m_tiles = self.rows_per_warp // ROWS_PER_MMA
        q = m_tiles * config.head_dim // 16 * 4 if self.q_in_registers else 0
        return m_tiles * (self.tile_kv + config.v_head_dim) // 8 * 4 + q

    def check(self, config: AttentionConfig) -> None:
        _require(
            self.fragment_registers(config) <= MAX_FRAGMENT_REGISTERS,
            f"rows_per_warp={self.rows_per_warp}, tile_kv={self.tile_kv}, q_in_registers={self.q_in_registers} hold"
            f" {self.fragment_registers(config)} fragment registers per thread with head_dim={config.head_dim},"
            f" v_head_dim={config.v_head_dim}; at most {MAX_FRAGMENT_REGISTERS} leave room under the 255 limit",
        )
        limit = CUDA_MAX_SHARED_BYTES.get(config.cuda_arch, CUDA_DEFAULT_SHARED_BYTES)
        _require(
            self.shared_bytes(config) <= limit,
            f"tile_q={self.tile_q}, tile_kv={self.tile_kv}, stages={self.stages} need {self.shared_bytes(config)}"
            f" bytes of shared memory, {config.cuda_arch} has {limit}",
        )


def choose_mma_prefill_schedule(config: AttentionConfig) -> MmaPrefillSchedule:
    """4 warps per block, 64 keys per step. Head dims up to 64: 32 rows per warp (128-row
    tiles), Q fragments read from shared memory per step (128 fragment registers; with them
    in registers too a thread would need every register it has). Up to 128: 16 rows per warp
    (64-row tiles), Q fragments in registers (128 fragment registers; 80 KiB of shared memory
    at d128).
    Above 128: 32 keys per step and Q fragments read from shared memory per step, so the O
    accumulators (4 * v_head_dim / 8 registers) fit and shared memory stays at 96 KiB (Ada's
    99 KiB limit)."""
    width = max(config.head_dim, config.v_head_dim)
    if width <= 64:
        return MmaPrefillSchedule(warps=4, rows_per_warp=32, tile_kv=64, stages=2, q_in_registers=False)
    if width <= 128:
        return MmaPrefillSchedule(warps=4, rows_per_warp=16, tile_kv=64, stages=2, q_in_registers=True)
    return MmaPrefillSchedule(warps=4, rows_per_warp=16, tile_kv=32, stages=2, q_in_registers=False)


def _check_config(config: AttentionConfig, generator: str) -> None:
    if config.dtype not in MMA_DTYPES:
        raise ValueError(
            f"dtype={config.dtype!r} is not supported by {generator}: expected one of {tuple(MMA_DTYPES)}"
            " (tensor-core prefill; paged_prefill / ragged_prefill serve float32)"
        )
    if config.sm_version < MIN_ARCH:
        raise ValueError(
            f"target={config.target!r} is not supported by {generator}: expected a CUDA target of sm_{MIN_ARCH}"
            " or newer"
        )


def mma_problem(config: AttentionConfig) -> str | None:
    """Why the mma.sync prefill cannot serve `config`, or None when it can (`_check_config`'s
    conditions)."""
    if config.dtype not in MMA_DTYPES:
        return f"dtype={config.dtype!r} (tensor cores serve {tuple(MMA_DTYPES)})"
    if config.sm_version < MIN_ARCH:
        return f"target={config.target!r} (mma.sync needs a CUDA target of sm_{MIN_ARCH} or newer)"
    return None


def _acc(m, blocks, nb):
    """Index of the first of the 4 accumulator registers of m16 tile m, n8 block nb (of
    `blocks` per m16 tile): registers +0, +1 hold row g, +2, +3 row g + 8 (g = lane / 4)."""
    return (m * blocks + nb) * 4


def _row_of(r):
    """Row of this thread's accumulator row r (0 .. 2M-1) relative to its first: r = 2m + h
    is row g + 8h of m16 tile m."""
    return r // 2 * ROWS_PER_MMA + r % 2 * 8


class _Layout:
    """Compile-time sizes of one mma.sync prefill kernel (its config and schedule), the regions
    of its shared buffer, and the masks' bounds. Every name __init__ binds is an attribute; the
    macro factories below unpack the ones their macros read."""

    def __init__(self, config: AttentionConfig, sched: MmaPrefillSchedule):
        dtype, G = config.dtype, config.group_size
        D_QK, D_V = config.head_dim, config.v_head_dim
        BQ, BK, NT, STAGES = sched.tile_q, sched.tile_kv, sched.num_threads, sched.stages
        QT, KT, VT = Tile(D_QK), Tile(D_QK), Tile(D_V)
        KSTEPS_QK, KSTEPS_PV = D_QK // 16, BK // 16  # k16 steps of S = QK^T and of O += PV
        SN, ON = BK // 8, D_V // 8  # n8 blocks of S and of O
        MMA, PACK = mma_name(dtype), pack_name(dtype)
        shared = "shared.dyn"
        Q_OFF, K_OFF = 0, BQ * QT.stride  # element offsets of the regions of the shared buffer
        V_OFF = K_OFF + STAGES * BK * KT.stride
        SMEM_ELEMS = V_OFF + STAGES * BK * VT.stride
        M, RW = sched.rows_per_warp // ROWS_PER_MMA, sched.rows_per_warp  # m16 tiles and rows per warp

        vars(self).update((name, value) for name, value in locals().items() if name != "self")

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


def _load_macros(lay: _Layout, L):
    """Loads: copy_rows, load_q (Q -> shared), load_kv (a K/V tile -> a stage) and
    load_q_frag (Q's A fragments)."""
    BK, BQ, KT, K_OFF, NT, QT, Q_OFF, VT = lay.BK, lay.BQ, lay.KT, lay.K_OFF, lay.NT, lay.QT, lay.Q_OFF, lay.VT
    V_OFF, dtype = lay.V_OFF, lay.dtype

    @T.macro
    def copy_rows(smem_, tile_, rows_, handle_, valid_, dst0_, src0_, dst1_, src1_, tid_):
        """cp.async `rows_` rows of tile_.chunks chunks each into smem_: row r of the tile at
        element offset dst0_ from src0_(handle_(r), element) (and at dst1_ from src1_ unless
        src1_ is None: K and V share the row handle), when valid_(r); zeros otherwise, so
        nothing past the end is read."""
        handle = T.alloc_buffer((1,), "int32", scope="local")
        for it in L.unroll(ceildiv(rows_ * tile_.chunks, NT)):
            c = T.meta_var(it * NT + tid_)
            r = T.meta_var(c // tile_.chunks)
            off = T.meta_var(tile_.offset(r, c % tile_.chunks))
            if rows_ * tile_.chunks % NT == 0 or c < rows_ * tile_.chunks:
                if valid_(r):
                    handle[0] = handle_(r)
                    T.ptx["cp.async.cg.shared.global"](
                        smem_.ptr_to([dst0_ + off]), T.address_of(src0_(handle[0], c % tile_.chunks * CHUNK)), 16)
                    if src1_ is not None:
                        T.ptx["cp.async.cg.shared.global"](
                            smem_.ptr_to([dst1_ + off]), T.address_of(src1_(handle[0], c % tile_.chunks * CHUNK)), 16)
                else:
                    for e in L.vector(CHUNK):
                        smem_[dst0_ + off + e] = T.Cast(dtype, 0)
                    if src1_ is not None:
                        for e in L.vector(CHUNK):
                            smem_[dst1_ + off + e] = T.Cast(dtype, 0)

    @T.macro
    def load_q(q_at_, smem_, rows_, p0_, tid_):
        """load_q: packed rows p0_.. of Q -> the Q region; zeros past rows_."""
        copy_rows(smem_, QT, BQ, lambda r: p0_ + r, lambda r: p0_ + r < rows_, Q_OFF, q_at_, 0, None, tid_)

    @T.macro
    def load_kv(kv_row_, k_at_, v_at_, smem_, stage_, kv_start_, kv_end_, tid_):
        """load_kv: keys / values kv_start_.. -> stage stage_ of the K / V regions; zeros from
        kv_end_ on."""
        if KT.chunks == VT.chunks:
            copy_rows(smem_, KT, BK, lambda r: kv_row_(kv_start_ + r), lambda r: kv_start_ + r < kv_end_,
                      K_OFF + stage_ * BK * KT.stride, k_at_, V_OFF + stage_ * BK * VT.stride, v_at_, tid_)
        else:
            copy_rows(smem_, KT, BK, lambda r: kv_row_(kv_start_ + r), lambda r: kv_start_ + r < kv_end_,
                      K_OFF + stage_ * BK * KT.stride, k_at_, 0, None, tid_)
            copy_rows(smem_, VT, BK, lambda r: kv_row_(kv_start_ + r), lambda r: kv_start_ + r < kv_end_,
                      V_OFF + stage_ * BK * VT.stride, v_at_, 0, None, tid_)

    @T.macro
    def load_q_frag(smem_, qf_, base_, kk_, row0_, lane_):
        """A fragment of Q for k16 step kk_ of the 16 rows from row0_ -> qf_[base_..base_+3]."""
        T.ptx[LDSM](qf_[base_], qf_[base_ + 1], qf_[base_ + 2], qf_[base_ + 3],
                    smem_.ptr_to([Q_OFF + QT.offset(row0_ + lane_ % 16, kk_ * 2 + lane_ // 16)]))

    return load_q, load_kv, load_q_frag


def _mma_macros(lay: _Layout, L):
    """The products: s_mma (S = Q K^T) and pv_mma (O += P V)."""
    sched, BK, KSTEPS_PV, KSTEPS_QK, KT, K_OFF = lay.sched, lay.BK, lay.KSTEPS_PV, lay.KSTEPS_QK, lay.KT, lay.K_OFF
    M, MMA, ON, PACK, RW, SN, VT, V_OFF = lay.M, lay.MMA, lay.ON, lay.PACK, lay.RW, lay.SN, lay.VT, lay.V_OFF
    acc = _acc
    load_q_frag = _load_macros(lay, L)[2]

    @T.macro
    def s_mma(smem_, qf_, s_, stage_, warp_, lane_):
        """s_mma: s_ <- Q K^T of this warp's rows and the tile's BK keys."""
        kf = T.alloc_buffer((4,), "uint32", scope="local")
        qk = T.alloc_buffer((M * 4,), "uint32", scope="local")
        for i in L.unroll(M * SN * 4):
            s_[i] = T.float32(0)
        for kk in L.unroll(KSTEPS_QK):
            if not sched.q_in_registers:
                for m in L.unroll(M):
                    load_q_frag(smem_, qk, m * 4, kk, warp_ * RW + m * 16, lane_)
            for np_ in L.unroll(SN // 2):
                T.ptx[LDSM](kf[0], kf[1], kf[2], kf[3], smem_.ptr_to([
                    K_OFF + stage_ * BK * KT.stride
                    + KT.offset(np_ * 16 + lane_ % 8 + lane_ // 16 * 8, kk * 2 + lane_ // 8 % 2)]))
                for m in L.unroll(M):
                    for h in L.unroll(2):
                        n = T.meta_var(acc(m, SN, np_ * 2 + h))
                        a = T.meta_var((m * KSTEPS_QK + kk) * 4 if sched.q_in_registers else m * 4)
                        if sched.q_in_registers:
                            T.ptx[MMA](s_[n], s_[n + 1], s_[n + 2], s_[n + 3], qf_[a], qf_[a + 1], qf_[a + 2],
                                       qf_[a + 3], kf[h * 2], kf[h * 2 + 1], s_[n], s_[n + 1], s_[n + 2], s_[n + 3])
                        else:
                            T.ptx[MMA](s_[n], s_[n + 1], s_[n + 2], s_[n + 3], qk[a], qk[a + 1], qk[a + 2],
                                       qk[a + 3], kf[h * 2], kf[h * 2 + 1], s_[n], s_[n + 1], s_[n + 2], s_[n + 3])

    @T.macro
    def pv_mma(s_, smem_, o_, stage_, lane_):
        """pv_mma: o_ += P V, P from the S accumulators packed to 16-bit pairs."""
        pf = T.alloc_buffer((M * 4,), "uint32", scope="local")
        vf = T.alloc_buffer((4,), "uint32", scope="local")
        for kk in L.unroll(KSTEPS_PV):
            for m in L.unroll(M):
                for i in L.unroll(4):  # a0..a3: rows g / g+8 of key blocks 2kk and 2kk+1
                    T.ptx[PACK](pf[m * 4 + i], s_[acc(m, SN, kk * 2 + i // 2) + i % 2 * 2 + 1],
                                s_[acc(m, SN, kk * 2 + i // 2) + i % 2 * 2])
            for np_ in L.unroll(ON // 2):
                T.ptx[LDSM_T](vf[0], vf[1], vf[2], vf[3], smem_.ptr_to([
                    V_OFF + stage_ * BK * VT.stride
                    + VT.offset(kk * 16 + lane_ % 8 + lane_ // 8 % 2 * 8, np_ * 2 + lane_ // 16)]))
                for m in L.unroll(M):
                    for h in L.unroll(2):
                        n = T.meta_var(acc(m, ON, np_ * 2 + h))
                        T.ptx[MMA](o_[n], o_[n + 1], o_[n + 2], o_[n + 3], pf[m * 4], pf[m * 4 + 1], pf[m * 4 + 2],
                                   pf[m * 4 + 3], vf[h * 2], vf[h * 2 + 1], o_[n], o_[n + 1], o_[n + 2], o_[n + 3])

    return s_mma, pv_mma


def _mask_macros(lay: _Layout, L):
    """Masks: mask (causal / end), tree_rows and tree_mask (token trees)."""
    G, M, SN, visible_end = lay.G, lay.M, lay.SN, lay.visible_end
    acc, row_of = _acc, _row_of

    @T.macro
    def mask(s_, kv_start_, kv_len_, qo_len_, p_, causal_, lane_):
        """Scores of keys past kv_len_ or above the causal diagonal -> lowest float.
        p_: packed row of this thread's first accumulator row (see `row_of`)."""
        for r in L.unroll(2 * M):
            for nb in L.unroll(SN):
                for e in L.unroll(2):
                    if kv_start_ + nb * 8 + lane_ % 4 * 2 + e >= visible_end(kv_len_, qo_len_, p_ + row_of(r), causal_):
                        s_[acc(r // 2, SN, nb) + r % 2 * 2 + e] = T.min_value("float32")

    @T.macro
    def tree_rows(tree_, kv_len_, qo_len_, p_, vis_end_, q_begin_, keys_):
        """Per-row and per-block values of the tree mask, hoisted out of the KV loop: for the
        thread's rows r (packed row p_ + row_of(r)), vis_end_[r] <- its causal bound and
        q_begin_[r] <- the DFS begin of its node; keys_ <- [history, node of key 0]."""
        keys_[0] = tree_.history(kv_len_)
        keys_[1] = tree_.key0_node(kv_len_)
        for r in L.unroll(2 * M):
            vis_end_[r] = visible_end(kv_len_, qo_len_, p_ + row_of(r), tree_)
            q_begin_[r] = 0
            if tree_.tree_len() > 0:
                q_begin_[r] = tree_.key_span(tree_.query_node((p_ + row_of(r)) // G, qo_len_), 0)

    @T.macro
    def tree_mask(s_, kv_start_, tree_, vis_end_, q_begin_, keys_, lane_):
        """`mask` under a token tree: keys past a row's causal bound, and keys past the history
        that are not the row's node or an ancestor of it -> lowest float. The interval of each
        of the thread's key columns is read once for all its rows."""
        span = T.alloc_buffer((2,), "int32", scope="local")
        for nb in L.unroll(SN):
            for e in L.unroll(2):
                j = T.meta_var(kv_start_ + nb * 8 + lane_ % 4 * 2 + e)
                span[0] = T.int32(-2147483647)  # keys of the history: an interval holding every node
                span[1] = T.int32(2147483647)
                if j >= keys_[0] and j < vis_end_[2 * M - 1]:
                    span[0] = tree_.key_span(keys_[1] + j, 0)
                    span[1] = tree_.key_span(keys_[1] + j, 1)
                for r in L.unroll(2 * M):
                    if tirx.any(j >= vis_end_[r], q_begin_[r] < span[0], q_begin_[r] >= span[1]):
                        s_[acc(r // 2, SN, nb) + r % 2 * 2 + e] = T.min_value("float32")

    return mask, tree_rows, tree_mask


def _softmax_macros(lay: _Layout, L):
    """softmax (online, in registers) and store (o = acc / l, lse)."""
    M, ON, SN = lay.M, lay.ON, lay.SN
    acc, row_of = _acc, _row_of

    @T.macro
    def softmax(s_, o_, m_run_, l_run_):
        """Online softmax of this thread's 2 * M rows: rescale the state to the new row maxima,
        s_ -> P = exp2(s_ - m) (unnormalised; l_run_ keeps this thread's partial sums)."""
        m_new = T.alloc_buffer((1,), "float32", scope="local")
        alpha = T.alloc_buffer((1,), "float32", scope="local")
        for r in L.unroll(2 * M):
            m_new[0] = m_run_[r]
            for nb in L.unroll(SN):
                for e in L.unroll(2):
                    m_new[0] = T.max(m_new[0], s_[acc(r // 2, SN, nb) + r % 2 * 2 + e])
            for k in L.unroll(2):  # the 4 lanes of a quad hold the row
                m_new[0] = T.max(m_new[0], T.tvm_warp_shuffle_xor(T.uint32(FULL_WARP), m_new[0], 1 << k, 32, 32))
            alpha[0] = rescale_factor(m_run_[r], m_new[0])
            m_run_[r] = m_new[0]
            l_run_[r] = l_run_[r] * alpha[0]
            for nb in L.unroll(SN):
                for e in L.unroll(2):
                    i = T.meta_var(acc(r // 2, SN, nb) + r % 2 * 2 + e)
                    s_[i] = prob(s_[i], m_new[0])
                    l_run_[r] = l_run_[r] + s_[i]
            for nb in L.unroll(ON):
                for e in L.unroll(2):
                    o_[acc(r // 2, ON, nb) + r % 2 * 2 + e] = o_[acc(r // 2, ON, nb) + r % 2 * 2 + e] * alpha[0]

    @T.macro
    def store(o_, m_run_, l_run_, rows_, p_, lane_, write_o_, write_lse_):
        """o = acc / l and lse = m + log2(l) for this thread's rows p_ + row_of(r); rows that
        saw no key get 0 and EMPTY_LSE."""
        inv = T.alloc_buffer((1,), "float32", scope="local")
        for r in L.unroll(2 * M):
            for k in L.unroll(2):
                l_run_[r] = l_run_[r] + T.tvm_warp_shuffle_xor(T.uint32(FULL_WARP), l_run_[r], 1 << k, 32, 32)
            if p_ + row_of(r) < rows_:
                inv[0] = finalize_scale(l_run_[r])
                for nb in L.unroll(ON):
                    for e in L.vector(2):
                        write_o_(p_ + row_of(r), nb * 8 + lane_ % 4 * 2 + e,
                                 o_[acc(r // 2, ON, nb) + r % 2 * 2 + e] * inv[0])
                if lane_ % 4 == 0:
                    write_lse_(p_ + row_of(r), finalize_lse(m_run_[r], l_run_[r]))

    return softmax, store


def _attend_macro(lay: _Layout, L):
    """The tensor-core `attend` macro (see the module docstring)."""
    sched, BK, BQ, G, KSTEPS_QK, M, ON, RW = lay.sched, lay.BK, lay.BQ, lay.G, lay.KSTEPS_QK, lay.M, lay.ON, lay.RW
    SMEM_ELEMS, SN, STAGES, dtype, shared = lay.SMEM_ELEMS, lay.SN, lay.STAGES, lay.dtype, lay.shared
    unmasked_end, visible_end = lay.unmasked_end, lay.visible_end
    load_q, load_kv, load_q_frag = _load_macros(lay, L)
    s_mma, pv_mma = _mma_macros(lay, L)
    mask, tree_rows, tree_mask = _mask_macros(lay, L)
    softmax, store = _softmax_macros(lay, L)

    @T.macro
    def attend(q_at_, kv_row_, k_at_, v_at_, write_o_, write_lse_, qo_len_, kv_len_, tile_, causal_, sm_scale_,
               tid_):
        """Attention of row tile tile_ of one request and KV head (the accessors are those of
        prefill_simt.py's `attend`: q_at_(p, d), kv_row_(j), k_at_(row, d), v_at_(row, d),
        write_o_(p, d, value), write_lse_(p, value))."""
        # One shared buffer carved by hand (Q | K stages | V stages): TVM's merging of shared
        # allocations does not see accesses made through addresses in asm operands.
        smem = T.alloc_buffer((SMEM_ELEMS,), dtype, scope=shared)
        qf = T.alloc_buffer((M * KSTEPS_QK * 4 if sched.q_in_registers else 4,), "uint32", scope="local")
        s = T.alloc_buffer((M * SN * 4,), "float32", scope="local")
        o = T.alloc_buffer((M * ON * 4,), "float32", scope="local")
        m_run = T.alloc_buffer((2 * M,), "float32", scope="local")
        l_run = T.alloc_buffer((2 * M,), "float32", scope="local")
        warp = tid_ // 32
        lane = tid_ % 32
        qo_len = qo_len_  # bound once: the arguments may be expressions that read memory
        kv_len = kv_len_
        scale = sm_scale_ * T.float32(LOG2E)
        # A block without a tile (tile_ < 0) loads no key and writes nothing: no branch
        # around the body, whose barriers every thread must reach.
        rows = T.if_then_else(tile_ >= 0, qo_len * G, 0)
        p0 = T.max(tile_, 0) * BQ
        p_thread = p0 + warp * RW + lane // 4  # packed row of accumulator row 0 (see row_of)
        # Keys seen by every row of the tile (no mask needed below) and by its last row.
        free_end = unmasked_end(kv_len, qo_len, p0, causal_)
        kv_end = T.if_then_else(tile_ >= 0, visible_end(kv_len, qo_len, p0 + BQ - 1, causal_), 0)
        if is_tree(causal_):
            vis_end = T.alloc_buffer((2 * M,), "int32", scope="local")
            q_begin = T.alloc_buffer((2 * M,), "int32", scope="local")
            tree_keys = T.alloc_buffer((2,), "int32", scope="local")
            tree_rows(causal_, kv_len, qo_len, p_thread, vis_end, q_begin, tree_keys)
        for r in L.unroll(2 * M):
            m_run[r] = T.float32(EMPTY_LSE)
            l_run[r] = T.float32(0)
        for i in L.unroll(M * ON * 4):
            o[i] = T.float32(0)
        load_q(q_at_, smem, rows, p0, tid_)
        T.ptx["cp.async.commit_group"]()
        if kv_end > 0:
            load_kv(kv_row_, k_at_, v_at_, smem, 0, 0, kv_end, tid_)
        T.ptx["cp.async.commit_group"]()  # (an empty group when there is no key)
        T.ptx["cp.async.wait_group"](1)  # Q has landed (the groups complete in order)
        T.tvm_storage_sync(shared)
        if sched.q_in_registers:
            for m in L.unroll(M):
                for kk in L.unroll(KSTEPS_QK):
                    load_q_frag(smem, qf, (m * KSTEPS_QK + kk) * 4, kk, warp * RW + m * 16, lane)
        for t in T.serial(ceildiv(kv_end, BK)):
            T.ptx["cp.async.wait_group"](0)  # tile t has landed ...
            T.tvm_storage_sync(shared)  # ... for every thread, and no warp still reads tile t - 1
            if STAGES == 2:
                if (t + 1) * BK < kv_end:
                    load_kv(kv_row_, k_at_, v_at_, smem, (t + 1) % 2, (t + 1) * BK, kv_end, tid_)
                    T.ptx["cp.async.commit_group"]()
            s_mma(smem, qf, s, t % STAGES, warp, lane)
            for i in L.unroll(M * SN * 4):
                s[i] = s[i] * scale
            if (t + 1) * BK > free_end:
                if is_tree(causal_):
                    tree_mask(s, t * BK, causal_, vis_end, q_begin, tree_keys, lane)
                else:
                    mask(s, t * BK, kv_len, qo_len, p_thread, causal_, lane)
            softmax(s, o, m_run, l_run)
            pv_mma(s, smem, o, t % STAGES, lane)
            if STAGES == 1:
                if (t + 1) * BK < kv_end:
                    T.tvm_storage_sync(shared)  # every warp is done with the only stage
                    load_kv(kv_row_, k_at_, v_at_, smem, 0, (t + 1) * BK, kv_end, tid_)
                    T.ptx["cp.async.commit_group"]()
        store(o, m_run, l_run, rows, p_thread, lane, write_o_, write_lse_)

    return attend


def _mma_attend(config: AttentionConfig, sched: MmaPrefillSchedule):
    """The tensor-core `attend` macro (see the module docstring)."""
    return _attend_macro(_Layout(config, sched), loop_kinds(config))


def _core_schedule(config: AttentionConfig) -> PrefillSchedule:
    """prefill_simt.py's schedule for the RoPE kernel, with fewer rows per thread where its default
    does not fit the arch's shared memory (head dim 256 on sm_86/sm_89's 99 KiB)."""
    sched = choose_prefill_schedule(config)
    while True:
        try:
            return schedule_for(config, sched)
        except ValueError:
            if sched.rows_per_thread == 1:
                raise
            sched = dataclasses.replace(sched, rows_per_thread=sched.rows_per_thread // 2)


class _Kernels:
    """What a generator needs: the mma schedule and `attend`, and prefill_simt.py's CUDA-core
    `attend` with its schedule for rotary_mode == 1; `find_tile` / `num_slots` with the mma
    tile height (prefill_simt.py's, built for a schedule of tile_q = 16 * warps rows)."""

    def __init__(self, config: AttentionConfig, schedule: MmaPrefillSchedule | None, generator: str):
        _check_config(config, generator)
        self.sched = schedule or choose_mma_prefill_schedule(config)
        self.sched.check(config)
        self.attend = _mma_attend(config, self.sched)
        self.tiles = prefill_macros(
            config, PrefillSchedule(threads_y=self.sched.tile_q, threads_x=1, rows_per_thread=1, cols_per_thread=4))
        self.core_sched = _core_schedule(config)
        self.core = prefill_macros(config, self.core_sched)


def paged_prefill_mma(config: AttentionConfig, schedule: MmaPrefillSchedule | None = None):
    """Paged-KV prefill on tensor cores; the PrimFunc of `prefill.paged_prefill` (same
    arguments, semantics and global symbol):

    q [total_q, Hq, D], qo_indptr [B+1] i32, pages [P, 2, Hkv, page_size, D],
    page_indptr [B+1] i32, page_indices [nnz] i32, length_info [B] i32 (or [3, B] when
    sliding: last_page_len, sliding_window_offset, sink_size), k_rope_pos_offset [B] i32,
    q_rope_position [total_q] i32, o [total_q, Hq, D], lse [total_q, Hq] f32 (base 2),
    causal i32, rotary_mode i32, rope_scale f32, rope_theta f32, sm_scale f32.
    dtype float16 or bfloat16, a CUDA target of sm_80 or newer (ValueError otherwise).
    """
    return paged_prefill_func(config, _paged_macro(config, schedule, "paged_prefill_mma"))


def _paged_macro(config: AttentionConfig, schedule: MmaPrefillSchedule | None, generator: str):
    """The paged kernel macro (prefill_contract's paged argument order; its mask argument is
    the causal flag or `masks.TreeMasks`)."""
    if config.v_head_dim != config.head_dim:
        raise ValueError(
            f"v_head_dim={config.v_head_dim} is not supported by {generator}: expected"
            f" head_dim={config.head_dim}"
        )
    kern = _Kernels(config, schedule, generator)
    L = loop_kinds(config)
    dtype, ps = config.dtype, config.page_size
    Hkv, G = config.num_kv_heads, config.group_size
    sliding = config.sliding_window
    CORE_TX = kern.core_sched.threads_x

    @T.macro
    def kernel(Q_, qo_indptr_, pages_, page_indptr_, page_indices_, length_info_, k_pos_, q_pos_, O_, lse_, causal_,
               rotate_, rope_scale_, rope_theta_, sm_scale_):
        """One block per (tile slot, KV head); see the module docstring. rotate_ (a Python
        bool) selects prefill_simt.py's CUDA-core kernel with RoPE."""
        tiles = T.meta_var(kern.core if rotate_ else kern.tiles)
        threads = T.meta_var(kern.core_sched.num_threads if rotate_ else kern.sched.num_threads)
        for blk in L.block(tiles.num_slots(Q_.shape[0], k_pos_.shape[0]) * Hkv, "x", outer=True):
            for tid in L.thread(threads, "x"):
                req = T.alloc_buffer((1,), "int32", scope="local")
                tile = T.alloc_buffer((1,), "int32", scope="local")
                tiles.find_tile(qo_indptr_, k_pos_.shape[0], blk // Hkv, req, tile)
                b = req[0]
                hkv = blk % Hkv
                q0 = qo_indptr_[b]
                page0 = page_indptr_[b]
                q_at = T.meta_var(lambda p, d: Q_[q0 + p // G, hkv * G + p % G, d])
                # A key's handle is its slot in the page pool: page id * page_size + offset.
                kv_row = T.meta_var(
                    lambda j: page_indices_[page0 + paged_position(j, length_info_, b, sliding) // ps] * ps
                    + paged_position(j, length_info_, b, sliding) % ps)
                k_at = T.meta_var(lambda slot, d: pages_[slot // ps, 0, hkv, slot % ps, d])
                v_at = T.meta_var(lambda slot, d: pages_[slot // ps, 1, hkv, slot % ps, d])
                write_o = T.meta_var(
                    lambda p, d, val: T.buffer_store(O_, T.Cast(dtype, val), [q0 + p // G, hkv * G + p % G, d]))
                write_lse = T.meta_var(lambda p, val: T.buffer_store(lse_, val, [q0 + p // G, hkv * G + p % G]))
                qo_len = qo_indptr_[b + 1] - q0
                kv_len = kv_chunk_len(page_indptr_[b + 1] - page0, ps, length_info_, b, sliding)
                if rotate_:
                    kern.core.attend(q_at, lambda p: q_pos_[q0 + p // G], kv_row, k_at, v_at, k_pos_[b], write_o,
                                   write_lse, qo_len, kv_len, tile[0], causal_, True, rope_scale_, rope_theta_,
                                   sm_scale_, tid // CORE_TX, tid % CORE_TX)
                else:
                    kern.attend(q_at, kv_row, k_at, v_at, write_o, write_lse, qo_len, kv_len, tile[0],
                                mask_of_request(causal_, b), sm_scale_, tid)

    return kernel


def ragged_prefill_mma(config: AttentionConfig, schedule: MmaPrefillSchedule | None = None):
    """Ragged-KV prefill on tensor cores; the PrimFunc of `prefill.ragged_prefill` (same
    arguments, semantics and global symbol):

    q [total_q, Hq, Dqk], qo_indptr [B+1] i32, k [total_kv, Hkv, Dqk], v [total_kv, Hkv, Dv],
    kv_indptr [B+1] i32, q_rope_position [total_q] i32, k_rope_pos_offset [B] i32,
    o [total_q, Hq, Dv], lse [total_q, Hq] f32 (base 2), causal i32, rotary_mode i32,
    rope_scale f32, rope_theta f32, sm_scale f32. Dqk = config.head_dim, Dv = config.v_head_dim.
    dtype float16 or bfloat16, a CUDA target of sm_80 or newer (ValueError otherwise).
    """
    return ragged_prefill_func(config, _ragged_macro(config, schedule, "ragged_prefill_mma"))


def _ragged_macro(config: AttentionConfig, schedule: MmaPrefillSchedule | None, generator: str):
    """The ragged kernel macro (prefill_contract's ragged argument order; its mask argument is
    the causal flag or `masks.TreeMasks`)."""
    kern = _Kernels(config, schedule, generator)
    L = loop_kinds(config)
    dtype, Hkv, G = config.dtype, config.num_kv_heads, config.group_size
    CORE_TX = kern.core_sched.threads_x

    @T.macro
    def kernel(Q_, qo_indptr_, K_, V_, kv_indptr_, q_pos_, k_pos_, O_, lse_, causal_, rotate_, rope_scale_, rope_theta_,
               sm_scale_):
        """One block per (tile slot, KV head); see the module docstring. rotate_ (a Python
        bool) selects prefill_simt.py's CUDA-core kernel with RoPE."""
        tiles = T.meta_var(kern.core if rotate_ else kern.tiles)
        threads = T.meta_var(kern.core_sched.num_threads if rotate_ else kern.sched.num_threads)
        for blk in L.block(tiles.num_slots(Q_.shape[0], k_pos_.shape[0]) * Hkv, "x", outer=True):
            for tid in L.thread(threads, "x"):
                req = T.alloc_buffer((1,), "int32", scope="local")
                tile = T.alloc_buffer((1,), "int32", scope="local")
                tiles.find_tile(qo_indptr_, k_pos_.shape[0], blk // Hkv, req, tile)
                b = req[0]
                hkv = blk % Hkv
                q0 = qo_indptr_[b]
                kv0 = kv_indptr_[b]
                q_at = T.meta_var(lambda p, d: Q_[q0 + p // G, hkv * G + p % G, d])
                kv_row = T.meta_var(lambda j: kv0 + j)
                k_at = T.meta_var(lambda row, d: K_[row, hkv, d])
                v_at = T.meta_var(lambda row, d: V_[row, hkv, d])
                write_o = T.meta_var(
                    lambda p, d, val: T.buffer_store(O_, T.Cast(dtype, val), [q0 + p // G, hkv * G + p % G, d]))
                write_lse = T.meta_var(lambda p, val: T.buffer_store(lse_, val, [q0 + p // G, hkv * G + p % G]))
                qo_len = qo_indptr_[b + 1] - q0
                kv_len = kv_indptr_[b + 1] - kv0
                if rotate_:
                    kern.core.attend(q_at, lambda p: q_pos_[q0 + p // G], kv_row, k_at, v_at, k_pos_[b], write_o,
                                   write_lse, qo_len, kv_len, tile[0], causal_, True, rope_scale_, rope_theta_,
                                   sm_scale_, tid // CORE_TX, tid % CORE_TX)
                else:
                    kern.attend(q_at, kv_row, k_at, v_at, write_o, write_lse, qo_len, kv_len, tile[0],
                                mask_of_request(causal_, b), sm_scale_, tid)

    return kernel


def tree_paged_prefill_mma(config: AttentionConfig, schedule: MmaPrefillSchedule | None = None):
    """Tensor-core body of `prefill.tree_mask_paged_prefill` (TVM's `tree_attn_paged_kv`
    arguments): the paged kernel with the token-tree mask (masks.TreeMask) in place of the
    causal one; keys are cached rotated (rotary_mode must be 0, asserted by the PrimFunc)."""
    return tree_paged_prefill_func(config, _paged_macro(config, schedule, "tree_paged_prefill_mma"))


def tree_ragged_prefill_mma(config: AttentionConfig, schedule: MmaPrefillSchedule | None = None):
    """Tensor-core body of `prefill.tree_mask_ragged_prefill` (TVM's `batch_tree_attn` arguments)."""
    return tree_ragged_prefill_func(config, _ragged_macro(config, schedule, "tree_ragged_prefill_mma"))


__all__ = ["MmaPrefillSchedule", "choose_mma_prefill_schedule", "paged_prefill_mma", "ragged_prefill_mma",
           "tree_paged_prefill_mma", "tree_ragged_prefill_mma"]
