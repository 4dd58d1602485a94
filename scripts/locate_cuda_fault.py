"""Find the kernel behind a CUDA fault in bench_e2e.py's decode: the same libraries, weights,
cache sizes and call order as `scripts/bench_e2e.py`, few steps, at one of three degrees of
synchronization (--sync):
- launch (default): every launch synchronous (CUDA_LAUNCH_BLOCKING=1, set before CUDA starts)
  and a device sync after each decode step and each greedy token: the launch that reports a
  fault is the faulting one;
- step: launches asynchronous, a device sync after each decode step: a fault seen here but not
  with `launch` needs kernels of one step in flight together;
- none: bench_e2e.py's own pace (a sync after the first step only, the host then runs ahead of
  the GPU): a fault seen only here needs a step's host work (its planning, its uploads) to
  overlap the kernels of the step before. TVM's stock cache uploads its page tables on a
  non-blocking copy stream into one reused device buffer, ordered after nothing the compute
  stream runs: a fault there with `none` alone points at that.

    python scripts/locate_cuda_fault.py --model scripts/gemma3-270m-config.json --prompt-len 4096 \
        [--order 1,16,64] [--libraries tvmattn,tvm] [--steps 67] [--sync launch|step|none]

Runs, like bench_e2e.py: the first prefill call and --reps timed prefills per library; then for
each batch of --order, each library: --prompt-len-token prefills of every sequence (synchronized),
then --steps decode steps (`decode` at batch 1, `batch_decode` above) with greedy tokens (torch's
argmax via DLPack, as bench_e2e.py). Cache sizes are bench_e2e.py's for --bench-batches and
--bench-steps (its defaults), whatever --order and --steps say, so the pages a run touches are
those of the benchmark's run. Before each phase it prints a line `phase: ...`; a fault prints
`FAULT: <phase>` (with --sync none, the phase whose call first saw the error: the fault may be a
step earlier), the CUDA error (grid, block and, for a library holding CUDA source,
`// func_name=`), and the Python frames of the failing call: the cache's frames (tvmattn/runtime:
forward.py, windows.py) name an attention launch, none beyond Runner.forward a kernel the VM
launched (a model kernel, or TVM's stock cache from C++). Exit status 3 after a fault, 0 without
one. Under `compute-sanitizer --tool memcheck` (scripts/locate_cuda_fault.sh) the sanitizer
names the kernel and the bad address itself.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402


SYNC_MODES = ("launch", "step", "none")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="scripts/gemma3-270m-config.json")
    p.add_argument("--libs", default="build/e2e", help="bench_e2e.py's library folder (built when missing)")
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--order", default="1,16,64", help="decode batch sizes, in the order to run them")
    p.add_argument("--libraries", default="tvmattn,tvm", help="libraries in the order to run them (tvmattn, tvm)")
    p.add_argument("--steps", type=int, default=67, help="decode steps per batch and library (default: "
                                                           "bench_e2e.py's 3 warm-up + 64)")
    p.add_argument("--sync", default="launch", choices=SYNC_MODES,
                   help="launch: every launch synchronous, a sync after each step; step: a sync after each step; "
                        "none: bench_e2e.py's pace")
    p.add_argument("--reps", type=int, default=1, help="timed prefills per library before the decode phases "
                                                       "(0: none)")
    p.add_argument("--bench-batches", default="1,16,64", help="bench_e2e.py's --batches: sizes the cache")
    p.add_argument("--bench-steps", type=int, default=64, help="bench_e2e.py's --steps: sizes the cache")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", default="cuda", choices=["cuda", "llvm"], help="llvm: a CPU smoke run of this script")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.sync == "launch":
        os.environ["CUDA_LAUNCH_BLOCKING"] = "1"  # before TVM or torch start CUDA (imported below)
    import bench_e2e
    import tvm

    libraries = [lib for lib in args.libraries.split(",") if lib]
    bench_argv = ["--model", args.model, "--libs", args.libs, "--prompt-len", str(args.prompt_len),
                  "--batches", args.bench_batches, "--steps", str(args.bench_steps), "--seed", str(args.seed),
                  "--no-cuda-graph", "--target", args.target]
    bargs = bench_e2e.parse_args(bench_argv)
    unknown = set(libraries) - set(bargs.libraries)
    if unknown:
        raise SystemExit(f"error: --libraries {sorted(unknown)}: expected some of {list(bargs.libraries)}")
    device = tvm.cuda(0) if args.target == "cuda" else tvm.cpu(0)
    if not device.exist:
        raise SystemExit("error: no CUDA GPU (--target llvm for a CPU smoke run)")
    max_batch = max(int(b) for b in args.bench_batches.split(","))
    bench_e2e.ensure_libraries(bargs, max_batch)  # builds what is missing (bench_e2e.py's names and sizes)
    metadata = bench_e2e.json.loads(bench_e2e.sidecar(bench_e2e.library_path(bargs, "tvmattn"),
                                                      bench_e2e.RUNTIME_SUFFIX).read_text())["metadata"]
    params, note = bench_e2e.load_weights(bargs, device, metadata)
    page = metadata["kv_cache"]["page_size"]
    pages_per_sequence = -(-(args.prompt_len + args.bench_steps + bench_e2e.WARMUP_STEPS + 8) // page)
    capacity = max_batch * pages_per_sequence * page
    print(f"--sync {args.sync}, CUDA_LAUNCH_BLOCKING={os.environ.get('CUDA_LAUNCH_BLOCKING')}; {note}; "
          f"capacity {capacity} tokens, "
          f"max batch {max_batch}, page {page}")
    runners = {kv: bench_e2e.Runner(bench_e2e.library_path(bargs, kv), device, params, capacity, max_batch,
                                    args.prompt_len) for kv in libraries}
    for kv, runner in runners.items():
        print(f"{kv}: GPU code {runner.gpu_code}")
    vocab = metadata["model_config"]["vocab_size"]
    prompt = np.random.default_rng(args.seed).integers(0, vocab, args.prompt_len, dtype=np.int32)
    prompt_ids = tvm.runtime.tensor(prompt, device=device)
    phase = "start"

    def enter(name: str) -> None:
        nonlocal phase
        phase = name
        print(f"phase: {name}", flush=True)

    try:
        for kv, runner in runners.items():
            enter(f"{kv} first prefill")
            runner.host["add_sequence"](runner.cache, 0)
            runner.prefill(0, prompt_ids).numpy()
            runner.host["remove_sequence"](runner.cache, 0)
            if args.reps > 0:
                enter(f"{kv} prefill benchmark ({args.reps} reps)")
                bench_e2e.bench_prefill(runner, prompt_ids, args.reps)
        for batch in (int(b) for b in args.order.split(",")):
            prompts = [tvm.runtime.tensor(np.roll(prompt, 7 * i), device=device) for i in range(batch)]
            for kv, runner in runners.items():
                decode_phase(runner, kv, batch, prompts, args.steps, device, enter, args.sync)
    except Exception as err:  # noqa: BLE001 - the fault is the finding
        report(phase, err)
        return 3
    print("no fault")
    return 0


def decode_phase(runner, kv: str, batch: int, prompts, steps: int, device, enter, sync: str) -> None:
    """bench_e2e.bench_decode's calls, each decode step named; synchronized as `sync` says."""
    import bench_e2e
    import tvm

    seq_ids = list(range(batch))
    enter(f"{kv} batch {batch}: prefill of {batch} sequences")
    for seq_id, ids in zip(seq_ids, prompts):
        runner.host["add_sequence"](runner.cache, seq_id)
        runner.prefill(seq_id, ids)
        runner.sync()
    tokens = tvm.runtime.tensor(np.full(batch, 17, np.int32), device=device)
    function = "decode" if batch == 1 else "batch_decode"
    for step in range(steps):
        enter(f"{kv} batch {batch}: {function} step {step}")
        logits = runner.decode(seq_ids, tokens)
        if sync != "none":
            runner.sync()
        elif step == 0:
            logits.numpy()  # bench_e2e.py keeps the first step's logits
        enter(f"{kv} batch {batch}: greedy token of step {step} (torch argmax via DLPack)")
        tokens, _ = bench_e2e.greedy(logits, device)
        if sync != "none":
            runner.sync()
    enter(f"{kv} batch {batch}: end of the steps (sync)")
    runner.sync()
    enter(f"{kv} batch {batch}: remove sequences")  # (after a fault the run ends instead)
    for seq_id in seq_ids:
        runner.host["remove_sequence"](runner.cache, seq_id)


def report(phase: str, err: BaseException) -> None:
    """FAULT line, the error's launch lines (not the CUDA source TVM may append) and the frames."""
    print(f"FAULT: {phase}")
    lines = str(err).splitlines()
    keep = [line for line in lines if ("CUDA" in line or "grid=" in line or "block=" in line or "func_name" in line)
            and not line.startswith("// CUDA Source")]
    print("\n".join(keep[:12]) or "\n".join(lines[:12]))
    print("Python frames of the failing call (innermost last):")
    for frame in traceback.extract_tb(err.__traceback__):
        print(f"  {os.path.relpath(frame.filename)}:{frame.lineno} {frame.name}: {frame.line}")


if __name__ == "__main__":
    sys.exit(main())
