"""The Relax compilation pipeline of a model library.

TVM's default pipeline for a target, with two changes that matter for speed:
- `FuseTransposeMatmul` first: `nn.Linear` multiplies by `permute_dims(weight)`, which the
  default pipeline runs as a separate transpose kernel of every weight at every call (5 per
  layer, measured on the H200: more time than the attention); fused, each projection is one
  `NT_matmul` that dlight's GEMV / Matmul rules schedule.
- on the CPU, after fusion: cpu_matmul.CPUMatmul for the multi-token projections (prefill,
  batch_prefill, batch_verify, batch_decode: token tiles that share each weight read, vectorized;
  unscheduled they re-read every weight per token), then dlight's CPU rules (GEMV for the
  single-token decode projections, Reduction for norms); the default CPU pipeline schedules nothing.
  A reduction over one static row (decode's RMSNorm of [1, 1, hidden]) is left to plain loops
  (`SingleRowReduction`): dlight's CPU Reduction rule makes the weight cast's hidden axis its
  parallel loop and recomputes the whole norm inside it, hidden-size times the work (SmolLM2:
  0.8 ms per norm, 61 per decode step).
- on CUDA, before dlight's default rules: `DecodeBatchGEMV`, dlight's LowBatchGEMV for the
  matmuls of batch_decode / decode_step (symbolic batch_size; weights up to 16 MiB), which the
  Matmul rule served badly;
- on CUDA, after memory planning: `lift_graph_storage`, the storage of `decode_step` (planned for
  its batch upper bound) allocated once per VM instead of per call, so a CUDA graph that
  captured a step can be replayed (tvmattn.runtime.graphs). It runs TVM's RewriteCUDAGraph on
  that function alone: with a symbolic batch it only lifts the allocations, and the other
  functions keep TVM's default (no capture regions between the cache's attention calls).
The attention kernels from tir_kernels are already scheduled and pass through unchanged.
"""

from __future__ import annotations

import re

import tvm
from tvm import relax, s_tir, tirx
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.base import ScheduleRule


# DecodeBatchGEMV: rows per pass over the weight (the batch is padded to a multiple), and the
# largest weight it takes (a larger one, the LM head, is re-read from memory on every pass: it
# keeps the Matmul rule).
DECODE_GEMV_BUCKET = 8
DECODE_GEMV_MAX_WEIGHT_BYTES = 16 << 20


class DecodeBatchGEMV(ScheduleRule):
    """dlight's LowBatchGEMV for matmuls over a symbolic `batch_size` (batch_decode, decode_step:
    a few rows against a whole weight): each pass reads the weight once for `bucket` rows, split
    over many blocks. dlight's Matmul rule, which the default CUDA pipeline gives them, tiles
    for many rows and reads weights at a fraction of the bandwidth (measured on the H200:
    30.6 us for SmolLM2's down projection at batch 16). Prefill-like functions (symbolic
    seq_len) and weights over max_weight_bytes (None: any) keep the Matmul rule."""

    def __init__(self, bucket: int = DECODE_GEMV_BUCKET, max_weight_bytes: int | None = DECODE_GEMV_MAX_WEIGHT_BYTES):
        from tvm.s_tir.dlight.gpu import LowBatchGEMV

        self._rule = LowBatchGEMV(bucket)
        self.max_weight_bytes = max_weight_bytes

    def apply(self, func, target, tunable):
        if not isinstance(func, tirx.PrimFunc) or not _has_var(func, "batch_size"):
            return None
        if self.max_weight_bytes is not None and _largest_static_read(func) > self.max_weight_bytes:
            return None
        return self._rule.apply(func, target, tunable)


def _largest_static_read(func: tirx.PrimFunc) -> int:
    """Bytes of the largest buffer of static shape that func's blocks read (a matmul's weight)."""
    sch = s_tir.Schedule(func)
    try:
        infos = normalize_prim_func(sch)
    except (tvm.error.TVMError, ValueError):
        return 0
    largest = 0
    for info in infos or []:
        for region in sch.get(info.block_rv).reads:
            buf = region.source  # (TVM 0.27: the region's buffer)
            if all(isinstance(d, (int, tirx.IntImm)) for d in buf.shape):
                elems = 1
                for d in buf.shape:
                    elems *= int(d)
                largest = max(largest, elems * tvm.DataType(buf.dtype).bits // 8)
    return largest


def _has_var(func: tirx.PrimFunc, name: str) -> bool:
    """func has a symbolic shape variable `name`: TVMScript declares it on a line of its own
    (`name = TypeVar("name")` in TVM 0.27; the earlier check for `name = T.int64()` never matched,
    so this rule did not apply)."""
    return re.search(rf"^{re.escape(name)} = ", func.script(), re.MULTILINE) is not None


class SingleRowReduction(ScheduleRule):
    """Leaves a reduction over one static row (every reduction block writes one element, every
    loop is static) to plain loops: see the module docstring."""

    def apply(self, func, target, _tunable):
        if not isinstance(func, tirx.PrimFunc) or target.kind.name != "llvm":
            return None
        try:
            infos = normalize_prim_func(s_tir.Schedule(func))
        except (tvm.error.TVMError, ValueError):
            return None
        if not infos or not any(bool(info.is_reduction()) for info in infos):
            return None
        for info in infos:
            extents = [int(d) if isinstance(d, (int, tirx.IntImm)) else None for d in info.dom()]
            if any(e is None for e in extents):
                return None
            if bool(info.is_reduction()) and any(e != 1 for e, kind in zip(extents, info.dom_kind()) if kind == "S"):
                return None
        return s_tir.Schedule(func)


GRAPH_FUNCTIONS = ("decode_step",)  # functions whose storage is allocated once (captured by CUDA graphs)


@tvm.transform.module_pass(opt_level=0, name="LiftGraphStorage")
def lift_graph_storage(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
    """After StaticPlanBlockMemory: the static storage of GRAPH_FUNCTIONS comes from
    `vm.builtin.cuda_graph.get_cached_alloc` (allocated by the first call, kept by the VM)."""
    graph_vars = [gv for gv in mod.get_global_vars() if gv.name_hint in GRAPH_FUNCTIONS]
    if not graph_vars:
        return mod
    kernels = {gv: func for gv, func in mod.functions.items() if isinstance(func, tirx.PrimFunc)}
    sub = tvm.IRModule({**kernels, **{gv: mod[gv] for gv in graph_vars}})
    with tvm.transform.PassContext(config={"relax.backend.use_cuda_graph": True}):
        sub = relax.transform.RewriteCUDAGraph()(sub)
    for gv, func in sub.functions.items():
        if isinstance(func, relax.Function):
            mod[gv] = func
    return mod


def _finalize(backend, target: tvm.target.Target) -> list:
    passes = list(backend.finalize_passes(target))
    if target.kind.name == "cuda":
        planned = next(i for i, p in enumerate(passes) if p.info.name == "StaticPlanBlockMemory")
        passes.insert(planned + 1, lift_graph_storage)
    return passes


def relax_pipeline(target: tvm.target.Target) -> tvm.transform.Pass:
    """The module pass that lowers a model library's Relax module for `target`."""
    from tvm.s_tir import dlight as dl

    if target.kind.name == "cuda":
        from tvm.relax.backend.cuda import pipeline as backend

        # placed before the CUDA legalize passes' own dlight rules (which skip what is scheduled)
        decode_gemv = dl.ApplyDefaultSchedule(DecodeBatchGEMV())
        schedule = []
    else:
        from tvm.relax.backend.cpu_generic import pipeline as backend

        from .cpu_matmul import CPUMatmul

        # CPUMatmul first: it leaves single-token (static) matmuls to GEMV
        schedule = [dl.ApplyDefaultSchedule(CPUMatmul(), dl.cpu.GEMV(), SingleRowReduction(), dl.cpu.Reduction())]
        decode_gemv = None

    @tvm.transform.module_pass(opt_level=0, name="TvmattnModelPipeline")
    def _pipeline(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        with target:
            legalize = list(backend.legalize_passes(target))
            if decode_gemv is not None:  # the last legalize pass is dlight's default schedule
                legalize.insert(len(legalize) - 1, decode_gemv)
            passes = ([relax.transform.FuseTransposeMatmul()] + backend.library_dispatch_passes(target)
                      + legalize + schedule + backend.dataflow_lower_passes(target)
                      + _finalize(backend, target))
            return tvm.transform.Sequential(passes)(mod)

    return _pipeline
