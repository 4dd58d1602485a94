"""A forward step is a transaction: the specification of how PagedKVCache keeps or abandons a step.

The contract (PagedKVCache's docstring, "Forward steps are transactions"):
- begin_forward reserves the step's rows. end_forward keeps them only when every layer wrote the
  step's K/V (attention_with_fused_qkv on an MHA or MHA_SLIDING layer, append_mla_kv on an MLA
  layer; a call of attention_with_shared_kv stands for a layer that reads another's K/V);
  otherwise it rolls the step back and raises KVCacheError.
- A step abandoned in any way is rolled back: the cache is then exactly as it was before
  begin_forward (sequences, page tables, reference counts, the free list in order, token trees,
  windows). Abandoning calls: cancel_forward, begin_forward and begin_graph_decode (a new step),
  remove_sequence, fork_sequence, popn and clear (each then does its own work), and a per-layer
  call whose kernels raised after its arguments were checked.
- Refused inside a step (KVCacheError, the step intact): commit_accepted_token_tree_nodes,
  enable_sliding_window_for_seq, debug_get_kv. A per-layer call with bad arguments is refused
  the same way (the step goes on when the call is repeated correctly).
- A row is readable only once written: a rolled-back step's rows, in pages that held another
  sequence's K/V, are never attended.
- Token trees: a commit checks every sequence before it changes any. A windowed sequence slides
  its window only when a path is committed, so it keeps exactly the tokens that appending the
  accepted path one by one would keep (and a tree step's end_forward slides nothing).

Each test drives a cache beside the unpaged float64 truth of tests/test_cache.py (`Model`,
`TreeModel` of test_cache_tree.py) and checks every output, the cached K/V (debug_get_kv) and the
page accounting; "exactly as before" compares the allocator's free list and reference counts too.
The defect tests (one per way a cache may keep a bad step) fail on a cache without transactions.
"""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest
import tvm
from harness import empty, randn, tensor
from test_cache import ATOL, DTYPE, HKV, HQ, LAYERS, RTOL, SM_SCALE, D, Model, read_kv, state, zeros_kv
from test_cache_layer_kinds import KindsModel
from test_cache_tree import TreeModel
from test_tree_prefill import chain, star
from tvm.runtime import ShapeTuple

from tir_kernels import AttentionConfig
from tvmattn import KVCacheError
from tvmattn.runtime import ffi
from tvmattn.runtime.kernels import build_slot


class StepModel(TreeModel):
    """TreeModel whose steps may be taken apart: begin, some layers, then any call."""

    def begin(self, seq_ids: list, lengths: list) -> None:
        self.saved = self.truth()
        self.step = (list(seq_ids), list(lengths), [self.length(s) for s in seq_ids])
        self.cache.begin_forward(seq_ids, lengths)

    def layer(self, layer: int) -> None:
        """attention_with_fused_qkv of one layer, its output checked (the truth grows)."""
        seq_ids, lengths, history = self.step
        qkv = randn(self.rng, (sum(lengths), HQ + 2 * HKV, D), DTYPE)
        o = empty((sum(lengths), HQ, D), DTYPE, self.device)
        self.cache.attention_with_fused_qkv(layer, SM_SCALE, tensor(qkv, self.device), o)
        np.testing.assert_allclose(o.numpy().astype(np.float64), self._expected(seq_ids, lengths, history, layer, qkv),
                                   rtol=RTOL, atol=ATOL, err_msg=f"layer {layer} of {self.step}")

    def end(self) -> None:
        self.cache.end_forward()
        for seq_id in self.step[0]:
            self._slide(seq_id)

    def rolled_back(self) -> None:
        """The truth of a step the cache rolled back: as before begin."""
        self.k, self.v, self.parents = self.saved

    def truth(self) -> tuple:
        return copy.deepcopy((self.k, self.v, self.parents))


def exact(m: Model) -> tuple:
    """Everything a step may change (outside a step): test_cache.state plus the allocator's
    free list in order and every page's reference count."""
    allocator = m.cache._allocator
    allocator.check_invariants()
    return state(m), list(allocator._free), [allocator.refcount(p) for p in range(allocator.num_pages)]


def bad_qkv(m: StepModel):
    """A qkv one row short for the step in progress."""
    return tensor(randn(m.rng, (sum(m.step[1]) - 1, HQ + 2 * HKV, D), DTYPE), m.device)


def model(**options) -> StepModel:
    options = {"page_size": 4, "seed": 31, "max_num_sequences": 8, "max_total_seq_len": 96, **options}
    return StepModel("llvm", "none", **options)


def reuse_pages(m: StepModel) -> None:
    """Fill pages with a request's K/V and remove it: the next sequences get those pages."""
    m.add(7)
    m.forward([7], [16])
    m.remove(7)


# ---------------------------------------------------------------------------------------------
# A step that did not complete is not kept


def test_a_step_whose_layer_was_refused_is_rolled_back_by_end_forward():
    """A layer's call is refused (a qkv of the wrong shape) and the caller ends the step: the
    step is not kept, and its reserved rows (in a page that held a removed request's K/V) are
    never attended by a later step."""
    m = model()
    reuse_pages(m)
    m.add(0)
    m.forward([0], [5])
    before = exact(m)
    m.begin([0], [3])
    m.layer(0)
    with pytest.raises(KVCacheError, match="qkv must have shape"):
        m.cache.attention_with_fused_qkv(1, SM_SCALE, bad_qkv(m), empty((3, HQ, D), DTYPE, m.device))
    with pytest.raises(KVCacheError, match=r"layers \[1\] did not write .* rolled back"):
        m.cache.end_forward()
    m.rolled_back()
    assert exact(m) == before
    m.forward([0], [3])  # over exactly the 5 + 3 tokens of sequence 0
    m.forward([0], [1])
    m.check_no_leaks()


def test_a_refused_layer_call_leaves_the_step_going():
    """A refused call changes nothing: the layer called again with good arguments completes
    the step."""
    m = model()
    m.add(0)
    m.forward([0], [5])
    m.begin([0], [3])
    with pytest.raises(KVCacheError, match="qkv must have shape"):
        m.cache.attention_with_fused_qkv(0, SM_SCALE, bad_qkv(m), empty((3, HQ, D), DTYPE, m.device))
    for layer in range(LAYERS):
        m.layer(layer)
    m.end()
    m.check_no_leaks()


class FaultyAppend:
    """transpose_append that raises on its `fail_at`-th call (counting from 0), else runs the
    real kernel: a kernel failing inside a layer's call, after the arguments were checked."""

    def __init__(self, real):
        self.real, self.calls, self.fail_at = real, 0, None

    def __call__(self, *args):
        call, self.calls = self.calls, self.calls + 1
        if call == self.fail_at:
            raise RuntimeError("injected kernel failure")
        return self.real(*args)


def faulty_model(**options) -> tuple[StepModel, FaultyAppend]:
    config = AttentionConfig(HQ, HKV, D, dtype=DTYPE, page_size=4, target="llvm")
    fault = FaultyAppend(build_slot("transpose_append", config, LAYERS))
    return model(kernels={"transpose_append": fault}, **options), fault


@pytest.mark.parametrize("lengths", [[3], [1]], ids=["prefill", "decode"])
def test_a_kernel_failure_rolls_the_step_back_at_once(lengths):
    """A layer's kernels raise after its arguments were checked: the step is rolled back at once
    (its pages may hold half a layer); later calls of the step are refused, end_forward says
    why, and the next step sees exactly the sequence as it was."""
    m, fault = faulty_model()
    reuse_pages(m)
    m.add(0)
    m.forward([0], [5])
    before = exact(m)
    m.begin([0], lengths)
    m.layer(0)
    fault.fail_at = fault.calls
    with pytest.raises(RuntimeError, match="injected"):
        m.layer(1)
    with pytest.raises(KVCacheError, match="no forward step in progress.*rolled back.*layer 1"):
        m.cache.attention_with_fused_qkv(1, SM_SCALE, bad_qkv(m), None)
    with pytest.raises(KVCacheError, match="rolled back.*layer 1"):
        m.cache.end_forward()
    m.cache.end_forward()  # (said once)
    m.rolled_back()
    assert exact(m) == before
    m.forward([0], lengths)
    m.forward([0], [2])
    m.check_no_leaks()


def test_end_forward_before_every_layer_ran_rolls_back():
    m = model()
    m.add(0)
    m.add(1)
    m.forward([0, 1], [6, 2])
    before = exact(m)
    for layers in ([], [1], [0]):
        m.begin([0, 1], [1, 3])
        for layer in layers:
            m.layer(layer)
        missing = [layer for layer in range(LAYERS) if layer not in layers]
        with pytest.raises(KVCacheError, match=re.escape(f"layers {missing} did not write")):
            m.cache.end_forward()
        m.rolled_back()
        assert exact(m) == before
    m.check_no_leaks()


def test_self_and_cross_attention_alone_write_nothing_to_keep():
    """An MHA step of self_attention and cross_attention caches nothing (as in TVM): its rows
    cannot be kept; cancel_forward ends it."""
    m = model()
    m.add(0)
    m.forward([0], [6])
    before = exact(m)
    m.begin([0], [2])
    dev = m.device
    q, k, v = (tensor(randn(m.rng, (2, h, D), DTYPE), dev) for h in (HQ, HKV, HKV))
    o, lse = empty((2, HQ, D), DTYPE, dev), empty((2, HQ), "float32", dev)
    for layer in range(LAYERS):
        m.cache.self_attention(layer, SM_SCALE, q, k, v, o, lse)
        m.cache.cross_attention(layer, SM_SCALE, q, o, lse)
    m.cache.cancel_forward()
    assert exact(m) == before
    m.begin([0], [2])
    m.cache.self_attention(0, SM_SCALE, q, k, v, o, lse)
    with pytest.raises(KVCacheError, match="did not write"):
        m.cache.end_forward()
    assert exact(m) == before


def test_a_shared_kv_call_stands_for_its_layer():
    """A layer that reads another layer's K/V (attention_with_shared_kv) writes none: the step
    is complete when every other layer wrote."""
    m = model()
    m.add(0)
    m.forward([0], [5])
    m.begin([0], [2])
    m.layer(0)
    q = tensor(randn(m.rng, (2, HQ, D), DTYPE), m.device)
    k, v = (tensor(randn(m.rng, (2, HKV, D), DTYPE), m.device) for _ in range(2))
    m.cache.attention_with_shared_kv(0, SM_SCALE, q, k, v, empty((2, HQ, D), DTYPE, m.device))
    m.cache.end_forward()
    assert m.cache.sequence_state(0)["length"] == 7


# ---------------------------------------------------------------------------------------------
# Calls inside a step: each abandons it (rolled back, then the call) or is refused


def test_begin_forward_again_abandons_the_step_in_progress():
    m = model()
    m.add(0)
    m.forward([0], [4])
    m.begin([0], [3])
    m.rolled_back()
    m.forward([0], [2])  # the first step is rolled back: 4 + 2 tokens
    assert m.cache.sequence_state(0)["length"] == 6
    m.check_no_leaks()


def test_popn_inside_a_step_rolls_back_then_pops():
    m = model()
    m.add(0)
    m.forward([0], [4])
    m.begin([0], [3])
    m.layer(0)
    m.rolled_back()
    m.popn(0, 1)
    assert m.cache.sequence_state(0)["length"] == 3
    with pytest.raises(KVCacheError, match="no forward step in progress"):
        m.cache.attention_with_fused_qkv(1, SM_SCALE, bad_qkv(m), None)
    m.forward([0], [2])
    m.check_no_leaks()


def twins(setup) -> tuple[StepModel, StepModel]:
    """Two caches in the same state (the same calls from the same seed)."""
    pair = []
    for _ in range(2):
        m = model(seed=32)
        setup(m)
        pair.append(m)
    return tuple(pair)


def populated(m: StepModel) -> None:
    reuse_pages(m)
    for seq_id in (0, 1, 2):
        m.add(seq_id)
    m.forward([0, 1, 2], [9, 4, 6])
    m.fork(0, 3, 8)  # shares two full pages with sequence 0
    m.popn(0, 3)  # 0 now ends inside a page it shares with 3: the next append copies it


ABANDONING = {
    "cancel_forward": lambda m: m.cache.cancel_forward(),
    "remove a sequence of the step": lambda m: m.remove(0),
    "remove another sequence": lambda m: m.remove(2),
    "fork a sequence of the step": lambda m: m.fork(0, 5, 4),
    "popn": lambda m: m.popn(3, 2),
    "clear": lambda m: (m.cache.clear(), m.k.clear(), m.v.clear(), m.parents.clear()),
    "begin_forward": lambda m: m.forward([1, 3], [2, 1]),
    "begin_graph_decode": lambda m: m.cache.begin_graph_decode([0, 1], 2),
}


@pytest.mark.parametrize("call", ABANDONING, ids=list(ABANDONING))
def test_a_call_that_abandons_the_step_sees_the_cache_as_before_it(call):
    """A step (with a copy-on-write and new pages, one layer run) interrupted by `call` leaves
    the cache exactly as if the step had never begun and `call` had run."""
    m, twin = twins(populated)
    m.begin([0, 1, 3], [3, 1, 5])
    m.layer(0)
    m.rolled_back()
    m.rng, twin.rng = np.random.default_rng(5), np.random.default_rng(5)
    ABANDONING[call](m)
    ABANDONING[call](twin)
    m.cache.cancel_forward()
    twin.cache.cancel_forward()
    assert exact(m) == exact(twin)
    assert m.cache.current_plan() is None
    if m.k:
        m.forward(sorted(m.k)[:2], [1, 2][: len(m.k)])
    m.check_no_leaks()


def test_add_sequence_inside_a_step_leaves_it_going():
    """add_sequence touches no sequence of the step: the step goes on, to be kept or rolled back."""
    m = model()
    m.add(0)
    m.forward([0], [5])
    m.begin([0], [2])
    m.layer(0)
    m.add(1)
    m.layer(1)
    m.end()
    before = exact(m)
    m.begin([0], [3])
    m.layer(0)
    m.add(2)
    m.cache.cancel_forward()
    m.rolled_back()
    m.k[2], m.v[2], m.parents[2] = zeros_kv(), zeros_kv(), []  # (the truth of the sequence added)
    assert exact(m)[1:] == before[1:] and m.cache.sequence_state(0) == before[0][1][0]
    m.forward([0, 1, 2], [1, 3, 2])
    m.check_no_leaks()


REFUSED_IN_A_STEP = {
    "commit_accepted_token_tree_nodes": lambda c, kv: c.commit_accepted_token_tree_nodes([0], [0]),
    "enable_sliding_window_for_seq": lambda c, kv: c.enable_sliding_window_for_seq(1, 4, 1),
    "debug_get_kv": lambda c, kv: c.debug_get_kv(0, 0, 1, *kv),
}


@pytest.mark.parametrize("call", REFUSED_IN_A_STEP, ids=list(REFUSED_IN_A_STEP))
def test_calls_refused_inside_a_step_leave_it_going(call):
    m = model(sliding=True)
    m.add(0)
    m.add(1)
    m.forward([0], [5])
    m.begin([0], [3])
    m.layer(0)
    plan = m.cache.current_plan()
    kv = [empty((LAYERS, 1, HKV, D), DTYPE, m.device) for _ in range(2)]
    with pytest.raises(KVCacheError, match="a forward step is in progress"):
        REFUSED_IN_A_STEP[call](m.cache, kv)
    assert m.cache.current_plan() is plan
    m.layer(1)
    m.end()
    m.check_no_leaks()


def test_cancel_forward_outside_a_step_does_nothing():
    m = model()
    m.add(0)
    m.forward([0], [3])
    before = exact(m)
    m.cache.cancel_forward()
    m.cache.end_forward()
    assert exact(m) == before


# ---------------------------------------------------------------------------------------------
# Rows of reused pages


@pytest.mark.parametrize("interrupt", ["end_forward", "begin_forward", "remove"])
def test_a_reused_page_never_shows_its_old_rows(interrupt):
    """Reuse a page, fail a step, attend: the rows a failed step reserved in a page that held
    another request's K/V are never attended, however the step ended."""
    m = model()
    reuse_pages(m)
    m.add(0)
    m.add(1)
    m.forward([0, 1], [2, 1])
    m.begin([0, 1], [5, 6])
    m.layer(0)
    m.rolled_back()
    if interrupt == "end_forward":
        with pytest.raises(KVCacheError, match="rolled back"):
            m.cache.end_forward()
    elif interrupt == "remove":
        m.remove(1)
    for lengths in ([1] * len(m.k), [4] * len(m.k), [1] * len(m.k)):
        m.forward(sorted(m.k), lengths)
    m.check_no_leaks()


# ---------------------------------------------------------------------------------------------
# Token trees and windows


def test_a_commit_of_several_sequences_is_all_or_nothing():
    """Every sequence's commit is checked before any is applied: a commit refused for its last
    sequence leaves the first one's tree as it was; the same commit with good leaves keeps the
    accepted paths of both (one of them windowed)."""
    m = model(sliding=True)
    m.add(1)
    m.add(0, (4, 1))
    m.forward([1, 0], [3, 4])
    m.tree_forward([1, 0], [chain(5), chain(6)])
    before = exact(m)
    with pytest.raises(KVCacheError, match="7 is not a node"):
        m.cache.commit_accepted_token_tree_nodes([1, 0], [0, 7])
    assert exact(m) == before
    m.commit([1, 0], [0, 0])
    m.check_kv()
    m.forward([1, 0], [1, 1])
    m.check_no_leaks()


def kept_one_by_one(committed: list, path: list, window: int, sink: int) -> list:
    """The tokens a windowed sequence keeps when `path` is appended to `committed` one token at
    a time (the window slides after each)."""
    kept = list(committed)
    for token in path:
        kept.append(token)
        if len(kept) > window:
            kept = kept[:sink] + kept[len(kept) - (window - sink):]
    return kept


@pytest.mark.parametrize("window,sink,prefill,tree,leaf", [
    (8, 2, 8, 4, 0),  # the window is full: a path of one drops one token
    (4, 1, 4, 6, 0),  # a chain longer than the window
    (4, 1, 4, 6, 5),
    (4, 1, 4, 6, -1),
    (6, 3, 2, 7, 6),  # the window first slides at the commit
    (5, 0, 9, 3, 1),
])
def test_a_committed_path_keeps_what_appending_it_would(window, sink, prefill, tree, leaf):
    """A token tree on a windowed sequence: its step slides nothing (every node is attended by
    its descendants); the commit keeps exactly the tokens that appending the accepted path one
    by one keeps, and the sequence goes on decoding."""
    m = model(sliding=True)
    m.add(0, (window, sink))
    m.forward([0], [prefill])
    committed = m.length(0)
    m.tree_forward([0], [chain(tree)])
    assert m.cache.sequence_state(0)["length"] == committed + tree, "a tree step slides no window"
    k_all, v_all = read_kv(m.cache, 0, committed + tree, m.device)
    m.commit([0], [leaf])
    kept = kept_one_by_one(list(range(committed)), [committed + node for node in range(leaf + 1)], window, sink)
    k, v = read_kv(m.cache, 0, len(kept), m.device)
    np.testing.assert_array_equal(k, k_all[:, kept])
    np.testing.assert_array_equal(v, v_all[:, kept])
    m.check_kv()
    m.forward([0], [1])
    m.forward([0], [3])
    m.check_no_leaks()


def test_a_tree_that_does_not_fit_is_refused_at_begin_forward():
    """A windowed sequence holds its tree's nodes until the commit: a tree whose nodes need
    more pages than are free is refused when it begins, the cache unchanged; trees that are
    not chains are refused in a cache with windows (no tree-mask kernel reads windowed pages)."""
    m = model(sliding=True, max_total_seq_len=16, max_num_sequences=1)
    m.add(0, (8, 2))
    m.forward([0], [12])
    before = exact(m)
    free = m.cache.get_num_available_pages()
    with pytest.raises(KVCacheError, match="full"):
        m.cache.begin_forward([0], [4 * free + 1], chain(4 * free + 1))
    with pytest.raises(KVCacheError, match="support_sliding_window"):
        m.cache.begin_forward([0], [3], star(3))
    assert exact(m) == before
    m.tree_forward([0], [chain(4 * free)])
    m.commit([0], [2])
    m.check_no_leaks()


@pytest.mark.parametrize("leaf", [-1, 2, 7])
def test_layer_windows_keep_what_appending_the_path_would(leaf):
    """A cache with MHA_SLIDING layers: a chain tree's step attends in each token's window; the
    commit keeps the path (as if appended one by one) and later steps attend in the windows of
    the kept tokens."""
    m = KindsModel("llvm", page_size=4, seed=33)
    m.add(0)
    m.forward([0], [7])
    parents = chain(8)
    m.forward([0], [8], begin=lambda seq_ids, lengths: m.cache.begin_forward(seq_ids, lengths, parents))
    m.cache.commit_accepted_token_tree_nodes([0], [leaf])
    rejected = 8 - (leaf + 1)
    m.k[0] = [k[: len(k) - rejected] for k in m.k[0]]
    m.v[0] = [v[: len(v) - rejected] for v in m.v[0]]
    m.check_kv()
    m.forward([0], [1])
    m.forward([0], [6])
    before = m.cache.sequence_state(0), m.cache.get_num_available_pages()
    with pytest.raises(KVCacheError, match="MHA_SLIDING"):
        m.cache.begin_forward([0], [3], star(3))
    assert (m.cache.sequence_state(0), m.cache.get_num_available_pages()) == before


# ---------------------------------------------------------------------------------------------
# The model-library path: the tvmattn.* functions and the vm.builtin.* overrides


def through(prefix: str):
    return lambda name: tvm.get_global_func(prefix + name)


@pytest.mark.parametrize("prefix", ["tvmattn.", "vm.builtin."])
def test_the_ffi_functions_keep_steps_transactional(prefix):
    """Through the global functions a compiled model calls: a step whose layer was refused is
    rolled back by end_forward (the error crosses the FFI as KVCacheError), a doubled
    begin_forward abandons the first, and kv_state_cancel_forward rolls back."""
    ffi.install_vm_builtins()
    try:
        api = through(prefix)
        m = model()
        m.add(0)
        m.forward([0], [5])
        before = exact(m)
        cache = m.cache
        api("kv_state_begin_forward")(cache, ShapeTuple([0]), ShapeTuple([3]))
        qkv = tensor(randn(m.rng, (3, HQ + 2 * HKV, D), DTYPE), m.device)
        api("attention_kv_cache_attention_with_fused_qkv")(cache, 0, SM_SCALE, qkv, empty((3, HQ, D), DTYPE, m.device))
        with pytest.raises(KVCacheError, match="o must have shape"):
            api("attention_kv_cache_attention_with_fused_qkv")(cache, 1, SM_SCALE, qkv, empty((2, HQ, D), DTYPE,
                                                                                            m.device))
        with pytest.raises(KVCacheError, match="rolled back"):
            api("kv_state_end_forward")(cache)
        assert exact(m) == before
        api("kv_state_begin_forward")(cache, ShapeTuple([0]), ShapeTuple([3]))
        api("kv_state_begin_forward")(cache, ShapeTuple([0]), ShapeTuple([1]))
        assert api("attention_kv_cache_get_total_sequence_length")(cache) == 6
        api("kv_state_cancel_forward")(cache)
        assert exact(m) == before
        api("kv_state_begin_forward")(cache, ShapeTuple([0]), ShapeTuple([2]))
        api("kv_state_popn")(cache, 0, 1)
        assert api("attention_kv_cache_get_total_sequence_length")(cache) == 4
        m.k[0], m.v[0] = [k[:4] for k in m.k[0]], [v[:4] for v in m.v[0]]
        m.forward([0], [2])
        m.check_no_leaks()
    finally:
        ffi.uninstall_vm_builtins()
