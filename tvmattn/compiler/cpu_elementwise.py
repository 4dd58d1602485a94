"""A dlight CPU schedule rule for the model's elementwise functions.

Legalized and fused, `silu(gate) * up` is five loops (two split copies, sigmoid, two multiplies)
over four intermediate buffers, each a TVMBackendAllocWorkspace of the whole row, and sigmoid a
libm expf call per element (at SmolLM2's decode size, 1536 elements and 30 calls a token), and
serial at any size (figures: docs/performance.md). Two changes:

- `cpu_legalize`: float32 SiLU legalizes to x * fast_sigmoid(x), 1 / (1 + exp2_vector(-x log2 e))
  (tir_kernels.common), arithmetic that LLVM's loop vectorizer takes (expf is a call per lane);
- `CPUElementwise`, a function whose blocks are all injective (elementwise, copies, reshapes,
  splits): every block inlined into the last one; a static last axis of MIN_ROW elements or
  more stays the inner loop, the other axes fused into a loop of rows, split into parallel
  tasks of about PARALLEL_CHUNK elements when larger than PARALLEL_MIN_ELEMENTS (or symbolic);
  otherwise every loop fused into one loop over the output, split the same way. The inner loop
  is left to LLVM's vectorizer. Functions with a
  reduction, or whose blocks cannot be inlined into the last one (several outputs), are left to
  the other rules, i.e. unscheduled.
"""

from __future__ import annotations

import math

import tvm
from tvm import relax, s_tir, te, tirx, topi
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.base import ScheduleRule

from tir_kernels.common import exp2_vector

# Below this many output elements a function runs on the calling thread: a parallel region
# costs a fork / join of TVM's pool, more than a decode step's elementwise work (1536 SiLU
# elements, vectorized).
PARALLEL_MIN_ELEMENTS = 16384
# Elements per parallel task (a multiple of every vector width)
PARALLEL_CHUNK = 4096
# A last axis of at least this many elements (static) stays the inner loop, whole: a loop of
# static extent over contiguous elements, which LLVM vectorizes. Fused with the others into one
# flat loop, every element's indices are a division and a remainder by the row length, and
# with a symbolic row count LLVM left such a loop scalar.
MIN_ROW = 16

def fast_sigmoid(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """sigmoid(x) = 1 / (1 + 2**(-x log2 e)) in float32 arithmetic LLVM vectorizes (exp2_vector:
    about 1e-7 relative, plus the rounding of x log2 e; saturates to 0 / 1 beyond |x| ~ 87)."""
    return tirx.const(1.0, "float32") / (tirx.const(1.0, "float32")
                                         + exp2_vector(x * tirx.const(-math.log2(math.e), "float32")))


def _legalize_silu(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """relax.nn.silu: x * fast_sigmoid(x) in float32, TVM's x * sigmoid(x) in other dtypes."""

    def silu(x: te.Tensor) -> te.Tensor:
        if x.dtype != "float32":
            return topi.multiply(x, topi.sigmoid(x))
        return te.compute(x.shape, lambda *i: x(*i) * fast_sigmoid(x(*i)), name="silu")

    return bb.call_te(silu, call.args[0], primfunc_name_hint="silu")


def cpu_legalize() -> tvm.transform.Pass:
    """LegalizeOps with the CPU's own legalizations (float32 SiLU by fast_sigmoid); run before the
    backend's LegalizeOps, which then legalizes the rest."""
    return relax.transform.LegalizeOps(customize_legalize_map={"relax.nn.silu": _legalize_silu})


def _parallel_rows(sch: s_tir.Schedule, outer_loops: list, row: int) -> None:
    """The rows (every axis but the last, fused) in parallel tasks of about PARALLEL_CHUNK
    elements, when there are more than PARALLEL_MIN_ELEMENTS (or a symbolic count)."""
    outer = sch.fuse(*outer_loops) if len(outer_loops) > 1 else outer_loops[0]
    rows = sch.get(outer).extent
    if not isinstance(rows, tirx.IntImm) or int(rows) * row > PARALLEL_MIN_ELEMENTS:
        task, _ = sch.split(outer, [None, max(1, PARALLEL_CHUNK // row)])
        sch.parallel(task)


class CPUElementwise(ScheduleRule):
    """See the module docstring."""

    def apply(self, func, target, _tunable):
        if not isinstance(func, tirx.PrimFunc) or target.kind.name != "llvm":
            return None
        try:
            sch = s_tir.Schedule(func)
            infos = normalize_prim_func(sch)
            if not infos or not all(bool(info.is_injective()) for info in infos):
                return None
            for info in infos[:-1]:
                sch.compute_inline(info.block_rv)
            loops = sch.get_loops(infos[-1].block_rv)
            if not loops:
                return None
            row = sch.get(loops[-1]).extent
            if len(loops) > 1 and isinstance(row, tirx.IntImm) and int(row) >= MIN_ROW:
                _parallel_rows(sch, loops[:-1], int(row))
                return sch
            loop = sch.fuse(*loops) if len(loops) > 1 else loops[0]
            extent = sch.get(loop).extent
            if not isinstance(extent, tirx.IntImm) or int(extent) > PARALLEL_MIN_ELEMENTS:
                outer, _ = sch.split(loop, [None, PARALLEL_CHUNK])
                sch.parallel(outer)
        except (RuntimeError, ValueError):  # ScheduleError and TVM internal errors are RuntimeErrors
            return None
        return sch
