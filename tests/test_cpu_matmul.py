"""CPUMatmul (tvmattn/models/cpu_matmul.py): the llvm schedule of multi-token NT_matmul functions.

Small shapes (fast on 2 cores): the scheduled function, compiled for llvm, matches numpy for a
symbolic token count n in {1, 3, 8, 17, 64}, with and without a fused epilogue; functions that
are not such a matmul (or a single static token, or float16) are left unscheduled.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm.script import tirx as T

import tir_kernels.build  # noqa: F401  - registers the "tvmattn" TIR pipeline
from tvmattn.compiler.cpu_matmul import CPUMatmul

TARGET = tvm.target.Target("llvm")
TOKENS = (1, 3, 8, 17, 64)


@T.prim_func(private=True, s_tir=True)
def nt_matmul(var_x: T.handle, w: T.Buffer((T.int64(96), T.int64(40)), "float32"), var_out: T.handle):
    T.func_attr({"op_pattern": 4, "tirx.noalias": True})
    n = T.int64()
    x = T.match_buffer(var_x, (T.int64(1), n, T.int64(40)))
    out = T.match_buffer(var_out, (T.int64(1), n, T.int64(96)))
    for i0, i1, i2, k in T.grid(T.int64(1), n, T.int64(96), T.int64(40)):
        with T.sblock("NT_matmul"):
            v0, v1, v2, vk = T.axis.remap("SSSR", [i0, i1, i2, k])
            with T.init():
                out[v0, v1, v2] = T.float32(0.0)
            out[v0, v1, v2] = out[v0, v1, v2] + x[v0, v1, vk] * w[v2, vk]


@T.prim_func(private=True, s_tir=True)
def nt_matmul_add(var_x: T.handle, w: T.Buffer((T.int64(60), T.int64(64)), "float32"), var_r: T.handle,
                  var_out: T.handle):
    """(batch, 1, K) layout (batch_decode's) with a residual add; N = 60 (not a multiple of 8)."""
    T.func_attr({"tirx.noalias": True})
    b = T.int64()
    x = T.match_buffer(var_x, (b, T.int64(1), T.int64(64)))
    r = T.match_buffer(var_r, (b, T.int64(1), T.int64(60)))
    out = T.match_buffer(var_out, (b, T.int64(1), T.int64(60)))
    mm = T.sblock_alloc_buffer((b, T.int64(1), T.int64(60)))
    for i0, i1, i2, k in T.grid(b, T.int64(1), T.int64(60), T.int64(64)):
        with T.sblock("NT_matmul"):
            v0, v1, v2, vk = T.axis.remap("SSSR", [i0, i1, i2, k])
            with T.init():
                mm[v0, v1, v2] = T.float32(0.0)
            mm[v0, v1, v2] = mm[v0, v1, v2] + x[v0, v1, vk] * w[v2, vk]
    for i0, i1, i2 in T.grid(b, T.int64(1), T.int64(60)):
        with T.sblock("T_add"):
            v0, v1, v2 = T.axis.remap("SSS", [i0, i1, i2])
            out[v0, v1, v2] = r[v0, v1, v2] + mm[v0, v1, v2]


@T.prim_func(private=True, s_tir=True)
def single_token(x: T.Buffer((T.int64(1), T.int64(1), T.int64(40)), "float32"),
                 w: T.Buffer((T.int64(96), T.int64(40)), "float32"),
                 out: T.Buffer((T.int64(1), T.int64(1), T.int64(96)), "float32")):
    for i0, i1, i2, k in T.grid(T.int64(1), T.int64(1), T.int64(96), T.int64(40)):
        with T.sblock("NT_matmul"):
            v0, v1, v2, vk = T.axis.remap("SSSR", [i0, i1, i2, k])
            with T.init():
                out[v0, v1, v2] = T.float32(0.0)
            out[v0, v1, v2] = out[v0, v1, v2] + x[v0, v1, vk] * w[v2, vk]


@T.prim_func(private=True, s_tir=True)
def nt_matmul_fp16(var_x: T.handle, w: T.Buffer((T.int64(96), T.int64(40)), "float16"), var_out: T.handle):
    n = T.int64()
    x = T.match_buffer(var_x, (T.int64(1), n, T.int64(40)), "float16")
    out = T.match_buffer(var_out, (T.int64(1), n, T.int64(96)), "float16")
    for i0, i1, i2, k in T.grid(T.int64(1), n, T.int64(96), T.int64(40)):
        with T.sblock("NT_matmul"):
            v0, v1, v2, vk = T.axis.remap("SSSR", [i0, i1, i2, k])
            with T.init():
                out[v0, v1, v2] = T.float16(0.0)
            out[v0, v1, v2] = out[v0, v1, v2] + x[v0, v1, vk] * w[v2, vk]


@T.prim_func(private=True, s_tir=True)
def row_sum(var_x: T.handle, var_out: T.handle):
    """A reduction that is no matmul (one input)."""
    n = T.int64()
    x = T.match_buffer(var_x, (n, T.int64(40)))
    out = T.match_buffer(var_out, (n,))
    for i, k in T.grid(n, T.int64(40)):
        with T.sblock("sum"):
            vi, vk = T.axis.remap("SR", [i, k])
            with T.init():
                out[vi] = T.float32(0.0)
            out[vi] = out[vi] + x[vi, vk] * x[vi, vk]


@T.prim_func(private=True, s_tir=True)
def add(var_x: T.handle, var_out: T.handle):
    n = T.int64()
    x = T.match_buffer(var_x, (n, T.int64(40)))
    out = T.match_buffer(var_out, (n, T.int64(40)))
    for i, j in T.grid(n, T.int64(40)):
        with T.sblock("add"):
            vi, vj = T.axis.remap("SS", [i, j])
            out[vi, vj] = x[vi, vj] + T.float32(1.0)


def _build(func):
    sch = CPUMatmul().apply(func, TARGET, False)
    assert sch is not None, "CPUMatmul left an NT_matmul unscheduled"
    scheduled = sch.mod["main"].with_attr("global_symbol", "main")
    with TARGET:
        return tvm.compile(tvm.IRModule({"main": scheduled}), target=TARGET, tir_pipeline="tvmattn")["main"]


def _run(fn, *arrays):
    dev = tvm.cpu()
    args = [tvm.runtime.tensor(a, dev) for a in arrays]
    fn(*args)
    return args[-1].numpy()


def test_nt_matmul_matches_numpy():
    fn = _build(nt_matmul)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((96, 40)).astype("float32")
    for n in TOKENS:
        x = rng.standard_normal((1, n, 40)).astype("float32")
        got = _run(fn, x, w, np.zeros((1, n, 96), "float32"))
        np.testing.assert_allclose(got, x @ w.T, rtol=1e-5, atol=1e-4, err_msg=f"n={n}")


def test_nt_matmul_epilogue_matches_numpy():
    fn = _build(nt_matmul_add)
    rng = np.random.default_rng(1)
    w = rng.standard_normal((60, 64)).astype("float32")
    for n in TOKENS:
        x = rng.standard_normal((n, 1, 64)).astype("float32")
        r = rng.standard_normal((n, 1, 60)).astype("float32")
        got = _run(fn, x, w, r, np.zeros((n, 1, 60), "float32"))
        np.testing.assert_allclose(got, r + x @ w.T, rtol=1e-5, atol=1e-4, err_msg=f"n={n}")


def test_schedule_shape():
    """Parallel over column chunks, vectorized k lanes, the epilogue inside the output tile."""
    script = CPUMatmul().apply(nt_matmul_add, TARGET, False).mod["main"].script()
    assert "T.parallel" in script and "T.vectorized" in script and "T.unroll" in script
    assert 'scope="local"' in script


@pytest.mark.parametrize("func", [single_token, nt_matmul_fp16, row_sum, add],
                         ids=["single-token", "float16", "row-sum", "elementwise"])
def test_other_functions_left_alone(func):
    assert CPUMatmul().apply(func, TARGET, False) is None


def test_not_for_cuda():
    assert CPUMatmul().apply(nt_matmul, tvm.target.Target("cuda"), False) is None
