"""Decode speed of the serving engine with and without lookahead steps, on one library bundle.

The engine (tvmattn.serve.engine) is what `serve`, `chat` and `generate` run. Here --batch
greedy requests of --prompt-len prompt tokens and --new-tokens answer tokens are submitted at
once to a fresh engine on one loaded library (`--sampling device`); the engine is stepped until
every request has its first token (the prefill), then timed until all are done:
decode tokens/s = tokens generated after each request's first / seconds. Lookahead off and on
alternate for --rounds rounds (the median is reported, the best beside it), and the two runs
must give the same tokens. Steps are replayed as CUDA graphs where the session uses them
(`--no-cuda-graph`: eager steps).

    python scripts/bench_engine.py --lib build/eng/smollm2.so --batches 1,16,64 --json engine.json

The library: a bundle made by `compile` (a config with `--random-weights` serves: the engine
never detokenizes here). --json PATH writes rows of docs/bench-format.md: bench "engine", kernel
"decode", impl "tvmattn", variant "lookahead" or "wait", tokens_per_s, ms per decode step,
lookahead_steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import bench_rows  # noqa: E402
from tvmattn.sampling import SamplingOptions  # noqa: E402
from tvmattn.serve.engine import Engine  # noqa: E402
from tvmattn.serve.runner import ModelRunner  # noqa: E402
from tvmattn.session import no_cyclic_gc  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lib", required=True, help="a library bundle (OUT.so beside OUT.params.npz, OUT.runtime.json)")
    p.add_argument("--batches", default="1,16", help="requests decoding at once, comma-separated")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64, help="answer tokens per request")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-cuda-graph", action="store_true", help="eager decode steps")
    p.add_argument("--json", default=None, help="write the rows here (docs/bench-format.md)")
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    if min(args.batches) < 1 or args.prompt_len < 1 or args.new_tokens < 2 or args.rounds < 1:
        p.error("--batches, --prompt-len, --rounds must be >= 1 and --new-tokens >= 2")
    problem = bench_rows.output_path_problem(args.json)
    if problem:
        p.error(problem)
    return args


@no_cyclic_gc()
def decode_run(runner: ModelRunner, batch: int, args, lookahead: bool) -> tuple[float, int, int, int, list]:
    """(decode seconds, tokens decoded, decode steps, lookahead steps, every request's tokens) of
    one engine run."""
    engine = Engine(runner, sampling="device", lookahead=lookahead, prefix_cache="off", max_running=batch,
                    max_batched_tokens=min(runner.prefill_chunk, max(batch, 64)))
    rng = np.random.default_rng(batch)
    vocab = runner.vocab_size
    options = SamplingOptions(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    requests = [engine.submit([int(t) for t in rng.integers(0, vocab, args.prompt_len)], options, text=False)
                for _ in range(batch)]
    while any(r.first_token is None for r in requests):
        engine.step()
    runner.session.device.sync()
    steps = engine.decode_steps
    first = sum(len(r.output) for r in requests)
    start = time.perf_counter()
    while engine.step():
        pass
    runner.session.device.sync()
    seconds = time.perf_counter() - start
    tokens = [r.stream.result().tokens for r in requests]
    return seconds, sum(map(len, tokens)) - first, engine.decode_steps - steps, engine.lookahead_steps, tokens


def main(argv=None) -> int:
    args = parse_args(argv)
    runner = ModelRunner(args.lib, max_total_tokens=max(args.batches) * (args.prompt_len + args.new_tokens + 32),
                         max_sequences=max(args.batches), cuda_graph=not args.no_cuda_graph)
    session = runner.session
    on_gpu = not session.on_cpu
    print(f"library {args.lib}: {session.metadata['model_config'].get('num_hidden_layers')} layers, "
          f"CUDA graphs {'on' if session.uses_cuda_graph else 'off'}; prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens a request")
    rows = []
    print(f"{'batch':>6} {'wait tok/s':>12} {'lookahead tok/s':>16} {'wait ms/step':>13} {'ahead ms/step':>14} "
          f"{'ratio':>6}")
    for batch in args.batches:
        decode_run(runner, batch, args, False)  # warm-up: graphs captured, modules loaded
        results = {False: [], True: []}
        answers = {}
        for _ in range(args.rounds):
            for lookahead in (False, True):
                seconds, tokens, steps, ahead, answer = decode_run(runner, batch, args, lookahead)
                results[lookahead].append((tokens / seconds, 1e3 * seconds / max(steps, 1), ahead))
                answers.setdefault(lookahead, answer)
        if answers[True] != answers[False]:
            print(f"batch {batch}: lookahead changed the tokens", file=sys.stderr)
            return 1
        median = {k: statistics.median(r[0] for r in v) for k, v in results.items()}
        ms = {k: statistics.median(r[1] for r in v) for k, v in results.items()}
        print(f"{batch:>6} {median[False]:>12.1f} {median[True]:>16.1f} {ms[False]:>13.3f} {ms[True]:>14.3f} "
              f"{median[True] / median[False]:>6.2f}  (best {max(r[0] for r in results[False]):.1f} / "
              f"{max(r[0] for r in results[True]):.1f})")
        for lookahead, values in results.items():
            rows.append({"bench": "engine", "kernel": "decode", "impl": "tvmattn",
                         "variant": "lookahead" if lookahead else "wait", "batch": batch, "seq_len": args.prompt_len,
                         "qo_len": 1, "new_tokens": args.new_tokens, "cuda_graph": session.uses_cuda_graph,
                         "tokens_per_s": median[lookahead], "best_tokens_per_s": max(r[0] for r in values),
                         "ms": ms[lookahead], "rounds": args.rounds,
                         "lookahead_steps": values[0][2]})
    if args.json:
        meta = bench_rows.run_meta(gpu=on_gpu)
        bench_rows.write_rows([{**row, **meta} for row in rows], args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
