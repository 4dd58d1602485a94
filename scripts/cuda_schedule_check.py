"""A model library's CUDA kernels without a GPU: the kernels each step function launches, in
order, with their grid and block (as expressions and at given batch sizes), and a CPU run of the
CUDA schedules' index math with every buffer access bound-checked.

Exports the library's Relax module for a Hugging Face config.json (no weights needed) and runs the
model pipeline for cuda:sm_90 (tvmattn.compiler.pipeline), without generating code.

- Launches: every PrimFunc call of the function in order; a kernel is a nest of thread-bound
  loops (several nests: several launches, `name#i`). The KV cache's own launches happen inside
  its packed call (`[cache] ...`): tvmattn's cache kernels (the library's `tvmattn_*` PrimFuncs)
  are listed with --kernels.
- --check: each listed kernel scheduled by the pipeline's rules (dlight, tvmattn's rules: block
  form without PTX intrinsics, warp shuffles or tensor-core fragments) is rewritten with its
  thread bindings as serial loops and shared / local buffers as global ones (the same index
  expressions, now evaluated in order on one CPU thread), an assert before every buffer store
  that the store and each load outside `if_then_else` (guarded loads, e.g. padding) lie inside
  their buffers, built for llvm and run with the batch size's shapes (symbolic dims = the batch,
  float inputs random, integer inputs zero). TVM's own `tirx.instrument_bound_checkers` adds no
  checks in this TVM's lowering (its buffer-bound annotations are gone), hence the asserts.
  Hand-written kernels (tir_kernels' attention, TVM's stock attention) are skipped: their index
  math needs a runtime plan (see tvmattn/runtime and tests of the plans).

    python scripts/cuda_schedule_check.py --model scripts/gemma3-270m-config.json \
        [--kv-cache tvmattn|tvm] [--functions decode,batch_decode] [--batches 1,16,64] [--check]
        [--kernels tvmattn_decode_paged,...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

BIND = re.compile(r'^(\s*)for \w+ in T\.thread_binding\((.*), thread="(\w+)\.(\w)"')
ACCESS = re.compile(r"\b([A-Za-z_]\w*)\[")
# what a CPU cannot run: PTX / CUDA intrinsics, warp shuffles, tensor-core fragments, barriers
NOT_SERIAL = ("T.ptx", "T.cuda", "tvm_warp_shuffle", "tvm_storage_sync", "wmma.", "tvm_store_matrix_sync",
              "tvm_load_matrix_sync", "tvm_mma_sync", "T.match_buffer")
SIZE_NAMES = ("batch_size", "batch", "seq_len", "n", "N", "B", "total_q", "ntoken")


def lowered_module(hf_config: dict, kv_cache: str = "tvmattn", max_batch: int = 64):
    """The library module of `hf_config` (float16, page 16) after the model pipeline for cuda:sm_90."""
    from tvmattn.compiler.pipeline import relax_pipeline
    from tvmattn.models import BuildOptions, export_module
    from tvmattn.models.config import model_config_from_hf

    options = BuildOptions(target="cuda:sm_90", dtype="float16", kv_cache=kv_cache, max_batch_size=max_batch)
    mod, _ = export_module(model_config_from_hf(hf_config), options)
    target = options.tvm_target()
    with target:
        return relax_pipeline(target, options.small_batch_matmul, tensor_core_matmul=options.tensor_core_matmul)(mod)


def launched(mod, function: str) -> list[str]:
    """PrimFunc names (host shape functions left out) and `[cache] <packed function>` entries, in
    the order `function` calls them."""
    import tvm
    from tvm import relax, tirx

    calls: list[str] = []

    def visit(expr):
        if not isinstance(expr, relax.Call):
            return
        if isinstance(expr.op, tvm.ir.GlobalVar) and isinstance(mod[expr.op], tirx.PrimFunc):
            if not expr.op.name_hint.startswith(("compute_symbolic", "shape_func")):
                calls.append(expr.op.name_hint)
        elif isinstance(expr.op, relax.ExternFunc) and str(expr.op.global_symbol).startswith("tvmattn."):
            calls.append(f"[cache] {expr.op.global_symbol}")

    relax.analysis.post_order_visit(mod[function], visit)
    return calls


def split_top(text: str) -> list[str]:
    """text split at its top-level commas (not inside brackets), items stripped."""
    depth, out, cur = 0, [], ""
    for ch in text:
        depth += ch in "([" and 1 or 0
        depth -= ch in ")]" and 1 or 0
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return out + ([cur.strip()] if cur.strip() else [])


def closing(text: str, start: int) -> int:
    """Index of the bracket that closes text[start] ("(" or "[")."""
    depth = 0
    for i in range(start, len(text)):
        depth += text[i] in "([" and 1 or 0
        depth -= text[i] in ")]" and 1 or 0
        if depth == 0:
            return i
    raise ValueError(f"unbalanced brackets in {text[start:start + 80]!r}")


def launches(script: str) -> list[dict[str, str]]:
    """The launches of a scheduled PrimFunc's TVMScript: per kernel (a top-level nest of
    thread-bound loops) {"blockIdx.x": extent text, ..., "threadIdx.x": ...}."""
    kernels: list[dict] = []
    indent = None
    for line in script.splitlines():
        m = BIND.match(line)
        if not m:
            continue
        args = split_top(m.group(2))
        extent = args[0] if len(args) == 1 else args[1]
        if indent is None or len(m.group(1)) <= indent:
            indent = len(m.group(1))
            kernels.append({})
        kernels[-1].setdefault(f"{m.group(3)}.{m.group(4)}", extent)
    return kernels


class _T:
    """What launch extents call, for `evaluate`."""
    int64 = int32 = staticmethod(int)
    min = staticmethod(min)
    max = staticmethod(max)

    @staticmethod
    def Cast(_dtype, x):  # noqa: N802 - TVMScript's name
        return int(x)


def evaluate(extent: str, batch: int):
    """A launch extent at a batch size (every symbolic size set to it): an int, or the text where
    it names other variables."""
    try:
        return int(eval(extent, {"T": _T, "__builtins__": {}}, dict.fromkeys(SIZE_NAMES, batch)))  # noqa: S307
    except Exception:  # noqa: BLE001 - a variable of another kind: shown as it is
        return extent


def launch_rows(mod, names, batches) -> list[str]:
    """One line per launch: name#i, grid and block expressions, their values per batch."""
    rows = []
    for name in names:
        if name.startswith("[cache]"):
            rows.append(f"  {name}")
            continue
        for i, ext in enumerate(launches(mod[name].script())):
            grid = [ext.get(f"blockIdx.{a}", "1") for a in "xyz"]
            block = [ext.get(f"threadIdx.{a}", "1") for a in "xyz"]
            values = "  ".join(f"{b}: {tuple(evaluate(g, b) for g in grid)}x{tuple(evaluate(t, b) for t in block)}"
                               for b in batches)
            rows.append(f"  {name}#{i}: grid ({', '.join(grid)}) block ({', '.join(block)})  ->  {values}")
    return rows


def serial_source(script: str) -> str:
    """A scheduled PrimFunc's TVMScript with thread-bound loops serial and shared/local buffers global."""
    script = re.sub(r'T\.thread_binding\(([^\n]*?), thread="[\w.]+"(, annotations=\{[^}]*\})?\)', r"T.serial(\1)",
                    script)
    return re.sub(r', scope="(shared|local|shared\.dyn)"', "", script)


def buffer_shapes(script: str) -> dict[str, list[str]]:
    shapes = {m.group(1): [d.strip('"') for d in split_top(m.group(2))]  # a size declared inline is quoted
              for m in re.finditer(r"(\w+): T\.Buffer\(\((.*?)\),\s*\"\w+\"", script)}
    for m in re.finditer(r"(\w+) = T\.(?:sblock_)?alloc_buffer\(\(", script):
        shapes[m.group(1)] = split_top(script[m.end():closing(script, m.end() - 1)])
    return shapes


def with_bound_asserts(script: str) -> tuple[str, int]:
    """script with an assert before each buffer store: its indices and those of every load on the
    line outside `T.if_then_else(...)` inside the buffers' shapes. Returns (script, asserts added)."""
    shapes = buffer_shapes(script)
    out, added = [], 0
    for n, line in enumerate(script.splitlines()):
        body = line.lstrip()
        if re.match(r"[A-Za-z_]\w*\[.*\]\s*=\s", body):
            guarded = [(m.start(), closing(body, m.end() - 1)) for m in re.finditer(r"T\.if_then_else\(", body)]
            conds = []
            for m in ACCESS.finditer(body):
                shape = shapes.get(m.group(1))
                if shape is None or any(a <= m.start() <= b for a, b in guarded):
                    continue
                index = split_top(body[m.end():closing(body, m.end() - 1)])
                if len(index) != len(shape):
                    continue
                conds += [f"(T.int64(0) <= T.Cast('int64', {i}) and T.Cast('int64', {i}) < T.Cast('int64', {s}))"
                          for i, s in zip(index, shape) if ":" not in i]
            if conds:
                added += 1
                what = re.sub(r"[^A-Za-z0-9_ ,+*%/.()\[\]-]", "", body)[:120]
                out.append(f'{line[:len(line) - len(body)]}assert {" and ".join(conds)}, '
                           f'"out of bounds (script line {n}): {what}"')
        out.append(line)
    return "\n".join(out), added


def serial_problem(script: str) -> str | None:
    """Why a kernel cannot run serially on the CPU (None: it can)."""
    found = [s for s in NOT_SERIAL if s in script]
    return f"hand-written or tensor-core kernel ({', '.join(found)})" if found else None


def check_kernel(func, batch: int, seed: int = 0) -> str:
    """Run a scheduled PrimFunc serially on the CPU with bound asserts at `batch` (see the module
    docstring). Returns "ok (N checked stores)", "skipped: ..." or raises the failed check."""
    import numpy as np
    import tvm

    script = func.script()
    problem = serial_problem(script)
    if problem:
        return f"skipped: {problem}"
    checked, added = with_bound_asserts(serial_source(script))
    parsed = tvm.script.from_source(checked)
    if isinstance(parsed, tvm.IRModule):
        parsed = parsed[parsed.get_global_vars()[0]]
    lib = tvm.compile(tvm.IRModule({"main": parsed.with_attr("global_symbol", "main")}), target="llvm")
    rng = np.random.default_rng(seed)
    signature = script[script.index("def "):closing(script, script.index("(", script.index("def ")))]
    args = []
    for m in re.finditer(r'\w+: T\.Buffer\(\((.*?)\), "(\w+)"\)', signature):
        dims = [int(d.group(1) or d.group(2)) if d else batch
                for d in (re.fullmatch(r"T\.int64\((\d+)\)|(\d+)", s) for s in split_top(m.group(1)))]
        dtype = m.group(2)
        value = np.zeros(dims, dtype) if dtype.startswith(("int", "uint")) else \
            (rng.standard_normal(dims) * 0.1).astype(dtype)
        args.append(tvm.runtime.tensor(value))
    lib["main"](*args)
    return f"ok ({added} checked stores)"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a Hugging Face config.json")
    p.add_argument("--kv-cache", default="tvmattn", choices=("tvmattn", "tvm"))
    p.add_argument("--functions", default="decode,batch_decode")
    p.add_argument("--kernels", default="", help="also these PrimFuncs (e.g. the cache's tvmattn_decode_paged)")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--max-batch", type=int, default=64, help="the library's max batch size")
    p.add_argument("--check", action="store_true", help="run the listed kernels serially on the CPU, bound-checked")
    args = p.parse_args(argv)
    try:
        batches = [int(b) for b in args.batches.split(",") if b]
        with open(args.model) as f:
            hf_config = json.load(f)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    mod = lowered_module(hf_config, args.kv_cache, args.max_batch)
    functions = [f for f in args.functions.split(",") if f]
    missing = [f for f in functions if f not in [gv.name_hint for gv in mod.get_global_vars()]]
    if missing:
        print(f"error: --functions {missing[0]!r}: the library has no such function", file=sys.stderr)
        return 2
    to_check: list[str] = []
    for function in functions:
        names = launched(mod, function)
        print(f"{function} ({args.kv_cache} library), launches in order:")
        print("\n".join(dict.fromkeys(launch_rows(mod, names, batches))))  # repeated layers once
        to_check += [n for n in names if not n.startswith("[cache]")]
    extra = [k for k in args.kernels.split(",") if k]
    if extra:
        print("kernels:")
        print("\n".join(launch_rows(mod, extra, batches)))
        to_check += extra
    failures = 0
    if args.check:
        for name in dict.fromkeys(to_check):
            for batch in batches:
                try:
                    result = check_kernel(mod[name], batch)
                except Exception as err:  # noqa: BLE001 - the failed check is the finding
                    failures += 1
                    lines = [line for line in str(err).splitlines() if line.strip()]
                    result = "FAILED: " + " | ".join(lines[-2:])[:600]
                print(f"check {name} at batch {batch}: {result}")
                if result.startswith("skipped"):
                    break
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
