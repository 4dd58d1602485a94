"""MLA paged prefill on Hopper tensor cores (sm_90a): absorbed queries over the latent pages.

Same contract as `mla.mla_paged_prefill` (q [n, H, qk_dim], pages [P, page_size, qk_dim],
o [n, H, latent_dim], lse base 2). The heads are the M dimension: packed row p = (token p // H,
head p % H), a CTA owns a tile of 64 packed rows of one request (tiles numbered from the
request's last, as in prefill_sm90), and every latent row is both the key (all qk_dim values)
and, through its first latent_dim values, the value.

A CTA has three warpgroups:
  warpgroup 0, the producer: gathers each step's tile_kv latent rows through the page table
    with 16-byte `cp.async` copies into a ring of `stages` buffers in the 128B-swizzled layout
    (rows past the visible end zero-filled), and signals each buffer full on an mbarrier. The
    value operand is the same buffer: its first latent_dim columns, read MN-major.
  warpgroups 1 and 2, the consumers: both own all 64 rows; consumer c accumulates output columns
    [c * latent_dim / 2, (c + 1) * latent_dim / 2) (a 64 x 512 fp32 accumulator does not fit one
    warpgroup's registers), so each needs P of all the step's keys. Two schedules:
    - split_keys: consumer c computes S = Q K^T by `wgmma` for its
      half of the step's keys only, masks, exchanges its row maxima with the other consumer
      through shared memory (named barrier), runs the online softmax in base 2 on the common
      maxima, packs P into the registers of wgmma's A operand, and exchanges them too: a
      thread's A fragment holds the same rows in both consumers, so the other half is read as
      stored. Then O += P V of its columns by `wgmma`. Row sums are combined at the end.
    - duplicated scores (split_keys=False; the default, with four 32-row stages where they fit:
      `choose_mla_wgmma_schedule`): each consumer computes S for all the step's keys
      itself (the score product runs twice per CTA: 65% of the executed flops are useful at
      576 / 512), no exchange; the consumers take turns issuing S = Q K^T (named barriers) so
      that one's softmax overlaps the other's product.
    Consumer 0 writes lse.

Decode (`mla_paged_decode_wgmma`, `mla.mla_paged_decode`'s contract): the same CTA with one
query a request, so packed row p is head p; CTAs (request, 64-head tile, split slot), the slots
per (request, tile) chosen at launch (`MLAWgmmaDecodeSplit`: about one CTA an SM, 1 from 67
tiles up). A split CTA runs the same loop over its run of whole steps. A TIRx PrimFunc lowers to
one kernel, so the merge is in it: a split writes its FP32 o / lse to the function's workspace,
arrives at its group's counter (`_split_sync`: module-scope __device__ counters, zeroed at module
load and left zero by every launch), and, once all the group's splits arrived, every member CTA
that waits (all of them when the whole grid is resident, else only the last to arrive) claims
pairs of the tile's heads and merges them (a consumer a head, a thread per float4 of the row).
"""

from __future__ import annotations

import dataclasses

import tvm
from tvm.script import tirx as T

from .build import TIRX_ATTR
from .common import EMPTY_LSE, LOG2E, ceildiv, kv_chunk_len
from .config import MLAConfig
from .cuda_funcs import LDCG, LDCG4, LDCG4_SRC, LDCG_SRC
from .hopper import (
    CHUNK,
    PANEL,
    pack2,
    ring_barriers,
    ring_producer,
    row_softmax,
    swizzled,
    wgmma_accumulate,
    wgmma_name,
    wgmma_scores,
)
from .mla_contract import decode_contract_func, prefill_contract_func
from .schedules import CUDA_MAX_SHARED_BYTES, CUDA_NUM_SMS
from .simt_tile import find_tile_macro
from .softmax import finalize_lse, finalize_scale, finished_l, prob, rescale_factor
from .support import TENSOR_CORE_DTYPES, WGMMA_ARCHS

WARPGROUP = 128
CONSUMERS = 2
Q_BARRIER = 1  # named barrier: both consumers' halves of the Q tile have landed
TURN_BARRIER = 3  # named barriers 3 and 4: the consumers' turns on S = Q K^T
MERGE_BARRIER = 5  # named barrier: the consumers of a decode split CTA around its merge's steps
MERGE_UNROLL = 16  # split partials a merging thread loads at once
MASKED = -1.0e30
BARRIER_BYTES = 64  # the ring's mbarriers and alignment slack, beside the dynamic buffer


@dataclasses.dataclass(frozen=True)
class MLAWgmmaDecodeSplit:
    """Split-KV of the wgmma decode, chosen at launch from the batch: slots = min(target_ctas //
    (batch * head tiles), max_splits) split CTAs per (request, head tile) (at least 1); a request
    of kv_len keys uses min(slots, ceil(kv_len / min_split_keys)) of them, each a run of whole
    tile_kv steps. max_splits=1: never split (one CTA per request and head tile). target_ctas is
    also the number of (request, head tile) arrival counters (a split launch has at most
    target_ctas / 2 such groups)."""

    max_splits: int = 66
    min_split_keys: int = 128
    target_ctas: int = CUDA_NUM_SMS

    def __post_init__(self):
        for name in ("max_splits", "min_split_keys", "target_ctas"):
            if getattr(self, name) < 1:
                raise ValueError(f"invalid decode split: {name}={getattr(self, name)} must be >= 1")

    def slots(self, batch, head_tiles: int):
        """Split CTAs per (request, head tile) in a launch of `batch` requests (an int for an int
        batch, else a PrimExpr)."""
        if self.max_splits == 1:
            return 1
        if isinstance(batch, int):
            return min(max(self.target_ctas // (batch * head_tiles), 1), self.max_splits)
        return T.min(T.max(self.target_ctas // (batch * head_tiles), 1), self.max_splits)


def _split_sync(groups: int):
    """{name: (function, CUDA source)} of the split decode's counters: a module-scope __device__ array
    (zeroed when the module loads, left zero by every launch; launches of one module must not
    overlap in time). Per (request, head tile) group g: arrivals, merge claims, departures; for
    the grid: CTAs started, CTAs ended (the last to end resets both).
      start(): a CTA has started (so is resident or done).
      arrive(g, n, grid): after the CTA's partial is written: 1 when this CTA merges. The n-th
        arrival merges at once; an earlier one waits for the n-th (acquire spin) only when all
        grid CTAs have started (then every member is resident and will arrive: no deadlock),
        else returns 0 (and the last arrival merges every row alone).
      claim(g): the next unit of the group's merge (units past the last: done).
      depart(g, n) / end(grid): the last of the group / grid resets its counters."""
    tag = f"tvmattn_mla_split_{groups}"
    c, grid_word = f"{tag}_counters", 3 * groups
    # TVM emits a function's source once per name: each carries the guarded shared part
    common = f"""
#ifndef {tag.upper()}
#define {tag.upper()}
__device__ unsigned {c}[{3 * groups + 2}];
__device__ __forceinline__ unsigned {tag}_acquire(const unsigned* p) {{
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}}
#endif
"""
    bodies = {
        "start": f"""(int unused) {{
  atomicAdd(&{c}[{grid_word}], 1u);
  return unused;
}}""",
        "arrive": f"""(int g, int n, int grid) {{
  __threadfence();
  unsigned seen = atomicAdd(&{c}[3 * g], 1u) + 1u;
  if (seen < (unsigned)n) {{
    if ({tag}_acquire(&{c}[{grid_word}]) < (unsigned)grid) return 0;
    while ({tag}_acquire(&{c}[3 * g]) < (unsigned)n) __nanosleep(32);
  }}
  __threadfence();
  return 1;
}}""",
        "claim": f"""(int g) {{
  return (int)atomicAdd(&{c}[3 * g + 1], 1u);
}}""",
        "depart": f"""(int g, int n) {{
  if (atomicAdd(&{c}[3 * g + 2], 1u) + 1u == (unsigned)n) {{
    {c}[3 * g] = 0u;
    {c}[3 * g + 1] = 0u;
    {c}[3 * g + 2] = 0u;
  }}
  return 0;
}}""",
        "end": f"""(int grid) {{
  if (atomicAdd(&{c}[{grid_word} + 1], 1u) + 1u == (unsigned)grid) {{
    {c}[{grid_word}] = 0u;
    {c}[{grid_word} + 1] = 0u;
  }}
  return 0;
}}""",
    }
    return {k: (f"{tag}_{k}", f"{common}__device__ __forceinline__ int {tag}_{k}{body}\n")
            for k, body in bodies.items()}
@dataclasses.dataclass(frozen=True)
class MLAWgmmaSchedule:
    """Tiling of the tensor-core MLA prefill: tile_kv latent rows a step (the N of S = Q K^T),
    `stages` buffers in the ring, registers per thread after `setmaxnreg` (producer, consumers),
    pingpong: the consumers take turns on S = Q K^T. split_keys: instead, consumer c computes the
    scores of its half of the step's keys only, and the two exchange row maxima and packed P
    through shared memory (no score computed twice; no pingpong). tile_q = 64 packed rows per CTA."""

    tile_kv: int = 64
    stages: int = 2
    producer_regs: int = 40
    consumer_regs: int = 232
    pingpong: bool = True
    split_keys: bool = False

    tile_q = 64
    REGISTER_FILE = 65536

    def __post_init__(self):
        if self.tile_kv not in (16, 32, 64, 128):
            raise ValueError(f"invalid schedule: tile_kv={self.tile_kv} must be 16, 32, 64 or 128 (it divides the "
                             "producer's 128 threads)")
        if self.split_keys and self.tile_kv < 32:
            raise ValueError(f"invalid schedule: split_keys needs tile_kv >= 32, not {self.tile_kv}")
        if self.stages < 2:
            raise ValueError(f"invalid schedule: stages={self.stages} must be >= 2")
        for name in ("producer_regs", "consumer_regs"):
            value = getattr(self, name)
            if not (value % 8 == 0 and 24 <= value <= 256):
                raise ValueError(f"invalid schedule: {name}={value} must be a multiple of 8 in 24..256")
        if 128 * (self.producer_regs + 2 * self.consumer_regs) > self.REGISTER_FILE:
            raise ValueError("invalid schedule: producer_regs + 2 * consumer_regs exceeds 512")

    def shared_bytes(self, config: MLAConfig) -> int:
        """The Q tile and `stages` latent tiles, two bytes an element (split_keys: and the P and
        row-state exchange buffers)."""
        tiles = 2 * config.qk_dim * (self.tile_q + self.stages * self.tile_kv)
        return tiles + (self.exchange_words() * 4 if self.split_keys else 0)

    def exchange_words(self) -> int:
        """32-bit words of the split_keys exchange: packed P halves (2 consumers x 128 threads x
        tile_kv / 8) and row maxima and sums (2 x 2 x tile_q)."""
        return 2 * 128 * (self.tile_kv // 8) + 4 * self.tile_q

    def accumulator_registers(self, config: MLAConfig) -> int:
        """fp32 S and O (half the latent width) fragments and the packed P of one consumer thread."""
        return self.tile_kv // 2 + config.latent_dim // 4 + self.tile_kv // 4

    def check(self, config: MLAConfig) -> None:
        limit = CUDA_MAX_SHARED_BYTES["sm_90"] - BARRIER_BYTES
        if self.shared_bytes(config) > limit:
            raise ValueError(f"invalid schedule: tile_kv={self.tile_kv}, stages={self.stages} need "
                             f"{self.shared_bytes(config)} bytes of shared memory at qk_dim={config.qk_dim}, "
                             f"sm_90 has {limit}")
        if self.accumulator_registers(config) + 56 > self.consumer_regs:
            raise ValueError(f"invalid schedule: tile_kv={self.tile_kv} at latent_dim={config.latent_dim} needs "
                             f"{self.accumulator_registers(config)} accumulator registers; "
                             f"consumer_regs={self.consumer_regs}")


def mla_wgmma_problem(config: MLAConfig) -> str | None:
    """Why the tensor-core MLA prefill cannot serve `config`, or None when it can."""
    if not config.is_gpu or config.cuda_arch not in WGMMA_ARCHS:
        return f"target {config.target!r} is not a Hopper GPU (sm_90)"
    if config.dtype not in TENSOR_CORE_DTYPES:
        return f"dtype={config.dtype!r} (tensor cores serve {' and '.join(TENSOR_CORE_DTYPES)})"
    if config.kv_fp8:
        return (f"kv_dtype={config.kv_dtype!r} (its TMA loads feed wgmma the pages as they are: FP8 pages are read "
                "by mla_simt's prefill and mla_tc's decode)")
    if config.latent_dim % (2 * PANEL) or config.latent_dim > 512:
        return f"latent_dim={config.latent_dim} (a multiple of {2 * PANEL} up to 512: two {PANEL}-aligned halves)"
    if config.qk_dim % PANEL:
        return f"qk_dim={config.qk_dim} (latent + rope must be a multiple of {PANEL})"
    sched = MLAWgmmaSchedule(tile_kv=16)
    if sched.shared_bytes(config) > CUDA_MAX_SHARED_BYTES["sm_90"] - BARRIER_BYTES:
        return f"qk_dim={config.qk_dim} (the tiles do not fit shared memory)"
    return None


# Schedules in order of preference (tile_kv, stages, split_keys): on DeepSeek shapes four 32-row
# stages with duplicated scores (pingpong) ran faster than two 64-row stages with split keys, and
# four 32-row stages with split keys about as fast as two 64-row ones (docs/performance.md); the
# smaller ones serve configs whose tiles do not fit otherwise.
WGMMA_SCHEDULE_ORDER = ((32, 4, False), (64, 2, True), (64, 2, False), (32, 2, True), (32, 2, False),
                        (16, 4, False), (16, 2, False))


def choose_mla_wgmma_schedule(config: MLAConfig) -> MLAWgmmaSchedule:
    """The first of WGMMA_SCHEDULE_ORDER that fits shared memory and registers."""
    for tile_kv, stages, split in WGMMA_SCHEDULE_ORDER:
        sched = MLAWgmmaSchedule(tile_kv=tile_kv, stages=stages, split_keys=split)
        try:
            sched.check(config)
        except ValueError:
            continue
        return sched
    raise ValueError(f"the tensor-core MLA prefill has no schedule for qk_dim={config.qk_dim}")


class _Layout:
    """Compile-time sizes of one wgmma MLA kernel (its config, schedule and decode split), the
    regions of its shared buffer, and the index arithmetic on them. Every name __init__ binds
    is an attribute; the macro factories below unpack the ones their macros read."""

    def __init__(self, config: MLAConfig, sched: MLAWgmmaSchedule, split: MLAWgmmaDecodeSplit):
        dtype, H, ps = config.dtype, config.num_heads, config.page_size
        D_QK, D_L = config.qk_dim, config.latent_dim
        DVH = D_L // 2  # output columns per consumer
        BM, BN, ST = sched.tile_q, sched.tile_kv, sched.stages
        K_OFF = BM * D_QK
        K_ELEMS = BN * D_QK
        SMEM_ELEMS = K_OFF + ST * K_ELEMS
        WG_S = wgmma_name(f"m64n{BN}k16", dtype)
        WG_O = wgmma_name(f"m64n{DVH}k16", dtype)
        WG_SH = wgmma_name(f"m64n{BN // 2}k16", dtype)
        NS, NO, NP = BN // 2, DVH // 2, BN // 4
        CHUNKS = D_QK // CHUNK  # 16-byte chunks per row
        TPR = WARPGROUP // BN  # producer threads per latent row
        PINGPONG = sched.pingpong and not sched.split_keys
        SPLIT = sched.split_keys
        BNH = BN // 2  # split_keys: keys per consumer and step
        NSH, NPH = BNH // 2, BNH // 4  # its S (fp32) and P (packed) registers
        X_BARRIER, P_BARRIER = 2, 3  # split_keys: row maxima, P halves exchanged
        HEAD_TILES = ceildiv(H, BM)
        VECS = D_L // 4  # float4 columns of an output row in the split merge
        SYNC = _split_sync(split.target_ctas)
        vars(self).update((name, value) for name, value in locals().items() if name != "self")

    def row_tiles(self, qo_indptr, b):
        return ceildiv((qo_indptr[b + 1] - qo_indptr[b]) * self.H, self.BM)

    def visible_end(self, kv_len, qo_len, p, causal):
        """Keys packed row p sees: [0, visible_end) (causal: query i sees j <= kv_len - qo_len + i)."""
        last = kv_len - qo_len + T.min(p // self.H, qo_len - 1) + 1
        return T.if_then_else(causal != 0, T.max(T.min(last, kv_len), 0), kv_len)

    def sync_call(self, name, *args):
        """A call of the split decode's counter function `name` (`_split_sync`)."""
        return T.cuda.func_call(self.SYNC[name][0], *args, source_code=self.SYNC[name][1], return_type="int32")


def _produce_macros(lay: _Layout):
    """The producer: copy_rows (rows -> a swizzled tile) and produce (the ring of latent tiles)."""
    BN, CHUNKS, K_ELEMS, K_OFF, ST, TPR = lay.BN, lay.CHUNKS, lay.K_ELEMS, lay.K_OFF, lay.ST, lay.TPR
    produce_steps = ring_producer(ST)

    @T.macro
    def copy_rows(smem_, base_, row0_, rows_, tile_rows_, tid_, src_, valid_):
        """cp.async rows row0_ .. row0_ + rows_ of the swizzled tile of tile_rows_ rows at
        smem_[base_] (one warpgroup, 16 bytes a thread a step); src_(r, c): address of element c
        of tile row r; valid_(r) False: zeros."""
        for it in T.unroll(ceildiv(rows_ * CHUNKS, WARPGROUP)):
            idx = T.meta_var(it * WARPGROUP + tid_)
            r = T.meta_var(row0_ + idx // CHUNKS)
            c = T.meta_var(idx % CHUNKS * CHUNK)
            if rows_ * CHUNKS % WARPGROUP == 0 or idx < rows_ * CHUNKS:
                T.ptx["cp.async.cg.shared.global"](
                    smem_.ptr_to([base_ + swizzled(tile_rows_, r, c)]), src_(r, c), 16,
                    T.Cast("uint32", T.if_then_else(valid_(r), 16, 0)))

    @T.macro
    def copy_step(smem_, t, kv_end_, tid_, slot_of_, row_ptr_, slot):
        """Step t's latent rows -> buffer t % ST (cp.async; rows past kv_end_ zero-filled)."""
        # TPR threads per latent row: one page-table lookup per thread and step
        slot[0] = slot_of_(T.min(t * BN + tid_ // TPR, kv_end_ - 1))
        for k in T.unroll(CHUNKS // TPR):
            T.ptx["cp.async.cg.shared.global"](
                smem_.ptr_to([K_OFF + (t % ST) * K_ELEMS
                              + swizzled(BN, tid_ // TPR, (tid_ % TPR + k * TPR) * CHUNK)]),
                row_ptr_(slot[0], (tid_ % TPR + k * TPR) * CHUNK), 16,
                T.Cast("uint32", T.if_then_else(t * BN + tid_ // TPR < kv_end_, 16, 0)))

    @T.macro
    def produce(smem_, full_, empty_, nkv_, kv_end_, tid_, slot_of_, row_ptr_):
        """The ring: step t's latent rows -> buffer t % ST, signalled full once they landed."""
        slot = T.alloc_local((1,), "int32")
        produce_steps(full_, empty_, nkv_, lambda t: copy_step(smem_, t, kv_end_, tid_, slot_of_, row_ptr_, slot))

    return copy_rows, produce


def _mma_macros(lay: _Layout):
    """The consumers' products and output: s_mma, s_mma_half (split_keys), pv_mma, mask and
    write_state."""
    BM, BN, BNH, DVH, D_QK, K_ELEMS, K_OFF = lay.BM, lay.BN, lay.BNH, lay.DVH, lay.D_QK, lay.K_ELEMS, lay.K_OFF
    NO, NP, NS, NSH, WG_O, WG_S, WG_SH = lay.NO, lay.NP, lay.NS, lay.NSH, lay.WG_O, lay.WG_S, lay.WG_SH
    scores = wgmma_scores(WG_S, NS, D_QK // 16)
    scores_half = wgmma_scores(WG_SH, NSH, D_QK // 16)
    accumulate = wgmma_accumulate(WG_O, NO, NP, BN // 16, BN)

    @T.macro
    def s_mma(smem_, sacc_, s_):
        """sacc_ <- Q K^T of buffer s_ (every key of the step)."""
        scores(smem_, sacc_, lambda kk: (kk * 16 // PANEL) * BM * PANEL + kk * 16 % PANEL,
               lambda kk: K_OFF + s_ * K_ELEMS + (kk * 16 // PANEL) * BN * PANEL + kk * 16 % PANEL)

    @T.macro
    def s_mma_half(smem_, sacc_, s_, cw_):
        """split_keys: sacc_ <- Q K^T of keys [cw_ * BNH, (cw_ + 1) * BNH) of buffer s_."""
        scores_half(smem_, sacc_, lambda kk: (kk * 16 // PANEL) * BM * PANEL + kk * 16 % PANEL,
                    lambda kk: K_OFF + s_ * K_ELEMS + (kk * 16 // PANEL) * BN * PANEL + cw_ * BNH * PANEL
                    + kk * 16 % PANEL)

    @T.macro
    def pv_mma(smem_, oacc_, preg_, s_, cw_):
        """oacc_ += P V[:, columns of consumer cw_] (V: the first latent columns of buffer s_)."""
        accumulate(smem_, oacc_, preg_,
                   lambda kk: K_OFF + s_ * K_ELEMS + cw_ * (DVH // PANEL) * BN * PANEL + kk * 16 * PANEL)

    @T.macro
    def mask(sacc_, kv_start_, vis_end_, lane_, count_):
        """Scores (count_ of a thread) of keys at or past a row's visible end -> MASKED (element
        i * 4 + e of a thread: row r0 + 8 (e // 2), key 8 i + 2 (lane % 4) + e % 2)."""
        for i in T.unroll(count_ // 4):
            for e in T.unroll(4):
                sacc_[i * 4 + e] = T.if_then_else(
                    kv_start_ + i * 8 + (lane_ % 4) * 2 + e % 2 >= vis_end_[e // 2], T.float32(MASKED),
                    sacc_[i * 4 + e])

    @T.macro
    def write_state(oacc_, m_, lsum_, p0_, rows_, row0_, lane_, cw_, write_o_, write_lse_):
        """The finished rows of a consumer: o = O / l (its columns) and, consumer 0, lse."""
        for i in T.unroll(NO // 4):
            for e in T.unroll(4):
                if row0_ + (e // 2) * 8 < rows_ - p0_:
                    write_o_(p0_ + row0_ + (e // 2) * 8, cw_ * DVH + i * 8 + (lane_ % 4) * 2 + e % 2,
                             oacc_[i * 4 + e] * finalize_scale(lsum_[e // 2]))
        if cw_ == 0 and lane_ % 4 == 0:
            for r in T.unroll(2):
                if row0_ + r * 8 < rows_ - p0_:
                    write_lse_(p0_ + row0_ + r * 8, finalize_lse(m_[r], lsum_[r]))

    return s_mma, s_mma_half, pv_mma, mask, write_state


def _consume_macro(lay: _Layout):
    """consume: a consumer's loop with duplicated scores (module docstring)."""
    BM, BN, NO, NP, NS, PINGPONG, ST, dtype = lay.BM, lay.BN, lay.NO, lay.NP, lay.NS, lay.PINGPONG, lay.ST, lay.dtype
    visible_end = lay.visible_end
    copy_rows = _produce_macros(lay)[0]
    s_mma, _, pv_mma, mask, write_state = _mma_macros(lay)
    quad_reduce, softmax = row_softmax(NS, NO, NP, dtype)

    @T.macro
    def consume(smem_, full_, empty_, nkv_, free_end_, kv_len_, qo_len_, p0_, rows_, causal_, scale_, cw_, tid_,
                q_ptr_, write_o_, write_lse_, direct_, write_part_o_, write_part_lse_):
        """Consumer cw_: all rows of the tile, output columns [cw_ * DVH, (cw_ + 1) * DVH)."""
        sacc = T.alloc_local((NS,), "float32")
        oacc = T.alloc_local((NO,), "float32")
        preg = T.alloc_local((NP,), "uint32")
        m = T.alloc_local((2,), "float32")
        lsum = T.alloc_local((2,), "float32")
        vis_end = T.alloc_local((2,), "int32")
        warp = T.meta_var(tid_ // 32)
        lane = T.meta_var(tid_ % 32)
        row0 = T.meta_var(warp * 16 + lane // 4)  # the thread's first row in the tile
        # each consumer copies half of the Q tile's rows (zeros past the request's rows)
        copy_rows(smem_, 0, cw_ * (BM // 2), BM // 2, BM, tid_,
                  lambda r, c: q_ptr_(T.min(p0_ + r, T.max(rows_ - 1, 0)), c), lambda r: p0_ + r < rows_)
        T.ptx["cp.async.commit_group"]()
        T.ptx["cp.async.wait_group"](0)
        T.ptx["fence.proxy.async.shared::cta"]()
        T.ptx["bar.sync"](T.uint32(Q_BARRIER), T.uint32(CONSUMERS * WARPGROUP))
        for i in T.unroll(NO):
            oacc[i] = T.float32(0)
        for r in T.unroll(2):
            m[r] = T.float32(EMPTY_LSE)
            lsum[r] = T.float32(0)
            vis_end[r] = visible_end(kv_len_, qo_len_, p0_ + row0 + r * 8, causal_)
        if PINGPONG:
            if cw_ == 1 and nkv_ > 0:
                T.ptx["bar.arrive"](T.uint32(TURN_BARRIER), T.uint32(2 * WARPGROUP))  # consumer 0 goes first
        for t in T.serial(nkv_):
            s = T.meta_var(t % ST)
            T.cuda.mbarrier_wait(full_.ptr_to([s]), (t // ST) % 2)
            if PINGPONG:
                T.ptx["bar.sync"](T.uint32(TURN_BARRIER) + T.Cast("uint32", cw_), T.uint32(2 * WARPGROUP))
            s_mma(smem_, sacc, s)
            if PINGPONG:
                if cw_ == 0 or t + 1 < nkv_:
                    T.ptx["bar.arrive"](T.uint32(TURN_BARRIER + 1) - T.Cast("uint32", cw_), T.uint32(2 * WARPGROUP))
            if (t + 1) * BN > free_end_:
                mask(sacc, t * BN, vis_end, lane, NS)
            softmax(sacc, preg, oacc, m, lsum, scale_)
            pv_mma(smem_, oacc, preg, s, cw_)
            if tid_ == 0:
                T.ptx.mbarrier.arrive.shared.b64(empty_.ptr_to([s]))
        for r in T.unroll(2):
            quad_reduce(lsum, r, lambda a, b: a + b)
        if direct_:
            write_state(oacc, m, lsum, p0_, rows_, row0, lane, cw_, write_o_, write_lse_)
        else:
            write_state(oacc, m, lsum, p0_, rows_, row0, lane, cw_, write_part_o_, write_part_lse_)

    return consume


def _consume_split_macro(lay: _Layout):
    """consume_split: a consumer's loop with split keys (module docstring)."""
    BM, BN, BNH, NO, NP, NPH, NS, NSH = lay.BM, lay.BN, lay.BNH, lay.NO, lay.NP, lay.NPH, lay.NS, lay.NSH
    P_BARRIER, ST, X_BARRIER, dtype, visible_end = lay.P_BARRIER, lay.ST, lay.X_BARRIER, lay.dtype, lay.visible_end
    copy_rows = _produce_macros(lay)[0]
    _, s_mma_half, pv_mma, mask, write_state = _mma_macros(lay)
    quad_reduce, _ = row_softmax(NS, NO, NP, dtype)

    @T.macro
    def consume_split(smem_, xp_, xs_, full_, empty_, nkv_, free_end_, kv_len_, qo_len_, p0_, rows_, causal_, scale_,
                      cw_, tid_, q_ptr_, write_o_, write_lse_, direct_, write_part_o_, write_part_lse_):
        """split_keys consumer cw_: scores of its half of each step's keys; row maxima through
        xs_[cw_ * BM + row] and packed P through xp_[(cw_ * 128 + tid) * NPH + i] (the A-operand
        fragment of a thread is the same in both consumers, so the other half is read as is);
        output columns [cw_ * DVH, (cw_ + 1) * DVH); row sums combined at the end. direct_ False
        (decode splits): the state goes through write_part_o_ / write_part_lse_ (fp32)."""
        sacc = T.alloc_local((NSH,), "float32")
        oacc = T.alloc_local((NO,), "float32")
        pown = T.alloc_local((NPH,), "uint32")
        preg = T.alloc_local((NP,), "uint32")
        m = T.alloc_local((2,), "float32")
        lsum = T.alloc_local((2,), "float32")
        mx = T.alloc_local((2,), "float32")
        alpha = T.alloc_local((2,), "float32")
        vis_end = T.alloc_local((2,), "int32")
        warp = T.meta_var(tid_ // 32)
        lane = T.meta_var(tid_ % 32)
        row0 = T.meta_var(warp * 16 + lane // 4)
        copy_rows(smem_, 0, cw_ * (BM // 2), BM // 2, BM, tid_,
                  lambda r, c: q_ptr_(T.min(p0_ + r, T.max(rows_ - 1, 0)), c), lambda r: p0_ + r < rows_)
        T.ptx["cp.async.commit_group"]()
        T.ptx["cp.async.wait_group"](0)
        T.ptx["fence.proxy.async.shared::cta"]()
        T.ptx["bar.sync"](T.uint32(Q_BARRIER), T.uint32(CONSUMERS * WARPGROUP))
        for i in T.unroll(NO):
            oacc[i] = T.float32(0)
        for r in T.unroll(2):
            m[r] = T.float32(EMPTY_LSE)
            lsum[r] = T.float32(0)
            vis_end[r] = visible_end(kv_len_, qo_len_, p0_ + row0 + r * 8, causal_)
        for t in T.serial(nkv_):
            s = T.meta_var(t % ST)
            T.cuda.mbarrier_wait(full_.ptr_to([s]), (t // ST) % 2)
            s_mma_half(smem_, sacc, s, cw_)
            if (t + 1) * BN > free_end_:
                mask(sacc, t * BN + cw_ * BNH, vis_end, lane, NSH)
            for r in T.unroll(2):
                mx[r] = m[r]
            for i in T.unroll(NSH // 4):
                for e in T.unroll(4):
                    mx[e // 2] = T.max(mx[e // 2], sacc[i * 4 + e] * scale_)
            for r in T.unroll(2):
                quad_reduce(mx, r, T.max)
            if lane % 4 == 0:
                for r in T.unroll(2):
                    xs_[cw_ * BM + row0 + r * 8] = mx[r]
            T.ptx["bar.sync"](T.uint32(X_BARRIER), T.uint32(CONSUMERS * WARPGROUP))
            for r in T.unroll(2):
                mx[r] = T.max(mx[r], xs_[(1 - cw_) * BM + row0 + r * 8])
                alpha[r] = rescale_factor(m[r], mx[r])
                m[r] = mx[r]
                lsum[r] = lsum[r] * alpha[r]
            for i in T.unroll(NSH // 4):
                for e in T.unroll(4):
                    sacc[i * 4 + e] = prob(sacc[i * 4 + e] * scale_, m[e // 2])
                    lsum[e // 2] = lsum[e // 2] + sacc[i * 4 + e]
            for q in T.unroll(NPH):
                pown[q] = pack2(dtype, sacc[q * 2], sacc[q * 2 + 1])
                xp_[(cw_ * WARPGROUP + tid_) * NPH + q] = pown[q]
            for i in T.unroll(NO // 4):
                for e in T.unroll(4):
                    oacc[i * 4 + e] = oacc[i * 4 + e] * alpha[e // 2]
            T.ptx["bar.sync"](T.uint32(P_BARRIER), T.uint32(CONSUMERS * WARPGROUP))
            for h in T.unroll(2):
                for q in T.unroll(NPH):
                    preg[h * NPH + q] = T.if_then_else(cw_ == h, pown[q], xp_[(h * WARPGROUP + tid_) * NPH + q])
            pv_mma(smem_, oacc, preg, s, cw_)
            if tid_ == 0:
                T.ptx.mbarrier.arrive.shared.b64(empty_.ptr_to([s]))
        for r in T.unroll(2):
            quad_reduce(lsum, r, lambda a, b: a + b)
        if lane % 4 == 0:
            for r in T.unroll(2):
                xs_[2 * BM + cw_ * BM + row0 + r * 8] = lsum[r]
        T.ptx["bar.sync"](T.uint32(X_BARRIER), T.uint32(CONSUMERS * WARPGROUP))
        for r in T.unroll(2):
            lsum[r] = lsum[r] + xs_[2 * BM + (1 - cw_) * BM + row0 + r * 8]
        if direct_:
            write_state(oacc, m, lsum, p0_, rows_, row0, lane, cw_, write_o_, write_lse_)
        else:
            write_state(oacc, m, lsum, p0_, rows_, row0, lane, cw_, write_part_o_, write_part_lse_)

    return consume_split


def _consumer_macro(lay: _Layout):
    """consumer: a consumer warpgroup's share of the CTA (its registers, then its loop)."""
    sched, SPLIT = lay.sched, lay.SPLIT
    consume = _consume_macro(lay)
    consume_split = _consume_split_macro(lay)

    @T.macro
    def consumer(smem, xp, xs, full, empty, nkv, free_end, kv_len, qo_len, p0, rows, causal, sm_scale, wg, tid,
                 q_at, store_o, store_lse, direct, store_part_o, store_part_lse):
        """A consumer warpgroup's share of the CTA: its registers raised, then the schedule's
        consume loop (split keys or duplicated scores) over the CTA's rows, writing o and lse
        (direct) or, a decode split, its FP32 partial through store_part_o / store_part_lse."""
        T.ptx["setmaxnreg.inc.sync.aligned.u32"](sched.consumer_regs)
        if SPLIT:
            consume_split(smem, xp, xs, full, empty, nkv, free_end, kv_len, qo_len, p0, rows, causal,
                          sm_scale * T.float32(LOG2E), wg - 1, tid, q_at, store_o, store_lse, direct, store_part_o,
                          store_part_lse)
        else:
            consume(smem, full, empty, nkv, free_end, kv_len, qo_len, p0, rows, causal,
                    sm_scale * T.float32(LOG2E), wg - 1, tid, q_at, store_o, store_lse, direct, store_part_o,
                    store_part_lse)

    return consumer


def _prefill_kernel_macro(lay: _Layout):
    """kernel: the prefill's CTAs (one per tile slot)."""
    sched, BM, BN, H, NPH, SMEM_ELEMS, SPLIT = lay.sched, lay.BM, lay.BN, lay.H, lay.NPH, lay.SMEM_ELEMS, lay.SPLIT
    ST, dtype, ps, row_tiles, visible_end = lay.ST, lay.dtype, lay.ps, lay.row_tiles, lay.visible_end
    find_tile = find_tile_macro(row_tiles)
    init_ring = ring_barriers(ST, WARPGROUP, CONSUMERS)
    produce = _produce_macros(lay)[1]
    consumer = _consumer_macro(lay)

    @T.macro
    def kernel(Q, qo_indptr, pages, page_indptr, page_indices, length_info, Out, lse, causal, sm_scale, batch):
        """One CTA per tile slot, 3 warpgroups (module docstring)."""
        T.device_entry()
        bx = T.cta_id([ceildiv(Q.shape[0] * H, BM) + batch])
        wg = T.warpgroup_id([CONSUMERS + 1])
        tid = T.thread_id_in_wg([WARPGROUP])
        smem = T.alloc_buffer((SMEM_ELEMS,), dtype, scope="shared.dyn", align=1024)
        full = T.alloc_shared((ST,), "uint64")
        empty = T.alloc_shared((ST,), "uint64")
        if SPLIT:
            xp = T.alloc_shared((2 * WARPGROUP * NPH,), "uint32")
            xs = T.alloc_shared((4 * BM,), "float32")
        else:
            xp = T.meta_var(None)
            xs = T.meta_var(None)
        req = T.alloc_local((1,), "int32")
        tile = T.alloc_local((1,), "int32")
        init_ring(full, empty, wg, tid)
        find_tile(qo_indptr, batch, bx, req, tile)
        b: T.let[T.int32] = req[0]
        q0: T.let[T.int32] = qo_indptr[b]
        qo_len: T.let[T.int32] = qo_indptr[b + 1] - q0
        page0: T.let[T.int32] = page_indptr[b]
        kv_len: T.let[T.int32] = kv_chunk_len(page_indptr[b + 1] - page0, ps, length_info, b, False)
        rows: T.let[T.int32] = T.if_then_else(tile[0] >= 0, qo_len * H, 0)
        p0: T.let[T.int32] = T.max(tile[0], 0) * BM
        free_end: T.let[T.int32] = visible_end(kv_len, qo_len, p0, causal)
        kv_end: T.let[T.int32] = T.if_then_else(rows > 0, visible_end(kv_len, qo_len, p0 + BM - 1, causal), 0)
        nkv: T.let[T.int32] = ceildiv(kv_end, BN)
        if wg == 0:
            T.ptx["setmaxnreg.dec.sync.aligned.u32"](sched.producer_regs)
            produce(smem, full, empty, nkv, kv_end, tid,
                    lambda j: page_indices[page0 + j // ps] * ps + j % ps,
                    lambda slot, c: pages.ptr_to([slot // ps, slot % ps, c]))
        else:
            consumer(smem, xp, xs, full, empty, nkv, free_end, kv_len, qo_len, p0, rows, causal, sm_scale, wg, tid,
                     lambda p, c: Q.ptr_to([q0 + p // H, p % H, c]),
                     lambda p, c, val: T.buffer_store(Out, T.Cast(dtype, val), [q0 + p // H, p % H, c]),
                     lambda p, val: T.buffer_store(lse, val, [q0 + p // H, p % H]), True, None, None)

    return kernel


def _merge_macro(lay: _Layout):
    """merge_splits: the decode's in-kernel merge of a group's split partials."""
    BM, D_L, H, VECS, dtype, sync_call = lay.BM, lay.D_L, lay.H, lay.VECS, lay.dtype, lay.sync_call

    @T.macro
    def leader_to_all(word_, value_, tid_, cw_):
        """word_[0] <- value_ (evaluated by the first consumer thread only), seen by all consumer threads."""
        T.ptx["bar.sync"](T.uint32(MERGE_BARRIER), T.uint32(CONSUMERS * WARPGROUP))
        if cw_ == 0 and tid_ == 0:
            word_[0] = value_
        T.ptx["bar.sync"](T.uint32(MERGE_BARRIER), T.uint32(CONSUMERS * WARPGROUP))

    @T.macro
    def merge_row(o_part_, lse_part_, out_, lse_, batch_, b_, h_, used_, tid_):
        """out_[b_, h_] and lse_[b_, h_] <- the FP32 merge of the used_ splits' partials of head h_
        (a thread per float4 of the row, MERGE_UNROLL partials loaded at once, read through L2:
        other CTAs wrote them), one online pass over the splits' LSEs."""
        m = T.alloc_local((1,), "float32")
        lsum = T.alloc_local((1,), "float32")
        mn = T.alloc_local((1,), "float32")
        w = T.alloc_local((MERGE_UNROLL,), "float32")
        lv = T.alloc_local((MERGE_UNROLL,), "float32")
        pre = T.alloc_local((MERGE_UNROLL * 4,), "float32")
        acc = T.alloc_local((4,), "float32")
        for k in T.unroll(ceildiv(VECS, WARPGROUP)):
            v = T.meta_var(k * WARPGROUP + tid_)
            if VECS % WARPGROUP == 0 or v < VECS:
                m[0] = T.float32(EMPTY_LSE)
                lsum[0] = T.float32(0)
                for c in T.unroll(4):
                    acc[c] = T.float32(0)
                for y0 in T.serial(ceildiv(used_, MERGE_UNROLL)):
                    for u in T.unroll(MERGE_UNROLL):
                        y = T.meta_var(T.min(y0 * MERGE_UNROLL + u, used_ - 1))
                        lv[u] = T.cuda.func_call(LDCG, T.address_of(lse_part_[(y * batch_ + b_) * H + h_]),
                                                 source_code=LDCG_SRC, return_type="float32")
                        T.evaluate(T.cuda.func_call(
                            LDCG4, T.address_of(pre[u * 4]),
                            T.address_of(o_part_[((y * batch_ + b_) * H + h_) * D_L + v * 4]), source_code=LDCG4_SRC))
                    mn[0] = m[0]
                    for u in T.unroll(MERGE_UNROLL):
                        w[u] = T.if_then_else(y0 * MERGE_UNROLL + u < used_, finished_l(lv[u]), T.float32(0))
                        mn[0] = T.max(mn[0], T.if_then_else(w[u] > T.float32(0), lv[u], mn[0]))
                    lsum[0] = lsum[0] * rescale_factor(m[0], mn[0])
                    for c in T.unroll(4):
                        acc[c] = acc[c] * rescale_factor(m[0], mn[0])
                    m[0] = mn[0]
                    for u in T.unroll(MERGE_UNROLL):
                        w[u] = w[u] * rescale_factor(lv[u], m[0])
                        lsum[0] = lsum[0] + w[u]
                        for c in T.unroll(4):
                            acc[c] = acc[c] + w[u] * pre[u * 4 + c]
                for c in T.unroll(4):
                    out_[b_, h_, v * 4 + c] = T.Cast(dtype, acc[c] * finalize_scale(lsum[0]))
                if v == 0:
                    lse_[b_, h_] = finalize_lse(m[0], lsum[0])

    @T.macro
    def merge_splits(word_, o_part_, lse_part_, out_, lse_, batch_, b_, p0_, group_, used_, grid_, tid_, cw_):
        """After the CTA's partial is written: arrive at the group's counter; a merging CTA then
        claims pairs of the tile's heads (one a consumer) until none is left; then depart."""
        leader_to_all(word_, sync_call("arrive", group_, used_, grid_), tid_, cw_)
        if word_[0] != 0:
            leader_to_all(word_, sync_call("claim", group_), tid_, cw_)
            while word_[0] * 2 < T.min(H - p0_, BM):
                if p0_ + word_[0] * 2 + cw_ < H:
                    merge_row(o_part_, lse_part_, out_, lse_, batch_, b_, p0_ + word_[0] * 2 + cw_, used_, tid_)
                leader_to_all(word_, sync_call("claim", group_), tid_, cw_)
        if cw_ == 0 and tid_ == 0:
            T.evaluate(sync_call("depart", group_, used_))

    return merge_splits


def _decode_kernel_macro(lay: _Layout):
    """decode_kernel: the decode's CTAs (request, tile of 64 heads, split slot)."""
    sched, BM, BN, D_L, H, HEAD_TILES, NPH = lay.sched, lay.BM, lay.BN, lay.D_L, lay.H, lay.HEAD_TILES, lay.NPH
    SMEM_ELEMS, SPLIT, ST, dtype, ps, split = lay.SMEM_ELEMS, lay.SPLIT, lay.ST, lay.dtype, lay.ps, lay.split
    sync_call = lay.sync_call
    init_ring = ring_barriers(ST, WARPGROUP, CONSUMERS)
    produce = _produce_macros(lay)[1]
    consumer = _consumer_macro(lay)
    merge_splits = _merge_macro(lay)

    @T.macro
    def decode_kernel(Q, pages, page_indptr, page_indices, length_info, Out, lse, o_part, lse_part, sm_scale):
        """Decode: one CTA per (request, tile of 64 heads, split slot), 3 warpgroups; the
        prefill's CTA with one query over the split's run of keys (module docstring)."""
        T.device_entry()
        batch = T.meta_var(Q.shape[0])
        slots = T.meta_var(split.slots(batch, HEAD_TILES))
        grid = T.meta_var(batch * HEAD_TILES * slots)
        bx = T.cta_id([grid])
        wg = T.warpgroup_id([CONSUMERS + 1])
        tid = T.thread_id_in_wg([WARPGROUP])
        smem = T.alloc_buffer((SMEM_ELEMS,), dtype, scope="shared.dyn", align=1024)
        full = T.alloc_shared((ST,), "uint64")
        empty = T.alloc_shared((ST,), "uint64")
        word = T.alloc_shared((1,), "int32")
        if SPLIT:
            xp = T.alloc_shared((2 * WARPGROUP * NPH,), "uint32")
            xs = T.alloc_shared((4 * BM,), "float32")
        else:
            xp = T.meta_var(None)
            xs = T.meta_var(None)
        init_ring(full, empty, wg, tid)
        # the request's splits: runs of whole steps of at least min_split_keys keys, each non-empty;
        # the values in registers (TVM would inline each expression at every use)
        at = T.alloc_local((8,), "int32")  # group, request, split, kv_len, used, first key, keys, rows
        at[0] = bx // slots
        at[1] = at[0] // HEAD_TILES
        at[2] = bx % slots
        b: T.let[T.int32] = at[1]
        p0: T.let[T.int32] = at[0] % HEAD_TILES * BM
        page0: T.let[T.int32] = page_indptr[b]
        at[3] = kv_chunk_len(page_indptr[b + 1] - page0, ps, length_info, b, False)
        at[4] = T.max(ceildiv(ceildiv(at[3], T.min(slots, T.max(ceildiv(at[3], split.min_split_keys), 1))), BN) * BN,
                      BN)  # keys a split
        at[5] = at[2] * at[4]
        at[6] = T.if_then_else(at[5] < at[3], T.min(at[3] - at[5], at[4]), 0)
        at[4] = T.max(ceildiv(at[3], at[4]), 1)
        at[7] = T.if_then_else(at[2] < at[4], H, 0)
        group = T.meta_var(at[0])
        sp = T.meta_var(at[2])
        used = T.meta_var(at[4])
        k0 = T.meta_var(at[5])
        keys = T.meta_var(at[6])
        nkv: T.let[T.int32] = ceildiv(keys, BN)
        if wg == 0:
            T.ptx["setmaxnreg.dec.sync.aligned.u32"](sched.producer_regs)
            produce(smem, full, empty, nkv, keys, tid,
                    lambda j: page_indices[page0 + (k0 + j) // ps] * ps + (k0 + j) % ps,
                    lambda slot, c: pages.ptr_to([slot // ps, slot % ps, c]))
        else:
            if slots > 1 and wg == 1 and tid == 0:
                T.evaluate(sync_call("start", 0))
            consumer(smem, xp, xs, full, empty, nkv, keys, keys, 1, p0, at[7], T.int32(0),
                     sm_scale, wg, tid, lambda p, c: Q.ptr_to([b, p, c]),
                     lambda p, c, val: T.buffer_store(Out, T.Cast(dtype, val), [b, p, c]),
                     lambda p, val: T.buffer_store(lse, val, [b, p]), used == 1,
                     lambda p, c, val: T.buffer_store(o_part, val, [((sp * batch + b) * H + p) * D_L + c]),
                     lambda p, val: T.buffer_store(lse_part, val, [(sp * batch + b) * H + p]))
            if used > 1 and sp < used:
                merge_splits(word, o_part, lse_part, Out, lse, batch, b, p0, group, used, grid, tid, wg - 1)
            if slots > 1 and wg == 1 and tid == 0:
                T.evaluate(sync_call("end", grid))

    return decode_kernel


def _kernel_macro(config: MLAConfig, sched: MLAWgmmaSchedule, decode: bool = False,
                  split: MLAWgmmaDecodeSplit = MLAWgmmaDecodeSplit()):
    """The prefill kernel macro, or (decode) the decode one, split as `split` says."""
    lay = _Layout(config, sched, split)
    return _decode_kernel_macro(lay) if decode else _prefill_kernel_macro(lay)


def mla_paged_prefill_wgmma(config: MLAConfig, schedule: MLAWgmmaSchedule | None = None):
    """Tensor-core body of `mla.mla_paged_prefill` (same arguments, symbol and semantics)."""
    problem = mla_wgmma_problem(config)
    if problem:
        raise ValueError(f"the tensor-core MLA prefill does not serve {problem}")
    sched = schedule or choose_mla_wgmma_schedule(config)
    sched.check(config)
    kernel = _kernel_macro(config, sched)
    func = prefill_contract_func(config, kernel, align=16)
    return func.with_attr(TIRX_ATTR, True).with_attr(
        "target", tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}, host="llvm"))


def mla_wgmma_decode_problem(config: MLAConfig) -> str | None:
    """Why the tensor-core MLA decode (`mla_paged_decode_wgmma`) cannot serve `config`, or None."""
    return mla_wgmma_problem(config)


def mla_paged_decode_wgmma(config: MLAConfig, schedule: MLAWgmmaSchedule | None = None,
                           split: MLAWgmmaDecodeSplit | None = None):
    """Tensor-core `mla.mla_paged_decode` (same arguments, symbol and semantics): the prefill's
    CTA with one query a request (64 heads as M, the prefill's schedule), split-KV as `split`
    says (default MLAWgmmaDecodeSplit(); chosen at launch, so large batches run one CTA per
    request and head tile over all its keys). The split CTAs of a (request, head tile) write FP32
    partials to the function's workspace and merge them in the same kernel (`_split_sync`)."""
    problem = mla_wgmma_decode_problem(config)
    if problem:
        raise ValueError(f"the tensor-core MLA decode does not serve {problem}")
    sched = schedule or choose_mla_wgmma_schedule(config)
    sched.check(config)
    split = split or MLAWgmmaDecodeSplit()
    head_tiles = ceildiv(config.num_heads, sched.tile_q)
    func = decode_contract_func(config, _kernel_macro(config, sched, decode=True, split=split),
                                lambda batch: split.slots(batch, head_tiles), None)
    return func.with_attr(TIRX_ATTR, True).with_attr(
        "target", tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}, host="llvm"))
