"""The Llama-family decoder in `tvm.relax.frontend.nn`, with the functions a model library
exports (MLC-LLM style) and the map from its parameters to Hugging Face tensor names.

Architecture: token embedding; per layer RMSNorm -> grouped-query attention (one fused q/k/v
projection, optional q/k/v bias as in Qwen2, RoPE and paged attention in the KV cache) ->
residual -> RMSNorm -> SwiGLU MLP (fused gate/up projection) -> residual; final RMSNorm; LM
head (its own matrix, or the embedding matrix when tied). Logits are float32.

Decode shapes (`[batch, 1, hidden]`: decode, batch_decode, decode_step) of float projections run
the fused ops of compiler.fused_decode where the export enables them (BuildOptions.fused_layers):
the input RMSNorm inside the qkv projection, the post-attention RMSNorm and SiLU * mul inside
gate_up; FuseOps adds the residuals to o_proj and down_proj. A layer is then four model kernels
and the cache's attention call. Where the fused ops are left out of the batched steps (CUDA
without fused_batch_layers), the export's batched_swiglu writes gate_up with SiLU * mul as one
op (matmul_swiglu) after its own RMSNorm. Kept-quantized layers fuse inside QuantLinear instead.

Parameter names are HF's with the fused projections renamed: `...self_attn.qkv_proj.*` holds
q_proj, k_proj, v_proj stacked on the output axis, `...mlp.gate_up_proj.weight` holds gate_proj
then up_proj (see `hf_parameter_sources`).

`weight_formats` (parameter prefix -> GGUF block type, see quant/linear.py) keeps the named
matrices quantized: their layers are QuantLinear / QuantEmbedding, whose `<prefix>.weight`
becomes the block arrays `<prefix>.weight_qs`, `<prefix>.weight_d` (and `<prefix>.weight_m`).
"""

from __future__ import annotations

import functools
import math

from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from typing import Mapping

from ..compiler.fused_decode import (batched_swiglu_enabled, fused_decode_enabled, matmul_swiglu, rms_norm_matmul,
                                     rms_norm_matmul_swiglu)
from ..quant.linear import PART_PREFIX, QuantEmbedding, QuantLinear, float32_products
from ..weights.quant import PACKED
from .config import ModelConfig
from .kv_cache import KVCacheSpec, TvmattnKVCache, kv_cache_object_type, tvm_stock_kv_cache


def _linear(formats: Mapping[str, str], prefix: str, in_features: int, out_features: int, bias: bool = False):
    """nn.Linear, or QuantLinear when `formats` keeps the layer at `prefix` quantized."""
    if prefix in formats:
        return QuantLinear(in_features, out_features, formats[prefix], bias=bias)
    return nn.Linear(in_features, out_features, bias=bias)


def _project(linear, x: nn.Tensor, residual: nn.Tensor | None) -> nn.Tensor:
    """residual + linear(x) (linear(x) without one); a QuantLinear adds it in its kernel where it can."""
    if residual is None:
        return linear(x)
    return linear(x, residual=residual) if isinstance(linear, QuantLinear) else residual + linear(x)


def _fusable(linear, x: nn.Tensor, norm: nn.RMSNorm) -> bool:
    """Whether linear(norm(x)) runs as one fused decode op (compiler.fused_decode): a float
    nn.Linear, a decode shape ([batch, 1, hidden]: one new token per sequence) and the fusion on."""
    return (isinstance(linear, nn.Linear) and _decode_shape(x) and getattr(norm, "bias", None) is None
            and fused_decode_enabled(x.shape[0]))


def _decode_shape(x: nn.Tensor) -> bool:
    """x is [batch, 1, hidden]: one new token per sequence."""
    return len(x.shape) == 3 and isinstance(x.shape[1], int) and x.shape[1] == 1


def _batched_swiglu(linear, x: nn.Tensor) -> bool:
    """Whether a float gate_up without bias of a batched decode step ([batch_size, 1, hidden],
    symbolic batch) runs as compiler.fused_decode.matmul_swiglu (the export's batched_swiglu)."""
    return (isinstance(linear, nn.Linear) and linear.bias is None and _decode_shape(x)
            and batched_swiglu_enabled(x.shape[0]))


def _normed(linear, x: nn.Tensor, norm: nn.RMSNorm) -> nn.Tensor:
    """linear(norm(x)); a QuantLinear normalizes inside its kernel where it can, a float
    projection of a decode step in one fused op (_fusable)."""
    if isinstance(linear, QuantLinear):
        return linear(x, norm=norm)
    if _fusable(linear, x, norm):
        args = [x, norm.weight, linear.weight] + ([linear.bias] if linear.bias is not None else [])
        return op.tensor_expr_op(functools.partial(rms_norm_matmul, eps=float(norm.epsilon)),
                                 "fused_rms_norm_matmul", args=args)
    return linear(norm(x))


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, formats: Mapping[str, str] = {}, prefix: str = ""):
        self.num_q_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.sm_scale = 1.0 / math.sqrt(config.head_dim)
        self.qkv_proj = _linear(formats, f"{prefix}.qkv_proj", config.hidden_size, config.q_size + 2 * config.kv_size,
                                bias=config.attention_bias)
        self.o_proj = _linear(formats, f"{prefix}.o_proj", config.q_size, config.hidden_size)
        if config.qk_norm:  # Qwen3: RMSNorm of each q and k head before RoPE
            self.q_norm = nn.RMSNorm(config.head_dim, -1, config.rms_norm_eps, bias=False)
            self.k_norm = nn.RMSNorm(config.head_dim, -1, config.rms_norm_eps, bias=False)

    def forward(self, x: nn.Tensor, cache, layer_id: int, norm: nn.RMSNorm) -> nn.Tensor:
        """x + attention(norm(x)) (the residual stream x; the norm may run inside the qkv projection)."""
        b, s, _ = x.shape
        heads = self.num_q_heads + 2 * self.num_kv_heads
        qkv = op.reshape(_normed(self.qkv_proj, x, norm), (b, s, heads, self.head_dim))
        if hasattr(self, "q_norm"):
            q, k, v = op.split(qkv, [self.num_q_heads, self.num_q_heads + self.num_kv_heads], axis=2)
            qkv = op.concat([self.q_norm(q), self.k_norm(k), v], dim=2)
        o = cache.attention_with_fused_qkv(layer_id, qkv, self.num_q_heads, sm_scale=self.sm_scale)
        return _project(self.o_proj, op.reshape(o, (b, s, self.num_q_heads * self.head_dim)), x)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, formats: Mapping[str, str] = {}, prefix: str = ""):
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = _linear(formats, f"{prefix}.gate_up_proj", config.hidden_size, 2 * config.intermediate_size)
        self.down_proj = _linear(formats, f"{prefix}.down_proj", config.intermediate_size, config.hidden_size)

    def forward(self, x: nn.Tensor, norm: nn.RMSNorm) -> nn.Tensor:
        """x + mlp(norm(x)) (the norm may run inside gate_up_proj, the SwiGLU gate inside down_proj)."""
        if _fusable(self.gate_up_proj, x, norm):  # norm, gate_up and SiLU * mul in one op
            h = op.tensor_expr_op(functools.partial(rms_norm_matmul_swiglu, eps=float(norm.epsilon)),
                                  "fused_rms_norm_matmul_swiglu", args=[x, norm.weight, self.gate_up_proj.weight])
            return _project(self.down_proj, h, x)
        if _batched_swiglu(self.gate_up_proj, x):  # gate_up with SiLU * mul as its epilogue
            h = op.tensor_expr_op(matmul_swiglu, "fused_matmul_swiglu", args=[norm(x), self.gate_up_proj.weight])
            return _project(self.down_proj, h, x)
        gate_up = _normed(self.gate_up_proj, x, norm)
        if isinstance(self.down_proj, QuantLinear):
            return self.down_proj(gate_up, residual=x, swiglu=True)
        gate, up = op.split(gate_up, 2, axis=-1)
        return _project(self.down_proj, op.silu(gate) * up, x)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, formats: Mapping[str, str] = {}, prefix: str = ""):
        self.self_attn = Attention(config, formats, f"{prefix}.self_attn")
        self.mlp = MLP(config, formats, f"{prefix}.mlp")
        self.input_layernorm = nn.RMSNorm(config.hidden_size, -1, config.rms_norm_eps, bias=False)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, -1, config.rms_norm_eps, bias=False)

    def forward(self, x: nn.Tensor, cache, layer_id: int) -> nn.Tensor:
        x = self.self_attn(x, cache, layer_id, self.input_layernorm)
        return self.mlp(x, self.post_attention_layernorm)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, formats: Mapping[str, str] = {}):
        if "model.embed_tokens" in formats:
            self.embed_tokens = QuantEmbedding(config.vocab_size, config.hidden_size, formats["model.embed_tokens"])
        else:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(config, formats, f"model.layers.{i}")
                                     for i in range(config.num_hidden_layers)])
        self.norm = nn.RMSNorm(config.hidden_size, -1, config.rms_norm_eps, bias=False)

    def forward(self, x: nn.Tensor, cache) -> nn.Tensor:
        for layer_id, layer in enumerate(self.layers):
            x = layer(x, cache, layer_id)
        return self.norm(x)


def _last_token(x: te.Tensor) -> te.Tensor:
    """[b, s, d] -> [b, 1, d]: the last position of each row."""
    b, s, d = x.shape
    return te.compute((b, 1, d), lambda i, _, k: x[i, s - 1, k], name="last_token")


class LlamaForCausalLM(nn.Module):
    """The decoder and its exported functions.

    kv_cache: "tvmattn" (tvmattn's cache with the kernels compiled into the library) or "tvm"
    (TVM's stock TIRPagedKVCache); cache_spec fixes the cache's compile-time options;
    weight_formats: the layers kept quantized (module docstring).
    """

    decoder_class = LlamaModel  # the layer stack; a family with other layers names its own

    def __init__(self, config: ModelConfig, cache_spec: KVCacheSpec, kv_cache: str = "tvmattn",
                 weight_formats: Mapping[str, str] | None = None):
        formats = dict(weight_formats or {})
        self.config = config
        self.cache_spec = cache_spec
        self.kv_cache = kv_cache
        self.dtype = cache_spec.dtype
        self.model = self.decoder_class(config, formats)
        if not config.tie_word_embeddings:
            self.lm_head = _linear(formats, "lm_head", config.hidden_size, config.vocab_size)

    def logits(self, h: nn.Tensor) -> nn.Tensor:
        if self.config.tie_word_embeddings and isinstance(self.model.embed_tokens, QuantEmbedding):
            out = self.model.embed_tokens.lm_head(h)
        elif self.config.tie_word_embeddings:
            out = op.matmul(h, op.permute_dims(self.model.embed_tokens.weight))
        else:
            out = self.lm_head(h)
        return out if out.dtype == "float32" else op.astype(out, "float32")

    # ---- exported functions ----------------------------------------------------------------
    def embed(self, input_ids: nn.Tensor) -> nn.Tensor:
        """input_ids [n] int32 -> embeddings [n, hidden]."""
        return self.model.embed_tokens(input_ids)

    def prefill(self, input_embed: nn.Tensor, paged_kv_cache):
        """input_embed [1, n, hidden] of one sequence -> (logits [1, 1, vocab] of its last token, cache)."""
        h = self.model(input_embed, paged_kv_cache)
        h = op.tensor_expr_op(_last_token, name_hint="last_token", args=[h])
        return self.logits(h), paged_kv_cache

    def decode(self, input_embed: nn.Tensor, paged_kv_cache):
        """input_embed [1, 1, hidden] -> (logits [1, 1, vocab], cache)."""
        return self.logits(self.model(input_embed, paged_kv_cache)), paged_kv_cache

    def batch_prefill(self, input_embeds: nn.Tensor, logit_positions: nn.Tensor, paged_kv_cache):
        """input_embeds [1, n, hidden] (the step's sequences packed in begin_forward order),
        logit_positions [k] int32 (token indices to score) -> (logits [1, k, vocab], cache)."""
        h = op.take(self.model(input_embeds, paged_kv_cache), logit_positions, axis=1)
        return self.logits(h), paged_kv_cache

    def batch_decode(self, input_embeds: nn.Tensor, paged_kv_cache):
        """input_embeds [batch, 1, hidden] -> (logits [batch, 1, vocab], cache)."""
        return self.logits(self.model(input_embeds, paged_kv_cache)), paged_kv_cache

    def decode_step(self, input_ids: nn.Tensor, paged_kv_cache):
        """input_ids [batch] int32 -> (logits [batch, 1, vocab] f32, cache): a whole decode step
        (embedding, every layer, final norm, logits) in one call, the unit a CUDA graph captures
        (tvmattn.runtime.graphs); its intermediates live in storage allocated once."""
        h = self.model.embed_tokens(input_ids)
        h = op.reshape(h, (input_ids.shape[0], 1, self.config.hidden_size))
        return self.logits(self.model(h, paged_kv_cache)), paged_kv_cache

    def batch_verify(self, input_embeds: nn.Tensor, paged_kv_cache):
        """input_embeds [1, n, hidden]: every node of the step's token trees (the sequences
        packed in begin_forward order, each tree's nodes parent before child, with the tree
        given to begin_forward as token_tree_parent_ptr) -> (logits [1, n, vocab] of every
        node, cache). Speculative decoding verifies a draft with it; kept-quantized layers
        multiply in float32 here (quant.linear.float32_products)."""
        with float32_products():
            return self.logits(self.model(input_embeds, paged_kv_cache)), paged_kv_cache

    def create_paged_kv_cache(self, max_batch_size: tirx.Var, max_total_seq_len: tirx.Var,
                              prefill_chunk_size: tirx.Var, page_size: tirx.Var, support_sliding_window: tirx.Var):
        args = (self.cache_spec, max_batch_size, max_total_seq_len, prefill_chunk_size, page_size,
                support_sliding_window)
        if self.kv_cache == "tvmattn":
            return TvmattnKVCache.create(*args)
        return tvm_stock_kv_cache(*args)

    def get_default_spec(self) -> nn.spec.ModuleSpec:
        hidden, dtype = self.config.hidden_size, self.dtype
        cache = nn.spec.Object(object_type=kv_cache_object_type(self.kv_cache))
        packed = {"param_mode": "packed", "effect_mode": "none"}
        spec = {
            "embed": {"input_ids": nn.spec.Tensor(["seq_len"], "int32"), "$": packed},
            "prefill": {"input_embed": nn.spec.Tensor([1, "seq_len", hidden], dtype), "paged_kv_cache": cache,
                        "$": packed},
            "decode": {"input_embed": nn.spec.Tensor([1, 1, hidden], dtype), "paged_kv_cache": cache, "$": packed},
            "batch_prefill": {"input_embeds": nn.spec.Tensor([1, "seq_len", hidden], dtype),
                              "logit_positions": nn.spec.Tensor(["batch_size"], "int32"),
                              "paged_kv_cache": cache, "$": packed},
            "batch_decode": {"input_embeds": nn.spec.Tensor(["batch_size", 1, hidden], dtype),
                             "paged_kv_cache": cache, "$": packed},
            "decode_step": {"input_ids": nn.spec.Tensor(["batch_size"], "int32"), "paged_kv_cache": cache,
                            "$": packed},
            "batch_verify": {"input_embeds": nn.spec.Tensor([1, "seq_len", hidden], dtype),
                             "paged_kv_cache": cache, "$": packed},
            "create_paged_kv_cache": {
                "max_batch_size": int, "max_total_seq_len": int, "prefill_chunk_size": int, "page_size": int,
                "support_sliding_window": int, "$": {"param_mode": "none", "effect_mode": "none"},
            },
        }
        return nn.spec.ModuleSpec.from_raw(spec, self)


def hf_parameter_sources(config: ModelConfig, weight_formats: Mapping[str, str] | None = None
                         ) -> dict[str, tuple[str, ...]]:
    """Parameter name -> the HF tensors it is made of, concatenated along axis 0, in the
    order the model declares its parameters (a layer kept quantized: one entry per block array,
    `<prefix>.weight_<part>`, each made of the same HF tensors)."""
    return with_kept_parts(_float_parameter_sources(config), weight_formats)


def with_kept_parts(sources: dict[str, tuple[str, ...]], weight_formats: Mapping[str, str] | None
                    ) -> dict[str, tuple[str, ...]]:
    """`sources` (parameter name -> HF tensors) with each layer kept quantized replaced by one
    entry per block array, `<prefix>.weight_<part>`, each made of the same HF tensors."""
    formats = weight_formats or {}
    out: dict[str, tuple[str, ...]] = {}
    for name, names in sources.items():
        prefix = name[:-len(".weight")] if name.endswith(".weight") else None
        if prefix in formats:
            for part, _, _ in PACKED[formats[prefix]]:
                out[f"{prefix}.{PART_PREFIX}{part}"] = names
        else:
            out[name] = names
    return out


def _float_parameter_sources(config: ModelConfig) -> dict[str, tuple[str, ...]]:
    sources: dict[str, tuple[str, ...]] = {"model.embed_tokens.weight": ("model.embed_tokens.weight",)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        attn = f"{p}.self_attn"
        sources[f"{attn}.qkv_proj.weight"] = tuple(f"{attn}.{x}_proj.weight" for x in "qkv")
        if config.attention_bias:
            sources[f"{attn}.qkv_proj.bias"] = tuple(f"{attn}.{x}_proj.bias" for x in "qkv")
        sources[f"{attn}.o_proj.weight"] = (f"{attn}.o_proj.weight",)
        if config.qk_norm:
            sources[f"{attn}.q_norm.weight"] = (f"{attn}.q_norm.weight",)
            sources[f"{attn}.k_norm.weight"] = (f"{attn}.k_norm.weight",)
        sources[f"{p}.mlp.gate_up_proj.weight"] = (f"{p}.mlp.gate_proj.weight", f"{p}.mlp.up_proj.weight")
        sources[f"{p}.mlp.down_proj.weight"] = (f"{p}.mlp.down_proj.weight",)
        sources[f"{p}.input_layernorm.weight"] = (f"{p}.input_layernorm.weight",)
        sources[f"{p}.post_attention_layernorm.weight"] = (f"{p}.post_attention_layernorm.weight",)
    sources["model.norm.weight"] = ("model.norm.weight",)
    if not config.tie_word_embeddings:
        sources["lm_head.weight"] = ("lm_head.weight",)
    return sources
