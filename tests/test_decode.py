"""paged_decode against the float64 reference, CPU and CUDA."""

import dataclasses
import re
import zlib

import numpy as np
import pytest
import tvm
import reference as ref
from harness import (PAGED_CASES, device_for, empty, index_view, make_paged_batch, paged_case_id, randn, slow_except,
                     tensor)

from tir_kernels import AttentionConfig, DecodeSchedule, RopeScaling, default_sm_scale, paged_decode
from tir_kernels.schedules import choose_decode_schedule


def lengths_for(page_size):
    # Empty history, one token, exactly one and two pages, ragged lengths.
    return [0, 1, page_size, 2 * page_size, 37, 3 * page_size + 5, 130]


def run_decode(kernels, config, batch, q, rotary_mode=0, rope_scale=1.0, rope_theta=1e4, q_pos=None, k_pos=None):
    dev = device_for(config)
    fn = kernels.get(paged_decode, config)
    b = batch.batch
    o = empty((b, config.num_qo_heads, config.head_dim), config.dtype, dev)
    lse = empty((b, config.num_qo_heads), "float32", dev)
    q_pos = np.zeros(b, np.int32) if q_pos is None else q_pos
    k_pos = np.zeros(b, np.int32) if k_pos is None else k_pos
    fn(tensor(q, dev), tensor(batch.pages, dev), index_view(batch.page_indptr, dev), index_view(batch.page_indices, dev),
       index_view(batch.length_info(), dev, offset=3), index_view(k_pos, dev, offset=11), index_view(q_pos, dev, offset=2),
       o, lse, rotary_mode, rope_scale, rope_theta, default_sm_scale(config.head_dim))
    return o.numpy().astype(np.float64), lse.numpy()


def check(config, o, lse, expected):
    rtol, atol = ref.TOLERANCES[config.dtype]
    for i, (eo, else_) in enumerate(expected):
        np.testing.assert_allclose(o[i], eo[0], rtol=rtol, atol=atol, err_msg=f"o of request {i}")
        np.testing.assert_allclose(lse[i], else_[0], rtol=ref.LSE_TOLERANCE[0], atol=ref.LSE_TOLERANCE[1], err_msg=f"lse of request {i}")


# The default tier: fp32 at page size 1, bf16 and fp16 at GQA 4 and 16 (a sliding window: the CPU
# split-KV test below); -m slow: every case.
@pytest.mark.parametrize("case", slow_except(PAGED_CASES, (8, 4, 64, 1, "float32", False), (8, 2, 128, 16, "bfloat16", False),
                                             (16, 1, 64, 16, "float16", False)), ids=paged_case_id)
def test_paged_decode(kernels, target, case):
    hq, hkv, d, ps, dtype, sliding = case
    config = AttentionConfig(hq, hkv, d, dtype=dtype, page_size=ps, target=target, sliding_window=sliding)
    rng = np.random.default_rng(zlib.crc32(paged_case_id(case).encode()))
    batch = make_paged_batch(rng, lengths_for(ps), hkv, d, ps, dtype, sliding=sliding)
    q = randn(rng, (batch.batch, hq, d), dtype)
    o, lse = run_decode(kernels, config, batch, q)
    expected = [ref.attention(q[i : i + 1], *batch.visible(i), default_sm_scale(d), causal=False) for i in range(batch.batch)]
    check(config, o, lse, expected)


@pytest.mark.parametrize("scaling", [pytest.param(None, marks=pytest.mark.slow), RopeScaling(8.0, 1.0, 4.0, 64)],
                         ids=["rope", "llama3-rope"])
def test_paged_decode_inline_rope(kernels, target, scaling):
    """rotary_mode=1: q at q_rope_position, key j at k_rope_pos_offset + j, rotated in-kernel."""
    hq, hkv, d, ps, dtype = 8, 2, 64, 16, "float32"
    config = AttentionConfig(hq, hkv, d, dtype=dtype, page_size=ps, target=target, rope_scaling=scaling)
    rng = np.random.default_rng(7)
    batch = make_paged_batch(rng, [5, 16, 40], hkv, d, ps, dtype)
    q = randn(rng, (batch.batch, hq, d), dtype)
    q_pos = np.array([9, 30, 100], np.int32)
    k_pos = np.array([4, 14, 60], np.int32)
    theta, scale = 5e5, 0.5
    o, lse = run_decode(kernels, config, batch, q, 1, scale, theta, q_pos, k_pos)
    expected = []
    for i in range(batch.batch):
        k, v = batch.visible(i)
        qr = ref.rope(q[i : i + 1], q_pos[i : i + 1], theta, scale, scaling)
        kr = ref.rope(k, k_pos[i] + np.arange(len(k)), theta, scale, scaling)
        expected.append(ref.attention(qr, kr, v, default_sm_scale(d), causal=False))
    check(config, o, lse, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("batch_size,length", [(1, 3000), (3, 700), (256, 33)])
def test_paged_decode_split_kv(kernels, batch_size, length):
    """Split-KV path (small batches split history over blocks) matches the reference."""
    hq, hkv, d, ps, dtype = 32, 8, 128, 16, "float16"
    config = AttentionConfig(hq, hkv, d, dtype=dtype, page_size=ps, target="cuda")
    rng = np.random.default_rng(batch_size)
    lengths = [length + 17 * i for i in range(batch_size)]
    batch = make_paged_batch(rng, lengths, hkv, d, ps, dtype)
    q = randn(rng, (batch_size, hq, d), dtype)
    o, lse = run_decode(kernels, config, batch, q)
    expected = [ref.attention(q[i : i + 1], *batch.visible(i), default_sm_scale(d), causal=False) for i in range(batch_size)]
    check(config, o, lse, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("fused_merge", [True, False], ids=["fused-merge", "merge-kernel"])
@pytest.mark.parametrize("min_split_keys", [None, 1, 32, 4096])
def test_paged_decode_request_splits(kernels, min_split_keys, fused_merge):
    """SmolLM2's heads (9 / 3, d64: the CUDA-core kernel) with ragged lengths: each request
    takes min(slots, ceil(kv_len / min_split_keys)) splits (one: written directly, the merge
    skips it); default, every slot, and never split; the splits merged by the last split block
    (fused_merge) or by the merge kernel. Each call runs twice: the fused merge's arrival
    counters must be back at zero for the next launch."""
    hq, hkv, d, ps, dtype = 9, 3, 64, 16, "float16"
    config = AttentionConfig(hq, hkv, d, dtype=dtype, page_size=ps, target="cuda")
    lengths = [1, 0, 64, 65, 512, 3000, 17]
    rng = np.random.default_rng(13)
    batch = make_paged_batch(rng, lengths, hkv, d, ps, dtype)
    q = randn(rng, (batch.batch, hq, d), dtype)
    sched = choose_decode_schedule(config)
    sched = dataclasses.replace(sched, min_split_keys=min_split_keys or sched.min_split_keys, fused_merge=fused_merge)
    runner = _Scheduled(kernels, sched)
    expected = [ref.attention(q[i : i + 1], *batch.visible(i), default_sm_scale(d), causal=False)
                for i in range(batch.batch)]
    for _ in range(2):
        o, lse = run_decode(runner, config, batch, q)
        check(config, o, lse, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("batch_size,length", [(1, 512), (1, 70000), (64, 300), (175, 129)])
def test_paged_decode_fused_merge_at_every_grid(kernels, batch_size, length):
    """The default CUDA-core schedule (fused merge) where the grid has many split slots per
    request (batch 1: 64 slots, 70,000 keys: every slot taken) down to two (175 requests of 3
    KV heads: 525 of the 528 target blocks), ragged lengths, group 3 at head dim 64."""
    hq, hkv, d, ps, dtype = 9, 3, 64, 16, "bfloat16"
    config = AttentionConfig(hq, hkv, d, dtype=dtype, page_size=ps, target="cuda")
    rng = np.random.default_rng(batch_size * 7 + length)
    batch = make_paged_batch(rng, [length + 5 * (i % 13) for i in range(batch_size)], hkv, d, ps, dtype)
    q = randn(rng, (batch_size, hq, d), dtype)
    o, lse = run_decode(kernels, config, batch, q)
    expected = [ref.attention(q[i : i + 1], *batch.visible(i), default_sm_scale(d), causal=False)
                for i in range(batch_size)]
    check(config, o, lse, expected)


CPU_SPLIT_SCHEDULES = [
    None,  # the default CPU schedule: splits up to 2 tasks per core
    DecodeSchedule(lanes=1, rows=1, rows_per_thread=4, heads_per_block=1, max_splits=16, target_blocks=64),
    DecodeSchedule(lanes=1, rows=1, rows_per_thread=16, heads_per_block=3, max_splits=5, target_blocks=64),
    # per-request split counts: ceil(kv_len / min_split_keys) of the grid's slots (one: no merge)
    DecodeSchedule(lanes=1, rows=1, rows_per_thread=4, heads_per_block=1, max_splits=16, target_blocks=64,
                   min_split_keys=100),
    DecodeSchedule(lanes=1, rows=1, rows_per_thread=16, heads_per_block=3, max_splits=5, target_blocks=64,
                   min_split_keys=64),
    # row tiles (rows_per_thread == decode.CPU_LANES) of one head a block
    DecodeSchedule(lanes=1, rows=1, rows_per_thread=16, heads_per_block=1, max_splits=3, target_blocks=8),
]


@pytest.mark.parametrize("sched", slow_except(CPU_SPLIT_SCHEDULES, first=2),
                         ids=["default", "hb1-x16", "hb3-x5", "hb1-x16-m100", "hb3-x5-m64", "hb1-tiles-x3"])
@pytest.mark.parametrize("lengths,sliding", [([700], False), ([5], False), ([0, 300, 33], False), ([400, 90], True),
                                             ([700, 5, 0, 300, 33, 129, 64, 17], False)],
                         ids=["1x700", "1x5", "3-ragged", "sliding", "8-ragged"])
def test_paged_decode_cpu_split_kv(kernels, sched, lengths, sliding):
    """CPU blocks of (request, head chunk, split) in one parallel loop, split-KV merged: small
    batches with few KV heads (SmolLM2's 9 / 3 heads, d64), more splits than keys included; the
    merge serial below decode.CPU_PARALLEL_MERGE_ROWS rows and parallel from there (8 requests x
    9 heads = 72 rows, merged where the schedule gives a batch of 8 more than one split)."""
    hq, hkv, d, ps, dtype = 9, 3, 64, 16, "float32"
    config = AttentionConfig(hq, hkv, d, dtype=dtype, page_size=ps, target="llvm", sliding_window=sliding)
    rng = np.random.default_rng(len(lengths) * 1000 + lengths[0])
    batch = make_paged_batch(rng, lengths, hkv, d, ps, dtype, sliding=sliding)
    q = randn(rng, (batch.batch, hq, d), dtype)
    o, lse = run_decode(kernels if sched is None else _Scheduled(kernels, sched), config, batch, q)
    expected = [ref.attention(q[i : i + 1], *batch.visible(i), default_sm_scale(d), causal=False)
                for i in range(batch.batch)]
    check(config, o, lse, expected)


class _Scheduled:
    """kernels.get(paged_decode, config) with a given schedule."""

    def __init__(self, kernels, sched):
        self.kernels, self.sched = kernels, sched

    def get(self, generator, config):
        return self.kernels.get(generator, config, self.sched)


def test_decode_schedule_validation():
    config = AttentionConfig(8, 2, 64)
    with pytest.raises(ValueError, match="heads_per_block"):
        paged_decode(config.replace(target="cuda"), DecodeSchedule(lanes=8, rows=16, rows_per_thread=2, heads_per_block=3))
    with pytest.raises(ValueError, match="lanes"):
        DecodeSchedule(lanes=3, rows=1, rows_per_thread=1, heads_per_block=1)
    with pytest.raises(ValueError, match="min_split_keys"):
        DecodeSchedule(lanes=8, rows=16, rows_per_thread=2, heads_per_block=1, min_split_keys=0)
    with pytest.raises(ValueError, match="v_head_dim"):
        paged_decode(AttentionConfig(8, 2, 64, v_head_dim=128))
    with pytest.raises(ValueError, match="fused_merge is CUDA's"):
        paged_decode(AttentionConfig(9, 3, 64), DecodeSchedule(lanes=1, rows=1, rows_per_thread=16, heads_per_block=3,
                                                               max_splits=4, fused_merge=True))


@pytest.mark.parametrize("fused_merge", [True, False])
def test_cuda_core_decode_merges_in_the_split_kernel(fused_merge):
    """CUDA source (no GPU needed): with fused_merge (the default schedule's) each rotary mode is
    one kernel that counts its split blocks' arrivals; without it a merge kernel follows either."""
    config = AttentionConfig(9, 3, 64, dtype="float16", page_size=16, target="cuda")
    sched = dataclasses.replace(choose_decode_schedule(config), fused_merge=fused_merge)
    assert choose_decode_schedule(config).fused_merge
    module = tvm.compile(tvm.IRModule({"decode": paged_decode(config, sched)}), target=config.tvm_target())
    cuda_source = module.mod.imports[0].inspect_source()
    kernels = set(re.findall(r'extern "C" __global__ void __launch_bounds__\(\d+\) (\w+)\(', cuda_source))
    assert len(kernels) == (2 if fused_merge else 3)
    assert ("tvmattn_decode_arrive_simt" in cuda_source) == fused_merge


def test_paged_decode_cpu_prefetches_next_step():
    """The CPU decode asks for the next step's K/V rows in L2 (x86 prefetcht1) while it computes
    the current step (decode.CPU_PREFETCH_LOCALITY); tests above check that the results are unchanged."""
    config = AttentionConfig(9, 3, 64, dtype="float32", page_size=16, target="llvm")
    module = tvm.compile(tvm.IRModule({"decode": paged_decode(config)}), target=config.tvm_target())
    assert "prefetcht1" in module.mod.inspect_source("asm")


@pytest.mark.parametrize("head_dim", [80, 96])
def test_head_dims_the_tensor_core_decode_cannot_rotate_build_for_sm80(head_dim):
    """fp16 at GQA 4 on sm_80 at head dims whose rows the tensor-core decode's inline RoPE cannot
    rotate in whole passes (schedules.tc_rope_pass_problem): the dispatch builds the CUDA-core
    kernel (CUDA source, no GPU needed), never the tensor-core one's assertion."""
    config = AttentionConfig(16, 4, head_dim, dtype="float16", page_size=16, target="cuda:sm_80")
    module = tvm.compile(tvm.IRModule({"batch_decode_paged_kv": paged_decode(config)}), target=config.tvm_target())
    cuda_source = module.mod.imports[0].inspect_source()
    assert 'extern "C" __global__' in cuda_source and "mma.sync" not in cuda_source


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [80, 96])
@pytest.mark.parametrize("rotary_mode", [0, 1])
def test_paged_decode_at_head_dims_off_the_tensor_cores(kernels, head_dim, rotary_mode):
    """fp16 GQA 4 at head dims 80 and 96 (the CUDA-core kernel on every arch), with and without
    inline RoPE, against the float64 reference."""
    hq, hkv, ps, dtype = 16, 4, 16, "float16"
    config = AttentionConfig(hq, hkv, head_dim, dtype=dtype, page_size=ps, target="cuda")
    rng = np.random.default_rng(head_dim + rotary_mode)
    batch = make_paged_batch(rng, [5, 70, 300], hkv, head_dim, ps, dtype)
    q = randn(rng, (batch.batch, hq, head_dim), dtype)
    q_pos, k_pos = np.array([9, 80, 310], np.int32), np.array([4, 10, 0], np.int32)
    theta, scale = 1e4, 1.0
    o, lse = run_decode(kernels, config, batch, q, rotary_mode, scale, theta, q_pos, k_pos)
    expected = []
    for i in range(batch.batch):
        k, v = batch.visible(i)
        qi = q[i : i + 1]
        if rotary_mode:
            qi, k = ref.rope(qi, q_pos[i : i + 1], theta, scale), ref.rope(k, k_pos[i] + np.arange(len(k)), theta, scale)
        expected.append(ref.attention(qi, k, v, default_sm_scale(head_dim), causal=False))
    check(config, o, lse, expected)


@pytest.mark.parametrize("dtype", slow_except(["float16", "bfloat16", "float32"], "float16", "bfloat16"))
@pytest.mark.parametrize("head_dim", slow_except([64, 128, 256], 64))
def test_paged_decode_cuda_codegen(dtype, head_dim):
    """Every dtype x head dim builds for CUDA (no GPU needed) with 16-byte K/V loads."""
    config = AttentionConfig(16, 2, head_dim, dtype=dtype, target="cuda", sliding_window=head_dim == 64)
    module = tvm.compile(tvm.IRModule({"decode": paged_decode(config)}), target=config.tvm_target())
    cuda_source = module.mod.imports[0].inspect_source()
    assert ("uint4" in cuda_source) or ("float4" in cuda_source)
