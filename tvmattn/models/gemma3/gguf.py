"""Gemma 3 GGUF files (general.architecture "gemma3", as llama.cpp's converter writes them): the
tensor names' Hugging Face equivalents and the config from the `gemma3.*` metadata.

What the metadata says is read from it (widths, heads, head dim, norm epsilon, window, the
global RoPE base, and where present the local base, the layer pattern and the logit soft-cap).
What llama.cpp assumes for Gemma 3 where the file says nothing, we assume too (llama-model.cpp):
a window pattern of 6 (every sixth layer full), a local RoPE base of 10,000, no soft-capping,
and queries scaled by head_dim^-0.5 (hidden_size / heads for the 62-layer 27B). The converter
stores each RMSNorm's multiplier 1 + w; the reader gives back Hugging Face's w.
"""

from __future__ import annotations

import pathlib

import numpy as np

from ...weights.common import fail
from ...weights.gguf_file import GgufLayout, as_float, require

ARCH = "gemma3"
BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# llama.cpp's values where a Gemma 3 GGUF has no key (llama-model.cpp, LLM_ARCH_GEMMA3)
DEFAULT_PATTERN = 6
DEFAULT_LOCAL_BASE = 10_000.0
LAYERS_27B = 62


def hf_config(path: pathlib.Path, meta: dict, names: set[str], embed_rows: int) -> dict:
    """The Hugging Face Gemma3TextConfig keys of a Gemma 3 GGUF's metadata."""
    def key(name, default=None):
        return require(path, meta, f"{ARCH}.{name}", default)

    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    layers = int(key("block_count"))
    if hidden <= 0 or heads <= 0 or layers <= 0:
        raise fail(path, None, f"metadata: embedding_length {hidden}, head_count {heads} and block_count {layers} "
                               "must be positive")
    head_dim = int(key("attention.key_length", hidden // heads))
    if int(key("attention.value_length", head_dim)) != head_dim:
        raise fail(path, None, "unsupported attention: key_length and value_length differ")
    window = int(key("attention.sliding_window"))
    pattern = int(meta.get(f"{ARCH}.attention.sliding_window_pattern", DEFAULT_PATTERN))
    config = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": as_float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": as_float(key("rope.freq_base")),
        "rope_local_base_freq": as_float(meta.get(f"{ARCH}.rope.freq_base_swa", DEFAULT_LOCAL_BASE)),
        "sliding_window": window,
        "sliding_window_pattern": pattern,
        "layer_types": ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)],
        "query_pre_attn_scalar": hidden // heads if layers == LAYERS_27B else head_dim,
        "final_logit_softcapping": as_float(meta[f"{ARCH}.final_logit_softcapping"])
        if f"{ARCH}.final_logit_softcapping" in meta else None,
        "vocab_size": embed_rows,
        "max_position_embeddings": int(key("context_length")),
        "tie_word_embeddings": "lm_head.weight" not in names,
    }
    for name in ("bos", "eos", "padding"):
        if f"tokenizer.ggml.{name}_token_id" in meta:
            config[f"{'pad' if name == 'padding' else name}_token_id"] = int(meta[f"tokenizer.ggml.{name}_token_id"])
    return config


def expected_shapes(config: dict) -> tuple[dict, dict]:
    """(required, optional) HF tensor name -> shape of a Gemma 3 config dict."""
    hidden, inter, head_dim = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    required = {"model.embed_tokens.weight": (config["vocab_size"], hidden), "model.norm.weight": (hidden,)}
    if not config.get("tie_word_embeddings", True):
        required["lm_head.weight"] = (config["vocab_size"], hidden)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        required.update({
            f"{p}.self_attn.q_proj.weight": (q, hidden), f"{p}.self_attn.k_proj.weight": (kv, hidden),
            f"{p}.self_attn.v_proj.weight": (kv, hidden), f"{p}.self_attn.o_proj.weight": (hidden, q),
            f"{p}.self_attn.q_norm.weight": (head_dim,), f"{p}.self_attn.k_norm.weight": (head_dim,),
            f"{p}.mlp.gate_proj.weight": (inter, hidden), f"{p}.mlp.up_proj.weight": (inter, hidden),
            f"{p}.mlp.down_proj.weight": (hidden, inter),
        })
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            required[f"{p}.{norm}.weight"] = (hidden,)
    return required, {}


def hf_norm_weight(name: str, values: np.ndarray) -> np.ndarray:
    """A GGUF tensor as Hugging Face stores it: RMSNorm weights w from the converter's 1 + w."""
    return values - np.float32(1.0) if name.endswith("norm.weight") else values


LAYOUT = GgufLayout(block_names=BLOCK_NAMES, hf_config=hf_config, expected_shapes=expected_shapes,
                    adjust=hf_norm_weight)
