"""paged_decode_append (split_rotary_append and the tensor-core paged decode in one launch)
against the float64 reference, and against the two kernels it replaces, bit for bit.

A request of length n holds n - 1 keys of history in its pages (stored rotated, as the cache
stores them) and its new token in the step's qkv row (un-rotated). Its page slot holds NaN
before the launch: the kernel must store the rotated key and the value there, and must not read
the slot back. GPU tests build for the present GPU's arch; CPU tests check the generator's
refusals, the CUDA source, and where the runtime and model libraries build the kernel.
"""

import re

import numpy as np
import pytest
import reference as ref
from harness import device_for, empty, index_view, make_paged_batch, randn, tensor

import tir_kernels
from tir_kernels import (AttentionConfig, TensorCoreDecodeSchedule, default_sm_scale, paged_decode, paged_decode_append,
                         split_rotary_append)
from tir_kernels.config import RopeScaling
from tir_kernels.schedules import choose_tc_decode_schedule
from tir_kernels.support import present_cuda_arch

LLAMA3 = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)

# (num_qo_heads, num_kv_heads, head_dim, page_size, dtype, rope_scaling): GQA groups 3 / 4 / 8 /
# 16, head dims 64 / 128 / 256, pages of 1 / 16 / 64 slots, fp16 and bf16, Llama-3 frequencies.
CASES = [
    (9, 3, 64, 16, "float16", None),  # SmolLM2
    (32, 8, 64, 16, "float16", LLAMA3),  # Llama-3.2-1B
    (32, 8, 128, 16, "bfloat16", None),
    (16, 4, 128, 1, "float16", None),
    (32, 4, 128, 64, "bfloat16", None),
    (16, 1, 64, 64, "float16", None),
    (16, 2, 256, 16, "bfloat16", LLAMA3),
]

# Requests' lengths (the new token counted): the new token alone, on the first slot of a page, on
# the last, ragged, and long ones whose splits hold more tiles than the prologue issues.
LENGTHS = [1, 2, 16, 17, 64, 65, 129, 300, 1000, 3000]


def case_id(case):
    hq, hkv, d, ps, dtype, scaling = case
    return f"hq{hq}-hkv{hkv}-d{d}-ps{ps}-{dtype}" + ("-llama3" if scaling else "")


def config_of(case, target: str) -> AttentionConfig:
    hq, hkv, d, ps, dtype, scaling = case
    return AttentionConfig(hq, hkv, d, dtype=dtype, page_size=ps, target=target, rope_theta=5e5, rope_scale=0.5,
                           rope_scaling=scaling)


def step_inputs(rng, config, lengths):
    """(paged batch of the histories and new tokens, qkv [B, Hq + 2 Hkv, D], q positions,
    append slots): each request's last key is its new token, whose page slot holds NaN and
    whose un-rotated key and value sit in qkv (history keys are stored rotated)."""
    batch = make_paged_batch(rng, lengths, config.num_kv_heads, config.head_dim, config.page_size, config.dtype)
    hq, hkv = config.num_qo_heads, config.num_kv_heads
    qkv = randn(rng, (batch.batch, hq + 2 * hkv, config.head_dim), config.dtype)
    positions = rng.integers(0, 20000, batch.batch).astype(np.int32)
    slots = np.full(batch.batch, -1, np.int32)
    for i, n in enumerate(lengths):
        if n:
            first, last = batch.page_indptr[i], batch.page_indptr[i + 1]
            page = batch.page_indices[first:last][(n - 1) // config.page_size]
            slots[i] = page * config.page_size + (n - 1) % config.page_size
            batch.pages[page, :, :, (n - 1) % config.page_size] = np.nan
    return batch, qkv, positions, slots


def run_fused(kernels, config, batch, qkv, positions, slots, apply_rope, schedule=None):
    """(o, lse, pages after the launch) of paged_decode_append."""
    dev = device_for(config)
    fn = kernels.get(paged_decode_append, config, schedule)
    b = batch.batch
    o = empty((b, config.num_qo_heads, config.head_dim), config.dtype, dev)
    lse = empty((b, config.num_qo_heads), "float32", dev)
    pages = tensor(batch.pages, dev)
    fn(tensor(qkv, dev), pages, index_view(batch.page_indptr, dev), index_view(batch.page_indices, dev),
       index_view(batch.length_info(), dev, offset=3), index_view(positions, dev, offset=2),
       index_view(slots, dev, offset=5), o, lse, apply_rope, default_sm_scale(config.head_dim))
    return o.numpy(), lse.numpy(), pages.numpy()


def run_unfused(kernels, config, batch, qkv, positions, slots, apply_rope, schedule=None):
    """(o, lse, pages) of split_rotary_append, then paged_decode: what the fused kernel replaces."""
    dev = device_for(config)
    b, hq, d = batch.batch, config.num_qo_heads, config.head_dim
    q = empty((b, hq, d), config.dtype, dev)
    pages = tensor(batch.pages, dev)
    positions_view = index_view(positions, dev, offset=2)
    kernels.get(split_rotary_append, config)(tensor(qkv, dev), positions_view, q, pages,
                                             index_view(slots, dev, offset=5), apply_rope)
    o = empty((b, hq, d), config.dtype, dev)
    lse = empty((b, hq), "float32", dev)
    decode_config = config.replace(rope_theta=1e4, rope_scale=1.0)  # (the decode reads neither)
    kernels.get(paged_decode, decode_config, schedule)(
        q, pages, index_view(batch.page_indptr, dev), index_view(batch.page_indices, dev),
        index_view(batch.length_info(), dev, offset=3), index_view(np.zeros(b, np.int32), dev), positions_view,
        o, lse, 0, 1.0, 1e4, default_sm_scale(d))
    return o.numpy(), lse.numpy(), pages.numpy()


def check_reference(config, ks, vs, qkv, positions, apply_rope, o, lse, pages, slots):
    """o / lse of requests with keys ks[i], values vs[i] (the new token's last) against float64
    attention over the history and the (rotated, rounded) new token; the new token's page slot
    against its rotated key and its value."""
    rtol, atol = ref.TOLERANCES[config.dtype]
    hq, hkv, ps = config.num_qo_heads, config.num_kv_heads, config.page_size
    rotate = (lambda x, p: ref.rope(x, p, config.rope_theta, config.rope_scale, config.rope_scaling)
              .astype(qkv.dtype)) if apply_rope else (lambda x, p: x)
    for i in range(len(ks)):
        pos = positions[i : i + 1]
        q = rotate(qkv[i : i + 1, :hq], pos)
        k_new = rotate(qkv[i : i + 1, hq : hq + hkv], pos)
        v_new = qkv[i : i + 1, hq + hkv :]
        k = np.concatenate([ks[i][:-1], k_new])
        v = np.concatenate([vs[i][:-1], v_new])
        eo, else_ = ref.attention(q, k, v, default_sm_scale(config.head_dim), causal=False)
        np.testing.assert_allclose(o[i].astype(np.float64), eo[0], rtol=rtol, atol=atol, err_msg=f"o of request {i}")
        np.testing.assert_allclose(lse[i], else_[0], rtol=ref.LSE_TOLERANCE[0], atol=ref.LSE_TOLERANCE[1],
                                   err_msg=f"lse of request {i}")
        slot = slots[i]  # (the float32 angles may round a rotated element the other way: a tolerance)
        np.testing.assert_allclose(pages[slot // ps, 0, :, slot % ps].astype(np.float64), k_new[0], rtol=rtol,
                                   atol=atol, err_msg=f"new key of {i}")
        np.testing.assert_array_equal(pages[slot // ps, 1, :, slot % ps], v_new[0], err_msg=f"new value of {i}")


def bits(x: np.ndarray) -> np.ndarray:
    return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


@pytest.fixture(scope="session")
def gpu_target():
    return f"cuda:{present_cuda_arch()}"


@pytest.mark.gpu
@pytest.mark.parametrize("apply_rope", [1, 0], ids=["rope", "no-rope"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_decode_append_matches_the_reference_and_the_two_kernels(kernels, gpu_target, case, apply_rope):
    """Batch 10 of LENGTHS, and batch 1 (one request split over many blocks): o, lse and the
    pages equal those of split_rotary_append + paged_decode bit for bit (the tile row stored from
    registers holds the values the page slot gets), and o / lse match the reference."""
    config = config_of(case, gpu_target)
    for lengths in (LENGTHS, [2500]):
        rng = np.random.default_rng(len(lengths) * 7 + apply_rope)
        batch, qkv, positions, slots = step_inputs(rng, config, lengths)
        o, lse, pages = run_fused(kernels, config, batch, qkv, positions, slots, apply_rope)
        check_reference(config, batch.k, batch.v, qkv, positions, apply_rope, o, lse, pages, slots)
        uo, ulse, upages = run_unfused(kernels, config, batch, qkv, positions, slots, apply_rope)
        np.testing.assert_array_equal(bits(o), bits(uo))
        np.testing.assert_array_equal(lse.view(np.uint32), ulse.view(np.uint32))
        np.testing.assert_array_equal(bits(pages), bits(upages))


@pytest.mark.gpu
@pytest.mark.parametrize("batch_size,length", [(1, 129), (3, 700), (64, 1000), (256, 33)])
def test_decode_append_batches(kernels, gpu_target, batch_size, length):
    """Batch 1..256, ragged (empty requests too: a padded graph batch's rows): at batch 64 of 1000
    keys a request takes one split of 16 tiles, so the new key's tile is issued in the main loop."""
    config = config_of(CASES[1], gpu_target)
    rng = np.random.default_rng(batch_size)
    lengths = [length + 17 * i if i % 5 != 4 else 0 for i in range(batch_size)]
    batch, qkv, positions, slots = step_inputs(rng, config, lengths)
    o, lse, pages = run_fused(kernels, config, batch, qkv, positions, slots, 1)
    live = [i for i, n in enumerate(lengths) if n]
    check_reference(config, [batch.k[i] for i in live], [batch.v[i] for i in live], qkv[live], positions[live], 1,
                    o[live], lse[live], pages, slots[live])
    empty_rows = [i for i, n in enumerate(lengths) if not n]
    assert not np.any(o[empty_rows].astype(np.float32)), "a request with no key gets o = 0"
    np.testing.assert_array_equal(lse[empty_rows], tir_kernels.EMPTY_LSE)


@pytest.mark.gpu
def test_decode_append_without_a_slot_stores_nothing(kernels, gpu_target):
    """append_position -1: the pages are left as they were; the attention still takes the new token."""
    config = config_of(CASES[0], gpu_target)
    rng = np.random.default_rng(5)
    batch, qkv, positions, slots = step_inputs(rng, config, [40, 300])
    before = batch.pages.copy()
    o, lse, pages = run_fused(kernels, config, batch, qkv, positions, np.full(2, -1, np.int32), 1)
    np.testing.assert_array_equal(bits(pages), bits(before))
    assert np.isfinite(o.astype(np.float32)).all() and np.isfinite(lse).all()


# -- CPU: refusals, source, where it is built


@pytest.mark.parametrize("change, message", [
    (dict(sliding_window=True), "sliding_window=True"),
    (dict(kv_dtype="float8_e4m3fn"), "kv_dtype='float8_e4m3fn'"),
    (dict(num_qo_heads=6, num_kv_heads=3), "CUDA-core kernel"),  # group 2
    (dict(target="llvm"), "CUDA-core kernel"),
])
def test_decode_append_refuses_what_it_does_not_serve(change, message):
    config = config_of(CASES[0], "cuda:sm_90").replace(**change)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        paged_decode_append(config)
    assert tir_kernels.decode_append_problem(config) is not None


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_decode_append_cuda_source(arch):
    """One launch (sm_90): the query rows and the new token's rows come from qkv by vector loads (no
    cp.async of q), the new key's row is skipped by the tile copies and stored from registers
    in the prologue or the main loop, and the new key and value go to their page slot."""
    import tvm

    from tir_kernels.build import PIPELINE

    config = config_of(CASES[0], f"cuda:{arch}")
    func = paged_decode_append(config)
    module = tvm.compile(tvm.IRModule({"f": func}), target=config.tvm_target(), tir_pipeline=PIPELINE)
    cuda = module.mod.imports[0].inspect_source()
    kernels = set(re.findall(r"__global__ void __launch_bounds__\(\d+\) (\w+)", cuda))
    # sm_90's schedule merges the splits in the kernel (fused_merge); sm_80's in a merge kernel
    assert len(kernels) == (1 if arch == "sm_90" else 2), kernels
    assert "append_position" in cuda and "q_rope_position" in cuda
    assert cuda.count("cvt.rn.f16x2.f32") >= 1
    stores = cuda.count("newkv_ptr[0];")
    assert stores == 2, f"the new row is put into a tile in two places (prologue, main loop), found {stores}"


@pytest.mark.parametrize("tables_before_wait", [False, True])
def test_decode_append_copies_the_history_before_the_wait(tables_before_wait):
    """With programmatic dependent launch and tables_before_wait, a block reads the page tables and
    issues its prologue's copies of the history's K and V rows before griddepcontrol.wait; qkv
    (the previous kernel's output), the positions and the outputs only after it. Without
    tables_before_wait nothing is read before the wait."""
    import dataclasses

    import tvm

    from tir_kernels.build import PIPELINE

    config = config_of(CASES[0], "cuda:sm_90")
    sched = dataclasses.replace(choose_tc_decode_schedule(config), early_pages=True, dependent_launch=True,
                                tables_before_wait=tables_before_wait)
    module = tvm.compile(tvm.IRModule({"f": paged_decode_append(config, sched)}), target=config.tvm_target(),
                         tir_pipeline=PIPELINE)
    body = next(k for k in module.mod.imports[0].inspect_source().split('extern "C" __global__')[1:]
                if "{" in k.split(";")[0] and "ldmatrix" in k)  # the attention kernel (not the merge)
    before = body[body.index("{"):body.index("tvmattn_grid_dependency_wait();")]
    assert body.count("tvmattn_grid_dependency_wait();") == 1
    early = ["page_indices_ptr[", "length_info_ptr[", "pages_ptr"]
    late = ["QKV_ptr", "q_rope_position_ptr", "append_position_ptr", "O_ptr", "lse_ptr", "o_part_ptr"]
    for pointer in early + late:
        assert (pointer in before) == (tables_before_wait and pointer in early), pointer


def test_decode_append_signature_and_schedule_checks():
    config = config_of(CASES[0], "cuda:sm_90")
    assert tir_kernels.choose_decode_kernel(config).kernel == "decode_tc"
    func = paged_decode_append(config)
    assert func.attrs["global_symbol"] == "tvmattn_decode_append_paged_kv"
    assert len(func.params) == 11  # qkv, pages, 5 index arrays, o, lse, apply_rope, sm_scale
    with pytest.raises(ValueError, match="threads cannot hold"):  # 32 threads, 2 x 32 chunks
        paged_decode_append(config.replace(head_dim=256, v_head_dim=256), TensorCoreDecodeSchedule(warps=1, stages=2, q_in_registers=False))


# -- the cache: decode steps with decode_append against the same steps without it


LAYERS, HQ, HKV, D = 2, 8, 2, 64  # the caches' layers: GQA groups of 4, fp16


def group4_cache(kernels: dict | None, rope_mode: str = "normal"):
    """A CUDA PagedKVCache of LAYERS group-4 fp16 layers (kernels: the slots replaced)."""
    import tvm

    from tvmattn import PagedKVCache

    return PagedKVCache(num_layers=LAYERS, num_qo_heads=HQ, num_kv_heads=HKV, qk_head_dim=D, dtype="float16",
                        page_size=16, rope_mode=rope_mode, rope_theta=5e5, rope_scale=0.5, device=tvm.cuda(0),
                        max_num_sequences=8, max_total_seq_len=4096, prefill_chunk_size=512, kernels=kernels)


def forward_layers(cache, rng, seq_ids, lengths, outputs: list) -> None:
    """One step of random qkv through every layer; each layer's o appended to outputs."""
    cache.begin_forward(seq_ids, lengths)
    for layer in range(LAYERS):
        qkv = tensor(randn(rng, (sum(lengths), HQ + 2 * HKV, D), "float16"), cache.device)
        o = empty((sum(lengths), HQ, D), "float16", cache.device)
        cache.attention_with_fused_qkv(layer, default_sm_scale(D), qkv, o)
        outputs.append(o.numpy())
    cache.end_forward()


def run_cache_steps(kernels: dict | None, rope_mode: str, seed: int = 3):
    """A group-4 cache: three sequences prefilled (ragged), then decode steps (a fork and a new
    sequence on the way; batch 1 and 4) -> (the cache, every step's outputs)."""
    cache = group4_cache(kernels, rope_mode)
    rng = np.random.default_rng(seed)
    outputs = []

    def forward(seq_ids, lengths):
        forward_layers(cache, rng, seq_ids, lengths, outputs)

    for seq_id in (0, 1, 2):
        cache.add_sequence(seq_id)
    forward([0, 1, 2], [300, 15, 1])
    for _ in range(3):
        forward([0, 1, 2], [1, 1, 1])
    cache.fork_sequence(1, 5, -1)
    forward([5, 1, 0], [1, 1, 1])
    cache.add_sequence(6)
    forward([6], [40])
    for _ in range(2):
        forward([0, 1, 2, 6], [1, 1, 1, 1])
        forward([6], [1])
    return cache, outputs


@pytest.mark.gpu
@pytest.mark.parametrize("rope_mode", ["normal", "none", "inline"])
def test_cache_decode_steps_with_decode_append_equal_those_without(rope_mode):
    """The cache's decode steps launch decode_append (one kernel a layer) where the rope mode is
    not inline; their outputs equal those of the cache without it, bit for bit (forks and a
    sequence added between decode steps included), and so do the caches' K/V."""
    fused, fused_out = run_cache_steps(None, rope_mode)
    plain, plain_out = run_cache_steps({"decode_append": None}, rope_mode)
    assert fused.kernels.decode_append is not None and plain.kernels.decode_append is None
    for step, (a, b) in enumerate(zip(fused_out, plain_out)):
        np.testing.assert_array_equal(bits(a), bits(b), err_msg=f"output {step}")
    for seq_id, length in ((0, 306), (1, 21), (2, 6), (5, 19), (6, 44)):
        kv = []
        for cache in (fused, plain):
            k, v = (empty((LAYERS, length, HKV, D), "float16", cache.device) for _ in range(2))
            cache.debug_get_kv(seq_id, 0, length, k, v)
            kv.append((k.numpy(), v.numpy()))
        for a, b in zip(*kv):
            np.testing.assert_array_equal(bits(a), bits(b), err_msg=f"K/V of sequence {seq_id}")


@pytest.mark.gpu
def test_graph_replays_with_decode_append_equal_the_steps_without():
    """Decode steps replayed from CUDA graphs (three sequences in bucket 4: one padded row, which
    appends nothing) on a cache with decode_append: the real rows equal the same graph-planned
    steps run eagerly on the cache without it, bit for bit."""
    from tvmattn.runtime.graphs import DecodeGraphs

    fused, plain = group4_cache(None), group4_cache({"decode_append": None})
    qkv = {b: [empty((b, HQ + 2 * HKV, D), "float16", fused.device) for _ in range(LAYERS)] for b in (1, 2, 4)}
    out = {b: [empty((b, HQ, D), "float16", fused.device) for _ in range(LAYERS)] for b in (1, 2, 4)}

    def step(bucket):
        for layer in range(LAYERS):
            fused.attention_with_fused_qkv(layer, default_sm_scale(D), qkv[bucket][layer], out[bucket][layer])
        return out[bucket]

    graphs = DecodeGraphs(fused, step, 4)
    rng = np.random.default_rng(9)
    for cache in (fused, plain):
        for seq_id in (0, 1, 2):
            cache.add_sequence(seq_id)
        forward_layers(cache, np.random.default_rng(1), [0, 1, 2], [200, 33, 5], [])
    for _ in range(4):
        rows = [randn(rng, (4, HQ + 2 * HKV, D), "float16") for _ in range(LAYERS)]
        for layer in range(LAYERS):
            qkv[4][layer].copyfrom(rows[layer])
        replayed = [o.numpy()[:3] for o in graphs.run([0, 1, 2])]
        plain.begin_graph_decode([0, 1, 2], 4)
        for layer in range(LAYERS):
            o = empty((4, HQ, D), "float16", plain.device)
            plain.attention_with_fused_qkv(layer, default_sm_scale(D), tensor(rows[layer], plain.device), o)
            np.testing.assert_array_equal(bits(replayed[layer]), bits(o.numpy()[:3]), err_msg=f"layer {layer}")
        plain.end_forward()
    assert graphs.captures == 1 and graphs.replays == 4


@pytest.mark.parametrize("rope_mode", ["normal", "none", "inline"])
def test_cache_launches_decode_append_in_plain_decode_steps(rope_mode):
    """CPU: a decode_append given as a Python function (split_rotary_append, then the paged decode,
    with the arguments it is called with) is what a plain decode step launches, once a layer, when
    the rope mode is not inline, and never in prefill steps; the outputs equal the cache's own
    split + decode."""
    import tvm

    from tvmattn import PagedKVCache

    def cpu_cache(kernels=None):
        return PagedKVCache(num_layers=LAYERS, num_qo_heads=HQ, num_kv_heads=HKV, qk_head_dim=D, dtype="float32",
                            page_size=4, rope_mode=rope_mode, rope_theta=5e5, rope_scale=0.5, device=tvm.cpu(0),
                            max_num_sequences=4, max_total_seq_len=256, prefill_chunk_size=64, kernels=kernels)

    plain = cpu_cache()
    split, (_, decode) = plain.kernels.split_rotary_append, plain.kernels.decode_paged
    calls = []

    def decode_append(qkv, pages, indptr, indices, length_info, q_positions, append_positions, o, lse, apply_rope,
                      sm_scale):
        calls.append(int(qkv.shape[0]))
        q = empty((qkv.shape[0], HQ, D), "float32", qkv.device)
        split(qkv, q_positions, q, pages, append_positions, apply_rope)
        decode(q, pages, indptr, indices, length_info, tensor(np.zeros(qkv.shape[0], np.int32), qkv.device),
               q_positions, o, lse, 0, 1.0, 1e4, sm_scale)

    fused = cpu_cache({"decode_append": decode_append})
    rng = {name: np.random.default_rng(4) for name in ("fused", "plain")}
    outputs = {"fused": [], "plain": []}
    for name, cache in (("fused", fused), ("plain", plain)):
        for seq_id in (0, 1):
            cache.add_sequence(seq_id)
        dtype_rng = rng[name]
        for seq_ids, lengths in (([0, 1], [9, 4]), ([0, 1], [1, 1]), ([1], [1]), ([1, 0], [3, 1]), ([0, 1], [1, 1])):
            cache.begin_forward(seq_ids, lengths)
            for layer in range(LAYERS):
                qkv = tensor(dtype_rng.standard_normal((sum(lengths), HQ + 2 * HKV, D)).astype("float32"), cache.device)
                o = empty((sum(lengths), HQ, D), "float32", cache.device)
                cache.attention_with_fused_qkv(layer, default_sm_scale(D), qkv, o)
                outputs[name].append(o.numpy())
            cache.end_forward()
    from tvmattn import KVCacheError

    with pytest.raises(KVCacheError, match="slot 'decode_append' must be a function, got 'not a kernel'"):
        cpu_cache({"decode_append": "not a kernel"})
    expected_calls = [] if rope_mode == "inline" else [2, 2, 1, 1, 2, 2]  # the three decode steps' layers
    assert calls == expected_calls
    for step, (a, b) in enumerate(zip(outputs["fused"], outputs["plain"])):
        np.testing.assert_array_equal(a, b, err_msg=f"output {step}")


def test_where_the_runtime_builds_decode_append():
    """CUDA group-3+ fp16 / bf16 caches build it beside the decode (CUDA source, no GPU needed);
    sliding-window caches, the CPU and a replaced decode slot do not."""
    from tvmattn.runtime.kernels import decode_append_kernel

    config = config_of(CASES[0], "cuda:sm_90")
    assert decode_append_kernel(config) is not None
    assert decode_append_kernel(config.replace(num_qo_heads=6)) is None  # group 2: CUDA-core decode
    assert decode_append_kernel(config.replace(target="llvm")) is None
    assert decode_append_kernel(config.replace(kv_dtype="float8_e5m2")) is None
