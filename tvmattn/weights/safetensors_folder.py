"""Hugging Face model folders: config.json plus *.safetensors (one file or an index of shards).

The safetensors format is parsed here: an 8-byte little-endian header length N, N bytes of JSON
({name: {"dtype", "shape", "data_offsets": [begin, end]}, optional "__metadata__"}), then the raw
little-endian tensor data, offsets counted from the end of the header.

A corrupt file is refused with a WeightError naming the file and tensor: every header entry must
have a supported dtype, a shape of non-negative integers and offsets 0 <= begin <= end that fit
the shape; the data must lie inside the file, no two tensors' data may overlap, and the decoded
values must be finite.
"""

from __future__ import annotations

import json
import math
import pathlib

import numpy as np

from .common import Extent, LoadedModel, check_disjoint, check_finite, check_inside, check_tensors, fail
from .quant import dequantize

DTYPES = {"F32": ("F32", 4), "F16": ("F16", 2), "BF16": ("BF16", 2)}  # safetensors dtype -> (our type, bytes)
MODEL_TYPES = {"llama", "mistral", "qwen2"}
INDEX = "model.safetensors.index.json"
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)  # buffers some old checkpoints saved alongside weights


def read_header(path: pathlib.Path, data: np.ndarray) -> tuple[dict, int]:
    """The JSON header of a safetensors file and the byte offset where its data begins."""
    if len(data) < 8:
        raise fail(path, None, f"truncated file: {len(data)} bytes, shorter than the 8-byte header length")
    length = int(data[:8].view("<u8")[0])
    if 8 + length > len(data):
        raise fail(path, None, f"truncated file: header of {length} bytes, file has {len(data) - 8} after the length")
    try:
        header = json.loads(bytes(data[8:8 + length]))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise fail(path, None, f"malformed JSON header ({error})") from error
    if not isinstance(header, dict):
        raise fail(path, None, "malformed header: not a JSON object")
    header.pop("__metadata__", None)
    return header, 8 + length


def is_count(value) -> bool:
    """Whether a JSON value is a non-negative integer (booleans and floats are not)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def parse_entry(path: pathlib.Path, name: str, info, base: int) -> tuple[str, tuple[int, ...], Extent]:
    """(our type, shape, file extent) of one header entry, or WeightError naming the tensor."""
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise fail(path, name, f"malformed header entry {info!r}")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise fail(path, name, f"unsupported dtype {dtype} (supported: {', '.join(DTYPES)})")
    if not isinstance(shape, list) or not all(is_count(d) for d in shape):
        raise fail(path, name, f"invalid shape {shape!r} (expected a list of non-negative integers)")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(is_count(o) for o in offsets)
            and offsets[0] <= offsets[1]):
        raise fail(path, name, f"invalid data_offsets {offsets!r} (expected [begin, end], 0 <= begin <= end)")
    begin, end = offsets
    if end - begin != math.prod(shape) * DTYPES[dtype][1]:
        raise fail(path, name, f"data_offsets {offsets} do not fit shape {shape} of {dtype}")
    return DTYPES[dtype][0], tuple(shape), Extent(name, base + begin, base + end)


def read_file(path: pathlib.Path) -> dict[str, np.ndarray]:
    """Every tensor of one .safetensors file, as finite float32 (shapes as in the header)."""
    try:
        data = np.memmap(path, dtype=np.uint8, mode="r") if path.stat().st_size else np.zeros(0, np.uint8)
    except OSError as error:
        raise fail(path, None, f"cannot read ({error})") from error
    header, base = read_header(path, data)
    entries = {name: parse_entry(path, name, info, base) for name, info in header.items()}
    for _, _, extent in entries.values():
        check_inside(path, extent, len(data))
    check_disjoint(path, [extent for _, _, extent in entries.values()])
    tensors = {}
    for name, (type_name, shape, extent) in entries.items():
        if not name.endswith(IGNORED_SUFFIXES):
            tensors[name] = dequantize(data[extent.start:extent.end], type_name, shape)
            check_finite(path, name, tensors[name])
    return tensors


def read_config(folder: pathlib.Path) -> dict:
    """config.json with the defaults Llama-family configs leave implicit filled in."""
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise fail(path, None, f"cannot read config ({error})") from error
    if config.get("model_type") not in MODEL_TYPES:
        raise fail(path, None,
                   f"unsupported model_type {config.get('model_type')!r} (supported: {sorted(MODEL_TYPES)})")
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if not isinstance(config.get(key), int):
            raise fail(path, None, f"key {key!r} is missing or not an integer")
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    if config.get("head_dim") is None:
        config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    config.setdefault("tie_word_embeddings", False)
    return config


def shard_files(folder: pathlib.Path) -> list[pathlib.Path]:
    """The .safetensors files to read: those the index names, else every *.safetensors."""
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as error:
            raise fail(index, None, f"malformed index ({error!r})") from error
        return [folder / name for name in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise fail(folder, None, "no *.safetensors files")
    return files


def read_safetensors_folder(path) -> LoadedModel:
    """Config and float32 weights (HF names and shapes) of a Hugging Face safetensors folder."""
    folder = pathlib.Path(path)
    if not folder.is_dir():
        raise fail(folder, None, "not a folder")
    config = read_config(folder)
    tensors: dict[str, np.ndarray] = {}
    for file in shard_files(folder):
        if not file.is_file():
            raise fail(file, None, f"shard named in {INDEX} is missing")
        for name, array in read_file(file).items():
            if name in tensors:
                raise fail(file, name, "appears in more than one shard")
            tensors[name] = array
    if config["tie_word_embeddings"]:
        tensors.pop("lm_head.weight", None)  # some checkpoints store the tied copy too
    check_tensors(folder, config, tensors)
    return LoadedModel(path=folder, hf_config=config, tensors=tensors)
