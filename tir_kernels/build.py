"""Compile a generated PrimFunc for its config's target, and the TIR pipeline that does it.

Two kinds of kernels live side by side: the CUDA-core and CPU kernels are written with
thread bindings and lowered by TVM's standard ("s_tir") pipeline; the Hopper tensor-core
kernels are written in TIRx's explicit form (`T.device_entry`, warpgroups, raw PTX) and
need TVM's "tirx" pipeline. `PIPELINE` ("tvmattn") lowers each function with the pipeline
it was written for (`TIRX_ATTR` marks the TIRx ones), so one module - a cache's kernel or a
whole model library - can hold both. A TIRx kernel also carries its own "target" attribute
(sm_90a: wgmma and setmaxnreg exist only there), built as a separate device module.

Programmatic dependent launch: the device kernels of a PrimFunc carrying the attribute
`PDL_TAG` (TVM's launch tag; TVM's split of host and device code drops it, so the pipeline adds
it to the kernels' launch parameters afterwards) are launched with CUDA's programmatic stream
serialization: their blocks may be scheduled while the previous kernel of the stream still
runs, so every kernel of such a function must call `common.grid_dependency_wait()` before its first
access to global memory. Compiled without this pipeline, the launch is ordinary and the call
returns at once.
"""

from __future__ import annotations

import re

import tvm
import tvm_ffi

from .common import PDL_TAG
from .config import AttentionConfig

PIPELINE = "tvmattn"
TIRX_ATTR = "tvmattn.tirx_pipeline"
DYN_SHARED_TAG = "tirx.use_dyn_shared_memory"  # the runtime requires it last among a kernel's launch tags
LAUNCH_PARAMS_ATTR = "tirx.kernel_launch_params"


def uses_tirx_pipeline(func) -> bool:
    return isinstance(func, tvm.tirx.PrimFunc) and func.attrs is not None and bool(func.attrs.get(TIRX_ATTR, False))


def _tag_dependent_launches(mod: tvm.IRModule) -> tvm.IRModule:
    """Add PDL_TAG to the launch parameters of the device kernels split from each function that
    carries PDL_TAG as an attribute (kernels `<name>_kernel`, `<name>_kernel_<n>`), before the
    dynamic shared memory tag, which the runtime requires last. The host's launch arguments are
    unchanged: the tag takes none."""
    hosts = [gv.name_hint for gv, f in mod.functions_items()
             if isinstance(f, tvm.tirx.PrimFunc) and f.attrs is not None and bool(f.attrs.get(PDL_TAG, False))]
    if not hosts:
        return mod
    kernel = re.compile("^(" + "|".join(re.escape(h) for h in hosts) + r")_kernel(_\d+)?$")
    for gv, func in list(mod.functions_items()):
        if not kernel.match(gv.name_hint) or not isinstance(func, tvm.tirx.PrimFunc) or func.attrs is None:
            continue
        tags = [str(p) for p in func.attrs.get(LAUNCH_PARAMS_ATTR, [])]
        if PDL_TAG in tags:
            continue
        at = tags.index(DYN_SHARED_TAG) if DYN_SHARED_TAG in tags else len(tags)
        mod[gv] = func.with_attr(LAUNCH_PARAMS_ATTR, tags[:at] + [PDL_TAG] + tags[at:])
    return mod


def _mixed_pipeline():
    s_tir, finalize_host, finalize_device = tvm.tirx.get_tir_pipeline("s_tir")
    tirx = tvm.tirx.get_tir_pipeline("tirx")[0]  # its finalize passes are the same as s_tir's

    @tvm.transform.module_pass(opt_level=0, name="tvmattn.MixedTIRPipeline")
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        explicit = {gv: f for gv, f in mod.functions_items() if uses_tirx_pipeline(f)}
        if not explicit:
            return _tag_dependent_launches(s_tir(mod))
        standard = {gv: f for gv, f in mod.functions_items() if gv not in explicit}
        lowered = tirx(tvm.IRModule(explicit, attrs=mod.attrs))
        if standard:
            lowered.update(s_tir(tvm.IRModule(standard, attrs=mod.attrs)))
        return _tag_dependent_launches(lowered)

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
