"""CPU time of SmolLM2-135M's (or Gemma 3 270M's) decode projections over kept GGUF blocks, schedule against schedule.

For each projection of a decode step (one token; SmolLM2: Q4_1 matrices and the tied Q8_0 LM
head; --model gemma3: its Q5_0, Q8_0, Q4_K and Q6_K matrices and Q8_0 head), the
fused kernels of tvmattn/quant/ under each CPU schedule given (the host's
choice, `choose_schedule`, and the alternatives below), compiled for `host_target(avx512=True)`
(the lookup variants need AVX-512). Each runs over --layers copies of random blocks in turn
(together larger than the caches, as in a decode step), --calls passes per sample, --samples
samples, the variants interleaved; the best sample's time per call is printed (the machine is
shared: the best is the least disturbed), with the median beside it. Every kernel's output is
first checked against dequantize-then-matmul in float64 numpy (the int8 dot-product variants
quantize x to int8: checked within 1% of the largest output). TVM_NUM_THREADS sets the threads
(default here: 1).

    TVM_NUM_THREADS=1 python scripts/bench_cpu_gemv.py [--model gemma3] [--layers 30] [--samples 30] [--only gate_up,down]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TVM_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import tvm  # noqa: E402

from tvmattn.compiler.targets import host_target  # noqa: E402
from tvmattn.quant.config import QuantMatmulConfig  # noqa: E402
from tvmattn.quant.cpu import UNPACK_FORMATS, TABLE_GEMV_FORMATS, CPUSchedule, choose_schedule  # noqa: E402
from tvmattn.quant.matmul import kernel  # noqa: E402
from bench_quant_gemv import random_blocks  # noqa: E402 - the same random blocks as the CUDA GEMV bench

# (name, format, N, K): SmolLM2-135M's decode projections and its tied Q8_0 LM head
PROJECTIONS = [("qkv", "Q4_1", 960, 576), ("o", "Q4_1", 576, 576), ("gate_up", "Q4_1", 3072, 576),
               ("down", "Q4_1", 576, 1536), ("lm_head", "Q8_0", 49152, 576)]
# Gemma 3 270M's (its Q4_K_M GGUF): q, k, gate_up Q5_0; v Q8_0 or Q5_0; o Q4_K; down Q4_K or Q6_K
GEMMA3_PROJECTIONS = [("q", "Q5_0", 1024, 640), ("k", "Q5_0", 256, 640), ("v", "Q8_0", 256, 640),
                      ("o", "Q4_K", 640, 1024), ("gate_up", "Q5_0", 4096, 640), ("down", "Q4_K", 640, 2048),
                      ("down6", "Q6_K", 640, 2048), ("lm_head", "Q8_0", 262144, 640)]
# the alternatives timed beside the host's choice: (label, schedule or None for the choice)
VARIANTS = {
    "chosen": None,
    "convert-8": CPUSchedule(lanes=8, rows=4, chunk=32),  # gemv_algorithm, 8 lanes (AVX2)
    "convert-8-r1": CPUSchedule(lanes=8, rows=1, chunk=32),  # the Q8_0 head's tile before unpack_gemv
    "convert-16": CPUSchedule(lanes=16, rows=4, chunk=32),  # gemv_algorithm, 16 lanes
    "convert-16-r1": CPUSchedule(lanes=16, rows=1, chunk=32),  # the Q8_0 head's tile, 16 lanes
    "convert-16-r2": CPUSchedule(lanes=16, rows=2, chunk=32),
    "lookup-r1": CPUSchedule(lanes=16, rows=1, chunk=32, lookup=True),
    "lookup-r2": CPUSchedule(lanes=16, rows=2, chunk=32, lookup=True),
    "lookup-r4": CPUSchedule(lanes=16, rows=4, chunk=32, lookup=True),
    "lookup-r8": CPUSchedule(lanes=16, rows=8, chunk=32, lookup=True),
    "dot-r1": CPUSchedule(lanes=16, rows=1, chunk=32, dot=2),  # dot_gemv (AVX-512 VNNI), x in 2 int8 digits
    "dot-r2": CPUSchedule(lanes=16, rows=2, chunk=32, dot=2),
    "dot-r4": CPUSchedule(lanes=16, rows=4, chunk=32, dot=2),
    "dot-r8": CPUSchedule(lanes=16, rows=8, chunk=32, dot=2),
    "unpack-r1": CPUSchedule(lanes=16, rows=1, chunk=32, unpack=True),  # unpack_gemv (float32)
    "unpack-r2": CPUSchedule(lanes=16, rows=2, chunk=32, unpack=True),
    "unpack-r4": CPUSchedule(lanes=16, rows=4, chunk=32, unpack=True),
    "dot1-r1": CPUSchedule(lanes=16, rows=1, chunk=32, dot=1),  # x in one int8 digit (llama.cpp's rounding)
    "dot1-r4": CPUSchedule(lanes=16, rows=4, chunk=32, dot=1),
}


def choose_schedule_in(target, config: QuantMatmulConfig) -> CPUSchedule:
    with target:
        return choose_schedule(config)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=("smollm2", "gemma3"), default="smollm2", help="whose projections")
    p.add_argument("--layers", type=int, default=30, help="weight copies cycled through (the LM head: 1)")
    p.add_argument("--samples", type=int, default=30)
    p.add_argument("--calls", type=int, default=2, help="passes over the copies per sample")
    p.add_argument("--only", default=None, help="comma-separated projections (default: all)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {','.join(VARIANTS)}")
    args = p.parse_args(argv)
    only = set(args.only.split(",")) if args.only else None
    variants = args.variants.split(",")
    rng = np.random.default_rng(0)
    target = host_target(avx512=True)  # as compile_model builds a library whose matrices are all kept
    print(f"target {target}, TVM_NUM_THREADS={os.environ['TVM_NUM_THREADS']}, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    rows = []
    for name, fmt, n, k in GEMMA3_PROJECTIONS if args.model == "gemma3" else PROJECTIONS:
        if only and name not in only:
            continue
        config = QuantMatmulConfig(fmt, n, k, tokens=1)
        layers = 1 if name == "lm_head" else args.layers
        copies = [random_blocks(fmt, n, k, rng) for _ in range(layers)]
        weights = [[tvm.runtime.tensor(b.parts[part]) for part, _, _ in config.part_shapes()] for b in copies]
        x_np = rng.standard_normal((1, k)).astype(np.float32)
        want = x_np.astype(np.float64) @ copies[0].dequantize().astype(np.float64).T
        x, y = tvm.runtime.tensor(x_np), tvm.runtime.empty((1, n), "float32", tvm.cpu())
        fns = {}
        for label in variants:
            plan = VARIANTS[label]
            if plan is not None and (plan.lookup and fmt not in TABLE_GEMV_FORMATS
                                     or (plan.dot or plan.unpack) and fmt not in UNPACK_FORMATS):
                continue
            with target:  # the host's choice follows the target in scope
                fn = tvm.compile(kernel(config, plan), target=target)
            fn(x, *weights[0], y)
            err = np.abs(y.numpy() - want).max() / np.abs(want).max()
            int8 = plan.dot if plan is not None else choose_schedule_in(target, config).dot
            assert err < (1e-2 if int8 else 1e-5), f"{name} {label}: max relative error {err:.2e}"
            fns[label] = fn
        times = {label: [] for label in fns}
        for _ in range(args.samples):  # the variants interleaved, sample by sample
            for label, fn in fns.items():
                start = time.perf_counter()
                for _ in range(args.calls):
                    for parts in weights:
                        fn(x, *parts, y)
                times[label].append((time.perf_counter() - start) / (args.calls * layers) * 1e6)
        chosen = choose_schedule_in(target, config)
        for label, ts in times.items():
            rows.append((name, f"{n}x{k} {fmt}", label, min(ts), statistics.median(ts)))
        print(f"{name}: chosen {chosen}", flush=True)
    print(f"{'projection':>10} {'shape':>16} {'variant':>11} {'best us':>9} {'median us':>10}")
    for name, shape, label, best, median in rows:
        print(f"{name:>10} {shape:>16} {label:>11} {best:9.1f} {median:10.1f}")
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
