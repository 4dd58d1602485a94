"""`ModelConfig`: the shape and numerics of a Llama-family decoder, validated at construction.

Built from a Hugging Face style `config.json` dict with `ModelConfig.from_hf` (the weight
readers turn GGUF metadata into such a dict too). It says nothing about how the model is
compiled (target, dtype of the library, KV-cache sizes): those are build options.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from tir_kernels import RopeScaling

# HF `model_type`s whose decoder is the one in llama.py (Qwen2 = Llama + q/k/v bias).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "smollm", "smollm2")


class ModelConfigError(ValueError):
    """A model configuration the decoder cannot run; the message names the field."""


def _fail(field: str, value, expected: str):
    raise ModelConfigError(f"model config: {field}={value!r} is not supported: expected {expected}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder.

    hidden_size: model width; intermediate_size: SwiGLU inner width.
    num_attention_heads / num_key_value_heads: query and key/value heads (GQA);
    head_dim: per-head width (default hidden_size // num_attention_heads).
    rms_norm_eps: RMSNorm epsilon; rope_theta: RoPE base; rope_scaling: optional Llama-3
    frequency scaling. vocab_size: embedding rows. tie_word_embeddings: the LM head reuses the
    embedding matrix. attention_bias: q/k/v projections have a bias (Qwen2); o_proj never does.
    max_position_embeddings: the longest context the model was trained for.
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int = 0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 2048

    def __post_init__(self):
        for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                      "num_key_value_heads", "vocab_size", "max_position_embeddings"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                _fail(field, value, "a positive integer")
        if self.head_dim == 0:
            if self.hidden_size % self.num_attention_heads:
                _fail("hidden_size", self.hidden_size,
                      f"a multiple of num_attention_heads={self.num_attention_heads} when head_dim is not given")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if not isinstance(self.head_dim, int) or self.head_dim <= 0 or self.head_dim % 16 or self.head_dim > 256:
            _fail("head_dim", self.head_dim, "a multiple of 16 from 16 to 256 (the attention kernels' limit)")
        if self.num_attention_heads % self.num_key_value_heads:
            _fail("num_key_value_heads", self.num_key_value_heads,
                  f"a divisor of num_attention_heads={self.num_attention_heads}")
        if not (self.rms_norm_eps > 0 and math.isfinite(self.rms_norm_eps)):
            _fail("rms_norm_eps", self.rms_norm_eps, "a positive number")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            _fail("rope_theta", self.rope_theta, "a positive number")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            _fail("rope_scaling", self.rope_scaling, "a tir_kernels.RopeScaling or None")

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> "ModelConfig":
        """From a Hugging Face `config.json` dict (Llama, Mistral without sliding window, Qwen2)."""
        if not isinstance(config, dict):
            raise ModelConfigError(f"model config: expected a dict (config.json), got {type(config).__name__}")
        model_type = config.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            _fail("model_type", model_type, f"one of {SUPPORTED_MODEL_TYPES}")
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
            if key not in config:
                raise ModelConfigError(f"model config: the required field {key!r} is missing")
        if config.get("sliding_window") and config.get("use_sliding_window", model_type == "mistral"):
            _fail("sliding_window", config["sliding_window"], "none (sliding-window models are not supported yet)")
        if config.get("hidden_act", "silu") != "silu":
            _fail("hidden_act", config["hidden_act"], '"silu" (SwiGLU)')
        try:
            rope_scaling = RopeScaling.from_hf(config.get("rope_scaling"))
        except (KeyError, ValueError) as error:
            raise ModelConfigError(f"model config: rope_scaling={config.get('rope_scaling')!r}: {error}") from None
        heads = config["num_attention_heads"]
        return cls(
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            vocab_size=config["vocab_size"],
            head_dim=config.get("head_dim") or 0,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
            rope_theta=float(config.get("rope_theta", 10000.0)),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", model_type == "qwen2")),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (rope_scaling as an HF-style dict)."""
        fields = dataclasses.asdict(self)
        if self.rope_scaling is not None:
            fields["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(self.rope_scaling)}
        return fields

    def hf_rope_scaling(self) -> dict[str, Any]:
        """rope_scaling as the HF dict TVM's kernels read ({} when none)."""
        return self.to_dict()["rope_scaling"] or {}
