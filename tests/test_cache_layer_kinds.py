"""Per-layer attention kinds: MHA_SLIDING layers beside MHA ones in tvmattn.PagedKVCache.

`KindsModel` drives a cache whose layers are [MHA_SLIDING, MHA, MHA_SLIDING] and keeps each
sequence's K/V per layer unpaged (every layer keeps every token). The reference of a layer is
attention over that unpaged sequence: an MHA layer's query at position p sees keys 0..p, an
MHA_SLIDING layer's the keys max(0, p - W + 1)..p (W = layer_sliding_window_size), in every
kind of step (prefills longer than the window, prefills over a history, decode, mixed batches).

TVM's own C++ cache, with the same kernels from the same create call, attends the same way in
decode steps (checked against ours); in a prefill step over a history it does not (its history
part is causal over the window's last tokens and its new tokens unwindowed), nor after a fork
(the window applied per cascade depth), which test_where_tvm_cache_leaves_the_window shows.
Bad kinds and calls raise KVCacheError and leave the cache as it was. CPU always; CUDA through
the `target` fixture where a GPU is present.
"""

from __future__ import annotations

import numpy as np
import pytest
import reference as ref
import tvm
from harness import empty, randn, tensor, to_dtype
from tvm.runtime import ShapeTuple

from tir_kernels import AttentionConfig, default_sm_scale
from tvmattn import KVCacheError, PagedKVCache
from tvmattn.runtime.ffi import AttnKind, CreateArgs, paged_attention_kv_cache_create
from tvmattn.runtime.kernels import build_slot

KINDS = ["mha_sliding", "mha", "mha_sliding"]
HQ, HKV, D, DTYPE, WINDOW = 4, 2, 64, "float16", 5
ROPE_THETA, ROPE_SCALE = 1e4, 1.0
SM_SCALE = default_sm_scale(D)
RTOL, ATOL = ref.TOLERANCES[DTYPE]


def device_of(target: str):
    return tvm.cuda(0) if target.startswith("cuda") else tvm.cpu(0)


def visible(kind: str, history: int, n: int, window: int) -> np.ndarray:
    """[n, history + n] bool: which keys each of n new queries (positions history..) sees."""
    p = history + np.arange(n)[:, None]
    j = np.arange(history + n)[None, :]
    see = j <= p
    return see & (j > p - window) if kind == "mha_sliding" else see


class KindsModel:
    """A cache with per-layer kinds and the unpaged truth (see the module docstring)."""

    def __init__(self, target="llvm", page_size=4, rope_mode="none", seed=0, kinds=KINDS, window=WINDOW,
                 cache=None, **options):
        self.device = device_of(target)
        self.kinds, self.window, self.rope = list(kinds), window, rope_mode
        options = {"max_num_sequences": 8, "max_total_seq_len": 512, "prefill_chunk_size": 64, **options}
        self.cache = cache or PagedKVCache(
            num_layers=len(kinds), num_qo_heads=HQ, num_kv_heads=HKV, qk_head_dim=D, dtype=DTYPE,
            page_size=page_size, rope_mode=rope_mode, rope_theta=ROPE_THETA, rope_scale=ROPE_SCALE,
            attn_kinds=kinds, layer_sliding_window_size=window, device=self.device, **options)
        self.rng = np.random.default_rng(seed)
        self.k: dict[int, list] = {}
        self.v: dict[int, list] = {}
        self.outputs: list = []

    def add(self, seq_id):
        self.cache.add_sequence(seq_id)
        self.k[seq_id] = [np.zeros((0, HKV, D)) for _ in self.kinds]
        self.v[seq_id] = [np.zeros((0, HKV, D)) for _ in self.kinds]

    def fork(self, parent, child, pos=-1):
        self.cache.fork_sequence(parent, child, pos)
        end = len(self.k[parent][0]) if pos == -1 else pos
        self.k[child] = [k[:end].copy() for k in self.k[parent]]
        self.v[child] = [v[:end].copy() for v in self.v[parent]]

    def popn(self, seq_id, n):
        self.cache.popn(seq_id, n)
        self.k[seq_id] = [k[: len(k) - n] for k in self.k[seq_id]]
        self.v[seq_id] = [v[: len(v) - n] for v in self.v[seq_id]]

    def remove(self, seq_id):
        self.cache.remove_sequence(seq_id)
        del self.k[seq_id], self.v[seq_id]

    def forward(self, seq_ids, lengths, shared_from_window: bool = False, begin=None):
        """One step, every layer checked; shared_from_window: also attention_with_shared_kv over
        layer 0 (an MHA_SLIDING layer) with a new query."""
        history = [len(self.k[s][0]) for s in seq_ids]
        (begin or self.cache.begin_forward)(seq_ids, lengths)
        total = sum(lengths)
        for layer, kind in enumerate(self.kinds):
            qkv = randn(self.rng, (total, HQ + 2 * HKV, D), DTYPE)
            o = empty((total, HQ, D), DTYPE, self.device)
            self.cache.attention_with_fused_qkv(layer, SM_SCALE, tensor(qkv, self.device), o)
            expected = self._expected(seq_ids, lengths, history, layer, kind, qkv)
            what = f"layer {layer} ({kind}) of {seq_ids} {lengths}"
            np.testing.assert_allclose(o.numpy().astype(np.float64), expected, rtol=RTOL, atol=ATOL, err_msg=what)
            self.outputs.append(o.numpy())
            if shared_from_window and layer == 0:
                self._shared(seq_ids, lengths, history, qkv)
        self.cache.end_forward()

    def _split(self, rows, positions):
        q, k, v = rows[:, :HQ], rows[:, HQ : HQ + HKV], rows[:, HQ + HKV :]
        if self.rope == "normal":  # split_rotary rotates in fp32 and stores in the kernel dtype
            q = to_dtype(ref.rope(q, positions, ROPE_THETA, ROPE_SCALE), DTYPE)
            k = to_dtype(ref.rope(k, positions, ROPE_THETA, ROPE_SCALE), DTYPE)
        return q, k, v

    def _expected(self, seq_ids, lengths, history, layer, kind, qkv):
        out, start = [], 0
        for seq_id, n, h in zip(seq_ids, lengths, history):
            q, k, v = self._split(qkv[start : start + n], h + np.arange(n))
            start += n
            self.k[seq_id][layer] = np.concatenate([self.k[seq_id][layer], k.astype(np.float64)])
            self.v[seq_id][layer] = np.concatenate([self.v[seq_id][layer], v.astype(np.float64)])
            mask = visible(kind, h, n, self.window)
            out.append(ref.attention(q, self.k[seq_id][layer], self.v[seq_id][layer], SM_SCALE, False, mask)[0])
        return np.concatenate(out)

    def _shared(self, seq_ids, lengths, history, qkv):
        total = sum(lengths)
        q = randn(self.rng, (total, HQ, D), DTYPE)
        k, v = qkv[:, HQ : HQ + HKV].copy(), qkv[:, HQ + HKV :].copy()
        o = empty((total, HQ, D), DTYPE, self.device)
        self.cache.attention_with_shared_kv(0, SM_SCALE, *(tensor(x, self.device) for x in (q, k, v)), o)
        out, start = [], 0
        for seq_id, n, h in zip(seq_ids, lengths, history):
            mask = visible(self.kinds[0], h, n, self.window)
            out.append(ref.attention(q[start : start + n], self.k[seq_id][0], self.v[seq_id][0], SM_SCALE, False,
                                     mask)[0])
            start += n
        np.testing.assert_allclose(o.numpy().astype(np.float64), np.concatenate(out), rtol=RTOL, atol=ATOL,
                                   err_msg=f"attention_with_shared_kv over layer 0 of {seq_ids} {lengths}")

    def kept(self, seq_id) -> list:
        """Per layer, the truth of what debug_get_kv reads: an MHA layer every token, an
        MHA_SLIDING layer zeros before the tokens its pages still hold (a whole number of pages
        before the next query's window), the tokens after."""
        start = self.cache.sliding_kept_from(seq_id)
        length = len(self.k[seq_id][0])
        need = max(0, length - self.window + 1)
        assert start <= need and need - start < self.cache.options.page_size, (start, need)
        out = []
        for x, y, kind in zip(self.k[seq_id], self.v[seq_id], self.kinds):
            if kind == "mha_sliding" and start and getattr(self.cache, "_slides", None) is not None:
                x, y = x.copy(), y.copy()
                x[:start] = y[:start] = 0
            out.append((x, y))
        return out

    def check_kv(self):
        """debug_get_kv against the truth: every token of the MHA layers, the MHA_SLIDING
        layers' kept tokens and zeros for those they released (`kept`)."""
        tol = (2e-3, 1e-3) if self.rope == "normal" else (0, 0)
        for seq_id in self.k:
            n, layers = len(self.k[seq_id][0]), len(self.kinds)
            if n == 0:
                continue
            k, v = (empty((layers, n, HKV, D), DTYPE, self.device) for _ in range(2))
            self.cache.debug_get_kv(seq_id, 0, n, k, v)
            truth = self.kept(seq_id)
            np.testing.assert_allclose(k.numpy().astype(np.float64), np.stack([x for x, _ in truth]), rtol=tol[0],
                                       atol=tol[1], err_msg=f"K of {seq_id}")
            np.testing.assert_array_equal(v.numpy().astype(np.float64), np.stack([y for _, y in truth]))

    def check_no_leaks(self, initial):
        self.check_kv()
        for seq_id in list(self.k):
            self.remove(seq_id)
        assert self.cache.empty() and self.cache.get_num_available_pages() == initial


@pytest.mark.parametrize("page_size,rope_mode", [(4, "none"), (1, "normal"),
                                                pytest.param(16, "none", marks=pytest.mark.slow)])
def test_layer_windows(target, page_size, rope_mode):
    """Prefills longer than the window from empty histories, prefills over a history, decode
    steps across page boundaries, a mixed batch, attention_with_shared_kv over a windowed layer,
    forks (inside a page where the window allows, at its end) and popn as far back as the
    window allows (one token more is refused, the cache unchanged), no page leaked."""
    m = KindsModel(target, page_size, rope_mode, seed=page_size)
    initial = m.cache.get_num_available_pages()
    for s in (0, 1, 2):
        m.add(s)
    # pages much larger than the window: longer prompts, so that the sliding layers release pages
    extra = 2 * page_size if page_size > WINDOW else 0
    if extra:
        m.forward([0, 1], [extra, extra])
    m.forward([0, 1, 2], [12, 1, 3])
    m.forward([1, 0], [7, 3], shared_from_window=True)
    for _ in range(3):
        m.forward([0, 1, 2], [1, 1, 1], shared_from_window=True)
    m.forward([2, 0], [1, 8])  # a 1-token append in a prefill step
    # the earliest fork point: its window starts at the first token the sliding pages hold
    length = len(m.k[0][0])
    m.fork(0, 3, max(m.cache.sliding_kept_from(0) + WINDOW - 1, length - 1))
    m.fork(1, 4)
    m.forward([3, 4, 0], [2, 1, 1])
    assert m.cache.sliding_kept_from(4) > 0, "the case must release pages to refuse the popn below"
    back = len(m.k[4][0]) - (m.cache.sliding_kept_from(4) + WINDOW - 1)
    before = m.cache.sequence_state(4), m.cache.get_num_available_pages()
    with pytest.raises(KVCacheError, match="released the tokens before"):
        m.cache.popn(4, back + 1)
    assert (m.cache.sequence_state(4), m.cache.get_num_available_pages()) == before
    m.popn(4, back)
    m.forward([4, 1], [1, 9])
    m.check_kv()
    m.remove(0)
    m.forward([1, 2, 3, 4], [1, 1, 1, 1])
    m.check_no_leaks(initial)


def test_window_wider_than_every_sequence_is_full_attention():
    """With the default window (1024) an MHA_SLIDING layer attends as an MHA layer."""
    m = KindsModel(page_size=16, seed=5, window=1024)
    assert m.cache.options.attn_kinds[0] == AttnKind.MHA_SLIDING
    m.kinds = ["mha"] * len(KINDS)  # the reference: every layer full attention
    m.add(0)
    m.forward([0], [20])
    m.forward([0], [1])


def test_window_plan_one_request_per_token():
    """The windowed level: in a prefill step whose windows hide nothing, one causal paged-prefill
    request per sequence over its whole sliding page table; otherwise one decode request per new
    token over the MHA_SLIDING layers' own pages, its window's pages only."""
    m = KindsModel(page_size=4, seed=6)
    m.add(0)

    def within(seq_ids, lengths):
        m.cache.begin_forward(seq_ids, lengths)
        (level,) = m.cache.current_plan().host.window
        # positions 0..4, window 5: every query sees keys 0..p, the causal bound; pages 0 and 1
        assert level.qo_indptr.tolist() == [0, 5] and level.page_indptr.tolist() == [0, 2]
        assert level.length_info.tolist() == [1] and level.k_offset.tolist() == [0]
        pages = m.cache.sequence_state(0)["slide_pages"]
        assert level.page_indices.tolist() == pages
        (positions,) = m.cache.current_plan().host.slide_positions
        assert positions.tolist() == [pages[0] * 4 + i for i in range(4)] + [pages[1] * 4]
        assert m.cache._step.window_kernel == "prefill"

    m.forward([0], [WINDOW], begin=within)
    m.forward([0], [4])
    state = m.cache.sequence_state(0)
    # 9 tokens: the next query (position 9) reads 5..9, so page 0 (tokens 0..3) was released
    assert state["slide_dropped"] == 1 and len(state["slide_pages"]) == 2

    def check(seq_ids, lengths):
        m.cache.begin_forward(seq_ids, lengths)
        (level,) = m.cache.current_plan().host.window
        # positions 9, 10 with window 5: keys 5..9 (pages 1, 2) and 6..10 (pages 1, 2)
        assert level.qo_indptr is None and level.page_indptr.tolist() == [0, 2, 4]
        assert level.length_info.tolist() == [[2, 3], [1, 2], [0, 0]]
        assert level.k_offset.tolist() == [5, 6]
        pages = m.cache.sequence_state(0)["slide_pages"]
        assert level.page_indices.tolist() == pages * 2
        (positions,) = m.cache.current_plan().host.slide_positions
        assert positions.tolist() == [pages[1] * 4 + 1, pages[1] * 4 + 2]

    m.forward([0], [2], begin=check)


# ---------------------------------------------------------------------------------------------
# TVM's C++ cache with the same kinds and kernels


def create_args(target: str, page_size: int) -> CreateArgs:
    """TVM's positional create call with MHA_SLIDING layers and tvmattn's kernels (built by the
    runtime for the same configuration as the caches above: built once)."""
    config = AttentionConfig(HQ, HKV, D, dtype=DTYPE, page_size=page_size, target=target)

    def k(slot):
        return build_slot(slot, config, len(KINDS))

    kinds = [int(AttnKind[kind.upper()]) for kind in KINDS]
    return CreateArgs(
        ShapeTuple([8, 512, 64, page_size, 0, WINDOW]), ShapeTuple([0, len(KINDS)]), HQ, HKV, D, D,
        ShapeTuple(kinds), False, 0, ROPE_SCALE, ROPE_THETA, None,
        tvm.runtime.empty((), DTYPE, device=device_of(target)),
        k("transpose_append"), None, k("prefill_ragged"), k("prefill_paged"), k("decode_paged"),
        k("prefill_paged_sliding_window"), k("decode_paged_sliding_window"), [], [], [],
        [k("merge_state")], k("split_rotary"), k("copy_single_page"), k("debug_get_kv"), k("compact_copy"))


class TVMCache:
    """TVM's C++ cache behind the PagedKVCache methods KindsModel calls."""

    def __init__(self, cache):
        self.handle = cache

    def __getattr__(self, name):
        builtin = {"add_sequence": "kv_state_add_sequence", "begin_forward": "kv_state_begin_forward",
                   "end_forward": "kv_state_end_forward", "fork_sequence": "kv_state_fork_sequence",
                   "popn": "kv_state_popn", "remove_sequence": "kv_state_remove_sequence"}.get(
                       name, f"attention_kv_cache_{name}")
        func = tvm.get_global_func(f"vm.builtin.{builtin}")

        def call(*args):
            if name == "begin_forward":
                args = tuple(ShapeTuple(a) for a in args)
            return func(self.handle, *args)

        return call


def test_tvm_cache_agrees_in_decode_steps(target):
    """TVM's create call (cache_config[5] = the window) on TVM's C++ cache and on ours: a first
    prefill no longer than the window, then decode steps past it: the same outputs, both equal
    to the window reference. (After a fork TVM applies the window to each cascade depth's block
    on its own, so a decode step may see more than W keys there; ours does not, see
    test_layer_windows.)"""
    args = create_args(target, 4)
    ours = paged_attention_kv_cache_create(*args.positional())
    assert ours.options.attn_kinds == (AttnKind.MHA_SLIDING, AttnKind.MHA, AttnKind.MHA_SLIDING)
    assert ours.options.layer_sliding_window_size == WINDOW
    theirs = TVMCache(tvm.get_global_func("vm.builtin.paged_attention_kv_cache_create")(*args.positional()))
    runs = [KindsModel(target, 4, seed=7, cache=cache) for cache in (ours, theirs)]
    for m in runs:
        m.add(0)
        m.add(1)
        m.forward([0, 1], [WINDOW, 3])
        for _ in range(6):
            m.forward([0, 1], [1, 1])
    runs[0].check_kv()  # (TVM's debug_get_kv serves MHA layers only)
    for i, (a, b) in enumerate(zip(*(m.outputs for m in runs))):
        np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64), rtol=RTOL, atol=ATOL,
                                   err_msg=f"output {i}: ours against TVM's cache")


def test_where_tvm_cache_leaves_the_window():
    """Where TVM's cache leaves the window, ours follows the window reference: a prefill over a
    history (TVM: the history's last W tokens masked causally, the new tokens unwindowed), and a
    decode step after a fork (TVM: the window applied to each cascade depth's block on its own)."""
    args = create_args("llvm", 4).positional()

    def tvm_cache():
        return TVMCache(tvm.get_global_func("vm.builtin.paged_attention_kv_cache_create")(*args))

    for cache, leaves in ((tvm_cache(), True), (paged_attention_kv_cache_create(*args), False)):
        m = KindsModel(seed=8, cache=cache)
        m.add(0)
        m.forward([0], [WINDOW])
        if leaves:
            with pytest.raises(AssertionError, match=r"layer 0 \(mha_sliding\) of \[0\] \[4\]"):
                m.forward([0], [4])
        else:
            m.forward([0], [4])
    for cache, leaves in ((tvm_cache(), True), (paged_attention_kv_cache_create(*args), False)):
        m = KindsModel(seed=7, cache=cache)
        m.add(0)
        m.add(1)
        m.forward([0, 1], [WINDOW, 3])
        for _ in range(6):
            m.forward([0, 1], [1, 1])
        # (ours keeps only the window of position 11's next query in the MHA_SLIDING layers'
        # pages: the earliest fork point it allows is 8, where the released page 0 ends + W - 1)
        m.fork(0, 2, 6 if leaves else m.cache.sliding_kept_from(0) + WINDOW - 1)
        if leaves:
            with pytest.raises(AssertionError, match=r"layer 0 \(mha_sliding\) of \[2, 0\]"):
                m.forward([2, 0], [1, 1])
        else:
            m.forward([2, 0], [1, 1])


# ---------------------------------------------------------------------------------------------
# Bad kinds and calls


def test_invalid_kind_options():
    base = dict(num_layers=2, num_qo_heads=4, num_kv_heads=2, qk_head_dim=64)
    for bad, message in [({"attn_kinds": ["mha", "sliding"]}, r"attn_kinds\[1\] must be one of"),
                         ({"attn_kinds": ["mha"] * 3}, "attn_kinds has 3 entries for num_layers=2"),
                         ({"attn_kinds": ["mha", 2]}, "LINEAR"),
                         ({"attn_kinds": 5}, "attn_kinds must be a kind or a sequence"),
                         ({"attn_kinds": "mha_sliding", "layer_sliding_window_size": 0},
                          "layer_sliding_window_size must be at least 1"),
                         ({"attn_kinds": "mha_sliding", "rope_mode": "inline"}, "MHA_SLIDING layers need RoPE"),
                         ({"attn_kinds": "mha_sliding", "rope_mode": "normal", "support_sliding_window": True},
                          "MHA_SLIDING layers need RoPE"),
                         ({"attn_kinds": "mha_sliding", "kernels": {"decode_paged_sliding_window": []}},
                          "slot 'decode_paged_sliding_window' is empty")]:
        with pytest.raises(KVCacheError, match=message):
            PagedKVCache(**{**base, **bad})


def test_create_call_with_kinds():
    """Kinds in TVM's create call: named refusals; support_sliding_window with MHA_SLIDING layers
    turns per-sequence windows off, as TVM does."""
    args = create_args("llvm", 4)
    for kinds, message in [([0, 1, 0], "attn_kinds mixes MLA"), ([0, 0], "attn_kinds has 2 entries"),
                           ([0, 2, 0], "LINEAR"), ([0, 0, 4], r"attn_kinds\[2\]")]:
        bad = args.positional()
        bad[6] = ShapeTuple(kinds)
        with pytest.raises(KVCacheError, match=message):
            paged_attention_kv_cache_create(*bad)
    bad = args.positional()
    bad[0] = ShapeTuple([8, 512, 64, 4, 1, WINDOW])
    cache = paged_attention_kv_cache_create(*bad)
    assert cache.options.support_sliding_window and not cache.options.sequence_windows
    cache.add_sequence(0)
    with pytest.raises(KVCacheError, match="per-sequence windows are off"):
        cache.enable_sliding_window_for_seq(0, 8, 2)


def test_bad_calls_on_windowed_layers_leave_the_cache_unchanged():
    m = KindsModel(page_size=4, seed=9)
    m.add(0)
    m.add(1)
    m.forward([0, 1], [7, 2])
    m.cache.begin_forward([0, 1], [1, 1])
    dev, n = m.device, 2
    q, o = tensor(randn(m.rng, (n, HQ, D), DTYPE), dev), empty((n, HQ, D), DTYPE, dev)
    k = tensor(randn(m.rng, (n, HKV, D), DTYPE), dev)
    lse = empty((n, HQ), "float32", dev)
    cases = {
        "self on a window layer": (lambda c: c.self_attention(0, SM_SCALE, q, k, k, o, lse), "MHA_SLIDING layer"),
        "cross on a window layer": (lambda c: c.cross_attention(2, SM_SCALE, q, o, lse), "MHA_SLIDING layer"),
        "append_mla_kv": (lambda c: c.append_mla_kv(1, tensor(np.zeros((n, D), np.float16), dev)), "MHA layer"),
        "debug_get_kv_mla": (lambda c: c.debug_get_kv_mla(0, 0, 1, o), "no MLA layers"),
        "shared before its layer": (lambda c: c.attention_with_shared_kv(0, SM_SCALE, q, k, k, o), "source layer 0"),
    }

    def state():
        c = m.cache
        return (c.sequence_ids(), {s: c.sequence_state(s) for s in c.sequence_ids()}, c.get_num_available_pages())

    for case, (op, message) in cases.items():
        before = state()
        with pytest.raises(KVCacheError, match=message):
            op(m.cache)
        assert state() == before, case
    m.cache.cancel_forward()
    before = state()  # (a begin_forward inside a step would first abandon the step)
    with pytest.raises(KVCacheError, match="bucket=1"):  # (graph decode steps serve MHA_SLIDING layers)
        m.cache.begin_graph_decode([0, 1], 1)
    assert state() == before
    with pytest.raises(KVCacheError, match="MHA_SLIDING layers"):
        m.cache.begin_forward([0], [3], [-1, 0, 0])
    assert state() == before
