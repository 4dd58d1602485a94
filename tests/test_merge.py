"""merge_state (in-place merge of two attention states) against reference.merge_states."""

import numpy as np
import pytest
import tvm
import reference as ref
from harness import device_for, randn, tensor

from tir_kernels import EMPTY_LSE, AttentionConfig, merge_state

# (num_qo_heads, head_dim, v_head_dim, dtype)
CASES = [
    (8, 128, 128, "float16"),
    (4, 64, 64, "bfloat16"),
    (32, 256, 256, "float32"),
    (16, 192, 128, "float16"),  # v_head_dim differs from head_dim (MLA-style outputs)
    (2, 48, 48, "float32"),  # a row of 12 fp32 chunks: blocks hold a non-power-of-two row count
]


def case_id(case):
    hq, d, dv, dtype = case
    return f"hq{hq}-d{d}-dv{dv}-{dtype}"


def make_config(case, target):
    hq, d, dv, dtype = case
    return AttentionConfig(hq, hq, d, v_head_dim=dv, dtype=dtype, target=target)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_merge_state(kernels, target, case):
    """Random states, some rows empty (EMPTY_LSE) on one side or on both: no NaN anywhere."""
    hq, d, dv, dtype = case
    config = make_config(case, target)
    dev = device_for(config)
    rng = np.random.default_rng(sum(case[:3]))
    n = 37
    o1, o2 = randn(rng, (n, hq, dv), dtype), randn(rng, (n, hq, dv), dtype)
    lse1 = rng.uniform(-8, 20, (n, hq)).astype(np.float32)
    lse2 = rng.uniform(-8, 20, (n, hq)).astype(np.float32)
    lse1[3] = EMPTY_LSE
    lse2[5] = EMPTY_LSE
    lse1[7, : hq // 2 + 1] = EMPTY_LSE
    lse2[7, : hq // 2 + 1] = EMPTY_LSE
    lse2[9, ::2] = lse1[9, ::2]  # equal weights
    o1[7, : hq // 2 + 1] = 0  # empty rows carry o = 0
    o2[7, : hq // 2 + 1] = 0
    exp_o, exp_lse = ref.merge_states(o1, lse1, o2, lse2)
    o, lse = tensor(o1, dev), tensor(lse1, dev)
    kernels.get(merge_state, config)(o, lse, tensor(o2, dev), tensor(lse2, dev))
    o, lse = o.numpy().astype(np.float64), lse.numpy()
    assert np.isfinite(o).all() and np.isfinite(lse).all()
    rtol, atol = ref.TOLERANCES[dtype]
    np.testing.assert_allclose(o, exp_o, rtol=rtol, atol=atol)
    np.testing.assert_allclose(lse, exp_lse, rtol=ref.LSE_TOLERANCE[0], atol=ref.LSE_TOLERANCE[1])
    # A row that is empty on one side takes the other side unchanged.
    np.testing.assert_allclose(o[3], o2[3].astype(np.float64), rtol=rtol, atol=atol)
    np.testing.assert_allclose(o[5], o1[5].astype(np.float64), rtol=rtol, atol=atol)
    np.testing.assert_array_equal(o[7, : hq // 2 + 1], 0)


def test_merge_state_validation():
    from tir_kernels import CopySchedule

    with pytest.raises(ValueError, match="vector"):
        merge_state(AttentionConfig(4, 4, 48, target="cuda"), CopySchedule(vector=32, threads=128))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_cuda_codegen(case):
    """merge_state compiles for CUDA (no GPU needed) and moves 16 bytes per access."""
    config = make_config(case, "cuda")
    func = merge_state(config)
    name = str(func.attrs["global_symbol"])
    source = tvm.compile(tvm.IRModule({name: func}), target=config.tvm_target()).mod.imports[0].inspect_source()
    vector_type = "float4" if config.dtype == "float32" else "uint4"
    assert f"*({vector_type}*)" in source, f"no 16-byte accesses in\n{source}"
