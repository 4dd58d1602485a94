"""tree_mask_paged_prefill / tree_mask_ragged_prefill (token-tree attention for speculative
decoding) against the float64 reference with explicit ancestor masks (tests/reference.py:
tree_visibility walks the parent pointers; the kernel gets TVM's DFS intervals).

On the CPU: the CUDA-core kernel (llvm) and CUDA code generation of each path. Under the gpu
mark: the same cases on CUDA, and the tensor-core paths that fp16/bf16 take there, the Hopper
wgmma kernel (prefill_sm90: fp16 and bf16, head dims 64/128/256, GQA groups 1..16, page sizes
1/16/64) and the mma.sync kernel (prefill_sm80: an explicit MmaPrefillSchedule, or head dim
96), paged and ragged. Each config is built once per session (the `kernels` fixture)."""

import zlib

import numpy as np
import pytest
import reference as ref
import tvm
from harness import device_for, empty, index_view, make_paged_batch, randn, tensor
from test_prefill import check, indptr

from tir_kernels import (
    AttentionConfig,
    default_sm_scale,
    tree_mask_paged_prefill,
    tree_mask_ragged_prefill,
)
from tir_kernels.build import uses_tirx_pipeline
from tir_kernels.prefill_sm80 import MmaPrefillSchedule


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
# Trees over long histories: the tensor-core kernels mask only the steps past the history.
LONG_HISTORY = [(4096, random_tree(64, 5), 64), (1000, chain(64), 64), (130, star(200), 150), (2047, balanced(33), 33)]
REQUEST_SETS = {"mixed-trees": TREE_BATCH, "256-nodes": BIG_TREE, "long-history": LONG_HISTORY}

CASES = [  # (num_qo_heads, num_kv_heads, head_dim, page_size, dtype)
    (8, 2, 64, 16, "float16"),
    (4, 4, 128, 1, "float32"),
    (16, 1, 128, 64, "bfloat16"),
]


def run_tree(kernels, config, batch, q, qo_indptr, mn_indptr, intervals, rotary_mode=0, extra=()):
    """tree_mask_paged_prefill(config, *extra) (built once per session) on a paged batch."""
    dev = device_for(config)
    fn = kernels.get(tree_mask_paged_prefill, config, *extra)
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
    """CUDA code generation of both tree kernels on the Hopper tensor-core path (no GPU needed);
    the GPU runs the cases of this file under the gpu mark."""
    from tir_kernels.build import PIPELINE

    config = AttentionConfig(32, 8, 128, dtype="float16", page_size=16, target="cuda:sm_90")
    for generator, symbol in ((tree_mask_paged_prefill, "tree_attn_paged_kv"),
                              (tree_mask_ragged_prefill, "batch_tree_attn")):
        func = generator(config)
        assert func.attrs["global_symbol"] == symbol and uses_tirx_pipeline(func)
        module = tvm.compile(tvm.IRModule({symbol: func}), target=config.tvm_target(), tir_pipeline=PIPELINE)
        source = "".join(m.inspect_source() for m in module.mod.imports if m.kind == "cuda")
        assert "wgmma.mma_async" in source and "__shfl_xor_sync" in source


@pytest.mark.parametrize("generator", [tree_mask_paged_prefill, tree_mask_ragged_prefill], ids=["paged", "ragged"])
def test_tree_kernels_dispatch_like_prefill(generator):
    """fp16/bf16 on sm_90: wgmma (head dims it tiles), else mma.sync on sm_80+ (head dim 96 on
    Hopper, sm_80/sm_89, or an explicit MmaPrefillSchedule); fp32 and the CPU: CUDA cores."""
    hopper = AttentionConfig(32, 8, 128, dtype="bfloat16", page_size=16, target="cuda:sm_90")
    assert uses_tirx_pipeline(generator(hopper))
    for config, schedule in ((hopper.replace(head_dim=96, v_head_dim=96), None),
                             (hopper.replace(target="cuda:sm_80"), None), (hopper.replace(target="cuda:sm_89"), None),
                             (hopper, MmaPrefillSchedule())):
        func = generator(config, schedule)
        assert not uses_tirx_pipeline(func) and "T.ptx.mma" in func.script()
    for config in (hopper.replace(dtype="float32"), hopper.replace(target="llvm")):
        func = generator(config)
        assert not uses_tirx_pipeline(func) and "mma" not in func.script()


RAGGED_TREES = [([-1], 1), (chain(7), 7), (star(9), 9), (balanced(15), 15), (random_tree(40, 1), 40),
                (forest(12), 12), (random_tree(24, 2), 10), (random_tree(256, 3), 256)]


@pytest.mark.parametrize("case", [(8, 2, 64, 64, "float16"), (4, 4, 128, 64, "float32"), (16, 4, 192, 128, "bfloat16")],
                         ids=lambda c: "-".join(map(str, c)))
def test_tree_mask_ragged_prefill(kernels, target, case):
    """Ragged K/V: each request's keys are the nodes of this forward (its last qo_len nodes)."""
    hq, hkv, dqk, dv, dtype = case
    check_ragged_tree(kernels, AttentionConfig(hq, hkv, dqk, v_head_dim=dv, dtype=dtype, target=target), case)


def check_ragged_tree(kernels, config, seed, extra=()):
    """tree_mask_ragged_prefill(config, *extra) on RAGGED_TREES against the reference."""
    hq, hkv, dqk, dv, dtype = (config.num_qo_heads, config.num_kv_heads, config.head_dim, config.v_head_dim,
                               config.dtype)
    rng = np.random.default_rng(zlib.crc32(repr(seed).encode()))
    trees = RAGGED_TREES
    qo_lens = [qo for _, qo in trees]
    q = randn(rng, (sum(qo_lens), hq, dqk), dtype)
    k = randn(rng, (sum(qo_lens), hkv, dqk), dtype)
    v = randn(rng, (sum(qo_lens), hkv, dv), dtype)
    qo_indptr = indptr(qo_lens)
    mn_indptr = indptr([len(parents) for parents, _ in trees])
    intervals = np.concatenate([ref.dfs_intervals(parents) for parents, _ in trees]).astype(np.int32)
    dev = device_for(config)
    fn = kernels.get(tree_mask_ragged_prefill, config, *extra)
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


# --- tensor cores (GPU) ----------------------------------------------------------------------

# (num_qo_heads, num_kv_heads, head_dim, page_size, dtype): fp16 and bf16, head dims 64/128/256,
# GQA groups 1/2/3/4/6/8/16, page sizes 1/16/64, on the Hopper wgmma kernel.
TC_CASES = [
    (8, 8, 128, 16, "float16"),
    (16, 4, 64, 1, "bfloat16"),
    (32, 2, 256, 64, "float16"),
    (8, 1, 128, 64, "bfloat16"),
    (16, 8, 256, 16, "bfloat16"),
    (16, 1, 64, 16, "float16"),
    (9, 3, 64, 16, "float16"),  # SmolLM2's heads: a group of 3 packs rows across tiles unevenly
    (12, 2, 128, 16, "bfloat16"),  # a group of 6
]
# The mma.sync kernel: an explicit schedule on a head dim wgmma serves, and head dim 96 (which
# Hopper sends to mma.sync by itself).
MMA_CASES = [
    ((32, 8, 128, 16, "float16"), MmaPrefillSchedule()),
    ((16, 4, 64, 64, "bfloat16"), MmaPrefillSchedule(warps=4, rows_per_warp=32, tile_kv=64)),
    ((8, 2, 96, 16, "float16"), None),
]


def tc_config(case, target="cuda"):
    hq, hkv, d, ps, dtype = case
    return AttentionConfig(hq, hkv, d, dtype=dtype, page_size=ps, target=target)


def check_paged_tree(kernels, config, requests, seed, extra=()):
    rng = np.random.default_rng(zlib.crc32(repr(seed).encode()))
    batch, q, qo_indptr, mn_indptr, intervals = tree_inputs(rng, config, requests)
    o, lse = run_tree(kernels, config, batch, q, qo_indptr, mn_indptr, intervals, extra=extra)
    check(config, o, lse, qo_indptr, expected_tree(q, qo_indptr, batch, requests, default_sm_scale(config.head_dim)))


@pytest.mark.gpu
@pytest.mark.parametrize("requests", list(REQUEST_SETS), ids=list(REQUEST_SETS))
@pytest.mark.parametrize("case", TC_CASES, ids=lambda c: "-".join(map(str, c)))
def test_tree_paged_wgmma(kernels, case, requests):
    config = tc_config(case)
    assert uses_tirx_pipeline(tree_mask_paged_prefill(config))
    check_paged_tree(kernels, config, REQUEST_SETS[requests], (case, requests))


@pytest.mark.gpu
@pytest.mark.parametrize("requests", list(REQUEST_SETS), ids=list(REQUEST_SETS))
@pytest.mark.parametrize("case, schedule", MMA_CASES, ids=lambda c: "-".join(map(str, c)) if isinstance(c, tuple)
                         else ("default" if c is None else f"w{c.warps}-r{c.rows_per_warp}-kv{c.tile_kv}"))
def test_tree_paged_mma_sync(kernels, case, schedule, requests):
    config = tc_config(case)
    assert "T.ptx.mma" in tree_mask_paged_prefill(config, schedule).script()
    check_paged_tree(kernels, config, REQUEST_SETS[requests], (case, requests), (schedule,))


@pytest.mark.gpu
@pytest.mark.parametrize("case, schedule", [
    ((32, 8, 128, 128, "bfloat16"), None),
    ((16, 1, 256, 256, "float16"), None),
    ((16, 4, 192, 128, "float16"), None),
    ((8, 2, 64, 64, "bfloat16"), None),
    ((8, 2, 128, 128, "float16"), MmaPrefillSchedule()),
    ((8, 8, 96, 96, "bfloat16"), None),
], ids=lambda c: "-".join(map(str, c)) if isinstance(c, tuple) else ("default" if c is None else "mma"))
def test_tree_ragged_tensor_cores(kernels, case, schedule):
    hq, hkv, dqk, dv, dtype = case
    config = AttentionConfig(hq, hkv, dqk, v_head_dim=dv, dtype=dtype, target="cuda")
    check_ragged_tree(kernels, config, case, (schedule,))


@pytest.mark.gpu
def test_tree_tensor_cores_refuse_rotary_mode(kernels):
    config = tc_config((8, 2, 128, 16, "float16"))
    rng = np.random.default_rng(4)
    batch, q, qo_indptr, mn_indptr, intervals = tree_inputs(rng, config, [(40, star(3), 3)])
    with pytest.raises(Exception, match="rotary_mode"):
        run_tree(kernels, config, batch, q, qo_indptr, mn_indptr, intervals, rotary_mode=1)


@pytest.mark.gpu
def test_tree_of_chains_matches_causal_tensor_cores(kernels):
    """Chains on the wgmma kernel give the plain causal paged prefill's output (same kernel
    family, same inputs): the tree mask hides nothing the causal one shows."""
    from test_prefill import run_paged

    config = tc_config((32, 8, 128, 16, "bfloat16"))
    rng = np.random.default_rng(11)
    requests = [(4096, chain(64), 64), (10, chain(130), 130), (0, chain(5), 5)]
    batch, q, qo_indptr, mn_indptr, intervals = tree_inputs(rng, config, requests)
    tree = run_tree(kernels, config, batch, q, qo_indptr, mn_indptr, intervals)
    causal = run_paged(kernels, config, batch, q, qo_indptr, True)
    np.testing.assert_allclose(tree[0], causal[0], rtol=1e-2, atol=1e-3)  # within bf16 rounding of o
    np.testing.assert_allclose(tree[1], causal[1], atol=1e-4)
