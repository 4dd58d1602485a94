"""Serving benchmark: replay a workload against an OpenAI-compatible server and report output
tokens/s, time to first token (TTFT) and inter-token latency (ITL) percentiles, the prefix-cache
hit rate and the preemptions (and the tokens they made the engine prefill again), as rows of the
project's benchmark format (docs/bench-format.md, bench "serve").

The server: `--url` (one already running; `--server-pid` lets the waves read its memory), or
`--lib X.so` / `--model smollm2` (this script starts `python -m tvmattn serve` on a free
127.0.0.1 port, once per `--prefix-cache` mode, and stops it at the end). With `--llama-cpp GGUF`,
the load levels also run against llama-cpp-python's server (`python -m llama_cpp.server`,
started here the same way) when llama_cpp is importable.

Prompts: words of a fixed list (about a token each), or with `--token-ids A:B` token ids drawn
from [A, B) (exact lengths in tokens; any tokenizer). `--prompt-len A:B` and `--output-len A:B`
(max_tokens, with ignore_eos) are drawn uniformly; `--shared-prefix N --shared-fraction F` puts a
common N-word (N-token) system prompt before the prompts of a fraction F of the requests.

Modes (any together):
- load levels: `--rates` (Poisson arrivals, requests per second; `inf` sends all at once) and/or
  `--concurrency` (closed loop: N clients, each sending its next request when the last one is
  done), `--requests` requests per level; `--plot FILE.svg` draws latency against load;
- `--prefix-ttft N`: a request with the shared prefix, alone, then N more with it, one at a time:
  the TTFT of the later ones against the first's (after `--warmup` requests without it);
- `--waves W --wave-size M --cancel-fraction F`: W waves of M concurrent streams, a fraction F of
  them disconnecting after a few tokens; after each wave the leaked pages (pages in use minus
  those the prefix cache holds, once idle), the server's RSS and the requests that ended without
  their full output. The exit status is 1 when a page leaked or an output came back short.

SmolLM2-shaped runs without the GGUF (random weights; the tokenizer travels in
scripts/assets/smollm2-135m, 1.5 MB), from the repository root (the server runs as
`python -m tvmattn` there); each command writes its own rows:

    python -m tvmattn compile --model scripts/assets/smollm2-135m --random-weights 0 --target cuda \
        --max-batch-size 256 -o build/smol-rand.so
    # 1/16/64/256 concurrent streams (closed loop), 128 new tokens each
    python scripts/bench_serve.py --lib build/smol-rand.so --token-ids 100:49000 --prompt-len 64:128 \
        --output-len 128:128 --concurrency 1,16,64,256 --requests 32,128,512,1024 --warmup 256 \
        --json build/serve-h200-streams.json --plot build/serve-h200-streams.svg
    # 16 concurrent requests with 512-token prompts (TTFT p50)
    python scripts/bench_serve.py --lib build/smol-rand.so --token-ids 100:49000 --prompt-len 512:512 \
        --output-len 16:16 --concurrency 16 --requests 64 --warmup 16 --server-args "--max-batched-tokens 2048" \
        --json build/serve-h200-ttft512.json
    # a 2,048-token shared system prompt, prefix cache radix and off
    python scripts/bench_serve.py --lib build/smol-rand.so --token-ids 100:49000 --shared-prefix 2048 \
        --prompt-len 32:32 --output-len 16:16 --prefix-ttft 16 --prefix-cache radix,off --warmup 2 \
        --json build/serve-h200-prefix.json
    # nothing lost: ten waves of 64 streams, a quarter cancelled
    python scripts/bench_serve.py --lib build/smol-rand.so --token-ids 100:49000 --prompt-len 16:256 \
        --output-len 16:128 --waves 10 --wave-size 64 --cancel-fraction 0.25 --json build/serve-h200-waves.json

On the CPU: `python scripts/bench_serve.py --lib smol.so --concurrency 1,8 --requests 32
--json docs/bench/serve-cpu.json` (add `--llama-cpp GGUF` for llama-cpp-python's rows).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
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
    try:
        low, high = int(low), int(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected A:B with integers, got {text!r}") from None
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"expected A:B with 1 <= A <= B, got {text!r}")
    return low, high


def _floats(text: str) -> list[float]:
    return [math.inf if x.strip() == "inf" else float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction from 0 to 1, got {text!r}")
    return value


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes or any(m not in ("radix", "off") for m in modes):
        raise argparse.ArgumentTypeError(f"expected radix, off or radix,off, got {text!r}")
    return modes


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


class Prompts:
    """Random prompts: words of WORDS joined by spaces, or token ids from [token_ids[0], token_ids[1])."""

    def __init__(self, rng, token_ids: tuple[int, int] | None):
        self.rng, self.token_ids = rng, token_ids

    def make(self, n: int):
        if self.token_ids is not None:
            return [self.rng.randrange(*self.token_ids) for _ in range(n)]
        return " ".join(self.rng.choice(WORDS) for _ in range(n))

    def join(self, prefix, rest, tag: str):
        if self.token_ids is not None:
            return list(prefix) + list(rest)
        return f"{prefix} {rest} ({tag})".strip() if prefix else f"{rest} ({tag})"


class Workload:
    """`count` (prompt, max_tokens) pairs of the named random stream; a fraction
    (args.shared_fraction) of the prompts open with the shared prefix."""

    def __init__(self, args, stream: str, count: int, shared_fraction: float | None = None):
        # each stream of random numbers is named (random.Random(-1) would repeat Random(1))
        rng = random.Random(f"{args.seed}/{stream}")
        prompts = Prompts(rng, args.token_ids)
        self.shared = Prompts(random.Random(f"{args.seed}/shared"), args.token_ids).make(args.shared_prefix)
        fraction = args.shared_fraction if shared_fraction is None else shared_fraction
        self.items = []
        for i in range(count):
            rest = prompts.make(rng.randint(*args.prompt_len))
            shared = args.shared_prefix and rng.random() < fraction
            self.items.append((prompts.join(self.shared if shared else prompts.make(0), rest, f"request {i}"),
                               rng.randint(*args.output_len)))


async def one_request(client, url: str, model: str | None, prompt, max_tokens: int, extra: dict,
                      cancel_after: int | None = None) -> dict:
    """One streamed /v1/completions request: its TTFT, inter-token gaps, completion tokens and
    finish reason; with cancel_after, the client disconnects after that many text chunks."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    if model:
        body["model"] = model
    start = time.perf_counter()
    stamps, tokens, finish, error, cancelled = [], None, None, None, False
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                return {"error": f"{response.status_code}: {(await response.aread())[:200]!r}", "max_tokens": max_tokens}
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if event.get("error"):
                    error = str(event["error"].get("message"))
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                for choice in event.get("choices") or []:
                    if choice.get("text"):
                        stamps.append(time.perf_counter())
                    finish = choice.get("finish_reason") or finish
                if cancel_after is not None and len(stamps) >= cancel_after:
                    cancelled = True
                    break  # leaving the block closes the connection: the server cancels the request
    except Exception as err:  # noqa: BLE001 - counted as a failed request
        error = f"{type(err).__name__}: {err}"
    end = time.perf_counter()
    return {"ttft": stamps[0] - start if stamps else None, "itl": [b - a for a, b in zip(stamps, stamps[1:])],
            "tokens": tokens if tokens is not None else len(stamps), "usage_tokens": tokens, "finish": finish,
            "latency": end - start, "error": error, "cancelled": cancelled, "max_tokens": max_tokens}


def _client():
    import httpx

    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    return httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits)


async def run_level(url: str, model: str | None, work: Workload, rate: float | None, concurrency: int | None,
                    extra: dict, seed: str) -> tuple[list[dict], float]:
    rng = random.Random(seed)
    async with _client() as client:
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


async def run_all_at_once(url: str, model: str | None, items: list, extra: dict,
                          cancel_after: list | None = None) -> list[dict]:
    async with _client() as client:
        cancel_after = cancel_after or [None] * len(items)
        return list(await asyncio.gather(*(one_request(client, url, model, prompt, n, extra, after)
                                           for (prompt, n), after in zip(items, cancel_after))))


async def run_one_by_one(url: str, model: str | None, items: list, extra: dict) -> list[dict]:
    async with _client() as client:
        return [await one_request(client, url, model, prompt, n, extra) for prompt, n in items]


# ---------------------------------------------------------------------- the server's side
def read_metrics(url: str, headers: dict) -> dict[str, float] | None:
    """tvmattn's /metrics gauges and counters without labels (None for another server)."""
    import httpx

    try:
        response = httpx.get(f"{url}/metrics", headers=headers, timeout=60)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    found = {m.group(1): float(m.group(2))
             for m in re.finditer(r"^(tvmattn_[a-z_]+) ([0-9.e+-]+|NaN)$", response.text, re.M)}
    return found or None


def _delta(before: dict | None, after: dict | None, name: str) -> float | None:
    if before is None or after is None or name not in before or name not in after:
        return None
    return after[name] - before[name]


def _count(before: dict | None, after: dict | None, name: str) -> int | None:
    delta = _delta(before, after, name)
    return None if delta is None else int(delta)


def _sampling(before: dict | None, after: dict | None) -> dict:
    """Which sampler chose the level's tokens: the engine's mode, and the choices the library's
    kernels and the host made (the host's: fallback rows, or every row with --sampling host);
    the decode steps launched before the previous step's tokens were read (lookahead)."""
    mode = None
    if after is not None and "tvmattn_sampling_device" in after:
        mode = "device" if after["tvmattn_sampling_device"] else "host"
    return {"sampling": mode, "sampled_device": _count(before, after, "tvmattn_sampled_tokens_device"),
            "sampled_host": _count(before, after, "tvmattn_sampled_tokens_host"),
            "lookahead_steps": _count(before, after, "tvmattn_lookahead_steps")}


def wait_idle(url: str, headers: dict, timeout_s: float = 120) -> dict | None:
    """The metrics once no request runs or waits (cancellations reach the engine a moment after
    the disconnect)."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = read_metrics(url, headers)
        if metrics is None:
            return None
        if metrics.get("tvmattn_requests_running", 0) == 0 and metrics.get("tvmattn_requests_waiting", 0) == 0:
            return metrics
        if time.monotonic() > deadline:
            return metrics
        time.sleep(0.1)


def rss_mib(pid: int | None) -> float | None:
    """The resident memory of a process (VmRSS of /proc/PID/status), MiB."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


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


# ---------------------------------------------------------------------- the modes
def _round(x: float | None, digits: int = 2) -> float | None:
    return None if x is None else round(x, digits)


def _shape(args) -> dict:
    return {"prompt_len": f"{args.prompt_len[0]}:{args.prompt_len[1]}",
            "output_len": f"{args.output_len[0]}:{args.output_len[1]}",
            "prompt_unit": "tokens" if args.token_ids else "words"}


def bench(impl: str, url: str, model: str | None, args, extra: dict, headers: dict, label: dict) -> list[dict]:
    rows = []
    levels = [("rate", r) for r in args.rates] + [("concurrency", c) for c in args.concurrency]
    for index, (kind, value) in enumerate(levels):
        work = Workload(args, f"level/{index}", count=args.requests[index if len(args.requests) > 1 else 0])
        before = read_metrics(url, headers)
        results, wall = asyncio.run(run_level(url, model, work, value if kind == "rate" else None,
                                              value if kind == "concurrency" else None, extra,
                                              f"{args.seed}/arrivals/{index}"))
        after = wait_idle(url, headers) if before is not None else None
        done = [r for r in results if not r.get("error")]
        ttft = [r["ttft"] * 1e3 for r in done if r["ttft"] is not None]
        itl = [x * 1e3 for r in done for x in r["itl"]]
        out_tokens = sum(r["tokens"] for r in done)
        hits, queried = (_delta(before, after, "tvmattn_prefix_cache_hit_tokens"),
                         _delta(before, after, "tvmattn_prefix_cache_queried_tokens"))
        preempted = _count(before, after, "tvmattn_preemptions")
        recomputed = _count(before, after, "tvmattn_recomputed_tokens")
        row = {"bench": "serve", "impl": impl, **label,
               "variant": f"{kind}={value:g}" if kind == "rate" else f"{kind}={value}",
               kind: value if value != math.inf else "inf", "requests": len(results), "completed": len(done),
               **_shape(args), "shared_prefix": args.shared_prefix,
               "shared_fraction": args.shared_fraction if args.shared_prefix else 0,
               "wall_s": round(wall, 3), "output_tokens": out_tokens,
               "tokens_per_s": round(out_tokens / wall, 2) if wall > 0 else None,
               "ttft_p50_ms": _round(percentile(ttft, 50)), "ttft_p99_ms": _round(percentile(ttft, 99)),
               "itl_p50_ms": _round(percentile(itl, 50)), "itl_p99_ms": _round(percentile(itl, 99)),
               "prefix_hit_rate": round(hits / queried, 4) if queried else None,
               "preemptions": preempted, "recomputed_tokens": recomputed, **_sampling(before, after)}
        failed = [r["error"] for r in results if r.get("error")]
        if failed:
            row["errors"] = failed[:3]
        rows.append(row)
        print(f"{impl:>9} {row['variant']:>16}: {row['tokens_per_s']} tokens/s, TTFT p50 {row['ttft_p50_ms']} ms "
              f"p99 {row['ttft_p99_ms']} ms, ITL p50 {row['itl_p50_ms']} ms p99 {row['itl_p99_ms']} ms, "
              f"prefix hits {row['prefix_hit_rate']}, preemptions {row['preemptions']} "
              f"(recomputed tokens {row['recomputed_tokens']}), {len(done)}/{len(results)} completed", flush=True)
    return rows


def warm_up(url: str, model: str | None, args, extra: dict) -> None:
    """args.warmup requests at once without the shared prefix (graph captures, first kernel
    loads): what the measured requests should not pay."""
    if args.warmup:
        work = Workload(args, "warmup", count=args.warmup, shared_fraction=0.0)
        asyncio.run(run_all_at_once(url, model, work.items, extra))


def prefix_ttft(impl: str, url: str, model: str | None, args, extra: dict, label: dict) -> list[dict]:
    """The shared prefix's first request alone, then args.prefix_ttft more, one at a time."""
    work = Workload(args, "prefix-ttft", count=args.prefix_ttft + 1, shared_fraction=1.0)
    results = asyncio.run(run_one_by_one(url, model, work.items, extra))
    failed = [r["error"] for r in results if r.get("error")]
    first = results[0]["ttft"]
    rest = [r["ttft"] * 1e3 for r in results[1:] if r.get("ttft") is not None]
    first_ms = None if first is None else first * 1e3
    rest_p50 = percentile(rest, 50)
    row = {"bench": "serve", "impl": impl, **label, "part": "prefix-ttft", "variant": f"prefix-ttft={args.prefix_ttft}",
           "requests": len(results), "completed": len(results) - len(failed), **_shape(args),
           "shared_prefix": args.shared_prefix, "ttft_first_ms": _round(first_ms), "ttft_rest_p50_ms": _round(rest_p50),
           "ttft_rest_max_ms": _round(max(rest) if rest else None),
           "ttft_rest_ratio": round(rest_p50 / first_ms, 4) if rest_p50 is not None and first_ms else None}
    if failed:
        row["errors"] = failed[:3]
    print(f"{impl:>9} {'prefix-ttft':>16} {label}: first {row['ttft_first_ms']} ms, the next {args.prefix_ttft} "
          f"p50 {row['ttft_rest_p50_ms']} ms ({row['ttft_rest_ratio']} of the first)", flush=True)
    return [row]


def waves(impl: str, url: str, model: str | None, args, extra: dict, headers: dict, pid: int | None,
          label: dict) -> tuple[list[dict], list[str]]:
    """args.waves waves of args.wave_size concurrent streams, a fraction cancelled: rows per wave,
    and the problems found (leaked pages, short outputs, RSS growth from the second wave on)."""
    rows, problems = [], []
    for wave in range(args.waves):
        rng = random.Random(f"{args.seed}/cancel/{wave}")
        work = Workload(args, f"wave/{wave}", count=args.wave_size)
        cancel_after = [rng.randint(1, 3) if rng.random() < args.cancel_fraction else None
                        for _ in range(args.wave_size)]
        before = read_metrics(url, headers)
        start = time.perf_counter()
        results = asyncio.run(run_all_at_once(url, model, work.items, extra, cancel_after))
        wall = time.perf_counter() - start
        after = wait_idle(url, headers)
        cancelled = sum(r.get("cancelled", False) for r in results)
        # a request that stayed must end with finish_reason length and exactly max_tokens tokens
        short = [r for r in results if not r.get("cancelled") and
                 (r.get("error") or r.get("finish") != "length" or r.get("usage_tokens") != r["max_tokens"])]
        leaked = None
        if after is not None and "tvmattn_kv_pages_prefix_cache" in after:
            leaked = int(after["tvmattn_kv_pages_used"] - after["tvmattn_kv_pages_prefix_cache"])
        row = {"bench": "serve", "impl": impl, **label, "part": "waves", "variant": f"wave={wave + 1}",
               "wave": wave + 1, "requests": len(results), "cancelled": cancelled,
               "completed": len(results) - cancelled - len(short), "incomplete": len(short), **_shape(args),
               "wall_s": round(wall, 3), "leaked_pages": leaked,
               "pages_used": None if after is None else int(after.get("tvmattn_kv_pages_used", 0)),
               "rss_mib": _round(rss_mib(pid), 1),
               "preemptions": _count(before, after, "tvmattn_preemptions"),
               "recomputed_tokens": _count(before, after, "tvmattn_recomputed_tokens"), **_sampling(before, after)}
        if short:
            row["errors"] = [r.get("error") or f"{r.get('usage_tokens')} of {r['max_tokens']} tokens, "
                             f"finish {r.get('finish')}" for r in short[:3]]
            problems.append(f"wave {wave + 1}: {len(short)} outputs short ({row['errors'][0]})")
        if leaked:
            problems.append(f"wave {wave + 1}: {leaked} pages leaked")
        rows.append(row)
        print(f"{impl:>9} {row['variant']:>16}: {cancelled} cancelled, {row['completed']} complete, "
              f"{len(short)} incomplete, leaked pages {leaked}, RSS {row['rss_mib']} MiB", flush=True)
    rss = [r["rss_mib"] for r in rows[1:] if r["rss_mib"] is not None]
    if rss:
        growth = max(rss) / min(rss) - 1
        for row in rows:
            row["rss_spread_from_wave_2"] = round(growth, 4)
        if growth > 0.10:
            problems.append(f"RSS varies by {growth:.1%} from the second wave on (over 10%)")
    return rows, problems


# ---------------------------------------------------------------------- the plot
def plot_svg(rows: list[dict], path: str) -> None:
    """TTFT and inter-token latency (p50 solid, p99 dashed) against output tokens/s, one line per
    implementation and prefix-cache mode: a self-contained SVG."""
    series: dict[str, list[dict]] = {}
    for row in rows:
        if row.get("part") is None and row.get("tokens_per_s") and row.get("ttft_p50_ms") is not None:
            name = row["impl"] + (f" ({row['prefix_cache']})" if row.get("prefix_cache") else "")
            series.setdefault(name, []).append(row)
    width, height, pad = 900, 380, 60
    panel_w = (width - 3 * pad) / 2
    colors = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>']
    panels = (("time to first token (ms)", "ttft"), ("inter-token latency (ms)", "itl"))
    for p, (title, key) in enumerate(panels):
        x0, y0, h = pad + p * (panel_w + pad), pad / 2, height - 2 * pad
        points = [(r["tokens_per_s"], r[f"{key}_{q}_ms"]) for rs in series.values() for r in rs
                  for q in ("p50", "p99") if r.get(f"{key}_{q}_ms") is not None]
        xmax = max([x for x, _ in points] + [1e-9]) * 1.05
        ymax = max([y for _, y in points] + [1e-9]) * 1.05

        def sx(x, x0=x0, xmax=xmax):
            return x0 + panel_w * x / xmax

        def sy(y, y0=y0, h=h, ymax=ymax):
            return y0 + h - h * y / ymax

        out.append(f'<rect x="{x0:.1f}" y="{y0:.1f}" width="{panel_w:.1f}" height="{h:.1f}" fill="none" '
                   f'stroke="black"/>')
        for i in range(5):
            xt, yt = xmax * i / 4, ymax * i / 4
            out.append(f'<text x="{sx(xt):.1f}" y="{y0 + h + 14:.1f}" text-anchor="middle">{xt:.4g}</text>')
            out.append(f'<text x="{x0 - 4:.1f}" y="{sy(yt) + 4:.1f}" text-anchor="end">{yt:.4g}</text>')
        out.append(f'<text x="{x0 + panel_w / 2:.1f}" y="{y0 + h + 30:.1f}" text-anchor="middle">'
                   f'output tokens/s</text>')
        out.append(f'<text x="{x0 + panel_w / 2:.1f}" y="{y0 - 8:.1f}" text-anchor="middle">{title}</text>')
        for s, (name, rs) in enumerate(sorted(series.items())):
            color = colors[s % len(colors)]
            rs = sorted(rs, key=lambda r: r["tokens_per_s"])
            for q, dash in (("p50", ""), ("p99", ' stroke-dasharray="5,3"')):
                pts = [(sx(r["tokens_per_s"]), sy(r[f"{key}_{q}_ms"])) for r in rs
                       if r.get(f"{key}_{q}_ms") is not None]
                if pts:
                    line = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
                    out.append(f'<polyline class="{_xml(name)} {q}" points="{line}" fill="none" '
                               f'stroke="{color}"{dash}/>')
                    out += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{color}"/>' for x, y in pts]
            if p == 0:
                out.append(f'<text x="{x0 + 8:.1f}" y="{y0 + 14 + 14 * s:.1f}" fill="{color}">'
                           f'{_xml(name)}: p50 solid, p99 dashed</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")
    print(f"wrote {path}")


def _xml(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


# ---------------------------------------------------------------------- main
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    source.add_argument("--lib", help="start `python -m tvmattn serve --lib LIB`")
    source.add_argument("--model", choices=("smollm2",), help="start `python -m tvmattn serve --model smollm2`")
    parser.add_argument("--server-args", default="", help="more options of `tvmattn serve` (one string)")
    parser.add_argument("--server-pid", type=int, default=None, help="with --url: the server's process (for RSS)")
    parser.add_argument("--prefix-cache", type=_modes, default=None,
                        help="radix, off or radix,off: start the server with each (default: the server's default)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--rates", type=_floats, default=[], help="Poisson arrival rates, requests/s (inf: at once)")
    parser.add_argument("--concurrency", type=_ints, default=[], help="closed-loop client counts")
    parser.add_argument("--requests", type=_ints, default=[32],
                        help="requests per load level: one count, or one per level (rates first)")
    parser.add_argument("--token-ids", type=_range, default=None, metavar="A:B",
                        help="prompts of token ids from [A, B) (lengths in tokens) instead of words")
    parser.add_argument("--prompt-len", type=_range, default=(32, 128), help="prompt words (tokens) A:B")
    parser.add_argument("--output-len", type=_range, default=(32, 128), help="max_tokens A:B")
    parser.add_argument("--shared-prefix", type=int, default=0, help="words (tokens) of a shared system prompt")
    parser.add_argument("--shared-fraction", type=_fraction, default=0.5, help="requests that carry it")
    parser.add_argument("--warmup", type=int, default=0, help="requests sent at once before measuring")
    parser.add_argument("--prefix-ttft", type=int, default=0, metavar="N",
                        help="the shared prefix's first request alone, then N more: their TTFT against the first's")
    parser.add_argument("--waves", type=int, default=0, help="waves of concurrent streams with cancellations")
    parser.add_argument("--wave-size", type=int, default=64, help="streams per wave")
    parser.add_argument("--cancel-fraction", type=_fraction, default=0.25,
                        help="streams of a wave that disconnect after 1 to 3 text chunks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--llama-cpp", metavar="GGUF", default=None,
                        help="also run the load levels on llama-cpp-python's server with this GGUF")
    parser.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: all CPUs)")
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--plot", default=None, metavar="FILE.svg", help="latency against load, an SVG file")
    args = parser.parse_args(argv)
    if not args.rates and not args.concurrency and not args.prefix_ttft and not args.waves:
        parser.error("give --rates, --concurrency, --prefix-ttft and/or --waves")
    if args.prefix_ttft and not args.shared_prefix:
        parser.error("--prefix-ttft needs --shared-prefix N")
    if args.prefix_cache and args.url:
        parser.error("--prefix-cache starts servers: give --lib or --model, not --url")
    if args.token_ids and args.token_ids[1] - args.token_ids[0] < 1:
        parser.error("--token-ids A:B needs A < B")
    for name in ("wave_size", "waves", "warmup", "prefix_ttft", "shared_prefix"):
        if getattr(args, name) < 0 or (name == "wave_size" and getattr(args, name) < 1):
            parser.error(f"--{name.replace('_', '-')} must be {'positive' if name == 'wave_size' else '>= 0'}")
    levels = len(args.rates) + len(args.concurrency)
    if not args.requests or min(args.requests) < 1 or len(args.requests) not in (1, levels):
        parser.error(f"--requests: one positive count, or one per load level ({levels}), got {args.requests}")
    problem = bench_rows.output_path_problem(args.json)
    if problem:
        parser.error(f"--json: {problem}")
    if args.plot and not args.plot.endswith(".svg"):
        parser.error("--plot writes an SVG file: give FILE.svg")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    extra = {"ignore_eos": True}
    rows, problems = [], []
    log_dir = os.environ.get("TMPDIR", "/tmp")
    for mode in args.prefix_cache or [None]:
        process = None
        url, pid = args.url, args.server_pid
        label = {"prefix_cache": mode} if mode else {}
        try:
            if url is None:
                port = free_port()
                url = f"http://127.0.0.1:{port}"
                command = [sys.executable, "-m", "tvmattn", "serve", "--port", str(port)]
                command += ["--lib", args.lib] if args.lib else ["--model", args.model]
                command += args.server_args.split()
                if mode:
                    command += ["--prefix-cache", mode]
                if args.api_key:
                    command += ["--api-key", args.api_key]
                process = start_server(command, url, os.path.join(log_dir, "bench_serve_tvmattn.log"))
                pid = process.pid
            import httpx

            models = httpx.get(f"{url}/v1/models", headers=headers, timeout=10).json()
            model = models["data"][0]["id"]
            warm_up(url, model, args, extra)
            rows += bench("tvmattn", url, model, args, extra, headers, label)
            if args.prefix_ttft:
                rows += prefix_ttft("tvmattn", url, model, args, extra, label)
            if args.waves:
                wave_rows, wave_problems = waves("tvmattn", url, model, args, extra, headers, pid, label)
                rows += wave_rows
                problems += [f"{mode + ': ' if mode else ''}{p}" for p in wave_problems]
        finally:
            if process is not None:
                stop_server(process)
    if args.llama_cpp and (args.rates or args.concurrency):
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
                rows += bench("llama.cpp", url, None, args, {}, {}, {})
            finally:
                stop_server(process)
    meta = bench_rows.run_meta()  # the GPU's name where one is present, else the CPU's
    rows = [{**row, **meta} for row in rows]
    if args.json:
        bench_rows.write_rows(rows, args.json)
    if args.plot:
        plot_svg(rows, args.plot)
    if args.waves:
        if problems:
            print("nothing lost: FAILED: " + "; ".join(problems), file=sys.stderr)
            return 1
        print("nothing lost: no page leaked, every stream that stayed got its full output"
              + ("" if args.waves < 2 or not any(r.get("rss_mib") for r in rows) else
                 ", RSS within 10% from the second wave on"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
