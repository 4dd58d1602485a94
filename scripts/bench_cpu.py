"""Prompt and decode tokens/s of SmolLM2-135M-Instruct libraries on the CPU: f32 vs keep (issue 15).

For each --quantization (default `f32,keep`; `default`: compile's default) the library is compiled
into --libs (default build/bench_cpu/<quantization>/smollm2.so) with the main job's settings, or
reused from there with --reuse (the folder is not keyed by the sources: delete it or leave out
--reuse after a code change). Each library runs in a child process of its own, so that its row's
peak memory (VmHWM: resident set, TVM, torch and numpy included) is its own: one sequence is prefilled
with a --prompt-tokens prompt (random token ids, fixed seed; one prefill call) and then decodes
--decode-tokens tokens greedily (stop tokens ignored, so every run decodes the same count); each
step includes the embedding, the cache's begin/end_forward and the logits' copy to the host, as the
generator's. The best of --reps runs is reported (the machine is shared: the best is the least
disturbed).

--check also generates greedily (--check-tokens tokens) from the test prompts (the main job's prompt
and tvmattn.speculative.EXAMPLE_PROMPTS) with every library and says whether the tokens are
identical to the first library's.

llama.cpp: its column is left out; llama-cpp-python is not installed here (it builds from source in
about 6 minutes). Issue 15 measured it on this machine: 86-115 tokens/s decode, 249-314 prompt, 2
threads, the same Q4_1 GGUF.

    python scripts/bench_cpu.py [--quantization f32,keep] [--prompt-tokens 512] [--decode-tokens 128]
                                [--reps 3] [--check] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

QUANTIZATIONS = ("default", "f32", "f16", "keep")


def _quantizations(text: str) -> list[str]:
    names = [x for x in text.split(",") if x]
    bad = [x for x in names if x not in QUANTIZATIONS]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {QUANTIZATIONS}, got {text!r}")
    return names


def peak_rss() -> int:
    """This process's peak resident set in bytes: VmHWM, which starts afresh at exec (ru_maxrss
    keeps the high-water mark of the process before exec: the compiling parent's)."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def measure(lib: str, prompt_tokens: int, decode_tokens: int, reps: int) -> dict:
    """Prefill and decode tokens/s (best of reps) of one library, in this process."""
    from tvmattn.generate import Generator

    g = Generator(lib)
    vocab = g.metadata["model_config"]["vocab_size"]
    prompt = np.random.default_rng(0).integers(0, vocab, size=prompt_tokens).tolist()
    g._ensure_cache(prompt_tokens + decode_tokens + 16)
    host = g._host
    best_prefill = best_decode = float("inf")
    tokens = []
    for rep in range(reps + 1):  # the first run warms up
        host["kv_state_add_sequence"](g.cache, 0)
        start = time.perf_counter()
        logits = g._forward("prefill", [0], [prompt_tokens], g._embed(prompt)[None])
        token = int(np.argmax(np.asarray(logits)[0, -1]))
        prefill_s = time.perf_counter() - start
        tokens = [token]
        start = time.perf_counter()
        for _ in range(decode_tokens):
            logits = g._forward("decode", [0], [1], g._embed([token])[None])
            token = int(np.argmax(np.asarray(logits)[0, -1]))
            tokens.append(token)
        decode_s = time.perf_counter() - start
        host["kv_state_remove_sequence"](g.cache, 0)
        if rep:
            best_prefill, best_decode = min(best_prefill, prefill_s), min(best_decode, decode_s)
    params = os.path.getsize(lib.replace(".so", ".params.npz"))
    return {"prefill_tok_s": prompt_tokens / best_prefill, "decode_tok_s": decode_tokens / best_decode,
            "prefill_s": best_prefill, "decode_s": best_decode, "params_bytes": params,
            "peak_rss_bytes": peak_rss(), "tokens": tokens}


def check_tokens(lib: str, max_new_tokens: int) -> list[list[int]]:
    """Greedy tokens of the test prompts, one list per prompt."""
    from tvmattn.generate import Generator
    from tvmattn.quickstart import DEFAULT_PROMPT
    from tvmattn.speculative import EXAMPLE_PROMPTS

    g = Generator(lib)
    return [g.generate([p], max_new_tokens=max_new_tokens).tokens[0]
            for p in [DEFAULT_PROMPT, *EXAMPLE_PROMPTS.values()]]


def child(args) -> int:
    result = measure(args.lib, args.prompt_tokens, args.decode_tokens, args.reps)
    if args.check_tokens:
        result["check"] = check_tokens(args.lib, args.check_tokens)
    print("RESULT " + json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quantization", type=_quantizations, default=["f32", "keep"],
                        help=f"comma-separated, of {QUANTIZATIONS}")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--check", action="store_true", help="compare greedy tokens on the test prompts")
    parser.add_argument("--check-tokens", type=int, default=64, help="tokens per test prompt for --check")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--libs", default=os.path.join(ROOT, "build", "bench_cpu"),
                        help="folder of the compiled libraries")
    parser.add_argument("--reuse", action="store_true", help="reuse libraries already in --libs")
    parser.add_argument("--lib", default=None, help=argparse.SUPPRESS)  # the child's library
    args = parser.parse_args(argv)
    if args.lib:
        if not args.check:
            args.check_tokens = 0
        return child(args)

    from tvmattn.build import compile_model
    from tvmattn.quickstart import CONTEXT_WINDOW, MAX_BATCH_SIZE, MODEL

    rows = []
    for quant in args.quantization:
        lib = os.path.join(args.libs, quant, "smollm2.so")
        if not (args.reuse and os.path.isfile(lib)):
            os.makedirs(os.path.dirname(lib), exist_ok=True)
            start = time.perf_counter()
            compile_model(MODEL, lib, target="llvm", max_batch_size=MAX_BATCH_SIZE, context_window=CONTEXT_WINDOW,
                          quantization=None if quant == "default" else quant,
                          log=lambda m: print(m, file=sys.stderr))
            print(f"{quant:>8}: compiled in {time.perf_counter() - start:.1f} s", flush=True)
        command = [sys.executable, os.path.abspath(__file__), "--lib", str(lib), "--prompt-tokens",
                   str(args.prompt_tokens), "--decode-tokens", str(args.decode_tokens), "--reps", str(args.reps),
                   "--check-tokens", str(args.check_tokens)] + (["--check"] if args.check else [])
        out = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True).stdout
        result = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
        rows.append({"quantization": quant, "library": str(lib), **result})
        print(f"{quant:>8}: prompt {result['prefill_tok_s']:7.1f} tok/s ({args.prompt_tokens} tokens in "
              f"{result['prefill_s']:.2f} s), decode {result['decode_tok_s']:6.1f} tok/s ({args.decode_tokens} "
              f"tokens in {result['decode_s']:.2f} s), params {result['params_bytes'] / 1e6:.1f} MB, "
              f"peak RSS {result['peak_rss_bytes'] / 1e6:.0f} MB", flush=True)
    first = rows[0]
    for row in rows[1:]:
        same = row["tokens"] == first["tokens"]
        print(f"{row['quantization']} vs {first['quantization']}: the {args.decode_tokens + 1} greedy tokens after "
              f"the random prompt are {'identical' if same else 'different'}")
        if args.check:
            equal = [a == b for a, b in zip(row["check"], first["check"])]
            print(f"{row['quantization']} vs {first['quantization']}: test prompts' greedy tokens identical: {equal}")
    print("llama.cpp: not installed here (left out); issue 15 measured 86-115 tok/s decode, 249-314 tok/s prompt "
          "on this machine (2 threads, the same GGUF)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode_tokens,
                       "threads": os.cpu_count(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
