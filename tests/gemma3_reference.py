"""An independent float64 torch Gemma 3 decoder (Hugging Face's Gemma3TextModel, written out):
`TorchGemma3(hf_config, hf_tensors).logits(tokens)` runs the whole sequence, no cache.

Hugging Face conventions: RMSNorm multiplies by (1 + w); q and k RMS-normed per head before
rotate-half RoPE with the layer's base (rope_local_base_freq on sliding layers, rope_theta on
full ones); scores scaled by query_pre_attn_scalar^-0.5; a sliding layer's query at p sees
the keys j with p - window < j <= p; GeGLU with tanh GELU; embeddings times sqrt(hidden);
logits soft-capped when final_logit_softcapping is set.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def layer_kinds(hf: dict) -> list[bool]:
    """Per layer: sliding (True) or full, from layer_types or sliding_window_pattern."""
    if hf.get("layer_types"):
        return [kind == "sliding_attention" for kind in hf["layer_types"]]
    pattern = hf.get("sliding_window_pattern", 6)
    return [(i + 1) % pattern != 0 for i in range(hf["num_hidden_layers"])]


class TorchGemma3:
    def __init__(self, hf: dict, weights: dict[str, np.ndarray], layers: int | None = None):
        """layers: run only the first `layers` decoder layers (a slice of a big model)."""
        self.hf = hf
        self.w = {name: torch.tensor(np.asarray(value), dtype=torch.float64) for name, value in weights.items()}
        self.heads, self.kv_heads, self.d = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
        self.sliding = layer_kinds(hf)
        self.layers = hf["num_hidden_layers"] if layers is None else layers

    def _norm(self, x, name):
        scale = 1.0 + self.w[name]
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.hf["rms_norm_eps"]) * scale

    def _rope(self, x, positions, theta):  # x [n, heads, d]
        inv_freq = 1.0 / theta ** (torch.arange(0, self.d, 2, dtype=torch.float64) / self.d)
        angles = positions[:, None].double() * inv_freq[None, :]
        cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None, :]
        sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None, :]
        half = self.d // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    def _mask(self, n: int, layer: int) -> torch.Tensor:
        p, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        visible = j <= p
        return visible & (p - j < self.hf["sliding_window"]) if self.sliding[layer] else visible

    def hidden(self, tokens: list[int]) -> torch.Tensor:
        """[n, hidden] float64: the residual stream after self.layers layers (no final norm)."""
        hf, n = self.hf, len(tokens)
        x = self.w["model.embed_tokens.weight"][torch.tensor(tokens)] * math.sqrt(hf["hidden_size"])
        positions = torch.arange(n)
        for i in range(self.layers):
            p = f"model.layers.{i}"
            theta = hf.get("rope_local_base_freq", 1e4) if self.sliding[i] else hf["rope_theta"]
            h = self._norm(x, f"{p}.input_layernorm.weight")
            q = (h @ self.w[f"{p}.self_attn.q_proj.weight"].T).view(n, self.heads, self.d)
            k = (h @ self.w[f"{p}.self_attn.k_proj.weight"].T).view(n, self.kv_heads, self.d)
            v = (h @ self.w[f"{p}.self_attn.v_proj.weight"].T).view(n, self.kv_heads, self.d)
            q = self._rope(self._norm(q, f"{p}.self_attn.q_norm.weight"), positions, theta)
            k = self._rope(self._norm(k, f"{p}.self_attn.k_norm.weight"), positions, theta)
            group = self.heads // self.kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, k) * hf.get("query_pre_attn_scalar", self.d) ** -0.5
            probs = scores.masked_fill(~self._mask(n, i), float("-inf")).softmax(-1)
            o = torch.einsum("hqk,khd->qhd", probs, v).reshape(n, self.heads * self.d)
            x = x + self._norm(o @ self.w[f"{p}.self_attn.o_proj.weight"].T, f"{p}.post_attention_layernorm.weight")
            h = self._norm(x, f"{p}.pre_feedforward_layernorm.weight")
            gate = h @ self.w[f"{p}.mlp.gate_proj.weight"].T
            up = h @ self.w[f"{p}.mlp.up_proj.weight"].T
            down = (torch.nn.functional.gelu(gate, approximate="tanh") * up) @ self.w[f"{p}.mlp.down_proj.weight"].T
            x = x + self._norm(down, f"{p}.post_feedforward_layernorm.weight")
        return x

    def logits(self, tokens: list[int], rows: list[int] | None = None) -> np.ndarray:
        """[len(tokens), vocab] logits of every position (rows: of those positions only)."""
        x = self.hidden(tokens)
        x = self._norm(x if rows is None else x[rows], "model.norm.weight")
        head = self.w["lm_head.weight" if "lm_head.weight" in self.w else "model.embed_tokens.weight"]
        out = x @ head.T
        cap = self.hf.get("final_logit_softcapping")
        if cap:
            out = torch.tanh(out / cap) * cap
        return out.numpy()


def random_gemma3_weights(hf: dict, seed: int) -> dict[str, np.ndarray]:
    """HF-named float32 tensors for a Gemma 3 config (norm weights w near 0: multipliers near 1)."""
    rng = np.random.default_rng(seed)
    h, inter, d = hf["hidden_size"], hf["intermediate_size"], hf["head_dim"]
    q, kv = hf["num_attention_heads"] * d, hf["num_key_value_heads"] * d

    def w(*shape, scale=None):
        scale = shape[-1] ** -0.5 if scale is None else scale
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def norm(n):
        return (rng.standard_normal(n) * 0.1).astype(np.float32)

    weights = {"model.embed_tokens.weight": w(hf["vocab_size"], h, scale=0.2), "model.norm.weight": norm(h)}
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}"
        weights.update({
            f"{p}.self_attn.q_proj.weight": w(q, h), f"{p}.self_attn.k_proj.weight": w(kv, h),
            f"{p}.self_attn.v_proj.weight": w(kv, h), f"{p}.self_attn.o_proj.weight": w(h, q),
            f"{p}.self_attn.q_norm.weight": norm(d), f"{p}.self_attn.k_norm.weight": norm(d),
            f"{p}.mlp.gate_proj.weight": w(inter, h), f"{p}.mlp.up_proj.weight": w(inter, h),
            f"{p}.mlp.down_proj.weight": w(h, inter),
        })
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            weights[f"{p}.{name}.weight"] = norm(h)
    if not hf.get("tie_word_embeddings", True):
        weights["lm_head.weight"] = w(hf["vocab_size"], h)
    return weights
