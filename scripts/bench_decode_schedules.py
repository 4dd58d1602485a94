"""Model graph steps with the library's paged-decode schedule changed: which schedule a step wants.

A model library compiles one schedule per decode kernel (the decode, and the decode with the
append: tvmattn/models/kv_cache.py): the decode table's schedule for the config's bucket at the
bucket's largest shape (`schedules.choose_decode_variant` without a shape), at every batch. The
table's entries were measured on the kernel alone (`tune_decode.py`: eager calls, the history
read after the launch); inside a CUDA-graph step the history is read before the grid wait, and
the step is what counts. This script builds the model's library as it is and once per
--variant: the library's schedule with some fields changed (`stages=3`,
`min_split_keys=64,cooperative_merge=true`), each build in a process of its own under a table
whose bucket names the variant at every shape (`schedules.use_decode_table`). Then it times
greedy CUDA-graph decode steps of every library (bench_e2e.py's runner, the same random weights
and prompts) at each --batches size, in --rounds rounds that alternate the libraries, and prints
each one's median step, its graph replayed alone, and the largest |difference| of its first
step's logits from the unchanged library's.

    python scripts/bench_decode_schedules.py --model scripts/smollm2-config.json --variant stages=3 \\
        --variant min_split_keys=64 --batches 1,16,64
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import multiprocessing
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_e2e  # noqa: E402
from tir_kernels.config import AttentionConfig  # noqa: E402
from tir_kernels.schedules import (TensorCoreDecodeSchedule, choose_decode_variant, decode_table_bucket,  # noqa: E402
                                   load_decode_table, schedule_to_dict)

SCHEDULE_FIELDS = {f.name: f.type for f in dataclasses.fields(TensorCoreDecodeSchedule)}
PROMPT_LEN = 512


def parse_variant(spec: str) -> dict:
    """'field=value,field=value' -> {field: int or bool} of TensorCoreDecodeSchedule fields."""
    changes = {}
    for item in spec.split(","):
        field, sep, value = item.partition("=")
        field, value = field.strip(), value.strip()
        if not sep or field not in SCHEDULE_FIELDS:
            raise ValueError(f"--variant {spec!r}: expected field=value pairs of {sorted(SCHEDULE_FIELDS)}, "
                             f"got {item!r}")
        if "bool" in str(SCHEDULE_FIELDS[field]):
            if value.lower() not in ("true", "false"):
                raise ValueError(f"--variant {spec!r}: {field} is true or false, got {value!r}")
            changes[field] = value.lower() == "true"
        else:
            try:
                changes[field] = int(value)
            except ValueError:
                raise ValueError(f"--variant {spec!r}: {field} is an integer, got {value!r}") from None
    return changes


def model_attention_config(model: str, target: str) -> AttentionConfig:
    """The attention config of a config.json model's float16 library for `target` ("cuda:sm_90")."""
    from tvmattn.build import load_model
    from tvmattn.models.config import ModelConfig

    config = ModelConfig.from_hf(load_model(model)[0])
    return AttentionConfig(config.num_attention_heads, config.num_key_value_heads, config.head_dim, dtype="float16",
                           target=target)


def variant_table(table: dict, config: AttentionConfig, changes: dict) -> tuple[dict, TensorCoreDecodeSchedule]:
    """(a copy of table whose bucket for config names the library's schedule with `changes` at
    every shape, that schedule). ValueError where the library's decode is not the tensor-core
    kernel or the changed schedule does not fit config."""
    base = choose_decode_variant(config, table=table)
    if not isinstance(base, TensorCoreDecodeSchedule):
        raise ValueError(f"the library's decode for {config} is the CUDA-core kernel: no tensor-core schedule to vary")
    sched = dataclasses.replace(base, **changes)
    sched.check(config)
    table = copy.deepcopy(table)
    table["schedules"][sched.label] = schedule_to_dict(sched)
    for shape in decode_table_bucket(config, table)["shapes"]:
        shape["schedule"] = sched.label
    return table, sched


def plan_libraries(table: dict, config: AttentionConfig, variants: dict) -> dict:
    """{"library": (the library's schedule, None), label: (a variant's schedule, its table), ...}
    for variants {--variant spec: changes}; a variant that changes nothing, or repeats another,
    is timed once (a note is printed)."""
    libraries = {"library": (choose_decode_variant(config, table=table), None)}
    for spec, changes in variants.items():
        changed, sched = variant_table(table, config, changes)
        if any(sched == planned for planned, _ in libraries.values()):
            print(f"--variant {spec}: {sched.label} is already in the run (the library's own schedule or another "
                  "variant): timed once")
            continue
        libraries[sched.label] = (sched, changed)
    return libraries


def _build(job: tuple) -> str:
    """Build one library (in a worker process): (model, path, table or None, max batch, context)."""
    from tir_kernels.schedules import use_decode_table
    from tvmattn.build import compile_model

    model, path, table, max_batch, context = job
    with use_decode_table(table if table is not None else load_decode_table()):
        compile_model(model, path, target="cuda", max_batch_size=max_batch, context_window=context,
                      prefill_chunk=PROMPT_LEN, log=lambda _: None)
    return path


def context_tokens(steps: int) -> int:
    """The context a run's libraries are built for: the prompt, the warm-up and timed steps of a
    round (bench_e2e.bench_decode), rounded up to 64 tokens."""
    return -(-(PROMPT_LEN + bench_e2e.WARMUP_STEPS + steps) // 64) * 64


def library_paths(folder: str, model: str, libraries: dict, max_batch: int, context: int) -> dict:
    """name -> the library file of each planned library; the name says what it was built for
    (schedule, largest batch, context), so a file of another run's shape is never taken."""
    stem = Path(model).stem
    return {name: str(Path(folder) / f"{stem}-b{max_batch}-c{context}-{sched.label}.so")
            for name, (sched, _) in libraries.items()}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="scripts/smollm2-config.json", help="a config.json (random float16 weights)")
    p.add_argument("--libs", default="build/decode-schedules", help="folder of the libraries (built when missing)")
    p.add_argument("--variant", action="append", default=[], metavar="FIELD=VALUE[,...]",
                   help="the library's decode schedule with these TensorCoreDecodeSchedule fields changed (repeat)")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps a round")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    if not args.variant:
        p.error("argument --variant: give at least one")
    try:
        args.changes = [parse_variant(spec) for spec in args.variant]
    except ValueError as err:
        p.error(str(err))
    try:
        args.batch_sizes = [int(b) for b in args.batches.split(",")]
    except ValueError:
        p.error(f"argument --batches: expected comma-separated batch sizes, got {args.batches!r}")
    if min(args.batch_sizes) < 1 or args.steps < 1 or args.rounds < 1:
        p.error("arguments --batches, --steps and --rounds: expected positive integers")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from tvmattn.build import resolve_target

    config = model_attention_config(args.model, resolve_target("cuda"))
    libraries = plan_libraries(load_decode_table(), config, dict(zip(args.variant, args.changes)))
    Path(args.libs).mkdir(parents=True, exist_ok=True)
    max_batch, context = max(args.batch_sizes), context_tokens(args.steps)
    paths = library_paths(args.libs, args.model, libraries, max_batch, context)
    jobs = [(args.model, paths[name], changed, max_batch, context)
            for name, (_, changed) in libraries.items() if not Path(paths[name]).is_file()]
    if jobs:
        # spawned, not forked: the parent has initialized CUDA (the target's arch)
        with multiprocessing.get_context("spawn").Pool(len(jobs)) as pool:
            for path in pool.imap_unordered(_build, jobs):
                print(f"built {path}", flush=True)
    return time_steps(args, libraries, paths, max_batch, context)


def time_steps(args, libraries: dict, paths: dict, max_batch: int, context: int) -> int:
    import numpy as np
    import tvm

    device = tvm.cuda(0)
    if not device.exist:
        raise SystemExit("bench_decode_schedules.py needs a CUDA GPU")
    metadata = json.loads(bench_e2e.sidecar(Path(paths["library"]), bench_e2e.RUNTIME_SUFFIX).read_text())["metadata"]
    params, _ = bench_e2e.load_weights(argparse.Namespace(libraries=(), seed=0), device, metadata)
    page = metadata["kv_cache"]["page_size"]
    capacity = max_batch * -(-context // page) * page
    runners = {name: bench_e2e.Runner(Path(paths[name]), device, params, capacity, max_batch, PROMPT_LEN, graph=True)
               for name in libraries}
    prompt = np.random.default_rng(0).integers(0, metadata["model_config"]["vocab_size"], PROMPT_LEN, dtype=np.int32)
    print(f"{args.model}: the library's decode schedule {libraries['library'][0].label}; ms a graph step "
          f"({args.rounds} rounds of {args.steps} steps, H = the step's graph replayed alone)")
    for batch in args.batch_sizes:
        prompts = [tvm.runtime.tensor(np.roll(prompt, 7 * i), device=device) for i in range(batch)]
        timings = {name: [] for name in runners}
        first = {}
        for index in range(args.rounds):
            for name in bench_e2e.round_order(tuple(runners), index):
                timing, logits = bench_e2e.bench_decode(runners[name], prompts, args.steps)
                timings[name].append(timing)
                first.setdefault(name, logits)
        for name, (sched, _) in libraries.items():
            step = statistics.median(1e3 * t.step_s for t in timings[name])
            replay = statistics.median(1e3 * t.gpu_s for t in timings[name])
            diff = float(np.abs(first[name] - first["library"]).max())
            print(f"  batch {batch:3d}  {sched.label:40s} {step:.4f} (H {replay:.4f})  max |diff| {diff:.2e}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
