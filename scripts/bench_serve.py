"""Serving benchmark: replay a workload against an OpenAI-compatible server and report output
tokens/s, time to first token (TTFT) and inter-token latency (ITL) percentiles and the prefix-cache
hit rate, as rows of the project's benchmark format (shared/docs/bench-format.md, bench "serve").

The server: `--url` (one already running), or `--lib X.so` / `--model smollm2` (this script starts
`python -m tvmattn serve` on a free 127.0.0.1 port, and stops it at the end). With `--llama-cpp
GGUF`, the same workload also runs against llama-cpp-python's server (`python -m llama_cpp.server`,
started here the same way) when llama_cpp is importable.

The workload, per load level: `--rates` (Poisson arrivals, requests per second; `inf` sends all at
once) and/or `--concurrency` (closed loop: N clients, each sending its next request when the last
one is done), `--requests` requests per level. Prompt lengths (words of a fixed list, about a token
each) and output lengths (max_tokens) are drawn uniformly from `--prompt-len A:B` and
`--output-len A:B`; `--shared-prefix N --shared-fraction F` puts a common N-word system prompt before
the prompts of a fraction F of the requests. Streams are read with stream_options.include_usage.

    python scripts/bench_serve.py --lib smol.so --concurrency 1,8 --requests 32 --json docs/bench/serve-cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_rows  # noqa: E402

WORDS = ("time year people way day man thing woman life child world school state family student group country "
         "problem hand part place case week company system program question work government number night point "
         "home water room mother area money story fact month lot right study book eye job word business issue "
         "side kind head house service friend father power hour game line end member law car city community name "
         "president team minute idea kid body information back parent face others level office door health person "
         "art war history party result change morning reason research girl guy moment air teacher force education").split()


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    low, high = int(low), int(high or low)
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"expected A:B with 1 <= A <= B, got {text!r}")
    return low, high


def _floats(text: str) -> list[float]:
    return [math.inf if x.strip() == "inf" else float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


class Workload:
    def __init__(self, args, rng_seed: int):
        import random

        rng = random.Random(rng_seed)
        shared = " ".join(rng.choice(WORDS) for _ in range(args.shared_prefix))
        self.items = []
        for i in range(args.requests):
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*args.prompt_len)))
            prompt = f"{shared} {words}" if args.shared_prefix and rng.random() < args.shared_fraction else words
            self.items.append((f"{prompt} (request {i})", rng.randint(*args.output_len)))


async def one_request(client, url: str, model: str | None, prompt: str, max_tokens: int, extra: dict) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    if model:
        body["model"] = model
    start = time.perf_counter()
    stamps, tokens, error = [], None, None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                return {"error": f"{response.status_code}: {(await response.aread())[:200]!r}"}
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                for choice in event.get("choices") or []:
                    if choice.get("text"):
                        stamps.append(time.perf_counter())
    except Exception as err:  # noqa: BLE001 - counted as a failed request
        error = f"{type(err).__name__}: {err}"
    end = time.perf_counter()
    return {"ttft": stamps[0] - start if stamps else None, "itl": [b - a for a, b in zip(stamps, stamps[1:])],
            "tokens": tokens if tokens is not None else len(stamps), "latency": end - start, "error": error}


async def run_level(url: str, model: str | None, work: Workload, rate: float | None, concurrency: int | None,
                    extra: dict, seed: int) -> tuple[list[dict], float]:
    import random

    import httpx

    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        start = time.perf_counter()
        if concurrency is not None:
            queue = list(work.items)
            results = []

            async def worker():
                while queue:
                    prompt, n = queue.pop(0)
                    results.append(await one_request(client, url, model, prompt, n, extra))

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        else:
            tasks = []
            for prompt, n in work.items:
                tasks.append(asyncio.create_task(one_request(client, url, model, prompt, n, extra)))
                if rate != math.inf:
                    await asyncio.sleep(rng.expovariate(rate))
            results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def prefix_counts(url: str, headers: dict) -> tuple[float, float] | None:
    """(hit tokens, queried tokens) from tvmattn's /metrics (None for another server)."""
    import httpx

    try:
        text = httpx.get(f"{url}/metrics", headers=headers, timeout=10).text
    except httpx.HTTPError:
        return None
    found = {}
    for name in ("tvmattn_prefix_cache_hit_tokens", "tvmattn_prefix_cache_queried_tokens"):
        match = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
        if match is None:
            return None
        found[name] = float(match.group(1))
    return found["tvmattn_prefix_cache_hit_tokens"], found["tvmattn_prefix_cache_queried_tokens"]


def start_server(command: list[str], url: str, log_path: str, timeout_s: float = 1800) -> subprocess.Popen:
    import httpx

    log = open(log_path, "w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise SystemExit(f"error: the server exited (status {process.returncode}); see {log_path}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code in (200, 401):
                return process
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise SystemExit(f"error: the server did not start in {timeout_s:.0f} s; see {log_path}")
        time.sleep(0.5)


def stop_server(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def bench(impl: str, url: str, model: str | None, args, extra: dict, headers: dict) -> list[dict]:
    rows = []
    levels = [("rate", r) for r in args.rates] + [("concurrency", c) for c in args.concurrency]
    for index, (kind, value) in enumerate(levels):
        work = Workload(args, args.seed + index)
        before = prefix_counts(url, headers)
        results, wall = asyncio.run(run_level(url, model, work, value if kind == "rate" else None,
                                              value if kind == "concurrency" else None, extra, args.seed + index))
        after = prefix_counts(url, headers)
        done = [r for r in results if not r.get("error")]
        ttft = [r["ttft"] * 1e3 for r in done if r["ttft"] is not None]
        itl = [x * 1e3 for r in done for x in r["itl"]]
        out_tokens = sum(r["tokens"] for r in done)
        hit = None
        if before is not None and after is not None and after[1] > before[1]:
            hit = (after[0] - before[0]) / (after[1] - before[1])
        row = {"bench": "serve", "impl": impl, "variant": f"{kind}={value:g}" if kind == "rate" else f"{kind}={value}",
               kind: value if value != math.inf else "inf", "requests": len(results), "completed": len(done),
               "prompt_len": f"{args.prompt_len[0]}:{args.prompt_len[1]}",
               "output_len": f"{args.output_len[0]}:{args.output_len[1]}",
               "shared_prefix": args.shared_prefix, "shared_fraction": args.shared_fraction if args.shared_prefix else 0,
               "wall_s": round(wall, 3), "output_tokens": out_tokens,
               "tokens_per_s": round(out_tokens / wall, 2) if wall > 0 else None,
               "ttft_p50_ms": _round(percentile(ttft, 50)), "ttft_p99_ms": _round(percentile(ttft, 99)),
               "itl_p50_ms": _round(percentile(itl, 50)), "itl_p99_ms": _round(percentile(itl, 99)),
               "prefix_hit_rate": None if hit is None else round(hit, 4)}
        failed = [r["error"] for r in results if r.get("error")]
        if failed:
            row["errors"] = failed[:3]
        rows.append(row)
        print(f"{impl:>9} {row['variant']:>16}: {row['tokens_per_s']} tokens/s, TTFT p50 {row['ttft_p50_ms']} ms "
              f"p99 {row['ttft_p99_ms']} ms, ITL p50 {row['itl_p50_ms']} ms p99 {row['itl_p99_ms']} ms, "
              f"prefix hits {row['prefix_hit_rate']}, {len(done)}/{len(results)} completed", flush=True)
    return rows


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed: no plot", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for impl in sorted({r["impl"] for r in rows}):
        mine = [r for r in rows if r["impl"] == impl and r["tokens_per_s"]]
        xs = [r["tokens_per_s"] for r in mine]
        axes[0].plot(xs, [r["ttft_p50_ms"] for r in mine], "o-", label=f"{impl} p50")
        axes[0].plot(xs, [r["ttft_p99_ms"] for r in mine], "x--", label=f"{impl} p99")
        axes[1].plot(xs, [r["itl_p50_ms"] for r in mine], "o-", label=f"{impl} p50")
        axes[1].plot(xs, [r["itl_p99_ms"] for r in mine], "x--", label=f"{impl} p99")
    for ax, what in zip(axes, ("time to first token (ms)", "inter-token latency (ms)")):
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(what)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    source.add_argument("--lib", help="start `python -m tvmattn serve --lib LIB`")
    source.add_argument("--model", choices=("smollm2",), help="start `python -m tvmattn serve --model smollm2`")
    parser.add_argument("--server-args", default="", help="more options of `tvmattn serve` (one string)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--rates", type=_floats, default=[], help="Poisson arrival rates, requests/s (inf: at once)")
    parser.add_argument("--concurrency", type=_ints, default=[], help="closed-loop client counts")
    parser.add_argument("--requests", type=int, default=32, help="requests per load level")
    parser.add_argument("--prompt-len", type=_range, default=(32, 128), help="prompt words A:B")
    parser.add_argument("--output-len", type=_range, default=(32, 128), help="max_tokens A:B")
    parser.add_argument("--shared-prefix", type=int, default=0, help="words of a shared system prompt")
    parser.add_argument("--shared-fraction", type=float, default=0.5, help="requests that carry it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--llama-cpp", metavar="GGUF", default=None,
                        help="also run the workload on llama-cpp-python's server with this GGUF")
    parser.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: all CPUs)")
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--plot", default=None, help="latency against load, PNG (needs matplotlib)")
    args = parser.parse_args(argv)
    if not args.rates and not args.concurrency:
        parser.error("give --rates and/or --concurrency")
    problem = bench_rows.output_path_problem(args.json)
    if problem:
        parser.error(f"--json: {problem}")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    extra = {"ignore_eos": True}
    rows = []
    process = None
    url = args.url
    log_dir = os.environ.get("TMPDIR", "/tmp")
    try:
        if url is None:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            command = [sys.executable, "-m", "tvmattn", "serve", "--port", str(port)]
            command += ["--lib", args.lib] if args.lib else ["--model", args.model]
            command += args.server_args.split()
            if args.api_key:
                command += ["--api-key", args.api_key]
            process = start_server(command, url, os.path.join(log_dir, "bench_serve_tvmattn.log"))
        import httpx

        models = httpx.get(f"{url}/v1/models", headers=headers, timeout=10).json()
        model = models["data"][0]["id"]
        rows += bench("tvmattn", url, model, args, {**extra}, headers)
    finally:
        if process is not None:
            stop_server(process)
    if args.llama_cpp:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            print("note: llama_cpp is not importable (pip install 'llama-cpp-python[server]'): llama.cpp rows skipped",
                  file=sys.stderr)
        else:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            threads = args.threads or len(os.sched_getaffinity(0))
            command = [sys.executable, "-m", "llama_cpp.server", "--model", args.llama_cpp, "--host", "127.0.0.1",
                       "--port", str(port), "--n_threads", str(threads), "--n_ctx", "4096",
                       # its default lets each new request cut the running one short
                       "--interrupt_requests", "False"]
            process = start_server(command, url, os.path.join(log_dir, "bench_serve_llama_cpp.log"))
            try:
                rows += bench("llama.cpp", url, None, args, {}, {})
            finally:
                stop_server(process)
    meta = bench_rows.run_meta()  # the GPU's name where one is present, else the CPU's
    rows = [{**row, **meta} for row in rows]
    if args.json:
        bench_rows.write_rows(rows, args.json)
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
