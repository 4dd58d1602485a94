"""compiler.fused_mlp: a decode step's whole MLP for one token as one CUDA kernel.

The reference is numpy over the same float16 / bfloat16 values, rounding where the kernel does:
n = rms_norm(x, g) rounded to the dtype, h = silu(n W_gate^T) * (n W_up^T) rounded once, y = x +
(h W_d^T rounded) rounded. The kernel's float32 sums (and their order across blocks) differ from
float64's by far less than one rounding of y; the tolerance allows one unit in the last place of
y and of the product before the add.
"""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest
import tvm

from harness import compiles_with_nvcc
from tvmattn.compiler.dependent_launch import chain_kernels
from tvmattn.compiler.fused_mlp import (MAX_WEIGHT_BYTES_PER_THREAD, FusedMLPSchedule, check_fused_mlp,
                                        choose_fused_mlp_schedule, fused_mlp_kernel)
from tvmattn.compiler.targets import cuda_target

EPS = 1e-5
NP_DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
ULP = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}


def reference(x, g, w_gu, w_d, dtype: str) -> np.ndarray:
    """y [H] for x [H], g [H], w_gu [2 I, H], w_d [H, I] (all of the dtype), float64 sums."""
    to = NP_DTYPES[dtype]
    x64 = x.astype(np.float64)
    rstd = 1.0 / np.sqrt(np.mean(x64 * x64) + EPS)
    n = (rstd * x64 * g.astype(np.float64)).astype(np.float32).astype(to).astype(np.float64)
    inter = w_gu.shape[0] // 2
    gate, up = w_gu[:inter].astype(np.float64) @ n, w_gu[inter:].astype(np.float64) @ n
    h = (gate / (1.0 + np.exp(-gate)) * up).astype(np.float32).astype(to).astype(np.float64)
    down = (w_d.astype(np.float64) @ h).astype(np.float32).astype(to).astype(np.float64)
    return (x64 + down).astype(np.float32).astype(to)


def random_mlp(hidden: int, intermediate: int, dtype: str, seed: int):
    rng = np.random.default_rng(seed)
    to = NP_DTYPES[dtype]
    x = rng.standard_normal(hidden).astype(to)
    g = (1.0 + 0.1 * rng.standard_normal(hidden)).astype(to)
    w_gu = (rng.standard_normal((2 * intermediate, hidden)) / np.sqrt(hidden)).astype(to)
    w_d = (rng.standard_normal((hidden, intermediate)) / np.sqrt(intermediate)).astype(to)
    return x, g, w_gu, w_d


# ---------------------------------------------------------------------------- schedules

@pytest.mark.parametrize("kwargs, message", [
    (dict(cols=8, threads=100), "threads=100"),
    (dict(cols=8, vec=3), "vec=3"),
    (dict(cols=12), "cols=12: expected a positive multiple of the 8 warps"),
])
def test_schedule_validation(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        FusedMLPSchedule(**kwargs)


@pytest.mark.parametrize("hidden, intermediate, dtype, message", [
    (576, 1536, "float32", "dtype='float32'"),
    (576 + 32, 1536, "float16", "hidden=608: expected a multiple of 32 * vec = 64"),
    (576, 1540, "float16", "cols=8: expected a multiple of 8 dividing intermediate=1540"),
])
def test_kernel_arguments_are_checked(hidden, intermediate, dtype, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_fused_mlp(hidden, intermediate, dtype, FusedMLPSchedule(cols=8))


@pytest.mark.parametrize("hidden, intermediate, expected", [
    (576, 1536, FusedMLPSchedule(cols=8, vec=2)),      # SmolLM2-135M: 192 blocks
    (960, 2560, FusedMLPSchedule(cols=16, threads=512, vec=2)),  # SmolLM2-360M: 160 blocks
    (2048, 8192, None),                                # Llama-3.2-1B: its MLP streams 100 MB
])
def test_schedule_choice(hidden, intermediate, expected):
    """The fewest columns a block whose blocks are all resident (264: 132 SMs, 2 blocks each),
    then the fewest threads, whose weights a thread holds fit MAX_WEIGHT_BYTES_PER_THREAD; None
    where none does."""
    chosen = choose_fused_mlp_schedule(hidden, intermediate, "float16", blocks_limit=264)
    assert chosen == expected
    if chosen is not None:
        assert chosen.weight_bytes_per_thread(hidden) <= MAX_WEIGHT_BYTES_PER_THREAD


# ---------------------------------------------------------------------------- CUDA source

def test_weights_load_before_the_wait_and_x_after(tmp_path):
    """With programmatic dependent launch the kernel's weight loads (plain ld.global, which ptxas
    keeps in place) come before griddepcontrol.wait, and x, which the previous kernel writes, is
    read after it through L2 (never as a .nc load, which ptxas may hoist above the wait); the
    accumulator's reds and the last block's arrival follow. With nvcc on PATH it compiles."""
    if tvm.get_global_func("target.build.cuda", allow_missing=True) is None:
        pytest.skip("TVM built without CUDA codegen")
    func = chain_kernels(fused_mlp_kernel(576, 1536, "float16", EPS, FusedMLPSchedule(cols=8)))
    with cuda_target():
        source = tvm.compile(func, target=cuda_target()).mod.imports[0].inspect_source()
    body = source[source.index("{", source.index("__global__ void")):]
    wait = body.index("tvmattn_grid_dependency_wait();")
    loads = [m.start() for m in re.finditer(r"tvmattn_load_before_wait_(?:4|16)\(", body)]
    assert len(loads) == 2 * 9 + 3 and max(loads) < wait  # 9 vectors of a gate and an up row, 3 W_d rows
    assert min(m.start() for m in re.finditer(r"tvmattn_ldcg_16\(", body)) > wait
    assert not re.search(r"[^&(]x_ptr\[", body)  # x's every read is an argument of tvmattn_ldcg_16
    assert re.search(r"tvmattn_mlp_acc_576\([^;]*, 0\);", body) and "tvmattn_decode_arrive_mlp_1(0, 192)" in body
    # its weights are in registers before the wait, so its dependents may start right after it
    # (whatever its 5 MB of weights) and nothing is prefetched into L2
    assert body.index("tvmattn_launch_dependents();") > wait and "prefetch" not in body
    compiles_with_nvcc(source, tmp_path, cubin=True)


@pytest.mark.parametrize("kwargs, message", [
    (dict(target="llvm", fused_mlp=True), "fused_mlp=True is not supported with target='llvm': it needs a CUDA"),
    (dict(target="cuda:sm_90", dtype="float16", fused_layers=False, fused_mlp=True),
     "fused_mlp=True is not supported with target='cuda:sm_90' and fused_layers=False"),
    (dict(target="cuda:sm_90", dtype="float16", fused_mlp=1), "fused_mlp=1 is not supported: expected a bool"),
])
def test_build_option_is_checked(kwargs, message):
    from tvmattn.models import BuildOptions

    with pytest.raises(ValueError, match=re.escape(message)):
        BuildOptions(**kwargs)


# ---------------------------------------------------------------------------- GPU

GPU_CASES = [  # hidden, intermediate, dtype, schedule (None: the chosen one)
    pytest.param(576, 1536, "float16", None, id="smollm2-f16"),
    pytest.param(576, 1536, "bfloat16", None, id="smollm2-bf16"),
    pytest.param(960, 2560, "float16", None, id="smollm2-360m-f16"),
    pytest.param(1024, 2816, "float16", FusedMLPSchedule(cols=32, vec=8), id="vec8-f16"),
    pytest.param(640, 2048, "bfloat16", FusedMLPSchedule(cols=16, vec=4), id="vec4-bf16"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("hidden, intermediate, dtype, schedule", GPU_CASES)
@pytest.mark.parametrize("dependent", [False, True], ids=["plain", "pdl"])
def test_matches_numpy_launch_after_launch(hidden, intermediate, dtype, schedule, dependent):
    """Three launches in a row on different inputs (the accumulator the last block zeroes is
    clean for the next) each match the numpy reference within one unit in the last place."""
    if not tvm.cuda(0).exist:
        pytest.skip("no CUDA device")
    schedule = schedule or choose_fused_mlp_schedule(hidden, intermediate, dtype, blocks_limit=264)
    func = fused_mlp_kernel(hidden, intermediate, dtype, EPS, schedule)
    with cuda_target():
        fn = tvm.compile(chain_kernels(func) if dependent else func, target=cuda_target())
    dev = tvm.cuda(0)
    for seed in range(3):
        x, g, w_gu, w_d = random_mlp(hidden, intermediate, dtype, seed)
        y = tvm.runtime.tensor(np.full((1, 1, hidden), np.nan, NP_DTYPES[dtype]), device=dev)
        fn(*[tvm.runtime.tensor(a, device=dev) for a in (x.reshape(1, 1, -1), g, w_gu, w_d)], y)
        got = y.numpy().reshape(-1).astype(np.float64)
        want = reference(x, g, w_gu, w_d, dtype).astype(np.float64)
        down = np.abs(want - x.astype(np.float64))
        tolerance = ULP[dtype] * (np.abs(want) + down) + 1e-6
        assert np.all(np.abs(got - want) <= tolerance), (seed, np.max(np.abs(got - want) - tolerance))
