"""TVM's own attention kernels through our harness and reference: the harness agrees with them.

If these pass, a failure elsewhere is in our kernels, not in the harness (random paged
batches with shuffled page ids, junk in unused slots, index views with non-zero element
offsets, base-2 LSE reference). TVM's kernels come from `tvm.relax.frontend.nn.llm`: the
CPU ones (`_attention_*_cpu`) for llvm, the GPU ones (`_attention_*`, already scheduled) for
CUDA; both compile with plain `tvm.compile`.

Quirks of TVM's kernels that shape these tests:
- their CUDA kernels load whole tiles and mask afterwards, so they read slots no request
  owns: the harness's junk value (300) is finite, so masked scores stay harmless;
- their online softmax starts from a phantom entry (m = -5e4, d = 1): a row that sees no
  key gets o = 0 and lse = -5e4, which is our EMPTY_LSE convention, so the empty request
  in the decode batch is compared like any other.
"""

import numpy as np
import pytest
import reference as ref
from harness import device_for, empty, index_view, make_paged_batch, randn, tensor
from tvm.relax.frontend.nn.llm.kv_cache import (
    _attention_decode,
    _attention_decode_cpu,
    _attention_prefill,
    _attention_prefill_cpu,
    _attention_prefill_ragged,
    _attention_prefill_ragged_cpu,
)

from tir_kernels import AttentionConfig, default_sm_scale

HQ, HKV, D, PAGE_SIZE, DTYPE = 32, 8, 128, 16, "float16"
ROPE_THETA, ROPE_SCALE = 5e5, 0.5
NO_ROPE_SCALING = {}  # TVM's spelling of "default RoPE"


# Adapters: config -> TVM's PrimFunc, so that the session kernel cache builds them once.
def tvm_paged_decode(config: AttentionConfig):
    if config.is_gpu:
        return _attention_decode(config.num_kv_heads, config.num_qo_heads, config.head_dim, config.dtype,
                                 config.sliding_window, NO_ROPE_SCALING, config.tvm_target(), config.page_size)
    return _attention_decode_cpu(config.num_kv_heads, config.num_qo_heads, config.head_dim, config.dtype,
                                 config.sliding_window, NO_ROPE_SCALING, config.page_size)


def tvm_paged_prefill(config: AttentionConfig):
    if config.is_gpu:
        return _attention_prefill(config.num_kv_heads, config.num_qo_heads, config.head_dim, config.dtype,
                                  config.sliding_window, NO_ROPE_SCALING, config.tvm_target(), config.page_size)
    return _attention_prefill_cpu(config.num_kv_heads, config.num_qo_heads, config.head_dim, config.dtype,
                                  config.sliding_window, NO_ROPE_SCALING, config.page_size)


def tvm_ragged_prefill(config: AttentionConfig):
    if config.is_gpu:
        return _attention_prefill_ragged(config.num_kv_heads, config.num_qo_heads, config.head_dim,
                                         config.v_head_dim, config.dtype, NO_ROPE_SCALING, config.tvm_target())
    return _attention_prefill_ragged_cpu(config.num_kv_heads, config.num_qo_heads, config.head_dim,
                                         config.v_head_dim, config.dtype, NO_ROPE_SCALING)


def make_config(target):
    return AttentionConfig(HQ, HKV, D, dtype=DTYPE, page_size=PAGE_SIZE, target=target)


def check(o, lse, expected, rows_of):
    """expected[i] = (o, lse) of request i; rows_of(i) = its slice of the packed outputs."""
    rtol, atol = ref.TOLERANCES[DTYPE]
    for i, (eo, el) in enumerate(expected):
        np.testing.assert_allclose(o[rows_of(i)], eo, rtol=rtol, atol=atol, err_msg=f"o of request {i}")
        np.testing.assert_allclose(lse[rows_of(i)], el, rtol=ref.LSE_TOLERANCE[0], atol=ref.LSE_TOLERANCE[1],
                                   err_msg=f"lse of request {i}")


def roped(x, positions, rotary_mode):
    return ref.rope(x, positions, ROPE_THETA, ROPE_SCALE) if rotary_mode else x


@pytest.mark.parametrize("rotary_mode", [0, 1], ids=["no-rope", "inline-rope"])
def test_tvm_paged_decode(kernels, target, rotary_mode):
    config = make_config(target)
    dev = device_for(config)
    rng = np.random.default_rng(11 + rotary_mode)
    batch = make_paged_batch(rng, [0, 1, 15, 16, 37, 130], HKV, D, PAGE_SIZE, DTYPE)
    b = batch.batch
    q = randn(rng, (b, HQ, D), DTYPE)
    q_pos = np.array([len(k) - 1 + 3 for k in batch.k], np.int32)
    k_pos = np.full(b, 3, np.int32)
    o, lse = empty((b, HQ, D), DTYPE, dev), empty((b, HQ), "float32", dev)
    kernels.get(tvm_paged_decode, config)(
        tensor(q, dev), tensor(batch.pages, dev), index_view(batch.page_indptr, dev),
        index_view(batch.page_indices, dev), index_view(batch.length_info(), dev, offset=3),
        index_view(k_pos, dev, offset=11), index_view(q_pos, dev, offset=2), o, lse,
        rotary_mode, ROPE_SCALE, ROPE_THETA, default_sm_scale(D))
    expected = [
        ref.attention(roped(q[i : i + 1], q_pos[i : i + 1], rotary_mode),
                      roped(batch.k[i], k_pos[i] + np.arange(len(batch.k[i])), rotary_mode),
                      batch.v[i], default_sm_scale(D), causal=False)
        for i in range(b)
    ]
    check(o.numpy().astype(np.float64), lse.numpy(), expected, lambda i: slice(i, i + 1))


@pytest.mark.parametrize("causal,rotary_mode", [(1, 0), (0, 0), (1, 1)], ids=["causal", "non-causal", "causal-inline-rope"])
def test_tvm_paged_prefill(kernels, target, causal, rotary_mode):
    config = make_config(target)
    dev = device_for(config)
    rng = np.random.default_rng(23 + causal + 2 * rotary_mode)
    kv_lens, qo_lens = [5, 1, 16, 37, 70], [3, 1, 16, 5, 33]
    batch = make_paged_batch(rng, kv_lens, HKV, D, PAGE_SIZE, DTYPE)
    qo_indptr = np.cumsum([0] + qo_lens).astype(np.int32)
    total = int(qo_indptr[-1])
    q = randn(rng, (total, HQ, D), DTYPE)
    # Query j of request i is token kv_len - qo_len + j; keys start at position 0.
    q_pos = np.concatenate([np.arange(kv - qo, kv) for kv, qo in zip(kv_lens, qo_lens)]).astype(np.int32)
    k_pos = np.zeros(batch.batch, np.int32)
    o, lse = empty((total, HQ, D), DTYPE, dev), empty((total, HQ), "float32", dev)
    kernels.get(tvm_paged_prefill, config)(
        tensor(q, dev), index_view(qo_indptr, dev, offset=5), tensor(batch.pages, dev),
        index_view(batch.page_indptr, dev), index_view(batch.page_indices, dev),
        index_view(batch.length_info(), dev, offset=3), index_view(k_pos, dev, offset=11),
        index_view(q_pos, dev, offset=2), o, lse, causal, rotary_mode, ROPE_SCALE, ROPE_THETA, default_sm_scale(D))
    rows = lambda i: slice(qo_indptr[i], qo_indptr[i + 1])  # noqa: E731
    expected = [
        ref.attention(roped(q[rows(i)], q_pos[rows(i)], rotary_mode),
                      roped(batch.k[i], np.arange(kv_lens[i]), rotary_mode),
                      batch.v[i], default_sm_scale(D), causal=bool(causal))
        for i in range(batch.batch)
    ]
    check(o.numpy().astype(np.float64), lse.numpy(), expected, rows)


@pytest.mark.parametrize("causal", [1, 0], ids=["causal", "non-causal"])
def test_tvm_ragged_prefill(kernels, target, causal):
    config = make_config(target)
    dev = device_for(config)
    rng = np.random.default_rng(31 + causal)
    kv_lens, qo_lens = [5, 1, 16, 37, 70], [3, 1, 16, 37, 33]
    qo_indptr = np.cumsum([0] + qo_lens).astype(np.int32)
    kv_indptr = np.cumsum([0] + kv_lens).astype(np.int32)
    q = randn(rng, (int(qo_indptr[-1]), HQ, D), DTYPE)
    k = randn(rng, (int(kv_indptr[-1]), HKV, D), DTYPE)
    v = randn(rng, (int(kv_indptr[-1]), HKV, D), DTYPE)
    q_pos = np.zeros(len(q), np.int32)
    k_pos = np.zeros(len(kv_lens), np.int32)
    o, lse = empty(q.shape, DTYPE, dev), empty(q.shape[:2], "float32", dev)
    kernels.get(tvm_ragged_prefill, config)(
        tensor(q, dev), index_view(qo_indptr, dev, offset=5), tensor(k, dev), tensor(v, dev),
        index_view(kv_indptr, dev, offset=9), index_view(q_pos, dev, offset=2), index_view(k_pos, dev, offset=11),
        o, lse, causal, 0, 1.0, 1e4, default_sm_scale(D))
    rows = lambda i: slice(qo_indptr[i], qo_indptr[i + 1])  # noqa: E731
    expected = [
        ref.attention(q[rows(i)], k[kv_indptr[i] : kv_indptr[i + 1]], v[kv_indptr[i] : kv_indptr[i + 1]],
                      default_sm_scale(D), causal=bool(causal))
        for i in range(len(kv_lens))
    ]
    check(o.numpy().astype(np.float64), lse.numpy(), expected, rows)
