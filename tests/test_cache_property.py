"""Property-based test of tvmattn.PagedKVCache: random operation sequences against a plain model.

A hypothesis rule-based state machine applies random sequences of add / remove / fork (any
position, or -1) / popn / enable_sliding_window / clear / forward (begin_forward with prefill
chunks or decode steps, attention_with_fused_qkv on every layer with random qkv, end_forward)
/ token-tree steps and commits / interrupted steps to the cache and to `ReferenceCache`, which
keeps each sequence's K/V unpaged in float64 and computes attention with tests/reference.py.
After every step the two agree on:
  - every layer's attention output and the query positions (checked inside the forward rule);
  - the K/V of every sequence (debug_get_kv), its length (reading one token past the end is
    refused) and the total length;
  - the number of available pages: within the bounds that prefix sharing allows, and back to
    the initial count whenever no sequence is left (no leaks).
Some generated operations are invalid (unknown or duplicate ids, more sequences than
max_num_sequences, popn longer than the sequence, fork past the end, zero-length appends, a
sequence twice in a batch, chunks over the prefill chunk size, a bad layer id, tensor shape,
dtype or device, attention outside a forward ...): the cache must raise KVCacheError and
stay exactly as it was; the model is not touched.

Forward steps are transactions (PagedKVCache's docstring): the machine also begins steps and
abandons them after some layers (cancel_forward, end_forward before every layer ran, a second
begin_forward, remove / popn / fork / clear inside the step, a kernel that raises inside a
layer's call, which `Faults` injects), after which the cache must be exactly as before the step
(the model rolls back its copy) and the call must then have done its own work; calls the cache
refuses inside a step (debug_get_kv, commits, enabling a window) must leave the step going.
Removed sequences' pages are reused by later ones, so a row kept without being written would
show another sequence's K/V in some output.

Semantics the model follows (those of TVM's C++ cache, paged_kv_cache.cc):
  - RoPE "normal": q and k rotated at positions history + i before attention, K cached rotated;
    "inline": K cached as given, q and every key rotated inside attention (key j at position j,
    its index among the cached keys). A cache with sliding-window support runs "normal" inline.
  - Sliding window (window w, sink s), enabled on an empty sequence: new tokens attend to the
    cached tokens plus all new tokens (causal); after the step the cache keeps the first s
    tokens and the last w - s. A windowed sequence can only be forked within its sink (the
    child has no window). popn removes the last n cached tokens, also from a slid window
    (TVM's PopN ignores the window's page layout; tvmattn defines it this way). Sinks stay
    below the page size here, so a windowed sequence never shares a page (see page_bounds).
  - Token trees: a tree step's nodes (the parents of each new node; -1 a root) see the
    committed tokens, their ancestors and themselves, at RoPE positions committed + depth; a
    tree may grow over several steps; a commit keeps the path to one node (or none) for each
    named sequence, all checked before any is applied. Trees that are not chains are refused
    where RoPE is inline (the sliding-window setups and "rope-inline"). A windowed sequence
    slides only at the commit: it keeps what appending the accepted path one by one keeps.

Runs on the CPU and, where a GPU is present, on CUDA (the `target` fixture). Failures print
the operations applied (hypothesis notes) and the minimal rule sequence.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import math

import numpy as np
import pytest
import reference as ref
import tvm
from harness import empty, load_script
from hypothesis import HealthCheck, Phase, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from tir_kernels import default_sm_scale
from tvmattn import PagedKVCache
from tvmattn.runtime.errors import KVCacheError
from tvmattn.runtime.kernels import paged_slots
from tvmattn.runtime.trees import MAX_TREE_NODES, accepted_path, depths, is_chain

NUM_LAYERS, NUM_QO_HEADS, NUM_KV_HEADS, DTYPE = 2, 4, 2, "float32"
MAX_SEQS, CAPACITY, PREFILL_CHUNK = 6, 1024, 64
ROPE_THETA, ROPE_SCALE = 1e4, 0.5
# Distinct cached tokens the strategy stays under, so that the cache never runs out of pages
# (out-of-pages is tested on its own below).
TOKEN_BUDGET = 400
NEW_ID = st.integers(-1, 7)  # an id not in use (the code-th one), or -1: one in use
PICK = st.integers(-1, 63)  # a live sequence (index modulo their number) or -1: an unknown id
RTOL, ATOL = ref.TOLERANCES[DTYPE]


@dataclasses.dataclass(frozen=True)
class Setup:
    """One cache configuration the state machine runs against."""

    name: str
    rope_mode: str
    page_size: int
    head_dim: int
    sliding: bool

    @property
    def kv_rope_mode(self) -> str:
        """How RoPE reaches the keys: a cache with sliding windows rotates them inline (as TVM's
        does), since a window changes the positions of the cached keys."""
        return "inline" if self.sliding and self.rope_mode == "normal" else self.rope_mode

    @property
    def sm_scale(self) -> float:
        return default_sm_scale(self.head_dim)

    @property
    def chains_only(self) -> bool:
        """Token trees must be chains: with sliding windows or RoPE inline (tree attention has
        no kernels for either)."""
        return self.sliding or self.rope_mode == "inline"

    def make_cache(self, device: tvm.runtime.Device, kernels: dict | None = None) -> PagedKVCache:
        return PagedKVCache(num_layers=NUM_LAYERS, num_qo_heads=NUM_QO_HEADS, num_kv_heads=NUM_KV_HEADS,
                            qk_head_dim=self.head_dim, dtype=DTYPE, page_size=self.page_size,
                            max_num_sequences=MAX_SEQS, max_total_seq_len=CAPACITY,
                            prefill_chunk_size=PREFILL_CHUNK, rope_mode=self.rope_mode,
                            rope_scale=ROPE_SCALE, rope_theta=ROPE_THETA,
                            support_sliding_window=self.sliding, device=device, kernels=kernels)


class Faults:
    """The cache's kernels, some wrapped to raise when armed: a launch failing inside a layer's
    call after its arguments were checked (split_rotary_append, transpose_append and the paged
    decode kernel; `skip` wrapped launches of the call run first)."""

    def __init__(self, setup: Setup, device: tvm.runtime.Device):
        base = _kernels(setup, device.dlpack_device_type())
        decode = paged_slots(setup.sliding)[1]
        self.kernels = {"split_rotary_append": self._wrap(base.split_rotary_append),
                        "transpose_append": self._wrap(base.transpose_append),
                        decode: ["tirx", self._wrap(getattr(base, decode)[1])]}
        self._countdown = None

    def arm(self, skip: int) -> None:
        self._countdown = skip

    def disarm(self) -> None:
        self._countdown = None

    def _wrap(self, kernel):
        def launch(*args):
            if self._countdown is not None:
                if self._countdown == 0:
                    self._countdown = None
                    raise RuntimeError("injected kernel failure")
                self._countdown -= 1
            return kernel(*args)

        return launch


@functools.lru_cache(maxsize=None)
def _kernels(setup: Setup, device_type: int):
    """The kernels a cache of `setup` builds (once per process)."""
    device = tvm.cuda(0) if device_type == tvm.cuda(0).dlpack_device_type() else tvm.cpu()
    return setup.make_cache(device).kernels


SETUPS = [
    Setup("sliding-window", rope_mode="none", page_size=4, head_dim=32, sliding=True),
    Setup("rope-normal", rope_mode="normal", page_size=8, head_dim=32, sliding=False),
    Setup("rope-inline", rope_mode="inline", page_size=4, head_dim=16, sliding=False),
    Setup("sliding-window-rope", rope_mode="normal", page_size=8, head_dim=64, sliding=True),
]


class InvalidOperation(Exception):
    """The reference model refuses an operation; the cache must raise KVCacheError."""


# ---------------------------------------------------------------------------------------------
# The reference model


@dataclasses.dataclass
class RefSequence:
    """One sequence, unpaged: k[layer] / v[layer] are [length, Hkv, D] float64 (K rotated when
    RoPE is "normal"); uids names each cached token (to reason about shared pages)."""

    k: list
    v: list
    uids: list
    window: tuple[int, int] | None = None  # (window size, sink size)
    slid: bool = False  # the window has dropped tokens at least once
    tree: list = dataclasses.field(default_factory=list)  # parents of the uncommitted tree's nodes (the last tokens)

    @property
    def length(self) -> int:
        return len(self.uids)

    @property
    def committed(self) -> int:
        return self.length - len(self.tree)

    def keep(self, index) -> None:
        self.k = [k[index] for k in self.k]
        self.v = [v[index] for v in self.v]
        self.uids = [self.uids[i] for i in index]


@dataclasses.dataclass
class RefStep:
    """A forward in progress: per request (seq_id, new tokens, cached tokens before it, RoPE
    positions of its new tokens, which keys each new token sees or None: causal), and the
    sequences as they were before it (to roll back)."""

    seq_ids: list
    lengths: list
    history: list
    positions: list
    visible: list
    saved: dict


class ReferenceCache:
    """What the cache must hold and compute. Every operation validates first and raises
    InvalidOperation (leaving the model untouched) or applies completely."""

    def __init__(self, setup: Setup):
        self.setup = setup
        self.seqs: dict[int, RefSequence] = {}
        self.step: RefStep | None = None
        self._next_uid = 0

    # -- sequences
    def _get(self, seq_id: int) -> RefSequence:
        if seq_id not in self.seqs:
            raise InvalidOperation(f"unknown sequence {seq_id}")
        return self.seqs[seq_id]

    def _empty_seq(self) -> RefSequence:
        d = self.setup.head_dim
        zeros = [np.zeros((0, NUM_KV_HEADS, d)) for _ in range(NUM_LAYERS)]
        return RefSequence(k=list(zeros), v=list(zeros), uids=[])

    def add(self, seq_id: int) -> None:
        if seq_id in self.seqs:
            raise InvalidOperation(f"sequence {seq_id} already exists")
        if len(self.seqs) >= MAX_SEQS:
            raise InvalidOperation(f"already {MAX_SEQS} sequences")
        self.seqs[seq_id] = self._empty_seq()

    def remove(self, seq_id: int) -> None:
        self._get(seq_id)
        del self.seqs[seq_id]

    def fork(self, parent_id: int, child_id: int, pos: int) -> None:
        parent = self._get(parent_id)
        if parent.tree:
            raise InvalidOperation(f"sequence {parent_id} has an uncommitted token tree")
        if child_id in self.seqs:
            raise InvalidOperation(f"child {child_id} already exists")
        if len(self.seqs) >= MAX_SEQS:
            raise InvalidOperation(f"already {MAX_SEQS} sequences")
        if pos < -1 or pos > parent.length:
            raise InvalidOperation(f"fork position {pos} outside [-1, {parent.length}]")
        end = parent.length if pos == -1 else pos
        if parent.window is not None and end > parent.window[1]:
            raise InvalidOperation(f"windowed parent forked at {end}, past its sink {parent.window[1]}")
        child = self._empty_seq()
        child.k = [k[:end].copy() for k in parent.k]
        child.v = [v[:end].copy() for v in parent.v]
        child.uids = parent.uids[:end]
        self.seqs[child_id] = child

    def popn(self, seq_id: int, n: int) -> None:
        seq = self._get(seq_id)
        if n < 0 or n > seq.length:
            raise InvalidOperation(f"popn {n} from a sequence of {seq.length}")
        seq.keep(list(range(seq.length - n)))
        del seq.tree[max(len(seq.tree) - n, 0):]

    def enable_sliding_window(self, seq_id: int, window: int, sink: int) -> None:
        seq = self._get(seq_id)
        if not self.setup.sliding:
            raise InvalidOperation("the cache does not support sliding windows")
        if seq.window is not None:
            raise InvalidOperation(f"sequence {seq_id} already has a window")
        if window <= 0 or sink < 0 or sink >= window:
            raise InvalidOperation(f"window {window} with sink {sink}")
        assert seq.length == 0, "the strategy only windows empty sequences"
        seq.window = (window, sink)

    def clear(self) -> None:
        self.seqs.clear()

    # -- forward
    def begin_forward(self, seq_ids: list, lengths: list, parents: list | None = None) -> None:
        """parents: the token-tree parents of every new token (None: no tree)."""
        if len(seq_ids) != len(lengths):
            raise InvalidOperation(f"{len(seq_ids)} seq_ids but {len(lengths)} append lengths")
        if len(set(seq_ids)) != len(seq_ids):
            raise InvalidOperation(f"seq_ids {seq_ids} repeat a sequence")
        for seq_id in seq_ids:
            self._get(seq_id)
        if min(lengths) <= 0:
            raise InvalidOperation(f"append lengths {lengths}")
        if sum(lengths) > PREFILL_CHUNK:
            raise InvalidOperation(f"{sum(lengths)} tokens > prefill chunk {PREFILL_CHUNK}")
        seqs = [self.seqs[s] for s in seq_ids]
        trees = self._new_trees(seqs, lengths, parents)
        saved = {seq_id: copy.deepcopy(seq) for seq_id, seq in zip(seq_ids, seqs)}
        history = [seq.length for seq in seqs]
        positions, visible = [], []
        for seq, n, new in zip(seqs, lengths, trees):
            seq.uids += list(range(self._next_uid, self._next_uid + n))
            self._next_uid += n
            if new is None:
                positions.append(seq.length - n + np.arange(n))
                visible.append(None)
                continue
            seq.tree = seq.tree + new
            positions.append(seq.committed + np.asarray(depths(seq.tree)[len(seq.tree) - n:]))
            visible.append(ref.tree_visibility(seq.tree, seq.committed, n))
        self.step = RefStep(list(seq_ids), list(lengths), history, positions, visible, saved)

    def _new_trees(self, seqs: list, lengths: list, parents: list | None) -> list:
        """Each sequence's new nodes' parents (None each without a tree), checked."""
        if parents is None:
            if any(seq.tree for seq in seqs):
                raise InvalidOperation("a sequence of the step has an uncommitted token tree")
            return [None] * len(seqs)
        if len(parents) != sum(lengths):
            raise InvalidOperation(f"{len(parents)} parents for {sum(lengths)} new tokens")
        trees, start = [], 0
        for seq, n in zip(seqs, lengths):
            new = list(parents[start : start + n])
            start += n
            if len(seq.tree) + n > MAX_TREE_NODES:
                raise InvalidOperation("tree too large")
            if any(not -1 <= p < len(seq.tree) + i for i, p in enumerate(new)):
                raise InvalidOperation(f"bad parents {new} after a tree of {len(seq.tree)}")
            trees.append(new)
        if self.setup.chains_only and not all(is_chain(seq.tree + new) for seq, new in zip(seqs, trees)):
            raise InvalidOperation("a tree that is not a chain where RoPE is inline")
        return trees

    def query_positions(self) -> np.ndarray:
        return np.concatenate(self.step.positions)

    def attention(self, layer: int, qkv: np.ndarray) -> np.ndarray:
        """Append this layer's new K/V and return the expected output [n, Hq, D]."""
        hq, hkv = NUM_QO_HEADS, NUM_KV_HEADS
        outputs, start = [], 0
        rope_args = (ROPE_THETA, ROPE_SCALE)
        step = self.step
        for seq_id, n, positions, visible in zip(step.seq_ids, step.lengths, step.positions, step.visible):
            seq = self.seqs[seq_id]
            rows = qkv[start : start + n].astype(np.float64)
            start += n
            q, k, v = rows[:, :hq], rows[:, hq : hq + hkv], rows[:, hq + hkv :]
            if self.setup.kv_rope_mode == "normal":
                q, k = ref.rope(q, positions, *rope_args), ref.rope(k, positions, *rope_args)
            seq.k[layer] = np.concatenate([seq.k[layer], k])
            seq.v[layer] = np.concatenate([seq.v[layer], v])
            keys = seq.k[layer]
            if self.setup.kv_rope_mode == "inline":
                q = ref.rope(q, positions, *rope_args)
                keys = ref.rope(keys, np.arange(len(keys)), *rope_args)
            outputs.append(ref.attention(q, keys, seq.v[layer], self.setup.sm_scale, causal=True, visible=visible)[0])
        return np.concatenate(outputs)

    def end_forward(self) -> None:
        for seq_id in self.step.seq_ids:
            if not self.seqs[seq_id].tree:
                self._slide(self.seqs[seq_id])
        self.step = None

    def rollback(self) -> None:
        """The step in progress abandoned: its sequences as they were before it."""
        self.seqs.update(self.step.saved)
        self.step = None

    @staticmethod
    def _slide(seq: RefSequence) -> None:
        if seq.window is None or seq.length <= seq.window[0]:
            return
        window, sink = seq.window
        seq.keep(list(range(sink)) + list(range(seq.length - (window - sink), seq.length)))
        seq.slid = True

    def commit(self, seq_ids: list, leaves: list) -> None:
        """Keep each sequence's path from its tree's root to node leaves[i] (-1: none)."""
        if len(seq_ids) != len(leaves):
            raise InvalidOperation(f"{len(seq_ids)} seq_ids but {len(leaves)} leaves")
        if len(set(seq_ids)) != len(seq_ids):
            raise InvalidOperation(f"seq_ids {seq_ids} repeat a sequence")
        seqs = [self._get(seq_id) for seq_id in seq_ids]
        for seq, leaf in zip(seqs, leaves):
            if not (leaf == -1 or -1 <= leaf < len(seq.tree)):
                raise InvalidOperation(f"leaf {leaf} of a tree of {len(seq.tree)} nodes")
        for seq, leaf in zip(seqs, leaves):
            committed = seq.committed
            seq.keep(list(range(committed)) + [committed + node for node in accepted_path(seq.tree, leaf)])
            seq.tree = []
            self._slide(seq)

    # -- accounting
    def total_length(self) -> int:
        return sum(s.length for s in self.seqs.values())

    def distinct_tokens(self) -> int:
        return len({u for s in self.seqs.values() for u in s.uids})

    def page_bounds(self) -> tuple[int, int]:
        """(fewest, most) pages the sequences may hold.

        A full page is shared by every sequence that holds the same tokens in it (forks share
        full pages by reference); a partly filled page belongs to one sequence (a fork inside a
        page copies it), except that a lazy copy-on-write may keep it shared with a sequence
        holding the same tokens or more. A windowed sequence holds its tokens' pages plus at
        most two that the window has partly emptied.
        """
        ps = self.setup.page_size
        full, partial, low, high = set(), [], 0, 0
        for seq in self.seqs.values():
            if seq.window is not None:
                low += math.ceil(seq.length / ps)
                high += math.ceil(seq.length / ps) + 2
                continue
            num_full = seq.length // ps
            full.update(tuple(seq.uids[j * ps : (j + 1) * ps]) for j in range(num_full))
            if seq.length % ps:
                partial.append(tuple(seq.uids[num_full * ps :]))
        distinct = set(partial)

        def may_share(p):
            return any(f[: len(p)] == p for f in full) or any(len(q) > len(p) and q[: len(p)] == p for q in distinct)

        low += len(full) + sum(1 for p in distinct if not may_share(p))
        high += len(full) + len(partial)
        return low, high


# ---------------------------------------------------------------------------------------------
# The state machine

# Faults injected into a forward: None = a valid forward; "begin:*" break begin_forward (then the
# valid forward runs); "attn:*" make one attention call invalid before the valid ones.
FAULTS = [None, None, None, None, None, None, "begin:unknown_seq", "begin:duplicate_seq", "begin:zero_length",
          "begin:length_mismatch", "begin:over_chunk", "attn:layer", "attn:negative_layer",
          "attn:qkv_rows", "attn:qkv_heads", "attn:o_shape", "attn:dtype", "attn:device"]


def choose_position(code: int, length: int, page_size: int) -> int:
    """A fork position from a strategy code: -1 (the end) and a few invalid negatives, spread
    over [0, length] (0..32), page boundaries (33..40, possibly past the end) and 1..4 past
    the end (41..44)."""
    if code < 0:
        return code
    if code <= 32:
        return round(code * length / 32)
    if code <= 40:
        return (code - 33) * page_size
    return length + code - 40


def choose_count(code: int, length: int) -> int:
    """A popn count from a strategy code: -1 (invalid), spread over [0, length] (0..32), or
    1..3 more than the length (33..35, invalid)."""
    if code < 0:
        return code
    if code <= 32:
        return round(code * length / 32)
    return length + code - 32


MEMBERS = st.lists(st.integers(0, 63), min_size=1, max_size=5)  # batch members (indices into live ids)
# How interrupted_step ends its step (see the rule).
INTERRUPTIONS = ["cancel", "end", "begin_again", "remove", "popn", "fork", "clear", "launch", "refused", "add"]
SEEDS = st.integers(0, 2**16)


def has_sequences(machine) -> bool:
    return bool(machine.model.seqs)


class CacheMachine(RuleBasedStateMachine):
    def __init__(self, setup: Setup, device: tvm.runtime.Device):
        super().__init__()
        self.setup = setup
        self.device = device
        self.faults = Faults(setup, device)
        self.cache = setup.make_cache(device, self.faults.kernels)
        self.model = ReferenceCache(setup)
        self.initial_pages = self.cache.get_num_available_pages()
        note(f"setup {setup}; {self.initial_pages} pages")

    # -- helpers
    def _tensor(self, array: np.ndarray) -> tvm.runtime.Tensor:
        return tvm.runtime.tensor(array, device=self.device)

    def _pick(self, code: int) -> int:
        live = sorted(self.model.seqs)
        if code < 0 or not live:
            return max(live, default=0) + 100
        return live[code % len(live)]

    def _new_id(self, code: int) -> int:
        """code >= 0: the code-th smallest id not in use; -1: one in use (a duplicate)."""
        live = sorted(self.model.seqs)
        if code < 0 and live:
            return live[0]
        free = [i for i in range(len(live) + 8) if i not in self.model.seqs]
        return free[max(code, 0) % len(free)]

    def _snapshot(self):
        return (self.cache.get_num_available_pages(), self.cache.get_total_sequence_length(), self.cache.empty(),
                {seq_id: self.cache.sequence_state(seq_id) for seq_id in self.cache.sequence_ids()})

    def _apply(self, what: str, model_op, cache_op, before=None) -> bool:
        """Apply an operation to both; if the model refuses it, the cache must refuse it too
        (KVCacheError) and be as `before` (default: as it was). True when it was applied."""
        before = self._snapshot() if before is None else before
        try:
            model_op()
        except InvalidOperation as refused:
            note(f"{what}  -> invalid ({refused})")
            with pytest.raises(KVCacheError):
                cache_op()
            assert self._snapshot() == before, f"{what} raised but changed the cache"
            return False
        note(what)
        cache_op()
        return True

    # -- rules
    @initialize(lengths=st.lists(st.integers(0, 21), min_size=1, max_size=3), window=st.integers(0, 14),
                sink=st.integers(0, 3), seed=SEEDS)
    def start(self, lengths, window, sink, seed):
        """A few sequences, prefilled with `lengths` tokens (0: left empty); with sliding-window
        support, the first may get a window."""
        for _ in lengths:
            self.add(0)
        if self.setup.sliding and window:
            self.enable_sliding_window(0, window, sink)
        seq_ids = [seq_id for seq_id, n in zip(sorted(self.model.seqs), lengths) if n]
        if seq_ids:
            self._forward(seq_ids, [n for n in lengths if n], None, seed)

    @rule(code=NEW_ID)
    def add(self, code):
        seq_id = self._new_id(code)
        self._apply(f"add_sequence({seq_id})", lambda: self.model.add(seq_id),
                    lambda: self.cache.add_sequence(seq_id))

    @precondition(has_sequences)
    @rule(which=PICK)
    def remove(self, which):
        seq_id = self._pick(which)
        self._apply(f"remove_sequence({seq_id})", lambda: self.model.remove(seq_id),
                    lambda: self.cache.remove_sequence(seq_id))

    @precondition(has_sequences)
    @rule(which=PICK, code=NEW_ID, pos_code=st.integers(-3, 44))
    def fork(self, which, code, pos_code):
        parent, child = self._pick(which), self._new_id(code)
        length = self.model.seqs[parent].length if parent in self.model.seqs else 0
        pos = choose_position(pos_code, length, self.setup.page_size)
        self._apply(f"fork_sequence({parent}, {child}, {pos})", lambda: self.model.fork(parent, child, pos),
                    lambda: self.cache.fork_sequence(parent, child, pos))

    @precondition(has_sequences)
    @rule(which=PICK, n_code=st.integers(-1, 35))
    def popn(self, which, n_code):
        self._apply_popn(self._pick(which), n_code)

    def _apply_popn(self, seq_id, n_code):
        length = self.model.seqs[seq_id].length if seq_id in self.model.seqs else 0
        n = choose_count(n_code, length)
        self._apply(f"popn({seq_id}, {n})", lambda: self.model.popn(seq_id, n), lambda: self.cache.popn(seq_id, n))

    @precondition(has_sequences)
    @rule(which=PICK, code=NEW_ID, pos_code=st.integers(-1, 40), n_code=st.integers(0, 32), pop_child=st.booleans())
    def branch(self, which, code, pos_code, n_code, pop_child):
        """fork, then popn the parent or the child, possibly back into their shared pages (as
        speculative decoding rolls back): the next append must copy the shared page first."""
        parent, child = self._pick(which), self._new_id(code)
        self.fork(which, code, pos_code)
        if child in self.model.seqs:
            target = child if pop_child else parent
            self._apply_popn(target, n_code)

    @precondition(lambda self: self.setup.sliding)
    @rule(which=st.integers(-2, 63), window=st.integers(0, 14), sink=st.integers(0, 3))
    def enable_sliding_window(self, which, window, sink):
        """which: an empty windowless sequence (index), -1 an unknown id, -2 a windowed one."""
        if which == -2:
            windowed = sorted(s for s, seq in self.model.seqs.items() if seq.window is not None)
            if not windowed:
                return
            seq_id = windowed[0]
        elif which == -1:
            seq_id = self._pick(-1)
        else:
            empties = sorted(s for s, seq in self.model.seqs.items() if seq.window is None and seq.length == 0)
            if not empties:
                return
            seq_id = empties[which % len(empties)]
        self._apply(f"enable_sliding_window_for_seq({seq_id}, {window}, {sink})",
                    lambda: self.model.enable_sliding_window(seq_id, window, sink),
                    lambda: self.cache.enable_sliding_window_for_seq(seq_id, window, sink))

    @rule(code=st.integers(0, 15))
    def clear(self, code):
        if code != 15:  # rare: it wipes everything the other rules built
            return
        note("clear()")
        self.model.clear()
        self.cache.clear()

    @rule()
    def attention_outside_forward(self):
        note("attention_with_fused_qkv outside a forward -> invalid")
        d = self.setup.head_dim
        qkv = self._tensor(np.zeros((1, NUM_QO_HEADS + 2 * NUM_KV_HEADS, d), DTYPE))
        o = empty((1, NUM_QO_HEADS, d), DTYPE, self.device)
        before = self._snapshot()
        with pytest.raises(KVCacheError):
            self.cache.attention_with_fused_qkv(0, self.setup.sm_scale, qkv, o)
        assert self._snapshot() == before

    @precondition(has_sequences)
    @rule(members=MEMBERS, lengths=st.lists(st.integers(1, 24), min_size=5, max_size=5),
          fault=st.sampled_from(FAULTS), seed=SEEDS)
    def prefill(self, members, lengths, fault, seed):
        seq_ids = list(dict.fromkeys(self._pick(c) for c in members))
        self._forward(seq_ids, lengths[: len(seq_ids)], fault, seed)

    @precondition(has_sequences)
    @rule(members=MEMBERS, fault=st.sampled_from(FAULTS), seed=SEEDS)
    def decode(self, members, fault, seed):
        seq_ids = list(dict.fromkeys(self._pick(c) for c in members))
        self._forward(seq_ids, [1] * len(seq_ids), fault, seed)

    def _forward(self, seq_ids, lengths, fault, seed, parents=None, before=None):
        """A whole step (fault: see FAULTS); before: what a refused begin_forward leaves."""
        while sum(lengths) > PREFILL_CHUNK:
            lengths = [max(1, n // 2) for n in lengths]
        if self.model.distinct_tokens() + sum(lengths) > TOKEN_BUDGET:
            return
        if parents is not None:
            parents = self._parents(seq_ids, lengths, parents)
        if fault is not None and fault.startswith("begin:"):
            self._begin_with_fault(seq_ids, lengths, fault)
        if not self._begin(seq_ids, lengths, parents, before):
            return
        rng = np.random.default_rng(seed)
        for layer in range(NUM_LAYERS):
            qkv = self._qkv(rng)
            if layer == 0 and fault is not None and fault.startswith("attn:"):
                self._attention_with_fault(qkv, fault)
            self._layer(layer, qkv)
        self._end()

    def _begin(self, seq_ids, lengths, parents=None, before=None) -> bool:
        tree = "" if parents is None else f", parents {parents}"
        if not self._apply(f"begin_forward({seq_ids}, {lengths}{tree})",
                           lambda: self.model.begin_forward(seq_ids, lengths, parents),
                           lambda: self.cache.begin_forward(seq_ids, lengths, parents), before):
            return False
        positions = self.cache.get_query_positions().numpy()
        np.testing.assert_array_equal(positions, self.model.query_positions(), err_msg="query positions")
        return True

    def _qkv(self, rng) -> np.ndarray:
        total, d = sum(self.model.step.lengths), self.setup.head_dim
        return rng.standard_normal((total, NUM_QO_HEADS + 2 * NUM_KV_HEADS, d)).astype(DTYPE)

    def _layer(self, layer: int, qkv: np.ndarray) -> None:
        """attention_with_fused_qkv of one layer of the step in progress, checked."""
        total, d = qkv.shape[0], self.setup.head_dim
        o = empty((total, NUM_QO_HEADS, d), DTYPE, self.device)
        self.cache.attention_with_fused_qkv(layer, self.setup.sm_scale, self._tensor(qkv), o)
        expected = self.model.attention(layer, qkv)
        np.testing.assert_allclose(o.numpy(), expected, rtol=RTOL, atol=ATOL, err_msg=f"output of layer {layer}")

    def _end(self) -> None:
        self.cache.end_forward()
        self.model.end_forward()

    def _parents(self, seq_ids: list, lengths: list, codes: list) -> list:
        """Token-tree parents of the new tokens from strategy codes: a chain where trees must be
        chains, else code -1 a root and c >= 0 node c modulo the nodes before it; code -2 makes
        the node its own parent (invalid)."""
        parents, i = [], 0
        for seq_id, n in zip(seq_ids, lengths):
            seq = self.model.seqs.get(seq_id)
            have = len(seq.tree) if seq is not None else 0
            for j in range(n):
                node, code = have + j, codes[i % len(codes)]
                i += 1
                if code == -2:
                    parents.append(node)
                elif self.setup.chains_only or code == -1 or node == 0:
                    parents.append(node - 1 if self.setup.chains_only or code != -1 else -1)
                else:
                    parents.append(code % node)
        return parents

    @precondition(has_sequences)
    @rule(members=MEMBERS, lengths=st.lists(st.integers(1, 6), min_size=5, max_size=5),
          codes=st.lists(st.integers(-2, 63), min_size=1, max_size=8), seed=SEEDS)
    def tree_step(self, members, lengths, codes, seed):
        """A token-tree step (speculative drafts): new trees, or trees grown over earlier steps."""
        seq_ids = list(dict.fromkeys(self._pick(c) for c in members))
        self._forward(seq_ids, lengths[: len(seq_ids)], None, seed, parents=codes)

    @precondition(has_sequences)
    @rule(members=MEMBERS, leaves=st.lists(st.integers(-3, 63), min_size=5, max_size=5), any_seq=st.integers(0, 7))
    def commit(self, members, leaves, any_seq):
        """Commit paths of sequences with trees (any_seq 0: of any sequence, or an unknown one):
        leaf code -1 keeps none, -2 / -3 ask for nodes past the tree (invalid)."""
        with_trees = sorted(seq_id for seq_id, seq in self.model.seqs.items() if seq.tree)
        if any_seq == 0 or not with_trees:
            seq_ids = list(dict.fromkeys(self._pick(c) for c in members))
        else:
            seq_ids = list(dict.fromkeys(with_trees[c % len(with_trees)] for c in members))
        chosen = []
        for seq_id, code in zip(seq_ids, leaves):
            size = len(self.model.seqs[seq_id].tree) if seq_id in self.model.seqs else 0
            chosen.append(-1 if code == -1 else size + 2 + code if code < -1 else code % max(size, 1))
        self._apply(f"commit_accepted_token_tree_nodes({seq_ids}, {chosen})",
                    lambda: self.model.commit(seq_ids, chosen),
                    lambda: self.cache.commit_accepted_token_tree_nodes(seq_ids, chosen))

    @precondition(has_sequences)
    @rule(members=MEMBERS, lengths=st.lists(st.integers(1, 12), min_size=5, max_size=5),
          tree=st.booleans(), codes=st.lists(st.integers(-1, 63), min_size=1, max_size=6),
          done=st.integers(0, NUM_LAYERS), interruption=st.sampled_from(INTERRUPTIONS),
          which=PICK, code=NEW_ID, count=st.integers(0, 35), seed=SEEDS)
    def interrupted_step(self, members, lengths, tree, codes, done, interruption, which, code, count, seed):
        """A step begun, `done` layers run, then `interruption`: the step must be abandoned
        (the cache exactly as before it, then the call's own work done) or, for calls refused
        inside a step, left going."""
        seq_ids = list(dict.fromkeys(self._pick(c) for c in members))
        lengths = lengths[: len(seq_ids)]
        if self.model.distinct_tokens() + sum(lengths) > TOKEN_BUDGET:
            return
        parents = self._parents(seq_ids, lengths, codes) if tree else None
        before = self._snapshot()
        if not self._begin(seq_ids, lengths, parents):
            return
        rng = np.random.default_rng(seed)
        for layer in range(done):
            self._layer(layer, self._qkv(rng))
        note(f"  interrupted after {done} layers by {interruption}")
        if interruption == "launch" and done < NUM_LAYERS:
            self.faults.arm(count % 2)
            try:
                self._layer(done, self._qkv(rng))
            except RuntimeError as error:
                assert "injected" in str(error)
                self.model.rollback()
                assert self._snapshot() == before, "a failed launch did not roll the step back"
                with pytest.raises(KVCacheError, match="rolled back"):
                    self.cache.end_forward()
                self.cache.end_forward()
                return
            finally:
                self.faults.disarm()
            done += 1  # (no wrapped launch left in the call: it ran)
        if interruption in ("refused", "add", "launch") or done == NUM_LAYERS and interruption == "end":
            if interruption == "refused":
                self._refused_inside(which)
            elif interruption == "add":
                new = self._new_id(code)
                self._apply(f"add_sequence({new}) inside the step", lambda: self.model.add(new),
                            lambda: self.cache.add_sequence(new))
            for layer in range(done, NUM_LAYERS):
                self._layer(layer, self._qkv(rng))
            self._end()
            return
        self.model.rollback()
        if interruption == "cancel":
            self.cache.cancel_forward()
        elif interruption == "end":
            with pytest.raises(KVCacheError, match="did not write"):
                self.cache.end_forward()
        elif interruption == "begin_again":  # (within the budget: the abandoned step was)
            self._forward(list(reversed(seq_ids)), [max(1, n // 2) for n in lengths], None, seed + 1, before=before)
            assert self.cache.current_plan() is None
            return
        elif interruption == "clear":
            self.model.clear()
            self.cache.clear()
            return
        else:
            seq_id = self._pick(which)
            if interruption == "remove":
                self._apply(f"remove_sequence({seq_id})", lambda: self.model.remove(seq_id),
                            lambda: self.cache.remove_sequence(seq_id), before)
                return
            if interruption == "popn":
                n = choose_count(count, self.model.seqs[seq_id].length if seq_id in self.model.seqs else 0)
                self._apply(f"popn({seq_id}, {n})", lambda: self.model.popn(seq_id, n),
                            lambda: self.cache.popn(seq_id, n), before)
                return
            child = self._new_id(code)
            length = self.model.seqs[seq_id].length if seq_id in self.model.seqs else 0
            pos = choose_position(count, length, self.setup.page_size)
            self._apply(f"fork_sequence({seq_id}, {child}, {pos})", lambda: self.model.fork(seq_id, child, pos),
                        lambda: self.cache.fork_sequence(seq_id, child, pos), before)
            return
        assert self._snapshot() == before, f"{interruption} did not roll the step back"

    def _refused_inside(self, which: int) -> None:
        """A call the cache refuses inside a step: KVCacheError, the step unchanged."""
        seq_id, d = self._pick(which), self.setup.head_dim
        in_step = self.model.step.seq_ids[0]  # (its first token is cached: only the step is in the way)
        calls = [lambda: self.cache.commit_accepted_token_tree_nodes([seq_id], [-1]),
                 lambda: self.cache.debug_get_kv(in_step, 0, 1, *(empty((NUM_LAYERS, 1, NUM_KV_HEADS, d), DTYPE,
                                                                        self.device) for _ in range(2)))]
        if self.setup.sliding:
            calls.append(lambda: self.cache.enable_sliding_window_for_seq(seq_id, 4, 1))
        before, plan = self._snapshot(), self.cache.current_plan()
        with pytest.raises(KVCacheError, match="forward step is in progress"):
            calls[which % len(calls)]()
        assert self._snapshot() == before and self.cache.current_plan() is plan

    @precondition(has_sequences)
    @rule(which=PICK, lengths=st.lists(st.integers(1, 24), min_size=1, max_size=2), seed=SEEDS)
    def recycle(self, which, lengths, seed):
        """Remove a sequence and prefill a new one: it gets the removed one's pages."""
        seq_id = self._pick(which)
        self._apply(f"remove_sequence({seq_id})", lambda: self.model.remove(seq_id),
                    lambda: self.cache.remove_sequence(seq_id))
        new = self._new_id(0)
        if self._apply(f"add_sequence({new})", lambda: self.model.add(new), lambda: self.cache.add_sequence(new)):
            for n in lengths:
                self._forward([new], [n], None, seed)

    def _begin_with_fault(self, seq_ids, lengths, fault):
        bad_ids, bad_lengths = list(seq_ids), list(lengths)
        if fault == "begin:unknown_seq":
            bad_ids.append(self._pick(-1))
            bad_lengths.append(1)
        elif fault == "begin:duplicate_seq":
            bad_ids.append(bad_ids[0])
            bad_lengths.append(1)
        elif fault == "begin:zero_length":
            bad_lengths[-1] = 0
        elif fault == "begin:length_mismatch":
            bad_lengths.append(1)
        elif fault == "begin:over_chunk":
            bad_lengths[0] += PREFILL_CHUNK - sum(lengths) + 1
        self._apply(f"begin_forward({bad_ids}, {bad_lengths})", lambda: self.model.begin_forward(bad_ids, bad_lengths),
                    lambda: self.cache.begin_forward(bad_ids, bad_lengths))

    def _attention_with_fault(self, qkv: np.ndarray, fault: str):
        total, heads, d = qkv.shape
        layer, o_shape, device = 0, (total, NUM_QO_HEADS, d), self.device
        if fault == "attn:layer":
            layer = NUM_LAYERS
        elif fault == "attn:negative_layer":
            layer = -1
        elif fault == "attn:qkv_rows":
            qkv = np.concatenate([qkv, qkv[:1]])
        elif fault == "attn:qkv_heads":
            qkv = qkv[:, 1:]
        elif fault == "attn:o_shape":
            o_shape = (total, NUM_QO_HEADS, d // 2)
        elif fault == "attn:dtype":
            qkv = qkv.astype("float16")
        elif fault == "attn:device":
            if self.device.dlpack_device_type() == tvm.cpu().dlpack_device_type():
                return  # no other device to put qkv on
            device = tvm.cpu()
        note(f"attention_with_fused_qkv({layer}, qkv {qkv.shape} {qkv.dtype} on {device}, o {o_shape}) "
             f"-> invalid ({fault})")
        with pytest.raises(KVCacheError):
            self.cache.attention_with_fused_qkv(layer, self.setup.sm_scale, tvm.runtime.tensor(qkv, device=device),
                                                empty(o_shape, DTYPE, self.device))

    # -- invariants
    @invariant()
    def lengths_and_pages_agree(self):
        assert self.cache.get_total_sequence_length() == self.model.total_length(), "total sequence length"
        assert self.cache.empty() == (not self.model.seqs), "empty()"
        used = self.initial_pages - self.cache.get_num_available_pages()
        low, high = self.model.page_bounds()
        assert low <= used <= high, f"{used} pages in use, expected {low}..{high}"

    @invariant()
    def cached_kv_agrees(self):
        d = self.setup.head_dim
        # K rotated by the cache in fp32 (angles up to ~200 rad lose ~1e-5), else copied exactly.
        k_tol = (RTOL, ATOL) if self.setup.kv_rope_mode == "normal" else (0, 0)
        for seq_id, seq in self.model.seqs.items():
            n = seq.length
            k = empty((NUM_LAYERS, n + 1, NUM_KV_HEADS, d), DTYPE, self.device)
            v = empty((NUM_LAYERS, n + 1, NUM_KV_HEADS, d), DTYPE, self.device)
            with pytest.raises(KVCacheError):  # the sequence is no longer than the model's
                self.cache.debug_get_kv(seq_id, 0, n + 1, k, v)
            if n == 0:
                continue
            k, v = (empty((NUM_LAYERS, n, NUM_KV_HEADS, d), DTYPE, self.device) for _ in range(2))
            self.cache.debug_get_kv(seq_id, 0, n, k, v)
            np.testing.assert_allclose(k.numpy(), np.stack(seq.k), rtol=k_tol[0], atol=k_tol[1],
                                       err_msg=f"K of sequence {seq_id}")
            np.testing.assert_array_equal(v.numpy(), np.stack(seq.v), err_msg=f"V of sequence {seq_id}")

    def teardown(self):
        for seq_id in list(self.model.seqs):
            self.cache.remove_sequence(seq_id)
        assert self.cache.empty()
        assert self.cache.get_num_available_pages() == self.initial_pages, "pages leaked"


# Deterministic (derandomize, no example database). The default tier runs a few short
# programs per setup; the slow tier many long ones.
SETTINGS = settings(max_examples=12, stateful_step_count=40, deadline=None, derandomize=True, database=None,
                    phases=[Phase.generate, Phase.shrink],
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
LONG_SETTINGS = settings(SETTINGS, max_examples=400, stateful_step_count=120)


@pytest.mark.parametrize("setup", [*SETUPS[:3], pytest.param(SETUPS[3], marks=pytest.mark.slow)], ids=lambda s: s.name)
def test_cache_matches_reference_model(target, setup):
    device = tvm.cuda(0) if target == "cuda" else tvm.cpu()
    run_state_machine_as_test(lambda: CacheMachine(setup, device), settings=SETTINGS)


@pytest.mark.slow
@pytest.mark.parametrize("setup", SETUPS, ids=lambda s: s.name)
def test_cache_matches_reference_model_long(target, setup):
    device = tvm.cuda(0) if target == "cuda" else tvm.cpu()
    run_state_machine_as_test(lambda: CacheMachine(setup, device), settings=LONG_SETTINGS)


@pytest.mark.slow
def test_fuzz_script_finds_no_divergence():
    """scripts/fuzz_cache.py (its own reference, every configuration of its CONFIGS) for a few
    episodes: no divergence, no leaked page."""
    fuzz = load_script("fuzz_cache")
    counts = collections.Counter()
    for episode, config in enumerate(fuzz.CONFIGS):
        fuzzer = fuzz.Fuzzer(config, episode, counts, check_every=20)
        for _ in range(300):
            fuzzer.op()
        fuzzer.finish()
    assert counts["leaks"] == 0 and counts["completed steps"] > 0 and counts["rolled back"] > 0


# ---------------------------------------------------------------------------------------------
# Running out of pages (the state machine stays within capacity)


def _forward(cache: PagedKVCache, setup: Setup, seq_ids: list, lengths: list, rng) -> None:
    cache.begin_forward(seq_ids, lengths)
    for layer in range(NUM_LAYERS):
        qkv = rng.standard_normal((sum(lengths), NUM_QO_HEADS + 2 * NUM_KV_HEADS, setup.head_dim)).astype(DTYPE)
        o = empty((sum(lengths), NUM_QO_HEADS, setup.head_dim), DTYPE, tvm.cpu())
        cache.attention_with_fused_qkv(layer, setup.sm_scale, tvm.runtime.tensor(qkv), o)
    cache.end_forward()


def _state(cache: PagedKVCache, setup: Setup, lengths: dict) -> tuple:
    """Pages, total length and every sequence's K/V (lengths: seq_id -> expected length)."""
    kv = []
    for seq_id, n in sorted(lengths.items()):
        if n == 0:
            continue
        k, v = (empty((NUM_LAYERS, n, NUM_KV_HEADS, setup.head_dim), DTYPE, tvm.cpu()) for _ in range(2))
        cache.debug_get_kv(seq_id, 0, n, k, v)
        kv += [k.numpy().tobytes(), v.numpy().tobytes()]
    return cache.get_num_available_pages(), cache.get_total_sequence_length(), kv


def test_out_of_pages_leaves_cache_unchanged():
    """A forward or fork that needs more pages than are free raises KVCacheError and changes
    nothing; removing everything gives every page back."""
    setup = Setup("tiny", rope_mode="none", page_size=4, head_dim=16, sliding=False)
    cache = PagedKVCache(num_layers=NUM_LAYERS, num_qo_heads=NUM_QO_HEADS, num_kv_heads=NUM_KV_HEADS,
                         qk_head_dim=setup.head_dim, dtype=DTYPE, page_size=4, max_num_sequences=4,
                         max_total_seq_len=16, prefill_chunk_size=64, device=tvm.cpu())
    rng = np.random.default_rng(0)
    pages = cache.get_num_available_pages()
    assert 4 <= pages <= 16
    cache.add_sequence(0)
    cache.add_sequence(1)
    _forward(cache, setup, [0], [4 * pages - 2], rng)  # every page but two free slots of the last
    lengths = {0: 4 * pages - 2, 1: 0}
    assert cache.get_num_available_pages() == 0
    before = _state(cache, setup, lengths)

    with pytest.raises(KVCacheError):
        cache.begin_forward([0], [3])  # one token too many for the last page
    assert _state(cache, setup, lengths) == before
    with pytest.raises(KVCacheError):
        cache.begin_forward([0, 1], [2, 1])  # sequence 0 fits, sequence 1 needs a page
    assert _state(cache, setup, lengths) == before
    with pytest.raises(KVCacheError):
        cache.fork_sequence(0, 2, 5)  # a fork inside a page copies it
    assert _state(cache, setup, lengths) == before
    with pytest.raises(KVCacheError):
        cache.debug_get_kv(2, 0, 1, *(empty((NUM_LAYERS, 1, NUM_KV_HEADS, 16), DTYPE, tvm.cpu()) for _ in range(2)))

    _forward(cache, setup, [0], [2], rng)  # what still fits works
    cache.fork_sequence(0, 2, 8)  # page-aligned: shares pages, needs none
    assert cache.get_num_available_pages() == 0
    for seq_id in (0, 1, 2):
        cache.remove_sequence(seq_id)
    assert cache.empty() and cache.get_num_available_pages() == pages
