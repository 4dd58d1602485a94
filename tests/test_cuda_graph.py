"""Specification of CUDA-graph decode (tvmattn/runtime/graphs.py, PagedKVCache.begin_graph_decode,
a model library's decode_step, Generator's graph path).

- The graph plan (CPU and CUDA): a decode step planned with `begin_graph_decode` into a bucket's
  fixed layout, padded rows included, gives every real row the attention of the unpaged
  reference and appends nothing for the padding, over steps with sequences added, removed,
  forked and popped, crossing page boundaries and buckets; its layout does not depend on the
  sequences; bad input is refused with the cache unchanged.
- MHA_SLIDING layers (CPU and CUDA): in a cache of MHA and MHA_SLIDING layers the graph plan
  also carries the window level (fixed offsets, a capacity of bucket * the pages a window
  touches); every layer's real rows match the windowed reference past the window and across
  page boundaries, the sliding pages held after each step are exactly those of the window
  (taken and released as by begin_forward), padding writes nothing, and a cancelled graph step
  leaves both allocators exactly as they were.
- Replay (CUDA): DecodeGraphs replays equal the same steps run eagerly, bit for bit, and the
  reference (MHA caches and caches with MHA_SLIDING layers), and replays timed back to back
  leave the cache unchanged; a model library's decode_step replayed by Generator gives the
  eager tokens (a tiny Llama, and a sliding-window one).
"""

from __future__ import annotations

import numpy as np
import pytest
from harness import empty, randn, tensor
import test_cache_layer_kinds as kinds
from test_cache import DTYPE, HKV, HQ, LAYERS, RTOL, ATOL, SM_SCALE, D, Model
from test_sliding_pages import check_pages, exact

from tvmattn import KVCacheError
from tvmattn.runtime.graphs import bucket_of, buckets_for, graph_layout, window_pages_per_row

QKV_HEADS = HQ + 2 * HKV


def graph_step(m: Model, seq_ids: list, bucket: int, qkv: list | None = None) -> list:
    """One graph-planned decode step run eagerly; each layer's real rows checked against the
    reference. qkv: per layer [bucket, Hq + 2 Hkv, D] (random if None). Returns each layer's o."""
    n = len(seq_ids)
    history = [m.length(s) for s in seq_ids]
    m.cache.begin_graph_decode(seq_ids, bucket)
    np.testing.assert_array_equal(m.cache.get_query_positions().numpy()[:n], history)
    outputs = []
    for layer in range(LAYERS):
        rows = randn(m.rng, (bucket, QKV_HEADS, D), DTYPE) if qkv is None else qkv[layer]
        o = empty((bucket, HQ, D), DTYPE, m.device)
        m.cache.attention_with_fused_qkv(layer, SM_SCALE, tensor(rows, m.device), o)
        out = o.numpy()
        expected = m._expected(seq_ids, [1] * n, history, layer, rows[:n])
        np.testing.assert_allclose(out[:n].astype(np.float64), expected, rtol=RTOL, atol=ATOL,
                                   err_msg=f"layer {layer}, graph step {seq_ids} in bucket {bucket}")
        outputs.append(out)
    m.cache.end_forward()
    return outputs


def kinds_graph_step(m: kinds.KindsModel, seq_ids: list, bucket: int, qkv: list | None = None) -> list:
    """graph_step for a cache with MHA_SLIDING layers (KindsModel): each layer's real rows
    against the windowed reference. Returns each layer's o."""
    n = len(seq_ids)
    history = [len(m.k[s][0]) for s in seq_ids]
    m.cache.begin_graph_decode(seq_ids, bucket)
    np.testing.assert_array_equal(m.cache.get_query_positions().numpy()[:n], history)
    outputs = []
    for layer, kind in enumerate(m.kinds):
        rows = randn(m.rng, (bucket, QKV_HEADS, D), DTYPE) if qkv is None else qkv[layer]
        o = empty((bucket, HQ, D), DTYPE, m.device)
        m.cache.attention_with_fused_qkv(layer, kinds.SM_SCALE, tensor(rows, m.device), o)
        out = o.numpy()
        expected = m._expected(seq_ids, [1] * n, history, layer, kind, rows[:n])
        np.testing.assert_allclose(out[:n].astype(np.float64), expected, rtol=kinds.RTOL, atol=kinds.ATOL,
                                   err_msg=f"layer {layer} ({kind}), graph step {seq_ids} in bucket {bucket}")
        outputs.append(out)
    m.cache.end_forward()
    return outputs


def test_buckets():
    assert buckets_for(1) == (1,)
    assert buckets_for(6) == (1, 2, 4, 6)
    assert buckets_for(8) == (1, 2, 4, 8)
    assert bucket_of(3, buckets_for(6)) == 4 and bucket_of(5, buckets_for(6)) == 6
    with pytest.raises(KVCacheError, match="exceeds the largest graph bucket 6"):
        bucket_of(7, buckets_for(6))


def test_layout_depends_on_the_bucket_only():
    a, b = graph_layout(4, 100, False), graph_layout(4, 100, False)
    assert a == b and a.fused[0].page_indices.offset > a.fused[0].k_offset.offset  # page indices last
    assert graph_layout(8, 100, False) != a
    assert graph_layout(4, 100, True).fused[0].length_info.shape == (3, 4)
    windowed = graph_layout(4, 100, False, 3)
    assert windowed == graph_layout(4, 100, False, 3) and not a.window
    (level,), (slide,) = windowed.window, windowed.slide_positions
    assert level.page_indices.shape == (12,) and level.length_info.shape == (3, 4) and slide.shape == (4,)
    assert windowed.fused[0].page_indices.offset > max(spec.offset for spec in (*level, slide) if spec is not None)
    assert [window_pages_per_row(w, 4) for w in (1, 2, 5, 8, 9)] == [1, 2, 2, 3, 3]


SLIDING_KINDS = ["mha_sliding", "mha", "mha_sliding"]


def kinds_model(target, page_size: int, window: int, seed: int, **options) -> kinds.KindsModel:
    options = {"max_num_sequences": 8, "max_total_seq_len": 1024, "prefill_chunk_size": 64, **options}
    return kinds.KindsModel(target, page_size, "normal", seed=seed, kinds=SLIDING_KINDS, window=window, **options)


@pytest.mark.parametrize("page_size,window", [(4, 7), (1, 5), (16, 21)])
def test_graph_plan_steps_with_sliding_layers_match_the_reference(target, page_size, window):
    """Prompts past the window, graph-planned decode steps across page boundaries and past the
    window in every bucket, forks, popn, removals and eager steps in between: every layer
    against the windowed reference, the sliding pages exactly the window's after every step."""
    m = kinds_model(target, page_size, window, seed=page_size + window)
    initial = (m.cache.get_num_available_pages(), m.cache._slides.allocator.num_free)
    for seq_id in (0, 1, 2):
        m.add(seq_id)
    m.forward([0, 1, 2], [window + 9, 1, 3])  # 0 past the window, 1 and 2 within
    layouts = set()
    for _ in range(max(page_size, window) + 2):  # 1 and 2 grow past the window, pages slide
        kinds_graph_step(m, [0, 1, 2], 4)
        check_pages(m)
        layouts.add(m.cache._graph_layouts[4])
    assert len(layouts) == 1 and m.cache._graph_layouts[4].window
    m.fork(0, 3)  # shares the window's full pages
    earliest = m.cache.sliding_kept_from(1) + window - 1  # popn reaches back only as far as the kept tokens serve
    pop = min(2, len(m.k[1][0]) - max(earliest, 1))
    if pop > 0:
        m.popn(1, pop)
    m.add(4)
    m.forward([4], [3])
    kinds_graph_step(m, [3, 0, 1, 4, 2], 8)  # bucket 8, three padded rows
    check_pages(m)
    m.remove(2)
    kinds_graph_step(m, [1], 1)
    kinds_graph_step(m, [4, 3], 2)
    for _ in range(3):
        m.forward([0, 3], [1, 1])  # eager steps in between
        kinds_graph_step(m, [0, 1, 3, 4], 4)
        check_pages(m)
    for seq_id in list(m.k):
        m.remove(seq_id)
    assert m.cache.empty()
    assert (m.cache.get_num_available_pages(), m.cache._slides.allocator.num_free) == initial


def test_graph_steps_with_sliding_layers_equal_eager_steps():
    """The same decode steps planned by begin_graph_decode (in a bucket larger than the batch)
    and by begin_forward give the same outputs and the same sliding pages."""
    graph, eager = (kinds_model("llvm", 4, 7, seed=5) for _ in range(2))
    rng = np.random.default_rng(2)
    for m in (graph, eager):
        for seq_id in (0, 1, 2):
            m.add(seq_id)
        m.forward([0, 1, 2], [12, 2, 6])
    for _ in range(9):
        qkv = [randn(rng, (4, QKV_HEADS, D), DTYPE) for _ in SLIDING_KINDS]
        graphed = kinds_graph_step(graph, [0, 1, 2], 4, qkv)
        eager.cache.begin_forward([0, 1, 2], [1, 1, 1])
        for layer, rows in enumerate(qkv):
            o = empty((3, HQ, D), DTYPE, eager.device)
            eager.cache.attention_with_fused_qkv(layer, kinds.SM_SCALE, tensor(rows[:3], eager.device), o)
            np.testing.assert_allclose(graphed[layer][:3], o.numpy(), rtol=1e-3, atol=1e-3, err_msg=f"layer {layer}")
        eager.cache.end_forward()
        assert exact(graph) == exact(eager)


def test_cancelled_graph_step_with_sliding_layers_leaves_the_cache_unchanged():
    """A graph step that takes sliding pages (a page boundary) and is cancelled, or abandoned by
    the next begin_forward, leaves both allocators and every sequence exactly as before."""
    m = kinds_model("llvm", 4, 7, seed=1)
    for seq_id in (0, 1):
        m.add(seq_id)
    m.forward([0, 1], [12, 8])  # both at a page boundary: the next token takes a page
    before = exact(m)
    m.cache.begin_graph_decode([0, 1], 2)
    assert exact(m) != before
    m.cache.cancel_forward()
    assert exact(m) == before
    m.cache.begin_graph_decode([1, 0], 4)
    m.forward([0], [2])  # (its begin_forward abandons the graph step)
    kinds_graph_step(m, [0, 1], 2)
    check_pages(m)


@pytest.mark.parametrize("rope_mode,page_size", [("none", 4), ("normal", 1), ("inline", 16)])
def test_graph_plan_steps_match_the_reference(target, rope_mode, page_size):
    m = Model(target, rope_mode, page_size, seed=7, max_num_sequences=8)
    for seq_id in (0, 1, 2):
        m.add(seq_id)
    m.forward([0, 1, 2], [5, 1, 8])  # eager prefill; then graph-planned decode steps
    layouts = set()
    for step in range(6):  # crosses page boundaries (page sizes 1 and 4)
        graph_step(m, [0, 1, 2], 4)
        layouts.add(m.cache._graph_layouts[4])
    assert len(layouts) == 1
    m.fork(0, 3)  # shares pages: no cascade in a graph step
    m.popn(1, 2)
    m.add(4)
    m.forward([4], [3])
    graph_step(m, [3, 0, 1, 4, 2], 8)  # bucket 8, three padded rows
    m.remove(2)
    graph_step(m, [1], 1)
    graph_step(m, [4, 3], 2)
    for _ in range(3):
        m.forward([0, 3], [1, 1])  # eager steps in between
        graph_step(m, [0, 1, 3, 4], 4)
    m.check_kv()  # padding appended nothing
    m.check_no_leaks()


def test_the_graph_plan_buffer_holds_a_full_cache_from_its_first_step():
    """The graph-plan buffer is made large enough for a full pool and a new page in every row:
    graph steps of the largest bucket up to a full cache never replace it (a replacement makes
    every captured graph stale: bench_e2e saw a recapture mid-run at batch 64)."""
    m = Model("llvm", "none", 4, seed=5, max_num_sequences=8, max_total_seq_len=96)
    seq_ids = list(range(8))
    for seq_id in seq_ids:
        m.add(seq_id)
    m.forward(seq_ids, [3] * 8)  # (one page each, one slot left in it)
    graph_step(m, seq_ids, 8)
    generation = m.cache.graph_state()[0]
    pool = m.cache._allocator.num_pages
    pages_each = pool // 8
    for _ in range(pages_each * 4 - 4):  # up to pages_each full pages per row
        graph_step(m, seq_ids, 8)
        assert m.cache.graph_state()[0] == generation, (pool - m.cache._allocator.num_free, pool)
    assert m.cache._allocator.num_free == pool - 8 * pages_each  # (the pool as full as 8 rows make it)
    m.check_kv()


def test_graph_plan_refusals_leave_the_cache_unchanged():
    m = Model("llvm", "none", 4, sliding=True, seed=3, max_num_sequences=4)
    for seq_id in (0, 1):
        m.add(seq_id)
    m.add(2, window=(8, 2))
    m.forward([0, 1, 2], [3, 4, 5])
    before = {s: m.cache.sequence_state(s) for s in (0, 1, 2)}
    pages = m.cache.get_num_available_pages()
    for seq_ids, bucket, match in (([0, 1], 1, "bucket=1"), ([0, 1], 5, "bucket=5"), ([0, 7], 2, "7"),
                                   ([0, 2], 2, "sliding window"), ([0, 0], 2, "twice")):
        with pytest.raises(KVCacheError, match=match):
            m.cache.begin_graph_decode(seq_ids, bucket)
        assert {s: m.cache.sequence_state(s) for s in (0, 1, 2)} == before
        assert m.cache.get_num_available_pages() == pages
        assert m.cache.current_plan() is None
    graph_step(m, [0, 1], 2)  # sliding-window kernels (length_info [3, B]) for sequences without one
    m.check_kv()


# ---------------------------------------------------------------------------------------------
# Replay on the GPU


class FixedBuffers:
    """Per bucket and layer, qkv and o tensors at fixed addresses (what a captured step reads
    and writes)."""

    def __init__(self, device, buckets, layers: int = LAYERS):
        self.layers = layers
        self.qkv = {b: [empty((b, QKV_HEADS, D), DTYPE, device) for _ in range(layers)] for b in buckets}
        self.o = {b: [empty((b, HQ, D), DTYPE, device) for _ in range(layers)] for b in buckets}

    def step(self, cache, sm_scale: float = SM_SCALE):
        def run(bucket: int):
            for layer in range(self.layers):
                cache.attention_with_fused_qkv(layer, sm_scale, self.qkv[bucket][layer], self.o[bucket][layer])
            return self.o[bucket]

        return run


@pytest.mark.gpu
def test_replay_equals_eager_and_the_reference():
    from tvmattn.runtime.graphs import DecodeGraphs

    graph, eager = (Model("cuda", "normal", 4, seed=11, max_num_sequences=8) for _ in range(2))
    buffers = FixedBuffers(graph.device, buckets_for(8))
    graphs = DecodeGraphs(graph.cache, buffers.step(graph.cache), 8)
    with pytest.raises(KVCacheError, match="max_batch=9 exceeds the cache's max_num_sequences 8"):
        DecodeGraphs(graph.cache, buffers.step(graph.cache), 9)
    rng = np.random.default_rng(5)

    def both(op, *args):
        getattr(graph, op)(*args)
        getattr(eager, op)(*args)

    def step(seq_ids):
        bucket = bucket_of(len(seq_ids), graphs.buckets)
        qkv = [randn(rng, (bucket, QKV_HEADS, D), DTYPE) for _ in range(LAYERS)]
        for layer in range(LAYERS):
            buffers.qkv[bucket][layer].copyfrom(qkv[layer])
        history = [graph.length(s) for s in seq_ids]
        outputs = graphs.run(seq_ids)
        replayed = [o.numpy() for o in outputs]
        for layer in range(LAYERS):
            expected = graph._expected(seq_ids, [1] * len(seq_ids), history, layer, qkv[layer][: len(seq_ids)])
            np.testing.assert_allclose(replayed[layer][: len(seq_ids)].astype(np.float64), expected, rtol=RTOL,
                                       atol=ATOL, err_msg=f"replay of {seq_ids}, layer {layer}")
        eager_out = graph_step(eager, seq_ids, bucket, qkv)
        for layer in range(LAYERS):
            np.testing.assert_array_equal(replayed[layer][: len(seq_ids)], eager_out[layer][: len(seq_ids)],
                                          err_msg=f"replay vs eager, {seq_ids}, layer {layer}")

    for seq_id in (0, 1, 2):
        both("add", seq_id)
    both("forward", [0, 1, 2], [6, 13, 1])
    for _ in range(5):
        step([0, 1, 2])  # bucket 4: captured once, then replayed
    both("fork", 1, 5)
    both("popn", 0, 3)
    step([5, 1, 0])
    both("remove", 2)
    for seq_id in (6, 7, 8):
        both("add", seq_id)
    both("forward", [6, 7, 8], [2, 9, 4])
    for _ in range(4):
        step([0, 1, 5, 6, 7, 8])  # bucket 8
        step([7])  # bucket 1
    assert graphs.captures == 3 and graphs.replays == 14
    assert graphs.memory_bytes > 0
    # timing replays of the last step rewrite its K/V slots with the same values (check_kv below)
    assert graphs.time_replays(1, 5) > 0
    with pytest.raises(KVCacheError, match="no current graph of bucket 2"):
        graphs.time_replays(2, 1)
    with pytest.raises(KVCacheError, match="count must be at least 1, got 0"):
        graphs.time_replays(1, 0)
    graph.check_kv()
    eager.check_kv()
    for seq_id in list(graph.k):
        both("remove", seq_id)
    # forks of one long sequence read more page indices than the graph plan holds: a larger
    # buffer, and every graph captured again
    both("add", 20)
    both("forward", [20], [250])
    for child in range(21, 28):
        both("fork", 20, child)
    step(list(range(20, 28)))
    assert graphs.captures == 4
    step(list(range(20, 28)))
    assert graphs.captures == 4
    graph.check_no_leaks()


@pytest.mark.gpu
@pytest.mark.parametrize("page_size,window", [(16, 21), (4, 7)])
def test_replay_with_sliding_layers_equals_eager_and_the_reference(page_size, window):
    """DecodeGraphs over a cache of MHA_SLIDING and MHA layers: replays past the window and
    across page boundaries equal the same graph-planned steps run eagerly, bit for bit, and the
    windowed reference; the sliding pages are the window's after every replay."""
    from tvmattn.runtime.graphs import DecodeGraphs

    graph, eager = (kinds_model("cuda", page_size, window, seed=11) for _ in range(2))
    buffers = FixedBuffers(graph.device, buckets_for(8), len(SLIDING_KINDS))
    graphs = DecodeGraphs(graph.cache, buffers.step(graph.cache, kinds.SM_SCALE), 8)
    rng = np.random.default_rng(5)

    def both(op, *args):
        getattr(graph, op)(*args)
        getattr(eager, op)(*args)

    def step(seq_ids):
        n, bucket = len(seq_ids), bucket_of(len(seq_ids), graphs.buckets)
        qkv = [randn(rng, (bucket, QKV_HEADS, D), DTYPE) for _ in SLIDING_KINDS]
        for layer, rows in enumerate(qkv):
            buffers.qkv[bucket][layer].copyfrom(rows)
        history = [len(graph.k[s][0]) for s in seq_ids]
        replayed = [o.numpy() for o in graphs.run(seq_ids)]
        for layer, kind in enumerate(SLIDING_KINDS):
            expected = graph._expected(seq_ids, [1] * n, history, layer, kind, qkv[layer][:n])
            np.testing.assert_allclose(replayed[layer][:n].astype(np.float64), expected, rtol=kinds.RTOL,
                                       atol=kinds.ATOL, err_msg=f"replay of {seq_ids}, layer {layer} ({kind})")
        eager_out = kinds_graph_step(eager, seq_ids, bucket, qkv)
        for layer in range(len(SLIDING_KINDS)):
            np.testing.assert_array_equal(replayed[layer][:n], eager_out[layer][:n],
                                          err_msg=f"replay vs eager, {seq_ids}, layer {layer}")
        check_pages(graph)
        assert exact(graph) == exact(eager)

    for seq_id in (0, 1, 2):
        both("add", seq_id)
    both("forward", [0, 1, 2], [window + 20, 13, 1])
    for _ in range(page_size + 3):
        step([0, 1, 2])  # bucket 4: captured once, then replayed while the windows slide
    both("fork", 1, 5)
    step([5, 1, 0])
    both("remove", 2)
    for seq_id in (6, 7, 8):
        both("add", seq_id)
    both("forward", [6, 7, 8], [2, window + 1, 4])
    for _ in range(4):
        step([0, 1, 5, 6, 7, 8])  # bucket 8
        step([7])  # bucket 1
    assert graphs.captures == 3 and graphs.replays == page_size + 3 + 1 + 8
    for seq_id in list(graph.k):
        both("remove", seq_id)
    assert graph.cache.empty()


@pytest.fixture(scope="module")
def tiny_cuda_library(tmp_path_factory):
    """A float16 CUDA library of a tiny GGUF model (max batch 4)."""
    pytest.importorskip("gguf")
    from test_weights import write_tiny_gguf

    from tvmattn.build import compile_model, resolve_target

    folder = tmp_path_factory.mktemp("tiny-cuda")
    write_tiny_gguf(folder / "tiny.gguf", np.random.default_rng(7))
    library = folder / "tiny.so"
    compile_model(str(folder / "tiny.gguf"), library, target=resolve_target("cuda"), max_batch_size=4,
                  log=lambda m: None)
    return library


@pytest.mark.gpu
def test_generator_replays_decode_steps_with_the_eager_tokens(tiny_cuda_library):
    """Generator with graphs (the default) gives the tokens and logits of Generator without
    them, for one prompt and a batch."""
    from tvmattn.generate import Generator

    graphed, eager = Generator(tiny_cuda_library), Generator(tiny_cuda_library, cuda_graph=False)
    prompts = [[5, 17, 9, 3, 42], [9, 4, 10], [12, 8, 3, 3, 45, 27, 0]]
    for batch in (prompts[:1], prompts):
        a = graphed.generate_tokens(batch, max_new_tokens=12, keep_logits=True)
        b = eager.generate_tokens(batch, max_new_tokens=12, keep_logits=True)
        assert graphed.uses_cuda_graph and not eager.uses_cuda_graph
        assert a.tokens == b.tokens
        for x, y in zip(a.logits, b.logits):
            np.testing.assert_allclose(x, y, rtol=2e-2, atol=2e-2)
    assert graphed.session.graphs.captures >= 2 and graphed.session.graphs.replays >= 12


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3])
def test_graph_samples_its_rows_like_the_host(tiny_cuda_library, rows):
    """decode_sampled: the graph's last kernel is `sample` with the parameters prepare uploaded
    into the graph's buffer: greedy rows get the argmax of the step's logits, seeded ones the
    host Sampler's token from those logits; 3 rows replay bucket 4 (a padding row), each step
    fed the previous step's ids on the device. At 1 row the cache holds 2 sequences, fewer
    than the library's max batch of 4: the graphs' largest bucket is then the cache's."""
    from tvmattn.sampling import Sampler, SamplingOptions
    from tvmattn.session import ModelSession

    session = ModelSession(tiny_cuda_library)
    session.create_cache(2 if rows == 1 else 4, 256)
    vocab = session.vocab_size
    options = [SamplingOptions(temperature=0), SamplingOptions(temperature=0.9, seed=2),
               SamplingOptions(temperature=1.2, top_k=7, top_p=0.9, seed=3)][:rows]
    device_side = [Sampler(o, vocab) for o in options]
    host_side = [Sampler(o, vocab) for o in options]
    seq_ids = list(range(rows))
    for seq_id in seq_ids:
        session.add_sequence(seq_id)
    session.prefill(seq_ids, [[5, 17, 9], [9, 4, 10, 11], [12, 8]][:rows])
    assert session.samples_in_graph
    sampler = session.device_sampler()
    tokens = [3] * rows
    for _ in range(6):
        plan = sampler.prepare(device_side, vocab=vocab, params_at=session.graph_sample_params(rows))
        logits, sampled = session.decode_sampled(seq_ids, tokens)
        host_logits = logits.numpy()
        step = sampler.launch(plan, logits, sampled=sampled).wait()
        expected = [h.choose(host_logits[i])[0] for i, h in enumerate(host_side)]
        assert [c[0] for c in step.choices] == expected
        assert expected[0] == int(np.argmax(host_logits[0]))
        for h, d, token in zip(host_side, device_side, expected):
            h.accept(token)
            d.accept(token)
        tokens = sampled  # the next step reads them on the device
    assert session.graphs.replays >= 5
