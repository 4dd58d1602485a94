"""Model step times of a compiled library at batch 1: decode, batch_verify of n tokens, prefill.

For each library given, one sequence is prefilled with --context tokens; then, each timed
--reps times (the median is printed, and the best, after one warm-up call; --rounds R: the
libraries in turn, R times, for A/B comparisons on a shared machine):
- decode: one `decode` step (then popped, so the context stays the same);
- verify N: one `batch_verify` step of a chain of N draft tokens (parents -1, 0, 1, ...),
  popped afterwards (the tokens are never committed);
- prefill N: `prefill` of N tokens into a fresh sequence (removed afterwards).
Times include begin/end_forward and copying the logits to the host, as the engine's steps do
(tvmattn.session.ModelSession).

--profile N: instead, one decode step at --context (after warm-up; --profile-prefill T: a prefill
of T tokens) with every call of the VM timed (its instrument hook; N: rows of the table, the
functions by total time), and the step's time outside them (embedding, begin/end_forward,
logits to the host).

    python scripts/bench_cpu_steps.py LIB.so [LIB2.so ...] [--verify 4,8,9] [--prefill 64,512]
                                      [--profile 25 [--profile-prefill 512]]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from tvmattn.session import ModelSession, no_cyclic_gc  # noqa: E402


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def median_ms(fn, reps: int) -> tuple[float, float]:
    """(median, best) of reps timed calls after a warm-up call, ms."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, min(times) * 1e3


def bench(lib: str, context: int, verify: list[int], prefill: list[int], reps: int) -> dict[str, tuple[float, float]]:
    g = ModelSession(lib)
    rng = np.random.default_rng(0)
    vocab = g.metadata["model_config"]["vocab_size"]
    tokens = rng.integers(0, vocab, size=context + max(prefill + verify + [1])).tolist()
    g.create_cache(2, context + max(prefill + verify + [1]) + 64)
    g.add_sequence(0)
    g.forward("prefill", [0], [context], g.embed(tokens[:context])[None])
    results = {}

    def decode():  # the engine's decode step
        g.decode_step([0], tokens[context:context + 1])
        g.popn(0, 1)

    with no_cyclic_gc():  # as in Generator's engine loop
        results["decode"] = median_ms(decode, reps)
    for n in verify:
        def step(n=n):
            g.forward("batch_verify", [0], [n], g.embed(tokens[context:context + n])[None],
                       parents=list(range(-1, n - 1)))
            g.popn(0, n)

        results[f"verify {n}"] = median_ms(step, reps)
    for n in prefill:
        def fill(n=n):
            g.add_sequence(1)
            g.forward("prefill", [1], [n], g.embed(tokens[:n])[None])
            g.remove_sequence(1)

        results[f"prefill {n}"] = median_ms(fill, max(1, reps // (1 + n // 64)))
    return results


def profile(lib: str, context: int, rows: int, prefill: int = 0) -> str:
    """The calls of one decode step (or, with prefill, of a prefill of that many tokens into a
    fresh sequence) timed one by one (the VM's instrument hook: perf_counter before and after
    each call), summed per function, the `rows` largest; and the step's time outside the VM's
    calls."""
    import collections

    g = ModelSession(lib)
    vocab = g.metadata["model_config"]["vocab_size"]
    tokens = np.random.default_rng(0).integers(0, vocab, size=max(context + 1, prefill)).tolist()
    g.create_cache(2, context + prefill + 64)
    g.add_sequence(0)
    g.forward("prefill", [0], [context], g.embed(tokens[:context])[None])

    def step():
        if prefill:
            g.add_sequence(1)
            g.forward("prefill", [1], [prefill], g.embed(tokens[:prefill])[None])
            g.remove_sequence(1)
            return
        g.decode_step([0], tokens[context:context + 1])
        g.popn(0, 1)

    plain = median_ms(step, 3 if prefill else 20)[0]
    totals: dict = collections.defaultdict(float)
    counts: dict = collections.defaultdict(int)
    started: list = []

    def instrument(func, symbol, before, ret, *args):
        if before:
            started.append(time.perf_counter())
        else:
            totals[str(symbol)] += time.perf_counter() - started.pop()
            counts[str(symbol)] += 1
        return 0

    g.vm.set_instrument(instrument)
    reps = 1 if prefill else 5
    start = time.perf_counter()
    for _ in range(reps):
        step()
    instrumented = (time.perf_counter() - start) / reps * 1e3
    g.vm.set_instrument(None)
    calls = sum(totals.values()) / reps * 1e3
    lines = [f"{'function':<60} {'calls':>6} {'ms/step':>8} {'share':>6}"]
    for name, total in sorted(totals.items(), key=lambda kv: -kv[1])[:rows]:
        ms = total / reps * 1e3
        lines.append(f"{name[:60]:<60} {counts[name] // reps:6d} {ms:8.3f} {ms / calls:6.1%}")
    lines.append(f"{'prefill ' + str(prefill) if prefill else 'decode'} step {plain:.2f} ms (median, not "
                 f"instrumented); instrumented {instrumented:.2f} ms, "
                 f"of which {calls:.2f} ms inside the {sum(counts.values()) // reps} calls")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("libs", nargs="+")
    p.add_argument("--context", type=int, default=100, help="tokens in the sequence before decode / verify")
    p.add_argument("--verify", default="4,8,9")
    p.add_argument("--prefill", default="8,64,512")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--rounds", type=int, default=1, help="time the libraries in turn this many times (A/B)")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="profile a decode step, N table rows")
    p.add_argument("--profile-prefill", type=int, default=0, metavar="T",
                   help="with --profile: a prefill of T tokens instead of a decode step")
    args = p.parse_args(argv)
    for lib in [lib for _ in range(args.rounds) for lib in args.libs]:
        if args.profile:
            print(lib + ":\n" + profile(lib, args.context, args.profile, args.profile_prefill), flush=True)
            continue
        results = bench(lib, args.context, _ints(args.verify), _ints(args.prefill), args.reps)
        print(lib + ": " + ", ".join(f"{k} {v[0]:.2f} ms (best {v[1]:.2f})" for k, v in results.items())
              + f"; load average {os.getloadavg()[0]:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
