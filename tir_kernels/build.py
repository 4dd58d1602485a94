"""Compile a generated PrimFunc for its config's target, and the TIR pipeline that does it.

Two kinds of kernels live side by side: the CUDA-core and CPU kernels are written with
thread bindings and lowered by TVM's standard ("s_tir") pipeline; the Hopper tensor-core
kernels are written in TIRx's explicit form (`T.device_entry`, warpgroups, raw PTX) and
need TVM's "tirx" pipeline. `PIPELINE` ("tvmattn") lowers each function with the pipeline
it was written for (`TIRX_ATTR` marks the TIRx ones), so one module - a cache's kernel or a
whole model library - can hold both. A TIRx kernel also carries its own "target" attribute
(sm_90a: wgmma and setmaxnreg exist only there), built as a separate device module.
"""

from __future__ import annotations

import tvm
import tvm_ffi

from .config import AttentionConfig

PIPELINE = "tvmattn"
TIRX_ATTR = "tvmattn.tirx_pipeline"


def uses_tirx_pipeline(func) -> bool:
    return isinstance(func, tvm.tirx.PrimFunc) and func.attrs is not None and bool(func.attrs.get(TIRX_ATTR, False))


def _mixed_pipeline():
    s_tir, finalize_host, finalize_device = tvm.tirx.get_tir_pipeline("s_tir")
    tirx = tvm.tirx.get_tir_pipeline("tirx")[0]  # its finalize passes are the same as s_tir's

    @tvm.transform.module_pass(opt_level=0, name="tvmattn.MixedTIRPipeline")
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        explicit = {gv: f for gv, f in mod.functions_items() if uses_tirx_pipeline(f)}
        if not explicit:
            return s_tir(mod)
        standard = {gv: f for gv, f in mod.functions_items() if gv not in explicit}
        lowered = tirx(tvm.IRModule(explicit, attrs=mod.attrs))
        if standard:
            lowered.update(s_tir(tvm.IRModule(standard, attrs=mod.attrs)))
        return lowered

    return _pipeline, finalize_host, finalize_device


tvm.tirx.register_tir_pipeline(PIPELINE, _mixed_pipeline)

# TVM compiles each CUDA device module with the arch of the *current* target (or of the GPU
# present), not of the module's own target; inside `with Target(sm_90)` a module holding
# wgmma would go to ptxas as sm_90 and fail. Its source names instructions that exist only on
# sm_90a, so such a module is compiled for sm_90a, every other module as TVM would.
HOPPER_ONLY = ("wgmma.mma_async", "setmaxnreg.")
_tvm_cuda_compile = tvm_ffi.get_global_func("tvm_callback_cuda_compile", allow_missing=True)


def _cuda_compile(code):
    if any(mark in code for mark in HOPPER_ONLY):
        with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}):
            return _tvm_cuda_compile(code)
    return _tvm_cuda_compile(code)


if _tvm_cuda_compile is not None:
    tvm_ffi.register_global_func("tvm_callback_cuda_compile", _cuda_compile, override=True)


def build(func: tvm.tirx.PrimFunc, config: AttentionConfig):
    """Compile `func` for `config.tvm_target()`; returns the callable packed function.

    Without a GPU driver a CUDA build embeds CUDA source that TVM compiles when loaded.
    """
    name = str(func.attrs["global_symbol"]) if func.attrs and "global_symbol" in func.attrs else "main"
    module = tvm.compile(tvm.IRModule({name: func}), target=config.tvm_target(), tir_pipeline=PIPELINE)
    return module[name]
