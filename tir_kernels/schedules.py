"""Schedules: how a kernel's work is tiled and mapped to threads, and their choice per config.

A schedule never changes what a kernel computes, only how fast. `choose_*` functions pick
one for a config; tests and benchmarks may pass their own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os

from .common import is_power_of_two
from .config import AttentionConfig
from .mma import Tile
from .support import DTYPE_BYTES, MMA_MIN_SM, PDL_MIN_SM, TENSOR_CORE_DTYPES

# H200 / H100 multiprocessor count; split-KV aims to fill the chip about twice.
CUDA_NUM_SMS = 132
CUDA_VECTOR_BYTES = 16


def _require(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(f"invalid schedule: {what}")


@dataclasses.dataclass(frozen=True)
class DecodeSchedule:
    """Thread mapping of `paged_decode`.

    lanes: threads that share one KV row, each holding head_dim/lanes elements.
    rows: KV rows processed side by side (threadIdx.y).
    rows_per_thread: rows each thread loads per step, for memory-level parallelism.
    heads_per_block: query heads of one GQA group a block serves (K/V is read once for them).
    max_splits: most blocks one request's history is split over (1: never split, no workspace).
    target_blocks: the grid's split slots per request are chosen at launch as
      target_blocks / (batch * heads), at most max_splits.
    min_split_keys: a request uses min(slots, ceil(kv_len / min_split_keys)) of the slots (read
      in the kernel from its length, so a captured grid stays valid); one split writes o / lse
      directly, more are merged in FP32.
    fused_merge (CUDA): the last of a request's split blocks to finish (an arrival counter per
      request and head chunk) merges the splits, instead of a second kernel.
    """

    lanes: int
    rows: int
    rows_per_thread: int
    heads_per_block: int
    max_splits: int = 1
    target_blocks: int = 2 * CUDA_NUM_SMS
    min_split_keys: int = 1
    fused_merge: bool = False

    def __post_init__(self):
        _require(is_power_of_two(self.lanes) and self.lanes <= 32, "lanes must be a power of two <= 32")
        _require(self.rows >= 1 and self.lanes * self.rows <= 1024, "lanes * rows must be <= 1024")
        _require(self.rows_per_thread >= 1, "rows_per_thread must be >= 1")
        _require(self.heads_per_block >= 1, "heads_per_block must be >= 1")
        _require(self.max_splits >= 1, "max_splits must be >= 1")
        _require(self.min_split_keys >= 1, f"min_split_keys={self.min_split_keys} must be >= 1")

    def check(self, config: AttentionConfig) -> None:
        _require(config.head_dim % self.lanes == 0, f"lanes={self.lanes} must divide head_dim={config.head_dim}")
        _require(
            config.group_size % self.heads_per_block == 0,
            f"heads_per_block={self.heads_per_block} must divide the GQA group {config.group_size}",
        )
        _require(config.is_gpu or not self.fused_merge, f"fused_merge is CUDA's (target={config.target!r})")


def choose_decode_schedule(config: AttentionConfig) -> DecodeSchedule:
    if not config.is_gpu:
        # One thread per block; a block reads 16 rows per step (one max update per 16 rows,
        # 16 independent dot products); splits so that batch * KV heads * splits >= 2 tasks
        # per core (batch 1 of SmolLM2's 3 KV heads: 2 splits, 6 tasks on 2 cores).
        return DecodeSchedule(lanes=1, rows=1, rows_per_thread=16, heads_per_block=config.group_size,
                              max_splits=16, target_blocks=2 * (os.cpu_count() or 1))
    vec = CUDA_VECTOR_BYTES // config.elem_bytes
    # Each lane of a row owns whole 16-byte vectors: the largest power of two <= 32 dividing
    # the vectors per row (32 at head_dim 128 and 256 in fp16, fewer for head dims such as 80).
    vectors = config.head_dim // vec
    lanes = 32
    while vectors % lanes:
        lanes //= 2
    per_lane = config.head_dim // lanes
    # q and o of the served heads live in registers: keep them under ~128 fp32 values.
    heads = max(h for h in range(1, config.group_size + 1) if config.group_size % h == 0 and (h == 1 or h * per_lane <= 64))
    # 2 rows per thread rather than 4 or 8: fewer registers, more resident warps; aiming at 4
    # blocks per SM helps long single requests (docs/performance.md); a split of at least
    # MIN_SPLIT_KEYS keys (short requests take fewer splits, or one).
    return DecodeSchedule(
        lanes=lanes,
        rows=max(1, 128 // lanes),
        rows_per_thread=2,
        heads_per_block=heads,
        max_splits=64,
        target_blocks=4 * CUDA_NUM_SMS,
        min_split_keys=CUDA_CORE_MIN_SPLIT_KEYS,
        fused_merge=True,
    )


# Keys per split of the CUDA-core decode at least (the GPU default schedule's min_split_keys).
CUDA_CORE_MIN_SPLIT_KEYS = 64


# Tensor-core decode (`decode_tc`): the dtypes, smallest arch and GQA groups it serves.
TC_DECODE_DTYPES = TENSOR_CORE_DTYPES
TC_DECODE_MIN_ARCH = MMA_MIN_SM  # cp.async, ldmatrix and bf16 mma.sync: sm_80 and newer
# below, 16-row MMA tiles waste more than the CUDA-core kernel loses; at 3 (SmolLM2's 9 / 3 heads)
# the tensor-core kernel moved more bytes at every shape tune_decode measured (docs/performance.md)
TC_DECODE_MIN_GROUP = 3
TC_DECODE_MAX_GROUP = 16  # the query heads of a group are the M = 16 rows of one MMA tile
PDL_MIN_ARCH = PDL_MIN_SM  # griddepcontrol (programmatic dependent launch): sm_90 and newer
# 32-bit registers per thread the O accumulators, S accumulators and Q fragments may take.
TC_DECODE_MAX_FRAGMENT_REGISTERS = 192


def _mma_row_stride(width: int) -> int:
    """Elements per shared-memory row of 16-bit `width`-wide rows in the mma kernels' layout
    (mma.Tile): swizzled rows of a multiple of 8 chunks are unpadded, others get one 16-byte chunk."""
    return Tile(width).stride


@dataclasses.dataclass(frozen=True)
class TensorCoreDecodeSchedule:
    """Tiling of the tensor-core paged decode (`decode_tc.paged_decode_tc`).

    A block serves one request, one KV head (its whole GQA group as the M = 16 rows of
    m16n8k16 MMAs) and one split of the request's keys. Each step the block loads a tile of
    tile_kv = warps * keys_per_warp keys into one of `stages` shared-memory buffers
    (cp.async); warp w computes keys w * keys_per_warp.. of the tile; warps are merged in
    shared memory at the end.
    warps: warps per block; keys_per_warp: keys each warp takes per step (multiple of 16);
    stages: tiles in the cp.async ring (>= 2); q_in_registers: Q's A fragments stay in
    registers (else read from shared memory per step).
    Split-KV: the grid has min(max(floor(target_blocks / (batch * num_kv_heads)), 1),
    max_splits) split slots per request (chosen at launch; target_blocks is about the blocks
    resident at once); a request uses min(slots, ceil(kv_len / min_split_keys)) of them, each
    a whole number of tiles; one split writes o / lse directly, more are merged in FP32.
    l2_prefetch: 0, or 64 / 128 / 256: the K/V copies ask L2 to fetch that many bytes around
    each 16-byte access (cp.async's .L2::<n>B hint); 0: no hint.
    early_pages: the prologue reads the page-table entries of all its stages - 1 tiles before
    it issues any copy (one round trip instead of one per tile; 2 * (stages - 1) more int32
    registers per page-table pass); False: a tile's lookup, then its copies, then the next.
    threads_per_row: threads that copy one K/V row together (a warp's copy instruction covers
    32 / threads_per_row rows of threads_per_row * 16 contiguous bytes each): 1, 2, 4, 8 or 16,
    dividing head_dim / 8; 0: the kernel's rule (4 where it divides).
    heads_first: the grid runs (KV head, split, request) from fastest to slowest, so the blocks
    of one request's heads and splits start together and read the same pages at about the same
    time (the KV heads of a page slot are adjacent in memory); False: (request, KV head, split).
    fused_merge: the last split block of a (request, KV head) to finish merges the splits (an
    arrival counter per (request, KV head) in the kernel module's memory), so a call is one
    launch; False: a separate merge kernel.
    merge_fanin (with fused_merge): 0, the last of the nsplit blocks merges all nsplit partials;
    n >= 2, a two-level tree: the last block of each run of n consecutive splits merges the
    run (in place, into the run's first slot), and the last of those mergers merges the runs'
    results (so no block reads more than max(n, ceil(nsplit / n)) partials; a second arrival
    counter per (request, KV head)).
    cooperative_merge (with fused_merge, merge_fanin 0): the merge is spread over the last
    min(nsplit, group) blocks of a (request, KV head) to arrive: each waits (spinning on the
    arrival counter) until all nsplit partials are written, then merges its own query heads, so
    the merge costs one round of L2 loads per block instead of the last block reading all of
    the group's partials. Taken only where no block can wait for a block that is not resident:
    batch * num_kv_heads * (min(grid split slots, group) - 1) waiting blocks fewer than the
    device's SMs (%nsmid, read in the kernel), else the last block merges alone (as -f).
    dependent_launch (sm_90 and newer): programmatic dependent launch. The kernels are launched
    with CUDA's programmatic stream serialization, so a launch's blocks may become resident
    while the previous kernel of the stream still runs; every block executes
    `griddepcontrol.wait` (until the previous grids have completed and their memory is visible)
    before its first global memory access, and `griddepcontrol.launch_dependents` once its
    prologue's copies are issued, so the next launch's blocks are scheduled as SMs free up and
    the launch gap between calls is hidden.
    tables_before_wait (with dependent_launch and early_pages): a block reads length_info,
    page_indptr and its prologue's page_indices entries before `griddepcontrol.wait` (q, the
    pages, the workspace and the counters after it), so the page-table round trips overlap the
    previous kernel's tail. Contract: the kernel launched just before the decode in its stream
    must not write the page tables (host copies, and kernels before that one, may: they have
    completed when the decode's blocks start, provided that kernel is an ordinary launch or lets
    its dependents start only after its own griddepcontrol.wait, as this one does). The append
    build (decode_tc.paged_decode_append_tc) also copies the prologue's K and V rows of the
    history before the wait, all but the new token's, which it stores itself: there the kernel
    launched just before must not write the pages either.
    """

    warps: int = 4
    keys_per_warp: int = 16
    stages: int = 3
    q_in_registers: bool = True
    max_splits: int = 64
    target_blocks: int = 2 * CUDA_NUM_SMS
    min_split_keys: int = 256
    l2_prefetch: int = 0
    early_pages: bool = False
    heads_first: bool = False
    threads_per_row: int = 0
    fused_merge: bool = False
    merge_fanin: int = 0
    cooperative_merge: bool = False
    dependent_launch: bool = False
    tables_before_wait: bool = False

    def __post_init__(self):
        _require(1 <= self.warps <= 16, f"warps={self.warps} must be 1..16")
        _require(self.keys_per_warp >= 16 and self.keys_per_warp % 16 == 0,
                 f"keys_per_warp={self.keys_per_warp} must be a multiple of 16")
        _require(2 <= self.stages <= 8, f"stages={self.stages} must be 2..8")
        _require(self.max_splits >= 1, f"max_splits={self.max_splits} must be >= 1")
        _require(self.target_blocks >= 1, f"target_blocks={self.target_blocks} must be >= 1")
        _require(self.min_split_keys >= 1, f"min_split_keys={self.min_split_keys} must be >= 1")
        _require(self.l2_prefetch in (0, 64, 128, 256), f"l2_prefetch={self.l2_prefetch} must be 0, 64, 128 or 256")
        _require(self.threads_per_row in (0, 1, 2, 4, 8, 16),
                 f"threads_per_row={self.threads_per_row} must be 0 (automatic), 1, 2, 4, 8 or 16")
        _require(self.merge_fanin == 0 or (self.fused_merge and 2 <= self.merge_fanin <= self.max_splits),
                 f"merge_fanin={self.merge_fanin} must be 0, or 2..max_splits={self.max_splits} with fused_merge")
        _require(not self.cooperative_merge or (self.fused_merge and self.merge_fanin == 0),
                 f"cooperative_merge needs fused_merge=True and merge_fanin=0 (got fused_merge={self.fused_merge},"
                 f" merge_fanin={self.merge_fanin})")
        _require(not self.tables_before_wait or (self.dependent_launch and self.early_pages),
                 "tables_before_wait needs dependent_launch=True and early_pages=True")

    @property
    def tile_kv(self) -> int:
        return self.warps * self.keys_per_warp

    @property
    def label(self) -> str:
        """Short name: w<warps>k<keys_per_warp>s<stages>t<target_blocks>m<min_split_keys>[x<max_splits>][-qsmem]
        [-p<l2_prefetch>][-c<threads_per_row>][-e (early_pages)][-h (heads_first)][-f (fused_merge)][<merge_fanin>]
        [c (cooperative_merge)][-pdl (dependent_launch)][t (tables_before_wait)]."""
        return (f"w{self.warps}k{self.keys_per_warp}s{self.stages}t{self.target_blocks}m{self.min_split_keys}"
                + (f"x{self.max_splits}" if self.max_splits != 64 else "") + ("" if self.q_in_registers else "-qsmem")
                + (f"-p{self.l2_prefetch}" if self.l2_prefetch else "")
                + (f"-c{self.threads_per_row}" if self.threads_per_row else "") + ("-e" if self.early_pages else "")
                + ("-h" if self.heads_first else "") + ("-f" if self.fused_merge else "")
                + (str(self.merge_fanin) if self.merge_fanin else "") + ("c" if self.cooperative_merge else "")
                + ("-pdl" if self.dependent_launch else "") + ("t" if self.tables_before_wait else ""))

    @property
    def num_threads(self) -> int:
        return 32 * self.warps

    def shared_bytes(self, config: AttentionConfig) -> int:
        """The Q tile (16 rows) and `stages` K and V tiles (16-bit elements), or the fp32
        states the warps are merged through at the end (they reuse the same memory)."""
        stride = _mma_row_stride(config.head_dim)
        tiles = 2 * (16 * stride + 2 * self.stages * self.tile_kv * stride)
        merge = 4 * (self.warps * config.group_size * config.head_dim + 2 * 16 * self.warps)
        return max(tiles, merge)

    def fragment_registers(self, config: AttentionConfig) -> int:
        """O accumulators (head_dim / 2), S accumulators (keys_per_warp / 2) and, with
        q_in_registers, Q fragments (head_dim / 4) per thread."""
        q = config.head_dim // 4 if self.q_in_registers else 4
        return config.head_dim // 2 + self.keys_per_warp // 2 + q

    def check(self, config: AttentionConfig) -> None:
        _require(config.dtype in TC_DECODE_DTYPES,
                 f"dtype={config.dtype!r}: the tensor-core decode serves {TC_DECODE_DTYPES}")
        _require(config.is_gpu and config.sm_version >= TC_DECODE_MIN_ARCH,
                 f"target={config.target!r}: the tensor-core decode needs CUDA sm_{TC_DECODE_MIN_ARCH} or newer")
        _require(config.group_size <= TC_DECODE_MAX_GROUP,
                 f"GQA group {config.group_size}: the tensor-core decode serves groups up to {TC_DECODE_MAX_GROUP}")
        _require(config.head_dim % 16 == 0 and config.v_head_dim == config.head_dim,
                 f"head_dim={config.head_dim}, v_head_dim={config.v_head_dim}: the tensor-core decode needs equal"
                 " head dims, a multiple of 16")
        problem = tc_rope_pass_problem(config, self)
        _require(problem is None, problem or "")
        _require(self.threads_per_row == 0 or (config.head_dim // 8) % self.threads_per_row == 0,
                 f"threads_per_row={self.threads_per_row} must divide the {config.head_dim // 8} 16-byte chunks of a"
                 f" row at head_dim={config.head_dim}")
        _require(self.fragment_registers(config) <= TC_DECODE_MAX_FRAGMENT_REGISTERS,
                 f"keys_per_warp={self.keys_per_warp}, q_in_registers={self.q_in_registers} hold"
                 f" {self.fragment_registers(config)} fragment registers per thread at head_dim={config.head_dim};"
                 f" at most {TC_DECODE_MAX_FRAGMENT_REGISTERS}")
        _require(not self.dependent_launch or config.sm_version >= PDL_MIN_ARCH,
                 f"target={config.target!r}: dependent_launch (griddepcontrol) needs CUDA sm_{PDL_MIN_ARCH} or newer")
        limit = CUDA_MAX_SHARED_BYTES.get(config.cuda_arch, CUDA_DEFAULT_SHARED_BYTES)
        _require(self.shared_bytes(config) <= limit,
                 f"tile_kv={self.tile_kv}, stages={self.stages} need {self.shared_bytes(config)} bytes of shared"
                 f" memory, {config.cuda_arch} has {limit}")


def tc_rope_pass_problem(config: AttentionConfig, sched: TensorCoreDecodeSchedule) -> str | None:
    """Why the tensor-core decode's inline RoPE cannot rotate sched's K tiles at config's head
    dim, or None. A pass of the block's threads rotates whole rows in shared memory: thread t
    takes the rotate-half pair t % P of 16-byte chunks (d.., d + D/2..) of row t // P, where
    P = head_dim / 16 pairs make a row; so P must divide the threads (a thread left over would
    rotate a row of the next pass a second time) and the rows of a pass the tile (the angles
    advance by whole passes from tile to tile). With 4 warps of 16 keys that leaves head dims
    32, 64, 128 and 256: 80 or 96, for example, make 5 or 6 pairs, which divide no 128 threads."""
    pairs = config.head_dim // 16
    rows = sched.num_threads // pairs if pairs else 0
    if pairs and sched.num_threads % pairs == 0 and sched.tile_kv % rows == 0:
        return None
    return (f"head_dim={config.head_dim}: the tensor-core decode's inline RoPE rotates a K tile of {sched.tile_kv} keys"
            f" in passes of whole rows, its {sched.num_threads} threads over the {pairs} rotate-half chunk pairs of a"
            f" row; that needs {pairs} to divide {sched.num_threads} and the rows of a pass to divide"
            f" {sched.tile_kv} (head dims 32, 64, 128 and 256 at warps=4, keys_per_warp=16)")


def tc_decode_problem(config: AttentionConfig) -> str | None:
    """Why `paged_decode` does not serve `config` on tensor cores by default, or None where it
    does (see TensorCoreDecodeSchedule.check; groups below TC_DECODE_MIN_GROUP run on CUDA cores;
    head dims whose rows the inline RoPE cannot rotate in whole passes, `tc_rope_pass_problem`,
    on the CUDA-core kernel)."""
    if not config.is_gpu or config.sm_version < TC_DECODE_MIN_ARCH:
        return f"target={config.target!r} (the tensor-core decode needs CUDA sm_{TC_DECODE_MIN_ARCH} or newer)"
    if config.dtype not in TC_DECODE_DTYPES:
        return f"dtype={config.dtype!r} (the tensor-core decode serves {TC_DECODE_DTYPES})"
    if not TC_DECODE_MIN_GROUP <= config.group_size <= TC_DECODE_MAX_GROUP:
        return (f"GQA group {config.group_size} (the tensor-core decode serves groups of {TC_DECODE_MIN_GROUP}.."
                f"{TC_DECODE_MAX_GROUP} by default)")
    if config.head_dim % 16 or config.v_head_dim != config.head_dim or config.head_dim > 256:
        return (f"head_dim={config.head_dim}, v_head_dim={config.v_head_dim} (the tensor-core decode needs equal"
                " head dims, multiples of 16 up to 256)")
    return tc_rope_pass_problem(config, choose_tc_decode_schedule(config))


def tc_decode_applies(config: AttentionConfig) -> bool:
    """Whether `paged_decode` serves `config` on tensor cores (see TensorCoreDecodeSchedule.check)."""
    return tc_decode_problem(config) is None


def tc_decode_resident_blocks(config: AttentionConfig, sched: TensorCoreDecodeSchedule) -> int:
    """Blocks of `sched` an SM holds at once: by shared memory (1 KiB reserved per block) and
    by registers (about 168 per thread: what the kernel takes at head dim 128, with a margin)."""
    limit = CUDA_MAX_SHARED_BYTES.get(config.cuda_arch, CUDA_DEFAULT_SHARED_BYTES)
    by_shared = (limit + 1024) // (sched.shared_bytes(config) + 1024)
    by_registers = 65536 // (168 * sched.num_threads)
    return max(1, min(by_shared, by_registers))


def choose_tc_decode_schedule(config: AttentionConfig) -> TensorCoreDecodeSchedule:
    """4 warps of 16 keys (64-key tiles), 4 stages (2 above head dim 128, where Q fragments are
    read from shared memory per step to leave registers for the 256-wide O accumulators), splits
    of at least 128 keys; fewer stages or warps where the arch's shared memory is smaller.

    4 stages and one block per SM moved more bytes per second than 3 stages and two blocks per
    SM at every shape scripts/tune_decode.py measures (docs/performance.md). Splits of 128 keys
    instead of 256 let groups of 8 (4 KV heads) fill the SMs at batch 1 (they have half the
    blocks of groups of 4)."""
    wide = config.head_dim > 128
    sched = TensorCoreDecodeSchedule(warps=4, keys_per_warp=16, stages=2 if wide else 4, q_in_registers=not wide,
                                     min_split_keys=128)
    limit = CUDA_MAX_SHARED_BYTES.get(config.cuda_arch, CUDA_DEFAULT_SHARED_BYTES)
    # Where shared memory is short (sm_86 / sm_89: 99 KiB), fewer stages, then fewer warps.
    while sched.shared_bytes(config) > limit and sched.stages > 2:
        sched = dataclasses.replace(sched, stages=sched.stages - 1)
    while sched.shared_bytes(config) > limit and sched.warps > 1:
        sched = dataclasses.replace(sched, warps=sched.warps // 2)
    # one wave of resident blocks: split counts round down to it
    return dataclasses.replace(sched, target_blocks=CUDA_NUM_SMS * tc_decode_resident_blocks(config, sched))


def tc_decode_rope_schedule(config: AttentionConfig, sched: TensorCoreDecodeSchedule) -> TensorCoreDecodeSchedule:
    """The schedule of the inline-RoPE build (rotary_mode 1) beside plain `sched`: the same, with
    threads_per_row = head_dim / 16 (half a row's 16-byte chunks) where that is a valid copy
    width, so that each thread copies exactly the rotate-half chunk pairs (d.., d + D/2..) it
    rotates: the build then copies warp-wise and each warp rotates and multiplies its own keys
    with no block barrier in the main loop (decode_tc's ROPE_OWN); else `sched` unchanged."""
    half = config.head_dim // 16
    if half == sched.threads_per_row or half not in (1, 2, 4, 8, 16):
        return sched
    return dataclasses.replace(sched, threads_per_row=half)


def tc_decode_rope_candidates(config: AttentionConfig) -> dict:
    """name -> TensorCoreDecodeSchedule: schedules `scripts/tune_decode.py --rope` measures for
    the inline-RoPE build (rotary_mode 1) at small batches, those valid for config. All copy
    with threads_per_row = head_dim / 16 (tc_decode_rope_schedule: each thread rotates its own
    copies), early page lookups, heads first and the fused merge, and launch dependently (a rope
    schedule keeps its plain schedule's dependent_launch, and every table schedule at batch 1
    has it); they differ in the split grid: 1-4 blocks per SM (4, 3 or 2 stages; one wave, or
    two where the blocks are more than one wave holds), splits of at least 64 or 128 keys
    (1 or 2 tiles), the fused or cooperative merge, page tables before the wait or after.
    More, shorter splits give an SM more blocks whose rotations overlap each other's loads."""
    half = config.head_dim // 16
    if half not in (1, 2, 4, 8, 16):
        return {}
    qreg = choose_tc_decode_schedule(config).q_in_registers
    out = {}

    def add(warps, stages, waves, keys, coop, early):
        sched = TensorCoreDecodeSchedule(warps=warps, keys_per_warp=16, stages=stages, q_in_registers=qreg,
                                         min_split_keys=keys, threads_per_row=half, early_pages=True,
                                         heads_first=True, fused_merge=True, cooperative_merge=coop,
                                         dependent_launch=True, tables_before_wait=early)
        try:
            sched.check(config)
        except ValueError:
            return
        blocks = waves * CUDA_NUM_SMS * tc_decode_resident_blocks(config, sched)
        sched = dataclasses.replace(sched, target_blocks=blocks)
        out.setdefault(sched.label, sched)

    for stages, waves in ((4, 1), (4, 2), (3, 1), (3, 2), (2, 1)):
        for keys in (64, 128):
            for coop, early in ((False, False), (False, True), (True, True)):
                add(4, stages, waves, keys, coop, early)
    # 2 warps (32-key tiles, more blocks per SM) and 8 (128-key tiles, more warps per block)
    for warps, stages in ((2, 4), (2, 2), (8, 2)):
        for keys in (64, 128):
            add(warps, stages, 1, keys, True, True)
    return out


def tc_decode_candidates(config: AttentionConfig) -> dict:
    """name -> TensorCoreDecodeSchedule: the default and the variants `scripts/tune_decode.py`
    measures beside it (tests/test_decode_tc.py runs each on the GPU), those valid for config.
    A variant's target_blocks is one wave of its resident blocks (times `waves`)."""
    base = choose_tc_decode_schedule(config)
    qreg = base.q_in_registers

    def tc(warps, kpw, stages, min_split_keys=128, waves=1):
        sched = TensorCoreDecodeSchedule(warps=warps, keys_per_warp=kpw, stages=stages, q_in_registers=qreg,
                                         min_split_keys=min_split_keys)
        return dataclasses.replace(sched, target_blocks=waves * CUDA_NUM_SMS * tc_decode_resident_blocks(config, sched))

    # Tilings of 2 and 3 blocks per SM (w4k16s2, w4k16s3, w2k16s6, w2k32s3, w2k16s4 with splits of
    # 64 and 256 keys) and w4k32s3 / w8k16s3 were slower than the default at every shape
    # (docs/performance.md); w2k16s4 stays as their representative.
    variants = [
        base,
        dataclasses.replace(base, min_split_keys=256),
        dataclasses.replace(base, min_split_keys=512),
        dataclasses.replace(base, target_blocks=2 * base.target_blocks),
        tc(4, 32, 2), tc(8, 16, 2), tc(4, 16, 6), tc(2, 16, 4),
        # L2 prefetch hints on the K/V copies
        dataclasses.replace(base, l2_prefetch=128),
        dataclasses.replace(base, l2_prefetch=256),
        dataclasses.replace(base, min_split_keys=256, l2_prefetch=256),
        dataclasses.replace(tc(4, 16, 6), l2_prefetch=256),
        # the prologue's page lookups at once; the grid's heads and splits of a request together
        dataclasses.replace(base, l2_prefetch=128, early_pages=True),
        dataclasses.replace(base, l2_prefetch=128, heads_first=True),
        dataclasses.replace(base, l2_prefetch=128, early_pages=True, heads_first=True),
        # whole 128-byte lines (8 threads a row) or whole rows (16) per copy instruction
        dataclasses.replace(base, l2_prefetch=128, threads_per_row=8, early_pages=True, heads_first=True),
        dataclasses.replace(base, threads_per_row=8, early_pages=True, heads_first=True),
        dataclasses.replace(base, l2_prefetch=256, threads_per_row=8, early_pages=True, heads_first=True),
        dataclasses.replace(base, threads_per_row=16, early_pages=True, heads_first=True),
        # with -c8-e-h: two blocks per SM (3 stages), 5 stages, two waves of splits
        dataclasses.replace(tc(4, 16, 3), threads_per_row=8, early_pages=True, heads_first=True),
        dataclasses.replace(base, stages=5, threads_per_row=8, early_pages=True, heads_first=True),
        dataclasses.replace(base, target_blocks=2 * base.target_blocks, threads_per_row=8, early_pages=True,
                            heads_first=True),
        # one launch a call: the last split block merges (-f), splits of at least 128 or 256 keys
        *(dataclasses.replace(sched, min_split_keys=keys, threads_per_row=8, early_pages=True, heads_first=True,
                              fused_merge=True)
          for sched in (base, tc(4, 16, 3)) for keys in (128, 256)),
        # the fused merge as a two-level tree of runs of 6 splits
        *(dataclasses.replace(sched, min_split_keys=keys, threads_per_row=8, early_pages=True, heads_first=True,
                              fused_merge=True, merge_fanin=6)
          for sched in (base, tc(4, 16, 3)) for keys in (128, 256)),
        # the fused merge spread over the last blocks to arrive, a query head each
        *(dataclasses.replace(sched, min_split_keys=keys, threads_per_row=8, early_pages=True, heads_first=True,
                              fused_merge=True, cooperative_merge=True)
          for sched in (base, tc(4, 16, 3)) for keys in (128, 256)),
        # programmatic dependent launch: the next call's blocks are scheduled while this one ends
        *(dataclasses.replace(sched, min_split_keys=128, threads_per_row=8, early_pages=True, heads_first=True,
                              fused_merge=True, cooperative_merge=coop, dependent_launch=True, tables_before_wait=early)
          for sched in (base, tc(4, 16, 3)) for coop in (False, True) for early in (False, True)),
        # one block a (request, KV head) for short contexts (splits of at least 256 or 512 keys):
        # 8 warps (128-key tiles) or 32 keys a warp, a short request's tiles all in flight at once
        # and no merge between blocks
        *(dataclasses.replace(sched, min_split_keys=keys, threads_per_row=8, early_pages=True, heads_first=True,
                              fused_merge=True, dependent_launch=True, tables_before_wait=True)
          for sched in (tc(8, 16, 4), tc(8, 16, 3), tc(4, 32, 4), base) for keys in (256, 512)),
        # with -fc-pdlt at two blocks per SM: L2 prefetch hints, splits of at least 256 keys
        *(dataclasses.replace(tc(4, 16, 3), min_split_keys=keys, threads_per_row=8, early_pages=True, heads_first=True,
                              fused_merge=True, cooperative_merge=True, dependent_launch=True, tables_before_wait=True,
                              l2_prefetch=prefetch)
          for keys, prefetch in ((128, 128), (128, 256), (256, 0))),
    ]
    out = {}
    for sched in variants:
        try:
            sched.check(config)
        except ValueError:
            continue
        out.setdefault(sched.label, sched)
    return out


# Decode schedule table (tir_kernels/decode_table.json, written by scripts/tune_decode.py
# --table): per (dtype, head dim, GQA group) bucket of one CUDA arch and SM count, the schedule
# measured fastest at each (batch, context) shape. A config takes the nearest bucket's entries
# (same head dim and arch; the other 16-bit dtype and then the nearest group where its own is
# absent); a shape the nearest entry in log2(batch), log2(context). Schedules that do not fit
# the config are skipped; no entry: today's defaults. An entry may also name a "rope_schedule":
# the inline-RoPE build's schedule (rotary_mode 1, compiled into the same PrimFunc; it must keep
# the entry's dependent_launch); without one, or where it does not fit, that build takes
# tc_decode_rope_schedule of the entry's schedule.
DECODE_TABLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "decode_table.json")


def schedule_from_dict(params: dict):
    """A DecodeSchedule or TensorCoreDecodeSchedule from a table's schedule entry
    ({"kind": "tensor-core" | "cuda-core", fields...})."""
    params = dict(params)
    kind = params.pop("kind")
    cls = {"tensor-core": TensorCoreDecodeSchedule, "cuda-core": DecodeSchedule}[kind]
    return cls(**params)


def schedule_to_dict(sched) -> dict:
    kind = "tensor-core" if isinstance(sched, TensorCoreDecodeSchedule) else "cuda-core"
    return {"kind": kind, **dataclasses.asdict(sched)}


def decode_schedule_label(sched) -> str:
    """A schedule's short name: TensorCoreDecodeSchedule.label, or cc-l<lanes>r<rows>p<rows per
    thread>h<heads per block>t<target_blocks>x<max_splits>[m<min_split_keys>][-f (fused_merge)] for the CUDA-core kernel."""
    if isinstance(sched, TensorCoreDecodeSchedule):
        return sched.label
    return (f"cc-l{sched.lanes}r{sched.rows}p{sched.rows_per_thread}h{sched.heads_per_block}"
            f"t{sched.target_blocks}x{sched.max_splits}"
            + (f"m{sched.min_split_keys}" if sched.min_split_keys != 1 else "") + ("-f" if sched.fused_merge else ""))


_TABLE_CACHE: dict = {}
_TABLE_OVERRIDE: list = []  # use_decode_table's tables, innermost last


def load_decode_table(path: str | None = None) -> dict:
    """The table file as a dict (read once per path); {} where it is absent. Without a path,
    inside `use_decode_table(table)`: that table."""
    if path is None and _TABLE_OVERRIDE:
        return _TABLE_OVERRIDE[-1]
    path = path or DECODE_TABLE_PATH
    if path not in _TABLE_CACHE:
        try:
            with open(path) as f:
                _TABLE_CACHE[path] = json.load(f)
        except FileNotFoundError:
            _TABLE_CACHE[path] = {}
    return _TABLE_CACHE[path]


def _fits(config: AttentionConfig, sched) -> bool:
    try:
        if isinstance(sched, TensorCoreDecodeSchedule) and not tc_decode_applies(config):
            return False
        sched.check(config)
        return True
    except ValueError:
        return False


@contextlib.contextmanager
def use_decode_table(table: dict):
    """Inside, `load_decode_table()` (and so every schedule choice without a table argument)
    returns `table` instead of the file's (scripts/bench_decode_schedules.py builds a model
    library with another decode schedule this way)."""
    _TABLE_OVERRIDE.append(table)
    try:
        yield table
    finally:
        _TABLE_OVERRIDE.pop()


def decode_table_bucket(config: AttentionConfig, table: dict) -> dict | None:
    """The table's bucket that serves config: of its head dim and element size, the nearest in
    GQA group (log2), then the same dtype; None where the table serves no such config (not
    CUDA, another arch or SM count, no bucket of this head dim)."""
    if not table or not config.is_gpu or config.cuda_arch != table.get("arch") or config.head_dim != config.v_head_dim:
        return None
    if table.get("sms", CUDA_NUM_SMS) != CUDA_NUM_SMS:
        return None
    buckets = [b for b in table.get("buckets", []) if b["head_dim"] == config.head_dim
               and _dtype_bytes(b["dtype"]) == config.elem_bytes]
    if not buckets:
        return None
    return min(buckets, key=lambda b: (abs(math.log2(b["group"]) - math.log2(config.group_size)),
                                       b["dtype"] != config.dtype))


def decode_table_entries(config: AttentionConfig, table: dict | None = None) -> list:
    """[(batch, seq_len, schedule, rope_schedule)] of the bucket nearest to config whose
    schedules fit it, or [] (not CUDA, another arch or SM count, no bucket of this head dim);
    rope_schedule: the entry's "rope_schedule" where it names one that fits config and keeps
    the schedule's dependent_launch, else None (decode_tc's default rope schedule)."""
    table = load_decode_table() if table is None else table
    bucket = decode_table_bucket(config, table)
    if bucket is None:
        return []
    schedules = table.get("schedules", {})
    out = []
    for e in bucket["shapes"]:
        sched = schedule_from_dict(schedules[e["schedule"]])
        if not _fits(config, sched):
            continue
        rope = schedule_from_dict(schedules[e["rope_schedule"]]) if e.get("rope_schedule") else None
        if rope is not None and not (isinstance(sched, TensorCoreDecodeSchedule) and _fits(config, rope)
                                     and rope.dependent_launch == sched.dependent_launch):
            rope = None
        out.append((e["batch"], e["seq_len"], sched, rope))
    return out


def _dtype_bytes(dtype: str) -> int:
    return DTYPE_BYTES.get(dtype, 0)


def nearest_entry(entries: list, batch: int, seq_len: int):
    """The schedule of the entry nearest to (batch, seq_len) in log2 space (ties: the first)."""
    b, n = math.log2(max(batch, 1)), math.log2(max(seq_len, 1))
    return min(entries, key=lambda e: abs(math.log2(e[0]) - b) + abs(math.log2(e[1]) - n))[2]


def default_decode_schedule(config: AttentionConfig):
    """Today's default without a table: tensor cores where they apply, else the CUDA-core one."""
    return choose_tc_decode_schedule(config) if tc_decode_applies(config) else choose_decode_schedule(config)


def choose_decode_variant(config: AttentionConfig, batch: int | None = None, seq_len: int | None = None,
                          table: dict | None = None, rope: bool = False):
    """The decode schedule for config (and, where given, a batch of requests of about seq_len
    keys) from the table; without a shape, the table's schedule for the bucket's largest shape
    (where the kernel spends the most time); the defaults where the table has nothing.
    rope=True: (schedule, rope_schedule or None) of the same entry."""
    entries = decode_table_entries(config, table)
    if not entries:
        return (default_decode_schedule(config), None) if rope else default_decode_schedule(config)
    if batch is None:
        entry = max(entries, key=lambda e: e[0] * e[1])
    else:
        entry = entries[nearest_entry([(b, n, i) for i, (b, n, *_) in enumerate(entries)], batch, seq_len or 1)]
    return (entry[2], entry[3]) if rope else entry[2]


def decode_variants(config: AttentionConfig, table: dict | None = None) -> list:
    """[(schedule, rope_schedule, [(batch, seq_len), ...])]: the distinct (schedule, rope
    schedule) pairs the table chooses for config (rope_schedule None: decode_tc's default for
    the schedule), each with the shapes it serves (the variants a cache compiles and picks on
    the host); [(default, None, [])] where the table has nothing."""
    entries = decode_table_entries(config, table)
    if not entries:
        return [(default_decode_schedule(config), None, [])]
    out: dict = {}
    for batch, seq_len, sched, rope in entries:
        out.setdefault((sched, rope), []).append((batch, seq_len))
    return [(sched, rope, shapes) for (sched, rope), shapes in out.items()]


def decode_variant_label(sched, rope_sched=None) -> str:
    """A table variant's short name: its schedule's label, with "+rope:<label>" where it names
    its own rope schedule."""
    return decode_schedule_label(sched) + (f"+rope:{rope_sched.label}" if rope_sched is not None else "")


@dataclasses.dataclass(frozen=True)
class CopySchedule:
    """Thread mapping of the element-wise kernels (page ops, merge_state, split_rotary).

    Work is cut into chunks of `vector` consecutive elements of one row (a head's head_dim
    values); one thread moves one chunk per access.
    vector: elements per chunk (16 bytes on CUDA; a whole row on CPU, for LLVM to vectorize).
    threads: threads per block (1 on CPU).
    """

    vector: int
    threads: int

    def __post_init__(self):
        _require(self.vector >= 1, "vector must be >= 1")
        _require(1 <= self.threads <= 1024, "threads must be in 1..1024")

    def check(self, row_len: int) -> None:
        _require(row_len % self.vector == 0, f"vector={self.vector} must divide the row length {row_len}")

    def chunks(self, row_len: int) -> int:
        """Chunks (threads) per row."""
        return row_len // self.vector

    def threads_for(self, items: int) -> int:
        """Threads per block for a grid of `items` chunks known at compile time: no more than
        whole warps covering them."""
        return min(self.threads, -(-items // 32) * 32)


def choose_copy_schedule(config: AttentionConfig, row_len: int) -> CopySchedule:
    """16-byte accesses and 256-thread blocks on CUDA; one row per iteration on CPU."""
    if not config.is_gpu:
        return CopySchedule(vector=row_len, threads=1)
    return CopySchedule(vector=CUDA_VECTOR_BYTES // config.elem_bytes, threads=256)


# Opt-in shared memory per block (bytes) of the CUDA archs tvmattn targets.
CUDA_MAX_SHARED_BYTES = {"sm_80": 163 * 1024, "sm_90": 227 * 1024}
CUDA_DEFAULT_SHARED_BYTES = 99 * 1024
# float32 lanes of the CPU kernels' vectors (one AVX-512 register) and the CPU prefill's packed
# query rows a block (4 tokens of a GQA group of 4).
CPU_VECTOR_LANES = 16
CPU_PREFILL_ROWS = 16
# Head dims from which the CPU prefill scores rows in pairs (score_rows=2): below, the ragged
# prefill's q . k of one row at a time was the faster.
CPU_PAIRED_SCORES_MIN_DIM = 128
# Extra fp32 words per shared-memory row of the prefill tiles: threads that read 16 bytes of
# different rows at the same column then hit different banks.
PREFILL_ROW_PAD = 4
PREFILL_P_ROW_PAD = 4


@dataclasses.dataclass(frozen=True)
class PrefillSchedule:
    """Tiling and thread mapping of `paged_prefill` / `ragged_prefill`.

    A block has threads_y x threads_x threads (threadIdx.y, threadIdx.x). Thread (ty, tx)
    computes the scores of rows ty + threads_y * m (m < rows_per_thread) and keys
    tx + threads_x * n (n < cols_per_thread) of a tile, and holds the same rows of the
    output, columns tx*4 + 4*threads_x*k + (0..3). So a block owns
    tile_q = threads_y * rows_per_thread packed query rows and consumes
    tile_kv = threads_x * cols_per_thread keys per step. The threads_x threads of a row are
    consecutive lanes of one warp (row maxima and sums use warp shuffles).
    vector_lanes (CPU only): 0, the scalar tile above; V (16), the vectorized CPU algorithm
    (prefill_cpu.py): one thread, tile_q = rows_per_thread packed rows, cols_per_thread = V keys
    a step, every head dimension in V-lane float32 vectors (head dims multiples of V, no FP8
    pages). score_rows (with vector_lanes): 1, each row's q . k alone; 2, rows in pairs, each key
    vector loaded once for both (rows_per_thread even).
    """

    threads_y: int
    threads_x: int
    rows_per_thread: int
    cols_per_thread: int
    vector_lanes: int = 0
    score_rows: int = 1

    def __post_init__(self):
        _require(
            is_power_of_two(self.threads_x) and self.threads_x <= 32,
            f"threads_x={self.threads_x} must be a power of two <= 32",
        )
        _require(
            self.threads_y >= 1 and self.num_threads <= 1024,
            f"threads_y={self.threads_y}: threads_y * threads_x must be 1..1024",
        )
        _require(self.rows_per_thread >= 1, f"rows_per_thread={self.rows_per_thread} must be >= 1")
        _require(
            self.cols_per_thread >= 1 and self.tile_kv % 4 == 0,
            f"cols_per_thread={self.cols_per_thread}: tile_kv = threads_x * cols_per_thread must be a multiple of 4",
        )
        _require(self.vector_lanes in (0, CPU_VECTOR_LANES), f"vector_lanes={self.vector_lanes} must be 0 or {CPU_VECTOR_LANES}")
        _require(not self.vector_lanes or (self.num_threads == 1 and self.cols_per_thread == self.vector_lanes),
                 f"vector_lanes={self.vector_lanes}: expected one thread and cols_per_thread={self.vector_lanes}")
        _require(self.score_rows == 1 or (self.score_rows == 2 and self.vector_lanes
                                          and self.rows_per_thread % 2 == 0),
                 f"score_rows={self.score_rows} must be 1, or 2 with vector_lanes and an even rows_per_thread")

    @property
    def num_threads(self) -> int:
        return self.threads_y * self.threads_x

    @property
    def tile_q(self) -> int:
        return self.threads_y * self.rows_per_thread

    @property
    def tile_kv(self) -> int:
        return self.threads_x * self.cols_per_thread

    def shared_bytes(self, config: AttentionConfig) -> int:
        """fp32 tiles of Q, K, V (rows padded by PREFILL_ROW_PAD) and P."""
        d_qk, d_v = config.head_dim, config.v_head_dim
        words = (self.tile_q + self.tile_kv) * (d_qk + PREFILL_ROW_PAD) + self.tile_kv * (d_v + PREFILL_ROW_PAD)
        words += self.tile_q * (self.tile_kv + PREFILL_P_ROW_PAD)
        return 4 * words

    def check(self, config: AttentionConfig) -> None:
        _require(
            config.v_head_dim % (4 * self.threads_x) == 0,
            f"threads_x={self.threads_x}: 4 * threads_x must divide v_head_dim={config.v_head_dim}",
        )
        if not config.is_gpu:
            _require(self.num_threads == 1, f"threads_y * threads_x = {self.num_threads} must be 1 on the CPU")
            if self.vector_lanes:
                _require(config.head_dim % self.vector_lanes == 0 and config.v_head_dim % self.vector_lanes == 0,
                         f"vector_lanes={self.vector_lanes} must divide head_dim={config.head_dim} and "
                         f"v_head_dim={config.v_head_dim}")
                _require(not config.kv_fp8, f"vector_lanes={self.vector_lanes} reads no FP8 pages "
                         f"(kv_dtype={config.kv_dtype!r}): expected vector_lanes=0")
            return
        _require(not self.vector_lanes, f"vector_lanes={self.vector_lanes} is for the CPU: expected 0 on CUDA")
        _require(self.num_threads % 32 == 0, f"threads_y * threads_x = {self.num_threads} must be a multiple of 32")
        limit = CUDA_MAX_SHARED_BYTES.get(config.cuda_arch, CUDA_DEFAULT_SHARED_BYTES)
        _require(
            self.shared_bytes(config) <= limit,
            f"tile_q={self.tile_q}, tile_kv={self.tile_kv} need {self.shared_bytes(config)} bytes of shared memory,"
            f" {config.cuda_arch} has {limit}",
        )


def choose_prefill_schedule(config: AttentionConfig) -> PrefillSchedule:
    """GPU: 128 threads, 64 (32 for head dims above 128) packed query rows x 32 keys per block
    (8 threads per row; fewer where v_head_dim is not a multiple of 32),
    so that two blocks share an SM (three at head_dim 128: 75 KiB of shared memory each);
    CPU: one thread a block; head dims of multiples of 16 (pages not FP8): the vectorized
    algorithm over CPU_PREFILL_ROWS packed rows (the GQA group's heads share each K/V read),
    16 keys a step, scores of row pairs from head dim 128; others a scalar 16 x 32 tile."""
    if not config.is_gpu:
        if config.head_dim % CPU_VECTOR_LANES == 0 and config.v_head_dim % CPU_VECTOR_LANES == 0 \
                and not config.kv_fp8:
            return PrefillSchedule(threads_y=1, threads_x=1, rows_per_thread=CPU_PREFILL_ROWS,
                                   cols_per_thread=CPU_VECTOR_LANES, vector_lanes=CPU_VECTOR_LANES,
                                   score_rows=2 if config.head_dim >= CPU_PAIRED_SCORES_MIN_DIM else 1)
        return PrefillSchedule(threads_y=1, threads_x=1, rows_per_thread=16, cols_per_thread=32)
    threads_x = 8
    while threads_x > 1 and config.v_head_dim % (4 * threads_x):  # each of a row's threads owns 4-column groups
        threads_x //= 2
    threads_y = 128 // threads_x
    tile_q = 64 if max(config.head_dim, config.v_head_dim) <= 128 else 32
    limit = CUDA_MAX_SHARED_BYTES.get(config.cuda_arch, CUDA_DEFAULT_SHARED_BYTES)
    while True:  # fewer rows per block where the arch has less shared memory (sm_86/sm_89: 99 KiB)
        sched = PrefillSchedule(threads_y=threads_y, threads_x=threads_x,
                                rows_per_thread=max(1, tile_q // threads_y), cols_per_thread=32 // threads_x)
        if sched.shared_bytes(config) <= limit or sched.rows_per_thread == 1:
            return sched
        tile_q //= 2


@dataclasses.dataclass(frozen=True)
class WgmmaPrefillSchedule:
    """Tiling of the Hopper tensor-core prefill (`prefill_sm90`).

    A CTA has three warpgroups: a producer that gathers K/V with cp.async and two wgmma
    consumers of 64 packed query rows each (tile_q = 128). tile_kv: keys per step (the N of
    S = Q K^T); stages: K/V buffers in the ring; producer_regs / consumer_regs: registers per
    thread after `setmaxnreg` (the three warpgroups share the SM's 64K registers);
    pingpong: the consumers take turns issuing S = Q K^T (named barriers), so that one's
    softmax overlaps the other's matrix multiply.
    """

    tile_kv: int
    stages: int
    producer_regs: int = 40
    consumer_regs: int = 232
    pingpong: bool = True

    tile_q = 128
    REGISTER_FILE = 65536

    def __post_init__(self):
        _require(self.tile_kv % 16 == 0 and 16 <= self.tile_kv <= 256,
                 f"tile_kv={self.tile_kv} must be a multiple of 16 in 16..256")
        _require(self.stages >= 2, f"stages={self.stages} must be >= 2")
        for name in ("producer_regs", "consumer_regs"):
            value = getattr(self, name)
            _require(value % 8 == 0 and 24 <= value <= 256, f"{name}={value} must be a multiple of 8 in 24..256")
        _require(128 * (self.producer_regs + 2 * self.consumer_regs) <= self.REGISTER_FILE,
                 f"producer_regs + 2 * consumer_regs = {self.producer_regs + 2 * self.consumer_regs} exceeds 512")

    def shared_bytes(self, config: AttentionConfig) -> int:
        """The Q tile and `stages` K and V tiles, two bytes an element."""
        return 2 * (self.tile_q * config.head_dim + self.stages * self.tile_kv * (config.head_dim + config.v_head_dim))

    def accumulator_registers(self, config: AttentionConfig) -> int:
        """fp32 S and O fragments and the packed P of one consumer thread."""
        return self.tile_kv // 2 + config.v_head_dim // 2 + self.tile_kv // 4

    def check(self, config: AttentionConfig) -> None:
        limit = CUDA_MAX_SHARED_BYTES["sm_90"]
        _require(self.shared_bytes(config) <= limit,
                 f"tile_kv={self.tile_kv}, stages={self.stages} need {self.shared_bytes(config)} bytes of shared"
                 f" memory, sm_90 has {limit}")
        # leave ~56 registers for addresses, softmax state and descriptors
        _require(self.accumulator_registers(config) + 56 <= self.consumer_regs,
                 f"tile_kv={self.tile_kv} with v_head_dim={config.v_head_dim} needs"
                 f" {self.accumulator_registers(config)} accumulator registers; consumer_regs={self.consumer_regs}")


def choose_wgmma_prefill_schedule(config: AttentionConfig) -> WgmmaPrefillSchedule:
    """128 keys a step (64 when the output fragment is 256 wide), as many stages (up to 3) as
    shared memory holds; where 128-key steps fit only twice (e.g. MLA's 192 / 128 head dims),
    64-key steps in 4 stages (the same bytes, and faster at MLA's 192 / 128 head dims:
    docs/performance.md)."""
    tile_kv = 128 if config.v_head_dim <= 128 else 64
    for stages in (3, 2):
        sched = WgmmaPrefillSchedule(tile_kv=tile_kv, stages=stages)
        if sched.shared_bytes(config) <= CUDA_MAX_SHARED_BYTES["sm_90"]:
            if tile_kv == 128 and stages == 2:
                return WgmmaPrefillSchedule(tile_kv=64, stages=4)
            return sched
    return WgmmaPrefillSchedule(tile_kv=64, stages=2)
