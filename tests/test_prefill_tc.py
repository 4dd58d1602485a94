"""The Hopper tensor-core prefill (tir_kernels/prefill_sm90.py) against the float64 reference.

The shape matrix (dtype x head dim x GQA group x page size x causal x sliding window) is
sampled: each case below exercises several axes at once, and together they cover every value
of each axis. Outputs are NaN-poisoned and unowned page slots hold junk (tests/harness.py).
"""

import zlib

import numpy as np
import pytest
import reference as ref
from harness import JUNK, make_paged_batch, randn
from test_prefill import (
    check,
    expected,
    indptr,
    paged_inputs,
    requests_for,
    rope_args,
    run_paged,
    run_ragged,
)

from tir_kernels import (
    AttentionConfig,
    RopeScaling,
    default_sm_scale,
    paged_prefill,
    ragged_prefill,
)
from tir_kernels.build import uses_tirx_pipeline
from tir_kernels.prefill_sm90 import wgmma_problem
from tir_kernels.schedules import WgmmaPrefillSchedule, choose_prefill_schedule, choose_wgmma_prefill_schedule

# (num_qo_heads, num_kv_heads, head_dim, page_size, dtype, sliding)
TC_PAGED_CASES = [
    (8, 8, 128, 16, "float16", False),
    (16, 4, 64, 1, "bfloat16", False),
    (32, 2, 128, 64, "bfloat16", True),
    (16, 1, 256, 128, "float16", False),
    (32, 4, 64, 128, "float16", True),
    (8, 1, 128, 8, "bfloat16", False),
    (16, 2, 256, 16, "bfloat16", True),
    (4, 4, 64, 32, "float16", False),
]
# (num_qo_heads, num_kv_heads, qk_head_dim, v_head_dim, dtype)
TC_RAGGED_CASES = [
    (8, 8, 128, 128, "float16"),
    (16, 4, 192, 128, "bfloat16"),
    (16, 1, 128, 64, "float16"),
    (32, 8, 256, 256, "bfloat16"),
    (8, 2, 64, 64, "bfloat16"),
    # MLA self-attention over the new tokens (DeepSeek-V2-Lite / V2/V3: 16 / 128 heads, no GQA)
    (16, 16, 192, 128, "float16"),
    (128, 128, 192, 128, "bfloat16"),
]
# MLA self-attention with each schedule the 192 / 128 head dims can take (shared memory holds
# two 128-key stages or four 64-key ones).
MLA_RAGGED_SCHEDULES = [WgmmaPrefillSchedule(tile_kv=128, stages=2), WgmmaPrefillSchedule(tile_kv=64, stages=4),
                        WgmmaPrefillSchedule(tile_kv=64, stages=3)]


def case_id(case):
    return "-".join(str(x) for x in case)


def test_tensor_cores_serve_hopper_fp16_and_bf16():
    """Which configs take the tensor-core path (no GPU needed: only the generator's choice)."""
    hopper = AttentionConfig(32, 8, 128, dtype="bfloat16", target="cuda:sm_90")
    assert wgmma_problem(hopper) is None
    assert uses_tirx_pipeline(paged_prefill(hopper))
    assert uses_tirx_pipeline(ragged_prefill(hopper.replace(head_dim=192, v_head_dim=128)))
    assert "dtype" in wgmma_problem(hopper.replace(dtype="float32"))
    assert "head_dim=80" in wgmma_problem(hopper.replace(head_dim=80))
    assert "Hopper" in wgmma_problem(hopper.replace(target="cuda:sm_80"))
    assert "Hopper" in wgmma_problem(hopper.replace(target="llvm"))
    # head dims wgmma does not tile take the mma.sync kernel (run on the H200 in test_prefill_mma)
    odd = paged_prefill(hopper.replace(head_dim=80, v_head_dim=80))
    assert not uses_tirx_pipeline(odd) and "mma" in odd.script()
    # an explicit CUDA-core schedule keeps the CUDA-core kernel
    assert not uses_tirx_pipeline(paged_prefill(hopper, choose_prefill_schedule(hopper)))
    with pytest.raises(ValueError, match="dtype"):
        paged_prefill(hopper.replace(dtype="float32"), WgmmaPrefillSchedule(tile_kv=128, stages=2))


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_89"])
def test_ampere_and_ada_get_the_mma_sync_kernel(arch):
    config = AttentionConfig(32, 8, 128, dtype="float16", target=f"cuda:{arch}")
    for generator in (paged_prefill, ragged_prefill):
        func = generator(config)
        assert not uses_tirx_pipeline(func)
        assert "mma.sync" in func.script() or "mma" in func.script()
        assert "mma" not in generator(config.replace(dtype="float32")).script()


def test_wgmma_schedule_validation():
    config = AttentionConfig(32, 8, 256, dtype="float16", target="cuda:sm_90")
    with pytest.raises(ValueError, match="shared memory"):
        WgmmaPrefillSchedule(tile_kv=128, stages=4).check(config)
    with pytest.raises(ValueError, match="accumulator registers"):
        WgmmaPrefillSchedule(tile_kv=128, stages=2).check(config.replace(head_dim=64, v_head_dim=256))
    with pytest.raises(ValueError, match="stages"):
        WgmmaPrefillSchedule(tile_kv=128, stages=1)
    with pytest.raises(ValueError, match="consumer_regs"):
        WgmmaPrefillSchedule(tile_kv=128, stages=2, consumer_regs=250)


def test_wgmma_schedule_choice():
    """128-key steps in 3 stages where they fit; MLA's 192 / 128 dims (two 128-key stages at most)
    take four 64-key stages, measured faster on the H200; 256-wide outputs 64-key steps."""
    hopper = AttentionConfig(32, 8, 128, dtype="float16", target="cuda:sm_90")
    assert choose_wgmma_prefill_schedule(hopper) == WgmmaPrefillSchedule(tile_kv=128, stages=3)
    assert choose_wgmma_prefill_schedule(hopper.replace(head_dim=64, v_head_dim=64)).tile_kv == 128
    mla = hopper.replace(num_qo_heads=128, num_kv_heads=128, head_dim=192, v_head_dim=128)
    assert choose_wgmma_prefill_schedule(mla) == WgmmaPrefillSchedule(tile_kv=64, stages=4)
    assert choose_wgmma_prefill_schedule(hopper.replace(head_dim=256, v_head_dim=256)) == WgmmaPrefillSchedule(
        tile_kv=64, stages=2)


def _tc_config(**fields):
    config = AttentionConfig(target="cuda", **fields)
    assert wgmma_problem(config) is None, wgmma_problem(config)
    return config


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("case", TC_PAGED_CASES, ids=case_id)
def test_paged_prefill_tensor_cores(kernels, case, causal):
    hq, hkv, d, ps, dtype, sliding = case
    config = _tc_config(num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype, page_size=ps,
                        sliding_window=sliding)
    rng = np.random.default_rng(zlib.crc32(case_id(case).encode()))
    # the usual ragged requests, plus a 1-token request beside a long one and several tiles
    requests = requests_for(ps) + [(1, 700), (300, 1100)]
    batch, q, qo_indptr = paged_inputs(rng, config, requests)
    o, lse = run_paged(kernels, config, batch, q, qo_indptr, causal)
    check(config, o, lse, qo_indptr, expected(q, qo_indptr, batch.visible, default_sm_scale(d), causal))


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("case", TC_RAGGED_CASES, ids=case_id)
def test_ragged_prefill_tensor_cores(kernels, case, causal):
    hq, hkv, dqk, dv, dtype = case
    config = _tc_config(num_qo_heads=hq, num_kv_heads=hkv, head_dim=dqk, v_head_dim=dv, dtype=dtype)
    rng = np.random.default_rng(zlib.crc32(case_id(case).encode()))
    requests = [(37, 37), (20, 100), (1, 50), (0, 10), (3, 0), (129, 129), (1, 900), (260, 400)]
    qo_lens, kv_lens = zip(*requests)
    q = randn(rng, (sum(qo_lens), hq, dqk), dtype)
    k = randn(rng, (sum(kv_lens), hkv, dqk), dtype)
    v = randn(rng, (sum(kv_lens), hkv, dv), dtype)
    qo_indptr, kv_indptr = indptr(qo_lens), indptr(kv_lens)
    o, lse = run_ragged(kernels, config, q, qo_indptr, k, v, kv_indptr, causal)
    kv_of = lambda i: (k[kv_indptr[i]:kv_indptr[i + 1]], v[kv_indptr[i]:kv_indptr[i + 1]])  # noqa: E731
    check(config, o, lse, qo_indptr, expected(q, qo_indptr, kv_of, default_sm_scale(dqk), causal))


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", MLA_RAGGED_SCHEDULES, ids=lambda s: f"k{s.tile_kv}s{s.stages}")
def test_mla_self_attention_schedules(kernels, schedule):
    """Ragged prefill at DeepSeek's 192 / 128 head dims (128 heads, fp16, causal) under each
    schedule, ragged lengths across tiles and steps."""
    config = _tc_config(num_qo_heads=128, num_kv_heads=128, head_dim=192, v_head_dim=128, dtype="float16")
    rng = np.random.default_rng(schedule.tile_kv * 10 + schedule.stages)
    lens = [1, 130, 64, 257, 0, 33]
    q = randn(rng, (sum(lens), 128, 192), "float16")
    k = randn(rng, (sum(lens), 128, 192), "float16")
    v = randn(rng, (sum(lens), 128, 128), "float16")
    qo_indptr = indptr(lens)
    o, lse = run_ragged(kernels, config, q, qo_indptr, k, v, qo_indptr, True, extra=(schedule,))
    kv_of = lambda i: (k[qo_indptr[i]:qo_indptr[i + 1]], v[qo_indptr[i]:qo_indptr[i + 1]])  # noqa: E731
    check(config, o, lse, qo_indptr, expected(q, qo_indptr, kv_of, default_sm_scale(192), True))


@pytest.mark.gpu
def test_tensor_cores_match_cuda_cores(kernels):
    """Both CUDA kernels of the same config agree closely (same inputs, fp32 accumulation)."""
    config = _tc_config(num_qo_heads=32, num_kv_heads=8, head_dim=128, dtype="float16", page_size=16)
    rng = np.random.default_rng(5)
    batch, q, qo_indptr = paged_inputs(rng, config, [(500, 1500), (1, 64), (64, 64)])
    tc = run_paged(kernels, config, batch, q, qo_indptr, True)
    simt = run_paged(kernels, config, batch, q, qo_indptr, True, generator=paged_prefill_cuda_cores)
    np.testing.assert_allclose(tc[0], simt[0], atol=2e-3)
    np.testing.assert_allclose(tc[1], simt[1], atol=1e-3)


def paged_prefill_cuda_cores(config: AttentionConfig):
    return paged_prefill(config, choose_prefill_schedule(config))


@pytest.mark.gpu
def test_long_context_tensor_cores(kernels):
    """128 new tokens over a 32768-token context (and a 1-token step beside it), float64 reference."""
    config = _tc_config(num_qo_heads=8, num_kv_heads=2, head_dim=128, dtype="bfloat16", page_size=64)
    rng = np.random.default_rng(32768)
    lengths = [32768, 32768]
    batch = make_paged_batch(rng, lengths, 2, 128, 64, "bfloat16")
    q = randn(rng, (129, 8, 128), "bfloat16")
    qo_indptr = indptr([128, 1])
    o, lse = run_paged(kernels, config, batch, q, qo_indptr, True)
    check(config, o, lse, qo_indptr, expected(q, qo_indptr, batch.visible, default_sm_scale(128), True))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,head_dim,scaling",
                         [("float16", 128, None), ("bfloat16", 64, RopeScaling(8.0, 1.0, 4.0, 64))],
                         ids=["fp16-d128-rope", "bf16-d64-llama3-rope"])
def test_tensor_cores_inline_rope(kernels, dtype, head_dim, scaling):
    """rotary_mode=1 on the tensor-core kernels: q rotated at q_rope_position, key j at
    k_rope_pos_offset + j (the same kernel serves both modes, chosen at run time)."""
    config = _tc_config(num_qo_heads=16, num_kv_heads=4, head_dim=head_dim, dtype=dtype, page_size=16,
                        rope_scaling=scaling)
    rng = np.random.default_rng(head_dim)
    requests = [(37, 37), (20, 300), (1, 50), (0, 10), (3, 0), (200, 200)]
    batch, q, qo_indptr = paged_inputs(rng, config, requests)
    k_pos, q_pos = rope_args(*zip(*requests))
    rope = (5e5, 0.5)
    o, lse = run_paged(kernels, config, batch, q, qo_indptr, True, 1, rope, k_pos, q_pos)
    want = expected(q, qo_indptr, batch.visible, default_sm_scale(head_dim), True, (*rope, scaling), k_pos, q_pos)
    check_rotated(config, o, lse, qo_indptr, want)
    # ragged: the same requests with contiguous K/V
    kv_lens = [kv for _, kv in requests]
    k = np.concatenate([batch.visible(i)[0] for i in range(len(requests))])
    v = np.concatenate([batch.visible(i)[1] for i in range(len(requests))])
    kv_indptr = indptr(kv_lens)
    o, lse = run_ragged(kernels, config, q, qo_indptr, k, v, kv_indptr, True, 1, rope, k_pos, q_pos)
    check_rotated(config, o, lse, qo_indptr, want)


def check_rotated(config, o, lse, qo_indptr, want):
    """`check`, with the LSE tolerance widened by the rounding of the rotated q and k to the
    kernel's 16-bit dtype (tensor cores take 16-bit operands; bf16 keeps 8 bits of mantissa,
    so a score of size ~10 moves by ~0.04)."""
    rtol, atol = ref.TOLERANCES[config.dtype]
    lse_atol = 0.05 if config.dtype == "bfloat16" else ref.LSE_TOLERANCE[1]
    for i, (eo, else_) in enumerate(want):
        s, e = qo_indptr[i], qo_indptr[i + 1]
        np.testing.assert_allclose(o[s:e], eo, rtol=rtol, atol=atol, err_msg=f"o of request {i}")
        np.testing.assert_allclose(lse[s:e], else_, rtol=ref.LSE_TOLERANCE[0], atol=lse_atol,
                                   err_msg=f"lse of request {i}")


@pytest.mark.gpu
def test_tensor_cores_ignore_nan_in_unowned_slots(kernels):
    """NaN (not just a large finite junk value) in every page slot no request owns, including
    the tails of last pages that a 128-key step covers: nothing of it reaches o or lse."""
    config = _tc_config(num_qo_heads=16, num_kv_heads=2, head_dim=128, dtype="float16", page_size=16)
    rng = np.random.default_rng(7)
    batch, q, qo_indptr = paged_inputs(rng, config, [(5, 21), (16, 16), (1, 33), (40, 100), (130, 130)])
    junk = batch.pages.astype(np.float32) == JUNK
    assert junk.any()
    batch.pages = np.where(junk, np.nan, batch.pages).astype(batch.pages.dtype)
    for causal in (True, False):
        o, lse = run_paged(kernels, config, batch, q, qo_indptr, causal)
        check(config, o, lse, qo_indptr, expected(q, qo_indptr, batch.visible, default_sm_scale(128), causal))
