"""Which decoder a model configuration gets: its nn model class, its parameter map from HF
tensor names, the HF tensors' preparation, its cache spec and the functions its library exports.

The Llama family (config.ModelConfig: llama.py, optionally with sliding-window layers),
DeepSeek-V2 (config.DeepseekV2Config: deepseek.py, MLA on tvmattn's cache) and Gemma 3
(gemma3/: Gemma3Config, its model, GGUF names and chat template).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import numpy as np

from .config import DEEPSEEK_V2, AnyModelConfig, DeepseekV2Config

LLAMA_FUNCTIONS = ("embed", "prefill", "decode", "batch_prefill", "batch_decode", "decode_step", "batch_verify",
                   "create_paged_kv_cache")


@dataclasses.dataclass(frozen=True)
class Architecture:
    """model_type: the metadata's name; model_class(config, cache_spec, kv_cache, weight_formats);
    parameter_sources(config, weight_formats) -> {parameter: HF tensor names};
    prepare_tensors(config, tensors) -> the HF tensors as the parameters take them;
    functions: the exported functions."""

    model_type: str
    model_class: type
    parameter_sources: Callable[..., dict[str, tuple[str, ...]]]
    prepare_tensors: Callable[[Any, Mapping[str, np.ndarray]], Mapping[str, np.ndarray]]
    functions: tuple[str, ...]


def _as_given(config: Any, tensors: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
    return tensors


def architecture(config: AnyModelConfig) -> Architecture:
    from .gemma3 import Gemma3Config

    if isinstance(config, Gemma3Config):
        from .gemma3 import model as gemma3

        return Architecture("gemma3_text", gemma3.Gemma3ForCausalLM, gemma3.hf_parameter_sources,
                            gemma3.prepare_tensors, LLAMA_FUNCTIONS)
    if isinstance(config, DeepseekV2Config):
        from . import deepseek

        return Architecture(DEEPSEEK_V2, deepseek.DeepseekV2ForCausalLM, deepseek.hf_parameter_sources,
                            deepseek.prepare_hf_tensors, deepseek.FUNCTIONS)
    from .llama import LlamaForCausalLM, hf_parameter_sources

    return Architecture("llama", LlamaForCausalLM, hf_parameter_sources, _as_given, LLAMA_FUNCTIONS)


def cache_spec(config: AnyModelConfig, options) -> Any:
    """The compile-time cache spec of `config` built with BuildOptions `options`."""
    if isinstance(config, DeepseekV2Config):
        from .deepseek import cache_spec as mla_cache_spec

        return mla_cache_spec(config, options.dtype, options.target, options.page_size, options.kv_dtype)
    from .gemma3 import Gemma3Config
    from .kv_cache import KVCacheSpec

    if isinstance(config, Gemma3Config):  # RoPE by the model: a base per layer kind
        return KVCacheSpec(
            num_layers=config.num_hidden_layers, num_qo_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim, dtype=options.dtype,
            target=options.target, page_size=options.page_size, rope_theta=config.rope_theta,
            sliding_window=config.sliding_window, sliding_layers=config.sliding_layers, kv_dtype=options.kv_dtype,
            rope_mode="none", decode_append=options.decode_append)
    return KVCacheSpec(
        num_layers=config.num_hidden_layers, num_qo_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim, dtype=options.dtype,
        target=options.target, page_size=options.page_size, rope_theta=config.rope_theta,
        rope_scaling=config.rope_scaling, sliding_window=config.sliding_window,
        sliding_layers=config.sliding_layers, kv_dtype=options.kv_dtype, decode_append=options.decode_append,
    )


def gguf_layouts() -> dict:
    """general.architecture -> weights.gguf_file.GgufLayout of the architectures whose GGUF
    mapping lives in their model folder (read_gguf's `layouts`)."""
    from .gemma3.gguf import ARCH, LAYOUT

    return {ARCH: LAYOUT}


def default_chat(hf_config: dict) -> tuple[str | None, tuple[str, ...]]:
    """(chat template, stop token texts) of an architecture for GGUF files that carry no template."""
    from .gemma3 import MODEL_TYPES

    if hf_config.get("model_type") in MODEL_TYPES:
        from .gemma3.template import CHAT_TEMPLATE, STOP_TOKENS

        return CHAT_TEMPLATE, STOP_TOKENS
    return None, ()
