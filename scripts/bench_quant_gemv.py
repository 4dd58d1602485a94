"""GPU time of the decode projections of SmolLM2-135M, kept quantized against float16, side by side.

For each projection of a decode step (one token): our CUDA GEMV over the GGUF blocks
(tvmattn/quant/gemv_cuda.py, with the residual add where the layer has one) and the
float16 library's kernel for the same product (dlight's GEMV rule on the float16 NT matmul, the
add as its epilogue). Each runs for every one of the model's 30 layers with that layer's own
weights, layer by layer as in a step (the weights together exceed the H200's 50 MB L2, as in the
model), for --steps steps; the table gives the mean GPU time per call from CUPTI (torch.profiler),
as bench_e2e.py --profile does. Random blocks (every bit pattern of a block is valid) and
weights; layer 0's outputs are compared against each other (its float16 W is its blocks
dequantized).

    python scripts/bench_quant_gemv.py [--steps 5] [--layers 30]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import tvm  # noqa: E402
from tvm import te, tirx  # noqa: E402

from tvmattn.compiler.targets import cuda_target  # noqa: E402
from tvmattn.quant.config import QuantMatmulConfig  # noqa: E402
from tvmattn.quant.matmul import kernel  # noqa: E402
from tvmattn.weights.quant import QuantizedTensor, part_shapes  # noqa: E402

# (name, format, N, K, residual): SmolLM2-135M's decode projections and its tied Q8_0 LM head
PROJECTIONS = [("qkv", "Q4_1", 960, 576, False), ("o", "Q4_1", 576, 576, True),
               ("gate_up", "Q4_1", 3072, 576, False), ("down", "Q4_1", 576, 1536, True),
               ("lm_head", "Q8_0", 49152, 576, False)]


def f16_gemv(n: int, k: int, residual: bool, name: str) -> tirx.PrimFunc:
    """The float16 library's decode projection: y[1, n] = sum_k x[1, k] * w[n, k] in float16
    (as Relax's matmul of float16), + r[1, n] as its epilogue, scheduled by dlight's GEMV rule."""
    from tvm.s_tir import dlight as dl

    x = te.placeholder((1, k), "float16", name="x")
    w = te.placeholder((n, k), "float16", name="w")
    red = te.reduce_axis((0, k), name="k")
    y = te.compute((1, n), lambda t, j: te.sum(x[t, red] * w[j, red], axis=red), name="NT_matmul")
    args = [x, w]
    if residual:
        r = te.placeholder((1, n), "float16", name="r")
        y = te.compute((1, n), lambda t, j: y[t, j] + r[t, j], name="add")
        args.append(r)
    func = te.create_prim_func([*args, y])
    mod = tvm.IRModule({name: func.with_attr("global_symbol", name)})
    with cuda_target():
        mod = dl.ApplyDefaultSchedule(dl.gpu.GEMV(), dl.gpu.Fallback())(mod)
    return mod[name]


def random_blocks(fmt: str, n: int, k: int, rng) -> QuantizedTensor:
    """Random quants and float16 scales (every bit pattern of the quants is a valid block)."""
    parts = {}
    for part, dtype, shape in part_shapes(fmt, n, k):
        if dtype == "float16":
            parts[part] = (rng.standard_normal(shape) * 0.01).astype(np.float16)
        else:
            parts[part] = rng.integers(0, 256, shape, dtype=np.uint8).view(dtype)
    return QuantizedTensor(fmt, (n, k), parts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--layers", type=int, default=30)
    args = p.parse_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile

    dev = tvm.cuda(0)
    rng = np.random.default_rng(0)
    runs = []  # (projection, layers of (ours fn, ours args), (f16 fn, f16 args))
    for name, fmt, n, k, residual in PROJECTIONS:
        layers = 1 if name == "lm_head" else args.layers
        config = QuantMatmulConfig(fmt, n, k, tokens=1, target="cuda", dtype="float16", residual=residual)
        ours = tvm.compile(kernel(config), target=cuda_target())
        anchor_name = f"f16_gemv_{name}"
        anchor = tvm.compile(f16_gemv(n, k, residual, anchor_name), target=cuda_target())
        x = tvm.runtime.tensor(rng.standard_normal((1, k)).astype(np.float16), device=dev)
        r = tvm.runtime.tensor(rng.standard_normal((1, n)).astype(np.float16), device=dev)
        y_ours = tvm.runtime.empty((1, n), "float16", dev)
        y_f16 = tvm.runtime.empty((1, n), "float16", dev)
        calls = []
        for layer in range(layers):
            blocks = random_blocks(fmt, n, k, rng)
            parts = [tvm.runtime.tensor(blocks.parts[part], device=dev) for part, _, _ in config.part_shapes()]
            # layer 0's float16 W is its blocks dequantized (the outputs are compared); the others random
            w = (blocks.dequantize() if layer == 0 else rng.standard_normal((n, k)) * 0.05).astype(np.float16)
            w = tvm.runtime.tensor(w, device=dev)
            calls.append(((ours, [x, *parts, *([r] if residual else []), y_ours]),
                          (anchor, [x, w, *([r] if residual else []), y_f16])))
            if layer == 0:
                for (fn, fargs) in calls[0]:
                    fn(*fargs)
                a, b = y_ours.numpy().astype(np.float64), y_f16.numpy().astype(np.float64)
                print(f"{name}: max |ours - f16| {np.abs(a - b).max():.3e} (max |y| {np.abs(b).max():.3e})")
        runs.append((name, calls))
    for _ in range(2):  # warm-up
        for _, calls in runs:
            for pair in calls:
                for fn, fargs in pair:
                    fn(*fargs)
    dev.sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            for layer in range(args.layers):
                for _, calls in runs:
                    if layer < len(calls):
                        for fn, fargs in calls[layer]:
                            fn(*fargs)
        dev.sync()
    times = {e.key: (e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total, e.count)
             for e in prof.key_averages()}
    print(f"{'projection':>10} {'kept (us)':>10} {'f16 (us)':>10} {'kept/f16':>9}   (GPU time per call, "
          f"{args.steps} steps x {args.layers} layers; torch {torch.__version__})")
    per_layer = [0.0, 0.0]
    for name, fmt, n, k, residual in PROJECTIONS:
        config = QuantMatmulConfig(fmt, n, k, tokens=1, target="cuda", dtype="float16", residual=residual)
        ours = next((t / c for key, (t, c) in times.items() if key.startswith(config.name)), float("nan"))
        f16 = next((t / c for key, (t, c) in times.items() if key.startswith(f"f16_gemv_{name}")), float("nan"))
        if name != "lm_head":
            per_layer[0] += ours
            per_layer[1] += f16
        print(f"{name:>10} {ours:>10.3f} {f16:>10.3f} {ours / f16:>9.2f}")
    print(f"{'per layer':>10} {per_layer[0]:>10.3f} {per_layer[1]:>10.3f} {per_layer[0] / per_layer[1]:>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
