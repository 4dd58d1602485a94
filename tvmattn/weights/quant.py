"""GGML tensor dequantization in numpy (F32, F16, BF16, Q8_0, Q4_1) -> float32.

Block layouts (little-endian), each block covering 32 consecutive elements of a row:
  Q8_0: fp16 scale d, 32 x int8 q                         -> d * q              (34 bytes)
  Q4_1: fp16 scale d, fp16 min m, 16 bytes of nibbles     -> d * q + m          (20 bytes)
        element j < 16 is the low nibble of byte j, element j >= 16 the high nibble of byte j - 16.
"""

from __future__ import annotations

import numpy as np

BLOCK = 32
# type name -> (elements per block, bytes per block), as in GGML
LAYOUTS = {"F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "Q8_0": (32, 34), "Q4_1": (32, 20)}
FLOAT_TYPES = ("F32", "F16", "BF16")  # the unquantized types, the only ones vectors (norms, biases) may use


def nbytes(type_name: str, n_elements: int) -> int:
    """Bytes that `n_elements` of `type_name` occupy (n_elements must fill whole blocks)."""
    block_elems, block_bytes = LAYOUTS[type_name]
    return n_elements // block_elems * block_bytes


def dequantize(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> np.ndarray:
    """float32 array of `shape` from the bytes `raw` (uint8, any shape) of a `type_name` tensor.

    The caller has checked that `type_name` is in LAYOUTS, that the innermost dimension is a
    whole number of blocks and that `raw` holds exactly `nbytes(type_name, prod(shape))` bytes.
    """
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    if type_name == "F32":
        values = raw.view("<f4").astype(np.float32)
    elif type_name == "F16":
        values = raw.view("<f2").astype(np.float32)
    elif type_name == "BF16":
        values = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    elif type_name == "Q8_0":
        blocks = raw.reshape(-1, 34)
        scale = blocks[:, :2].copy().view("<f2").astype(np.float32)
        values = (scale * blocks[:, 2:].view(np.int8).astype(np.float32)).reshape(-1)
    elif type_name == "Q4_1":
        blocks = raw.reshape(-1, 20)
        scale = blocks[:, 0:2].copy().view("<f2").astype(np.float32)
        low = blocks[:, 2:4].copy().view("<f2").astype(np.float32)
        packed = blocks[:, 4:]
        q = np.concatenate([packed & 0x0F, packed >> 4], axis=1).astype(np.float32)
        values = (scale * q + low).reshape(-1)
    else:
        raise KeyError(type_name)
    return values.reshape(shape)
