"""Specification of the serving engine (tvmattn.serve) on a tiny random-weight library (CPU).

The reference for every greedy request is the request's prompt alone: `Generator.generate_tokens`
on it (the engine with a batch of one), whose tokens are checked in turn against the greedy tokens
of the independent float64 torch model of tests/test_model.py on the same weights. The engine
must produce exactly those tokens whatever the interleaving (requests joining and leaving at
random steps, prompt chunks beside decode tokens, preemption and recompute, prefix forks,
speculation). After every scenario no page is leaked: the pages in use are those the prefix
cache's sequences hold, the cache holds no other sequence, and clearing the prefix cache frees
every page.
"""

from __future__ import annotations

import collections
import threading

import numpy as np
import pytest

from serve_support import tiny_library
from tvmattn.generate import Generator
from tvmattn.sampling import SamplingOptions
from tvmattn.serve.engine import Engine, RequestError
from tvmattn.serve.prefix import RadixPrefixCache
from tvmattn.serve.runner import DraftModel, ModelRunner
from tvmattn.serve.text import TextStream
from tvmattn.session import ModelSession
from tvmattn.speculative import SpeculativeOptions, build_trie

VOCAB = 268
MAX_NEW = 10


@pytest.fixture(scope="module")
def library():
    return tiny_library()


@pytest.fixture(scope="module")
def torch_model(library):
    """The float64 torch model on the library's GGUF weights (None for a prebuilt library
    without its GGUF beside it)."""
    from test_model import TorchLlama

    from tvmattn.weights import read_gguf

    gguf = library.parent / "tiny.gguf"
    if not gguf.is_file():
        return None
    loaded = read_gguf(gguf)
    return TorchLlama(loaded.hf_config, loaded.tensors)


@pytest.fixture(scope="module")
def reference(library, torch_model):
    """prompt (tuple), n -> the greedy tokens of Generator.generate_tokens on it alone, which
    equal the float64 torch model's."""
    generator = Generator(library)
    generator.stop_ids = set()
    memo: dict = {}

    def tokens(prompt, n=MAX_NEW):
        key = (tuple(prompt), n)
        if key not in memo:
            memo[key] = generator.generate_tokens([list(prompt)], n).tokens[0]
            if torch_model is not None:
                context = list(prompt)
                for _ in range(n):
                    context.append(int(np.argmax(torch_model.logits(context)[-1])))
                assert memo[key] == context[len(prompt):], "the engine alone differs from the torch model"
        return memo[key]

    return tokens


def make_engine(library, **kwargs) -> Engine:
    runner_args = {k: kwargs.pop(k) for k in ("max_total_tokens", "kv_cache_memory", "cuda_graph") if k in kwargs}
    return Engine(ModelRunner(library, **runner_args), **kwargs)


def greedy(n=MAX_NEW, **kwargs) -> SamplingOptions:
    return SamplingOptions(temperature=0, max_tokens=n, ignore_eos=True, **kwargs)


def prompts(seed: int, lengths) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, VOCAB, size=n)] for n in lengths]


def run_all(engine: Engine, limit: int = 2000) -> int:
    steps = 0
    while engine.step():
        steps += 1
        assert steps < limit, "the engine does not finish"
    return steps


def assert_no_leak(engine: Engine) -> None:
    used, held = engine.held_pages()
    assert used == held, f"{used} pages in use, the prefix cache holds {held}"
    prefix = sorted(engine.prefix.sequence_ids()) if engine.prefix is not None else []
    assert engine.cache_sequences() == prefix, "a sequence outlived its request"
    engine.clear_prefix_cache()
    assert engine.runner.available_pages() == engine.runner.num_pages
    assert engine.cache_sequences() == []


@pytest.mark.parametrize("prefix_cache", ["radix", "off"])
def test_random_joins_and_leaves_give_each_request_its_solo_greedy_tokens(library, reference, prefix_cache):
    engine = make_engine(library, max_batched_tokens=24, prefix_cache=prefix_cache)
    rng = np.random.default_rng(1)
    shared = prompts(2, [20])[0]
    work = []
    for i, n in enumerate(rng.integers(1, 90, size=14)):
        prompt = prompts(100 + i, [int(n)])[0]
        if i % 3 == 0:
            prompt = shared + prompt  # a shared prefix (two pages and a bit) on some
        work.append((prompt, int(rng.integers(1, MAX_NEW + 1))))
    submitted = []
    step = 0
    while work or engine.busy():
        if work and rng.random() < 0.45:  # joins at random steps
            prompt, n = work.pop()
            submitted.append((prompt, n, engine.submit(prompt, greedy(n))))
        engine.step()
        step += 1
        assert step < 3000
    for prompt, n, request in submitted:
        out = request.stream.result()
        assert out.finish_reason == "length" and out.tokens == reference(prompt, MAX_NEW)[:n]
    assert_no_leak(engine)


def test_chunked_prefill_runs_beside_decode(library, reference):
    engine = make_engine(library, max_batched_tokens=16)
    short, long = prompts(3, [6, 150])
    first = engine.submit(short, greedy(12))
    engine.step()  # its prefill; it decodes from now on
    second = engine.submit(long, greedy(4))
    tokens_before_long = []
    while second.first_token is None:
        engine.step()
        tokens_before_long.append(len(first.output))
    # the long prompt needs ceil(150 / 15) steps of the 16-token budget; the short stream
    # gains a token in each of them instead of waiting for the whole prefill
    assert len(tokens_before_long) >= 10
    assert tokens_before_long[:10] == list(range(2, 12))
    run_all(engine)
    assert first.stream.result().tokens == reference(short, 12)
    assert second.stream.result().tokens == reference(long, 4)
    assert_no_leak(engine)


def test_preemption_recomputes_and_loses_nothing(library, reference):
    # 7 pages for four requests of up to 64 tokens each: over-committed
    engine = make_engine(library, max_total_tokens=7 * 16, max_batched_tokens=32, prefix_cache="off")
    work = prompts(4, [20, 25, 30, 18])
    requests = [engine.submit(p, greedy(30)) for p in work]
    run_all(engine)
    assert engine.preemptions > 0
    for prompt, request in zip(work, requests):
        out = request.stream.result()
        assert out.finish_reason == "length" and out.tokens == reference(prompt, 30)
    assert sum(r.stream.result().preemptions for r in requests) == engine.preemptions
    # without a prefix cache a readmitted request prefills again at least its prompt
    assert engine.recomputed_tokens >= engine.preemptions * (min(map(len, work)) - 1)
    assert_no_leak(engine)


def test_prefix_forks_skip_the_cached_prompt_and_eviction_frees_pages(library, reference):
    engine = make_engine(library, max_total_tokens=12 * 16, max_batched_tokens=64)
    system = prompts(5, [40])[0]
    a, b, c = ([*system, *tail] for tail in prompts(6, [5, 9, 3]))
    ra = engine.submit(a, greedy())
    run_all(engine)
    rb = engine.submit(b, greedy())
    run_all(engine)
    assert ra.stream.result().cached_tokens == 0
    assert rb.stream.result().cached_tokens == 32  # two whole pages of the system prompt
    assert rb.stream.result().tokens == reference(b)
    # the same prompt again: everything but its last token comes from the cache
    again = engine.submit(b, greedy())
    run_all(engine)
    assert again.stream.result().cached_tokens == len(b) - 1
    assert again.stream.result().tokens == reference(b)
    assert engine.prefix.hit_rate > 0
    # distinct prompts fill the 12-page pool: least-recently-used leaves go
    others = prompts(7, [60, 60, 60])
    outs = [engine.submit(p, greedy()) for p in others]
    rc = engine.submit(c, greedy())
    run_all(engine)
    for p, r in zip([*others, c], [*outs, rc]):
        assert r.stream.result().tokens == reference(p)
    assert engine.prefix.nodes >= 1
    assert_no_leak(engine)


def test_cancellation_between_steps_frees_the_pages(library, reference):
    engine = make_engine(library, max_running=2)
    work = prompts(8, [30, 40, 20])
    running = engine.submit(work[0], greedy(50))
    other = engine.submit(work[1], greedy(8))
    waiting = engine.submit(work[2], greedy(8))  # max_running 2: it waits
    for _ in range(4):
        engine.step()
    assert waiting.seq_id is None and running.seq_id is not None
    engine.cancel(running)
    engine.cancel(waiting)
    run_all(engine)
    assert running.stream.result().finish_reason == "cancelled"
    assert 0 < len(running.output) < 50
    assert waiting.stream.result().finish_reason == "cancelled" and waiting.output == []
    assert other.stream.result().tokens == reference(work[1], 8)
    assert_no_leak(engine)


@pytest.mark.parametrize("back_off", [False, True], ids=["every-step", "back-off"])
def test_speculative_requests_keep_the_greedy_tokens(library, reference, back_off):
    """Every step verifies what prompt lookup drafts (back_off=False), or the back-off weighs
    drafts against the measured step costs first; the tokens are greedy decoding's either way."""
    engine = make_engine(library, max_batched_tokens=64,
                         speculative=SpeculativeOptions("prompt-lookup", back_off=back_off))
    base = prompts(9, [12])[0]
    repetitive = base * 4  # prompt lookup drafts from it (the random model seldom agrees)
    plain = prompts(10, [25])[0]
    spec = engine.submit(repetitive, greedy(20), speculative=True)
    other = engine.submit(plain, greedy(20))
    run_all(engine)
    assert spec.speculative and (engine.drafted > 0 or back_off)
    stats = spec.stats
    # each decode step yields a token, and a verify step its accepted drafts too (prefill the first)
    assert stats.plain_steps + stats.verify_steps + stats.accepted == len(spec.output) - 1
    assert spec.stream.result().tokens == reference(repetitive, 20)
    assert other.stream.result().tokens == reference(plain, 20)
    assert_no_leak(engine)


@pytest.mark.parametrize("pool_pages", [64, 8], ids=["roomy", "preempting"])
def test_draft_model_requests_join_late_and_keep_the_greedy_tokens(library, reference, pool_pages):
    """A draft model (the library drafting for itself, a cache of its own) beside plain requests
    that join at later steps, in a pool small enough to preempt: the greedy tokens, accepted
    drafts, and no sequence left in either cache."""
    runner = ModelRunner(library, max_total_tokens=pool_pages * 16)
    draft = DraftModel(runner.session.sibling(), 2, 8 * 256, 16)
    free = draft.session.available_pages()
    options = SpeculativeOptions("draft-model", 4, 2, str(library), back_off=False)
    engine = Engine(runner, max_batched_tokens=32, speculative=options, draft_model=draft)
    work = prompts(17, [12, 40, 7, 25])
    requests = []
    for i, prompt in enumerate(work):
        requests.append(engine.submit(prompt, greedy(40), speculative=i % 2 == 0))
        engine.step()
    run_all(engine)
    for prompt, request in zip(work, requests):
        assert request.stream.result().tokens == reference(prompt, 40)
    assert engine.accepted > 0 and (pool_pages > 20 or engine.preemptions > 0)
    assert draft.cached == {} and draft.session.available_pages() == free
    assert_no_leak(engine)


class OracleDrafter:
    """Drafts the true greedy continuation (known beforehand) under a wrong first sibling, so that
    verify steps accept several nodes of a branching tree."""

    def __init__(self, prompt, answer):
        self.prompt, self.answer = prompt, answer

    def draft(self, context, budget):
        done = len(context) - len(self.prompt)  # answer tokens so far (the last is the root)
        truth = self.answer[done:done + max(budget - 1, 0)]
        wrong = [(self.answer[done] + 1) % VOCAB] if done < len(self.answer) else []
        return build_trie(context[-1], [wrong, truth] if truth else [], budget)


def test_accepted_draft_paths_are_committed_in_a_mixed_batch(library, reference):
    # back_off=False: every draft is verified (the back-off would first want to see drafts pay)
    engine = make_engine(library, max_batched_tokens=64,
                         speculative=SpeculativeOptions("prompt-lookup", back_off=False))
    prompt, plain, late = prompts(15, [14, 30, 70])
    answer = reference(prompt, 20)
    engine._drafter = OracleDrafter(prompt, answer)
    spec = engine.submit(prompt, greedy(20), speculative=True)
    other = engine.submit(plain, greedy(20))
    engine.step()
    third = engine.submit(late, greedy(5))  # its prompt chunks run beside the verify steps
    steps = 1
    while not spec.finished:
        engine.step()
        steps += 1
    run_all(engine)
    assert engine.accepted >= 10 and steps <= 10  # plain decoding: 20 steps
    assert spec.stream.result().tokens == answer
    assert other.stream.result().tokens == reference(plain, 20)
    assert third.stream.result().tokens == reference(late, 5)
    assert_no_leak(engine)


def test_stop_token_ids_and_the_model_stop_tokens_end_a_request(library, reference):
    engine = make_engine(library)
    prompt = prompts(11, [10])[0]
    expected = reference(prompt, 8)
    stop_at = expected[3]
    request = engine.submit(prompt, SamplingOptions(temperature=0, max_tokens=8, stop_token_ids=[stop_at],
                                                    ignore_eos=True))
    run_all(engine)
    out = request.stream.result()
    assert out.finish_reason == "stop" and out.tokens == expected[:expected.index(stop_at)]
    assert_no_leak(engine)


def test_seeded_sampling_does_not_depend_on_the_batch(library):
    prompt = prompts(12, [15])[0]
    options = SamplingOptions(temperature=1.0, top_p=0.9, seed=42, max_tokens=12, ignore_eos=True)
    alone = make_engine(library)
    first = alone.submit(prompt, options)
    run_all(alone)
    crowded = make_engine(library)
    noise = [crowded.submit(p, SamplingOptions(temperature=1.0, seed=i, max_tokens=12, ignore_eos=True))
             for i, p in enumerate(prompts(13, [30, 7, 50]))]
    second = crowded.submit(prompt, options)
    run_all(crowded)
    assert first.stream.result().tokens == second.stream.result().tokens
    assert all(len(n.stream.result().tokens) == 12 for n in noise)


def test_refusals(library):
    engine = make_engine(library, max_queue=2)
    with pytest.raises(RequestError, match="context window") as err:
        engine.submit([5] * 250, greedy(10))
    assert err.value.status == 413
    with pytest.raises(RequestError, match="outside the vocabulary") as err:
        engine.submit([5, VOCAB], greedy())
    assert err.value.status == 400
    with pytest.raises(RequestError, match="at least one token"):
        engine.submit([], greedy())
    engine.submit([5, 6], greedy())
    engine.submit([5, 7], greedy())
    with pytest.raises(RequestError, match="queue is full") as err:
        engine.submit([5, 8], greedy())
    assert err.value.status == 429
    small = make_engine(library, max_total_tokens=64)
    with pytest.raises(RequestError, match="KV cache pool") as err:
        small.submit([5] * 40, greedy(30))
    assert err.value.status == 413
    run_all(engine)
    assert_no_leak(engine)


def test_background_loop_serves_threads_and_drains(library, reference):
    engine = make_engine(library, max_batched_tokens=32)
    engine.start()
    work = prompts(14, [9, 33, 61, 4, 17, 45])
    results = {}

    def client(i):
        request = engine.submit(work[i], greedy())
        results[i] = [e for e in request.stream]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(work))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    engine.drain(grace_s=5)
    for i, events in results.items():
        assert events[-1].output.tokens == reference(work[i])
        assert [t for e in events for t in e.tokens] == reference(work[i])
    with pytest.raises(RequestError) as err:
        engine.submit(work[0], greedy())
    assert err.value.status == 503
    assert_no_leak(engine)


# ---------------------------------------------------------------------- pure pieces

def test_text_stream_holds_back_a_possible_stop_string():
    pieces = {1: "Hel", 2: "lo", 3: " wo", 4: "rld", 5: "!", 6: "\n"}

    def decode(ids):
        return "".join(pieces[i] for i in ids)

    stream = TextStream(decode, ("world",))
    out = [stream.push([t]) for t in (1, 2, 3)]
    assert out == ["Hel", "lo", " "]  # " wo" could start "world": only " " is safe
    assert stream.push([4]) == "" and stream.stopped and stream.answer() == "Hello "
    plain = TextStream(decode, ("xyz",))
    assert "".join(plain.push([t]) for t in (1, 2, 3, 4, 5)) + plain.flush() == "Hello world!"


def test_text_stream_waits_for_whole_characters():
    stream = TextStream(lambda ids: b"".join(bytes([i]) for i in ids).decode("utf-8", errors="replace"))
    euro = "€".encode()
    assert stream.push([euro[0]]) == "" and stream.push([euro[1]]) == ""
    assert stream.push([euro[2]]) == "€"


def test_radix_tree_splits_edges_and_evicts_least_recently_used_leaves():
    forks, removed = [], []
    ids = iter(range(100, 200))
    tree = RadixPrefixCache(4, 10, fork=lambda p, c, n: forks.append((p, c, n)), remove=removed.append,
                            free_pages=lambda: 0, new_id=lambda: next(ids))
    a = list(range(12))
    tree.insert(a + [99], seq_id=1)  # 12 tokens: three pages
    assert forks == [(1, 100, 12)]
    assert tree.match(a + [5, 6]) [1] == 12
    b = a[:8] + [50, 51, 52, 53]
    tree.insert(b, seq_id=2)  # shares two pages: the edge splits at 8
    assert forks[1] == (100, 101, 8) and forks[2] == (2, 102, 12)
    node, n = tree.match(b[:10])
    assert n == 8 and node.seq_id == 101
    node, n = tree.match(a[:6])
    assert n == 4 and node.seq_id == 101  # mid-edge: the node's sequence holds the prefix
    tree.match(a)  # a's leaf is now the most recent
    assert tree.evict_one() and removed == [102]
    assert tree.evict_one() and removed == [102, 100]
    assert tree.evict_one() and removed == [102, 100, 101] and not tree.evict_one()


@pytest.mark.gpu
def test_cuda_engine_replays_decode_graphs_and_keeps_the_greedy_tokens(tmp_path):
    from test_weights import write_tiny_gguf

    from tvmattn.build import compile_model

    write_tiny_gguf(tmp_path / "tiny.gguf", np.random.default_rng(7))
    library = compile_model(str(tmp_path / "tiny.gguf"), tmp_path / "tiny.so", target="cuda", max_batch_size=8,
                            prefill_chunk=64, log=lambda _m: None).library
    engine = make_engine(library, max_batched_tokens=32)
    assert engine.runner.session.uses_cuda_graph
    reference_generator = Generator(library, cuda_graph=False)
    reference_generator.stop_ids = set()
    work = prompts(16, [5, 40, 90, 12, 33])
    requests = [engine.submit(p, greedy(16)) for p in work]
    run_all(engine)
    assert engine.runner.session.graphs.replays > 0
    scorer = ModelSession(library, cuda_graph=False)
    scorer.create_cache(1, 256)
    exact = 0
    for prompt, request in zip(work, requests):
        expected = reference_generator.generate_tokens([prompt], 16).tokens[0]
        exact += assert_greedy_up_to_a_near_tie(scorer, prompt, request.stream.result().tokens, expected)
    assert exact >= len(work) - 1
    assert_no_leak(engine)


def assert_greedy_up_to_a_near_tie(session: ModelSession, prompt: list[int], got: list[int], expected: list[int],
                                   tolerance: float = 0.05) -> bool:
    """float16 greedy tokens of a batched run (`got`) against a solo run's (`expected`): equal,
    or parting where the solo run's two best logits are within `tolerance` and `got` took the
    other one (batching changes float16 rounding; the continuations then differ). -> equal?"""
    assert len(got) == len(expected)
    part = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), None)
    if part is None:
        return True
    session.add_sequence(0)
    logits = session.prefill([0], [prompt + expected[:part]])[0].astype(np.float64)
    session.remove_sequence(0)
    top = logits.max()
    assert top - logits[expected[part]] <= tolerance and top - logits[got[part]] <= tolerance, (
        f"token {part}: got {got[part]} (logit {logits[got[part]]:.4f}), the solo run took {expected[part]} "
        f"(logit {logits[expected[part]]:.4f}), the best logit is {top:.4f}: not a near tie")
    return False


@pytest.mark.parametrize("pool_pages, budget, lengths, new", [(8, 16, [60, 60, 50], 20), (6, 8, [40, 45, 30, 20], 30),
                                                              (10, 64, [70, 10, 70, 10], 40)])
def test_over_committed_prefills_and_decodes_all_finish(library, reference, pool_pages, budget, lengths, new):
    engine = make_engine(library, max_total_tokens=pool_pages * 16, max_batched_tokens=budget)
    work = prompts(sum(lengths), lengths)
    requests = [engine.submit(p, greedy(new)) for p in work]
    run_all(engine, limit=5000)
    for prompt, request in zip(work, requests):
        assert request.stream.result().tokens == reference(prompt, new)
    assert_no_leak(engine)


def test_page_pool_is_sized_from_memory_or_tokens(library):
    from tvmattn.generate import GenerateError

    per_token = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads, head dim 16, float32
    runner = ModelRunner(library, kv_cache_memory="64KiB")
    assert runner.bytes_per_token() == per_token
    # the cache sizes its pool as TVM does: the tokens' pages plus one
    assert runner.total_tokens == 65536 // per_token and runner.num_pages == runner.total_tokens // 16 + 1
    assert ModelRunner(library, max_total_tokens=100).total_tokens == 112  # whole pages
    assert ModelRunner(library).total_tokens == 8 * 256  # max batch size x context window
    assert ModelRunner(library, kv_cache_memory=0.0001).total_tokens > 0
    for kwargs, message in ((dict(kv_cache_memory="lots"), "kv-cache-memory"),
                            (dict(kv_cache_memory=100), "less than one page"),
                            (dict(max_total_tokens=4), "max-total-tokens"),
                            (dict(max_total_tokens=64, kv_cache_memory="1MiB"), "not both")):
        with pytest.raises(GenerateError, match=message):
            ModelRunner(library, **kwargs)


# ---------------------------------------------------------------------- device sampling

SAMPLED = [dict(temperature=0.0), dict(temperature=1.0, seed=1), dict(temperature=0.8, top_p=0.9, seed=2),
           dict(temperature=1.2, top_k=7, seed=3),
           dict(temperature=1.0, top_k=20, top_p=0.8, seed=4, presence_penalty=0.6, frequency_penalty=0.4),
           dict(temperature=0.0, frequency_penalty=1.5), dict(temperature=0.9, seed=5, logprobs=True, top_logprobs=2)]


def sampled_run(library, sampling: str, keep_last: bool = False):
    """Every option set of SAMPLED at once (prompts of several chunks beside decode steps), then
    the engine and each request's (tokens, logprobs)."""
    engine = make_engine(library, max_batched_tokens=24, sampling=sampling)
    work = prompts(40, [9, 50, 3, 31, 17, 70, 5])
    requests = [engine.submit(p, SamplingOptions(max_tokens=14, ignore_eos=True, **o),
                              keep_logits=keep_last and i == len(work) - 1)
                for i, (p, o) in enumerate(zip(work, SAMPLED))]
    run_all(engine)
    outputs = [r.stream.result() for r in requests]
    assert_no_leak(engine)
    return engine, requests, [(o.tokens, o.logprobs) for o in outputs]


def test_device_and_host_sampling_give_the_same_tokens(library, reference):
    """Greedy, temperature, top-k, top-p and penalties chosen by the library's kernels give the
    host sampler's tokens for the same seeds; the logprobs request (a host fallback row) gets
    the same tokens and records; only token ids come back for the device rows."""
    host, _, expected = sampled_run(library, "host")
    device, requests, got = sampled_run(library, "device")
    assert host.sampling == "host" and device.sampling == "device"
    assert got == expected
    assert got[0][0] == reference(prompts(40, [9])[0], 14)
    total = sum(len(tokens) for tokens, _ in got)
    logprob_tokens = len(got[-1][0])
    assert host.sampled_on_device == 0 and host.sampled_on_host == total
    assert device.sampled_on_host == logprob_tokens and device.sampled_on_device == total - logprob_tokens
    assert all(r.kept is None for r in requests)


def test_kept_logits_come_back_whole_and_unpenalized(library):
    """A request that keeps its logits is sampled on the host from the whole row, as the library
    returned it (the kernels penalize rows in place: the kept row is read before)."""
    _, host_requests, expected = sampled_run(library, "host", keep_last=True)
    device, requests, got = sampled_run(library, "device", keep_last=True)
    assert got == expected
    np.testing.assert_array_equal(np.stack(requests[-1].kept), np.stack(host_requests[-1].kept))


def test_auto_sampling_picks_the_host_on_the_cpu_the_device_elsewhere(library, monkeypatch):
    assert make_engine(library).sampling == "host"  # the logits already are in host memory
    assert make_engine(library, sampling="device").sampling == "device"
    runner = ModelRunner(library)
    monkeypatch.setattr(runner.session, "on_cpu", False)  # as on CUDA
    assert Engine(runner).sampling == "device"


def test_bad_sampling_modes_are_refused(library, monkeypatch):
    with pytest.raises(ValueError, match="sampling must be one of"):
        make_engine(library, sampling="gpu")
    runner = ModelRunner(library)
    monkeypatch.setattr(runner.session, "device_sampler", lambda: None)  # a library compiled before the kernels
    assert Engine(runner).sampling == "host"
    with pytest.raises(ValueError, match="sampling='device': .* has no sampling kernels"):
        Engine(runner, sampling="device")


@pytest.mark.parametrize("keep", [False, True], ids=["ids-only", "kept-logits"])
def test_verify_steps_choose_on_the_device_like_the_host(library, keep):
    """Speculative trees verified beside sampled and logprobs requests: the draft nodes'
    argmaxes and the plain rows' choices come from the kernels (no row read back unless its
    request keeps logits or asks logprobs), the same tokens, accepted drafts and logprobs as
    the host path's."""
    def run(sampling):
        engine = make_engine(library, max_batched_tokens=64, sampling=sampling,
                             speculative=SpeculativeOptions("prompt-lookup", back_off=False))
        repetitive = prompts(9, [12])[0] * 4
        work = [(repetitive, greedy(14), True), (prompts(44, [20])[0], SamplingOptions(
            temperature=0.9, top_k=30, seed=8, max_tokens=14, ignore_eos=True), False),
            (prompts(45, [7])[0], SamplingOptions(temperature=0, logprobs=True, max_tokens=14, ignore_eos=True), False)]
        requests = [engine.submit(p, o, speculative=spec, keep_logits=keep and spec) for p, o, spec in work]
        run_all(engine)
        assert_no_leak(engine)
        outputs = [r.stream.result() for r in requests]
        kept = np.stack(requests[0].kept) if keep else None
        return engine, [(o.tokens, o.logprobs) for o in outputs], kept, requests[0].stats

    host, expected, host_kept, host_stats = run("host")
    device, got, kept, stats = run("device")
    assert got == expected and stats == host_stats and stats.verify_steps > 0 and device.drafted > 0
    total = sum(len(tokens) for tokens, _ in got)
    on_host = len(got[2][0]) + (len(got[0][0]) if keep else 0)  # logprobs rows, kept rows
    assert (device.sampled_on_device, device.sampled_on_host) == (total - on_host, on_host)
    if keep:
        np.testing.assert_array_equal(kept, host_kept)


def poison(engine: Engine, request_index: int, step: int):
    """Make the runner's logits row of the request with that submission index NaN at its
    `step`-th step (the library's own tensor, as NaN weights would), in steps of host ids and
    in lookahead steps fed the device's."""
    seen = collections.Counter()

    def poisoned(original):
        def run(seq_ids, inputs, on_host=False):
            logits = original(seq_ids, inputs, on_host) if on_host else original(seq_ids, inputs)
            rows = logits if on_host else np.from_dlpack(logits).reshape(len(seq_ids), -1)
            for i, seq_id in enumerate(seq_ids):
                request = next(r for r in engine.running if r.seq_id == seq_id)
                if request.id == request_index:
                    seen[request.id] += 1
                    if seen[request.id] == step:
                        rows[i, 5] = np.nan
            return logits
        return run

    mixed = poisoned(engine.runner.mixed)
    engine.runner.mixed = lambda seq_ids, chunks, on_host=True: mixed(seq_ids, chunks, on_host)
    engine.runner.decode_fed = poisoned(engine.runner.decode_fed)


@pytest.mark.parametrize("step, kind", [(1, "prefill"), (2, "prefill"), (4, "decode"), (6, "decode")])
def test_nan_logits_fail_with_the_same_error_on_device_and_host(library, step, kind):
    """A NaN in a row of logits, one that chooses a token or a prompt chunk's that does not, is
    the same GenerateError on the device as on the host, and in lookahead steps (whose next
    step already took the NaN row's token, as id 0): the kernel flags the row."""
    from tvmattn.generate import GenerateError

    messages = []
    for sampling, lookahead in (("host", False), ("device", False), ("device", True)):
        engine = make_engine(library, max_batched_tokens=24, sampling=sampling, lookahead=lookahead)
        work = prompts(41, [40, 6])  # the first prompt takes two steps: a chunk that chooses nothing, then one
        requests = [engine.submit(p, SamplingOptions(temperature=0.7, seed=1, max_tokens=8, ignore_eos=True))
                    for p in work]
        poison(engine, requests[0].id, step)
        with pytest.raises(GenerateError, match=f"logits are not finite at step \\d+ \\({kind}\\) of request") as err:
            run_all(engine)
        messages.append(str(err.value).replace(f"request {requests[0].id}", "request R"))
    assert messages[0] == messages[1]


@pytest.fixture(scope="module")
def cuda_library(tmp_path_factory):
    from test_weights import write_tiny_gguf

    from tvmattn.build import compile_model

    folder = tmp_path_factory.mktemp("cuda-tiny")
    write_tiny_gguf(folder / "tiny.gguf", np.random.default_rng(7))
    return compile_model(str(folder / "tiny.gguf"), folder / "tiny.so", target="cuda", max_batch_size=8,
                         prefill_chunk=64, log=lambda _m: None).library


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graph", [True, False])
def test_cuda_engine_samples_on_the_device_like_the_host(cuda_library, cuda_graph):
    """On CUDA (graph replays or eager steps) the device sampler gives the host sampler's tokens
    for every option set, reads the ids back through pinned memory, and only the logprobs
    request's rows come to the host."""
    from tvmattn.device_sampling import _AsyncReadback

    def run(sampling):
        engine = Engine(ModelRunner(cuda_library, cuda_graph=cuda_graph), max_batched_tokens=24, sampling=sampling)
        work = prompts(42, [9, 50, 3, 31, 17, 70, 5])
        requests = [engine.submit(p, SamplingOptions(max_tokens=20, ignore_eos=True, **o))
                    for p, o in zip(work, SAMPLED)]
        run_all(engine)
        assert_no_leak(engine)
        return engine, [(r.stream.result().tokens, r.stream.result().logprobs) for r in requests]

    host, expected = run("host")
    device, got = run("device")
    assert device.sampling == "device" and isinstance(device._sampler._readback, _AsyncReadback)
    assert device.runner.session.uses_cuda_graph == cuda_graph
    assert got == expected
    total = sum(len(tokens) for tokens, _ in got)
    assert device.sampled_on_host == len(got[-1][0]) and device.sampled_on_device == total - len(got[-1][0])
    assert host.sampled_on_device == 0


@pytest.mark.gpu
def test_cuda_generator_greedy_and_seeded_tokens_do_not_depend_on_the_sampler(cuda_library):
    work = prompts(43, [5, 40, 90, 12])
    answers = {}
    for sampling in ("host", "device"):
        generator = Generator(cuda_library, sampling=sampling)
        generator.stop_ids = set()
        answers[sampling] = [generator.generate_tokens(work, 24, temperature=t, top_p=0.9, seed=7).tokens
                             for t in (0.0, 1.0)]
    assert answers["device"] == answers["host"]


# ------------------------------------------------------------------ lookahead
def lookahead_run(library, lookahead: bool, **engine_args):
    """Requests joining at different steps with every device-served option set (greedy, seeded
    temperature, top-p, top-k), short and long answers, a shared system prompt, and a
    penalized request (no lookahead while it runs) -> the engine and each request's (tokens,
    finish reason)."""
    engine = make_engine(library, max_batched_tokens=24, sampling="device", lookahead=lookahead, **engine_args)
    system = prompts(50, [20])[0]
    work = [(system + p, o) for p, o in zip(prompts(51, [5, 9, 3, 12]), [
        SamplingOptions(temperature=0, max_tokens=30, ignore_eos=True),
        SamplingOptions(temperature=1.0, seed=3, max_tokens=25, ignore_eos=True),
        SamplingOptions(temperature=0.8, top_p=0.9, seed=4, max_tokens=40, ignore_eos=True),
        SamplingOptions(temperature=1.1, top_k=9, seed=5, max_tokens=3, ignore_eos=True)])]
    late = [(p, SamplingOptions(temperature=0, max_tokens=12, ignore_eos=True)) for p in prompts(52, [7, 30])]
    late.append((prompts(53, [6])[0], SamplingOptions(temperature=0.7, seed=6, presence_penalty=0.5, max_tokens=6,
                                                      ignore_eos=True)))
    requests = [engine.submit(p, o) for p, o in work]
    for _ in range(12):  # the first requests reach steady decoding before the others join
        engine.step()
    requests += [engine.submit(p, o) for p, o in late]
    run_all(engine)
    # the same prompts again, after the first answers were recorded in the prefix cache
    requests += [engine.submit(p, o) for p, o in work[:2]]
    run_all(engine)
    assert_no_leak(engine)
    return engine, [(r.stream.result().tokens, r.stream.result().finish_reason) for r in requests]


def test_lookahead_steps_give_the_tokens_of_steps_that_wait(library):
    """Launching each decode step before the previous one's tokens are read changes nothing a
    request sees: the same tokens and finish reasons as waiting for each step, for greedy and
    seeded sampling, requests joining mid-stream, penalized requests beside them and prompts
    found again in the prefix cache; the tokens computed past a request's end are dropped and
    no page leaks."""
    waiting, expected = lookahead_run(library, lookahead=False)
    ahead, got = lookahead_run(library, lookahead=True)
    assert got == expected
    assert waiting.lookahead_steps == 0 and ahead.lookahead_steps > 20
    assert ahead.lookahead_dropped == 0  # every request ends by length, which lookahead foresees
    assert ahead.generated_tokens == waiting.generated_tokens


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graph", [True, False], ids=["graphs", "eager"])
def test_cuda_lookahead_steps_give_the_tokens_of_steps_that_wait(cuda_library, cuda_graph):
    """On CUDA (lookahead on by default): the sampled ids feed the next step on the device,
    into the replayed graph's input buffer or the eager step's, with the tokens of an engine
    that waits for every step; with graphs every lookahead step samples inside its graph (the
    library's `sample` as the graph's last kernel, its parameters uploaded into the graph's buffer)."""
    waiting, expected = lookahead_run(cuda_library, lookahead=False, cuda_graph=cuda_graph)
    ahead, got = lookahead_run(cuda_library, lookahead=None, cuda_graph=cuda_graph)
    assert ahead.lookahead and ahead.runner.session.uses_cuda_graph == cuda_graph
    assert got == expected and ahead.lookahead_steps > 20
    assert ahead.graph_sampled_steps == (ahead.lookahead_steps if cuda_graph else 0)
    assert waiting.graph_sampled_steps == 0


def test_lookahead_past_a_stop_token_pops_the_extra_token(library, reference):
    """A stop token read after the next step was launched: the request ends with the tokens of
    a waiting engine, its extra cache token is popped before its sequence is shared, and a
    request continuing the same text from the prefix cache gets the reference tokens."""
    prompt = prompts(54, [35])[0]
    expected = reference(prompt, 20)
    stop_at = next(t for t in expected[4:] if t not in expected[:4])
    options = SamplingOptions(temperature=0, max_tokens=20, stop_token_ids=[stop_at], ignore_eos=True)
    outputs = []
    for lookahead in (False, True):
        engine = make_engine(library, sampling="device", lookahead=lookahead)
        request = engine.submit(prompt, options)
        bystander = engine.submit(prompts(55, [9])[0], greedy(20))
        run_all(engine)
        out = request.stream.result()
        assert out.finish_reason == "stop" and out.tokens == expected[:expected.index(stop_at)]
        assert engine.lookahead_dropped == (1 if lookahead else 0)
        follow = prompt + out.tokens
        again = engine.submit(follow, greedy(6))
        run_all(engine)
        # the popped sequence was recorded: its whole pages (all but the last token) are found
        assert again.stream.result().cached_tokens == min(len(follow) // 16 * 16, len(follow) - 1) >= 32
        assert again.stream.result().tokens == reference(follow, 6)
        outputs.append((out.tokens, bystander.stream.result().tokens))
        assert_no_leak(engine)
    assert outputs[0] == outputs[1]


def test_cancelling_during_lookahead_frees_the_pages(library, reference):
    engine = make_engine(library, sampling="device", lookahead=True)
    work = prompts(56, [14, 22, 8])
    requests = [engine.submit(p, greedy(30)) for p in work]
    while engine.lookahead_steps < 3:
        engine.step()
    engine.cancel(requests[1])
    run_all(engine)
    assert requests[1].stream.result().finish_reason == "cancelled"
    for i in (0, 2):
        assert requests[i].stream.result().tokens == reference(work[i], 30)
    assert_no_leak(engine)


def test_decode_steps_take_the_previous_steps_sampled_ids_on_the_device(library):
    """ModelSession.decode_step fed a device tensor of ids (a `sample` output, NON_FINITE rows
    read as id 0) gives the logits of the same ids sent from the host."""
    import tvm

    runner = ModelRunner(library)
    session = runner.session
    assert session.feeds_tokens
    work = prompts(57, [6, 10, 3])
    logits = {}
    for fed in (False, True):
        for seq_id, prompt in enumerate(work):
            runner.add(seq_id)
            runner.mixed([seq_id], [prompt])
        ids = [17, -1, 200]
        tokens = tvm.runtime.tensor(np.array(ids, np.int32), session.device) if fed else [17, 0, 200]
        logits[fed] = session.decode_step([0, 1, 2], tokens)
        for seq_id in range(len(work)):
            runner.remove(seq_id)
    np.testing.assert_array_equal(logits[True], logits[False])
    with pytest.raises(ValueError, match="tokens: expected an int32 tensor of shape \\(2,\\)"):
        session.decode_step([0, 1], tvm.runtime.tensor(np.zeros(3, np.int32), session.device))


def test_lookahead_needs_device_sampling_and_the_feed_function(library, monkeypatch):
    assert make_engine(library, sampling="device").lookahead is False  # the CPU: nothing to overlap
    runner = ModelRunner(library)
    monkeypatch.setattr(runner.session, "on_cpu", False)  # as on CUDA
    assert Engine(runner).lookahead is True
    with pytest.raises(ValueError, match="lookahead needs sampling on the device"):
        make_engine(library, sampling="host", lookahead=True)
    with pytest.raises(ValueError, match="lookahead must be True, False or None"):
        make_engine(library, sampling="device", lookahead="yes")
    runner = ModelRunner(library)
    functions = [f for f in runner.session.metadata["functions"] if f != "feed_tokens"]
    monkeypatch.setitem(runner.session.metadata, "functions", functions)  # a library compiled before it
    monkeypatch.setattr(runner.session, "on_cpu", False)
    assert Engine(runner).lookahead is False
    with pytest.raises(ValueError, match="exports feed_tokens: .* compiled before it; recompile"):
        Engine(runner, sampling="device", lookahead=True)
    runner = ModelRunner(library)
    monkeypatch.setitem(runner.session.metadata, "kv_cache", {**runner.session.metadata["kv_cache"], "kind": "tvm"})
    monkeypatch.setattr(runner.session, "on_cpu", False)
    assert Engine(runner).lookahead is False  # TVM's stock cache: its plan uploads must not run ahead
    with pytest.raises(ValueError, match="lookahead needs tvmattn's KV cache"):
        Engine(runner, sampling="device", lookahead=True)
    runner = ModelRunner(library)
    monkeypatch.setattr(runner.session, "on_cpu", False)
    monkeypatch.setattr(runner.cache, "backend", "flashinfer")
    assert Engine(runner).lookahead is False
    with pytest.raises(ValueError, match="lookahead needs tvmattn's TIR kernels \\(this cache runs the flashinfer"):
        Engine(runner, sampling="device", lookahead=True)


def test_decode_sampled_refuses_a_session_that_does_not_sample_in_a_graph(library):
    """On the CPU (no CUDA graphs) there is no graph parameter buffer, and decode_sampled is a
    GenerateError that runs nothing: no graphs made, the sequence's length unchanged."""
    from tvmattn.generate import GenerateError

    session = ModelSession(library)
    session.create_cache(2, 128)
    session.add_sequence(0)
    session.prefill([0], [[5, 6, 7]])
    assert not session.samples_in_graph and session.graph_sample_params(1) is None
    pages = session.available_pages()
    with pytest.raises(GenerateError, match="decode_sampled: this session's decode steps do not sample in a CUDA "
                                            r"graph \(samples_in_graph is False\)"):
        session.decode_sampled([0], [3])
    assert session.graphs is None and session.available_pages() == pages
    session.decode_step([0], [3])  # the sequence takes its next token as if nothing had happened
