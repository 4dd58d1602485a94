"""The Gemma 3 decoder in `tvm.relax.frontend.nn` (Gemma3Config's docstring says what it
computes), exporting the Llama library's functions (llama.LlamaForCausalLM: the same names,
arguments and cache calls), and its parameter map from Hugging Face tensor names.

Where it differs from the Llama decoder: q, k and v are separate projections (a GGUF stores
them in different block types, e.g. Q5_0 q and k beside a Q8_0 v); q and k are RMS-normed per
head and rotated here, by the layer's RoPE base (the cache runs with rope_mode "none" and gives
the positions); four RMSNorms a layer; a GeGLU MLP (gate and up fused when they share a block
type, as they do in a GGUF); embeddings scaled by sqrt(hidden_size). RMSNorm parameters hold
Gemma's multiplier 1 + w (`prepare_tensors` adds the 1 to Hugging Face's w).
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np
from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from tir_kernels.common import exp2_vector

from ...quant.linear import QuantEmbedding
from ..kv_cache import query_positions
from ..llama import LlamaForCausalLM, _linear, with_kept_parts
from .config import Gemma3Config

NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


def rope_table(positions: te.Tensor, theta: float, d: int) -> te.Tensor:
    """The rotation of positions [n] at base theta: float32 [n, d], cos(angle_k) in column k and
    sin(angle_k) in column half + k (angle_k = position * theta ** (-2 k / d), k < half = d / 2).
    Computed once a step for each base and read by every layer of that base: the transcendentals
    are then per token, not per token, head and layer."""
    half = d // 2

    def value(t, k):
        exponent = (k % half).astype("float32") * tirx.const(2.0 / d, "float32")
        angle = positions[t].astype("float32") * tirx.power(tirx.const(theta, "float32"), -exponent)
        return tirx.if_then_else(k < half, tirx.cos(angle), tirx.sin(angle))

    return te.compute((positions.shape[0], d), value, name="rope_table")


def rope(x: te.Tensor, table: te.Tensor) -> te.Tensor:
    """x [b, s, h, d] rotated (rotate-half, as llama.cpp's NEOX mode, float32) by `rope_table`'s
    rows [b * s, d]."""
    s, d = x.shape[1], int(x.shape[3])
    half = d // 2

    def value(i, j, head, k):
        t = i * s + j
        own = x[i, j, head, k].astype("float32")
        other = tirx.if_then_else(k < half, -x[i, j, head, k + half].astype("float32"),
                                  x[i, j, head, k - half].astype("float32"))
        return (own * table[t, k % half] + other * table[t, half + k % half]).astype(x.dtype)

    return te.compute(x.shape, value, name="rope")


def soft_cap(x: te.Tensor, cap: float) -> te.Tensor:
    """cap * tanh(x / cap) in float32, tanh(y) as 1 - 2 / (1 + 2**(2 y log2 e)) in arithmetic LLVM
    vectorizes (tanhf is a library call per element, and a decode step caps every logit of the
    vocabulary). Within 2e-7 * cap of the exact value (exp2_vector's error and the
    rounding of the division; +-cap where 2**(2 y log2 e) leaves float32's range)."""
    def value(*i):
        y = x(*i).astype("float32") * tirx.const(2.0 * math.log2(math.e) / cap, "float32")
        one = tirx.const(1.0, "float32")
        return tirx.const(cap, "float32") * (one - tirx.const(2.0, "float32") / (one + exp2_vector(y)))

    return te.compute(x.shape, value, name="soft_cap")


def gelu_tanh_gate(gate: te.Tensor, up: te.Tensor) -> te.Tensor:
    """GELU-tanh(gate) * up, computed in float32 as gate * sigmoid(2 y) * up with y = sqrt(2 / pi)
    (gate + 0.044715 gate^3) (0.5 (1 + tanh y) = sigmoid(2 y)), the sigmoid by exp2_vector: arithmetic
    LLVM vectorizes, where TVM's gelu calls tanhf per element (figures: docs/performance.md). Within
    2e-7 * |gate * up| of the exact product."""
    def value(*i):
        x = gate(*i).astype("float32")
        y = tirx.const(math.sqrt(2.0 / math.pi), "float32") * (x + tirx.const(0.044715, "float32") * x * x * x)
        sigmoid = tirx.const(1.0, "float32") / (tirx.const(1.0, "float32") + exp2_vector(
            y * tirx.const(-2.0 * math.log2(math.e), "float32")))
        return (x * sigmoid * up(*i).astype("float32")).astype(gate.dtype)

    return te.compute(gate.shape, value, name="gelu_tanh_gate")


class Gemma3Attention(nn.Module):
    def __init__(self, config: Gemma3Config, layer_id: int, formats: Mapping[str, str], prefix: str):
        self.config = config
        self.theta = config.layer_rope_theta(layer_id)
        hidden, d = config.hidden_size, config.head_dim
        self.q_proj = _linear(formats, f"{prefix}.q_proj", hidden, config.q_size)
        self.k_proj = _linear(formats, f"{prefix}.k_proj", hidden, config.kv_size)
        self.v_proj = _linear(formats, f"{prefix}.v_proj", hidden, config.kv_size)
        self.o_proj = _linear(formats, f"{prefix}.o_proj", config.q_size, hidden)
        self.q_norm = nn.RMSNorm(d, -1, config.rms_norm_eps, bias=False)
        self.k_norm = nn.RMSNorm(d, -1, config.rms_norm_eps, bias=False)

    def forward(self, x: nn.Tensor, cache, layer_id: int, rope_tables: Mapping[float, nn.Tensor]) -> nn.Tensor:
        """x [b, s, hidden] (normed) -> the attention's projection [b, s, hidden]; rope_tables:
        `rope_table` of the step's positions by RoPE base."""
        c = self.config
        b, s, _ = x.shape
        hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        q = self.q_norm(op.reshape(self.q_proj(x), (b, s, hq, d)))
        k = self.k_norm(op.reshape(self.k_proj(x), (b, s, hkv, d)))
        v = op.reshape(self.v_proj(x), (b, s, hkv, d))
        q = op.tensor_expr_op(rope, "rope_q", [q, rope_tables[self.theta]])
        k = op.tensor_expr_op(rope, "rope_k", [k, rope_tables[self.theta]])
        o = cache.attention_with_fused_qkv(layer_id, op.concat([q, k, v], dim=2), hq, sm_scale=c.sm_scale)
        return self.o_proj(op.reshape(o, (b, s, hq * d)))


class Gemma3MLP(nn.Module):
    def __init__(self, config: Gemma3Config, formats: Mapping[str, str], prefix: str):
        hidden, inter = config.hidden_size, config.intermediate_size
        self.gate_up_proj = _linear(formats, f"{prefix}.gate_up_proj", hidden, 2 * inter)
        self.down_proj = _linear(formats, f"{prefix}.down_proj", inter, hidden)

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        gate, up = op.split(self.gate_up_proj(x), 2, axis=-1)
        return self.down_proj(op.tensor_expr_op(gelu_tanh_gate, "gelu_tanh_gate", [gate, up]))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: Gemma3Config, layer_id: int, formats: Mapping[str, str], prefix: str):
        self.self_attn = Gemma3Attention(config, layer_id, formats, f"{prefix}.self_attn")
        self.mlp = Gemma3MLP(config, formats, f"{prefix}.mlp")
        for name in NORMS:
            setattr(self, name, nn.RMSNorm(config.hidden_size, -1, config.rms_norm_eps, bias=False))

    def forward(self, x: nn.Tensor, cache, layer_id: int, rope_tables: Mapping[float, nn.Tensor]) -> nn.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cache, layer_id, rope_tables))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Model(nn.Module):
    def __init__(self, config: Gemma3Config, formats: Mapping[str, str]):
        if "model.embed_tokens" in formats:
            self.embed_tokens = QuantEmbedding(config.vocab_size, config.hidden_size, formats["model.embed_tokens"])
        else:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Gemma3DecoderLayer(config, i, formats, f"model.layers.{i}")
                                     for i in range(config.num_hidden_layers)])
        self.norm = nn.RMSNorm(config.hidden_size, -1, config.rms_norm_eps, bias=False)

    def forward(self, x: nn.Tensor, cache) -> nn.Tensor:
        b, s, _ = x.shape
        positions = query_positions(cache, b * s)
        d = self.layers[0].self_attn.config.head_dim
        tables = {theta: op.tensor_expr_op(rope_table, "rope_table", [positions, theta, d])
                  for theta in sorted({layer.self_attn.theta for layer in self.layers})}
        for layer_id, layer in enumerate(self.layers):
            x = layer(x, cache, layer_id, tables)
        return self.norm(x)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """The decoder and the Llama library's exported functions (kv_cache, cache_spec,
    weight_formats as LlamaForCausalLM's)."""

    decoder_class = Gemma3Model

    def _scaled_embedding(self, input_ids: nn.Tensor) -> nn.Tensor:
        """input_ids [n] int32 -> embeddings [n, hidden] * sqrt(hidden) (a float32 factor, as llama.cpp's)."""
        return self.model.embed_tokens(input_ids) * math.sqrt(self.config.hidden_size)

    def logits(self, h: nn.Tensor) -> nn.Tensor:
        out = super().logits(h)
        cap = self.config.final_logit_softcapping
        return op.tensor_expr_op(soft_cap, "soft_cap", [out, cap]) if cap else out

    def embed(self, input_ids: nn.Tensor) -> nn.Tensor:
        """input_ids [n] int32 -> scaled embeddings [n, hidden]."""
        return self._scaled_embedding(input_ids)

    def decode_step(self, input_ids: nn.Tensor, paged_kv_cache):
        """input_ids [batch] int32 -> (logits [batch, 1, vocab] f32, cache): a whole decode step."""
        h = op.reshape(self._scaled_embedding(input_ids), (input_ids.shape[0], 1, self.config.hidden_size))
        return self.logits(self.model(h, paged_kv_cache)), paged_kv_cache


def _float_parameter_sources(config: Gemma3Config) -> dict[str, tuple[str, ...]]:
    sources: dict[str, tuple[str, ...]] = {"model.embed_tokens.weight": ("model.embed_tokens.weight",)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sources[f"{p}.self_attn.{proj}.weight"] = (f"{p}.self_attn.{proj}.weight",)
        for norm in ("q_norm", "k_norm"):
            sources[f"{p}.self_attn.{norm}.weight"] = (f"{p}.self_attn.{norm}.weight",)
        sources[f"{p}.mlp.gate_up_proj.weight"] = (f"{p}.mlp.gate_proj.weight", f"{p}.mlp.up_proj.weight")
        sources[f"{p}.mlp.down_proj.weight"] = (f"{p}.mlp.down_proj.weight",)
        for norm in NORMS:
            sources[f"{p}.{norm}.weight"] = (f"{p}.{norm}.weight",)
    sources["model.norm.weight"] = ("model.norm.weight",)
    if not config.tie_word_embeddings:
        sources["lm_head.weight"] = ("lm_head.weight",)
    return sources


def hf_parameter_sources(config: Gemma3Config, weight_formats: Mapping[str, str] | None = None
                         ) -> dict[str, tuple[str, ...]]:
    """Parameter name -> the HF tensors it is made of (concatenated along axis 0), in the order
    the model declares its parameters; a layer kept quantized: one entry per block array."""
    return with_kept_parts(_float_parameter_sources(config), weight_formats)


def prepare_tensors(config: Gemma3Config, tensors: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
    """HF tensors as the parameters take them: each RMSNorm weight w as Gemma's multiplier 1 + w."""
    return {name: value + np.float32(1.0) if name.endswith("norm.weight") else value
            for name, value in tensors.items()}
