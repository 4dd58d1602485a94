"""The GPU kernels of a small-batch decode step, variant by variant (a tuning aid, H200):

- matmuls: the symbolic-batch projections of a model library's `decode_step` (taken from the
  exported module after legalization, so the same fused PrimFuncs; beside them gate_up with
  SiLU * mul as one op, compiler.fused_decode.matmul_swiglu, which only the "tc" variants take), scheduled by dlight's
  default CUDA rules ("matmul"), by compiler.pipeline.DecodeBatchGEMV (dlight's LowBatchGEMV)
  with a batch bucket of 4, 8 or 16 ("gemv-b<bucket>"), by compiler.pipeline.SmallBatchMatmul
  (CUDA cores, "rows"), by compiler.tensor_core_matmul.SmallBatchTensorCoreMatmul alone
  (tensor cores at every batch, "tc"), or by the pipeline's rules with the tensor-core kernel
  (compiler.pipeline.small_batch_rules(True): CUDA cores below batch 16, "hybrid"), at batches
  1 to 128; checked against torch (float32 products of the same fp16 inputs).
- decode attention: tir_kernels.paged_decode with the default CUDA-core schedule and variants
  of it (DECODE_VARIANTS: split size and count, rows per thread), at batch 1, 16 and 64
  (--len keys each).

Kernel time is the device time of its kernels (torch.profiler, mean over --iters calls), not
the host launch time. Everything is compiled before CUDA is first used (a compile after that
has failed on the GPU machine); `--only matmul` runs the matmul part alone.

    python scripts/bench_small_batch.py [--model scripts/smollm2-config.json] [--len 520] [--iters 20]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BATCHES = (1, 2, 4, 8, 16, 64, 128)
BUCKETS = (4, 8, 16)


def device_us(fn, iters: int) -> float:
    """Mean device time (us) of the CUDA kernels one fn() call launches."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    total = sum(e.device_time_total for e in prof.key_averages() if e.device_time_total > 0
                and e.key not in ("cudaDeviceSynchronize",) and not e.key.startswith("Memcpy")
                and not e.key.startswith("Memset"))
    return total / iters


def decode_step_matmuls(model: str, max_batch: int, fused: bool = False):
    """{name: PrimFunc}: decode_step's legalized matmul PrimFuncs (symbolic batch_size) of the
    library without the fused decode ops (every projection plain); fused: the library's fused
    decode ops instead (compiler.fused_decode: RMSNorm + qkv, RMSNorm + gate_up + SiLU * mul)."""
    import tvm
    from tvm import relax, tirx
    from tvm.relax.backend.cuda import pipeline as backend

    from tvmattn.models import BuildOptions, export_module
    from tvmattn.models.config import model_config_from_hf
    from tvmattn.compiler.pipeline import SmallBatchMatmul, _has_var

    config = model_config_from_hf(json.load(open(model)))
    # (a CUDA library fuses its batched steps only with fused_batch_layers: models/export.py)
    options = BuildOptions(target="cuda:sm_90", dtype="float16", max_batch_size=max_batch, fused_layers=fused,
                           fused_batch_layers=fused)
    mod, _ = export_module(config, options)
    target = options.tvm_target()
    with target:
        legalize = list(backend.legalize_passes(target))[:-1]  # without dlight's default schedule
        mod = tvm.transform.Sequential([relax.transform.FuseTransposeMatmul()]
                                       + backend.library_dispatch_passes(target) + legalize)(mod)
    funcs = {}
    for gv, func in mod.functions.items():
        if not (isinstance(func, tirx.PrimFunc) and _has_var(func, "batch_size")):
            continue
        if fused:
            if gv.name_hint.startswith("fused_rms_norm_matmul"):
                funcs[gv.name_hint] = func
        # decode_step's [batch_size, 1, K] x [N, K]^T projections: the pattern SmallBatchMatmul takes
        elif "matmul" in gv.name_hint and SmallBatchMatmul(max_weight_bytes=None).apply(func, target, False) is not None:
            funcs[gv.name_hint] = func
    return funcs, target


def swiglu_matmuls(model: str) -> dict:
    """{"fused_matmul_swiglu": PrimFunc}: the model's gate_up with SiLU * mul as one op over the
    symbolic batch (what a CUDA library's batched steps run), or {} where the kernel does not
    serve its shape."""
    from tvmattn.compiler.tensor_core_matmul import swiglu_matmul_definition, swiglu_matmul_takes
    from tvmattn.models.config import model_config_from_hf

    config = model_config_from_hf(json.load(open(model)))
    hidden, intermediate = config.hidden_size, config.intermediate_size
    if not swiglu_matmul_takes(intermediate, hidden, "float16"):
        return {}
    return {"fused_matmul_swiglu": swiglu_matmul_definition(intermediate, hidden, "float16")}


def schedule(func, target, variant: str):
    """The compiled module of func under `variant`: "matmul", "gemv-b<bucket>", "rows"
    (SmallBatchMatmul), "rows-r<R>-t<T>" (SmallBatchMatmul(rows=R, threads=T)), "tc"
    (SmallBatchTensorCoreMatmul), "hybrid" (small_batch_rules(True)) or "tc-n<W>-p<S>" (its kernel with warps_n=W and S stages, K
    tiled as the default schedule tiles it); None where a tc variant does not tile the weight."""
    import tvm
    from tvm.s_tir import dlight as dl
    from tvm.relax.backend.cuda import pipeline as backend

    from tvmattn.compiler.pipeline import DecodeBatchGEMV, SmallBatchMatmul, small_batch_rules
    from tvmattn.compiler.tensor_core_matmul import SmallBatchTensorCoreMatmul, swiglu_shaped

    mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
    with target:
        if _is_fused(func):  # RMSNorm + projection: the fused GEMV ("rows"), norm_matmul ("tc") or both
            from tvmattn.compiler.fused_schedules import CUDAFusedDecodeGEMV
            from tvmattn.compiler.tensor_core_matmul import FusedNormTensorCoreMatmul

            rules = {"rows": [CUDAFusedDecodeGEMV()], "tc": [FusedNormTensorCoreMatmul()],
                     "hybrid": [FusedNormTensorCoreMatmul(below=CUDAFusedDecodeGEMV()), CUDAFusedDecodeGEMV()]}
            if variant not in rules:
                return None
            mod = dl.ApplyDefaultSchedule(*rules[variant])(mod)
            if "tirx.is_scheduled" not in mod["main"].attrs:
                return None
        elif swiglu_shaped(func):  # no CUDA-core schedule: the tensor-core kernel at every batch
            if not (variant.startswith("tc") or variant == "hybrid"):
                return None
            tc = "tc" if variant == "hybrid" else variant
            mod = dl.ApplyDefaultSchedule(SmallBatchTensorCoreMatmul(tc_schedule(tc)))(mod)
            if "tirx.is_scheduled" not in mod["main"].attrs:
                return None
        elif variant.startswith("tc"):
            mod = dl.ApplyDefaultSchedule(SmallBatchTensorCoreMatmul(tc_schedule(variant)))(mod)
            if "tirx.is_scheduled" not in mod["main"].attrs:
                return None  # (the variant does not tile this weight)
        elif variant.startswith("gemv-b"):
            mod = dl.ApplyDefaultSchedule(DecodeBatchGEMV(int(variant[6:]), max_weight_bytes=None))(mod)
        elif variant == "rows":
            mod = dl.ApplyDefaultSchedule(SmallBatchMatmul())(mod)
        elif variant == "hybrid":
            mod = dl.ApplyDefaultSchedule(*small_batch_rules(tensor_cores=True))(mod)
        elif variant.startswith("rows-"):
            rows, threads = (int(part[1:]) for part in variant.split("-")[1:])
            mod = dl.ApplyDefaultSchedule(SmallBatchMatmul(rows=rows, threads=threads, max_weight_bytes=None))(mod)
        mod = list(backend.legalize_passes(target))[-1](mod)
        return tvm.compile(mod, target=target)


def tc_schedule(variant: str):
    """schedule_for(n, k) of a "tc" / "tc-n<W>-p<S>" variant (None: the rule's default)."""
    if variant == "tc":
        return None
    from tvmattn.compiler.tensor_core_matmul import choose_skinny_schedule

    warps_n, stages = (int(part[1:]) for part in variant.split("-")[1:])

    def schedule_for(n, k, halves=1):
        base = choose_skinny_schedule(n, k, halves)
        return None if base is None else dataclasses.replace(base, warps_n=warps_n, stages=stages)

    return schedule_for


TC_SWEEP = tuple(f"tc-n{w}-p{s}" for w in (1, 2, 4) for s in (3, 4, 6))
MATMUL_VARIANTS = (("matmul", "rows", "tc", "hybrid") + TC_SWEEP + tuple(f"gemv-b{b}" for b in BUCKETS)
                   + tuple(f"rows-r{r}-t{t}" for r in (2, 4, 8, 16) for t in (32, 64, 128)))


def _is_fused(func) -> bool:
    """Whether func is a fused decode op (RMSNorm + projection) rather than a plain projection."""
    from tvmattn.compiler.tensor_core_matmul import fused_op_params

    return fused_op_params(func) is not None


def build_matmuls(args):
    """[(name, func, {variant: compiled module})] of decode_step's matmuls (with --fused, its
    fused decode ops)."""
    funcs, target = decode_step_matmuls(args.model, max(BATCHES), args.fused)
    if not args.fused:
        funcs.update(swiglu_matmuls(args.model))
    return [(name, func, {v: schedule(func, target, v) for v in args.variants}) for name, func in sorted(funcs.items())]


def bench_matmuls(args, built_funcs, rows):
    import torch
    import tvm

    for name, func, built in built_funcs:
        print(f"{name}: {[shape for shape, _ in _buffers(func)]}", flush=True)
        for batch in BATCHES:
            ins = _inputs(func, batch)
            ref = _reference(func, ins)
            for variant, lib in built.items():
                if lib is None:  # (a tc variant that does not tile this weight)
                    continue
                vm_args = [tvm.runtime.from_dlpack(t) for t in ins]
                fn = lib["main"]
                fn(*vm_args)
                torch.cuda.synchronize()
                out = ins[-1].float()
                err = float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-6))
                us = device_us(lambda: fn(*vm_args), args.iters)
                rows.append(dict(part="matmul", func=name, batch=batch, variant=variant, us=round(us, 2),
                                 rel_err=float(f"{err:.2e}")))
                print(f"  b{batch:<3d} {variant:10s} {us:8.2f} us  rel err {err:.1e}", flush=True)


def _buffers(func):
    """[(shape with batch_size as None, dtype)] of func's parameters (TVM 0.27: buffer params)."""
    from tvm import tirx

    return [([None if isinstance(d, tirx.Var) else int(d) for d in p.shape], str(p.dtype)) for p in func.params]


def _inputs(func, batch):
    import torch

    gen = torch.Generator(device="cuda").manual_seed(batch)
    ins = []
    for shape, dtype in _buffers(func):
        full = [batch if d is None else d for d in shape]
        ins.append((torch.randn(full, generator=gen, device="cuda") * 0.5).to(getattr(torch, dtype)))
    return ins


def _reference(func, ins):
    """x @ W^T in float32 (+ the residual of a fused add); a fused decode op: x's RMSNorm (rounded
    to its dtype) times W^T (+ bias), or SwiGLU of its gate and up halves."""
    if _is_fused(func):
        import torch

        from tvmattn.compiler.tensor_core_matmul import fused_op_params

        eps, swiglu = fused_op_params(func)
        x, g, w = ins[0].float()[:, 0], ins[1].float(), ins[2].float()
        h = (x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * g).to(ins[0].dtype).float()
        out = h @ w.T
        if swiglu:
            gate, up = out.chunk(2, dim=-1)
            out = torch.nn.functional.silu(gate) * up
        elif len(ins) == 5:
            out = out + ins[3].float()
        return out[:, None]
    from tvmattn.compiler.tensor_core_matmul import swiglu_shaped

    x, w = ins[0].float(), ins[1].float()
    out = x @ w.T
    if swiglu_shaped(func):  # silu(gate) * up of the float32 sums
        import torch

        gate, up = out.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up
    if len(ins) == 4:  # fused_NT_matmul_add: (x, W, residual, out)
        out = out + ins[2].float()
    return out


# decode schedules: label -> DecodeSchedule fields replaced in the default CUDA-core schedule
# (m: min_split_keys, r: rows_per_thread, b: target_blocks in SMs)
DECODE_VARIANTS = {"default": {}, "m1": dict(min_split_keys=1), "m128": dict(min_split_keys=128),
                   "nosplit": dict(max_splits=1), "r4": dict(rows_per_thread=4), "r8": dict(rows_per_thread=8),
                   "b8": dict(target_blocks=8 * 132), "r4-b8": dict(rows_per_thread=4, target_blocks=8 * 132),
                   "b16": dict(target_blocks=16 * 132)}


def build_decode(args):
    """{variant: compiled paged_decode}: the default CUDA-core schedule with DECODE_VARIANTS' changes."""
    import tvm

    from tir_kernels import AttentionConfig, paged_decode
    from tir_kernels.schedules import choose_decode_schedule

    hq, hkv, d, ps = args.heads
    config = AttentionConfig(hq, hkv, d, dtype="float16", page_size=ps, target="cuda:sm_90")
    base = choose_decode_schedule(config)
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    return {v: tvm.compile(paged_decode(config, dataclasses.replace(base, **DECODE_VARIANTS[v])), target=target)
            for v in args.decode_variants}


def bench_decode(args, libs, rows):
    import torch
    import tvm

    from tir_kernels import default_sm_scale

    hq, hkv, d, ps = args.heads
    for batch in (1, 16, 64):
        pages_per = -(-args.len // ps)
        num_pages = batch * pages_per
        gen = torch.Generator(device="cuda").manual_seed(batch)
        pages = torch.randn((num_pages, 2, hkv, ps, d), generator=gen, device="cuda").half()
        indptr = torch.arange(0, num_pages + 1, pages_per, device="cuda", dtype=torch.int32)
        indices = torch.randperm(num_pages, generator=gen, device="cuda").int()
        last = torch.full((batch,), args.len - (pages_per - 1) * ps, device="cuda", dtype=torch.int32)
        pos = torch.zeros((batch,), device="cuda", dtype=torch.int32)
        q = torch.randn((batch, hq, d), generator=gen, device="cuda").half()
        outs = {}
        for m, lib in libs.items():
            o = torch.empty((batch, hq, d), device="cuda", dtype=torch.float16)
            lse = torch.empty((batch, hq), device="cuda", dtype=torch.float32)
            targs = [tvm.runtime.from_dlpack(t) for t in (q, pages, indptr, indices, last, pos, pos, o, lse)]
            fn = lib["batch_decode_paged_kv"]

            def call(fn=fn, targs=targs):
                fn(*targs, 0, 1.0, 1e4, default_sm_scale(d))

            call()
            torch.cuda.synchronize()
            outs[m] = o.float().clone()
            us = device_us(call, args.iters)
            first = next(iter(outs))
            err = float((outs[m] - outs[first]).abs().max())
            rows.append(dict(part="decode", batch=batch, len=args.len, variant=m, us=round(us, 2),
                             diff_vs_first=float(f"{err:.2e}")))
            print(f"decode b{batch:<3d} len {args.len} {m:10s}: {us:8.2f} us (max |o - o[{first}]| "
                  f"{err:.1e})", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=os.path.join(os.path.dirname(__file__), "smollm2-config.json"))
    parser.add_argument("--len", type=int, default=520, help="keys per request of the decode part")
    parser.add_argument("--heads", type=int, nargs=4, default=(9, 3, 64, 16), metavar=("HQ", "HKV", "D", "PAGE"))
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--only", choices=("matmul", "decode"))
    parser.add_argument("--variants", nargs="+", choices=MATMUL_VARIANTS, default=["matmul", "rows", "tc", "hybrid"],
                        help="matmul schedules to compare")
    parser.add_argument("--decode-variants", nargs="+", choices=list(DECODE_VARIANTS), default=list(DECODE_VARIANTS),
                        help="CUDA-core decode schedules to compare")
    parser.add_argument("--fused", action="store_true",
                        help="the library's fused decode ops (RMSNorm + qkv, RMSNorm + gate_up + SiLU * mul) instead "
                             "of its plain projections: variants rows (the fused GEMV), tc (norm_matmul), hybrid")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    rows = []
    # everything is compiled before CUDA is touched (compiles after it have failed: tune_decode.py)
    decode_libs = build_decode(args) if args.only != "matmul" else None
    matmul_libs = build_matmuls(args) if args.only != "decode" else None
    if decode_libs is not None:
        bench_decode(args, decode_libs, rows)
    if matmul_libs is not None:
        bench_matmuls(args, matmul_libs, rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
