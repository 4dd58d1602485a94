"""Scenario tests of tvmattn.PagedKVCache against a reference that keeps every sequence unpaged.

`Model` drives a cache and, beside it, keeps each sequence's K/V per layer unpaged (the values
the cache must hold: K rotated when RoPE is "normal"), applies windows, forks and pops to them,
and computes every layer's expected attention output with tests/reference.py. Each scenario
checks every layer's output of every forward and, at its checkpoints, the cached K/V of every
sequence (debug_get_kv), and ends by removing every sequence: no page may leak.

Error tests: each bad input raises KVCacheError with a message naming the problem, and the
cache's state (sequence ids, lengths, page tables, window fields, available pages, the K/V of
every sequence) is exactly what it was.

CPU always; CUDA through the `target` fixture where a GPU is present.
"""

from __future__ import annotations

import numpy as np
import pytest
import reference as ref
import tvm
from harness import empty, randn, tensor, to_dtype

import tir_kernels
from tir_kernels import default_sm_scale
from tvmattn import KVCacheError, PagedKVCache
from tvmattn.runtime.cache import target_for
from tvmattn.runtime.backends import (
    FlashInferPagedPrefill,
    PagedDecode,
    PagedPrefill,
    RaggedPrefill,
    RopeMode,
    TIRPagedPrefill,
    backend_from_spec,
)
from tvmattn.runtime.pages import PageAllocator

LAYERS, HQ, HKV, D, DTYPE = 2, 4, 2, 64, "float16"
ROPE_THETA, ROPE_SCALE = 1e4, 0.5
SM_SCALE = default_sm_scale(D)
RTOL, ATOL = ref.TOLERANCES[DTYPE]


def device_of(target: str):
    return tvm.cuda(0) if target.startswith("cuda") else tvm.cpu(0)


def zeros_kv(n: int = 0) -> list:
    return [np.zeros((n, HKV, D)) for _ in range(LAYERS)]


class Model:
    """A PagedKVCache and the unpaged truth of what it holds (see the module docstring)."""

    def __init__(self, target="llvm", rope_mode="none", page_size=4, sliding=False, seed=0, **options):
        options = {"max_num_sequences": 16, "max_total_seq_len": 1024, "prefill_chunk_size": 256, **options}
        self.device = device_of(target)
        self.cache = PagedKVCache(num_layers=LAYERS, num_qo_heads=HQ, num_kv_heads=HKV, qk_head_dim=D, dtype=DTYPE,
                                  page_size=page_size, rope_mode=rope_mode, rope_theta=ROPE_THETA,
                                  rope_scale=ROPE_SCALE, support_sliding_window=sliding, device=self.device,
                                  **options)
        # With sliding windows the cache applies "normal" RoPE inline (keys move as windows slide).
        self.rope = "inline" if sliding and rope_mode == "normal" else rope_mode
        self.page_size = page_size
        self.rng = np.random.default_rng(seed)
        self.initial_pages = self.cache.get_num_available_pages()
        self.k: dict[int, list] = {}
        self.v: dict[int, list] = {}
        self.window: dict[int, tuple] = {}

    # -- sequence operations, mirrored in the truth
    def add(self, seq_id: int, window: tuple | None = None) -> None:
        self.cache.add_sequence(seq_id)
        self.k[seq_id], self.v[seq_id] = zeros_kv(), zeros_kv()
        if window is not None:
            self.cache.enable_sliding_window_for_seq(seq_id, *window)
            self.window[seq_id] = window

    def remove(self, seq_id: int) -> None:
        self.cache.remove_sequence(seq_id)
        del self.k[seq_id], self.v[seq_id]
        self.window.pop(seq_id, None)

    def fork(self, parent: int, child: int, pos: int = -1) -> None:
        self.cache.fork_sequence(parent, child, pos)
        end = self.length(parent) if pos == -1 else pos
        self.k[child] = [k[:end].copy() for k in self.k[parent]]
        self.v[child] = [v[:end].copy() for v in self.v[parent]]

    def popn(self, seq_id: int, n: int) -> None:
        self.cache.popn(seq_id, n)
        self.k[seq_id] = [k[: len(k) - n] for k in self.k[seq_id]]
        self.v[seq_id] = [v[: len(v) - n] for v in self.v[seq_id]]

    def length(self, seq_id: int) -> int:
        return len(self.k[seq_id][0])

    # -- forward
    def forward(self, seq_ids: list, lengths: list) -> None:
        """One step: every layer's output checked against the reference."""
        history = [self.length(s) for s in seq_ids]
        self.cache.begin_forward(seq_ids, lengths)
        positions = np.concatenate([h + np.arange(n) for h, n in zip(history, lengths)])
        np.testing.assert_array_equal(self.cache.get_query_positions().numpy(), positions, err_msg="query positions")
        self.check_layers(sum(lengths), lambda layer, qkv: self._expected(seq_ids, lengths, history, layer, qkv),
                          f"forward {seq_ids} {lengths}")
        self.cache.end_forward()
        for seq_id in seq_ids:
            self._slide(seq_id)

    def check_layers(self, total: int, expected_of, what: str) -> None:
        """Every layer of the step begun: attention_with_fused_qkv of random qkv [total, ...]
        against expected_of(layer, qkv) (which also updates the truth)."""
        for layer in range(LAYERS):
            qkv = randn(self.rng, (total, HQ + 2 * HKV, D), DTYPE)
            o = empty((total, HQ, D), DTYPE, self.device)
            self.cache.attention_with_fused_qkv(layer, SM_SCALE, tensor(qkv, self.device), o)
            np.testing.assert_allclose(o.numpy().astype(np.float64), expected_of(layer, qkv), rtol=RTOL, atol=ATOL,
                                       err_msg=f"layer {layer} of {what}")

    def _expected(self, seq_ids, lengths, history, layer, qkv) -> np.ndarray:
        out, start = [], 0
        for seq_id, n, h in zip(seq_ids, lengths, history):
            rows = qkv[start : start + n]
            start += n
            q, k, v = rows[:, :HQ], rows[:, HQ : HQ + HKV], rows[:, HQ + HKV :]
            out.append(self._attend(seq_id, layer, q, k, v, h + np.arange(n)))
        return np.concatenate(out)

    def _attend(self, seq_id, layer, q, k, v, positions) -> np.ndarray:
        """Append k/v to the truth and return the new queries' attention output."""
        if self.rope == "normal":  # split_rotary rotates in fp32 and stores in the kernel dtype
            q = to_dtype(ref.rope(q, positions, ROPE_THETA, ROPE_SCALE), DTYPE)
            k = to_dtype(ref.rope(k, positions, ROPE_THETA, ROPE_SCALE), DTYPE)
        self.k[seq_id][layer] = np.concatenate([self.k[seq_id][layer], k.astype(np.float64)])
        self.v[seq_id][layer] = np.concatenate([self.v[seq_id][layer], v.astype(np.float64)])
        keys, values = self.k[seq_id][layer], self.v[seq_id][layer]
        if self.rope == "inline":
            q = ref.rope(q, positions, ROPE_THETA, ROPE_SCALE)
            keys = ref.rope(keys, np.arange(len(keys)), ROPE_THETA, ROPE_SCALE)
        return ref.attention(q, keys, values, SM_SCALE, causal=True)[0]

    def _slide(self, seq_id: int) -> None:
        if seq_id not in self.window:
            return
        window, sink = self.window[seq_id]
        n = self.length(seq_id)
        if n > window:
            keep = np.r_[0:sink, n - (window - sink) : n]
            self.k[seq_id] = [k[keep] for k in self.k[seq_id]]
            self.v[seq_id] = [v[keep] for v in self.v[seq_id]]

    # -- checks
    def check_kv(self) -> None:
        """debug_get_kv of every sequence equals the truth (K rotated by the cache may differ
        from the float64 truth by an fp16 rounding)."""
        rtol, atol = (2e-3, 1e-3) if self.rope == "normal" else (0, 0)
        assert self.cache.get_total_sequence_length() == sum(self.length(s) for s in self.k)
        for seq_id in self.k:
            k, v = read_kv(self.cache, seq_id, self.length(seq_id), self.device)
            np.testing.assert_allclose(k, np.stack(self.k[seq_id]), rtol=rtol, atol=atol, err_msg=f"K of {seq_id}")
            np.testing.assert_array_equal(v, np.stack(self.v[seq_id]), err_msg=f"V of {seq_id}")

    def check_no_leaks(self) -> None:
        self.check_kv()
        for seq_id in list(self.k):
            self.remove(seq_id)
        assert self.cache.empty()
        assert self.cache.get_num_available_pages() == self.initial_pages


def read_kv(cache: PagedKVCache, seq_id: int, n: int, device) -> tuple:
    """(k, v) [LAYERS, n, HKV, D] float64 of a sequence (empty arrays for n = 0)."""
    if n == 0:
        return np.zeros((LAYERS, 0, HKV, D)), np.zeros((LAYERS, 0, HKV, D))
    k, v = (empty((LAYERS, n, HKV, D), DTYPE, device) for _ in range(2))
    cache.debug_get_kv(seq_id, 0, n, k, v)
    return k.numpy().astype(np.float64), v.numpy().astype(np.float64)


# ---------------------------------------------------------------------------------------------
# Scenarios


@pytest.mark.parametrize("rope_mode,page_size", [("none", 4), ("normal", 16), ("inline", 4)])
def test_prefill_then_decode(target, rope_mode, page_size):
    m = Model(target, rope_mode, page_size, seed=1)
    for seq_id in (0, 1, 2):
        m.add(seq_id)
    m.forward([0, 1, 2], [23, 16, 5])  # prefill from empty: ragged only
    m.forward([0, 1, 2], [7, 12, 1])  # chunked prefill: history (paged) + new (ragged), merged
    for _ in range(3):
        m.forward([2, 0, 1], [1, 1, 1])  # decode: append, then paged decode
    m.check_kv()
    m.check_no_leaks()


def test_layer_calls_take_the_fast_path(target):
    """attention_with_fused_qkv with good arguments runs none of the Python checks (the launches'
    own argument checks pass them) and, in a decode step, one closure makes the launches; the
    results are checked against the reference as in every scenario."""
    m = Model(target, "normal", 16, seed=3)
    for seq_id in (0, 1):
        m.add(seq_id)
    checked = []
    m.cache._attention_with_fused_qkv = lambda *args: checked.append(args)  # the checked path: must not run
    m.forward([0, 1], [5, 19])
    for _ in range(3):
        m.forward([0, 1], [1, 1])
    m.forward([1, 0], [3, 1])
    assert checked == []
    m.check_kv()
    cache = PagedKVCache(num_layers=1, num_qo_heads=HQ, num_kv_heads=HKV, qk_head_dim=D, dtype=DTYPE,
                         device=device_of(target))
    cache.add_sequence(0)
    for lengths, fused in (([1], "launches"), ([2], "attention_with_fused_qkv")):
        cache.begin_forward([0], lengths)
        assert cache._step.fused.__name__ == fused
        cache.cancel_forward()


def test_python_kernels_take_the_checked_path():
    """A kernel given as a Python callable may not check its arguments, so such a cache checks
    every call in Python before it launches (a compiled kernel checks them itself)."""
    launched = []
    m = populated()
    real = m.cache.kernels.split_rotary_append

    def split_rotary_append(*args):
        launched.append(args)
        return real(*args)

    python = Model("llvm", "none", page_size=4, seed=14, max_num_sequences=4, max_total_seq_len=64,
                   prefill_chunk_size=48, kernels={"split_rotary_append": split_rotary_append})
    assert m.cache._fast_pages and not python.cache._fast_pages
    for seq_id in (0, 1):
        python.add(seq_id)
    python.forward([0, 1], [3, 2])
    python.cache.begin_forward([0, 1], [1, 1])
    launched.clear()
    with pytest.raises(KVCacheError, match=r"o must have shape \(2, 4, 64\)"):
        python.cache.attention_with_fused_qkv(0, SM_SCALE, qkv_for(python, 2), empty((3, HQ, D), DTYPE, python.device))
    assert launched == []
    python.cache.cancel_forward()
    python.forward([0, 1], [1, 1])
    python.check_no_leaks()


def test_decode_steps_of_one_layout_share_their_launches(target):
    """A decode step whose sequences took no page since the last one (the same plan layout and
    rows) is a new Step making the last one's prepared launches; a step that takes a page
    prepares its own. A bad o refused on the fast path (after the layer's append ran) leaves the
    step going: the good call that follows gives the reference's output and K/V. A decode step
    after a prefill step checks its arguments against its own token count."""
    m = Model(target, "normal", page_size=4, seed=9)
    seq_ids = [0, 1]
    for seq_id in seq_ids:
        m.add(seq_id)
    m.forward(seq_ids, [5, 2])
    m.forward(seq_ids, [1, 1])  # lengths 6 and 3
    made = m.cache._last_step

    def probe():
        m.cache.begin_forward(seq_ids, [1, 1])
        step = m.cache._step
        m.cache.cancel_forward()
        return step

    again = probe()  # (7 and 4: no page taken)
    assert again is not made and again.fused is made.fused and again.appended_layers == set()
    m.forward(seq_ids, [1, 1])  # 7 and 4
    assert probe().fused is not made.fused  # (sequence 1's 5th token takes a page)

    history = [m.length(s) for s in seq_ids]
    m.cache.begin_forward(seq_ids, [1, 1])
    with pytest.raises(KVCacheError, match=r"o must have shape \(2, 4, 64\)"):
        m.cache.attention_with_fused_qkv(0, SM_SCALE, qkv_for(m, 2), empty((3, HQ, D), DTYPE, m.device))
    m.check_layers(2, lambda layer, qkv: m._expected(seq_ids, [1, 1], history, layer, qkv), "after a refused o")
    m.cache.end_forward()
    m.check_kv()

    m.forward([0], [3])
    m.cache.begin_forward(seq_ids, [1, 1])
    with pytest.raises(KVCacheError, match=r"qkv must have shape \(2, 8, 64\)"):
        m.cache.attention_with_fused_qkv(0, SM_SCALE, qkv_for(m, 3), empty((2, HQ, D), DTYPE, m.device))
    m.cache.cancel_forward()
    m.forward(seq_ids, [1, 1])
    m.check_no_leaks()


@pytest.mark.parametrize("rope_mode", ["none", "normal"])
def test_decode_without_the_fused_split_append(target, rope_mode):
    """With no split_rotary_append kernel, decode steps run split_rotary then transpose_append
    (as model libraries and caches with replaced split/append kernels do): same results."""
    m = Model(target, rope_mode, page_size=4, seed=5, kernels={"split_rotary_append": None})
    assert m.cache.kernels.split_rotary_append is None
    assert Model(target, rope_mode, page_size=4).cache.kernels.split_rotary_append is not None
    with pytest.raises(KVCacheError, match="slot 'split_rotary_append' must be a function"):
        Model(target, rope_mode, page_size=4, kernels={"split_rotary_append": "not a kernel"})
    for seq_id in (0, 1):
        m.add(seq_id)
    m.forward([0, 1], [6, 3])
    for _ in range(3):
        m.forward([0, 1], [1, 1])
    m.check_kv()
    m.check_no_leaks()


@pytest.mark.parametrize("rope_mode", ["none", "normal"])
def test_attention_with_shared_kv(target, rope_mode):
    """A layer reading layer 0's cache (attention_with_shared_kv): in prefill, chunked prefill
    and decode steps it equals attention over layer 0's keys and values and appends nothing;
    before layer 0 has run in the step it is refused."""
    m = Model(target, rope_mode, page_size=4, seed=7)
    seq_ids = [0, 1]
    for seq_id in seq_ids:
        m.add(seq_id)
    for lengths in ([9, 5], [3, 6], [1, 1], [1, 1]):
        history = [m.length(s) for s in seq_ids]
        total = sum(lengths)
        m.cache.begin_forward(seq_ids, lengths)
        q = randn(m.rng, (total, HQ, D), DTYPE)
        o = empty((total, HQ, D), DTYPE, m.device)
        k0, v0 = (empty((total, HKV, D), DTYPE, m.device) for _ in range(2))
        with pytest.raises(KVCacheError, match="source layer 0 has not run attention_with_fused_qkv"):
            m.cache.attention_with_shared_kv(0, SM_SCALE, tensor(q, m.device), k0, v0, o)
        m.check_layers(total, lambda layer, qkv: m._expected(seq_ids, lengths, history, layer, qkv), "step")
        positions = np.concatenate([h + np.arange(n) for h, n in zip(history, lengths)])
        if rope_mode == "normal":  # q and k as split_rotary gives them
            q = to_dtype(ref.rope(q, positions, ROPE_THETA, ROPE_SCALE), DTYPE)
        # layer 0's new keys and values of the step: the last rows of its truth
        k_new = np.concatenate([m.k[s][0][len(m.k[s][0]) - n:] for s, n in zip(seq_ids, lengths)]).astype(DTYPE)
        v_new = np.concatenate([m.v[s][0][len(m.v[s][0]) - n:] for s, n in zip(seq_ids, lengths)]).astype(DTYPE)
        m.cache.attention_with_shared_kv(0, SM_SCALE, tensor(q, m.device), tensor(k_new, m.device),
                                         tensor(v_new, m.device), o)
        expected, start = [], 0
        for seq_id, n in zip(seq_ids, lengths):
            rows = q[start:start + n].astype(np.float64)
            expected.append(ref.attention(rows, m.k[seq_id][0], m.v[seq_id][0], SM_SCALE, causal=True)[0])
            start += n
        np.testing.assert_allclose(o.numpy().astype(np.float64), np.concatenate(expected), rtol=RTOL, atol=ATOL)
        m.cache.end_forward()
    m.check_no_leaks()


def test_mixed_prefill_and_decode_batch(target):
    m = Model(target, "inline", page_size=4, seed=2)
    for seq_id in range(4):
        m.add(seq_id)
    m.forward([0, 1], [9, 4])
    m.forward([0, 1, 2, 3], [1, 6, 13, 1])  # decodes, a chunk and fresh prompts in one batch
    m.forward([3, 2, 1, 0], [2, 1, 1, 5])
    m.check_kv()
    m.remove(1)
    m.forward([0, 2, 3], [1, 1, 1])
    m.check_no_leaks()


@pytest.mark.parametrize("page_size", [4, 16])
def test_fork_positions(target, page_size):
    """Forks at the start, inside a page, on page boundaries and at the end; each fork and its
    parent then diverge and must never see each other's new tokens."""
    m = Model(target, "normal", page_size, seed=3)
    m.add(0)
    m.forward([0], [3 * page_size + 3])
    length = m.length(0)
    positions = {1: 0, 2: page_size // 2 + 1, 3: page_size, 4: 2 * page_size, 5: length - 1, 6: -1}
    for child, pos in positions.items():
        m.fork(0, child, pos)
    m.check_kv()
    everyone = [0, *positions]
    m.forward(everyone, [1] * len(everyone))  # decode all (cascade over the shared pages)
    m.forward(everyone, [2, 5, 1, 3, 1, 2, 7])  # prefill all
    m.forward(everyone[::-1], [1] * len(everyone))
    m.check_kv()
    m.check_no_leaks()


def test_fork_chain_8_deep(target):
    """Each sequence forks the previous one (at the end, inside a page, on a boundary) and
    appends a little; all are then decoded together."""
    m = Model(target, "none", page_size=4, seed=4)
    m.add(0)
    m.forward([0], [6])
    for child in range(1, 9):
        parent = child - 1
        pos = [-1, m.length(parent) - 1, 4 * (m.length(parent) // 4)][child % 3]
        m.fork(parent, child, pos)
        m.forward([child], [child % 4 + 1])
    m.check_kv()
    chain = list(range(9))
    m.forward(chain, [1] * 9)
    m.forward(chain, [2] * 9)
    m.check_kv()
    m.check_no_leaks()


@pytest.mark.parametrize("page_size", [4, 16])
def test_popn(target, page_size):
    """popn within a sequence's own pages, across pages, to zero, and into a prefix shared with
    a fork: the next append must not change what the fork sees (copy-on-write)."""
    m = Model(target, "normal", page_size, seed=5)
    m.add(0)
    m.forward([0], [3 * page_size + 2])
    m.popn(0, 1)
    m.popn(0, page_size + 2)  # across a page boundary
    m.forward([0], [3])
    m.fork(0, 1)  # shares every full page of 0
    m.forward([1], [page_size])
    m.popn(1, page_size + 3)  # back into the pages it shares with 0
    m.check_kv()
    shared_pages = m.cache.get_num_available_pages()
    m.forward([1, 0], [1, 1])  # 1 writes into a shared, partly filled page: copied first
    assert m.cache.get_num_available_pages() <= shared_pages - 1
    m.forward([1], [2])
    m.check_kv()
    m.popn(0, m.length(0))  # to zero
    m.forward([0, 1], [4, 1])
    m.check_kv()
    m.check_no_leaks()


@pytest.mark.parametrize("rope_mode", ["none", "inline"])
def test_sliding_window_with_sinks(target, rope_mode):
    """Windows with and without a sink slide over decode and prefill steps; pages that fall
    out of the window are given back."""
    m = Model(target, rope_mode, page_size=4, sliding=True, seed=6)
    windows = {0: (12, 3), 1: (9, 0), 2: (20, 5)}
    for seq_id, window in windows.items():
        m.add(seq_id, window)
    m.add(3)  # no window, in a sliding-window cache
    m.forward([0, 1, 2, 3], [4, 6, 7, 5])
    m.forward([0, 1, 2, 3], [11, 10, 15, 2])  # longer than the window in one step
    m.check_kv()
    for _ in range(9):
        m.forward([0, 1, 2, 3], [1, 1, 1, 1])
    m.forward([2, 0], [6, 30])
    m.check_kv()
    for seq_id, (window, _) in windows.items():
        assert m.length(seq_id) == window
        pages = m.cache.sequence_state(seq_id)["pages"]
        assert len(pages) <= -(-window // 4) + 2, "slid pages must be released"
    m.check_no_leaks()


def test_sliding_window_with_forks(target):
    """A windowed sequence forked within its sink (the fork has no window), and a window
    enabled on a fork of a plain sequence, which slides away pages it shares."""
    m = Model(target, "none", page_size=4, sliding=True, seed=7)
    m.add(0, (10, 6))
    m.forward([0], [5])
    m.fork(0, 1, 3)  # within the sink: inside a page
    m.forward([0, 1], [12, 4])  # 0 slides
    m.fork(0, 2, 4)  # after sliding, still within the sink: a page boundary
    m.forward([0, 1, 2], [1, 1, 1])
    m.add(3)
    m.forward([3], [14])
    m.fork(3, 4)
    m.cache.enable_sliding_window_for_seq(4, 8, 2)
    m.window[4] = (8, 2)
    for _ in range(3):
        m.forward([4, 3], [2, 1])  # 4 slides out of pages it shares with 3
    m.check_kv()
    m.check_no_leaks()


def test_sliding_window_rope_normal_runs_inline(target):
    """With support_sliding_window, RoPE "normal" is applied inline: K is cached unrotated."""
    m = Model(target, "normal", page_size=4, sliding=True, seed=8)
    assert m.rope == "inline"
    m.add(0, (8, 2))
    m.forward([0], [6])
    m.forward([0], [5])
    m.forward([0], [1])
    m.check_kv()
    m.check_no_leaks()


def test_cascade_two_forks_of_a_long_prefix(target):
    """Two forks of a long prompt decoded together read the prompt's pages once (a shared
    level merged with each fork's own pages); the result is the same as without sharing."""
    m = Model(target, "inline", page_size=4, seed=9)
    m.add(0)
    m.forward([0], [61])
    m.fork(0, 1)
    m.fork(0, 2)
    m.add(3)
    m.forward([3], [5])
    for step in range(3):
        m.cache.begin_forward([1, 2, 3], [1, 1, 1])
        plan = m.cache.current_plan()
        # the shared level (paged prefill of all three's queries), then each fork's own pages
        assert plan.decode and [level.kernel for level in plan.host.fused] == ["prefill", "decode"]
        shared = plan.host.fused[0].page_indices
        assert len(shared) == 15, "the 15 full pages of the prompt are attended once"
        m.cache.cancel_forward()  # (the plan only: nothing is kept)
        m.forward([1, 2, 3], [1, 1, 1])
    m.forward([1, 2], [3, 4])  # prefill over the shared prefix: shared level + own history
    m.check_kv()
    m.check_no_leaks()


def test_cascade_prefill_plan(target):
    m = Model(target, "none", page_size=4, seed=10)
    m.add(0)
    m.forward([0], [40])
    for child in (1, 2, 3):
        m.fork(0, child)
    m.cache.begin_forward([1, 2, 3, 0], [3, 2, 4, 1])
    plan = m.cache.current_plan()
    assert not plan.decode and len(plan.host.fused) == 1  # the shared level only: no history of their own
    assert list(plan.host.fused[0].qo_indptr) == [0, 10]  # all four share the 10 pages
    m.cache.cancel_forward()  # (the plan only: nothing is kept)
    m.forward([1, 2, 3, 0], [3, 2, 4, 1])
    m.check_kv()
    m.check_no_leaks()


def self_plus_cross(m: Model, layer: int, total: int) -> tuple:
    """In the step begun: self_attention of random q, k, v merged with cross_attention, then
    cancel_forward (neither caches anything, so the step has nothing to keep). Returns q, k, v
    (numpy) and the merged o, lse (device tensors)."""
    dev = m.device
    q, k, v = (randn(m.rng, (total, h, D), DTYPE) for h in (HQ, HKV, HKV))
    o_self, o_cross = (empty((total, HQ, D), DTYPE, dev) for _ in range(2))
    lse_self, lse_cross = (empty((total, HQ), "float32", dev) for _ in range(2))
    m.cache.self_attention(layer, SM_SCALE, tensor(q, dev), tensor(k, dev), tensor(v, dev), o_self, lse_self)
    m.cache.cross_attention(layer, SM_SCALE, tensor(q, dev), o_cross, lse_cross)
    m.cache.merge_attn_output_inplace(o_self, lse_self, o_cross, lse_cross)
    m.cache.cancel_forward()
    return q, k, v, o_self, lse_self


@pytest.mark.parametrize("rope_mode", ["none", "inline"])
def test_self_and_cross_attention_merge_to_full_attention(target, rope_mode):
    """self_attention (new tokens, causal) merged with cross_attention (the cached tokens) is
    attention over both; neither caches anything."""
    m = Model(target, rope_mode, page_size=4, seed=11)
    m.add(0)
    m.add(1)
    m.forward([0, 1], [9, 14])
    for lengths in ([3, 5], [1, 1]):
        history = [m.length(0), m.length(1)]
        before = [read_kv(m.cache, s, m.length(s), m.device) for s in (0, 1)]
        m.cache.begin_forward([0, 1], lengths)
        q, k, v, o_self, lse_self = self_plus_cross(m, 1, sum(lengths))
        start = 0
        for seq_id, n, h in zip((0, 1), lengths, history):
            rows = slice(start, start + n)
            keys = np.concatenate([m.k[seq_id][1], k[rows]])
            values = np.concatenate([m.v[seq_id][1], v[rows]])
            qs = q[rows]
            if rope_mode == "inline":
                qs = ref.rope(qs, h + np.arange(n), ROPE_THETA, ROPE_SCALE)
                keys = ref.rope(keys, np.arange(len(keys)), ROPE_THETA, ROPE_SCALE)
            o, lse = ref.attention(qs, keys, values, SM_SCALE, causal=True)
            np.testing.assert_allclose(o_self.numpy()[rows], o, rtol=RTOL, atol=ATOL)
            np.testing.assert_allclose(lse_self.numpy()[rows], lse, *ref.LSE_TOLERANCE)
            start += n
        # Nothing was cached: the abandoned step left every sequence as it was.
        for seq_id, (k0, v0) in zip((0, 1), before):
            k1, v1 = read_kv(m.cache, seq_id, m.length(seq_id), m.device)
            np.testing.assert_array_equal(k1, k0)
            np.testing.assert_array_equal(v1, v0)
    m.check_no_leaks()


def test_cross_attention_without_history_is_empty(target):
    m = Model(target, "none", page_size=4)
    m.add(0)
    m.cache.begin_forward([0], [3])
    o, lse = empty((3, HQ, D), DTYPE, m.device), empty((3, HQ), "float32", m.device)
    m.cache.cross_attention(0, SM_SCALE, tensor(randn(m.rng, (3, HQ, D), DTYPE), m.device), o, lse)
    np.testing.assert_array_equal(o.numpy(), 0)
    np.testing.assert_array_equal(lse.numpy(), ref.EMPTY_LSE)


def test_clear(target):
    m = Model(target, "none", page_size=4, seed=16)
    m.add(0)
    m.forward([0], [9])
    m.fork(0, 1, 5)
    m.cache.begin_forward([0, 1], [1, 1])
    m.cache.clear()
    assert m.cache.empty() and m.cache.get_num_available_pages() == m.initial_pages
    assert m.cache.get_total_sequence_length() == 0 and m.cache.current_plan() is None
    m.k.clear(), m.v.clear()
    m.add(0)
    m.forward([0], [3])
    m.check_no_leaks()


def test_token_tree_chains(target):
    """A token tree that is a chain is ordinary appending; committing keeps the accepted path."""
    m = Model(target, "none", page_size=4, seed=12)
    m.add(0)
    m.add(1)
    m.forward([0, 1], [5, 6])
    cache = m.cache
    cache.begin_forward([0, 1], [3, 4], token_tree_parent_ptr=[-1, 0, 1, -1, 0, 1, 2])
    m.check_layers(7, lambda layer, qkv: m._expected([0, 1], [3, 4], [5, 6], layer, qkv), "chains")
    cache.end_forward()
    with pytest.raises(KVCacheError, match="commit_accepted_token_tree_nodes"):
        cache.begin_forward([0], [1])
    cache.commit_accepted_token_tree_nodes([0, 1], [1, -1])  # keep 2 of 3, none of 4
    for seq_id, keep in ((0, 7), (1, 6)):
        m.k[seq_id], m.v[seq_id] = [k[:keep] for k in m.k[seq_id]], [v[:keep] for v in m.v[seq_id]]
    assert cache.sequence_state(0)["length"] == 7 and cache.sequence_state(1)["length"] == 6
    m.popn(0, 2)
    m.forward([0, 1], [1, 1])
    m.check_kv()


def test_second_cache_builds_nothing(monkeypatch):
    Model("llvm", "none", page_size=4)
    built = []
    original = tir_kernels.build
    monkeypatch.setattr(tir_kernels, "build", lambda *args: built.append(args) or original(*args))
    m = Model("llvm", "inline", page_size=4)
    m.add(0)
    m.forward([0], [5])
    assert built == []


def _tvm_kernels(device, page_size: int) -> dict:
    """TVM's own attention kernels (tvm.relax.frontend.nn.llm) as backend specs."""
    from tvm.relax.frontend.nn.llm.kv_cache import (
        _attention_decode,
        _attention_decode_cpu,
        _attention_prefill,
        _attention_prefill_cpu,
        _attention_prefill_ragged,
        _attention_prefill_ragged_cpu,
    )

    gpu = device.dlpack_device_type() == 2
    target = tir_kernels.tvm_target(target_for(device))
    args = (HKV, HQ, D, DTYPE, False, {})
    funcs = {
        "prefill_paged": _attention_prefill(*args, target, page_size) if gpu
        else _attention_prefill_cpu(*args, page_size),
        "decode_paged": _attention_decode(*args, target, page_size) if gpu else _attention_decode_cpu(*args, page_size),
        "prefill_ragged": _attention_prefill_ragged(HKV, HQ, D, D, DTYPE, {}, target) if gpu
        else _attention_prefill_ragged_cpu(HKV, HQ, D, D, DTYPE, {}),
    }
    return {slot: ["tirx", tvm.compile(tvm.IRModule({"main": f}), target=target)["main"]] for slot, f in funcs.items()}


def test_tvm_own_kernels_in_the_slots(target):
    """Any slot may hold another kernel with the contract's arguments, e.g. TVM's own."""
    m = Model(target, "inline", page_size=16, seed=13, kernels=_tvm_kernels(device_of(target), 16))
    m.add(0)
    m.forward([0], [37])
    m.fork(0, 1, 20)
    m.forward([0, 1], [4, 2])
    m.forward([0, 1], [1, 1])
    m.check_no_leaks()


# ---------------------------------------------------------------------------------------------
# Backends and the allocator


def test_backend_specs():
    f = tvm.get_global_func("runtime.GetDeviceAttr")
    assert backend_from_spec([], PagedPrefill) is None
    assert backend_from_spec(None, PagedDecode) is None
    for spec in (["tir", f], ["tirx", f], f, tvm.runtime.convert(["tirx", f])):
        backend = backend_from_spec(spec, PagedPrefill)
        assert isinstance(backend, TIRPagedPrefill) and backend.kind == "tir"
    assert backend_from_spec(["flashinfer", f, f], PagedPrefill).kind == "flashinfer"  # tests/test_flashinfer.py
    with pytest.raises(KVCacheError, match="spec must be"):
        backend_from_spec(["cutlass", f], RaggedPrefill)
    assert issubclass(FlashInferPagedPrefill, PagedPrefill)
    assert RopeMode.parse("inline") == RopeMode.INLINE == RopeMode.parse(2)


def test_tir_backend_argument_order():
    calls = []
    backend = backend_from_spec(["tirx", lambda *args: calls.append(args)], PagedPrefill)
    backend.mha(0, "q", "qo", "pages", "indptr", "indices", "info", "q_pos", "k_off", True, RopeMode.INLINE,
                0.5, 1e4, 0.125, "o", "lse")
    assert calls == [("q", "qo", "pages", "indptr", "indices", "info", "k_off", "q_pos", "o", "lse", 1, 1, 0.5,
                      1e4, 0.125)]


def test_page_allocator_transaction_rolls_back():
    pages = PageAllocator(4)
    a = pages.alloc()
    pages.retain(a)
    with pytest.raises(KVCacheError, match="full"):
        with pages.transaction():
            pages.release(a)
            pages.release(a)  # a is free again
            pages.alloc_many(2)
            pages.alloc_many(5)
    assert pages.refcount(a) == 2 and pages.num_free == 3
    assert [pages.alloc() for _ in range(3)] == [1, 2, 3]
    pages.check_invariants()


# ---------------------------------------------------------------------------------------------
# Bad input: KVCacheError, and the cache exactly as it was


def populated(target="llvm") -> Model:
    """3 sequences (of at most 4), a fork sharing pages; 17 pages of which 8 are free."""
    m = Model(target, "none", page_size=4, seed=14, max_num_sequences=4, max_total_seq_len=64,
              prefill_chunk_size=48)
    for seq_id in (0, 2):
        m.add(seq_id)
    m.forward([0, 2], [21, 5])
    m.fork(0, 1, 13)
    return m


def state(m: Model) -> tuple:
    cache = m.cache
    kv = {s: [x.tobytes() for x in read_kv(cache, s, cache.sequence_state(s)["length"], m.device)]
          for s in cache.sequence_ids()}
    return (cache.sequence_ids(), {s: cache.sequence_state(s) for s in cache.sequence_ids()},
            cache.get_num_available_pages(), cache.get_total_sequence_length(), cache.empty(), kv)


def qkv_for(m: Model, n: int, heads: int = HQ + 2 * HKV, dtype: str = DTYPE, device=None):
    return tensor(randn(m.rng, (n, heads, D), dtype), device or m.device)


BAD_SEQUENCE_OPS = {
    "duplicate add": (lambda c: c.add_sequence(0), "already in the KV cache"),
    "remove unknown": (lambda c: c.remove_sequence(7), "seq_id=7: no such sequence"),
    "fork missing parent": (lambda c: c.fork_sequence(7, 8), "parent_id=7"),
    "fork existing child": (lambda c: c.fork_sequence(0, 2), "child_id=2: the sequence is already"),
    "fork past the end": (lambda c: c.fork_sequence(2, 9, 6), "fork_pos must be at most 5"),
    "fork before -1": (lambda c: c.fork_sequence(2, 9, -2), "fork_pos must be at least -1"),
    "popn too long": (lambda c: c.popn(2, 6), "n must be at most 5"),
    "popn negative": (lambda c: c.popn(2, -1), "n must be at least 0"),
    "popn unknown": (lambda c: c.popn(5, 1), "seq_id=5"),
    "window unsupported": (lambda c: c.enable_sliding_window_for_seq(0, 8, 2), "support_sliding_window=False"),
    "lists differ": (lambda c: c.begin_forward([0, 2], [1]), "seq_ids has 2 entries but append_lengths has 1"),
    "unknown in batch": (lambda c: c.begin_forward([0, 6], [1, 1]), r"seq_ids\[1\]=6"),
    "duplicate in batch": (lambda c: c.begin_forward([0, 0], [1, 1]), "twice"),
    "empty batch": (lambda c: c.begin_forward([], []), "empty"),
    "zero length": (lambda c: c.begin_forward([0, 2], [1, 0]), "at least one token"),
    "over the chunk": (lambda c: c.begin_forward([0, 2], [30, 19]), "prefill_chunk_size=48"),
    "no free pages": (lambda c: c.begin_forward([2, 0], [40, 1]), "the KV cache is full"),
    "bad parent": (lambda c: c.begin_forward([0], [2], [-1, 1]), r"expected -1 \(a root\) or an earlier node"),
    "commit without tree": (lambda c: c.commit_accepted_token_tree_nodes([0], [0]), "no token tree"),
    "attention outside a step": (lambda c: c.attention_with_fused_qkv(0, SM_SCALE, None, None), "begin_forward"),
    "positions outside a step": (lambda c: c.get_query_positions(), "begin_forward"),
    "debug_get_kv past the end": (lambda c: c.debug_get_kv(2, 0, 6, None, None), "end=6"),
    "debug_get_kv empty range": (lambda c: c.debug_get_kv(2, 3, 3, None, None), "start < end"),
    "debug_get_kv unknown": (lambda c: c.debug_get_kv(8, 0, 1, None, None), "seq_id=8"),
}


def check_refused(m: Model, op, message: str) -> None:
    """op(cache) raises KVCacheError matching `message` and leaves the cache's state as it was."""
    before = state(m)
    with pytest.raises(KVCacheError, match=message):
        op(m.cache)
    assert state(m) == before


@pytest.mark.parametrize("case", BAD_SEQUENCE_OPS, ids=list(BAD_SEQUENCE_OPS))
def test_bad_input_leaves_the_cache_unchanged(case):
    check_refused(populated(), *BAD_SEQUENCE_OPS[case])


def test_too_many_sequences():
    m = populated()
    m.add(3)
    before = state(m)
    for op in (lambda c: c.add_sequence(9), lambda c: c.fork_sequence(0, 9)):
        with pytest.raises(KVCacheError, match="max_num_sequences=4"):
            op(m.cache)
        assert state(m) == before


def _bad_attention_calls(m: Model) -> dict:
    """Bad per-layer calls during a step of 2 tokens (sequences 0 and 2 decode)."""
    n, dev = 2, m.device
    good_o = empty((n, HQ, D), DTYPE, dev)
    lse = empty((n, HQ), "float32", dev)
    q = qkv_for(m, n, HQ)
    return {
        "layer out of range": (lambda c: c.attention_with_fused_qkv(LAYERS, SM_SCALE, qkv_for(m, n), good_o),
                               "layer_id must be at most 1"),
        "negative layer": (lambda c: c.attention_with_fused_qkv(-1, SM_SCALE, qkv_for(m, n), good_o), "layer_id"),
        "qkv rows": (lambda c: c.attention_with_fused_qkv(0, SM_SCALE, qkv_for(m, n + 1), good_o),
                     r"qkv must have shape \(2, 8, 64\)"),
        "qkv heads": (lambda c: c.attention_with_fused_qkv(0, SM_SCALE, qkv_for(m, n, HQ), good_o), "qkv"),
        "qkv dtype": (lambda c: c.attention_with_fused_qkv(0, SM_SCALE, qkv_for(m, n, dtype="float32"), good_o),
                      "qkv must have dtype float16"),
        "qkv device": (lambda c: c.attention_with_fused_qkv(0, SM_SCALE, qkv_for(m, n, device=tvm.cpu(1)), good_o),
                       "qkv must be on"),
        "o shape": (lambda c: c.attention_with_fused_qkv(0, SM_SCALE, qkv_for(m, n),
                                                         empty((n, HQ, D // 2), DTYPE, dev)), "o must have shape"),
        "o rows": (lambda c: c.attention_with_fused_qkv(0, SM_SCALE, qkv_for(m, n), empty((n + 1, HQ, D), DTYPE, dev)),
                   r"o must have shape \(2, 4, 64\)"),
        "o dtype": (lambda c: c.attention_with_fused_qkv(0, SM_SCALE, qkv_for(m, n), empty((n, HQ, D), "float32", dev)),
                    "o must have dtype float16"),
        "o device": (lambda c: c.attention_with_fused_qkv(0, SM_SCALE, qkv_for(m, n),
                                                          empty((n, HQ, D), DTYPE, tvm.cpu(1))), "o must be on"),
        "o not a tensor": (lambda c: c.attention_with_fused_qkv(0, SM_SCALE, qkv_for(m, n), None), "o must be a"),
        "bool layer": (lambda c: c.attention_with_fused_qkv(True, SM_SCALE, qkv_for(m, n), good_o),
                       "layer_id must be an integer"),
        "sm_scale inf": (lambda c: c.attention_with_fused_qkv(0, float("inf"), qkv_for(m, n), good_o),
                         "sm_scale must be a finite number"),
        "self lse dtype": (lambda c: c.self_attention(0, SM_SCALE, q, qkv_for(m, n, HKV), qkv_for(m, n, HKV), good_o,
                                                      empty((n, HQ), DTYPE, dev)), "lse must have dtype float32"),
        "self k heads": (lambda c: c.self_attention(0, SM_SCALE, q, q, qkv_for(m, n, HKV), good_o, lse), "k must"),
        "cross q heads": (lambda c: c.cross_attention(0, SM_SCALE, qkv_for(m, n, HKV), good_o, lse), "q must"),
        "merge shapes": (lambda c: c.merge_attn_output_inplace(good_o, lse, empty((n + 1, HQ, D), DTYPE, dev), lse),
                         "o2 must have shape"),
        "not a tensor": (lambda c: c.attention_with_fused_qkv(0, SM_SCALE, [1, 2], good_o), "qkv must be a"),
        "sm_scale text": (lambda c: c.attention_with_fused_qkv(0, "0.125", qkv_for(m, n), good_o),
                          "sm_scale must be a finite number, got '0.125'"),
        "sm_scale nan": (lambda c: c.self_attention(0, float("nan"), q, qkv_for(m, n, HKV), qkv_for(m, n, HKV),
                                                    good_o, lse), "sm_scale must be a finite number"),
        "sm_scale none": (lambda c: c.cross_attention(0, None, q, good_o, lse), "sm_scale must be a finite number"),
        "strided DLPack": (lambda c: c.attention_with_fused_qkv(
            0, SM_SCALE, np.zeros((n, HQ + 2 * HKV, 2 * D), np.float16)[:, :, ::2], good_o),
            "qkv must be a contiguous"),
    }


def step_state(m: Model) -> tuple:
    """`state` inside a step (whose rows cannot be read yet): all but the K/V, and the step."""
    cache = m.cache
    return (cache.sequence_ids(), {s: cache.sequence_state(s) for s in cache.sequence_ids()},
            cache.get_num_available_pages(), cache.get_total_sequence_length(), id(cache.current_plan()))


def test_bad_attention_calls_leave_the_cache_unchanged(target):
    """Each bad call is refused and leaves the step going, unchanged (on CUDA too, where the
    fast path's check is the CUDA kernels' own)."""
    m = populated(target)
    before_step = state(m)
    m.cache.begin_forward([0, 2], [1, 1])
    cases = _bad_attention_calls(m)
    for case, (op, message) in cases.items():
        before = step_state(m)
        with pytest.raises(KVCacheError, match=message):
            op(m.cache)
        assert step_state(m) == before, case
    m.cache.cancel_forward()
    assert state(m) == before_step


def test_out_of_pages_rolls_back_everything():
    """A step that runs out of pages half way (after copy-on-write and window slides) and a
    fork that needs a page when none is free change nothing."""
    m = Model("llvm", "none", page_size=4, sliding=True, seed=15, max_num_sequences=3, max_total_seq_len=24,
              prefill_chunk_size=64)
    m.add(0, (8, 2))
    m.add(1)
    m.forward([0], [11])  # slid
    m.forward([1], [6])
    m.fork(1, 2)
    m.forward([2], [3])
    m.popn(2, 6)  # 2 now ends inside the page it shares with 1
    assert m.cache.get_num_available_pages() == 8
    before = state(m)
    with pytest.raises(KVCacheError, match="full"):
        m.cache.begin_forward([0, 2, 1], [9, 1, 40])  # slides 0, copies 2's page, 1 needs 10 pages
    assert state(m) == before
    m.remove(0)
    m.forward([1], [2 + 4 * m.cache.get_num_available_pages()])  # fills every page
    assert m.cache.get_num_available_pages() == 0
    before = state(m)
    with pytest.raises(KVCacheError, match="full"):
        m.cache.fork_sequence(1, 3, 2)  # inside a page: needs a copy
    assert state(m) == before
    m.check_no_leaks()


def test_invalid_options():
    base = dict(num_layers=1, num_qo_heads=4, num_kv_heads=2, qk_head_dim=64)
    for bad, message in [({"num_kv_heads": 3}, "divide"), ({"page_size": 6}, "power of two"),
                         ({"rope_mode": "yarn"}, "rope_mode"), ({"dtype": "int8"}, "dtype"),
                         ({"v_head_dim": 32}, "v_head_dim"), ({"num_layers": 0}, "num_layers"),
                         ({"qk_head_dim": 24}, "no kernels for this cache configuration"),
                         ({"kernels": {"nope": []}}, "unknown slots"),
                         ({"kernels": {"prefill_paged": []}}, "slot 'prefill_paged' is empty"),
                         ({"kernels": {"decode_paged": ["flashinfer", 1, print]}}, "must be functions"),
                         ({"backend": "triton"}, "backend must be one of")]:
        with pytest.raises(KVCacheError, match=message):
            PagedKVCache(**{**base, **bad})
