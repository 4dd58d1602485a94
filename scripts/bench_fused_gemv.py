"""The fused RMSNorm + projection kernels of a batch-1 decode step, schedule by schedule (a tuning aid).

compiler.fused_decode's ops (`rms_norm_matmul`: the qkv projection after the input norm;
`rms_norm_matmul_swiglu`: gate/up after the post-attention norm) at the shapes of SmolLM2-135M,
Llama-3.2-1B and Gemma 3 270M, batch 1, float16, scheduled by compiler.fused_schedules'
CUDAFusedDecodeGEMV in each variant below; beside them the anchor, torch: its RMSNorm, then
F.linear (cuBLAS), then SiLU * mul for SwiGLU, on the same inputs.

Variants: "warp" (staged=False: each column's lanes compute the norm themselves), and
"staged-t<threads>-b<min_blocks>" (the normalized row in shared memory once per block, up to
<threads> threads a block (one warp at most), fewer columns a block while there would be under
<min_blocks> blocks; the default: staged-t32-b264), and any staged variant with "-noprefetch"
(lanes interleaving 16-byte vectors, no weight prefetch; the prefetch itself pays under
programmatic dependent launch, which these lone calls do not use).

Device time per call is the kernels' time (torch.profiler, mean over --iters calls). Each call
reads another copy of the weight, the copies together larger than the L2 cache, so the weight
comes from memory as in a model step; GB/s counts the weight's bytes. Every variant's output
is checked against a float64 numpy reference (the test's tolerance).

    python scripts/bench_fused_gemv.py [--iters 50] [--variants warp staged-t128-b264 ...] [--json rows.json]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

# (label, kind, K, N): N is the weight's rows (SwiGLU: gate and up, 2 x intermediate)
SHAPES = (
    ("smollm2-qkv", "plain", 576, 960),
    ("smollm2-gate-up", "swiglu", 576, 3072),
    ("llama-1b-qkv", "plain", 2048, 3072),
    ("llama-1b-gate-up", "swiglu", 2048, 16384),
    ("gemma3-qkv", "plain", 640, 1536),
    ("gemma3-gate-up", "swiglu", 640, 4096),
)
VARIANTS = ("warp", "staged-t32-b264", "staged-t32-b132", "staged-t32-b528", "staged-t32-b264-noprefetch")
L2_BYTES = 200 << 20  # the weight copies of one shape, together: over any Hopper's L2
EPS = 1e-5


def rule(variant: str):
    from tvmattn.compiler.fused_schedules import CUDAFusedDecodeGEMV

    if variant == "warp":
        return CUDAFusedDecodeGEMV(staged=False)
    parts = variant.split("-")
    prefetch = parts[-1] != "noprefetch"
    if not prefetch:
        parts = parts[:-1]
    if len(parts) != 3 or parts[0] != "staged" or parts[1][:1] != "t" or parts[2][:1] != "b":
        raise ValueError(f"variant {variant!r}: expected warp or staged-t<threads>-b<min_blocks>[-noprefetch]")
    _, threads, blocks = parts
    return CUDAFusedDecodeGEMV(threads=int(threads[1:]), min_blocks=int(blocks[1:]), prefetch=prefetch)


def fused_func(kind: str, k: int, n: int):
    from tvm import te

    from tvmattn.compiler.fused_decode import rms_norm_matmul, rms_norm_matmul_swiglu

    x = te.placeholder((1, 1, k), "float16", "x")
    g = te.placeholder((k,), "float16", "g")
    w = te.placeholder((n, k), "float16", "w")
    y = rms_norm_matmul_swiglu(x, g, w, eps=EPS) if kind == "swiglu" else rms_norm_matmul(x, g, w, eps=EPS)
    return te.create_prim_func([x, g, w, y]).with_attr("global_symbol", "main")


def build(job: tuple, folder: str) -> str:
    """Compile one (shape label, variant) into a shared library; returns its path."""
    import tvm

    label, variant = job
    _, kind, k, n = next(s for s in SHAPES if s[0] == label)
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    with target:
        sch = rule(variant).apply(fused_func(kind, k, n), target, False)
        lib = tvm.compile(tvm.IRModule({"main": sch.mod["main"]}), target=target)
    path = os.path.join(folder, f"{label}-{variant}.so")
    lib.export_library(path)
    return path


def reference(kind: str, x, g, w) -> np.ndarray:
    """float64: the norm rounded to float16 (TVM's rms_norm), the product, SiLU(gate) * up."""
    x64 = x.astype(np.float64)[0, 0]
    normed = (x64 / np.sqrt((x64 ** 2).mean() + EPS) * g.astype(np.float64)).astype(np.float16)
    y = normed.astype(np.float64) @ w.astype(np.float64).T
    if kind == "swiglu":
        gate, up = np.split(y, 2)
        y = gate / (1 + np.exp(-gate)) * up
    return y


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS))
    p.add_argument("--shapes", nargs="+", default=[s[0] for s in SHAPES], choices=[s[0] for s in SHAPES])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--jobs", type=int, default=8, help="build processes")
    p.add_argument("--json", metavar="PATH", help="also write the results as rows (docs/bench-format.md)")
    args = p.parse_args(argv)
    for variant in args.variants:
        rule(variant)  # (a bad name fails before the builds)
    folder = tempfile.mkdtemp(prefix="fused-gemv-")
    jobs = [(label, variant) for label in args.shapes for variant in args.variants]
    with concurrent.futures.ProcessPoolExecutor(args.jobs) as pool:  # before CUDA is touched
        paths = dict(zip(jobs, pool.map(build, jobs, [folder] * len(jobs))))

    import torch
    import tvm
    from bench_small_batch import device_us

    import bench_rows

    dev = tvm.cuda(0)
    meta = bench_rows.run_meta(gpu=True) if args.json else {}
    rng = np.random.default_rng(0)
    rows, failures = [], []
    print(f"{'shape':>18} {'K':>5} {'N':>6} " + " ".join(f"{v:>18}" for v in ("torch", *args.variants))
          + "   (us per call, GB/s of the weight)")
    for label, kind, k, n in (s for s in SHAPES if s[0] in args.shapes):
        x = rng.standard_normal((1, 1, k)).astype(np.float16)
        g = (1 + 0.1 * rng.standard_normal(k)).astype(np.float16)
        w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float16)
        expected = reference(kind, x, g, w)
        copies = max(2, -(-L2_BYTES // w.nbytes))
        weights = torch.from_numpy(w).cuda().unsqueeze(0).repeat(copies, 1, 1)
        xs, gs = torch.from_numpy(x).cuda(), torch.from_numpy(g).cuda()
        out_rows = n // 2 if kind == "swiglu" else n
        outs = torch.empty((1, 1, out_rows), dtype=torch.float16, device="cuda")
        tvm_x, tvm_g, tvm_out = (tvm.runtime.from_dlpack(t) for t in (xs, gs, outs))
        tvm_w = [tvm.runtime.from_dlpack(weights[i]) for i in range(copies)]
        times = {}

        def torch_call(state=[0]):
            i = state[0] = (state[0] + 1) % copies
            h = torch.nn.functional.rms_norm(xs, (k,), gs, EPS)
            y = torch.nn.functional.linear(h, weights[i])
            if kind == "swiglu":
                gate, up = y.chunk(2, dim=-1)
                y = torch.nn.functional.silu(gate) * up
            return y

        times["torch"] = device_us(torch_call, args.iters)
        got = torch_call().float().cpu().numpy().ravel()
        if np.abs(got - expected).max() > 2e-2 * max(1.0, np.abs(expected).max()):
            failures.append(f"{label} torch")
        for variant in args.variants:
            fn = tvm.runtime.load_module(paths[(label, variant)])["main"]

            def call(fn=fn, state=[0]):
                i = state[0] = (state[0] + 1) % copies
                fn(tvm_x, tvm_g, tvm_w[i], tvm_out)

            times[variant] = device_us(call, args.iters)
            fn(tvm_x, tvm_g, tvm_w[0], tvm_out)
            got = outs.float().cpu().numpy().ravel()
            ok = bool(np.allclose(got, expected, rtol=2e-2, atol=2e-2))
            if not ok:
                failures.append(f"{label} {variant}")
            rows.append({"bench": "kernels", "kernel": "fused_rms_norm_gemv", "impl": f"tvmattn-{variant}",
                         "variant": f"{label} {kind}", "dtype": "float16", "batch": 1, "k": k, "n": n,
                         "ms": times[variant] / 1e3, "gbps": w.nbytes / times[variant] / 1e3, "agrees": ok, **meta})
        rows.append({"bench": "kernels", "kernel": "fused_rms_norm_gemv", "impl": "torch", "variant": f"{label} {kind}",
                     "dtype": "float16", "batch": 1, "k": k, "n": n, "ms": times["torch"] / 1e3,
                     "gbps": w.nbytes / times["torch"] / 1e3, **meta})
        print(f"{label:>18} {k:>5} {n:>6} " + " ".join(
            f"{times[v]:>8.2f} {w.nbytes / times[v] / 1e3:>7.0f}  " for v in ("torch", *args.variants)))
    return bench_rows.finish(rows, args.json, failures, "FAILED (disagrees with the reference): ")


if __name__ == "__main__":
    sys.exit(main())
