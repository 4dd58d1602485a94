"""Prompt and decode tokens/s of SmolLM2-135M-Instruct on the CPU: our libraries and llama.cpp.

For each --quantization (default `f32,keep`; `default`: compile's default) the library is compiled
into --libs (default build/bench_cpu/<quantization>/smollm2.so) with the main job's settings, or
reused from there with --reuse (the folder is not keyed by the sources: delete it or leave out
--reuse after a code change). When llama-cpp-python is importable (and unless --no-llama-cpp), the
same GGUF runs on llama.cpp too (n_threads and n_threads_batch: --threads, default the CPU count;
our children get TVM_NUM_THREADS=--threads, since TVM's own default is half the CPUs, one thread
on this 2-CPU machine; n_ctx the prompt plus the decoded tokens; n_batch and n_ubatch the prompt,
one batch; greedy: the argmax of its logits).

Every engine runs in a child process of its own, so that its memory is its own; the children run
one after the other, --rounds times in turn (ours, llama.cpp, ours, ...), so that a load spike of
the shared machine hits both. In each child one sequence is prefilled with a --prompt-tokens prompt
(random token ids, seed 0, the same for every engine; ours in the session's prefill calls, of
tvmattn.session.CPU_PREFILL_CHUNK tokens) and then decodes --decode-tokens tokens greedily (stop
tokens ignored, so every run decodes the same count), --reps times after one warm-up; each of our
steps includes the embedding, the cache's begin/end_forward and the logits' copy to the host, as
the engine's (its KV cache sized as the Generator sizes it for one prompt, Python's cyclic GC off
as in its loop); llama.cpp's includes its copy of the logits.
Reported: the median over all rounds and reps, and the best.

Memory, measured the same way for each engine: `peak_rss_bytes` is the child's VmHWM (peak
resident set: Python, numpy, TVM or llama.cpp's library, weights, caches; llama.cpp maps the GGUF,
and the pages it touched count as resident); `runtime_rss_bytes` its VmRSS after the engine's
imports and before loading the model; `model_peak_bytes` their difference, what the model adds at
its peak (the project's target: at most 2x the GGUF's size).

--check also generates greedily (--check-tokens tokens) from the test prompts (the main job's prompt
and tvmattn.speculative.EXAMPLE_PROMPTS) with every library and says whether the tokens are
identical to the first library's.

--json OUT writes bench-format rows (docs/bench-format.md): per engine, a `prefill` and a
`decode` row (`ms` and `tokens_per_s` the medians), with the load average seen before and after.

    python scripts/bench_cpu.py [--quantization f32,keep] [--prompt-tokens 512] [--decode-tokens 128]
                                [--reps 3] [--rounds 1] [--check] [--no-llama-cpp] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

QUANTIZATIONS = ("default", "f32", "f16", "keep")
LLAMA_CPP = "llama.cpp"


def _quantizations(text: str) -> list[str]:
    names = [x for x in text.split(",") if x]
    bad = [x for x in names if x not in QUANTIZATIONS]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {QUANTIZATIONS}, got {text!r}")
    return names


def proc_status(field: str) -> int:
    """A byte count of this process's /proc/self/status: VmHWM (peak resident set, which starts
    afresh at exec; ru_maxrss keeps the high-water mark of the process before exec) or VmRSS."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def random_prompt(vocab: int, n: int) -> list[int]:
    return np.random.default_rng(0).integers(0, vocab, size=n).tolist()


def _timed_runs(prefill, decode_step, prompt: list[int], decode_tokens: int, reps: int, reset) -> dict:
    """Per rep (after one warm-up): prefill(prompt) -> first token, then decode_tokens steps of
    decode_step(token) -> next token; reset() between runs. Times in seconds, tokens of the last run."""
    prefill_s, decode_s, tokens = [], [], []
    for rep in range(reps + 1):
        start = time.perf_counter()
        token = prefill(prompt)
        mid = time.perf_counter()
        tokens = [token]
        for _ in range(decode_tokens):
            token = decode_step(token)
            tokens.append(token)
        end = time.perf_counter()
        reset()
        if rep:
            prefill_s.append(mid - start)
            decode_s.append(end - mid)
    return {"prefill_s": prefill_s, "decode_s": decode_s, "tokens": tokens}


def measure(lib: str, prompt_tokens: int, decode_tokens: int, reps: int) -> dict:
    """Our library, in this process."""
    from tvmattn.session import ModelSession, no_cyclic_gc

    runtime = proc_status("VmRSS")
    g = ModelSession(lib)
    prompt = random_prompt(g.metadata["model_config"]["vocab_size"], prompt_tokens)
    page = g.settings["page_size"]  # the cache sized as Generator sizes it for one prompt
    g.create_cache(1, max(-(-(prompt_tokens + decode_tokens + 1) // page) * page + page, 256))
    g.add_sequence(0)

    def prefill(ids):  # in the session's prefill calls (on the CPU, of CPU_PREFILL_CHUNK tokens)
        return int(np.argmax(g.prefill([0], [ids])[0]))

    def decode_step(token):  # the session's decode step
        return int(np.argmax(g.decode_step([0], [token])[0]))

    def reset():
        g.remove_sequence(0)
        g.add_sequence(0)

    with no_cyclic_gc():  # as in Generator's engine loop
        result = _timed_runs(prefill, decode_step, prompt, decode_tokens, reps, reset)
    params = os.path.getsize(lib.replace(".so", ".params.npz"))
    return {**result, "params_bytes": params, "runtime_rss_bytes": runtime, "peak_rss_bytes": proc_status("VmHWM")}


def measure_llama_cpp(gguf: str, prompt_tokens: int, decode_tokens: int, reps: int, threads: int) -> dict:
    """llama.cpp (llama-cpp-python) on the GGUF, in this process."""
    import llama_cpp

    runtime = proc_status("VmRSS")
    llm = llama_cpp.Llama(model_path=gguf, n_ctx=prompt_tokens + decode_tokens + 16, n_batch=prompt_tokens,
                          n_ubatch=prompt_tokens, n_threads=threads, n_threads_batch=threads, verbose=False)
    vocab = llm.n_vocab()
    prompt = random_prompt(vocab, prompt_tokens)

    def last_argmax() -> int:  # the last token's logits (llm.scores holds none without logits_all)
        return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))))

    def prefill(ids):
        llm.eval(ids)
        return last_argmax()

    def decode_step(token):
        llm.eval([token])
        return last_argmax()

    result = _timed_runs(prefill, decode_step, prompt, decode_tokens, reps, llm.reset)
    return {**result, "params_bytes": os.path.getsize(gguf), "runtime_rss_bytes": runtime,
            "peak_rss_bytes": proc_status("VmHWM"), "llama_cpp_version": llama_cpp.__version__}


def check_tokens(lib: str, max_new_tokens: int) -> list[list[int]]:
    """Greedy tokens of the test prompts, one list per prompt."""
    from tvmattn.generate import Generator
    from tvmattn.quickstart import DEFAULT_PROMPT
    from tvmattn.speculative import EXAMPLE_PROMPTS

    g = Generator(lib)
    return [g.generate([p], max_new_tokens=max_new_tokens).tokens[0]
            for p in [DEFAULT_PROMPT, *EXAMPLE_PROMPTS.values()]]


def child(args) -> int:
    if args.llama_cpp_child:
        result = measure_llama_cpp(args.llama_cpp_child, args.prompt_tokens, args.decode_tokens, args.reps,
                                   args.threads)
    else:
        result = measure(args.lib, args.prompt_tokens, args.decode_tokens, args.reps)
        if args.check_tokens:
            result["check"] = check_tokens(args.lib, args.check_tokens)
    print("RESULT " + json.dumps(result))
    return 0


def _run_child(args, extra: list[str]) -> dict:
    command = [sys.executable, os.path.abspath(__file__), *extra, "--prompt-tokens", str(args.prompt_tokens),
               "--decode-tokens", str(args.decode_tokens), "--reps", str(args.reps), "--threads", str(args.threads),
               "--check-tokens", str(args.check_tokens)] + (["--check"] if args.check else [])
    env = {**os.environ, "TVM_NUM_THREADS": str(args.threads)}  # TVM's default here is half the CPUs
    out = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True, env=env).stdout
    return json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])


def _merge(results: list[dict]) -> dict:
    """One engine's rounds: times pooled, memory the largest, tokens and the rest of the first."""
    merged = dict(results[0])
    for key in ("prefill_s", "decode_s"):
        merged[key] = [t for r in results for t in r[key]]
    for key in ("peak_rss_bytes", "runtime_rss_bytes"):
        merged[key] = max(r[key] for r in results)
    return merged


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _commit() -> str:
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], stdout=subprocess.PIPE,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def bench_rows(engine: dict, args, common: dict) -> list[dict]:
    """The prefill and decode rows (bench-format) of one engine's merged result."""
    rows = []
    for kernel, tokens, qo_len in (("prefill", args.prompt_tokens, args.prompt_tokens),
                                   ("decode", args.decode_tokens, 1)):
        times = engine[f"{kernel}_s"]
        median, best = statistics.median(times), min(times)
        rows.append({**common, "impl": engine["impl"], "variant": engine["variant"], "kernel": kernel,
                     "seq_len": args.prompt_tokens, "qo_len": qo_len, "tokens": tokens,
                     "ms": median / tokens * 1e3 if kernel == "decode" else median * 1e3,
                     "tokens_per_s": tokens / median, "best_tokens_per_s": tokens / best, "runs": len(times),
                     "params_bytes": engine["params_bytes"], "peak_rss_bytes": engine["peak_rss_bytes"],
                     "runtime_rss_bytes": engine["runtime_rss_bytes"],
                     "model_peak_bytes": engine["peak_rss_bytes"] - engine["runtime_rss_bytes"],
                     **({"greedy_tokens_equal_first": engine["same_tokens"]} if "same_tokens" in engine else {})})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quantization", type=_quantizations, default=["f32", "keep"],
                        help=f"comma-separated, of {QUANTIZATIONS}")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3, help="timed runs per child (after one warm-up)")
    parser.add_argument("--rounds", type=int, default=1, help="children per engine, run in turn")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("TVM_NUM_THREADS", os.cpu_count())),
                        help="threads of both engines: llama.cpp's n_threads, TVM_NUM_THREADS of our children "
                             "(default: TVM_NUM_THREADS, else the CPU count)")
    parser.add_argument("--no-llama-cpp", action="store_true", help="leave llama.cpp out even when installed")
    parser.add_argument("--check", action="store_true", help="compare greedy tokens on the test prompts")
    parser.add_argument("--check-tokens", type=int, default=64, help="tokens per test prompt for --check")
    parser.add_argument("--json", default=None, help="also write the bench-format rows to this file")
    parser.add_argument("--libs", default=os.path.join(ROOT, "build", "bench_cpu"),
                        help="folder of the compiled libraries")
    parser.add_argument("--reuse", action="store_true", help="reuse libraries already in --libs")
    parser.add_argument("--lib", default=None, help=argparse.SUPPRESS)  # a child's library
    parser.add_argument("--llama-cpp-child", default=None, help=argparse.SUPPRESS)  # a child's GGUF
    args = parser.parse_args(argv)
    if args.lib or args.llama_cpp_child:
        if not args.check:
            args.check_tokens = 0
        return child(args)

    from tvmattn.build import compile_model
    from tvmattn.quickstart import CONTEXT_WINDOW, MAX_BATCH_SIZE, MODEL
    from tvmattn.weights.locate import smollm2_path

    gguf = str(smollm2_path())
    engines = []  # (impl, variant, child arguments)
    for quant in args.quantization:
        lib = os.path.join(args.libs, quant, "smollm2.so")
        if not (args.reuse and os.path.isfile(lib)):
            os.makedirs(os.path.dirname(lib), exist_ok=True)
            start = time.perf_counter()
            compile_model(MODEL, lib, target="llvm", max_batch_size=MAX_BATCH_SIZE, context_window=CONTEXT_WINDOW,
                          quantization=None if quant == "default" else quant,
                          log=lambda m: print(m, file=sys.stderr))
            print(f"{quant:>9}: compiled in {time.perf_counter() - start:.1f} s", flush=True)
        engines.append(("tvmattn", quant, ["--lib", lib]))
    have_llama = importlib.util.find_spec("llama_cpp") is not None
    if have_llama and not args.no_llama_cpp:
        engines.append((LLAMA_CPP, os.path.basename(gguf).split(".")[-2].lower(), ["--llama-cpp-child", gguf]))
    load_before = _load()
    results: dict[int, list[dict]] = {i: [] for i in range(len(engines))}
    for _ in range(args.rounds):
        for i, (_, _, extra) in enumerate(engines):
            results[i].append(_run_child(args, extra))
    load_after = _load()
    merged = []
    for i, (impl, variant, _) in enumerate(engines):
        engine = {**_merge(results[i]), "impl": impl, "variant": variant}
        if merged:
            engine["same_tokens"] = engine["tokens"] == merged[0]["tokens"]
        merged.append(engine)
    common = {"bench": "cpu", "model": os.path.basename(gguf), "batch": 1, "threads": args.threads,
              "device": f"{os.cpu_count()}-core CPU (shared; load average before {load_before}, after {load_after})",
              "date": datetime.date.today().isoformat(), "commit": _commit()}
    rows = [row for engine in merged for row in bench_rows(engine, args, common)]
    gguf_bytes = os.path.getsize(gguf)
    for row in rows:
        row["model_peak_over_gguf"] = row["model_peak_bytes"] / gguf_bytes
    print(f"{'engine':>18} {'prompt tok/s':>13} {'(best)':>8} {'decode tok/s':>13} {'(best)':>8} {'params MB':>10} "
          f"{'peak MB':>8} {'runtime MB':>11} {'model peak MB':>14} {'x GGUF':>7}")
    for engine, (prefill, decode) in zip(merged, zip(rows[::2], rows[1::2])):
        print(f"{engine['impl'] + ' ' + engine['variant']:>18} {prefill['tokens_per_s']:13.1f} "
              f"{prefill['best_tokens_per_s']:8.1f} {decode['tokens_per_s']:13.1f} {decode['best_tokens_per_s']:8.1f} "
              f"{engine['params_bytes'] / 1e6:10.1f} {engine['peak_rss_bytes'] / 1e6:8.0f} "
              f"{engine['runtime_rss_bytes'] / 1e6:11.0f} {prefill['model_peak_bytes'] / 1e6:14.0f} "
              f"{prefill['model_peak_bytes'] / gguf_bytes:7.2f}")
    print(f"medians of {len(merged[0]['decode_s'])} runs per engine ({args.rounds} rounds x {args.reps} reps), "
          f"{args.prompt_tokens}-token prompt, {args.decode_tokens} decoded tokens, {args.threads} threads; "
          f"load average before {load_before}, after {load_after}; x GGUF: the model peak (peak RSS less the "
          f"RSS after imports) over the GGUF's {gguf_bytes / 1e6:.1f} MB (issue 15's target: at most 2)")
    first = merged[0]
    for engine in merged[1:]:
        name = f"{engine['impl']} {engine['variant']}"
        print(f"{name} vs {first['impl']} {first['variant']}: the {args.decode_tokens + 1} greedy tokens after the "
              f"random prompt are {'identical' if engine['same_tokens'] else 'different'}")
        if args.check and "check" in engine:
            equal = [a == b for a, b in zip(engine["check"], first["check"])]
            print(f"{name} vs {first['impl']} {first['variant']}: test prompts' greedy tokens identical: {equal}")
    if not have_llama:
        print("llama.cpp: llama-cpp-python is not installed (left out; pip install llama-cpp-python==0.3.36 builds "
              "it from source in about 6 minutes)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
