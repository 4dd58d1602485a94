"""A Llama-family library with alternating sliding-window layers (Gemma-2's pattern, Mistral's
window) against an independent float64 torch model, on the CPU (llvm, float32) and on CUDA (fp16).

The library is compiled once by `compile_model` from the example config
(scripts/sliding-window-tiny-config.json: 3 layers, window 8, sliding_window_pattern 2, so
layers 0 and 2 slide) with random parameters (`--random-weights`), turned back into HF tensors
for the torch model (qkv_proj split into q, k, v; gate_up_proj into gate, up).

The torch model is the Llama one of test_model.py with an explicit mask per layer: a query at
position p of a sliding layer sees the keys j with p - window < j <= p (HF's Mistral / Gemma-2
sliding mask), a full layer every j <= p. No KV cache there: every step recomputes the whole
sequence. Prompts and answers run past the window (8 tokens, half a page), so the windows
change the logits. The library's cache gets the layer kinds MHA_SLIDING / MHA in its create
call (TVM's attn_kinds) and the window as cache_config's sixth value.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import tvm

import tvmattn  # noqa: F401  - registers the tvmattn.* functions the library calls
from test_model import (LOGITS_TOLERANCE, PAGE_SIZE, Session, TorchLlama, load_bundle, random_hf_weights, run_batch,
                        run_single)
from tvmattn.build import compile_model
from tvmattn.generate import Generator
from tvmattn.models import ModelConfig, ModelConfigError, compile_library, pack_params
from tvmattn.models.config import model_config_from_hf
from tvmattn.runtime.ffi import AttnKind

CONFIG_FILE = Path(__file__).resolve().parent.parent / "scripts" / "sliding-window-tiny-config.json"
SLIDING = json.loads(CONFIG_FILE.read_text())
WINDOW = SLIDING["sliding_window"]


class TorchSlidingLlama(TorchLlama):
    """TorchLlama with per-layer masks: windowed causal on the sliding layers."""

    def __init__(self, hf: dict, weights: dict[str, np.ndarray], sliding: tuple[bool, ...], window: int):
        super().__init__(hf, weights)
        self.sliding, self.window = sliding, window

    def mask(self, n: int, layer: int) -> torch.Tensor:
        """[n, n] bool: query p sees key j."""
        p, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        visible = j <= p
        return visible & (p - j < self.window) if self.sliding[layer] else visible


def hf_weights(hf: dict, named: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The library's parameters as HF tensors (fused projections split)."""
    d = hf["hidden_size"] // hf["num_attention_heads"]
    q_rows, kv_rows = hf["num_attention_heads"] * d, hf["num_key_value_heads"] * d
    out = {}
    for name, value in named.items():
        value = value.astype(np.float32)
        if name.endswith("qkv_proj.weight"):
            parts = np.split(value, [q_rows, q_rows + kv_rows])
            out.update({name.replace("qkv_proj", f"{x}_proj"): part for x, part in zip("qkv", parts)})
        elif name.endswith("gate_up_proj.weight"):
            gate, up = np.split(value, 2)
            out.update({name.replace("gate_up_proj", "gate_proj"): gate, name.replace("gate_up_proj", "up_proj"): up})
        else:
            out[name] = value
    return out


class SlidingModel:
    """A bundle from compile_model with random parameters, loaded into a VM, and the torch model
    on the same weights (Session's interface: params, device, kv_cache, tolerance, torch)."""

    def __init__(self, folder: Path, seed: int, target: str = "llvm", dtype: str = "float32"):
        self.lib = folder / "model.so"
        compile_model(str(CONFIG_FILE), self.lib, target=target, dtype=dtype, page_size=PAGE_SIZE, max_batch_size=4,
                      context_window=256, prefill_chunk=64, random_weights=seed, log=lambda m: None)
        self.kv_cache = "tvmattn"
        self.config = ModelConfig.from_hf(SLIDING)
        self.device = tvm.cpu() if target == "llvm" else tvm.cuda()
        self.tolerance = LOGITS_TOLERANCE[dtype]
        self.vm, self.metadata, self.params, named = load_bundle(self.lib, self.device)
        self.torch = TorchSlidingLlama(SLIDING, hf_weights(SLIDING, named), self.config.sliding_layers, WINDOW)

    def session(self) -> Session:
        return Session(self, vm=self.vm)


class StockSlidingModel:
    """The same model on TVM's C++ cache (compile_library, HF random weights packed)."""

    def __init__(self, seed: int):
        self.kv_cache = "tvm"
        self.device = tvm.cpu()
        self.tolerance = LOGITS_TOLERANCE["float32"]
        self.library = compile_library(ModelConfig.from_hf(SLIDING), page_size=PAGE_SIZE, kv_cache="tvm")
        weights = random_hf_weights(SLIDING, seed)
        self.params = pack_params(self.library.metadata, weights)
        self.torch = TorchSlidingLlama(SLIDING, weights, ModelConfig.from_hf(SLIDING).sliding_layers, WINDOW)


@pytest.fixture(scope="module")
def sliding_model(tmp_path_factory) -> SlidingModel:
    return SlidingModel(tmp_path_factory.mktemp("sliding"), seed=3)


@pytest.fixture(scope="module")
def stock_sliding_model() -> StockSlidingModel:
    return StockSlidingModel(seed=3)


PROMPT = [5, 17, 99, 3, 42, 64, 7, 120, 1, 33, 18, 77, 2, 90, 11, 54, 26, 8, 71]  # 19 > WINDOW, crosses a page
PROMPTS = [[9, 4, 100, 23, 61], [12, 80, 3, 3, 45, 127, 0, 66, 19, 101, 38, 7, 56]]


def test_config_reads_the_layer_pattern():
    config = ModelConfig.from_hf(SLIDING)
    assert config.sliding_layers == (True, False, True)
    mistral = ModelConfig.from_hf({**SLIDING, "model_type": "mistral", "sliding_window_pattern": None})
    assert mistral.sliding_layers == (True, True, True)
    explicit = ModelConfig.from_hf({**SLIDING, "layer_types": ["full_attention", "sliding_attention",
                                                               "full_attention"]})
    assert explicit.sliding_layers == (False, True, False)
    qwen = ModelConfig.from_hf({**SLIDING, "model_type": "qwen2", "sliding_window_pattern": None})
    assert qwen.sliding_layers == (False, False, False), "Qwen2's use_sliding_window defaults to false"
    with pytest.raises(ModelConfigError, match="layer_types"):
        ModelConfig.from_hf({**SLIDING, "layer_types": ["full_attention"]})
    with pytest.raises(ModelConfigError, match="layer_types"):
        ModelConfig.from_hf({**SLIDING, "layer_types": ["local"] * 3})
    with pytest.raises(ModelConfigError, match="soft-capping"):
        model_config_from_hf({**SLIDING, "model_type": "gemma2"})


def test_cache_spec_names_the_layer_kinds():
    """The create call's attn_kinds and window come from the config (the metadata records them)."""
    from tvmattn.models import BuildOptions

    spec = BuildOptions().cache_spec(ModelConfig.from_hf(SLIDING))
    assert spec.attn_kinds == [AttnKind.MHA_SLIDING, AttnKind.MHA, AttnKind.MHA_SLIDING]
    assert spec.to_dict()["sliding_window"] == WINDOW and spec.to_dict()["sliding_layers"] == [True, False, True]


def test_prefill_then_decode_matches_torch(sliding_model):
    """A prompt past the window, then decode steps: every step's logits against torch."""
    run_single(sliding_model.session(), PROMPT, steps=6)


def test_batch_of_different_lengths_matches_torch(sliding_model):
    """batch_prefill scores every position of a 5- and a 13-token prompt, then batch_decode."""
    run_batch(sliding_model.session(), PROMPTS, steps=6)


def test_chunked_prefill_matches_torch(sliding_model):
    """A prompt in three prefill chunks (history inside and outside the window) then decode."""
    session = sliding_model.session()
    session.add(0)
    for chunk in (PROMPT[:5], PROMPT[5:14], PROMPT[14:]):
        logits = session.prefill(0, chunk)
        np.testing.assert_allclose(logits, sliding_model.torch.logits(session.tokens[0])[-1],
                                   **sliding_model.tolerance, err_msg=f"chunk ending at {len(session.tokens[0])}")
    for step in range(3):
        logits = session.decode(0, int(np.argmax(logits)))
        np.testing.assert_allclose(logits, sliding_model.torch.logits(session.tokens[0])[-1],
                                   **sliding_model.tolerance, err_msg=f"decode step {step}")


@pytest.mark.slow  # a library of its own
def test_stock_cache_matches_torch_within_the_window(stock_sliding_model):
    """TVM's C++ cache with the same kinds: a prompt no longer than the window, then decode
    steps that slide it (TVM's prefill attends to all new tokens of a chunk, so a prompt longer
    than the window is not compared there)."""
    run_single(Session(stock_sliding_model), PROMPT[:WINDOW], steps=8)


def test_generator_runs_the_bundle(sliding_model):
    """Generator answers one prompt past the window and a batch; every logits row against torch."""
    generator = Generator(sliding_model.lib)
    for prompts in ([PROMPT], PROMPTS):
        result = generator.generate_tokens(prompts, max_new_tokens=6, keep_logits=True)
        for prompt, tokens, rows in zip(prompts, result.tokens, result.logits):
            assert tokens == [int(np.argmax(row)) for row in rows] and len(tokens) == 6
            expected = sliding_model.torch.logits(prompt + tokens[:-1])[len(prompt) - 1:]
            np.testing.assert_allclose(rows, expected, **sliding_model.tolerance)


def test_graph_planned_decode_steps_match_torch(sliding_model):
    """What a CUDA graph replays, run eagerly on the CPU: the library's decode step
    (session.library_decode_step: `decode_step`, or `embed` + `decode` at one row) over steps
    planned by begin_graph_decode in padded buckets, past the window; each real row's logits
    against torch."""
    from tvmattn.runtime.graphs import bucket_of, buckets_for
    from tvmattn.session import library_decode_step

    session = sliding_model.session()
    prompts = [PROMPT, *PROMPTS]
    last = []
    for seq_id, prompt in enumerate(prompts):
        session.add(seq_id)
        last.append(int(np.argmax(session.prefill(seq_id, prompt))))
    buckets, hidden = buckets_for(4), SLIDING["hidden_size"]
    for step in range(WINDOW + 3):  # every sequence past its window
        seq_ids = [[0, 1, 2], [2, 0], [1]][step % 3]
        bucket = bucket_of(len(seq_ids), buckets)
        ids = np.zeros(bucket, np.int32)
        ids[: len(seq_ids)] = [last[s] for s in seq_ids]
        session.cache.begin_graph_decode(seq_ids, bucket)
        logits = library_decode_step(session.vm, tvm.runtime.tensor(ids, device=session.device), session.cache,
                                     session.params, hidden).numpy()
        session.host("kv_state_end_forward")(session.cache)
        assert logits.shape[0] == bucket
        for row, seq_id in enumerate(seq_ids):
            session.tokens[seq_id].append(last[seq_id])
            np.testing.assert_allclose(logits[row, -1], sliding_model.torch.logits(session.tokens[seq_id])[-1],
                                       **sliding_model.tolerance, err_msg=f"step {step}, sequence {seq_id}")
            last[seq_id] = int(np.argmax(logits[row, -1]))


@pytest.mark.gpu
def test_cuda_float16_matches_torch(tmp_path):
    from tir_kernels.support import resolve_target

    model = SlidingModel(tmp_path, seed=3, target=resolve_target("cuda"), dtype="float16")
    run_single(model.session(), PROMPT, steps=6)
    run_batch(model.session(), PROMPTS, steps=4)
    result = Generator(model.lib).generate_tokens(PROMPTS, max_new_tokens=4, keep_logits=True)
    for prompt, tokens, rows in zip(PROMPTS, result.tokens, result.logits):
        np.testing.assert_allclose(rows, model.torch.logits(prompt + tokens[:-1])[len(prompt) - 1:], **model.tolerance)


def test_serving_past_the_window_with_prefix_cache_and_draft_model(sliding_model):
    """The serving engine over the sliding library, whose MHA_SLIDING layers keep only their
    windows: the prefix cache's forks at positions whose window those layers released fall
    back to a fresh sequence (a fork at a node's end is served), and the draft model (the
    library drafting for itself in chains) starts its sequence over where a rollback reaches
    back past its window. Every request gets torch's greedy tokens; nothing leaks."""
    from tvmattn.sampling import SamplingOptions
    from tvmattn.serve.engine import Engine
    from tvmattn.serve.runner import DraftModel, ModelRunner
    from tvmattn.speculative import SpeculativeOptions

    rng = np.random.default_rng(5)
    first = [int(t) for t in rng.integers(0, 128, size=40)]
    work = [first, first[:35] + [int(t) for t in rng.integers(0, 128, size=9)], first + [3, 9]]
    runner = ModelRunner(sliding_model.lib)
    draft = DraftModel(runner.session.sibling(), 1, 4 * 256, 4)
    free = draft.session.available_pages()
    options = SpeculativeOptions("draft-model", 4, 1, str(sliding_model.lib), back_off=False)
    engine = Engine(runner, max_batched_tokens=32, speculative=options, draft_model=draft, prefix_cache="radix")
    for i, prompt in enumerate(work):  # one after another: each later one finds the earlier ones cached
        request = engine.submit(prompt, SamplingOptions(temperature=0, max_tokens=12, ignore_eos=True),
                                speculative=i != 1)
        while engine.step():
            pass
        context = list(prompt)
        for _ in range(12):
            context.append(int(np.argmax(sliding_model.torch.logits(context)[-1])))
        assert request.stream.result().tokens == context[len(prompt):], f"request {i}"
    assert engine.accepted > 0 and engine.prefix.hit_tokens > 0
    assert draft.cached == {} and draft.session.available_pages() == free
    engine.clear_prefix_cache()
    assert engine.runner.available_pages() == engine.runner.num_pages and engine.cache_sequences() == []
    report = engine.memory_report()
    assert report["sliding_layers"] == 2 and report["held_bytes"] == report["full_bytes"] == 0


@pytest.mark.gpu
def test_cuda_graph_decode_replays_the_eager_steps(tmp_path):
    """A float16 CUDA library with MHA_SLIDING layers replays its decode steps as CUDA graphs:
    Generator with graphs gives the tokens of Generator without them and torch's logits, for one
    prompt and a batch running past the window; bench_e2e's Runner replaying graphs gives the
    logits of its eager decode, step by step, in the buckets of 1, 2 and 3 sequences."""
    from harness import load_script
    from tir_kernels.support import resolve_target

    model = SlidingModel(tmp_path, seed=3, target=resolve_target("cuda"), dtype="float16")
    graphed, eager = Generator(model.lib), Generator(model.lib, cuda_graph=False)
    prompts = [PROMPT, *PROMPTS]
    for batch in (prompts[:1], prompts):
        a = graphed.generate_tokens(batch, max_new_tokens=2 * WINDOW, keep_logits=True)
        b = eager.generate_tokens(batch, max_new_tokens=2 * WINDOW, keep_logits=True)
        assert graphed.uses_cuda_graph and not eager.uses_cuda_graph
        assert a.tokens == b.tokens
        for prompt, tokens, x, y in zip(batch, a.tokens, a.logits, b.logits):
            np.testing.assert_allclose(x, y, rtol=2e-2, atol=2e-2)
            np.testing.assert_allclose(x, model.torch.logits(prompt + tokens[:-1])[len(prompt) - 1:],
                                       **model.tolerance)
    assert graphed.session.graphs.captures >= 2 and graphed.session.graphs.replays >= 2 * WINDOW

    e2e = load_script("bench_e2e")
    params = [tvm.runtime.tensor(p, device=model.device) for p in model.params]
    runners = [e2e.Runner(model.lib, model.device, params, 256, 4, 64, graph=graph) for graph in (True, False)]
    for runner in runners:
        for seq_id, prompt in enumerate(prompts):
            runner.host["add_sequence"](runner.cache, seq_id)
            runner.prefill(seq_id, tvm.runtime.tensor(np.array(prompt, np.int32), device=model.device))
    rng = np.random.default_rng(1)
    for step in range(2 * WINDOW):
        seq_ids = [[0, 1, 2], [2, 0], [1]][step % 3]
        ids = rng.integers(0, SLIDING["vocab_size"], len(seq_ids)).astype(np.int32)
        x, y = (runner.decode(seq_ids, tvm.runtime.tensor(ids, device=model.device)).numpy() for runner in runners)
        np.testing.assert_allclose(x.reshape(y.shape), y, rtol=2e-2, atol=2e-2, err_msg=f"step {step} of {seq_ids}")
    assert runners[0].graphs.captures == 3 and runners[0].graphs.replays == 2 * WINDOW
