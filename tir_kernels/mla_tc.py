"""Tensor-core MLA paged decode (fp16/bf16, CUDA sm_80 and newer).

`mla_paged_decode_tc(config)` returns a PrimFunc with the parameters, argument order,
semantics and global symbol of `mla.mla_paged_decode` (its docstring is the contract),
computed with `mma.sync.aligned.m16n8k16` and fp32 accumulation, on the mma kernels'
shared-memory tile layout (`mma.Tile`) and decode_tc.py's fragment loads.

Work mapping: a block serves one request, one tile of `16 * m_tiles` heads and one split of
the request's keys (blockIdx = request, head tile, split). The heads are the M dimension, so
each latent row is copied from memory once per block for all its heads. The block has
m_tiles x col_slices warps; warp (mt, cs) owns the 16 heads of m-tile mt and, of the output,
columns cs * latent_dim / col_slices ..; a tile of the keys has tile_kv = 16 * col_slices
latent rows, and warp (mt, cs) scores keys cs * 16 .. of it for its heads (no work is done
twice). Per tile:

  issue: the latent rows of tile t + stages - 1 -> a ring buffer of `stages` tiles (16-byte
    cp.async; rows past the split's end are zero-filled).
  S = Q K^T for the warp's 16 heads x 16 keys (ldmatrix Q and K, the whole qk_dim deep);
    scale to base 2, mask keys past the end; the row maxima go through shared memory so that
    the col_slices warps of an m-tile move to the same running max.
  P = exp2(S - m) -> shared memory (16-bit), then O += P V: the warp's m-tile of P over all the
    tile's keys times its slice of V (the tile's first latent_dim columns, ldmatrix.trans).
  finish: the l sums of an m-tile's warps are added through shared memory; o = O / l and
    lse = m + log2(l) go to o / lse, or, when the keys are split, to an fp32 workspace that
    softmax.merge_splits_macro merges (split count chosen at launch from the batch size).

FP8 latent pages (config.kv_dtype, tir_kernels.kv_quant): `issue` fills the same fp16/bf16 tiles
from the codes instead of by cp.async: a thread loads the 8 codes of a 16-byte tile chunk and
stores code * scale (the latent columns' scale or the rotary ones', read once per block) in the
dtype, so the MMAs are unchanged. Where a thread's chunks of a tile take at most
MAX_STAGED_WORDS registers, a step's refill only loads the codes and stores them after the
step's MMAs (into the stage no warp reads in that step), so the loads overlap the arithmetic;
else (few threads a row, e.g. 16 heads at latent 512) each chunk is stored as it is loaded.
The ring's barriers order the stores before the reads.

`mla.mla_paged_decode_auto(config)` picks this kernel where it applies (`mla_tc_problem`: CUDA
sm_80+, fp16/bf16, latent_dim a multiple of 32) and the SIMT kernel (mla_simt.py) otherwise.
"""

from __future__ import annotations

import dataclasses

from tvm.script import tirx as T

from .common import EMPTY_LSE, LOG2E, ceildiv, kv_chunk_len, loop_kinds
from .config import MLAConfig
from .kv_quant import FP8_FETCH, FP8_FETCH_SRC, fp8_chunk_function, fp8_store_function, mla_scale
from .mla_contract import decode_contract_func
from .mma import (CHUNK, CP_ASYNC, FULL_WARP, LDSM, LDSM_T, MIN_ARCH, MMA_DTYPES, ROWS_PER_MMA, Tile, mma_name,
                  pack_name)
from .schedules import CUDA_DEFAULT_SHARED_BYTES, CUDA_MAX_SHARED_BYTES, CUDA_NUM_SMS
from .softmax import finalize_lse, finalize_scale, merge_splits_macro, prob, rescale_factor

KEYS_PER_WARP = 16  # keys one warp scores per tile (two n8 blocks of S)
SM_RESERVED_SHARED_BYTES = 1024  # shared memory the driver keeps per resident block
P_PAD = CHUNK  # extra 16-bit elements per row of P in shared memory (ldmatrix rows in distinct banks)
MAX_STAGED_WORDS = 32  # registers a thread may hold FP8 codes of the next tile in


def _require(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(f"invalid schedule: {what}")


def _sm_version(config: MLAConfig) -> int:
    return int(config.cuda_arch[3:].rstrip("a")) if config.is_gpu else 0


def mla_tc_problem(config: MLAConfig) -> str | None:
    """Why `mla_paged_decode_tc` cannot serve `config`, or None when it can."""
    if not config.is_gpu or _sm_version(config) < MIN_ARCH:
        return f"target={config.target!r} (mma.sync needs a CUDA target of sm_{MIN_ARCH} or newer)"
    if config.dtype not in MMA_DTYPES:
        return f"dtype={config.dtype!r} (tensor cores serve {tuple(MMA_DTYPES)})"
    if config.latent_dim % 32:
        return f"latent_dim={config.latent_dim} (a multiple of 32)"
    return None


def supports_tc(config: MLAConfig) -> bool:
    """Whether `mla_paged_decode_tc` serves this config."""
    return mla_tc_problem(config) is None


@dataclasses.dataclass(frozen=True)
class MLATensorCoreSchedule:
    """Work mapping of `mla_paged_decode_tc` (module docstring).

    m_tiles: 16-head m-tiles per block (heads per block = 16 * m_tiles). col_slices: warps per
    m-tile, each owning latent_dim / col_slices output columns and scoring 16 keys of a tile
    (tile_kv = 16 * col_slices). stages: tiles in flight (cp.async ring buffer).
    max_splits, target_blocks: a request's keys are split into
    clamp(target_blocks // (batch * head tiles), 1, max_splits) parts.
    """

    m_tiles: int
    col_slices: int
    stages: int
    max_splits: int = 128
    target_blocks: int = CUDA_NUM_SMS

    def __post_init__(self):
        _require(1 <= self.m_tiles <= 8, f"m_tiles={self.m_tiles} must be 1..8")
        _require(self.col_slices in (1, 2, 4, 8), f"col_slices={self.col_slices} must be 1, 2, 4 or 8")
        _require(self.num_threads <= 1024, f"m_tiles * col_slices = {self.num_warps} warps must be at most 32")
        _require(self.stages >= 2, f"stages={self.stages} must be >= 2")
        _require(self.max_splits >= 1, f"max_splits={self.max_splits} must be >= 1")
        _require(self.target_blocks >= 1, f"target_blocks={self.target_blocks} must be >= 1")

    @property
    def num_warps(self) -> int:
        return self.m_tiles * self.col_slices

    @property
    def num_threads(self) -> int:
        return 32 * self.num_warps

    @property
    def heads_per_block(self) -> int:
        return ROWS_PER_MMA * self.m_tiles

    @property
    def tile_kv(self) -> int:
        return KEYS_PER_WARP * self.col_slices

    def shared_bytes(self, config: MLAConfig) -> int:
        """Q tile, `stages` latent tiles, P (16-bit) and the fp32 row exchange."""
        stride = Tile(config.qk_dim).stride
        elems = (self.heads_per_block + self.stages * self.tile_kv) * stride
        elems += self.heads_per_block * (self.tile_kv + P_PAD)
        return 2 * elems + 4 * self.num_warps * ROWS_PER_MMA

    def check(self, config: MLAConfig) -> None:
        if not supports_tc(config):
            raise ValueError(f"config {config} is not supported by mla_paged_decode_tc: expected a CUDA target of "
                             f"sm_{MIN_ARCH} or newer, dtype one of {tuple(MMA_DTYPES)} and latent_dim a multiple "
                             "of 32")
        _require(config.latent_dim % (16 * self.col_slices) == 0,
                 f"col_slices={self.col_slices}: 16 * col_slices must divide latent_dim={config.latent_dim}")
        limit = CUDA_MAX_SHARED_BYTES.get(config.cuda_arch, CUDA_DEFAULT_SHARED_BYTES)
        _require(self.shared_bytes(config) <= limit,
                 f"m_tiles={self.m_tiles}, col_slices={self.col_slices}, stages={self.stages} need "
                 f"{self.shared_bytes(config)} bytes of shared memory, {config.cuda_arch} has {limit}")


def choose_mla_tc_schedule(config: MLAConfig) -> MLATensorCoreSchedule:
    """Up to 4 m-tiles (64 heads) per block with 2 warps each (128 fp32 accumulators a thread at
    latent 512) and 2 stages; one m-tile (16 heads or fewer): 2 warps and 2 stages (small
    enough for two blocks an SM). Then more stages or fewer m-tiles until it fits the arch's
    shared memory; fewer warps per m-tile where latent_dim needs. Splits aim at one wave of
    resident blocks (SMs x the blocks an SM's shared memory holds). These ran faster than 3
    stages at 128 heads and 4 warps at 16 heads (docs/performance.md)."""
    limit = CUDA_MAX_SHARED_BYTES.get(config.cuda_arch, CUDA_DEFAULT_SHARED_BYTES)
    m_tiles = min(4, ceildiv(config.num_heads, ROWS_PER_MMA))
    candidates = []
    while m_tiles >= 1:
        shapes = [(2, 2), (2, 3)] if m_tiles > 1 else [(2, 2), (4, 2), (1, 2)]
        candidates += [(m_tiles, cs, st) for cs, st in shapes]
        m_tiles //= 2
    for m_tiles, col_slices, stages in candidates:
        while config.latent_dim % (16 * col_slices):
            col_slices //= 2
        sched = MLATensorCoreSchedule(m_tiles, col_slices, stages)
        need = sched.shared_bytes(config)
        if need <= limit:
            per_sm = max(1, (limit + SM_RESERVED_SHARED_BYTES) // (need + SM_RESERVED_SHARED_BYTES))
            return dataclasses.replace(sched, target_blocks=CUDA_NUM_SMS * per_sm)
    return sched


def _copy_threads_per_row(chunks: int, threads: int, rows: int) -> int:
    """Threads copying one latent row: the most, up to threads / rows, that divide its chunks."""
    for tpr in range(max(1, threads // rows), 0, -1):
        if chunks % tpr == 0 and threads % tpr == 0:
            return tpr
    return 1


class _Layout:
    """Compile-time sizes of one tensor-core MLA decode kernel (its config and schedule), the
    regions of its shared buffer, and the split count. Every name __init__ binds is an
    attribute; the macro factories below unpack the ones their macros read."""

    def __init__(self, config: MLAConfig, sched: MLATensorCoreSchedule):
        dtype, H, D_QK, D_L, ps = config.dtype, config.num_heads, config.qk_dim, config.latent_dim, config.page_size
        CS, STAGES, NW, NT = sched.col_slices, sched.stages, sched.num_warps, sched.num_threads
        HT, BK, MS = sched.heads_per_block, sched.tile_kv, sched.max_splits
        HEAD_TILES = ceildiv(H, HT)
        TL = Tile(D_QK)
        KSTEPS_QK, KSTEPS_PV = D_QK // 16, BK // 16
        CW = D_L // CS  # output columns per warp
        ON = CW // 8  # n8 blocks of O per warp
        PSTR = BK + P_PAD
        MMA, PACK = mma_name(dtype), pack_name(dtype)
        shared = "shared.dyn"
        # One fp32 shared buffer addressed in 16-bit elements (halved for the fp32 index; every
        # region starts at a whole 16-byte chunk): Q | latent stages | P | row exchange (fp32).
        Q_OFF = 0
        K_OFF = HT * TL.stride
        P_OFF = K_OFF + STAGES * BK * TL.stride
        RED = (P_OFF + HT * PSTR) // 2  # fp32 word: [NW, 16] row maxima, then row sums
        SMEM_WORDS = RED + NW * ROWS_PER_MMA
        TPR = _copy_threads_per_row(TL.chunks, NT, BK)
        RP = NT // TPR  # rows a pass of the block's threads copies
        PASSES = ceildiv(BK, RP)
        CPT = TL.chunks // TPR  # chunks per thread per row
        # FP8 pages: a thread loads its chunks' codes and stores code * scale of the chunk's part
        # (latent or rope: latent_dim is a multiple of 32, so no chunk straddles them)
        FP8 = config.kv_fp8
        FP8_CHUNK, FP8_CHUNK_SRC = fp8_chunk_function(config.kv_dtype, dtype, scaled=True) if FP8 else (None, None)
        FP8_STORE, FP8_STORE_SRC = fp8_store_function(config.kv_dtype, dtype, scaled=True) if FP8 else (None, None)
        # a step's loads held in registers until after its MMAs (where that takes at most 32 words
        # a thread; else each chunk is stored as it is loaded)
        DEFER = FP8 and PASSES * CPT * 2 <= MAX_STAGED_WORDS
        vars(self).update((name, value) for name, value in locals().items() if name != "self")

    @staticmethod
    def word(elem):
        """fp32 index of a 16-bit element offset (a multiple of 8)."""
        return elem // 2

    def num_splits(self, batch):
        if self.MS == 1:
            return 1
        return T.min(T.max(self.sched.target_blocks // (batch * self.HEAD_TILES), 1), self.MS)


def _load_macros(lay: _Layout, L):
    """Loads: load_q (the block's query rows) and issue (a tile of latent rows -> the ring)."""
    BK, CPT, H, HT, K_OFF, NT, PASSES = lay.BK, lay.CPT, lay.H, lay.HT, lay.K_OFF, lay.NT, lay.PASSES
    Q_OFF, RP, TL, TPR, ps, word = lay.Q_OFF, lay.RP, lay.TL, lay.TPR, lay.ps, lay.word
    D_L, FP8, FP8_CHUNK, FP8_CHUNK_SRC = lay.D_L, lay.FP8, lay.FP8_CHUNK, lay.FP8_CHUNK_SRC
    FP8_STORE, FP8_STORE_SRC = lay.FP8_STORE, lay.FP8_STORE_SRC

    @T.macro
    def copy_chunk(smem_, off_, pages_, page_, slot_, ch_, scales_):
        """Chunk ch_ of a latent row -> the tile at 16-bit element off_: cp.async, or FP8 pages'
        codes dequantized (kv_quant.fp8_chunk_function) with scales_[0] (latent) or [1] (rope)."""
        if FP8:
            T.evaluate(T.cuda.func_call(FP8_CHUNK, smem_.ptr_to([word(off_)]),
                                        T.address_of(pages_[page_, slot_, ch_ * CHUNK]),
                                        T.if_then_else(ch_ * CHUNK < D_L, scales_[0], scales_[1]),
                                        source_code=FP8_CHUNK_SRC))
        else:
            T.ptx[CP_ASYNC](smem_.ptr_to([word(off_)]), T.address_of(pages_[page_, slot_, ch_ * CHUNK]), 16)

    @T.macro
    def load_q(q_, smem_, b_, h0_, tid_):
        """The block's HT query rows -> the Q region (cp.async); rows past the last head zero."""
        for it in L.unroll(ceildiv(HT * TL.chunks, NT)):
            c = T.meta_var(it * NT + tid_)
            r = T.meta_var(c // TL.chunks)
            ch = T.meta_var(c % TL.chunks)
            if HT * TL.chunks % NT == 0 or c < HT * TL.chunks:
                if h0_ + r < H:
                    T.ptx[CP_ASYNC](smem_.ptr_to([word(Q_OFF + TL.offset(r, ch))]),
                                    T.address_of(q_[b_, h0_ + r, ch * CHUNK]), 16)
                else:
                    for e in L.vector(4):
                        smem_[word(Q_OFF + TL.offset(r, ch)) + e] = T.float32(0)

    @T.macro
    def issue(pages_, indices_, page0_, smem_, stage_, kv0_, kv_end_, tid_, scales_, deferred_, staged_):
        """cp.async of this thread's chunks of latent rows kv0_.. -> ring buffer stage_ (FP8:
        dequantized with scales_, `copy_chunk`; with deferred_ only loaded into staged_, which
        `commit` stores after the step's MMAs); zeros from kv_end_ on."""
        for p in L.unroll(PASSES):
            r = T.meta_var(p * RP + tid_ // TPR)
            if BK % RP == 0 or r < BK:
                if kv0_ + r < kv_end_:
                    page = T.meta_var(indices_[page0_ + (kv0_ + r) // ps])
                    for c in L.unroll(CPT):
                        ch = T.meta_var(tid_ % TPR + c * TPR)
                        if FP8 and deferred_:
                            T.evaluate(T.cuda.func_call(
                                FP8_FETCH, T.address_of(staged_[(p * CPT + c) * 2]),
                                T.address_of(pages_[page, (kv0_ + r) % ps, ch * CHUNK]), source_code=FP8_FETCH_SRC))
                        else:
                            copy_chunk(smem_, K_OFF + stage_ * BK * TL.stride + TL.offset(r, ch), pages_, page,
                                       (kv0_ + r) % ps, ch, scales_)
                else:
                    for c in L.unroll(CPT):
                        ch = T.meta_var(tid_ % TPR + c * TPR)
                        for e in L.vector(4):
                            smem_[word(K_OFF + stage_ * BK * TL.stride + TL.offset(r, ch)) + e] = T.float32(0)

    @T.macro
    def commit(smem_, stage_, kv0_, kv_end_, tid_, scales_, staged_):
        """FP8 pages: the codes a deferred `issue` of rows kv0_.. loaded into staged_ -> code *
        scale in ring buffer stage_ (that issue zeroed the rows past the end already)."""
        for p in L.unroll(PASSES):
            r = T.meta_var(p * RP + tid_ // TPR)
            if BK % RP == 0 or r < BK:
                if kv0_ + r < kv_end_:
                    for c in L.unroll(CPT):
                        ch = T.meta_var(tid_ % TPR + c * TPR)
                        T.evaluate(T.cuda.func_call(
                            FP8_STORE, smem_.ptr_to([word(K_OFF + stage_ * BK * TL.stride + TL.offset(r, ch))]),
                            staged_[(p * CPT + c) * 2], staged_[(p * CPT + c) * 2 + 1],
                            T.if_then_else(ch * CHUNK < D_L, scales_[0], scales_[1]), source_code=FP8_STORE_SRC))

    return load_q, issue, commit


def _mma_macros(lay: _Layout, L):
    """A warp's step: s_mma (S = Q K^T), probs (online softmax, P -> shared) and pv_mma
    (O += P V)."""
    BK, CS, CW, KSTEPS_PV, KSTEPS_QK, K_OFF = lay.BK, lay.CS, lay.CW, lay.KSTEPS_PV, lay.KSTEPS_QK, lay.K_OFF
    MMA, ON, PACK, PSTR, P_OFF, Q_OFF, RED = lay.MMA, lay.ON, lay.PACK, lay.PSTR, lay.P_OFF, lay.Q_OFF, lay.RED
    TL, word = lay.TL, lay.word

    @T.macro
    def s_mma(smem_, s_, stage_, mt_, cs_, lane_):
        """s_ <- Q K^T of m-tile mt_'s heads and keys cs_ * 16 .. of the tile in stage_."""
        qf = T.alloc_buffer((4,), "uint32", scope="local")
        kf = T.alloc_buffer((4,), "uint32", scope="local")
        for i in L.unroll(8):
            s_[i] = T.float32(0)
        for kk in L.unroll(KSTEPS_QK):
            T.ptx[LDSM](qf[0], qf[1], qf[2], qf[3],
                        smem_.ptr_to([word(Q_OFF + TL.offset(mt_ * 16 + lane_ % 16, kk * 2 + lane_ // 16))]))
            T.ptx[LDSM](kf[0], kf[1], kf[2], kf[3], smem_.ptr_to([word(
                K_OFF + stage_ * BK * TL.stride
                + TL.offset(cs_ * KEYS_PER_WARP + lane_ % 8 + lane_ // 16 * 8, kk * 2 + lane_ // 8 % 2))]))
            for h in L.unroll(2):
                T.ptx[MMA](s_[h * 4], s_[h * 4 + 1], s_[h * 4 + 2], s_[h * 4 + 3], qf[0], qf[1], qf[2], qf[3],
                           kf[h * 2], kf[h * 2 + 1], s_[h * 4], s_[h * 4 + 1], s_[h * 4 + 2], s_[h * 4 + 3])

    @T.macro
    def probs(smem_, s_, o_, m_run_, l_run_, mt_, cs_, lane_):
        """Move the state to the m-tile's new max, s_ -> P = exp2(s - m) into the P region."""
        m_new = T.alloc_buffer((1,), "float32", scope="local")
        alpha = T.alloc_buffer((1,), "float32", scope="local")
        pk = T.alloc_buffer((1,), "uint32", scope="local")
        for r in L.unroll(2):
            m_new[0] = m_run_[r]
            for c in L.unroll(CS):
                m_new[0] = T.max(m_new[0], smem_[RED + (mt_ * CS + c) * ROWS_PER_MMA + lane_ // 4 + r * 8])
            alpha[0] = rescale_factor(m_run_[r], m_new[0])
            m_run_[r] = m_new[0]
            l_run_[r] = l_run_[r] * alpha[0]
            for nb in L.unroll(2):
                for e in L.unroll(2):
                    s_[nb * 4 + r * 2 + e] = prob(s_[nb * 4 + r * 2 + e], m_new[0])
                    l_run_[r] = l_run_[r] + s_[nb * 4 + r * 2 + e]
                T.ptx[PACK](pk[0], s_[nb * 4 + r * 2 + 1], s_[nb * 4 + r * 2])
                smem_[word(P_OFF + (mt_ * 16 + lane_ // 4 + r * 8) * PSTR + cs_ * KEYS_PER_WARP + nb * 8)
                      + lane_ % 4] = T.reinterpret("float32", pk[0])
            for nb in L.unroll(ON):
                for e in L.unroll(2):
                    o_[nb * 4 + r * 2 + e] = o_[nb * 4 + r * 2 + e] * alpha[0]

    @T.macro
    def pv_mma(smem_, o_, stage_, mt_, cs_, lane_):
        """o_ += P V: m-tile mt_'s P over the tile's keys times the warp's columns of V."""
        pf = T.alloc_buffer((4,), "uint32", scope="local")
        vf = T.alloc_buffer((4,), "uint32", scope="local")
        for kk in L.unroll(KSTEPS_PV):
            T.ptx[LDSM](pf[0], pf[1], pf[2], pf[3], smem_.ptr_to([word(
                P_OFF + (mt_ * 16 + lane_ % 16) * PSTR + (kk * 2 + lane_ // 16) * CHUNK)]))
            for np_ in L.unroll(ON // 2):
                T.ptx[LDSM_T](vf[0], vf[1], vf[2], vf[3], smem_.ptr_to([word(
                    K_OFF + stage_ * BK * TL.stride
                    + TL.offset(kk * 16 + lane_ % 8 + lane_ // 8 % 2 * 8,
                                cs_ * (CW // CHUNK) + np_ * 2 + lane_ // 16))]))
                for h in L.unroll(2):
                    n = T.meta_var((np_ * 2 + h) * 4)
                    T.ptx[MMA](o_[n], o_[n + 1], o_[n + 2], o_[n + 3], pf[0], pf[1], pf[2], pf[3],
                               vf[h * 2], vf[h * 2 + 1], o_[n], o_[n + 1], o_[n + 2], o_[n + 3])

    return s_mma, probs, pv_mma


def _finish_macro(lay: _Layout, L):
    """finish: an m-tile's l sums added and o / lse written."""
    CS, CW, H, ON, RED, shared = lay.CS, lay.CW, lay.H, lay.ON, lay.RED, lay.shared

    @T.macro
    def finish(smem_, o_, m_run_, l_run_, h0_, mt_, cs_, warp_, lane_, write_o_, write_lse_):
        """Add the m-tile's warps' l sums (through RED) and write o = O / l and lse for the
        warp's rows: write_o_(head, column, pair index e, value), write_lse_(head, value)."""
        l_all = T.alloc_buffer((1,), "float32", scope="local")
        inv = T.alloc_buffer((1,), "float32", scope="local")
        T.ptx["cp.async.wait_group"](0)
        for r in L.unroll(2):
            for k in L.unroll(2):
                l_run_[r] = l_run_[r] + T.tvm_warp_shuffle_xor(T.uint32(FULL_WARP), l_run_[r], 1 << k, 32, 32)
        T.tvm_storage_sync(shared)  # every warp has read the last tile's maxima
        if lane_ % 4 == 0:
            for r in L.unroll(2):
                smem_[RED + warp_ * ROWS_PER_MMA + lane_ // 4 + r * 8] = l_run_[r]
        T.tvm_storage_sync(shared)
        for r in L.unroll(2):
            head = T.meta_var(h0_ + mt_ * 16 + lane_ // 4 + r * 8)
            l_all[0] = T.float32(0)
            for c in L.unroll(CS):
                l_all[0] = l_all[0] + smem_[RED + (mt_ * CS + c) * ROWS_PER_MMA + lane_ // 4 + r * 8]
            inv[0] = finalize_scale(l_all[0])
            if head < H:
                for nb in L.unroll(ON):
                    for e in L.unroll(2):
                        write_o_(head, cs_ * CW + nb * 8 + lane_ % 4 * 2 + e, o_[nb * 4 + r * 2 + e] * inv[0])
                if cs_ == 0 and lane_ % 4 == 0:
                    write_lse_(head, finalize_lse(m_run_[r], l_all[0]))

    return finish


def _body_macro(lay: _Layout, L):
    """body: the work of one block (request, head tile, split), thread by thread."""
    BK, CS, D_L, H, HT, MS, ON, RED = lay.BK, lay.CS, lay.D_L, lay.H, lay.HT, lay.MS, lay.ON, lay.RED
    SMEM_WORDS, STAGES, dtype, num_splits, ps = lay.SMEM_WORDS, lay.STAGES, lay.dtype, lay.num_splits, lay.ps
    FP8, DEFER, PASSES, CPT = lay.FP8, lay.DEFER, lay.PASSES, lay.CPT
    shared = lay.shared
    load_q, issue, commit = _load_macros(lay, L)
    s_mma, probs, pv_mma = _mma_macros(lay, L)
    finish = _finish_macro(lay, L)

    @T.macro
    def body(q_, pages_, indptr_, indices_, length_info_, o_, lse_, o_part_, lse_part_, sm_scale_, b, hc, split,
             tid):
        """The work of block (request b, head tile hc, split `split`), thread tid."""
        batch = q_.shape[0]
        smem = T.alloc_buffer((SMEM_WORDS,), "float32", scope=shared)
        s = T.alloc_buffer((8,), "float32", scope="local")
        o = T.alloc_buffer((ON * 4,), "float32", scope="local")
        m_run = T.alloc_buffer((2,), "float32", scope="local")
        l_run = T.alloc_buffer((2,), "float32", scope="local")
        mloc = T.alloc_buffer((1,), "float32", scope="local")
        fp8_scales = T.alloc_buffer((2,), "float32", scope="local")  # latent, rope (FP8 pages)
        staged = T.alloc_buffer((PASSES * CPT * 2 if DEFER else 1,), "uint32", scope="local")  # FP8 refill codes
        warp = tid // 32
        lane = tid % 32
        mt = warp // CS
        cs = warp % CS
        h0 = hc * HT
        page0 = indptr_[b]
        kv_len = kv_chunk_len(indptr_[b + 1] - page0, ps, length_info_, b, False)
        nsplit = num_splits(batch)
        split_len = ceildiv(ceildiv(kv_len, nsplit), BK) * BK
        j_begin = T.min(split * split_len, kv_len)
        j_end = T.min(j_begin + split_len, kv_len)
        ntiles = ceildiv(j_end - j_begin, BK)
        scale = sm_scale_ * T.float32(LOG2E)
        for r in L.unroll(2):
            m_run[r] = T.float32(EMPTY_LSE)
            l_run[r] = T.float32(0)
        for i in L.unroll(ON * 4):
            o[i] = T.float32(0)
        if FP8:
            for part in L.unroll(2):
                fp8_scales[part] = mla_scale(pages_, part)
        load_q(q_, smem, b, h0, tid)
        T.ptx["cp.async.commit_group"]()
        for st in L.unroll(STAGES - 1):
            if st < ntiles:
                issue(pages_, indices_, page0, smem, st, j_begin + st * BK, j_end, tid, fp8_scales, False, staged)
            T.ptx["cp.async.commit_group"]()  # (empty groups keep the count)
        for t in T.serial(ntiles):
            T.ptx["cp.async.wait_group"](STAGES - 2)  # Q and tile t have landed ...
            T.tvm_storage_sync(shared)  # ... for all; no warp still reads tile t - 1 or P
            if t + STAGES - 1 < ntiles:
                issue(pages_, indices_, page0, smem, (t + STAGES - 1) % STAGES, j_begin + (t + STAGES - 1) * BK,
                      j_end, tid, fp8_scales, DEFER, staged)
            T.ptx["cp.async.commit_group"]()
            s_mma(smem, s, t % STAGES, mt, cs, lane)
            # scale, mask, and publish the row maxima of the warp's keys
            for r in L.unroll(2):
                for nb in L.unroll(2):
                    for e in L.unroll(2):
                        s[nb * 4 + r * 2 + e] = s[nb * 4 + r * 2 + e] * scale
                        if j_begin + t * BK + cs * KEYS_PER_WARP + nb * 8 + lane % 4 * 2 + e >= j_end:
                            s[nb * 4 + r * 2 + e] = T.min_value("float32")
                mloc[0] = T.max(T.max(s[r * 2], s[r * 2 + 1]), T.max(s[4 + r * 2], s[4 + r * 2 + 1]))
                for k in L.unroll(2):  # the 4 lanes of a quad hold the row
                    mloc[0] = T.max(mloc[0], T.tvm_warp_shuffle_xor(T.uint32(FULL_WARP), mloc[0], 1 << k, 32, 32))
                if lane % 4 == 0:
                    smem[RED + warp * ROWS_PER_MMA + lane // 4 + r * 8] = mloc[0]
            T.tvm_storage_sync(shared)
            probs(smem, s, o, m_run, l_run, mt, cs, lane)
            T.tvm_storage_sync(shared)
            pv_mma(smem, o, t % STAGES, mt, cs, lane)
            if DEFER:  # the tile this step's refill loaded, into the stage no warp reads in this step
                if t + STAGES - 1 < ntiles:
                    commit(smem, (t + STAGES - 1) % STAGES, j_begin + (t + STAGES - 1) * BK, j_end, tid, fp8_scales,
                           staged)
        if MS == 1:
            finish(smem, o, m_run, l_run, h0, mt, cs, warp, lane,
                   lambda h, d, val: T.buffer_store(o_, T.Cast(dtype, val), [b, h, d]),
                   lambda h, val: T.buffer_store(lse_, val, [b, h]))
        elif nsplit == 1:
            finish(smem, o, m_run, l_run, h0, mt, cs, warp, lane,
                   lambda h, d, val: T.buffer_store(o_, T.Cast(dtype, val), [b, h, d]),
                   lambda h, val: T.buffer_store(lse_, val, [b, h]))
        else:
            finish(smem, o, m_run, l_run, h0, mt, cs, warp, lane,
                   lambda h, d, val: T.buffer_store(o_part_, val, [((split * batch + b) * H + h) * D_L + d]),
                   lambda h, val: T.buffer_store(lse_part_, val, [(split * batch + b) * H + h]))

    return body


def mla_paged_decode_tc(config: MLAConfig, schedule: MLATensorCoreSchedule | None = None):
    """MLA paged decode on tensor cores; the PrimFunc of `mla.mla_paged_decode` (same arguments,
    semantics and global symbol): q [B, H, qk_dim], pages [P, page_size, qk_dim], page_indptr
    [B+1] i32, page_indices [nnz] i32, length_info [B] i32, o [B, H, latent_dim], lse [B, H] f32
    (base 2), sm_scale f32. ValueError for a config it does not serve (see `supports_tc`)."""
    if not isinstance(config, MLAConfig):
        raise TypeError(f"config must be an MLAConfig, not {type(config).__name__}")
    problem = mla_tc_problem(config)
    if problem:
        raise ValueError(f"the tensor-core MLA decode does not serve {problem}")
    sched = schedule or choose_mla_tc_schedule(config)
    sched.check(config)
    lay = _Layout(config, sched)
    L = loop_kinds(config)
    body = _body_macro(lay, L)
    HEAD_TILES, NT, num_splits = lay.HEAD_TILES, lay.NT, lay.num_splits
    merge_splits = merge_splits_macro(L, lay.dtype, lay.H, lay.D_L, num_splits)

    @T.macro
    def kernel(q_, pages_, indptr_, indices_, length_info_, o_, lse_, o_part_, lse_part_, sm_scale_):
        batch = q_.shape[0]
        for b in L.block(batch, "x", outer=True):
            for hc in L.block(HEAD_TILES, "y"):
                for split in L.block(num_splits(batch), "z"):
                    for tid in L.thread(NT, "x"):
                        body(q_, pages_, indptr_, indices_, length_info_, o_, lse_, o_part_, lse_part_, sm_scale_,
                             b, hc, split, tid)

    return decode_contract_func(config, kernel, num_splits, merge_splits)


__all__ = ["MLATensorCoreSchedule", "choose_mla_tc_schedule", "mla_paged_decode_tc", "mla_tc_problem", "supports_tc"]
