"""A Llama-family library with alternating sliding-window layers (Gemma-2's pattern, Mistral's
window) against an independent float64 torch model, on the CPU (llvm, float32) and on CUDA (fp16).

The torch model is the Llama one of test_model.py with an explicit mask per layer: a query at
position p of a sliding layer sees the keys j with p - window < j <= p (HF's Mistral / Gemma-2
sliding mask), a full layer every j <= p. No KV cache there: every step recomputes the whole
sequence. Prompts and answers run past the window (8 tokens, half a page), so the windows
change the logits. The library's cache gets the layer kinds MHA_SLIDING / MHA in its create
call (TVM's attn_kinds) and the window as cache_config's sixth value.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import tvm

import tvmattn  # noqa: F401  - registers the tvmattn.* functions the library calls
from test_model import LOGITS_TOLERANCE, PAGE_SIZE, Session, TorchLlama, random_hf_weights, run_batch, run_single
from tvmattn.models import ModelConfig, ModelConfigError, compile_library, pack_params
from tvmattn.models.config import model_config_from_hf
from tvmattn.runtime.ffi import AttnKind

WINDOW = 8
SLIDING = {  # Gemma-2's alternation (layers 0 and 2 slide), Llama otherwise
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "sliding_window": WINDOW, "sliding_window_pattern": 2,
}


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

    def logits(self, tokens: list[int]) -> np.ndarray:
        n = len(tokens)
        x = self.w["model.embed_tokens.weight"][torch.tensor(tokens)]
        positions = torch.arange(n)
        for i in range(self.hf["num_hidden_layers"]):
            p = f"model.layers.{i}"
            h = self._rms_norm(x, self.w[f"{p}.input_layernorm.weight"])
            q = self._rope(self._linear(h, f"{p}.self_attn.q_proj").view(n, self.heads, self.d), positions)
            k = self._rope(self._linear(h, f"{p}.self_attn.k_proj").view(n, self.kv_heads, self.d), positions)
            v = self._linear(h, f"{p}.self_attn.v_proj").view(n, self.kv_heads, self.d)
            group = self.heads // self.kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(self.d)
            probs = scores.masked_fill(~self.mask(n, i), float("-inf")).softmax(-1)
            o = torch.einsum("hqk,khd->qhd", probs, v).reshape(n, self.heads * self.d)
            x = x + self._linear(o, f"{p}.self_attn.o_proj")
            h = self._rms_norm(x, self.w[f"{p}.post_attention_layernorm.weight"])
            gate, up = self._linear(h, f"{p}.mlp.gate_proj"), self._linear(h, f"{p}.mlp.up_proj")
            x = x + self._linear(torch.nn.functional.silu(gate) * up, f"{p}.mlp.down_proj")
        x = self._rms_norm(x, self.w["model.norm.weight"])
        return (x @ self.w["lm_head.weight"].T).numpy()


class SlidingModel:
    """A compiled library, its packed random weights and the torch model (Session's interface)."""

    def __init__(self, kv_cache: str, seed: int, target: str = "llvm", dtype: str = "float32"):
        self.kv_cache = kv_cache
        self.config = ModelConfig.from_hf(SLIDING)
        self.device = tvm.cpu() if target == "llvm" else tvm.cuda()
        self.tolerance = LOGITS_TOLERANCE[dtype]
        self.library = compile_library(self.config, target=target, dtype=dtype, page_size=PAGE_SIZE,
                                       kv_cache=kv_cache)
        weights = random_hf_weights(SLIDING, seed)
        self.params = pack_params(self.library.metadata, weights)
        stored = {name: w.astype(dtype).astype(np.float32) for name, w in weights.items()}
        self.torch = TorchSlidingLlama(SLIDING, stored, self.config.sliding_layers, WINDOW)


@pytest.fixture(scope="module")
def sliding_model() -> SlidingModel:
    return SlidingModel("tvmattn", seed=3)


@pytest.fixture(scope="module")
def stock_sliding_model() -> SlidingModel:
    return SlidingModel("tvm", seed=3)


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
    run_single(Session(sliding_model), PROMPT, steps=6)


def test_batch_of_different_lengths_matches_torch(sliding_model):
    """batch_prefill scores every position of a 5- and a 13-token prompt, then batch_decode."""
    run_batch(Session(sliding_model), PROMPTS, steps=6)


def test_chunked_prefill_matches_torch(sliding_model):
    """A prompt in three prefill chunks (history inside and outside the window) then decode."""
    session = Session(sliding_model)
    session.add(0)
    for chunk in (PROMPT[:5], PROMPT[5:14], PROMPT[14:]):
        logits = session.prefill(0, chunk)
        np.testing.assert_allclose(logits, sliding_model.torch.logits(session.tokens[0])[-1],
                                   **sliding_model.tolerance, err_msg=f"chunk ending at {len(session.tokens[0])}")
    for step in range(3):
        logits = session.decode(0, int(np.argmax(logits)))
        np.testing.assert_allclose(logits, sliding_model.torch.logits(session.tokens[0])[-1],
                                   **sliding_model.tolerance, err_msg=f"decode step {step}")


def test_stock_cache_matches_torch_within_the_window(stock_sliding_model):
    """TVM's C++ cache with the same kinds: a prompt no longer than the window, then decode
    steps that slide it (TVM's prefill attends to all new tokens of a chunk, so a prompt longer
    than the window is not compared there)."""
    run_single(Session(stock_sliding_model), PROMPT[:WINDOW], steps=8)


@pytest.mark.gpu
def test_cuda_float16_matches_torch():
    from tir_kernels.support import resolve_target

    model = SlidingModel("tvmattn", seed=3, target=resolve_target("cuda"), dtype="float16")
    run_single(Session(model), PROMPT, steps=6)
    run_batch(Session(model), PROMPTS, steps=4)
