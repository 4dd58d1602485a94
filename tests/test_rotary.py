"""split_rotary (split fused QKV, RoPE on q and k) against reference.rope, and
split_rotary_append (the same split with k and v written straight into their page slots)."""

import numpy as np
import pytest
import tvm
import reference as ref
from harness import device_for, empty, index_view, randn, tensor

from tir_kernels import AttentionConfig, RopeScaling, split_rotary, split_rotary_append

LLAMA3 = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)

# (num_qo_heads, num_kv_heads, head_dim, dtype, rope_theta, rope_scale, rope_scaling)
CASES = [
    (8, 2, 128, "float16", 1e4, 1.0, None),
    (4, 4, 64, "float32", 5e5, 0.5, LLAMA3),
    (16, 1, 256, "bfloat16", 1e6, 1.0, None),
    (6, 2, 80, "float32", 1e4, 1.0, None),
    (8, 4, 128, "bfloat16", 5e5, 1.0, LLAMA3),
]


def case_id(case):
    hq, hkv, d, dtype, theta, scale, scaling = case
    return f"hq{hq}-hkv{hkv}-d{d}-{dtype}-theta{theta:g}-scale{scale:g}" + ("-llama3" if scaling else "")


def make_config(case, target, page_size=16):
    hq, hkv, d, dtype, theta, scale, scaling = case
    return AttentionConfig(hq, hkv, d, dtype=dtype, target=target, rope_theta=theta, rope_scale=scale,
                           rope_scaling=scaling, page_size=page_size)


def expected_qkv(case, qkv, positions, apply_rope):
    """(q, k, v) as float64: the heads of qkv, q and k rotated to `positions` when apply_rope."""
    hq, hkv, d, dtype, theta, scale, scaling = case
    q, k, v = (x.astype(np.float64) for x in (qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]))
    if apply_rope:
        q, k = (ref.rope(x, positions, theta, scale, scaling) for x in (q, k))
    return q, k, v


# token counts: on the CPU, fewer than rotary.CPU_PARALLEL_TOKENS (16) run a serial loop, more a parallel one
@pytest.mark.parametrize("n", [23, 5])
@pytest.mark.parametrize("apply_rope", [1, 0], ids=["rope", "no-rope"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_split_rotary(kernels, target, case, apply_rope, n):
    hq, hkv, d, dtype, theta, scale, scaling = case
    config = make_config(case, target)
    dev = device_for(config)
    rng = np.random.default_rng(hq * 1000 + d)
    qkv = randn(rng, (n, hq + 2 * hkv, d), dtype)
    positions = rng.integers(0, 300, n).astype(np.int32)
    positions[:3] = [0, 1, 299]
    q, k, v = (empty((n, h, d), dtype, dev) for h in (hq, hkv, hkv))
    kernels.get(split_rotary, config)(tensor(qkv, dev), index_view(positions, dev, offset=9), q, k, v, apply_rope)
    q, k, v = q.numpy(), k.numpy(), v.numpy()
    q_in, k_in, v_in = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
    np.testing.assert_array_equal(v, v_in)
    if not apply_rope:
        np.testing.assert_array_equal(q, q_in)
        np.testing.assert_array_equal(k, k_in)
        return
    rtol, atol = ref.TOLERANCES[dtype]
    for name, out, x in (("q", q, q_in), ("k", k, k_in)):
        expected = ref.rope(x, positions, theta, scale, scaling)
        np.testing.assert_allclose(out.astype(np.float64), expected, rtol=rtol, atol=atol, err_msg=name)


@pytest.mark.parametrize("n", [19, 4])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("apply_rope", [1, 0], ids=["rope", "no-rope"])
@pytest.mark.parametrize("case", CASES[:3], ids=case_id)
def test_split_rotary_append(kernels, target, case, apply_rope, page_size, n):
    """q as split_rotary's; k and v land in their slots of the pool (a negative slot stores
    nothing), every other slot keeps its value."""
    hq, hkv, d, dtype, *_ = case
    config = make_config(case, target, page_size)
    dev = device_for(config)
    rng = np.random.default_rng(hq * 100 + page_size)
    num_pages = 48 // page_size + 2
    qkv = randn(rng, (n, hq + 2 * hkv, d), dtype)
    positions = rng.integers(0, 300, n).astype(np.int32)
    slots = rng.permutation(num_pages * page_size)[:n].astype(np.int32)
    slots[1::8] = -1
    pool = randn(rng, (num_pages, 2, hkv, page_size, d), dtype)
    pages, q = tensor(pool, dev), empty((n, hq, d), dtype, dev)
    kernels.get(split_rotary_append, config)(tensor(qkv, dev), index_view(positions, dev, offset=5), q, pages,
                                             index_view(slots, dev, offset=2), apply_rope)
    q_ref, k_ref, v_ref = expected_qkv(case, qkv, positions, apply_rope)
    want = pool.astype(np.float64)
    for token, slot in enumerate(slots):
        if slot >= 0:
            want[slot // page_size, 0, :, slot % page_size] = k_ref[token]
            want[slot // page_size, 1, :, slot % page_size] = v_ref[token]
    rtol, atol = ref.TOLERANCES[dtype] if apply_rope else (0, 0)
    np.testing.assert_allclose(q.numpy().astype(np.float64), q_ref, rtol=rtol, atol=atol, err_msg="q")
    np.testing.assert_allclose(pages.numpy().astype(np.float64), want, rtol=rtol, atol=atol, err_msg="pages")


def test_split_rotary_validation():
    with pytest.raises(ValueError, match="v_head_dim"):
        split_rotary(AttentionConfig(4, 4, 64, v_head_dim=128))
    with pytest.raises(ValueError, match="v_head_dim=128 is not supported by split_rotary_append"):
        split_rotary_append(AttentionConfig(4, 4, 64, v_head_dim=128))


@pytest.mark.parametrize("generator", [split_rotary, split_rotary_append], ids=lambda g: g.__name__)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_cuda_codegen(case, generator):
    """split_rotary(_append) compiles for CUDA (no GPU needed) and moves 16 bytes per access."""
    config = make_config(case, "cuda")
    func = generator(config)
    name = str(func.attrs["global_symbol"])
    source = tvm.compile(tvm.IRModule({name: func}), target=config.tvm_target()).mod.imports[0].inspect_source()
    vector_type = "float4" if config.dtype == "float32" else "uint4"
    assert f"*({vector_type}*)" in source, f"no 16-byte accesses in\n{source}"
