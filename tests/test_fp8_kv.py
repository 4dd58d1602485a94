"""FP8 K/V pages (AttentionConfig.kv_dtype): the kernels that write codes (append, split + RoPE +
append) and read them (debug_get_kv, decode, prefill, tree, MLA) against float64 references on
the dequantized K/V, on the CPU; their CUDA builds, and on the GPU machine their CUDA runs."""

import zlib

import numpy as np
import pytest
import reference
from fp8_reference import FP8_BF16_LSE_TOLERANCE, dequantize, np_fp8, quantize, random_scales, with_scales
from harness import device_for, empty, index_view, randn, tensor

from tir_kernels import (AttentionConfig, copy_single_page, debug_get_kv, split_rotary, split_rotary_append,
                         transpose_append)
from tir_kernels.support import FP8_KV_DTYPES

FMTS = [pytest.param(f, id=f.split("_")[1]) for f in FP8_KV_DTYPES]


def fp8_config(target, fmt, hkv=2, hq=None, d=64, ps=16, dtype="float16", **kw):
    return AttentionConfig(hq or hkv, hkv, d, dtype=dtype, page_size=ps, target=target, kv_dtype=fmt, **kw)


def code_pool(rng, config, num_pages):
    """Random codes in every data page, the scale page last (scales [2, Hkv])."""
    scales = random_scales(rng, config.num_kv_heads)
    shape = (num_pages, 2, config.num_kv_heads, config.page_size, config.head_dim)
    values = rng.standard_normal(shape) * scales.reshape(1, 2, -1, 1, 1) * 40
    codes = quantize(values, scales.reshape(1, 2, -1, 1, 1), config.kv_dtype)
    return with_scales(codes, scales), scales


@pytest.mark.parametrize("fmt", FMTS)
def test_append_quantizes_and_debug_get_kv_dequantizes(kernels, target, fmt):
    """transpose_append stores the code of x / scale[kv, head] (saturated: some values lie
    beyond the format's range); debug_get_kv reads code * scale back in the dtype; the scale
    page is never written."""
    config = fp8_config(target, fmt, hkv=3, d=32, ps=4)
    dev = device_for(config)
    rng = np.random.default_rng(zlib.crc32(fmt.encode()))
    num_pages, n = 9, 21
    pool, scales = code_pool(rng, config, num_pages)
    k = randn(rng, (n, 3, 32), "float16") * np.float16(4)
    v = randn(rng, (n, 3, 32), "float16")
    k[0, 0, :4] = [1e4, -1e4, 6e-8, 0]
    positions = rng.choice(num_pages * 4, size=n, replace=False).astype(np.int32)
    positions[[3, 11]] = -1
    expected = pool.copy()
    for i, pos in enumerate(positions):
        if pos >= 0:
            expected[pos // 4, 0, :, pos % 4] = quantize(k[i], scales[0][:, None], fmt)
            expected[pos // 4, 1, :, pos % 4] = quantize(v[i], scales[1][:, None], fmt)
    pages = tensor(pool, dev)
    kernels.get(transpose_append, config)(pages, tensor(k, dev), tensor(v, dev), index_view(positions, dev))
    np.testing.assert_array_equal(pages.numpy().view(np.uint8), expected.view(np.uint8))

    kept = positions[positions >= 0]
    k_out = empty((2, len(kept), 3, 32), "float16", dev)
    v_out = empty((2, len(kept), 3, 32), "float16", dev)
    kernels.get(debug_get_kv, config, 2)(pages, index_view(kept, dev), k_out, v_out, 1)
    codes = expected[kept // 4, :, :, kept % 4]  # [len, 2, Hkv, D]
    for kv, out in ((0, k_out), (1, v_out)):
        want = dequantize(codes[:, kv], scales[kv][None, :, None]).astype(np.float16)
        np.testing.assert_array_equal(out.numpy()[1], want)
        assert np.isnan(out.numpy()[0]).all()


@pytest.mark.parametrize("fmt", FMTS)
def test_copy_single_page_moves_codes(kernels, target, fmt):
    config = fp8_config(target, fmt, hkv=2, d=64, ps=8)
    dev = device_for(config)
    pool, _ = code_pool(np.random.default_rng(5), config, 6)
    expected = pool.copy()
    expected[4, :, :, :5] = pool[1, :, :, :5]
    pages = tensor(pool, dev)
    kernels.get(copy_single_page, config)(pages, 1, 4, 5)
    np.testing.assert_array_equal(pages.numpy().view(np.uint8), expected.view(np.uint8))


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("rope", [0, 1])
def test_split_rotary_append_quantizes(kernels, target, fmt, rope):
    """The fused split + RoPE + append writes q as split_rotary does and the codes of its
    (rotated) k and v over the scales into their slots."""
    hq, hkv, d, ps = 4, 2, 64, 8
    config = fp8_config(target, fmt, hkv=hkv, hq=hq, d=d, ps=ps)
    plain = config.replace(kv_dtype="")
    dev = device_for(config)
    rng = np.random.default_rng(17 + rope)
    n, num_pages = 13, 5
    pool, scales = code_pool(rng, config, num_pages)
    qkv = randn(rng, (n, hq + 2 * hkv, d), "float16")
    qpos = rng.integers(0, 500, n).astype(np.int32)
    slots = rng.choice(num_pages * ps, size=n, replace=False).astype(np.int32)
    slots[2] = -1
    q_ref, k_ref, v_ref = (empty((n, h, d), "float16", dev) for h in (hq, hkv, hkv))
    kernels.get(split_rotary, plain)(tensor(qkv, dev), index_view(qpos, dev), q_ref, k_ref, v_ref, rope)
    q = empty((n, hq, d), "float16", dev)
    pages = tensor(pool, dev)
    kernels.get(split_rotary_append, config)(tensor(qkv, dev), index_view(qpos, dev), q, pages,
                                            index_view(slots, dev), rope)
    np.testing.assert_array_equal(q.numpy(), q_ref.numpy())
    expected = pool.copy()
    for i, pos in enumerate(slots):
        if pos >= 0:
            expected[pos // ps, 0, :, pos % ps] = quantize(k_ref.numpy()[i], scales[0][:, None], fmt)
            expected[pos // ps, 1, :, pos % ps] = quantize(v_ref.numpy()[i], scales[1][:, None], fmt)
    np.testing.assert_array_equal(pages.numpy().view(np.uint8), expected.view(np.uint8))


# ---- attention over FP8 pages: the reference attends over the dequantized K/V in float64 ----

import reference as ref  # noqa: E402
from harness import make_paged_batch  # noqa: E402

from tir_kernels import DecodeSchedule, default_sm_scale, paged_decode, paged_prefill, tree_mask_paged_prefill  # noqa: E402,E501


def quantized_batch(rng, lengths, config, sliding=False):
    """A paged batch whose pages hold FP8 codes (the scale page last) and whose k / v are the
    dequantized float64 values the kernels must attend over."""
    hkv, d, ps = config.num_kv_heads, config.head_dim, config.page_size
    batch = make_paged_batch(rng, lengths, hkv, d, ps, "float32", sliding=sliding)
    scales = random_scales(rng, hkv)
    col = scales.reshape(1, 2, hkv, 1, 1)
    codes = quantize(batch.pages.astype(np.float64) * col * 60, col, config.kv_dtype)
    deq = dequantize(codes, col)
    batch.pages = with_scales(codes, scales)
    for i, n in enumerate(lengths):
        ids = batch.page_indices[batch.page_indptr[i]:batch.page_indptr[i + 1]]
        rows = [deq[ids[j // ps], :, :, j % ps] for j in range(n)]  # [2, Hkv, D] each
        stacked = np.stack(rows) if rows else np.zeros((0, 2, hkv, d))
        batch.k[i], batch.v[i] = stacked[:, 0], stacked[:, 1]
    return batch


def run_decode(kernels, config, batch, q, schedule=None, rotary_mode=0, q_pos=None, k_pos=None):
    dev = device_for(config)
    fn = kernels.get(paged_decode, config, *(() if schedule is None else (schedule,)))
    b = batch.batch
    o = empty((b, config.num_qo_heads, config.head_dim), config.dtype, dev)
    lse = empty((b, config.num_qo_heads), "float32", dev)
    q_pos = np.zeros(b, np.int32) if q_pos is None else q_pos
    k_pos = np.zeros(b, np.int32) if k_pos is None else k_pos
    fn(tensor(q, dev), tensor(batch.pages, dev), index_view(batch.page_indptr, dev),
       index_view(batch.page_indices, dev), index_view(batch.length_info(), dev, offset=3),
       index_view(k_pos, dev, offset=11), index_view(q_pos, dev, offset=2), o, lse, rotary_mode, 1.0, 1e4,
       default_sm_scale(config.head_dim))
    return o.numpy().astype(np.float64), lse.numpy()


def check_rows(config, o, lse, expected):
    """The kernel's arithmetic error only: the reference already holds the FP8 rounding."""
    rtol, atol = ref.TOLERANCES[config.dtype]
    for i, (eo, else_) in enumerate(expected):
        np.testing.assert_allclose(o[i], eo[0], rtol=rtol, atol=atol, err_msg=f"o of request {i}")
        np.testing.assert_allclose(lse[i], else_[0], rtol=ref.LSE_TOLERANCE[0], atol=ref.LSE_TOLERANCE[1],
                                   err_msg=f"lse of request {i}")


# (hq, hkv, d, ps, dtype, sliding, schedule): the CPU's row-tile path, its general path (4 rows a
# step), a sliding window with sinks, bf16, page size 1
DECODE_CASES = [
    (8, 2, 64, 16, "float16", False, None),
    (6, 3, 32, 8, "float16", False, DecodeSchedule(lanes=1, rows=1, rows_per_thread=4, heads_per_block=1,
                                                   max_splits=4, target_blocks=16)),
    (4, 1, 64, 4, "bfloat16", True, None),
    (4, 4, 16, 1, "float32", False, None),
]


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"h{c[0]}-{c[1]}-d{c[2]}-ps{c[3]}-{c[4]}"
                         f"{'-sliding' if c[5] else ''}{'-rows4' if c[6] else ''}")
def test_decode_over_fp8_pages(kernels, target, fmt, case):
    hq, hkv, d, ps, dtype, sliding, schedule = case
    config = fp8_config(target, fmt, hkv=hkv, hq=hq, d=d, ps=ps, dtype=dtype, sliding_window=sliding)
    rng = np.random.default_rng(zlib.crc32(f"{fmt}{case}".encode()))
    batch = quantized_batch(rng, [0, 1, ps, 37, 3 * ps + 5, 130], config, sliding=sliding)
    q = randn(rng, (batch.batch, hq, d), dtype)
    o, lse = run_decode(kernels, config, batch, q, schedule)
    expected = [ref.attention(q[i:i + 1], *batch.visible(i), default_sm_scale(d), causal=False)
                for i in range(batch.batch)]
    check_rows(config, o, lse, expected)


@pytest.mark.parametrize("fmt", FMTS)
def test_decode_over_fp8_pages_inline_rope(kernels, target, fmt):
    """rotary_mode 1: keys are dequantized, then rotated in the kernel."""
    config = fp8_config(target, fmt, hkv=2, hq=4, d=32, ps=8, dtype="float32")
    rng = np.random.default_rng(3)
    batch = quantized_batch(rng, [5, 16, 40], config)
    q = randn(rng, (3, 4, 32), "float32")
    q_pos, k_pos = np.array([9, 30, 100], np.int32), np.array([4, 14, 60], np.int32)
    o, lse = run_decode(kernels, config, batch, q, rotary_mode=1, q_pos=q_pos, k_pos=k_pos)
    expected = []
    for i in range(3):
        k, v = batch.visible(i)
        expected.append(ref.attention(ref.rope(q[i:i + 1], q_pos[i:i + 1]), ref.rope(k, k_pos[i] + np.arange(len(k))),
                                      v, default_sm_scale(32), causal=False))
    check_rows(config, o, lse, expected)


PREFILL_CASES = [(8, 2, 64, 16, "float16"), (4, 4, 32, 1, "float32"), (8, 1, 64, 8, "bfloat16")]


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: "-".join(map(str, c)))
def test_paged_prefill_over_fp8_pages(kernels, target, fmt, causal, case):
    from test_prefill import check, expected, indptr, run_paged

    hq, hkv, d, ps, dtype = case
    config = fp8_config(target, fmt, hkv=hkv, hq=hq, d=d, ps=ps, dtype=dtype)
    rng = np.random.default_rng(zlib.crc32(f"{fmt}{case}{causal}".encode()))
    requests = [(1, 1), (9, 9), (5, 2 * ps + 3), (17, 70)]
    batch = quantized_batch(rng, [kv for _, kv in requests], config)
    q = randn(rng, (sum(qo for qo, _ in requests), hq, d), dtype)
    qo_indptr = indptr([qo for qo, _ in requests])
    o, lse = run_paged(kernels, config, batch, q, qo_indptr, causal)
    check(config, o, lse, qo_indptr, expected(q, qo_indptr, batch.visible, default_sm_scale(d), causal),
          FP8_BF16_LSE_TOLERANCE if dtype == "bfloat16" else ref.LSE_TOLERANCE)


@pytest.mark.parametrize("fmt", FMTS)
def test_paged_prefill_over_fp8_pages_inline_rope(kernels, target, fmt):
    from test_prefill import check, expected, indptr, rope_args, run_paged

    config = fp8_config(target, fmt, hkv=2, hq=4, d=32, ps=4, dtype="float32")
    rng = np.random.default_rng(19)
    requests = [(9, 9), (12, 40), (1, 33)]
    batch = quantized_batch(rng, [kv for _, kv in requests], config)
    q = randn(rng, (22, 4, 32), "float32")
    qo_indptr = indptr([qo for qo, _ in requests])
    k_pos, q_pos = rope_args(*zip(*requests))
    rope = (5e5, 0.5)
    o, lse = run_paged(kernels, config, batch, q, qo_indptr, True, 1, rope, k_pos, q_pos)
    check(config, o, lse, qo_indptr, expected(q, qo_indptr, batch.visible, default_sm_scale(32), True,
                                              (*rope, None), k_pos, q_pos))


@pytest.mark.parametrize("fmt", FMTS)
def test_tree_prefill_over_fp8_pages(kernels, target, fmt):
    from test_prefill import check, indptr
    from test_tree_prefill import TREE_BATCH, expected_tree, run_tree

    config = fp8_config(target, fmt, hkv=2, hq=8, d=64, ps=16)
    rng = np.random.default_rng(23)
    batch = quantized_batch(rng, [h + len(parents) for h, parents, _ in TREE_BATCH], config)
    qo_lens = [qo for _, _, qo in TREE_BATCH]
    q = randn(rng, (sum(qo_lens), 8, 64), "float16")
    mn_indptr = indptr([len(parents) for _, parents, _ in TREE_BATCH])
    intervals = np.concatenate([ref.dfs_intervals(parents) for _, parents, _ in TREE_BATCH]).astype(np.int32)
    qo_indptr = indptr(qo_lens)
    o, lse = run_tree(kernels, config, batch, q, qo_indptr, mn_indptr, intervals)
    check(config, o, lse, qo_indptr, expected_tree(q, qo_indptr, batch, TREE_BATCH, default_sm_scale(64)))


# ---- CUDA: the FP8 kernels' source for sm_90 (built without a GPU) compiles with nvcc ----

import shutil  # noqa: E402
import subprocess  # noqa: E402

from tir_kernels import choose_decode_kernel, choose_prefill_kernel  # noqa: E402

NVCC = shutil.which("nvcc")


def cuda_sources(func, config) -> str:
    import tvm

    from tir_kernels.build import PIPELINE

    name = str(func.attrs["global_symbol"])
    module = tvm.compile(tvm.IRModule({name: func}), target=config.tvm_target(), tir_pipeline=PIPELINE)
    return "\n".join(m.inspect_source() for m in module.mod.imports)


# the default tier: e4m3 decode, prefill and the fused append (nvcc takes seconds a kernel)
CUDA_GENERATORS = [
    pytest.param(fmt, generator, args, id=f"{name}-{fmt.split('_')[1]}",
                 marks=() if fmt == "float8_e4m3fn" and name in ("decode", "prefill", "split_rotary_append")
                 else pytest.mark.slow)
    for fmt in FP8_KV_DTYPES
    for generator, args, name in [(transpose_append, (), "transpose_append"),
                                  (split_rotary_append, (), "split_rotary_append"), (debug_get_kv, (2,), "debug_get_kv"),
                                  (copy_single_page, (), "copy_single_page"), (paged_decode, (), "decode"),
                                  (paged_prefill, (), "prefill"), (tree_mask_paged_prefill, (), "tree")]
]


@pytest.mark.parametrize("fmt,generator,args", CUDA_GENERATORS)
def test_fp8_kernels_build_cuda_source_for_sm90(tmp_path, fmt, generator, args):
    """Each FP8 kernel builds for cuda:sm_90 on a machine without a GPU, its pages are
    `__nv_fp8_*` (1 byte an element), and its source compiles with nvcc for sm_90 where nvcc is
    installed."""
    config = fp8_config("cuda:sm_90", fmt, hkv=8, hq=32, d=128, ps=16)
    source = cuda_sources(generator(config, *args), config)
    assert ("__nv_fp8_e4m3" if "e4m3" in fmt else "__nv_fp8_e5m2") in source
    if NVCC is None:
        return
    path = tmp_path / "kernel.cu"
    path.write_text(source)
    result = subprocess.run([NVCC, "-arch=sm_90", "-c", "-w", str(path), "-o", str(tmp_path / "kernel.o")],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


def test_fp8_dispatch_names_the_kernels():
    """FP8 pages take the tensor-core decode on Hopper where fp16 pages would (GQA groups of
    4..16), else the CUDA-core one with its reason; the CUDA-core prefill, saying why; the ragged
    prefill reads no pages and keeps its tensor-core kernel."""
    config = fp8_config("cuda:sm_90", "float8_e4m3fn", hkv=8, hq=32, d=128, ps=16)
    decode = choose_decode_kernel(config)
    assert decode.kernel == "decode_tc" and decode.reason is None
    mha = choose_decode_kernel(config.replace(num_qo_heads=8))
    assert mha.kernel == "decode" and "GQA group 1" in mha.reason
    assert choose_decode_kernel(config.replace(dtype="float32")).kernel == "decode"
    prefill = choose_prefill_kernel(config)
    assert prefill.kernel == "prefill" and "FP8" in prefill.reason
    assert choose_prefill_kernel(config.replace(kv_dtype="")).kernel == "prefill_sm90"
    from tir_kernels import ragged_prefill
    from tir_kernels.build import uses_tirx_pipeline

    assert uses_tirx_pipeline(ragged_prefill(config))  # the wgmma kernel


def test_kv_dtype_is_validated():
    with pytest.raises(ValueError, match="kv_dtype='int8'"):
        AttentionConfig(4, 4, 64, kv_dtype="int8")
    with pytest.raises(ValueError, match="kv_dtype='float32'"):
        AttentionConfig(4, 4, 64, dtype="float16", kv_dtype="float32")
    assert AttentionConfig(4, 4, 64, kv_dtype="float16").kv_dtype == ""


# ---- the tensor-core decode (decode_tc.py) over FP8 pages ----

from tir_kernels import TensorCoreDecodeSchedule  # noqa: E402
from tir_kernels.decode_tc import paged_decode_tc  # noqa: E402

# (hq, hkv, d, ps, dtype, sliding): groups 4, 8 and 16, head dims 64..256, a sliding window
TC_CASES = [(16, 4, 128, 16, "float16", False), (16, 2, 64, 8, "bfloat16", False), (16, 1, 256, 16, "float16", False),
            (8, 2, 128, 16, "bfloat16", True)]
TC_BUILDS = [
    pytest.param(fmt, case, id=f"h{case[0]}-{case[1]}-d{case[2]}-{case[4]}{'-sliding' if case[5] else ''}-"
                 f"{fmt.split('_')[1]}", marks=() if i == 0 and fmt == "float8_e4m3fn" else pytest.mark.slow)
    for fmt in FP8_KV_DTYPES for i, case in enumerate(TC_CASES)
]


@pytest.mark.parametrize("fmt,case", TC_BUILDS)
def test_fp8_tensor_core_decode_builds_for_sm90(tmp_path, fmt, case):
    """paged_decode of an FP8 config on sm_90 is the tensor-core kernel (plain and inline-RoPE
    builds in one function); it loads the pages through the FP8 tile conversion (no cp.async of
    pages), and its source compiles with nvcc where installed."""
    hq, hkv, d, ps, dtype, sliding = case
    config = fp8_config("cuda:sm_90", fmt, hkv=hkv, hq=hq, d=d, ps=ps, dtype=dtype, sliding_window=sliding)
    assert choose_decode_kernel(config).kernel == "decode_tc"
    source = cuda_sources(paged_decode(config), config)
    assert f"tvmattn_fp8_chunk_{fmt}_{dtype}(" in source
    if NVCC is None:
        return
    path = tmp_path / "kernel.cu"
    path.write_text(source)
    result = subprocess.run([NVCC, "-arch=sm_90", "-c", "-w", str(path), "-o", str(tmp_path / "kernel.o")],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("case", TC_CASES, ids=lambda c: f"h{c[0]}-{c[1]}-d{c[2]}-{c[4]}{'-sliding' if c[5] else ''}")
def test_tensor_core_decode_over_fp8_pages(kernels, fmt, case):
    """decode_tc over FP8 pages against the reference on the dequantized K/V: empty, short and
    split lengths (one split, several, a batch of one long request)."""
    hq, hkv, d, ps, dtype, sliding = case
    config = fp8_config("cuda", fmt, hkv=hkv, hq=hq, d=d, ps=ps, dtype=dtype, sliding_window=sliding)
    assert choose_decode_kernel(config).kernel == "decode_tc"
    rng = np.random.default_rng(zlib.crc32(f"tc{fmt}{case}".encode()))
    for lengths in ([0, 1, ps, 37, 3 * ps + 5, 700], [3000]):
        batch = quantized_batch(rng, lengths, config, sliding=sliding)
        q = randn(rng, (batch.batch, hq, d), dtype)
        o, lse = run_decode(kernels, config, batch, q)
        expected = [ref.attention(q[i:i + 1], *batch.visible(i), default_sm_scale(d), causal=False)
                    for i in range(batch.batch)]
        check_rows(config, o, lse, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_tensor_core_decode_over_fp8_pages_inline_rope(kernels, fmt, dtype):
    """rotary_mode 1 on decode_tc: the tile's code values are rotated, the K scale applied to the
    scores; against the reference that rotates the dequantized keys."""
    config = fp8_config("cuda", fmt, hkv=2, hq=8, d=128, ps=16, dtype=dtype)
    rng = np.random.default_rng(zlib.crc32(f"tcrope{fmt}{dtype}".encode()))
    batch = quantized_batch(rng, [5, 16, 400], config)
    q = randn(rng, (3, 8, 128), dtype)
    q_pos, k_pos = np.array([9, 30, 500], np.int32), np.array([4, 14, 100], np.int32)
    o, lse = run_decode(kernels, config, batch, q, rotary_mode=1, q_pos=q_pos, k_pos=k_pos)
    expected = []
    for i in range(3):
        k, v = batch.visible(i)
        expected.append(ref.attention(ref.rope(q[i:i + 1], q_pos[i:i + 1]), ref.rope(k, k_pos[i] + np.arange(len(k))),
                                      v, default_sm_scale(128), causal=False))
    check_rows(config, o, lse, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FMTS)
def test_tensor_core_decode_schedules_over_fp8_pages(kernels, fmt):
    """Other decode_tc schedules on FP8 pages: the separate split merge (no fused merge), two
    stages, Q fragments from shared memory, page lookups per tile."""
    config = fp8_config("cuda", fmt, hkv=2, hq=16, d=128, ps=16, dtype="float16")
    rng = np.random.default_rng(zlib.crc32(f"tcsched{fmt}".encode()))
    batch = quantized_batch(rng, [1, 300, 1000], config)
    q = randn(rng, (3, 16, 128), "float16")
    expected = [ref.attention(q[i:i + 1], *batch.visible(i), default_sm_scale(128), causal=False) for i in range(3)]
    for sched in (TensorCoreDecodeSchedule(warps=4, keys_per_warp=16, stages=2, q_in_registers=False, max_splits=8,
                                           target_blocks=16, min_split_keys=64),
                  TensorCoreDecodeSchedule(warps=2, keys_per_warp=32, stages=3, max_splits=4, target_blocks=8,
                                           min_split_keys=128, fused_merge=True, early_pages=False),
                  TensorCoreDecodeSchedule(stages=4, max_splits=16, target_blocks=24, min_split_keys=64,
                                           early_pages=True, heads_first=True, fused_merge=True,
                                           cooperative_merge=True, dependent_launch=True, tables_before_wait=True)):
        o, lse = run_decode(kernels, config, batch, q, sched)
        check_rows(config, o, lse, expected)


def test_tensor_core_decode_schedule_accepts_fp8_pages():
    """A TensorCoreDecodeSchedule names the tensor-core kernel for FP8 pages too."""
    config = fp8_config("cuda:sm_90", "float8_e5m2", hkv=2, hq=16, d=128, ps=16)
    sched = TensorCoreDecodeSchedule(warps=4, keys_per_warp=16, stages=2)
    assert choose_decode_kernel(config, sched).kernel == "decode_tc"
    assert paged_decode_tc(config, sched) is not None
