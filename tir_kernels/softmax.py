"""Online softmax and LSE merge: the one implementation decode, prefill and merge_state share.

A softmax state over a set of keys is (m, l, o): running max m and denominator l, both in
the base-2 domain (scores are pre-scaled by sm_scale * log2(e) and exponentiated with exp2),
and the unnormalised output o = sum_j exp2(s_j - m) v_j. A finished state is (o / l, lse)
with lse = m + log2(l). A row that saw no key has l = 0, m = EMPTY_LSE and finishes as
o = 0, lse = EMPTY_LSE (finite, so merging two empty states never computes inf - inf).
A finished state (o, lse) is the state (m = lse, l = 1, o) again, so finished states merge
with the same arithmetic.

Two layers:
- Scalar expressions (`rescale_factor`, `prob`, `merge_weight(s)`, `merged_lse`,
  `finalize_scale`, `finalize_lse`, ...): plain functions of PrimExprs, for kernels that keep
  their state in registers of their own layout (tensor-core fragments).
- Buffer macros from `softmax_macros(loops)`: `init`, `update`, `merge`, `combine`,
  `finalize` over float32 buffers laid out as m[row], l[row], o[row * width + c]. Their loops
  come from a `LoopKinds`, so the CUDA and the CPU variant of a kernel share them.
"""

from __future__ import annotations

from typing import NamedTuple

from tvm.script import tirx as T

from .common import EMPTY_LSE, LoopKinds


def rescale_factor(m_old, m_new):
    """alpha = exp2(m_old - m_new): what a state's l and o are multiplied by when its max
    moves from m_old to m_new >= m_old."""
    return T.exp2(m_old - m_new)


def prob(s, m):
    """Unnormalised probability exp2(s - m) of a base-2 score s under running max m."""
    return T.exp2(s - m)


def lse_of(m, l):
    """Base-2 LSE m + log2(l) of a state with l > 0."""
    return m + T.log2(l)


def finalize_scale(l):
    """1 / l, the factor that finishes o; 0 for an empty row (l = 0), so o = 0."""
    return T.if_then_else(l > T.float32(0), T.float32(1) / l, T.float32(0))


def finalize_lse(m, l):
    """The LSE of a finished state: m + log2(l), or EMPTY_LSE for an empty row (l = 0)."""
    return T.if_then_else(l > T.float32(0), lse_of(m, l), T.float32(EMPTY_LSE))


def merge_weight(lse, lse_other):
    """exp2(lse - max(lse, lse_other)): the weight of the state with LSE `lse` in its merge
    with the other, relative to the larger (which gets 1). 1 for two empty states."""
    return T.exp2(lse - T.max(lse, lse_other))


def merge_weights(lse_a, lse_b):
    """(w_a, w_b): both `merge_weight`s of a pair of finished states (a Python tuple; in
    TVMScript bind them one at a time, e.g. w[0] = merge_weight(a, b))."""
    return merge_weight(lse_a, lse_b), merge_weight(lse_b, lse_a)


def merged_lse_from(lse_a, lse_b, w_a, w_b):
    """The merged LSE, given the `merge_weights` w_a, w_b of lse_a, lse_b."""
    return lse_of(T.max(lse_a, lse_b), w_a + w_b)


def merged_lse(lse_a, lse_b):
    """LSE of the merge of two finished states: log2(exp2(lse_a) + exp2(lse_b)), computed
    from the larger; finite (EMPTY_LSE + 1) for two empty states."""
    w_a, w_b = merge_weights(lse_a, lse_b)
    return merged_lse_from(lse_a, lse_b, w_a, w_b)


def merged_o(o_a, o_b, w_a, w_b, inv):
    """Output of the merge of two finished states: (w_a o_a + w_b o_b) * inv,
    inv = 1 / (w_a + w_b), in float32."""
    return (T.Cast("float32", o_a) * w_a + T.Cast("float32", o_b) * w_b) * inv


def finished_l(lse):
    """Denominator of a finished state seen as a state (m = lse, l, o): 1, or 0 when empty."""
    return T.if_then_else(lse > T.float32(EMPTY_LSE), T.float32(1), T.float32(0))


class SoftmaxMacros(NamedTuple):
    """Buffer macros over states laid out as m_[row], l_[row], o_[row * width + c] (float32)."""

    init: object
    update: object
    merge: object
    combine: object
    finalize: object


def softmax_macros(loops: LoopKinds) -> SoftmaxMacros:
    """The state macros, with loops of `loops` (unrolled on CUDA, serial on the CPU)."""
    L = loops

    @T.macro
    def init(m_, l_, o_, rows_, width_):
        """Empty states for rows 0..rows_-1: m = EMPTY_LSE, l = 0, o = 0."""
        for r in L.unroll(rows_):
            m_[r] = T.float32(EMPTY_LSE)
            l_[r] = T.float32(0)
            for c in L.unroll(width_):
                o_[r * width_ + c] = T.float32(0)

    @T.macro
    def update(m_, l_, o_, row_, width_, m_new_):
        """Move row row_'s state to the running max m_new_ (>= m_[row_]): l and o are
        multiplied by alpha = exp2(m - m_new_), m <- m_new_. The caller then adds
        p = prob(s, m_new_) to l and p * v to o for each new score s."""
        alpha = T.alloc_buffer((1,), "float32", scope=L.local)
        alpha[0] = rescale_factor(m_[row_], m_new_)
        m_[row_] = m_new_
        l_[row_] = l_[row_] * alpha[0]
        for c in L.unroll(width_):
            o_[row_ * width_ + c] = o_[row_ * width_ + c] * alpha[0]

    @T.macro
    def merge(o_, o_other_, width_, lse_, lse_other_, w_):
        """Merge two finished states (o_, lse_) and (o_other_, lse_other_) in float32:
        o_[c] <- merged_o for c < width_ (cast to o_'s dtype); w_ (float32[4]) <- the two
        weights, the merged LSE and 1 / (sum of the weights). The caller stores w_[2] as the
        new LSE. Finite for two empty states."""
        w_[0] = merge_weight(lse_, lse_other_)
        w_[1] = merge_weight(lse_other_, lse_)
        w_[2] = merged_lse_from(lse_, lse_other_, w_[0], w_[1])
        w_[3] = T.float32(1) / (w_[0] + w_[1])
        for c in L.unroll(width_):
            o_[c] = T.Cast(o_.dtype, merged_o(o_[c], o_other_[c], w_[0], w_[1], w_[3]))

    @T.macro
    def combine(count_, m_at_, l_at_, o_at_, m_, l_, o_):
        """Merge count_ states of one row and column into m_[0], l_[0], o_[0] (unfinished):
        state y is (m_at_(y), l_at_(y), o_at_(y)); a finished state (o, lse) is
        (lse, finished_l(lse), o * finished_l(lse)). Empty states (l = 0, o = 0) add nothing."""
        m_[0] = T.float32(EMPTY_LSE)
        for y in T.serial(count_):
            m_[0] = T.max(m_[0], m_at_(y))
        l_[0] = T.float32(0)
        o_[0] = T.float32(0)
        for y in T.serial(count_):
            l_[0] = l_[0] + l_at_(y) * rescale_factor(m_at_(y), m_[0])
            o_[0] = o_[0] + o_at_(y) * rescale_factor(m_at_(y), m_[0])

    @T.macro
    def finalize(m_, l_, o_, row_, width_):
        """Finish row row_'s state in place: o <- o / l and m_[row_] <- its LSE
        m + log2(l); an empty row gets o = 0 and EMPTY_LSE."""
        inv = T.alloc_buffer((1,), "float32", scope=L.local)
        inv[0] = finalize_scale(l_[row_])
        for c in L.unroll(width_):
            o_[row_ * width_ + c] = o_[row_ * width_ + c] * inv[0]
        m_[row_] = finalize_lse(m_[row_], l_[row_])

    return SoftmaxMacros(init, update, merge, combine, finalize)


__all__ = [
    "EMPTY_LSE",
    "SoftmaxMacros",
    "finalize_lse",
    "finalize_scale",
    "finished_l",
    "lse_of",
    "merge_weight",
    "merge_weights",
    "merged_lse",
    "merged_lse_from",
    "merged_o",
    "prob",
    "rescale_factor",
    "softmax_macros",
]


def merge_splits_macro(loops: LoopKinds, dtype: str, heads: int, width: int, num_splits):
    """merge_splits(o_part_, lse_part_, O_, lse_): O_ [B, heads, width] (dtype), lse_ [B, heads]
    <- the FP32 merge of each (request, head)'s finished split states, o_part_
    [splits * B * heads * width], lse_part_ [splits * B * heads] with splits = num_splits(B);
    an empty split (lse EMPTY_LSE) adds nothing. One block per (request, head), a thread per
    output column; split s's finished state (o, lse) is the state (m = lse, l = 1, o)."""
    L = loops
    sm = softmax_macros(L)

    @T.macro
    def merge_splits(o_part_, lse_part_, O_, lse_):
        batch = O_.shape[0]
        for b in L.block(batch, "x", outer=True):
            for h in L.block(heads, "y"):
                for e in L.thread(width, "x"):
                    m_all = T.alloc_buffer((1,), "float32", scope=L.local)
                    d_all = T.alloc_buffer((1,), "float32", scope=L.local)
                    acc = T.alloc_buffer((1,), "float32", scope=L.local)
                    sm.combine(num_splits(batch),
                               lambda s: lse_part_[(s * batch + b) * heads + h],
                               lambda s: finished_l(lse_part_[(s * batch + b) * heads + h]),
                               lambda s: o_part_[((s * batch + b) * heads + h) * width + e]
                               * finished_l(lse_part_[(s * batch + b) * heads + h]),
                               m_all, d_all, acc)
                    sm.finalize(m_all, d_all, acc, 0, 1)
                    O_[b, h, e] = T.Cast(dtype, acc[0])
                    if e == 0:
                        lse_[b, h] = m_all[0]

    return merge_splits
