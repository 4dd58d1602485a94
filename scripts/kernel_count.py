"""Kernels launched per decode step and per decoder layer, by kind, of a model library.

Exports the library's Relax module for the model (a Hugging Face config.json; no weights are
needed) and runs the model pipeline (tvmattn.compiler.pipeline) for --target, without generating
code, then counts the launches of the step functions (tvmattn.compiler.kernel_count: kinds,
the cache's launches, how kernels are assigned to layers). --quantization keep keeps every weight
matrix in --format blocks (as `compile --quantization keep` does a GGUF's; the CUDA library's
activations are float16, the CPU's float32); none builds the float library (float16 on CUDA,
float32 on llvm, or --dtype). --unfused builds the layers without the fused decode ops
(tvmattn.compiler.fused_decode), the library before them.

    python scripts/kernel_count.py --model scripts/smollm2-config.json --target cuda
        [--quantization none|keep] [--format Q4_1] [--dtype float16] [--unfused]
        [--functions decode,batch_decode,decode_step] [--json OUT.json]

Prints, per function, the launches of one layer by kind (every layer alike; else each layer),
those before the first layer and after the last, and the step's total.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

FUNCTIONS = ("decode", "batch_decode", "decode_step")
FORMATS = ("Q4_0", "Q4_1", "Q8_0")


def lowered_module(hf_config: dict, target: str, quantization: str = "none", fmt: str = "Q4_1",
                   dtype: str | None = None, fused: bool = True, fused_batch_layers: bool = False,
                   decode_append: bool = True):
    """The library module of `hf_config` after the model pipeline for `target` ("llvm", "cuda" or
    "cuda:sm_XY"; CUDA defaults to sm_90), and its BuildOptions (fused_batch_layers,
    decode_append: as BuildOptions')."""
    import tvm

    from tvmattn.build import _weight_formats, kept_dtype
    from tvmattn.compiler.pipeline import relax_pipeline
    from tvmattn.models import BuildOptions, export_module
    from tvmattn.models.config import model_config_from_hf

    if target == "cuda":
        target = "cuda:sm_90"
    config = model_config_from_hf(hf_config)
    formats: tuple = ()
    if quantization == "keep":
        from tvmattn.weights.random_blocks import random_block_tensors

        formats = _weight_formats(config, random_block_tensors(hf_config, fmt, 0), lambda _: None)
        dtype = kept_dtype(target)
    dtype = dtype or ("float32" if target == "llvm" else "float16")
    options = BuildOptions(target=target, dtype=dtype, weight_formats=formats, fused_layers=fused,
                           fused_batch_layers=fused_batch_layers, decode_append=decode_append)
    mod, _ = export_module(config, options)
    tvm_target = options.tvm_target()
    with tvm_target:
        return relax_pipeline(tvm_target, options.small_batch_matmul,
                              tensor_core_matmul=options.tensor_core_matmul)(mod), options


def _kinds(counts: dict[str, int]) -> str:
    from tvmattn.compiler.kernel_count import KINDS

    return ", ".join(f"{kind} {counts[kind]}" for kind in KINDS if counts.get(kind))


def report(mod, functions) -> dict:
    """{function: {"per_layer": {kind: n} or {layer: {kind: n}}, "layer_total", "embed", "head", "total"}}."""
    from tvmattn.compiler.kernel_count import count_step

    out = {}
    for name in functions:
        counts = count_step(mod, name)
        uniform = counts.uniform_layer()
        out[name] = {
            "per_layer": uniform if uniform is not None else {str(k): v for k, v in counts.per_layer.items()},
            "layer_total": sum(uniform.values()) if uniform is not None else None,
            "layers": len(counts.per_layer), "embed": counts.embed, "head": counts.head, "total": counts.total,
        }
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a Hugging Face config.json")
    parser.add_argument("--target", default="cuda", help="llvm, cuda or cuda:sm_XY (default cuda: sm_90)")
    parser.add_argument("--quantization", default="none", choices=("none", "keep"))
    parser.add_argument("--format", default="Q4_1", choices=FORMATS, help="the kept block type (default Q4_1)")
    parser.add_argument("--dtype", default=None, help="the float library's dtype (default float16 on CUDA, "
                                                      "float32 on llvm)")
    parser.add_argument("--unfused", action="store_true", help="without the fused decode ops")
    parser.add_argument("--no-decode-append", dest="decode_append", action="store_false",
                        help="the K/V append in a kernel of its own (compile --no-decode-append)")
    parser.add_argument("--functions", default=",".join(FUNCTIONS[:2]))
    parser.add_argument("--json", default=None, help="also write the counts to this file")
    args = parser.parse_args(argv)
    functions = [f for f in args.functions.split(",") if f]
    bad = [f for f in functions if f not in FUNCTIONS]
    if bad:
        print(f"error: --functions {bad[0]!r}: expected some of {FUNCTIONS}", file=sys.stderr)
        return 2
    if args.target not in ("llvm", "cuda") and not args.target.startswith("cuda:sm_"):
        print(f"error: --target {args.target!r}: expected llvm, cuda or cuda:sm_XY", file=sys.stderr)
        return 2
    try:
        with open(args.model) as f:
            hf_config = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        print(f"error: --model {args.model!r}: {err}", file=sys.stderr)
        return 2
    try:
        mod, options = lowered_module(hf_config, args.target, args.quantization, args.format, args.dtype,
                                      fused=not args.unfused, decode_append=args.decode_append)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    counts = report(mod, functions)
    label = (f"{args.model}: target {options.target}, dtype {options.dtype}, "
             f"{'kept ' + args.format if args.quantization == 'keep' else 'float weights'}, "
             f"{'unfused' if args.unfused else 'fused'} layers" + ("" if args.decode_append else ", no decode_append"))
    print(label)
    for name, c in counts.items():
        if c["layer_total"] is not None:
            print(f"  {name}: {c['layer_total']} per layer ({_kinds(c['per_layer'])}) x {c['layers']} layers; "
                  f"before the layers {sum(c['embed'].values())}, after {sum(c['head'].values())}; "
                  f"step total {c['total']}")
        else:
            print(f"  {name}: layers differ: " + "; ".join(f"layer {k}: {_kinds(v)}" for k, v in c["per_layer"].items())
                  + f"; step total {c['total']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"label": label, "target": options.target, "dtype": options.dtype,
                       "quantization": args.quantization, "fused": not args.unfused, "functions": counts}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
