"""Differential fuzz of tvmattn's PagedKVCache against a float64 reference.

Random operations run on a cache and on `Reference`, which keeps every sequence's K/V unpaged
in float64 numpy and computes attention directly. Operations: add / remove / fork (any
position) / popn / sliding windows with attention sinks / clear; forward steps (prefill
chunks, decode steps, mixed batches) with attention_with_fused_qkv on every layer; token-tree
steps (trees that grow over several steps) and commits of several sequences at once; steps
abandoned part way (cancel_forward, end_forward before every layer ran, a second begin_forward,
remove / popn / fork / clear inside the step, a kernel that raises inside a layer's call);
misuse (unknown or duplicate ids, lengths and positions out of range, bad tree parents and
leaves, tensors of the wrong shape, calls outside or inside a step that the cache must refuse).
Every output and query position is compared with the reference; so are every sequence's K/V
(debug_get_kv) and the page accounting (allocator invariants) every `--check-every` operations
and at the end of each episode, which removes every sequence: no page may leak. A refused
operation must raise KVCacheError and change nothing (or, for a call that abandons a step, leave
the cache exactly as before the step).

Episodes cycle through cache configurations (CONFIGS): RoPE none / normal / inline, page sizes
1 to 8, caches with sliding-window support (windows with sinks on some sequences, chain trees)
and with MHA_SLIDING layers. Shapes are tiny (2 layers, 2 query heads, 1 KV head, head dim 16,
float32) so that the kernels and the reference are cheap. On a divergence the fuzzer prints
the episode's seed, the operation and the recent history, and stops (--keep-going: counts it
and goes on).

    nice -n 10 python scripts/fuzz_cache.py --ops 100000 --seed 1
    python scripts/fuzz_cache.py --ops 2000 --episode 200 --seed 7   # a quick run
"""

from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import tvm  # noqa: E402

from tvmattn import KVCacheError, PagedKVCache  # noqa: E402
from tvmattn.runtime.kernels import paged_slots  # noqa: E402
from tvmattn.runtime.trees import MAX_TREE_NODES  # noqa: E402

LAYERS, HQ, HKV, D, DTYPE = 2, 2, 1, 16, "float32"
THETA, SCALE = 1e4, 0.5
SM_SCALE = 1.0 / math.sqrt(D)
MAX_SEQS, CHUNK = 6, 48
TOL = 1e-4  # rtol and atol of float32 kernels against the float64 reference


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    rope: str  # "none", "normal" or "inline"
    page_size: int
    sliding: bool = False  # support_sliding_window: sequences may get windows with sinks
    layer_window: int = 0  # > 0: layer 0 is MHA_SLIDING with this window
    capacity: int = 320  # max_total_seq_len

    @property
    def kv_rope(self) -> str:
        """How keys are rotated: "normal" runs inline in a cache with sliding-window support."""
        return "inline" if self.sliding and self.rope == "normal" else self.rope

    @property
    def chains_only(self) -> bool:
        """Token trees must be chains (no tree-mask kernel reads windows or rotates inline)."""
        return self.sliding or self.layer_window > 0 or self.rope == "inline"

    @property
    def kinds(self) -> list:
        return ["mha_sliding" if self.layer_window and layer == 0 else "mha" for layer in range(LAYERS)]


CONFIGS = [
    Config("trees-rope-normal", "normal", 4),
    Config("windows-sinks", "none", 4, sliding=True),
    Config("trees-page-1", "none", 1, capacity=160),
    Config("windows-rope-inline", "normal", 8, sliding=True),
    Config("rope-inline", "inline", 2),
    Config("layer-window", "normal", 4, layer_window=6),
]


class Invalid(Exception):
    """The reference refuses an operation: the cache must raise KVCacheError."""


class Divergence(AssertionError):
    pass


# ---------------------------------------------------------------------------------------------
# The reference


def rope(x, positions):
    """Rotate-half RoPE of x [n, H, D] at positions [n] (float64)."""
    inv = 1.0 / THETA ** (np.arange(0, D, 2, dtype=np.float64) / D)
    angles = (np.asarray(positions, np.float64) * SCALE)[:, None] * inv[None]
    cos = np.concatenate([np.cos(angles)] * 2, axis=-1)[:, None, :]
    sin = np.concatenate([np.sin(angles)] * 2, axis=-1)[:, None, :]
    return x * cos + np.concatenate([-x[..., D // 2:], x[..., : D // 2]], axis=-1) * sin


def attend(q, k, v, visible):
    """q [n, HQ, D] over k, v [m, HKV, D]; visible [n, m] bool -> [n, HQ, D] float64."""
    group = HQ // HKV
    scores = np.einsum("qhd,khd->hqk", q, np.repeat(k, group, axis=1)) * SM_SCALE
    scores = np.where(visible[None], scores, -np.inf)
    top = scores.max(axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    weights = np.where(visible[None], np.exp(scores - top), 0.0)
    total = weights.sum(axis=-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", weights / np.where(total > 0, total, 1.0), np.repeat(v, group, axis=1))


def depths(parents):
    out = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


def is_chain(parents):
    return all(p == i - 1 for i, p in enumerate(parents))


def path_to(parents, leaf):
    path = []
    while leaf >= 0:
        path.append(leaf)
        leaf = parents[leaf]
    return path[::-1]


@dataclasses.dataclass
class Seq:
    k: list  # per layer [length, HKV, D] float64 (rotated when RoPE is "normal")
    v: list
    window: tuple | None = None  # (window, sink)
    tree: list = dataclasses.field(default_factory=list)  # parents of the uncommitted nodes (the last tokens)

    @property
    def length(self) -> int:
        return len(self.k[0])

    def keep(self, index) -> None:
        index = np.asarray(index, dtype=np.int64)
        self.k = [k[index] for k in self.k]
        self.v = [v[index] for v in self.v]

    def slide(self) -> None:
        if self.window is not None and self.length > self.window[0] and not self.tree:
            window, sink = self.window
            self.keep(list(range(sink)) + list(range(self.length - (window - sink), self.length)))


def empty_seq() -> Seq:
    return Seq([np.zeros((0, HKV, D)) for _ in range(LAYERS)], [np.zeros((0, HKV, D)) for _ in range(LAYERS)])


class Reference:
    """What the cache must hold and compute; each operation validates (Invalid) or applies."""

    def __init__(self, config: Config):
        self.config = config
        self.seqs: dict[int, Seq] = {}
        self.step = None  # (seq_ids, lengths, positions, visible, saved)

    def get(self, seq_id) -> Seq:
        if seq_id not in self.seqs:
            raise Invalid(f"no sequence {seq_id}")
        return self.seqs[seq_id]

    def add(self, seq_id) -> None:
        if seq_id in self.seqs or len(self.seqs) >= MAX_SEQS:
            raise Invalid("duplicate or too many")
        self.seqs[seq_id] = empty_seq()

    def remove(self, seq_id) -> None:
        self.get(seq_id)
        del self.seqs[seq_id]

    def fork(self, parent_id, child_id, pos) -> None:
        parent = self.get(parent_id)
        if parent.tree or child_id in self.seqs or len(self.seqs) >= MAX_SEQS or not -1 <= pos <= parent.length:
            raise Invalid("bad fork")
        end = parent.length if pos == -1 else pos
        if parent.window is not None and end > parent.window[1]:
            raise Invalid("a windowed sequence forks within its sink only")
        child = empty_seq()
        child.k, child.v = [k[:end].copy() for k in parent.k], [v[:end].copy() for v in parent.v]
        self.seqs[child_id] = child

    def popn(self, seq_id, n) -> None:
        seq = self.get(seq_id)
        if not 0 <= n <= seq.length:
            raise Invalid("bad popn")
        seq.keep(range(seq.length - n))
        del seq.tree[max(len(seq.tree) - n, 0):]

    def enable_window(self, seq_id, window, sink) -> None:
        seq = self.get(seq_id)
        if not self.config.sliding or seq.window is not None or window < 1 or not 0 <= sink < window:
            raise Invalid("bad window")
        seq.window = (window, sink)

    def clear(self) -> None:
        self.seqs.clear()

    def begin(self, seq_ids, lengths, parents=None) -> None:
        if len(seq_ids) != len(lengths) or not seq_ids or len(set(seq_ids)) != len(seq_ids):
            raise Invalid("bad batch")
        seqs = [self.get(s) for s in seq_ids]
        if min(lengths) < 1 or sum(lengths) > CHUNK:
            raise Invalid("bad lengths")
        trees = [None] * len(seqs)
        if parents is None:
            if any(seq.tree for seq in seqs):
                raise Invalid("uncommitted tree")
        else:
            if len(parents) != sum(lengths):
                raise Invalid("parents count")
            trees, start = [], 0
            for seq, n in zip(seqs, lengths):
                new = list(parents[start : start + n])
                start += n
                if len(seq.tree) + n > MAX_TREE_NODES or any(not -1 <= p < len(seq.tree) + i for i, p in enumerate(new)):
                    raise Invalid("bad parents")
                trees.append(new)
            if self.config.chains_only and not all(is_chain(seq.tree + new) for seq, new in zip(seqs, trees)):
                raise Invalid("a tree that is not a chain")
        saved = {s: copy.deepcopy(seq) for s, seq in zip(seq_ids, seqs)}
        positions, visible = [], []
        for seq, n, new in zip(seqs, lengths, trees):
            start = seq.length
            if new is None:
                positions.append(start + np.arange(n))
                visible.append(np.arange(start + n)[None, :] <= (start + np.arange(n))[:, None])
                continue
            seq.tree = seq.tree + new
            committed = start + n - len(seq.tree)
            positions.append(committed + np.asarray(depths(seq.tree)[len(seq.tree) - n:]))
            see = np.zeros((n, start + n), dtype=bool)
            see[:, :committed] = True
            for row, node in enumerate(range(len(seq.tree) - n, len(seq.tree))):
                while node >= 0:
                    see[row, committed + node] = True
                    node = seq.tree[node]
            visible.append(see)
        self.step = (list(seq_ids), list(lengths), positions, visible, saved)

    def attention(self, layer, qkv) -> np.ndarray:
        seq_ids, lengths, positions, visible, _ = self.step
        out, start, rope_mode = [], 0, self.config.kv_rope
        for seq_id, n, pos, see in zip(seq_ids, lengths, positions, visible):
            seq = self.seqs[seq_id]
            rows = qkv[start : start + n].astype(np.float64)
            start += n
            q, k, v = rows[:, :HQ], rows[:, HQ : HQ + HKV], rows[:, HQ + HKV:]
            if rope_mode == "normal":
                q, k = rope(q, pos), rope(k, pos)
            seq.k[layer] = np.concatenate([seq.k[layer], k])
            seq.v[layer] = np.concatenate([seq.v[layer], v])
            keys = seq.k[layer]
            if rope_mode == "inline":
                q, keys = rope(q, pos), rope(keys, np.arange(len(keys)))
            if self.config.kinds[layer] == "mha_sliding":
                see = see & (np.arange(len(keys))[None, :] > pos[:, None] - self.config.layer_window)
            out.append(attend(q, keys, seq.v[layer], see))
        return np.concatenate(out)

    def end(self) -> None:
        for seq_id in self.step[0]:
            self.seqs[seq_id].slide()
        self.step = None

    def rollback(self) -> None:
        self.seqs.update(self.step[4])
        self.step = None

    def commit(self, seq_ids, leaves) -> None:
        if len(seq_ids) != len(leaves) or len(set(seq_ids)) != len(seq_ids):
            raise Invalid("bad commit")
        seqs = [self.get(s) for s in seq_ids]
        if any(not (leaf == -1 or 0 <= leaf < len(seq.tree)) for seq, leaf in zip(seqs, leaves)):
            raise Invalid("bad leaf")
        for seq, leaf in zip(seqs, leaves):
            committed = seq.length - len(seq.tree)
            seq.keep(list(range(committed)) + [committed + node for node in path_to(seq.tree, leaf)])
            seq.tree = []
            seq.slide()


# ---------------------------------------------------------------------------------------------
# The fuzzer


class Faults:
    """Kernels that raise when armed: split_rotary_append, transpose_append and the paged decode
    (`skip` wrapped launches of the armed call run first)."""

    def __init__(self, base, sliding: bool):
        self.countdown = None
        decode = paged_slots(sliding)[1]
        self.kernels = {"split_rotary_append": self._wrap(base.split_rotary_append),
                        "transpose_append": self._wrap(base.transpose_append),
                        decode: ["tirx", self._wrap(getattr(base, decode)[1])]}

    def _wrap(self, kernel):
        def launch(*args):
            if self.countdown is not None:
                if self.countdown == 0:
                    self.countdown = None
                    raise RuntimeError("injected kernel failure")
                self.countdown -= 1
            return kernel(*args)

        return launch


_BASES: dict = {}


def make_cache(config: Config) -> tuple[PagedKVCache, Faults]:
    options = dict(num_layers=LAYERS, num_qo_heads=HQ, num_kv_heads=HKV, qk_head_dim=D, dtype=DTYPE,
                   page_size=config.page_size, max_num_sequences=MAX_SEQS, max_total_seq_len=config.capacity,
                   prefill_chunk_size=CHUNK, rope_mode=config.rope, rope_theta=THETA, rope_scale=SCALE,
                   support_sliding_window=config.sliding, attn_kinds=config.kinds,
                   layer_sliding_window_size=config.layer_window or 1024)
    if config not in _BASES:
        _BASES[config] = PagedKVCache(**options).kernels
    faults = Faults(_BASES[config], config.sliding)
    return PagedKVCache(**options, kernels=faults.kernels), faults


class Fuzzer:
    def __init__(self, config: Config, seed: int, counts: collections.Counter, check_every: int):
        self.config = config
        self.rng = np.random.default_rng(seed)
        self.counts = counts
        self.check_every = check_every
        self.cache, self.faults = make_cache(config)
        self.ref = Reference(config)
        self.initial_pages = self.cache.get_num_available_pages()
        self.history = collections.deque(maxlen=25)
        self.tokens_budget = config.capacity * 2 // 3  # the reference's tokens stay within the pages

    # -- helpers
    def log(self, what: str) -> None:
        self.history.append(what)

    def pick(self, unknown: float = 0.0):
        live = sorted(self.ref.seqs)
        if not live or self.rng.random() < unknown:
            return max(live, default=0) + 100
        return live[self.rng.integers(len(live))]

    def new_id(self):
        return next(i for i in range(100) if i not in self.ref.seqs)

    def snapshot(self):
        c = self.cache
        return (c.get_num_available_pages(), c.get_total_sequence_length(),
                {s: c.sequence_state(s) for s in c.sequence_ids()})

    def apply(self, what, ref_op, cache_op, before=None) -> bool:
        """Both, or (the reference refuses) the cache refuses and is as `before` (default now)."""
        before = self.snapshot() if before is None else before
        self.log(what)
        try:
            ref_op()
        except Invalid:
            try:
                cache_op()
            except KVCacheError:
                pass
            else:
                raise Divergence(f"{what}: the reference refuses it, the cache did not")
            if self.snapshot() != before:
                raise Divergence(f"{what}: refused but changed the cache")
            self.counts["misuses"] += 1
            return False
        try:
            cache_op()
        except KVCacheError as error:
            raise Divergence(f"{what}: the reference accepts it, the cache refused: {error}") from None
        return True

    def total_tokens(self) -> int:
        return sum(seq.length for seq in self.ref.seqs.values())

    # -- checks
    def check_state(self) -> None:
        c = self.cache
        c._allocator.check_invariants()
        if c.get_total_sequence_length() != self.total_tokens() or sorted(c.sequence_ids()) != sorted(self.ref.seqs):
            raise Divergence("sequence lengths or ids")
        for seq_id, seq in self.ref.seqs.items():
            n = seq.length
            if n == 0:
                continue
            k, v = (tvm.runtime.empty((LAYERS, n, HKV, D), DTYPE) for _ in range(2))
            c.debug_get_kv(seq_id, 0, n, k, v)
            if not np.allclose(k.numpy(), np.stack(seq.k), rtol=TOL, atol=TOL) or \
                    not np.array_equal(v.numpy(), np.stack(seq.v)):
                raise Divergence(f"K/V of sequence {seq_id}")

    def finish(self) -> None:
        """End of an episode: everything checked, every sequence removed, no page leaked."""
        self.check_state()
        for seq_id in list(self.ref.seqs):
            self.cache.remove_sequence(seq_id)
        self.ref.clear()
        if not self.cache.empty() or self.cache.get_num_available_pages() != self.initial_pages:
            self.counts["leaks"] += 1
            raise Divergence(f"pages leaked: {self.cache.get_num_available_pages()} of {self.initial_pages} free")

    # -- a step, piece by piece
    def lengths_for(self, seq_ids, kind):
        if kind == "decode":
            return [1] * len(seq_ids)
        return [int(x) for x in self.rng.integers(1, 13 if kind == "tree" else 20, size=len(seq_ids))]

    def parents_for(self, seq_ids, lengths, invalid=False):
        """Parents of the new tokens (chains where trees must be chains); invalid: one node is
        its own parent."""
        parents, nodes = [], []
        for seq_id, n in zip(seq_ids, lengths):
            have = len(self.ref.seqs[seq_id].tree) if seq_id in self.ref.seqs else 0
            for j in range(n):
                node = have + j
                nodes.append(node)
                if self.config.chains_only or node == 0 or self.rng.random() < 0.1:
                    parents.append(node - 1 if self.config.chains_only or self.rng.random() < 0.5 else -1)
                else:
                    parents.append(int(self.rng.integers(node)))
        if invalid and parents:
            i = int(self.rng.integers(len(parents)))
            parents[i] = nodes[i]
        return parents

    def begin(self, seq_ids, lengths, parents=None, before=None) -> bool:
        if not self.apply(f"begin_forward({seq_ids}, {lengths}, {parents})",
                          lambda: self.ref.begin(seq_ids, lengths, parents),
                          lambda: self.cache.begin_forward(seq_ids, lengths, parents), before):
            return False
        self.counts["steps"] += 1
        if not np.array_equal(self.cache.get_query_positions().numpy(), np.concatenate(self.ref.step[2])):
            raise Divergence("query positions")
        return True

    def layer(self, layer: int) -> None:
        total = sum(self.ref.step[1])
        qkv = self.rng.standard_normal((total, HQ + 2 * HKV, D)).astype(DTYPE)
        o = tvm.runtime.empty((total, HQ, D), DTYPE)
        self.cache.attention_with_fused_qkv(layer, SM_SCALE, tvm.runtime.tensor(qkv), o)
        expected = self.ref.attention(layer, qkv)
        if not np.allclose(o.numpy(), expected, rtol=TOL, atol=TOL):
            raise Divergence(f"output of layer {layer}: max error {np.abs(o.numpy() - expected).max():.3g}")

    def end(self) -> None:
        self.cache.end_forward()
        self.ref.end()
        self.counts["completed steps"] += 1

    # -- operations
    def op(self) -> None:
        r = self.rng.random()
        live = bool(self.ref.seqs)
        if r < 0.07 or not live:
            self.op_add()
        elif r < 0.12:
            self.op_remove()
        elif r < 0.18:
            self.op_fork()
        elif r < 0.24:
            self.op_popn()
        elif r < 0.27:
            self.op_window()
        elif r < 0.52:
            self.op_step("decode" if self.rng.random() < 0.5 else "prefill")
        elif r < 0.64:
            self.op_step("tree")
        elif r < 0.72:
            self.op_commit()
        elif r < 0.86:
            self.op_interrupted()
        elif r < 0.995:
            self.op_misuse()
        else:
            self.log("clear()")
            self.cache.clear()
            self.ref.clear()

    def op_add(self):
        seq_id = self.new_id() if self.rng.random() < 0.9 else self.pick()
        self.apply(f"add_sequence({seq_id})", lambda: self.ref.add(seq_id), lambda: self.cache.add_sequence(seq_id))

    def op_remove(self):
        seq_id = self.pick(unknown=0.05)
        self.apply(f"remove_sequence({seq_id})", lambda: self.ref.remove(seq_id),
                   lambda: self.cache.remove_sequence(seq_id))

    def fork_args(self):
        parent, child = self.pick(unknown=0.03), self.new_id() if self.rng.random() < 0.95 else self.pick()
        length = self.ref.seqs[parent].length if parent in self.ref.seqs else 0
        r = self.rng.random()
        pos = -1 if r < 0.2 else int(self.rng.integers(0, length + 1)) if r < 0.9 else length + int(self.rng.integers(1, 4))
        seq = self.ref.seqs.get(parent)
        if seq is not None and seq.window is not None and r < 0.6:
            pos = int(self.rng.integers(0, min(seq.window[1], length) + 1))  # within the sink
        return parent, child, pos

    def op_fork(self, before=None):
        parent, child, pos = self.fork_args()
        if self.apply(f"fork_sequence({parent}, {child}, {pos})", lambda: self.ref.fork(parent, child, pos),
                      lambda: self.cache.fork_sequence(parent, child, pos), before):
            self.counts["forks"] += 1

    def popn_args(self):
        seq_id = self.pick(unknown=0.03)
        length = self.ref.seqs[seq_id].length if seq_id in self.ref.seqs else 0
        n = int(self.rng.integers(0, length + 1)) if self.rng.random() < 0.93 else length + 1
        return seq_id, n

    def op_popn(self, before=None):
        seq_id, n = self.popn_args()
        self.apply(f"popn({seq_id}, {n})", lambda: self.ref.popn(seq_id, n), lambda: self.cache.popn(seq_id, n),
                   before)

    def op_window(self):
        empties = [s for s, seq in self.ref.seqs.items() if seq.length == 0 and seq.window is None]
        seq_id = empties[self.rng.integers(len(empties))] if empties and self.rng.random() < 0.9 else self.pick()
        window = int(self.rng.integers(1, 24))
        sink = int(self.rng.integers(0, min(window, 6)))
        if self.rng.random() < 0.05:
            sink = window  # invalid
        self.apply(f"enable_sliding_window_for_seq({seq_id}, {window}, {sink})",
                   lambda: self.ref.enable_window(seq_id, window, sink),
                   lambda: self.cache.enable_sliding_window_for_seq(seq_id, window, sink))

    def batch(self, kind):
        """Sequences and lengths of a step within the token budget (None: none fits)."""
        live = sorted(self.ref.seqs)
        if kind != "tree":  # sequences with uncommitted trees need a commit first (mostly)
            live = [s for s in live if not self.ref.seqs[s].tree] or live
        size = int(self.rng.integers(1, min(4, len(live)) + 1))
        seq_ids = [live[i] for i in self.rng.permutation(len(live))[:size]]
        lengths = self.lengths_for(seq_ids, kind)
        room = self.tokens_budget - self.total_tokens()
        while sum(lengths) > max(room, 0) and max(lengths) > 1:
            lengths = [max(1, n // 2) for n in lengths]
        if sum(lengths) > room:
            return None
        return seq_ids, lengths

    def op_step(self, kind):
        picked = self.batch(kind)
        if picked is None:
            return
        seq_ids, lengths = picked
        parents = self.parents_for(seq_ids, lengths) if kind == "tree" else None
        if not self.begin(seq_ids, lengths, parents):
            return
        for layer in range(LAYERS):
            self.layer(layer)
        self.end()

    def op_commit(self):
        with_trees = [s for s, seq in self.ref.seqs.items() if seq.tree]
        if not with_trees or self.rng.random() < 0.1:
            seq_ids = [self.pick(unknown=0.1)]
        else:
            size = int(self.rng.integers(1, len(with_trees) + 1))
            seq_ids = [with_trees[i] for i in self.rng.permutation(len(with_trees))[:size]]
        leaves = []
        for seq_id in seq_ids:
            tree = self.ref.seqs[seq_id].tree if seq_id in self.ref.seqs else []
            r = self.rng.random()
            leaves.append(-1 if r < 0.15 or not tree else len(tree) + 1 if r < 0.2 else int(self.rng.integers(len(tree))))
        if self.apply(f"commit_accepted_token_tree_nodes({seq_ids}, {leaves})",
                      lambda: self.ref.commit(seq_ids, leaves),
                      lambda: self.cache.commit_accepted_token_tree_nodes(seq_ids, leaves)):
            self.counts["commits"] += 1

    def op_interrupted(self):
        """A step begun, some layers run, then abandoned (or a refused call, and completed)."""
        kind = ["decode", "prefill", "tree"][int(self.rng.integers(3))]
        picked = self.batch(kind)
        if picked is None:
            return
        seq_ids, lengths = picked
        parents = self.parents_for(seq_ids, lengths) if kind == "tree" else None
        before = self.snapshot()
        if not self.begin(seq_ids, lengths, parents):
            return
        done = int(self.rng.integers(0, LAYERS + 1))
        for layer in range(done):
            self.layer(layer)
        how = ["cancel", "end", "begin", "remove", "popn", "fork", "clear", "launch", "refused", "bad_layer"][
            int(self.rng.integers(10))]
        self.log(f"  after {done} layers: {how}")
        if how in ("launch", "refused", "bad_layer") and done < LAYERS:
            if how == "launch":
                self.faults.countdown = int(self.rng.integers(2))
                try:
                    self.layer(done)
                except RuntimeError:
                    self.counts["failed launches"] += 1
                    self.ref.rollback()
                    self.counts["rolled back"] += 1
                    if self.snapshot() != before:
                        raise Divergence("a failed launch did not roll the step back") from None
                    try:
                        self.cache.end_forward()
                    except KVCacheError:
                        pass
                    else:
                        raise Divergence("end_forward after a failed launch did not say so") from None
                    return
                finally:
                    self.faults.countdown = None
                done += 1
            elif how == "refused":
                self.refused_in_step()
            else:
                self.bad_layer_call()
            for layer in range(done, LAYERS):
                self.layer(layer)
            self.end()
            return
        if done == LAYERS and how in ("end", "launch", "refused", "bad_layer"):
            self.end()
            return
        self.ref.rollback()
        self.counts["rolled back"] += 1
        if how == "cancel":
            self.cache.cancel_forward()
        elif how == "end":
            try:
                self.cache.end_forward()
            except KVCacheError:
                pass
            else:
                raise Divergence("end_forward kept a step whose layers did not all run")
        elif how == "begin":
            self.op_step_after(before)
            return
        elif how == "clear":
            self.cache.clear()
            self.ref.clear()
            return
        elif how == "remove":
            seq_id = self.pick(unknown=0.1)
            self.apply(f"remove_sequence({seq_id})", lambda: self.ref.remove(seq_id),
                       lambda: self.cache.remove_sequence(seq_id), before)
            return
        elif how == "popn":
            self.op_popn(before)
            return
        else:
            self.op_fork(before)
            return
        if self.snapshot() != before:
            raise Divergence(f"{how} inside a step did not roll it back")

    def op_step_after(self, before):
        """A whole step begun while another is in progress (which it abandons)."""
        picked = self.batch("prefill")
        if picked is None:
            self.cache.cancel_forward()
            return
        seq_ids, lengths = picked
        if not self.begin(seq_ids, lengths, None, before):
            return
        for layer in range(LAYERS):
            self.layer(layer)
        self.end()

    def refused_in_step(self):
        seq_id = self.pick()
        kv = [tvm.runtime.empty((LAYERS, 1, HKV, D), DTYPE) for _ in range(2)]
        calls = [("commit", lambda: self.cache.commit_accepted_token_tree_nodes([seq_id], [-1])),
                 ("debug_get_kv", lambda: self.cache.debug_get_kv(seq_id, 0, 1, *kv))]
        if self.config.sliding:
            calls.append(("window", lambda: self.cache.enable_sliding_window_for_seq(seq_id, 4, 1)))
        what, call = calls[int(self.rng.integers(len(calls)))]
        self.refuse(f"{what} inside a step", call)

    def bad_layer_call(self):
        total = sum(self.ref.step[1])
        shape = [(total + 1, HQ + 2 * HKV, D), (total, HQ, D), (total, HQ + 2 * HKV, D // 2)][int(self.rng.integers(3))]
        qkv = tvm.runtime.tensor(np.zeros(shape, DTYPE))
        o = tvm.runtime.empty((total, HQ, D), DTYPE)
        layer = int(self.rng.integers(LAYERS))
        self.refuse(f"attention_with_fused_qkv({layer}, qkv {shape})",
                    lambda: self.cache.attention_with_fused_qkv(layer, SM_SCALE, qkv, o))

    def refuse(self, what, call):
        """A call the cache must refuse, changing nothing (the step in progress goes on)."""
        self.log(what)
        before, plan = self.snapshot(), self.cache.current_plan()
        try:
            call()
        except KVCacheError:
            pass
        else:
            raise Divergence(f"{what} was not refused")
        if self.snapshot() != before or self.cache.current_plan() is not plan:
            raise Divergence(f"{what} was refused but changed the cache")
        self.counts["misuses"] += 1

    def op_misuse(self):
        self.misuse()
        if self.ref.step is not None:  # (the "misuse" was a valid begin_forward: abandon it)
            self.cache.cancel_forward()
            self.ref.rollback()

    def misuse(self):
        c = self.cache
        r = int(self.rng.integers(11))
        seq_id = self.pick()
        if r == 0:
            self.refuse("attention outside a step", lambda: c.attention_with_fused_qkv(
                0, SM_SCALE, tvm.runtime.empty((1, HQ + 2 * HKV, D), DTYPE), tvm.runtime.empty((1, HQ, D), DTYPE)))
        elif r == 1:
            n = self.ref.seqs[seq_id].length
            kv = [tvm.runtime.empty((LAYERS, n + 1, HKV, D), DTYPE) for _ in range(2)]
            self.refuse("debug_get_kv past the end", lambda: c.debug_get_kv(seq_id, 0, n + 1, *kv))
        elif r == 2:
            self.apply("begin_forward (duplicate)", lambda: self.ref.begin([seq_id, seq_id], [1, 1]),
                       lambda: c.begin_forward([seq_id, seq_id], [1, 1]))
        elif r == 3:
            self.apply("begin_forward (zero length)", lambda: self.ref.begin([seq_id], [0]),
                       lambda: c.begin_forward([seq_id], [0]))
        elif r == 4:
            self.apply("begin_forward (over the chunk)", lambda: self.ref.begin([seq_id], [CHUNK + 1]),
                       lambda: c.begin_forward([seq_id], [CHUNK + 1]))
        elif r == 5:
            parents = self.parents_for([seq_id], [3], invalid=True)
            self.apply(f"begin_forward (bad parents {parents})", lambda: self.ref.begin([seq_id], [3], parents),
                       lambda: c.begin_forward([seq_id], [3], parents))
        elif r == 6:
            self.apply("begin_forward (unknown)", lambda: self.ref.begin([seq_id, 999], [1, 1]),
                       lambda: c.begin_forward([seq_id, 999], [1, 1]))
        elif r == 7:
            n = self.ref.seqs[seq_id].length + 1
            self.apply(f"popn({seq_id}, {n})", lambda: self.ref.popn(seq_id, n), lambda: c.popn(seq_id, n))
        elif r == 8:
            self.apply("commit (duplicate)", lambda: self.ref.commit([seq_id, seq_id], [-1, -1]),
                       lambda: c.commit_accepted_token_tree_nodes([seq_id, seq_id], [-1, -1]))
        elif r == 9:
            self.apply("fork (existing child)", lambda: self.ref.fork(seq_id, seq_id, -1),
                       lambda: c.fork_sequence(seq_id, seq_id, -1))
        else:
            self.apply(f"add_sequence({seq_id}) (exists)", lambda: self.ref.add(seq_id), lambda: c.add_sequence(seq_id))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", type=int, default=100_000, help="operations in all")
    parser.add_argument("--episode", type=int, default=500, help="operations per episode (a fresh cache)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check-every", type=int, default=25, help="operations between K/V and page checks")
    parser.add_argument("--keep-going", action="store_true", help="count divergences instead of stopping")
    parser.add_argument("--report-every", type=float, default=60.0, help="seconds between progress lines")
    args = parser.parse_args()
    counts: collections.Counter = collections.Counter()
    start = last = time.time()
    episode = 0
    while counts["ops"] < args.ops:
        config = CONFIGS[episode % len(CONFIGS)]
        seed = args.seed * 1_000_003 + episode
        fuzzer = Fuzzer(config, seed, counts, args.check_every)
        try:
            for i in range(min(args.episode, args.ops - counts["ops"])):
                fuzzer.op()
                counts["ops"] += 1
                if (i + 1) % args.check_every == 0:
                    fuzzer.check_state()
            fuzzer.finish()
        except Exception as error:  # noqa: BLE001 - a divergence, or a failure the cache should not have
            counts["divergences"] += 1
            print(f"DIVERGENCE in episode {episode} ({config.name}, seed {seed}) after {counts['ops']} ops: "
                  f"{type(error).__name__}: {error}")
            print("  recent operations:\n    " + "\n    ".join(fuzzer.history))
            if not args.keep_going:
                break
        counts["episodes"] += 1
        episode += 1
        if time.time() - last > args.report_every:
            last = time.time()
            print(f"[{last - start:7.0f} s] " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())), flush=True)
    print(f"done in {time.time() - start:.0f} s: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    for name in ("divergences", "leaks"):
        print(f"{name}: {counts[name]}")
    return 1 if counts["divergences"] or counts["leaks"] else 0


if __name__ == "__main__":
    sys.exit(main())
