"""paged_prefill and ragged_prefill against the float64 reference, CPU and CUDA."""

import zlib

import numpy as np
import pytest
import reference as ref
import tvm
from harness import (PAGED_CASES, device_for, empty, index_view, make_paged_batch, paged_case_id, randn, slow_except,
                     tensor)

from tir_kernels import (
    AttentionConfig,
    PrefillSchedule,
    RopeScaling,
    default_sm_scale,
    paged_prefill,
    ragged_prefill,
)
from tir_kernels.build import PIPELINE
from tir_kernels.schedules import choose_decode_schedule, choose_prefill_schedule

# (num_qo_heads, num_kv_heads, qk_head_dim, v_head_dim, dtype)
RAGGED_CASES = [
    (8, 8, 128, 128, "float16"),
    (16, 4, 192, 128, "bfloat16"),
    (8, 2, 64, 128, "float32"),
    (16, 1, 128, 64, "float16"),
    (32, 8, 256, 256, "float32"),
]


def ragged_case_id(case):
    hq, hkv, dqk, dv, dtype = case
    return f"hq{hq}-hkv{hkv}-dqk{dqk}-dv{dv}-{dtype}"


def requests_for(page_size):
    """(qo_len, kv_len) per request: no history (kv_len == qo_len), history plus new tokens,
    one new token, KV ending on a page boundary, no query, no key, several tiles."""
    return [(37, 37), (20, 100), (1, 50), (min(5, 2 * page_size), 2 * page_size), (0, 10), (3, 0),
            (page_size, 3 * page_size), (70, 150)]


def indptr(lengths):
    return np.cumsum([0, *lengths]).astype(np.int32)


def rope_args(qo_lens, kv_lens):
    """k_rope_pos_offset [B] and q_rope_position [total_q]: new tokens follow the history."""
    k_pos = np.array([3 + 5 * i for i in range(len(kv_lens))], np.int32)
    q_pos = np.concatenate(
        [k_pos[i] + kv - qo + np.arange(qo) for i, (qo, kv) in enumerate(zip(qo_lens, kv_lens))]
    ).astype(np.int32)
    return k_pos, q_pos


def expected(q, qo_indptr, kv_of, sm_scale, causal, rope=None, k_pos=None, q_pos=None):
    """Per-request reference; kv_of(i) -> (k, v); rope = (theta, scale, scaling) or None."""
    out = []
    for i in range(len(qo_indptr) - 1):
        s, e = qo_indptr[i], qo_indptr[i + 1]
        qi, (k, v) = q[s:e], kv_of(i)
        if rope is not None:
            qi = ref.rope(qi, q_pos[s:e], *rope)
            k = ref.rope(k, k_pos[i] + np.arange(len(k)), *rope)
        out.append(ref.attention(qi, k, v, sm_scale, causal))
    return out


def check(config, o, lse, qo_indptr, want, lse_tolerance=ref.LSE_TOLERANCE):
    assert np.isfinite(o).all() and np.isfinite(lse).all(), "unwritten (NaN) or non-finite outputs"
    rtol, atol = ref.TOLERANCES[config.dtype]
    for i, (eo, else_) in enumerate(want):
        s, e = qo_indptr[i], qo_indptr[i + 1]
        np.testing.assert_allclose(o[s:e], eo, rtol=rtol, atol=atol, err_msg=f"o of request {i}")
        np.testing.assert_allclose(lse[s:e], else_, rtol=lse_tolerance[0], atol=lse_tolerance[1],
                                   err_msg=f"lse of request {i}")


def run_paged(kernels, config, batch, q, qo_indptr, causal, rotary_mode=0, rope=(1e4, 1.0), k_pos=None, q_pos=None,
              generator=paged_prefill, extra=()):
    """Run `generator(config, *extra)` (built once per session) on a paged batch; (o, lse) in numpy."""
    dev = device_for(config)
    fn = kernels.get(generator, config, *extra)
    total_q, b = q.shape[0], batch.batch
    o = empty((total_q, config.num_qo_heads, config.head_dim), config.dtype, dev)
    lse = empty((total_q, config.num_qo_heads), "float32", dev)
    k_pos = np.zeros(b, np.int32) if k_pos is None else k_pos
    q_pos = np.zeros(total_q, np.int32) if q_pos is None else q_pos
    theta, scale = rope
    fn(tensor(q, dev), index_view(qo_indptr, dev, offset=5), tensor(batch.pages, dev),
       index_view(batch.page_indptr, dev), index_view(batch.page_indices, dev),
       index_view(batch.length_info(), dev, offset=3), index_view(k_pos, dev, offset=11),
       index_view(q_pos, dev, offset=2), o, lse, int(causal), rotary_mode, scale, theta,
       default_sm_scale(config.head_dim))
    return o.numpy().astype(np.float64), lse.numpy()


def run_ragged(kernels, config, q, qo_indptr, k, v, kv_indptr, causal, rotary_mode=0, rope=(1e4, 1.0), k_pos=None,
               q_pos=None, generator=ragged_prefill, extra=()):
    """Run `generator(config, *extra)` (built once per session) on ragged K/V; (o, lse) in numpy."""
    dev = device_for(config)
    fn = kernels.get(generator, config, *extra)
    total_q, b = q.shape[0], len(qo_indptr) - 1
    o = empty((total_q, config.num_qo_heads, config.v_head_dim), config.dtype, dev)
    lse = empty((total_q, config.num_qo_heads), "float32", dev)
    k_pos = np.zeros(b, np.int32) if k_pos is None else k_pos
    q_pos = np.zeros(total_q, np.int32) if q_pos is None else q_pos
    theta, scale = rope
    fn(tensor(q, dev), index_view(qo_indptr, dev, offset=5), tensor(k, dev), tensor(v, dev),
       index_view(kv_indptr, dev, offset=9), index_view(q_pos, dev, offset=2), index_view(k_pos, dev, offset=11),
       o, lse, int(causal), rotary_mode, scale, theta, default_sm_scale(config.head_dim))
    return o.numpy().astype(np.float64), lse.numpy()


def paged_inputs(rng, config, requests):
    """A paged batch whose request i has requests[i][1] visible tokens, and the packed queries."""
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
    q = randn(rng, (sum(qo_lens), config.num_qo_heads, d), config.dtype)
    return batch, q, indptr(qo_lens)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
# The default tier: fp32 at page size 1, bf16, a sliding window at GQA 8; -m slow: every case.
@pytest.mark.parametrize("case", slow_except(PAGED_CASES, (8, 4, 64, 1, "float32", False), (8, 2, 128, 16, "bfloat16", False),
                                             (8, 1, 128, 16, "float16", True)), ids=paged_case_id)
def test_paged_prefill(kernels, target, case, causal):
    hq, hkv, d, ps, dtype, sliding = case
    config = AttentionConfig(hq, hkv, d, dtype=dtype, page_size=ps, target=target, sliding_window=sliding)
    rng = np.random.default_rng(zlib.crc32(paged_case_id(case).encode()))
    requests = requests_for(ps)
    batch, q, qo_indptr = paged_inputs(rng, config, requests)
    assert [len(batch.visible(i)[0]) for i in range(batch.batch)] == [kv for _, kv in requests]
    o, lse = run_paged(kernels, config, batch, q, qo_indptr, causal)
    check(config, o, lse, qo_indptr, expected(q, qo_indptr, batch.visible, default_sm_scale(d), causal))


@pytest.mark.parametrize("scaling", [None, RopeScaling(8.0, 1.0, 4.0, 64)], ids=["rope", "llama3-rope"])
def test_paged_prefill_inline_rope(kernels, target, scaling):
    """rotary_mode=1: q rotated at q_rope_position, key j at k_rope_pos_offset + j."""
    config = AttentionConfig(8, 4, 64, dtype="float32", page_size=1, target=target, rope_scaling=scaling)
    rng = np.random.default_rng(11)
    requests = [(9, 9), (12, 40), (1, 33)]
    batch, q, qo_indptr = paged_inputs(rng, config, requests)
    k_pos, q_pos = rope_args(*zip(*requests))
    rope = (5e5, 0.5)
    o, lse = run_paged(kernels, config, batch, q, qo_indptr, True, 1, rope, k_pos, q_pos)
    want = expected(q, qo_indptr, batch.visible, default_sm_scale(64), True, (*rope, scaling), k_pos, q_pos)
    check(config, o, lse, qo_indptr, want)


def ragged_inputs(rng, config, requests):
    hkv, dqk, dv, dtype = config.num_kv_heads, config.head_dim, config.v_head_dim, config.dtype
    qo_lens, kv_lens = [qo for qo, _ in requests], [kv for _, kv in requests]
    q = randn(rng, (sum(qo_lens), config.num_qo_heads, dqk), dtype)
    k = randn(rng, (sum(kv_lens), hkv, dqk), dtype)
    v = randn(rng, (sum(kv_lens), hkv, dv), dtype)
    return q, indptr(qo_lens), k, v, indptr(kv_lens)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("case", slow_except(RAGGED_CASES, (16, 4, 192, 128, "bfloat16"), (8, 2, 64, 128, "float32")),
                         ids=ragged_case_id)
def test_ragged_prefill(kernels, target, case, causal):
    hq, hkv, dqk, dv, dtype = case
    config = AttentionConfig(hq, hkv, dqk, v_head_dim=dv, dtype=dtype, target=target)
    rng = np.random.default_rng(zlib.crc32(ragged_case_id(case).encode()))
    q, qo_indptr, k, v, kv_indptr = ragged_inputs(rng, config, requests_for(16))
    o, lse = run_ragged(kernels, config, q, qo_indptr, k, v, kv_indptr, causal)
    kv_of = lambda i: (k[kv_indptr[i] : kv_indptr[i + 1]], v[kv_indptr[i] : kv_indptr[i + 1]])  # noqa: E731
    check(config, o, lse, qo_indptr, expected(q, qo_indptr, kv_of, default_sm_scale(dqk), causal))


@pytest.mark.parametrize("scaling", [None, RopeScaling(8.0, 1.0, 4.0, 64)], ids=["rope", "llama3-rope"])
def test_ragged_prefill_inline_rope(kernels, target, scaling):
    config = AttentionConfig(8, 2, 64, v_head_dim=128, dtype="float32", target=target, rope_scaling=scaling)
    rng = np.random.default_rng(5)
    requests = [(9, 9), (12, 40), (1, 33)]
    q, qo_indptr, k, v, kv_indptr = ragged_inputs(rng, config, requests)
    k_pos, q_pos = rope_args(*zip(*requests))
    rope = (5e5, 0.5)
    o, lse = run_ragged(kernels, config, q, qo_indptr, k, v, kv_indptr, True, 1, rope, k_pos, q_pos)
    kv_of = lambda i: (k[kv_indptr[i] : kv_indptr[i + 1]], v[kv_indptr[i] : kv_indptr[i + 1]])  # noqa: E731
    want = expected(q, qo_indptr, kv_of, default_sm_scale(64), True, (*rope, scaling), k_pos, q_pos)
    check(config, o, lse, qo_indptr, want)


@pytest.mark.gpu
@pytest.mark.parametrize("requests", [[(1000, 1000)], [(300, 300), (1, 700), (130, 900), (517, 517)]],
                         ids=["one-long", "mixed"])
def test_paged_prefill_long(kernels, requests):
    """The benchmark shape (32 q / 8 kv heads, d128, fp16, page 16) with many tiles per request."""
    config = AttentionConfig(32, 8, 128, dtype="float16", page_size=16, target="cuda")
    rng = np.random.default_rng(len(requests))
    batch, q, qo_indptr = paged_inputs(rng, config, requests)
    for causal in (True, False):
        o, lse = run_paged(kernels, config, batch, q, qo_indptr, causal)
        check(config, o, lse, qo_indptr, expected(q, qo_indptr, batch.visible, default_sm_scale(128), causal))


# Configurations whose CUDA variants must generate code on a GPU-less machine (CI catches
# codegen crashes here; the GPU tests above check the results).
CUDA_BUILD_CASES = [
    pytest.param(paged_prefill, AttentionConfig(32, 8, 128, dtype="float16", page_size=16, target="cuda"),
                 "batch_prefill_paged_kv", id="paged-fp16-d128"),
    pytest.param(paged_prefill, AttentionConfig(16, 2, 256, dtype="bfloat16", page_size=1, target="cuda",
                                                sliding_window=True),
                 "batch_prefill_paged_kv_sliding_window", id="paged-bf16-d256-sliding"),
    pytest.param(ragged_prefill, AttentionConfig(16, 4, 192, v_head_dim=128, dtype="float32", target="cuda"),
                 "batch_prefill_ragged_kv", id="ragged-fp32-d192-128"),
]


@pytest.mark.parametrize("generator,config,symbol", CUDA_BUILD_CASES)
def test_prefill_builds_for_cuda(generator, config, symbol):
    """CUDA code generation succeeds for both CUDA kernels: the CUDA-core one (K/V and Q move in
    16-byte vectors, rows reduce by shuffles) and, where it applies, the Hopper tensor-core one."""
    func = generator(config, choose_prefill_schedule(config))
    assert func.attrs["global_symbol"] == symbol
    module = tvm.compile(tvm.IRModule({symbol: func}), target=config.tvm_target(), tir_pipeline=PIPELINE)
    cuda = module.mod.imports[0].inspect_source()
    assert "__shfl_xor_sync" in cuda
    assert ("uint4" if config.elem_bytes == 2 else "float4") in cuda
    if config.dtype == "float32":
        return
    func = generator(config)
    assert func.attrs["global_symbol"] == symbol
    module = tvm.compile(tvm.IRModule({symbol: func}), target=config.tvm_target(), tir_pipeline=PIPELINE)
    cuda = module.mod.imports[0].inspect_source()
    assert "wgmma.mma_async" in cuda and "cp.async.cg.shared.global" in cuda and "mbarrier" in cuda


def test_prefill_schedule_validation():
    with pytest.raises(ValueError, match="v_head_dim"):
        paged_prefill(AttentionConfig(8, 2, 64, v_head_dim=128))
    with pytest.raises(ValueError, match="threads_x"):
        PrefillSchedule(threads_y=4, threads_x=3, rows_per_thread=4, cols_per_thread=4)
    with pytest.raises(ValueError, match="cols_per_thread"):
        PrefillSchedule(threads_y=1, threads_x=1, rows_per_thread=4, cols_per_thread=3)
    gpu = AttentionConfig(8, 2, 128, target="cuda")
    with pytest.raises(ValueError, match="shared memory"):
        paged_prefill(gpu, PrefillSchedule(threads_y=16, threads_x=8, rows_per_thread=16, cols_per_thread=16))
    with pytest.raises(ValueError, match="threads_x"):
        ragged_prefill(gpu.replace(v_head_dim=16), PrefillSchedule(threads_y=16, threads_x=8, rows_per_thread=4,
                                                                   cols_per_thread=4))
    with pytest.raises(ValueError, match="must be 1 on the CPU"):
        paged_prefill(AttentionConfig(8, 2, 64), PrefillSchedule(threads_y=4, threads_x=8, rows_per_thread=4,
                                                                 cols_per_thread=4))


# CPU schedules: the scalar tile (inline RoPE and FP8 pages take it) and the vectorized one at
# tiles of 12 (8-row O blocks do not divide it), 16 (the default) and 32 packed rows, scores a row
# or a pair of rows at a time; GQA groups of 4 (Gemma 3's head dim 256) and 3 (tiles that split a
# token's heads).
CPU_SCALAR = PrefillSchedule(threads_y=1, threads_x=1, rows_per_thread=16, cols_per_thread=32)
CPU_VECTOR = [PrefillSchedule(threads_y=1, threads_x=1, rows_per_thread=r, cols_per_thread=16, vector_lanes=16,
                              score_rows=s) for r, s in ((12, 2), (16, 1), (16, 2), (32, 2))]
CPU_SCHEDULE_CASES = slow_except(
    [(CPU_SCALAR, 4, 1, 256, "float32"), (CPU_VECTOR[0], 6, 2, 64, "float16"), (CPU_VECTOR[1], 6, 2, 128, "float32"),
     (CPU_VECTOR[2], 4, 1, 256, "float32"), (CPU_VECTOR[3], 4, 1, 256, "float32"),
     (CPU_VECTOR[0], 4, 1, 256, "bfloat16")], first=3)


def cpu_schedule_id(case):
    sched, hq, hkv, d, dtype = case
    kind = f"vector{sched.rows_per_thread}x{sched.score_rows}" if sched.vector_lanes else "scalar"
    return f"{kind}-hq{hq}-hkv{hkv}-d{d}-{dtype}"


@pytest.mark.parametrize("case", CPU_SCHEDULE_CASES, ids=cpu_schedule_id)
def test_cpu_prefill_schedules(kernels, case):
    """Both CPU algorithms (scalar tile, vectorized) against the reference, paged and ragged,
    causal and not; with a request whose first queries see no key (o = 0, EMPTY_LSE) beside
    queries that do, in the same tile."""
    sched, hq, hkv, d, dtype = case
    config = AttentionConfig(hq, hkv, d, dtype=dtype, page_size=16, target="llvm")
    rng = np.random.default_rng(zlib.crc32(cpu_schedule_id(case).encode()))
    requests = requests_for(16) + [(20, 10)]
    batch, q, qo_indptr = paged_inputs(rng, config, requests)
    rq, r_indptr, k, v, kv_indptr = ragged_inputs(rng, config, requests)
    kv_of = lambda i: (k[kv_indptr[i] : kv_indptr[i + 1]], v[kv_indptr[i] : kv_indptr[i + 1]])  # noqa: E731
    for causal in (True, False):
        o, lse = run_paged(kernels, config, batch, q, qo_indptr, causal, extra=(sched,))
        check(config, o, lse, qo_indptr, expected(q, qo_indptr, batch.visible, default_sm_scale(d), causal))
        o, lse = run_ragged(kernels, config, rq, r_indptr, k, v, kv_indptr, causal, extra=(sched,))
        check(config, o, lse, r_indptr, expected(rq, r_indptr, kv_of, default_sm_scale(d), causal))


def test_cpu_prefill_schedule_choice():
    """The CPU default is the vectorized algorithm (16 packed rows, 16 keys a step) except over FP8
    pages (the scalar tile dequantizes as it stages); vector_lanes is checked."""
    config = AttentionConfig(4, 1, 256, dtype="float32")
    assert choose_prefill_schedule(config) == PrefillSchedule(threads_y=1, threads_x=1, rows_per_thread=16,
                                                              cols_per_thread=16, vector_lanes=16, score_rows=2)
    assert choose_prefill_schedule(config.replace(head_dim=64)).score_rows == 1
    assert choose_prefill_schedule(config.replace(dtype="float16", kv_dtype="float8_e4m3fn")).vector_lanes == 0
    with pytest.raises(ValueError, match="vector_lanes=8 must be 0 or 16"):
        PrefillSchedule(threads_y=1, threads_x=1, rows_per_thread=16, cols_per_thread=8, vector_lanes=8)
    with pytest.raises(ValueError, match="cols_per_thread=16"):
        PrefillSchedule(threads_y=1, threads_x=1, rows_per_thread=16, cols_per_thread=32, vector_lanes=16)
    with pytest.raises(ValueError, match="score_rows=2 must be 1, or 2 with vector_lanes"):
        PrefillSchedule(threads_y=1, threads_x=1, rows_per_thread=15, cols_per_thread=16, vector_lanes=16,
                        score_rows=2)
    with pytest.raises(ValueError, match="score_rows=2 must be 1, or 2 with vector_lanes"):
        PrefillSchedule(threads_y=1, threads_x=1, rows_per_thread=16, cols_per_thread=32, score_rows=2)
    with pytest.raises(ValueError, match="is for the CPU"):
        paged_prefill(config.replace(target="cuda", dtype="float16"),
                      PrefillSchedule(threads_y=1, threads_x=1, rows_per_thread=16, cols_per_thread=16,
                                      vector_lanes=16))
    with pytest.raises(ValueError, match="reads no FP8 pages"):
        paged_prefill(config.replace(dtype="float16", kv_dtype="float8_e4m3fn"), CPU_VECTOR[2])


@pytest.mark.parametrize("arch", ["sm_90", "sm_89"])  # sm_89: 99 KiB of shared memory per block
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("head_dim,v_head_dim", [(d, d) for d in range(16, 257, 16)] + [(192, 128), (128, 16)])
def test_default_cuda_schedules_fit_every_head_dim(dtype, head_dim, v_head_dim, arch):
    """The default CUDA schedules are valid for every head-dim pair a config accepts."""
    config = AttentionConfig(32, 8, head_dim, v_head_dim=v_head_dim, dtype=dtype, target=f"cuda:{arch}")
    choose_prefill_schedule(config).check(config)
    decode_config = config.replace(v_head_dim=head_dim)
    choose_decode_schedule(decode_config).check(decode_config)
