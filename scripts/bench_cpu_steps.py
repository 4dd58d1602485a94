"""Model step times of a compiled library at batch 1: decode, batch_verify of n tokens, prefill.

For each library given, one sequence is prefilled with --context tokens; then, each timed
--reps times (the median is printed, after one warm-up call):
- decode: one `decode` step (then popped, so the context stays the same);
- verify N: one `batch_verify` step of a chain of N draft tokens (parents -1, 0, 1, ...),
  popped afterwards (the tokens are never committed);
- prefill N: `prefill` of N tokens into a fresh sequence (removed afterwards).
Times include begin/end_forward and copying the logits to the host, as Generator does.

    python scripts/bench_cpu_steps.py LIB.so [LIB2.so ...] [--verify 4,8,9] [--prefill 64,512]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from tvmattn.generate import Generator  # noqa: E402


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def bench(lib: str, context: int, verify: list[int], prefill: list[int], reps: int) -> dict[str, float]:
    g = Generator(lib)
    rng = np.random.default_rng(0)
    vocab = g.metadata["model_config"]["vocab_size"]
    tokens = rng.integers(0, vocab, size=context + max(prefill + verify + [1])).tolist()
    g._ensure_cache(context + max(prefill + verify + [1]) + 64)
    host = g._host
    host["kv_state_add_sequence"](g.cache, 0)
    g._forward("prefill", [0], [context], g._embed(tokens[:context])[None])
    results = {}

    def decode():
        g._forward("decode", [0], [1], g._embed(tokens[context:context + 1])[None])
        host["kv_state_popn"](g.cache, 0, 1)

    results["decode"] = _median_ms(decode, reps)
    for n in verify:
        def step(n=n):
            g._forward("batch_verify", [0], [n], g._embed(tokens[context:context + n])[None],
                       parents=list(range(-1, n - 1)))
            host["kv_state_popn"](g.cache, 0, n)

        results[f"verify {n}"] = _median_ms(step, reps)
    for n in prefill:
        def fill(n=n):
            host["kv_state_add_sequence"](g.cache, 1)
            g._forward("prefill", [1], [n], g._embed(tokens[:n])[None])
            host["kv_state_remove_sequence"](g.cache, 1)

        results[f"prefill {n}"] = _median_ms(fill, max(1, reps // (1 + n // 64)))
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("libs", nargs="+")
    p.add_argument("--context", type=int, default=100, help="tokens in the sequence before decode / verify")
    p.add_argument("--verify", default="4,8,9")
    p.add_argument("--prefill", default="8,64,512")
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args(argv)
    for lib in args.libs:
        results = bench(lib, args.context, _ints(args.verify), _ints(args.prefill), args.reps)
        print(lib + ": " + ", ".join(f"{k} {v:.1f} ms" for k, v in results.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
