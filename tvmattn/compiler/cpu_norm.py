"""A dlight CPU schedule rule for row reductions: the RMSNorms of a prompt (`CPURowNorm`).

dlight's CPU Reduction rule computes each stage of a legalized RMSNorm (the casts, the squares,
the sum, rsqrt, the scaled row) into its own full-size buffer, and sums a row one element at a
time. `CPURowNorm` takes a function of one reduction over a static last axis (ROW_LANES lanes or
more, a multiple of them) whose other blocks are all injective: the element-wise producers
inlined into the reduction and the output; the blocks of one value a row (rsqrt) computed once
a row; per row, the sum as ROW_LANES partial sums in a vector (`rfactor`), then the output row
in vectors; the rows in parallel tasks of about PARALLEL_CHUNK elements (cpu_elementwise's). A
function with another output (an add whose result is kept besides the norm), several reductions
or a short row is left to the other rules.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.base import ScheduleRule

from .cpu_elementwise import PARALLEL_CHUNK

# Float32 lanes of the partial sums and of the output row's vectors (an AVX-512 vector)
ROW_LANES = 16


def _static(extent) -> int | None:
    return int(extent) if isinstance(extent, (int, tirx.IntImm)) else None


class CPURowNorm(ScheduleRule):
    """See the module docstring."""

    def apply(self, func, target, _tunable):
        if not isinstance(func, tirx.PrimFunc) or target.kind.name != "llvm":
            return None
        try:
            return self._schedule(s_tir.Schedule(func))
        except (RuntimeError, ValueError):  # ScheduleError and TVM internal errors are RuntimeErrors
            return None

    def _schedule(self, sch: s_tir.Schedule):
        infos = normalize_prim_func(sch)
        if not infos:
            return None
        reductions = [info for info in infos if bool(info.is_reduction())]
        if len(reductions) != 1 or not all(bool(info.is_injective()) for info in infos if info not in reductions):
            return None
        reduction, output = reductions[0], infos[-1]
        kinds = reduction.dom_kind()
        row = _static(reduction.dom()[-1])
        if kinds[-1] != "R" or "R" in kinds[:-1] or row is None or row % ROW_LANES or output is reduction:
            return None
        out_dims = output.dom()
        if _static(out_dims[-1]) != row or len(out_dims) != len(kinds):
            return None
        per_row = []  # blocks of one value a row (rsqrt), computed once a row
        for info in infos[:-1]:
            if info is reduction:
                continue
            if [str(d) for d in info.dom()] == [str(d) for d in out_dims[:-1]]:
                per_row.append(info.block_rv)
                continue
            sch.compute_inline(info.block_rv)
        # the sum as ROW_LANES partial sums [rows, lanes] over the row's vectors (rfactor), whose
        # loop nest (rows, the row's vectors, lanes) takes the rows in parallel tasks; under each
        # row the rest: the lanes' sum (the reduction block), the per-row values, the output row
        sch.split(sch.get_loops(reduction.block_rv)[-1], [None, ROW_LANES])
        partial = sch.rfactor(sch.get_loops(reduction.block_rv)[-1], factor_axis=len(kinds) - 1)
        *spatial, k_outer, k_lanes = sch.get_loops(partial)
        rows = sch.fuse(*spatial) if len(spatial) > 1 else spatial[0]
        task, each_row = sch.split(rows, [None, max(1, PARALLEL_CHUNK // row)])
        sch.parallel(task)
        for block in (reduction.block_rv, *per_row, output.block_rv):
            sch.reverse_compute_at(block, each_row, preserve_unit_loops=True)
        sch.vectorize(k_lanes)
        init = sch.decompose_reduction(partial, k_outer)
        sch.vectorize(sch.get_loops(init)[-1])
        _, lanes = sch.split(sch.get_loops(output.block_rv)[-1], [None, ROW_LANES])
        sch.vectorize(lanes)
        return sch
