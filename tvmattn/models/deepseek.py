"""The DeepSeek-V2-style decoder (multi-head latent attention, dense SwiGLU MLPs) in
`tvm.relax.frontend.nn`, on tvmattn's MLA cache (mla_cache.py), and its parameter map.

Per layer: RMSNorm -> MLA -> residual -> RMSNorm -> SwiGLU MLP -> residual; then the final
RMSNorm and the LM head (as llama.py; the exported functions are LlamaForCausalLM's but
batch_verify: TVM's and our MLA caches have no token trees).

MLA (H heads; nope, rope, v: the head dims; latent: kv_lora_rank; see DeepseekV2Config):
- q [b, s, H, nope + rope] = q_proj(x), or q_b_proj(RMSNorm(q_a_proj(x))) with q_lora_rank;
  q = [q_nope, q_pe];
- kv_a_proj_with_mqa(x) = [c (latent), k_pe (rope)], c <- RMSNorm(c); RoPE on q_pe and k_pe at
  the cache's query positions; the cache gets the row [c, k_pe] (append_mla_kv);
- kv_b_proj [H * (nope + v), latent] holds per head W_UK [nope, latent] and W_UV [v, latent];
- absorbed attention over the cache: q_abs = [W_UK^T q_nope, q_pe] [n, H, latent + rope]
  against the rows [c, k_pe] gives o_lat [n, H, latent], and W_UV o_lat the per-head output;
  q_abs . [c, k_pe] = q_nope . (W_UK c) + q_pe . k_pe, the original score;
- prefill steps: self attention among the step's tokens on the expanded heads (k = [W_UK c,
  k_pe], v = W_UV c: ragged prefill at nope + rope / v) merged by LSE with the absorbed cross
  attention over the history; decode steps: the absorbed attention alone (the cache appends
  the step's rows before it);
- softmax scale 1/sqrt(nope + rope) everywhere; o_proj.

Prefill functions need a step in which some sequence appends more than one token: the cache
plans a step of one token per sequence as a decode step (TVM's rule), whose cross attention
already covers the new rows, so the self attention would count them twice. Such steps go to
decode / batch_decode (tvmattn.session.ModelSession routes them so).

RoPE: rotate-half over the rope part. HF's DeepSeek-V2 rotates interleaved pairs (it
de-interleaves q_pe and k_pe, [x0, x2, ..., x1, x3, ...], before rotate-half); `prepare_hf_tensors`
applies that permutation to the output rows of the rope part of q_proj / q_b_proj and of
kv_a_proj_with_mqa, so the library's rotate-half gives HF's result (scores are invariant to the
same permutation of q_pe and k_pe).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from .config import DeepseekV2Config
from .llama import MLP, LlamaForCausalLM, _last_token
from .mla_cache import MLACacheSpec, TvmattnMLACache

# The functions a DeepSeek library exports (no batch_verify).
FUNCTIONS = ("embed", "prefill", "decode", "batch_prefill", "batch_decode", "create_paged_kv_cache")


def _rope(x: te.Tensor, positions: te.Tensor, theta: float) -> te.Tensor:
    """x [b, s, h, d] rotated (rotate-half, fp32) at positions [b * s] int32."""
    s, d = x.shape[1], int(x.shape[3])
    half = d // 2

    def value(i, j, head, k):
        position = positions[i * s + j].astype("float32")
        exponent = (k % half).astype("float32") * (2.0 / d)
        angle = position / tirx.power(tirx.const(theta, "float32"), exponent)
        own = x[i, j, head, k].astype("float32")
        other = tirx.if_then_else(k < half, -x[i, j, head, k + half].astype("float32"),
                                  x[i, j, head, k - half].astype("float32"))
        return (own * tirx.cos(angle) + other * tirx.sin(angle)).astype(x.dtype)

    return te.compute(x.shape, value, name="rope")


class MLAttention(nn.Module):
    def __init__(self, config: DeepseekV2Config):
        self.config = config
        c, heads = config, config.num_attention_heads
        if c.q_lora_rank:
            self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False)
            self.q_a_layernorm = nn.RMSNorm(c.q_lora_rank, -1, c.rms_norm_eps, bias=False)
            self.q_b_proj = nn.Linear(c.q_lora_rank, heads * c.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(c.hidden_size, heads * c.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = nn.RMSNorm(c.kv_lora_rank, -1, c.rms_norm_eps, bias=False)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, heads * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.o_proj = nn.Linear(heads * c.v_head_dim, c.hidden_size, bias=False)

    def _queries(self, x: nn.Tensor) -> nn.Tensor:
        if self.config.q_lora_rank:
            return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return self.q_proj(x)

    def _heads_first(self, x: nn.Tensor) -> nn.Tensor:
        """[b, s, H, d] -> [H, b * s, d]."""
        b, s, h, d = x.shape
        return op.permute_dims(op.reshape(x, (b * s, h, d)), (1, 0, 2))

    def _heads_last(self, x: nn.Tensor, b, s) -> nn.Tensor:
        """[H, b * s, d] -> [b, s, H, d]."""
        h, _, d = x.shape
        return op.reshape(op.permute_dims(x, (1, 0, 2)), (b, s, h, d))

    def forward(self, x: nn.Tensor, cache: TvmattnMLACache, layer_id: int, decode: bool):
        """x [b, s, hidden] -> ([b, s, hidden], the cache after the append)."""
        c, heads = self.config, self.config.num_attention_heads
        nope, rope, latent, dv = c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank, c.v_head_dim
        b, s, _ = x.shape
        q = op.reshape(self._queries(x), (b, s, heads, nope + rope))
        q_nope, q_pe = op.split(q, [nope], axis=3)
        compressed, k_pe = op.split(self.kv_a_proj_with_mqa(x), [latent], axis=2)
        compressed = self.kv_a_layernorm(compressed)
        positions = cache.query_positions(b * s)
        q_pe = op.tensor_expr_op(_rope, "rope_q", [q_pe, positions, c.rope_theta])
        k_pe = op.tensor_expr_op(_rope, "rope_k", [op.reshape(k_pe, (b, s, 1, rope)), positions, c.rope_theta])
        cache = cache.append_mla_kv(layer_id, op.concat([compressed, op.reshape(k_pe, (b, s, rope))], dim=2))

        w = op.reshape(self.kv_b_proj.weight, (heads, nope + dv, latent))
        w_uk, w_uv = op.split(w, [nope], axis=1)  # [H, nope, latent], [H, v, latent]
        q_latent = self._heads_last(op.matmul(self._heads_first(q_nope), w_uk), b, s)  # [b, s, H, latent]
        o_latent, lse_cross = cache.cross_attention(layer_id, op.concat([q_latent, q_pe], dim=3), latent,
                                                    c.sm_scale)
        o = self._heads_last(op.matmul(self._heads_first(o_latent), op.permute_dims(w_uv, (0, 2, 1))), b, s)
        if not decode:
            kv = op.reshape(self.kv_b_proj(compressed), (b, s, heads, nope + dv))
            k_nope, v = op.split(kv, [nope], axis=3)
            k = op.concat([k_nope, op.broadcast_to(k_pe, (b, s, heads, rope))], dim=3)
            o_self, lse_self = cache.self_attention(layer_id, op.concat([q_nope, q_pe], dim=3), k, v, c.sm_scale)
            o, _ = cache.merge_attn_output_inplace(o_self, lse_self, o, lse_cross)
        return self.o_proj(op.reshape(o, (b, s, heads * dv))), cache


class DecoderLayer(nn.Module):
    def __init__(self, config: DeepseekV2Config):
        self.self_attn = MLAttention(config)
        self.mlp = MLP(config)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, -1, config.rms_norm_eps, bias=False)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, -1, config.rms_norm_eps, bias=False)

    def forward(self, x: nn.Tensor, cache: TvmattnMLACache, layer_id: int, decode: bool):
        attn, cache = self.self_attn(self.input_layernorm(x), cache, layer_id, decode)
        x = x + attn
        return self.mlp(x, self.post_attention_layernorm), cache


class DeepseekV2Model(nn.Module):
    def __init__(self, config: DeepseekV2Config):
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = nn.RMSNorm(config.hidden_size, -1, config.rms_norm_eps, bias=False)

    def forward(self, x: nn.Tensor, cache: TvmattnMLACache, decode: bool) -> nn.Tensor:
        for layer_id, layer in enumerate(self.layers):
            x, cache = layer(x, cache, layer_id, decode)
        return self.norm(x)


def cache_spec(config: DeepseekV2Config, dtype: str, target: str, page_size: int,
               kv_dtype: str = "") -> MLACacheSpec:
    """The library's MLA cache spec; kv_dtype: "" (dtype pages) or an FP8 format (latent pages)."""
    return MLACacheSpec(num_layers=config.num_hidden_layers, num_heads=config.num_attention_heads,
                        latent_dim=config.kv_lora_rank, rope_dim=config.qk_rope_head_dim,
                        qk_nope_head_dim=config.qk_nope_head_dim, v_head_dim=config.v_head_dim, dtype=dtype,
                        target=target, page_size=page_size, rope_theta=config.rope_theta, kv_dtype=kv_dtype)


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    """The decoder and its exported functions (LlamaForCausalLM's, with the MLA cache and
    without batch_verify). kv_cache must be "tvmattn"; no weight formats (float weights only)."""

    def __init__(self, config: DeepseekV2Config, cache_spec: MLACacheSpec, kv_cache: str = "tvmattn",
                 weight_formats: Mapping[str, str] | None = None):
        if kv_cache != "tvmattn":
            raise ValueError(f"kv_cache={kv_cache!r}: the DeepSeek (MLA) model runs on tvmattn's cache only")
        if weight_formats:
            raise ValueError("weight_formats: the DeepSeek (MLA) model takes float weights only")
        self.config = config
        self.cache_spec = cache_spec
        self.kv_cache = kv_cache
        self.dtype = cache_spec.dtype
        self.model = DeepseekV2Model(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def prefill(self, input_embed: nn.Tensor, paged_kv_cache):
        h = self.model(input_embed, paged_kv_cache, decode=False)
        h = op.tensor_expr_op(_last_token, name_hint="last_token", args=[h])
        return self.logits(h), paged_kv_cache

    def decode(self, input_embed: nn.Tensor, paged_kv_cache):
        return self.logits(self.model(input_embed, paged_kv_cache, decode=True)), paged_kv_cache

    def batch_prefill(self, input_embeds: nn.Tensor, logit_positions: nn.Tensor, paged_kv_cache):
        h = op.take(self.model(input_embeds, paged_kv_cache, decode=False), logit_positions, axis=1)
        return self.logits(h), paged_kv_cache

    def batch_decode(self, input_embeds: nn.Tensor, paged_kv_cache):
        return self.logits(self.model(input_embeds, paged_kv_cache, decode=True)), paged_kv_cache

    def create_paged_kv_cache(self, max_batch_size: tirx.Var, max_total_seq_len: tirx.Var,
                              prefill_chunk_size: tirx.Var, page_size: tirx.Var, support_sliding_window: tirx.Var):
        return TvmattnMLACache.create(self.cache_spec, max_batch_size, max_total_seq_len, prefill_chunk_size,
                                      page_size, support_sliding_window)

    def get_default_spec(self) -> nn.spec.ModuleSpec:
        spec = super().get_default_spec()
        cache = nn.spec.Object(object_type=TvmattnMLACache)
        raw = {}
        for name, function in zip(spec.method_names, spec.method_specs):
            if name not in FUNCTIONS:
                continue
            args = {arg: (cache if arg == "paged_kv_cache" else info)
                    for arg, info in zip(function.arg_names, function.arg_specs)}
            raw[name] = {**args, "$": {"param_mode": function.param_mode, "effect_mode": function.effect_mode}}
        return nn.spec.ModuleSpec.from_raw(raw, self)


def hf_parameter_sources(config: DeepseekV2Config, weight_formats: Mapping[str, str] | None = None
                         ) -> dict[str, tuple[str, ...]]:
    """Parameter name -> the HF tensors it is made of (concatenated along axis 0), in the order
    the model declares its parameters; the names are HF's but mlp.gate_up_proj (gate, up)."""
    if weight_formats:
        raise ValueError("weight_formats: the DeepSeek (MLA) model takes float weights only")
    sources: dict[str, tuple[str, ...]] = {"model.embed_tokens.weight": ("model.embed_tokens.weight",)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        attn = [f"{p}.self_attn.{name}.weight" for name in (
            ("q_a_proj", "q_a_layernorm", "q_b_proj") if config.q_lora_rank else ("q_proj",))]
        attn += [f"{p}.self_attn.{name}.weight" for name in ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj",
                                                              "o_proj")]
        sources.update({name: (name,) for name in attn})
        sources[f"{p}.mlp.gate_up_proj.weight"] = (f"{p}.mlp.gate_proj.weight", f"{p}.mlp.up_proj.weight")
        sources[f"{p}.mlp.down_proj.weight"] = (f"{p}.mlp.down_proj.weight",)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            sources[f"{p}.{norm}.weight"] = (f"{p}.{norm}.weight",)
    sources["model.norm.weight"] = ("model.norm.weight",)
    if not config.tie_word_embeddings:
        sources["lm_head.weight"] = ("lm_head.weight",)
    return sources


def deinterleave(rope_dim: int) -> np.ndarray:
    """Row order that turns interleaved rotary pairs into rotate-half order: [0, 2, ..., 1, 3, ...]."""
    return np.concatenate([np.arange(0, rope_dim, 2), np.arange(1, rope_dim, 2)])


def prepare_hf_tensors(config: DeepseekV2Config, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF tensors with the rope rows of q_proj / q_b_proj and kv_a_proj_with_mqa de-interleaved
    (module docstring); others as given. Tensors missing here are left for pack_params to name."""
    heads, nope, rope, latent = (config.num_attention_heads, config.qk_nope_head_dim, config.qk_rope_head_dim,
                                 config.kv_lora_rank)
    order = deinterleave(rope)
    out = dict(tensors)
    for i in range(config.num_hidden_layers):
        attn = f"model.layers.{i}.self_attn"
        q_name = f"{attn}.q_b_proj.weight" if config.q_lora_rank else f"{attn}.q_proj.weight"
        if q_name in out:
            q = np.asarray(out[q_name])
            per_head = q.reshape(heads, nope + rope, -1)
            rows = np.concatenate([np.arange(nope), nope + order])
            out[q_name] = per_head[:, rows].reshape(q.shape)
        kv_name = f"{attn}.kv_a_proj_with_mqa.weight"
        if kv_name in out:
            kv = np.asarray(out[kv_name])
            out[kv_name] = kv[np.concatenate([np.arange(latent), latent + order])]
    return out
