"""Benchmark tvmattn's attention kernels beside TVM's own TIR kernels, torch SDPA and FlashInfer.

Kernels: paged decode (GB/s of K/V + q + o moved), causal paged prefill and, with --ragged,
causal ragged prefill (contiguous K/V; TFLOP/s of the causal work: 4 * B * Hq * D times the
keys each query sees, QK^T and PV at 2 flops per multiply-add). Every implementation runs in
one process on the same inputs, and every output is compared with torch SDPA's: "MISMATCH"
marks a max |diff| above 2e-2 (float16) or 5e-2 (bfloat16).

Token trees (speculative decoding), with --tree [BxN@L ...] (default 32x64@4160): B requests, each
a tree of N nodes (the queries) over L keys, the last N of which are the tree's nodes (L-N history
tokens before it); one row per tree form, a random tree per request (parents drawn with a fixed seed)
and a chain of N (which is plain causal attention). Implementations: tvmattn's tree_mask_paged_prefill
("tvmattn"), tvmattn's plain causal paged_prefill on the same tokens ("tvmattn-causal", the yardstick),
TVM's tree kernel (tree_attn_with_paged_kv_cache, page size 16 only) and SDPA with the tree's boolean
mask, which is the reference the tree rows are checked against (the causal row against causal SDPA).
Every tree_prefill row counts the causal FLOPs of the shape (the formula above, as for a causal
prefill of N tokens over L keys), whatever the mask hides, so that TFLOP/s ratios are time ratios;
ours/tvmattn-causal is the tree kernel's speed over the causal one's.

Shapes: decode BxL, B requests of L keys each. Prefill BxL, B requests of L new tokens each
and no history; or BxQ@L, chunked prefill: Q new tokens each over L keys in total (L-Q of them
cached before), causal: new token i sees keys j <= L-Q+i. Heads: 32 query / 8 KV.

Timing: the median of 5 samples of the mean time per call (CUDA events around a host loop of
calls: "eager", the host's launch cost included where it is the longer). Decode rows warm up
for DECODE_WARMUP_MS and sample at least DECODE_SAMPLE_MS; on CUDA each decode row of tvmattn,
TVM and SDPA has a second row (variant "cuda-graph ...", column "impl (graph)") of the same
calls replayed from a CUDA graph (the GPU's time alone; --no-graph leaves them out).

    python scripts/bench_kernels.py                                  # default shapes, fp16 + bf16
    python scripts/bench_kernels.py --decode --prefill 1x4096 8x512@8192 --dtype bfloat16 --json k.json
    python scripts/bench_kernels.py --decode --prefill --tree --json tree.json  # token trees only
    python scripts/bench_kernels.py --decode 8x32768 --prefill 1x4096 --dtype float16 --kv-dtype float8_e4m3fn
    python scripts/bench_kernels.py --from-json k.json --plot k.png  # no GPU needed
    python scripts/bench_kernels.py --mla --json mla.json            # MLA decode only (see its section)
    python scripts/bench_kernels.py --mla-prefill --dtype float16 --json mla.json  # MLA prefill only

FP8 K/V (--kv-dtype float8_e4m3fn|float8_e5m2): beside each decode and paged prefill row of
tvmattn, a row "tvmattn-fp8e4m3" / "tvmattn-fp8e5m2" of the same kernel built for FP8 pages (the
config's kv_dtype) on the same shape: the fp16/bf16 pages quantized per (K/V, KV head) at amax /
FP8_MAX, the scales in an extra last page laid out by the cache's own scale_page_pool. It is
checked against SDPA on the dequantized K/V ("max_abs_diff", the usual tolerance) and against SDPA
on the unquantized K/V ("max_abs_diff_vs_unquantized", within FP8_TOLERANCE); its decode GB/s
count one byte per K/V element, and "time_vs_fp16" is its time over tvmattn's fp16/bf16 row's.

MLA prefill (--mla-prefill; kernel "mla_prefill"): DeepSeek's self-attention over the new tokens
(ragged prefill, qk / v head dims 192 / 128, 128 or 16 heads, causal) and the absorbed paged prefill
(q [n, H, 576] over latent pages, o [n, H, 512], causal = 0), each beside TVM's kernel and SDPA;
see run_mla_prefill.

A run needs a CUDA GPU and torch. FlashInfer rows: from the modules built by
`python -m tvmattn.flashinfer.build` where they are present (decode on CUDA cores
"flashinfer-decode" and on tensor cores "flashinfer-decode-tc", prefill "flashinfer-fa2" and
"flashinfer-fa3"; no flashinfer package needed), else from the flashinfer package
(BatchPrefillWithPagedKVCacheWrapper, fa2 and, on sm_90, fa3) where `import flashinfer` works. --json writes the rows in the format of
docs/bench-format.md; --plot draws rate against context length (needs matplotlib).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import math
import os
import statistics
import sys
from typing import NamedTuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (REPO, os.path.join(REPO, "scripts")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from bench_rows import git_commit, now_iso, write_json

NUM_QO_HEADS, NUM_KV_HEADS = 32, 8
DTYPES = ("float16", "bfloat16")
HEAD_DIMS = (64, 128, 256)
DEFAULT_HEAD_DIMS = (128,)
DEFAULT_PAGE_SIZE = 16
DECODE_SHAPES = ["1x4096", "1x32768", "8x32768", "64x4096", "256x2048"]
PREFILL_SHAPES = ["1x4096", "4x4096", "1x16384", "8x512@8192"]
TREE_SHAPES = ["32x64@4160"]  # 32 trees of 64 nodes over 4096 history tokens
TREE_FORMS = ("random", "chain")
TREE_SEED = 0
TVM_TREE_PAGE_SIZE = 16  # TVM's paged tree kernel is written for this page size
KERNELS = ("decode", "prefill", "ragged_prefill", "tree_prefill", "mla_prefill")
TOLERANCE = {"float16": 2e-2, "bfloat16": 5e-2}
ELEM_BYTES = {"float16": 2, "bfloat16": 2}
KV_DTYPES = ("float8_e4m3fn", "float8_e5m2")
FP8_IMPL = {"float8_e4m3fn": "tvmattn-fp8e4m3", "float8_e5m2": "tvmattn-fp8e5m2"}
# Max |diff| of an FP8 row against SDPA on the unquantized K/V of the benchmark's N(0, 1) pages:
# a relative rounding step of 2^-4 (e4m3) or 2^-3 (e5m2) on values up to amax ~ 5, averaged by
# the softmax over many keys.
FP8_TOLERANCE = {"float8_e4m3fn": 0.1, "float8_e5m2": 0.2}
L2_BYTES = 60 << 20
IMPL_ORDER = ("tvmattn", "tvm", "sdpa")  # then flashinfer-* and anything else, by name
REFERENCE = "sdpa"
OURS = "tvmattn"
# Where a run's tensors live. "cuda" for a real run; the CPU ("cpu", kernels built for llvm) only
# serves to smoke-test this script's plumbing on a machine without a GPU (set it from Python).
DEVICE = "cuda"


# ---------------------------------------------------------------------------------------------
# Shapes, work counts and rows (pure Python: usable without a GPU)


class Shape(NamedTuple):
    """batch requests, qo_len new tokens each, seq_len keys each (qo_len = 1 for decode)."""

    batch: int
    qo_len: int
    seq_len: int

    @property
    def label(self) -> str:
        if self.qo_len in (1, self.seq_len):
            return f"{self.batch}x{self.seq_len}"
        return f"{self.batch}x{self.qo_len}@{self.seq_len}"


def parse_shape(text: str, kernel: str = "prefill") -> Shape:
    """Parse "BxL" (any kernel) or "BxQ@L" (prefill only); ValueError saying what was expected."""
    chunked = kernel != "decode"
    expected = "BxL or BxQ@L (for example 4x4096 or 8x512@8192)" if chunked else "BxL (for example 8x32768)"
    bad = ValueError(f"bad shape {text!r}: expected {expected}, positive integers")
    head, at, tail = str(text).partition("@")
    if at and not chunked:
        raise bad
    parts = head.split("x")
    if len(parts) != 2 or not all(p.isdigit() for p in parts) or (at and not tail.isdigit()):
        raise bad
    batch, first = int(parts[0]), int(parts[1])
    seq_len = int(tail) if at else first
    if min(batch, first, seq_len) <= 0:
        raise bad
    if kernel == "decode":
        return Shape(batch, 1, seq_len)
    if first > seq_len:
        raise ValueError(f"bad shape {text!r}: the new tokens Q={first} exceed the context L={seq_len}"
                         " (BxQ@L needs Q <= L)")
    return Shape(batch, first, seq_len)


def causal_visible_keys(qo_len: int, seq_len: int) -> int:
    """Sum over the qo_len new tokens of the keys each sees: token i sees j <= seq_len - qo_len + i."""
    if not 0 < qo_len <= seq_len:
        raise ValueError(f"need 0 < qo_len <= seq_len, got qo_len={qo_len}, seq_len={seq_len}")
    return qo_len * (seq_len - qo_len) + qo_len * (qo_len + 1) // 2


def causal_flops(batch: int, qo_len: int, seq_len: int, num_qo_heads: int, head_dim: int) -> int:
    """FLOPs of causal attention: QK^T and PV, 2 flops per multiply-add, over the visible keys only."""
    return 4 * batch * num_qo_heads * head_dim * causal_visible_keys(qo_len, seq_len)


def tree_parents(form: str, nodes: int, seed: int) -> list[int]:
    """Parent of each node of a token tree (-1: the root; parents come before children): a chain,
    or a random tree whose node i hangs under a node drawn uniformly from 0..i-1."""
    import random

    if form == "chain":
        return [i - 1 for i in range(nodes)]
    if form != "random":
        raise ValueError(f"bad tree form {form!r}: expected one of {TREE_FORMS}")
    rng = random.Random(seed)
    return [-1] + [rng.randrange(i) for i in range(1, nodes)]


def dfs_intervals(parents) -> list[tuple[int, int]]:
    """Each node's DFS interval [begin, end) (TVM's tree_attn_mask layout): node k is node q or an
    ancestor of it exactly when begin[k] <= begin[q] < end[k]."""
    children: list[list[int]] = [[] for _ in parents]
    for node, parent in enumerate(parents):
        if parent >= 0:
            children[parent].append(node)
    spans = [[0, 0] for _ in parents]
    counter = 0
    stack = [(node, False) for node in reversed(range(len(parents))) if parents[node] < 0]
    while stack:
        node, done = stack.pop()
        if done:
            spans[node][1] = counter
            continue
        spans[node][0] = counter
        counter += 1
        stack.append((node, True))
        stack.extend((child, False) for child in reversed(children[node]))
    return [tuple(span) for span in spans]


def tree_visible(parents, history: int) -> list[list[bool]]:
    """[N][history + N]: which keys each node sees (the history, its ancestors and itself),
    found by walking the parents (independent of the DFS intervals the kernels get)."""
    rows = []
    for node in range(len(parents)):
        row = [True] * history + [False] * len(parents)
        walk = node
        while walk >= 0:
            row[history + walk] = True
            walk = parents[walk]
        rows.append(row)
    return rows


def decode_bytes(batch: int, seq_len: int, num_qo_heads: int, num_kv_heads: int, head_dim: int, elem_bytes: int,
                 kv_elem_bytes: int | None = None) -> int:
    """Bytes a decode step must move: K and V of every request (kv_elem_bytes each, default
    elem_bytes), q in and o out."""
    kv_elem_bytes = elem_bytes if kv_elem_bytes is None else kv_elem_bytes
    return kv_elem_bytes * 2 * batch * seq_len * num_kv_heads * head_dim + elem_bytes * 2 * batch * num_qo_heads * head_dim


def rate_field(kernel: str) -> str:
    return "gbps" if kernel == "decode" else "tflops"


def make_row(kernel: str, impl: str, variant: str, dtype: str, head_dim: int, page_size: int, shape: Shape, ms: float,
             max_abs_diff: float | None, meta: dict, num_qo_heads: int = NUM_QO_HEADS,
             num_kv_heads: int | None = None) -> dict:
    """One flat row of docs/bench-format.md; the rate follows from the shape and `ms`
    (num_kv_heads: the module's NUM_KV_HEADS at the call, which --kv-heads sets, by default)."""
    num_kv_heads = NUM_KV_HEADS if num_kv_heads is None else num_kv_heads
    row = {"bench": "kernels", "kernel": kernel, "impl": impl, "variant": variant, "dtype": dtype, "head_dim": head_dim,
           "num_qo_heads": num_qo_heads, "num_kv_heads": num_kv_heads, "page_size": page_size, "batch": shape.batch,
           "seq_len": shape.seq_len, "qo_len": shape.qo_len, "ms": ms}
    if kernel == "decode":
        moved = decode_bytes(shape.batch, shape.seq_len, num_qo_heads, num_kv_heads, head_dim, ELEM_BYTES.get(dtype, 2))
        row["gbps"] = moved / ms / 1e6
    else:
        row["tflops"] = causal_flops(shape.batch, shape.qo_len, shape.seq_len, num_qo_heads, head_dim) / ms / 1e9
    if max_abs_diff is not None:
        row["max_abs_diff"] = max_abs_diff
        row["agrees"] = agrees(max_abs_diff, dtype)
    row.update(meta)
    return row


def agrees(diff: float, dtype: str) -> bool:
    return math.isfinite(diff) and diff <= TOLERANCE.get(dtype, 2e-2)


# ---------------------------------------------------------------------------------------------
# Tables, JSON and plots (from rows; no GPU)


def impl_sort_key(impl: str):
    """IMPL_ORDER first, then by name; an impl's " (graph)" column right after its eager one."""
    base, graph = (impl[:-len(" (graph)")], 1) if impl.endswith(" (graph)") else (impl, 0)
    return (IMPL_ORDER.index(base), "", graph) if base in IMPL_ORDER else (len(IMPL_ORDER), base, graph)


def short(impl: str) -> str:
    return impl.replace("flashinfer-", "fi-")


def _groups(rows, key):
    groups: dict = {}
    for row in rows:
        groups.setdefault(key(row), []).append(row)
    return groups


def _table_key(row):
    return (row["kernel"], row.get("dtype"), row.get("head_dim"), row.get("num_qo_heads"), row.get("num_kv_heads"),
            row.get("page_size"), row.get("device"), row.get("commit"))


def format_tables(rows) -> str:
    """One table per kernel kind / dtype / head dim (and device, commit): a line per shape with each
    implementation's time and rate, tvmattn's rate over each anchor's, and the agreement with SDPA."""
    out = []
    for (kernel, dtype, head_dim, hq, hkv, page_size, device, commit), group in _groups(rows, _table_key).items():
        field = rate_field(kernel)
        unit = "GB/s" if field == "gbps" else "TFLOP/s"
        impls = sorted({display_impl(r) for r in group}, key=impl_sort_key)
        anchors = [i for i in impls if i != OURS and not i.endswith(" (graph)")]  # ours/X: eager rows
        cells: dict = {}
        for r in group:
            cells.setdefault((r["batch"], r.get("qo_len", 1), r["seq_len"], r.get("tree")), {})[display_impl(r)] = r
        out.append(f"\n{kernel}, {dtype}, head_dim {head_dim}, {hq} q / {hkv} kv heads, page {page_size}: ms and {unit}"
                   f" ({device or 'unknown device'}, commit {commit or 'unknown'})")
        cell_w = 19
        label_w = 19 if any(r.get("tree") for r in group) else 12
        head = f"{'shape':>{label_w}} | " + " | ".join(f"{i:>{cell_w}}" for i in impls)
        if OURS in impls and anchors:
            head += " | " + " ".join(f"{'ours/' + short(a):>12}" for a in anchors)
        head += f" | max|diff| vs {REFERENCE}"
        out.append(head)
        for (batch, qo_len, seq_len, tree), by_impl in cells.items():
            label = Shape(batch, qo_len, seq_len).label + (f" {tree}" if tree else "")
            line = f"{label:>{label_w}} | " + " | ".join(
                f"{by_impl[i]['ms']:>9.3f} {by_impl[i][field]:>9.4g}" if i in by_impl else f"{'-':>{cell_w}}"
                for i in impls)
            if OURS in impls and anchors:
                ours = by_impl.get(OURS)
                ratios = [ours[field] / by_impl[a][field] if ours and a in by_impl and by_impl[a][field] else None
                          for a in anchors]
                line += " | " + " ".join(f"{'-':>12}" if r is None else f"{r:>12.2f}" for r in ratios)
            checks = []
            for i in impls:
                r = by_impl.get(i)
                if r is None or r.get("max_abs_diff") is None or i == REFERENCE:
                    continue
                ok = agrees(r["max_abs_diff"], dtype)
                checks.append(f"{short(i)}={r['max_abs_diff']:.1e}" + ("" if ok else " MISMATCH"))
            line += " | " + (" ".join(checks) or "-")
            out.append(line)
    if rows:
        out.append(f"(ours/X: {OURS}'s rate over X's, above 1 means {OURS} is faster;"
                   f" MISMATCH: max |diff| vs {REFERENCE} above {TOLERANCE['float16']:g} in float16,"
                   f" {TOLERANCE['bfloat16']:g} in bfloat16)")
    return "\n".join(out)


REQUIRED_FIELDS = ("kernel", "impl", "batch", "seq_len", "ms")


def load_rows(paths) -> list[dict]:
    """Rows of bench="kernels" from --json files; ValueError naming the file for anything else."""
    rows = []
    for path in paths:
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: cannot read the rows: {e}") from None
        if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
            raise ValueError(f"{path}: expected a JSON list of objects (rows written by --json)")
        for n, row in enumerate(data):
            if row.get("bench", "kernels") != "kernels":
                continue
            missing = [k for k in REQUIRED_FIELDS if k not in row]
            if missing or row["kernel"] not in KERNELS or rate_field(row["kernel"]) not in row:
                rate = "gbps" if row.get("kernel") == "decode" else "tflops"
                what = missing or [f"kernel in {KERNELS} with its rate ({rate})"]
                raise ValueError(f"{path}: row {n} lacks {', '.join(what)}")
            row.setdefault("qo_len", 1 if row["kernel"] == "decode" else row["seq_len"])
            rows.append(row)
    return rows


class PlotError(RuntimeError):
    pass


def import_pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PlotError("--plot needs matplotlib, which is not installed here (pip install matplotlib); save the"
                        " rows with --json PATH and plot them anywhere with --from-json PATH --plot PNG") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_rows(rows, path: str) -> None:
    """A PNG: rate against context length (keys per request), one line per (impl, batch), one
    subplot per kernel kind / dtype / head dim. Chunked-prefill shapes (Q < L) get lines of their own."""
    plt = import_pyplot()
    groups = _groups(rows, lambda r: (r["kernel"], r.get("dtype"), r.get("head_dim")))
    if not groups:
        raise PlotError("no rows to plot")
    impls = sorted({display_impl(r) for r in rows}, key=impl_sort_key)
    colors = {impl: f"C{n % 10}" for n, impl in enumerate(impls)}
    batches = sorted({r["batch"] for r in rows})
    markers = {b: "osD^v<>ph*"[n % 10] for n, b in enumerate(batches)}
    several_devices = len({r.get("device") for r in rows}) > 1
    ncols = min(3, len(groups))
    nrows = math.ceil(len(groups) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6 * ncols, 4.2 * nrows), squeeze=False)
    for ax, ((kernel, dtype, head_dim), group) in zip(axes.flat, groups.items(), strict=False):
        field = rate_field(kernel)

        def line_key(r, chunks=kernel != "decode"):
            qo_len = r.get("qo_len", 1)
            return (display_impl(r), r["batch"], qo_len if chunks and qo_len != r["seq_len"] else None,
                    r.get("device") if several_devices else None)

        def line_order(item):
            impl, batch, qo_len, device = item[0]
            return impl_sort_key(impl), batch, qo_len or 0, str(device)

        for (impl, batch, qo_len, device), line in sorted(_groups(group, line_key).items(), key=line_order):
            points = sorted(line, key=lambda r: r["seq_len"])
            label = f"{impl} B={batch}" + (f" Q={qo_len}" if qo_len else "") + (f" {device}" if device else "")
            ax.plot([r["seq_len"] for r in points], [r[field] for r in points], color=colors[impl],
                    marker=markers[batch], linestyle="--" if qo_len else "-", label=label)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{kernel}, {dtype}, head_dim {head_dim}")
        ax.set_xlabel("context length (keys per request)")
        ax.set_ylabel("GB/s" if field == "gbps" else "TFLOP/s")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(groups):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Command line


def _shape_type(kernel: str):
    def parse(text):
        try:
            return parse_shape(text, kernel)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = f"{kernel} shape"
    return parse


def _page_size(text):
    from tir_kernels.support import page_size_problem

    try:
        value = int(text)
    except ValueError:
        value = text
    problem = page_size_problem(value)
    if problem:
        raise argparse.ArgumentTypeError(f"bad page size {text!r}: expected {problem}")
    return value


def _non_negative_float(text):
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _arch(text):
    from tir_kernels.support import is_cuda_arch

    if not is_cuda_arch(text):
        raise argparse.ArgumentTypeError(f"bad CUDA arch {text!r}: expected one like sm_90 or sm_90a")
    return text


def add_decode_timing_arguments(parser) -> None:
    """--decode-warmup-ms and --decode-sample-ms (also scripts/tune_decode.py's)."""
    parser.add_argument("--decode-warmup-ms", type=_non_negative_float, default=DECODE_WARMUP_MS, metavar="MS",
                        help=f"decode: warm-up calls per row for at least this long (default: {DECODE_WARMUP_MS:g})")
    parser.add_argument("--decode-sample-ms", type=_non_negative_float, default=DECODE_SAMPLE_MS, metavar="MS",
                        help="decode: a timing sample is --iters calls or as many more as take this long"
                             f" (default: {DECODE_SAMPLE_MS:g})")


def decode_timing(ctx) -> dict:
    """time_ms / graph_time_ms keywords of a decode row: the context's warmup_ms / sample_ms
    (set from the command line), else the defaults."""
    return {"warmup_ms": getattr(ctx, "warmup_ms", DECODE_WARMUP_MS),
            "sample_ms": getattr(ctx, "sample_ms", DECODE_SAMPLE_MS)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decode", nargs="*", type=_shape_type("decode"), default=None, metavar="BxL",
                        help=f"decode shapes; give the flag alone to skip decode (default: {' '.join(DECODE_SHAPES)})")
    parser.add_argument("--prefill", nargs="*", type=_shape_type("prefill"), default=None, metavar="BxL|BxQ@L",
                        help="causal prefill shapes; give the flag alone to skip prefill"
                             f" (default: {' '.join(PREFILL_SHAPES)})")
    parser.add_argument("--ragged", action="store_true",
                        help="also bench the ragged prefill (tir_kernels.ragged_prefill, contiguous K/V) on the"
                             " prefill shapes")
    parser.add_argument("--tree", nargs="*", type=_shape_type("tree_prefill"), default=None, metavar="BxN@L",
                        help="token-tree rows: B trees of N nodes over L keys each (L-N history; a random tree"
                             " and a chain each), tvmattn's tree kernel beside its causal prefill and TVM's tree"
                             f" kernel; the flag alone: {' '.join(TREE_SHAPES)} (default: no tree rows)")
    parser.add_argument("--dtype", nargs="+", choices=DTYPES, default=list(DTYPES), help="dtypes (default: both)")
    parser.add_argument("--kv-dtype", nargs="+", choices=KV_DTYPES, default=[], metavar="FP8",
                        help="also bench tvmattn's decode and paged prefill on FP8 pages of these formats "
                             f"({', '.join(KV_DTYPES)}), beside the --dtype rows")
    parser.add_argument("--no-tvm", action="store_true", help="leave out TVM's own kernels (they take a build each)")
    parser.add_argument("--kv-heads", nargs="+", type=_positive_int, default=[NUM_KV_HEADS], metavar="N",
                        help=f"KV heads of the {NUM_QO_HEADS} query heads (GQA group {NUM_QO_HEADS} / N; "
                             f"default: {NUM_KV_HEADS})")
    parser.add_argument("--head-dim", nargs="+", type=int, choices=HEAD_DIMS, default=list(DEFAULT_HEAD_DIMS),
                        metavar="D", help=f"head dims, of {HEAD_DIMS} (default: {DEFAULT_HEAD_DIMS[0]})")
    parser.add_argument("--page-size", type=_page_size, default=DEFAULT_PAGE_SIZE,
                        help=f"tokens per page (default: {DEFAULT_PAGE_SIZE})")
    parser.add_argument("--decode-rope", action="store_true",
                        help="beside each decode row of tvmattn, the same kernel with inline RoPE (rotary_mode 1: "
                             "impl tvmattn-rope, keys at positions 0.., the query at L - 1), checked against SDPA "
                             "on the rotated q and K")
    parser.add_argument("--decode-window", action="store_true",
                        help="beside each decode row of tvmattn, its sliding-window build (impl tvmattn-window) "
                             "on the same pages: 4 sink tokens and the last 7/8 of each request's pages "
                             "(length_info [3, B]), GB/s of the keys it reads, checked against SDPA on them")
    parser.add_argument("--no-graph", action="store_true",
                        help="decode: leave out the rows of the same calls replayed from a CUDA graph (variant"
                             " \"cuda-graph ...\", beside each eager row on CUDA)")
    add_decode_timing_arguments(parser)
    parser.add_argument("--iters", type=_positive_int, default=20,
                        help="calls per timing sample, decode (prefill: a quarter, at least 3; default: 20)")
    parser.add_argument("--arch", type=_arch, default=None, help="CUDA arch to build for (default: the present GPU's)")
    parser.add_argument("--mla", nargs="*", type=_shape_type("decode"), default=None, metavar="BxL",
                        help="MLA decode only (DeepSeek latent 512 + rope 64): these shapes, or for the flag alone"
                             f" {' '.join(MLA_DECODE_SHAPES)}; heads --mla-decode-heads, page sizes"
                             " --mla-decode-page-sizes")
    parser.add_argument("--mla-decode-heads", nargs="+", type=_positive_int, default=list(MLA_DECODE_HEADS),
                        metavar="H", help=f"MLA decode query heads (default: {' '.join(map(str, MLA_DECODE_HEADS))})")
    parser.add_argument("--mla-decode-page-sizes", nargs="+", type=_page_size, default=list(MLA_DECODE_PAGE_SIZES),
                        metavar="P",
                        help=f"MLA decode page sizes (default: {' '.join(map(str, MLA_DECODE_PAGE_SIZES))})")
    parser.add_argument("--mla-decode-anchors", nargs="*", choices=MLA_DECODE_ANCHORS,
                        default=list(MLA_DECODE_ANCHORS),
                        help="MLA decode anchor kernels, timed at the first page size (default: both)")
    parser.add_argument("--mla-decode-variants", action="store_true",
                        help="MLA decode: also time other tensor-core schedules (at the first page size): the"
                             " wgmma decode's where it serves (sm_90), else mla_tc's")
    parser.add_argument("--json", metavar="PATH", help="write every row as a JSON list (docs/bench-format.md)")
    parser.add_argument("--plot", metavar="PNG", help="draw the rates against context length (needs matplotlib)")
    parser.add_argument("--from-json", nargs="+", metavar="PATH",
                        help="no run: print the tables (and --plot, --json) from rows saved by --json; no GPU needed")
    add_mla_prefill_arguments(parser)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.dtype, args.head_dim = list(dict.fromkeys(args.dtype)), list(dict.fromkeys(args.head_dim))
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder and not os.path.isdir(folder):
            parser.error(f"argument {option}: the folder of {path!r} does not exist")
    if args.from_json:
        try:
            rows = load_rows(args.from_json)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(format_tables(rows) if rows else "no kernel rows in " + " ".join(args.from_json))
        return finish(rows, args.json, args.plot)
    problem = gpu_problem()
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.mla_prefill is not None:
        return finish(run_mla_prefill(args), args.json, None)
    json_path = args.json
    if args.plot:
        try:
            import_pyplot()
        except PlotError as e:
            json_path = json_path or os.path.splitext(args.plot)[0] + ".json"
            print(f"warning: {e}; the rows go to {json_path}", file=sys.stderr)
    if args.mla is not None:
        shapes = args.mla or [parse_shape(s, "decode") for s in MLA_DECODE_SHAPES]
        return finish(run_mla_decode(args, shapes, args.mla_decode_heads, args.mla_decode_page_sizes), json_path, None)
    decode = [parse_shape(s, "decode") for s in DECODE_SHAPES] if args.decode is None else args.decode
    prefill = [parse_shape(s, "prefill") for s in PREFILL_SHAPES] if args.prefill is None else args.prefill
    rows = run(args, decode, prefill, tree_shapes(args.tree))
    return finish(rows, json_path, args.plot)


def tree_shapes(option) -> list:
    """The --tree shapes: none without the flag, TREE_SHAPES for the flag alone."""
    if option is None:
        return []
    return option or [parse_shape(s, "tree_prefill") for s in TREE_SHAPES]


def finish(rows, json_path, plot_path) -> int:
    if json_path:
        try:
            write_json(rows, json_path)
        except OSError as e:
            print(f"error: cannot write the rows to {json_path}: {e}", file=sys.stderr)
            return 2
        print(f"wrote {len(rows)} rows to {json_path}")
    if plot_path:
        try:
            plot_rows(rows, plot_path)
        except PlotError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"wrote {plot_path}")
    return 0


# ---------------------------------------------------------------------------------------------
# The GPU run (torch, TVM and FlashInfer imported here only)


def gpu_problem() -> str | None:
    """None where this machine can run the benchmark, else why not."""
    hint = "; to print or plot saved rows without a GPU: --from-json PATH [--plot PNG]"
    try:
        import torch
    except ImportError as e:
        return f"the benchmark needs torch ({e}){hint}"
    if not torch.cuda.is_available():
        return f"the benchmark needs a CUDA GPU, and torch sees none (torch.cuda.is_available() is False){hint}"
    import tvm

    if not tvm.cuda(0).exist:
        return f"torch sees a CUDA GPU but TVM does not (a TVM built without CUDA?){hint}"
    return None


class Context:
    """One (dtype, head dim) of a run: the config, the built kernels per kind
    (kind -> [(impl, variant, function)]), FlashInfer (None where absent) and its backends."""

    def __init__(self, config, meta: dict, flashinfer, fi_backends: list):
        self.config = config
        self.dtype, self.head_dim, self.page_size = config.dtype, config.head_dim, config.page_size
        self.meta = meta
        self.kernels: dict = {}
        self.flashinfer = flashinfer
        self.fi_backends = fi_backends
        self.workspace = None  # FlashInfer's, allocated on first use
        # the FlashInfer modules' workspaces (tvmattn.runtime.backends.FlashInferWorkspace), one per impl:
        # a plan writes its schedule into its workspace's int buffers, so two backends planned side by
        # side must not share one (the first one's run would read the second one's schedule)
        self.fi_workspaces: dict = {}
        self.no_tvm = False  # --no-tvm: no TVM kernels beside ours

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    @property
    def sm_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)


def skip(impl: str, kernel: str, ctx: Context, what: str, error: BaseException | str) -> None:
    text = str(error).strip().splitlines()
    reason = f"{type(error).__name__}: {text[-1] if text else ''}" if isinstance(error, BaseException) else error
    where = f"{kernel}, {ctx.dtype}, head_dim {ctx.head_dim}" + (f", {what}" if what else "")
    print(f"  skip {impl} ({where}): {reason[:300]}")


def to_tvm(t):
    import tvm

    return tvm.runtime.from_dlpack(t)


def synchronize() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


# Decode rows (eager and graph) are timed after at least DECODE_WARMUP_MS of calls (defaults of
# --decode-warmup-ms / --decode-sample-ms), so that clocks are up and caches and workspaces warm
# (a batch-1 call is so short that a few calls warm nothing), in samples of at least
# DECODE_SAMPLE_MS (a fixed count of such calls is too short a sample).
DECODE_WARMUP_MS = 100.0
DECODE_SAMPLE_MS = 5.0
MAX_SAMPLE_CALLS = 20000


def _warm_up(fn, calls: int, ms: float) -> float:
    """Call fn(0), fn(1), ... at least `calls` times and for at least `ms` ms (waiting for the
    GPU); returns the time per call of the warm-up in ms (host clock, after synchronizing)."""
    import time

    n, t0 = 0, time.perf_counter()
    while n < calls or (time.perf_counter() - t0) * 1e3 < ms:
        fn(n)
        n += 1
        if ms and n % 256 == 0:
            synchronize()  # the host must not run far ahead of the GPU it is timing
    synchronize()
    return (time.perf_counter() - t0) * 1e3 / max(n, 1)


def sample_calls(iters: int, per_call_ms: float, sample_ms: float) -> int:
    """Calls per timing sample: `iters`, or more where `iters` calls take under sample_ms."""
    if sample_ms <= 0 or per_call_ms <= 0:
        return iters
    return max(iters, min(MAX_SAMPLE_CALLS, math.ceil(sample_ms / per_call_ms)))


def time_ms(fn, iters: int, repeats: int = 5, warmup: int = 3, warmup_ms: float = 0.0,
            sample_ms: float = 0.0) -> float:
    """Median over `repeats` samples of the mean time per call (CUDA events), after warm-up calls
    (at least `warmup`, and for at least warmup_ms); a sample is `iters` calls, or as many more as
    take sample_ms (from the warm-up's time per call)."""
    import time

    import torch

    once = _warm_up(fn, warmup, warmup_ms)
    n = sample_calls(iters, once, sample_ms)
    samples = []
    for _ in range(repeats):
        if DEVICE != "cuda":
            t0 = time.perf_counter()
            for i in range(n):
                fn(i)
            samples.append((time.perf_counter() - t0) * 1e3 / n)
            continue
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(n):
            fn(i)
        stop.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(stop) / n)
    return float(statistics.median(samples))


def graph_time_ms(fn, iters: int, repeats: int = 5, warmup_ms: float = 0.0, sample_ms: float = 0.0,
                  tvm_stream: bool = True) -> float:
    """Median over `repeats` samples of the time per call replayed from one CUDA graph of the
    calls fn(0) .. fn(iters - 1) (captured on torch's capture stream; tvm_stream: TVM's launches
    too, through tvm_ffi.use_torch_stream): the GPU's time without the host's launch cost. The
    graph is replayed for at least warmup_ms first, and as often per sample as take sample_ms."""
    import torch

    graph = torch.cuda.CUDAGraph()
    capture = torch.cuda.graph(graph)
    if tvm_stream:
        import tvm_ffi

        capture = tvm_ffi.use_torch_stream(capture)
    with capture:
        for i in range(iters):
            fn(i)
    once = _warm_up(lambda i: graph.replay(), 2, warmup_ms)
    replays = sample_calls(1, once, sample_ms)
    samples = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        stop.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(stop) / (replays * iters))
    return float(statistics.median(samples))


def is_graph_row(row: dict) -> bool:
    """A row timed from a CUDA-graph replay (variant "cuda-graph ...")."""
    return str(row.get("variant", "")).startswith("cuda-graph")


def display_impl(row: dict) -> str:
    """The row's impl, with " (graph)" for a CUDA-graph row (a column of its own in the tables)."""
    return row["impl"] + (" (graph)" if is_graph_row(row) else "")


def max_diff(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


def sdpa(q, k, v, **kwargs):
    """torch SDPA with GQA (K/V heads repeated where this torch has no enable_gqa)."""
    import torch

    F = torch.nn.functional
    try:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs)
    except TypeError:
        group = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), **kwargs)


class Inputs:
    """B requests of L keys in `copies` page pools (shuffled page ids; several pools so that
    repeated decode calls do not just hit L2), the same K/V contiguous ([B, Hkv, L, D], for SDPA)
    and packed ([B*L, Hkv, D], for the ragged kernels); q of B*Q rows (decode: B)."""

    def __init__(self, ctx: Context, shape: Shape, copies: int, gen, ragged: bool = False):
        import torch

        B, Q, L, D, ps = shape.batch, shape.qo_len, shape.seq_len, ctx.head_dim, ctx.page_size
        dt, dev, i32 = ctx.torch_dtype, DEVICE, torch.int32
        pages_per_req = math.ceil(L / ps)
        num_pages = B * pages_per_req
        self.pools = [torch.randn((num_pages, 2, NUM_KV_HEADS, ps, D), generator=gen, device=dev, dtype=dt)
                      for _ in range(copies)]
        self.tvm_pools = [to_tvm(p) for p in self.pools]
        perm = torch.randperm(num_pages, generator=gen, device=dev).to(i32)
        self.page_indices = perm
        self.page_indptr = torch.arange(0, num_pages + 1, pages_per_req, device=dev, dtype=i32)
        self.last_page_len = torch.full((B,), L - (pages_per_req - 1) * ps, device=dev, dtype=i32)
        kv = self.pools[0][perm.long().view(B, pages_per_req)]  # [B, pages, 2, Hkv, ps, D]
        kv = kv.permute(0, 2, 3, 1, 4, 5).reshape(B, 2, NUM_KV_HEADS, pages_per_req * ps, D)
        self.k = kv[:, 0, :, :L].contiguous()
        self.v = kv[:, 1, :, :L].contiguous()
        del kv
        self.zeros_b = torch.zeros(B, device=dev, dtype=i32)
        self.q = torch.randn((B * Q, NUM_QO_HEADS, D), generator=gen, device=dev, dtype=dt)
        self.qo_indptr = torch.arange(0, B * Q + 1, Q, device=dev, dtype=i32)
        self.q_pos = torch.zeros(B * Q, device=dev, dtype=i32)
        if ragged:
            self.k_packed = self.k.transpose(1, 2).reshape(B * L, NUM_KV_HEADS, D).contiguous()
            self.v_packed = self.v.transpose(1, 2).reshape(B * L, NUM_KV_HEADS, D).contiguous()
            self.kv_indptr = torch.arange(0, B * L + 1, L, device=dev, dtype=i32)


def tvm_anchor_problem(kernel: str, dtype: str, head_dim: int) -> str | None:
    """Why TVM's own kernel cannot serve this case, or None. Its decode kernel assumes two-byte
    q/k/v elements (float16, bfloat16); head dims 64, 128 and 256 generate and build for sm_90 in
    TVM 0.27. Any other limit shows when it is built or first called, and is reported as a skip."""
    if dtype not in ("float16", "bfloat16"):
        return f"TVM's {kernel} kernel assumes two-byte elements, not {dtype}"
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} is not one this benchmark checked TVM's kernels for ({HEAD_DIMS})"
    return None


def tvm_anchor(kernel: str, config):
    from tvm.relax.frontend.nn.llm import _decode_kernels, _prefill_kernels

    hkv, hq, d, dtype, ps, target = (config.num_kv_heads, config.num_qo_heads, config.head_dim, config.dtype,
                                     config.page_size, config.tvm_target())
    if not config.is_gpu:  # the CPU smoke run
        if kernel == "decode":
            return _decode_kernels._attention_decode_cpu(hkv, hq, d, dtype, False, {}, ps)
        if kernel == "prefill":
            return _prefill_kernels._attention_prefill_cpu(hkv, hq, d, dtype, False, {}, ps)
        return _prefill_kernels._attention_prefill_ragged_cpu(hkv, hq, d, d, dtype, {})
    if kernel == "decode":
        return _decode_kernels._attention_decode(hkv, hq, d, dtype, False, {}, target, ps)
    if kernel == "prefill":
        return _prefill_kernels._attention_prefill(hkv, hq, d, dtype, False, {}, target, ps)
    return _prefill_kernels._attention_prefill_ragged(hkv, hq, d, d, dtype, {}, target)


def tvmattn_decode(config):
    """(variant, function) of tvmattn's decode as the cache runs it: each schedule the decode
    table picks for config (schedules.decode_variants: a schedule and its rope build's) compiled
    once, and where there are several, the one of the nearest measured shape picked per call on the host
    (tvmattn.runtime.kernels.DecodeByShape); paged_decode(config) where the table has none."""
    from tir_kernels import build, paged_decode
    from tir_kernels.schedules import decode_variant_label, decode_variants

    variants = decode_variants(config)
    if len(variants) == 1 and not variants[0][2]:  # no table entry: paged_decode's own choice
        func = paged_decode(config)
        return tvmattn_variant("decode", config, func), build(func, config)
    labels = "table: " + ", ".join(f"{decode_variant_label(sched, rope)} at " + " ".join(f"{b}x{n}" for b, n in shapes)
                                   for sched, rope, shapes in variants)
    if len(variants) == 1:
        return labels, build(paged_decode(config, variants[0][0], variants[0][1]), config)
    from tvmattn.runtime.kernels import DecodeByShape

    funcs = [(build(paged_decode(config, sched, rope), config), shapes) for sched, rope, shapes in variants]
    return labels, DecodeByShape(funcs, config.page_size)


def tvmattn_func(kernel: str, config):
    import tir_kernels

    return {"decode": tir_kernels.paged_decode, "prefill": tir_kernels.paged_prefill,
            "ragged_prefill": tir_kernels.ragged_prefill}[kernel](config)


def schedule_summary(schedule) -> str:
    if not dataclasses.is_dataclass(schedule):
        return type(schedule).__name__
    fields = ",".join(f"{f.name}={getattr(schedule, f.name)}" for f in dataclasses.fields(schedule))
    return f"{type(schedule).__name__}({fields})"


# Tensor-core paths, told apart by the instructions in the kernel's TIR, and where their
# schedule chooser may live (the first that exists is asked).
TENSOR_CORE_PATHS = (
    ("wgmma", "wgmma",
     (("prefill_sm90", "choose_wgmma_prefill_schedule"), ("schedules", "choose_wgmma_prefill_schedule"))),
    ("mma", "ptx.mma",
     (("prefill_sm80", "choose_mma_prefill_schedule"), ("schedules", "choose_mma_prefill_schedule"))),
)


def tvmattn_variant(kernel: str, config, func) -> str:
    """The path and schedule tvmattn chose: "wgmma ..." (Hopper) or "mma ..." (sm_80 tensor cores)
    where the kernel uses tensor cores, else the CUDA-core schedule."""
    import importlib

    text = str(func)
    path, choosers = "", (("schedules", "choose_decode_schedule" if kernel == "decode" else "choose_prefill_schedule"),)
    for name, marker, places in TENSOR_CORE_PATHS:
        if marker in text:
            path, choosers = name, places
            if kernel == "decode":  # the tensor-core decode (decode_tc.py) has a schedule of its own
                choosers = (("schedules", "choose_tc_decode_schedule"),)
            break
    summary = "default"
    for module, chooser in choosers:
        try:
            summary = schedule_summary(getattr(importlib.import_module(f"tir_kernels.{module}"), chooser)(config))
            break
        except Exception:  # noqa: BLE001 - the label is informative only
            continue
    return f"{path} {summary}" if path else summary


def build_jobs(kernel: str, ctx: Context) -> list:
    """[(impl, job)] for tvmattn and TVM of one kernel kind (not tree_prefill): job() compiles
    and returns (impl, variant, function). TVM's is left out with ctx.no_tvm, and with a skip
    line where it cannot serve the case."""
    from tir_kernels import build

    def ours():
        if kernel == "decode":
            return (OURS, *tvmattn_decode(ctx.config))
        func = tvmattn_func(kernel, ctx.config)
        return OURS, tvmattn_variant(kernel, ctx.config, func), build(func, ctx.config)

    def anchor():
        return "tvm", "tir", build(tvm_anchor(kernel, ctx.config), ctx.config)

    if ctx.no_tvm:
        return [(OURS, ours)]
    problem = tvm_anchor_problem(kernel, ctx.dtype, ctx.head_dim)
    if problem:
        skip("tvm", kernel, ctx, "", problem)
        return [(OURS, ours)]
    return [(OURS, ours), ("tvm", anchor)]


def collect_builds(kernel: str, ctx: Context, jobs) -> list:
    """[(impl, variant, function)] from [(impl, job or future)]; failures print a skip."""
    built = []
    for impl, job in jobs:
        try:
            built.append(job.result() if isinstance(job, concurrent.futures.Future) else job())
        except Exception as e:  # noqa: BLE001 - report and go on with the others
            skip(impl, kernel, ctx, "build", e)
    return built


def build_kernels(kernel: str, ctx: Context) -> list:
    """[(impl, variant, function)] of tvmattn and TVM for one kernel kind; failures print a skip."""
    if kernel == "tree_prefill":
        return build_tree_kernels(ctx)
    return collect_builds(kernel, ctx, build_jobs(kernel, ctx))


def import_flashinfer():
    try:
        import flashinfer
    except Exception:  # noqa: BLE001 - ImportError, or a broken install failing at import
        return None
    return flashinfer


def fi_wrapper(cls, ctx: Context, layout: str, backend: str | None):
    import torch

    if ctx.workspace is None:
        ctx.workspace = torch.empty(256 << 20, dtype=torch.uint8, device=DEVICE)
    if backend is None:
        return cls(ctx.workspace, layout)
    try:
        return cls(ctx.workspace, layout, backend=backend)
    except TypeError:  # a FlashInfer without backend choice: its one path is FA2
        if backend != "fa2":
            raise
        return cls(ctx.workspace, layout)


def fi_label(wrapper, backend: str) -> str:
    resolved = getattr(wrapper, "_backend", None)
    return "flashinfer-" + (resolved if isinstance(resolved, str) and resolved != "auto" else backend)


def into(run, out):
    """run(*tensors) writing into `out` (no allocation per call) where this FlashInfer takes out=."""
    takes_out = [True]

    def call(*tensors):
        if takes_out[0]:
            try:
                return run(*tensors, out=out)
            except TypeError:
                takes_out[0] = False
        return run(*tensors)

    return call


def flashinfer_calls(kernel: str, ctx: Context, inputs: Inputs) -> list:
    """[(impl, variant, call(i) -> output)] of FlashInfer for one kernel kind and shape."""
    import torch

    fi = ctx.flashinfer
    if fi is None:
        return []
    calls, seen = [], set()
    hq, hkv, d, ps, dt = NUM_QO_HEADS, NUM_KV_HEADS, ctx.head_dim, ctx.page_size, ctx.torch_dtype
    backends = [None] if kernel == "decode" else ctx.fi_backends
    for backend in backends:
        impl = "flashinfer-decode" if kernel == "decode" else f"flashinfer-{backend}"
        try:
            if kernel == "decode":
                w = fi_wrapper(fi.BatchDecodeWithPagedKVCacheWrapper, ctx, "HND", None)
                w.plan(inputs.page_indptr, inputs.page_indices, inputs.last_page_len, hq, hkv, d, ps,
                       pos_encoding_mode="NONE", sm_scale=ctx.sm_scale, q_data_type=dt, kv_data_type=dt)
                variant, run = "paged HND", into(w.run, torch.empty_like(inputs.q))

                def call(i, run=run):
                    return run(inputs.q, inputs.pools[i % len(inputs.pools)])
            elif kernel == "prefill":
                w = fi_wrapper(fi.BatchPrefillWithPagedKVCacheWrapper, ctx, "HND", backend)
                w.plan(inputs.qo_indptr, inputs.page_indptr, inputs.page_indices, inputs.last_page_len, hq, hkv, d, ps,
                       causal=True, sm_scale=ctx.sm_scale, q_data_type=dt, kv_data_type=dt)
                impl, variant, run = fi_label(w, backend), "paged HND", into(w.run, torch.empty_like(inputs.q))

                def call(i, run=run):
                    return run(inputs.q, inputs.pools[0])
            else:
                w = fi_wrapper(fi.BatchPrefillWithRaggedKVCacheWrapper, ctx, "NHD", backend)
                w.plan(inputs.qo_indptr, inputs.kv_indptr, hq, hkv, d, causal=True, sm_scale=ctx.sm_scale,
                       q_data_type=dt, kv_data_type=dt)
                impl, variant, run = fi_label(w, backend), "ragged NHD", into(w.run, torch.empty_like(inputs.q))

                def call(i, run=run):
                    return run(inputs.q, inputs.k_packed, inputs.v_packed)
        except Exception as e:  # noqa: BLE001 - an unsupported case of this FlashInfer
            skip(impl, kernel, ctx, "plan", e)
            continue
        if impl not in seen:
            seen.add(impl)
            calls.append((impl, variant, call))
    return calls


FI_MODULE_IMPLS = {  # kernel -> [(impl, module kind, decode flavour)] of the built FlashInfer modules
    "decode": [("flashinfer-decode", "decode", "cuda_core"), ("flashinfer-decode-tc", "prefill_fa2", "tensor_core")],
    "prefill": [("flashinfer-fa2", "prefill_fa2", None), ("flashinfer-fa3", "prefill_fa3", None)],
    "ragged_prefill": [("flashinfer-fa2", "prefill_fa2", None), ("flashinfer-fa3", "prefill_fa3", None)],
}


def module_calls(kernel: str, ctx: Context, inputs: Inputs) -> list:
    """[(impl, variant, call(i) -> output)] of the FlashInfer modules built by tvmattn.flashinfer
    (no flashinfer package needed), run through tvmattn's FlashInfer backends: planned once, then
    `run` with the arguments the backend's mha passes (precomputed, so that only the kernel is timed)."""
    import torch

    from tvmattn.flashinfer import FlashInferConfig, available, load
    from tvmattn.runtime import backends as fb

    if DEVICE != "cuda" or kernel not in FI_MODULE_IMPLS:
        return []
    arch = ctx.config.target.partition(":")[2]
    config = FlashInferConfig(ctx.dtype, ctx.head_dim, ctx.head_dim, False, "sm_90a" if arch == "sm_90" else arch)
    if config.problem() is not None:
        return []
    import tvm

    hq, hkv, d, ps, dt = NUM_QO_HEADS, NUM_KV_HEADS, ctx.head_dim, ctx.page_size, ctx.dtype
    host = {name: getattr(inputs, name).cpu().numpy() for name in ("qo_indptr", "page_indptr", "last_page_len")}
    batch = len(host["page_indptr"]) - 1
    calls = []
    for impl, kind, decode in FI_MODULE_IMPLS[kernel]:
        if not available(config, (kind,)):
            continue
        try:
            funcs = load(config, kind)
            if impl not in ctx.fi_workspaces:
                ctx.fi_workspaces[impl] = fb.FlashInferWorkspace(tvm.cuda(0))
            workspace = ctx.fi_workspaces[impl]
            o = torch.empty_like(inputs.q)
            lse = torch.empty(inputs.q.shape[:2], device=DEVICE, dtype=torch.float32)
            q, o_t, lse_t = to_tvm(inputs.q), to_tvm(o), to_tvm(lse)
            tail = (1.0, 1e4, ctx.sm_scale, o_t, lse_t)
            if kernel == "decode":
                cls = fb.FlashInferPagedDecode if decode == "cuda_core" else fb.FlashInferTensorCoreDecode
                backend = cls(funcs.run if decode == "cuda_core" else funcs.paged_run, funcs.plan)
                backend.bind(workspace)
                backend.begin_forward(0, host["page_indptr"], batch, ps, hq, hkv, d, d, fb.RopeMode.NONE, dt, dt)
                idx = [to_tvm(inputs.page_indptr), to_tvm(inputs.page_indices), to_tvm(inputs.last_page_len)]
                args = [backend.run_args(0, q, pool, *idx, None, None, fb.RopeMode.NONE, *tail)
                        for pool in inputs.tvm_pools]
                variant = "aot paged HND" + (" tensor-core" if decode == "tensor_core" else "")
            elif kernel == "prefill":
                backend = fb.FlashInferPagedPrefill(funcs.paged_run, funcs.plan)
                backend.bind(workspace)
                backend.begin_forward(0, host["qo_indptr"], host["page_indptr"], host["last_page_len"], batch,
                                      int(inputs.q.shape[0]), ps, hq, hkv, d, d, True)
                args = [backend.run_args(0, q, to_tvm(inputs.qo_indptr), inputs.tvm_pools[0],
                                         to_tvm(inputs.page_indptr), to_tvm(inputs.page_indices),
                                         to_tvm(inputs.last_page_len), None, None, True, fb.RopeMode.NONE, *tail)]
                variant = "aot paged HND"
            else:
                backend = fb.FlashInferRaggedPrefill(funcs.ragged_run, funcs.plan)
                backend.bind(workspace)
                kv_indptr = inputs.kv_indptr.cpu().numpy()
                backend.begin_forward(host["qo_indptr"], kv_indptr, batch, int(inputs.q.shape[0]), hq, hkv, d, d,
                                      True)
                args = [backend.run_args(q, to_tvm(inputs.k_packed), to_tvm(inputs.v_packed),
                                         to_tvm(inputs.qo_indptr), to_tvm(inputs.kv_indptr), None, None, True,
                                         fb.RopeMode.NONE, *tail)]
                variant = "aot ragged NHD"
        except Exception as e:  # noqa: BLE001 - report and go on with the others
            skip(impl, kernel, ctx, "plan", e)
            continue

        def call(i, run=backend.run, args=args, o=o):
            run(*args[i % len(args)])
            return o

        calls.append((impl, variant, call))
    return calls


def tvm_args(kernel: str, ctx: Context, inputs: Inputs, o, lse) -> list:
    """The contract's arguments of a decode / paged prefill / ragged prefill kernel."""
    rope = [1.0, 1e4, ctx.sm_scale]
    if kernel == "decode":
        return [to_tvm(inputs.q), inputs.tvm_pools[0], to_tvm(inputs.page_indptr), to_tvm(inputs.page_indices),
                to_tvm(inputs.last_page_len), to_tvm(inputs.zeros_b), to_tvm(inputs.q_pos), to_tvm(o), to_tvm(lse),
                0, *rope]
    if kernel == "prefill":
        return [to_tvm(inputs.q), to_tvm(inputs.qo_indptr), inputs.tvm_pools[0], to_tvm(inputs.page_indptr),
                to_tvm(inputs.page_indices), to_tvm(inputs.last_page_len), to_tvm(inputs.zeros_b), to_tvm(inputs.q_pos),
                to_tvm(o), to_tvm(lse), 1, 0, *rope]
    return [to_tvm(inputs.q), to_tvm(inputs.qo_indptr), to_tvm(inputs.k_packed), to_tvm(inputs.v_packed),
            to_tvm(inputs.kv_indptr), to_tvm(inputs.q_pos), to_tvm(inputs.zeros_b), to_tvm(o), to_tvm(lse), 1, 0, *rope]


def sdpa_reference(kernel: str, ctx: Context, shape: Shape, inputs: Inputs):
    """(variant, call(i) -> output shaped like q, output, diff of the timed form vs a boolean mask or None)."""
    import torch

    B, Q, L, D = shape.batch, shape.qo_len, shape.seq_len, ctx.head_dim
    if kernel == "decode":
        qs = inputs.q.view(B, NUM_QO_HEADS, 1, D)

        def dense(i):
            return sdpa(qs, inputs.k, inputs.v).view(B, NUM_QO_HEADS, D)

        return "dense", dense, dense(0), None
    qs = inputs.q.view(B, Q, NUM_QO_HEADS, D).transpose(1, 2)

    def caller(**kwargs):
        def call(i):
            return sdpa(qs, inputs.k, inputs.v, **kwargs).transpose(1, 2).reshape(B * Q, NUM_QO_HEADS, D)

        return call

    if Q == L:
        call = caller(is_causal=True)
        return "is_causal", call, call(0), None
    # Chunked prefill: query i sees keys j <= L - Q + i (bottom-right aligned). The boolean mask
    # is the definition; torch's causal_lower_right bias is the same and faster where it works.
    mask = torch.ones(Q, L, dtype=torch.bool, device=DEVICE).tril(diagonal=L - Q)
    call_masked = caller(attn_mask=mask)
    masked = call_masked(0)
    try:
        from torch.nn.attention.bias import causal_lower_right

        bias = causal_lower_right(Q, L)
        call = caller(attn_mask=bias)
        out = call(0)
        diff = max_diff(out, masked)
        if agrees(diff, ctx.dtype):
            return "causal_lower_right", call, out, diff
        print(f"  sdpa: causal_lower_right differs from the boolean mask by {diff:.1e}; timing the mask")
    except Exception as e:  # noqa: BLE001 - an older torch, or no kernel for it: time the mask
        print(f"  sdpa: causal_lower_right unusable ({type(e).__name__}: {e}); timing the boolean mask")
    return "bool-mask", call_masked, masked, None


def rope_torch(x, positions, theta: float = 1e4):
    """Rotate-half RoPE of x [..., n, D] at positions [n] (float32 arithmetic, x's dtype out)."""
    import torch

    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    xf = x.float()
    rotated = torch.cat([-xf[..., d // 2:], xf[..., : d // 2]], -1)
    return (xf * cos + rotated * sin).to(x.dtype)


def decode_rope_rows(ctx: Context, shape: Shape, inputs: Inputs, fn, args: list, iters: int, timing: dict,
                     graphs: bool, impl: str = "tvmattn", impl_variant: str = "") -> list[dict]:
    """Decode `impl` (function fn) with inline RoPE (rotary_mode 1, rope scale 1, theta 1e4; keys
    at positions 0..L-1, the query at L - 1) on the shape's inputs: its eager row (and graph
    row), impl "<impl>-rope", checked against SDPA over the rotated q and K. Same bytes moved as
    the plain row. (ctx.decode_rope_impls names the impls that get these rows: "tvmattn" by
    default, every candidate in scripts/tune_decode.py --rope.)"""
    import torch

    B, L, D = shape.batch, shape.seq_len, ctx.head_dim
    q_pos = torch.full((B,), L - 1, device=DEVICE, dtype=torch.int32)
    k_rot = rope_torch(inputs.k, torch.arange(L, device=DEVICE))
    q_rot = rope_torch(inputs.q.view(B, NUM_QO_HEADS, 1, D), q_pos[:1].expand(1))
    ref = sdpa(q_rot, k_rot, inputs.v).view(B, NUM_QO_HEADS, D)
    del k_rot
    o = torch.empty_like(inputs.q)
    lse = torch.empty(inputs.q.shape[:2], device=DEVICE, dtype=torch.float32)
    rope_args = list(args)
    rope_args[6], rope_args[7], rope_args[8], rope_args[9] = to_tvm(q_pos), to_tvm(o), to_tvm(lse), 1
    variant = "rotary_mode=1 " + (impl_variant or ctx.kernels["decode"][0][1])
    return variant_rows(ctx, f"{impl}-rope", variant, shape, fn, rope_args, inputs.tvm_pools, o, ref, iters, timing,
                        graphs)


def variant_rows(ctx: Context, impl: str, variant: str, shape: Shape, fn, args: list, pools: list, o, ref,
                 iters: int, timing: dict, graphs: bool) -> list[dict]:
    """The eager decode row (and with graphs the CUDA-graph row) of fn(*args), the page pool
    (argument 1) cycling over `pools`; its diff against ref is taken after the first call (the
    timed calls read other pools)."""
    def call(i):
        args[1] = pools[i % len(pools)]
        fn(*args)

    call(0)
    synchronize()
    diff = max_diff(o, ref)
    row = make_row("decode", impl, variant, ctx.dtype, ctx.head_dim, ctx.page_size, shape,
                   time_ms(call, iters, **timing), diff, ctx.meta)
    progress(row)
    rows = [row]
    if graphs:
        try:
            ms = graph_time_ms(call, iters, **timing)
        except Exception as e:  # noqa: BLE001 - reported, the eager row stands
            synchronize()
            skip(impl, "decode (cuda graph)", ctx, shape.label, e)
            return rows
        rows.append(make_row("decode", impl, f"cuda-graph {variant}", ctx.dtype, ctx.head_dim, ctx.page_size, shape,
                             ms, None, ctx.meta))
        progress(rows[-1])
    return rows


WINDOW_SINK = 4  # attention-sink tokens of the --decode-window rows


def decode_window_rows(ctx: Context, shape: Shape, inputs: Inputs, iters: int, timing: dict, graphs: bool) -> list[dict]:
    """tvmattn's decode built for sliding windows (length_info [3, B] = last page length, window
    offset, sink size), on the shape's pages: each request keeps its first page (WINDOW_SINK
    sink tokens) and its last 7/8 of pages, the window starting 3 slots into them. Rows of
    shape B x (visible keys): eager (and graph), checked against SDPA on the visible keys."""
    import torch

    if getattr(ctx, "window_kernel", None) is None:
        ctx.window_kernel = tvmattn_decode(ctx.config.replace(sliding_window=True))
    variant, fn = ctx.window_kernel
    B, L, D, ps = shape.batch, shape.seq_len, ctx.head_dim, ctx.page_size
    per_req = math.ceil(L / ps)
    first = per_req // 8
    if first < 1:
        return []
    offset = ps + 3  # the window's first slot in the kept page list [page 0, pages first..]
    kept = torch.cat([torch.zeros(1, dtype=torch.long), torch.arange(first, per_req)]).to(DEVICE)
    table = inputs.page_indices.view(B, per_req)[:, kept].reshape(-1).contiguous()
    indptr = torch.arange(0, B * len(kept) + 1, len(kept), device=DEVICE, dtype=torch.int32)
    info = torch.stack([inputs.last_page_len, torch.full_like(inputs.last_page_len, offset),
                        torch.full_like(inputs.last_page_len, WINDOW_SINK)]).contiguous()
    start = first * ps + 3  # the window's first token in the request
    visible = WINDOW_SINK + L - start
    k_vis = torch.cat([inputs.k[:, :, :WINDOW_SINK], inputs.k[:, :, start:]], 2)
    v_vis = torch.cat([inputs.v[:, :, :WINDOW_SINK], inputs.v[:, :, start:]], 2)
    ref = sdpa(inputs.q.view(B, NUM_QO_HEADS, 1, D), k_vis, v_vis).view(B, NUM_QO_HEADS, D)
    del k_vis, v_vis
    o = torch.empty_like(inputs.q)
    lse = torch.empty(inputs.q.shape[:2], device=DEVICE, dtype=torch.float32)
    args = [to_tvm(inputs.q), inputs.tvm_pools[0], to_tvm(indptr), to_tvm(table), to_tvm(info),
            to_tvm(inputs.zeros_b), to_tvm(inputs.q_pos), to_tvm(o), to_tvm(lse), 0, 1.0, 1e4, ctx.sm_scale]
    variant = f"sliding window (sink {WINDOW_SINK}, {visible} of {L} keys) {variant}"
    return variant_rows(ctx, "tvmattn-window", variant, Shape(B, 1, visible), fn, args, inputs.tvm_pools, o, ref,
                        iters, timing, graphs)


def copies_for(nbytes: int) -> int:
    return max(1, min(16, math.ceil(4 * L2_BYTES / nbytes)))


def bench_shape(kinds, ctx: Context, shape: Shape, iters: int, gen) -> list[dict]:
    """Rows of every implementation of `kinds` (one kernel kind, or the paged and ragged
    prefill) on one shape, all on the same inputs, checked against SDPA."""
    import torch

    decode = kinds == ["decode"]
    elem = ELEM_BYTES[ctx.dtype]
    pages = shape.batch * math.ceil(shape.seq_len / ctx.page_size)
    pool_bytes = pages * ctx.page_size * NUM_KV_HEADS * ctx.head_dim * 2 * elem
    inputs = Inputs(ctx, shape, copies_for(pool_bytes) if decode else 1, gen, ragged="ragged_prefill" in kinds)
    rows = []
    ref_kind = "decode" if decode else "prefill"
    variant, sdpa_call, ref, ref_diff = sdpa_reference(ref_kind, ctx, shape, inputs)
    synchronize()
    # decode: long warm-up and samples (time_ms), and beside each eager row one of the same calls
    # replayed from a CUDA graph (ctx.graph; variant "cuda-graph ...")
    timing = decode_timing(ctx) if decode else {}
    graphs = decode and DEVICE == "cuda" and getattr(ctx, "graph", False)

    def graph_row(impl, impl_variant, call, tvm_stream=True):
        try:
            ms = graph_time_ms(call, iters, tvm_stream=tvm_stream, **timing)
        except Exception as e:  # noqa: BLE001 - reported, the eager row stands
            synchronize()
            skip(impl, "decode (cuda graph)", ctx, shape.label, e)
            return []
        row = make_row("decode", impl, f"cuda-graph {impl_variant}", ctx.dtype, ctx.head_dim, ctx.page_size, shape,
                       ms, None, ctx.meta)
        progress(row)
        return [row]

    sdpa_ms = time_ms(sdpa_call, iters, **timing)
    for kernel in kinds:
        for impl, impl_variant, fn in ctx.kernels[kernel]:
            o = torch.empty_like(inputs.q)
            lse = torch.empty(inputs.q.shape[:2], device=DEVICE, dtype=torch.float32)
            args = tvm_args(kernel, ctx, inputs, o, lse)

            def call(i, fn=fn, args=args, pools=inputs.tvm_pools if kernel == "decode" else None):
                if pools:  # decode: the next page pool each call (pages are argument 1)
                    args[1] = pools[i % len(pools)]
                fn(*args)

            try:
                call(0)
                synchronize()
            except Exception as e:  # noqa: BLE001
                skip(impl, kernel, ctx, shape.label, e)
                continue
            diff = max_diff(o, ref)
            rows.append(make_row(kernel, impl, impl_variant, ctx.dtype, ctx.head_dim, ctx.page_size, shape,
                                 time_ms(call, iters, **timing), diff, ctx.meta))
            progress(rows[-1])
            if graphs:
                rows += graph_row(impl, impl_variant, call)
            if kernel == "decode" and getattr(ctx, "decode_rope", False) and impl in getattr(
                    ctx, "decode_rope_impls", ("tvmattn",)):
                rows += decode_rope_rows(ctx, shape, inputs, fn, args, iters, timing, graphs, impl, impl_variant)
            if kernel == "decode" and getattr(ctx, "decode_window", False) and impl == "tvmattn":
                rows += decode_window_rows(ctx, shape, inputs, iters, timing, graphs)
        for impl, impl_variant, fi_call in module_calls(kernel, ctx, inputs) or flashinfer_calls(kernel, ctx, inputs):
            print(f"  {kernel} {shape.label} {impl}: running", file=sys.stderr, flush=True)
            try:
                out = fi_call(0)
                synchronize()
            except Exception as e:  # noqa: BLE001
                skip(impl, kernel, ctx, shape.label, e)
                continue
            diff = max_diff(out.view(ref.shape), ref)
            rows.append(make_row(kernel, impl, impl_variant, ctx.dtype, ctx.head_dim, ctx.page_size, shape,
                                 time_ms(fi_call, iters, **timing), diff, ctx.meta))
            progress(rows[-1])
        rows.append(make_row(kernel, REFERENCE, variant, ctx.dtype, ctx.head_dim, ctx.page_size, shape, sdpa_ms,
                             ref_diff, ctx.meta))
        if graphs:
            rows += graph_row(REFERENCE, variant, sdpa_call, tvm_stream=False)
        fp16_ms = {is_graph_row(r): r["ms"] for r in rows if r["kernel"] == kernel and r["impl"] == OURS}
        for (fp8_kernel, fmt), (impl_variant, fn) in getattr(ctx, "fp8_kernels", {}).items():
            if fp8_kernel == kernel:
                rows += fp8_rows(kernel, fmt, ctx, shape, inputs, ref, fn, impl_variant, iters, timing, graphs,
                                 fp16_ms)
    del inputs
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return rows


def build_fp8_kernels(ctx: Context, kinds: list, kv_dtypes: list) -> dict:
    """{(kernel, fmt): (variant, function)} of tvmattn's decode / paged prefill built for FP8
    pages (ctx's config with kv_dtype=fmt); a kernel that does not build prints a skip."""
    from tir_kernels import build

    kernels = {}
    for fmt in dict.fromkeys(kv_dtypes):
        config = dataclasses.replace(ctx.config, kv_dtype=fmt)
        for kernel in kinds:
            try:
                if kernel == "decode":
                    kernels[(kernel, fmt)] = tvmattn_decode(config)
                else:
                    func = tvmattn_func(kernel, config)
                    kernels[(kernel, fmt)] = (tvmattn_variant(kernel, config, func), build(func, config))
            except Exception as e:  # noqa: BLE001 - report and go on with the others
                skip(FP8_IMPL[fmt], kernel, ctx, "build", e)
    return kernels


def fp8_pool(pool, fmt: str):
    """(codes, dequantized) of a page pool [P, 2, Hkv, ps, D] (float16/bfloat16): codes a tvm
    tensor [P + 1, 2, Hkv, ps, D] of `fmt` whose last page holds the scales (amax / FP8_MAX per
    K/V and KV head, laid out by the cache's scale_page_pool), dequantized a torch pool [P, ...]
    of code * scale in pool's dtype."""
    import numpy as np
    import torch

    from tir_kernels.support import FP8_MAX
    from tvmattn.runtime.cache import scale_page_pool

    amax = pool.abs().amax(dim=(0, 3, 4)).float()  # [2, Hkv]
    scales = torch.where(amax > 0, amax / FP8_MAX[fmt], torch.ones_like(amax))
    s = scales[None, :, :, None, None]
    codes = (pool.float() / s).clamp(-FP8_MAX[fmt], FP8_MAX[fmt]).to(getattr(torch, fmt))
    dequantized = (codes.float() * s).to(pool.dtype)
    extra = scale_page_pool((1, *pool.shape[1:]), fmt, scales.cpu().numpy()).view(np.uint8)
    raw = torch.cat([codes.view(torch.uint8), torch.from_numpy(extra).to(pool.device)]).contiguous()
    return to_tvm(raw)._create_view(tuple(raw.shape), fmt), dequantized, raw


def fp8_rows(kernel: str, fmt: str, ctx: Context, shape: Shape, inputs: Inputs, ref, fn, impl_variant: str, iters: int,
             timing: dict, graphs: bool, fp16_ms: dict) -> list[dict]:
    """Rows of tvmattn's `kernel` on FP8 pages (fp8_pool of the shape's pools; decode: enough
    copies to pass L2, as for fp16) on the shape's q, checked against SDPA on the dequantized
    and on the unquantized K/V (`ref`); fp16_ms: {graph row?: ms} of tvmattn's own rows."""
    import torch

    impl = FP8_IMPL[fmt]
    B, L, ps = shape.batch, shape.seq_len, ctx.page_size
    count = copies_for(inputs.pools[0].numel()) if kernel == "decode" else 1  # one byte an element
    made = [fp8_pool(inputs.pools[i % len(inputs.pools)], fmt) for i in range(count)]
    pools, keep = [m[0] for m in made], [m[2] for m in made]
    pages_per_req = math.ceil(L / ps)
    kv = made[0][1][inputs.page_indices.long().view(B, pages_per_req)].permute(0, 2, 3, 1, 4, 5)
    kv = kv.reshape(B, 2, NUM_KV_HEADS, pages_per_req * ps, ctx.head_dim)
    dequantized = Inputs.__new__(Inputs)  # the shape's inputs with the dequantized K/V
    dequantized.__dict__.update(inputs.__dict__)
    dequantized.k, dequantized.v = kv[:, 0, :, :L].contiguous(), kv[:, 1, :, :L].contiguous()
    del kv, made
    ref_fp8 = sdpa_reference(kernel, ctx, shape, dequantized)[2]
    o = torch.empty_like(inputs.q)
    lse = torch.empty(inputs.q.shape[:2], device=DEVICE, dtype=torch.float32)
    args = tvm_args(kernel, ctx, inputs, o, lse)
    slot = 1 if kernel == "decode" else 2
    args[slot] = pools[0]

    def call(i):
        args[slot] = pools[i % len(pools)]
        fn(*args)

    try:
        call(0)
        synchronize()
    except Exception as e:  # noqa: BLE001
        skip(impl, kernel, ctx, shape.label, e)
        return []
    diff, diff_exact = max_diff(o, ref_fp8), max_diff(o, ref)
    timed = [(impl_variant, time_ms(call, iters, **timing))]
    if graphs:
        try:
            timed.append((f"cuda-graph {impl_variant}", graph_time_ms(call, iters, **timing)))
        except Exception as e:  # noqa: BLE001 - reported, the eager row stands
            synchronize()
            skip(impl, "decode (cuda graph)", ctx, shape.label, e)
    rows = []
    for variant, ms in timed:
        row = make_row(kernel, impl, variant, ctx.dtype, ctx.head_dim, ctx.page_size, shape, ms, diff, ctx.meta)
        if kernel == "decode":
            row["gbps"] = decode_bytes(B, L, NUM_QO_HEADS, NUM_KV_HEADS, ctx.head_dim, ELEM_BYTES.get(ctx.dtype, 2),
                                       kv_elem_bytes=1) / ms / 1e6
        row.update(kv_dtype=fmt, max_abs_diff_vs_unquantized=diff_exact,
                   agrees_vs_unquantized=math.isfinite(diff_exact) and diff_exact <= FP8_TOLERANCE[fmt])
        base = fp16_ms.get(variant.startswith("cuda-graph"))
        if base:
            row["time_vs_fp16"] = ms / base
        progress(row)
        rows.append(row)
    del keep  # the torch storage under the tvm views, alive until the last call
    return rows


def progress(row: dict) -> None:
    """One line on stderr per measured row, as it is measured (the tables come at the end)."""
    print(f"  {row['kernel']} {row['impl']} {row['dtype']} b{row['batch']} L{row['seq_len']}: {row['ms']:.4f} ms",
          file=sys.stderr, flush=True)


OURS_CAUSAL = "tvmattn-causal"  # tree rows: tvmattn's plain causal paged prefill on the same tokens


def tvm_tree_anchor(config):
    from tvm.relax.frontend.nn.llm.tree_attn import (
        tree_attn_with_paged_kv_cache,
        tree_attn_with_paged_kv_cache_cpu,
    )

    args = (config.num_kv_heads, config.num_qo_heads, config.head_dim, config.dtype, {})
    if not config.is_gpu:  # the CPU smoke run
        return tree_attn_with_paged_kv_cache_cpu(*args)
    return tree_attn_with_paged_kv_cache(*args, config.tvm_target())


def build_tree_kernels(ctx: Context) -> list:
    """[(impl, variant, function)] for the tree rows: tvmattn's tree kernel, its causal paged prefill
    and TVM's tree kernel; failures print a skip."""
    import tir_kernels

    built = []
    for impl, generator in ((OURS, tir_kernels.tree_mask_paged_prefill), (OURS_CAUSAL, tir_kernels.paged_prefill)):
        try:
            func = generator(ctx.config)
            variant = tvmattn_variant("prefill", ctx.config, func) + ("" if impl == OURS else " causal")
            built.append((impl, variant, tir_kernels.build(func, ctx.config)))
        except Exception as e:  # noqa: BLE001 - report and go on with the others
            skip(impl, "tree_prefill", ctx, "build", e)
    problem = tvm_anchor_problem("tree_prefill", ctx.dtype, ctx.head_dim)
    if not problem and ctx.page_size != TVM_TREE_PAGE_SIZE:
        problem = f"TVM's paged tree kernel is written for page size {TVM_TREE_PAGE_SIZE}, not {ctx.page_size}"
    if problem:
        skip("tvm", "tree_prefill", ctx, "", problem)
        return built
    try:
        built.append(("tvm", "tir", tir_kernels.build(tvm_tree_anchor(ctx.config), ctx.config)))
    except Exception as e:  # noqa: BLE001
        skip("tvm", "tree_prefill", ctx, "build", e)
    return built


def bench_tree(ctx: Context, shape: Shape, iters: int, gen) -> list[dict]:
    """Rows of the token-tree kernels on one shape, for each tree form (see the module docstring):
    every request's queries are the N nodes of its tree, the last N of its L keys."""
    import torch

    B, N, L, D = shape.batch, shape.qo_len, shape.seq_len, ctx.head_dim
    history = L - N
    inputs = Inputs(ctx, shape, 1, gen)
    i32 = torch.int32
    mn_indptr = torch.arange(0, B * N + 1, N, device=DEVICE, dtype=i32)
    rope = [1.0, 1e4, ctx.sm_scale]
    qs = inputs.q.view(B, N, NUM_QO_HEADS, D).transpose(1, 2)
    rows = []
    _, causal_ref_call, causal_ref, _ = sdpa_reference("prefill", ctx, shape, inputs)
    del causal_ref_call
    for form in TREE_FORMS:
        trees = [tree_parents(form, N, TREE_SEED + b) for b in range(B)]
        intervals = torch.tensor([span for parents in trees for span in dfs_intervals(parents)], dtype=i32,
                                 device=DEVICE)
        mask = torch.tensor([tree_visible(parents, history) for parents in trees], dtype=torch.bool,
                            device=DEVICE).view(B, 1, N, L)

        def reference(i, mask=mask, k=inputs.k, v=inputs.v):
            return sdpa(qs, k, v, attn_mask=mask).transpose(1, 2).reshape(B * N, NUM_QO_HEADS, D)

        ref = reference(0)
        meta = {**ctx.meta, "tree": form, "history": history, "flops": "causal"}
        for impl, variant, fn in ctx.kernels["tree_prefill"]:
            o = torch.empty_like(inputs.q)
            lse = torch.empty(inputs.q.shape[:2], device=DEVICE, dtype=torch.float32)
            head = [to_tvm(inputs.q), to_tvm(inputs.qo_indptr), inputs.tvm_pools[0], to_tvm(inputs.page_indptr),
                    to_tvm(inputs.page_indices), to_tvm(inputs.last_page_len), to_tvm(inputs.zeros_b),
                    to_tvm(inputs.q_pos), to_tvm(o), to_tvm(lse)]
            if impl == OURS_CAUSAL:
                args, want = [*head, 1, 0, *rope], causal_ref
            else:
                args, want = [*head, 0, *rope, to_tvm(mn_indptr), to_tvm(intervals)], ref

            def call(i, fn=fn, args=args):
                fn(*args)

            try:
                call(0)
                synchronize()
            except Exception as e:  # noqa: BLE001
                skip(impl, "tree_prefill", ctx, f"{shape.label} {form}", e)
                continue
            rows.append(make_row("tree_prefill", impl, variant, ctx.dtype, D, ctx.page_size, shape,
                                 time_ms(call, iters), max_diff(o, want), meta))
        rows.append(make_row("tree_prefill", REFERENCE, "bool-mask", ctx.dtype, D, ctx.page_size, shape,
                             time_ms(reference, iters), None, meta))
    del inputs
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return rows


def run(args, decode_shapes, prefill_shapes, tree_shapes=()) -> list[dict]:
    import time

    import torch

    from tir_kernels import AttentionConfig
    from tir_kernels.support import resolve_target

    target = resolve_target("cuda", args.arch) if DEVICE == "cuda" else "llvm"
    arch = target.partition(":")[2]
    fi = import_flashinfer()
    print("flashinfer: not installed" if fi is None else f"flashinfer: {getattr(fi, '__version__', '?')}")
    fi_backends = ["fa2", "fa3"] if arch.startswith("sm_90") else ["fa2"]
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    meta = {"device": device, "date": now_iso(), "commit": git_commit()}
    print(f"{meta['device']} ({target}), commit {meta['commit']}, torch {torch.__version__}")
    kinds = (["decode"] if decode_shapes else []) + (["prefill"] if prefill_shapes else [])
    kinds += ["ragged_prefill"] if prefill_shapes and args.ragged else []
    kinds += ["tree_prefill"] if tree_shapes else []
    rows = []
    global NUM_KV_HEADS
    contexts = [Context(AttentionConfig(NUM_QO_HEADS, kv, head_dim, dtype=dtype, page_size=args.page_size,
                                        target=target), meta, fi, fi_backends)
                for kv in dict.fromkeys(args.kv_heads) for dtype in args.dtype for head_dim in args.head_dim]
    for ctx in contexts:
        ctx.no_tvm = getattr(args, "no_tvm", False)
        ctx.graph = not getattr(args, "no_graph", False)
        ctx.decode_rope = getattr(args, "decode_rope", False)
        ctx.decode_window = getattr(args, "decode_window", False)
        ctx.warmup_ms = getattr(args, "decode_warmup_ms", DECODE_WARMUP_MS)
        ctx.sample_ms = getattr(args, "decode_sample_ms", DECODE_SAMPLE_MS)
    # The decode kernels of every context are compiled at once, in threads (nvcc is a subprocess).
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=8) if DEVICE == "cuda" and "decode" in kinds else None
    decode_jobs = {id(ctx): [(impl, pool.submit(job)) for impl, job in build_jobs("decode", ctx)]
                   for ctx in contexts} if pool else {}
    for ctx in contexts:
        dtype, head_dim, config = ctx.dtype, ctx.head_dim, ctx.config
        NUM_KV_HEADS = config.num_kv_heads  # the inputs, byte counts and rows follow it
        t0 = time.time()
        for kernel in kinds:
            ctx.kernels[kernel] = (collect_builds(kernel, ctx, decode_jobs[id(ctx)]) if id(ctx) in decode_jobs
                                   and kernel == "decode" else build_kernels(kernel, ctx))
        ctx.fp8_kernels = build_fp8_kernels(ctx, [k for k in kinds if k in ("decode", "prefill")],
                                            getattr(args, "kv_dtype", []))
        print(f"{dtype}, head_dim {head_dim}, {NUM_QO_HEADS}/{NUM_KV_HEADS} heads: kernels built in "
              f"{time.time() - t0:.1f} s")
        group = []
        gen = torch.Generator(device=DEVICE).manual_seed(0)
        prefill_kinds = [k for k in kinds if k in ("prefill", "ragged_prefill")]
        todo = [(["decode"], shape, args.iters) for shape in decode_shapes]
        todo += [(prefill_kinds, shape, max(3, args.iters // 4)) for shape in prefill_shapes]
        todo += [(["tree_prefill"], shape, max(3, args.iters // 4)) for shape in tree_shapes]
        for shape_kinds, shape, iters in todo:
            try:
                if shape_kinds == ["tree_prefill"]:
                    group += bench_tree(ctx, shape, iters, gen)
                else:
                    group += bench_shape(shape_kinds, ctx, shape, iters, gen)
            except Exception as e:  # noqa: BLE001 - out of memory, say: keep the other shapes' rows
                skip("every impl", "/".join(shape_kinds), ctx, shape.label, e)
                if DEVICE == "cuda":
                    torch.cuda.empty_cache()
        print(format_tables(group))
        rows += group
    if pool:
        pool.shutdown()
    bad = [r for r in rows if r.get("agrees") is False]
    if bad:
        where = [f"{r['kernel']} {r['impl']} {r['dtype']} d{r['head_dim']} "
                 + Shape(r["batch"], r["qo_len"], r["seq_len"]).label for r in bad]
        print(f"MISMATCH in {len(bad)} rows: " + ", ".join(where))
    return rows


# ---------------------------------------------------------------------------------------------
# MLA decode (--mla): DeepSeek's latent attention, absorbed queries [B, H, latent + rope] against
# one latent row per token ([pages, page_size, latent + rope], shared by every head). Rate: GB/s
# of latent-cache read (B * L * (latent + rope) * element bytes per call). Implementations in one
# process on the same inputs: tvmattn's decode as the cache picks it (tensor cores on CUDA,
# "tvmattn"; on sm_90 per batch between mla_tc's split mma.sync kernel, "tvmattn-tc", and
# mla_sm90's wgmma one, "tvmattn-wgmma", both also timed alone), its SIMT kernel
# ("tvmattn-simt"), TVM's own MLA kernel (TVM 0.27 has only `_attention_prefill_mla`, which its
# cache runs for decode too: one query per request, causal 0;
# "tvm") and torch over the gathered latent (einsum, fp32 softmax; "torch"). The two anchor
# kernels run at the first page size only (they are slow to build and to run). Every output is
# compared with an fp32 torch reference over the unpaged latent.

MLA_DECODE_SHAPES = ["64x4096", "1x32768"]
MLA_DECODE_HEADS = (128, 16)  # DeepSeek-V2/V3, DeepSeek-V2-Lite
MLA_DECODE_PAGE_SIZES = (16, 64)
MLA_DECODE_LATENT, MLA_DECODE_ROPE = 512, 64
MLA_DECODE_SM_SCALE = 1.0 / math.sqrt(192.0)  # DeepSeek: from the original qk head dim 128 + 64
MLA_DECODE_IMPLS = ("tvmattn", "tvmattn-tc", "tvmattn-wgmma", "tvmattn-simt", "tvm", "torch")
MLA_DECODE_ANCHORS = ("tvmattn-simt", "tvm")
# --mla-decode-variants: other schedules of the wgmma decode (MLAWgmmaSchedule fields).
MLA_DECODE_WGMMA_VARIANTS = {"k64s2-split": dict(tile_kv=64, stages=2, split_keys=True)}
MLA_DECODE_SAMPLE_S = 0.05  # aim for about this much GPU time per timing sample


def mla_decode_read_bytes(batch: int, seq_len: int, qk_dim: int, elem_bytes: int) -> int:
    """Latent-cache bytes one MLA decode call reads: every request's rows, once."""
    return batch * seq_len * qk_dim * elem_bytes


def mla_decode_row(impl: str, variant: str, dtype: str, heads: int, page_size: int, shape: Shape, ms: float,
                   diff: float | None, meta: dict, latent: int = MLA_DECODE_LATENT,
                   rope: int = MLA_DECODE_ROPE) -> dict:
    """One row of docs/bench-format.md for kernel mla_decode."""
    row = {"bench": "kernels", "kernel": "mla_decode", "impl": impl, "variant": variant, "dtype": dtype,
           "head_dim": latent + rope, "latent_dim": latent, "rope_dim": rope, "num_qo_heads": heads,
           "num_kv_heads": 1, "page_size": page_size, "batch": shape.batch, "seq_len": shape.seq_len, "qo_len": 1,
           "ms": ms}
    row["gbps"] = mla_decode_read_bytes(shape.batch, shape.seq_len, latent + rope, ELEM_BYTES.get(dtype, 2)) / ms / 1e6
    if diff is not None:
        row["max_abs_diff"] = diff
        row["agrees"] = agrees(diff, dtype)
    row.update(meta)
    return row


def format_mla_decode_tables(rows) -> str:
    """One table per dtype / heads / page size: ms and GB/s per implementation, tvmattn's rate over
    each other's, and the max |diff| against the fp32 reference."""
    out = []
    key = lambda r: (r["dtype"], r["num_qo_heads"], r["page_size"], r.get("device"), r.get("commit"))  # noqa: E731
    for (dtype, heads, page_size, device, commit), group in _groups(rows, key).items():
        impls = sorted({r["impl"] for r in group}, key=lambda i: (MLA_DECODE_IMPLS + (i,)).index(i))
        others = [i for i in impls if i != OURS]
        out.append(f"\nmla_decode, {dtype}, {heads} heads, latent {group[0]['latent_dim']} + rope "
                   f"{group[0]['rope_dim']}, page {page_size}: ms and GB/s of latent read ({device}, commit {commit})")
        out.append(f"{'shape':>9} | " + " | ".join(f"{i:>19}" for i in impls)
                   + (" | " + " ".join(f"{'ours/' + i:>14}" for i in others) if OURS in impls else "")
                   + " | max|diff| vs fp32")
        for (batch, seq_len), by_impl in _groups(group, lambda r: (r["batch"], r["seq_len"])).items():
            by_impl = {r["impl"]: r for r in by_impl}
            line = f"{batch}x{seq_len:<7} | " + " | ".join(
                f"{by_impl[i]['ms']:>9.4f} {by_impl[i]['gbps']:>9.5g}" if i in by_impl else f"{'-':>19}" for i in impls)
            if OURS in by_impl:
                line += " | " + " ".join(f"{by_impl[OURS]['gbps'] / by_impl[i]['gbps']:>14.2f}" if i in by_impl
                                         else f"{'-':>14}" for i in others)
            line += " | " + " ".join(f"{i}={r['max_abs_diff']:.1e}" + ("" if r["agrees"] else " MISMATCH")
                                     for i, r in by_impl.items() if "max_abs_diff" in r)
            out.append(line)
    return "\n".join(out)


def mla_decode_time_ms(call, budget_iters: int) -> float:
    """time_ms with as many calls per sample as fit MLA_DECODE_SAMPLE_S (at most budget_iters; slow
    kernels: one call, one sample)."""
    import time

    t0 = time.perf_counter()
    call(0)
    synchronize()
    once = time.perf_counter() - t0
    iters = max(1, min(budget_iters, int(MLA_DECODE_SAMPLE_S / max(once, 1e-6))))
    if once > 0.05:
        return time_ms(call, 1, repeats=1, warmup=0)
    return time_ms(call, iters)


def mla_decode_variants(config) -> list:
    """Other tensor-core schedules to time beside the chosen one (--mla-decode-variants):
    (m_tiles, col_slices, stages, max_splits, target_blocks)."""
    from tir_kernels.mla_tc import MLATensorCoreSchedule, choose_mla_tc_schedule

    if config.num_heads > 16:
        shapes = [(4, 2, 2, 128, 132), (2, 4, 2, 128, 132), (4, 2, 3, 64, 132), (4, 2, 3, 128, 264)]
    else:
        shapes = [(1, 2, 4, 128, 132), (1, 2, 2, 128, 264), (1, 4, 2, 128, 264), (1, 4, 2, 64, 132)]
    chosen = choose_mla_tc_schedule(config)
    out = []
    for m, c, st, ms, tb in shapes:
        sched = MLATensorCoreSchedule(m, c, st, max_splits=ms, target_blocks=tb)
        try:
            sched.check(config)
        except ValueError:
            continue
        if sched != chosen:
            out.append(sched)
    return out


def mla_decode_kernels(config, anchors=("tvmattn-simt", "tvm"), variants: bool = False) -> list:
    """[(impl, variant, function, prefill-style arguments?)] built for one MLA config: tvmattn's
    as the cache runs it ("tvmattn": on sm_90 the kernel `choose_mla_decode_kernel` names for the
    call's batch; variant a function of the batch), its two tensor-core kernels on their own
    ("tvmattn-tc": mla_tc's split mma.sync decode, "tvmattn-wgmma": mla_sm90's), the `anchors`
    among tvmattn-simt and tvm (TVM's on CUDA only); with variants, also
    tvmattn[m,c,s,splits,blocks] for each of `mla_decode_variants`. A build that fails prints a
    skip."""
    import tir_kernels
    from tir_kernels.mla_sm90 import choose_mla_wgmma_schedule, mla_paged_decode_wgmma, mla_wgmma_decode_problem
    from tir_kernels.mla import choose_mla_decode_kernel, mla_paged_decode_auto
    from tir_kernels.mla_tc import choose_mla_tc_schedule, mla_paged_decode_tc, supports_tc

    built = []
    variant = ("tc:" + schedule_summary(choose_mla_tc_schedule(config))) if supports_tc(config) else "simt"
    wgmma = mla_wgmma_decode_problem(config) is None
    makers = [(f"{OURS}-tc" if wgmma else OURS, variant, lambda: mla_paged_decode_auto(config), False)]
    if wgmma:
        makers.append((f"{OURS}-wgmma", "wgmma:" + schedule_summary(choose_mla_wgmma_schedule(config)),
                       lambda: mla_paged_decode_wgmma(config), False))
    makers.append(("tvmattn-simt", schedule_summary(tir_kernels.choose_mla_schedule(config, True)),
                   lambda: tir_kernels.mla_paged_decode(config), False))
    if variants and wgmma:
        for name, fields in MLA_DECODE_WGMMA_VARIANTS.items():
            v = dataclasses.replace(choose_mla_wgmma_schedule(config), **fields)
            makers.append((f"{OURS}-wgmma-{name}", "wgmma:" + schedule_summary(v),
                           lambda v=v: mla_paged_decode_wgmma(config, v), False))
    if variants and supports_tc(config) and not wgmma:
        for v in mla_decode_variants(config):
            makers.append((f"tvmattn[{v.m_tiles},{v.col_slices},{v.stages},{v.max_splits},{v.target_blocks}]",
                           "tc:" + schedule_summary(v), lambda v=v: mla_paged_decode_tc(config, v), False))
    if "tvmattn-simt" not in anchors:
        makers = [m for m in makers if m[0] != "tvmattn-simt"]
    if "tvm" in anchors and config.is_gpu:
        from tvm.relax.frontend.nn.llm import _prefill_kernels

        makers.append(("tvm", "_attention_prefill_mla", lambda: _prefill_kernels._attention_prefill_mla(
            config.num_heads, config.latent_dim, config.rope_dim, config.dtype, False, config.tvm_target(),
            config.page_size), True))
    for impl, impl_variant, make, prefill_args in makers:
        try:
            built.append((impl, impl_variant, tir_kernels.build(make(), config), prefill_args))
        except Exception as e:  # noqa: BLE001 - report and go on with the others
            print(f"  skip {impl} (mla_decode, {config.dtype}, {config.num_heads} heads, page "
                  f"{config.page_size}, build): {type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}")
    funcs = {impl[len(OURS) + 1:]: (fn, v) for impl, v, fn, _ in built if impl in (f"{OURS}-tc", f"{OURS}-wgmma")}
    if wgmma and len(funcs) == 2:
        def chosen(*args):
            funcs[choose_mla_decode_kernel(config, int(args[0].shape[0]))][0](*args)

        built.insert(0, (OURS, lambda batch: "chosen " + funcs[choose_mla_decode_kernel(config, batch)][1],
                         chosen, False))
    return built


def bench_mla_decode_shape(config, kernels, shape: Shape, iters: int, gen, meta: dict) -> list[dict]:
    """Rows of every MLA implementation on one shape, on the same inputs, against the fp32
    reference over the unpaged latent."""
    import torch

    B, L, H, ps = shape.batch, shape.seq_len, config.num_heads, config.page_size
    D, DL, dt, dev = config.qk_dim, config.latent_dim, getattr(torch, config.dtype), DEVICE
    i32 = torch.int32
    per_req = math.ceil(L / ps)
    latent = torch.randn((B, per_req * ps, D), generator=gen, device=dev, dtype=dt)
    q = torch.randn((B, H, D), generator=gen, device=dev, dtype=dt)
    perm = torch.randperm(B * per_req, generator=gen, device=dev)
    pool = torch.empty((B * per_req, ps, D), device=dev, dtype=dt)
    pool[perm] = latent.reshape(B * per_req, ps, D)
    latent = latent[:, :L]
    copies = copies_for(pool.numel() * pool.element_size())
    pools = [pool] + [pool.clone() for _ in range(copies - 1)]
    page_indptr = torch.arange(0, B * per_req + 1, per_req, device=dev, dtype=i32)
    page_indices = perm.to(i32)
    last_len = torch.full((B,), L - (per_req - 1) * ps, device=dev, dtype=i32)
    qo_indptr = torch.arange(0, B + 1, device=dev, dtype=i32)
    s = torch.einsum("bhd,bld->bhl", q.float(), latent.float()) * MLA_DECODE_SM_SCALE
    ref = torch.einsum("bhl,bld->bhd", torch.softmax(s, -1), latent[..., :DL].float())
    del s
    rows = []
    tvm_pools = [to_tvm(p) for p in pools]
    for impl, variant, fn, prefill_args in kernels:
        o = torch.empty((B, H, DL), device=dev, dtype=dt)
        lse = torch.empty((B, H), device=dev, dtype=torch.float32)
        if prefill_args:
            args = [to_tvm(q), to_tvm(qo_indptr), None, to_tvm(page_indptr), to_tvm(page_indices), to_tvm(last_len),
                    to_tvm(o), to_tvm(lse), 0, MLA_DECODE_SM_SCALE]
            slot = 2
        else:
            args = [to_tvm(q), None, to_tvm(page_indptr), to_tvm(page_indices), to_tvm(last_len), to_tvm(o),
                    to_tvm(lse), MLA_DECODE_SM_SCALE]
            slot = 1

        def call(i, fn=fn, args=args, slot=slot):
            args[slot] = tvm_pools[i % len(tvm_pools)]
            fn(*args)

        try:
            call(0)
            synchronize()
        except Exception as e:  # noqa: BLE001
            print(f"  skip {impl} (mla_decode {shape.label}): {type(e).__name__}: {str(e).strip()[:300]}")
            continue
        diff = max_diff(o, ref)
        ms = mla_decode_time_ms(call, iters)
        variant = variant(B) if callable(variant) else variant
        rows.append(mla_decode_row(impl, variant, config.dtype, H, ps, shape, ms, diff, meta, DL, config.rope_dim))
        print(f"  mla_decode {impl} {config.dtype} h{H} ps{ps} {shape.label}: {rows[-1]['ms']:.4f} ms "
              f"{rows[-1]['gbps']:.1f} GB/s diff {diff:.2e}", file=sys.stderr, flush=True)

    def torch_call(i):
        s = torch.einsum("bhd,bld->bhl", q, latent)
        p = torch.softmax(s.float() * MLA_DECODE_SM_SCALE, -1).to(dt)
        return torch.einsum("bhl,bld->bhd", p, latent[..., :DL])

    diff = max_diff(torch_call(0), ref)
    ms = mla_decode_time_ms(torch_call, iters)
    rows.append(mla_decode_row("torch", "einsum over the gathered latent, fp32 softmax", config.dtype, H, ps, shape,
                               ms, diff, meta, DL, config.rope_dim))
    return rows


def run_mla_decode(args, shapes, heads=MLA_DECODE_HEADS, page_sizes=MLA_DECODE_PAGE_SIZES, latent=MLA_DECODE_LATENT,
                   rope=MLA_DECODE_ROPE) -> list:
    """Every MLA decode row of a run: dtypes x heads x page sizes x shapes."""
    import time

    import torch

    from tir_kernels import MLAConfig
    from tir_kernels.support import resolve_target

    target = resolve_target("cuda", args.arch) if DEVICE == "cuda" else "llvm"
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    meta = {"device": device, "date": now_iso(), "commit": git_commit()}
    print(f"{meta['device']} ({target}), commit {meta['commit']}, torch {torch.__version__}")
    rows = []
    for dtype in args.dtype:
        for h in heads:
            for ps in page_sizes:
                config = MLAConfig(h, latent_dim=latent, rope_dim=rope, dtype=dtype, page_size=ps, target=target)
                t0 = time.time()
                first = ps == page_sizes[0]
                anchors = getattr(args, "mla_decode_anchors", MLA_DECODE_ANCHORS) if first else ()
                kernels = mla_decode_kernels(config, anchors=anchors,
                                             variants=first and getattr(args, "mla_decode_variants", False))
                print(f"mla {dtype}, {h} heads, page {ps}: kernels built in {time.time() - t0:.1f} s", flush=True)
                gen = torch.Generator(device=DEVICE).manual_seed(0)
                group = []
                for shape in shapes:
                    try:
                        group += bench_mla_decode_shape(config, kernels, shape, args.iters, gen, meta)
                        if DEVICE == "cuda":
                            torch.cuda.empty_cache()
                    except Exception as e:  # noqa: BLE001 - out of memory, say: keep the other shapes' rows
                        print(f"  skip every impl (mla_decode {shape.label}): {type(e).__name__}: {e}")
                        if DEVICE == "cuda":
                            torch.cuda.empty_cache()
                print(format_mla_decode_tables(group), flush=True)
                rows += group
    bad = [r for r in rows if r.get("agrees") is False]
    if bad:
        print(f"MISMATCH in {len(bad)} mla rows: " + ", ".join(
            f"{r['impl']} {r['dtype']} h{r['num_qo_heads']} ps{r['page_size']} {r['batch']}x{r['seq_len']}"
            for r in bad))
    return rows


# MLA prefill (--mla-prefill): DeepSeek's two prefill kernels, each beside TVM's and SDPA.
#
# self-attention: tir_kernels.ragged_prefill at qk 192 / v 128 head dims, H query and H key heads,
#   causal, B requests of L new tokens (as the MLA cache's self_attention calls it);
# absorbed: tir_kernels.mla_paged_prefill, q [n, H, 576] over latent pages [P, page_size, 576],
#   o [n, H, 512]; BxQ@L: Q new tokens per request over its L cached rows, causal = 0 (as the
#   cache's cross_attention calls it over the history).
# Rows: kernel "mla_prefill", head_dim / v_head_dim 192 / 128 or 576 / 512 (field "part"),
# TFLOP/s = 2 (head_dim + v_head_dim) per query head and visible key; softmax scale 1/sqrt(192).

MLA_HEADS = (128, 16)
MLA_QK_DIM, MLA_V_DIM = 192, 128
MLA_LATENT, MLA_ROPE = 512, 64
MLA_SELF_SHAPES = ["1x4096", "4x2048", "16x512"]
MLA_ABSORBED_SHAPES = ["1x512@4096", "4x256@2048", "16x64@1024"]
MLA_SM_SCALE = 1.0 / math.sqrt(MLA_QK_DIM)
SLOW_MS = 50.0  # an implementation slower than this per call is timed with single calls
# --mla-variants: other schedules of the tensor-core absorbed prefill (MLAWgmmaSchedule fields
# over the chosen one; those that do not fit are left out).
MLA_ABSORBED_VARIANTS = {
    "k64s2-split": dict(tile_kv=64, stages=2, split_keys=True),
    "k32s4-split": dict(tile_kv=32, stages=4, split_keys=True),
    "k32s4-dup": dict(tile_kv=32, stages=4, split_keys=False),
    "r24-240": dict(producer_regs=24, consumer_regs=240),
}


def add_mla_prefill_arguments(parser) -> None:
    parser.add_argument("--mla-prefill", nargs="*", type=_shape_type("prefill"), default=None, metavar="BxL",
                        help="MLA prefill rows instead of the others: self-attention (ragged, 192/128, causal) on"
                             f" these shapes (the flag alone: {' '.join(MLA_SELF_SHAPES)}) and the absorbed paged"
                             " prefill on --mla-absorbed's")
    parser.add_argument("--mla-absorbed", nargs="*", type=_shape_type("prefill"), default=None, metavar="BxQ@L",
                        help="absorbed MLA prefill shapes (Q new tokens over L cached rows, causal = 0; default:"
                             f" {' '.join(MLA_ABSORBED_SHAPES)}; the flag alone: none)")
    parser.add_argument("--mla-absorbed-only", action="store_true",
                        help="absorbed prefill rows only: no self-attention rows and no CUDA-core / TVM anchors"
                             " (schedule comparisons)")
    parser.add_argument("--mla-heads", nargs="+", type=_positive_int, default=list(MLA_HEADS),
                        help=f"query heads of the MLA rows (default: {' '.join(map(str, MLA_HEADS))})")
    parser.add_argument("--mla-variants", action="store_true",
                        help="also time each tensor-core schedule the self-attention can take")


def mla_prefill_flops(part: str, shape: Shape, heads: int, causal: bool) -> int:
    """FLOPs of one MLA prefill call: 2 (qk + v dims) per query head and visible key."""
    dims = MLA_QK_DIM + MLA_V_DIM if part == "self-attention" else 2 * MLA_LATENT + MLA_ROPE
    keys = causal_visible_keys(shape.qo_len, shape.seq_len) if causal else shape.qo_len * shape.seq_len
    return 2 * dims * shape.batch * heads * keys


def mla_row(part: str, impl: str, variant: str, dtype: str, heads: int, page_size: int, shape: Shape, ms: float,
            diff, meta: dict) -> dict:
    causal = part == "self-attention"
    head_dim, v_dim = (MLA_QK_DIM, MLA_V_DIM) if causal else (MLA_LATENT + MLA_ROPE, MLA_LATENT)
    row = make_row("mla_prefill", impl, variant, dtype, head_dim, page_size, shape, ms, diff, meta, heads,
                   heads if causal else 1)
    flops = mla_prefill_flops(part, shape, heads, causal)
    row.update({"part": part, "v_head_dim": v_dim, "causal": causal, "flops": flops, "tflops": flops / ms / 1e9})
    if causal:  # ragged K/V: no pages
        del row["page_size"]
    return row


def timed(call, iters: int) -> float:
    """time_ms, with single calls for an implementation slower than SLOW_MS."""
    import time

    call(0)  # the first call loads the module
    synchronize()
    t0 = time.perf_counter()
    call(0)
    synchronize()
    if (time.perf_counter() - t0) * 1e3 > SLOW_MS:
        return time_ms(call, 1, repeats=3, warmup=0)
    return time_ms(call, iters)


def mla_self_kernels(config, variants: bool) -> list:
    """[(impl, variant, function)]: tvmattn's ragged prefill (and its schedule variants), TVM's."""
    import tir_kernels
    from tir_kernels.build import build
    from tir_kernels.schedules import WgmmaPrefillSchedule, choose_wgmma_prefill_schedule
    from tvm.relax.frontend.nn.llm import _prefill_kernels

    built = []
    todo = [(OURS, None)]
    if variants:
        chosen = choose_wgmma_prefill_schedule(config)
        for tile_kv, stages in ((128, 2), (64, 4)):
            sched = WgmmaPrefillSchedule(tile_kv=tile_kv, stages=stages)
            if sched != chosen:
                todo.append((f"{OURS}-k{tile_kv}s{stages}", sched))
    for impl, sched in todo:
        try:
            func = tir_kernels.ragged_prefill(config, sched) if sched else tir_kernels.ragged_prefill(config)
            built.append((impl, tvmattn_variant("ragged_prefill", config, func) if sched is None
                          else f"wgmma {schedule_summary(sched)}", build(func, config)))
        except Exception as e:  # noqa: BLE001 - report and go on with the others
            print(f"  skip {impl} (mla self-attention, {config.dtype}, {config.num_qo_heads} heads): {e}")
    try:
        func = _prefill_kernels._attention_prefill_ragged(config.num_kv_heads, config.num_qo_heads, MLA_QK_DIM,
                                                          MLA_V_DIM, config.dtype, {}, config.tvm_target())
        built.append(("tvm", "tir", build(func, config)))
    except Exception as e:  # noqa: BLE001
        print(f"  skip tvm (mla self-attention, {config.dtype}): {type(e).__name__}: {str(e)[:300]}")
    return built


def mla_absorbed_kernels(config, variants: bool, anchors: bool = True) -> list:
    """[(impl, variant, function)]: tvmattn's MLA paged prefill (tensor cores where it applies, and
    the CUDA-core kernel as "tvmattn-simt"; with variants the other tensor-core schedule), TVM's."""
    import tir_kernels
    from tir_kernels.build import build
    from tir_kernels.mla import choose_mla_schedule
    from tir_kernels.mla_sm90 import choose_mla_wgmma_schedule

    from tvm.relax.frontend.nn.llm import _prefill_kernels

    simt = choose_mla_schedule(config, decode=False)
    makers = [(OURS, lambda: tir_kernels.mla_paged_prefill(config))]
    if anchors:
        makers.append((f"{OURS}-simt", lambda: tir_kernels.mla_paged_prefill(config, simt)))
    if variants:
        chosen = choose_mla_wgmma_schedule(config)
        for name, fields in MLA_ABSORBED_VARIANTS.items():
            other = dataclasses.replace(chosen, **fields)
            try:
                other.check(config)
            except ValueError:
                continue
            if other != chosen:
                makers.append((f"{OURS}-{name}", lambda other=other: tir_kernels.mla_paged_prefill(config, other)))
    built = []
    for impl, make in makers:
        try:
            func = make()
            variant = "wgmma" if "wgmma" in str(func) else "simt"
            built.append((impl, variant, build(func, config)))
        except Exception as e:  # noqa: BLE001
            print(f"  skip {impl} (mla absorbed, {config.dtype}): {type(e).__name__}: {str(e)[:300]}")
    if not anchors:
        return built
    try:
        func = _prefill_kernels._attention_prefill_mla(config.num_heads, config.latent_dim, config.rope_dim,
                                                       config.dtype, False, config.tvm_target(), config.page_size)
        built.append(("tvm", "tir", build(func, config)))
    except Exception as e:  # noqa: BLE001
        print(f"  skip tvm (mla absorbed, {config.dtype}): {type(e).__name__}: {str(e)[:300]}")
    return built


def bench_mla_self(kernels, config, shape: Shape, iters: int, gen, meta: dict) -> list[dict]:
    """Causal self-attention rows of one shape: every kernel on the same ragged q, k, v, against SDPA."""
    import torch

    B, Q, L, H = shape.batch, shape.qo_len, shape.seq_len, config.num_qo_heads
    dt, i32 = getattr(torch, config.dtype), torch.int32
    q = torch.randn((B * Q, H, MLA_QK_DIM), generator=gen, device=DEVICE, dtype=dt)
    k = torch.randn((B * L, H, MLA_QK_DIM), generator=gen, device=DEVICE, dtype=dt)
    v = torch.randn((B * L, H, MLA_V_DIM), generator=gen, device=DEVICE, dtype=dt)
    qo_indptr = torch.arange(0, B * Q + 1, Q, device=DEVICE, dtype=i32)
    kv_indptr = torch.arange(0, B * L + 1, L, device=DEVICE, dtype=i32)
    zeros_b, q_pos = torch.zeros(B, device=DEVICE, dtype=i32), torch.zeros(B * Q, device=DEVICE, dtype=i32)
    qs, ks, vs = (t.view(B, -1, H, t.shape[-1]).transpose(1, 2) for t in (q, k, v))
    if Q == L:
        mask = {"is_causal": True}
    else:
        mask = {"attn_mask": torch.ones(Q, L, dtype=torch.bool, device=DEVICE).tril(diagonal=L - Q)}

    def reference(i):
        return torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, scale=MLA_SM_SCALE, **mask).transpose(
            1, 2).reshape(B * Q, H, MLA_V_DIM)

    ref = reference(0)
    rows = []
    for impl, variant, fn in kernels:
        o = torch.empty((B * Q, H, MLA_V_DIM), device=DEVICE, dtype=dt)
        lse = torch.empty((B * Q, H), device=DEVICE, dtype=torch.float32)
        args = [to_tvm(q), to_tvm(qo_indptr), to_tvm(k), to_tvm(v), to_tvm(kv_indptr), to_tvm(q_pos),
                to_tvm(zeros_b), to_tvm(o), to_tvm(lse), 1, 0, 1.0, 1e4, MLA_SM_SCALE]
        try:
            ms = timed(lambda i, fn=fn, args=args: fn(*args), iters)
        except Exception as e:  # noqa: BLE001
            print(f"  skip {impl} (mla self-attention {shape.label}): {type(e).__name__}: {str(e)[:300]}")
            continue
        rows.append(mla_row("self-attention", impl, variant, config.dtype, H, 0, shape, ms, max_diff(o, ref), meta))
        progress(rows[-1])
    rows.append(mla_row("self-attention", REFERENCE, "is_causal" if Q == L else "bool-mask", config.dtype, H, 0,
                        shape, timed(reference, iters), None, meta))
    return rows


def bench_mla_absorbed(kernels, config, shape: Shape, iters: int, gen, meta: dict) -> list[dict]:
    """Absorbed rows of one shape (causal = 0): the kernels on one shuffled latent page pool,
    against SDPA over the same rows gathered (every head's key the whole row, its value the latent)."""
    import torch

    B, Q, L, H, ps = shape.batch, shape.qo_len, shape.seq_len, config.num_heads, config.page_size
    D, DL = config.qk_dim, config.latent_dim
    dt, i32 = getattr(torch, config.dtype), torch.int32
    per_req = math.ceil(L / ps)
    pages = torch.randn((B * per_req, ps, D), generator=gen, device=DEVICE, dtype=dt)
    page_indices = torch.randperm(B * per_req, generator=gen, device=DEVICE).to(i32)
    page_indptr = torch.arange(0, B * per_req + 1, per_req, device=DEVICE, dtype=i32)
    last_len = torch.full((B,), L - (per_req - 1) * ps, device=DEVICE, dtype=i32)
    rows_kv = pages[page_indices.long()].view(B, per_req * ps, D)[:, :L]  # [B, L, D]
    q = torch.randn((B * Q, H, D), generator=gen, device=DEVICE, dtype=dt)
    qo_indptr = torch.arange(0, B * Q + 1, Q, device=DEVICE, dtype=i32)
    qs = q.view(B, Q, H, D).transpose(1, 2)
    ks = rows_kv.unsqueeze(1)  # [B, 1, L, D]
    vs = rows_kv[..., :DL].unsqueeze(1).contiguous()
    ks = ks.contiguous()

    def reference(i):
        return sdpa(qs, ks, vs, scale=MLA_SM_SCALE).transpose(1, 2).reshape(B * Q, H, DL)

    ref = reference(0)
    rows = []
    for impl, variant, fn in kernels:
        o = torch.empty((B * Q, H, DL), device=DEVICE, dtype=dt)
        lse = torch.empty((B * Q, H), device=DEVICE, dtype=torch.float32)
        args = [to_tvm(q), to_tvm(qo_indptr), to_tvm(pages), to_tvm(page_indptr), to_tvm(page_indices),
                to_tvm(last_len), to_tvm(o), to_tvm(lse), 0, MLA_SM_SCALE]
        try:
            ms = timed(lambda i, fn=fn, args=args: fn(*args), iters)
        except Exception as e:  # noqa: BLE001
            print(f"  skip {impl} (mla absorbed {shape.label}): {type(e).__name__}: {str(e)[:300]}")
            continue
        rows.append(mla_row("absorbed", impl, variant, config.dtype, H, ps, shape, ms, max_diff(o, ref), meta))
        progress(rows[-1])
    try:
        rows.append(mla_row("absorbed", REFERENCE, "gqa", config.dtype, H, ps, shape, timed(reference, iters), None,
                            meta))
    except Exception as e:  # noqa: BLE001
        print(f"  skip sdpa timing (mla absorbed {shape.label}): {type(e).__name__}: {str(e)[:300]}")
    return rows


def run_mla_prefill(args) -> list[dict]:
    """The --mla-prefill run: per dtype and head count, self-attention then absorbed rows."""
    import time

    import torch

    from tir_kernels import AttentionConfig, MLAConfig
    from tir_kernels.support import resolve_target

    target = resolve_target("cuda", args.arch)
    meta = {"device": torch.cuda.get_device_name(), "date": now_iso(), "commit": git_commit()}
    print(f"{meta['device']} ({target}), commit {meta['commit']}, torch {torch.__version__}")
    self_shapes = args.mla_prefill or [parse_shape(s) for s in MLA_SELF_SHAPES]
    quick = getattr(args, "mla_absorbed_only", False)
    if quick:
        self_shapes = []
    absorbed = [parse_shape(s) for s in MLA_ABSORBED_SHAPES] if args.mla_absorbed is None else args.mla_absorbed
    iters = max(2, args.iters // 4)
    rows = []
    for dtype in args.dtype:
        for heads in dict.fromkeys(args.mla_heads):
            group = []
            gen = torch.Generator(device=DEVICE).manual_seed(0)
            t0 = time.time()
            config = AttentionConfig(heads, heads, MLA_QK_DIM, v_head_dim=MLA_V_DIM, dtype=dtype, target=target)
            kernels = mla_self_kernels(config, args.mla_variants) if self_shapes else []
            print(f"{dtype}, {heads} heads: self-attention kernels built in {time.time() - t0:.1f} s")
            for shape in self_shapes:
                try:
                    group += bench_mla_self(kernels, config, shape, iters, gen, meta)
                except Exception as e:  # noqa: BLE001 - out of memory, say: keep the other rows
                    print(f"  skip mla self-attention {shape.label}: {type(e).__name__}: {str(e)[:300]}")
                torch.cuda.empty_cache()
            if absorbed:
                t0 = time.time()
                mla = MLAConfig(heads, latent_dim=MLA_LATENT, rope_dim=MLA_ROPE, dtype=dtype, page_size=args.page_size,
                                target=target)
                kernels = mla_absorbed_kernels(mla, args.mla_variants, anchors=not quick)
                print(f"{dtype}, {heads} heads: absorbed kernels built in {time.time() - t0:.1f} s")
                for shape in absorbed:
                    try:
                        group += bench_mla_absorbed(kernels, mla, shape, iters, gen, meta)
                    except Exception as e:  # noqa: BLE001
                        print(f"  skip mla absorbed {shape.label}: {type(e).__name__}: {str(e)[:300]}")
                    torch.cuda.empty_cache()
            print(format_tables(group), flush=True)
            rows += group
    bad = [r for r in rows if r.get("agrees") is False]
    if bad:
        print(f"MISMATCH in {len(bad)} rows: " + ", ".join(
            f"{r['part']} {r['impl']} {r['dtype']} h{r['num_qo_heads']} "
            + Shape(r["batch"], r["qo_len"], r["seq_len"]).label for r in bad))
    return rows

if __name__ == "__main__":
    sys.exit(main())
