"""CPU attention kernels timed directly: causal prefill of one prompt, and the per-token windowed
decode that MHA_SLIDING layers run over the same keys, in GFLOP/s of the causal work.

Kernels (built for the host CPU as a model library builds them: `compiler.targets.host_target`,
AVX-512 where the CPU has it, unless --no-avx512), float32 (the CPU libraries' dtype), page
size 16, one request of --tokens new tokens and no history:
- ragged: `ragged_prefill` (what an MHA layer runs on a fresh prompt);
- paged: `paged_prefill` over the prompt's pages (what a window-prefill plan runs);
- window-decode: the sliding-window `paged_decode` with one request per token, token i seeing
  keys 0..i (`runtime.windows.window_plan` within the window).
FLOPs: 4 * Hq * D times the keys each query sees (QK^T and PV, 2 flops a multiply-add).
Each row: the median (and best) of --reps timed calls after one warm-up call.

    python scripts/bench_cpu_attention.py --head-dims 64,128,256 --heads 4/1 --tokens 512
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_cpu_steps  # noqa: E402
import numpy as np  # noqa: E402
import tvm  # noqa: E402

from tir_kernels import AttentionConfig, default_sm_scale, paged_decode, paged_prefill, ragged_prefill  # noqa: E402
from tir_kernels.schedules import choose_prefill_schedule  # noqa: E402
from tir_kernels.build import PIPELINE  # noqa: E402
from tvmattn.compiler.targets import host_target  # noqa: E402

KERNELS = ("ragged", "paged", "window-decode")


def build(func, target):
    name = str(func.attrs["global_symbol"])
    return tvm.compile(tvm.IRModule({name: func}), target=target, tir_pipeline=PIPELINE)[name]


def timed(fn, reps: int) -> tuple[float, float]:
    """(median, best) seconds of reps calls after a warm-up call."""
    median_ms, best_ms = bench_cpu_steps.median_ms(fn, reps)
    return median_ms / 1e3, best_ms / 1e3


def arrays(n: int, hq: int, hkv: int, d: int, ps: int, rng):
    q = rng.standard_normal((n, hq, d), dtype=np.float32)
    k = rng.standard_normal((n, hkv, d), dtype=np.float32)
    v = rng.standard_normal((n, hkv, d), dtype=np.float32)
    npages = -(-n // ps)
    pages = np.zeros((npages, 2, hkv, ps, d), np.float32)
    for j in range(n):
        pages[j // ps, 0, :, j % ps] = k[j]
        pages[j // ps, 1, :, j % ps] = v[j]
    return q, k, v, pages


def runner(kind: str, config: AttentionConfig, n: int, target, rng, rows: int = 0):
    """A no-argument callable that runs `kind` once on a prompt of n tokens (rows: the prefill
    schedule's rows_per_thread instead of the default's)."""
    sched = choose_prefill_schedule(config)
    if rows:
        sched = dataclasses.replace(sched, rows_per_thread=rows)
    hq, hkv, d, ps = config.num_qo_heads, config.num_kv_heads, config.head_dim, config.page_size
    q, k, v, pages = arrays(n, hq, hkv, d, ps, rng)
    t = tvm.runtime.tensor
    i32 = lambda a: t(np.asarray(a, np.int32))  # noqa: E731
    o = t(np.zeros((n, hq, d), np.float32))
    lse = t(np.zeros((n, hq), np.float32))
    sm = default_sm_scale(d)
    npages = pages.shape[0]
    if kind == "ragged":
        fn = build(ragged_prefill(config, sched), target)
        args = (t(q), i32([0, n]), t(k), t(v), i32([0, n]), i32(np.arange(n)), i32([0]), o, lse, 1, 0, 1.0, 1e4, sm)
    elif kind == "paged":
        fn = build(paged_prefill(config, sched), target)
        args = (t(q), i32([0, n]), t(pages), i32([0, npages]), i32(np.arange(npages)), i32([(n - 1) % ps + 1]),
                i32([0]), i32(np.arange(n)), o, lse, 1, 0, 1.0, 1e4, sm)
    else:
        fn = build(paged_decode(config.replace(sliding_window=True)), target)
        p = np.arange(n)
        counts = p // ps + 1
        indptr = np.concatenate([[0], np.cumsum(counts)])
        indices = np.concatenate([np.arange(c) for c in counts])
        info = np.stack([p % ps + 1, np.zeros(n), np.zeros(n)])
        args = (t(q), t(pages), i32(indptr), i32(indices), i32(info), i32(np.zeros(n)), i32(p), o, lse, 0, 1.0, 1e4,
                sm)
    return lambda: fn(*args)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head-dims", default="64,128,256")
    ap.add_argument("--heads", default="4/1", help="query heads / KV heads")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--kernels", default=",".join(KERNELS))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--no-avx512", action="store_true")
    ap.add_argument("--rows", type=int, default=0, help="the prefill schedule's rows_per_thread (default: its own)")
    args = ap.parse_args(argv)
    hq, hkv = map(int, args.heads.split("/"))
    target = host_target(avx512=not args.no_avx512)
    n = args.tokens
    rng = np.random.default_rng(0)
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; TVM_NUM_THREADS="
          f"{os.environ.get('TVM_NUM_THREADS', '(all)')}; {n} tokens, {hq}/{hkv} heads, float32, page 16")
    print(f"{'kernel':>14} {'D':>4} {'median ms':>10} {'best ms':>8} {'GFLOP/s':>8} {'(best)':>8}")
    for d in map(int, args.head_dims.split(",")):
        config = AttentionConfig(hq, hkv, d, dtype="float32", page_size=16, target="llvm")
        flops = 4 * hq * d * n * (n + 1) / 2
        for kind in args.kernels.split(","):
            med, best = timed(runner(kind, config, n, target, rng, args.rows), args.reps)
            print(f"{kind:>14} {d:>4} {med * 1e3:>10.3f} {best * 1e3:>8.3f} {flops / med / 1e9:>8.2f} "
                  f"{flops / best / 1e9:>8.2f}", flush=True)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
