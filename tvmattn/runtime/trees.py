"""Token trees of speculative decoding, on the host.

A sequence's uncommitted token tree is the list of its nodes' parents (`parents[i]` < i, or
-1 for a root; a forest is allowed). Its nodes are the sequence's last `len(parents)` tokens,
in node order. A tree may grow over several forwards before `commit_accepted_token_tree_nodes`
keeps one root-to-leaf path.

What the kernels read (one forward, B sequences), as TVM's cache builds it:
- `tree_attn_mn_indptr [B+1]`: sequence b's nodes (its whole tree, earlier forwards' nodes
  too) are rows mn_indptr[b] .. mn_indptr[b+1] of the mask;
- `tree_attn_mask [total_nodes, 2]`: each node's DFS interval [begin, end) (children visited in
  node order, roots in node order), so node k is node q or one of its ancestors exactly when
  begin[k] <= begin[q] < end[k];
- `q_rope_position [N]`: a new node's RoPE position, the sequence's committed length plus the
  node's depth (a root has depth 0).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .errors import check

MAX_TREE_NODES = 256  # nodes of one sequence's uncommitted tree (TVM's kTreeAttnMaxTreeSize)


def is_chain(parents: list) -> bool:
    """Every node's parent is the node before it (the tree is ordinary appending)."""
    return all(parent == node - 1 for node, parent in enumerate(parents))


def check_new_nodes(seq_id: int, tree: list, new: list) -> None:
    """Validate parents `new` of nodes appended to a sequence's tree `tree` (KVCacheError)."""
    size = len(tree) + len(new)
    check(size <= MAX_TREE_NODES, f"token_tree_parent_ptr: the token tree of sequence {seq_id} would have "
          f"{size} nodes, more than the {MAX_TREE_NODES} a tree may have before it is committed")
    for j, parent in enumerate(new):
        node = len(tree) + j
        check(-1 <= parent < node, f"token_tree_parent_ptr: node {node} of sequence {seq_id} has parent {parent}, "
              "expected -1 (a root) or an earlier node of its tree")


def depths(parents: list) -> list:
    """Depth of each node (roots: 0)."""
    out: list[int] = []
    for parent in parents:
        out.append(0 if parent < 0 else out[parent] + 1)
    return out


def dfs_intervals(parents: list) -> np.ndarray:
    """[n, 2] int32: each node's DFS interval [begin, end) (see the module docstring).

    One pass over subtree sizes (children come after their parent, so a reverse pass adds
    each subtree into its parent), one forward pass that numbers nodes in preorder."""
    n = len(parents)
    size = [1] * n
    for node in range(n - 1, -1, -1):
        if parents[node] >= 0:
            size[parents[node]] += size[node]
    begin = [0] * n
    next_free = [0] * n  # the begin of a node's next child
    roots_end = 0
    for node, parent in enumerate(parents):
        if parent < 0:
            begin[node], roots_end = roots_end, roots_end + size[node]
        else:
            begin[node] = next_free[parent]
            next_free[parent] += size[node]
        next_free[node] = begin[node] + 1
    out = np.empty((n, 2), dtype=np.int32)
    out[:, 0] = begin
    out[:, 1] = np.asarray(begin) + np.asarray(size)
    return out


def accepted_path(parents: list, leaf: int) -> list:
    """Nodes from the root to `leaf`, in order (empty for leaf -1)."""
    path = []
    while leaf >= 0:
        path.append(leaf)
        leaf = parents[leaf]
    return path[::-1]


@dataclasses.dataclass(frozen=True)
class TreeStep:
    """The tree arrays of one forward (see the module docstring)."""

    q_positions: np.ndarray  # [N] int32
    mn_indptr: np.ndarray  # [B+1] int32
    mask: np.ndarray  # [total_nodes, 2] int32


def tree_step(trees: list, committed: list, lengths: list) -> TreeStep:
    """The arrays of a forward whose sequences have trees `trees` (each the whole tree after
    this forward's nodes were added), committed lengths `committed` and `lengths` new nodes."""
    positions = []
    for parents, start, n in zip(trees, committed, lengths):
        positions.extend(start + d for d in depths(parents)[len(parents) - n:])
    sizes = [len(parents) for parents in trees]
    mn_indptr = np.zeros(len(trees) + 1, dtype=np.int32)
    np.cumsum(sizes, out=mn_indptr[1:])
    mask = np.concatenate([dfs_intervals(parents) for parents in trees]) if trees else np.zeros((0, 2), np.int32)
    return TreeStep(np.asarray(positions, dtype=np.int32), mn_indptr, mask)


def compact_copies(path: list, first: int) -> list[tuple[int, int]]:
    """(source token, destination token) pairs that move an accepted path (`accepted_path`)
    into place: node k of the path goes to token first + k (first = the tree's first token).
    Nodes already in place are skipped; no destination is a later pair's source."""
    return [(first + node, first + k) for k, node in enumerate(path) if node != k]
