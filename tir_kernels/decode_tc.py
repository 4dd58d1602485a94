"""Tensor-core paged decode for GQA groups of 3..16 (fp16/bf16, pages of the dtype or FP8, CUDA sm_80 and newer).

`paged_decode_tc(config)` returns the PrimFunc of `decode.paged_decode` (same parameters,
argument order, semantics and global symbol; its docstring is the contract), computed with
`mma.sync.aligned.m16n8k16` and fp32 accumulation, the instructions and shared-memory layout of
mma.py, which prefill_sm80 shares (they also run on sm_90, which is how the H200 runs them).

Work mapping: a block serves one request, one KV head and one split of the request's visible
keys (blockIdx = request, KV head, split slot). The grid's split slots per request are chosen at
launch from the batch size (`grid_splits`: about one wave of resident blocks); each request
uses as many of them as its length allows (`request_splits`: at least min_split_keys keys a
split, whole tiles; a sliding-window build starts them `page_shift` keys before key 0, so that
the window's tiles start on page boundaries); a request of one split writes o / lse directly,
the others are merged in
FP32 by `merge` (one block per request and query head; each thread loads every split's LSE and
o of its column in one round of loads, compiled for a few split-slot counts), or, with
`fused_merge`, by the last of the request's split blocks to finish (`fused_merge` below: an
arrival counter per (request, KV head), one launch per call), or with `cooperative_merge` by the
last min(nsplit, G) of them, a query head each, after all have arrived (`merge_head`). The G query heads
of the KV head are the M rows of the MMAs (padded with zero rows to 16), so each K/V row is read
from memory once for the whole group.

Per block (`TensorCoreDecodeSchedule`: warps, keys_per_warp, stages):
  load_q: the group's query rows -> shared (cp.async), then A fragments (ldmatrix).
  lookup / issue: K and V rows of a tile of tile_kv = warps * keys_per_warp keys -> one of
    `stages` ring buffers, 16-byte cp.async, threads_per_row threads per row (the schedule's,
    or `threads_per_row`'s rule); each thread reads the page table once per row it copies, a
    tile ahead of the copies (early_pages: the prologue's tiles all at once); rows past the
    split's end are zero-filled. heads_first orders the grid (KV head, split, request).
  Per step, warp w computes keys w * keys_per_warp.. of the tile: S = Q K^T (ldmatrix K), the
    online softmax of its rows in registers (base 2, softmax.py's arithmetic), O += P V (P
    packed from the S accumulators, ldmatrix.trans V).
  finish: the warps' (m, l, O) states are merged through shared memory (softmax.combine) and
    finished into o / lse, or into the split workspace.
  dependent_launch (sm_90): the block first waits for the stream's previous grids
    (griddepcontrol.wait; with tables_before_wait only after the prologue's page-table reads,
    and in the append build after the prologue's copies of the history's K and V rows too:
    `pages_early`) and lets the next launch start once its prologue is issued (build.py: the
    launch tag).

rotary_mode == 1 (RoPE inside the kernel: q and the keys are stored un-rotated) runs the same
kernel, compiled a second time with `rope_rows` and its own schedule (by default
`schedules.tc_decode_rope_schedule`: the plain one with threads_per_row = D / 16). A rotate-half
pair (d, d + D/2) lies in chunks c and c + D/16 of a row, so a thread rotates one pair of
16-byte chunks per row (8 pairs), the same chunk index in every tile: its 8 frequencies are
computed once, its rows' angles exactly every ROPE_EXACT_TILES tiles and advanced between by the
angle-sum identity; the frequencies, the query's angles and each exact tile's angles are
computed before the wait for the data they rotate. The group's Q rows are rotated once, after
they land, between two barriers. K tiles: with threads_per_row = D / 16 (ROPE_OWN) the rope
build copies warp-wise: warp w copies (K and V), rotates and multiplies only its keys
w * keys_per_warp.., each thread exactly the chunk pairs it rotates, so the main loop has no
block barrier: step t refills the stage the warp read in step t - 1, waits for its own copies of
tile t, rotates them and syncs the warp (every stage of the ring in flight during the wait);
otherwise one step ahead (step t rotates tile t + 1 while the warps multiply tile t: one stage less in
flight; with 2 stages, tile t before its S = Q K^T behind a second barrier). The rotated values
are rounded to the K/V dtype, as split + rotary would have stored them.

FP8 pages (config.kv_dtype, tir_kernels.kv_quant): the tiles keep their fp16/bf16 layout, so
ldmatrix and the MMAs are unchanged; `issue` fills them from the codes instead of by cp.async.
Each thread loads the 8 codes of a 16-byte tile chunk (8 bytes), widens them with the hardware's
FP8 pair conversion (exact) times FP8_TILE_FACTOR, and stores them to the chunk. The prologue's
tiles are stored as they are loaded; in the main loop a step's refill only loads the codes into
registers, and `refill_commit` stores them after the step's MMAs (into the stage no warp reads
in that step), so the loads overlap the step's arithmetic as cp.async's copies do; the ring's
barriers order the stores before the reads. The block's K and V
scales (read once, after the grid dependency wait) are not applied to the tiles: the K scale
multiplies the scores' scale, the V scale the output (both linear), so the tiles hold the codes'
values exactly and the inline RoPE rotates them as it would dequantized keys.
"""

from __future__ import annotations

from tvm.script import tirx as T

from .common import (EMPTY_LSE, LOG2E, PDL_TAG, ceildiv, grid_dependency_wait, launch_dependents, loop_kinds,
                     paged_position, rope_angle, rope_inv_freq)
from .config import AttentionConfig
from .cuda_funcs import FMA4, FMA4_SRC, LDCG, LDCG4, LDCG4_SRC, LDCG_SRC, arrival_counter
from .decode_contract import check_config, decode_append_func, decode_func
from .kv_quant import (FP8_FETCH, FP8_FETCH_SRC, FP8_TILE_FACTOR, fp8_chunk_function, fp8_store_function,
                       kv_scale)
from .mma import CHUNK, CP_ASYNC, FULL_WARP, LDSM, LDSM_T, ROWS_PER_MMA, Tile, mma_name, pack_name
from .schedules import TensorCoreDecodeSchedule, choose_tc_decode_schedule, tc_decode_rope_schedule
from .softmax import finalize_lse, finalize_scale, finished_l, prob, rescale_factor, softmax_macros


WARP_SIZE = 32
MERGE_UNROLL = 16  # split slots whose partials a merging thread loads at once (fused_merge)


def _rope_chunks_function(dtype: str):
    """Name and CUDA source of the inline RoPE's rotation of one pair of 16-byte chunks in
    shared memory: lo holds elements d..d+7 of a row, hi elements d+D/2..; c0..c7, s0..s7 the
    cos and sin of the 8 pairs' angles (scalars, and the words reinterpreted through a union,
    so that nothing leaves the registers). lo <- c * lo - s * hi, hi <- c * hi + s * lo
    (rotate-half), computed in float32 and rounded to `dtype` (float16 or bfloat16), two
    elements per conversion instruction."""
    pair, to_f2, from_f2 = {"float16": ("__half2", "__half22float2", "__floats2half2_rn"),
                            "bfloat16": ("__nv_bfloat162", "__bfloat1622float2", "__floats2bfloat162_rn")}[dtype]
    name = f"tvmattn_rope_chunks_{dtype}"
    params = ", ".join([f"float c{i}" for i in range(8)] + [f"float s{i}" for i in range(8)])
    src = f"""
union {name}_word {{ unsigned u; {pair} h; }};
__device__ __forceinline__ void {name}(float* lo, float* hi, {params}) {{
  const float c[8] = {{c0, c1, c2, c3, c4, c5, c6, c7}};
  const float s[8] = {{s0, s1, s2, s3, s4, s5, s6, s7}};
  uint4 a = *reinterpret_cast<uint4*>(lo);
  uint4 b = *reinterpret_cast<uint4*>(hi);
  unsigned x[4] = {{a.x, a.y, a.z, a.w}};
  unsigned y[4] = {{b.x, b.y, b.z, b.w}};
#pragma unroll
  for (int k = 0; k < 4; ++k) {{
    {name}_word wx, wy;
    wx.u = x[k];
    wy.u = y[k];
    float2 fx = {to_f2}(wx.h), fy = {to_f2}(wy.h);
    wx.h = {from_f2}(c[2 * k] * fx.x - s[2 * k] * fy.x, c[2 * k + 1] * fx.y - s[2 * k + 1] * fy.y);
    wy.h = {from_f2}(c[2 * k] * fy.x + s[2 * k] * fx.x, c[2 * k + 1] * fy.y + s[2 * k + 1] * fx.y);
    x[k] = wx.u;
    y[k] = wy.u;
  }}
  *reinterpret_cast<uint4*>(lo) = make_uint4(x[0], x[1], x[2], x[3]);
  *reinterpret_cast<uint4*>(hi) = make_uint4(y[0], y[1], y[2], y[3]);
}}
"""
    return name, src


SYNCWARP, SYNCWARP_SRC = "tvmattn_syncwarp", """
// The warp's lanes meet; their shared-memory writes (and landed cp.async copies) are visible to each other.
__device__ __forceinline__ void tvmattn_syncwarp() { __syncwarp(); }
"""
NSMID, NSMID_SRC = "tvmattn_nsmid", """
// %nsmid: the device's SM identifiers (its SM count where they are contiguous, as on the H200).
__device__ __forceinline__ int tvmattn_nsmid() {
  unsigned r;
  asm volatile("mov.u32 %0, %%nsmid;" : "=r"(r));
  return (int)r;
}
"""


def _cooperative_arrival(slots: int):
    """Name and CUDA source of the cooperative merge's arrival over `slots` counters (a
    module-scope __device__ array, zero when the module loads): arrive(slot, n, mergers), called
    by one thread of each of the n split blocks of a counter after the block's partial is
    written, returns -1 to the first n - mergers blocks to arrive (they leave at once) and k =
    0..mergers-1 to the last `mergers`, each after all n blocks have arrived (it spins on the
    counter; the last to arrive waits for nobody and resets the counter to 0, so a waiter sees
    n or 0, never a value below n before the last arrival). Launches of one module must not
    overlap in time, and every waiting block must be able to wait for non-resident blocks to
    run (the caller's condition)."""
    name, counters = f"tvmattn_decode_arrive_coop_{slots}", f"tvmattn_decode_arrivalsc_{slots}"
    src = f"""
__device__ unsigned {counters}[{slots}];
__device__ __forceinline__ int {name}(int slot, int n, int mergers) {{
  __threadfence();
  unsigned seen = atomicAdd(&{counters}[slot], 1u);
  int k = (int)seen - (n - mergers);
  if (k < 0) return -1;
  if (seen + 1u == (unsigned)n) {{
    atomicExch(&{counters}[slot], 0u);
  }} else {{
    const volatile unsigned* c = &{counters}[slot];
    unsigned v = *c;
    while (v != 0u && v < (unsigned)n) {{
      __nanosleep(32);
      v = *c;
    }}
  }}
  __threadfence();
  return k;
}}
"""
    return name, src


def threads_per_row(chunks: int) -> int:
    """Threads that copy one K/V row together: 4 (64 contiguous bytes per 4 lanes) where the
    row's 16-byte chunks allow, else 2 or 1."""
    for tpr in (4, 2, 1):
        if chunks % tpr == 0:
            return tpr
    return 1


def grid_splits(sched: TensorCoreDecodeSchedule, num_kv_heads: int, batch):
    """Split slots per request in the grid, chosen at launch: floor(target_blocks / (batch *
    num_kv_heads)), within 1..max_splits (rounded down, so that batch * heads * splits stays
    within one wave of target_blocks resident blocks)."""
    if sched.max_splits == 1:
        return 1
    return T.min(T.max(sched.target_blocks // (batch * num_kv_heads), 1), sched.max_splits)


def request_splits(sched: TensorCoreDecodeSchedule, slots, kv_len):
    """Splits request with kv_len keys uses: at most the grid's slots, each of at least
    min_split_keys keys (a short request takes fewer, or one: then no merge)."""
    if sched.max_splits == 1:
        return 1
    return T.min(slots, T.max(ceildiv(kv_len, sched.min_split_keys), 1))


def split_length(sched: TensorCoreDecodeSchedule, kv_len, nsplit):
    """Keys per split: kv_len / nsplit rounded up to whole tiles (a sliding build passes its
    visible keys plus page_shift's)."""
    return ceildiv(ceildiv(kv_len, nsplit), sched.tile_kv) * sched.tile_kv


class _Layout:
    """Compile-time sizes of one tensor-core decode kernel (its config and schedule), the layout
    of its shared memory, and the index arithmetic on them. Every name __init__ binds is an
    attribute; the macro factories below unpack the ones their macros read."""

    def __init__(self, config: AttentionConfig, sched: TensorCoreDecodeSchedule):
        dtype, G, D, ps = config.dtype, config.group_size, config.head_dim, config.page_size
        sliding = config.sliding_window
        Hq, Hkv = config.num_qo_heads, config.num_kv_heads
        NW, KPW, STAGES, QREG = sched.warps, sched.keys_per_warp, sched.stages, sched.q_in_registers
        BK, NT = sched.tile_kv, sched.num_threads
        TL = Tile(D)  # Q, K and V rows share the layout
        KSTEPS_QK, KSTEPS_PV = D // 16, KPW // 16
        SN, ON = KPW // 8, D // 8  # n8 blocks of S and of O per warp
        UPPER = G > 8  # rows g + 8 of the accumulators hold query heads too
        HALVES = 2 if UPPER else 1
        MMA, PACK = mma_name(dtype), pack_name(dtype)
        CP_ASYNC_KV = CP_ASYNC + (f".L2::{sched.l2_prefetch}B" if sched.l2_prefetch else "")
        MS = sched.max_splits
        shared = "shared.dyn"
        # One fp32 shared buffer, addressed in 16-bit elements for the tiles (halved for the
        # fp32 index; every tile offset is a multiple of a 16-byte chunk): Q | K stages | V stages.
        # At the end the same memory holds the warps' states: O [NW, G, D] | m [NW, 16] | l [NW, 16].
        Q_OFF, K_OFF = 0, ROWS_PER_MMA * TL.stride
        V_OFF = K_OFF + STAGES * BK * TL.stride
        TILE_ELEMS = V_OFF + STAGES * BK * TL.stride
        C_O, C_M = 0, NW * G * D
        C_L = C_M + NW * ROWS_PER_MMA
        # fused_merge: the merging block's split weights [G, W_SLOTS] (from word 0, after finish)
        FUSED = sched.fused_merge and MS > 1
        W_SLOTS = ceildiv(MS, MERGE_UNROLL) * MERGE_UNROLL
        FLAG_WORD = G * W_SLOTS  # the arrival's verdict, broadcast to the block (no static shared memory,
        # which would move the dynamic buffer off its 128-byte alignment and the tiles off their swizzle)
        # cooperative_merge: a merging block's query head, VS float4 columns, TPV threads per column
        # (each takes every TPV-th split, COOP_WIDTHS splits per round of loads; VPT columns per thread
        # where the block has fewer threads than columns); the TPV partial sums meet in shared memory
        COOP = sched.cooperative_merge and FUSED
        VS = D // 4
        TPV = max(NT // VS, 1)
        VPT = ceildiv(VS, NT)
        # splits per thread per round, compiled for 8 and 16 (a launch takes the first that loads a
        # request's splits in one round: 64 splits at head dim 128 take 16)
        COOP_WIDTHS = sorted({min(8, ceildiv(MS, TPV)), min(16, ceildiv(MS, TPV))})
        LSE_SLOTS = ceildiv(MS, 32)
        RED_WORDS = TPV * VS * 4
        SMEM_WORDS = max(TILE_ELEMS // 2, C_L + NW * ROWS_PER_MMA, FLAG_WORD + 1 if FUSED else 0,
                         RED_WORDS if COOP else 0)
        MERGE_VECS = G * D // 4  # float4 columns of the group's outputs
        VECS_PER_THREAD = ceildiv(MERGE_VECS, NT)
        HEADS_PER_WARP = ceildiv(G, NW)  # heads whose weights a warp computes
        LANE_SLOTS = ceildiv(W_SLOTS, 32)
        TPR = sched.threads_per_row or threads_per_row(TL.chunks)
        RP = NT // TPR  # rows a pass of the block's threads copies
        PASSES = ceildiv(BK, RP)
        CPT = TL.chunks // TPR  # chunks per thread per row
        EARLY, HEADS_FIRST = sched.early_pages, sched.heads_first
        PDL = sched.dependent_launch  # programmatic dependent launch (common.grid_dependency_wait)
        TABLES_EARLY = sched.tables_before_wait  # the prologue's page-table reads before the wait
        PRE = STAGES - 1 if EARLY else 1  # tiles whose page entries a thread holds at once

        LI_SHAPE = (3, 1) if sliding else (1,)
        # inline RoPE: pair chunks per row (c with c + HC), rows one pass of the block's threads
        # rotates (thread tid: pair chunk tid % HC of rows tid // HC + p * ROPE_RPP)
        HC = TL.chunks // 2
        ROPE_RPP = NT // HC
        assert BK % ROPE_RPP == 0, "a K tile is a whole number of rotation passes"  # tile_kv: 16-key multiples
        ROPE_EXACT_TILES = 8  # K tiles between exact angle computations (at most 8 * tile_kv / ROPE_RPP steps)
        # ROPE_OWN: the rope build copies warp-wise, each thread exactly the pair chunks it rotates
        # (threads_per_row = chunks / 2; a warp's KPW keys are whole copy passes of RPW rows): warp w
        # copies, rotates and multiplies its own keys w * KPW.. (thread tid: chunks c and c + HC of rows
        # copy_row(p, tid, True)), so no warp reads another's rows of a tile. A step refills stage
        # (t - 1) % STAGES first (this warp read it in step t - 1), then waits for its own copies of
        # tile t, rotates them and syncs the warp, not the block: STAGES tiles in flight during the wait.
        RPW = WARP_SIZE // TPR
        ROPE_OWN = TPR * 2 == TL.chunks and KPW * TPR % WARP_SIZE == 0
        ROPE_OWN_JUMP = BK - (PASSES - 1) * RPW  # from a thread's last row of a tile to its first of the next
        # else: rotate tile t + 1 during step t (it must have landed: one stage less in flight)
        ROPE_AHEAD = not ROPE_OWN and STAGES >= 3
        ROPE, ROPE_SRC = _rope_chunks_function(dtype)
        # (request, KV head) arrival counters of fused_merge: a launch with more than one split slot
        # has at most target_blocks / 2 of them
        ARRIVE, ARRIVE_SRC = arrival_counter(max(sched.target_blocks, 1))
        # merge_fanin: the first level counts per (request, KV head, run of splits) at the run's first
        # block slot (batch * Hkv * slots <= target_blocks), the second per (request, KV head)
        FANIN = sched.merge_fanin if FUSED else 0
        ARRIVE2, ARRIVE2_SRC = arrival_counter(max(sched.target_blocks, 1), "runs")
        ARRIVEC, ARRIVEC_SRC = _cooperative_arrival(max(sched.target_blocks, 1))
        # Split slots the merge is compiled for (a launch takes the first that holds its slots):
        # 8, the slots of a batch of one, max_splits.
        MERGE_WIDTHS = sorted({min(8, MS), min(MS, max(sched.target_blocks // Hkv, 1)), MS})
        # FP8 pages: each thread loads its chunks' codes and stores their values into the same
        # tiles (no cp.async); the scales (times 1 / FP8_TILE_FACTOR) scale the scores and the output
        FP8 = config.kv_fp8
        FP8_TILE, FP8_TILE_SRC = fp8_chunk_function(config.kv_dtype, dtype) if FP8 else (None, None)
        FP8_STORE, FP8_STORE_SRC = fp8_store_function(config.kv_dtype, dtype) if FP8 else (None, None)
        vars(self).update((name, value) for name, value in locals().items() if name != "self")

    def copy_row(self, p, tid_, warp_rows):
        """Tile row that thread tid_ copies in pass p: rows p * RP + tid_ // TPR (the block's
        threads side by side), or with warp_rows (ROPE_OWN) the warp's own keys: row
        warp * KPW + p * RPW + lane // TPR."""
        if warp_rows:
            return tid_ // WARP_SIZE * self.KPW + p * self.RPW + tid_ % WARP_SIZE // self.TPR
        return p * self.RP + tid_ // self.TPR

    def rope_own(self, rope_):
        """Whether the build with rope_ (None: plain) copies and rotates warp-wise (ROPE_OWN)."""
        return rope_ is not None and self.ROPE_OWN

    def rope_row0(self, tid_, warp_rows):
        """The first tile row whose pair chunk thread tid_ rotates (rope_rows' or rope_own_tile's)."""
        return self.copy_row(0, tid_, True) if warp_rows else tid_ // self.HC

    @staticmethod
    def word(elem):
        """fp32 index of a 16-bit element offset (a multiple of 8)."""
        return elem // 2

    def visible_keys(self, npages, li_):
        """kv_chunk_len's count from the loaded length_info li_ (`load_length_info`), without a
        branch (which would keep the length_info load behind the page count's)."""
        last = li_[0, 0] - li_[1, 0] + li_[2, 0] if self.sliding else li_[0]
        return ((npages - 1) * self.ps + last) * T.Cast("int32", npages > 0)

    def page_shift(self, li_, kv_len):
        """Sliding builds: keys the splits' tiles start before key 0, so that every tile of the
        window lands on page boundaries (the window's key j >= sink sits at slot j - sink +
        offset of the page list: a tile from key -shift + n * tile_kv starts a page; tiles off the
        page grid read more pages per tile). Split 0's first tile then holds `shift` masked,
        zero-filled rows before key 0. 0 for the plain build, and where the request has no key
        past its sinks."""
        if not self.sliding:
            return 0
        return T.if_then_else(kv_len > li_[2, 0], T.floormod(li_[1, 0] - li_[2, 0], self.ps), 0)

    def part_row(self, first, count, stride, y, batch, b, h):
        """Row of lse_part (of o_part, times D) of query head h in a merge's y-th partial (split
        slots first, first + stride, ..; past count the last one's, which then weighs 0)."""
        return ((first + T.min(y, count - 1) * stride) * batch + b) * self.Hq + h


def _rope_macros(lay: _Layout, L):
    """Inline RoPE (rotary_mode 1): rope_freqs, rope_steps, rope_angles, rope_rows, rope_exact,
    rope_own_tile, rope_own_next and rope_tile (see the module docstring)."""
    config, BK, D, HC, K_OFF, PASSES, ROPE = lay.config, lay.BK, lay.D, lay.HC, lay.K_OFF, lay.PASSES, lay.ROPE
    ROPE_EXACT_TILES, ROPE_RPP, ROPE_SRC, STAGES = lay.ROPE_EXACT_TILES, lay.ROPE_RPP, lay.ROPE_SRC, lay.STAGES
    TL, copy_row, rope_row0, word = lay.TL, lay.copy_row, lay.rope_row0, lay.word

    @T.macro
    def rope_freqs(rope_scale_, rope_theta_, tid_, freq_, step_, rows):
        """Inline RoPE: freq_[i] <- rope_scale * inverse frequency of element (tid_ % HC) * 8 + i
        (the thread's pair chunk); step_[i], step_[8 + i] <- cos, sin of `rows` rows' angle."""
        for i in L.unroll(CHUNK):
            freq_[i] = T.Cast("float32", rope_scale_) * rope_inv_freq((tid_ % HC) * CHUNK + i, D, rope_theta_,
                                                                      config.rope_scaling)
            step_[i] = T.cos(T.float32(rows) * freq_[i])
            step_[CHUNK + i] = T.sin(T.float32(rows) * freq_[i])

    @T.macro
    def rope_steps(freq_, rows, step_):
        """step_[i], step_[8 + i] <- cos, sin of `rows` rows' angle at the thread's frequencies."""
        for i in L.unroll(CHUNK):
            step_[i] = T.cos(T.float32(rows) * freq_[i])
            step_[CHUNK + i] = T.sin(T.float32(rows) * freq_[i])

    @T.macro
    def rope_angles(pos_, tid_, freq_, cs_):
        """cs_ <- cos (0..7) and sin (8..15) of the thread's 8 pairs' angles at position pos_."""
        for i in L.unroll(CHUNK):
            cs_[i] = T.cos(T.Cast("float32", pos_) * freq_[i])
            cs_[CHUNK + i] = T.sin(T.Cast("float32", pos_) * freq_[i])

    @T.macro
    def rope_advance(step_, cs_):
        """cs_ <- the angles ROPE_RPP rows further (angle-sum identity with step_)."""
        nxt = T.alloc_buffer((CHUNK,), "float32", scope="local")
        for i in L.unroll(CHUNK):
            nxt[i] = cs_[i] * step_[i] - cs_[CHUNK + i] * step_[CHUNK + i]
            cs_[CHUNK + i] = cs_[CHUNK + i] * step_[i] + cs_[i] * step_[CHUNK + i]
            cs_[i] = nxt[i]

    @T.macro
    def rope_rows(smem_, region_, rows, advance, tid_, step_, cs_):
        """Inline RoPE in shared memory: rotate rows 0..rows-1 of the tile at 16-bit element
        offset region_; the thread's pair chunk of rows tid_ // HC + p * ROPE_RPP with the
        angles in cs_, advanced by ROPE_RPP rows after each pass (advance: keys, one position a
        row; else every row at cs_'s position: the query heads). With advance, cs_ ends at the
        angles of row tid_ // HC + rows (rows a multiple of ROPE_RPP): the next tile's."""
        for p in L.unroll(ceildiv(rows, ROPE_RPP)):
            r = T.meta_var(p * ROPE_RPP + tid_ // HC)
            if rows % ROPE_RPP == 0 or r < rows:
                T.evaluate(T.cuda.func_call(
                    ROPE, smem_.ptr_to([word(region_ + TL.offset(r, tid_ % HC))]),
                    smem_.ptr_to([word(region_ + TL.offset(r, tid_ % HC + HC))]),
                    *[cs_[i] for i in range(2 * CHUNK)], source_code=ROPE_SRC))
            if advance:
                rope_advance(step_, cs_)

    @T.macro
    def rope_exact(k_pos_, j_begin_, tile, tid_, freq_, cs_, warp_rows):
        """cs_ <- the exact angles of the thread's first row of K tile `tile` (position k_pos_ +
        j_begin_ + tile * BK + rope_row0) where tile is a multiple of ROPE_EXACT_TILES; else
        cs_ stays as the previous tile's rope_rows left it."""
        if tile % ROPE_EXACT_TILES == 0:
            rope_angles(k_pos_ + j_begin_ + tile * BK + rope_row0(tid_, warp_rows), tid_, freq_, cs_)

    @T.macro
    def rope_own_tile(smem_, stage_, tid_, step_, cs_):
        """ROPE_OWN: rotate the thread's pair chunk (tid_ % HC) of its rows warp * KPW + p * RPW
        + lane // HC of the tile in stage stage_, in place; cs_ holds the first row's angles and
        ends at the last row's (advanced by step_, RPW rows, between the passes)."""
        for p in L.unroll(PASSES):
            r = T.meta_var(copy_row(p, tid_, True))
            T.evaluate(T.cuda.func_call(
                ROPE, smem_.ptr_to([word(K_OFF + stage_ * BK * TL.stride + TL.offset(r, tid_ % HC))]),
                smem_.ptr_to([word(K_OFF + stage_ * BK * TL.stride + TL.offset(r, tid_ % HC + HC))]),
                *[cs_[i] for i in range(2 * CHUNK)], source_code=ROPE_SRC))
            if p + 1 < PASSES:
                rope_advance(step_, cs_)

    @T.macro
    def rope_own_next(k_pos_, j_begin_, tile, tid_, freq_, tstep_, cs_):
        """ROPE_OWN: cs_ <- the angles of the thread's first row of K tile `tile` (tile >= 1):
        exact every ROPE_EXACT_TILES tiles, else advanced from tile - 1's last row by
        ROPE_OWN_JUMP rows (tstep_)."""
        if tile % ROPE_EXACT_TILES == 0:
            rope_angles(k_pos_ + j_begin_ + tile * BK + rope_row0(tid_, True), tid_, freq_, cs_)
        else:
            rope_advance(tstep_, cs_)

    @T.macro
    def rope_tile(smem_, k_pos_, j_begin_, tile, tid_, freq_, step_, cs_):
        """Inline RoPE of K tile `tile` (in its ring stage) in place by the block (not ROPE_OWN),
        its first key at position k_pos_ + j_begin_ + tile * BK: exact angles every
        ROPE_EXACT_TILES tiles (rope_exact), else cs_ as the previous tile's rope_rows left it."""
        rope_exact(k_pos_, j_begin_, tile, tid_, freq_, cs_, False)
        rope_rows(smem_, K_OFF + tile % STAGES * BK * TL.stride, BK, True, tid_, step_, cs_)

    return rope_freqs, rope_steps, rope_angles, rope_rows, rope_exact, rope_own_tile, rope_own_next, rope_tile


def _chunk_macros(lay: _Layout, L):
    """The append build's rows from qkv: chunk_values (a 16-byte chunk of a head row in float32,
    rotated), pack (rounded into words) and store_words (the words -> shared memory)."""
    D, HC, PACK, TL, dtype, word = lay.D, lay.HC, lay.PACK, lay.TL, lay.dtype, lay.word
    config = lay.config
    theta, scale, scaling = T.float32(config.rope_theta), T.float32(config.rope_scale), config.rope_scaling

    @T.macro
    def chunk_values(qkv_, b_, h_, ch_, pos_, rotate_, vals_):
        """vals_ <- chunk ch_ of head row qkv_[b_, h_] in float32, rotated to position pos_ where
        rotate_ (rotate-half RoPE with split_rotary's arithmetic: common.rope_angle and
        rope_rotate's expression, so that the rounded values are the ones it stores)."""
        own = T.alloc_buffer((CHUNK,), dtype, scope="local")
        mate = T.alloc_buffer((CHUNK,), dtype, scope="local")
        for e in L.vector(CHUNK):
            own[e] = qkv_[b_, h_, ch_ * CHUNK + e]
        if rotate_:
            for e in L.vector(CHUNK):
                mate[e] = qkv_[b_, h_, (ch_ + HC) % TL.chunks * CHUNK + e]
            for e in L.unroll(CHUNK):
                angle = T.meta_var(rope_angle(ch_ * CHUNK + e, pos_, D, theta, scale, scaling))
                vals_[e] = T.cos(angle) * T.Cast("float32", own[e]) + T.sin(angle) * T.if_then_else(
                    ch_ < HC, T.float32(0.0) - T.Cast("float32", mate[e]), T.Cast("float32", mate[e]))
        else:
            for e in L.unroll(CHUNK):
                vals_[e] = T.Cast("float32", own[e])

    @T.macro
    def pack(vals_, words_):
        """words_[k] <- elements 2k, 2k + 1 of vals_ rounded to dtype (element 2k in the low half)."""
        for k in L.unroll(CHUNK // 2):
            T.ptx[PACK](words_[k], vals_[2 * k + 1], vals_[2 * k])

    @T.macro
    def store_words(smem_, off_, words_):
        """The 16-byte chunk at 16-bit element off_ of shared memory <- words_."""
        for k in L.unroll(CHUNK // 2):
            smem_[word(off_) + k] = T.reinterpret("float32", words_[k])

    return chunk_values, pack, store_words


def _load_macros(lay: _Layout, L):
    """Loads: load_length_info, load_q (Q -> shared), lookup (page table), issue (K/V tiles ->
    the ring), refill (a step's issue and lookup) and load_q_frag (Q's A fragments)."""
    BK, CPT, CP_ASYNC_KV, G, K_OFF, NT = lay.BK, lay.CPT, lay.CP_ASYNC_KV, lay.G, lay.K_OFF, lay.NT
    PASSES, Q_OFF, RP, STAGES, TL, TPR, V_OFF = lay.PASSES, lay.Q_OFF, lay.RP, lay.STAGES, lay.TL, lay.TPR, lay.V_OFF
    copy_row, ps, sliding, word = lay.copy_row, lay.ps, lay.sliding, lay.word
    FP8, FP8_TILE, FP8_TILE_SRC, FP8_STORE, FP8_STORE_SRC = (lay.FP8, lay.FP8_TILE, lay.FP8_TILE_SRC, lay.FP8_STORE,
                                                             lay.FP8_STORE_SRC)
    chunk_values, pack, store_words = _chunk_macros(lay, L)

    @T.macro
    def copy_chunk(smem_, off_, pages_, page_, kv_, hkv_, slot_, ch_):
        """Chunk ch_ of a K (kv_ 0) or V row of the pages -> the tile at 16-bit element off_:
        cp.async, or FP8 pages' codes widened (`kv_quant.fp8_chunk_function`)."""
        if FP8:
            T.evaluate(T.cuda.func_call(FP8_TILE, smem_.ptr_to([word(off_)]),
                                        T.address_of(pages_[page_, kv_, hkv_, slot_, ch_ * CHUNK]),
                                        source_code=FP8_TILE_SRC))
        else:
            T.ptx[CP_ASYNC_KV](smem_.ptr_to([word(off_)]), T.address_of(pages_[page_, kv_, hkv_, slot_, ch_ * CHUNK]),
                               16)

    @T.macro
    def load_length_info(length_info_, b_, li_):
        """li_ <- request b_'s length_info (one load each, not behind the page count's branch),
        shaped for visible_keys and paged_position (request index 0)."""
        if sliding:
            for k in L.unroll(3):
                li_[k, 0] = length_info_[k, b_]
        else:
            li_[0] = length_info_[b_]

    @T.macro
    def load_q(q_, smem_, b_, hkv_, tid_, rope_q_):
        """The group's G query rows -> the Q region: by cp.async from q_ [B, Hq, D], or, with
        rope_q_ = (position, rotate) (the append build), from the step's qkv_ rotated to position
        where rotate (each element rounded once, as split_rotary stores it); rows G..15 zero."""
        vals = T.alloc_buffer((CHUNK if rope_q_ is not None else 1,), "float32", scope="local")
        words = T.alloc_buffer((CHUNK // 2 if rope_q_ is not None else 1,), "uint32", scope="local")
        for it in L.unroll(ceildiv(ROWS_PER_MMA * TL.chunks, NT)):
            c = T.meta_var(it * NT + tid_)
            r = T.meta_var(c // TL.chunks)
            ch = T.meta_var(c % TL.chunks)
            if ROWS_PER_MMA * TL.chunks % NT == 0 or c < ROWS_PER_MMA * TL.chunks:
                if r < G:
                    if rope_q_ is None:
                        T.ptx[CP_ASYNC](smem_.ptr_to([word(Q_OFF + TL.offset(r, ch))]),
                                        T.address_of(q_[b_, hkv_ * G + r, ch * CHUNK]), 16)
                    else:
                        chunk_values(q_, b_, hkv_ * G + r, ch, rope_q_[0], rope_q_[1], vals)
                        pack(vals, words)
                        store_words(smem_, Q_OFF + TL.offset(r, ch), words)
                else:
                    for e in L.vector(4):
                        smem_[word(Q_OFF + TL.offset(r, ch)) + e] = T.float32(0)

    @T.macro
    def lookup(indices_, li_, page0_, kv0_, kv_end_, tid_, page_, slot_, at_, warp_rows):
        """page_, slot_ [at_ .. at_ + PASSES) <- where this thread's rows (copy_row) of the tile
        from key kv0_ live (every page-table read of a tile before any of its copies); li_: the
        request's length_info (`load_length_info`)."""
        for p in L.unroll(PASSES):
            j = T.meta_var(kv0_ + copy_row(p, tid_, warp_rows))
            page_[at_ + p] = 0
            slot_[at_ + p] = 0
            if j < kv_end_ and (not sliding or j >= 0):
                page_[at_ + p] = indices_[page0_ + paged_position(j, li_, 0, sliding) // ps]
                slot_[at_ + p] = paged_position(j, li_, 0, sliding) % ps

    @T.macro
    def issue(pages_, smem_, hkv_, stage_, kv0_, kv_end_, tid_, page_, slot_, at_, warp_rows, deferred_, staged_,
              skip_):
        """cp.async of this thread's chunks of K and V rows kv0_.. (copy_row; found by `lookup`,
        at at_ of page_ / slot_) -> ring buffer stage_; zeros from kv_end_ on (and, sliding,
        before key 0). FP8 pages: the chunks' codes widened into the tile (`copy_chunk`), or with
        deferred_ only loaded into staged_ (registers), which `commit` stores after the step's
        MMAs (so the loads overlap them). skip_ (None, or a key index): that key's row is left
        alone (the append build stores the new key's row itself, `put_new_row`)."""
        for p in L.unroll(PASSES):
            r = T.meta_var(copy_row(p, tid_, warp_rows))
            if BK % RP == 0 or r < BK:
                if kv0_ + r < kv_end_ and (not sliding or kv0_ + r >= 0):
                    for c in L.unroll(CPT):
                        ch = T.meta_var(tid_ % TPR + c * TPR)
                        if skip_ is not None and kv0_ + r == skip_:
                            T.evaluate(0)
                        elif FP8 and deferred_:
                            for kv in L.unroll(2):
                                T.evaluate(T.cuda.func_call(
                                    FP8_FETCH, T.address_of(staged_[((p * CPT + c) * 2 + kv) * 2]),
                                    T.address_of(pages_[page_[at_ + p], kv, hkv_, slot_[at_ + p], ch * CHUNK]),
                                    source_code=FP8_FETCH_SRC))
                        else:
                            copy_chunk(smem_, K_OFF + stage_ * BK * TL.stride + TL.offset(r, ch), pages_,
                                       page_[at_ + p], 0, hkv_, slot_[at_ + p], ch)
                            copy_chunk(smem_, V_OFF + stage_ * BK * TL.stride + TL.offset(r, ch), pages_,
                                       page_[at_ + p], 1, hkv_, slot_[at_ + p], ch)
                else:
                    for c in L.unroll(CPT):
                        ch = T.meta_var(tid_ % TPR + c * TPR)
                        for e in L.vector(4):
                            smem_[word(K_OFF + stage_ * BK * TL.stride + TL.offset(r, ch)) + e] = T.float32(0)
                        for e in L.vector(4):
                            smem_[word(V_OFF + stage_ * BK * TL.stride + TL.offset(r, ch)) + e] = T.float32(0)

    @T.macro
    def commit(smem_, stage_, kv0_, kv_end_, tid_, warp_rows, staged_):
        """FP8 pages: the codes a deferred `issue` of rows kv0_.. loaded into staged_ -> their
        values in ring buffer stage_ (that issue zeroed the rows past the end already)."""
        for p in L.unroll(PASSES):
            r = T.meta_var(copy_row(p, tid_, warp_rows))
            if BK % RP == 0 or r < BK:
                if kv0_ + r < kv_end_ and (not sliding or kv0_ + r >= 0):
                    for c in L.unroll(CPT):
                        for kv in L.unroll(2):
                            i = T.meta_var(((p * CPT + c) * 2 + kv) * 2)
                            T.evaluate(T.cuda.func_call(
                                FP8_STORE, smem_.ptr_to([word(K_OFF + kv * (V_OFF - K_OFF) + stage_ * BK * TL.stride
                                                              + TL.offset(r, tid_ % TPR + c * TPR))]),
                                staged_[i], staged_[i + 1], source_code=FP8_STORE_SRC))

    @T.macro
    def refill(pages_, indices_, li_, page0_, smem_, hkv_, t_, ntiles_, j_begin_, j_end_, tid_, page_, slot_,
               warp_rows, staged_, skip_):
        """Step t_ of the main loop: `issue` tile t_ + STAGES - 1 into the stage it takes (FP8
        pages: deferred, `refill_commit` stores it), then `lookup` tile t_ + STAGES (warp_rows:
        the warp-wise row mapping, copy_row)."""
        if t_ + STAGES - 1 < ntiles_:
            issue(pages_, smem_, hkv_, (t_ + STAGES - 1) % STAGES, j_begin_ + (t_ + STAGES - 1) * BK, j_end_, tid_,
                  page_, slot_, 0, warp_rows, True, staged_, skip_)
            if t_ + STAGES < ntiles_:
                lookup(indices_, li_, page0_, j_begin_ + (t_ + STAGES) * BK, j_end_, tid_, page_, slot_, 0, warp_rows)

    @T.macro
    def refill_commit(smem_, t_, ntiles_, j_begin_, j_end_, tid_, warp_rows, staged_):
        """FP8 pages, the end of step t_: `commit` the tile its `refill` loaded (the stage no
        warp reads in step t_; the next steps' barriers order the stores before its reads)."""
        if FP8:
            if t_ + STAGES - 1 < ntiles_:
                commit(smem_, (t_ + STAGES - 1) % STAGES, j_begin_ + (t_ + STAGES - 1) * BK, j_end_, tid_, warp_rows,
                       staged_)

    @T.macro
    def load_q_frag(smem_, qf_, base_, kk_, lane_):
        """A fragment of Q for k16 step kk_ -> qf_[base_..base_+3]."""
        T.ptx[LDSM](qf_[base_], qf_[base_ + 1], qf_[base_ + 2], qf_[base_ + 3],
                    smem_.ptr_to([word(Q_OFF + TL.offset(lane_ % 16, kk_ * 2 + lane_ // 16))]))

    return load_length_info, load_q, lookup, issue, refill, refill_commit, load_q_frag


def _append_macros(lay: _Layout, L):
    """The append build (`paged_decode_append_tc`): load_new_kv (the new key and value rows -> their
    page slot and registers) and put_new_row (those registers -> the new key's row of a tile)."""
    BK, Hkv, Hq, K_OFF, TL, V_OFF, dtype, ps = lay.BK, lay.Hkv, lay.Hq, lay.K_OFF, lay.TL, lay.V_OFF, lay.dtype, lay.ps
    chunk_values, pack, store_words = _chunk_macros(lay, L)

    @T.macro
    def load_new_kv(qkv_, pages_, b_, hkv_, tid_, pos_, rotate_, slot_, newkv_):
        """The request's new key (rotated to pos_ where rotate_) and value rows of KV head hkv_:
        thread tid_ < 2 * chunks takes chunk tid_ % chunks of the key (tid_ < chunks) or of the
        value row, stores it to page slot slot_ (none where slot_ < 0) and keeps it packed in
        newkv_ (`put_new_row`)."""
        vals = T.alloc_buffer((CHUNK,), "float32", scope="local")
        out = T.alloc_buffer((CHUNK,), dtype, scope="local")
        if tid_ < 2 * TL.chunks:
            kv = T.meta_var(tid_ // TL.chunks)
            ch = T.meta_var(tid_ % TL.chunks)
            chunk_values(qkv_, b_, Hq + kv * Hkv + hkv_, ch, pos_, rotate_ and kv == 0, vals)
            pack(vals, newkv_)
            if slot_ >= 0:
                for e in L.unroll(CHUNK):
                    out[e] = T.Cast(dtype, vals[e])
                for e in L.vector(CHUNK):
                    pages_[slot_ // ps, kv, hkv_, slot_ % ps, ch * CHUNK + e] = out[e]

    @T.macro
    def put_new_row(smem_, stage_, row_, tid_, newkv_):
        """load_new_kv's chunks -> row row_ of the K and V tiles in ring stage stage_."""
        if tid_ < 2 * TL.chunks:
            store_words(smem_, K_OFF + tid_ // TL.chunks * (V_OFF - K_OFF) + stage_ * BK * TL.stride
                        + TL.offset(row_, tid_ % TL.chunks), newkv_)

    return load_new_kv, put_new_row


def _mma_macros(lay: _Layout, L):
    """A warp's step: s_mma (S = Q K^T), softmax (online, base 2) and pv_mma (O += P V)."""
    BK, HALVES, KPW, KSTEPS_PV, KSTEPS_QK = lay.BK, lay.HALVES, lay.KPW, lay.KSTEPS_PV, lay.KSTEPS_QK
    K_OFF, MMA, ON, PACK, QREG, SN, TL = lay.K_OFF, lay.MMA, lay.ON, lay.PACK, lay.QREG, lay.SN, lay.TL
    UPPER, V_OFF, sliding, word = lay.UPPER, lay.V_OFF, lay.sliding, lay.word
    load_q_frag = _load_macros(lay, L)[-1]

    @T.macro
    def s_mma(smem_, qf_, s_, stage_, warp_, lane_):
        """s_ <- Q K^T of the warp's KPW keys of the tile in stage stage_."""
        kf = T.alloc_buffer((4,), "uint32", scope="local")
        qk = T.alloc_buffer((4,), "uint32", scope="local")
        for i in L.unroll(SN * 4):
            s_[i] = T.float32(0)
        for kk in L.unroll(KSTEPS_QK):
            if not QREG:
                load_q_frag(smem_, qk, 0, kk, lane_)
            for np_ in L.unroll(SN // 2):
                T.ptx[LDSM](kf[0], kf[1], kf[2], kf[3], smem_.ptr_to([word(
                    K_OFF + stage_ * BK * TL.stride
                    + TL.offset(warp_ * KPW + np_ * 16 + lane_ % 8 + lane_ // 16 * 8, kk * 2 + lane_ // 8 % 2))]))
                for h in L.unroll(2):
                    n = T.meta_var((np_ * 2 + h) * 4)
                    if QREG:
                        T.ptx[MMA](s_[n], s_[n + 1], s_[n + 2], s_[n + 3], qf_[kk * 4], qf_[kk * 4 + 1],
                                   qf_[kk * 4 + 2], qf_[kk * 4 + 3], kf[h * 2], kf[h * 2 + 1],
                                   s_[n], s_[n + 1], s_[n + 2], s_[n + 3])
                    else:
                        T.ptx[MMA](s_[n], s_[n + 1], s_[n + 2], s_[n + 3], qk[0], qk[1], qk[2], qk[3],
                                   kf[h * 2], kf[h * 2 + 1], s_[n], s_[n + 1], s_[n + 2], s_[n + 3])

    @T.macro
    def softmax(s_, o_, m_run_, l_run_, key0_, kv_end_, scale_, lane_):
        """Online softmax of the thread's rows (g, and g + 8 when the group has more than 8
        heads) over the warp's keys key0_..: scale to base 2, mask keys from kv_end_ on (and,
        sliding, before key 0: page_shift's rows), move the state to the new max, s_ -> P =
        exp2(s - m) (l_run_ keeps this thread's sums)."""
        m_new = T.alloc_buffer((1,), "float32", scope="local")
        alpha = T.alloc_buffer((1,), "float32", scope="local")
        for r in L.unroll(HALVES):
            for nb in L.unroll(SN):
                for e in L.unroll(2):
                    s_[nb * 4 + r * 2 + e] = s_[nb * 4 + r * 2 + e] * scale_
            if key0_ + KPW > kv_end_ or (sliding and key0_ < 0):
                for nb in L.unroll(SN):
                    for e in L.unroll(2):
                        key = T.meta_var(key0_ + nb * 8 + lane_ % 4 * 2 + e)
                        if key >= kv_end_ or (sliding and key < 0):
                            s_[nb * 4 + r * 2 + e] = T.min_value("float32")
            m_new[0] = m_run_[r]
            for nb in L.unroll(SN):
                for e in L.unroll(2):
                    m_new[0] = T.max(m_new[0], s_[nb * 4 + r * 2 + e])
            for k in L.unroll(2):  # the 4 lanes of a quad hold the row
                m_new[0] = T.max(m_new[0], T.tvm_warp_shuffle_xor(T.uint32(FULL_WARP), m_new[0], 1 << k, 32, 32))
            alpha[0] = rescale_factor(m_run_[r], m_new[0])
            m_run_[r] = m_new[0]
            l_run_[r] = l_run_[r] * alpha[0]
            for nb in L.unroll(SN):
                for e in L.unroll(2):
                    s_[nb * 4 + r * 2 + e] = prob(s_[nb * 4 + r * 2 + e], m_new[0])
                    l_run_[r] = l_run_[r] + s_[nb * 4 + r * 2 + e]
            for nb in L.unroll(ON):
                for e in L.unroll(2):
                    o_[nb * 4 + r * 2 + e] = o_[nb * 4 + r * 2 + e] * alpha[0]

    @T.macro
    def pv_mma(s_, smem_, o_, stage_, warp_, lane_):
        """o_ += P V over the warp's keys, P packed from the S accumulators (rows g + 8 are
        zero when the group has at most 8 heads)."""
        pf = T.alloc_buffer((4,), "uint32", scope="local")
        vf = T.alloc_buffer((4,), "uint32", scope="local")
        for kk in L.unroll(KSTEPS_PV):
            # a0 / a2: row g, keys 16kk..+7 / +8..+15; a1 / a3: row g + 8
            T.ptx[PACK](pf[0], s_[kk * 8 + 1], s_[kk * 8])
            T.ptx[PACK](pf[2], s_[kk * 8 + 5], s_[kk * 8 + 4])
            if UPPER:
                T.ptx[PACK](pf[1], s_[kk * 8 + 3], s_[kk * 8 + 2])
                T.ptx[PACK](pf[3], s_[kk * 8 + 7], s_[kk * 8 + 6])
            else:
                pf[1] = T.uint32(0)
                pf[3] = T.uint32(0)
            for np_ in L.unroll(ON // 2):
                T.ptx[LDSM_T](vf[0], vf[1], vf[2], vf[3], smem_.ptr_to([word(
                    V_OFF + stage_ * BK * TL.stride
                    + TL.offset(warp_ * KPW + kk * 16 + lane_ % 8 + lane_ // 8 % 2 * 8, np_ * 2 + lane_ // 16))]))
                for h in L.unroll(2):
                    n = T.meta_var((np_ * 2 + h) * 4)
                    T.ptx[MMA](o_[n], o_[n + 1], o_[n + 2], o_[n + 3], pf[0], pf[1], pf[2], pf[3],
                               vf[h * 2], vf[h * 2 + 1], o_[n], o_[n + 1], o_[n + 2], o_[n + 3])

    return s_mma, softmax, pv_mma


def _finish_macro(lay: _Layout, L):
    """finish: the warps' states merged through shared memory and finished into o / lse."""
    C_L, C_M, C_O, D, G, HALVES, NT, NW = lay.C_L, lay.C_M, lay.C_O, lay.D, lay.G, lay.HALVES, lay.NT, lay.NW
    ON, shared = lay.ON, lay.shared
    sm = softmax_macros(L)

    @T.macro
    def finish(smem_, o_, m_run_, l_run_, warp_, lane_, tid_, write_o_, write_lse_):
        """Merge the warps' states through shared memory and finish them: write_o_(h, e, value)
        and write_lse_(h, value) for the group's heads h (o = 0, EMPTY_LSE for no key)."""
        m_all = T.alloc_buffer((1,), "float32", scope="local")
        l_all = T.alloc_buffer((1,), "float32", scope="local")
        acc = T.alloc_buffer((1,), "float32", scope="local")
        T.ptx["cp.async.wait_group"](0)
        T.tvm_storage_sync(shared)  # no warp still reads a tile: the memory is free
        for r in L.unroll(HALVES):
            for k in L.unroll(2):
                l_run_[r] = l_run_[r] + T.tvm_warp_shuffle_xor(T.uint32(FULL_WARP), l_run_[r], 1 << k, 32, 32)
            if lane_ // 4 + r * 8 < G:
                for nb in L.unroll(ON):
                    for e in L.unroll(2):
                        smem_[C_O + (warp_ * G + lane_ // 4 + r * 8) * D + nb * 8 + lane_ % 4 * 2 + e] = (
                            o_[nb * 4 + r * 2 + e])
                if lane_ % 4 == 0:
                    smem_[C_M + warp_ * ROWS_PER_MMA + lane_ // 4 + r * 8] = m_run_[r]
                    smem_[C_L + warp_ * ROWS_PER_MMA + lane_ // 4 + r * 8] = l_run_[r]
        T.tvm_storage_sync(shared)
        for it in L.unroll(ceildiv(G * D, NT)):
            idx = T.meta_var(it * NT + tid_)
            if G * D % NT == 0 or idx < G * D:
                sm.combine(NW, lambda y: smem_[C_M + y * ROWS_PER_MMA + idx // D],
                           lambda y: smem_[C_L + y * ROWS_PER_MMA + idx // D],
                           lambda y: smem_[C_O + (y * G + idx // D) * D + idx % D], m_all, l_all, acc)
                sm.finalize(m_all, l_all, acc, 0, 1)
                write_o_(idx // D, idx % D, acc[0])
                if idx % D == 0:
                    write_lse_(idx // D, m_all[0])

    return finish


def _merge_partials_macro(lay: _Layout, L):
    """merge_partials: the fused merge of a group's split partials by one block."""
    D, G, HEADS_PER_WARP, LANE_SLOTS, MERGE_VECS = lay.D, lay.G, lay.HEADS_PER_WARP, lay.LANE_SLOTS, lay.MERGE_VECS
    NT, NW, VECS_PER_THREAD, W_SLOTS, part_row = lay.NT, lay.NW, lay.VECS_PER_THREAD, lay.W_SLOTS, lay.part_row
    shared = lay.shared

    @T.macro
    def merge_partials(smem_, o_part_, lse_part_, batch, b, hkv, first_, count_, stride_, write_o_, write_lse_, warp_,
                       lane_, tid_):
        """The FP32 merge of the group's count_ (>= 2) split partials in slots first_, first_ +
        stride_, ..: write_o_(h, e, value), write_lse_(h, value). The first MERGE_UNROLL partials
        are loaded (float4, through L2) before the weights are known; a warp per head turns the
        LSEs (all loaded at once) into normalised weights in shared memory (0 past count_); each
        thread then accumulates its float4 columns, MERGE_UNROLL partials per round of loads. A
        thread writes only columns it alone read, so the output may be the first slot's partial."""
        lv = T.alloc_buffer((HEADS_PER_WARP * LANE_SLOTS,), "float32", scope="local")
        mx = T.alloc_buffer((HEADS_PER_WARP,), "float32", scope="local")
        lsum = T.alloc_buffer((HEADS_PER_WARP,), "float32", scope="local")
        acc = T.alloc_buffer((VECS_PER_THREAD * 4,), "float32", scope="local")
        pre = T.alloc_buffer((MERGE_UNROLL * VECS_PER_THREAD * 4,), "float32", scope="local")

        for u in L.unroll(MERGE_UNROLL):
            for k in L.unroll(VECS_PER_THREAD):
                v = T.meta_var(k * NT + tid_)
                if MERGE_VECS % NT == 0 or v < MERGE_VECS:
                    T.evaluate(T.cuda.func_call(
                        LDCG4, T.address_of(pre[(u * VECS_PER_THREAD + k) * 4]),
                        T.address_of(o_part_[part_row(first_, count_, stride_, u, batch, b, hkv * G + v // (D // 4)) * D
                                             + v % (D // 4) * 4]), source_code=LDCG4_SRC))
        for hh in L.unroll(HEADS_PER_WARP):
            for k in L.unroll(LANE_SLOTS):
                lv[hh * LANE_SLOTS + k] = T.float32(EMPTY_LSE)
                if k * 32 + lane_ < count_:
                    if G % NW == 0 or hh * NW + warp_ < G:
                        lv[hh * LANE_SLOTS + k] = T.cuda.func_call(
                            LDCG, T.address_of(lse_part_[part_row(first_, count_, stride_, k * 32 + lane_, batch, b,
                                                                  hkv * G + hh * NW + warp_)]),
                            source_code=LDCG_SRC, return_type="float32")
        for hh in L.unroll(HEADS_PER_WARP):
            mx[hh] = T.float32(EMPTY_LSE)
            for k in L.unroll(LANE_SLOTS):
                mx[hh] = T.max(mx[hh], lv[hh * LANE_SLOTS + k])
            for i in L.unroll(5):
                mx[hh] = T.max(mx[hh], T.tvm_warp_shuffle_xor(T.uint32(FULL_WARP), mx[hh], 1 << i, 32, 32))
            lsum[hh] = T.float32(0)
            for k in L.unroll(LANE_SLOTS):
                lsum[hh] = lsum[hh] + finished_l(lv[hh * LANE_SLOTS + k]) * rescale_factor(lv[hh * LANE_SLOTS + k],
                                                                                          mx[hh])
            for i in L.unroll(5):
                lsum[hh] = lsum[hh] + T.tvm_warp_shuffle_xor(T.uint32(FULL_WARP), lsum[hh], 1 << i, 32, 32)
        for hh in L.unroll(HEADS_PER_WARP):
            h = T.meta_var(hh * NW + warp_)
            if G % NW == 0 or h < G:
                for k in L.unroll(LANE_SLOTS):
                    if W_SLOTS % 32 == 0 or k * 32 + lane_ < W_SLOTS:
                        smem_[h * W_SLOTS + k * 32 + lane_] = (
                            finished_l(lv[hh * LANE_SLOTS + k]) * rescale_factor(lv[hh * LANE_SLOTS + k], mx[hh])
                            * finalize_scale(lsum[hh]))
                if lane_ == 0:
                    write_lse_(h, finalize_lse(mx[hh], lsum[hh]))
        T.tvm_storage_sync(shared)
        for k in L.unroll(VECS_PER_THREAD):
            v = T.meta_var(k * NT + tid_)
            for c in L.unroll(4):
                acc[k * 4 + c] = T.float32(0)
                for u in L.unroll(MERGE_UNROLL):
                    acc[k * 4 + c] = acc[k * 4 + c] + smem_[T.min(v // (D // 4), G - 1) * W_SLOTS + u] * pre[
                        (u * VECS_PER_THREAD + k) * 4 + c]
        for y0 in T.serial(ceildiv(count_, MERGE_UNROLL) - 1):
            for u in L.unroll(MERGE_UNROLL):
                for k in L.unroll(VECS_PER_THREAD):
                    v = T.meta_var(k * NT + tid_)
                    y = T.meta_var((y0 + 1) * MERGE_UNROLL + u)
                    if MERGE_VECS % NT == 0 or v < MERGE_VECS:
                        T.evaluate(T.cuda.func_call(
                            FMA4, T.address_of(acc[k * 4]),
                            T.address_of(o_part_[part_row(first_, count_, stride_, y, batch, b, hkv * G + v // (D // 4))
                                                 * D + v % (D // 4) * 4]),
                            smem_[v // (D // 4) * W_SLOTS + y], source_code=FMA4_SRC))
        for k in L.unroll(VECS_PER_THREAD):
            v = T.meta_var(k * NT + tid_)
            if MERGE_VECS % NT == 0 or v < MERGE_VECS:
                for c in L.unroll(4):
                    write_o_(v // (D // 4), v % (D // 4) * 4 + c, acc[k * 4 + c])

    return merge_partials


def _merge_head_macro(lay: _Layout, L):
    """merge_head: cooperative_merge's merge of one query head by one of the last blocks."""
    D, G, LSE_SLOTS, NT, TPV, VPT, VS = lay.D, lay.G, lay.LSE_SLOTS, lay.NT, lay.TPV, lay.VPT, lay.VS
    dtype, part_row, shared = lay.dtype, lay.part_row, lay.shared

    @T.macro
    def merge_head(smem_, o_part_, lse_part_, o_, lse_, batch, b, hkv, h, count_, lane_, tid_, unroll):
        """cooperative_merge: the FP32 merge of query head h of the group over the count_ (>= 2)
        split partials into o_ / lse_. Every warp turns the head's LSEs (all loaded at once) into
        the maximum and the weights' sum; thread t takes float4 column t % VS (and + NT, ..) of
        splits t // VS, + TPV, .. (`unroll`, one of COOP_WIDTHS, per round of loads, each split's
        LSE loaded beside its o and then turned into its weight; index clamped to the last split,
        weight 0 past it), and the TPV partial sums of a column are added through shared memory."""
        lv = T.alloc_buffer((LSE_SLOTS,), "float32", scope="local")
        mx = T.alloc_buffer((1,), "float32", scope="local")
        lsum = T.alloc_buffer((1,), "float32", scope="local")
        pl = T.alloc_buffer((unroll,), "float32", scope="local")
        po = T.alloc_buffer((unroll * VPT * 4,), "float32", scope="local")
        acc = T.alloc_buffer((VPT * 4,), "float32", scope="local")
        hq = T.meta_var(hkv * G + h)
        grp = T.meta_var(tid_ // VS if NT >= VS else 0)
        col = T.meta_var(tid_ % VS if NT >= VS else tid_)
        T.tvm_storage_sync(shared)  # the previous head's sums are read
        for k in L.unroll(LSE_SLOTS):
            lv[k] = T.float32(EMPTY_LSE)
            if k * 32 + lane_ < count_:
                lv[k] = T.cuda.func_call(LDCG, T.address_of(lse_part_[part_row(0, count_, 1, k * 32 + lane_, batch, b,
                                                                                hq)]),
                                         source_code=LDCG_SRC, return_type="float32")
        for i in L.unroll(VPT * 4):
            acc[i] = T.float32(0)
        for r in T.serial(ceildiv(count_, TPV * unroll)):
            for u in L.unroll(unroll):
                y = T.meta_var((r * unroll + u) * TPV + grp)
                pl[u] = T.cuda.func_call(LDCG, T.address_of(lse_part_[part_row(0, count_, 1, y, batch, b, hq)]),
                                         source_code=LDCG_SRC, return_type="float32")
                for i in L.unroll(VPT):
                    if VS % NT == 0 or NT >= VS or col + i * NT < VS:
                        T.evaluate(T.cuda.func_call(
                            LDCG4, T.address_of(po[(u * VPT + i) * 4]),
                            T.address_of(o_part_[part_row(0, count_, 1, y, batch, b, hq) * D + (col + i * NT) * 4]),
                            source_code=LDCG4_SRC))
            if r == 0:
                mx[0] = T.float32(EMPTY_LSE)
                for k in L.unroll(LSE_SLOTS):
                    mx[0] = T.max(mx[0], lv[k])
                for i in L.unroll(5):
                    mx[0] = T.max(mx[0], T.tvm_warp_shuffle_xor(T.uint32(FULL_WARP), mx[0], 1 << i, 32, 32))
                lsum[0] = T.float32(0)
                for k in L.unroll(LSE_SLOTS):
                    lsum[0] = lsum[0] + finished_l(lv[k]) * rescale_factor(lv[k], mx[0])
                for i in L.unroll(5):
                    lsum[0] = lsum[0] + T.tvm_warp_shuffle_xor(T.uint32(FULL_WARP), lsum[0], 1 << i, 32, 32)
            for u in L.unroll(unroll):
                y = T.meta_var((r * unroll + u) * TPV + grp)
                pl[u] = finished_l(pl[u]) * rescale_factor(pl[u], mx[0]) * T.Cast("float32", y < count_)
                for i in L.unroll(VPT * 4):
                    acc[i] = acc[i] + pl[u] * po[u * VPT * 4 + i]
        if NT >= VS:
            if NT % VS == 0 or tid_ < TPV * VS:
                for c in L.unroll(4):
                    smem_[(grp * VS + col) * 4 + c] = acc[c]
        else:
            for i in L.unroll(VPT):
                if VS % NT == 0 or col + i * NT < VS:
                    for c in L.unroll(4):
                        smem_[(col + i * NT) * 4 + c] = acc[i * 4 + c]
        T.tvm_storage_sync(shared)
        for k in L.unroll(ceildiv(D, NT)):
            e = T.meta_var(k * NT + tid_)
            if D % NT == 0 or e < D:
                acc[0] = T.float32(0)
                for g in L.unroll(TPV):
                    acc[0] = acc[0] + smem_[g * VS * 4 + e]
                o_[b, hq, e] = T.Cast(dtype, acc[0] * finalize_scale(lsum[0]))
        if tid_ == 0:
            lse_[b, hq] = finalize_lse(mx[0], lsum[0])

    return merge_head


def _fused_merge_macro(lay: _Layout, L):
    """fused_merge (with its `arrive`): the merge of the splits by the split blocks themselves."""
    ARRIVE, ARRIVE2, ARRIVE2_SRC, ARRIVEC = lay.ARRIVE, lay.ARRIVE2, lay.ARRIVE2_SRC, lay.ARRIVEC
    ARRIVEC_SRC, ARRIVE_SRC, COOP, COOP_WIDTHS, D = lay.ARRIVEC_SRC, lay.ARRIVE_SRC, lay.COOP, lay.COOP_WIDTHS, lay.D
    FANIN, FLAG_WORD, G, Hkv, Hq, TPV, dtype = lay.FANIN, lay.FLAG_WORD, lay.G, lay.Hkv, lay.Hq, lay.TPV, lay.dtype
    shared = lay.shared
    merge_partials = _merge_partials_macro(lay, L)
    merge_head = _merge_head_macro(lay, L)

    @T.macro
    def arrive(smem_, func_, src_, args_, tid_, last_):
        """last_[0] <- func_(*args_) (an arrival function of this module: `cuda_funcs.arrival_counter`'s
        1 in the n-th block to arrive, else 0; `_cooperative_arrival`'s merger index or -1),
        called by one thread after the block's barrier (the arrival fences); the verdict goes
        to every thread through shared memory."""
        T.tvm_storage_sync(shared)  # the block's partial is written; no thread reads shared memory any more
        if tid_ == 0:
            smem_[FLAG_WORD] = T.Cast("float32", T.cuda.func_call(func_, *args_, source_code=src_,
                                                                  return_type="int32"))
        T.tvm_storage_sync(shared)
        last_[0] = T.Cast("int32", smem_[FLAG_WORD])
        T.tvm_storage_sync(shared)  # (so that TVM needs no barrier inside the branch)

    @T.macro
    def fused_merge(smem_, o_part_, lse_part_, o_, lse_, b, hkv, split, slots, nsplit, warp_, lane_, tid_):
        """After this block wrote its split's partial: the last of the request's nsplit blocks
        merges the group's partials into o_ / lse_ (merge_fanin 0); cooperative_merge: the last
        min(nsplit, G) blocks to arrive wait for all, then merge a query head each (`merge_head`;
        heads k, k + mergers, .. where fewer blocks merge), or the last alone where waiting
        could outnumber the SMs; or, merge_fanin n: the last
        block of each run of n splits merges its run into the run's first slot, and the last of
        the runs' mergers merges the runs (a run of one split is its own result)."""
        batch = o_.shape[0]
        last = T.alloc_buffer((1,), "int32", scope="local")
        out = T.meta_var((lambda h, e, val: T.buffer_store(o_, T.Cast(dtype, val), [b, hkv * G + h, e]),
                          lambda h, val: T.buffer_store(lse_, val, [b, hkv * G + h])))
        if COOP:
            # Waiting blocks (at most mergers - 1 per counter) fewer than the SMs: one resident
            # block per SM is always free for a block that has not arrived yet.
            mergers = T.alloc_buffer((1,), "int32", scope="local")
            mergers[0] = 1
            if batch * Hkv * (T.min(slots, G) - 1) < T.cuda.func_call(NSMID, source_code=NSMID_SRC,
                                                                       return_type="int32"):
                mergers[0] = T.min(nsplit, G)
            arrive(smem_, ARRIVEC, ARRIVEC_SRC, (b * Hkv + hkv, nsplit, mergers[0]), tid_, last)
            if last[0] >= 0:
                if mergers[0] == 1:
                    merge_partials(smem_, o_part_, lse_part_, batch, b, hkv, 0, nsplit, 1, *out, warp_, lane_, tid_)
                else:
                    for i in T.serial(ceildiv(G - last[0], mergers[0])):
                        args = T.meta_var((smem_, o_part_, lse_part_, o_, lse_, batch, b, hkv, last[0] + i * mergers[0],
                                           nsplit, lane_, tid_))
                        if len(COOP_WIDTHS) == 1:
                            merge_head(*args, COOP_WIDTHS[0])
                        else:
                            if nsplit <= TPV * COOP_WIDTHS[0]:
                                merge_head(*args, COOP_WIDTHS[0])
                            else:
                                merge_head(*args, COOP_WIDTHS[1])
        elif FANIN == 0:
            arrive(smem_, ARRIVE, ARRIVE_SRC, (b * Hkv + hkv, nsplit), tid_, last)
            if last[0] != 0:
                merge_partials(smem_, o_part_, lse_part_, batch, b, hkv, 0, nsplit, 1, *out, warp_, lane_, tid_)
        else:
            first = T.meta_var(split // FANIN * FANIN)
            members = T.meta_var(T.min(nsplit - first, FANIN))
            arrive(smem_, ARRIVE, ARRIVE_SRC, ((b * Hkv + hkv) * slots + first, members), tid_, last)
            if last[0] != 0:
                if nsplit <= FANIN:
                    merge_partials(smem_, o_part_, lse_part_, batch, b, hkv, 0, nsplit, 1, *out, warp_, lane_, tid_)
                else:
                    if members > 1:
                        merge_partials(
                            smem_, o_part_, lse_part_, batch, b, hkv, first, members, 1,
                            lambda h, e, val: T.buffer_store(o_part_, val,
                                                             [((first * batch + b) * Hq + hkv * G + h) * D + e]),
                            lambda h, val: T.buffer_store(lse_part_, val, [(first * batch + b) * Hq + hkv * G + h]),
                            warp_, lane_, tid_)
                    arrive(smem_, ARRIVE2, ARRIVE2_SRC, (b * Hkv + hkv, ceildiv(nsplit, FANIN)), tid_, last)
                    if last[0] != 0:
                        merge_partials(smem_, o_part_, lse_part_, batch, b, hkv, 0, ceildiv(nsplit, FANIN), FANIN,
                                       *out, warp_, lane_, tid_)

    return fused_merge


def pages_early(append_) -> bool:
    """Whether a tables_before_wait block also issues its prologue's copies of the history's K and
    V rows before the grid wait: in the append build, whose new key row `issue` leaves alone and
    whose previous kernel (the QKV projection) writes no page (the schedule's contract)."""
    return append_ is not None


def new_key(append_, kv_len):
    """The key `issue` leaves alone in the append build (the new token: the last visible key), else None."""
    return None if append_ is None else kv_len - 1


def _body_macro(lay: _Layout, L):
    """body: the work of one block (request, KV head, split slot), thread by thread."""
    sched, BK, D, EARLY, FUSED, G, HALVES = lay.sched, lay.BK, lay.D, lay.EARLY, lay.FUSED, lay.G, lay.HALVES
    Hkv, Hq, KPW, KSTEPS_QK, LI_SHAPE, ON = lay.Hkv, lay.Hq, lay.KPW, lay.KSTEPS_QK, lay.LI_SHAPE, lay.ON
    PASSES, PDL, PRE, QREG, Q_OFF, ROPE_AHEAD = lay.PASSES, lay.PDL, lay.PRE, lay.QREG, lay.Q_OFF, lay.ROPE_AHEAD
    ROPE_OWN, ROPE_OWN_JUMP, ROPE_RPP, RPW = lay.ROPE_OWN, lay.ROPE_OWN_JUMP, lay.ROPE_RPP, lay.RPW
    SMEM_WORDS, SN, STAGES, TABLES_EARLY, dtype = lay.SMEM_WORDS, lay.SN, lay.STAGES, lay.TABLES_EARLY, lay.dtype
    page_shift, rope_own, shared, visible_keys = lay.page_shift, lay.rope_own, lay.shared, lay.visible_keys
    load_length_info, load_q, lookup, issue, refill, refill_commit, load_q_frag = _load_macros(lay, L)
    (rope_freqs, rope_steps, rope_angles, rope_rows, rope_exact, rope_own_tile, rope_own_next,
     rope_tile) = _rope_macros(lay, L)
    s_mma, softmax, pv_mma = _mma_macros(lay, L)
    finish = _finish_macro(lay, L)
    fused_merge = _fused_merge_macro(lay, L)
    load_new_kv, put_new_row = _append_macros(lay, L)
    FP8 = lay.FP8
    # FP8 pages: the tiles hold code values times FP8_TILE_FACTOR; the K scale (over that
    # factor) multiplies the scores, the V scale the output (both linear in the tile values)
    fp8_inverse = T.float32(1.0 / FP8_TILE_FACTOR[lay.config.kv_dtype]) if FP8 else None

    def k_scaled(scale, fp8_scale):
        return scale * fp8_scale[0] if FP8 else scale

    def v_scaled(val, fp8_scale):
        return val * fp8_scale[1] if FP8 else val

    @T.macro
    def body(q_, pages_, indptr_, indices_, length_info_, o_, lse_, o_part_, lse_part_, sm_scale_, rope_, append_, b,
             hkv, split, tid):
        """The work of block (request b, KV head hkv, split slot `split`), thread tid. rope_: None,
        or (k_rope_pos_offset, q_rope_position, rope_scale, rope_theta) for inline RoPE. append_:
        None, or (q_rope_position, append_position, apply_rope) for the append build (q_ is the
        step's qkv; see paged_decode_append_tc)."""
        batch = q_.shape[0]
        smem = T.alloc_buffer((SMEM_WORDS,), "float32", scope=shared)
        qf = T.alloc_buffer((KSTEPS_QK * 4 if QREG else 4,), "uint32", scope="local")
        s = T.alloc_buffer((SN * 4,), "float32", scope="local")
        o = T.alloc_buffer((ON * 4,), "float32", scope="local")
        m_run = T.alloc_buffer((HALVES,), "float32", scope="local")
        l_run = T.alloc_buffer((HALVES,), "float32", scope="local")
        # page-table entries: of the next tile (main loop), or of the prologue's tiles (early_pages)
        pg = T.alloc_buffer((PASSES * PRE,), "int32", scope="local")
        sl = T.alloc_buffer((PASSES * PRE,), "int32", scope="local")
        warp = tid // 32
        lane = tid % 32
        li = T.alloc_buffer(LI_SHAPE, "int32", scope="local")
        rope_freq = T.alloc_buffer((CHUNK if rope_ is not None else 1,), "float32", scope="local")
        rope_step = T.alloc_buffer((2 * CHUNK if rope_ is not None else 1,), "float32", scope="local")
        rope_cs = T.alloc_buffer((2 * CHUNK if rope_ is not None else 1,), "float32", scope="local")
        rope_qcs = T.alloc_buffer((2 * CHUNK if rope_ is not None else 1,), "float32", scope="local")
        rope_tstep = T.alloc_buffer((2 * CHUNK if rope_ is not None and ROPE_OWN else 1,), "float32", scope="local")
        fp8_scale = T.alloc_buffer((2 if FP8 else 1,), "float32", scope="local")  # K, V (FP8 pages)
        staged = T.alloc_buffer((PASSES * lay.CPT * 4 if FP8 else 1,), "uint32", scope="local")  # FP8 refill codes
        newkv = T.alloc_buffer((CHUNK // 2,), "uint32", scope="local")  # append build: a chunk of the new K / V row
        if PDL and not TABLES_EARLY:  # nothing of the previous grids' is read (or written) before they completed
            T.evaluate(grid_dependency_wait())
        load_length_info(length_info_, b, li)
        page0 = indptr_[b]
        kv_len = visible_keys(indptr_[b + 1] - page0, li)
        nsplit = request_splits(sched, grid_splits(sched, Hkv, batch), kv_len)
        shift = T.meta_var(page_shift(li, kv_len))
        split_len = split_length(sched, kv_len + shift, nsplit)
        j_begin = T.min(split * split_len - shift, kv_len)
        j_end = T.min(j_begin + split_len, kv_len)
        ntiles = T.if_then_else(split < nsplit, ceildiv(j_end - j_begin, BK), 0)
        # the append build: the new token is the request's last visible key, in this block's split
        # or not (its tile row is stored from registers, never copied from its page slot)
        holds_new = T.meta_var(split < nsplit and j_begin <= kv_len - 1 and kv_len - 1 < j_end)
        new_row = T.meta_var(kv_len - 1 - j_begin - (ntiles - 1) * BK)
        scale = sm_scale_ * T.float32(LOG2E)
        for r in L.unroll(HALVES):
            m_run[r] = T.float32(EMPTY_LSE)
            l_run[r] = T.float32(0)
        for i in L.unroll(ON * 4):
            o[i] = T.float32(0)
        if not TABLES_EARLY:
            if append_ is None:
                load_q(q_, smem, b, hkv, tid, None)
            T.ptx["cp.async.commit_group"]()
        if EARLY:  # every page-table read of the prologue, then every copy
            for st in L.unroll(STAGES - 1):
                if st < ntiles:
                    lookup(indices_, li, page0, j_begin + st * BK, j_end, tid, pg, sl, st * PASSES, rope_own(rope_))
            if TABLES_EARLY and pages_early(append_):  # no Q copy in the append build: an empty group
                T.ptx["cp.async.commit_group"]()
            elif TABLES_EARLY:  # the page tables are read; q, the pages and the workspace only after the wait
                T.evaluate(grid_dependency_wait())
                if append_ is None:
                    load_q(q_, smem, b, hkv, tid, None)
                T.ptx["cp.async.commit_group"]()
            for st in L.unroll(STAGES - 1):
                if st < ntiles:
                    issue(pages_, smem, hkv, st, j_begin + st * BK, j_end, tid, pg, sl, st * PASSES,
                          rope_own(rope_), False, staged, new_key(append_, kv_len))
                T.ptx["cp.async.commit_group"]()  # (empty groups keep the count)
            if TABLES_EARLY and pages_early(append_):  # the history's copies are in flight; q after the wait
                T.evaluate(grid_dependency_wait())
        else:
            for st in L.unroll(STAGES - 1):
                if st < ntiles:
                    lookup(indices_, li, page0, j_begin + st * BK, j_end, tid, pg, sl, 0, rope_own(rope_))
                    issue(pages_, smem, hkv, st, j_begin + st * BK, j_end, tid, pg, sl, 0, rope_own(rope_), False,
                          staged, new_key(append_, kv_len))
                T.ptx["cp.async.commit_group"]()  # (empty groups keep the count)
        # Page lookups run a tile ahead of the copies: their latency hides behind a step of
        # arithmetic.
        if STAGES - 1 < ntiles:
            lookup(indices_, li, page0, j_begin + (STAGES - 1) * BK, j_end, tid, pg, sl, 0, rope_own(rope_))
        if PDL:  # the prologue's copies are issued: the next launch may take SMs as they free up
            T.evaluate(launch_dependents())
        if append_ is not None:  # the query rows and the new key / value, while the copies are in flight
            load_q(q_, smem, b, hkv, tid, (append_[0][b], append_[2] > 0))
            if holds_new:
                load_new_kv(q_, pages_, b, hkv, tid, append_[0][b], append_[2] > 0, append_[1][b], newkv)
                if ntiles - 1 < STAGES - 1:  # its tile is one of the prologue's
                    put_new_row(smem, ntiles - 1, new_row, tid, newkv)
        if rope_ is not None:  # the angles need no data: computed while the copies are in flight
            rope_freqs(rope_[2], rope_[3], tid, rope_freq, rope_step, RPW if ROPE_OWN else ROPE_RPP)
            rope_angles(rope_[1][b], tid, rope_freq, rope_qcs)
            if ROPE_OWN:
                rope_steps(rope_freq, ROPE_OWN_JUMP, rope_tstep)
                rope_exact(rope_[0][b], j_begin, 0, tid, rope_freq, rope_cs, True)
        if rope_ is not None and ROPE_AHEAD:
            T.ptx["cp.async.wait_group"](STAGES - 2)  # Q and tile 0 have landed
        else:
            T.ptx["cp.async.wait_group"](STAGES - 1)  # Q has landed
        T.tvm_storage_sync(shared)
        if rope_ is not None:
            rope_rows(smem, Q_OFF, G, False, tid, rope_step, rope_qcs)
            if ROPE_AHEAD:  # tile 0 too; each step then rotates the next tile (one barrier a step)
                if ntiles > 0:
                    rope_tile(smem, rope_[0][b], j_begin, 0, tid, rope_freq, rope_step, rope_cs)
            T.tvm_storage_sync(shared)
        if QREG:
            for kk in L.unroll(KSTEPS_QK):
                load_q_frag(smem, qf, kk * 4, kk, lane)
        if FP8:  # (after the grid dependency wait, as every read of the pages)
            for kv in L.unroll(2):
                fp8_scale[kv] = kv_scale(pages_, kv, hkv) * fp8_inverse
        if not rope_own(rope_):
            for t in T.serial(ntiles):
                if rope_ is not None and ROPE_AHEAD:
                    T.ptx["cp.async.wait_group"](STAGES - 3)  # tiles t (rotated) and t + 1 have landed ...
                else:
                    T.ptx["cp.async.wait_group"](STAGES - 2)  # tile t has landed ...
                T.tvm_storage_sync(shared)  # ... for all, and no warp reads tile t - 1
                refill(pages_, indices_, li, page0, smem, hkv, t, ntiles, j_begin, j_end, tid, pg, sl, False,
                       staged, new_key(append_, kv_len))
                if append_ is not None:  # (the stage tile t - 1 left: no warp reads it after the barrier)
                    if holds_new and t + STAGES - 1 == ntiles - 1:
                        put_new_row(smem, (t + STAGES - 1) % STAGES, new_row, tid, newkv)
                T.ptx["cp.async.commit_group"]()
                if rope_ is not None:
                    if ROPE_AHEAD:  # tile t + 1's keys, in place, while the warps multiply tile t's
                        if t + 1 < ntiles:
                            rope_tile(smem, rope_[0][b], j_begin, t + 1, tid, rope_freq, rope_step, rope_cs)
                    else:  # tile t's keys, then a barrier before any warp reads them
                        rope_tile(smem, rope_[0][b], j_begin, t, tid, rope_freq, rope_step, rope_cs)
                        T.tvm_storage_sync(shared)
                s_mma(smem, qf, s, t % STAGES, warp, lane)
                softmax(s, o, m_run, l_run, j_begin + t * BK + warp * KPW, j_end, k_scaled(scale, fp8_scale),
                        lane)
                pv_mma(s, smem, o, t % STAGES, warp, lane)
                refill_commit(smem, t, ntiles, j_begin, j_end, tid, False, staged)
        else:  # ROPE_OWN: a warp's rows of a tile are its own (the block meets only after the loop)
            for t in T.serial(ntiles):
                T.evaluate(T.cuda.func_call(SYNCWARP, source_code=SYNCWARP_SRC))  # step t - 1 read its stage
                refill(pages_, indices_, li, page0, smem, hkv, t, ntiles, j_begin, j_end, tid, pg, sl, True,
                       staged, None)
                T.ptx["cp.async.commit_group"]()
                T.ptx["cp.async.wait_group"](STAGES - 1)  # this thread's copies of tile t have landed
                rope_own_tile(smem, t % STAGES, tid, rope_step, rope_cs)
                T.evaluate(T.cuda.func_call(SYNCWARP, source_code=SYNCWARP_SRC))  # ... and the warp's, rotated
                s_mma(smem, qf, s, t % STAGES, warp, lane)
                softmax(s, o, m_run, l_run, j_begin + t * BK + warp * KPW, j_end, k_scaled(scale, fp8_scale),
                        lane)
                pv_mma(s, smem, o, t % STAGES, warp, lane)
                refill_commit(smem, t, ntiles, j_begin, j_end, tid, True, staged)
                if t + 1 < ntiles:  # tile t + 1's angles before its wait
                    rope_own_next(rope_[0][b], j_begin, t + 1, tid, rope_freq, rope_tstep, rope_cs)
        if nsplit == 1:
            if split == 0:
                finish(smem, o, m_run, l_run, warp, lane, tid,
                       lambda h, e, val: T.buffer_store(o_, T.Cast(dtype, v_scaled(val, fp8_scale)),
                                                        [b, hkv * G + h, e]),
                       lambda h, val: T.buffer_store(lse_, val, [b, hkv * G + h]))
        elif split < nsplit:
            finish(smem, o, m_run, l_run, warp, lane, tid,
                   lambda h, e, val: T.buffer_store(o_part_, v_scaled(val, fp8_scale),
                                                    [((split * batch + b) * Hq + hkv * G + h) * D + e]),
                   lambda h, val: T.buffer_store(lse_part_, val, [(split * batch + b) * Hq + hkv * G + h]))
            if FUSED:
                fused_merge(smem, o_part_, lse_part_, o_, lse_, b, hkv, split, grid_splits(sched, Hkv, batch), nsplit,
                            warp, lane, tid)

    return body


def _kernel_macro(lay: _Layout, L):
    """tc_kernel: the grid of blocks (request, KV head, split slot) running `body`."""
    sched, HEADS_FIRST, Hkv, NT = lay.sched, lay.HEADS_FIRST, lay.Hkv, lay.NT
    body = _body_macro(lay, L)

    @T.macro
    def tc_kernel(q_, pages_, indptr_, indices_, length_info_, o_, lse_, o_part_, lse_part_, sm_scale_, rope_, append_):
        """One block per (request, KV head, split slot); slots past the request's split count
        do nothing. A request of one split writes o / lse, others the split workspace. The grid
        runs requests fastest, or KV heads (heads_first)."""
        batch = q_.shape[0]
        if HEADS_FIRST:
            for hkv in L.block(Hkv, "x", outer=True):
                for split in L.block(grid_splits(sched, Hkv, batch), "y"):
                    for b in L.block(batch, "z"):
                        for tid in L.thread(NT, "x"):
                            body(q_, pages_, indptr_, indices_, length_info_, o_, lse_, o_part_, lse_part_,
                                 sm_scale_, rope_, append_, b, hkv, split, tid)
        else:
            for b in L.block(batch, "x", outer=True):
                for hkv in L.block(Hkv, "y"):
                    for split in L.block(grid_splits(sched, Hkv, batch), "z"):
                        for tid in L.thread(NT, "x"):
                            body(q_, pages_, indptr_, indices_, length_info_, o_, lse_, o_part_, lse_part_,
                                 sm_scale_, rope_, append_, b, hkv, split, tid)

    return tc_kernel


def _split_merge_macro(lay: _Layout, L):
    """merge: the separate merge kernel of the split partials (without fused_merge)."""
    sched, D, Hkv, Hq, LI_SHAPE, MERGE_WIDTHS = lay.sched, lay.D, lay.Hkv, lay.Hq, lay.LI_SHAPE, lay.MERGE_WIDTHS
    PDL, dtype, visible_keys = lay.PDL, lay.dtype, lay.visible_keys
    load_length_info = _load_macros(lay, L)[0]

    @T.macro
    def merge_slots(width, slots, indptr_, length_info_, o_part_, lse_part_, o_, lse_, b, h, e):
        """The merge of (request b, query head h), column e, for at most `width` split slots:
        the LSE and o of all `width` slots are loaded at once (slot index clamped to the
        request's last split, whose copies then weigh 0), so the block waits for one round of
        loads instead of one per split; no use of a loaded value is conditional, so the compiler
        cannot sink the loads into per-split branches."""
        batch = o_.shape[0]
        lw = T.alloc_buffer((width,), "float32", scope="local")
        ov = T.alloc_buffer((width,), "float32", scope="local")
        li = T.alloc_buffer(LI_SHAPE, "int32", scope="local")
        np_ = T.alloc_buffer((1,), "int32", scope="local")
        m_all = T.alloc_buffer((1,), "float32", scope="local")
        l_all = T.alloc_buffer((1,), "float32", scope="local")
        acc = T.alloc_buffer((1,), "float32", scope="local")
        wt = T.alloc_buffer((1,), "float32", scope="local")
        if PDL:
            T.evaluate(grid_dependency_wait())
        np_[0] = indptr_[b + 1] - indptr_[b]
        load_length_info(length_info_, b, li)
        nsplit = request_splits(sched, slots, visible_keys(np_[0], li))
        if nsplit > 1:
            for y in L.unroll(width):
                lw[y] = lse_part_[(T.min(y, nsplit - 1) * batch + b) * Hq + h]
                ov[y] = o_part_[((T.min(y, nsplit - 1) * batch + b) * Hq + h) * D + e]
            m_all[0] = T.float32(EMPTY_LSE)
            for y in L.unroll(width):
                m_all[0] = T.max(m_all[0], lw[y])
            l_all[0] = T.float32(0)
            acc[0] = T.float32(0)
            for y in L.unroll(width):
                wt[0] = finished_l(lw[y]) * rescale_factor(lw[y], m_all[0]) * T.Cast("float32", y < nsplit)
                l_all[0] = l_all[0] + wt[0]
                acc[0] = acc[0] + wt[0] * ov[y]
            o_[b, h, e] = T.Cast(dtype, acc[0] * finalize_scale(l_all[0]))
            if e == 0:
                lse_[b, h] = finalize_lse(m_all[0], l_all[0])

    @T.macro
    def merge(indptr_, length_info_, o_part_, lse_part_, o_, lse_):
        """o_, lse_ <- the FP32 merge of the split states of each (request, query head) whose
        request took more than one split: block (request, head), one thread per column; split
        s's finished state (o, lse) counts as (m = lse, l = finished_l(lse), o * l). The code
        is compiled for each of MERGE_WIDTHS slot counts; the launch's slots pick one."""
        batch = o_.shape[0]
        slots = T.meta_var(grid_splits(sched, Hkv, batch))
        for b in L.block(batch, "x", outer=True):
            for h in L.block(Hq, "y"):
                for e in L.thread(D, "x"):
                    args = T.meta_var((slots, indptr_, length_info_, o_part_, lse_part_, o_, lse_, b, h, e))
                    if len(MERGE_WIDTHS) == 1:
                        merge_slots(MERGE_WIDTHS[0], *args)
                    elif len(MERGE_WIDTHS) == 2:
                        if slots <= MERGE_WIDTHS[0]:
                            merge_slots(MERGE_WIDTHS[0], *args)
                        else:
                            merge_slots(MERGE_WIDTHS[1], *args)
                    else:
                        if slots <= MERGE_WIDTHS[0]:
                            merge_slots(MERGE_WIDTHS[0], *args)
                        elif slots <= MERGE_WIDTHS[1]:
                            merge_slots(MERGE_WIDTHS[1], *args)
                        else:
                            merge_slots(MERGE_WIDTHS[2], *args)

    return merge


def _tc_macros(config: AttentionConfig, sched: TensorCoreDecodeSchedule):
    """The tensor-core decode kernel and its split merge (see the module docstring)."""
    lay = _Layout(config, sched)
    L = loop_kinds(config)
    return _kernel_macro(lay, L), _split_merge_macro(lay, L)


def paged_decode_tc(config: AttentionConfig, schedule: TensorCoreDecodeSchedule | None = None,
                    rope_schedule: TensorCoreDecodeSchedule | None = None):
    """Paged decode on tensor cores; the PrimFunc of `decode.paged_decode` (same arguments,
    semantics and global symbol):

    q [B, Hq, D], pages [P, 2, Hkv, page_size, D], page_indptr [B+1] i32,
    page_indices [nnz] i32, length_info [B] (or [3, B] sliding) i32, k_rope_pos_offset [B] i32,
    q_rope_position [B] i32, o [B, Hq, D], lse [B, Hq] f32 (base 2), rotary_mode i32,
    rope_scale f32, rope_theta f32, sm_scale f32.
    A request with no visible token gets o = 0 and lse = EMPTY_LSE. dtype float16 or bfloat16,
    CUDA sm_80 or newer, GQA group up to 16 (ValueError otherwise); rotary_mode == 1 applies
    RoPE to q (at q_rope_position) and to each key j (at k_rope_pos_offset + j) inside the
    kernel (a second compilation of the kernel, picked on the device), with rope_schedule
    (default: `schedules.tc_decode_rope_schedule` of the plain schedule; its dependent_launch
    must be the schedule's, ValueError otherwise).
    """
    check_config(config, "paged_decode_tc")
    sched = schedule or choose_tc_decode_schedule(config)
    sched.check(config)
    rope_sched = rope_schedule or tc_decode_rope_schedule(config, sched)
    rope_sched.check(config)
    # the PrimFunc's launch tag follows `schedule`: a rope build launched dependently must wait too
    if rope_sched.dependent_launch != sched.dependent_launch:
        raise ValueError(f"rope_schedule: dependent_launch={rope_sched.dependent_launch} must match the schedule's "
                         f"({sched.dependent_launch}): the kernels of one PrimFunc share its launch")
    tc_kernel, tc_merge = _tc_macros(config, sched)
    rope_kernel, rope_merge = _tc_macros(config, rope_sched) if rope_sched != sched else (tc_kernel, tc_merge)
    Hq, Hkv, D = config.num_qo_heads, config.num_kv_heads, config.head_dim
    # one merge kernel after either build where both split the same way (the default rope schedule)
    shared_merge = all(getattr(sched, f) == getattr(rope_sched, f)
                       for f in ("fused_merge", "max_splits", "target_blocks", "min_split_keys"))

    def slots(batch):
        """Split slots of the workspace: the larger grid of the two builds."""
        if rope_sched.max_splits == 1 and sched.max_splits == 1:
            return 1
        return T.max(grid_splits(sched, Hkv, batch), grid_splits(rope_sched, Hkv, batch))

    @T.macro
    def kernel(Q_, pages_, page_indptr_, page_indices_, length_info_, k_rope_pos_offset_, q_rope_position_, O_,
               lse_, rotary_mode_, rope_scale_, rope_theta_, sm_scale_):
        batch = Q_.shape[0]
        # Split partials: FP32 output and LSE per split slot.
        o_part = T.alloc_buffer((slots(batch) * batch * Hq * D,), "float32")
        lse_part = T.alloc_buffer((slots(batch) * batch * Hq,), "float32")
        if rotary_mode_ == 1:
            rope_kernel(Q_, pages_, page_indptr_, page_indices_, length_info_, O_, lse_, o_part, lse_part, sm_scale_,
                        (k_rope_pos_offset_, q_rope_position_, rope_scale_, rope_theta_), None)
            if not shared_merge and not rope_sched.fused_merge and grid_splits(rope_sched, Hkv, batch) > 1:
                rope_merge(page_indptr_, length_info_, o_part, lse_part, O_, lse_)
        else:
            tc_kernel(Q_, pages_, page_indptr_, page_indices_, length_info_, O_, lse_, o_part, lse_part, sm_scale_,
                      None, None)
            if not shared_merge and not sched.fused_merge and grid_splits(sched, Hkv, batch) > 1:
                tc_merge(page_indptr_, length_info_, o_part, lse_part, O_, lse_)
        if shared_merge and not sched.fused_merge and grid_splits(sched, Hkv, batch) > 1:
            tc_merge(page_indptr_, length_info_, o_part, lse_part, O_, lse_)

    func = decode_func(config, kernel)
    return func.with_attr(PDL_TAG, True) if sched.dependent_launch else func


def paged_decode_append_tc(config: AttentionConfig, schedule: TensorCoreDecodeSchedule | None = None):
    """split_rotary_append and the tensor-core paged decode in one launch (tvmattn's own kernel,
    `decode_contract.decode_append_func`'s arguments): a decode step's attention of each request's
    new token, its query heads read from the step's qkv [B, Hq + 2 Hkv, D] and its key and value
    stored to page slot append_position[b] by the block whose split holds the request's last
    visible key (the new token's), which puts the same rows into its tile from registers instead
    of reading the slot back; q and the key rotated to q_rope_position[b] where apply_rope > 0
    (RoPE with the config's theta, scale and scaling, split_rotary's arithmetic). Plain builds
    only: no sliding window, no FP8 pages (ValueError otherwise); `schedule` as paged_decode_tc's
    (default `schedules.choose_tc_decode_schedule`). With tables_before_wait the blocks also copy
    the history's K and V rows before the grid wait (`pages_early`), so the schedule's contract
    grows: the kernel launched just before this one must write no page either (in a model, the
    QKV projection)."""
    check_config(config, "paged_decode_append_tc")
    if config.sliding_window or config.kv_fp8:
        raise ValueError(f"paged_decode_append_tc: sliding_window={config.sliding_window}, kv_dtype="
                         f"{config.kv_dtype!r}: expected a plain build (no sliding window, pages of the dtype)")
    sched = schedule or choose_tc_decode_schedule(config)
    sched.check(config)
    if sched.num_threads < 2 * (config.head_dim // CHUNK):
        raise ValueError(f"paged_decode_append_tc: {sched.num_threads} threads cannot hold a new key and value row "
                         f"of {config.head_dim // CHUNK} chunks each")
    tc_kernel, tc_merge = _tc_macros(config, sched)
    Hq, Hkv, D = config.num_qo_heads, config.num_kv_heads, config.head_dim

    @T.macro
    def kernel(QKV_, pages_, page_indptr_, page_indices_, length_info_, q_rope_position_, append_position_, O_, lse_,
               apply_rope_, sm_scale_):
        batch = QKV_.shape[0]
        o_part = T.alloc_buffer((grid_splits(sched, Hkv, batch) * batch * Hq * D,), "float32")
        lse_part = T.alloc_buffer((grid_splits(sched, Hkv, batch) * batch * Hq,), "float32")
        tc_kernel(QKV_, pages_, page_indptr_, page_indices_, length_info_, O_, lse_, o_part, lse_part, sm_scale_, None,
                  (q_rope_position_, append_position_, apply_rope_))
        if not sched.fused_merge and grid_splits(sched, Hkv, batch) > 1:
            tc_merge(page_indptr_, length_info_, o_part, lse_part, O_, lse_)

    func = decode_append_func(config, kernel)
    return func.with_attr(PDL_TAG, True) if sched.dependent_launch else func


__all__ = ["paged_decode_append_tc", "paged_decode_tc", "threads_per_row"]
