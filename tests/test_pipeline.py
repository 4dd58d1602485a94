"""The model pipeline's CUDA schedule for small-batch matmuls (models/pipeline.SmallBatchMatmul).

Spec: `[batch_size, 1, K] x [N, K]^T` with a symbolic batch (decode_step's projections, with or
without an element-wise epilogue) is scheduled by the rule and compiles for CUDA; on the GPU it
equals numpy for batches that are and are not multiples of its row chunk; prefill-shaped matmuls,
K that is not a whole number of 16-byte vectors and weights over the cap are left to the next
rule (None).
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import te

from tvmattn.compiler.pipeline import SMALL_BATCH_THREADS, SmallBatchMatmul

CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})


def nt_matmul(n: int, k: int, epilogue: str | None = None, dtype: str = "float16", out_dtype: str = "float16",
              seq: bool = False) -> tvm.tirx.PrimFunc:
    """decode_step's legalized projection: x [batch_size, 1, k] times w [n, k]^T, then `epilogue`
    ("add": + a residual [batch_size, 1, n]; "cast": to out_dtype); seq: x is [1, seq_len, k]
    instead (a prefill)."""
    var = tvm.tirx.Var("seq_len" if seq else "batch_size", "int64")
    x_shape, o_shape = ((1, var, k), (1, var, n)) if seq else ((var, 1, k), (var, 1, n))
    x = te.placeholder(x_shape, dtype, "x")
    w = te.placeholder((n, k), dtype, "w")
    r = te.reduce_axis((0, k), "k")
    mm = te.compute(o_shape, lambda a, b, c: te.sum(x[a, b, r] * w[c, r], axis=r), name="NT_matmul")
    args = [x, w]
    if epilogue == "add":
        res = te.placeholder(o_shape, dtype, "res")
        result = te.compute(o_shape, lambda a, b, c: res[a, b, c] + mm[a, b, c], name="T_add")
        args.append(res)
    elif epilogue == "cast":
        result = te.compute(o_shape, lambda a, b, c: mm[a, b, c].astype(out_dtype), name="T_cast")
    else:
        result = mm
    return te.create_prim_func(args + [result]).with_attr("global_symbol", "main")


CASES = [
    pytest.param(960, 576, None, id="qkv-576"),
    pytest.param(576, 1536, "add", id="down-1536-add"),
    pytest.param(640, 64, "cast", id="head-64-cast"),
]


@pytest.mark.parametrize("n, k, epilogue", CASES)
def test_rule_schedules_decode_projections_for_cuda(n, k, epilogue):
    func = nt_matmul(n, k, epilogue)
    with CUDA:
        sch = SmallBatchMatmul().apply(func, CUDA, False)
        assert sch is not None
        lib = tvm.compile(tvm.IRModule({"main": sch.mod["main"]}), target=CUDA)
    source = lib.mod.imports[0].inspect_source()
    assert f"__launch_bounds__({SMALL_BATCH_THREADS})" in source and "__shfl" in source


def test_rule_leaves_other_shapes_to_the_next_rule():
    rule = SmallBatchMatmul()
    assert rule.apply(nt_matmul(64, 576, seq=True), CUDA, False) is None  # a prefill
    assert rule.apply(nt_matmul(64, 60), CUDA, False) is None  # K not a multiple of 8 halves
    assert rule.apply(nt_matmul(64, 576), tvm.target.Target("llvm"), False) is None
    # a weight over the cap (an LM head): re-read per block of rows, it keeps dlight's Matmul
    capped = SmallBatchMatmul(max_weight_bytes=64 * 576 * 2 - 1)
    assert capped.apply(nt_matmul(64, 576), CUDA, False) is None
    assert SmallBatchMatmul(max_weight_bytes=64 * 576 * 2).apply(nt_matmul(64, 576), CUDA, False) is not None


@pytest.mark.gpu
@pytest.mark.parametrize("n, k, epilogue", CASES)
@pytest.mark.parametrize("batch", [1, 3, 8, 17, 64])
def test_rule_matches_numpy_on_the_gpu(n, k, epilogue, batch):
    func = nt_matmul(n, k, epilogue, out_dtype="float32")
    with CUDA:
        sch = SmallBatchMatmul().apply(func, CUDA, False)
        lib = tvm.compile(tvm.IRModule({"main": sch.mod["main"]}), target=CUDA)
    rng = np.random.default_rng(batch)
    x = (rng.standard_normal((batch, 1, k)) * 0.5).astype("float16")
    w = (rng.standard_normal((n, k)) * 0.5).astype("float16")
    expected = x.astype(np.float32) @ w.astype(np.float32).T
    dev = tvm.cuda(0)
    ins = [tvm.runtime.tensor(x, dev), tvm.runtime.tensor(w, dev)]
    if epilogue == "add":
        res = (rng.standard_normal((batch, 1, n)) * 0.5).astype("float16")
        ins.append(tvm.runtime.tensor(res, dev))
        expected = expected + res.astype(np.float32)
    out_dtype = "float32" if epilogue == "cast" else "float16"
    out = tvm.runtime.tensor(np.zeros((batch, 1, n), out_dtype), dev)
    lib["main"](*ins, out)
    got = out.numpy().astype(np.float32)
    # fp16 sums (as the unscheduled function): about 1e-3 relative per product over k terms
    scale = np.abs(expected).max()
    assert np.abs(got - expected).max() <= 2e-2 * scale
