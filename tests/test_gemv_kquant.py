"""The CUDA GEMV of tvmattn/quant/gemv_cuda.py for Gemma 3's K-quant blocks (Q4_K, Q6_K).

Against a float64 reference: gguf's own dequantizer of random GGUF blocks (test_quant_matmul's
`quantized`), the product in float64. On the CPU: the kernel's arithmetic (the unpacking of the
nibbles, high bits and scales, the groups' sums) with its thread loops run serially (one lane,
one row: no warp shuffle), and the CUDA source built for sm_90 (16-byte loads of quants and X,
the lanes' sums by shuffles). On a GPU (marked gpu): one token, a decode batch, static tokens,
the residual and the prologues, float16 and float32, at Gemma 3's shapes too.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from test_quant_matmul import check_cuda, prologue_reference, quantized, run_cuda, run_matmul

from tvmattn.compiler.targets import cuda_target
from tvmattn.quant import gemv_cuda
from tvmattn.quant.config import QuantMatmulConfig
from tvmattn.quant.gemv_cuda import UNITS, CUDAGemvSchedule, choose_gemv_schedule, gemv_kernel
from tvmattn.quant.matmul import kernel, uses_cuda_gemv

K_QUANTS = tuple(UNITS)


@pytest.mark.parametrize("fmt", K_QUANTS)
@pytest.mark.parametrize("rows,cols,tokens,rows_per_thread", [(19, 256, 1, 1), (19, 256, 2, 2),
                                                                pytest.param(37, 768, 3, 1, marks=pytest.mark.slow)])
def test_kquant_gemv_arithmetic_on_the_cpu(monkeypatch, fmt, rows, cols, tokens, rows_per_thread):
    """The GEMV's own arithmetic, its thread loops serial on the CPU, against float64 gguf
    dequantize-then-matmul (float32 sums: within 1e-5 of the magnitudes' product)."""
    from tvm.script import tirx as T

    monkeypatch.setattr(T, "thread_binding", lambda extent, thread=None: T.serial(extent))
    monkeypatch.setattr(gemv_cuda, "magic_byte", gemv_cuda.magic_byte_by_shifts)  # PRMT is CUDA's
    plan = CUDAGemvSchedule(lanes=1, rows=1, token_tile=tokens, rows_per_thread=rows_per_thread)
    func = gemv_kernel(fmt, rows, cols, tokens, "float32", plan)
    lib = tvm.compile(func, target="llvm")
    blocks, w = quantized(fmt, rows, cols, seed=rows + cols)
    x = np.random.default_rng(tokens).standard_normal((tokens, cols)).astype(np.float32)
    config = QuantMatmulConfig(fmt, rows, cols, tokens=tokens)
    got = run_matmul(lib, config, blocks, x)
    want = x.astype(np.float64) @ w.astype(np.float64).T
    scale = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T
    assert (np.abs(got - want) <= 1e-5 * scale + 1e-6).all(), np.abs(got - want).max()


def test_kquant_gemv_routing_and_schedule():
    """One token and a decode batch take the GEMV; a lane's share is whole units (Q4_K: 64
    weights, Q6_K: 128), so the lanes cover the units of a row."""
    for fmt in K_QUANTS:
        config = QuantMatmulConfig(fmt, 640, 1024, tokens=1, target="cuda", dtype="float16")
        assert uses_cuda_gemv(config)
        assert uses_cuda_gemv(QuantMatmulConfig(fmt, 640, 2048, few_tokens=True, target="cuda", dtype="float16"))
        assert not uses_cuda_gemv(QuantMatmulConfig(fmt, 640, 2048, target="cuda", dtype="float16"))
    assert choose_gemv_schedule(640, 1024, 1, fmt="Q4_K").lanes == 16
    assert choose_gemv_schedule(640, 1024, 1, fmt="Q6_K").lanes == 8
    assert choose_gemv_schedule(640, 1024, 1).lanes == 32  # 32-weight blocks
    with pytest.raises(ValueError, match="k=640: expected whole blocks of 256"):
        gemv_kernel("Q4_K", 64, 640, 1, "float16", CUDAGemvSchedule())


@pytest.mark.parametrize("fmt", K_QUANTS)
def test_kquant_gemv_source_builds_for_sm90(fmt):
    """The CUDA source (no GPU needed): quants and X in 16-byte loads (Q6_K's high bits too),
    the lanes' sums by warp shuffles, 64 threads a block; built for sm_90."""
    if tvm.get_global_func("target.build.cuda", allow_missing=True) is None:
        pytest.skip("TVM built without CUDA codegen")
    config = QuantMatmulConfig(fmt, 640, 1024, tokens=1, target="cuda", dtype="float16", residual=True)
    source = tvm.compile(kernel(config), target=cuda_target()).mod.imports[0].inspect_source()
    assert "*(uint4*)(qw_ptr" in source and "*(uint4*)(x_ptr" in source
    assert ("*(uint4*)(qhw_ptr" in source) == (fmt == "Q6_K")
    assert "__shfl_xor_sync" in source and "__launch_bounds__(64)" in source


# (fmt, rows, cols): test_quant_matmul's K-quant shapes and Gemma 3 270M's (o_proj 640 x 1024, down 640 x 2048)
GPU_CASES = [(fmt, rows, cols) for fmt in K_QUANTS for rows, cols in ((37, 768), (19, 256), (640, 1024), (640, 2048))]


@pytest.fixture(scope="module")
def built():
    cache = {}

    def get(config):
        if config not in cache:
            cache[config] = tvm.compile(kernel(config), target=cuda_target())
        return cache[config]

    return get


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,rows,cols", GPU_CASES)
@pytest.mark.parametrize("tokens,few,dtype", [(1, False, "float16"), (None, True, "float16"), (3, False, "float32")])
def test_cuda_kquant_gemv_matches_gguf(built, fmt, rows, cols, tokens, few, dtype):
    config = QuantMatmulConfig(fmt, rows, cols, tokens=tokens, few_tokens=few, target="cuda", dtype=dtype)
    assert uses_cuda_gemv(config)
    blocks, w = quantized(fmt, rows, cols, seed=rows + cols)
    count = tokens or 5
    x = np.random.default_rng(count).standard_normal((count, cols)).astype(np.float32)
    check_cuda(run_cuda(built(config), config, blocks, x), x, w)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", K_QUANTS)
@pytest.mark.parametrize("tokens,prologue,residual", [(1, "rms_norm", True), (1, "swiglu", True),
                                                      (None, "none", True), (2, "rms_norm", False)])
def test_cuda_kquant_gemv_prologues_and_residual(built, fmt, tokens, prologue, residual):
    rows, cols = 640, 1024
    config = QuantMatmulConfig(fmt, rows, cols, tokens=tokens, few_tokens=tokens is None, target="cuda",
                               dtype="float16", residual=residual, prologue=prologue)
    blocks, w = quantized(fmt, rows, cols, seed=7)
    rng = np.random.default_rng(3)
    count = tokens or 4
    x = rng.standard_normal((count, 2 * cols if prologue == "swiglu" else cols)).astype(np.float32)
    g = (1 + 0.5 * rng.standard_normal(cols)).astype(np.float32) if prologue == "rms_norm" else None
    r = (rng.standard_normal((count, rows)) * 4).astype(np.float32) if residual else None
    got = run_cuda(built(config), config, blocks, x, r, g)
    want = x.astype(np.float16).astype(np.float64) if prologue == "none" else \
        prologue_reference(x, prologue, g, config.eps)
    check_cuda(got, want, w, r, rounded=True)
