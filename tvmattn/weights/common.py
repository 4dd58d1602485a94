"""The reader result (`LoadedModel`), the reader error (`WeightError`) and the checks every reader shares.

Shared checks: tensor shapes against the config (`check_tensors`), data ranges inside the file and
disjoint (`check_inside`, `check_disjoint` over `Extent`s), values finite (`check_finite`).

Tensor layout shared by every reader (Hugging Face names and shapes, float32, C-contiguous):
  model.embed_tokens.weight                      [vocab_size, hidden_size]
  model.layers.{i}.self_attn.q_proj.weight       [num_attention_heads * head_dim, hidden_size]
  model.layers.{i}.self_attn.{k,v}_proj.weight   [num_key_value_heads * head_dim, hidden_size]
  model.layers.{i}.self_attn.o_proj.weight       [hidden_size, num_attention_heads * head_dim]
  model.layers.{i}.self_attn.{q,k,v,o}_proj.bias [out_features]   (optional, e.g. Qwen2 q/k/v)
  model.layers.{i}.mlp.{gate,up}_proj.weight     [intermediate_size, hidden_size]
  model.layers.{i}.mlp.down_proj.weight          [hidden_size, intermediate_size]
  model.layers.{i}.{input,post_attention}_layernorm.weight  [hidden_size]
  model.norm.weight                              [hidden_size]
  lm_head.weight                                 [vocab_size, hidden_size]   (absent when tied)
q/k projections are in the rotate-half RoPE convention Hugging Face uses (GGUF's interleaved
permutation is undone by the GGUF reader).
"""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np


class WeightError(ValueError):
    """A weight file we cannot read: malformed, truncated, wrong shapes or unsupported types."""


def fail(path, tensor: str | None, problem: str) -> WeightError:
    """A WeightError whose message names the file, the tensor (if any) and the problem."""
    where = f"{path}" if tensor is None else f"{path}: tensor {tensor!r}"
    return WeightError(f"{where}: {problem}")


@dataclasses.dataclass(frozen=True)
class Extent:
    """Where one tensor's data lies in its file: bytes [start, end), counted from the file's start."""

    tensor: str
    start: int
    end: int

    def __str__(self) -> str:
        return f"[{self.start}, {self.end})"


def check_inside(path, extent: Extent, file_size: int) -> None:
    """Raise WeightError unless `extent` ends within a file of `file_size` bytes."""
    if extent.end > file_size:
        raise fail(path, extent.tensor, f"truncated file, or a corrupt offset or type: data bytes {extent} "
                                        f"extend past the end of the file ({file_size} bytes)")


def check_disjoint(path, extents: list[Extent]) -> None:
    """Raise WeightError naming both tensors if the data of any two (non-empty) tensors overlaps.

    Sorted by start, an overlap anywhere implies one between neighbours, so one pass suffices.
    """
    ordered = sorted((e for e in extents if e.end > e.start), key=lambda e: (e.start, e.end))
    for before, after in zip(ordered, ordered[1:]):
        if after.start < before.end:
            raise fail(path, before.tensor, f"data bytes {before} overlap those of tensor {after.tensor!r} "
                                            f"{after} (corrupt offset or type)")


def check_finite(path, tensor: str, values: np.ndarray) -> None:
    """Raise WeightError if float array `values` (any shape) holds a NaN or an infinity."""
    finite = np.isfinite(values)
    if not finite.all():
        bad = np.flatnonzero(~finite)
        first = [int(i) for i in np.unravel_index(bad[0], values.shape)]
        raise fail(path, tensor, f"{bad.size} non-finite value(s) (NaN or Inf) after decoding, "
                                 f"the first at index {first}")


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A model's configuration and weights as read from disk.

    path: the file (GGUF) or folder (safetensors) read.
    hf_config: Hugging Face `config.json` style keys (model_type, hidden_size, ...).
    tensors: float32 arrays under Hugging Face names, shapes as in the module docstring (read with
        keep_quantized, block-quantized matrices are quant.QuantizedTensor, of the same shapes).
    rope_freq_factors: GGUF `rope_freqs.weight` ([head_dim // 2] float32 divisors of the RoPE
        frequencies, how llama.cpp stores Llama-3 scaling), or None.
    """

    path: pathlib.Path
    hf_config: dict
    tensors: dict[str, np.ndarray]
    rope_freq_factors: np.ndarray | None = None


ATTN_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")


def expected_shapes(config: dict) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """(required, optional) parameter name -> shape for a Llama-family `config` dict."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    vocab = config["vocab_size"]
    out_features = {"q_proj": heads * head_dim, "k_proj": kv_heads * head_dim,
                    "v_proj": kv_heads * head_dim, "o_proj": hidden}
    in_features = {"q_proj": hidden, "k_proj": hidden, "v_proj": hidden, "o_proj": heads * head_dim}
    required = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    optional = {}
    if not config.get("tie_word_embeddings", False):
        required["lm_head.weight"] = (vocab, hidden)
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}"
        for proj in ATTN_PROJ:
            required[f"{prefix}.self_attn.{proj}.weight"] = (out_features[proj], in_features[proj])
            optional[f"{prefix}.self_attn.{proj}.bias"] = (out_features[proj],)
        for norm in ("q_norm", "k_norm"):  # Qwen3's per-head RMSNorms
            optional[f"{prefix}.self_attn.{norm}.weight"] = (head_dim,)
        required[f"{prefix}.mlp.gate_proj.weight"] = (inter, hidden)
        required[f"{prefix}.mlp.up_proj.weight"] = (inter, hidden)
        required[f"{prefix}.mlp.down_proj.weight"] = (hidden, inter)
        required[f"{prefix}.input_layernorm.weight"] = (hidden,)
        required[f"{prefix}.post_attention_layernorm.weight"] = (hidden,)
    return required, optional


def check_tensors(path, config: dict, tensors: dict[str, np.ndarray], shapes=None) -> None:
    """Raise WeightError unless `tensors` holds exactly the parameters `config` calls for
    (shapes(config) -> (required, optional) name -> shape; default: the Llama family's)."""
    required, optional = (shapes or expected_shapes)(config)
    for name, shape in required.items():
        if name not in tensors:
            raise fail(path, name, f"missing (expected shape {list(shape)})")
    for name, array in tensors.items():
        shape = required.get(name, optional.get(name))
        if shape is None:
            raise fail(path, name, "not a parameter of this model (unexpected tensor)")
        if tuple(array.shape) != shape:
            raise fail(path, name, f"has shape {list(array.shape)}, but the config calls for {list(shape)}")
