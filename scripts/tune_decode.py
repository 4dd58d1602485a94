"""Sweep DecodeSchedule variants on the GPU and print GB/s per shape (a tuning aid).

    python scripts/tune_decode.py [--shapes 1x32768 64x4096 256x2048]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_kernels as bk  # noqa: E402

from tir_kernels import AttentionConfig, DecodeSchedule, build, paged_decode  # noqa: E402


def variants():
    for lanes, rpt, target_blocks, max_splits in itertools.product((16, 8), (2, 4, 8), (264, 528), (32, 64)):
        heads = 4 if lanes == 16 else 2
        yield DecodeSchedule(lanes=lanes, rows=128 // lanes, rows_per_thread=rpt, heads_per_block=heads,
                             max_splits=max_splits, target_blocks=target_blocks)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="*", default=["1x32768", "8x32768", "64x4096", "256x2048"])
    args = parser.parse_args()
    config = AttentionConfig(bk.NUM_QO_HEADS, bk.NUM_KV_HEADS, bk.HEAD_DIM, dtype=bk.DTYPE, page_size=bk.PAGE_SIZE, target="cuda")
    kernels = {}
    for sched in variants():
        name = f"l{sched.lanes}r{sched.rows_per_thread}h{sched.heads_per_block}t{sched.target_blocks}s{sched.max_splits}"
        kernels[name] = build(paged_decode(config, sched), config)
    kernels["tvmattn"] = build(paged_decode(config), config)
    rows = bk.bench_decode(bk.parse_shapes(args.shapes), kernels, 20)
    for shape, times, rates, diffs in rows:
        best = sorted(rates.items(), key=lambda kv: -kv[1])
        print(shape, "default:", f"{rates['tvmattn']:.0f}", "best:", ", ".join(f"{n}={r:.0f}" for n, r in best[:6]),
              "max diff:", f"{max(v for k, v in diffs.items() if k != 'sdpa'):.1e}")


if __name__ == "__main__":
    main()
