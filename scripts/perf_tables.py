"""The performance tables of docs/performance.md and README.md, generated from the rows in docs/bench.

Each table sits between two markers in the Markdown file, `<!-- table:NAME -->` and
`<!-- /table:NAME -->`; this script rewrites what is between them from the rows (the latest row of
each configuration and point, see scripts/bench_latest.py) and leaves the rest of the files alone.

    python scripts/perf_tables.py           # rewrite the tables
    python scripts/perf_tables.py --check   # exit 1 when a table is not what the rows give

Under each table of docs/performance.md a line names the rows' files and runs (commit, day); the
README's summary names the files. No TVM, no torch.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_rows  # noqa: E402

REPO = bench_rows.REPO
BENCH_DIR = os.path.join(REPO, "docs", "bench")
PERFORMANCE = os.path.join(REPO, "docs", "performance.md")
README = os.path.join(REPO, "README.md")

DECODE_SHAPES = ((1, 4096), (1, 32768), (8, 32768), (64, 4096), (128, 8192), (256, 2048))
DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


# --------------------------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------------------------
DEFAULT_GPU = "NVIDIA H200"  # the GPU of the tables that name none (other GPUs' tables pass `device`)


class Rows:
    """Every row of docs/bench with its file; `get` finds the latest row matching some fields."""

    def __init__(self, folder: str = BENCH_DIR):
        self.rows = []
        for findex, name in enumerate(sorted(n for n in os.listdir(folder) if n.endswith(".json"))):
            with open(os.path.join(folder, name)) as f:
                for rindex, row in enumerate(json.load(f)):
                    self.rows.append((str(row.get("date", "")), findex, rindex, name, row))

    def find(self, **fields) -> list[tuple]:
        """(stamp..., file, row) of every row whose fields equal `fields` (graph=False: not a replay).
        Without a `device` field: rows of the CPU and of the default GPU (DEFAULT_GPU) only."""
        graph = fields.pop("graph", False)
        machines = None if "device" in fields else ("cpu", DEFAULT_GPU)
        return [entry for entry in self.rows
                if all(entry[4].get(k) == v for k, v in fields.items())
                and (machines is None or bench_rows.machine(entry[4]) in machines)
                and str(entry[4].get("variant", "")).startswith(bench_rows.GRAPH_PREFIX) == graph]

    def get(self, used: set | None = None, unless: dict | None = None, **fields) -> dict | None:
        """The latest matching row (None when none), skipping rows whose fields equal any of
        `unless`'s; its run is added to `used`."""
        found = [e for e in self.find(**fields) if not any(e[4].get(k) == v for k, v in (unless or {}).items())]
        if not found:
            return None
        entry = max(found, key=lambda e: e[:3])
        if used is not None:
            used.add((entry[3], entry[4].get("commit", "?"), str(entry[4].get("date", ""))[:10]))
        return entry[4]


def fmt(value, digits: int = 3) -> str:
    """A rate or time: integers from 1000 up, else `digits` significant digits."""
    if value is None:
        return "-"
    if abs(value) >= 1000:
        return f"{value:.0f}"
    text = f"{value:.{digits}g}"
    return text if "e" not in text else f"{value:.2e}"


def sources(used: set) -> str:
    """The line under a table: rows' files and runs."""
    by_file: dict = {}
    for name, commit, day in sorted(used, key=lambda u: (u[0], u[2], u[1]), reverse=True):
        by_file.setdefault(name, []).append(f"{commit}, {day}")
    by_file = dict(sorted(by_file.items()))
    parts = [f"`docs/bench/{name}` ({'; '.join(dict.fromkeys(runs))})" for name, runs in by_file.items()]
    return "Rows: " + ", ".join(parts) + "."


def table(header: list[str], lines: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(line) + " |" for line in lines]
    return "\n".join(out)


def shape_label(row: dict) -> str:
    b, s, q = row.get("batch"), row.get("seq_len"), row.get("qo_len")
    return f"{b}x{s}" if q in (None, 1, s) else f"{b}x{q}@{s}"


# --------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------
WINDOW_KEYS = re.compile(r"of (\d+) keys")


def window_row(rows: Rows, used: set, dtype: str, kv: int, batch: int, context: int) -> dict | None:
    """The sliding-window decode row of a (batch, context) point (its seq_len is the keys it reads)."""
    found = [e for e in rows.find(bench="kernels", kernel="decode", impl="tvmattn-window", dtype=dtype,
                                  head_dim=128, num_kv_heads=kv, batch=batch)
             if (m := WINDOW_KEYS.search(str(e[4].get("variant", "")))) and int(m.group(1)) == context]
    if not found:
        return None
    entry = max(found, key=lambda e: e[:3])
    used.add((entry[3], entry[4].get("commit", "?"), str(entry[4].get("date", ""))[:10]))
    return entry[4]


def decode_table(rows: Rows) -> str:
    used: set = set()
    header = ["group, dtype", "row"] + [f"{b}x{s}" for b, s in DECODE_SHAPES]
    lines = []
    for group, kv in ((4, 8), (8, 4)):
        for dtype in ("float16", "bfloat16"):
            common = dict(bench="kernels", kernel="decode", dtype=dtype, head_dim=128, num_qo_heads=32, num_kv_heads=kv)
            plain = [rows.get(used, impl="tvmattn", batch=b, seq_len=s, **common) for b, s in DECODE_SHAPES]
            label = f"{group}, {DTYPES[dtype]}"
            lines.append([label, "tvmattn"] + [fmt(r and r["gbps"]) for r in plain])

            def ratio_line(name, found):
                cells = []
                for r, p in zip(found, plain):
                    cells.append("-" if r is None else
                                 f"{fmt(r['gbps'])} ({r['gbps'] / p['gbps']:.3f})" if p else fmt(r["gbps"]))
                if any(r is not None for r in found):
                    lines.append(["", name] + cells)

            ratio_line("inline RoPE (/ plain)", [rows.get(used, impl="tvmattn-rope", batch=b, seq_len=s, **common)
                                                 for b, s in DECODE_SHAPES])
            ratio_line("sliding window (/ plain)", [window_row(rows, used, dtype, kv, b, s) for b, s in DECODE_SHAPES])
            for impl, name in (("sdpa", "torch SDPA"), ("tvm", "TVM's TIR kernel"),
                               ("flashinfer-decode", "FlashInfer, CUDA cores"),
                               ("flashinfer-decode-tc", "FlashInfer, tensor cores")):
                found = [rows.get(used, impl=impl, batch=b, seq_len=s, **common) for b, s in DECODE_SHAPES]
                if any(found):
                    lines.append(["", name] + [fmt(r and r["gbps"]) for r in found])
    d64 = dict(bench="kernels", kernel="decode", head_dim=64, num_qo_heads=32, num_kv_heads=32, batch=64, seq_len=4096)
    cells = []
    for dtype in ("float16", "bfloat16"):
        ours, sdpa, tvm = (rows.get(used, impl=i, dtype=dtype, **d64) for i in ("tvmattn", "sdpa", "tvm"))
        if ours:
            cells.append(f"{DTYPES[dtype]} {fmt(ours['gbps'])} (SDPA {fmt(sdpa and sdpa['gbps'])}"
                         + (f", TVM {fmt(tvm['gbps'])})" if tvm else ")"))
    grouped = []
    for batch, seq_len in ((64, 4096), (128, 8192)):
        shape = dict(bench="kernels", kernel="decode", dtype="bfloat16", head_dim=64, num_qo_heads=32, num_kv_heads=8,
                     batch=batch, seq_len=seq_len)
        ours, sdpa = (rows.get(used, impl=i, **shape) for i in ("tvmattn", "sdpa"))
        if ours:
            grouped.append(f"{batch}x{seq_len} {fmt(ours['gbps'])} (SDPA {fmt(sdpa and sdpa['gbps'])})")
    text = table(header, lines)
    if cells:
        text += "\n\nHead dim 64, group 1 (32 / 32 heads, the CUDA-core kernel), 64x4096: " + "; ".join(cells) + " GB/s."
    if grouped:
        text += "\n\nHead dim 64, group 4 (32 / 8 heads, bf16, the tensor-core kernel): " + "; ".join(grouped) + " GB/s."
    return text + "\n\n" + sources(used)


PREFILL_IMPLS = (("tvmattn", "tvmattn"), ("sdpa", "torch SDPA"), ("flashinfer-fa3", "FlashInfer FA3"),
                 ("flashinfer-fa2", "FlashInfer FA2"), ("tvm", "TVM's TIR kernel"))


def prefill_table(rows: Rows) -> str:
    used: set = set()
    points = sorted({(e[4]["kernel"], e[4]["dtype"], e[4]["head_dim"], e[4]["batch"], e[4]["seq_len"], e[4]["qo_len"])
                     for e in rows.find(bench="kernels", impl="tvmattn")
                     if e[4].get("kernel") in ("prefill", "ragged_prefill") and e[4].get("num_qo_heads") == 32},
                    key=lambda p: (p[0] != "prefill", p[1] != "float16", p[2], p[5] == 1, p[3] * p[5], p[4]))
    header = ["kernel", "dtype, head dim", "shape"] + [name for _, name in PREFILL_IMPLS]
    lines = []
    for kernel, dtype, head_dim, batch, seq_len, qo_len in points:
        cells = []
        for impl, _ in PREFILL_IMPLS:
            r = rows.get(used, bench="kernels", kernel=kernel, impl=impl, dtype=dtype, head_dim=head_dim,
                         num_qo_heads=32, batch=batch, seq_len=seq_len, qo_len=qo_len)
            cells.append(fmt(r and r["tflops"]))
        label = f"{batch}x{seq_len}" if qo_len == seq_len else f"{batch}x{qo_len}@{seq_len}"
        lines.append(["paged" if kernel == "prefill" else "ragged", f"{DTYPES[dtype]}, {head_dim}", label] + cells)
    return table(header, lines) + "\n\n" + sources(used)


def tree_table(rows: Rows) -> str:
    used: set = set()
    header = ["dtype", "tree", "tvmattn, tree mask", "tvmattn, causal", "tree / causal time", "TVM's tree kernel",
              "torch SDPA, boolean mask"]
    lines = []
    for dtype in ("float16", "bfloat16"):
        for tree in ("random", "chain"):
            common = dict(bench="kernels", kernel="tree_prefill", dtype=dtype, tree=tree)
            ours, causal, tvm, sdpa = (rows.get(used, impl=i, **common)
                                       for i in ("tvmattn", "tvmattn-causal", "tvm", "sdpa"))
            if not ours:
                continue
            lines.append([DTYPES[dtype], tree, fmt(ours["tflops"]), fmt(causal and causal["tflops"]),
                          f"{ours['ms'] / causal['ms']:.2f}" if causal else "-", fmt(tvm and tvm["tflops"]),
                          fmt(sdpa and sdpa["tflops"])])
    return table(header, lines) + "\n\n" + sources(used)


def mla_decode_table(rows: Rows) -> str:
    used: set = set()
    points = sorted({(e[4]["num_qo_heads"], e[4]["dtype"], e[4]["batch"], e[4]["seq_len"], e[4]["page_size"])
                     for e in rows.find(bench="kernels", kernel="mla_decode", impl="tvmattn")},
                    key=lambda p: (-p[0], p[1] != "float16", p[4], -p[2] * p[3], p[2]))
    header = ["heads", "dtype", "shape", "tvmattn (its pick)", "mma.sync kernel", "wgmma kernel", "TVM's MLA kernel",
              "torch einsum"]
    lines = []
    for heads, dtype, batch, seq_len, page in points:
        common = dict(bench="kernels", kernel="mla_decode", dtype=dtype, num_qo_heads=heads, batch=batch,
                      seq_len=seq_len, page_size=page)
        ours = rows.get(used, impl="tvmattn", **common)
        pick = str(ours.get("variant", "")).removeprefix("chosen ").split(":")[0]
        others = [rows.get(used, impl=i, **common) for i in ("tvmattn-tc", "tvmattn-wgmma", "tvm", "torch")]
        lines.append([str(heads), DTYPES[dtype], f"{batch}x{seq_len}" + ("" if page == 16 else f", page {page}"),
                      f"{fmt(ours['gbps'])} ({pick})"] + [fmt(r and r["gbps"]) for r in others])
    return table(header, lines) + "\n\n" + sources(used)


def mla_prefill_table(rows: Rows) -> str:
    used: set = set()
    points = sorted({(e[4]["part"], e[4]["dtype"], e[4]["num_qo_heads"], e[4]["batch"], e[4]["seq_len"], e[4]["qo_len"])
                     for e in rows.find(bench="kernels", kernel="mla_prefill")},
                    key=lambda p: (p[0] != "absorbed", p[1] != "float16", -p[2], p[3]))
    header = ["part", "dtype, heads", "shape", "tvmattn", "TVM's kernel", "torch SDPA"]
    lines = []
    for part, dtype, heads, batch, seq_len, qo_len in points:
        common = dict(bench="kernels", kernel="mla_prefill", part=part, dtype=dtype, num_qo_heads=heads, batch=batch,
                      seq_len=seq_len, qo_len=qo_len)
        ours = rows.get(used, impl="tvmattn", **common)
        chosen = rows.get(used, impl="tvmattn-k64s4", **common)
        if chosen:  # the schedule the chooser takes at these head dims, measured beside the then default
            cell = f"{fmt(chosen['tflops'])} (64-key tiles; 128-key: {fmt(ours and ours['tflops'])})"
        else:
            cell = fmt(ours and ours["tflops"])
        tvm, sdpa = (rows.get(used, impl=i, **common) for i in ("tvm", "sdpa"))
        if not (ours or chosen):
            continue
        label = f"{batch}x{seq_len}" if qo_len == seq_len else f"{batch}x{qo_len}@{seq_len}"
        lines.append([part, f"{DTYPES[dtype]}, {heads}", label, cell, fmt(tvm and tvm["tflops"]),
                      fmt(sdpa and sdpa["tflops"])])
    return table(header, lines) + "\n\n" + sources(used)


NULL_KERNELS = "null kernels"  # in the variant of bench_cache.py's --device host rows


def cache_table(rows: Rows) -> str:
    used: set = set()
    header = ["batch x context", "TVM's C++ cache + TVM's kernels", "TVM's C++ cache + tvmattn kernels",
              "tvmattn PagedKVCache", "wall: TVM's / ours"]
    lines = []
    points = sorted({(e[4]["batch"], e[4]["seq_len"], e[4]["variant"]) for e in rows.find(bench="cache", impl="tvmattn")
                     if NULL_KERNELS not in e[4]["variant"]})
    for batch, seq_len, variant in points:
        found = [rows.get(used, bench="cache", impl=i, batch=batch, seq_len=seq_len, variant=variant)
                 for i in ("tvm-cpp+tvm", "tvm-cpp+ours", "tvmattn")]
        cells = ["-" if r is None else f"{fmt(r['host_ms'])} / {fmt(r['ms'])}" for r in found]
        ratio = f"{found[0]['ms'] / found[2]['ms']:.2f}x" if found[0] and found[2] else "-"
        lines.append([f"{batch}x{seq_len}"] + cells + [ratio])
    return table(header, lines) + "\n\n" + sources(used)


def cache_host_table(rows: Rows) -> str:
    """The host paths alone (bench_cache.py --device host): host ms per decode step."""
    used: set = set()
    header = ["batch x context", "TVM's C++ cache + TVM's kernels", "tvmattn, direct calls",
              "tvmattn through tvmattn.*", "TVM's / ours through tvmattn.*"]
    lines = []
    points = sorted({(e[4]["batch"], e[4]["seq_len"], e[4]["variant"], e[4]["num_layers"])
                     for e in rows.find(bench="cache", impl="tvmattn-ffi") if NULL_KERNELS in e[4]["variant"]})
    for batch, seq_len, variant, layers in points:
        found = [rows.get(used, bench="cache", impl=i, batch=batch, seq_len=seq_len, variant=variant, num_layers=layers)
                 for i in ("tvm-cpp+tvm", "tvmattn", "tvmattn-ffi")]
        ratio = f"{found[0]['host_ms'] / found[2]['host_ms']:.2f}x" if found[0] and found[2] else "-"
        lines.append([f"{batch}x{seq_len}"] + [fmt(r and r["host_ms"]) for r in found] + [ratio])
    return table(header, lines) + "\n\n" + sources(used)


E2E_IMPLS = (("tvmattn", "tvmattn, eager"), ("tvmattn-cuda-graph", "tvmattn, CUDA graphs"),
             ("tvm-stock-cache", "TVM's stock cache"), ("tvmattn-cuda-graph-keep", "kept quantized, CUDA graphs"),
             ("tvmattn-flashinfer", "tvmattn + FlashInfer, eager"))


SMOLLM2_SHAPE = {"num_layers": 30, "num_qo_heads": 9}  # the e2e table's model (other shapes have rows too)
H200, H100 = DEFAULT_GPU, "NVIDIA H100 80GB HBM3"  # the e2e tables' devices (rows' `device`)
# rows of CUDA libraries with the fused decode ops in every decode function, which builds no longer
# make (models/export.py): never the e2e tables' configuration
E2E_UNLESS = {"fused_layers": "all", "dependent_launch": False}  # (the CPU runs; runs without the default PDL)


GEMMA3_SHAPE = {"num_layers": 18, "num_qo_heads": 4}  # scripts/gemma3-270m-config.json
LLAMA_1B_SHAPE = {"num_layers": 16, "num_qo_heads": 32}  # scripts/llama-3.2-1b-config.json


def e2e_points(rows: Rows, device: str, shape: dict = SMOLLM2_SHAPE) -> list[tuple]:
    points = {(e[4]["kernel"], e[4]["batch"]) for e in rows.find(bench="e2e", device=device, **shape)
              if e[4]["impl"] == "tvmattn-cuda-graph"}
    return sorted(points, key=lambda p: (p[0] != "prefill", p[1]))


def e2e_table(rows: Rows, device: str = H200, shape: dict = SMOLLM2_SHAPE) -> str:
    """bench_e2e.py's rows of one model (`shape`: its layers and query heads; SmolLM2 by
    default) on one GPU (`device`, the rows' field), without the runs built without programmatic
    dependent launch (a configuration of their own)."""
    used: set = set()
    header = ["step", *(name for _, name in E2E_IMPLS), "stock / graphs"]
    lines = []
    unless = E2E_UNLESS
    for kernel, batch in e2e_points(rows, device, shape):
        found = [rows.get(used, unless, bench="e2e", kernel=kernel, impl=i, batch=batch, device=device,
                          **shape) for i, _ in E2E_IMPLS]
        graphs, stock = found[1], found[2]
        label = f"prefill {found[1]['qo_len']} tokens" if kernel == "prefill" else f"decode, batch {batch}"
        lines.append([label] + [fmt(r and r["ms"]) for r in found]
                     + [f"{stock['ms'] / graphs['ms']:.2f}x" if graphs and stock else "-"])
    return table(header, lines) + "\n\n" + sources(used)


def engine_table(rows: Rows, device: str) -> str:
    """bench_engine.py's rows on one GPU: generated tokens per second of the serving engine
    waiting for each decode step's tokens against launching the next step first (lookahead)."""
    used: set = set()
    batches = sorted({e[4]["batch"] for e in rows.find(bench="engine", device=device)})
    lines = []
    for batch in batches:
        wait, ahead = (rows.get(used, bench="engine", variant=v, batch=batch, device=device)
                       for v in ("wait", "lookahead"))
        lines.append([str(batch), fmt(wait and wait["tokens_per_s"]), fmt(ahead and ahead["tokens_per_s"]),
                      fmt(wait and wait["ms"]), fmt(ahead and ahead["ms"]),
                      f"{ahead['tokens_per_s'] / wait['tokens_per_s']:.2f}x" if wait and ahead else "-"])
    header = ["batch", "wait, tok/s", "lookahead, tok/s", "wait, ms/step", "lookahead, ms/step", "lookahead / wait"]
    return table(header, lines) + "\n\n" + sources(used)


def kernels_table(rows: Rows, device: str, head_dim: int) -> str:
    """bench_kernels.py's rows of one head dim on one GPU: our decode (GB/s) and prefill
    (TFLOP/s) beside torch SDPA's."""
    used: set = set()
    points = sorted({(e[4]["kernel"], e[4]["dtype"], e[4]["batch"], e[4]["seq_len"], e[4]["qo_len"])
                     for e in rows.find(bench="kernels", impl="tvmattn", device=device, head_dim=head_dim)},
                    key=lambda p: (p[0] != "decode", p[1] != "float16", p[2] * p[4], p[3]))
    lines = []
    for kernel, dtype, batch, seq_len, qo_len in points:
        ours, sdpa = (rows.get(used, bench="kernels", kernel=kernel, impl=i, dtype=dtype, head_dim=head_dim,
                               batch=batch, seq_len=seq_len, qo_len=qo_len, device=device) for i in ("tvmattn", "sdpa"))
        rate = "gbps" if kernel == "decode" else "tflops"
        lines.append([kernel, DTYPES[dtype], shape_label(ours), f"{ours['num_qo_heads']} / {ours['num_kv_heads']}",
                      fmt(ours[rate]), fmt(sdpa and sdpa[rate]),
                      f"{ours[rate] / sdpa[rate]:.2f}" if sdpa else "-"])
    header = ["kernel", "dtype", "shape", "heads (q / kv)", "tvmattn", "torch SDPA", "tvmattn / SDPA"]
    return table(header, lines) + "\n\n" + sources(used)


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"  # the model of the cpu table (bench_cpu.py rows name their GGUF)
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"  # the model of the cpu-gemma3 table


def cpu_table(rows: Rows, model: str = SMOLLM2_GGUF) -> str:
    """bench_cpu.py's rows of one GGUF (`model`, the rows' file name)."""
    used: set = set()
    header = ["engine, weights", "prompt tokens/s", "decode tokens/s", "parameters", "model peak / GGUF", "run"]
    lines = []
    configs = dict.fromkeys((e[4]["impl"], e[4]["variant"], e[4].get("threads"))
                            for e in sorted(rows.find(bench="cpu", kernel="decode", model=model),
                                            key=lambda e: e[:3], reverse=True))
    for impl, variant, threads in configs:
        row = rows.get(used, bench="cpu", kernel="decode", impl=impl, variant=variant, threads=threads, model=model)
        prefill = rows.get(used, bench="cpu", kernel="prefill", impl=impl, variant=variant, threads=threads,
                           model=model)

        def rate(r):
            if r is None:
                return "-"
            best = r.get("best_tokens_per_s")
            return fmt(r["tokens_per_s"]) + (f" (best {fmt(best)})" if best else "")

        peak = row.get("model_peak_over_gguf")
        lines.append([f"{impl}, {variant}", rate(prefill), rate(row),
                      f"{row['params_bytes'] / 1e6:.1f} MB" if row.get("params_bytes") else "-",
                      f"{peak:.2f}" if peak else "-", f"{row.get('threads', '?')} threads, {row['date'][:10]}"])
    return table(header, lines) + "\n\n" + sources(used)


KEEP = "keep: "  # the variant prefix of speculative rows from a library that keeps the GGUF's blocks


def serve_cpu_table(rows: Rows) -> str:
    """bench_serve.py's load levels on the CPU: our server and llama-cpp-python's, on one workload."""
    used: set = set()
    header = ["server", "clients", "output tokens/s", "TTFT p50 / p99 (ms)", "inter-token p50 / p99 (ms)",
              "completed"]
    lines = []
    found = [e for e in rows.find(bench="serve", device="cpu") if "part" not in e[4]]
    for impl in dict.fromkeys(e[4]["impl"] for e in found):
        for clients in sorted({e[4]["concurrency"] for e in found if e[4]["impl"] == impl}):
            r = rows.get(used, bench="serve", device="cpu", impl=impl, concurrency=clients)
            lines.append([impl, str(clients), fmt(r["tokens_per_s"]), f"{fmt(r['ttft_p50_ms'])} / {fmt(r['ttft_p99_ms'])}",
                          f"{fmt(r['itl_p50_ms'])} / {fmt(r['itl_p99_ms'])}", f"{r['completed']}/{r['requests']}"])
    if not lines:
        return "(no rows)"
    r = found[0][4]
    return (table(header, lines) + f"\n\nPrompts of {r['prompt_len']} {r['prompt_unit']}, {r['output_len']} output "
            f"tokens, {r['requests']} requests a level.\n\n" + sources(used))


def speculative_table(rows: Rows) -> str:
    """Libraries with dequantized weights (float32 on the CPU, float16 on the H200)."""
    used: set = set()
    header = ["prompt", "mode", "CPU (llvm, float32) tokens/s", "H200 (float16) tokens/s"]
    lines = []
    found = [e for e in rows.find(bench="speculative") if not e[4]["variant"].startswith(KEEP)]
    modes = list(dict.fromkeys(e[4]["variant"] for e in found))
    for prompt in dict.fromkeys(e[4]["prompt"] for e in found):
        for mode in modes:
            cells = []
            for target in ("llvm", "cuda"):
                r = max((e for e in rows.find(bench="speculative", prompt=prompt, variant=mode)
                         if str(e[4].get("target", "")).split(":")[0] == target), key=lambda e: e[:3], default=None)
                if r is not None:
                    used.add((r[3], r[4].get("commit", "?"), str(r[4].get("date", ""))[:10]))
                    r = r[4]
                if r is None:
                    cells.append("-")
                    continue
                extra = [] if mode == "plain" else [f"{r['speedup']:.2f}x"]
                if r.get("acceptance_rate") is not None and mode != "plain":
                    extra.append(f"{100 * r['acceptance_rate']:.0f}% accepted")
                if r.get("identical") is False:
                    extra.append("answer differs")
                cells.append(fmt(r["tokens_per_s"]) + (f" ({', '.join(extra)})" if extra else ""))
            lines.append([prompt, mode] + cells)
    return table(header, lines) + "\n\n" + sources(used)


def speculative_keep_table(rows: Rows) -> str:
    """The CPU library that keeps the GGUF's blocks (the main job's): back-off (the default) and
    every-step runs, each against the plain runs interleaved with it."""
    used: set = set()
    header = ["prompt", "mode", "tokens/s (fastest rep)", "x plain (median of paired reps)", "drafts accepted",
              "verify / plain steps"]
    lines = []
    found = [e for e in rows.find(bench="speculative", target="llvm") if e[4]["variant"].startswith(KEEP)]

    def order(variant):  # each run's plain row first, the back-off run before the every-step one
        every = variant.endswith("every-step") or variant.endswith("(every-step run)")
        return every, not variant[len(KEEP):].startswith("plain")

    variants = sorted(dict.fromkeys(e[4]["variant"] for e in found), key=order)
    for prompt in dict.fromkeys(e[4]["prompt"] for e in found):
        for variant in variants:
            r = rows.get(used, bench="speculative", target="llvm", prompt=prompt, variant=variant)
            if r is None:
                continue
            mode = variant[len(KEEP):]
            if r.get("speedup_median") is None:  # a plain run
                lines.append([prompt, mode, fmt(r["tokens_per_s"]), "-", "-", "-"])
                continue
            accepted = f"{r['accepted']} of {r['drafted']}" if r.get("drafted") else "none drafted"
            lines.append([prompt, mode, fmt(r["tokens_per_s"]), f"{r['speedup_median']:.2f}x", accepted, f"{r['verify_steps']} / {r['plain_steps']}"
                          + ("" if r.get("identical", True) else ", answer differs")])
    return table(header, lines) + "\n\n" + sources(used)


def summary_table(rows: Rows) -> str:
    """The README's table: one line per area, tvmattn beside what it is compared with."""
    used: set = set()
    lines = []

    def add(what, ours, others):
        if ours is not None:
            lines.append([what, ours, ", ".join(o for o in others if o)])

    def rate(r, field):
        return None if r is None else fmt(r[field])

    dec = dict(bench="kernels", kernel="decode", dtype="float16", head_dim=128, num_qo_heads=32, num_kv_heads=8)
    for b, s in ((128, 8192), (1, 32768)):
        point = dict(dec, batch=b, seq_len=s)
        ours, sdpa, tvm = (rows.get(used, impl=i, **point) for i in ("tvmattn", "sdpa", "tvm"))
        add(f"paged decode, fp16, 32 / 8 heads, d128, {b}x{s} (GB/s)", rate(ours, "gbps"),
            [sdpa and f"torch SDPA {fmt(sdpa['gbps'])}", tvm and f"TVM {fmt(tvm['gbps'])}"])
    pre = dict(bench="kernels", kernel="prefill", dtype="float16", head_dim=128, num_qo_heads=32, batch=4,
               seq_len=4096, qo_len=4096)
    ours, sdpa, fa3, tvm = (rows.get(used, impl=i, **pre) for i in ("tvmattn", "sdpa", "flashinfer-fa3", "tvm"))
    add("causal paged prefill, fp16, d128, 4x4096 (TFLOP/s)", rate(ours, "tflops"),
        [sdpa and f"torch SDPA {fmt(sdpa['tflops'])}", fa3 and f"FlashInfer FA3 {fmt(fa3['tflops'])}",
         tvm and f"TVM {fmt(tvm['tflops'])}"])
    tree = dict(bench="kernels", kernel="tree_prefill", dtype="float16", tree="random")
    ours, tvm = rows.get(used, impl="tvmattn", **tree), rows.get(used, impl="tvm", **tree)
    if ours:
        add(f"token-tree prefill, {ours['batch']} x {ours['qo_len']}-node trees over {ours['history']} (TFLOP/s)",
            rate(ours, "tflops"), [tvm and f"TVM {fmt(tvm['tflops'])}"])
    mla = dict(bench="kernels", kernel="mla_decode", dtype="float16", num_qo_heads=128, batch=64, seq_len=4096,
               page_size=16)
    ours, torch_, tvm = (rows.get(used, impl=i, **mla) for i in ("tvmattn", "torch", "tvm"))
    add("MLA decode, fp16, 128 heads, 64x4096 (GB/s of latent)", rate(ours, "gbps"),
        [torch_ and f"torch {fmt(torch_['gbps'])}", tvm and f"TVM {fmt(tvm['gbps'])}"])
    mlp = dict(bench="kernels", kernel="mla_prefill", part="absorbed", dtype="float16", num_qo_heads=128, batch=1,
               seq_len=4096, qo_len=512)
    ours, sdpa, tvm = (rows.get(used, impl=i, **mlp) for i in ("tvmattn", "sdpa", "tvm"))
    add("MLA absorbed prefill, fp16, 128 heads, 1x512@4096 (TFLOP/s)", rate(ours, "tflops"),
        [sdpa and f"torch SDPA {fmt(sdpa['tflops'])}", tvm and f"TVM {fmt(tvm['tflops'])}"])
    for batch in (1, 16):
        e2e = dict(bench="e2e", kernel="decode", batch=batch, device=H200, **SMOLLM2_SHAPE)
        graphs = rows.get(used, E2E_UNLESS, impl="tvmattn-cuda-graph", **e2e)
        stock = rows.get(used, E2E_UNLESS, impl="tvm-stock-cache", **e2e)
        add(f"SmolLM2-135M decode step on the H200, batch {batch} (ms)",
            graphs and f"{fmt(graphs['ms'])} (CUDA graphs)", [stock and f"TVM's stock cache {fmt(stock['ms'])}"])
    e2e = dict(bench="e2e", kernel="decode", batch=64, device=H100, **GEMMA3_SHAPE)
    eager, graphs, stock = (rows.get(used, E2E_UNLESS, impl=i, **e2e)
                            for i in ("tvmattn", "tvmattn-cuda-graph", "tvm-stock-cache"))
    if eager and graphs:
        best = min((eager, "eager"), (graphs, "CUDA graphs"), key=lambda p: p[0]["ms"])
        add(f"Gemma 3 270M shapes, decode step on the H100, batch 64, {eager['seq_len']}-token prompts (ms)",
            f"{fmt(best[0]['ms'])} ({best[1]})", [stock and f"TVM's stock cache {fmt(stock['ms'])}"])
    waiting, ahead = (rows.get(used, bench="engine", variant=v, batch=16, device=H100) for v in ("wait", "lookahead"))
    if ahead:
        add("serving engine, SmolLM2-135M shapes on the H100, 16 requests (generated tokens/s)",
            f"{fmt(ahead['tokens_per_s'])} (lookahead)",
            [waiting and f"waiting for each step {fmt(waiting['tokens_per_s'])}"])
    ours = rows.get(used, bench="cpu", kernel="decode", impl="tvmattn", variant="keep", model=SMOLLM2_GGUF)
    llama = rows.get(used, bench="cpu", kernel="decode", impl="llama.cpp", model=SMOLLM2_GGUF)
    if ours:
        add(f"SmolLM2-135M Q4_1 decode on {ours.get('threads', 2)} CPU cores (tokens/s)", rate(ours, "tokens_per_s"),
            [llama and f"llama.cpp {fmt(llama['tokens_per_s'])}"])
    for kernel, what in (("prefill", "prompt"), ("decode", "decode")):
        ours = rows.get(used, bench="cpu", kernel=kernel, impl="tvmattn", variant="keep", model=GEMMA3_GGUF)
        llama = rows.get(used, bench="cpu", kernel=kernel, impl="llama.cpp", model=GEMMA3_GGUF)
        if ours:
            add(f"Gemma 3 270M Q4_K_M {what} on {ours.get('threads', 2)} CPU cores (tokens/s)",
                rate(ours, "tokens_per_s"), [llama and f"llama.cpp {fmt(llama['tokens_per_s'])}"])
    spec = dict(bench="speculative", target="llvm")
    backed = [rows.get(used, prompt=p, variant=KEEP + "prompt-lookup K=8 W=1", **spec) for p in ("code-edit", "free-form")]
    every = [rows.get(used, prompt=p, variant=KEEP + "prompt-lookup K=8 W=1 every-step", **spec)
             for p in ("code-edit", "free-form")]
    if all(backed):
        add("SmolLM2-135M Q4_1 prompt-lookup decoding on the CPU, code-edit / free-form prompt (x plain decode)",
            " / ".join(f"{r['speedup_median']:.2f}x" for r in backed) + " (backs off)",
            [all(every) and "drafting at every step " + " / ".join(f"{r['speedup_median']:.2f}x" for r in every)])
    files = ", ".join(f"`{name}`" for name in sorted({name for name, _, _ in used}))
    return (table(["what", "tvmattn", "compared with"], lines)
            + f"\n\nRows: {files} in `docs/bench/`; their runs and commands are in `docs/performance.md`.")


TABLES = {
    "decode": decode_table, "prefill": prefill_table, "tree": tree_table, "mla-decode": mla_decode_table,
    "mla-prefill": mla_prefill_table, "cache": cache_table, "cache-host": cache_host_table, "e2e": e2e_table,
    "e2e-h100": lambda rows: e2e_table(rows, H100),
    "e2e-gemma3-h100": lambda rows: e2e_table(rows, H100, GEMMA3_SHAPE),
    "e2e-llama-1b": lambda rows: e2e_table(rows, H200, LLAMA_1B_SHAPE),
    "engine-h100": lambda rows: engine_table(rows, H100),
    "kernels-d64-h100": lambda rows: kernels_table(rows, H100, 64),
    "serve-cpu": serve_cpu_table, "cpu": cpu_table, "cpu-gemma3": lambda rows: cpu_table(rows, GEMMA3_GGUF), "speculative": speculative_table, "speculative-keep": speculative_keep_table,
    "summary": summary_table,
}


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------
def replace_tables(text: str, tables: dict[str, str], path: str) -> str:
    """`text` with every marked table replaced (ValueError for an unknown name or an unclosed marker)."""
    def one(match):
        name = match.group(1)
        if name not in tables:
            raise ValueError(f"{path}: unknown table {name!r}; known: {sorted(tables)}")
        return f"<!-- table:{name} -->\n{tables[name]}\n<!-- /table:{name} -->"

    out = re.sub(r"<!-- table:([\w-]+) -->\n.*?<!-- /table:\1 -->", one, text, flags=re.S)
    opened = re.findall(r"<!-- table:([\w-]+) -->", out)
    closed = re.findall(r"<!-- /table:([\w-]+) -->", out)
    if opened != closed:
        raise ValueError(f"{path}: table markers do not pair up: {opened} against {closed}")
    return out


def render(folder: str = BENCH_DIR, paths=(PERFORMANCE, README)) -> dict[str, tuple[str, str]]:
    """{path: (current text, generated text)} of the files with tables."""
    rows = Rows(folder)
    tables = {name: make(rows) for name, make in TABLES.items()}
    out = {}
    for path in paths:
        with open(path) as f:
            text = f.read()
        out[path] = (text, replace_tables(text, tables, path))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when a table is not current")
    args = parser.parse_args(argv)
    stale = []
    for path, (old, new) in render().items():
        if old == new:
            continue
        stale.append(os.path.relpath(path, REPO))
        if not args.check:
            with open(path, "w") as f:
                f.write(new)
            print(f"rewrote the tables of {os.path.relpath(path, REPO)}")
    if args.check and stale:
        print("tables not current (run python scripts/perf_tables.py): " + ", ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
