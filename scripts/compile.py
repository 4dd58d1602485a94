"""Compile a model library: `python scripts/compile.py --model smollm2-135m -o smollm2.so`.

A thin argparse layer over `tvmattn.build.compile_model`; writes OUT.so, OUT.params.npz and
OUT.runtime.json. Run it with `python -m tvmattn generate --lib OUT.so --prompt TEXT`.
A CUDA build on a machine without a GPU driver restarts itself once with a stand-in driver
(tvmattn/offline_cuda.py) so that the library embeds compiled cubins, not CUDA source.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Compile a Llama-family model library on the tvmattn cache.")
    p.add_argument("--model", required=True, help="smollm2-135m, a .gguf file or a config.json path")
    p.add_argument("--target", default="auto", choices=["auto", "cuda", "llvm"])
    p.add_argument("--cuda-arch", default="sm_90")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                   help="default: float32 on llvm, float16 on cuda")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-batch-size", type=int, default=4)
    p.add_argument("--context-window", type=int, default=None)
    p.add_argument("--prefill-chunk", type=int, default=None)
    p.add_argument("--kv-cache", default="tvmattn", choices=["tvmattn", "tvm"])
    p.add_argument("-o", "--output", required=True, help="OUT.so")
    p.add_argument("--dump-ir", default=None, metavar="DIR")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from tvmattn import offline_cuda
    from tvmattn.build import compile_model, resolve_target
    from tvmattn.weights import WeightError

    try:
        target = resolve_target(args.target, args.cuda_arch)
        if target.startswith("cuda") and not offline_cuda.has_cuda_runtime():
            # No GPU driver here: restart once with a stand-in driver so that the library
            # embeds cubins instead of CUDA source (tvmattn/offline_cuda.py).
            reason = offline_cuda.why_not_offline()
            if reason is None:
                offline_cuda.reexec_with_standin()
            print(f"note: the library will hold CUDA source, compiled when it loads ({reason})", file=sys.stderr)
        compile_model(args.model, args.output, target=args.target, cuda_arch=args.cuda_arch, dtype=args.dtype,
                      page_size=args.page_size, max_batch_size=args.max_batch_size,
                      context_window=args.context_window, prefill_chunk=args.prefill_chunk,
                      kv_cache=args.kv_cache, dump_ir=args.dump_ir)
    except (ValueError, WeightError) as err:  # BuildError, WeightError, ModelConfigError
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
