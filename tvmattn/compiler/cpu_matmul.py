"""A dlight CPU schedule rule for the model's multi-token matrix products.

After `FuseTransposeMatmul` every projection is an `NT_matmul`

    C[b, t, n] = sum_k X[b, t, k] * W[n, k]      (W: a weight of static shape [N, K])

over a token dimension that is usually symbolic (prefill, batch_prefill, batch_verify: t = n
tokens; batch_decode: b = batch size), possibly followed by elementwise epilogues (the residual
add). Unscheduled, the CPU re-reads all of W for every token: a prefill or verify step of n
tokens costs about n decode steps. dlight's CPU GEMV rule only handles a static single token.

`CPUMatmul` schedules such a function for weight reuse:

    X' = X padded with zero rows to a multiple of MR tokens
    parallel  for column chunk  (NB columns of W, spread over the cores)
      for token tile  (MR tokens)
        for register tile  (NR columns of the chunk)
          acc[MR, NR, V] = 0                          (vector accumulators, in registers)
          for ko in K / V:
            unrolled MR x NR:  acc[m, n, :] += X'[m, ko*V : +V] * W[n, ko*V : +V]   (vectorized)
          C'[m, n] = sum(acc[m, n, :])
          for the tile's real tokens (m < n_tokens):  out[m, n] = epilogue(C'[m, n])

The k-dot product over contiguous K is split (rfactor) into V lanes that accumulate
independently, so both X and W are read as contiguous vectors without a layout change; a
chunk of W (NB x K floats) stays in L1/L2 while every token tile uses it, so the weights come
from memory once per step rather than once per token. Padding the tokens (pad_einsum) keeps
predicates out of the inner loops; only the tile's epilogue checks m < n_tokens. A few tokens
then cost less than one token under dlight's GEMV (figures: docs/performance.md).

Scope: float32 only (float16 / bfloat16 and anything unrecognized are left to the other rules,
i.e. unscheduled), a single sum-of-products reduction block whose last reduction-free index is
the weight row, static N and K, and at most one injective epilogue block. A function whose
token extent is statically 1 is left to GEMV (decode keeps its schedule).
"""

from __future__ import annotations

import tvm
from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.base import ScheduleRule, try_inline_contiguous_spatial
from tvm.s_tir.schedule import ScheduleError
from tvm.target import Target


# a buffer load's Python class (tirx.BufferLoad is a constructor function in TVM 0.27)
_LOAD = tvm.ir.expr.TensorLoad if hasattr(tvm.ir.expr, "TensorLoad") else tirx.BufferLoad


def _source(load):
    """The buffer a load reads (`source` in TVM 0.27, `buffer` before)."""
    return load.source if hasattr(load, "source") else load.buffer


def _is_var(expr) -> bool:
    return tvm.ir.is_prim_var(expr) if hasattr(tvm.ir, "is_prim_var") else isinstance(expr, tirx.Var)


def _int(expr) -> int | None:
    return int(expr) if isinstance(expr, (int, tirx.IntImm)) else None


def _is_var_list(indices, variables) -> bool:
    """Whether indices are `variables` in order, with constant-0 indices (unit dimensions) between."""
    found = []
    for i in indices:
        if _is_var(i):
            found.append(i)
        elif _int(i) != 0:
            return False
    return len(found) == len(variables) and all(i.same_as(v) for i, v in zip(found, variables))


def _match_nt_matmul(block: tirx.SBlock):
    """(x, w) loads of a float32 block `C[s...] = C[s...] + X[s[:-1]..., k] * W[s[-1], k]`, or None."""
    iters = list(block.iter_vars)
    if len(iters) < 2 or iters[-1].iter_type != tirx.IterVar.CommReduce:
        return None
    if any(it.iter_type != tirx.IterVar.DataPar for it in iters[:-1]):
        return None
    spatial = [it.var for it in iters[:-1]]
    k = iters[-1].var
    store = block.body
    if not isinstance(store, tirx.BufferStore) or not _is_var_list(store.indices, spatial):
        return None
    if block.init is None or not isinstance(block.init, tirx.BufferStore):
        return None
    init_value = block.init.value
    if not isinstance(init_value, (tirx.FloatImm, tirx.IntImm)) or float(init_value.value) != 0.0:
        return None
    value = store.value
    if not isinstance(value, tirx.Add):
        return None
    acc, prod = value.a, value.b
    if not (isinstance(acc, _LOAD) and _source(acc).same_as(store.buffer)):
        acc, prod = prod, acc
    if not (isinstance(acc, _LOAD) and _source(acc).same_as(store.buffer)
            and _is_var_list(acc.indices, spatial)):
        return None
    if not isinstance(prod, tirx.Mul):
        return None
    a, b = prod.a, prod.b  # no casts: same-dtype operands only
    if not (isinstance(a, _LOAD) and isinstance(b, _LOAD)):
        return None
    for x, w in ((a, b), (b, a)):
        if _is_var_list(x.indices, spatial[:-1] + [k]) and _is_var_list(w.indices, [spatial[-1], k]):
            break
    else:
        return None
    if any(str(buf.dtype) != "float32" for buf in (store.buffer, _source(x), _source(w))):
        return None
    if any(_int(d) is None for d in _source(w).shape):
        return None
    return x, w


def _split_index(axis: int, factor: int):
    """The index map that splits buffer dimension `axis` into [i // factor, i % factor]."""

    def index_map(*idx):
        return (*idx[:axis], idx[axis] // factor, idx[axis] % factor, *idx[axis + 1:])

    return index_map


class CPUMatmul(ScheduleRule):
    """Multi-token `NT_matmul` (+ injective epilogue) on llvm: see the module docstring.

    vector: V, the k lanes accumulated apart (a multiple of the SIMD width);
    token_tile: MR; col_tile: NR (register tile MR x NR x V floats);
    chunk: NB, the columns of W per parallel task (a multiple of NR dividing N).
    """

    def __init__(self, vector: int = 4, token_tile: int = 4, col_tile: int = 2, chunk: int = 32):
        self.vector = vector
        self.token_tile = token_tile
        self.col_tile = col_tile
        self.chunk = chunk

    def is_target_available(self, target: Target) -> bool:
        return super().is_target_available(target) and target.kind.name == "llvm"

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool) -> None | s_tir.Schedule:
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        try:
            return self._schedule(func)
        except (ScheduleError, tvm.error.TVMError, ValueError):
            # a schedule primitive refused: leave the function to the other rules
            return None

    def _schedule(self, func: tirx.PrimFunc) -> None | s_tir.Schedule:
        sch = s_tir.Schedule(func)
        infos = normalize_prim_func(sch)
        if infos is None:
            return None
        infos = try_inline_contiguous_spatial(sch, infos)
        if infos is None or not 1 <= len(infos) <= 2:
            return None
        main = infos[0]
        if not main.is_reduction() or main.dom_kind()[-1] != "R" or "R" in main.dom_kind()[:-1]:
            return None
        epilogue = infos[1] if len(infos) == 2 else None
        if epilogue is not None and not epilogue.is_injective():
            return None
        block = sch.get(main.block_rv)
        matched = _match_nt_matmul(block)
        if matched is None:
            return None
        _x, w = matched
        n_cols, k_len = (_int(d) for d in _source(w).shape)
        dom = main.dom()
        if _int(dom[-2]) != n_cols or _int(dom[-1]) != k_len:
            return None
        if len(dom) != 3 or _int(dom[0]) == 1:
            return None  # one token dimension only (normalized); a single token is GEMV's
        n_tokens = _int(dom[0])
        vec = next((v for v in (self.vector, 8, 4) if k_len % v == 0), None)
        if vec is None:
            return None
        nr = next(r for r in (self.col_tile, 4, 3, 2, 1) if n_cols % r == 0)
        nb = next(c for c in range(max(self.chunk, nr), 0, -1) if n_cols % c == 0 and c % nr == 0)
        mr = self.token_tile

        blk = main.block_rv
        # Pad the token dimension to a multiple of MR: the inner loops then need no predicate
        # (a copy of X with zero rows, an MR-padded result cropped in the tile's epilogue).
        if n_tokens is None or n_tokens % mr:
            sch.pad_einsum(blk, [mr, 1, 1])
            crop = sch.get_consumers(blk)
            if len(crop) != 1:
                return None
            crop = crop[0]
            if epilogue is not None:
                sch.compute_inline(crop)  # the epilogue reads the padded result directly
                last = epilogue.block_rv
            else:
                last = crop
        else:
            last = epilogue.block_rv if epilogue is not None else None

        m, n, k = sch.get_loops(blk)
        ko, ki = sch.split(k, factors=[None, vec])
        rf = sch.rfactor(ki, factor_axis=len(sch.get(blk).writes[0].region))
        # rf: loops m, n, ko, ki (spatial, the last index of its buffer); blk (write-back): m, n, ki (reduction)
        m, n, ko, ki = sch.get_loops(rf)
        mo, mi = sch.split(m, factors=[None, mr])
        no, nm, ni = sch.split(n, factors=[None, nb // nr, nr])
        sch.reorder(no, mo, nm, ko, mi, ni, ki)
        tile = nm
        sch.parallel(no)
        sch.unroll(mi)
        sch.unroll(ni)
        sch.vectorize(ki)
        init = sch.decompose_reduction(rf, ko)
        ii = sch.get_loops(init)[-3:]
        sch.unroll(ii[0])
        sch.unroll(ii[1])
        sch.vectorize(ii[2])

        sch.reverse_compute_at(blk, tile, preserve_unit_loops=True)
        for loop in sch.get_loops(blk)[-3:]:
            sch.unroll(loop)
        if last is not None:
            sch.reverse_compute_at(last, tile, preserve_unit_loops=True)
            for loop in sch.get_loops(last)[3:]:
                sch.unroll(loop)

        # The accumulators ([tokens, ..., N, V]) and the tile's result ([tokens, ..., N]) are
        # local; laid out [tokens // MR, MR, ...] a tile's region has static extents, so each
        # compacts to a small array (registers) instead of one the size of the whole result.
        for b in (rf, blk) if last is not None else (rf,):
            sch.set_scope(b, 0, "local")
            shape = _source(sch.get(b).writes[0]).shape
            tok = next(i for i, d in enumerate(shape) if _int(d) != 1)
            sch.transform_layout(b, ("write", 0), _split_index(tok, mr))
        return sch
