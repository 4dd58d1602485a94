"""tvmattn: TVM-native paged attention for LLM inference.

The kernels live in the sibling package `tir_kernels` (generators from a validated
`AttentionConfig` to TIR PrimFuncs, for CUDA and the CPU). This package holds what is built on
top of them, in layers:
- `tvmattn.runtime`: the Python paged KV cache `PagedKVCache` (page allocator, sequence table,
  host planning, attention backends) and the `tvmattn.*` packed functions;
- `tvmattn.weights` (GGUF / safetensors readers), `tvmattn.quant` (fused kernels and layers over
  GGUF blocks), `tvmattn.compiler` (the Relax pipeline, its CPU schedule rules, the targets);
- `tvmattn.models` (the Llama-family and DeepSeek model libraries on this cache);
- `tvmattn.build` compiles a model library; `tvmattn.session` loads one and runs its steps;
  `tvmattn.serve` (the engine, its one decode loop, and the HTTP server) schedules them;
  `tvmattn.generate` (`Generator`) answers prompts through that engine; `tvmattn.quickstart`
  and `python -m tvmattn`, the command line, sit on top.

`import tvmattn` registers the `tvmattn.*` packed functions (a model library built on this cache
needs them). The one exception is the command line: while `python -m tvmattn` locates its
`__main__`, the runtime (and TVM, seconds to import) is left for the command that needs it,
so that `--help` and argument errors answer at once.
"""

import sys as _sys

__version__ = "0.1.0"

_RUNTIME_NAMES = ("CacheOptions", "PagedKVCache", "KVCacheError", "install_vm_builtins", "uninstall_vm_builtins")


def __getattr__(name):  # PEP 562: the runtime's names, imported on first use
    if name in _RUNTIME_NAMES:
        from . import runtime

        return getattr(runtime, name)
    if name == "calibrate_kv_scales":  # FP8 KV scales from prompts (tvmattn/calibrate.py)
        from .calibrate import calibrate_kv_scales

        return calibrate_kv_scales
    raise AttributeError(f"module 'tvmattn' has no attribute {name!r}")


# Python sets sys.argv[0] to "-m" only while it locates the module of `python -m ...`.
if _sys.argv[:1] != ["-m"]:
    from . import runtime as _runtime  # noqa: F401  - registers tvmattn.*
