"""Attention masks beyond causal: token trees (speculative decoding).

A prefill kernel's `causal` argument is either the run-time causal flag (an int32 PrimExpr)
or `TreeMasks`, the two buffers of TVM's tree attention: `indptr [B+1]` (the nodes of
request b are rows indptr[b]..indptr[b+1] of `order`) and `order [total_nodes, 2]` (node i's
DFS interval [begin, end)). For one request (`TreeMasks.of(b)`):
- its tree's nodes are the last tree_len of its keys, in order (parent before child), and its
  queries are the last qo_len of those nodes (a tree may have grown over earlier forwards);
  with ragged K/V holding only this forward's nodes, the keys are the tree's last kv_len nodes;
- query node q sees key node k when k's interval contains q's begin: k is q or an ancestor;
- keys before the tree (the committed history) are seen by every query.
Every visible key is also visible under the causal mask, so kernels keep their causal bounds
(the last key a tile may see) and add the tree test on the keys past the history.
"""

from __future__ import annotations

from typing import NamedTuple

from tvm import tirx
from tvm.script import tirx as T


class TreeMask(NamedTuple):
    """The token-tree mask of request b (see the module docstring)."""

    indptr: object
    order: object
    b: object

    def tree_len(self):
        return self.indptr[self.b + 1] - self.indptr[self.b]

    def history(self, kv_len):
        """Keys every query of the request sees: those before its tree."""
        return T.max(kv_len - self.tree_len(), 0)

    def hides(self, j, query, kv_len, qo_len):
        """Whether key j is hidden from query `query` (0..qo_len-1) by the tree (indices of
        nodes are clamped into the request's tree, so no read leaves it)."""
        first, last = self.indptr[self.b], self.indptr[self.b + 1] - 1
        q_node = T.min(T.max(first + query + self.tree_len() - qo_len, first), last)
        k_node = T.min(T.max(first + j + self.tree_len() - kv_len, first), last)  # keys end with the tree
        q_begin = self.order[q_node, 0]
        return tirx.all(j >= self.history(kv_len),
                        tirx.any(q_begin < self.order[k_node, 0], q_begin >= self.order[k_node, 1]))

    # Per-row and per-key parts of `hides`, for kernels that hoist the row's part out of their
    # KV loop (the tensor-core kernels): hidden(j) = j >= history and
    # not (key_begin(j) <= query_begin < key_end(j)).

    def query_node(self, query, qo_len):
        """Node of query `query` (0..qo_len-1), clamped into the tree (read it only when the
        tree has a node: tree_len() > 0)."""
        first, last = self.indptr[self.b], self.indptr[self.b + 1] - 1
        return T.min(T.max(first + query + self.tree_len() - qo_len, first), last)

    def key0_node(self, kv_len):
        """Node of key 0 (valid as a node only for keys at or past the history): key j is node
        key0_node + j."""
        return self.indptr[self.b + 1] - kv_len

    def key_span(self, node, bound):
        """Bound `bound` of node `node`'s DFS interval [begin, end): 0 the begin, 1 the end."""
        return self.order[node, bound]


class TreeMasks(NamedTuple):
    """The tree-attention buffers of a batch: indptr [B+1] i32, order [total_nodes, 2] i32."""

    indptr: object
    order: object

    def of(self, b) -> TreeMask:
        return TreeMask(self.indptr, self.order, b)


def mask_of_request(mask, b):
    """The mask argument a kernel hands to request b's attention: the causal flag as it is, or
    request b's `TreeMask`."""
    return mask.of(b) if isinstance(mask, TreeMasks) else mask


def is_tree(mask) -> bool:
    return isinstance(mask, TreeMask)
