"""Token trees in PagedKVCache (speculative decoding): scenarios against the unpaged truth.

`TreeModel` extends test_cache.Model: a sequence's truth holds its committed tokens followed
by the nodes of its uncommitted token tree (in node order, as the cache stores them) and the
tree's parent pointers. A tree step's expected output for node q is attention over the
committed tokens plus q's ancestors and q (reference.tree_visibility walks the parents), with
RoPE at the committed length plus the node's depth. A commit keeps the accepted path's K/V,
which must then be exactly what debug_get_kv reads, as if the path had been appended token by
token. Errors leave the cache exactly as it was.
"""

from __future__ import annotations

import numpy as np
import pytest
import reference as ref
import tvm
from harness import empty, tensor, to_dtype
from test_cache import (ATOL, DTYPE, HKV, HQ, LAYERS, ROPE_SCALE, ROPE_THETA, RTOL, SM_SCALE, D, Model, check_refused,
                        read_kv, self_plus_cross)
from test_tree_prefill import balanced, chain, forest, random_tree, star

from tvmattn import KVCacheError, PagedKVCache
from tvmattn.runtime.trees import accepted_path, depths


class TreeModel(Model):
    """Model with token trees (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.parents: dict[int, list] = {}

    def add(self, seq_id: int, window=None) -> None:
        super().add(seq_id, window)
        self.parents[seq_id] = []

    def remove(self, seq_id: int) -> None:
        super().remove(seq_id)
        del self.parents[seq_id]

    def fork(self, parent: int, child: int, pos: int = -1) -> None:
        super().fork(parent, child, pos)
        self.parents[child] = []

    def popn(self, seq_id: int, n: int) -> None:
        super().popn(seq_id, n)
        tree = self.parents[seq_id]
        del tree[max(len(tree) - n, 0):]

    def tree_forward(self, seq_ids: list, new_parents: list) -> None:
        """A tree step: new_parents[i] are the parents of sequence i's new nodes (indices in
        its whole uncommitted tree). Every layer's output is checked."""
        lengths = [len(p) for p in new_parents]
        flat = [p for parents in new_parents for p in parents]
        self.cache.begin_forward(seq_ids, lengths, token_tree_parent_ptr=flat)
        positions = []
        for seq_id, new in zip(seq_ids, new_parents):
            tree = self.parents[seq_id] = self.parents[seq_id] + list(new)
            committed = self.length(seq_id) - (len(tree) - len(new))
            positions.append(committed + np.asarray(depths(tree)[len(tree) - len(new):], dtype=np.int64))
        positions = np.concatenate(positions)
        np.testing.assert_array_equal(self.cache.get_query_positions().numpy(), positions, err_msg="query positions")
        bounds = np.cumsum([0, *lengths])

        def expected_of(layer, qkv):
            return np.concatenate([self._attend_tree(seq_id, layer, qkv[b:e], positions[b:e])
                                   for seq_id, b, e in zip(seq_ids, bounds[:-1], bounds[1:])])

        self.check_layers(sum(lengths), expected_of, f"tree forward {seq_ids} {new_parents}")
        self.cache.end_forward()

    def _attend_tree(self, seq_id, layer, rows, positions) -> np.ndarray:
        n = len(rows)
        q, k, v = rows[:, :HQ], rows[:, HQ : HQ + HKV], rows[:, HQ + HKV :]
        if self.rope == "normal":
            q = to_dtype(ref.rope(q, positions, ROPE_THETA, ROPE_SCALE), DTYPE)
            k = to_dtype(ref.rope(k, positions, ROPE_THETA, ROPE_SCALE), DTYPE)
        self.k[seq_id][layer] = np.concatenate([self.k[seq_id][layer], k.astype(np.float64)])
        self.v[seq_id][layer] = np.concatenate([self.v[seq_id][layer], v.astype(np.float64)])
        tree = self.parents[seq_id]
        committed = len(self.k[seq_id][layer]) - len(tree)
        visible = ref.tree_visibility(tree, committed, n)
        return ref.attention(q, self.k[seq_id][layer], self.v[seq_id][layer], SM_SCALE, causal=False,
                             visible=visible)[0]

    def commit(self, seq_ids: list, leaves: list) -> None:
        self.cache.commit_accepted_token_tree_nodes(seq_ids, leaves)
        for seq_id, leaf in zip(seq_ids, leaves):
            tree = self.parents[seq_id]
            committed = self.length(seq_id) - len(tree)
            keep = np.r_[0:committed, committed + np.asarray(accepted_path(tree, leaf), dtype=np.int64)].astype(int)
            self.k[seq_id] = [k[keep] for k in self.k[seq_id]]
            self.v[seq_id] = [v[keep] for v in self.v[seq_id]]
            self.parents[seq_id] = []
            self._slide(seq_id)  # a windowed sequence slides when its path is committed
            assert self.cache.sequence_state(seq_id)["length"] == self.length(seq_id)


def deepest(parents: list) -> int:
    """The last node of greatest depth (a leaf whose path is long)."""
    d = depths(parents)
    return max(range(len(parents)), key=lambda i: (d[i], i))


@pytest.mark.parametrize("rope_mode,page_size", [("none", 4), ("normal", 16), ("normal", 1)])
def test_draft_verify_commit_grow_and_decode(target, rope_mode, page_size):
    """Trees mixed with an ordinary sequence and a sequence with no history; commit part of
    each; grow a tree over two forwards; keep decoding; no page leaks."""
    m = TreeModel(target, rope_mode, page_size=page_size, seed=21)
    for seq_id in (0, 1, 2):
        m.add(seq_id)
    m.forward([0, 1], [5, 16])  # sequence 1 ends on a page boundary; 2 has no history
    m.tree_forward([0, 1, 2], [star(5), chain(3), random_tree(9, 4)])
    m.commit([0, 1, 2], [3, 2, deepest(m.parents[2])])
    m.check_kv()
    m.forward([0, 1, 2], [1, 1, 1])
    # a tree that grows over two forwards, beside one that is drafted once
    m.tree_forward([0, 2], [balanced(7), forest(6)])
    m.tree_forward([0], [[6, 6, 8, -1]])  # children of nodes of the first forward, and a new root
    m.commit([0, 2], [9, -1])
    m.check_kv()
    m.forward([0, 1, 2], [2, 1, 3])
    m.check_no_leaks()


def test_big_trees_and_page_boundaries(target):
    """256-node trees (the most a tree may have) beside a 1-node tree; the accepted paths move
    across pages."""
    m = TreeModel(target, "normal", page_size=16, seed=22, prefill_chunk_size=600)
    for seq_id in (0, 1, 2):
        m.add(seq_id)
    m.forward([0, 1, 2], [32, 7, 100])
    m.tree_forward([0, 1, 2], [random_tree(256, 5), [-1], chain(40)])
    m.commit([0, 1, 2], [deepest(m.parents[0]), 0, 39])
    m.check_kv()
    m.forward([0, 1, 2], [1, 1, 1])
    m.check_no_leaks()


def test_chains_need_no_tree_kernels():
    """A tree step whose trees are all chains is ordinary appending (no tree-mask kernel is
    built); commit keeps a prefix."""
    m = TreeModel("llvm", "none", page_size=4, seed=12)
    m.add(0)
    m.add(1)
    m.forward([0, 1], [5, 6])
    m.tree_forward([0, 1], [chain(3), chain(4)])
    assert m.cache._step_kernels.tree_paged is None
    with pytest.raises(KVCacheError, match="commit_accepted_token_tree_nodes"):
        m.cache.begin_forward([0], [1])
    m.commit([0, 1], [1, -1])
    m.forward([0, 1], [1, 1])
    m.check_no_leaks()


def test_self_and_cross_attention_in_a_tree_step(target):
    """self_attention (tree-mask ragged prefill over the new nodes) merged with
    cross_attention (the history) equals the fused tree attention."""
    m = TreeModel(target, "none", page_size=4, seed=23)
    m.add(0)
    m.add(1)
    m.forward([0, 1], [9, 4])
    parents = [balanced(6), random_tree(5, 6)]
    lengths = [6, 5]
    m.cache.begin_forward([0, 1], lengths, token_tree_parent_ptr=parents[0] + parents[1])
    q, k, v, o_self, _ = self_plus_cross(m, 0, sum(lengths))
    dev = m.device
    o_cross, lse_cross = empty((2, HQ, D), DTYPE, dev), empty((2, HQ), "float32", dev)
    start = 0
    for seq_id, tree, n in zip((0, 1), parents, lengths):
        rows = slice(start, start + n)
        history = m.length(seq_id)
        keys = np.concatenate([m.k[seq_id][0], k[rows]])
        values = np.concatenate([m.v[seq_id][0], v[rows]])
        expected = ref.attention(q[rows], keys, values, SM_SCALE, causal=False,
                                 visible=ref.tree_visibility(tree, history, n))[0]
        np.testing.assert_allclose(o_self.numpy()[rows], expected, rtol=RTOL, atol=ATOL)
        start += n
    # a tree grown over an earlier forward has uncommitted history: cross_attention refuses
    m.tree_forward([0], [[-1, 0, 0]])
    m.cache.begin_forward([0], [2], token_tree_parent_ptr=[1, 2])
    with pytest.raises(KVCacheError, match="cross_attention: a token tree of this step grew"):
        m.cache.cross_attention(0, SM_SCALE, tensor(q[:2], dev), o_cross, lse_cross)
    m.cache.cancel_forward()
    m.commit([0], [-1])
    m.check_no_leaks()


def test_fork_after_commit_shares_the_accepted_path(target):
    m = TreeModel(target, "none", page_size=4, seed=24)
    m.add(0)
    m.forward([0], [6])
    m.tree_forward([0], [star(6)])
    with pytest.raises(KVCacheError, match="token tree is not committed yet"):
        m.cache.fork_sequence(0, 1)
    m.commit([0], [4])
    m.fork(0, 1)
    m.forward([0, 1], [2, 3])
    m.check_no_leaks()


def test_popn_inside_a_tree_keeps_a_tree():
    m = TreeModel("llvm", "none", page_size=4, seed=25)
    m.add(0)
    m.forward([0], [3])
    m.tree_forward([0], [[-1, 0, 0, 1, 2]])
    m.popn(0, 2)  # drops nodes 3 and 4
    m.tree_forward([0], [[1, 3]])  # new nodes 3 and 4
    m.commit([0], [4])  # path 0 -> 1 -> 3 -> 4
    m.forward([0], [1])
    m.check_no_leaks()


def tree_model() -> TreeModel:
    m = TreeModel("llvm", "none", page_size=4, seed=26, max_num_sequences=4)
    m.add(0)
    m.add(2)
    m.forward([0, 2], [9, 5])
    m.tree_forward([2], [star(3)])
    return m


BAD_TREES = {
    "child before parent": (lambda c: c.begin_forward([0], [3], [-1, 2, 0]), "node 1 of sequence 0 has parent 2"),
    "parent out of range": (lambda c: c.begin_forward([0], [2], [-1, -2]), "node 1 of sequence 0 has parent -2"),
    "wrong length": (lambda c: c.begin_forward([0], [3], [-1, 0]), "2 entries, expected one per new token"),
    "too many nodes": (lambda c: c.begin_forward([2], [254], [-1] * 254), "257 nodes, more than the 256"),
    "no tree for an uncommitted one": (lambda c: c.begin_forward([2], [1]), "commit_accepted_token_tree_nodes"),
    "leaf past the tree": (lambda c: c.commit_accepted_token_tree_nodes([2], [3]), "3 is not a node"),
    "commit twice in a list": (lambda c: c.commit_accepted_token_tree_nodes([2, 2], [0, 0]), "twice"),
    "leaf below -1": (lambda c: c.commit_accepted_token_tree_nodes([2], [-2]), "-2 is not a node"),
    "fork an uncommitted tree": (lambda c: c.fork_sequence(2, 3), "not committed yet"),
}


@pytest.mark.parametrize("case", BAD_TREES, ids=list(BAD_TREES))
def test_bad_trees_leave_the_cache_unchanged(case):
    check_refused(tree_model(), *BAD_TREES[case])


@pytest.mark.parametrize("options,message", [
    ({"support_sliding_window": True}, "support_sliding_window"),
    ({"rope_mode": "inline"}, 'rope_mode="inline"'),
])
def test_trees_refused_where_tree_attention_cannot_run(options, message):
    """Sliding-window caches and inline RoPE refuse trees that are not chains (chains still
    work), leaving the cache unchanged."""
    cache = PagedKVCache(num_layers=LAYERS, num_qo_heads=HQ, num_kv_heads=HKV, qk_head_dim=D, dtype=DTYPE,
                         page_size=4, max_total_seq_len=256, **options)
    cache.add_sequence(0)
    before = cache.sequence_state(0), cache.get_num_available_pages()
    with pytest.raises(KVCacheError, match=message):
        cache.begin_forward([0], [3], token_tree_parent_ptr=[-1, 0, 0])
    assert (cache.sequence_state(0), cache.get_num_available_pages()) == before
    cache.begin_forward([0], [3], token_tree_parent_ptr=[-1, 0, 1])
    for layer in range(LAYERS):
        qkv = np.random.default_rng(layer).standard_normal((3, HQ + 2 * HKV, D)).astype(np.float16)
        cache.attention_with_fused_qkv(layer, SM_SCALE, tensor(qkv, tvm.cpu()), empty((3, HQ, D), DTYPE, tvm.cpu()))
    cache.end_forward()
    cache.commit_accepted_token_tree_nodes([0], [1])
    assert cache.sequence_state(0)["length"] == 2


def test_library_without_tree_kernels_refuses_trees():
    cache = PagedKVCache(num_layers=LAYERS, num_qo_heads=HQ, num_kv_heads=HKV, qk_head_dim=D, dtype=DTYPE,
                         page_size=4, max_total_seq_len=256, kernels={"tree_attn_paged_kv": []})
    cache.add_sequence(0)
    with pytest.raises(KVCacheError, match="slot 'tree_attn_paged_kv' is empty"):
        cache.begin_forward([0], [2], token_tree_parent_ptr=[-1, -1])
    assert cache.sequence_state(0)["length"] == 0


def test_read_kv_after_commit_is_the_accepted_path_only():
    """The accepted path's K/V, read back, are the path nodes' K/V in order (explicitly)."""
    m = TreeModel("llvm", "none", page_size=4, seed=27)
    m.add(0)
    m.forward([0], [3])
    m.tree_forward([0], [[-1, -1, 1, 0, 2, 4]])
    k_before, v_before = read_kv(m.cache, 0, 9, m.device)
    m.cache.commit_accepted_token_tree_nodes([0], [5])  # path 1 -> 2 -> 4 -> 5
    k_after, v_after = read_kv(m.cache, 0, 7, m.device)
    keep = [0, 1, 2, 3 + 1, 3 + 2, 3 + 4, 3 + 5]
    np.testing.assert_array_equal(k_after, k_before[:, keep])
    np.testing.assert_array_equal(v_after, v_before[:, keep])


def test_self_attention_without_the_ragged_tree_kernel_is_refused():
    m = TreeModel("llvm", "none", page_size=4, seed=28, kernels={"tree_attn_ragged": []})
    m.add(0)
    m.forward([0], [5])
    m.cache.begin_forward([0], [3], token_tree_parent_ptr=[-1, 0, 0])
    q, k, v = (tensor(np.zeros((3, h, D), np.float16), m.device) for h in (HQ, HKV, HKV))
    o, lse = empty((3, HQ, D), DTYPE, m.device), empty((3, HQ), "float32", m.device)
    with pytest.raises(KVCacheError, match="slot 'tree_attn_ragged' is empty"):
        m.cache.self_attention(0, SM_SCALE, q, k, v, o, lse)
    m.cache.cancel_forward()
    m.check_no_leaks()
