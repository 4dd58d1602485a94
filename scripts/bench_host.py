"""Host time of PagedKVCache.begin_forward + end_forward per step (no kernels run).

Each batch's sequences are filled to the context by prefill steps whose attention is never
called (only the page tables matter here), then steps in which every sequence appends one
token (decode; `--append N`: N tokens, prefill) are timed with time.perf_counter around
begin_forward and end_forward. Reported: the median and the 10th percentile in microseconds
per step. The cache is on the CPU (`--device cuda`: on the GPU, with its non-blocking plan
upload); its model shape (heads, head dim) does not change the host path, so a small one keeps
the page pools small.

    python scripts/bench_host.py                          # batch 1, 16, 64, 256; context 512
    python scripts/bench_host.py --device cuda            # the cache on the GPU
    python scripts/bench_host.py --batches 1,256 --steps 500 --profile 256
    python scripts/bench_host.py --batches 16,64 --append 16 --steps 50   # prefill chunks
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tvm  # noqa: E402

from tvmattn import PagedKVCache  # noqa: E402

PAGE_SIZE = 16
DEVICES = {"cpu": tvm.cpu, "cuda": tvm.cuda}
# No kernel runs, so the step's one layer is counted as written, as for a replayed CUDA graph
# (end_forward keeps only steps whose every layer wrote its K/V).
WRITTEN = (frozenset({0}), 0)


def make_cache(batch: int, context: int, steps: int, append: int = 1, device: str = "cpu") -> PagedKVCache:
    """A cache on `device` holding `batch` sequences of `context` tokens, with room for `steps`
    steps of `append` more tokens each."""
    tokens = batch * (context + steps * append + 2 * PAGE_SIZE)
    chunk = max(context, 2048, batch * append)
    cache = PagedKVCache(num_layers=1, num_qo_heads=1, num_kv_heads=1, qk_head_dim=64, dtype="float16",
                         page_size=PAGE_SIZE, max_num_sequences=batch, max_total_seq_len=tokens,
                         prefill_chunk_size=chunk, rope_mode="normal", device=DEVICES[device](0))
    per_step = max(1, chunk // context)
    for seq_id in range(batch):
        cache.add_sequence(seq_id)
    for first in range(0, batch, per_step):
        seq_ids = list(range(first, min(batch, first + per_step)))
        cache.begin_forward(seq_ids, [context] * len(seq_ids))
        cache._replay_progress(WRITTEN)
        cache.end_forward()
    return cache


def decode_times(cache: PagedKVCache, batch: int, steps: int, warmup: int = 20, append: int = 1) -> list[float]:
    """Seconds of begin_forward + end_forward per timed step (`append` tokens per sequence)."""
    seq_ids, ones = list(range(batch)), [append] * batch
    times = []
    for step in range(warmup + steps):
        start = time.perf_counter()
        cache.begin_forward(seq_ids, ones)
        cache._replay_progress(WRITTEN)
        cache.end_forward()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,16,64,256", help="comma-separated batch sizes")
    parser.add_argument("--context", type=int, default=512, help="tokens per sequence before the timed steps")
    parser.add_argument("--steps", type=int, default=300, help="timed decode steps per batch")
    parser.add_argument("--append", type=int, default=1, help="tokens per sequence per timed step (1: decode)")
    parser.add_argument("--profile", type=int, default=0, help="also profile the steps of this batch (cProfile)")
    parser.add_argument("--device", choices=sorted(DEVICES), default="cpu", help="where the cache lives")
    args = parser.parse_args()
    print(f"{'batch':>6} {'median us':>10} {'p10 us':>8}")
    for batch in (int(b) for b in args.batches.split(",")):
        cache = make_cache(batch, args.context, args.steps * 2 + 40, args.append, args.device)
        times = sorted(decode_times(cache, batch, args.steps, append=args.append))
        print(f"{batch:>6} {statistics.median(times) * 1e6:10.1f} {times[len(times) // 10] * 1e6:8.1f}", flush=True)
        if batch == args.profile:
            profiler = cProfile.Profile()
            profiler.enable()
            decode_times(cache, batch, args.steps, warmup=0, append=args.append)
            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
