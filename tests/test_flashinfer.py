"""The FlashInfer backend: plan and run arguments, views, fallbacks and errors (CPU, with fake
plan/run callables; no flashinfer package needed), and on a GPU with built modules the cache
scenarios of test_cache.py against the same float64 references.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import tvm
from harness import empty, has_gpu, randn, tensor

from tir_kernels import default_sm_scale
from tvmattn import KVCacheError, PagedKVCache
from tvmattn.flashinfer import FlashInferConfig, available, modules
from tvmattn.flashinfer.build import _rename_exports
from tvmattn.runtime.backend_choice import attention_kernels, config_for, why_not
from tvmattn.flashinfer.views import paged_kv_views, rebased
from tvmattn.runtime.backends import (FlashInferPagedDecode, FlashInferPagedPrefill, FlashInferRaggedPrefill,
                                      FlashInferTensorCoreDecode, FlashInferWorkspace, PagedDecode, PagedPrefill,
                                      RaggedPrefill, RopeMode, backend_from_spec)
from tvmattn.runtime.cache import CacheOptions

HQ, HKV, D, PAGE = 4, 2, 64, 4
THETA, SCALE = 1e4, 0.5


class Recorder:
    """Fake plan/run functions: plan returns a fresh token (its call number) and both record
    their arguments."""

    def __init__(self):
        self.plans, self.runs = [], []

    def plan(self, *args):
        self.plans.append(args)
        return ["plan", len(self.plans) - 1]

    def run(self, *args):
        self.runs.append(args)


def fake_cache(rope_mode="normal", **options):
    rec = {slot: Recorder() for slot in ("prefill_ragged", "prefill_paged", "decode_paged")}
    kernels = {slot: ["flashinfer", r.run, r.plan] for slot, r in rec.items()}
    cache = PagedKVCache(num_layers=2, num_qo_heads=HQ, num_kv_heads=HKV, qk_head_dim=D, page_size=PAGE,
                         max_num_sequences=8, max_total_seq_len=256, prefill_chunk_size=64, rope_mode=rope_mode,
                         rope_theta=THETA, rope_scale=SCALE, kernels=kernels, **options)
    return cache, rec


def host(t) -> np.ndarray:
    return np.from_dlpack(t) if t.is_contiguous() is False else t.numpy()


def fused_qkv(cache, n, layers=(0,)):
    """attention_with_fused_qkv of `layers` (end_forward keeps a step once both layers ran)."""
    rng = np.random.default_rng(0)
    qkv = tensor(randn(rng, (n, HQ + 2 * HKV, D), "float16"), tvm.cpu())
    o = empty((n, HQ, D), "float16", tvm.cpu())
    for layer in layers:
        cache.attention_with_fused_qkv(layer, 0.125, qkv, o)


def test_views_rebase_and_split_the_pool():
    base = tvm.runtime.tensor(np.arange(40, dtype=np.int32))
    view = base._create_view((5,), "int32", 12)  # a non-zero byte offset, as the cache's index arrays
    re = rebased(view)
    assert re.data_ptr() == view.data_ptr() and tuple(re.shape) == (5,)
    np.testing.assert_array_equal(host(re), [3, 4, 5, 6, 7])
    pool = np.arange(3 * 2 * HKV * PAGE * 8, dtype=np.float16).reshape(3, 2, HKV, PAGE, 8)
    pages = tvm.runtime.tensor(pool)
    k, v = paged_kv_views(pages)
    assert tuple(k.strides) == tuple(v.strides) == (2 * HKV * PAGE * 8, PAGE * 8, 8, 1)
    assert v.data_ptr() - k.data_ptr() == HKV * PAGE * 8 * 2 and k.data_ptr() == pages.data_ptr()
    np.testing.assert_array_equal(host(k), pool[:, 0])
    np.testing.assert_array_equal(host(v), pool[:, 1])
    with pytest.raises(ValueError, match="pages must be"):
        paged_kv_views(tvm.runtime.tensor(np.zeros((3, 4), np.float16)))


def test_prefill_plans_and_runs_in_attn_backend_order():
    cache, rec = fake_cache()
    cache.add_sequence(0)
    cache.add_sequence(1)
    cache.begin_forward([0, 1], [5, 3])  # no history: the ragged part only
    ragged = rec["prefill_ragged"]
    (args,) = ragged.plans
    ws = cache._flashinfer_workspace
    assert args[0] is ws.float and args[1] is ws.slot(0)[1] and args[2] is ws.slot(0)[2]
    np.testing.assert_array_equal(args[3].numpy(), [0, 5, 8])  # qo_indptr
    np.testing.assert_array_equal(args[4].numpy(), [0, 5, 8])  # kv_indptr
    np.testing.assert_array_equal(args[5].numpy(), [5, 3])  # kv_len
    assert args[6:] == (8, 2, HQ, HKV, 1, False, D, D, True, -1, -1, False, 0, 0)
    assert rec["prefill_paged"].plans == [] and rec["decode_paged"].plans == []
    fused_qkv(cache, 8)
    (run,) = ragged.runs
    assert run[0] is ws.float and run[1] is ws.slot(0)[1] and run[2] == ["plan", 0]
    np.testing.assert_array_equal(host(run[6]), [0, 5, 8])
    np.testing.assert_array_equal(host(run[7]), [0, 5, 8])
    assert run[10:] == (1, 0, -1, False, 0.125, 1 / SCALE, 1 / THETA)
    fused_qkv(cache, 8, layers=(1,))
    cache.end_forward()

    cache.begin_forward([0, 1], [2, 4])  # now with history: ragged + a paged prefill level
    (paged,) = rec["prefill_paged"].plans
    assert paged[0] is ws.float and paged[1] is ws.slot(1)[1]
    np.testing.assert_array_equal(paged[3].numpy(), [0, 2, 6])  # qo_indptr
    np.testing.assert_array_equal(paged[4].numpy(), [0, 2, 3])  # page_indptr: 5 and 3 tokens in pages of 4
    np.testing.assert_array_equal(paged[5].numpy(), [5, 3])  # kv_len
    assert paged[6:] == (6, 2, HQ, HKV, PAGE, False, D, D, False, -1, -1, False, 0, 0)
    fused_qkv(cache, 6)
    (run,) = rec["prefill_paged"].runs
    pool = cache._pools[0]
    assert run[2] == ["plan", 0] and run[3] is not None
    assert run[4].data_ptr() == pool.data_ptr() and tuple(run[4].shape) == (int(pool.shape[0]), HKV, PAGE, D)
    np.testing.assert_array_equal(host(run[6]), [0, 2, 6])
    np.testing.assert_array_equal(host(run[7]), [0, 2, 3])
    np.testing.assert_array_equal(host(run[9]), [1, 3])  # last_page_len
    assert run[12:] == (0, 1, -1, False, 0.125, 1 / SCALE, 1 / THETA)


def test_decode_plan_once_per_forward_and_depth_with_cascade():
    cache, rec = fake_cache()
    cache.add_sequence(0)
    cache.begin_forward([0], [40])
    fused_qkv(cache, 40, layers=(0, 1))
    cache.end_forward()
    cache.fork_sequence(0, 1)
    cache.fork_sequence(0, 2)
    cache.begin_forward([1, 2], [1, 1])  # a shared level (paged prefill, depth 0) + own pages (decode, depth 1)
    plan = cache.current_plan()
    assert [level.kernel for level in plan.host.fused] == ["prefill", "decode"]
    ws = cache._flashinfer_workspace
    (shared,) = rec["prefill_paged"].plans
    (dec,) = rec["decode_paged"].plans
    assert shared[1] is ws.slot(1)[1] and dec[1] is ws.slot(2)[1]
    np.testing.assert_array_equal(dec[3].numpy(), plan.host.fused[1].page_indptr)
    assert dec[4:11] == (2, HQ, HKV, PAGE, False, -1, 0.0) and dec[11:13] == (D, D)
    assert str(dec[13].dtype) == "float16" and tuple(dec[13].shape) == (0,)
    fused_qkv(cache, 2)
    assert len(rec["prefill_paged"].plans) == 1 and len(rec["decode_paged"].plans) == 1, "one plan per depth"
    (drun,) = rec["decode_paged"].runs
    assert drun[2] == ["plan", 0] and drun[11:] == (1, -1, False, 0.125, 1 / SCALE, 1 / THETA)
    np.testing.assert_array_equal(host(drun[8]), plan.host.fused[1].length_info)
    # cross_attention plans its own levels (after the fused depths) on first use, once
    q = tensor(randn(np.random.default_rng(1), (2, HQ, D), "float16"), tvm.cpu())
    o, lse = empty((2, HQ, D), "float16", tvm.cpu()), empty((2, HQ), "float32", tvm.cpu())
    cache.cross_attention(0, 0.125, q, o, lse)
    cache.cross_attention(1, 0.125, q, o, lse)
    assert len(rec["decode_paged"].plans) == 2 and rec["decode_paged"].plans[1][1] is ws.slot(4)[1]
    assert rec["decode_paged"].runs[-1][2] == ["plan", 1]


def test_self_attention_in_a_decode_step_plans_the_ragged_prefill():
    """A decode step plans no ragged prefill; self_attention plans it (once) instead of running
    the last prefill's plan, and plans of earlier forwards are forgotten."""
    cache, rec = fake_cache()
    cache.add_sequence(0)
    cache.add_sequence(1)
    for lengths in ([5, 3], [2, 2]):  # the second plans a paged prefill level (depth 0) too
        cache.begin_forward([0, 1], lengths)
        fused_qkv(cache, sum(lengths), layers=(0, 1))
        cache.end_forward()
    assert len(rec["prefill_paged"].plans) == 1
    cache.begin_forward([0, 1], [1, 1])
    ragged = rec["prefill_ragged"]
    assert len(ragged.plans) == 2
    rng = np.random.default_rng(2)
    q, k, v = (tensor(randn(rng, (2, h, D), "float16"), tvm.cpu()) for h in (HQ, HKV, HKV))
    o, lse = empty((2, HQ, D), "float16", tvm.cpu()), empty((2, HQ), "float32", tvm.cpu())
    for layer in (0, 1):
        cache.self_attention(layer, 0.125, q, k, v, o, lse)
    assert len(ragged.plans) == 3, "planned once, on the first self_attention"
    np.testing.assert_array_equal(ragged.plans[2][3].numpy(), [0, 1, 2])
    assert ragged.plans[2][6:8] == (2, 2)
    assert [run[2] for run in ragged.runs[-2:]] == [["plan", 2], ["plan", 2]]
    with pytest.raises(KVCacheError, match="no plan for depth 0"):
        cache._step_kernels.paged_prefill._planned(0)  # the last forward's plans are gone


def test_tensor_core_decode_plans_a_prefill():
    rec = Recorder()
    backend = FlashInferTensorCoreDecode(rec.run, rec.plan)
    backend.bind(FlashInferWorkspace(tvm.cpu(), float_bytes=64, int_bytes=64))
    backend.begin_forward(0, np.array([0, 3, 5], np.int32), 2, 16, 32, 8, 128, 128, RopeMode.NORMAL, "float16",
                          "float16")
    (args,) = rec.plans
    np.testing.assert_array_equal(args[3].numpy(), [0, 1, 2])
    np.testing.assert_array_equal(args[5].numpy(), [48, 32])
    assert args[6:] == (2, 2, 32, 8, 16, False, 128, 128, False, -1, -1, False, 0, 0)
    pages = tvm.runtime.tensor(np.zeros((6, 2, 8, 16, 128), np.float16))
    idx = tvm.runtime.tensor(np.array([0, 3, 5], np.int32))
    backend.mha(0, "q", pages, idx, idx, idx, None, None, RopeMode.NORMAL, 1.0, 5e5, 0.1, "o", "lse")
    (run,) = rec.runs
    np.testing.assert_array_equal(host(run[6]), [0, 1, 2])
    assert run[12:] == (0, 1, -1, False, 0.1, 1.0, 1 / 5e5)


def test_specs_and_workspace_errors():
    f = tvm.get_global_func("runtime.GetDeviceAttr")
    for role, cls in ((PagedPrefill, FlashInferPagedPrefill), (RaggedPrefill, FlashInferRaggedPrefill),
                      (PagedDecode, FlashInferPagedDecode)):
        backend = backend_from_spec(["flashinfer", f, f], role)
        assert isinstance(backend, cls) and backend.kind == "flashinfer"
    ragged = backend_from_spec(["flashinfer", f, f, 192, 128], RaggedPrefill)
    assert (ragged.qk_head_dim_override, ragged.v_head_dim_override) == (192, 128)
    with pytest.raises(KVCacheError, match="must be functions"):
        backend_from_spec(["flashinfer", 1, f], PagedDecode)
    with pytest.raises(KVCacheError, match="no workspace bound"):
        backend.begin_forward(0, np.array([0, 1], np.int32), 1, 16, 4, 2, 64, 64, RopeMode.NONE, "float16", "float16")
    with pytest.raises(KVCacheError, match="no plan for depth 3"):
        backend._planned(3)


def _options(**kw):
    return CacheOptions(**{"num_layers": 1, "num_qo_heads": 32, "num_kv_heads": 8, "qk_head_dim": 128, **kw})


def test_fallback_reasons():
    assert why_not(_options(), "cuda:sm_90a") is None
    assert why_not(_options(), "cuda:sm_80") is None
    assert "not a CUDA GPU" in why_not(_options(), "llvm")
    assert "sm_80 or newer" in why_not(_options(), "cuda:sm_75")
    assert "sliding windows" in why_not(_options(support_sliding_window=True), "cuda:sm_90a")
    assert "inline" in why_not(_options(rope_mode="inline"), "cuda:sm_90a")
    assert "head dim 96" in why_not(_options(qk_head_dim=96), "cuda:sm_90a")
    assert "float32" in why_not(_options(dtype="float32"), "cuda:sm_90a")
    assert config_for(_options(), "cuda:sm_90").arch == "sm_90a"


def test_cpu_cache_falls_back_to_tir_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="tvmattn.flashinfer"):
        cache = PagedKVCache(num_layers=1, num_qo_heads=HQ, num_kv_heads=HKV, qk_head_dim=D, page_size=PAGE,
                             max_total_seq_len=64, prefill_chunk_size=16, backend="flashinfer")
    assert cache.backend == "tir" and cache._flashinfer_workspace is None
    assert "falling back to tvmattn's TIR kernels: the device is not a CUDA GPU" in caplog.text
    assert cache.kernels.decode_paged[0] == "tirx"


def test_missing_modules_and_bad_backend_are_errors(tmp_path):
    with pytest.raises(KVCacheError, match=r"not built .*python -m tvmattn.flashinfer.build --dtype float16 "
                                           r"--head-dim 128 --arch sm_90a"):
        attention_kernels("flashinfer", _options(), "cuda:sm_90a", None, base=tmp_path)
    with pytest.raises(KVCacheError, match="backend must be one of"):
        attention_kernels("cutlass", _options(), "cuda:sm_90a", None)
    with pytest.raises(KVCacheError, match="backend must be one of"):
        PagedKVCache(num_layers=1, num_qo_heads=HQ, num_kv_heads=HKV, qk_head_dim=D, backend="triton")
    assert attention_kernels("tir", _options(), "cuda:sm_90a", {"x": 1}) == ("tir", {"x": 1})


def test_config_keys_and_export_renaming(tmp_path):
    config = FlashInferConfig()
    assert config.key() == FlashInferConfig().key() != FlashInferConfig(dtype="bfloat16").key()
    assert config.cuda_arch_list() == "9.0" and FlashInferConfig(arch="sm_80").cuda_arch_list() == "8.0"
    assert config.problem() is None and "sm_80" in FlashInferConfig(arch="sm_75").problem()
    assert not available(config, base=tmp_path)
    binding = tmp_path / "x_binding.cu"
    binding.write_text("TVM_FFI_DLL_EXPORT_TYPED_FUNC(plan, Plan);\nTVM_FFI_DLL_EXPORT_TYPED_FUNC(run, Run);\n")
    for _ in range(2):  # idempotent
        _rename_exports([binding], "batch_decode")
    assert binding.read_text() == ("TVM_FFI_DLL_EXPORT_TYPED_FUNC(batch_decode_plan, Plan);\n"
                                   "TVM_FFI_DLL_EXPORT_TYPED_FUNC(batch_decode_run, Run);\n")


BUILT = available(FlashInferConfig())


@pytest.mark.skipif(not BUILT, reason="FlashInfer modules not built (python -m tvmattn.flashinfer.build)")
def test_built_modules_load_without_flashinfer():
    """The built modules load with tvm_ffi alone and export TVM's function names."""
    dec = modules.load(FlashInferConfig(), "decode")
    pre = modules.load(FlashInferConfig(), "prefill_fa2")
    assert all(callable(f) for f in (dec.plan, dec.run, pre.plan, pre.ragged_run, pre.paged_run))
    assert modules.manifest(FlashInferConfig())["tvm_ffi"]


# -- CPU: the same scenarios with numpy stand-ins for FlashInfer's run functions (float64
# attention computed from exactly the arguments the backends pass: the K/V views, the re-based
# index arrays, HND pages, base-2 LSE), which checks the wiring end to end without a GPU.


def _emu_np(t):
    return np.from_dlpack(t)


def _emu_attend(q, k, v, sm, causal):
    # q [n, Hq, D], k/v [L, Hkv, D]
    n, hq, d = q.shape
    L, hkv, _ = k.shape
    g = hq // hkv
    o = np.zeros((n, hq, d)); lse = np.full((n, hq), -np.inf)
    if L == 0:
        return o, lse
    for h in range(hq):
        s = q[:, h].astype(np.float64) @ k[:, h // g].astype(np.float64).T * sm
        if causal:
            s = np.where(np.arange(L)[None, :] <= (L - n + np.arange(n))[:, None], s, -np.inf)
        m = s.max(axis=1, keepdims=True)
        e = np.exp(s - m)
        o[:, h] = e @ v[:, h // g].astype(np.float64) / e.sum(1, keepdims=True)
        lse[:, h] = (m[:, 0] + np.log(e.sum(1))) / np.log(2)
    return o, lse


def _emu_plan(*args):
    return ["emu-plan"]


def _emu_pages(kc, vc, pages, last, ps):
    k = kc[pages].transpose(0, 2, 1, 3).reshape(-1, kc.shape[1], kc.shape[3])
    v = vc[pages].transpose(0, 2, 1, 3).reshape(-1, kc.shape[1], kc.shape[3])
    n = (len(pages) - 1) * ps + last if len(pages) else 0
    return k[:n], v[:n]


def _emu_paged_run(fw, iw, info, q, kc, vc, qo_indptr, indptr, indices, last, o, lse, mask, layout, wl, pdl, sm, rs, rt):
    q, kc, vc, o, lse = _emu_np(q), _emu_np(kc), _emu_np(vc), _emu_np(o), _emu_np(lse)
    qo, ip, idx, lp = _emu_np(qo_indptr), _emu_np(indptr), _emu_np(indices), _emu_np(last)
    for b in range(len(ip) - 1):
        k, v = _emu_pages(kc, vc, idx[ip[b]:ip[b + 1]], lp[b], kc.shape[2])
        ob, lb = _emu_attend(q[qo[b]:qo[b + 1]], k, v, sm, mask == 1)
        o[qo[b]:qo[b + 1]] = ob
        lse[qo[b]:qo[b + 1]] = lb


def _emu_decode_run(fw, iw, info, q, kc, vc, indptr, indices, last, o, lse, layout, wl, pdl, sm, rs, rt):
    q, kc, vc, o, lse = _emu_np(q), _emu_np(kc), _emu_np(vc), _emu_np(o), _emu_np(lse)
    ip, idx, lp = _emu_np(indptr), _emu_np(indices), _emu_np(last)
    for b in range(len(ip) - 1):
        k, v = _emu_pages(kc, vc, idx[ip[b]:ip[b + 1]], lp[b], kc.shape[2])
        ob, lb = _emu_attend(q[b:b + 1], k, v, sm, False)
        o[b:b + 1] = ob
        lse[b:b + 1] = lb


def _emu_ragged_run(fw, iw, info, q, k, v, qo_indptr, kv_indptr, o, lse, mask, layout, wl, pdl, sm, rs, rt):
    q, k, v, o, lse = _emu_np(q), _emu_np(k), _emu_np(v), _emu_np(o), _emu_np(lse)
    qo, kv = _emu_np(qo_indptr), _emu_np(kv_indptr)
    for b in range(len(qo) - 1):
        ob, lb = _emu_attend(q[qo[b]:qo[b + 1]], k[kv[b]:kv[b + 1]], v[kv[b]:kv[b + 1]], sm, mask == 1)
        o[qo[b]:qo[b + 1]] = ob
        lse[qo[b]:qo[b + 1]] = lb


EMULATED = {"prefill_ragged": ["flashinfer", _emu_ragged_run, _emu_plan],
            "prefill_paged": ["flashinfer", _emu_paged_run, _emu_plan],
            "decode_paged": ["flashinfer", _emu_decode_run, _emu_plan]}


def _set_heads(monkeypatch, tc, heads: int, kv_heads: int, head_dim: int) -> None:
    """test_cache's model shape for this test: query heads, KV heads, head dim (and its softmax scale)."""
    monkeypatch.setattr(tc, "HQ", heads)
    monkeypatch.setattr(tc, "HKV", kv_heads)
    monkeypatch.setattr(tc, "D", head_dim)
    monkeypatch.setattr(tc, "SM_SCALE", default_sm_scale(head_dim))


@pytest.fixture
def emulated_model(monkeypatch):
    import test_cache as tc

    _set_heads(monkeypatch, tc, 8, 2, 128)

    def make(rope_mode="none", page_size=16, seed=0, **options):
        return tc.Model("llvm", rope_mode, page_size=page_size, seed=seed, kernels=dict(EMULATED), **options)

    return tc, make


@pytest.mark.parametrize("rope_mode", ["none", "normal"])
def test_emulated_flashinfer_scenarios(emulated_model, rope_mode):
    _scenario(emulated_model, rope_mode)


def test_emulated_flashinfer_self_and_cross(emulated_model):
    _self_and_cross(emulated_model)


# -- GPU: the cache scenarios of test_cache.py with the FlashInfer backend (fp16, d128)

GPU_KINDS = [pytest.param(("cuda_core", "fa2", 128), id="fa2-cudacore"),
             pytest.param(("tensor_core", "fa2", 128), id="fa2-tensorcore"),
             pytest.param(("cuda_core", "fa3", 128), id="fa3-cudacore"),
             pytest.param(("tensor_core", "fa3", 128), id="fa3-tensorcore"),
             pytest.param(("cuda_core", "fa2", 64), id="fa2-cudacore-d64"),  # SmolLM2's head dim and group
             pytest.param(("cuda_core", "fa3", 64), id="fa3-cudacore-d64")]
GPU_HEADS = {128: (8, 2), 64: (9, 3)}  # head dim -> (query heads, KV heads) of the test model


@pytest.fixture
def fi_model(monkeypatch, request):
    """test_cache.Model on CUDA with FlashInfer kernels (8/2 heads at d128, 9/3 at d64)."""
    if not has_gpu():
        pytest.skip("no GPU")
    decode, prefill, head_dim = request.param
    config = FlashInferConfig(qk_head_dim=head_dim, v_head_dim=head_dim)
    kinds = ["decode", f"prefill_{prefill}"]
    if not available(config, kinds):
        pytest.skip(f"FlashInfer modules {kinds} not built")
    import test_cache as tc

    from tvmattn.runtime.backend_choice import flashinfer_specs

    _set_heads(monkeypatch, tc, *GPU_HEADS[head_dim], head_dim)

    def make(rope_mode="none", page_size=16, seed=0, **options):
        m = tc.Model("cuda", rope_mode, page_size=page_size, seed=seed,
                     kernels=flashinfer_specs(config, decode=decode, prefill=prefill), **options)
        assert m.cache._flashinfer_workspace is not None
        return m

    return tc, make


@pytest.mark.gpu
@pytest.mark.parametrize("fi_model", GPU_KINDS, indirect=True)
@pytest.mark.parametrize("rope_mode", ["none", "normal"])
def test_gpu_prefill_decode_fork_popn(fi_model, rope_mode):
    _scenario(fi_model, rope_mode)


@pytest.mark.gpu
@pytest.mark.parametrize("fi_model", GPU_KINDS[:1], indirect=True)
def test_gpu_self_and_cross_attention(fi_model):
    _self_and_cross(fi_model)


def _scenario(model, rope_mode):
    """Prefill, decode, a mixed step, forks (a cascade over the shared prefix), popn."""
    tc, make = model
    m = make(rope_mode, seed=3)
    m.add(0)
    m.add(1)
    m.forward([0, 1], [37, 16])
    for _ in range(3):
        m.forward([0, 1], [1, 1])
    m.forward([0, 1], [5, 1])  # mixed
    m.fork(0, 2)
    m.fork(0, 3, 20)
    for _ in range(2):
        m.forward([2, 3, 1], [1, 1, 1])  # cascade: shared prefix + own pages
    m.forward([2, 3], [7, 9])
    m.popn(2, 4)
    m.forward([2, 0], [1, 3])
    m.check_kv()
    for seq_id in list(m.k):
        m.remove(seq_id)
    m.check_no_leaks()


def _self_and_cross(model):
    """self_attention merged with cross_attention equals attention over history + new tokens."""
    tc, make = model
    m = make("none", seed=11)
    m.add(0)
    m.add(1)
    m.forward([0, 1], [9, 30])
    import reference as ref

    for lengths in ([3, 5], [1, 1]):
        m.cache.begin_forward([0, 1], lengths)
        total = sum(lengths)
        q, k, v = (randn(m.rng, (total, h, tc.D), "float16") for h in (tc.HQ, tc.HKV, tc.HKV))
        o_self, o_cross = (empty((total, tc.HQ, tc.D), "float16", m.device) for _ in range(2))
        lse_self, lse_cross = (empty((total, tc.HQ), "float32", m.device) for _ in range(2))
        dev = m.device
        m.cache.self_attention(1, tc.SM_SCALE, tensor(q, dev), tensor(k, dev), tensor(v, dev), o_self, lse_self)
        m.cache.cross_attention(1, tc.SM_SCALE, tensor(q, dev), o_cross, lse_cross)
        m.cache.merge_attn_output_inplace(o_self, lse_self, o_cross, lse_cross)
        m.cache.cancel_forward()  # nothing was written: the step has nothing to keep
        start = 0
        for seq_id, n in zip((0, 1), lengths):
            rows = slice(start, start + n)
            keys = np.concatenate([m.k[seq_id][1], k[rows]])
            values = np.concatenate([m.v[seq_id][1], v[rows]])
            o, lse = ref.attention(q[rows], keys, values, tc.SM_SCALE, causal=True)
            np.testing.assert_allclose(o_self.numpy()[rows], o, rtol=tc.RTOL, atol=tc.ATOL)
            np.testing.assert_allclose(lse_self.numpy()[rows], lse, *ref.LSE_TOLERANCE)
            start += n


# -- model libraries: --attn-backend flashinfer


def _lib_spec(**kw):
    from tvmattn.models.kv_cache import KVCacheSpec

    return KVCacheSpec(**{"num_layers": 2, "num_qo_heads": 32, "num_kv_heads": 8, "head_dim": 128,
                          "dtype": "float16", "target": "cuda:sm_90a", **kw})


def test_library_backend_choice(monkeypatch, tmp_path):
    from tvmattn.build import BuildError, _attention_backend
    from tvmattn.models.kv_cache import flashinfer_problem

    logs = []
    assert _attention_backend("tir", _lib_spec(), logs.append) == "tir"
    assert _attention_backend("flashinfer", _lib_spec(target="llvm"), logs.append) == "tir"
    assert "FlashInfer cannot serve this library (the target is llvm" in logs[-1]
    assert "head dim 80" in flashinfer_problem(_lib_spec(head_dim=80))
    monkeypatch.setenv("TVMATTN_FLASHINFER_DIR", str(tmp_path))
    with pytest.raises(BuildError, match="is not built .*python -m tvmattn.flashinfer.build"):
        _attention_backend("flashinfer", _lib_spec(), logs.append)


def test_library_specs_name_the_modules(monkeypatch, tmp_path):
    """A FlashInfer library's attention slots name the built modules' functions; the cache
    resolves the names when it is created (a clear error where the modules are missing)."""
    from tvmattn.flashinfer.modules import function_name
    from tvmattn.models.kv_cache import _flashinfer_specs

    config = FlashInferConfig()
    name = function_name(config, "prefill_fa2", "paged_run")
    assert name == f"tvmattn.flashinfer/{config.key()}/prefill_fa2/batch_prefill_paged_run"
    monkeypatch.setenv("TVMATTN_FLASHINFER_DIR", str(tmp_path))
    with pytest.raises(KVCacheError, match="is not built"):
        backend_from_spec(["flashinfer", name, function_name(config, "prefill_fa2", "plan")], PagedPrefill)
    with pytest.raises(KVCacheError, match="not a FlashInfer function name"):
        backend_from_spec(["flashinfer", "batch_prefill_paged_run", "x"], PagedPrefill)
    folder = tmp_path / config.key()
    folder.mkdir()
    for kind in ("decode", "prefill_fa2"):
        (folder / f"{kind}.so").write_bytes(b"")
    specs = _flashinfer_specs(_lib_spec())
    assert [str(x.value) for x in specs["decode_paged"].fields] == [
        "flashinfer", function_name(config, "decode", "run"), function_name(config, "decode", "plan")]
    assert str(specs["prefill_ragged"].fields[1].value).endswith("/prefill_fa2/batch_prefill_ragged_run")
    (folder / "prefill_fa3.so").write_bytes(b"")  # on sm_90a the Hopper prefill where it is built
    specs = _flashinfer_specs(_lib_spec())
    assert str(specs["prefill_paged"].fields[1].value).endswith("/prefill_fa3/batch_prefill_paged_run")


def test_library_metadata_names_its_attention_backend():
    from tvmattn.models.kv_cache import attention_backend, attention_backend_record

    assert attention_backend_record(_lib_spec()) == {"name": "tir"}
    with attention_backend("flashinfer"):
        record = attention_backend_record(_lib_spec(head_dim=64))
    assert record["name"] == "flashinfer" and record["flashinfer"] == "0.7.2.post1"
    assert record["modules"] == FlashInferConfig(qk_head_dim=64, v_head_dim=64).key()
    assert record["kinds"]["decode_paged"] == "decode"


@pytest.mark.skipif(not BUILT, reason="FlashInfer modules not built (python -m tvmattn.flashinfer.build)")
def test_library_spec_names_resolve_to_the_built_functions():
    from tvmattn.flashinfer.modules import function_name

    config = FlashInferConfig()
    spec = tvm.runtime.convert(["flashinfer", function_name(config, "decode", "run"),
                                function_name(config, "decode", "plan")])
    backend = backend_from_spec(spec, PagedDecode)
    assert isinstance(backend, FlashInferPagedDecode) and callable(backend.run) and callable(backend.plan)


def test_flashinfer_specs_given_to_a_sliding_window_cache_fall_back(caplog):
    f = tvm.get_global_func("runtime.GetDeviceAttr")
    with caplog.at_level(logging.WARNING, logger="tvmattn.flashinfer"):
        backend, kernels = attention_kernels("tir", _options(support_sliding_window=True), "cuda:sm_90a",
                                             {"prefill_ragged": ["flashinfer", f, f], "copy_single_page": f})
    assert backend == "tir" and kernels == {"copy_single_page": f}
    assert "given for prefill_ragged not used" in caplog.text and "sliding windows" in caplog.text


def test_fa3_plan_takes_its_own_arguments():
    """FA3's plan stops at window_left (16 arguments); the backends pass FA2's list (20)."""
    rec = Recorder()
    plan = modules._adapt("prefill_fa3", "batch_prefill_plan", rec.plan)
    backend = FlashInferPagedPrefill(rec.run, plan)
    backend.bind(FlashInferWorkspace(tvm.cpu(), float_bytes=64, int_bytes=64))
    backend.begin_forward(0, np.array([0, 2], np.int32), np.array([0, 1], np.int32), np.array([3], np.int32), 1, 2,
                          16, 32, 8, 128, 128, False)
    assert len(rec.plans[0]) == 16 and rec.plans[0][-1] == -1
    assert modules._adapt("prefill_fa2", "batch_prefill_plan", print) is print
