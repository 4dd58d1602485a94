"""Schedules of the fused decode ops (fused_decode.py: what they compute) on CUDA and the CPU.

Both rules recognize a fused op by its blocks (fused_decode.BLOCKS) and return None for anything
else, so the pipeline's other rules see every other function.

`CUDAFusedDecodeGEMV`: a GEMV like SmallBatchMatmul's (pipeline.py) with the norm in front. One
thread block (one warp) per chunk of `rows` rows (tokens) and `cols` output columns, the chunk
the fastest block index (the blocks that read one weight slice run together: it comes from
memory once, from L2 for the other chunks); `lanes` threads share a column and split K into
16-byte vectors (32 lanes where K has a multiple of 32 vectors, else fewer lanes and more
columns a block, fewer columns while that would leave under `min_blocks` blocks). The block
takes its rows one after the other (past the batch: skipped), so every local buffer has a
static size with a symbolic batch; the rows after the first read the weight slice from L1. Per
row, each of the block's threads sums the squares of its own vectors of x, a shuffle reduction
adds them, and the block writes the normalized row (in the activations' dtype, as TVM's
rms_norm rounds it) to shared memory once; each column's
lanes then read it and the weight as 16-byte vectors, their partial sums meet in a shuffle
reduction, then the epilogue. SwiGLU: the gate column, then the up column, in the same
threads, so the epilogue has both. With `prefetch` (the default), where each lane's contiguous
chunk of K is an odd multiple of 16 bytes (conflict-free shared-memory reads of the staged row:
SmolLM2's 576, Gemma 3's 640, not a 1B model's 2048), the lanes take contiguous chunks instead
of interleaved vectors and the block first loads its threads' whole chunks of the weight into
registers, before x: under programmatic dependent launch that load runs before the grid wait
(dependent_launch.py's PREFETCH_ATTR), while the previous kernel finishes. `staged=False` is the earlier layout, where every column's
lanes recomputed the norm from x and g element by element (slower: docs/performance.md,
"Kernels per decode layer"); it stays for scripts/bench_fused_gemv.py's comparison.

`CPUFusedDecodeGEMV`: the norm as plain loops (one row of sums and one normalized row per
token: little work), then the product parallel over column chunks, each column's dot product
vectorized over K (a vector of partial sums, summed at the end), every row of the batch against
the weight row while it is in cache; the epilogue per column.
"""

from __future__ import annotations

import tvm
from tvm import s_tir, tirx
from tvm.s_tir.dlight.base import ScheduleRule

from .dependent_launch import PREFETCH_ATTR
from .fused_decode import BLOCKS, UP_BLOCK

# threads per block and the most lanes per column: SmallBatchMatmul's (pipeline.py), whose sweep
# found 32-thread blocks fastest for these shapes; a K of fewer 16-byte vectors than a multiple of
# 32 gets fewer lanes per column and more columns per block
CUDA_THREADS = 32
CUDA_LANES = 32
CUDA_ROWS = 4  # rows (tokens) per thread block, one after the other: SmallBatchMatmul's count
CUDA_MIN_BLOCKS = 264  # staged: fewer columns a block while there would be fewer blocks (2 per H100 SM)
CPU_COLUMN_CHUNK = 16  # columns per parallel task on the CPU


def fused_op_schedule(func) -> s_tir.Schedule | None:
    """A schedule of func when it is a fused decode op (has every block of fused_decode.BLOCKS)."""
    if not isinstance(func, tirx.PrimFunc):
        return None
    sch = s_tir.Schedule(func)
    try:
        for name in BLOCKS:
            sch.get_sblock(name)
    except (RuntimeError, ValueError):  # ScheduleError and TVM internal errors are RuntimeErrors
        return None
    return sch


def fused_matmuls(sch: s_tir.Schedule) -> list:
    """The op's product blocks: NT_matmul, and NT_matmul_up where it has one (SwiGLU)."""
    blocks = [sch.get_sblock("NT_matmul")]
    try:
        blocks.append(sch.get_sblock(UP_BLOCK))
    except (RuntimeError, ValueError):  # ScheduleError and TVM internal errors are RuntimeErrors
        pass
    return blocks


def _vector(extent: int, candidates) -> int:
    """The first of `candidates` that divides `extent` (1 if none does)."""
    return next((v for v in candidates if extent % v == 0), 1)


def _split_k(sch: s_tir.Schedule, matmul, factors: list) -> tuple:
    """rfactor of `matmul` over its K axis split by `factors`; the factored axis is the first
    split loop of a given factor ([None, lanes, vec]: lanes interleaving vectors; [lanes, None,
    vec]: each lane a contiguous chunk). -> (partial block, write-back block)."""
    *_, k = sch.get_loops(matmul)
    splits = sch.split(k, factors)
    factored = next(i for i, factor in enumerate(factors) if factor is not None)
    return sch.rfactor(splits[factored], factor_axis=0), matmul


def _conflict_free(chunk: int, dtype_bits: int) -> bool:
    """Whether 16-byte shared-memory reads at a stride of `chunk` elements hit 8 distinct
    16-byte bank groups (the lanes of a quarter warp): the stride is an odd multiple of 16 bytes."""
    stride = chunk * dtype_bits // 8
    return stride % 16 == 0 and (stride // 16) % 2 == 1


class CUDAFusedDecodeGEMV(ScheduleRule):
    """Schedules fused_decode's ops for CUDA (module docstring). staged False: the per-warp
    layout (every column's lanes compute the norm themselves, no shared memory), kept for
    scripts/bench_fused_gemv.py's comparison."""

    def __init__(self, rows: int = CUDA_ROWS, threads: int = CUDA_THREADS, lanes: int = CUDA_LANES,
                 min_blocks: int = CUDA_MIN_BLOCKS, staged: bool = True, prefetch: bool = True):
        # One warp a block: blocks of several warps whose columns take 32 lanes each (K of 2048)
        # gave wrong sums on the H200 (scripts/bench_fused_gemv.py's check), and were no faster
        # where they were right
        if not 1 <= lanes <= threads <= 32:
            raise ValueError(f"threads={threads}, lanes={lanes}: expected 1 <= lanes <= threads <= 32 (one warp)")
        for name, flag in (("staged", staged), ("prefetch", prefetch)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name}={flag!r}: expected a bool")
        self.rows, self.threads, self.lanes, self.min_blocks, self.staged = rows, threads, lanes, min_blocks, staged
        self.prefetch = prefetch

    def apply(self, func, target, _tunable):
        if not isinstance(func, tirx.PrimFunc) or target.kind.name != "cuda":
            return None
        sch = fused_op_schedule(func)
        if sch is None:
            return None
        return self._schedule(sch)

    def _schedule(self, sch: s_tir.Schedule) -> s_tir.Schedule:
        sumsq, rstd, norm, _, epilogue = (sch.get_sblock(name) for name in BLOCKS)
        if self.staged:
            sch.set_scope(norm, 0, "shared")  # (before the cache reads below tell it from the weight)
        else:
            sch.compute_inline(norm)
        matmuls = fused_matmuls(sch)
        k_extent = int(sch.get(sch.get_loops(matmuls[0])[-1]).extent)
        dtype_bits = tvm.DataType(sch.get(matmuls[0]).reads[-1].source.dtype).bits
        vec = _vector(k_extent, [128 // dtype_bits, 4, 2, 1])
        lanes = self.lanes
        while lanes > 1 and (k_extent // vec) % lanes:
            lanes //= 2
        # prefetch: each lane takes a contiguous chunk of K (lane-major), so that a thread's
        # registers hold its own chunk and nothing else; else the lanes interleave 16-byte vectors
        prefetch = self.staged and self.prefetch and _conflict_free(k_extent // lanes, dtype_bits)
        factored = [_split_k(sch, m, [lanes, None, vec] if prefetch else [None, lanes, vec]) for m in matmuls]
        # one thread block per chunk of rows and `cols` columns (the chunk the fastest block index:
        # the blocks that read one weight slice run together, the slice comes from memory once);
        # the block's rows one after the other
        row, one, j = sch.get_loops(epilogue)
        extent = sch.get(row).extent
        rows = min(self.rows, int(extent)) if isinstance(extent, tirx.IntImm) else self.rows
        chunk, row = sch.split(row, [None, rows])
        n_cols = int(sch.get(j).extent)
        cols = max(1, self.threads // lanes)
        # (staged: fewer columns per block while that leaves too few blocks to fill the GPU)
        while cols > 1 and (n_cols % cols or (self.staged and n_cols // cols < self.min_blocks)):
            cols //= 2
        col_tile, col = sch.split(j, [None, cols])
        # staged: the row above the columns, so the block stages each row once for all its columns
        sch.reorder(chunk, col_tile, *((row, col) if self.staged else (col, row)), one)
        sch.bind(chunk, "blockIdx.x")
        sch.bind(col_tile, "blockIdx.y")
        sch.bind(col, "threadIdx.y")
        product_at = col if self.staged else row
        for partial, writeback in factored:
            sch.compute_at(writeback, product_at, preserve_unit_loops=True)
            sch.compute_at(partial, product_at, preserve_unit_loops=True)
            # under it: the rfactor axis (lanes) first, then the block's own (row, 1, column, K)
            lane, *_, k_step, k_vec = sch.get_loops(partial)[-6:]
            sch.bind(lane, "threadIdx.x")
            # 16-byte vectors of the weight (global) and, staged, of the normalized row (shared)
            for scope in ("global", "shared") if self.staged else ("global",):
                reads = sch.get(partial).reads
                index = next(i for i, region in enumerate(reads)
                             if region.source.scope() == scope and len(region.source.shape) == 2)
                vector = sch.cache_read(partial, index, "local", consumer_blocks=[partial])
                if scope == "global" and prefetch:
                    self._prefetch(sch, vector, col_tile, lanes, vec)
                    continue
                sch.compute_at(vector, k_step)
                sch.vectorize(sch.get_loops(vector)[-1])
            sch.unroll(k_vec)
            sch.set_scope(partial, 0, "local")
            sch.decompose_reduction(partial, k_step)
            if self.staged:
                sch.unroll(k_step)
            # the lanes' sums, a warp reduction: the write-back's loops are (lane, row, 1, column)
            sum_lane, *rest = sch.get_loops(writeback)[-4:]
            sch.reorder(*rest, sum_lane)
            sch.bind(sum_lane, "threadIdx.x")
            sch.set_scope(writeback, 0, "local")
        if self.staged:
            # the row normalized once per (block, row) into shared memory, 16-byte vectors
            sch.compute_at(norm, row, preserve_unit_loops=True)
            # (float32 math: vectors of at most 4, which CUDA has; 8 halves as 2 of them)
            norm_vec = _vector(vec, [4, 2, 1])
            steps, ty, tx, v = sch.split(sch.get_loops(norm)[-1], [None, cols, lanes, norm_vec])
            sch.unroll(steps)
            sch.bind(ty, "threadIdx.y")
            sch.bind(tx, "threadIdx.x")
            sch.vectorize(v)
        # the row's 1 / RMS: staged, a reduction over the whole block; else each warp's own
        sch.compute_at(rstd, row)
        if self.staged:
            self._block_sumsq(sch, sumsq, row, cols, lanes, vec)
        else:
            sch.compute_at(sumsq, row)
            _, sq_lane = sch.split(sch.get_loops(sumsq)[-1], [None, lanes])
            sch.bind(sq_lane, "threadIdx.x")
            sch.set_scope(sumsq, 0, "local")
        sch.set_scope(rstd, 0, "local")
        return sch

    @staticmethod
    def _prefetch(sch: s_tir.Schedule, vector, col_tile, lanes: int, vec: int) -> None:
        """The thread's whole chunk of its column of the weight into registers, first thing in
        the block (before x is read and normalized), as 16-byte vectors; the outermost loop is
        marked PREFETCH_ATTR, after which programmatic dependent launch puts the grid wait
        (compiler/dependent_launch.py: a weight is read-only, so its reads need not wait)."""
        sch.compute_at(vector, col_tile, preserve_unit_loops=True)
        col, k = sch.get_loops(vector)[-2:]
        lane, k_step, k_vec = sch.split(k, [lanes, None, vec])
        if int(sch.get(col).extent) > 1:  # (a unit loop bound to threadIdx.y mixes int64 and int32 extents)
            sch.bind(col, "threadIdx.y")
        sch.bind(lane, "threadIdx.x")
        sch.unroll(k_step)
        sch.vectorize(k_vec)
        sch.annotate(col, PREFETCH_ATTR, 1)

    @staticmethod
    def _block_sumsq(sch: s_tir.Schedule, sumsq, row, cols: int, lanes: int, vec: int) -> None:
        """The row's sum of squares by the block's cols * lanes threads: each sums its own
        16-byte vectors of x (a partial in a register), then a shuffle reduction."""
        threads = cols * lanes
        k_extent = int(sch.get(sch.get_loops(sumsq)[-1]).extent)
        # the widest vector (of at most `vec` elements) that splits the row evenly over the threads
        vec = _vector(k_extent // threads, [vec, 4, 2, 1]) if k_extent % threads == 0 else 1
        partial, writeback = _split_k(sch, sumsq, [None, threads, vec])
        sch.compute_at(writeback, row, preserve_unit_loops=True)
        sch.compute_at(partial, row, preserve_unit_loops=True)
        thread, *_, k_step, k_vec = sch.get_loops(partial)[-4:]
        sq_col, sq_lane = sch.split(thread, [cols, lanes])
        sch.bind(sq_col, "threadIdx.y")
        sch.bind(sq_lane, "threadIdx.x")
        if vec > 1:
            x_vector = sch.cache_read(partial, 0, "local", consumer_blocks=[partial])
            sch.compute_at(x_vector, k_step)
            sch.vectorize(sch.get_loops(x_vector)[-1])
        sch.unroll(k_vec)
        sch.set_scope(partial, 0, "local")
        sch.decompose_reduction(partial, k_step)
        sch.unroll(k_step)  # (every load issued before the sums wait on them)
        # the threads' partials, a shuffle reduction: the write-back's loops are (thread, row)
        sum_thread, row_loop = sch.get_loops(writeback)[-2:]
        sch.reorder(row_loop, sum_thread)
        sum_col, sum_lane = sch.split(sum_thread, [cols, lanes])
        sch.bind(sum_col, "threadIdx.y")
        sch.bind(sum_lane, "threadIdx.x")
        sch.set_scope(writeback, 0, "local")


class CPUFusedDecodeGEMV(ScheduleRule):
    """Schedules fused_decode's ops for the CPU (module docstring)."""

    def __init__(self, column_chunk: int = CPU_COLUMN_CHUNK):
        self.column_chunk = column_chunk

    def apply(self, func, target, _tunable):
        if not isinstance(func, tirx.PrimFunc) or target.kind.name != "llvm":
            return None
        sch = fused_op_schedule(func)
        if sch is None:
            return None
        norm, epilogue = sch.get_sblock("rms_norm"), sch.get_sblock("T_epilogue")
        matmuls = fused_matmuls(sch)
        k_extent = int(sch.get(sch.get_loops(matmuls[0])[-1]).extent)
        vec = _vector(k_extent, [16, 8, 4, 2])
        factored = [_split_k(sch, m, [None, vec]) for m in matmuls]
        row, one, j = sch.get_loops(epilogue)
        col_tile, col = sch.split(j, [None, self.column_chunk])
        sch.reorder(col_tile, row, one, col)
        sch.parallel(col_tile)
        for partial, writeback in factored:
            sch.compute_at(writeback, col_tile, preserve_unit_loops=True)
            sch.compute_at(partial, col_tile, preserve_unit_loops=True)
            k_vec, row, one, col, k_step = sch.get_loops(partial)[-5:]  # the rfactor axis first
            sch.reorder(row, one, col, k_step, k_vec)
            sch.vectorize(k_vec)
            init = sch.decompose_reduction(partial, k_step)
            sch.vectorize(sch.get_loops(init)[-1])
        sch.vectorize(sch.get_loops(norm)[-1])
        return sch
