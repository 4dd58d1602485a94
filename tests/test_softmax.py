"""tir_kernels.softmax (the online-softmax state and LSE merge every kernel shares) on the CPU.

Small PrimFuncs built from the macros run against float64 numpy: an online softmax over
chunks (init / update / finalize) equals the one-shot softmax, and merging states (pairwise
`merge`, N-way `combine`) equals reference.merge_states; empty rows stay o = 0, EMPTY_LSE.
"""

import numpy as np
import pytest
import tvm
import reference as ref
from tvm.script import tirx as T

from tir_kernels import EMPTY_LSE
from tir_kernels.common import LoopKinds
from tir_kernels.softmax import finished_l, merged_lse, prob, softmax_macros

sm = softmax_macros(LoopKinds(gpu=False))
ROWS, KEYS, WIDTH, CHUNK = 6, 40, 8, 16


def compile_cpu(func):
    return tvm.compile(tvm.IRModule({"main": func}), target="llvm")["main"]


def nd(x):
    return tvm.runtime.tensor(np.ascontiguousarray(x), tvm.cpu())


@T.prim_func
def online_softmax(
    s: T.Buffer((ROWS, KEYS), "float32"),
    v: T.Buffer((KEYS, WIDTH), "float32"),
    n_keys: T.Buffer((ROWS,), "int32"),
    o: T.Buffer((ROWS, WIDTH), "float32"),
    lse: T.Buffer((ROWS,), "float32"),
):
    """Row r attends to its first n_keys[r] keys (base-2 scores s), CHUNK keys per update."""
    for r in T.serial(ROWS):
        m_st = T.alloc_buffer((1,), "float32", scope="local")
        l_st = T.alloc_buffer((1,), "float32", scope="local")
        o_st = T.alloc_buffer((WIDTH,), "float32", scope="local")
        m_new = T.alloc_buffer((1,), "float32", scope="local")
        sm.init(m_st, l_st, o_st, 1, WIDTH)
        for step in T.serial((n_keys[r] + CHUNK - 1) // CHUNK):
            m_new[0] = m_st[0]
            for j in T.serial(CHUNK):
                if step * CHUNK + j < n_keys[r]:
                    m_new[0] = T.max(m_new[0], s[r, step * CHUNK + j])
            sm.update(m_st, l_st, o_st, 0, WIDTH, m_new[0])
            for j in T.serial(CHUNK):
                if step * CHUNK + j < n_keys[r]:
                    l_st[0] = l_st[0] + prob(s[r, step * CHUNK + j], m_st[0])
                    for c in T.serial(WIDTH):
                        o_st[c] = o_st[c] + prob(s[r, step * CHUNK + j], m_st[0]) * v[step * CHUNK + j, c]
        sm.finalize(m_st, l_st, o_st, 0, WIDTH)
        for c in T.serial(WIDTH):
            o[r, c] = o_st[c]
        lse[r] = m_st[0]


@T.prim_func
def merge_pair(
    o: T.Buffer((ROWS, WIDTH), "float16"),
    lse: T.Buffer((ROWS,), "float32"),
    o_other: T.Buffer((ROWS, WIDTH), "float16"),
    lse_other: T.Buffer((ROWS,), "float32"),
    lse_expr: T.Buffer((ROWS,), "float32"),
):
    """In place, as merge_state; lse_expr <- the scalar merged_lse of the same pair."""
    for r in T.serial(ROWS):
        w = T.alloc_buffer((4,), "float32", scope="local")
        a = T.alloc_buffer((WIDTH,), "float16", scope="local")
        b = T.alloc_buffer((WIDTH,), "float16", scope="local")
        for c in T.serial(WIDTH):
            a[c] = o[r, c]
            b[c] = o_other[r, c]
        lse_expr[r] = merged_lse(lse[r], lse_other[r])
        sm.merge(a, b, WIDTH, lse[r], lse_other[r], w)
        for c in T.serial(WIDTH):
            o[r, c] = a[c]
        lse[r] = w[2]


@T.prim_func
def combine_finished(
    o_parts: T.Buffer((3, ROWS, WIDTH), "float32"),
    lse_parts: T.Buffer((3, ROWS), "float32"),
    o: T.Buffer((ROWS, WIDTH), "float32"),
    lse: T.Buffer((ROWS,), "float32"),
):
    """N-way merge of finished states (o, lse), as paged_decode merges its splits."""
    for r, c in T.grid(ROWS, WIDTH):
        m_st = T.alloc_buffer((1,), "float32", scope="local")
        l_st = T.alloc_buffer((1,), "float32", scope="local")
        acc = T.alloc_buffer((1,), "float32", scope="local")
        sm.combine(3, lambda y: lse_parts[y, r], lambda y: finished_l(lse_parts[y, r]),
                   lambda y: o_parts[y, r, c] * finished_l(lse_parts[y, r]), m_st, l_st, acc)
        sm.finalize(m_st, l_st, acc, 0, 1)
        o[r, c] = acc[0]
        if c == 0:
            lse[r] = m_st[0]


def softmax_reference(s, v, n_keys):
    o = np.zeros((ROWS, WIDTH))
    lse = np.full(ROWS, EMPTY_LSE)
    for r, n in enumerate(n_keys):
        if n:
            x = s[r, :n].astype(np.float64)
            lse[r] = np.log2(np.exp2(x).sum())
            o[r] = np.exp2(x - lse[r]) @ v[:n].astype(np.float64)
    return o, lse


def test_online_softmax_matches_one_shot():
    """Chunked init / update / finalize = softmax in one go; an empty row is o = 0, EMPTY_LSE."""
    rng = np.random.default_rng(0)
    s = rng.uniform(-30, 30, (ROWS, KEYS)).astype(np.float32)
    s[3, :CHUNK] -= 200  # the running max rises sharply in the second chunk
    v = rng.standard_normal((KEYS, WIDTH)).astype(np.float32)
    n_keys = np.array([KEYS, 1, 0, KEYS, CHUNK, CHUNK + 3], np.int32)
    o, lse = nd(np.full((ROWS, WIDTH), np.nan, np.float32)), nd(np.full(ROWS, np.nan, np.float32))
    compile_cpu(online_softmax)(nd(s), nd(v), nd(n_keys), o, lse)
    exp_o, exp_lse = softmax_reference(s, v, n_keys)
    np.testing.assert_allclose(o.numpy(), exp_o, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse.numpy(), exp_lse, rtol=1e-6, atol=1e-4)
    assert lse.numpy()[2] == np.float32(EMPTY_LSE) and (o.numpy()[2] == 0).all()


def test_merge_pair():
    """merge = reference.merge_states; two empty states merge to a finite LSE and o = 0."""
    rng = np.random.default_rng(1)
    o1 = rng.standard_normal((ROWS, WIDTH)).astype(np.float16)
    o2 = rng.standard_normal((ROWS, WIDTH)).astype(np.float16)
    lse1 = rng.uniform(-8, 20, ROWS).astype(np.float32)
    lse2 = rng.uniform(-8, 20, ROWS).astype(np.float32)
    lse1[1] = EMPTY_LSE  # empty on one side
    lse1[2] = lse2[2] = EMPTY_LSE  # empty on both
    o1[[1, 2]] = 0
    o2[2] = 0
    lse2[3] = lse1[3]  # equal weights
    exp_o, exp_lse = ref.merge_states(o1, lse1, o2, lse2)
    o, lse, lse_expr = nd(o1), nd(lse1), nd(np.zeros(ROWS, np.float32))
    compile_cpu(merge_pair)(o, lse, nd(o2), nd(lse2), lse_expr)
    assert np.isfinite(lse.numpy()).all()
    np.testing.assert_allclose(o.numpy().astype(np.float64), exp_o, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(lse.numpy(), exp_lse, rtol=1e-6, atol=1e-4)
    np.testing.assert_array_equal(lse_expr.numpy(), lse.numpy())
    assert (o.numpy()[2] == 0).all()


@pytest.mark.parametrize("empty", [(), (1,), (0, 1, 2)], ids=["none", "one", "all"])
def test_combine_finished_states(empty):
    """combine of finished states skips empty ones; all empty gives o = 0 and EMPTY_LSE."""
    rng = np.random.default_rng(2)
    o_parts = rng.standard_normal((3, ROWS, WIDTH)).astype(np.float32)
    lse_parts = rng.uniform(-8, 20, (3, ROWS)).astype(np.float32)
    for y in empty:
        o_parts[y], lse_parts[y] = 0, EMPTY_LSE
    o, lse = nd(np.full((ROWS, WIDTH), np.nan, np.float32)), nd(np.full(ROWS, np.nan, np.float32))
    compile_cpu(combine_finished)(nd(o_parts), nd(lse_parts), o, lse)
    live = [y for y in range(3) if y not in empty]
    if not live:
        np.testing.assert_array_equal(o.numpy(), 0)
        np.testing.assert_array_equal(lse.numpy(), np.float32(EMPTY_LSE))
        return
    exp_o, exp_lse = o_parts[live[0]].astype(np.float64), lse_parts[live[0]].astype(np.float64)
    for y in live[1:]:
        exp_o, exp_lse = ref.merge_states(exp_o, exp_lse, o_parts[y], lse_parts[y])
    np.testing.assert_allclose(o.numpy(), exp_o, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse.numpy(), exp_lse, rtol=1e-6, atol=1e-4)
