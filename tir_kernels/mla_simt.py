"""MLA (multi-head latent attention, DeepSeek-V2/V3): paged decode and prefill on CUDA cores and the CPU.

`mla_paged_decode` and `mla_paged_prefill_simt` are the kernels `mla.py` runs where no tensor-core
kernel (mla_tc.py, mla_sm90.py) serves a config, or an `MLASchedule` asks for them.

An MLA layer caches one row per token, shared by every head: the latent vector (latent_dim
values) followed by the rotary key part (rope_dim values), in pages
`[num_pages, page_size, qk_dim]` (TVM's MLA layout, qk_dim = latent_dim + rope_dim). Queries
are absorbed: q [n, heads, qk_dim]. Head h's key for token j is the whole row, its value the
latent part, so o [n, heads, latent_dim]. The softmax scale is the caller's (DeepSeek's comes
from the original qk head dim, not from qk_dim). LSE is base 2, as everywhere (docs/design.md).

One block algorithm, `attend`, serves decode and prefill, on CUDA and on the CPU. A block owns
a tile of `tile_q` packed rows of one request, packed row p = (query token p // heads, head
p % heads), and a range of that request's keys; every latent row of the range is read once
for all the tile's rows (the heads are the M dimension of both products):

  Q_load: the tile's queries -> shared fp32, times sm_scale * log2(e) (scores in base 2).
  for each step of tile_kv latent rows (staged in registers one step ahead, 16-byte loads):
    commit the staged rows -> shared fp32 (one tile: keys are rows, values its first latent_dim
      columns)
    S = Q K^T on register micro-tiles; mask only the steps that cross the end or the causal
      diagonal; online softmax (softmax.py); O += P V.
  store: o = acc / l, lse = m + log2(l); a row that saw no key gets o = 0, lse = EMPTY_LSE.

`mla_paged_decode`: a block serves one request, one tile of heads and one split of the keys
(the split count is chosen at launch from the batch, as in decode_simt.py); splits go to an fp32
workspace that a second kernel merges (softmax.py's combine). `mla_paged_prefill_simt`: blocks
walk `qo_indptr` to find their request and row tile (no plan, no workspace) and mask causally
on absolute positions. The CPU runs the same code with one thread per block.

The schedule (`MLASchedule`, thread mapping and split policy) never changes the result.
"""

from __future__ import annotations

import dataclasses

from tvm import tirx
from tvm.script import tirx as T

from .common import LOG2E, ceildiv, is_power_of_two, kv_chunk_len, loop_kinds
from .config import MLAConfig
from .kv_quant import read_mla
from .mla_contract import decode_contract_func, prefill_contract_func
from .schedules import CUDA_DEFAULT_SHARED_BYTES, CUDA_MAX_SHARED_BYTES, CUDA_NUM_SMS, CUDA_VECTOR_BYTES
from .simt_tile import find_tile_macro, gemm_macros, load_macros, out_col, tile_softmax_macros
from .softmax import merge_splits_macro

ROW_PAD = 4  # extra fp32 words per shared-memory row, so rows start in different banks


def _require(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(f"invalid schedule: {what}")


@dataclasses.dataclass(frozen=True)
class MLASchedule:
    """Thread mapping of `mla_paged_decode` / `mla_paged_prefill`.

    A block has threads_y x threads_x threads. Thread (ty, tx) computes the scores of packed
    rows ty + threads_y * m (m < rows_per_thread) and keys tx + threads_x * n
    (n < cols_per_thread) of a step, and holds those rows' outputs at columns
    tx * 4 + 4 * threads_x * k + (0..3). So a block owns tile_q = threads_y * rows_per_thread
    packed rows and reads tile_kv = threads_x * cols_per_thread latent rows per step.
    max_splits, target_blocks (decode only; prefill needs max_splits = 1): a request's keys are
    split over ceil(target_blocks / (batch * head tiles)) blocks, at most max_splits.
    """

    threads_y: int
    threads_x: int
    rows_per_thread: int
    cols_per_thread: int
    max_splits: int = 1
    target_blocks: int = 2 * CUDA_NUM_SMS

    def __post_init__(self):
        _require(is_power_of_two(self.threads_x) and self.threads_x <= 32,
                 f"threads_x={self.threads_x} must be a power of two <= 32")
        _require(self.threads_y >= 1 and self.num_threads <= 1024,
                 f"threads_y={self.threads_y}: threads_y * threads_x must be 1..1024")
        _require(self.rows_per_thread >= 1, f"rows_per_thread={self.rows_per_thread} must be >= 1")
        _require(self.cols_per_thread >= 1, f"cols_per_thread={self.cols_per_thread} must be >= 1")
        _require(self.max_splits >= 1, f"max_splits={self.max_splits} must be >= 1")
        _require(self.target_blocks >= 1, f"target_blocks={self.target_blocks} must be >= 1")

    @property
    def num_threads(self) -> int:
        return self.threads_y * self.threads_x

    @property
    def tile_q(self) -> int:
        return self.threads_y * self.rows_per_thread

    @property
    def tile_kv(self) -> int:
        return self.threads_x * self.cols_per_thread

    def shared_bytes(self, config: MLAConfig) -> int:
        """fp32 tiles of Q and of the latent rows (padded rows) and of P."""
        row = config.qk_dim + ROW_PAD
        return 4 * (self.tile_q * row + self.tile_kv * row + self.tile_q * (self.tile_kv + ROW_PAD))

    def check(self, config: MLAConfig) -> None:
        _require(config.latent_dim % (4 * self.threads_x) == 0,
                 f"threads_x={self.threads_x}: 4 * threads_x must divide latent_dim={config.latent_dim}")
        if not config.is_gpu:
            _require(self.num_threads == 1, f"threads_y * threads_x = {self.num_threads} must be 1 on the CPU")
            return
        _require(self.num_threads % 32 == 0, f"threads_y * threads_x = {self.num_threads} must be a multiple of 32")
        limit = CUDA_MAX_SHARED_BYTES.get(config.cuda_arch, CUDA_DEFAULT_SHARED_BYTES)
        _require(self.shared_bytes(config) <= limit,
                 f"tile_q={self.tile_q}, tile_kv={self.tile_kv} need {self.shared_bytes(config)} bytes of shared"
                 f" memory, {config.cuda_arch} has {limit}")


def choose_mla_schedule(config: MLAConfig, decode: bool) -> MLASchedule:
    """CPU: one thread computing a 16 (decode: at most `num_heads`) x 32 tile, no split.
    CUDA: 16 x 16 threads (fewer along a row where latent_dim is not a multiple of 64), 32 rows
    per block (16 for decode with 16 heads or fewer: one row per thread), 32 latent rows per
    step (16 in float32, whose staged rows take twice the registers), fewer where the arch's
    shared memory does not hold the tiles; decode splits up to 64 ways."""
    if not config.is_gpu:
        rows = min(config.num_heads, 16) if decode else 16
        return MLASchedule(threads_y=1, threads_x=1, rows_per_thread=rows, cols_per_thread=32)
    threads_x = 16
    while config.latent_dim % (4 * threads_x):
        threads_x //= 2
    threads_y = 16
    rows = 16 if decode and config.num_heads <= 16 else 32
    tile_kv = 32 if config.elem_bytes == 2 else 16
    limit = CUDA_MAX_SHARED_BYTES.get(config.cuda_arch, CUDA_DEFAULT_SHARED_BYTES)
    while True:
        sched = MLASchedule(
            threads_y=threads_y, threads_x=threads_x, rows_per_thread=rows // threads_y,
            cols_per_thread=max(1, tile_kv // threads_x),
            max_splits=64 if decode else 1,
        )
        if sched.shared_bytes(config) <= limit or (rows == 16 and tile_kv == 16):
            return sched
        if tile_kv > 16:
            tile_kv = 16
        else:
            rows = 16


@dataclasses.dataclass(frozen=True)
class _Dims:
    """Compile-time sizes of one MLA attention kernel (its config and schedule) and the index
    arithmetic on them."""

    gpu: bool
    dtype: str
    H: int  # query heads
    D_QK: int  # values per latent row and per query head
    D_L: int  # latent (output) width
    ps: int  # page size
    TY: int  # threads along a tile's rows (threadIdx.y)
    TX: int  # threads along a row (threadIdx.x)
    TM: int  # rows per thread
    TN: int  # keys per thread per step
    VEC: int  # elements per 16-byte global access
    MAX_SPLITS: int
    TARGET_BLOCKS: int
    scaling: None = None  # RoPE frequency scaling read by simt_tile.load_macros: MLA kernels rotate nothing
    config: MLAConfig | None = None  # for kv_quant.read_mla (FP8 pages: dequantized as they are staged)
    KV_FP8: bool = False  # the pages hold FP8 codes, staged element by element (simt_tile.load_macros)

    @classmethod
    def of(cls, config: MLAConfig, sched: MLASchedule) -> "_Dims":
        return cls(
            gpu=config.is_gpu, dtype=config.dtype, H=config.num_heads, D_QK=config.qk_dim, D_L=config.latent_dim,
            ps=config.page_size, TY=sched.threads_y, TX=sched.threads_x, TM=sched.rows_per_thread,
            TN=sched.cols_per_thread, VEC=CUDA_VECTOR_BYTES // config.elem_bytes,
            MAX_SPLITS=sched.max_splits, TARGET_BLOCKS=sched.target_blocks, config=config, KV_FP8=config.kv_fp8,
        )

    def kv_at(self, pages):
        """kv_at_(slot, d) of `attend` over an MLA pool: element d of the latent row in pool slot
        `slot` (page id * page_size + offset), in the dtype (FP8 pages: dequantized)."""
        return lambda slot, d: read_mla(self.config, pages, slot // self.ps, slot % self.ps, d)

    @property
    def BQ(self) -> int:  # packed rows per block
        return self.TY * self.TM

    @property
    def BK(self) -> int:  # latent rows per step
        return self.TX * self.TN

    @property
    def NT(self) -> int:  # threads per block
        return self.TY * self.TX

    @property
    def QS(self) -> int:  # shared-memory row strides (padded) of the Q and latent tiles and of P
        return self.D_QK + ROW_PAD

    @property
    def KS(self) -> int:
        return self.D_QK + ROW_PAD

    @property
    def VS(self) -> int:  # values are the first D_L columns of the latent tile
        return self.KS

    @property
    def PS(self) -> int:
        return self.BK + ROW_PAD

    @property
    def OC(self) -> int:  # output columns per thread
        return self.D_L // self.TX

    @property
    def shared(self) -> str:
        return "shared.dyn" if self.gpu else "local"

    @property
    def head_tiles(self) -> int:  # decode blocks per request and split
        return ceildiv(self.H, self.BQ)

    def chunks(self, width):
        """16-byte chunks of a row of `width` elements."""
        return width // self.VEC

    def load_iters(self, rows, width):
        """Steps for NT threads to load `rows` rows of `width` elements, a chunk each."""
        return ceildiv(rows * self.chunks(width), self.NT)

    def out_col(self, tx, c):
        """Output column of a thread's c-th output register."""
        return out_col(self.TX, tx, c)

    def num_splits(self, batch):
        """Splits per request, chosen at launch so that batch * head tiles * splits fills the GPU."""
        if self.MAX_SPLITS == 1:
            return 1
        return T.min(T.max(ceildiv(self.TARGET_BLOCKS, batch * self.head_tiles), 1), self.MAX_SPLITS)

    def row_tiles(self, qo_indptr, b):
        """Prefill: row tiles of request b (qo_len * H packed rows)."""
        return ceildiv((qo_indptr[b + 1] - qo_indptr[b]) * self.H, self.BQ)

    def num_slots(self, total_q, batch):
        """Prefill: an upper bound of the number of row tiles over all requests."""
        return ceildiv(total_q * self.H, self.BQ) + batch

    def visible_end(self, kv_len, qo_len, p, causal):
        """Prefill: keys packed row p sees, [0, visible_end): all kv_len of them unless causal;
        causal query i of qo_len sees keys j <= kv_len - qo_len + i."""
        last = kv_len - qo_len + T.min(p // self.H, qo_len - 1) + 1
        return T.if_then_else(causal != 0, T.max(T.min(last, kv_len), 0), kv_len)


def _attend_macro(dims: _Dims, L):
    """attend: the online softmax of one block's rows over one range of keys (module docstring)."""
    dtype, D_QK, BQ, BK, QS, KS, PS = dims.dtype, dims.D_QK, dims.BQ, dims.BK, dims.QS, dims.KS, dims.PS
    TX, VEC, shared = dims.TX, dims.VEC, dims.shared
    load_q, stage_kv, commit_kv = load_macros(dims, L)
    s_gemm, o_gemm = gemm_macros(dims, L)
    init, mask, softmax, _ = tile_softmax_macros(dims, L)

    @T.macro
    def sync_threads():
        """Block-wide barrier (CUDA only: the CPU runs one thread per block)."""
        if dims.gpu:
            T.tvm_storage_sync(shared)

    @T.macro
    def attend(q_at_, slot_of_, kv_at_, rows_, p0_, j_begin_, j_end_, visible_end_, sm_scale_, ty_, tx_,
               o_, m_run_, l_run_):
        """Rows p0_ .. p0_ + BQ - 1 (those below rows_ are real) over keys j_begin_ .. j_end_ - 1.

        q_at_(p, d): element d of packed row p's query. slot_of_(j): where key j lives (an int32
        handle); kv_at_(slot, d): element d of that latent row. visible_end_(p): row p sees keys
        below it only (keys from j_end_ on are never seen). Leaves the unfinished softmax state
        of the thread's rows in o_ [TM * OC], m_run_, l_run_ [TM] for `store`.
        """
        qs = T.alloc_buffer((BQ * QS,), "float32", scope=shared)
        ks = T.alloc_buffer((BK * KS,), "float32", scope=shared)
        ps = T.alloc_buffer((BQ * PS,), "float32", scope=shared)
        stage = T.alloc_buffer((dims.load_iters(BK, D_QK) * VEC,), dtype, scope="local")
        s = T.alloc_buffer((dims.TM * dims.TN,), "float32", scope="local")
        tid = T.meta_var(ty_ * TX + tx_)
        rows = rows_  # bound once: the arguments may be expressions that read memory
        p0 = p0_
        j_begin = j_begin_
        j_end = j_end_
        # Keys every row of the tile sees: steps below need no mask.
        free_end = T.min(j_end, visible_end_(p0))
        init(m_run_, l_run_, o_, dims.TM, dims.OC)
        load_q(q_at_, None, qs, rows, p0, tid, False, None, None, sm_scale_ * T.float32(LOG2E))
        stage_kv(stage, slot_of_, kv_at_, D_QK, j_begin, j_end, tid, False, None, None, None)
        for t in T.serial(ceildiv(j_end - j_begin, BK)):
            sync_threads()
            commit_kv(stage, ks, D_QK, KS, tid)
            sync_threads()
            if j_begin + (t + 1) * BK < j_end:
                stage_kv(stage, slot_of_, kv_at_, D_QK, j_begin + (t + 1) * BK, j_end, tid, False, None, None, None)
            s_gemm(qs, ks, s, ty_, tx_)
            # TVM's barrier planner sees the dynamic shared pool as one buffer, so it wants a
            # barrier between the S_gemm reads and the P writes; place it here explicitly.
            sync_threads()
            if j_begin + (t + 1) * BK > free_end:
                mask(s, lambda p, j: tirx.any(j_begin + t * BK + j >= j_end, j_begin + t * BK + j >= visible_end_(p)),
                     p0, ty_, tx_)
            softmax(s, ps, o_, m_run_, l_run_, ty_, tx_)
            sync_threads()
            o_gemm(ps, ks, o_, ty_, tx_)

    return attend


def _schedule_for(config: MLAConfig, schedule: MLASchedule | None, decode: bool) -> MLASchedule:
    if not isinstance(config, MLAConfig):
        raise TypeError(f"config must be an MLAConfig, not {type(config).__name__}")
    sched = schedule or choose_mla_schedule(config, decode)
    sched.check(config)
    if not decode:
        _require(sched.max_splits == 1, f"max_splits={sched.max_splits}: prefill does not split (expected 1)")
    return sched


def _merge_splits_macro(dims: _Dims, L):
    """merge_splits: the FP32 merge of each (request, head)'s split states (decode)."""
    return merge_splits_macro(L, dims.dtype, dims.H, dims.D_L, dims.num_splits)


def mla_paged_decode(config: MLAConfig, schedule: MLASchedule | None = None):
    """MLA paged decode PrimFunc (one query token per request), arguments in the contract's order:

    q [B, H, qk_dim], pages [P, page_size, qk_dim], page_indptr [B+1] i32, page_indices [nnz] i32,
    length_info [B] i32 (slots used in each request's last page), o [B, H, latent_dim],
    lse [B, H] f32 (base 2), sm_scale f32. qk_dim = latent_dim + rope_dim.
    Each head attends to all of its request's latent rows; a request with none gets o = 0 and
    lse = EMPTY_LSE.
    """
    sched = _schedule_for(config, schedule, decode=True)
    dims = _Dims.of(config, sched)
    L = loop_kinds(config)
    attend = _attend_macro(dims, L)
    _, _, _, store = tile_softmax_macros(dims, L)
    merge_splits = _merge_splits_macro(dims, L)
    dtype, ps, H, D_L = dims.dtype, dims.ps, dims.H, dims.D_L
    TY, TX, TM, OC, BQ = dims.TY, dims.TX, dims.TM, dims.OC, dims.BQ

    @T.macro
    def split_kernel(Q_, pages_, indptr_, indices_, length_info_, O_, lse_, o_part_, lse_part_, sm_scale_):
        """One block per (request, head tile, split): attend, then write o_ / lse_, or the
        split's partial state when the keys are split."""
        batch = Q_.shape[0]
        for b in L.block(batch, "x", outer=True):
            for hc in L.block(dims.head_tiles, "y"):
                for split in L.block(dims.num_splits(batch), "z"):
                    for ty in L.thread(TY, "y"):
                        for tx in L.thread(TX, "x"):
                            o = T.alloc_buffer((TM * OC,), "float32", scope="local")
                            m_run = T.alloc_buffer((TM,), "float32", scope="local")
                            l_run = T.alloc_buffer((TM,), "float32", scope="local")
                            page0 = indptr_[b]
                            kv_len = kv_chunk_len(indptr_[b + 1] - page0, ps, length_info_, b, False)
                            split_len = ceildiv(kv_len, dims.num_splits(batch))
                            j_begin = T.min(split * split_len, kv_len)
                            j_end = T.min(j_begin + split_len, kv_len)
                            # A latent row's handle is its slot in the pool: page id * page_size + offset.
                            attend(lambda p, d: Q_[b, p, d], lambda j: indices_[page0 + j // ps] * ps + j % ps,
                                   dims.kv_at(pages_), H, hc * BQ, j_begin, j_end,
                                   lambda p: j_end, sm_scale_, ty, tx, o, m_run, l_run)
                            if dims.num_splits(batch) == 1:
                                store(o, m_run, l_run, H, hc * BQ, ty, tx,
                                      lambda p, d, val: T.buffer_store(O_, T.Cast(dtype, val), [b, p, d]),
                                      lambda p, val: T.buffer_store(lse_, val, [b, p]))
                            else:
                                store(o, m_run, l_run, H, hc * BQ, ty, tx,
                                      lambda p, d, val: T.buffer_store(
                                          o_part_, val, [((split * batch + b) * H + p) * D_L + d]),
                                      lambda p, val: T.buffer_store(lse_part_, val, [(split * batch + b) * H + p]))

    return decode_contract_func(config, split_kernel, dims.num_splits, merge_splits)


def mla_paged_prefill_simt(config: MLAConfig, schedule: MLASchedule | None = None):
    """MLA paged prefill PrimFunc on CUDA cores (and the CPU), arguments in the contract's order:

    q [total_q, H, qk_dim], qo_indptr [B+1] i32, pages [P, page_size, qk_dim],
    page_indptr [B+1] i32, page_indices [nnz] i32, length_info [B] i32 (slots used in the last
    page), o [total_q, H, latent_dim], lse [total_q, H] f32 (base 2), causal i32, sm_scale f32.
    With causal != 0, query i of a request's qo_len sees latent rows j <= kv_len - qo_len + i
    (absolute positions); else all of them. Rows that see none get o = 0 and lse = EMPTY_LSE.
    (TVM's cache calls it with causal = 0 for MLA cross-attention over the cached history, for
    decode too.)
    """
    sched = _schedule_for(config, schedule, decode=False)
    dims = _Dims.of(config, sched)
    L = loop_kinds(config)
    attend = _attend_macro(dims, L)
    _, _, _, store = tile_softmax_macros(dims, L)
    find_tile = find_tile_macro(dims.row_tiles)
    dtype, ps, H = dims.dtype, dims.ps, dims.H
    TY, TX, TM, OC, BQ = dims.TY, dims.TX, dims.TM, dims.OC, dims.BQ

    @T.macro
    def kernel(Q_, qo_indptr_, pages_, indptr_, indices_, length_info_, O_, lse_, causal_, sm_scale_, batch_):
        """One block per tile slot (module docstring)."""
        for blk in L.block(dims.num_slots(Q_.shape[0], batch_), "x", outer=True):
            for ty in L.thread(TY, "y"):
                for tx in L.thread(TX, "x"):
                    req = T.alloc_buffer((1,), "int32", scope="local")
                    tile = T.alloc_buffer((1,), "int32", scope="local")
                    o = T.alloc_buffer((TM * OC,), "float32", scope="local")
                    m_run = T.alloc_buffer((TM,), "float32", scope="local")
                    l_run = T.alloc_buffer((TM,), "float32", scope="local")
                    find_tile(qo_indptr_, batch_, blk, req, tile)
                    b = req[0]
                    q0 = qo_indptr_[b]
                    qo_len = qo_indptr_[b + 1] - q0
                    page0 = indptr_[b]
                    kv_len = kv_chunk_len(indptr_[b + 1] - page0, ps, length_info_, b, False)
                    # A block without a tile (tile < 0) runs no step and writes nothing: no branch
                    # around the body, as its barriers must stay in uniform, unconditional code.
                    rows = T.if_then_else(tile[0] >= 0, qo_len * H, 0)
                    p0 = T.max(tile[0], 0) * BQ
                    j_end = T.if_then_else(tile[0] >= 0, dims.visible_end(kv_len, qo_len, p0 + BQ - 1, causal_), 0)
                    attend(lambda p, d: Q_[q0 + p // H, p % H, d], lambda j: indices_[page0 + j // ps] * ps + j % ps,
                           dims.kv_at(pages_), rows, p0, 0, j_end,
                           lambda p: dims.visible_end(kv_len, qo_len, p, causal_), sm_scale_, ty, tx, o, m_run, l_run)
                    store(o, m_run, l_run, rows, p0, ty, tx,
                          lambda p, d, val: T.buffer_store(O_, T.Cast(dtype, val), [q0 + p // H, p % H, d]),
                          lambda p, val: T.buffer_store(lse_, val, [q0 + p // H, p % H]))

    return prefill_contract_func(config, kernel)
