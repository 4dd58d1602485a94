"""Prefix caching: a radix tree over page-aligned token blocks whose nodes hold KV-cache sequences.

Each node stands for a token prefix whose length is a multiple of the page size (its edge from
its parent is one or more whole pages of tokens) and owns one cache sequence holding exactly that
prefix. The sequences share their pages through the cache's reference counts (a node's
sequence is forked from a request's sequence, or from a deeper node when an edge is split, at a
page boundary, so no page is copied): the tree itself costs sequence slots, and only the pages
that no running request holds any more.

- `match(tokens)`: the longest cached prefix of `tokens` -> (the node whose sequence holds it,
  its length); a new request forks from that sequence (`fork_sequence`, the cache copies a
  partly filled last page) and prefills only the rest.
- `insert(tokens, seq_id)`: record the page-aligned part of `tokens`, held by cache sequence
  `seq_id`, forking new nodes from it.
- `evict(pages_wanted)` / `evict_one()`: remove least-recently-used leaves (their sequences),
  until the cache has the pages or no leaf is left.

The tree calls the cache through three callables (fork, remove, free page count) and takes new
sequence ids from `new_id`, so it holds no reference to TVM.
"""

from __future__ import annotations

import itertools
from typing import Callable


class Node:
    __slots__ = ("parent", "edge", "children", "seq_id", "length", "last_used")

    def __init__(self, parent: "Node | None", edge: tuple[int, ...], seq_id: int | None, length: int, now: int):
        self.parent = parent
        self.edge = edge  # the tokens from the parent's prefix to this one (whole pages)
        self.children: dict[tuple[int, ...], Node] = {}  # first page of the child's edge -> child
        self.seq_id = seq_id
        self.length = length  # tokens of the prefix (parent's length + len(edge))
        self.last_used = now


class RadixPrefixCache:
    """See the module docstring. max_nodes: most nodes (cache sequences) the tree keeps."""

    def __init__(self, page_size: int, max_nodes: int, *, fork: Callable[[int, int, int], None],
                 remove: Callable[[int], None], free_pages: Callable[[], int], new_id: Callable[[], int]):
        self.page_size = page_size
        self.max_nodes = max_nodes
        self._fork, self._remove, self._free_pages, self._new_id = fork, remove, free_pages, new_id
        self.root = Node(None, (), None, 0, 0)
        self._clock = itertools.count(1)
        self.nodes = 0
        # counts for the hit rate: prompt tokens looked up, tokens found cached
        self.queried_tokens = 0
        self.hit_tokens = 0

    def _block(self, tokens, start: int) -> tuple[int, ...]:
        return tuple(tokens[start:start + self.page_size])

    # ------------------------------------------------------------------ lookup
    def match(self, tokens: list[int], count: bool = True) -> tuple[Node | None, int]:
        """(node, n): tokens[:n] (n a multiple of the page size) is held by node.seq_id (None, 0:
        nothing cached). count: add to the hit-rate counts."""
        ps, now = self.page_size, next(self._clock)
        node, matched, best = self.root, 0, None
        while True:
            child = node.children.get(self._block(tokens, matched))
            if child is None or len(tokens) - matched < ps:
                break
            shared = 0  # whole pages of the child's edge that tokens repeat
            while shared < len(child.edge) and tuple(tokens[matched + shared:matched + shared + ps]) == \
                    child.edge[shared:shared + ps] and matched + shared + ps <= len(tokens):
                shared += ps
            child.last_used = now
            matched += shared
            best = child  # its sequence holds the prefix up to any point of its edge
            if shared < len(child.edge):
                break
            node = child
        while node is not None and node is not self.root:
            node.last_used = now
            node = node.parent
        if count:
            self.queried_tokens += len(tokens)
            self.hit_tokens += matched
        return (best, matched) if matched else (None, 0)

    # ------------------------------------------------------------------ insertion
    def insert(self, tokens: list[int], seq_id: int) -> None:
        """Record tokens[:k * page_size] (the whole pages of `tokens`), which cache sequence
        `seq_id` holds (it keeps its own sequence; the tree forks what it keeps)."""
        ps = self.page_size
        aligned = len(tokens) // ps * ps
        if aligned == 0:
            return
        now = next(self._clock)
        node, at = self.root, 0
        while at < aligned:
            child = node.children.get(self._block(tokens, at))
            if child is None:
                if not self._room(2):
                    return
                leaf = Node(node, tuple(tokens[at:aligned]), self._new_id(), aligned, now)
                if not self._forked(seq_id, leaf.seq_id, aligned):
                    return
                node.children[leaf.edge[:ps]] = leaf
                self.nodes += 1
                return
            shared = 0
            while shared < len(child.edge) and at + shared < aligned and \
                    tuple(tokens[at + shared:at + shared + ps]) == child.edge[shared:shared + ps]:
                shared += ps
            child.last_used = now
            if shared < len(child.edge):  # split the edge: a middle node at at + shared
                if not self._room(2):
                    return
                middle = Node(node, child.edge[:shared], self._new_id(), at + shared, now)
                if not self._forked(child.seq_id, middle.seq_id, at + shared):
                    return
                node.children[middle.edge[:ps]] = middle
                child.parent, child.edge = middle, child.edge[shared:]
                middle.children[child.edge[:ps]] = child
                self.nodes += 1
                child = middle
            node, at = child, at + shared

    def _forked(self, parent: int, child: int, position: int) -> bool:
        """Fork; False (nothing changed) where the cache refuses the position (ValueError: a
        cache whose sliding-window layers released the tokens that position's window reads)."""
        try:
            self._fork(parent, child, position)
        except ValueError:
            return False
        return True

    def _room(self, nodes: int) -> bool:
        """Make room for `nodes` more nodes (evicting LRU leaves); False if none can be made."""
        while self.nodes + nodes > self.max_nodes:
            if not self.evict_one():
                return False
        return True

    # ------------------------------------------------------------------ eviction
    def leaves(self) -> list[Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                out.append(node)
        return out

    def evict_one(self) -> bool:
        """Remove the least recently used leaf; False when the tree is empty."""
        leaves = self.leaves()
        if not leaves:
            return False
        leaf = min(leaves, key=lambda n: n.last_used)
        self._remove(leaf.seq_id)
        del leaf.parent.children[leaf.edge[:self.page_size]]
        self.nodes -= 1
        return True

    def evict(self, pages_wanted: int) -> bool:
        """Evict LRU leaves until the cache has `pages_wanted` free pages; False if the tree ran
        out of leaves first."""
        while self._free_pages() < pages_wanted:
            if not self.evict_one():
                return False
        return True

    def clear(self) -> None:
        while self.evict_one():
            pass

    def sequence_ids(self) -> list[int]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node.seq_id)
            stack.extend(node.children.values())
        return out

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
