"""Schedules: how a kernel's work is tiled and mapped to threads, and their choice per config.

A schedule never changes what a kernel computes, only how fast. `choose_*` functions pick
one for a config; tests and benchmarks may pass their own.
"""

from __future__ import annotations

import dataclasses

from .common import is_power_of_two
from .config import AttentionConfig

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
    target_blocks: the split count is chosen at run time as target_blocks / (batch * heads).
    """

    lanes: int
    rows: int
    rows_per_thread: int
    heads_per_block: int
    max_splits: int = 1
    target_blocks: int = 2 * CUDA_NUM_SMS

    def __post_init__(self):
        _require(is_power_of_two(self.lanes) and self.lanes <= 32, "lanes must be a power of two <= 32")
        _require(self.rows >= 1 and self.lanes * self.rows <= 1024, "lanes * rows must be <= 1024")
        _require(self.rows_per_thread >= 1, "rows_per_thread must be >= 1")
        _require(self.heads_per_block >= 1, "heads_per_block must be >= 1")
        _require(self.max_splits >= 1, "max_splits must be >= 1")

    def check(self, config: AttentionConfig) -> None:
        _require(config.head_dim % self.lanes == 0, f"lanes={self.lanes} must divide head_dim={config.head_dim}")
        _require(
            config.group_size % self.heads_per_block == 0,
            f"heads_per_block={self.heads_per_block} must divide the GQA group {config.group_size}",
        )


def choose_decode_schedule(config: AttentionConfig) -> DecodeSchedule:
    if not config.is_gpu:
        return DecodeSchedule(lanes=1, rows=1, rows_per_thread=1, heads_per_block=config.group_size)
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
    # Measured on the H200 (docs/perf-notes.md): 2 rows per thread beat 4 and 8 (fewer
    # registers, more resident warps); aiming at 4 blocks per SM helps long single requests.
    return DecodeSchedule(
        lanes=lanes,
        rows=max(1, 128 // lanes),
        rows_per_thread=2,
        heads_per_block=heads,
        max_splits=64,
        target_blocks=4 * CUDA_NUM_SMS,
    )


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
    """

    threads_y: int
    threads_x: int
    rows_per_thread: int
    cols_per_thread: int

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
            return
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
    CPU: one thread computing a 16 x 32 tile."""
    if not config.is_gpu:
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
    shared memory holds."""
    tile_kv = 128 if config.v_head_dim <= 128 else 64
    for stages in (3, 2):
        sched = WgmmaPrefillSchedule(tile_kv=tile_kv, stages=stages)
        if sched.shared_bytes(config) <= CUDA_MAX_SHARED_BYTES["sm_90"]:
            return sched
    return WgmmaPrefillSchedule(tile_kv=64, stages=2)
