"""MLA layers on FP8 latent pages (MLAConfig.kv_dtype): the page operations that write codes
(append) and read them (debug_get_kv), and the paged decode and prefill, against float64
references on the dequantized latent rows, on the CPU; their CUDA builds for sm_90 (nvcc where
installed), the kernel choice on CUDA, and on the GPU machine their CUDA runs.

An MLA pool's scales are two per layer: one for the latent columns (below latent_dim, also the
values) and one for the rotary key columns (tir_kernels.kv_quant). The tests give them values a
decade apart, so a column read with the other part's scale shows.
"""

import shutil
import subprocess
import zlib

import numpy as np
import pytest
import reference as ref
from fp8_reference import FP8_BF16_LSE_TOLERANCE, column_scales, dequantize, np_fp8, quantize, with_mla_scales
from harness import device_for, empty, index_view, randn, tensor

from tir_kernels import MLAConfig
from tir_kernels.mla import (choose_mla_decode_default, choose_mla_decode_kernel, choose_mla_prefill_kernel,
                             mla_debug_get_kv, mla_paged_decode, mla_paged_decode_auto, mla_paged_prefill,
                             mla_transpose_append, mla_copy_single_page)
from tir_kernels.support import FP8_KV_DTYPES

FMTS = [pytest.param(f, id=f.split("_")[1]) for f in FP8_KV_DTYPES]
SM_SCALE = 1.0 / np.sqrt(192.0)
# (num_heads, latent_dim, rope_dim, page_size, dtype): every dtype, a rope part and none, page 1
CASES = [(4, 64, 16, 16, "float16"), (3, 32, 32, 1, "bfloat16"), (8, 32, 0, 4, "float32")]
NVCC = shutil.which("nvcc")


def case_id(case):
    h, latent, rope, ps, dtype = case
    return f"h{h}-l{latent}-r{rope}-ps{ps}-{dtype}"


def fp8_config(case, target, fmt):
    h, latent, rope, ps, dtype = case
    return MLAConfig(h, latent_dim=latent, rope_dim=rope, dtype=dtype, page_size=ps, target=target, kv_dtype=fmt)


def rng_for(*parts):
    return np.random.default_rng(zlib.crc32("-".join(map(str, parts)).encode()))


def mla_scales(rng):
    """(latent, rope) scales a decade apart (the rotary part larger, as un-normalized keys are)."""
    latent = 10.0 ** rng.uniform(-2.2, -1.8)
    return np.array([latent, latent * 10.0], np.float32)


def code_pool(rng, config, num_pages, scales):
    """Codes of random rows of about 40 units of their column's scale in every data page, the
    scale page last; also the dequantized float64 rows [num_pages, ps, qk_dim]."""
    cols = column_scales(scales, config.latent_dim, config.qk_dim)
    values = rng.standard_normal((num_pages, config.page_size, config.qk_dim)) * cols * 40
    codes = quantize(values, cols, config.kv_dtype)
    return with_mla_scales(codes, scales), dequantize(codes, cols)


def paged_batch(rng, config, lengths, scales, spare_pages=2):
    """A shuffled FP8 pool holding each request's rows: (pool, rows per request (dequantized,
    float64), page_indptr, page_indices, last_page_len)."""
    ps = config.page_size
    per_req = [-(-n // ps) for n in lengths]
    total = sum(per_req) + spare_pages
    pool, values = code_pool(rng, config, total, scales)
    order = rng.permutation(total)
    indptr, indices, last, rows, cursor = [0], [], [], [], 0
    for n, npg in zip(lengths, per_req):
        ids = order[cursor:cursor + npg]
        cursor += npg
        rows.append(np.concatenate([values[i] for i in ids])[:n] if npg else np.zeros((0, config.qk_dim)))
        indices.extend(ids.tolist())
        indptr.append(len(indices))
        last.append(n - (npg - 1) * ps if npg else 0)
    return pool, rows, np.array(indptr, np.int32), np.array(indices, np.int32), np.array(last, np.int32)


def expected_attention(q, rows, latent_dim, causal):
    """Attention over the expanded per-head K (the row) and V (its latent part), float64."""
    k = np.repeat(np.asarray(rows, np.float64)[:, None, :], q.shape[1], axis=1)
    return ref.attention(q, k, k[:, :, :latent_dim], SM_SCALE, causal)


def check(config, o, lse, eo, el, what):
    rtol, atol = ref.TOLERANCES[config.dtype]
    np.testing.assert_allclose(o, eo, rtol=rtol, atol=atol, err_msg=f"o of {what}")
    lse_rtol, lse_atol = FP8_BF16_LSE_TOLERANCE if config.dtype == "bfloat16" else ref.LSE_TOLERANCE
    np.testing.assert_allclose(lse, el, rtol=lse_rtol, atol=lse_atol, err_msg=f"lse of {what}")


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("case", CASES[:2], ids=case_id)
def test_append_quantizes_debug_get_kv_dequantizes_copy_moves_codes(kernels, target, fmt, case):
    """append_mla stores the code of x / scale of x's part (latent or rope), -1 skips a token;
    debug_get_kv reads code * scale in the dtype; copy_single_page moves codes; the scale page
    is never written."""
    config = fp8_config(case, target, fmt)
    dev = device_for(config)
    rng = rng_for("append", fmt, case_id(case))
    scales = mla_scales(rng)
    ps, n = config.page_size, 13
    num_pages = -(-(n + 5) // ps) + 1
    pool, _ = code_pool(rng, config, num_pages, scales)
    kv = randn(rng, (n, config.qk_dim), config.dtype) * 4
    positions = rng.choice(num_pages * ps, size=n, replace=False).astype(np.int32)
    positions[[2, 7]] = -1
    cols = column_scales(scales, config.latent_dim, config.qk_dim)
    expected = pool.copy()
    for i, pos in enumerate(positions):
        if pos >= 0:
            expected[pos // ps, pos % ps] = quantize(kv[i].astype(np.float32), cols, fmt)
    pages = tensor(pool, dev)
    kernels.get(mla_transpose_append, config)(pages, tensor(kv, dev), index_view(positions, dev))
    np.testing.assert_array_equal(pages.numpy().view(np.uint8), expected.view(np.uint8))

    kept = positions[positions >= 0]
    out = empty((2, len(kept), config.qk_dim), config.dtype, dev)
    kernels.get(mla_debug_get_kv, config, 2)(pages, index_view(kept, dev), out, 1)
    codes = expected.reshape(-1, config.qk_dim)[kept]
    want = dequantize(codes, cols).astype(out.numpy().dtype)
    np.testing.assert_array_equal(out.numpy()[1], want)

    src, tgt = int(kept[0] // ps), num_pages - 1
    length = max(1, ps // 2)
    expected[tgt, :length] = expected[src, :length]
    kernels.get(mla_copy_single_page, config)(pages, src, tgt, length)
    np.testing.assert_array_equal(pages.numpy().view(np.uint8), expected.view(np.uint8))


def run_decode(kernels, config, generator, q, pool, indptr, indices, last):
    dev = device_for(config)
    b = q.shape[0]
    o = empty((b, config.num_heads, config.latent_dim), config.dtype, dev)
    lse = empty((b, config.num_heads), "float32", dev)
    kernels.get(generator, config)(tensor(q, dev), tensor(pool, dev), index_view(indptr, dev),
                                   index_view(indices, dev, offset=5), index_view(last, dev, offset=3), o, lse,
                                   SM_SCALE)
    return o.numpy().astype(np.float64), lse.numpy()


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_decode_over_fp8_latent_pages(kernels, target, fmt, case):
    """The decode the cache builds (mla_paged_decode_auto) over FP8 pages: an empty history, one
    row, page boundaries, ragged lengths."""
    config = fp8_config(case, target, fmt)
    rng = rng_for("decode", fmt, case_id(case))
    ps = config.page_size
    lengths = [0, 1, ps, 2 * ps + 3, 37]
    pool, rows, indptr, indices, last = paged_batch(rng, config, lengths, mla_scales(rng))
    q = randn(rng, (len(lengths), config.num_heads, config.qk_dim), config.dtype)
    o, lse = run_decode(kernels, config, mla_paged_decode_auto, q, pool, indptr, indices, last)
    for i, r in enumerate(rows):
        eo, el = expected_attention(q[i:i + 1], r, config.latent_dim, causal=False)
        check(config, o[i], lse[i], eo[0], el[0], f"request {i} (length {lengths[i]})")


def test_wrong_part_scale_is_seen(kernels):
    """The same pool read as if both parts had the latent scale gives other outputs: the rotary
    columns' scale matters (a kernel reading one scale for the whole row would fail the tests)."""
    config = fp8_config(CASES[0], "llvm", "float8_e4m3fn")
    rng = rng_for("wrong")
    scales = mla_scales(rng)
    pool, rows, indptr, indices, last = paged_batch(rng, config, [20], scales)
    q = randn(rng, (1, config.num_heads, config.qk_dim), config.dtype)
    o, _ = run_decode(kernels, config, mla_paged_decode, q, pool, indptr, indices, last)
    one = pool.copy()
    one.view(np.uint8)[-1, 0, 4:8] = one.view(np.uint8)[-1, 0, 0:4]
    o_one, _ = run_decode(kernels, config, mla_paged_decode, q, one, indptr, indices, last)
    assert np.abs(o - o_one).max() > 0.05


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_prefill_over_fp8_latent_pages(kernels, target, fmt, case, causal):
    """mla_paged_prefill over FP8 pages: queries of several lengths, causal on absolute positions
    and without a mask, a request with no rows."""
    config = fp8_config(case, target, fmt)
    dev = device_for(config)
    rng = rng_for("prefill", fmt, case_id(case), causal)
    kv_lens, qo_lens = [19, 0, 40], [5, 0, 17]
    pool, rows, indptr, indices, last = paged_batch(rng, config, kv_lens, mla_scales(rng))
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    total = int(qo_indptr[-1])
    q = randn(rng, (total, config.num_heads, config.qk_dim), config.dtype)
    o = empty((total, config.num_heads, config.latent_dim), config.dtype, dev)
    lse = empty((total, config.num_heads), "float32", dev)
    kernels.get(mla_paged_prefill, config)(tensor(q, dev), index_view(qo_indptr, dev, offset=9), tensor(pool, dev),
                                           index_view(indptr, dev), index_view(indices, dev, offset=5),
                                           index_view(last, dev, offset=3), o, lse, int(causal), SM_SCALE)
    o, lse = o.numpy().astype(np.float64), lse.numpy()
    for i, r in enumerate(rows):
        lo, hi = qo_indptr[i], qo_indptr[i + 1]
        if hi > lo:
            eo, el = expected_attention(q[lo:hi], r, config.latent_dim, causal)
            check(config, o[lo:hi], lse[lo:hi], eo, el, f"request {i}")


DEEPSEEK = (16, 512, 64, 16, "bfloat16")


def test_fp8_mla_kernel_choice_on_hopper():
    """FP8 pages on sm_90 take the kernels that read them: the SIMT prefill (the wgmma prefill
    passed over with its reason), mla_tc's decode at every batch (never the wgmma decode); float32
    the SIMT decode."""
    config = fp8_config(DEEPSEEK, "cuda:sm_90", "float8_e4m3fn")
    prefill = choose_mla_prefill_kernel(config)
    assert prefill.kernel == "mla" and "kv_dtype" in prefill.reason
    assert choose_mla_prefill_kernel(config.replace(kv_dtype="")).kernel == "mla_sm90"
    assert choose_mla_decode_default(config).kernel == "mla_tc"
    for batch in (1, 8, 256):
        assert choose_mla_decode_kernel(config, batch) == "tc"
    assert choose_mla_decode_kernel(config.replace(kv_dtype=""), 1) == "wgmma"
    assert choose_mla_decode_default(config.replace(dtype="float32")).kernel == "mla"
    from tir_kernels.mla_sm90 import mla_paged_decode_wgmma, mla_paged_prefill_wgmma

    for generator in (mla_paged_decode_wgmma, mla_paged_prefill_wgmma):
        with pytest.raises(ValueError, match="kv_dtype='float8_e4m3fn'"):
            generator(config)


def cuda_source(func, config) -> str:
    import tvm

    from tir_kernels.build import PIPELINE

    name = str(func.attrs["global_symbol"])
    module = tvm.compile(tvm.IRModule({name: func}), target=config.tvm_target(), tir_pipeline=PIPELINE)
    return "\n".join(m.inspect_source() for m in module.mod.imports)


DEEPSEEK_V3 = (128, 512, 64, 64, "float16")
BUILD_CASES = [
    pytest.param(generator, args, DEEPSEEK, id=name, marks=() if name in ("decode", "prefill") else pytest.mark.slow)
    for generator, args, name in [(mla_paged_decode_auto, (), "decode"), (mla_paged_prefill, (), "prefill"),
                                  (mla_paged_decode, (), "simt_decode"), (mla_transpose_append, (), "append"),
                                  (mla_debug_get_kv, (2,), "debug_get_kv"), (mla_copy_single_page, (), "copy")]
] + [pytest.param(mla_paged_decode_auto, (), DEEPSEEK_V3, id="decode-h128", marks=pytest.mark.slow)]


def test_mla_tc_defers_fp8_stores_where_registers_allow():
    """mla_tc holds a step's FP8 loads in registers until after its MMAs where a thread's chunks
    of a tile fit MAX_STAGED_WORDS (128 heads at DeepSeek's dims: many threads a row), else
    stores each chunk as it loads it (16 heads: few threads a row); never for the dtype's pages."""
    from tir_kernels.mla_tc import MAX_STAGED_WORDS, _Layout, choose_mla_tc_schedule

    def layout(heads, fmt):
        config = MLAConfig(heads, 512, 64, dtype="float16", target="cuda:sm_90", kv_dtype=fmt)
        return _Layout(config, choose_mla_tc_schedule(config))

    wide = layout(128, "float8_e4m3fn")
    assert wide.DEFER and wide.PASSES * wide.CPT * 2 <= MAX_STAGED_WORDS
    narrow = layout(16, "float8_e4m3fn")
    assert not narrow.DEFER and narrow.PASSES * narrow.CPT * 2 > MAX_STAGED_WORDS
    assert not layout(128, "").DEFER


@pytest.mark.parametrize("generator,args,case", BUILD_CASES)
def test_fp8_mla_kernels_build_cuda_source_for_sm90(tmp_path, generator, args, case):
    """Each FP8 MLA kernel (DeepSeek-V2-Lite's shapes; the decode also V3's 128 heads) builds for
    cuda:sm_90 on a machine without a GPU, its pages are `__nv_fp8_e4m3`, and the source
    compiles with nvcc where installed."""
    config = fp8_config(case, "cuda:sm_90", "float8_e4m3fn")
    source = cuda_source(generator(config, *args), config)
    assert "__nv_fp8_e4m3" in source
    if generator is mla_paged_decode_auto:  # mla_tc, dequantizing into its tiles
        assert f"tvmattn_fp8_chunk_float8_e4m3fn_{config.dtype}_scaled(" in source
    if generator is mla_paged_decode_auto and config.num_heads == 128:  # loads deferred past the MMAs
        assert "tvmattn_fp8_store_float8_e4m3fn_float16_scaled(" in source
    if NVCC is None:
        return
    path = tmp_path / "kernel.cu"
    path.write_text(source)
    result = subprocess.run([NVCC, "-arch=sm_90", "-c", "-w", str(path), "-o", str(tmp_path / "kernel.o")],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("case", [DEEPSEEK, DEEPSEEK_V3], ids=case_id)
def test_deepseek_shapes_on_the_gpu(kernels, fmt, case):
    """DeepSeek's latent 512 + rope 64 on CUDA: decode at batches that split and that do not, and
    a causal prefill, over FP8 pages."""
    config = fp8_config(case, "cuda", fmt)
    rng = rng_for("gpu", fmt, case_id(case))
    lengths = [1, 700, 33, 2000]
    pool, rows, indptr, indices, last = paged_batch(rng, config, lengths, mla_scales(rng))
    q = randn(rng, (len(lengths), config.num_heads, config.qk_dim), config.dtype)
    o, lse = run_decode(kernels, config, mla_paged_decode_auto, q, pool, indptr, indices, last)
    for i, r in enumerate(rows):
        eo, el = expected_attention(q[i:i + 1], r, config.latent_dim, causal=False)
        check(config, o[i], lse[i], eo[0], el[0], f"request {i}")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("case", [(4, 64, 16, 16, "float16"), (40, 96, 32, 1, "bfloat16")], ids=case_id)
def test_tensor_core_decode_over_fp8_latent_pages(kernels, fmt, case):
    """mla_tc's decode (what mla_paged_decode_auto builds for fp16/bf16 on CUDA) over FP8 pages:
    lengths across pages and splits, several head tiles, both scales."""
    config = fp8_config(case, "cuda", fmt)
    assert choose_mla_decode_default(config).kernel == "mla_tc"
    rng = rng_for("tc", fmt, case_id(case))
    lengths = [0, 1, 17, 300, 2500]
    pool, rows, indptr, indices, last = paged_batch(rng, config, lengths, mla_scales(rng))
    q = randn(rng, (len(lengths), config.num_heads, config.qk_dim), config.dtype)
    o, lse = run_decode(kernels, config, mla_paged_decode_auto, q, pool, indptr, indices, last)
    for i, r in enumerate(rows):
        eo, el = expected_attention(q[i:i + 1], r, config.latent_dim, causal=False)
        check(config, o[i], lse[i], eo[0], el[0], f"request {i} (length {lengths[i]})")
