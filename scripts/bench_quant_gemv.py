"""GPU time of a model's decode projections, kept quantized against float16, side by side.

For each projection of a decode step: our CUDA kernel over the GGUF blocks (the one a library
routes to: quant.matmul.kernel; with the residual add where the layer has one) and the float16
library's product. One token (--tokens 1): gemv_cuda's GEMV against dlight's GEMV rule on the
float16 NT matmul (the add as its epilogue). A decode batch (--tokens 4,16,64): the routed kernel
(gemv_mma for Q4_0 / Q4_1 / Q8_0) and each --mma-plans layout of gemv_mma (`MMAGemvSchedule`,
written w4t2u4r1: warps, token tiles, unroll, row tiles) against torch's float16 matmul
(cuBLAS; addmm with the residual). Each runs for every one of the model's layers with that
layer's own weights, layer by layer as in a step (the weights together exceed the H200's 50 MB
L2, as in the model), for --steps steps; the table gives the mean GPU time per call from CUPTI
(torch.profiler), all of a call's kernels summed. Random blocks (every bit pattern of a block is
valid) and weights; layer 0's outputs are checked against the float16 product of its blocks
dequantized (`agrees`): a kernel that disagrees is marked, and the script exits with status 1.

    python scripts/bench_quant_gemv.py [--model smollm2|llama-1b] [--tokens 1,16,64] [--steps 5]
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import tvm  # noqa: E402
from tvm import te, tirx  # noqa: E402

from tvmattn.compiler.targets import cuda_target  # noqa: E402
from tvmattn.quant.config import QuantMatmulConfig  # noqa: E402
from tvmattn.quant.gemv_mma import MMA_GEMV_FORMATS, MMAGemvSchedule, mma_gemv_kernel  # noqa: E402
from tvmattn.quant.matmul import kernel  # noqa: E402
from tvmattn.weights.quant import QuantizedTensor, part_shapes  # noqa: E402

# model -> (layers, [(name, format, N, K, residual)]): the decode projections and the LM head;
# SmolLM2-135M's as its GGUF keeps them (Q4_1, a Q8_0 head), Llama-3.2-1B's as bench_e2e's
# --keep-format Q4_0 draws them
MODELS = {
    "smollm2": (30, [("qkv", "Q4_1", 960, 576, False), ("o", "Q4_1", 576, 576, True),
                     ("gate_up", "Q4_1", 3072, 576, False), ("down", "Q4_1", 576, 1536, True),
                     ("lm_head", "Q8_0", 49152, 576, False)]),
    "llama-1b": (16, [("qkv", "Q4_0", 3072, 2048, False), ("o", "Q4_0", 2048, 2048, True),
                      ("gate_up", "Q4_0", 16384, 2048, False), ("down", "Q4_0", 2048, 8192, True),
                      ("lm_head", "Q4_0", 128256, 2048, False)]),
}


def parse_plan(text: str) -> MMAGemvSchedule:
    """'w4t2u4r2' -> MMAGemvSchedule(warps=4, token_tiles=2, unroll=4, row_tiles=2)."""

    match = re.fullmatch(r"w(\d)t(\d)u(\d)r(\d)", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"plan {text!r}: expected w<warps>t<token tiles>u<unroll>r<row tiles>, "
                                         "e.g. w4t2u4r1")
    return MMAGemvSchedule(warps=int(match[1]), token_tiles=int(match[2]), unroll=int(match[3]),
                           row_tiles=int(match[4]))


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


def agrees(got, want, scale) -> bool:
    """Whether a kernel's Y agrees with the float16 product: |Y - want| <= 2^-11 |want| (Y's
    rounding) + 2^-10 scale (the weights' rounding to float16, which gemv_cuda leaves out, and
    the float32 sums), scale = |X| |W|^T (+ |R|); torch tensors, on any device."""
    got, want, scale = got.double(), want.double(), scale.double()
    return bool(((got - want).abs() <= 2.0 ** -11 * want.abs() + 2.0 ** -10 * scale + 1e-6).all())


@functools.lru_cache(maxsize=None)
def kernels_of(name, fmt, n, k, residual, batch, plans):
    """([(label, compiled function)], anchor) of one projection, one token or a decode batch: the
    routed kernel, then each plan's (MMA_GEMV_FORMATS; at one token the plan's first token tile
    holds the token); anchor: dlight's float16 GEMV (one token) or None (a batch: torch's matmul)."""
    config = QuantMatmulConfig(fmt, n, k, tokens=None if batch else 1, few_tokens=batch, target="cuda",
                               dtype="float16", residual=residual)
    ours = [("routed", tvm.compile(kernel(config), target=cuda_target()))]
    if fmt in MMA_GEMV_FORMATS:
        for text, plan in plans:
            func = mma_gemv_kernel(fmt, n, k, "float16", plan, residual=residual)
            ours.append((text, tvm.compile(func.with_attr("global_symbol", f"mma_{name}_{text}"),
                                           target=cuda_target())))
    anchor = None if batch else tvm.compile(f16_gemv(n, k, residual, f"f16_gemv_{name}"), target=cuda_target())
    return ours, anchor


def gpu_us_per_call(calls: list, steps: int) -> float:
    """Mean GPU time per call (all of a call's kernels, from CUPTI) over `steps` rounds of `calls`,
    after two warm-up rounds."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for call in calls * 2:
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            for call in calls:
                call()
        torch.cuda.synchronize()
    total = sum(e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
                for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)
    return total / (steps * len(calls))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", choices=sorted(MODELS))
    p.add_argument("--tokens", default="1", help="comma-separated token counts (1: one token; more: a decode batch)")
    p.add_argument("--mma-plans", default="", help="comma-separated gemv_mma layouts beside the routed kernel, e.g. "
                                                  "w4t2u4r1,w8t2u4r2")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--layers", type=int, default=None, help="layers to cycle through (default: the model's)")
    args = p.parse_args(argv)
    import torch

    layers, projections = MODELS[args.model]
    layers = args.layers or layers
    plans = [(text, parse_plan(text)) for text in args.mma_plans.split(",") if text]
    dev = tvm.cuda(0)
    rng = np.random.default_rng(0)
    weights = {}  # projection -> [(blocks parts on the device, float16 W as torch)] per layer
    for name, fmt, n, k, residual in projections:
        count = 1 if name == "lm_head" else layers
        per_layer = []
        for layer in range(count):
            blocks = random_blocks(fmt, n, k, rng)
            parts = [tvm.runtime.tensor(blocks.parts[part], device=dev) for part, _, _ in part_shapes(fmt, n, k)]
            # layer 0's float16 W is its blocks dequantized (the outputs are compared); the others random
            w = (torch.tensor(blocks.dequantize(), dtype=torch.float16, device="cuda") if layer == 0 else
                 torch.randn(n, k, dtype=torch.float16, device="cuda") * 0.05)
            per_layer.append((parts, w))
        weights[name] = per_layer
    print(f"{args.model}: {layers} layers, GPU us per call ({args.steps} steps; torch {torch.__version__})")
    disagreeing = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        table = {}  # (projection, label) -> us per call
        for name, fmt, n, k, residual in projections:
            ours, anchor = kernels_of(name, fmt, n, k, residual, tokens > 1, tuple(plans))
            x16 = torch.randn(tokens, k, dtype=torch.float16, device="cuda")
            r16 = torch.randn(tokens, n, dtype=torch.float16, device="cuda")
            y = torch.empty(tokens, n, dtype=torch.float16, device="cuda")
            x, r, y_tvm = (tvm.runtime.from_dlpack(t) for t in (x16, r16, y))
            w0 = weights[name][0][1].double()
            want = x16.double() @ w0.T + (r16.double() if residual else 0)
            scale = x16.double().abs() @ w0.abs().T + (r16.double().abs() if residual else 0)
            runs = []
            for label, fn in ours:
                calls = [lambda fn=fn, parts=parts: fn(x, *parts, *([r] if residual else []), y_tvm)
                         for parts, _ in weights[name]]
                calls[0]()
                err = (y.double() - want).abs().max().item()
                ok = agrees(y, want, scale)
                disagreeing += [] if ok else [f"{tokens} tokens {name} {label}"]
                print(f"  {tokens:>3} tokens {name:>8} {label:>8}: max |ours - f16| {err:.3e} "
                      f"(max |y| {want.abs().max().item():.3e}) {'agrees' if ok else 'DISAGREES'}")
                runs.append((label, calls))
            if anchor is not None:
                runs.append(("f16", [lambda w=w: anchor(x, tvm.runtime.from_dlpack(w), *([r] if residual else []),
                                                        y_tvm) for _, w in weights[name]]))
            else:
                runs.append(("f16", [(lambda w=w: torch.addmm(r16, x16, w.T, out=y)) if residual else
                                     (lambda w=w: torch.matmul(x16, w.T, out=y)) for _, w in weights[name]]))
            for label, calls in runs:
                table[name, label] = gpu_us_per_call(calls, args.steps)
        labels = list(dict.fromkeys(label for _, label in table))
        print(f"{'tokens':>6} {'projection':>10} " + " ".join(f"{label:>9}" for label in labels) + "   routed/f16")
        per_layer = {label: 0.0 for label in labels}
        for name, *_ in projections:
            row = [table.get((name, label), float("nan")) for label in labels]
            if name != "lm_head":
                for label, value in zip(labels, row):
                    per_layer[label] += value
            print(f"{tokens:>6} {name:>10} " + " ".join(f"{v:>9.2f}" for v in row)
                  + f"   {table[name, 'routed'] / table[name, 'f16']:>6.2f}")
        print(f"{tokens:>6} {'per layer':>10} " + " ".join(f"{per_layer[label]:>9.2f}" for label in labels)
              + f"   {per_layer['routed'] / per_layer['f16']:>6.2f}")
    if disagreeing:
        print("disagree with the float16 product: " + ", ".join(disagreeing))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
