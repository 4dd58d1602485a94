"""GGUF files (read with the `gguf` package): config, dequantized tensors, tokenizer, chat template.

Supported: architectures `llama` (q/k rows un-permuted, see `unpermute_rows`) and `qwen2`;
tensor types F32, F16, BF16, Q4_0, Q4_1, Q8_0 (block-quantized matrices dequantized to float32,
or with `keep_quantized` kept as `QuantizedTensor`s); byte-level BPE tokenizers
(`tokenizer.ggml.model` "gpt2") with the GPT-2 or StarCoder/SmolLM pre-tokenizer.

A corrupt file is refused with a WeightError naming the file and tensor, never read into a broken
model: each tensor's data must lie inside the file, aligned, overlapping no other tensor's data
(`CheckedReader`), have a type its role allows (`role_types`) and decode to finite values.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pathlib
import re
from typing import TYPE_CHECKING, Callable, Mapping

import gguf
import numpy as np

from .common import Extent, LoadedModel, WeightError, check_disjoint, check_finite, check_inside, check_tensors, fail
from .quant import FLOAT_TYPES, LAYOUTS, QUANT_TYPES, QuantizedTensor, dequantize, nbytes, split_blocks

if TYPE_CHECKING:
    import tokenizers

# architecture -> (Hugging Face model_type, architectures entry, q/k rows permuted for interleaved RoPE)
ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM", True),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", False),
}

GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
ROPE_FREQS = "rope_freqs.weight"
# GGUF name suffix -> role of the 1-D tensors, which must be stored unquantized (FLOAT_TYPES)
VECTOR_ROLES = {"_norm.weight": "norm weight", ".bias": "bias", ROPE_FREQS: "RoPE frequency factor vector"}
BLOCK_PATTERN = re.compile(r"blk\.(\d+)\.(.+)")

# tokenizer.ggml.pre -> pre-tokenizer (llama.cpp's llama-vocab.cpp groups these names)
DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "codeshell"}
GPT2_PRE = {"gpt-2", "gpt2", "default", "mpt", "olmo"}
TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 3, 4


class CheckedReader(gguf.GGUFReader):
    """A GGUFReader that checks every tensor-info entry before it views any tensor's data.

    Checked per entry: a known type id, a row length (ne0) that is a whole number of the type's
    blocks, a data offset that is a multiple of the file's alignment (general.alignment, default
    32), and data that ends inside the file; then that no two tensors' data overlap. Offsets are
    unsigned and counted from the aligned start of the data section, so no data starts before it.
    gguf 0.19's `_build_tensors` checks none of this (pinned gguf==0.19.0): it would view garbage
    or fail with a bare numpy error.
    """

    def __init__(self, path: pathlib.Path):
        self.path = path
        super().__init__(path, "r")

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        check_disjoint(self.path, [self.extent(int(start_offs), field) for field in fields])
        super()._build_tensors(start_offs, fields)

    def extent(self, data_start: int, field) -> Extent:
        """The file extent of one tensor-info entry, or WeightError naming the tensor and the problem."""
        _, name_data, _, dims, raw_dtype, offset_part = field.parts
        name = bytes(name_data).decode("utf-8", "replace")
        try:
            kind = gguf.GGMLQuantizationType(int(raw_dtype[0]))
        except ValueError:
            raise fail(self.path, name, f"unknown tensor type id {int(raw_dtype[0])}") from None
        block_elems, block_bytes = gguf.GGML_QUANT_SIZES[kind]
        shape = [int(d) for d in dims]  # GGUF order: shape[0] (ne0) is the row length
        if shape and shape[0] % block_elems:
            raise fail(self.path, name, f"row length {shape[0]} is not a multiple of the {kind.name} block "
                                        f"({block_elems} elements)")
        offset, alignment = int(offset_part[0]), int(self.alignment)
        if offset % alignment:
            raise fail(self.path, name, f"data offset {offset} is not a multiple of the file's alignment "
                                        f"{alignment} (general.alignment)")
        start = data_start + offset
        extent = Extent(name, start, start + math.prod(shape) // block_elems * block_bytes)
        check_inside(self.path, extent, len(self.data))
        return extent


def open_gguf(path) -> tuple[pathlib.Path, gguf.GGUFReader]:
    """The path and a GGUFReader over it, or WeightError for a missing, unparsable or corrupt file.

    The reader of the last few files is reused while the file's size and modification time stay
    the same: gguf's reader parses a 262k-token vocabulary field by field, for many seconds, and
    one build reads the file's weights, tokenizer and chat template."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise fail(path, None, "no such file")
    stat = path.stat()
    return path, _cached_reader(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _cached_reader(path: pathlib.Path, size: int, mtime_ns: int) -> gguf.GGUFReader:
    try:
        return CheckedReader(path)
    except WeightError:
        raise
    except Exception as error:  # the gguf package raises many kinds on bad input; name them all
        raise fail(path, None, f"not a readable GGUF file ({type(error).__name__}: {error})") from error


def metadata(path: pathlib.Path, reader: gguf.GGUFReader) -> dict:
    """All GGUF key/value pairs as Python values (token lists are skipped: see tokenizer_from_gguf)."""
    skip = {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"}
    try:
        return {key: field.contents() for key, field in reader.fields.items() if key not in skip}
    except Exception as error:
        raise fail(path, None, f"malformed metadata ({type(error).__name__}: {error})") from error


def hf_name(path: pathlib.Path, name: str, block_names: Mapping[str, str] | None = None) -> str:
    """The Hugging Face parameter name of GGUF tensor `name` (block_names: an architecture's own
    block tensor names, GgufLayout, instead of BLOCK_NAMES)."""
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    block_names = BLOCK_NAMES if block_names is None else block_names
    match = BLOCK_PATTERN.fullmatch(name)
    if match and match.group(2) in block_names:
        return f"model.layers.{int(match.group(1))}.{block_names[match.group(2)]}"
    raise fail(path, name, "unknown GGUF tensor name (no Hugging Face equivalent)")


def unpermute_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation (interleaved -> rotate-half RoPE row order), per head.

    llama.cpp's converter orders each head's rows as pairs (j, j + head_dim/2) interleaved:
    permuted row 2j + s of a head is original row s * head_dim/2 + j. Works on biases too.
    """
    half = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def require(path, meta: dict, key: str, default=None):
    """meta[key], else `default`, else WeightError naming the missing key."""
    if key in meta:
        return meta[key]
    if default is not None:
        return default
    raise fail(path, None, f"metadata key {key!r} is missing")


def as_float(value) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-05, not 9.99e-06)."""
    return float(str(np.float32(value)))


def architecture(path, meta: dict, others: tuple[str, ...] = ()) -> str:
    """general.architecture, checked to be one we read (ARCHITECTURES, or `others`: GgufLayouts)."""
    arch = require(path, meta, "general.architecture")
    if arch not in ARCHITECTURES and arch not in others:
        raise fail(path, None, f"unsupported architecture {arch!r} (supported: {sorted([*ARCHITECTURES, *others])})")
    return arch


def build_config(path: pathlib.Path, meta: dict, names: set[str], embed_rows: int) -> dict:
    """Hugging Face config.json keys from GGUF metadata and the set of HF tensor names present."""
    arch = architecture(path, meta)
    model_type, hf_arch, _ = ARCHITECTURES[arch]
    hidden = int(require(path, meta, f"{arch}.embedding_length"))
    heads = int(require(path, meta, f"{arch}.attention.head_count"))
    for key, value in (("embedding_length", hidden), ("attention.head_count", heads)):
        if value <= 0:  # the head size below divides by them
            raise fail(path, None, f"metadata key '{arch}.{key}' must be positive, got {value}")
    kv_heads = int(require(path, meta, f"{arch}.attention.head_count_kv", heads))
    head_dim = int(require(path, meta, f"{arch}.attention.key_length", hidden // heads))
    value_dim = int(require(path, meta, f"{arch}.attention.value_length", head_dim))
    rope_dim = int(require(path, meta, f"{arch}.rope.dimension_count", head_dim))
    if value_dim != head_dim or rope_dim != head_dim:
        raise fail(path, None, f"unsupported attention: key_length {head_dim}, value_length {value_dim}, "
                               f"rope.dimension_count {rope_dim} must all be equal")
    config = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": int(require(path, meta, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(require(path, meta, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": as_float(require(path, meta, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": as_float(require(path, meta, f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling(path, meta, arch),
        "vocab_size": int(meta.get(f"{arch}.vocab_size", embed_rows)),
        "max_position_embeddings": int(require(path, meta, f"{arch}.context_length")),
        "tie_word_embeddings": "lm_head.weight" not in names,
        "attention_bias": any(name.endswith("_proj.bias") for name in names),
    }
    for key in ("bos", "eos", "padding"):
        if f"tokenizer.ggml.{key}_token_id" in meta:
            config[f"{'pad' if key == 'padding' else key}_token_id"] = int(meta[f"tokenizer.ggml.{key}_token_id"])
    return config


def rope_scaling(path, meta: dict, arch: str) -> dict | None:
    """HF rope_scaling from `{arch}.rope.scaling.*` (None or linear; Llama-3 comes as rope_freqs)."""
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": as_float(require(path, meta, f"{arch}.rope.scaling.factor"))}
    raise fail(path, None, f"unsupported rope scaling type {kind!r}")


def role_types(name: str) -> tuple[str, tuple[str, ...]]:
    """(role, allowed tensor types) of GGUF tensor `name`: vectors must be float, matrices any we read."""
    for suffix, role in VECTOR_ROLES.items():
        if name.endswith(suffix):
            return role, FLOAT_TYPES
    return "matrix", tuple(LAYOUTS)


def read_tensor(path: pathlib.Path, reader: gguf.GGUFReader, tensor,
                keep_quantized: bool = False) -> np.ndarray | QuantizedTensor:
    """One GGUF tensor as finite float32, numpy (row-major) shape: GGUF's [ne0, ne1] is numpy's [ne1, ne0].

    CheckedReader has checked the entry's extent and block shape; here its type is checked against
    what we read and what its role allows, and its decoded values for NaN and Inf.
    keep_quantized: a 2-D matrix of a block type (QUANT_TYPES) comes back as a QuantizedTensor,
    its scales and mins checked finite (then every value is).
    """
    type_name = tensor.tensor_type.name
    if type_name not in LAYOUTS:
        raise fail(path, tensor.name, f"unsupported tensor type {type_name} (supported: {', '.join(LAYOUTS)})")
    role, allowed = role_types(tensor.name)
    if type_name not in allowed:
        raise fail(path, tensor.name, f"type {type_name} is not allowed for a {role} (allowed: {', '.join(allowed)})")
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    start = int(tensor.data_offset)
    raw = reader.data[start:start + nbytes(type_name, math.prod(shape))]
    if keep_quantized and type_name in QUANT_TYPES and len(shape) == 2:
        kept = split_blocks(raw, type_name, shape)
        problem = kept.scales_problem()
        if problem:
            raise fail(path, tensor.name, problem)
        return kept
    values = dequantize(raw, type_name, shape)
    check_finite(path, tensor.name, values)
    return values


@dataclasses.dataclass(frozen=True)
class GgufLayout:
    """How the GGUF files of one architecture map to Hugging Face names and config keys (for
    architectures whose model module defines it, e.g. tvmattn.models.gemma3.gguf):
    block_names: GGUF block tensor suffix -> HF suffix under model.layers.{i};
    hf_config(path, meta, names, embed_rows) -> the HF config.json dict (raises WeightError);
    expected_shapes(config) -> (required, optional) HF name -> shape;
    adjust(name, values) -> a float tensor as HF stores it (e.g. Gemma's norms, stored 1 + w)."""

    block_names: Mapping[str, str]
    hf_config: Callable[[pathlib.Path, dict, set, int], dict]
    expected_shapes: Callable[[dict], tuple[dict, dict]]
    adjust: Callable[[str, np.ndarray], np.ndarray] = lambda name, values: values


def read_gguf(path, keep_quantized: bool = False, layouts: Mapping[str, GgufLayout] | None = None) -> LoadedModel:
    """Config and float32 weights (HF names and shapes, rotate-half q/k) of a GGUF model file;
    with keep_quantized, matrices stored in a block type (QUANT_TYPES) are QuantizedTensors.
    layouts: architectures beyond ARCHITECTURES (general.architecture -> GgufLayout)."""
    path, reader = open_gguf(path)
    meta = metadata(path, reader)
    arch = require(path, meta, "general.architecture")
    layout = (layouts or {}).get(arch)
    if layout is None:
        arch = architecture(path, meta, tuple(layouts or ()))
    tensors, rope_freqs = {}, None
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS and layout is None:
            rope_freqs = read_tensor(path, reader, tensor)
            continue
        name = hf_name(path, tensor.name, None if layout is None else layout.block_names)
        if name in tensors:
            raise fail(path, tensor.name, "appears twice")
        value = read_tensor(path, reader, tensor, keep_quantized)
        tensors[name] = value if layout is None or isinstance(value, QuantizedTensor) else layout.adjust(name, value)
    embed = tensors.get("model.embed_tokens.weight")
    if embed is None:
        raise fail(path, "token_embd.weight", "missing")
    if layout is not None:
        config = layout.hf_config(path, meta, set(tensors), embed.shape[0])
        check_tensors(path, config, tensors, layout.expected_shapes)
        return LoadedModel(path=path, hf_config=config, tensors=tensors)
    config = build_config(path, meta, set(tensors), embed.shape[0])
    check_tensors(path, config, tensors)
    if rope_freqs is not None and rope_freqs.shape != (config["head_dim"] // 2,):
        raise fail(path, ROPE_FREQS, f"has shape {list(rope_freqs.shape)}, expected [{config['head_dim'] // 2}]")
    if ARCHITECTURES[arch][2]:
        for name in [n for n in tensors if ".self_attn.q_proj." in n or ".self_attn.k_proj." in n]:
            n_head = config["num_attention_heads"] if ".q_proj." in name else config["num_key_value_heads"]
            value = tensors[name]
            if isinstance(value, QuantizedTensor):  # rows move whole: every part's rows alike
                tensors[name] = value.map_rows(lambda part, n_head=n_head: unpermute_rows(part, n_head))
            else:
                tensors[name] = np.ascontiguousarray(unpermute_rows(value, n_head))
    return LoadedModel(path=path, hf_config=config, tensors=tensors, rope_freq_factors=rope_freqs)


def field_value(path, reader: gguf.GGUFReader, key: str):
    """The metadata field `key` as a Python value (lists for arrays), or WeightError."""
    field = reader.get_field(key)
    if field is None:
        raise fail(path, None, f"metadata key {key!r} is missing (no embedded tokenizer)")
    return field.contents()


def pre_tokenizer(path, pre: str):
    """The `tokenizers` pre-tokenizer matching llama.cpp's `tokenizer.ggml.pre` value."""
    from tokenizers import pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in DIGIT_SPLIT_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in GPT2_PRE:
        return byte_level
    raise fail(path, None, f"unsupported tokenizer pre-type {pre!r} "
                           f"(supported: {sorted(DIGIT_SPLIT_PRE | GPT2_PRE)})")


def tokenizer_from_gguf(path) -> tokenizers.Tokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` built from the GGUF's embedded vocabulary and merges.

    Control tokens (token type 3, e.g. <|im_start|>) are special added tokens; user-defined
    tokens (type 4) are added tokens. When tokenizer.ggml.add_bos_token is true, encode() with
    add_special_tokens=True (the default) prepends the BOS token, as llama.cpp does; pass
    add_special_tokens=False for text whose chat template already starts with it.
    (`tokenizers` is imported here: reading weights does not need it.)
    """
    import tokenizers
    from tokenizers import decoders, models, processors

    path, reader = open_gguf(path)
    model_name = reader.get_field("tokenizer.ggml.model")
    model_name = model_name.contents() if model_name is not None else None
    if model_name == "llama":
        return _spm_tokenizer(path, reader)
    if model_name != "gpt2":
        raise fail(path, None, f"unsupported tokenizer model {model_name!r} (byte-level BPE 'gpt2' or "
                               "SentencePiece 'llama')")
    pre_field = reader.get_field("tokenizer.ggml.pre")
    pre = pre_field.contents() if pre_field is not None else "default"
    tokens = field_value(path, reader, "tokenizer.ggml.tokens")
    merges = field_value(path, reader, "tokenizer.ggml.merges")
    types_field = reader.get_field("tokenizer.ggml.token_type")
    types = types_field.contents() if types_field is not None else [1] * len(tokens)
    vocab = {token: index for index, token in enumerate(tokens)}
    pairs = []
    for merge in merges:
        left, space, right = merge.partition(" ")
        if not space:
            raise fail(path, None, f"malformed merge {merge!r} in tokenizer.ggml.merges")
        pairs.append((left, right))
    tokenizer = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizer(path, pre)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([tokenizers.AddedToken(token, special=True, normalized=False)
                                  for token, kind in zip(tokens, types) if kind == TOKEN_TYPE_CONTROL])
    tokenizer.add_tokens([tokenizers.AddedToken(token, normalized=False)
                          for token, kind in zip(tokens, types) if kind == TOKEN_TYPE_USER_DEFINED])
    add_bos = reader.get_field("tokenizer.ggml.add_bos_token")
    if add_bos is not None and add_bos.contents():
        bos_id = int(field_value(path, reader, "tokenizer.ggml.bos_token_id"))
        bos = tokens[bos_id]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 $B:1", special_tokens=[(bos, bos_id)])
    return tokenizer


def _flag(reader, key: str, default: bool) -> bool:
    field = reader.get_field(key)
    return default if field is None else bool(field.contents())


def _spm_tokenizer(path, reader) -> tokenizers.Tokenizer:
    """tokenizer_from_gguf of a SentencePiece vocabulary (tokenizer.ggml.model "llama": spm.py)."""
    from .spm import spm_tokenizer

    tokens = field_value(path, reader, "tokenizer.ggml.tokens")
    scores = field_value(path, reader, "tokenizer.ggml.scores")
    types_field = reader.get_field("tokenizer.ggml.token_type")
    types = types_field.contents() if types_field is not None else [1] * len(tokens)
    if len(scores) != len(tokens) or len(types) != len(tokens):
        raise fail(path, None, f"tokenizer.ggml.scores ({len(scores)}) and token_type ({len(types)}) must have "
                               f"one entry per token ({len(tokens)})")
    bos = None
    if _flag(reader, "tokenizer.ggml.add_bos_token", True):
        bos_id = int(field_value(path, reader, "tokenizer.ggml.bos_token_id"))
        bos = (tokens[bos_id], bos_id)
    unk_field = reader.get_field("tokenizer.ggml.unknown_token_id")
    unk = None if unk_field is None else tokens[int(unk_field.contents())]
    return spm_tokenizer(tokens, scores, types, _flag(reader, "tokenizer.ggml.add_space_prefix", True), bos, unk)


def chat_template(path) -> str | None:
    """The Jinja chat template stored under tokenizer.chat_template, or None."""
    path, reader = open_gguf(path)
    field = reader.get_field("tokenizer.chat_template")
    return None if field is None else field.contents()
