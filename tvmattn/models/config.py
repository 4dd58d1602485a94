"""Model configurations, validated at construction: `ModelConfig` (the Llama-family decoder,
optionally with sliding-window layers) and `DeepseekV2Config` (multi-head latent attention).

Built from a Hugging Face style `config.json` dict with `model_config_from_hf` (by its
`model_type`), or each class's `from_hf` (the weight readers turn GGUF metadata into such a dict
too). They say nothing about how the model is compiled (target, dtype of the library, KV-cache
sizes): those are build options.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from tir_kernels import RopeScaling
from tir_kernels.support import MAX_HEAD_DIM

from .config_base import LAYER_TYPES, ModelConfigError, _fail, _sliding_layers  # noqa: F401 - re-exported

# HF `model_type`s whose decoder is the one in llama.py (Qwen2 = Llama + q/k/v bias; Qwen3 =
# Llama + RMSNorm of each q and k head).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "smollm", "smollm2")
# HF `model_type` of the multi-head latent attention decoder in deepseek.py.
DEEPSEEK_V2 = "deepseek_v2"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder.

    hidden_size: model width; intermediate_size: SwiGLU inner width.
    num_attention_heads / num_key_value_heads: query and key/value heads (GQA);
    head_dim: per-head width (default hidden_size // num_attention_heads).
    rms_norm_eps: RMSNorm epsilon; rope_theta: RoPE base; rope_scaling: optional Llama-3
    frequency scaling. vocab_size: embedding rows. tie_word_embeddings: the LM head reuses the
    embedding matrix. attention_bias: q/k/v projections have a bias (Qwen2); o_proj never does.
    qk_norm: each q and k head is RMS-normed (weights [head_dim]) before RoPE (Qwen3).
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
    sliding_window: int = 0
    layer_types: tuple[str, ...] = ()
    qk_norm: bool = False

    def __post_init__(self):
        if not isinstance(self.qk_norm, bool):
            _fail("qk_norm", self.qk_norm, "a bool")
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
        self._check_sliding()

    def _check_sliding(self) -> None:
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        window = self.sliding_window
        if not isinstance(window, int) or isinstance(window, bool) or window < 0:
            _fail("sliding_window", window, "a non-negative integer (0: no sliding layers)")
        if not self.layer_types:
            return
        if len(self.layer_types) != self.num_hidden_layers:
            _fail("layer_types", list(self.layer_types), f"one entry per layer ({self.num_hidden_layers})")
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            _fail("layer_types", bad[0], f"one of {LAYER_TYPES}")
        if window == 0 and "sliding_attention" in self.layer_types:
            _fail("sliding_window", window, "a positive window size for the sliding_attention layers")

    @property
    def sliding_layers(self) -> tuple[bool, ...]:
        """Per layer: does it attend to a sliding window (True) or to every key (False)."""
        if self.sliding_window == 0 or not self.layer_types:
            return (False,) * self.num_hidden_layers
        return tuple(kind == "sliding_attention" for kind in self.layer_types)

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
        sliding_window, layer_types = _sliding_layers(config, model_type)
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
            sliding_window=sliding_window,
            layer_types=layer_types,
            qk_norm=model_type == "qwen3",
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (rope_scaling as an HF-style dict)."""
        fields = dataclasses.asdict(self)
        fields["layer_types"] = list(self.layer_types)
        if self.rope_scaling is not None:
            fields["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(self.rope_scaling)}
        return fields

    def hf_rope_scaling(self) -> dict[str, Any]:
        """rope_scaling as the HF dict TVM's kernels read ({} when none)."""
        return self.to_dict()["rope_scaling"] or {}


@dataclasses.dataclass(frozen=True)
class DeepseekV2Config:
    """A DeepSeek-V2-style decoder with multi-head latent attention (MLA) and dense SwiGLU MLPs.

    Attention per layer: q from hidden (q_lora_rank 0) or through a rank-q_lora_rank bottleneck
    with an RMSNorm; per head q = [q_nope (qk_nope_head_dim), q_pe (qk_rope_head_dim)]. One
    compressed row per token: kv_a_proj_with_mqa gives [c (kv_lora_rank), k_pe
    (qk_rope_head_dim)], c is RMS-normed; kv_b_proj expands c into per-head k_nope and v
    (v_head_dim). RoPE rotates q_pe and k_pe only. The softmax scale is
    1/sqrt(qk_nope_head_dim + qk_rope_head_dim). The cache holds [c, rotated k_pe] per token.
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048

    def __post_init__(self):
        from tir_kernels.config import MAX_MLA_LATENT_DIM

        for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                      "max_position_embeddings"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                _fail(field, value, "a positive integer")
        if not isinstance(self.q_lora_rank, int) or isinstance(self.q_lora_rank, bool) or self.q_lora_rank < 0:
            _fail("q_lora_rank", self.q_lora_rank, "a non-negative integer (0: no q bottleneck)")
        limits = {"kv_lora_rank": MAX_MLA_LATENT_DIM, "qk_nope_head_dim": MAX_HEAD_DIM,
                  "qk_rope_head_dim": MAX_HEAD_DIM, "v_head_dim": MAX_HEAD_DIM}
        for field, limit in limits.items():
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or value % 16 or value > limit:
                _fail(field, value, f"a multiple of 16 from 16 to {limit} (the MLA kernels' limit)")
        if self.qk_head_dim > MAX_HEAD_DIM:
            _fail("qk_nope_head_dim", self.qk_nope_head_dim,
                  f"at most {MAX_HEAD_DIM} with qk_rope_head_dim (the ragged prefill's head dim)")
        if not (self.rms_norm_eps > 0 and math.isfinite(self.rms_norm_eps)):
            _fail("rms_norm_eps", self.rms_norm_eps, "a positive number")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            _fail("rope_theta", self.rope_theta, "a positive number")

    @property
    def qk_head_dim(self) -> int:
        """The per-head query/key width of the un-absorbed attention: nope + rope."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def sm_scale(self) -> float:
        """1/sqrt(qk_head_dim): the original head dim's, also for the absorbed attention."""
        return 1.0 / math.sqrt(self.qk_head_dim)

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> "DeepseekV2Config":
        """From a Hugging Face DeepSeek-V2 `config.json` dict: dense MLPs only (MoE layers are
        refused), no rope_scaling (YaRN is not implemented), no attention bias."""
        if not isinstance(config, dict):
            raise ModelConfigError(f"model config: expected a dict (config.json), got {type(config).__name__}")
        if config.get("model_type") != DEEPSEEK_V2:
            _fail("model_type", config.get("model_type"), repr(DEEPSEEK_V2))
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if key not in config:
                raise ModelConfigError(f"model config: the required field {key!r} is missing")
        layers = config["num_hidden_layers"]
        if config.get("n_routed_experts") and config.get("first_k_dense_replace", 0) < layers:
            _fail("n_routed_experts", config["n_routed_experts"], "null, or first_k_dense_replace >= "
                  f"num_hidden_layers={layers} (mixture-of-experts layers are not implemented; dense MLPs only)")
        if config.get("rope_scaling"):
            _fail("rope_scaling", config["rope_scaling"], "null (YaRN scaling is not implemented)")
        if config.get("attention_bias"):
            _fail("attention_bias", config["attention_bias"], "false")
        if config.get("hidden_act", "silu") != "silu":
            _fail("hidden_act", config["hidden_act"], '"silu" (SwiGLU)')
        return cls(
            hidden_size=config["hidden_size"], intermediate_size=config["intermediate_size"],
            num_hidden_layers=layers, num_attention_heads=config["num_attention_heads"],
            vocab_size=config["vocab_size"], kv_lora_rank=config["kv_lora_rank"],
            qk_nope_head_dim=config["qk_nope_head_dim"], qk_rope_head_dim=config["qk_rope_head_dim"],
            v_head_dim=config["v_head_dim"], q_lora_rank=config.get("q_lora_rank") or 0,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)), rope_theta=float(config.get("rope_theta", 10000.0)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


AnyModelConfig = ModelConfig | DeepseekV2Config


def model_config_from_hf(config: dict[str, Any]) -> AnyModelConfig:
    """The configuration class of an HF config.json dict's `model_type` (DeepSeek-V2 or Llama-family)."""
    if isinstance(config, dict) and config.get("model_type") == DEEPSEEK_V2:
        return DeepseekV2Config.from_hf(config)
    from .gemma3.config import MODEL_TYPES, Gemma3Config

    if isinstance(config, dict) and config.get("model_type") in MODEL_TYPES:
        return Gemma3Config.from_hf(config)
    if isinstance(config, dict) and config.get("model_type") == "gemma2":
        _fail("model_type", "gemma2", f"one of {SUPPORTED_MODEL_TYPES + (DEEPSEEK_V2,)} (Gemma-2's soft-capping, "
              "sandwich norms, GeGLU and scaled embeddings are not implemented; its alternating windows are: a "
              "llama config with sliding_window and sliding_window_pattern 2)")
    return ModelConfig.from_hf(config)


def model_config_from_dict(model_type: str, fields: dict[str, Any]) -> AnyModelConfig:
    """A configuration back from a library's metadata ("model_type", "model_config"); the
    Llama family's rope_scaling is dropped (packing weights does not need it)."""
    if model_type == DEEPSEEK_V2:
        return DeepseekV2Config(**fields)
    from .gemma3.config import MODEL_TYPES, Gemma3Config

    if model_type in MODEL_TYPES:
        return Gemma3Config(**fields)
    return ModelConfig(**{**fields, "rope_scaling": None})
