"""An independent simulation of an FP8 KV cache on SmolLM2-135M-Instruct: the model in float64
torch on the GGUF's dequantized weights (tests/test_model.py's TorchLlama written out with a
quantization hook), K (after RoPE) and V rounded to FP8 per (layer, K/V, KV head) by ml_dtypes
at given scales, attention in float64. Nothing of tvmattn's kernels or cache is used, so its
figures say what FP8 itself costs; tests/fp8_accuracy.py measures the library.

`exact_from[i]`: query i reads keys j >= exact_from[i] unquantized (the step's own tokens, which
ragged prefill takes from the step's K/V rather than from the pages) and keys before it from
FP8. A whole-sequence run with exact_from = 0 is the unquantized model."""

from __future__ import annotations

import math

import numpy as np
import torch
from fp8_reference import FP8_MAX, np_fp8


def fp8_round(x: torch.Tensor, scales: np.ndarray, fmt: str) -> torch.Tensor:
    """x [n, heads, d] float64 -> float64 dequantized FP8 of float32(x) / scale[h] (saturated)."""
    s = np.asarray(scales, np.float32)[None, :, None]
    q = np.clip(x.numpy().astype(np.float32) / s, -FP8_MAX[fmt], FP8_MAX[fmt]).astype(np_fp8(fmt))
    return torch.from_numpy(q.astype(np.float64) * s.astype(np.float64))


class SimLlama:
    """Llama decoder in float64 torch whose attention can read FP8-rounded K/V."""

    def __init__(self, gguf_path):
        from tvmattn.weights.gguf_file import read_gguf

        loaded = read_gguf(gguf_path)
        self.hf = hf = loaded.hf_config
        self.w = {name: torch.tensor(np.asarray(value), dtype=torch.float64) for name, value in loaded.tensors.items()}
        self.heads, self.kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
        self.d = hf.get("head_dim") or hf["hidden_size"] // self.heads
        self.layers = hf["num_hidden_layers"]
        self.inv_freq = 1.0 / hf["rope_theta"] ** (torch.arange(0, self.d, 2, dtype=torch.float64) / self.d)
        assert not hf.get("rope_scaling") and loaded.rope_freq_factors is None

    def _rms_norm(self, x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.hf["rms_norm_eps"]) * weight

    def _rope(self, x, positions):
        angles = positions[:, None].double() * self.inv_freq[None, :]
        cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None, :]
        sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None, :]
        half = self.d // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    def _linear(self, x, name):
        y = x @ self.w[f"{name}.weight"].T
        bias = self.w.get(f"{name}.bias")
        return y if bias is None else y + bias

    def _attention(self, q, k, v, kq, vq, exact_from, block: int = 256):
        """q [n, H, d]; k, v exact and kq, vq FP8-rounded [n, Hkv, d]; causal."""
        n, group = q.shape[0], self.heads // self.kv_heads
        k, v, kq, vq = (t.repeat_interleave(group, dim=1) for t in (k, v, kq, vq))
        keys = torch.arange(n)
        out = torch.empty_like(q)
        for b in range(0, n, block):
            rows = torch.arange(b, min(n, b + block))
            qb = q[rows]
            exact = (keys[None, :] >= exact_from[rows, None]) & (keys[None, :] <= rows[:, None])
            quant = keys[None, :] < exact_from[rows, None]
            s_exact = torch.einsum("qhd,khd->hqk", qb, k) / math.sqrt(self.d)
            s_quant = torch.einsum("qhd,khd->hqk", qb, kq) / math.sqrt(self.d)
            scores = torch.where(exact[None], s_exact, torch.where(quant[None], s_quant, float("-inf")))
            probs = scores.softmax(-1)
            out[rows] = (torch.einsum("hqk,khd->qhd", probs * exact[None], v)
                         + torch.einsum("hqk,khd->qhd", probs * quant[None], vq))
        return out

    def logits(self, tokens: list[int], scales: np.ndarray | None = None, fmt: str = "float8_e4m3fn",
               exact_from: np.ndarray | None = None, keep_kv: bool = False,
               round_kv: tuple[bool, bool] = (True, True)) -> np.ndarray:
        """float64 [len(tokens), vocab]. scales [layers, 2, Hkv] (None: no quantization);
        round_kv: whether K, V are rounded (to tell their shares of the error apart)."""
        n = len(tokens)
        exact_from = torch.zeros(n, dtype=torch.long) if exact_from is None else torch.as_tensor(exact_from)
        x = self.w["model.embed_tokens.weight"][torch.tensor(tokens)]
        positions = torch.arange(n)
        self.kv = []
        for i in range(self.layers):
            p = f"model.layers.{i}"
            h = self._rms_norm(x, self.w[f"{p}.input_layernorm.weight"])
            q = self._rope(self._linear(h, f"{p}.self_attn.q_proj").view(n, self.heads, self.d), positions)
            k = self._rope(self._linear(h, f"{p}.self_attn.k_proj").view(n, self.kv_heads, self.d), positions)
            v = self._linear(h, f"{p}.self_attn.v_proj").view(n, self.kv_heads, self.d)
            if keep_kv:
                self.kv.append((k.numpy(), v.numpy()))
            if scales is None:
                kq, vq = k, v
            else:
                kq = fp8_round(k, scales[i, 0], fmt) if round_kv[0] else k
                vq = fp8_round(v, scales[i, 1], fmt) if round_kv[1] else v
            o = self._attention(q, k, v, kq, vq, exact_from).reshape(n, self.heads * self.d)
            x = x + self._linear(o, f"{p}.self_attn.o_proj")
            h = self._rms_norm(x, self.w[f"{p}.post_attention_layernorm.weight"])
            gate, up = self._linear(h, f"{p}.mlp.gate_proj"), self._linear(h, f"{p}.mlp.up_proj")
            x = x + self._linear(torch.nn.functional.silu(gate) * up, f"{p}.mlp.down_proj")
        x = self._rms_norm(x, self.w["model.norm.weight"])
        head = self.w["model.embed_tokens.weight" if self.hf.get("tie_word_embeddings") else "lm_head.weight"]
        return (x @ head.T).numpy()


def chunked_exact_from(n: int, chunk: int) -> np.ndarray:
    """exact_from of a sequence fed `chunk` tokens a step: each step's own tokens are exact."""
    return (np.arange(n) // chunk) * chunk
