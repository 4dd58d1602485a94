"""Merge of two partial attention states (output and base-2 LSE) over disjoint key sets.

Used in place by the cache to combine attention over committed pages with attention over
the tokens of the current step (and over cascade levels).
"""

from __future__ import annotations

from tvm.script import tirx as T

from .common import loop_kinds
from .config import AttentionConfig
from .page_ops import num_blocks
from .schedules import CopySchedule, choose_copy_schedule
from .softmax import softmax_macros


def merge_state(config: AttentionConfig, schedule: CopySchedule | None = None):
    """In-place merge PrimFunc, arguments in the contract's order:

    o [N, Hq, Dv], lse [N, Hq] f32, o_other [N, Hq, Dv], lse_other [N, Hq] f32 (Dv = v_head_dim).
    With m = max(lse, lse_other), w = exp2(lse - m), w_other = exp2(lse_other - m):
    o <- (w * o + w_other * o_other) / (w + w_other), lse <- m + log2(w + w_other), in FP32.
    A row that saw no key carries lse = EMPTY_LSE (finite), so two empty rows merge to a
    finite value without NaN. The arithmetic is `softmax_macros(...).merge` (softmax.py).

    One thread per chunk of a row; a block holds whole rows (threadIdx.y), and the row's
    new LSE is stored only after every thread of the block has read the old one.
    """
    Dv, Hq, dtype = config.v_head_dim, config.num_qo_heads, config.dtype
    sched = schedule or choose_copy_schedule(config, Dv)
    sched.check(Dv)
    L = loop_kinds(config)
    sm = softmax_macros(L)
    gpu = config.is_gpu
    VEC, CH = sched.vector, sched.chunks(Dv)
    ROWS = max(1, sched.threads // CH)  # rows (n, head) per block

    @T.prim_func
    def tir_attention_merge_state(
        o_handle: T.handle,
        lse_handle: T.handle,
        o_other_handle: T.handle,
        lse_other_handle: T.handle,
    ):
        T.func_attr({"tirx.noalias": True})
        N = T.int32()
        O = T.match_buffer(o_handle, (N, Hq, Dv), dtype)
        lse = T.match_buffer(lse_handle, (N, Hq), "float32")
        O_other = T.match_buffer(o_other_handle, (N, Hq, Dv), dtype)
        lse_other = T.match_buffer(lse_other_handle, (N, Hq), "float32")
        for bx in L.block(num_blocks(N * Hq, ROWS), "x", outer=True):
            for ty in L.thread(ROWS, "y"):
                for tx in L.thread(CH, "x"):
                    # weight, other weight, merged lse, 1 / (sum of the weights)
                    w = T.alloc_buffer((4,), "float32", scope="local")
                    a = T.alloc_buffer((VEC,), dtype, scope="local")
                    b = T.alloc_buffer((VEC,), dtype, scope="local")
                    row = bx * ROWS + ty
                    if row < N * Hq:
                        n = row // Hq
                        h = row % Hq
                        for e in L.vector(VEC):
                            a[e] = O[n, h, tx * VEC + e]
                        for e in L.vector(VEC):
                            b[e] = O_other[n, h, tx * VEC + e]
                        sm.merge(a, b, VEC, lse[n, h], lse_other[n, h], w)
                        for e in L.vector(VEC):
                            O[n, h, tx * VEC + e] = a[e]
                    if gpu:
                        T.tvm_storage_sync("shared")
                    if row < N * Hq and tx == 0:
                        lse[row // Hq, row % Hq] = w[2]

    return tir_attention_merge_state.with_attr("global_symbol", "tir_attention_merge_state")
