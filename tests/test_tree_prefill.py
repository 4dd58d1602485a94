"""tree_mask_paged_prefill (token-tree attention for speculative decoding) against the float64
reference with explicit ancestor masks (tests/reference.py: tree_visibility walks the parent
pointers; the kernel gets TVM's DFS intervals)."""

import zlib

import numpy as np
import pytest
import reference as ref
import tvm
from harness import device_for, empty, index_view, make_paged_batch, randn, tensor
from test_prefill import check, indptr

from tir_kernels import AttentionConfig, default_sm_scale, tree_mask_paged_prefill, tree_mask_ragged_prefill


def chain(n):
    return [i - 1 for i in range(n)]


def star(n):
    return [-1] + [0] * (n - 1)


def balanced(n):
    return [-1] + [(i - 1) // 2 for i in range(1, n)]


def random_tree(n, seed):
    rng = np.random.default_rng(seed)
    return [-1] + [int(rng.integers(0, i)) for i in range(1, n)]


def forest(n):
    """Three roots, each with a chain below it."""
    roots = {0, n // 3, 2 * n // 3}
    return [-1 if i in roots else i - 1 for i in range(n)]


# Each request: (history, parents, qo_len): qo_len < len(parents) is a tree grown over earlier
# forwards, whose first nodes are already in the cache and are keys only.
TREE_BATCH = [
    (0, [-1], 1),                   # one node, no history
    (16, chain(7), 7),              # an ordinary sequence (a chain) in the same batch
    (31, star(9), 9),
    (5, balanced(15), 15),
    (48, random_tree(40, 1), 40),   # history ends on a page boundary (page size 16)
    (20, forest(12), 12),
    (3, random_tree(24, 2), 10),    # a tree that grew: 14 earlier nodes are keys only
]
BIG_TREE = [(100, random_tree(256, 3), 256), (7, chain(1), 1)]  # 256 nodes beside a 1-token step

CASES = [  # (num_qo_heads, num_kv_heads, head_dim, page_size, dtype)
    (8, 2, 64, 16, "float16"),
    (4, 4, 128, 1, "float32"),
    (16, 1, 128, 64, "bfloat16"),
]


def run_tree(kernels, config, batch, q, qo_indptr, mn_indptr, intervals, rotary_mode=0):
    dev = device_for(config)
    fn = kernels.get(tree_mask_paged_prefill, config)
    total_q, b = q.shape[0], batch.batch
    o = empty((total_q, config.num_qo_heads, config.head_dim), config.dtype, dev)
    lse = empty((total_q, config.num_qo_heads), "float32", dev)
    fn(tensor(q, dev), index_view(qo_indptr, dev, offset=5), tensor(batch.pages, dev),
       index_view(batch.page_indptr, dev), index_view(batch.page_indices, dev),
       index_view(batch.length_info(), dev, offset=3), index_view(np.zeros(b, np.int32), dev, offset=11),
       index_view(np.zeros(total_q, np.int32), dev, offset=2), o, lse, rotary_mode, 1.0, 1e4,
       default_sm_scale(config.head_dim), index_view(mn_indptr, dev, offset=4), index_view(intervals, dev, offset=6))
    return o.numpy().astype(np.float64), lse.numpy()


def tree_inputs(rng, config, requests):
    """The paged batch (history + tree nodes per request), queries, and TVM's tree arrays."""
    lengths = [h + len(parents) for h, parents, _ in requests]
    batch = make_paged_batch(rng, lengths, config.num_kv_heads, config.head_dim, config.page_size, config.dtype)
    qo_lens = [qo for _, _, qo in requests]
    q = randn(rng, (sum(qo_lens), config.num_qo_heads, config.head_dim), config.dtype)
    mn_indptr = indptr([len(parents) for _, parents, _ in requests])
    intervals = np.concatenate([ref.dfs_intervals(parents) for _, parents, _ in requests]).astype(np.int32)
    return batch, q, indptr(qo_lens), mn_indptr, intervals


def expected_tree(q, qo_indptr, batch, requests, sm_scale):
    out = []
    for i, (history, parents, qo_len) in enumerate(requests):
        k, v = batch.visible(i)
        seen = ref.tree_visibility(parents, history, qo_len)
        out.append(ref.attention(q[qo_indptr[i]:qo_indptr[i + 1]], k, v, sm_scale, True, visible=seen))
    return out


@pytest.mark.parametrize("requests", [TREE_BATCH, BIG_TREE], ids=["mixed-trees", "256-nodes"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_tree_mask_paged_prefill(kernels, target, case, requests):
    hq, hkv, d, ps, dtype = case
    config = AttentionConfig(hq, hkv, d, dtype=dtype, page_size=ps, target=target)
    rng = np.random.default_rng(zlib.crc32(repr((case, len(requests))).encode()))
    batch, q, qo_indptr, mn_indptr, intervals = tree_inputs(rng, config, requests)
    o, lse = run_tree(kernels, config, batch, q, qo_indptr, mn_indptr, intervals)
    check(config, o, lse, qo_indptr, expected_tree(q, qo_indptr, batch, requests, default_sm_scale(d)))


def test_a_chain_is_causal_prefill(kernels):
    """Every request a chain: tree attention equals causal attention."""
    config = AttentionConfig(8, 2, 64, dtype="float32", page_size=16)
    rng = np.random.default_rng(3)
    requests = [(10, chain(5), 5), (0, chain(33), 33), (40, chain(20), 12)]
    batch, q, qo_indptr, mn_indptr, intervals = tree_inputs(rng, config, requests)
    o, lse = run_tree(kernels, config, batch, q, qo_indptr, mn_indptr, intervals)
    want = [ref.attention(q[qo_indptr[i]:qo_indptr[i + 1]], *batch.visible(i), default_sm_scale(64), True)
            for i in range(len(requests))]
    check(config, o, lse, qo_indptr, want)


def test_tree_mask_refuses_what_it_cannot_do(kernels):
    with pytest.raises(ValueError, match="sliding_window"):
        tree_mask_paged_prefill(AttentionConfig(8, 2, 64, sliding_window=True))
    with pytest.raises(ValueError, match="v_head_dim=128"):
        tree_mask_paged_prefill(AttentionConfig(8, 2, 64, v_head_dim=128))
    config = AttentionConfig(8, 2, 64, dtype="float32", page_size=16)
    rng = np.random.default_rng(4)
    batch, q, qo_indptr, mn_indptr, intervals = tree_inputs(rng, config, [(4, star(3), 3)])
    with pytest.raises(Exception, match="rotary_mode"):  # the PrimFunc's assertion, raised through TVM's FFI
        run_tree(kernels, config, batch, q, qo_indptr, mn_indptr, intervals, rotary_mode=1)


def test_tree_masks_build_for_cuda():
    """CUDA code generation of both tree kernels (no GPU needed); the GPU runs the cases above
    under the gpu mark."""
    from tir_kernels.build import PIPELINE

    config = AttentionConfig(32, 8, 128, dtype="float16", page_size=16, target="cuda:sm_90")
    func = tree_mask_paged_prefill(config)
    assert func.attrs["global_symbol"] == "tree_attn_paged_kv"
    module = tvm.compile(tvm.IRModule({"tree_attn_paged_kv": func}), target=config.tvm_target(), tir_pipeline=PIPELINE)
    assert "__shfl_xor_sync" in module.mod.imports[0].inspect_source()
    func = tree_mask_ragged_prefill(config)
    assert func.attrs["global_symbol"] == "batch_tree_attn"
    module = tvm.compile(tvm.IRModule({"batch_tree_attn": func}), target=config.tvm_target(), tir_pipeline=PIPELINE)
    assert "__shfl_xor_sync" in module.mod.imports[0].inspect_source()


@pytest.mark.parametrize("case", [(8, 2, 64, 64, "float16"), (4, 4, 128, 64, "float32"), (16, 4, 192, 128, "bfloat16")],
                         ids=lambda c: "-".join(map(str, c)))
def test_tree_mask_ragged_prefill(kernels, target, case):
    """Ragged K/V: each request's keys are the nodes of this forward (its last qo_len nodes)."""
    hq, hkv, dqk, dv, dtype = case
    config = AttentionConfig(hq, hkv, dqk, v_head_dim=dv, dtype=dtype, target=target)
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    trees = [([-1], 1), (chain(7), 7), (star(9), 9), (balanced(15), 15), (random_tree(40, 1), 40), (forest(12), 12),
             (random_tree(24, 2), 10), (random_tree(256, 3), 256)]
    qo_lens = [qo for _, qo in trees]
    q = randn(rng, (sum(qo_lens), hq, dqk), dtype)
    k = randn(rng, (sum(qo_lens), hkv, dqk), dtype)
    v = randn(rng, (sum(qo_lens), hkv, dv), dtype)
    qo_indptr = indptr(qo_lens)
    mn_indptr = indptr([len(parents) for parents, _ in trees])
    intervals = np.concatenate([ref.dfs_intervals(parents) for parents, _ in trees]).astype(np.int32)
    dev = device_for(config)
    fn = kernels.get(tree_mask_ragged_prefill, config)
    o = empty((q.shape[0], hq, dv), dtype, dev)
    lse = empty((q.shape[0], hq), "float32", dev)
    fn(tensor(q, dev), index_view(qo_indptr, dev, offset=5), tensor(k, dev), tensor(v, dev),
       index_view(qo_indptr, dev, offset=9), index_view(np.zeros(q.shape[0], np.int32), dev, offset=2),
       index_view(mn_indptr, dev, offset=4), index_view(intervals, dev, offset=6), o, lse, 0, 1.0, 1e4,
       default_sm_scale(dqk))
    want = []
    for i, (parents, qo_len) in enumerate(trees):
        s, e = qo_indptr[i], qo_indptr[i + 1]
        seen = ref.tree_visibility(parents, 0, qo_len)[:, len(parents) - qo_len:]  # keys: the last qo_len nodes
        want.append(ref.attention(q[s:e], k[s:e], v[s:e], default_sm_scale(dqk), True, visible=seen))
    check(config, o.numpy().astype(np.float64), lse.numpy(), qo_indptr, want)
