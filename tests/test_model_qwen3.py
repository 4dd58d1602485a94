"""A Qwen3-style library (the Llama layout plus an RMSNorm of each q and k head before RoPE, and
a head dim other than hidden / heads) compiled by `compile_model` from a config.json with
random weights (scripts/qwen3-tiny-config.json), against an independent float64 torch model on
the library's own parameters (qkv_proj split back into q, k, v; gate_up_proj into gate, up).
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
from test_model import LOGITS_TOLERANCE, PAGE_SIZE, Session, load_bundle, run_batch, run_single
from tvmattn.build import compile_model
from tvmattn.models.config import model_config_from_hf

CONFIG_FILE = Path(__file__).resolve().parent.parent / "scripts" / "qwen3-tiny-config.json"
QWEN3 = json.loads(CONFIG_FILE.read_text())
PROMPT = [5, 17, 99, 3, 42, 64, 7, 120, 1, 33, 18, 77, 2, 90, 11, 54, 26, 8, 71]
PROMPTS = [[9, 4, 100, 23, 61], [12, 80, 3, 3, 45, 127, 0, 66, 19, 101, 38, 7, 56, 91, 14, 29, 88]]


class TorchQwen3:
    """Qwen3's decoder in float64 torch (HF's Qwen3Model written out); logits(tokens) of every position."""

    def __init__(self, hf: dict, weights: dict[str, np.ndarray]):
        self.hf, self.w = hf, {n: torch.tensor(v, dtype=torch.float64) for n, v in weights.items()}
        self.heads, self.kv_heads, self.d = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]

    def _norm(self, x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.hf["rms_norm_eps"]) * self.w[name]

    def _rope(self, x, positions):
        inv_freq = 1.0 / self.hf["rope_theta"] ** (torch.arange(0, self.d, 2, dtype=torch.float64) / self.d)
        angles = positions[:, None].double() * inv_freq[None]
        cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
        half = self.d // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    def logits(self, tokens: list[int]) -> np.ndarray:
        n, positions = len(tokens), torch.arange(len(tokens))
        x = self.w["model.embed_tokens.weight"][torch.tensor(tokens)]
        for i in range(self.hf["num_hidden_layers"]):
            p = f"model.layers.{i}"
            h = self._norm(x, f"{p}.input_layernorm.weight")
            q = (h @ self.w[f"{p}.self_attn.q_proj.weight"].T).view(n, self.heads, self.d)
            k = (h @ self.w[f"{p}.self_attn.k_proj.weight"].T).view(n, self.kv_heads, self.d)
            v = (h @ self.w[f"{p}.self_attn.v_proj.weight"].T).view(n, self.kv_heads, self.d)
            q = self._rope(self._norm(q, f"{p}.self_attn.q_norm.weight"), positions)
            k = self._rope(self._norm(k, f"{p}.self_attn.k_norm.weight"), positions)
            group = self.heads // self.kv_heads
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(self.d)
            probs = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
            o = torch.einsum("hqk,khd->qhd", probs, v).reshape(n, self.heads * self.d)
            x = x + o @ self.w[f"{p}.self_attn.o_proj.weight"].T
            h = self._norm(x, f"{p}.post_attention_layernorm.weight")
            gate, up = h @ self.w[f"{p}.mlp.gate_proj.weight"].T, h @ self.w[f"{p}.mlp.up_proj.weight"].T
            x = x + (torch.nn.functional.silu(gate) * up) @ self.w[f"{p}.mlp.down_proj.weight"].T
        return (self._norm(x, "model.norm.weight") @ self.w["model.embed_tokens.weight"].T).numpy()


def hf_tensors(hf: dict, named: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The library's parameters as HF tensors (fused projections split)."""
    q_rows, kv_rows = hf["num_attention_heads"] * hf["head_dim"], hf["num_key_value_heads"] * hf["head_dim"]
    out = {}
    for name, value in named.items():
        if name.endswith("qkv_proj.weight"):
            for x, part in zip("qkv", np.split(value, [q_rows, q_rows + kv_rows])):
                out[name.replace("qkv_proj", f"{x}_proj")] = part
        elif name.endswith("gate_up_proj.weight"):
            gate, up = np.split(value, 2)
            out[name.replace("gate_up_proj", "gate_proj")], out[name.replace("gate_up_proj", "up_proj")] = gate, up
        else:
            out[name] = value
    return out


class Qwen3Model:
    """The bundle compile_model writes from the config.json with random weights, loaded (Session's interface)."""

    def __init__(self, folder: Path):
        library = folder / "qwen3.so"
        compile_model(str(CONFIG_FILE), library, target="llvm", page_size=PAGE_SIZE, max_batch_size=4,
                      context_window=256, prefill_chunk=64, random_weights=5, log=lambda m: None)
        self.device, self.kv_cache, self.tolerance = tvm.cpu(), "tvmattn", LOGITS_TOLERANCE["float32"]
        self.vm, self.metadata, self.params, named = load_bundle(library, self.device)
        self.torch = TorchQwen3(QWEN3, hf_tensors(QWEN3, named))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> Qwen3Model:
    return Qwen3Model(tmp_path_factory.mktemp("qwen3"))


def test_config_is_llama_with_qk_norm():
    config = model_config_from_hf(QWEN3)
    assert config.qk_norm and config.head_dim == 32 and config.q_size == 128
    assert not model_config_from_hf({**QWEN3, "model_type": "qwen2"}).qk_norm


@pytest.mark.slow  # the float32 library compiles for minutes on a loaded 2-core machine
def test_parameters_hold_the_per_head_norms(qwen3):
    names = [p["name"] for p in qwen3.metadata["params"]]
    assert "model.layers.1.self_attn.q_norm.weight" in names
    shapes = {p["name"]: p["shape"] for p in qwen3.metadata["params"]}
    assert shapes["model.layers.0.self_attn.k_norm.weight"] == [32]
    assert shapes["model.layers.0.self_attn.qkv_proj.weight"] == [128 + 2 * 64, 64]


@pytest.mark.slow
def test_prefill_decode_and_batch_match_torch(qwen3):
    run_single(Session(qwen3, vm=qwen3.vm), PROMPT, steps=4)
    run_batch(Session(qwen3, vm=qwen3.vm), PROMPTS, steps=3)
