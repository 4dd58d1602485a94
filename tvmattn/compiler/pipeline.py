"""The Relax compilation pipeline of a model library.

TVM's default pipeline for a target, with two changes that matter for speed:
- `FuseTransposeMatmul` first: `nn.Linear` multiplies by `permute_dims(weight)`, which the
  default pipeline runs as a separate transpose kernel of every weight at every call (5 per
  layer, together more time than the attention); fused, each projection is one
  `NT_matmul` that dlight's GEMV / Matmul rules schedule.
- on the CPU, after fusion: cpu_matmul.CPUMatmul for the multi-token projections (prefill,
  batch_prefill, batch_verify, batch_decode: token tiles that share each weight read, vectorized;
  unscheduled they re-read every weight per token), then dlight's CPU rules (GEMV for the
  single-token decode projections, Reduction for norms); the default CPU pipeline schedules nothing.
  A prompt's row reductions (its RMSNorms) get `cpu_norm.CPURowNorm` (a row's sum in vector
  lanes, the rows in parallel tasks). A reduction over one static row (decode's RMSNorm of
  [1, 1, hidden]) is left to plain loops (`SingleRowReduction`): dlight's CPU Reduction rule makes the weight cast's hidden axis its
  parallel loop and recomputes the whole norm inside it, hidden-size times the work (and a
  decode step runs two norms a layer). Last, `cpu_elementwise.CPUElementwise` for the
  elementwise functions: inlined into one loop that LLVM vectorizes (parallel chunks when
  large), float32 SiLU legalized with a polynomial exp (`cpu_elementwise.cpu_legalize`, before
  TVM's LegalizeOps) instead of a libm call per element.
- on CUDA, with `small_batch_matmul` (BuildOptions.small_batch_matmul, on by default), before
  dlight's default rules, for the matmuls of batch_decode / decode_step (`[batch_size, 1, K] x
  [N, K]^T`, symbolic batch_size): `SmallBatchMatmul` (CUDA cores); with
  BuildOptions.tensor_core_matmul (on by default for sm_80 and newer) first
  `tensor_core_matmul.SmallBatchTensorCoreMatmul`: the projections as TVM legalizes them, with
  no epilogue, a residual add or a float32 cast, replaced by a function that runs the CUDA-core
  kernel below batch 16 and a tensor-core kernel from 16 on (the LM head, which SmallBatchMatmul
  leaves, on tensor cores at every batch).
  Without small_batch_matmul they get dlight's Matmul rule, whose 128 x 128 tiles leave most SMs idle at these
  shapes (figures: docs/performance.md). dlight's LowBatchGEMV (`DecodeBatchGEMV`) is a variant
  in scripts/bench_small_batch.py;
- on CUDA, after memory planning: `lift_graph_storage`, the storage of `decode_step` (planned for
  its batch upper bound) allocated once per VM instead of per call, so a CUDA graph that
  captured a step can be replayed (tvmattn.runtime.graphs). It runs TVM's RewriteCUDAGraph on
  that function alone: with a symbolic batch it only lifts the allocations, and the other
  functions keep TVM's default (no capture regions between the cache's attention calls).
- the fused decode ops of a decoder layer (fused_decode: RMSNorm + projection + epilogue in one
  function) get their own schedules before any other rule (fused_schedules: CUDAFusedDecodeGEMV
  and CPUFusedDecodeGEMV); dlight's rules take only one reduction per function. With
  tensor_core_matmul, those over the symbolic batch (batch_decode, decode_step) first meet
  `tensor_core_matmul.FusedNormTensorCoreMatmul`: CUDAFusedDecodeGEMV's kernel below batch 16,
  a tensor-core kernel that normalizes X's rows in shared memory from 16 on.
- last, `inline_let_expressions`: the PrimFuncs that hold Let *expressions* get them substituted
  into their bodies (see its docstring: TVM's CommonSubexprElim can leave a variable used before
  its definition in such a function). In practice these are TVM's own stock-cache kernels with
  Llama-3 RoPE scaling (the stock cache's attention kernels and its fused RoPE).
- on CUDA (sm_90 and newer) with `dependent_launch` (BuildOptions.dependent_launch, on by
  default), at the very end, once every function is scheduled and before TIR lowering:
  `dependent_launch.chain_dependent_launches`, programmatic dependent launch for every kernel of
  the library (each waits for its predecessor's grid before touching memory; the safety argument
  is in that module's docstring).
The attention kernels from tir_kernels are already scheduled and pass through unchanged (but for
the dependent launch above).
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax, s_tir, tirx
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.base import ScheduleRule

from .dependent_launch import chain_dependent_launches, dependent_launch_problem
from .fused_schedules import CPUFusedDecodeGEMV, CUDAFusedDecodeGEMV
from .script_frames import cheap_frame_stacks
from .tensor_core_matmul import FusedNormTensorCoreMatmul, SmallBatchTensorCoreMatmul

# DecodeBatchGEMV: rows per pass over the weight (the batch is padded to a multiple), and the
# largest weight it takes (a larger one, the LM head, is re-read from memory on every pass: it
# keeps the Matmul rule).
DECODE_GEMV_BUCKET = 8
DECODE_GEMV_MAX_WEIGHT_BYTES = 16 << 20


class DecodeBatchGEMV(ScheduleRule):
    """dlight's LowBatchGEMV for matmuls over a symbolic `batch_size` (batch_decode, decode_step:
    a few rows against a whole weight): each pass reads the weight once for `bucket` rows, split
    over many blocks. dlight's Matmul rule, which the default CUDA pipeline gives them, tiles
    for many rows and reads weights at a fraction of the bandwidth. Prefill-like functions (symbolic
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


# SmallBatchMatmul: batch rows per block and threads per block, and the largest weight it takes.
# Chosen by a sweep (scripts/bench_small_batch.py over SmolLM2's decode_step projections at batch
# 1, 2, 16 and 64; figures: docs/performance.md): 4 rows and 32 threads were the fastest variant
# at batch 1 and 2, far ahead of dlight's Matmul rule, and close to the fastest at 16 and 64. A
# weight larger than the cap (the LM head) is read from memory again for every block of rows,
# slower than dlight's Matmul from batch 16 on: it keeps the Matmul rule.
SMALL_BATCH_ROWS = 4
SMALL_BATCH_THREADS = 32
SMALL_BATCH_MAX_WEIGHT_BYTES = 16 << 20


class SmallBatchMatmul(ScheduleRule):
    """`[batch_size, 1, K] x [N, K]^T` (+ element-wise epilogues: a residual add, a cast) for a
    symbolic batch_size of a few rows (decode_step, batch_decode).

    Schedule: one block per chunk of `rows` batch rows (zero-padded past the batch) and
    `threads // lanes` output columns, one group of `lanes` threads per column splitting K into
    16-byte vectors. Each thread keeps `rows` partial sums: each weight vector it loads is
    multiplied with every row's vector. The chunk is the fastest block index, so the blocks
    that share a weight slice run at the same time: the weight comes from memory once and from
    L2 for the other chunks. The lanes' partial sums are combined by a warp reduction per row,
    then the epilogue runs. Anything else (prefill shapes, K not a whole number of vectors, a
    weight over max_weight_bytes): None, for the next rule."""

    def __init__(self, rows: int = SMALL_BATCH_ROWS, threads: int = SMALL_BATCH_THREADS,
                 max_weight_bytes: int | None = SMALL_BATCH_MAX_WEIGHT_BYTES):
        self.rows = rows
        self.threads = threads
        self.max_weight_bytes = max_weight_bytes

    def apply(self, func, target, _tunable):
        if not isinstance(func, tirx.PrimFunc) or target.kind.name != "cuda" or not _has_var(func, "batch_size"):
            return None
        if self.max_weight_bytes is not None and _largest_static_read(func) > self.max_weight_bytes:
            return None
        sch = s_tir.Schedule(func)
        try:
            matmul = sch.get_sblock("NT_matmul")
        except (RuntimeError, ValueError):  # ScheduleError and TVM internal errors are RuntimeErrors
            return None
        loops = sch.get_loops(matmul)
        if len(loops) != 4:
            return None
        extents = [sch.get(loop).extent for loop in loops]
        if (not isinstance(extents[0], tirx.Var) or extents[0].name != "batch_size"
                or not all(isinstance(e, tirx.IntImm) for e in extents[1:]) or int(extents[1]) != 1):
            return None
        block = sch.get(matmul)
        if len(block.reads) != 2 or len(block.iter_vars) != 4:
            return None
        vec = 16 * 8 // tvm.DataType(block.reads[1].source.dtype).bits  # elements per 16-byte weight load
        if int(extents[3]) % vec:
            return None
        try:
            return self._schedule(sch, matmul, int(extents[3]), vec)
        except (RuntimeError, ValueError):  # ScheduleError and TVM internal errors are RuntimeErrors
            return None

    def _schedule(self, sch, matmul, k_extent: int, vec: int):
        sch.pad_einsum(matmul, [self.rows, 1, 1, 1])
        x_padded = sch.get_producers(matmul)  # zero-padded rows of x (the weight needs no padding)
        for consumer in sch.get_consumers(matmul):
            if sch.get_consumers(consumer):  # the unpadding copy, read by an epilogue
                sch.compute_inline(consumer)
        epilogues = sch.get_consumers(matmul)
        lanes = 32
        while (k_extent // vec) % lanes:
            lanes //= 2
        b, one, n, k = sch.get_loops(matmul)
        chunk, row = sch.split(b, [None, self.rows])
        col_tile, col = sch.split(n, [None, max(1, self.threads // lanes)])
        k_step, lane, k_vec = sch.split(k, [None, lanes, vec])
        sch.reorder(col_tile, chunk, col, one, lane, k_step, k_vec, row)
        partial = sch.rfactor(lane, factor_axis=0)
        col_tile, chunk, col, _, lane, k_step, k_vec, row = sch.get_loops(partial)
        # chunks are the fastest block index: the blocks that share a weight slice run together,
        # so it comes from memory once and from L2 for the other chunks
        sch.bind(chunk, "blockIdx.x")
        sch.bind(col_tile, "blockIdx.y")
        sch.bind(col, "threadIdx.y")
        sch.bind(lane, "threadIdx.x")
        weight = sch.cache_read(partial, 1, "local")
        sch.compute_at(weight, k_step)
        sch.vectorize(sch.get_loops(weight)[-1])
        for x in x_padded:
            sch.compute_at(x, k_step)
            sch.set_scope(x, 0, "local")
            sch.vectorize(sch.get_loops(x)[-1])
            sch.unroll(sch.get_loops(x)[-2])  # every row's load issued before the products
        sch.unroll(row)
        sch.unroll(k_vec)
        sch.set_scope(partial, 0, "local")
        sch.decompose_reduction(partial, k_step)
        sch.unroll(k_step)
        sch.reverse_compute_at(matmul, col)  # the lanes' sums: one warp reduction per row
        *_, lane_sum, row_sum = sch.get_loops(matmul)
        sch.reorder(row_sum, lane_sum)
        sch.bind(lane_sum, "threadIdx.x")
        for epilogue in epilogues:
            sch.reverse_compute_at(epilogue, col)
        sch.set_scope(matmul, 0, "local")
        return sch


def small_batch_rules(tensor_cores: bool = False) -> list[ScheduleRule]:
    """The CUDA rules of decode_step's / batch_decode's projections, first match wins: with
    tensor_cores, the projections the tensor-core kernel recognizes run on it from batch
    TENSOR_CORES_FROM_BATCH on and on CUDA cores below (where the CUDA-core rule takes them; else
    on tensor cores at every batch); CUDA cores for the others."""
    cuda_cores = SmallBatchMatmul()
    return ([SmallBatchTensorCoreMatmul(below=cuda_cores)] if tensor_cores else []) + [cuda_cores]


def _largest_static_read(func: tirx.PrimFunc) -> int:
    """Bytes of the largest buffer of static shape that func's blocks read (a matmul's weight)."""
    sch = s_tir.Schedule(func)
    try:
        infos = normalize_prim_func(sch)
    except (RuntimeError, ValueError):  # ScheduleError and TVM internal errors are RuntimeErrors
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
    """func has a symbolic shape variable `name` (a variable its body uses that no parameter
    defines). Not from func.script(): where TVMScript prints it differs between Python versions
    (at the top of the module, or inside the function on Python 3.12), so a search of the text
    would apply these rules on one machine and not on another."""
    return any(var.name == name for var in tirx.analysis.undefined_vars(func.body, list(func.params)))


class SingleRowReduction(ScheduleRule):
    """Leaves a reduction over one static row (every reduction block writes one element, every
    loop is static) to plain loops: see the module docstring."""

    def apply(self, func, target, _tunable):
        if not isinstance(func, tirx.PrimFunc) or target.kind.name != "llvm":
            return None
        try:
            infos = normalize_prim_func(s_tir.Schedule(func))
        except (RuntimeError, ValueError):  # ScheduleError and TVM internal errors are RuntimeErrors
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


def _has_let(stmt) -> bool:
    """stmt holds a Let expression (`tirx.Let`; not a statement-level binding)."""
    return tvm_ffi.structural_walk(stmt, (tirx.Let, tvm_ffi.VisitInterrupt), order="pre") is not None


def inline_lets(stmt):
    """stmt with every Let expression replaced by its body, the bound variable substituted by its
    value (innermost first: a value that names an outer Let's variable is substituted in turn)."""

    def inline(let):
        return tvm_ffi.structural_map(let.body, (tirx.Var, lambda var: let.value if var.same_as(let.var) else var))

    return tvm_ffi.structural_map(stmt, (tirx.Let, inline))


@tvm.transform.module_pass(opt_level=0, name="InlineLetExpressions")
def inline_let_expressions(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
    """Every PrimFunc that holds Let expressions gets them inlined (`inline_lets`).

    Why: TVM's CommonSubexprElim (run by the s_tir and tirx lowering pipelines) plans its
    bindings from the occurrences it records, and records none inside a Let's body, yet its
    rewriter replaces every occurrence, those in Let bodies included. An expression that occurs
    inside a Let body and twice again further on gets a binding placed before the later
    occurrences only, so the Let body uses the variable before its definition, and SplitHostDevice
    fails ("variable cse_vN has been used before definition"). TVM's stock batch_tree_attn at 32
    query / 8 KV heads with Llama-3 RoPE scaling (Llama-3.2-1B's shape; the scaling's frequencies
    are Let expressions) hits this with `LH_start % 4`. Inlined, CSE sees every occurrence, and
    the code computes the same values: only the RoPE frequencies' pure math calls (pow, cos, sin),
    which CSE leaves alone, are written out once per use, for the CUDA / LLVM compilers to merge."""
    holding = [(gv, func) for gv, func in mod.functions_items() if isinstance(func, tirx.PrimFunc) and _has_let(func.body)]
    if not holding:
        return mod
    mod = mod.clone()  # the pass's input stays as it was
    for gv, func in holding:
        mod[gv] = func.with_body(inline_lets(func.body))
    return mod


def _finalize(backend, target: tvm.target.Target) -> list:
    passes = list(backend.finalize_passes(target))
    if target.kind.name == "cuda":
        planned = next(i for i, p in enumerate(passes) if p.info.name == "StaticPlanBlockMemory")
        passes.insert(planned + 1, lift_graph_storage)
    return passes


def relax_pipeline(target: tvm.target.Target, small_batch_matmul: bool = True,
                   dependent_launch: bool = False, tensor_core_matmul: bool = False) -> tvm.transform.Pass:
    """The module pass that lowers a model library's Relax module for `target`; small_batch_matmul
    (CUDA): schedule decode_step's / batch_decode's projections with `SmallBatchMatmul` (False:
    dlight's Matmul rule); tensor_core_matmul (CUDA, with small_batch_matmul): those the
    tensor-core kernel recognizes run on it (tensor_core_matmul.SmallBatchTensorCoreMatmul);
    dependent_launch (CUDA, sm_90 and newer): every kernel launched with programmatic dependent
    launch (dependent_launch.chain_dependent_launches). ValueError for dependent_launch on
    another target."""
    from tvm.s_tir import dlight as dl

    problem = dependent_launch_problem(target) if dependent_launch else None
    if problem:
        raise ValueError(f"dependent_launch=True is not supported: {problem}")
    chain = [chain_dependent_launches] if dependent_launch else []
    if target.kind.name == "cuda":
        from tvm.relax.backend.cuda import pipeline as backend

        # placed before the CUDA legalize passes' own dlight rules (which skip what is scheduled)
        small = small_batch_rules(tensor_core_matmul) if small_batch_matmul else []
        fused_gemv = CUDAFusedDecodeGEMV()
        fused = [FusedNormTensorCoreMatmul(below=fused_gemv)] if tensor_core_matmul and small_batch_matmul else []
        decode_gemv = dl.ApplyDefaultSchedule(*fused, fused_gemv, *small)
        schedule = []
    else:
        from tvm.relax.backend.cpu_generic import pipeline as backend

        from .cpu_elementwise import CPUElementwise, cpu_legalize
        from .cpu_matmul import CPUMatmul
        from .cpu_norm import CPURowNorm

        # CPUMatmul first: it leaves single-token (static) matmuls to GEMV
        schedule = [dl.ApplyDefaultSchedule(CPUFusedDecodeGEMV(), CPUMatmul(), dl.cpu.GEMV(), SingleRowReduction(),
                                            CPURowNorm(), dl.cpu.Reduction(), CPUElementwise())]
        decode_gemv = None

    @tvm.transform.module_pass(opt_level=0, name="TvmattnModelPipeline")
    def _pipeline(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        with target, cheap_frame_stacks():  # (dlight's tensor-core rules parse TVMScript: script_frames)
            legalize = list(backend.legalize_passes(target))
            if target.kind.name != "cuda":  # the CPU's own legalizations first (cpu_elementwise)
                legalize.insert(0, cpu_legalize())
            if decode_gemv is not None:  # the last legalize pass is dlight's default schedule
                legalize.insert(len(legalize) - 1, decode_gemv)
            passes = ([relax.transform.FuseTransposeMatmul()] + backend.library_dispatch_passes(target)
                      + legalize + schedule + backend.dataflow_lower_passes(target)
                      + _finalize(backend, target) + [inline_let_expressions] + chain)
            return tvm.transform.Sequential(passes)(mod)

    return _pipeline
