"""Paged decode variants side by side on the GPU (a tuning aid): the tensor-core kernel's
default and candidate schedules (`schedules.tc_decode_candidates`), the CUDA-core kernel, TVM's
own decode kernel and torch SDPA, all on the same inputs (scripts/bench_kernels.py's timing,
checks and row format).

    python scripts/tune_decode.py [--shapes 1x4096 ...] [--dtype float16 bfloat16] [--sweep float16]
                                  [--iters 8] [--jobs 8] [--json rows.json]

Impl names: "tvmattn" (what paged_decode(config) builds: the dispatch), "tvmattn-cuda-core"
(paged_decode with the CUDA-core schedule), "tvmattn-tc-<label>" (a candidate, with --sweep
for that dtype), "tvm" (TVM's TIR kernel), "sdpa". Kernels are compiled in `--jobs` processes
(each exports a shared library) before CUDA is touched.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_kernels as bk  # noqa: E402

SHAPES = ["1x4096", "1x32768", "8x32768", "64x4096", "128x8192", "256x2048"]


def config_for(dtype: str, head_dim: int, page_size: int, num_kv_heads: int | None = None):
    from tir_kernels import AttentionConfig

    return AttentionConfig(bk.NUM_QO_HEADS, num_kv_heads or bk.NUM_KV_HEADS, head_dim, dtype=dtype,
                           page_size=page_size, target="cuda:sm_90" if bk.DEVICE == "cuda" else "llvm")


def jobs_for(dtypes, sweep, head_dim: int, page_size: int, kv_heads) -> list:
    """[(dtype, impl, variant, num_kv_heads)] to build; variant: "default", "cuda-core", "tvm" or
    a candidate label (candidates with the first of kv_heads only)."""
    from tir_kernels.schedules import tc_decode_candidates

    jobs = []
    for kv in kv_heads:
        for dtype in dtypes:
            jobs += [(dtype, impl, variant, kv) for impl, variant in
                     (("tvmattn", "default"), ("tvmattn-cuda-core", "cuda-core"), ("tvm", "tvm"))]
            if dtype in sweep and kv == kv_heads[0]:
                for label in tc_decode_candidates(config_for(dtype, head_dim, page_size, kv)):
                    jobs.append((dtype, f"tvmattn-tc-{label}", label, kv))
    return jobs


def make_func(job, head_dim: int, page_size: int):
    """(PrimFunc, variant description) of one job."""
    from tir_kernels import paged_decode
    from tir_kernels.schedules import choose_decode_schedule, tc_decode_candidates

    dtype, _, variant, kv = job
    config = config_for(dtype, head_dim, page_size, kv)
    if variant == "default":
        func = paged_decode(config)
        return func, bk.tvmattn_variant("decode", config, func)
    if variant == "cuda-core":
        sched = choose_decode_schedule(config)
        return paged_decode(config, sched), bk.schedule_summary(sched)
    if variant == "tvm":
        return bk.tvm_anchor("decode", config), "tir"
    sched = tc_decode_candidates(config)[variant]
    return paged_decode(config, sched), f"mma {bk.schedule_summary(sched)}"


def symbol(func) -> str:
    return str(func.attrs["global_symbol"]) if func.attrs and "global_symbol" in func.attrs else "main"


def build_one(args):
    """Build one job into a shared library; returns (job, path, symbol, description) or
    (job, None, None, error)."""
    job, head_dim, page_size, outdir = args
    try:
        import tvm

        from tir_kernels.build import PIPELINE

        func, desc = make_func(job, head_dim, page_size)
        config = config_for(job[0], head_dim, page_size, job[3])
        mod = tvm.compile(tvm.IRModule({symbol(func): func}), target=config.tvm_target(), tir_pipeline=PIPELINE)
        path = os.path.join(outdir, f"{job[0]}-{job[1]}-kv{job[3]}.so")
        mod.export_library(path)
        return job, path, symbol(func), desc
    except Exception as e:  # noqa: BLE001 - reported; built again in the main process
        return job, None, None, f"{type(e).__name__}: {str(e).strip()[-300:]}"


def build_all(jobs, head_dim, page_size, nproc: int):
    """{job: (function, description)}: built in worker processes (forked before CUDA is
    touched) and loaded here; whatever fails there is built again in this process."""
    import multiprocessing

    import tvm

    from tir_kernels import build

    outdir = tempfile.mkdtemp(prefix="tune_decode_")
    t0 = time.time()
    with multiprocessing.get_context("fork").Pool(nproc) as pool:
        work = [(j, head_dim, page_size, outdir) for j in jobs]
        results = {r[0]: r[1:] for r in pool.imap_unordered(build_one, work)}
    built = {}
    for job in jobs:
        path, name, desc = results[job]
        try:
            if path is None:
                raise RuntimeError(desc)
            built[job] = (tvm.runtime.load_module(path)[name], desc)
            continue
        except Exception as e:  # noqa: BLE001 - fall back to building here
            print(f"  {job[1]} {job[0]}: worker build unusable ({str(e)[:200]}); building here", flush=True)
        try:
            func, desc = make_func(job, head_dim, page_size)
            built[job] = (build(func, config_for(job[0], head_dim, page_size, job[3])), desc)
        except Exception as e:  # noqa: BLE001
            print(f"  skip {job[1]} {job[0]}: {type(e).__name__}: {str(e).strip()[-200:]}", flush=True)
    print(f"{len(built)}/{len(jobs)} kernels built in {time.time() - t0:.1f} s", flush=True)
    return built


def print_table(group, shapes, title: str) -> None:
    """GB/s per impl and shape; * marks a row that disagrees with SDPA."""
    impls = sorted({r["impl"] for r in group}, key=bk.impl_sort_key)
    print(f"\n{title}: GB/s (* = disagrees with SDPA)")
    print(f"{'impl':<36}" + "".join(f"{s.label:>11}" for s in shapes))
    for impl in impls:
        cells = []
        for s in shapes:
            r = [x for x in group if x["impl"] == impl and x["batch"] == s.batch and x["seq_len"] == s.seq_len]
            mark = "*" if r and r[0].get("agrees") is False else " "
            cells.append(f"{r[0]['gbps']:>10.0f}{mark}" if r else f"{'-':>11}")
        print(f"{impl:<36}" + "".join(cells))
    print(flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=SHAPES)
    parser.add_argument("--dtype", nargs="+", default=["float16", "bfloat16"], choices=bk.DTYPES)
    parser.add_argument("--sweep", nargs="*", default=["float16"], choices=bk.DTYPES,
                        help="dtypes whose candidate schedules are measured too (default: float16)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--kv-heads", type=int, nargs="+", default=[bk.NUM_KV_HEADS],
                        help=f"KV head counts ({bk.NUM_QO_HEADS} query heads; default: {bk.NUM_KV_HEADS})")
    parser.add_argument("--page-size", type=int, default=bk.DEFAULT_PAGE_SIZE)
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--jobs", type=int, default=8, help="build processes")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    shapes = [bk.parse_shape(s, "decode") for s in args.shapes]
    jobs = jobs_for(args.dtype, args.sweep, args.head_dim, args.page_size, args.kv_heads)
    built = build_all(jobs, args.head_dim, args.page_size, args.jobs)

    import torch

    device = torch.cuda.get_device_name() if bk.DEVICE == "cuda" else "cpu"
    meta = {"device": device, "date": bk.now_iso(), "commit": bk.git_commit()}
    rows = []
    for kv in args.kv_heads:
        bk.NUM_KV_HEADS = kv  # the benchmark's inputs, rows and byte counts follow it
        for dtype in args.dtype:
            config = config_for(dtype, args.head_dim, args.page_size, kv)
            ctx = bk.Context(config, meta, None, [])
            ctx.kernels["decode"] = [(impl, desc, fn) for (dt, impl, _, k), (fn, desc) in built.items()
                                     if dt == dtype and k == kv]
            gen = torch.Generator(device=bk.DEVICE).manual_seed(0)
            group = []
            for shape in shapes:
                try:
                    group += bk.bench_shape(["decode"], ctx, shape, args.iters, gen)
                except Exception as e:  # noqa: BLE001 - out of memory, say
                    print(f"  skip {dtype} {shape.label}: {type(e).__name__}: {e}")
                    if bk.DEVICE == "cuda":
                        torch.cuda.empty_cache()
            for r in group:  # (make_row's head count and bytes are the module's defaults)
                r["num_kv_heads"] = kv
                r["gbps"] = bk.decode_bytes(r["batch"], r["seq_len"], bk.NUM_QO_HEADS, kv, r["head_dim"],
                                            bk.ELEM_BYTES[dtype]) / r["ms"] / 1e6
            rows += group
            print_table(group, shapes, f"{dtype} d{args.head_dim} ps{args.page_size} {bk.NUM_QO_HEADS}q/{kv}kv")
    if args.json:
        bk.write_json(rows, args.json)
    return 0


if __name__ == "__main__":
    if os.environ.get("TUNE_DECODE_CPU"):  # smoke test of this script's plumbing without a GPU
        bk.DEVICE = "cpu"
    sys.exit(main())
