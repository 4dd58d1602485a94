"""cpu_elementwise (tvmattn/models/cpu_elementwise.py): the CPU's SiLU legalization and the
elementwise schedule rule.

Spec: fast_sigmoid matches the float64 sigmoid over the float32 range; the model's
`silu(gate) * up` (split, SiLU, multiply, fused as the CPU pipeline fuses it) is scheduled by
CPUElementwise for a static decode row and a symbolic prefill length, compiles for llvm without
libm's expf, runs in parallel chunks only when large, keeps a long last axis as the whole inner
loop (no per-element division by the row length) and short ones fused, and equals float64 numpy; float16 SiLU
keeps TVM's legalization; a function with a reduction is left to the other rules (None).
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import te
from tvm.relax.backend.cpu_generic import pipeline as cpu_backend
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

import tir_kernels.build  # noqa: F401  - registers the "tvmattn" TIR pipeline
from tvmattn.compiler.cpu_elementwise import (MIN_ROW, PARALLEL_CHUNK, PARALLEL_MIN_ELEMENTS, CPUElementwise, cpu_legalize,
                                               fast_sigmoid)

TARGET = tvm.target.Target("llvm")


def silu_np(x):
    x = x.astype(np.float64)
    return x / (1.0 + np.exp(-x))


def test_fast_sigmoid_matches_float64():
    xs = np.concatenate([np.linspace(-100, 100, 4001), [0.0, 1e-8, -1e-8, 87.0, -87.0, 88.7, -88.7]]).astype(np.float32)
    x = te.placeholder((len(xs),), "float32", "x")
    y = te.compute(x.shape, lambda i: fast_sigmoid(x[i]), name="y")
    lib = tvm.compile(te.create_prim_func([x, y]), target=TARGET)
    out = tvm.runtime.empty((len(xs),), "float32")
    lib["main"](tvm.runtime.tensor(xs), out)
    expected = 1.0 / (1.0 + np.exp(-xs.astype(np.float64)))
    # relative: the polynomial (1e-7) and the rounding of x log2(e) (|x| 2**-24 ln 2: 1.2e-6 at 20);
    # beyond, values under 2e-9 whose absolute error is what a sum ever sees (2**-126 below -87)
    near = np.abs(xs) <= 20
    np.testing.assert_allclose(out.numpy()[near], expected[near], rtol=2e-6, atol=0)
    np.testing.assert_allclose(out.numpy(), expected, rtol=0, atol=1e-7)


class _SwiGLU(nn.Module):
    def forward(self, x: nn.Tensor):
        gate, up = op.split(x, 2, axis=-1)
        return op.silu(gate) * up


def _fused_swiglu(rows, width: int, dtype: str) -> tvm.tirx.PrimFunc:
    """The fused PrimFunc of silu(x[:, :width]) * x[:, width:] for x [rows, 2 * width], legalized
    and fused as the model pipeline does on the CPU (cpu_legalize first)."""
    mod, _ = _SwiGLU().export_tvm(spec={"forward": {"x": nn.spec.Tensor([rows, 2 * width], dtype)}})
    with TARGET:
        mod = tvm.transform.Sequential([cpu_legalize(), *cpu_backend.legalize_passes(TARGET)])(mod)
    (func,) = [f for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    return func


@pytest.mark.parametrize("rows,width", [(1, 1536), ("seq_len", 96)], ids=["decode-1536", "prefill-symbolic"])
def test_swiglu_scheduled_vectorizable_and_exact(rows, width):
    func = _fused_swiglu(rows, width, "float32")
    assert "sigmoid" not in func.script()  # the polynomial, not T.sigmoid (a libm expf per element)
    with TARGET:
        sch = CPUElementwise().apply(func, TARGET, False)
    assert sch is not None
    script = sch.mod["main"].script()
    assert ("T.parallel" in script) == (rows != 1), "parallel chunks only when large or symbolic"
    lib = tvm.compile(tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")}), target=TARGET,
                      tir_pipeline="tvmattn")
    rng = np.random.default_rng(3)
    for n in ([1] if rows == 1 else [1, 5, PARALLEL_MIN_ELEMENTS // width + 3]):
        x = (rng.standard_normal((n, 2 * width)) * 6).astype(np.float32)
        out = tvm.runtime.empty((n, width), "float32")
        lib["main"](tvm.runtime.tensor(x), out)
        expected = silu_np(x[:, :width]) * x[:, width:]
        np.testing.assert_allclose(out.numpy(), expected, rtol=2e-6, atol=1e-6, err_msg=f"{n} rows")


@pytest.mark.parametrize("width", [MIN_ROW // 2, MIN_ROW, 96])
def test_rows_stay_whole_inner_loops(width):
    """A prefill's rows (a symbolic count): a last axis of MIN_ROW elements or more is the inner
    loop, whole (its extent, contiguous indices LLVM vectorizes), the rows in parallel tasks; a
    shorter one is fused with the rows into one flat loop (indices by division)."""
    func = _fused_swiglu("seq_len", width, "float32")
    with TARGET:
        sch = CPUElementwise().apply(func, TARGET, False)
    script = sch.mod["main"].script()
    flat = f"% T.int64({width})" in script
    assert flat == (width < MIN_ROW)
    inner = f"in range(T.int64({width}))" in script or f"T.grid(T.int64({PARALLEL_CHUNK // width}), T.int64({width}))" in script
    assert inner == (width >= MIN_ROW)
    assert "T.parallel" in script


def test_float16_silu_keeps_tvm_legalization():
    func = _fused_swiglu(1, 64, "float16")
    assert "sigmoid" in func.script()
    with TARGET:
        sch = CPUElementwise().apply(func, TARGET, False)
    lib = tvm.compile(tvm.IRModule({"main": (sch.mod["main"] if sch else func).with_attr("global_symbol", "main")}),
                      target=TARGET)
    x = np.random.default_rng(4).standard_normal((1, 128)).astype(np.float16)
    out = tvm.runtime.empty((1, 64), "float16")
    lib["main"](tvm.runtime.tensor(x), out)
    np.testing.assert_allclose(out.numpy().astype(np.float64), silu_np(x[:, :64]) * x[:, 64:].astype(np.float64),
                               rtol=2e-2, atol=2e-3)


def test_reduction_left_to_other_rules():
    x = te.placeholder((4, 32), "float32", "x")
    k = te.reduce_axis((0, 32), "k")
    y = te.compute((4,), lambda i: te.sum(x[i, k], axis=k), name="y")
    with TARGET:
        assert CPUElementwise().apply(te.create_prim_func([x, y]), TARGET, False) is None
