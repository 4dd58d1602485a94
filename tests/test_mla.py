"""MLA kernels (tir_kernels/mla.py) against an independent float64 numpy reference, CPU and CUDA.

The reference expands the latent cache into ordinary per-head K and V (every head's key for
token j is the whole cached row [latent, rope], its value the latent part) and runs plain
multi-head attention (reference.attention). Page operations are compared bit for bit.
"""

import dataclasses
import zlib

import numpy as np
import pytest
import tvm
import tvm_ffi
import reference as ref
from harness import JUNK, device_for, empty, index_view, randn, tensor, to_dtype
from tvm.relax.frontend.nn.llm.kv_cache import AttnKind
from tvm.runtime import ShapeTuple

from tir_kernels import (
    AttentionConfig,
    MLAConfig,
    MLASchedule,
    choose_mla_schedule,
    merge_state,
    mla_copy_single_page,
    mla_debug_get_kv,
    mla_paged_decode,
    mla_paged_prefill,
    mla_transpose_append,
)
from tir_kernels.mla import (
    WGMMA_DECODE_SPEEDUP,
    WGMMA_SPLIT_DECODE_MAX_BATCH,
    choose_mla_decode_kernel,
    mla_paged_decode_auto,
)
from tir_kernels.mla_tc import (
    MLATensorCoreSchedule,
    choose_mla_tc_schedule,
    mla_paged_decode_tc,
    supports_tc,
)
from tir_kernels.build import PIPELINE, uses_tirx_pipeline
from tir_kernels.mla_sm90 import (
    MLAWgmmaDecodeSplit,
    MLAWgmmaSchedule,
    choose_mla_wgmma_schedule,
    mla_paged_decode_wgmma,
    mla_wgmma_decode_problem,
    mla_wgmma_problem,
)

# DeepSeek's softmax scale comes from the original qk head dim (128 + 64), not from the
# latent width: the kernels take the caller's scale.
SM_SCALE = 1.0 / np.sqrt(192.0)

# Small configs for the CPU: (num_heads, latent_dim, rope_dim, page_size, dtype); every dtype,
# page sizes 1/16/64, a head count that is not a power of two, and no rope part.
CASES = [
    (4, 64, 16, 16, "float32"),
    (8, 32, 16, 1, "float16"),
    (3, 48, 32, 64, "bfloat16"),
    (16, 64, 0, 16, "float16"),
]
# DeepSeek-V2-Lite (16 heads) and V2/V3 (128 heads): latent 512, rope 64.
DEEPSEEK_CASES = [
    (16, 512, 64, 16, "bfloat16"),
    (128, 512, 64, 64, "float16"),
]


def case_id(case):
    h, latent, rope, ps, dtype = case
    return f"h{h}-l{latent}-r{rope}-ps{ps}-{dtype}"


def make_config(case, target):
    h, latent, rope, ps, dtype = case
    return MLAConfig(h, latent_dim=latent, rope_dim=rope, dtype=dtype, page_size=ps, target=target)


def rng_for(*parts):
    return np.random.default_rng(zlib.crc32("-".join(map(str, parts)).encode()))


@dataclasses.dataclass
class LatentBatch:
    """Per-request latent rows laid into one MLA page pool with shuffled page ids.

    rows[i]: [len_i, qk_dim] of request i (the unpaged truth); pages [P, page_size, qk_dim] with
    JUNK in every slot no request owns; page_indptr [B+1], page_indices [nnz], last_page_len [B].
    """

    rows: list
    pages: np.ndarray
    page_indptr: np.ndarray
    page_indices: np.ndarray
    last_page_len: np.ndarray


def make_latent_batch(rng, lengths, config: MLAConfig, spare_pages=3) -> LatentBatch:
    ps = config.page_size
    rows = [randn(rng, (n, config.qk_dim), config.dtype) for n in lengths]
    pages_per_req = [-(-n // ps) for n in lengths]
    total = sum(pages_per_req) + spare_pages
    pages = np.full((total, ps, config.qk_dim), JUNK, dtype=np.float64)
    order = rng.permutation(total)
    indptr, indices, last = [0], [], []
    cursor = 0
    for n, r, npg in zip(lengths, rows, pages_per_req):
        ids = order[cursor : cursor + npg]
        cursor += npg
        for slot in range(n):
            pages[ids[slot // ps], slot % ps] = r[slot]
        indices.extend(ids.tolist())
        indptr.append(len(indices))
        last.append(n - (npg - 1) * ps if npg else 0)
    return LatentBatch(rows, to_dtype(pages, config.dtype), np.array(indptr, np.int32), np.array(indices, np.int32),
                       np.array(last, np.int32))


def expected_attention(q, rows, latent_dim, causal):
    """q [qo_len, H, qk_dim] against latent rows [kv_len, qk_dim]: o [qo_len, H, latent_dim] and
    lse [qo_len, H] (float64, base 2), by ordinary attention over the expanded per-head K and V."""
    heads = q.shape[1]
    rows = np.asarray(rows, np.float64)
    k = np.repeat(rows[:, None, :], heads, axis=1)  # [kv_len, H, qk_dim]
    v = np.repeat(rows[:, None, :latent_dim], heads, axis=1)  # [kv_len, H, latent_dim]
    return ref.attention(q, k, v, SM_SCALE, causal)


def check(config, o, lse, expected_o, expected_lse, what):
    rtol, atol = ref.TOLERANCES[config.dtype]
    np.testing.assert_allclose(o, expected_o, rtol=rtol, atol=atol, err_msg=f"o of {what}")
    np.testing.assert_allclose(lse, expected_lse, rtol=ref.LSE_TOLERANCE[0], atol=ref.LSE_TOLERANCE[1],
                               err_msg=f"lse of {what}")


def run_decode(kernels, config, batch, q, schedule=None, generator=mla_paged_decode):
    dev = device_for(config)
    fn = kernels.get(generator, config, schedule) if schedule else kernels.get(generator, config)
    b = len(batch.rows)
    o = empty((b, config.num_heads, config.latent_dim), config.dtype, dev)
    lse = empty((b, config.num_heads), "float32", dev)
    fn(tensor(q, dev), tensor(batch.pages, dev), index_view(batch.page_indptr, dev),
       index_view(batch.page_indices, dev, offset=5), index_view(batch.last_page_len, dev, offset=3), o, lse, SM_SCALE)
    return o.numpy().astype(np.float64), lse.numpy()


def check_decode(kernels, config, lengths, rng, schedule=None, generator=mla_paged_decode):
    batch = make_latent_batch(rng, lengths, config)
    q = randn(rng, (len(lengths), config.num_heads, config.qk_dim), config.dtype)
    o, lse = run_decode(kernels, config, batch, q, schedule, generator)
    for i, rows in enumerate(batch.rows):
        eo, el = expected_attention(q[i : i + 1], rows, config.latent_dim, causal=False)
        check(config, o[i], lse[i], eo[0], el[0], f"request {i} (length {lengths[i]})")


def run_prefill(kernels, config, batch, q, qo_indptr, causal):
    dev = device_for(config)
    fn = kernels.get(mla_paged_prefill, config)
    total = q.shape[0]
    o = empty((total, config.num_heads, config.latent_dim), config.dtype, dev)
    lse = empty((total, config.num_heads), "float32", dev)
    fn(tensor(q, dev), index_view(qo_indptr, dev, offset=9), tensor(batch.pages, dev),
       index_view(batch.page_indptr, dev), index_view(batch.page_indices, dev, offset=5),
       index_view(batch.last_page_len, dev, offset=3), o, lse, int(causal), SM_SCALE)
    return o.numpy().astype(np.float64), lse.numpy()


def check_prefill(kernels, config, qo_lens, kv_lens, causal, rng):
    batch = make_latent_batch(rng, kv_lens, config)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    q = randn(rng, (int(qo_indptr[-1]), config.num_heads, config.qk_dim), config.dtype)
    o, lse = run_prefill(kernels, config, batch, q, qo_indptr, causal)
    for i, rows in enumerate(batch.rows):
        lo, hi = qo_indptr[i], qo_indptr[i + 1]
        eo, el = expected_attention(q[lo:hi], rows, config.latent_dim, causal)
        check(config, o[lo:hi], lse[lo:hi], eo, el, f"request {i} (qo_len {qo_lens[i]}, kv_len {kv_lens[i]})")


def decode_lengths(page_size):
    # Empty history, one token, exactly one and two pages, ragged lengths.
    return [0, 1, page_size, 2 * page_size, 37, 3 * page_size + 5, 130]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_mla_decode(kernels, target, case):
    config = make_config(case, target)
    check_decode(kernels, config, decode_lengths(config.page_size), rng_for("decode", case_id(case)))


@pytest.mark.parametrize("batch_size", [1, 64])
def test_mla_decode_batch_sizes(kernels, target, batch_size):
    """Batch 1 with a long history; batch 64 with ragged lengths, some empty."""
    config = make_config(CASES[1], target)
    rng = rng_for("decode-batch", batch_size)
    lengths = [300] if batch_size == 1 else rng.integers(0, 40, size=batch_size).tolist()
    check_decode(kernels, config, lengths, rng)


def test_mla_decode_split_kv_cpu(kernels):
    """The split-KV path (partials, then the FP32 merge) on the CPU, with empty splits."""
    config = make_config(CASES[0], "llvm")
    schedule = MLASchedule(threads_y=1, threads_x=1, rows_per_thread=4, cols_per_thread=8, max_splits=5,
                           target_blocks=64)
    check_decode(kernels, config, [0, 3, 1, 40, 77], rng_for("decode-split"), schedule)


def prefill_requests(page_size):
    """(qo_len, kv_len) per request: single tokens, no history, history, no new tokens, page
    boundaries, an empty history, and fewer keys than queries (causal rows that see nothing)."""
    return [(1, 1), (5, 5), (3, 20), (0, 7), (4, 2 * page_size + 3), (6, 0), (2, page_size), (7, 3)]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_mla_prefill(kernels, target, case, causal):
    config = make_config(case, target)
    qo_lens, kv_lens = zip(*prefill_requests(config.page_size))
    check_prefill(kernels, config, list(qo_lens), list(kv_lens), causal, rng_for("prefill", case_id(case), causal))


@pytest.mark.parametrize("batch_size", [1, 64])
def test_mla_prefill_batch_sizes(kernels, target, batch_size):
    """Many short requests (as TVM's cache calls the MLA prefill for decode: causal = 0)."""
    config = make_config(CASES[2], target)
    rng = rng_for("prefill-batch", batch_size)
    qo_lens = rng.integers(1, 4, size=batch_size).tolist()
    kv_lens = [q + int(rng.integers(0, 70)) for q in qo_lens]
    check_prefill(kernels, config, qo_lens, kv_lens, batch_size == 1, rng)


@pytest.mark.parametrize("case", DEEPSEEK_CASES, ids=case_id)
def test_mla_deepseek_decode(kernels, target, case):
    config = make_config(case, target)
    check_decode(kernels, config, [0, 17, 100], rng_for("deepseek-decode", case_id(case)))


@pytest.mark.parametrize("case", DEEPSEEK_CASES, ids=case_id)
def test_mla_deepseek_prefill(kernels, target, case):
    config = make_config(case, target)
    check_prefill(kernels, config, [3, 1, 2], [20, 64, 0], True, rng_for("deepseek-prefill", case_id(case)))


@pytest.mark.gpu
@pytest.mark.parametrize("batch_size,length", [(1, 3000), (3, 700), (64, 90)])
def test_mla_decode_split_kv_gpu(kernels, batch_size, length):
    """DeepSeek-V3 shape on CUDA: small batches split the history over blocks."""
    config = make_config(DEEPSEEK_CASES[1], "cuda").replace(page_size=16)
    lengths = [length + 17 * i for i in range(batch_size)]
    check_decode(kernels, config, lengths, rng_for("split-gpu", batch_size))


# Tensor-core MLA prefill (tir_kernels/mla_sm90.py): DeepSeek-V2-Lite / V2/V3 heads, both dtypes,
# page sizes 1 / 16 / 64; the rows of a request span several 64-row tiles and steps.
TC_CASES = [
    (16, 512, 64, 16, "bfloat16"),
    (128, 512, 64, 64, "float16"),
    (16, 512, 64, 1, "float16"),
    (128, 512, 64, 16, "bfloat16"),
]


def tc_prefill_requests():
    """(qo_len, kv_len): one token, a self-attention-sized chunk, chunks over history, a tail
    of keys past the last full step, no new tokens, no history, fewer keys than queries."""
    return [(1, 1), (37, 37), (5, 300), (0, 7), (130, 130), (3, 0), (20, 201), (9, 5)]


def test_mla_prefill_tensor_core_selection():
    """Which configs take the tensor-core MLA prefill (no GPU needed)."""
    hopper = MLAConfig(128, dtype="bfloat16", target="cuda:sm_90")
    assert mla_wgmma_problem(hopper) is None
    assert uses_tirx_pipeline(mla_paged_prefill(hopper))
    assert choose_mla_wgmma_schedule(hopper) == MLAWgmmaSchedule(tile_kv=32, stages=4, split_keys=False)
    assert not uses_tirx_pipeline(mla_paged_prefill(hopper, choose_mla_schedule(hopper, decode=False)))
    assert "Hopper" in mla_wgmma_problem(hopper.replace(target="cuda:sm_80"))
    assert "Hopper" in mla_wgmma_problem(hopper.replace(target="llvm"))
    assert "dtype" in mla_wgmma_problem(hopper.replace(dtype="float32"))
    assert "latent_dim=64" in mla_wgmma_problem(hopper.replace(latent_dim=64))
    assert "qk_dim" in mla_wgmma_problem(hopper.replace(rope_dim=32))
    for config in (hopper.replace(target="cuda:sm_80"), hopper.replace(target="llvm")):
        assert not uses_tirx_pipeline(mla_paged_prefill(config))
    with pytest.raises(ValueError, match="does not serve"):
        mla_paged_prefill(hopper.replace(dtype="float32"), MLAWgmmaSchedule())
    with pytest.raises(ValueError, match="tile_kv"):
        MLAWgmmaSchedule(tile_kv=48)
    with pytest.raises(ValueError, match="shared memory"):
        MLAWgmmaSchedule(tile_kv=128).check(hopper)
    with pytest.raises(ValueError, match="stages"):
        MLAWgmmaSchedule(stages=1)
    with pytest.raises(ValueError, match="split_keys"):
        MLAWgmmaSchedule(tile_kv=16, split_keys=True)
    MLAWgmmaSchedule(split_keys=True).check(hopper)  # the exchange buffers fit beside the tiles


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_mla_prefill_tensor_core_codegen(dtype):
    """The tensor-core MLA prefill lowers to wgmma for sm_90a without a GPU."""
    config = MLAConfig(16, dtype=dtype, target="cuda:sm_90")
    module = tvm.compile(tvm.IRModule({"main": mla_paged_prefill(config)}), target=config.tvm_target(),
                         tir_pipeline=PIPELINE)
    source = "\n".join(m.inspect_source() for m in module.mod.imports)
    assert "wgmma.mma_async" in source and "m64n256k16" in source and "cp.async" in source


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("case", TC_CASES, ids=case_id)
def test_mla_prefill_tensor_cores(kernels, case, causal):
    config = make_config(case, "cuda")
    assert mla_wgmma_problem(config) is None
    qo_lens, kv_lens = zip(*tc_prefill_requests())
    check_prefill(kernels, config, list(qo_lens), list(kv_lens), causal, rng_for("tc-prefill", case_id(case), causal))


@pytest.mark.gpu
@pytest.mark.parametrize("split_keys", [True, False], ids=["split_keys", "dup_scores"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("case", TC_CASES[:2], ids=case_id)
def test_mla_prefill_tensor_core_schedules(kernels, case, causal, split_keys):
    """Both schedules: split_keys (each consumer scores half of a step's keys; maxima and P
    exchanged) and duplicated scores (each consumer scores all keys, pingpong)."""
    config = make_config(case, "cuda")
    rng = rng_for("tc-split", case_id(case), causal)
    batch = make_latent_batch(rng, [1, 37, 300, 7, 130, 0, 201, 5], config)
    qo_lens = [1, 37, 5, 0, 130, 3, 20, 9]
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    q = randn(rng, (int(qo_indptr[-1]), config.num_heads, config.qk_dim), config.dtype)
    dev = device_for(config)
    fn = kernels.get(mla_paged_prefill, config, MLAWgmmaSchedule(split_keys=split_keys))
    o = empty((q.shape[0], config.num_heads, config.latent_dim), config.dtype, dev)
    lse = empty((q.shape[0], config.num_heads), "float32", dev)
    fn(tensor(q, dev), index_view(qo_indptr, dev, offset=9), tensor(batch.pages, dev),
       index_view(batch.page_indptr, dev), index_view(batch.page_indices, dev, offset=5),
       index_view(batch.last_page_len, dev, offset=3), o, lse, int(causal), SM_SCALE)
    o, lse = o.numpy().astype(np.float64), lse.numpy()
    for i, rows in enumerate(batch.rows):
        lo, hi = qo_indptr[i], qo_indptr[i + 1]
        eo, el = expected_attention(q[lo:hi], rows, config.latent_dim, causal)
        check(config, o[lo:hi], lse[lo:hi], eo, el, f"request {i}")


@pytest.mark.gpu
def test_mla_prefill_tensor_cores_many_requests(kernels):
    """64 short requests (TVM's cache calls the MLA prefill so for decode steps, causal = 0)."""
    config = make_config(TC_CASES[1], "cuda")
    rng = rng_for("tc-prefill-batch")
    qo_lens = rng.integers(1, 4, size=64).tolist()
    kv_lens = [q + int(rng.integers(0, 150)) for q in qo_lens]
    check_prefill(kernels, config, qo_lens, kv_lens, False, rng)


@pytest.mark.parametrize("case", DEEPSEEK_CASES[:1] + CASES[1:2], ids=case_id)
def test_merge_state_at_latent_width(kernels, target, case):
    """merge_state (merge.py) with an MLAConfig merges o [n, heads, latent_dim] (as the cache merges
    cross-attention over cascade depths); rows empty on one side take the other side."""
    config = make_config(case, target)
    dev = device_for(config)
    rng = rng_for("merge", case_id(case))
    n, h, width = 9, config.num_heads, config.latent_dim
    o1, o2 = randn(rng, (n, h, width), config.dtype), randn(rng, (n, h, width), config.dtype)
    lse1 = rng.uniform(-8, 20, (n, h)).astype(np.float32)
    lse2 = rng.uniform(-8, 20, (n, h)).astype(np.float32)
    lse1[3], lse2[5] = ref.EMPTY_LSE, ref.EMPTY_LSE
    expected_o, expected_lse = ref.merge_states(o1, lse1, o2, lse2)
    o, lse = tensor(o1, dev), tensor(lse1, dev)
    kernels.get(merge_state, config)(o, lse, tensor(o2, dev), tensor(lse2, dev))
    check(config, o.numpy().astype(np.float64), lse.numpy(), expected_o, expected_lse, "the merge")


# Page operations: (latent_dim, rope_dim, page_size, dtype).
PAGE_CASES = [(64, 16, 16, "float16"), (512, 64, 1, "bfloat16"), (32, 0, 64, "float32")]


def page_case_id(case):
    latent, rope, ps, dtype = case
    return f"l{latent}-r{rope}-ps{ps}-{dtype}"


def page_config(case, target):
    latent, rope, ps, dtype = case
    return MLAConfig(1, latent_dim=latent, rope_dim=rope, dtype=dtype, page_size=ps, target=target)


def assert_same(actual, expected, what):
    """Bit-exact equality (copies must not round)."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    uint = np.dtype(f"u{expected.dtype.itemsize}")
    mismatch = np.argwhere(np.asarray(actual).view(uint) != np.asarray(expected).view(uint))
    assert mismatch.size == 0, f"{what}: {len(mismatch)} elements differ, first at {tuple(mismatch[0])}"


@pytest.mark.parametrize("case", PAGE_CASES, ids=page_case_id)
def test_mla_transpose_append(kernels, target, case):
    """Rows land at their (page, slot) of a shuffled pool; -1 skips; every other slot is kept."""
    config = page_config(case, target)
    dev = device_for(config)
    rng = rng_for("append", page_case_id(case))
    n, ps = 37, config.page_size
    num_pages = -(-(n + 9) // ps) + 2
    pool = randn(rng, (num_pages, ps, config.qk_dim), config.dtype)
    kv = randn(rng, (n, config.qk_dim), config.dtype)
    positions = rng.choice(num_pages * ps, size=n, replace=False).astype(np.int32)
    positions[rng.choice(n, size=6, replace=False)] = -1
    expected = pool.copy()
    for i, pos in enumerate(positions):
        if pos >= 0:
            expected[pos // ps, pos % ps] = kv[i]
    pages = tensor(pool, dev)
    kernels.get(mla_transpose_append, config)(pages, tensor(kv, dev), index_view(positions, dev))
    assert_same(pages.numpy(), expected, "pages")
    # No tokens: nothing changes (and the launch still has a block).
    kernels.get(mla_transpose_append, config)(pages, tensor(kv[:0], dev), index_view(positions[:0], dev))
    assert_same(pages.numpy(), expected, "pages after an empty append")


@pytest.mark.parametrize("case", PAGE_CASES, ids=page_case_id)
def test_mla_copy_single_page(kernels, target, case):
    """Slots [0, copy_length) of page src go to page tgt; the rest of the pool is kept."""
    config = page_config(case, target)
    dev = device_for(config)
    rng = rng_for("copy", page_case_id(case))
    ps = config.page_size
    pool = randn(rng, (5, ps, config.qk_dim), config.dtype)
    pages = tensor(pool, dev)
    expected = pool.copy()
    for src, tgt, length in [(1, 3, max(1, ps // 2)), (4, 0, ps)]:
        expected[tgt, :length] = expected[src, :length]
        kernels.get(mla_copy_single_page, config)(pages, src, tgt, length)
        assert_same(pages.numpy(), expected, f"pages after copying {length} slots of page {src} to {tgt}")


@pytest.mark.parametrize("case", PAGE_CASES, ids=page_case_id)
def test_mla_debug_get_kv(kernels, target, case):
    """kv[layer_id, i] <- the row at position_map[i]; the other layers are untouched."""
    config = page_config(case, target)
    dev = device_for(config)
    rng = rng_for("debug", page_case_id(case))
    ps, layers, layer_id = config.page_size, 3, 1
    pool = randn(rng, (6, ps, config.qk_dim), config.dtype)
    positions = rng.choice(6 * ps, size=min(11, 6 * ps), replace=False).astype(np.int32)
    out = randn(rng, (layers, len(positions), config.qk_dim), config.dtype)
    expected = out.copy()
    expected[layer_id] = pool.reshape(-1, config.qk_dim)[positions]
    result = tensor(out, dev)
    kernels.get(mla_debug_get_kv, config, layers)(tensor(pool, dev), index_view(positions, dev), result, layer_id)
    assert_same(result.numpy(), expected, "kv")


def test_mla_config_validation():
    config = MLAConfig(128)
    assert (config.latent_dim, config.rope_dim, config.qk_dim) == (512, 64, 576)  # DeepSeek-V2/V3
    for field, value in [("num_heads", 0), ("latent_dim", 40), ("latent_dim", 2048), ("rope_dim", 8),
                         ("rope_dim", -16), ("dtype", "int8"), ("page_size", 3), ("target", "rocm")]:
        with pytest.raises(ValueError, match=field if field != "target" else "rocm"):
            MLAConfig(**{"num_heads": 4, field: value})
    with pytest.raises(TypeError, match="MLAConfig"):
        mla_paged_decode(AttentionConfig(8, 1, 64))


def test_mla_schedule_validation():
    cpu = MLAConfig(8, latent_dim=64, rope_dim=16)
    gpu = MLAConfig(128, target="cuda:sm_90")
    with pytest.raises(ValueError, match="power of two"):
        MLASchedule(threads_y=8, threads_x=3, rows_per_thread=2, cols_per_thread=2)
    with pytest.raises(ValueError, match="must be 1 on the CPU"):
        mla_paged_decode(cpu, MLASchedule(threads_y=8, threads_x=4, rows_per_thread=2, cols_per_thread=8))
    with pytest.raises(ValueError, match="prefill does not split"):
        mla_paged_prefill(cpu, MLASchedule(threads_y=1, threads_x=1, rows_per_thread=4, cols_per_thread=8,
                                           max_splits=4))
    with pytest.raises(ValueError, match="latent_dim"):
        mla_paged_decode(gpu.replace(latent_dim=96), MLASchedule(threads_y=16, threads_x=16, rows_per_thread=2,
                                                                 cols_per_thread=2))
    with pytest.raises(ValueError, match="shared"):
        mla_paged_decode(gpu, MLASchedule(threads_y=16, threads_x=16, rows_per_thread=4, cols_per_thread=4))


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_90"])
def test_choose_mla_schedule_fits(arch):
    """The chosen CUDA schedules fit each arch's shared memory for every DeepSeek and test shape."""
    for h, latent, rope, ps, dtype in CASES + DEEPSEEK_CASES:
        config = MLAConfig(h, latent_dim=latent, rope_dim=rope, dtype=dtype, page_size=ps, target=f"cuda:{arch}")
        for decode in (True, False):
            sched = choose_mla_schedule(config, decode)
            sched.check(config)
            assert sched.num_threads >= 32 and (sched.max_splits > 1) == decode


def cuda_source(func, config):
    module = tvm.compile(tvm.IRModule({"main": func}), target=config.tvm_target())
    return module.mod.imports[0].inspect_source()


def _simt_prefill(config):
    """The CUDA-core MLA prefill (an explicit MLASchedule keeps it on Hopper)."""
    return mla_paged_prefill(config, choose_mla_schedule(config, decode=False))


@pytest.mark.parametrize("generator", [mla_paged_decode, _simt_prefill, merge_state], ids=["decode", "prefill",
                                                                                         "merge"])
@pytest.mark.parametrize("case", [(128, 512, 64, 16, "float16"), (16, 512, 64, 64, "bfloat16"),
                                  (128, 512, 64, 1, "float32")], ids=case_id)
def test_mla_cuda_codegen(generator, case):
    """DeepSeek shapes build for CUDA without a GPU, with 16-byte loads."""
    source = cuda_source(generator(make_config(case, "cuda:sm_90")), make_config(case, "cuda:sm_90"))
    assert "__syncthreads" in source
    assert ("uint4" in source) or ("float4" in source)


@pytest.mark.parametrize("generator,args", [(mla_transpose_append, ()), (mla_copy_single_page, ()),
                                            (mla_debug_get_kv, (2,))], ids=["append", "copy", "debug"])
def test_mla_page_ops_cuda_codegen(generator, args):
    config = page_config(PAGE_CASES[0], "cuda")
    source = cuda_source(generator(config, *args), config)
    assert "uint4" in source


def _not_called(*args):
    raise AssertionError("an MLA cache without token trees or RoPE never calls this function")


def create_tvm_mla_cache(kernels, config: MLAConfig, num_layers: int):
    """TVM's own C++ paged KV cache with every layer MLA and our MLA kernels in its slots
    (`vm.builtin.paged_attention_kv_cache_create`, paged_kv_cache.cc's positional arguments)."""
    dev = device_for(config)
    unused = tvm_ffi.convert(_not_called)
    args = [
        ShapeTuple([8, 1024, 256, config.page_size, 0]),  # seqs, token capacity, prefill chunk, page size, sliding
        ShapeTuple([0, num_layers]),  # layer_indptr: one pipeline stage
        config.num_heads,  # num_qo_heads
        1,  # num_kv_heads: one latent row per token
        config.qk_dim,  # qk_head_dim
        config.latent_dim,  # v_head_dim
        ShapeTuple([int(AttnKind.MLA)] * num_layers),
        False,  # enable_kv_transfer
        0,  # rope_mode: none (the rope part is cached rotated)
        1.0,  # rope_scale
        1e4,  # rope_theta
        None,  # rope_ext_factors
        tvm.runtime.empty((), config.dtype, device=dev),  # the pages' dtype and device
        None,  # transpose_append (MHA)
        kernels.get(mla_transpose_append, config),
        [], [], [], [], [], [], [],  # ragged / paged prefill, decode, sliding prefill / decode, tree paged / ragged
        ["tirx", kernels.get(mla_paged_prefill, config)],
        [kernels.get(merge_state, config)],  # merges the cascade depths of cross-attention
        unused,  # split_rotary
        kernels.get(mla_copy_single_page, config),
        kernels.get(mla_debug_get_kv, config, num_layers),
        unused,  # compact_copy
    ]
    return tvm.get_global_func("vm.builtin.paged_attention_kv_cache_create")(*args)


def test_mla_in_tvm_cache(kernels, target):
    """TVM's C++ cache drives our MLA kernels as a DeepSeek model does: append_mla_kv, then
    cross-attention over the cache (prefill: the history; decode: the history and the new
    token), across forks (a partly copied page, cascade depths merged by merge_state) and popn;
    every output and LSE against the expanded reference, the cached rows by debug_get_kv_mla."""
    config = MLAConfig(4, latent_dim=64, rope_dim=16, dtype="float16", page_size=16, target=target)
    dev = device_for(config)
    layers = 2
    cache = create_tvm_mla_cache(kernels, config, layers)
    rng = rng_for("tvm-cache")
    rows = {}  # seq -> per layer [len, qk_dim]: what the cache must hold

    def builtin(name, *args):
        return tvm.get_global_func(f"vm.builtin.{name}")(cache, *args)

    def add(seq):
        builtin("kv_state_add_sequence", seq)
        rows[seq] = [np.zeros((0, config.qk_dim), np.float16) for _ in range(layers)]

    def forward(seq_ids, lengths):
        builtin("kv_state_begin_forward", ShapeTuple(seq_ids), ShapeTuple(lengths))
        decode = all(n == 1 for n in lengths)  # TVM appends before attention in decode steps only
        for layer in range(layers):
            new = [randn(rng, (n, config.qk_dim), config.dtype) for n in lengths]
            builtin("attention_kv_cache_append_mla_kv", layer, tensor(np.concatenate(new), dev))
            history = [rows[s][layer] for s in seq_ids]
            for s, kv in zip(seq_ids, new):
                rows[s][layer] = np.concatenate([rows[s][layer], kv])
            keys = [rows[s][layer] for s in seq_ids] if decode else history
            q = [randn(rng, (n, config.num_heads, config.qk_dim), config.dtype) for n in lengths]
            o = empty((sum(lengths), config.num_heads, config.latent_dim), config.dtype, dev)
            lse = empty((sum(lengths), config.num_heads), "float32", dev)
            builtin("attention_kv_cache_cross_attention", layer, SM_SCALE, tensor(np.concatenate(q), dev), o, lse)
            o, lse = o.numpy().astype(np.float64), lse.numpy()
            start = 0
            for s, qs, k in zip(seq_ids, q, keys):
                eo, el = expected_attention(qs, k, config.latent_dim, causal=False)
                end = start + len(qs)
                check(config, o[start:end], lse[start:end], eo, el, f"sequence {s}, layer {layer}")
                start = end
        builtin("kv_state_end_forward")

    add(0)
    add(1)
    builtin("kv_state_begin_forward", ShapeTuple([0, 1]), ShapeTuple([20, 5]))  # no history: append only
    for layer in range(layers):
        new = [randn(rng, (n, config.qk_dim), config.dtype) for n in (20, 5)]
        builtin("attention_kv_cache_append_mla_kv", layer, tensor(np.concatenate(new), dev))
        rows[0][layer], rows[1][layer] = new
    builtin("kv_state_end_forward")
    forward([0, 1], [1, 1])
    # At 20 (page size 16): 0 and 2 share page 0 as a block of its own (a cascade depth), and
    # copy_single_page copies the first 4 slots of page 1 for 2.
    builtin("kv_state_fork_sequence", 0, 2, 20)
    rows[2] = [r[:20].copy() for r in rows[0]]
    forward([0, 2, 1], [3, 4, 2])  # cross-attention per depth, merged by merge_state
    forward([0, 1, 2], [1, 1, 1])
    builtin("kv_state_popn", 1, 2)
    rows[1] = [r[:-2] for r in rows[1]]
    forward([1, 0], [1, 17])
    for seq, expected in rows.items():
        n = len(expected[0])
        kv = empty((layers, n, config.qk_dim), config.dtype, dev)
        builtin("attention_kv_cache_debug_get_kv_mla", seq, 0, n, kv)
        assert_same(kv.numpy(), np.stack(expected), f"cached rows of sequence {seq}")


# The tensor-core decode (tir_kernels/mla_tc.py): (num_heads, latent_dim, rope_dim, page_size,
# dtype). DeepSeek-V2/V3 (128 heads: two 64-head tiles) and V2-Lite (16 heads) at page sizes
# 16 and 64, fp16 and bf16; small shapes with a partial m-tile (3 and 40 heads), page size 1,
# latent widths that narrow the warps' column slices (96), and no rope part.
TC_CASES = [
    (128, 512, 64, 16, "float16"),
    (128, 512, 64, 64, "bfloat16"),
    (16, 512, 64, 16, "bfloat16"),
    (16, 512, 64, 64, "float16"),
    (3, 96, 32, 16, "float16"),
    (40, 128, 0, 1, "bfloat16"),
]


def tc_lengths(page_size, tile_kv):
    """Empty, one token, page and tile boundaries (each side), ragged lengths."""
    return [0, 1, page_size, page_size + 1, tile_kv - 1, tile_kv, tile_kv + 1, 2 * tile_kv + 5, 37, 301]


def test_mla_tc_supports():
    """The tensor-core decode serves fp16/bf16 on CUDA sm_80+ only; the auto pick falls back to
    the SIMT kernel elsewhere, and the tensor-core generator refuses with an error naming why."""
    assert supports_tc(MLAConfig(128, target="cuda:sm_90"))
    assert supports_tc(MLAConfig(16, dtype="bfloat16", target="cuda:sm_80"))
    assert not supports_tc(MLAConfig(128))  # the CPU
    assert not supports_tc(MLAConfig(128, dtype="float32", target="cuda:sm_90"))
    assert not supports_tc(MLAConfig(128, target="cuda:sm_75"))
    assert not supports_tc(MLAConfig(4, latent_dim=48, rope_dim=16, target="cuda:sm_90"))
    with pytest.raises(ValueError, match="float32"):
        mla_paged_decode_tc(MLAConfig(128, dtype="float32", target="cuda:sm_90"))
    with pytest.raises(ValueError, match="sm_80"):
        mla_paged_decode_tc(MLAConfig(8, latent_dim=64, rope_dim=16))
    with pytest.raises(TypeError, match="MLAConfig"):
        mla_paged_decode_tc(AttentionConfig(8, 1, 64, target="cuda:sm_90"))
    cpu = MLAConfig(8, latent_dim=64, rope_dim=16)
    assert mla_paged_decode_auto(cpu).script() == mla_paged_decode(cpu).script()


def test_mla_tc_schedule_validation():
    gpu = MLAConfig(128, target="cuda:sm_90")
    for kwargs, match in [(dict(m_tiles=0, col_slices=2, stages=2), "m_tiles"),
                          (dict(m_tiles=2, col_slices=3, stages=2), "col_slices"),
                          (dict(m_tiles=8, col_slices=8, stages=2), "warps"),
                          (dict(m_tiles=2, col_slices=2, stages=1), "stages"),
                          (dict(m_tiles=2, col_slices=2, stages=2, max_splits=0), "max_splits")]:
        with pytest.raises(ValueError, match=match):
            MLATensorCoreSchedule(**kwargs)
    with pytest.raises(ValueError, match="shared memory"):
        mla_paged_decode_tc(gpu, MLATensorCoreSchedule(m_tiles=8, col_slices=2, stages=4))
    with pytest.raises(ValueError, match="latent_dim"):
        mla_paged_decode_tc(gpu.replace(latent_dim=96), MLATensorCoreSchedule(m_tiles=1, col_slices=4, stages=2))


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_choose_mla_tc_schedule_fits(arch):
    """The chosen schedules fit each arch; 128 heads take 64-head tiles, 16 heads one m-tile."""
    for case in TC_CASES:
        config = make_config(case, f"cuda:{arch}")
        sched = choose_mla_tc_schedule(config)
        sched.check(config)
        assert sched.heads_per_block >= min(config.num_heads, 16)
    assert choose_mla_tc_schedule(MLAConfig(128, target=f"cuda:{arch}")).heads_per_block == 64
    assert choose_mla_tc_schedule(MLAConfig(16, target=f"cuda:{arch}")).heads_per_block == 16


def test_mla_cache_decode_slot_uses_auto_pick():
    """The MLA cache builds its decode slot with the auto pick (tensor cores on CUDA sm_80+)."""
    from tvmattn.runtime import mla as runtime_mla

    assert runtime_mla._MLA_GENERATORS["decode_paged_mla"] is mla_paged_decode_auto


@pytest.mark.parametrize("case", [TC_CASES[0], TC_CASES[2]], ids=case_id)
def test_mla_tc_cuda_codegen(case):
    """The tensor-core decode builds for sm_90 without a GPU: mma.sync, ldmatrix and cp.async,
    and it is what the cache's auto pick builds on CUDA."""
    config = make_config(case, "cuda:sm_90")
    source = cuda_source(mla_paged_decode_tc(config), config)
    for needle in ("mma.sync.aligned.m16n8k16", "ldmatrix", "cp.async", "__syncthreads"):
        assert needle in source
    assert mla_paged_decode_auto(config).script() == mla_paged_decode_tc(config).script()


@pytest.mark.gpu
@pytest.mark.parametrize("case", TC_CASES, ids=case_id)
def test_mla_tc_decode_gpu(kernels, case):
    """Every boundary length in one batch (split as the launch chooses for 10 requests)."""
    config = make_config(case, "cuda")
    lengths = tc_lengths(config.page_size, choose_mla_tc_schedule(config).tile_kv)
    check_decode(kernels, config, lengths, rng_for("tc", case_id(case)), generator=mla_paged_decode_tc)


@pytest.mark.gpu
@pytest.mark.parametrize("case", TC_CASES[:4], ids=case_id)
@pytest.mark.parametrize("batch_size,length", [(1, 5000), (2, 1), (5, 700), (64, 90)])
def test_mla_tc_decode_split_gpu(kernels, case, batch_size, length):
    """Small batches split the keys over blocks (fp32 merge), with empty splits for short
    requests; batch 64 mostly one split."""
    config = make_config(case, "cuda")
    lengths = [length + 17 * i for i in range(batch_size)]
    if batch_size == 5:
        lengths[2] = 0
    check_decode(kernels, config, lengths, rng_for("tc-split", case_id(case), batch_size),
                 generator=mla_paged_decode_tc)


@pytest.mark.gpu
def test_mla_tc_decode_schedules_gpu(kernels):
    """Other schedules give the same results: 3 stages, 16-head tiles without a split, 32-head
    tiles of 4 column slices, 4 stages with at most 7 splits."""
    config = make_config(TC_CASES[0], "cuda")
    rng = rng_for("tc-schedules")
    for sched in (MLATensorCoreSchedule(4, 2, 3), MLATensorCoreSchedule(1, 4, 2, max_splits=1),
                  MLATensorCoreSchedule(2, 4, 2), MLATensorCoreSchedule(1, 2, 4, max_splits=7)):
        check_decode(kernels, config, [0, 5, 100, 333], rng, schedule=sched, generator=mla_paged_decode_tc)


# The wgmma decode: DeepSeek shapes at both dtypes and page sizes, a partial head tile (40
# heads, no rope part, page 1).
WGMMA_DECODE_CASES = [
    (128, 512, 64, 16, "float16"),
    (128, 512, 64, 64, "bfloat16"),
    (16, 512, 64, 16, "bfloat16"),
    (16, 512, 64, 64, "float16"),
    (40, 128, 0, 1, "bfloat16"),
]


def test_mla_wgmma_decode_selection():
    """Which configs the wgmma decode serves, its refusals, and the per-batch pick between it and
    mla_tc's split decode (no GPU needed)."""
    hopper = MLAConfig(128, target="cuda:sm_90")
    assert mla_wgmma_decode_problem(hopper) is None
    assert uses_tirx_pipeline(mla_paged_decode_wgmma(hopper))
    assert "Hopper" in mla_wgmma_decode_problem(hopper.replace(target="cuda:sm_80"))
    assert "dtype" in mla_wgmma_decode_problem(hopper.replace(dtype="float32"))
    assert "latent_dim=96" in mla_wgmma_decode_problem(hopper.replace(latent_dim=96))
    with pytest.raises(ValueError, match="does not serve"):
        mla_paged_decode_wgmma(hopper.replace(target="llvm"))
    with pytest.raises(ValueError, match="shared memory"):
        mla_paged_decode_wgmma(hopper, MLAWgmmaSchedule(tile_kv=64, stages=3, split_keys=True))
    # the pick: the CPU, float32 and latent widths mla_sm90 cannot take never get wgmma
    assert choose_mla_decode_kernel(MLAConfig(128), 64) == "simt"
    assert choose_mla_decode_kernel(hopper.replace(dtype="float32"), 64) == "simt"
    assert choose_mla_decode_kernel(hopper.replace(target="cuda:sm_80"), 64) == "tc"
    assert choose_mla_decode_kernel(hopper.replace(latent_dim=96), 64) == "tc"
    # where the wgmma decode splits (up to 33 requests at 128 heads) the measured batch bound
    # decides; a partial wave of whole requests (34 .. 41) goes to mla_tc, a full one to wgmma
    assert choose_mla_decode_kernel(hopper, 0) == "tc"
    full, partial = WGMMA_SPLIT_DECODE_MAX_BATCH["full"], WGMMA_SPLIT_DECODE_MAX_BATCH["partial"]
    picks = {b: choose_mla_decode_kernel(hopper, b) for b in range(1, 300)}
    assert all(picks[b] == ("wgmma" if b <= full else "tc") for b in range(1, 34))
    assert [picks[b] for b in (34, 41)] == ["tc", "tc"]
    assert picks[66] == ("wgmma" if WGMMA_DECODE_SPEEDUP["full"] > 1 else "tc")
    sixteen = {b: choose_mla_decode_kernel(hopper.replace(num_heads=16), b) for b in range(1, 300)}
    assert all(sixteen[b] == ("wgmma" if b <= partial else "tc") for b in range(1, 67))
    if WGMMA_DECODE_SPEEDUP["partial"] <= 1:
        assert all(sixteen[b] == "tc" for b in range(67, 300))


def test_mla_wgmma_decode_codegen():
    """The wgmma decode lowers for sm_90a without a GPU: one kernel (wgmma, cp.async, setmaxnreg)."""
    config = MLAConfig(128, dtype="bfloat16", target="cuda:sm_90")
    module = tvm.compile(tvm.IRModule({"main": mla_paged_decode_wgmma(config)}), target=config.tvm_target(),
                         tir_pipeline=PIPELINE)
    source = "\n".join(m.inspect_source() for m in module.mod.imports)
    for needle in ("wgmma.mma_async", "m64n256k16", "m64n32k16", "cp.async", "setmaxnreg"):
        assert needle in source


def test_mla_cache_decode_slot_picks_per_batch(monkeypatch):
    """On sm_90 the MLA cache's decode slot holds both tensor-core kernels and runs the one
    choose_mla_decode_kernel names for each call's batch."""
    from tvmattn.runtime import mla as runtime_mla

    calls = []
    monkeypatch.setattr(runtime_mla, "_build", lambda generator, config, extra: (
        lambda *args: calls.append((generator.__name__, args[0].shape[0]))))
    config = MLAConfig(128, target="cuda:sm_90")
    kernels = runtime_mla.mla_kernel_set(config, 2, {})
    slot = kernels.decode_paged_mla
    assert isinstance(slot, runtime_mla.ChosenMLADecode) and set(slot.funcs) == {"tc", "wgmma"}
    for batch in (1, 36, 64):
        q = np.zeros((batch, 128, 576), np.float16)
        slot.mla(0, q, None, None, None, None, 0.1, None, None)
    assert calls == [("mla_paged_decode_wgmma", 1), ("mla_paged_decode_auto", 36), ("mla_paged_decode_wgmma", 64)]
    cpu = runtime_mla.mla_kernel_set(MLAConfig(8, latent_dim=64, rope_dim=16), 2, {})
    assert not isinstance(cpu.decode_paged_mla, runtime_mla.ChosenMLADecode)


@pytest.mark.gpu
@pytest.mark.parametrize("case", WGMMA_DECODE_CASES, ids=case_id)
def test_mla_wgmma_decode_gpu(kernels, case):
    """Empty, one token, page and 64-row step boundaries (each side), ragged and long lengths."""
    config = make_config(case, "cuda")
    lengths = tc_lengths(config.page_size, 64) + [1000, 2 * config.page_size - 1]
    check_decode(kernels, config, lengths, rng_for("wgmma", case_id(case)), generator=mla_paged_decode_wgmma)


@pytest.mark.gpu
@pytest.mark.parametrize("case", WGMMA_DECODE_CASES[:3], ids=case_id)
def test_mla_wgmma_decode_many_requests_gpu(kernels, case):
    """A wave of requests (one CTA per request and head tile), one of them empty."""
    config = make_config(case, "cuda")
    lengths = [90 + 37 * i for i in range(70)]
    lengths[5] = 0
    check_decode(kernels, config, lengths, rng_for("wgmma-many", case_id(case)), generator=mla_paged_decode_wgmma)


def wgmma_split_decode(config, split):
    """The wgmma decode with split-KV settings `split` (a generator for the kernel cache)."""
    return mla_paged_decode_wgmma(config, None, split)


def test_mla_wgmma_decode_split_settings():
    """Split slots per (request, head tile) chosen at launch from the batch; settings validated."""
    split = MLAWgmmaDecodeSplit()
    assert split.max_splits == 66 and split.target_ctas == 132
    assert MLAWgmmaDecodeSplit(max_splits=1).slots(5, 2) == 1
    with pytest.raises(ValueError, match="min_split_keys"):
        MLAWgmmaDecodeSplit(min_split_keys=0)
    config = MLAConfig(128, target="cuda:sm_90")
    module = tvm.compile(tvm.IRModule({"main": mla_paged_decode_wgmma(config)}), target=config.tvm_target(),
                         tir_pipeline=PIPELINE)
    source = "\n".join(m.inspect_source() for m in module.mod.imports)
    for needle in ("tvmattn_mla_split_132_arrive", "ld.acquire.gpu", "tvmattn_ldcg4", "o_part"):
        assert needle in source


# Split-KV wgmma decode: few requests, long and short, many splits (min_split_keys 32: a split
# per 32-key step), more split CTAs than SMs (target_ctas 400: some CTAs finish before others
# start, so the last arrival merges alone), consecutive calls of one kernel.
WGMMA_SPLIT_LENGTHS = [[9000], [0, 4097], [1, 2 * 64 * 16 + 16, 700]]
WGMMA_SPLITS = [MLAWgmmaDecodeSplit(), MLAWgmmaDecodeSplit(min_split_keys=32),
                MLAWgmmaDecodeSplit(max_splits=200, min_split_keys=32, target_ctas=400)]


@pytest.mark.gpu
@pytest.mark.parametrize("split", WGMMA_SPLITS, ids=["default", "short", "over-sms"])
@pytest.mark.parametrize("case", WGMMA_DECODE_CASES, ids=case_id)
def test_mla_wgmma_split_decode_gpu(kernels, case, split):
    """Batches 1, 2, 3 (empty, page-boundary, one-token and long requests), each twice in a row
    through the same kernel (the split counters are left zero by every launch)."""
    config = make_config(case, "cuda")
    for rep in range(2):
        for lengths in WGMMA_SPLIT_LENGTHS:
            check_decode(kernels, config, lengths, rng_for("wgmma-split", case_id(case), rep, *lengths), split,
                         wgmma_split_decode)


def test_mla_bench_plumbing_cpu(monkeypatch):
    """scripts/bench_kernels.py --mla's run on the CPU (tiny shape): a row per implementation
    that runs there, each checked against the fp32 reference."""
    import sys
    import types

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "scripts"))
    import bench_kernels

    monkeypatch.setattr(bench_kernels, "DEVICE", "cpu")
    args = types.SimpleNamespace(dtype=["float16"], arch=None, iters=2)
    rows = bench_kernels.run_mla_decode(args, [bench_kernels.parse_shape("2x40", "decode")], heads=(4,),
                                        page_sizes=(16,), latent=64, rope=16)
    assert {r["impl"] for r in rows} == {"tvmattn", "tvmattn-simt", "torch"}
    for r in rows:
        assert r["kernel"] == "mla_decode" and r["agrees"] and r["gbps"] > 0
        assert r["gbps"] == pytest.approx(2 * 40 * 80 * 2 / r["ms"] / 1e6)
    assert "mla_decode, float16, 4 heads" in bench_kernels.format_mla_decode_tables(rows)
