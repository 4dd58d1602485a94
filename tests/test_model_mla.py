"""The DeepSeek-V2-style library (multi-head latent attention on tvmattn's MLA cache) against an
independent float64 torch model, on the CPU (llvm, float32) and on CUDA (fp16).

The library is compiled once per configuration by `compile_model` from the example config
(scripts/deepseek-v2-tiny-config.json, q_lora_rank 48, and a copy without the q bottleneck),
with random parameters (`--random-weights`); the test turns those parameters back into HF
tensors (gate_up split into gate and up, the rope rows of q_b_proj / q_proj and
kv_a_proj_with_mqa interleaved again) and runs them through the torch model below.

The torch model is written from HF's DeepSeek-V2 attention, without weight absorption: per
head q = [q_nope, q_pe]; c, k_pe = kv_a_proj_with_mqa(x), c RMS-normed; kv_b_proj(c) = per-head
[k_nope, v]; k = [k_nope, k_pe] (k_pe shared by the heads); RoPE on q_pe and k_pe as HF applies
it (interleaved pairs de-interleaved by view / transpose, then rotate-half); softmax scale
1/sqrt(nope + rope); causal; no KV cache (every step recomputes the whole sequence). The
library instead caches [c, k_pe] and runs absorbed queries in decode and against the history.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import tvm

import tvmattn  # noqa: F401  - registers the tvmattn.* functions the library calls
from test_model import LOGITS_TOLERANCE, Session, load_bundle, run_batch, run_single
from tvmattn.build import compile_model
from tvmattn.generate import Generator
from tvmattn.models import ModelConfigError
from tvmattn.models.config import DeepseekV2Config, model_config_from_hf

CONFIG_FILE = Path(__file__).resolve().parent.parent / "scripts" / "deepseek-v2-tiny-config.json"
HF = json.loads(CONFIG_FILE.read_text())


class TorchDeepseekV2:
    """DeepSeek-V2 decoder (dense MLPs) in float64 torch; `logits(tokens)` runs the whole sequence."""

    def __init__(self, hf: dict, weights: dict[str, np.ndarray]):
        self.hf = hf
        self.w = {name: torch.tensor(value, dtype=torch.float64) for name, value in weights.items()}
        self.heads = hf["num_attention_heads"]
        self.nope, self.rope, self.dv = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"], hf["v_head_dim"]
        self.latent = hf["kv_lora_rank"]

    def _rms_norm(self, x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.hf["rms_norm_eps"]) * weight

    def _linear(self, x, name):
        return x @ self.w[f"{name}.weight"].T

    def _rope(self, x, positions):
        """HF's apply_rotary_pos_emb of DeepSeek-V2: x [n, h, d] in interleaved pair order."""
        n, h, d = x.shape
        x = x.view(n, h, d // 2, 2).transpose(-1, -2).reshape(n, h, d)
        inv_freq = 1.0 / self.hf["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        angles = positions[:, None].double() * inv_freq[None, :]
        emb = torch.cat([angles, angles], -1)[:, None, :]
        rotated = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
        return x * emb.cos() + rotated * emb.sin()

    def _attention(self, x, p, positions):
        n, heads = x.shape[0], self.heads
        if self.hf.get("q_lora_rank"):
            q = self._linear(self._rms_norm(self._linear(x, f"{p}.q_a_proj"), self.w[f"{p}.q_a_layernorm.weight"]),
                             f"{p}.q_b_proj")
        else:
            q = self._linear(x, f"{p}.q_proj")
        q = q.view(n, heads, self.nope + self.rope)
        q_nope, q_pe = q[..., :self.nope], self._rope(q[..., self.nope:], positions)
        compressed = self._linear(x, f"{p}.kv_a_proj_with_mqa")
        c = self._rms_norm(compressed[:, :self.latent], self.w[f"{p}.kv_a_layernorm.weight"])
        k_pe = self._rope(compressed[:, None, self.latent:], positions)
        kv = self._linear(c, f"{p}.kv_b_proj").view(n, heads, self.nope + self.dv)
        k = torch.cat([kv[..., :self.nope], k_pe.expand(n, heads, self.rope)], -1)
        v = kv[..., self.nope:]
        scores = torch.einsum("qhd,khd->hqk", torch.cat([q_nope, q_pe], -1), k) / math.sqrt(self.nope + self.rope)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        return self._linear(torch.einsum("hqk,khd->qhd", probs, v).reshape(n, heads * self.dv), f"{p}.o_proj")

    def logits(self, tokens: list[int]) -> np.ndarray:
        """[len(tokens), vocab] logits of every position."""
        x = self.w["model.embed_tokens.weight"][torch.tensor(tokens)]
        positions = torch.arange(len(tokens))
        for i in range(self.hf["num_hidden_layers"]):
            p = f"model.layers.{i}"
            x = x + self._attention(self._rms_norm(x, self.w[f"{p}.input_layernorm.weight"]), f"{p}.self_attn",
                                    positions)
            h = self._rms_norm(x, self.w[f"{p}.post_attention_layernorm.weight"])
            gate, up = self._linear(h, f"{p}.mlp.gate_proj"), self._linear(h, f"{p}.mlp.up_proj")
            x = x + self._linear(torch.nn.functional.silu(gate) * up, f"{p}.mlp.down_proj")
        x = self._rms_norm(x, self.w["model.norm.weight"])
        return (x @ self.w["lm_head.weight"].T).numpy()


def interleave_rope_rows(rows: np.ndarray, rope: int) -> np.ndarray:
    """The library's rotate-half order of the last `rope` rows back to HF's interleaved pairs:
    HF row 2i is library row i, HF row 2i + 1 is library row rope / 2 + i."""
    head, tail = rows[:-rope], rows[-rope:]
    pairs = np.empty_like(tail)
    pairs[0::2], pairs[1::2] = tail[:rope // 2], tail[rope // 2:]
    return np.concatenate([head, pairs])


def hf_weights(hf: dict, named: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The library's parameters as HF tensors (see the module docstring)."""
    heads, rope = hf["num_attention_heads"], hf["qk_rope_head_dim"]
    out = {}
    for name, value in named.items():
        value = value.astype(np.float32)
        if name.endswith("gate_up_proj.weight"):
            half = value.shape[0] // 2
            out[name.replace("gate_up_proj", "gate_proj")] = value[:half]
            out[name.replace("gate_up_proj", "up_proj")] = value[half:]
        elif name.endswith(("q_proj.weight", "q_b_proj.weight")):
            per_head = value.reshape(heads, -1, value.shape[1])
            out[name] = np.stack([interleave_rope_rows(h, rope) for h in per_head]).reshape(value.shape)
        elif name.endswith("kv_a_proj_with_mqa.weight"):
            out[name] = interleave_rope_rows(value, rope)
        else:
            out[name] = value
    return out


class MLAModel:
    """A bundle from compile_model with random parameters, loaded into a VM, and the torch model
    on the same weights (Session's interface: vm, params, device, kv_cache, tolerance, torch)."""

    def __init__(self, hf: dict, folder: Path, seed: int, target: str = "llvm", dtype: str = "float32"):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(hf))
        self.lib = folder / "model.so"
        compile_model(str(folder / "config.json"), self.lib, target=target, dtype=dtype, page_size=16,
                      max_batch_size=4, context_window=256, prefill_chunk=64, random_weights=seed, log=lambda m: None)
        self.kv_cache = "tvmattn"
        self.device = tvm.cpu() if target == "llvm" else tvm.cuda()
        self.tolerance = LOGITS_TOLERANCE[dtype]
        self.vm, self.metadata, self.params, named = load_bundle(self.lib, self.device)
        self.torch = TorchDeepseekV2(hf, hf_weights(hf, named))

    def session(self) -> Session:
        return Session(self, vm=self.vm)


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory) -> MLAModel:
    return MLAModel(HF, tmp_path_factory.mktemp("mla"), seed=5)


@pytest.fixture(scope="module")
def mla_model_without_q_lora(tmp_path_factory) -> MLAModel:
    return MLAModel({**HF, "q_lora_rank": None}, tmp_path_factory.mktemp("mla-no-q-lora"), seed=6)


PROMPT = [5, 17, 99, 3, 42, 64, 7, 120, 1, 33, 18, 77, 2, 90, 11, 54, 26, 8, 71]  # crosses a page (16)
PROMPTS = [[9, 4, 100, 23, 61], [12, 80, 3, 3, 45, 127, 0, 66, 19, 101, 38, 7, 56, 91, 14, 29, 88]]


def test_config_from_hf():
    config = model_config_from_hf(HF)
    assert isinstance(config, DeepseekV2Config)
    assert (config.qk_head_dim, config.q_lora_rank) == (48, 48)
    assert config.sm_scale == pytest.approx(1 / math.sqrt(48)), "the scale comes from nope + rope, not the latent"
    assert model_config_from_hf({**HF, "q_lora_rank": None}).q_lora_rank == 0
    assert model_config_from_hf({**HF, "n_routed_experts": 8, "first_k_dense_replace": 2}).num_hidden_layers == 2
    refused = [({"n_routed_experts": 8, "first_k_dense_replace": 1}, "n_routed_experts"),
               ({"rope_scaling": {"type": "yarn", "factor": 40}}, "rope_scaling"),
               ({"kv_lora_rank": 40}, "kv_lora_rank"), ({"qk_rope_head_dim": 0}, "qk_rope_head_dim"),
               ({"qk_nope_head_dim": 256}, "qk_nope_head_dim"), ({"attention_bias": True}, "attention_bias")]
    for change, field in refused:
        with pytest.raises(ModelConfigError, match=field):
            model_config_from_hf({**HF, **change})
    with pytest.raises(ModelConfigError, match="kv_lora_rank"):
        model_config_from_hf({key: value for key, value in HF.items() if key != "kv_lora_rank"})


def test_library_metadata(mla_model):
    meta = mla_model.metadata
    assert meta["model_type"] == "deepseek_v2" and "batch_verify" not in meta["functions"]
    assert meta["kv_cache"]["attention"] == "mla" and meta["kv_cache"]["latent_dim"] == 64
    session = mla_model.session()
    assert session.cache.options.is_mla and session.cache.options.qk_head_dim == 64 + 16


def test_prefill_then_decode_matches_torch(mla_model):
    """Prefill (self attention among the prompt, nothing cached before) and 8 decode steps
    (absorbed attention over the latent cache), each step's logits against torch."""
    run_single(mla_model.session(), PROMPT, steps=8)


def test_batch_of_different_lengths_matches_torch(mla_model):
    """batch_prefill scores every position of a 5- and a 17-token prompt, then batch_decode."""
    run_batch(mla_model.session(), PROMPTS, steps=5)


def test_chunked_prefill_merges_self_and_cross_attention(mla_model):
    """Prefill in chunks: each chunk's self attention merged with the absorbed cross attention
    over the cached history (a one-token chunk is a decode step for the cache, as in TVM, so it
    goes through decode), then decode."""
    session = mla_model.session()
    session.add(0)
    for chunk in (PROMPT[:4], PROMPT[4:13], PROMPT[13:14], PROMPT[14:16], PROMPT[16:]):
        logits = session.prefill(0, chunk) if len(chunk) > 1 else session.decode(0, chunk[0])
        np.testing.assert_allclose(logits, mla_model.torch.logits(session.tokens[0])[-1], **mla_model.tolerance,
                                   err_msg=f"chunk ending at {len(session.tokens[0])}")
    for step in range(3):
        logits = session.decode(0, int(np.argmax(logits)))
        np.testing.assert_allclose(logits, mla_model.torch.logits(session.tokens[0])[-1], **mla_model.tolerance,
                                   err_msg=f"decode step {step}")


@pytest.mark.slow  # a library of its own
def test_without_q_lora_matches_torch(mla_model_without_q_lora):
    run_single(mla_model_without_q_lora.session(), PROMPT[:11], steps=5)


def test_generator_runs_the_bundle(mla_model):
    """Generator (the bundle's files, checked and loaded) answers one prompt and a batch with
    greedy tokens whose every logits row matches torch."""
    generator = Generator(mla_model.lib)
    # one-token prompts: a step of one token per sequence runs the decode functions
    for prompts in ([PROMPT], PROMPTS, [[7], [99]], [[42]]):
        result = generator.generate_tokens(prompts, max_new_tokens=5, keep_logits=True)
        for prompt, tokens, rows in zip(prompts, result.tokens, result.logits):
            assert len(tokens) == 5
            expected = mla_model.torch.logits(prompt + tokens[:-1])[len(prompt) - 1:]
            np.testing.assert_allclose(rows, expected, **mla_model.tolerance)
            assert tokens == [int(np.argmax(row)) for row in rows]


# On CUDA, head dims the tensor-core prefill tiles (ragged 128 / 64, as in test_prefill_tc.py).
GPU_HF = {**HF, "qk_nope_head_dim": 64, "qk_rope_head_dim": 64, "v_head_dim": 64, "kv_lora_rank": 128}


@pytest.mark.gpu
def test_cuda_float16_matches_torch(tmp_path):
    from tir_kernels.support import resolve_target

    model = MLAModel(GPU_HF, tmp_path, seed=5, target=resolve_target("cuda"), dtype="float16")
    run_single(model.session(), PROMPT, steps=6)
    run_batch(model.session(), PROMPTS, steps=4)
    result = Generator(model.lib).generate_tokens(PROMPTS, max_new_tokens=4, keep_logits=True)
    for prompt, tokens, rows in zip(PROMPTS, result.tokens, result.logits):
        np.testing.assert_allclose(rows, model.torch.logits(prompt + tokens[:-1])[len(prompt) - 1:], **model.tolerance)
