"""cpu_norm.CPURowNorm (tvmattn/compiler/cpu_norm.py): the prompt's row reductions on the CPU.

Spec: an RMSNorm over a symbolic number of rows (a prompt's [1, n, hidden], and the per-head
q / k norm [1, n, heads, head_dim]), legalized and fused as the CPU pipeline does, is scheduled
with its sum in vector lanes and its rows in parallel tasks, and equals float64 numpy for 1 to
many rows; a function with a second output (the residual add kept beside the norm) or a row
shorter than the lanes is left to the other rules (None).
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax, te
from tvm.relax.backend.cpu_generic import pipeline as cpu_backend
from tvm.relax.frontend import nn

import tir_kernels.build  # noqa: F401  - registers the "tvmattn" TIR pipeline
from tvmattn.compiler.cpu_elementwise import cpu_legalize
from tvmattn.compiler.cpu_norm import ROW_LANES, CPURowNorm

TARGET = tvm.target.Target("llvm")
EPS = 1e-6


class _Norm(nn.Module):
    def __init__(self, width: int):
        self.norm = nn.RMSNorm(width, -1, EPS, bias=False)

    def forward(self, x: nn.Tensor):
        return self.norm(x)


class _NormAdd(nn.Module):
    """A sandwich norm's residual add: r + norm(x), one output."""

    def __init__(self, width: int):
        self.norm = nn.RMSNorm(width, -1, EPS, bias=False)

    def forward(self, x: nn.Tensor, r: nn.Tensor):
        return r + self.norm(x)


def _add_and_norm_kept() -> tvm.tirx.PrimFunc:
    """h = x + r and h's norm (no weight), both outputs of one function."""
    n = te.var("n", "int64")
    x, r = te.placeholder((n, 640), "float32", "x"), te.placeholder((n, 640), "float32", "r")
    h = te.compute((n, 640), lambda i, j: x[i, j] + r[i, j], name="h")
    k = te.reduce_axis((0, 640), "k")
    sq = te.compute((n,), lambda i: te.sum(h[i, k] * h[i, k], axis=k), name="sq")
    out = te.compute((n, 640), lambda i, j: h[i, j] * te.rsqrt(sq[i] / 640.0 + EPS), name="out")
    return te.create_prim_func([x, r, h, out])


def _fused(module: nn.Module, shapes: dict) -> tvm.tirx.PrimFunc:
    """The one fused PrimFunc of module's forward, legalized and fused as the CPU pipeline does."""
    spec = {name: nn.spec.Tensor(shape, "float32") for name, shape in shapes.items()}
    mod, _ = module.export_tvm(spec={"forward": spec})
    with TARGET:
        mod = tvm.transform.Sequential([cpu_legalize(), *cpu_backend.legalize_passes(TARGET),
                                        relax.transform.AnnotateTIROpPattern(), relax.transform.FuseOps(),
                                        relax.transform.FuseTIR()])(mod)
    (func,) = [f for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    return func


def rms_norm_np(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + EPS) * weight


@pytest.mark.parametrize("shape", [(1, "n", 640), (1, "n", 4, 256)], ids=["hidden-640", "per-head-4x256"])
def test_row_norm_is_vectorized_parallel_and_exact(shape):
    width = shape[-1]
    func = _fused(_Norm(width), {"x": list(shape)})
    with TARGET:
        sch = CPURowNorm().apply(func, TARGET, False)
    assert sch is not None
    script = sch.mod["main"].script()
    assert "T.parallel" in script and f"T.vectorized(T.int64({ROW_LANES}))" in script
    lib = tvm.compile(tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")}), target=TARGET,
                      tir_pipeline="tvmattn")
    rng = np.random.default_rng(5)
    weight = rng.uniform(0.5, 1.5, width).astype(np.float32)
    for rows in (1, 7, 300):
        x = (rng.standard_normal((1, rows, *shape[2:])) * 3).astype(np.float32)
        out = tvm.runtime.empty(x.shape, "float32")
        lib["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(weight), out)
        np.testing.assert_allclose(out.numpy(), rms_norm_np(x, weight), rtol=1e-5, atol=1e-6, err_msg=f"{rows} rows")


def test_norm_then_residual_add():
    func = _fused(_NormAdd(640), {"x": [1, "n", 640], "r": [1, "n", 640]})
    with TARGET:
        sch = CPURowNorm().apply(func, TARGET, False)
    lib = tvm.compile(tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")}), target=TARGET,
                      tir_pipeline="tvmattn")
    rng = np.random.default_rng(6)
    x, r = (rng.standard_normal((2, 1, 33, 640)) * 2).astype(np.float32)
    weight = rng.uniform(0.5, 1.5, 640).astype(np.float32)
    out = tvm.runtime.empty(x.shape, "float32")
    args = {"x": x, "r": r, "norm.weight": weight}
    lib["main"](*[tvm.runtime.tensor(args[p.name]) for p in func.params[:-1]], out)
    np.testing.assert_allclose(out.numpy(), r + rms_norm_np(x, weight), rtol=1e-5, atol=1e-5)


def test_second_output_and_short_rows_are_left_to_other_rules():
    with TARGET:
        assert CPURowNorm().apply(_add_and_norm_kept(), TARGET, False) is None
        assert CPURowNorm().apply(_fused(_Norm(ROW_LANES // 2), {"x": [1, "n", ROW_LANES // 2]}), TARGET, False) is None
