"""The CPU prefill's `attend` in explicit float32 vectors (a `PrefillSchedule` with vector_lanes).

The same algorithm as prefill_simt's `attend` (a block: one KV head and a tile of packed query
rows of one request; online softmax over K/V tiles; the same masks, empty rows and outputs),
written for one CPU thread per block with V = vector_lanes keys per step and every head
dimension in V-lane vectors:
  q: the tile's rows, scaled by sm_scale * log2(e), copied once into scratch (float32);
  per step, V keys read in place (no copy; keys past the tile's last visible one read that key
    and are masked), then
    S: q . k as V-lane partial sums, a row at a time (score_rows 1) or, for a pair of packed
      rows and half of the keys at a time, held in registers over the head dimension with each
      key vector loaded once for both rows (score_rows 2); then each row's V sums reduced to
      one vector of V scores by a tree of shuffles (decode_simt's);
    mask (steps that cross the diagonal or the end of the KV only): hidden scores -> the lowest
      float, whose probability is exactly 0;
    softmax, per row: max and sum by lane rotations, probabilities by exp2_fine;
  then O: o(rows) = o * alpha + P V, a V-lane slice of o for O_ROWS rows at a time kept in
    registers over the step's V keys, so each value vector is read once for those rows.
Packed rows of a GQA group share their K/V reads: a tile of rows_per_thread packed rows holds
rows_per_thread / G query tokens of all G heads. Inline RoPE (rotate_) takes the scalar tile
(prefill_simt), built from the same schedule.
"""

from __future__ import annotations

from typing import NamedTuple

from tvm.script import tirx as T

from .common import EMPTY_LSE, LOG2E, exp2_vector
from .decode_simt import _halving_shuffles
from .softmax import finalize_lse, finalize_scale

# Packed rows whose output slices stay in registers over one step of O (8 x V lanes).
O_ROWS = 8
# 2**f on [-1/2, 1/2]: Taylor terms (ln 2)**k / k! to degree 7 (truncation about 5e-9 relative).
_EXP2_TERMS = (1.0, 0.6931471805599453, 0.2402265069591007, 0.05550410866482158, 0.009618129107628477,
               0.0013333558146428443, 0.00015403530393381606, 1.525273380405984e-05)


def exp2_fine(x):
    """2**x (float32) in arithmetic LLVM vectorizes, to float32 rounding: common.exp2_vector with
    a degree-7 polynomial."""
    return exp2_vector(x, _EXP2_TERMS)


class _VectorOps(NamedTuple):
    vec: object  # vec(buf, at): buf[at : at + V] as a vector
    f32: object  # a vector of the dtype as float32
    row_scores: object  # macros: see _vector_ops
    pair_scores: object
    reduce_rows: object
    fold: object


def _vector_ops(dims) -> _VectorOps:
    """The vector steps of `cpu_attend_macro`, V = dims.VL lanes."""
    V, D_QK, dtype = dims.VL, dims.D_QK, dims.dtype
    H = V // 2  # keys of one pass of `pair_scores`
    fv = f"float32x{V}"
    halves = [_halving_shuffles(w) for w in (16, 8, 4, 2)]
    rotations = [[(i + n) % V for i in range(V)] for n in (8, 4, 2, 1)]

    def vec(buf, at):
        return buf[T.ramp(at, 1, V)]

    def f32(x):
        return x if dtype == "float32" else T.Cast(fv, x)

    def pair(buf, a, b, idx):
        both = [vec(buf, a), vec(buf, b)]
        return T.Shuffle(both, idx[0]) + T.Shuffle(both, idx[1])

    def dot(q_loc, p, k_at_, handle):
        """V-lane partial sums of q(row p) . k(handle)."""
        total = None
        for c in range(D_QK // V):
            term = vec(q_loc, p * D_QK + c * V) * f32(k_at_(handle, T.ramp(c * V, 1, V)))
            total = term if total is None else total + term
        return total

    @T.macro
    def row_scores(q_loc_, p_, k_at_, handle_, part_):
        """Row p_: the V-lane partial sums of q . k of the step's V keys into part_ (slot r: key r)."""
        for r in T.unroll(V):
            part_[T.ramp(r * V, 1, V)] = dot(q_loc_, p_, k_at_, handle_[r])

    @T.macro
    def pair_scores(q_loc_, p_, k_at_, handle_, acc0_, acc1_, part0_, part1_):
        """Rows p_ and p_ + 1: as row_scores into part0_ / part1_, H keys at a time; a key's
        vector, loaded once, serves both rows, and the 2 x H sums (acc0_, acc1_: H vectors each,
        under 1 KB, so registers) stay in registers over the head dimension."""
        for h in T.serial(2):
            for i in T.unroll(H):
                acc0_[T.ramp(i * V, 1, V)] = T.broadcast(T.float32(0), V)
                acc1_[T.ramp(i * V, 1, V)] = T.broadcast(T.float32(0), V)
            for c in T.serial(D_QK // V):
                for r in T.unroll(H):
                    acc0_[T.ramp(r * V, 1, V)] = vec(acc0_, r * V) + vec(q_loc_, p_ * D_QK + c * V) * f32(
                        k_at_(handle_[h * H + r], T.ramp(c * V, 1, V)))
                    acc1_[T.ramp(r * V, 1, V)] = vec(acc1_, r * V) + vec(q_loc_, (p_ + 1) * D_QK + c * V) * f32(
                        k_at_(handle_[h * H + r], T.ramp(c * V, 1, V)))
            for r in T.unroll(H):
                part0_[T.ramp((h * H + r) * V, 1, V)] = vec(acc0_, r * V)
                part1_[T.ramp((h * H + r) * V, 1, V)] = vec(acc1_, r * V)

    @T.macro
    def reduce_rows(part_):
        """part_[0 : V] <- lane r: the sum of the V lanes of part_[r * V : (r + 1) * V]."""
        for i in T.unroll(8):
            part_[T.ramp(i * V, 1, V)] = pair(part_, 2 * i * V, (2 * i + 1) * V, halves[0])
        for i in T.unroll(4):
            part_[T.ramp(i * V, 1, V)] = pair(part_, 2 * i * V, (2 * i + 1) * V, halves[1])
        for i in T.unroll(2):
            part_[T.ramp(i * V, 1, V)] = pair(part_, 2 * i * V, (2 * i + 1) * V, halves[2])
        part_[T.ramp(0, 1, V)] = pair(part_, 0, V, halves[3])

    @T.macro
    def fold(buf_, op):
        """buf_[0] <- op over buf_[0 : V] (lane rotations by 8, 4, 2, 1)."""
        buf_[T.ramp(0, 1, V)] = op(vec(buf_, 0), T.Shuffle([vec(buf_, 0)], rotations[0]))
        buf_[T.ramp(0, 1, V)] = op(vec(buf_, 0), T.Shuffle([vec(buf_, 0)], rotations[1]))
        buf_[T.ramp(0, 1, V)] = op(vec(buf_, 0), T.Shuffle([vec(buf_, 0)], rotations[2]))
        buf_[T.ramp(0, 1, V)] = op(vec(buf_, 0), T.Shuffle([vec(buf_, 0)], rotations[3]))

    return _VectorOps(vec, f32, row_scores, pair_scores, reduce_rows, fold)


def cpu_attend_macro(dims, L, scalar_attend):
    """attend (prefill_simt's signature) for dims.VL-lane vectors; scalar_attend serves rotate_."""
    V, G, D_QK, D_V, BQ, SR = dims.VL, dims.G, dims.D_QK, dims.D_V, dims.BQ, dims.SR
    RB = O_ROWS if BQ % O_ROWS == 0 else 1
    H = V // 2
    scope = L.local
    ops = _vector_ops(dims)
    vec, f32, reduce_rows, fold = ops.vec, ops.f32, ops.reduce_rows, ops.fold

    @T.macro
    def attend(q_at_, q_pos_at_, kv_row_, k_at_, v_at_, k_pos_base_, write_o_, write_lse_, qo_len_, kv_len_, tile_,
               causal_, rotate_, rope_scale_, rope_theta_, sm_scale_, ty_, tx_):
        """prefill_simt's attend (the same arguments and results)."""
        if rotate_:
            scalar_attend(q_at_, q_pos_at_, kv_row_, k_at_, v_at_, k_pos_base_, write_o_, write_lse_, qo_len_,
                          kv_len_, tile_, causal_, rotate_, rope_scale_, rope_theta_, sm_scale_, ty_, tx_)
        else:
            q_loc = T.alloc_buffer((BQ * D_QK,), "float32", scope=scope)
            o_loc = T.alloc_buffer((BQ * D_V,), "float32", scope=scope)
            m_loc = T.alloc_buffer((BQ,), "float32", scope=scope)
            l_loc = T.alloc_buffer((BQ,), "float32", scope=scope)
            a_loc = T.alloc_buffer((BQ,), "float32", scope=scope)  # the step's rescale factors
            s_loc = T.alloc_buffer((BQ * V,), "float32", scope=scope)  # the step's scores, then P
            part0 = T.alloc_buffer((V * V,), "float32", scope=scope)  # two rows' partial sums
            part1 = T.alloc_buffer((V * V,), "float32", scope=scope)
            acc0 = T.alloc_buffer((H * V,), "float32", scope=scope)  # under 1 KB: registers
            acc1 = T.alloc_buffer((H * V,), "float32", scope=scope)
            red = T.alloc_buffer((V,), "float32", scope=scope)
            acc = T.alloc_buffer((RB * V,), "float32", scope=scope)
            handle = T.alloc_buffer((V,), "int32", scope=scope)
            qo_len = qo_len_
            kv_len = kv_len_
            rows = T.if_then_else(tile_ >= 0, qo_len * G, 0)
            p0 = T.max(tile_, 0) * BQ
            free_end = dims.unmasked_end(kv_len, qo_len, p0, causal_)
            kv_end = T.if_then_else(tile_ >= 0, dims.visible_end(kv_len, qo_len, p0 + BQ - 1, causal_), 0)
            scale = sm_scale_ * T.float32(LOG2E)
            for p in T.serial(BQ):
                m_loc[p] = T.float32(EMPTY_LSE)
                l_loc[p] = T.float32(0)
                for c in T.serial(D_V // V):
                    o_loc[T.ramp(p * D_V + c * V, 1, V)] = T.broadcast(T.float32(0), V)
                if p0 + p < rows:
                    for c in T.serial(D_QK // V):
                        q_loc[T.ramp(p * D_QK + c * V, 1, V)] = f32(q_at_(p0 + p, T.ramp(c * V, 1, V))) * \
                            T.broadcast(scale, V)
                else:
                    for c in T.serial(D_QK // V):
                        q_loc[T.ramp(p * D_QK + c * V, 1, V)] = T.broadcast(T.float32(0), V)
            for t in T.serial((kv_end + V - 1) // V):
                for r in T.unroll(V):
                    handle[r] = kv_row_(T.min(t * V + r, kv_end - 1))
                if SR == 2:
                    for pp in T.serial(BQ // 2):
                        ops.pair_scores(q_loc, 2 * pp, k_at_, handle, acc0, acc1, part0, part1)
                        reduce_rows(part0)
                        s_loc[T.ramp(2 * pp * V, 1, V)] = vec(part0, 0)
                        reduce_rows(part1)
                        s_loc[T.ramp((2 * pp + 1) * V, 1, V)] = vec(part1, 0)
                else:
                    for p in T.serial(BQ):
                        ops.row_scores(q_loc, p, k_at_, handle, part0)
                        reduce_rows(part0)
                        s_loc[T.ramp(p * V, 1, V)] = vec(part0, 0)
                if (t + 1) * V > free_end:
                    for p in T.serial(BQ):
                        for r in T.serial(V):
                            if dims.hidden(t * V + r, kv_len, qo_len, p0 + p, causal_):
                                s_loc[p * V + r] = T.min_value("float32")
                for p in T.serial(BQ):
                    red[T.ramp(0, 1, V)] = vec(s_loc, p * V)
                    fold(red, T.max)
                    a_loc[p] = exp2_fine(m_loc[p] - T.max(m_loc[p], red[0]))
                    m_loc[p] = T.max(m_loc[p], red[0])
                    # a hidden score's probability is exactly 0 (exp2_fine stops at 2**-126)
                    for r in T.vectorized(V):
                        s_loc[p * V + r] = T.Select(s_loc[p * V + r] == T.min_value("float32"), T.float32(0),
                                                    exp2_fine(s_loc[p * V + r] - m_loc[p]))
                    red[T.ramp(0, 1, V)] = vec(s_loc, p * V)
                    fold(red, lambda a, b: a + b)
                    l_loc[p] = l_loc[p] * a_loc[p] + red[0]
                for c in T.serial(D_V // V):
                    for pb in T.serial(BQ // RB):
                        for i in T.unroll(RB):
                            acc[T.ramp(i * V, 1, V)] = vec(o_loc, (pb * RB + i) * D_V + c * V) * \
                                T.broadcast(a_loc[pb * RB + i], V)
                        for r in T.unroll(V):
                            for i in T.unroll(RB):
                                acc[T.ramp(i * V, 1, V)] = vec(acc, i * V) + T.broadcast(
                                    s_loc[(pb * RB + i) * V + r], V) * f32(v_at_(handle[r], T.ramp(c * V, 1, V)))
                        for i in T.unroll(RB):
                            o_loc[T.ramp((pb * RB + i) * D_V + c * V, 1, V)] = vec(acc, i * V)
            for p in T.serial(BQ):
                if p0 + p < rows:
                    red[0] = finalize_scale(l_loc[p])
                    for c in T.serial(D_V // V):
                        for e in T.vectorized(V):
                            write_o_(p0 + p, c * V + e, o_loc[p * D_V + c * V + e] * red[0])
                    write_lse_(p0 + p, finalize_lse(m_loc[p], l_loc[p]))

    return attend
