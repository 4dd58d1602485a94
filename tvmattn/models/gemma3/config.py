"""`Gemma3Config`: the Gemma 3 text decoder's configuration, validated at construction, from a
Hugging Face `config.json` dict (`model_type` "gemma3_text", or "gemma3" with a `text_config`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ..config_base import LAYER_TYPES, ModelConfigError, _fail, _sliding_layers

MODEL_TYPES = ("gemma3_text", "gemma3")
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")  # GELU, tanh approximation (Gemma's GeGLU)


@dataclasses.dataclass(frozen=True)
class Gemma3Config:
    """A Gemma 3 decoder (text).

    Per layer: RMSNorm -> attention (q, k, v projections; RMSNorm of each q and k head over
    head_dim; RoPE with the layer's base: `rope_local_base_freq` on sliding layers, `rope_theta`
    on full ones; scores scaled by query_pre_attn_scalar^-0.5) -> RMSNorm -> residual; RMSNorm ->
    GeGLU MLP (gelu_tanh(gate) * up, down) -> RMSNorm -> residual. Every RMSNorm multiplies by
    (1 + weight) as Gemma's does (Hugging Face's weights; GGUF files store 1 + weight). Embeddings
    scaled by sqrt(hidden_size); final RMSNorm; LM head (tied by default); logits soft-capped by
    final_logit_softcapping (cap * tanh(logits / cap); 0: none). layer_types: per layer
    "sliding_attention" (the last `sliding_window` tokens) or "full_attention".
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int
    sliding_window: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_local_base_freq: float = 10_000.0
    query_pre_attn_scalar: float = 256.0
    final_logit_softcapping: float = 0.0
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 32768

    def __post_init__(self):
        for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                      "num_key_value_heads", "vocab_size", "max_position_embeddings", "sliding_window"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                _fail(field, value, "a positive integer")
        if not isinstance(self.head_dim, int) or self.head_dim <= 0 or self.head_dim % 16 or self.head_dim > 256:
            _fail("head_dim", self.head_dim, "a multiple of 16 from 16 to 256 (the attention kernels' limit)")
        if self.num_attention_heads % self.num_key_value_heads:
            _fail("num_key_value_heads", self.num_key_value_heads,
                  f"a divisor of num_attention_heads={self.num_attention_heads}")
        for field in ("rms_norm_eps", "rope_theta", "rope_local_base_freq", "query_pre_attn_scalar"):
            value = getattr(self, field)
            if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                _fail(field, value, "a positive number")
        cap = self.final_logit_softcapping
        if not (isinstance(cap, (int, float)) and cap >= 0 and math.isfinite(cap)):
            _fail("final_logit_softcapping", cap, "a non-negative number (0: none)")
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if len(self.layer_types) != self.num_hidden_layers:
            _fail("layer_types", list(self.layer_types), f"one entry per layer ({self.num_hidden_layers})")
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            _fail("layer_types", bad[0], f"one of {LAYER_TYPES}")

    @property
    def sliding_layers(self) -> tuple[bool, ...]:
        """Per layer: does it attend to a sliding window (True) or to every key (False)."""
        return tuple(kind == "sliding_attention" for kind in self.layer_types)

    def layer_rope_theta(self, layer: int) -> float:
        """The RoPE base of layer `layer`: local on sliding layers, global on full ones."""
        return self.rope_local_base_freq if self.sliding_layers[layer] else self.rope_theta

    @property
    def sm_scale(self) -> float:
        return 1.0 / math.sqrt(self.query_pre_attn_scalar)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> "Gemma3Config":
        """From a Hugging Face Gemma 3 config.json dict (text decoder; a multimodal "gemma3"
        config's `text_config`). The per-layer kinds: `layer_types`, or `sliding_window_pattern`
        N (layer i full when (i + 1) % N == 0)."""
        if not isinstance(config, dict):
            raise ModelConfigError(f"model config: expected a dict (config.json), got {type(config).__name__}")
        if config.get("model_type") == "gemma3" and isinstance(config.get("text_config"), dict):
            config = {"model_type": "gemma3_text", **config["text_config"]}
        if config.get("model_type") not in MODEL_TYPES:
            _fail("model_type", config.get("model_type"), f"one of {MODEL_TYPES}")
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                    "sliding_window"):
            if key not in config:
                raise ModelConfigError(f"model config: the required field {key!r} is missing")
        activation = config.get("hidden_activation", config.get("hidden_act", "gelu_pytorch_tanh"))
        if activation not in ACTIVATIONS:
            _fail("hidden_activation", activation, f"one of {ACTIVATIONS} (GeGLU)")
        for key in ("attn_logit_softcapping", "rope_scaling"):
            if config.get(key):
                _fail(key, config[key], "null (not implemented)")
        window, layer_types = _sliding_layers({"sliding_window_pattern": 6, **config}, "gemma3_text")
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        return cls(
            hidden_size=config["hidden_size"], intermediate_size=config["intermediate_size"],
            num_hidden_layers=config["num_hidden_layers"], num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads, vocab_size=config["vocab_size"],
            head_dim=head_dim, sliding_window=window, layer_types=layer_types,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(config.get("rope_theta", 1_000_000.0)),
            rope_local_base_freq=float(config.get("rope_local_base_freq", 10_000.0)),
            query_pre_attn_scalar=float(config.get("query_pre_attn_scalar") or head_dim),
            final_logit_softcapping=float(config.get("final_logit_softcapping") or 0.0),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
            max_position_embeddings=int(config.get("max_position_embeddings", 32768)),
        )

    def to_dict(self) -> dict[str, Any]:
        fields = dataclasses.asdict(self)
        fields["layer_types"] = list(self.layer_types)
        return fields
