"""The MHA_SLIDING layers' pages are recycled as the window slides (tvmattn/runtime/slides.py).

A sequence of length L keeps, in those layers' own pages, the tokens from the page of position
max(0, L - W + 1) on (what its next query's window reads): at most ceil((W - 1) / page_size) + 1
pages however long it is. Every scenario runs long prompts well past small windows (page sizes
1, 4 and 16) through `KindsModel` of test_cache_layer_kinds.py, whose reference is plain
attention over the unpaged sequence with the window (tests/reference.py), and checks after each
step that the pages held are exactly those, that debug_get_kv reads zeros for the released
tokens of the windowed layers and every token of the others, and that nothing leaks. The
memory report against its arithmetic; popn and fork past the released tokens are refused with
the cache unchanged; a step that finds the sliding pages full, or is rolled back, leaves both
allocators exactly as before. CPU always; CUDA through the `target` fixture where a GPU is present.
"""

from __future__ import annotations

import numpy as np
import pytest
from fp8_reference import dequantize, quantize
from harness import empty, randn, tensor
from test_cache_layer_kinds import HKV, HQ, SM_SCALE, D, DTYPE, KindsModel
from test_tree_prefill import chain

from tvmattn import KVCacheError, PagedKVCache
from tvmattn.runtime.windows import sliding_pages_held

KINDS = ["mha_sliding", "mha", "mha_sliding"]


def ceildiv(a: int, b: int) -> int:
    return -(-a // b)


def model(target="llvm", page_size=4, window=7, seed=0, **options) -> KindsModel:
    options = {"max_num_sequences": 4, "max_total_seq_len": 1024, "prefill_chunk_size": 64, **options}
    return KindsModel(target, page_size, "normal", seed=seed, kinds=KINDS, window=window, **options)


def check_pages(m: KindsModel) -> None:
    """Each sequence keeps exactly the sliding pages from its next query's window on, within
    the bound; the windowed layers' K/V of the kept tokens (zeros before), every layer's other."""
    ps, window = m.cache.options.page_size, m.window
    for seq_id in m.k:
        length = len(m.k[seq_id][0])
        state = m.cache.sequence_state(seq_id)
        assert state["slide_dropped"] == max(0, length - window + 1) // ps, (seq_id, length, state)
        assert len(state["slide_pages"]) == sliding_pages_held(length, window, ps)
        assert len(state["slide_pages"]) <= ceildiv(window - 1, ps) + 1
    m.check_kv()
    m.cache._slides.allocator.check_invariants()
    m.cache._allocator.check_invariants()


def exact(m: KindsModel) -> tuple:
    """Every sequence's bookkeeping and both allocators' free lists (in order) and counts."""
    c = m.cache
    allocators = []
    for allocator in (c._allocator, c._slides.allocator):
        allocators.append((list(allocator._free), list(allocator._refs), allocator.num_shared))
    return {s: c.sequence_state(s) for s in c.sequence_ids()}, allocators


@pytest.mark.parametrize("page_size,window", [(1, 5), (16, 3), (16, 37), (4, 7)])
def test_long_prompts_past_the_window(target, page_size, window):
    """Chunked prefill well past the window, a ragged batch, decode steps across page
    boundaries, a fork at full length (shared pages) and its decode, removal: every output
    against the window reference, the pages held exactly the window's after every step."""
    m = model(target, page_size, window, seed=page_size + window, prefill_chunk_size=128)
    initial = (m.cache.get_num_available_pages(), m.cache._slides.allocator.num_free)
    assert m.cache.options.sliding_num_pages < m.cache.options.num_pages
    for s in (0, 1, 2):
        m.add(s)
    m.forward([0, 1, 2], [61, 3, 17])  # a ragged batch, 0 past the window in one chunk
    check_pages(m)
    m.forward([0, 2], [64, 40])  # chunks over a history past the window
    m.forward([0, 1], [60, 45])
    check_pages(m)
    for _ in range(page_size + 3):  # decode across page boundaries
        m.forward([0, 1, 2], [1, 1, 1])
        check_pages(m)
    m.fork(0, 3)
    m.forward([3, 0], [1, 2])
    m.forward([3, 0, 2], [1, 1, 1])
    check_pages(m)
    m.remove(0)
    m.forward([1, 2, 3], [1, 5, 1])
    check_pages(m)
    for s in list(m.k):
        m.remove(s)
    assert m.cache.empty()
    assert (m.cache.get_num_available_pages(), m.cache._slides.allocator.num_free) == initial


def test_prefill_within_the_window_on_the_cpu_runs_the_vectorized_prefill():
    """On the CPU a prefill step within the window runs the paged prefill where that kernel is
    the vectorized one (head dim 64 here), its outputs against the window reference."""
    m = model("llvm", 4, 20)
    m.add(0)
    assert window_kernels(m, [([0], [12]), ([0], [8])]) == ["prefill", "prefill"]


@pytest.mark.parametrize("head_dim,kv_dtype,expected", [(64, "", True), (256, "", True),
                                                       (64, "float8_e4m3fn", False)])
def test_cpu_window_prefill_needs_the_vectorized_prefill(head_dim, kv_dtype, expected):
    """On the CPU the MHA_SLIDING layers take the paged prefill within the window only where it is
    the vectorized kernel (not over FP8 pages, which the scalar tile reads); otherwise they keep
    the per-token decode, the faster of the two there."""
    cache = PagedKVCache(num_layers=2, num_qo_heads=4, num_kv_heads=1, qk_head_dim=head_dim, dtype="float32",
                         page_size=16, attn_kinds=["mha_sliding", "mha"], layer_sliding_window_size=32,
                         max_num_sequences=1, max_total_seq_len=64, prefill_chunk_size=64,
                         **({"kv_dtype": kv_dtype} if kv_dtype else {}))
    assert cache._window_prefill == expected


def window_kernels(m: KindsModel, steps: list) -> list:
    """Run `steps` ((seq_ids, lengths) or (seq_ids, lengths, shared_from_window)) through
    m.forward; the kernel that planned the MHA_SLIDING layers' level of each ("prefill" or
    "decode")."""
    kernels = []

    def begin(seq_ids, lengths):
        m.cache.begin_forward(seq_ids, lengths)
        kernels.append(m.cache._step.window_kernel)

    for seq_ids, lengths, *shared in steps:
        m.forward(seq_ids, lengths, *shared, begin=begin)
        check_pages(m)
    return kernels


@pytest.mark.parametrize("page_size,window", [(1, 20), (16, 20), (16, 16)])
def test_prefill_within_the_window_runs_the_tiled_prefill(target, page_size, window):
    """A prefill step in which every sequence's length after the append is at most the window
    (no window hides a key) runs the MHA_SLIDING layers with the paged prefill kernel over
    their own pages, causal over whole sequences: chunked up to exactly the window, ragged
    batches with a one-token append, a fork sharing pages (and its copied partial page),
    attention_with_shared_kv over a windowed layer; one token past the window, and decode
    steps, run the per-token windowed decode. Every output against the window reference. The
    cache takes that path by default on a GPU, and on the CPU at this head dim (64)."""
    m = model(target, page_size, window, seed=page_size + window, max_num_sequences=5)
    assert m.cache._window_prefill
    for s in (0, 1, 2):
        m.add(s)
    w = window
    kernels = window_kernels(m, [([0, 1, 2], [7, 1, w - 8], True)])  # ragged, a one-token append among prefills
    m.fork(0, 3)  # shares the full pages, copies a partial one
    m.fork(0, 4, 5)
    kernels += window_kernels(m, [
        ([0, 2, 3], [w - 7, 8, 5]),  # 0 and 2 reach exactly the window, chunked over a history
        ([1, 4, 3], [w - 1, 3, 1], True),  # 1 reaches the window
        ([4, 2], [5, 1]),  # 2 one past the window: the windowed decode for every sequence
        ([3], [w - 13], True),  # the fork reaches the window
        ([3, 4, 1], [1, 1, 1]),  # decode
        ([4], [w]),  # a prefill past the window
    ])
    assert kernels == ["prefill"] * 3 + ["decode", "prefill", "decode", "decode"]


def test_a_sequence_far_longer_than_the_sliding_pool():
    """The sliding layers' pool is sized for the windows: one sequence runs through 16 times
    its pages, its pages recycled (the pool's pages reused over and over)."""
    m = model(page_size=4, window=8, max_num_sequences=1, max_total_seq_len=1100)
    pool = m.cache.options.sliding_num_pages
    assert pool == 1 * (ceildiv(7, 4) + 2) + 64 // 4 and m.cache._pools[0].shape[0] == pool + 1
    m.add(0)
    for _ in range(16):
        m.forward([0], [64])
    m.forward([0], [1])
    check_pages(m)
    assert len(m.k[0][0]) == 1025 > 16 * pool


def test_popn_within_the_kept_window_and_copy_on_write():
    """A fork shares the window's pages; popn of the fork back into a page it shares (as far
    as its window allows) and an append copy that page first: the parent keeps its K/V. One
    token further is refused, the cache unchanged."""
    m = model(page_size=4, window=10, seed=3)
    m.add(0)
    m.forward([0], [30])  # 30 tokens: the next query reads 21..30, pages of 20.. are kept
    m.fork(0, 1)
    shared = m.cache.sequence_state(1)["slide_pages"]
    assert shared[:-1] == m.cache.sequence_state(0)["slide_pages"][:-1]  # (the partial last page: copied)
    back = 30 - (m.cache.sliding_kept_from(1) + 10 - 1)
    assert back == 1
    before = exact(m)
    with pytest.raises(KVCacheError, match=r"popn\(n=2\).*released the tokens before 20"):
        m.cache.popn(1, back + 1)
    assert exact(m) == before
    m.fork(0, 2, 29)  # (the earliest fork point: its window starts at 20)
    with pytest.raises(KVCacheError, match="fork_pos=28"):
        m.cache.fork_sequence(0, 3, 28)
    m.popn(1, back)  # into the page it shares with 0
    m.forward([1, 0, 2], [3, 2, 1])
    for _ in range(5):
        m.forward([0, 1, 2], [1, 1, 1])
    check_pages(m)


def test_rolled_back_and_refused_steps_leave_both_allocators_as_before():
    """cancel_forward, an end_forward before every layer wrote, and a token tree grown over
    several steps until the sliding pages are full (refused at begin_forward): each leaves
    every sequence and both allocators exactly as before; a committed chain drops the pages."""
    m = model(page_size=1, window=2, max_num_sequences=1, prefill_chunk_size=4)
    assert m.cache.options.sliding_num_pages == 1 * 3 + 4
    m.add(0)
    m.forward([0], [4])
    m.forward([0], [4])
    before = exact(m)
    m.cache.begin_forward([0], [4])
    m.cache.cancel_forward()
    assert exact(m) == before
    m.cache.begin_forward([0], [3])
    qkv = tensor(randn(m.rng, (3, HQ + 2 * HKV, D), DTYPE), m.device)
    m.cache.attention_with_fused_qkv(0, SM_SCALE, qkv, empty((3, HQ, D), DTYPE, m.device))
    with pytest.raises(KVCacheError, match="did not write"):
        m.cache.end_forward()
    assert exact(m) == before
    # a chain tree keeps every node in the sliding pages until its commit
    m.forward([0], [4], begin=lambda seq_ids, lengths: m.cache.begin_forward(seq_ids, lengths, chain(4)))
    m.forward([0], [2], begin=lambda seq_ids, lengths: m.cache.begin_forward(seq_ids, lengths, [3, 4]))
    # 8 committed tokens (the next query reads 7..) and 6 nodes: 7 pages, all of the pool
    assert m.cache._slides.allocator.num_free == 0
    grown = exact(m)
    with pytest.raises(KVCacheError, match="MHA_SLIDING layers' pages are full"):
        m.cache.begin_forward([0], [1], [5])
    assert exact(m) == grown
    m.cache.commit_accepted_token_tree_nodes([0], [4])
    for x in (m.k, m.v):
        x[0] = [a[: len(a) - 1] for a in x[0]]
    check_pages(m)
    m.forward([0], [1])
    check_pages(m)
    m.cache.begin_forward([0], [2])
    m.cache.clear()  # (abandons the step) every page of both allocators free
    assert m.cache.empty() and m.cache.memory_report()["sliding_pages"] == 0
    m.cache._slides.allocator.check_invariants()


def test_memory_report():
    """memory_report: the pages held by each kind of layer against full attention, counted
    from the page tables (shared pages once) and matching the arithmetic of the window."""
    ps, window = 16, 32
    m = model(page_size=ps, window=window, seed=4, max_total_seq_len=2048, prefill_chunk_size=256)
    opts = m.cache.options
    page = opts.layer_page_bytes()
    assert page == HKV * ps * 2 * D * 2  # fp16 K and V
    report = m.cache.memory_report()
    assert report["held_bytes"] == report["full_bytes"] == 0 and report["layers"] == 3
    assert report["sliding_layers"] == 2
    assert report["pool_bytes"] == (opts.pool_pages + 2 * opts.sliding_pool_pages) * page
    assert report["full_pool_bytes"] == 3 * opts.pool_pages * page > report["pool_bytes"]
    m.add(0)
    m.add(1)
    for _ in range(4):
        m.forward([0, 1], [200, 25])
    lengths = [800, 100]
    pages = sum(ceildiv(n, ps) for n in lengths)
    sliding = sum(sliding_pages_held(n, window, ps) for n in lengths)
    assert sliding == (ceildiv(800, ps) - (800 - 31) // ps) + (ceildiv(100, ps) - (100 - 31) // ps) == 2 + 3
    report = m.cache.memory_report()
    assert report == {"tokens": 900, "page_bytes": page, "layers": 3, "sliding_layers": 2, "pages": pages,
                      "sliding_pages": sliding, "held_bytes": (pages + 2 * sliding) * page,
                      "full_bytes": 3 * pages * page, "saved_bytes": 2 * (pages - sliding) * page,
                      "pool_bytes": report["pool_bytes"], "full_pool_bytes": report["full_pool_bytes"]}
    m.fork(0, 2)  # at a page boundary: every page shared, none held twice
    assert m.cache.memory_report()["sliding_pages"] == sliding and m.cache.memory_report()["pages"] == pages


def test_a_cache_without_windowed_layers_reports_no_saving():
    cache = PagedKVCache(num_layers=2, num_qo_heads=HQ, num_kv_heads=HKV, qk_head_dim=D, page_size=4,
                         max_total_seq_len=64)
    report = cache.memory_report()
    assert cache.options.sliding_num_pages == 0 and report["sliding_layers"] == 0
    assert report["pool_bytes"] == report["full_pool_bytes"]
    assert cache.sliding_kept_from is not None
    cache.add_sequence(0)
    assert cache.sliding_kept_from(0) == 0


def test_released_positions_read_zeros():
    """debug_get_kv: a windowed layer's rows of the tokens it released are zeros; the MHA
    layer's rows of the same tokens are the K/V written."""
    m = model(page_size=4, window=5, seed=7)
    m.add(0)
    m.forward([0], [23])
    start = m.cache.sliding_kept_from(0)
    assert start == 16  # the next query (23) reads 19..23
    k, v = (empty((3, 23, HKV, D), DTYPE, m.device) for _ in range(2))
    m.cache.debug_get_kv(0, 0, 23, k, v)
    k, v = k.numpy(), v.numpy()
    assert not k[[0, 2], :start].any() and not v[[0, 2], :start].any()
    assert np.abs(v[1, :start]).min() >= 0 and np.array_equal(v[1].astype(np.float64), m.v[0][1])
    assert np.array_equal(v[0, start:].astype(np.float64), m.v[0][0][start:])



class FP8KindsModel(KindsModel):
    """KindsModel over FP8 pages (scale 0.5) with only MHA_SLIDING layers: these append before
    they attend, so every key and value they read is the stored one, code * scale."""

    def _split(self, rows, positions):
        q, k, v = super()._split(rows, positions)
        return q, *(dequantize(quantize(x, 0.5, "float8_e4m3fn"), 0.5).astype(np.float16) for x in (k, v))


def test_fp8_pages_in_windowed_layers():
    """FP8 pages in the sliding pools (a scale page after the zero page): a long prompt, decode,
    a fork, against the window reference over the stored values; released tokens read zeros."""
    m = FP8KindsModel(page_size=4, rope_mode="normal", seed=11, kinds=["mha_sliding"] * 2, window=6,
                      max_num_sequences=4, max_total_seq_len=512, prefill_chunk_size=64,
                      kv_dtype="float8_e4m3fn", kv_scales=0.5)
    opts = m.cache.options
    assert m.cache._pools[0].shape[0] == opts.sliding_pool_pages == opts.sliding_num_pages + 2
    m.add(0)
    m.add(1)
    m.forward([0, 1], [40, 9])
    m.forward([0, 1], [1, 20])
    m.fork(1, 2)
    for _ in range(5):
        m.forward([0, 1, 2], [1, 1, 1])
    assert m.cache.sliding_kept_from(0) == 40
    check_pages(m)


def test_fp8_pages_prefill_within_the_window():
    """The paged prefill path over FP8 sliding pools (their scale page the pool's last): a
    ragged batch and a chunk up to exactly the window, against the reference over the stored
    values."""
    m = FP8KindsModel(page_size=4, rope_mode="normal", seed=12, kinds=["mha_sliding"] * 2, window=20,
                      max_num_sequences=4, max_total_seq_len=512, prefill_chunk_size=64,
                      kv_dtype="float8_e4m3fn", kv_scales=0.5)
    m.cache._window_prefill = True
    m.add(0)
    m.add(1)
    assert window_kernels(m, [([0, 1], [13, 6]), ([0, 1], [7, 1])]) == ["prefill", "prefill"]


@pytest.mark.parametrize("batch", [1, pytest.param(8, marks=pytest.mark.slow)])
def test_gemma_3_shapes_past_the_window(target, batch):
    """Gemma 3 270M's attention shapes (4 query heads over 1 KV head of 256, page 16, window 512):
    prompts past the window in prefill chunks, then decode steps, a sliding and a full layer
    against plain attention over the unpaged sequence with the window."""
    from test_cache_layer_kinds import device_of, visible
    import reference as ref

    hq, hkv, d, ps, window, chunk = 4, 1, 256, 16, 512, 256
    kinds = ["mha_sliding", "mha"]
    device = device_of(target)
    cache = PagedKVCache(num_layers=2, num_qo_heads=hq, num_kv_heads=hkv, qk_head_dim=d, dtype="float16",
                         page_size=ps, rope_mode="none", attn_kinds=kinds, layer_sliding_window_size=window,
                         max_num_sequences=batch, max_total_seq_len=batch * 1024, prefill_chunk_size=chunk,
                         device=device)
    rng = np.random.default_rng(batch)
    sm_scale = d ** -0.5
    keys = {(s, layer): np.zeros((0, hkv, d)) for s in range(batch) for layer in range(2)}
    values = dict(keys)

    def step(seq_ids, lengths):
        cache.begin_forward(seq_ids, lengths)
        for layer, kind in enumerate(kinds):
            qkv = randn(rng, (sum(lengths), hq + 2 * hkv, d), "float16")
            o = empty((sum(lengths), hq, d), "float16", device)
            cache.attention_with_fused_qkv(layer, sm_scale, tensor(qkv, device), o)
            start = 0
            for s, n in zip(seq_ids, lengths):
                rows = qkv[start:start + n].astype(np.float64)
                history = len(keys[s, layer])
                keys[s, layer] = np.concatenate([keys[s, layer], rows[:, hq:hq + hkv]])
                values[s, layer] = np.concatenate([values[s, layer], rows[:, hq + hkv:]])
                want, _ = ref.attention(rows[:, :hq], keys[s, layer], values[s, layer], sm_scale, False,
                                        visible(kind, history, n, window))
                np.testing.assert_allclose(o.numpy()[start:start + n].astype(np.float64), want, rtol=2e-2, atol=2e-2,
                                           err_msg=f"layer {layer} ({kind}), sequence {s}, {history} + {n} tokens")
                start += n
        cache.end_forward()

    prompt = [700 + 37 * s for s in range(batch)]  # past the window, ragged, some ending inside a page
    for s in range(batch):
        cache.add_sequence(s)
        for begin in range(0, prompt[s], chunk):
            step([s], [min(chunk, prompt[s] - begin)])
    for _ in range(3):
        step(list(range(batch)), [1] * batch)
