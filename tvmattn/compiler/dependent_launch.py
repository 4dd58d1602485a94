"""Programmatic dependent launch (sm_90 and newer) for every kernel of a model library.

A decode step launches a few small kernels per layer, each of which would otherwise start only
once the previous one has drained. With programmatic dependent launch (PDL), a kernel's blocks may
be scheduled while its predecessor in the stream still runs; the kernel then calls
`griddepcontrol.wait`, which returns once the predecessor grid has completed and its memory is
visible, and `griddepcontrol.launch_dependents`, which lets the stream's next kernel be scheduled
as soon as every block of this grid has called it (or exited).

`chain_dependent_launches` (a module pass, run by compiler.pipeline after every schedule rule and
before lowering, CUDA only, with BuildOptions.dependent_launch) rewrites each scheduled PrimFunc
that launches device kernels: the function gets tir_kernels' PDL_TAG attribute (tir_kernels.build
then puts TVM's launch tag on each of its kernels' launch parameters), and every kernel's body (the
body of its outermost blockIdx / threadIdx binding, a loop bound to a thread or a `thread_extent`
attribute) starts with `grid_dependency_wait()`, followed by `launch_dependents()` (tir_kernels.common)
in a function that streams less than EARLY_TRIGGER_MAX_BYTES through its static-shape buffers
(`static_buffer_bytes`). A function of several kernels gets the same in each.

Why the trigger is early only in small kernels: a decode step's small kernels (a norm, RoPE and
the append, attention at a short history, a small model's projections) take a few microseconds,
so the next kernel's launch latency is a large part of the step, and scheduling its blocks while
this kernel runs hides it. A kernel that streams megabytes (a 1B model's projections and LM head)
hides that latency behind its own tail, and its next kernel's blocks, scheduled early, would land
on whichever SMs have free slots at the time: an unbalanced placement that slows a bandwidth-bound
successor (docs/performance.md, "Programmatic dependent launch"). Without the call, the
dependents start as this grid's blocks exit, still before its completion is flushed.

One exception to "first": a kernel whose first statement is a loop nest marked PREFETCH_ATTR
(the fused decode GEMV's weight prefetch into registers, compiler/fused_schedules.py) waits right
after that nest, so the weight streams in while the previous kernel finishes. Such a nest reads
only its function's weight parameter: a model weight, which no kernel writes and whose storage
the VM never reuses, so reading it early observes nothing a wait would order. Where the source
puts a load is not where the SASS does: ptxas moves `ld.global.nc` loads (nvcc's reading of a
`__restrict__` argument the kernel never writes) across `griddepcontrol.wait` both ways, sinking
a weight load below it or hoisting an activation load above it (seen in a kernel's SASS, not
kept). Plain `ld.global` stays put; the prefetch nest's 16-byte loads compile to it, and in a
SmolLM2 library's SASS every `.nc` load ahead of a wait reads a table the host uploaded.

Before both, a kernel of an early-triggering function whose largest static-shape buffer parameter
(its weight: `prefetched_weight`) holds at least L2_PREFETCH_MIN_BYTES starts the block's share
of that buffer streaming into L2 (tir_kernels.common.prefetch_l2: one thread issues
`cp.async.bulk.prefetch.L2` for the block's 1/gridDim of the bytes, at most
L2_PREFETCH_BLOCK_BYTES). Such a kernel's blocks are scheduled while the previous kernel runs, so
a small model's projection weight is in L2 by the time its wait returns; a GEMV whose blocks take
rows in order reads what it prefetched. In a function streaming megabytes the blocks start only
as the previous grid exits, and the prefetch slowed a 1B model's steps (docs/performance.md), so
there is none. A prefetch is a hint that moves nothing into the block and is ordered with no
write (L2 is where every SM's accesses meet), so it may read any buffer before the wait.

Why this is safe: every thread of every rewritten kernel waits for the previous grid of the stream
to complete before it touches any memory (the wait is the first statement of the kernel's body,
and both calls are volatile asm with a memory clobber, so neither TIR's passes nor the CUDA
compiler moves a load or a store above them). A kernel launched without the tag starts only
after its predecessor completed, as usual. So, by induction along the stream, a kernel's
completion implies that of every kernel before it: a read sees every earlier write
(read-after-write), and a kernel that writes storage an earlier kernel reads - the VM reuses its
planned storage between calls and a CUDA graph replays the same buffers - writes only after that
reader completed (write-after-read). Letting dependents start right after the wait gives up no
safety either: they wait in turn, and since the trigger fires only once every block of the grid
has passed it, the early-scheduled blocks of the next kernel never keep this grid's blocks from
being scheduled.

Left untouched:
- functions without device kernels (no thread binding: the VM's host-side shape functions,
  `tirx.is_host_func`), and functions for another target than CUDA;
- functions that already carry PDL_TAG: tir_kernels' tensor-core decode kernels with a
  `dependent_launch` schedule place their own wait and trigger (with `tables_before_wait`, after
  reading the step's page tables, which the host uploads before the step, and in `decode_append`
  after issuing its copies of the history's K and V, which earlier steps wrote: that schedule's
  own contract, tir_kernels/schedules.py, which asks of the kernel before such a decode that it
  not write what the decode reads before its wait and let its dependents start only after its
  own wait, as every kernel rewritten here does); every other kernel's wait covers them as any
  predecessor;
- TIRx functions (tir_kernels.build.TIRX_ATTR: the Hopper prefill and MLA kernels, written with
  `T.device_entry` and lowered by TVM's TIRx pipeline, whose kernel bodies this pass does not
  read): they are launched without the tag, so they start after their predecessor completed,
  and the kernel after them waits for them as for any other.
"""

from __future__ import annotations

import math

import tvm
import tvm_ffi
from tvm import tirx
from tvm.tirx.buffer import BufferType

from tir_kernels.build import uses_tirx_pipeline
from tir_kernels.common import PDL_TAG, grid_dependency_wait, launch_dependents, prefetch_l2
from tir_kernels.support import PDL_MIN_SM, TargetName, sm_of

KERNEL_THREADS = ("blockIdx.", "threadIdx.")  # the bindings that start a device kernel (not vthread)
HOST_FUNC_ATTR = "tirx.is_host_func"
# a loop marked so (a schedule's weight prefetch, fused_schedules.py) may run before the grid wait
PREFETCH_ATTR = "tvmattn_prefetch_before_wait"
# functions streaming this much or more let their dependents start only as their blocks exit
# (module docstring); SmolLM2's largest layer projection streams 3.4 MiB, a 1B model's smallest 8 MiB
EARLY_TRIGGER_MAX_BYTES = 4 << 20
# an early-triggering function's kernels prefetch the block's share of its largest static buffer (its
# weight) into L2 before the wait: at most this many bytes a block, where that buffer holds at least
# L2_PREFETCH_MIN_BYTES
L2_PREFETCH_BLOCK_BYTES = 32 << 10
L2_PREFETCH_MIN_BYTES = 64 << 10


def dependent_launch_problem(target) -> str | None:
    """None where `target` (a tvm Target, or a target string: "llvm", "cuda", "cuda:sm_XY") can
    launch kernels dependently (CUDA, sm_90 and newer; "cuda" alone means
    tir_kernels.support.DEFAULT_CUDA_ARCH), else what it needs."""
    if isinstance(target, str):
        name = TargetName.parse(target)
        kind, arch = name.kind, (name.cuda_arch if name.is_cuda else "")
    else:
        kind, arch = target.kind.name, str(target.attrs.get("arch", "")) if target.attrs is not None else ""
    if sm_of(target) < PDL_MIN_SM:
        shown = f"{kind}:{arch}" if kind == "cuda" else kind
        return f"programmatic dependent launch needs a CUDA target of sm_{PDL_MIN_SM} or newer, got {shown!r}"
    return None


def _binds_kernel_thread(stmt) -> bool:
    """stmt binds blockIdx / threadIdx: a loop bound to it, or a `thread_extent` attribute."""
    if isinstance(stmt, tirx.For):
        binding = stmt.thread_binding
        return stmt.kind == tirx.ForKind.THREAD_BINDING and binding is not None and \
            str(binding.thread_tag).startswith(KERNEL_THREADS)
    if isinstance(stmt, tirx.AttrStmt) and stmt.attr_key == "thread_extent":
        return isinstance(stmt.node, tirx.IterVar) and str(stmt.node.thread_tag).startswith(KERNEL_THREADS)
    return False


def kernel_roots(body: tirx.Stmt) -> list:
    """The outermost thread bindings of `body`, one per device kernel it launches (in order)."""
    roots = []

    def visit(stmt):
        if _binds_kernel_thread(stmt):
            roots.append(stmt)
            return tvm_ffi.WalkResult.SKIP  # a binding inside it belongs to the same kernel
        return tvm_ffi.WalkResult.ADVANCE

    tvm_ffi.structural_walk(body, ((tirx.For, tirx.AttrStmt), visit), order="pre")
    return roots


def _static_buffers(func: tirx.PrimFunc) -> list:
    """(parameter, bytes) of each of func's buffer parameters whose shape is static."""
    found = []
    for param in func.params:
        buffer = param.ty  # a BufferType for a buffer parameter, a PrimType for a scalar
        if not isinstance(buffer, BufferType):
            continue
        dims = [int(d) if isinstance(d, tirx.IntImm) else None for d in buffer.shape]
        if None not in dims:
            found.append((param, math.prod(dims) * tvm.runtime.DataType(buffer.dtype).bits // 8))
    return found


def static_buffer_bytes(func: tirx.PrimFunc) -> int:
    """Bytes of func's buffer parameters whose shapes are static (a projection's weight and, at a
    static batch, its activations); parameters of a symbolic shape count nothing."""
    return sum(size for _, size in _static_buffers(func))


def prefetched_weight(func: tirx.PrimFunc):
    """(buffer parameter, bytes) of the largest static-shape buffer parameter of func (a
    projection's weight) where it holds at least L2_PREFETCH_MIN_BYTES, else None."""
    largest = max(_static_buffers(func), key=lambda found: found[1], default=None)
    return largest if largest is not None and largest[1] >= L2_PREFETCH_MIN_BYTES else None


def _l2_prefetch(func: tirx.PrimFunc):
    """The statement that prefetches a block's share of func's weight into L2, or None: only in a
    function that lets its dependents start early (module docstring)."""
    found = prefetched_weight(func) if early_trigger(func) else None
    if found is None:
        return None
    param, size = found
    first = tirx.BufferLoad(param, [tirx.IntImm(d.ty, 0) for d in param.ty.shape])
    return tirx.Evaluate(prefetch_l2(tirx.address_of(first), size, L2_PREFETCH_BLOCK_BYTES))


def early_trigger(func: tirx.PrimFunc) -> bool:
    """Whether func's kernels let their dependents start right after their wait (module docstring)."""
    return static_buffer_bytes(func) < EARLY_TRIGGER_MAX_BYTES


def _with_body(stmt, body):
    """stmt (a For or an AttrStmt) with another body."""
    if isinstance(stmt, tirx.For):
        return tirx.For(stmt.loop_var, stmt.min, stmt.extent, stmt.kind, body, stmt.thread_binding,
                        stmt.annotations, stmt.step, stmt.span)
    return tirx.AttrStmt(stmt.node, stmt.attr_key, stmt.value, body, stmt.span)


def _unmarked(loop: tirx.For) -> tirx.For:
    annotations = {k: v for k, v in loop.annotations.items() if k != PREFETCH_ATTR}
    return tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind, loop.body, loop.thread_binding,
                    annotations, loop.step, loop.span)


def _is_prefetch(stmt) -> bool:
    return isinstance(stmt, tirx.For) and PREFETCH_ATTR in stmt.annotations


def _after_prefetch(body, first: list):
    """body with `first` put right after its leading PREFETCH_ATTR loop: the loop must be the
    first statement the kernel runs (reached through loops and bindings only, as the first
    statement of each sequence). None where body has no such loop."""
    if _is_prefetch(body):
        return tirx.SeqStmt([_unmarked(body)] + first)
    if isinstance(body, tirx.SeqStmt) and len(body.seq) > 0:
        seq = list(body.seq)
        leading = 0  # (SwiGLU: the gate's and the up half's prefetch, one after the other)
        while leading < len(seq) and _is_prefetch(seq[leading]):
            leading += 1
        if leading:
            return tirx.SeqStmt([_unmarked(s) for s in seq[:leading]] + first + seq[leading:])
        inner = _after_prefetch(seq[0], first)
        return None if inner is None else tirx.SeqStmt([inner] + seq[1:])
    if isinstance(body, (tirx.For, tirx.AttrStmt)):
        inner = _after_prefetch(body.body, first)
        return None if inner is None else _with_body(body, inner)
    return None


def _waiting(stmt, trigger: bool, l2_prefetch=None):
    """stmt (a kernel's outermost binding) with the wait (and the trigger) first in its body, or
    right after the kernel's leading weight prefetch (PREFETCH_ATTR); `l2_prefetch` before both."""
    first = [tirx.Evaluate(grid_dependency_wait())] + ([tirx.Evaluate(launch_dependents())] if trigger else [])
    body = _after_prefetch(stmt.body, first)
    body = tirx.SeqStmt(first + [stmt.body]) if body is None else body
    if l2_prefetch is not None:
        body = tirx.SeqStmt([l2_prefetch, body])
    return _with_body(stmt, body)


def skip_reason(func) -> str | None:
    """Why `chain_kernels` leaves func as it is (the module docstring's list), or None."""
    attrs = func.attrs if func.attrs is not None else {}
    if bool(attrs.get(PDL_TAG, False)):
        return "already launched dependently (places its own wait)"
    if uses_tirx_pipeline(func):
        return "a TIRx function (launched without the tag)"
    if bool(attrs.get(HOST_FUNC_ATTR, False)):
        return "a host function"
    target = attrs.get("target")
    if target is not None and target.kind.name != "cuda":
        return f"a {target.kind.name} function"
    if not kernel_roots(func.body):
        return "launches no device kernel"
    return None


def chain_kernels(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """func with PDL_TAG and every kernel waiting first (module docstring); func itself where
    `skip_reason` names a reason."""
    if skip_reason(func) is not None:
        return func
    roots = kernel_roots(func.body)
    trigger = early_trigger(func)
    l2_prefetch = _l2_prefetch(func)

    def rewrite(stmt):
        return _waiting(stmt, trigger, l2_prefetch) if any(stmt.same_as(root) for root in roots) else stmt

    body = tvm_ffi.structural_map(func.body, ((tirx.For, tirx.AttrStmt), rewrite), order="pre")
    return func.with_body(body).with_attr(PDL_TAG, True)


@tvm.transform.module_pass(opt_level=0, name="ChainDependentLaunches")
def chain_dependent_launches(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
    """Every PrimFunc of mod through `chain_kernels` (a new module; mod stays as it was)."""
    changed = {}
    for gv, func in mod.functions_items():
        if isinstance(func, tirx.PrimFunc):
            chained = chain_kernels(func)
            if not chained.same_as(func):
                changed[gv] = chained
    if not changed:
        return mod
    mod = mod.clone()
    for gv, func in changed.items():
        mod[gv] = func
    return mod


__all__ = ["EARLY_TRIGGER_MAX_BYTES", "L2_PREFETCH_BLOCK_BYTES", "L2_PREFETCH_MIN_BYTES", "PDL_TAG", "PREFETCH_ATTR",
           "chain_dependent_launches", "chain_kernels", "dependent_launch_problem", "early_trigger", "kernel_roots",
           "prefetched_weight", "skip_reason", "static_buffer_bytes"]
