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
    lanes = min(32, config.head_dim // vec)
    per_lane = config.head_dim // lanes
    # q and o of the served heads live in registers: keep them under ~128 fp32 values.
    heads = max(h for h in range(1, config.group_size + 1) if config.group_size % h == 0 and h * per_lane <= 64)
    return DecodeSchedule(
        lanes=lanes,
        rows=max(1, 128 // lanes),
        rows_per_thread=4 if per_lane <= 8 else 2,
        heads_per_block=heads,
        max_splits=32,
    )
