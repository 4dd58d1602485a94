"""paged_prefill_mma / ragged_prefill_mma (tensor-core prefill, tir_kernels/prefill_sm80.py)
against the float64 reference.

GPU tests build for the present GPU's arch (`cuda:sm_90` on the H200: mma.sync, ldmatrix and
cp.async are valid there, and the generators always emit the mma kernel whatever the arch, so
the sm_80..sm_89 code path is what runs). Each config is built once per session. CPU tests
check CUDA source generation for sm_80 (no driver, no nvcc) and the argument checks.
"""

import zlib

import numpy as np
import pytest
import test_prefill as prefill_tests
import tvm
from harness import JUNK, make_paged_batch, randn
from test_prefill import check, expected, indptr, rope_args

from tir_kernels import AttentionConfig, default_sm_scale, paged_prefill, ragged_prefill
from tir_kernels.prefill_sm80 import (
    MmaPrefillSchedule,
    choose_mma_prefill_schedule,
    paged_prefill_mma,
    ragged_prefill_mma,
)
from tir_kernels.support import present_cuda_arch

# (num_qo_heads, num_kv_heads, head_dim, page_size, dtype, sliding): every dtype, GQA group
# 1/4/8/16, head dim 64/80/128/256, page size 1/8/16/64/128, with and without a window.
PAGED_CASES = [
    (8, 8, 128, 16, "float16", False),
    (32, 8, 128, 16, "float16", False),
    (16, 2, 128, 64, "bfloat16", False),
    (16, 1, 64, 1, "float16", False),
    (8, 2, 64, 128, "bfloat16", False),
    (16, 2, 256, 16, "float16", False),
    (16, 16, 256, 1, "bfloat16", False),
    (4, 2, 256, 64, "bfloat16", True),
    (8, 1, 128, 1, "float16", True),
    (16, 4, 64, 16, "bfloat16", True),
    (8, 2, 128, 128, "float16", True),
    (4, 2, 80, 8, "float16", False),  # rows of 10 chunks: the padded (not swizzled) layout
]

# (num_qo_heads, num_kv_heads, qk_head_dim, v_head_dim, dtype)
RAGGED_CASES = [
    (8, 8, 128, 128, "float16"),
    (16, 4, 192, 128, "bfloat16"),
    (16, 1, 128, 64, "float16"),
    (32, 8, 256, 256, "bfloat16"),
    (8, 2, 64, 64, "bfloat16"),
    (32, 4, 96, 96, "float16"),
]

# Schedules other than the default on a ragged fp16 d128 config: one stage, 8 warps, Q
# fragments from shared memory; 2 warps with 128-key tiles; 32 rows per warp (two m16 tiles).
SCHEDULES = [
    MmaPrefillSchedule(warps=8, tile_kv=32, stages=1, q_in_registers=False),
    MmaPrefillSchedule(warps=2, tile_kv=128, stages=2, q_in_registers=True),
    MmaPrefillSchedule(warps=4, rows_per_warp=32, tile_kv=32, stages=2, q_in_registers=False),
]


def paged_case_id(case):
    hq, hkv, d, ps, dtype, sliding = case
    return f"hq{hq}-hkv{hkv}-d{d}-ps{ps}-{dtype}" + ("-sliding" if sliding else "")


def ragged_case_id(case):
    hq, hkv, dqk, dv, dtype = case
    return f"hq{hq}-hkv{hkv}-dqk{dqk}-dv{dv}-{dtype}"


def schedule_id(s):
    return f"w{s.warps}-r{s.rows_per_warp}-kv{s.tile_kv}-st{s.stages}" + ("-qreg" if s.q_in_registers else "-qsmem")


@pytest.fixture(scope="session")
def gpu_target():
    """The present GPU's target, e.g. "cuda:sm_90"."""
    return f"cuda:{present_cuda_arch()}"


def requests_for(page_size):
    """(qo_len, kv_len) per request: empty history (kv_len == qo_len), history plus new tokens,
    one new token, KV ending on a page boundary, no query, no key, several tiles, a long one
    mixed with 1-token requests."""
    return [(37, 37), (20, 100), (1, 50), (min(5, 2 * page_size), 2 * page_size), (0, 10), (3, 0),
            (page_size, 3 * page_size), (70, 150), (1, 1), (130, 333), (1, 257)]


def paged_inputs(rng, config, requests):
    """A paged batch whose request i has requests[i][1] visible tokens (NaN in every page slot
    no request owns), and the packed queries."""
    qo_lens, kv_lens = [qo for qo, _ in requests], np.array([kv for _, kv in requests], np.int32)
    hkv, d, ps = config.num_kv_heads, config.head_dim, config.page_size
    if config.sliding_window:
        # Page half as many tokens again and cut them out of the middle: the sink (clamped to
        # kv_len) stays, and the window starts so that kv_len tokens remain visible.
        paged_lens = kv_lens + kv_lens // 2
        batch = make_paged_batch(rng, paged_lens, hkv, d, ps, config.dtype, sliding=True)
        batch.sink = np.minimum(batch.sink, kv_lens).astype(np.int32)
        batch.window_offset = (paged_lens - (kv_lens - batch.sink)).astype(np.int32)
    else:
        batch = make_paged_batch(rng, kv_lens, hkv, d, ps, config.dtype)
    junk = batch.pages.astype(np.float32) == JUNK
    assert junk.any()
    batch.pages[junk] = np.nan
    q = randn(rng, (sum(qo_lens), config.num_qo_heads, d), config.dtype)
    return batch, q, indptr(qo_lens)


def run_paged(*args, **kwargs):
    return prefill_tests.run_paged(*args, generator=paged_prefill_mma, **kwargs)


def ragged_inputs(rng, config, requests):
    hkv, dqk, dv, dtype = config.num_kv_heads, config.head_dim, config.v_head_dim, config.dtype
    qo_lens, kv_lens = [qo for qo, _ in requests], [kv for _, kv in requests]
    q = randn(rng, (sum(qo_lens), config.num_qo_heads, dqk), dtype)
    k = randn(rng, (sum(kv_lens), hkv, dqk), dtype)
    v = randn(rng, (sum(kv_lens), hkv, dv), dtype)
    return q, indptr(qo_lens), k, v, indptr(kv_lens)


def run_ragged(kernels, config, q, qo_indptr, k, v, kv_indptr, causal, schedule=None, *rope):
    """test_prefill.run_ragged on ragged_prefill_mma(config, schedule); rope: rotary_mode, ..."""
    return prefill_tests.run_ragged(kernels, config, q, qo_indptr, k, v, kv_indptr, causal, *rope,
                                    generator=ragged_prefill_mma, extra=(schedule,))


def ragged_kv_of(k, v, kv_indptr):
    return lambda i: (k[kv_indptr[i] : kv_indptr[i + 1]], v[kv_indptr[i] : kv_indptr[i + 1]])


@pytest.mark.gpu
@pytest.mark.parametrize("case", PAGED_CASES, ids=paged_case_id)
def test_paged_prefill_mma(kernels, gpu_target, case):
    hq, hkv, d, ps, dtype, sliding = case
    config = AttentionConfig(hq, hkv, d, dtype=dtype, page_size=ps, target=gpu_target, sliding_window=sliding)
    rng = np.random.default_rng(zlib.crc32(paged_case_id(case).encode()))
    requests = requests_for(ps)
    batch, q, qo_indptr = paged_inputs(rng, config, requests)
    assert [len(batch.visible(i)[0]) for i in range(batch.batch)] == [kv for _, kv in requests]
    for causal in (True, False):
        o, lse = run_paged(kernels, config, batch, q, qo_indptr, causal)
        check(config, o, lse, qo_indptr, expected(q, qo_indptr, batch.visible, default_sm_scale(d), causal))


@pytest.mark.gpu
@pytest.mark.parametrize("case", RAGGED_CASES, ids=ragged_case_id)
def test_ragged_prefill_mma(kernels, gpu_target, case):
    hq, hkv, dqk, dv, dtype = case
    config = AttentionConfig(hq, hkv, dqk, v_head_dim=dv, dtype=dtype, target=gpu_target)
    rng = np.random.default_rng(zlib.crc32(ragged_case_id(case).encode()))
    q, qo_indptr, k, v, kv_indptr = ragged_inputs(rng, config, requests_for(16))
    for causal in (True, False):
        o, lse = run_ragged(kernels, config, q, qo_indptr, k, v, kv_indptr, causal)
        want = expected(q, qo_indptr, ragged_kv_of(k, v, kv_indptr), default_sm_scale(dqk), causal)
        check(config, o, lse, qo_indptr, want)


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", SCHEDULES, ids=schedule_id)
def test_ragged_prefill_mma_schedules(kernels, gpu_target, schedule):
    config = AttentionConfig(8, 2, 128, dtype="float16", target=gpu_target)
    rng = np.random.default_rng(3)
    q, qo_indptr, k, v, kv_indptr = ragged_inputs(rng, config, requests_for(16))
    for causal in (True, False):
        o, lse = run_ragged(kernels, config, q, qo_indptr, k, v, kv_indptr, causal, schedule)
        check(config, o, lse, qo_indptr, expected(q, qo_indptr, ragged_kv_of(k, v, kv_indptr),
                                                  default_sm_scale(128), causal))


@pytest.mark.gpu
def test_prefill_mma_inline_rope(kernels, gpu_target):
    """rotary_mode=1 runs the CUDA-core kernel held in the same PrimFunc (paged and ragged)."""
    requests = [(9, 9), (12, 40), (1, 33), (70, 150)]
    k_pos, q_pos = rope_args(*zip(*requests))
    rope = (5e5, 0.5)
    config = AttentionConfig(32, 8, 128, dtype="float16", page_size=16, target=gpu_target)
    rng = np.random.default_rng(11)
    batch, q, qo_indptr = paged_inputs(rng, config, requests)
    o, lse = run_paged(kernels, config, batch, q, qo_indptr, True, 1, rope, k_pos, q_pos)
    check(config, o, lse, qo_indptr,
          expected(q, qo_indptr, batch.visible, default_sm_scale(128), True, (*rope, None), k_pos, q_pos))
    config = AttentionConfig(8, 8, 128, dtype="float16", target=gpu_target)
    q, qo_indptr, k, v, kv_indptr = ragged_inputs(rng, config, requests)
    o, lse = run_ragged(kernels, config, q, qo_indptr, k, v, kv_indptr, True, None, 1, rope, k_pos, q_pos)
    check(config, o, lse, qo_indptr, expected(q, qo_indptr, ragged_kv_of(k, v, kv_indptr), default_sm_scale(128),
                                              True, (*rope, None), k_pos, q_pos))


@pytest.mark.gpu
@pytest.mark.parametrize("requests", [[(1000, 1000)], [(300, 300), (1, 700), (130, 900), (517, 517)]],
                         ids=["one-long", "mixed"])
def test_paged_prefill_mma_long(kernels, gpu_target, requests):
    """The benchmark shape (32 q / 8 kv heads, d128, fp16, page 16) with many tiles per request."""
    config = AttentionConfig(32, 8, 128, dtype="float16", page_size=16, target=gpu_target)
    rng = np.random.default_rng(len(requests))
    batch, q, qo_indptr = paged_inputs(rng, config, requests)
    for causal in (True, False):
        o, lse = run_paged(kernels, config, batch, q, qo_indptr, causal)
        check(config, o, lse, qo_indptr, expected(q, qo_indptr, batch.visible, default_sm_scale(128), causal))


# CPU: CUDA source for sm_80 (tvm.compile without a driver embeds source; no nvcc runs).
SOURCE_CASES = [
    pytest.param(paged_prefill_mma, paged_prefill,
                 AttentionConfig(32, 8, 128, dtype="float16", page_size=16, target="cuda:sm_80"), id="paged-fp16-d128"),
    pytest.param(paged_prefill_mma, paged_prefill,
                 AttentionConfig(16, 2, 256, dtype="bfloat16", page_size=1, target="cuda:sm_89", sliding_window=True),
                 id="paged-bf16-d256-sliding-sm89"),
    pytest.param(ragged_prefill_mma, ragged_prefill,
                 AttentionConfig(16, 4, 192, v_head_dim=128, dtype="bfloat16", target="cuda:sm_80"),
                 id="ragged-bf16-d192-128"),
]


def signature(func):
    """Each parameter's name and dtype, and a buffer's shape and element offset."""
    def describe(p):
        if type(p.ty).__name__ == "BufferType":
            return p.name, str(p.dtype), str(p.shape), str(p.elem_offset)
        return p.name, str(p.ty)
    return [describe(p) for p in func.params]


@pytest.mark.parametrize("generator,core,config", SOURCE_CASES)
def test_prefill_mma_builds_cuda_source(generator, core, config):
    """Same signature and symbol as the CUDA-core generator; the source uses mma.sync
    m16n8k16 with fp32 accumulation, ldmatrix (.trans for V) and 16-byte cp.async."""
    # (the contract's signature does not depend on the target: compare with the CPU kernel's)
    func, reference_func = generator(config), core(config.replace(target="llvm"))
    assert func.attrs["global_symbol"] == reference_func.attrs["global_symbol"]
    assert signature(func) == signature(reference_func)
    module = tvm.compile(tvm.IRModule({str(func.attrs["global_symbol"]): func}), target=config.tvm_target())
    cuda = module.mod.imports[0].inspect_source()
    mma = "bf16" if config.dtype == "bfloat16" else "f16"
    assert f"mma.sync.aligned.m16n8k16.row.col.f32.{mma}.{mma}.f32" in cuda
    assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in cuda
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in cuda
    assert "cp.async.cg.shared.global [%0], [%1], 16;" in cuda
    assert f"cvt.rn.{mma}x2.f32" in cuda


def test_prefill_mma_rejects_unsupported_configs():
    with pytest.raises(ValueError, match="dtype='float32'"):
        paged_prefill_mma(AttentionConfig(8, 2, 128, dtype="float32", target="cuda:sm_80"))
    with pytest.raises(ValueError, match="dtype='float32'"):
        ragged_prefill_mma(AttentionConfig(8, 2, 128, dtype="float32", target="cuda:sm_80"))
    with pytest.raises(ValueError, match="target='llvm'"):
        ragged_prefill_mma(AttentionConfig(8, 2, 128, dtype="float16"))
    with pytest.raises(ValueError, match="target='cuda:sm_75'"):
        ragged_prefill_mma(AttentionConfig(8, 2, 128, dtype="float16", target="cuda:sm_75"))
    with pytest.raises(ValueError, match="v_head_dim"):
        paged_prefill_mma(AttentionConfig(8, 2, 64, v_head_dim=128, target="cuda:sm_80"))


def test_mma_prefill_schedule_validation():
    with pytest.raises(ValueError, match="tile_kv"):
        MmaPrefillSchedule(tile_kv=24)
    with pytest.raises(ValueError, match="stages"):
        MmaPrefillSchedule(stages=3)
    with pytest.raises(ValueError, match="warps"):
        MmaPrefillSchedule(warps=0)
    with pytest.raises(ValueError, match="rows_per_warp"):
        MmaPrefillSchedule(rows_per_warp=8)
    with pytest.raises(ValueError, match="fragment registers"):
        ragged_prefill_mma(AttentionConfig(8, 2, 128, dtype="float16", target="cuda:sm_80"),
                           MmaPrefillSchedule(rows_per_warp=32, tile_kv=64, q_in_registers=True))
    config = AttentionConfig(8, 2, 256, dtype="float16", target="cuda:sm_89")
    with pytest.raises(ValueError, match="shared memory"):
        ragged_prefill_mma(config, MmaPrefillSchedule(warps=8, tile_kv=64, stages=2, q_in_registers=False))


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_89", "sm_90"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_default_mma_schedules_fit_every_head_dim(arch, dtype):
    """The default schedule is valid for every head-dim pair a config accepts, on each arch."""
    for head_dim, v_head_dim in [(d, d) for d in range(16, 257, 16)] + [(192, 128), (128, 16), (64, 256)]:
        config = AttentionConfig(32, 8, head_dim, v_head_dim=v_head_dim, dtype=dtype, target=f"cuda:{arch}")
        choose_mma_prefill_schedule(config).check(config)
