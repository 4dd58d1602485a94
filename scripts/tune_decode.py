"""Paged decode variants side by side on the GPU (a tuning aid): the tensor-core kernel's
default and candidate schedules (`schedules.tc_decode_candidates`), the CUDA-core kernel, TVM's
own decode kernel and torch SDPA, all on the same inputs (scripts/bench_kernels.py's timing,
checks and row format).

    python scripts/tune_decode.py [--shapes 1x4096 ...] [--dtype float16 bfloat16] [--sweep float16]
                                  [--only LABEL ...] [--iters 8] [--jobs 8] [--json rows.json]
                                  [--graph [IMPL ...]] [--profile [IMPL ...]]
                                  [--rope [--table PATH --table-base PATH --rope-also bfloat16 float16]]

--rope sweeps the inline-RoPE candidates instead (`schedules.tc_decode_rope_candidates`, each
timed with rotary_mode 0 and 1: rows "tvmattn-tc-<label>" and "tvmattn-tc-<label>-rope"); with
--table it writes --table-base with a "rope_schedule" chosen for each measured entry.

Impl names: "tvmattn" (what paged_decode(config) builds: the dispatch), "tvmattn-cuda-core"
(paged_decode with the CUDA-core schedule), "tvmattn-tc-<label>" (a candidate, with --sweep
for that dtype), "tvm" (TVM's TIR kernel), "sdpa". Kernels are compiled in `--jobs` processes
(each exports a shared library) before CUDA is touched.
"""

from __future__ import annotations

import argparse
import math
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


def jobs_for(dtypes, sweep, head_dim: int, page_size: int, kv_heads, baselines: bool = True,
             sweep_all_kv: bool = False, table: bool = False, only=None, rope: bool = False) -> list:
    """[(dtype, impl, variant, num_kv_heads)] to build; variant: "default", "cuda-core", "tvm", a
    candidate label (candidates with the first of kv_heads only, unless sweep_all_kv) or
    "table:<label>" (each schedule the decode table picks for the config; measured together as
    "tvmattn-table", the host-side choice per shape). only: candidate labels to sweep (None: all).
    rope: the candidates are the inline-RoPE ones (schedules.tc_decode_rope_candidates), variant
    "rope:<label>": paged_decode with that schedule for both builds, measured with rotary_mode 0
    and 1 (rows "tvmattn-tc-<label>" and "tvmattn-tc-<label>-rope")."""
    from tir_kernels.schedules import (decode_variant_label, decode_variants, tc_decode_candidates,
                                       tc_decode_rope_candidates)

    jobs = []
    for kv in kv_heads:
        for dtype in dtypes:
            base = (("tvmattn", "default"), ("tvmattn-cuda-core", "cuda-core"), ("tvm", "tvm"))
            jobs += [(dtype, impl, variant, kv) for impl, variant in (base if baselines else base[:1])]
            if table:
                for sched, rope_sched, _ in decode_variants(config_for(dtype, head_dim, page_size, kv)):
                    label = decode_variant_label(sched, rope_sched)
                    jobs.append((dtype, f"table:{label}", f"table:{label}", kv))
            if dtype in sweep and (sweep_all_kv or kv == kv_heads[0]):
                candidates = (tc_decode_rope_candidates if rope else tc_decode_candidates)(
                    config_for(dtype, head_dim, page_size, kv))
                for label in candidates:
                    if only is None or label in only:
                        jobs.append((dtype, f"tvmattn-tc-{label}", f"rope:{label}" if rope else label, kv))
    return jobs


def make_func(job, head_dim: int, page_size: int):
    """(PrimFunc, variant description) of one job."""
    from tir_kernels import paged_decode
    from tir_kernels.schedules import (choose_decode_schedule, choose_decode_variant, decode_schedule_label,
                                       decode_variant_label, decode_variants, tc_decode_candidates,
                                       tc_decode_rope_candidates)

    dtype, _, variant, kv = job
    config = config_for(dtype, head_dim, page_size, kv)
    if variant == "default":  # the table's schedule for the config's largest measured shape, or the default
        return paged_decode(config), f"paged_decode: {decode_schedule_label(choose_decode_variant(config))}"
    if variant == "cuda-core":
        sched = choose_decode_schedule(config)
        return paged_decode(config, sched), bk.schedule_summary(sched)
    if variant == "tvm":
        return bk.tvm_anchor("decode", config), "tir"
    if variant.startswith("table:"):
        sched, rope = {decode_variant_label(s, r): (s, r) for s, r, _ in decode_variants(config)}[variant[6:]]
        return paged_decode(config, sched, rope), variant[6:]
    if variant.startswith("rope:"):
        sched = tc_decode_rope_candidates(config)[variant[5:]]
        return paged_decode(config, sched, sched), f"mma {bk.schedule_summary(sched)}"
    sched = tc_decode_candidates(config)[variant]
    return paged_decode(config, sched), f"mma {bk.schedule_summary(sched)}"


def symbol(func) -> str:
    return str(func.attrs["global_symbol"]) if func.attrs and "global_symbol" in func.attrs else "main"


def build_one(args):
    """Build one job into a shared library; returns (job, path, symbol, description) or
    (job, None, None, error)."""
    job, head_dim, page_size, outdir, num_qo_heads = args
    bk.NUM_QO_HEADS = num_qo_heads  # a spawned worker starts from the module's default
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
    """{job: (function, description)}: built in worker processes (spawned: a forked worker
    inherits the parent's CUDA state, and in one sweep every forked build failed with
    cudaErrorInitializationError) and loaded here; whatever fails there is built again in this
    process."""
    import multiprocessing

    import tvm

    from tir_kernels import build

    outdir = tempfile.mkdtemp(prefix="tune_decode_")
    t0 = time.time()
    with multiprocessing.get_context("spawn").Pool(nproc) as pool:
        work = [(j, head_dim, page_size, outdir, bk.NUM_QO_HEADS) for j in jobs]
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


def display_name(row) -> str:
    return bk.display_impl(row)


def print_table(group, shapes, title: str) -> None:
    """GB/s per impl and shape; * marks a row that disagrees with SDPA; "(graph)": replayed
    from a CUDA graph."""
    names = sorted({display_name(r) for r in group}, key=lambda n: (bk.impl_sort_key(n.split(" ")[0]), n))
    print(f"\n{title}: GB/s (* = disagrees with SDPA)")
    print(f"{'impl':<44}" + "".join(f"{s.label:>11}" for s in shapes))
    for name in names:
        cells = []
        for s in shapes:
            r = [x for x in group if display_name(x) == name and x["batch"] == s.batch and x["seq_len"] == s.seq_len]
            mark = "*" if r and r[0].get("agrees") is False else " "
            cells.append(f"{r[0]['gbps']:>10.0f}{mark}" if r else f"{'-':>11}")
        print(f"{name:<44}" + "".join(cells))
    print(flush=True)


def table_impl(built, dtype: str, kv: int, head_dim: int, page_size: int):
    """("tvmattn-table", description, function): the table's variants of the config behind the
    cache's host-side choice (tvmattn.runtime.kernels.DecodeByShape), or None."""
    from tir_kernels.schedules import decode_variant_label, decode_variants

    from tvmattn.runtime.kernels import DecodeByShape

    variants = decode_variants(config_for(dtype, head_dim, page_size, kv))
    funcs = []
    for sched, rope, shapes in variants:
        label = decode_variant_label(sched, rope)
        job = (dtype, f"table:{label}", f"table:{label}", kv)
        if job not in built:
            return None
        funcs.append((built[job][0], shapes or [(1, 1)]))
    labels = "+".join(decode_variant_label(s, r) for s, r, _ in variants)
    return "tvmattn-table", f"table {labels}", DecodeByShape(funcs, page_size)


def graph_rows(ctx, shape, impls, iters: int, gen, meta: dict) -> list:
    """Rows (variant "cuda-graph") of each impl's time per call replayed from a CUDA graph of
    `iters` calls (cycling the page pools, as the eager timing does; bench_kernels.graph_time_ms
    with the decode rows' warm-up and sample length): the kernels' GPU time without the host's
    launch cost. An impl whose capture fails is skipped with a message."""
    import torch

    pool_bytes = shape.batch * math.ceil(shape.seq_len / ctx.page_size) * ctx.page_size * bk.NUM_KV_HEADS \
        * ctx.head_dim * 2 * bk.ELEM_BYTES[ctx.dtype]
    inputs = bk.Inputs(ctx, shape, bk.copies_for(pool_bytes), gen)
    rows = []
    for impl, desc, fn in impls:
        o = torch.empty_like(inputs.q)
        lse = torch.empty(inputs.q.shape[:2], device=bk.DEVICE, dtype=torch.float32)
        args = bk.tvm_args("decode", ctx, inputs, o, lse)
        arglists = [[args[0], pool, *args[2:]] for pool in inputs.tvm_pools]
        try:
            for a in arglists:  # the workspace pool holds its buffers before capture
                fn(*a)
            torch.cuda.synchronize()
            ms = bk.graph_time_ms(lambda i, fn=fn: fn(*arglists[i % len(arglists)]), iters, **bk.decode_timing(ctx))
        except Exception as e:  # noqa: BLE001 - reported
            print(f"  graph {impl} {shape.label}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            torch.cuda.synchronize()
            continue
        rows.append(bk.make_row("decode", impl, f"cuda-graph {desc}", ctx.dtype, ctx.head_dim, ctx.page_size,
                                shape, ms, None, meta))
        print(f"  graph {impl} {shape.label}: {rows[-1]['ms'] * 1e3:.1f} us", flush=True)
    return rows


def profile_shape(ctx, shape, impls, iters: int, gen) -> None:
    """Print each impl's kernels at one shape: torch.profiler's device time per call of each
    kernel (the split kernel, the merge), their sum, and the CUDA-event time per call of the
    same eager loop (the difference: launch gaps and host time the GPU waited for)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    pool_bytes = shape.batch * math.ceil(shape.seq_len / ctx.page_size) * ctx.page_size * bk.NUM_KV_HEADS \
        * ctx.head_dim * 2 * bk.ELEM_BYTES[ctx.dtype]
    inputs = bk.Inputs(ctx, shape, bk.copies_for(pool_bytes), gen)
    for impl, _, fn in impls:
        o = torch.empty_like(inputs.q)
        lse = torch.empty(inputs.q.shape[:2], device=bk.DEVICE, dtype=torch.float32)
        args = bk.tvm_args("decode", ctx, inputs, o, lse)
        arglists = [[args[0], pool, *args[2:]] for pool in inputs.tvm_pools]
        for a in arglists:
            fn(*a)
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            start.record()
            for i in range(iters):
                fn(*arglists[i % len(arglists)])
            stop.record()
            torch.cuda.synchronize()
        wall = start.elapsed_time(stop) * 1e3 / iters
        kernels = []
        for ev in prof.key_averages():
            total = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
            if total and "Memcpy" not in ev.key and "Memset" not in ev.key:
                kernels.append((ev.key, total / iters, ev.count / iters))
        parts = ", ".join(f"{k} {t:.1f} us x{c:g}" for k, t, c in sorted(kernels))
        print(f"  profile {impl} {ctx.dtype} kv{bk.NUM_KV_HEADS} {shape.label}: {parts}; kernels "
              f"{sum(t for _, t, _ in kernels):.1f} us, events {wall:.1f} us per call", flush=True)
    del inputs


def default_label(dtype: str, head_dim: int, group: int, page_size: int) -> str:
    """The label of today's default tensor-core schedule for a bucket (32 query heads)."""
    from tir_kernels.schedules import choose_tc_decode_schedule

    return choose_tc_decode_schedule(config_for(dtype, head_dim, page_size, bk.NUM_QO_HEADS // group)).label


def measured_gbps(rows, suffix: str = "") -> dict:
    """bucket (dtype, head dim, group, page size) -> label -> (batch, seq_len) -> GB/s of the eager
    "tvmattn-tc-<label><suffix>" rows that agree with SDPA (suffix "-rope": the inline-RoPE rows)."""
    from collections import defaultdict

    groups = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        impl = r["impl"]
        if (not impl.startswith("tvmattn-tc-") or not impl.endswith(suffix) or r.get("agrees") is False
                or str(r.get("variant", "")).startswith("cuda-graph")):
            continue
        key = (r["dtype"], r["head_dim"], r["num_qo_heads"] // r["num_kv_heads"], r["page_size"])
        groups[key][impl[len("tvmattn-tc-"):len(impl) - len(suffix)]][(r["batch"], r["seq_len"])] = r["gbps"]
    return groups


def greedy_choice(by_label: dict, labels: list, shapes: list, min_gain: float, max_variants: int | None = None,
                  preferred: str | None = None) -> list:
    """Labels chosen greedily over shapes (by_label: label -> shape -> GB/s): the first is the best
    by the product of its GB/s, unless `preferred` comes within min_gain of it (a factor, e.g.
    1.03): then that one; each next one the one that raises the product of the per-shape best
    most, while it raises it by more than min_gain (and fewer than max_variants are chosen)."""

    def score(chosen):
        return sum(math.log(max(by_label[lab][shape] for lab in chosen)) for shape in shapes)

    chosen = [max(labels, key=lambda lab: score([lab]))]
    if preferred in labels and score([preferred]) >= score(chosen) - math.log(min_gain):
        chosen = [preferred]
    while max_variants is None or len(chosen) < max_variants:
        best = max((lab for lab in labels if lab not in chosen), key=lambda lab: score(chosen + [lab]), default=None)
        if best is None or score(chosen + [best]) - score(chosen) <= math.log(min_gain):
            break
        chosen.append(best)
    return chosen


def choose_table(rows, max_variants: int, min_gain: float, default=default_label) -> list:
    """Table buckets from measured rows: per (dtype, head dim, group), the candidate schedules
    ("tvmattn-tc-<label>" rows that agree with SDPA) chosen greedily, at most max_variants of
    them: the first is the best by the product of its GB/s over the bucket's shapes, unless the
    default (default(dtype, head_dim, group, page_size)) comes within min_gain of it (a factor,
    e.g. 1.03): then the default; each next one the one that raises the product of the per-shape
    best most, while it raises it by more than min_gain; each shape then takes the best chosen
    schedule. (Run-to-run noise is 1-2% at small shapes: smaller gains would pick noise.)"""
    buckets = []
    for (dtype, head_dim, group, page_size), by_label in sorted(measured_gbps(rows).items()):
        shapes = sorted({shape for m in by_label.values() for shape in m})
        labels = [lab for lab, m in by_label.items() if all(shape in m for shape in shapes)]
        if not labels:
            continue
        chosen = greedy_choice(by_label, labels, shapes, min_gain, max_variants,
                               preferred=default(dtype, head_dim, group, page_size))
        entries = []
        for shape in shapes:
            lab = max(chosen, key=lambda lab: by_label[lab][shape])
            entries.append({"batch": shape[0], "seq_len": shape[1], "schedule": lab,
                            "gbps": round(by_label[lab][shape], 1),
                            "best_gbps": round(max(m[shape] for m in by_label.values()), 1),
                            "best": max(labels, key=lambda x: by_label[x][shape])})
        buckets.append({"dtype": dtype, "head_dim": head_dim, "group": group, "page_size": page_size,
                        "shapes": entries})
    return buckets


def choose_rope_table(rows, base: dict, min_gain: float, candidates: dict, also: dict | None = None) -> dict:
    """The table `base` (a decode table file's dict) with a "rope_schedule" chosen for each of
    its entries at the shapes the rows measured: per (dtype, head dim, group, page size), among
    the "tvmattn-tc-<label>-rope" rows that agree with SDPA and whose schedule (candidates:
    label -> schedule) keeps the entry's dependent_launch, the greedy choice (`greedy_choice`)
    (the best by the product of GB/s over the bucket's measured shapes, then one more while it
    raises the product by more than min_gain), each shape the best chosen; where that is the
    entry's default rope schedule (schedules.tc_decode_rope_schedule of its schedule) the key is
    left out. Each entry gets "rope_gbps" (and "rope_best", "rope_best_gbps"). also: {dtype:
    measured dtype} whose choices a bucket of that dtype takes too (the other 16-bit type).
    Entries not measured keep their rope_schedule (or none)."""
    import copy

    from tir_kernels.schedules import schedule_from_dict, schedule_to_dict, tc_decode_rope_schedule

    measured = measured_gbps(rows, "-rope")
    table = copy.deepcopy(base)
    schedules = table.setdefault("schedules", {})
    for bucket in table.get("buckets", []):
        key = (bucket["dtype"], bucket["head_dim"], bucket["group"], bucket["page_size"])
        by_label = measured.get(key) or measured.get((((also or {}).get(key[0])), *key[1:]))
        if not by_label:
            continue
        entries = [e for e in bucket["shapes"] if any((e["batch"], e["seq_len"]) in m for m in by_label.values())]
        plains = {e["schedule"]: schedule_from_dict(schedules[e["schedule"]]) for e in entries}
        launch = {p.dependent_launch for p in plains.values()}
        shapes = [(e["batch"], e["seq_len"]) for e in entries]
        labels = [lab for lab, m in by_label.items() if all(shape in m for shape in shapes)
                  and len(launch) == 1 and candidates[lab].dependent_launch in launch]
        if not labels:
            continue
        chosen = greedy_choice(by_label, labels, shapes, min_gain)
        for e in entries:
            shape = (e["batch"], e["seq_len"])
            lab = max(chosen, key=lambda lab: by_label[lab][shape])
            default = tc_decode_rope_schedule(config_for(bucket["dtype"], bucket["head_dim"], bucket["page_size"],
                                                         bk.NUM_QO_HEADS // bucket["group"]), plains[e["schedule"]])
            e.pop("rope_schedule", None)
            if candidates[lab] != default:
                e["rope_schedule"] = lab
                schedules[lab] = schedule_to_dict(candidates[lab])
            e["rope_gbps"] = round(by_label[lab][shape], 1)
            e["rope_best"] = max(labels, key=lambda x: by_label[x][shape])
            e["rope_best_gbps"] = round(by_label[e["rope_best"]][shape], 1)
    used = {lab for b in table.get("buckets", []) for e in b["shapes"]
            for lab in (e["schedule"], e.get("rope_schedule")) if lab}
    table["schedules"] = {lab: d for lab, d in schedules.items() if lab in used}
    return table


TABLE_ABOUT = ("Decode schedule per (dtype, head dim, GQA group) bucket and (batch, context) shape, measured by "
               "scripts/tune_decode.py; read by tir_kernels/schedules.py; a bucket with its own "
               "device/command/date/commit was measured apart from the table's")
PROVENANCE = ("device", "command", "date", "commit")


def merge_buckets(base: dict, buckets: list, stamp: dict | None = None) -> tuple[list, dict]:
    """(buckets, schedules) of the table `base` (a decode table file's dict) with the new
    buckets' entries in place of its entries at the same (bucket, batch, seq_len); base's other
    entries and buckets stay, and so do the schedule dicts they name (returned by label).
    stamp ({device, command, date, commit} of this run): put on every bucket the new buckets
    measured (the run that last measured any of its shapes), so that base's own top-level
    provenance stays true of the buckets this run did not touch."""
    def key(b):
        return b["dtype"], b["head_dim"], b["group"], b["page_size"]

    stamp = stamp or {}
    new = {key(b): b for b in buckets}
    out = []
    for b in base.get("buckets", []):
        fresh = new.pop(key(b), {"shapes": []})
        measured = {(e["batch"], e["seq_len"]) for e in fresh["shapes"]}
        kept = [e for e in b["shapes"] if (e["batch"], e["seq_len"]) not in measured]
        out.append({**b, **(stamp if measured else {}),
                    "shapes": sorted(kept + fresh["shapes"], key=lambda e: (e["batch"], e["seq_len"]))})
    out += [{**b, **stamp} for b in new.values()]
    used = {lab for b in out for e in b["shapes"] for lab in (e["schedule"], e.get("rope_schedule")) if lab}
    return out, {lab: d for lab, d in base.get("schedules", {}).items() if lab in used}


def write_table(path: str, buckets: list, candidates: dict, meta: dict, command: str, base: dict | None = None) -> None:
    """The table file (see schedules.py, "Decode schedule table"); with `base` (a table file's
    dict), base's entries at shapes the new buckets did not measure are kept (`merge_buckets`),
    with base's top-level provenance, and the buckets this run measured carry this run's own."""
    import json

    from tir_kernels.schedules import schedule_to_dict

    header = {"about": TABLE_ABOUT, "command": command, "device": meta["device"], "arch": "sm_90", "sms": 132,
              "date": meta["date"], "commit": meta["commit"]}
    kept = {}
    if base is not None:
        buckets, kept = merge_buckets(base, buckets, stamp={k: header[k] for k in PROVENANCE})
        header.update({k: base[k] for k in PROVENANCE if k in base})
    used = sorted({lab for b in buckets for e in b["shapes"] for lab in (e["schedule"], e.get("rope_schedule")) if lab})
    table = {**header,
             "schedules": {lab: schedule_to_dict(candidates[lab]) if lab in candidates else kept[lab] for lab in used},
             "buckets": buckets}
    with open(path, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    print(f"wrote {path}: {len(buckets)} buckets, schedules {used}")


def write_rope_table(args, rows, meta: dict, argv) -> None:
    """--rope --table: --table-base (default: the package's table) with rope schedules chosen
    from the rows (choose_rope_table), written to --table."""
    import json

    from tir_kernels.schedules import DECODE_TABLE_PATH, tc_decode_rope_candidates

    with open(args.table_base or DECODE_TABLE_PATH) as f:
        base = json.load(f)
    candidates = {}
    for kv in args.kv_heads:
        for dtype in args.sweep:
            candidates.update(tc_decode_rope_candidates(config_for(dtype, args.head_dim, args.page_size, kv)))
    table = choose_rope_table(rows, base, args.table_gain, candidates, dict(args.rope_also))
    table["rope_command"] = "python3 scripts/tune_decode.py " + " ".join(argv if argv is not None else sys.argv[1:])
    table["rope_date"], table["rope_commit"] = meta["date"], meta["commit"]
    for b in table["buckets"]:
        print(f"table {b['dtype']} d{b['head_dim']} group {b['group']}: " + ", ".join(
            f"{e['batch']}x{e['seq_len']} rope {e.get('rope_schedule', 'default')} {e['rope_gbps']:.0f}"
            for e in b["shapes"] if "rope_gbps" in e))
    with open(args.table, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    print(f"wrote {args.table}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=SHAPES)
    parser.add_argument("--dtype", nargs="+", default=["float16", "bfloat16"], choices=bk.DTYPES)
    parser.add_argument("--sweep", nargs="*", default=["float16"], choices=bk.DTYPES,
                        help="dtypes whose candidate schedules are measured too (default: float16)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--qo-heads", type=int, default=bk.NUM_QO_HEADS,
                        help=f"query heads (default: {bk.NUM_QO_HEADS}; SmolLM2's shape: --qo-heads 9 --kv-heads 3)")
    parser.add_argument("--kv-heads", type=int, nargs="+", default=[bk.NUM_KV_HEADS],
                        help=f"KV head counts (default: {bk.NUM_KV_HEADS}); each must divide --qo-heads")
    parser.add_argument("--sweep-all-kv", action="store_true",
                        help="measure the candidates for every --kv-heads count (default: the first)")
    parser.add_argument("--no-baselines", action="store_true",
                        help="leave out the CUDA-core kernel and TVM's kernel (SDPA still checks)")
    parser.add_argument("--with-table", action="store_true",
                        help="also measure tvmattn-table: the decode table's variants chosen per shape on the host")
    parser.add_argument("--table", metavar="PATH", help="write a decode table chosen from the candidates' rows")
    parser.add_argument("--table-base", metavar="PATH",
                        help="with --table: keep this table's entries at the shapes not measured (e.g. the batch-1"
                             " shapes re-tuned, the rest as they were)")
    parser.add_argument("--table-variants", type=int, default=3, help="most schedules per bucket in --table")
    parser.add_argument("--table-gain", type=float, default=1.03,
                        help="a further schedule must raise the bucket's product of GB/s by this factor")
    parser.add_argument("--graph", nargs="*", metavar="IMPL",
                        help="also time these impls (default: tvmattn, tvmattn-table) replayed from a CUDA graph")
    parser.add_argument("--rope", action="store_true",
                        help="sweep the inline-RoPE candidates (schedules.tc_decode_rope_candidates), each timed"
                             " with rotary_mode 0 and 1; with --table, entries of --table-base get a rope_schedule")
    parser.add_argument("--rope-also", nargs=2, action="append", metavar=("DTYPE", "MEASURED"), default=[],
                        help="with --rope --table: DTYPE's buckets take MEASURED's rope choices"
                             " (e.g. bfloat16 float16)")
    parser.add_argument("--only", nargs="+", metavar="LABEL",
                        help="sweep only these candidate labels (default: every candidate)")
    parser.add_argument("--profile", nargs="*", metavar="IMPL",
                        help="print torch.profiler's device time per kernel of these impls at each shape "
                             "(default: tvmattn and tvmattn-table)")
    bk.add_decode_timing_arguments(parser)
    parser.add_argument("--page-size", type=int, default=bk.DEFAULT_PAGE_SIZE)
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--jobs", type=int, default=8, help="build processes")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    bad_kv = [kv for kv in args.kv_heads if kv < 1 or args.qo_heads % kv]
    if args.qo_heads < 1 or bad_kv:
        parser.error(f"--kv-heads {bad_kv or args.kv_heads}: each must divide --qo-heads {args.qo_heads}")
    bk.NUM_QO_HEADS = args.qo_heads  # the benchmark's inputs, references and byte counts follow it
    shapes = [bk.parse_shape(s, "decode") for s in args.shapes]
    jobs = jobs_for(args.dtype, args.sweep, args.head_dim, args.page_size, args.kv_heads,
                    baselines=not args.no_baselines, sweep_all_kv=args.sweep_all_kv, table=args.with_table,
                    only=args.only, rope=args.rope)
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
            ctx.warmup_ms, ctx.sample_ms = args.decode_warmup_ms, args.decode_sample_ms
            if args.rope:  # every candidate also with rotary_mode 1 ("<impl>-rope" rows)
                ctx.decode_rope = True
                ctx.decode_rope_impls = {impl for (dt, impl, _, k) in built if impl.startswith("tvmattn-tc-")}
            ctx.kernels["decode"] = [(impl, desc, fn) for (dt, impl, _, k), (fn, desc) in built.items()
                                     if dt == dtype and k == kv and not impl.startswith("table:")]
            if args.with_table:
                impl = table_impl(built, dtype, kv, args.head_dim, args.page_size)
                if impl is not None:
                    ctx.kernels["decode"].append(impl)
            gen = torch.Generator(device=bk.DEVICE).manual_seed(0)
            group = []
            for shape in shapes:
                try:
                    group += bk.bench_shape(["decode"], ctx, shape, args.iters, gen)
                except Exception as e:  # noqa: BLE001 - out of memory, say
                    print(f"  skip {dtype} {shape.label}: {type(e).__name__}: {e}")
                    if bk.DEVICE == "cuda":
                        torch.cuda.empty_cache()
            if args.profile is not None and bk.DEVICE == "cuda":
                wanted = args.profile or ["tvmattn", "tvmattn-table"]
                impls = [k for k in ctx.kernels["decode"] if k[0] in wanted]
                for shape in shapes:
                    try:
                        profile_shape(ctx, shape, impls, max(args.iters, 20), gen)
                    except Exception as e:  # noqa: BLE001 - reported
                        print(f"  skip profile {dtype} {shape.label}: {type(e).__name__}: {str(e)[:200]}")
                        torch.cuda.empty_cache()
            if args.graph is not None and bk.DEVICE == "cuda":
                wanted = args.graph or ["tvmattn", "tvmattn-table"]
                impls = [k for k in ctx.kernels["decode"] if k[0] in wanted]
                for shape in shapes:
                    try:
                        group += graph_rows(ctx, shape, impls, max(args.iters, 20), gen, meta)
                    except Exception as e:  # noqa: BLE001 - out of memory, say
                        print(f"  skip graph {dtype} {shape.label}: {type(e).__name__}: {e}")
                        torch.cuda.empty_cache()
            for r in group:  # (make_row's head count and bytes are the module's defaults)
                r["num_qo_heads"], r["num_kv_heads"] = bk.NUM_QO_HEADS, kv
                r["gbps"] = bk.decode_bytes(r["batch"], r["seq_len"], bk.NUM_QO_HEADS, kv, r["head_dim"],
                                            bk.ELEM_BYTES[dtype]) / r["ms"] / 1e6
            rows += group
            print_table(group, shapes, f"{dtype} d{args.head_dim} ps{args.page_size} {bk.NUM_QO_HEADS}q/{kv}kv")
    if args.json:
        bk.write_json(rows, args.json)
    if args.table and args.rope:
        write_rope_table(args, rows, meta, argv)
    elif args.table:
        from tir_kernels.schedules import tc_decode_candidates

        candidates = {}
        for kv in args.kv_heads:
            for dtype in args.sweep:
                candidates.update(tc_decode_candidates(config_for(dtype, args.head_dim, args.page_size, kv)))
        buckets = choose_table(rows, args.table_variants, args.table_gain)
        for b in buckets:
            print(f"table {b['dtype']} d{b['head_dim']} group {b['group']}: "
                  + ", ".join(f"{e['batch']}x{e['seq_len']} {e['schedule']} {e['gbps']:.0f}"
                              f" (best {e['best']} {e['best_gbps']:.0f})" for e in b["shapes"]))
        base = None
        if args.table_base:
            import json

            with open(args.table_base) as f:
                base = json.load(f)
        write_table(args.table, buckets, candidates, meta, "python3 scripts/tune_decode.py " + " ".join(
            argv if argv is not None else sys.argv[1:]), base)
    return 0


if __name__ == "__main__":
    if os.environ.get("TUNE_DECODE_CPU"):  # smoke test of this script's plumbing without a GPU
        bk.DEVICE = "cpu"
    sys.exit(main())
