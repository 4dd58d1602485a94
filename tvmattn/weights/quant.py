"""GGML tensors in numpy: dequantization (F32, F16, BF16, Q4_0, Q4_1, Q8_0) -> float32, and
block-quantized matrices kept quantized (`QuantizedTensor`, split into separate arrays).

Block layouts (little-endian), each block covering 32 consecutive elements of a row:
  Q4_0: fp16 scale d, 16 bytes of nibbles                 -> d * (q - 8)        (18 bytes)
  Q4_1: fp16 scale d, fp16 min m, 16 bytes of nibbles     -> d * q + m          (20 bytes)
  Q8_0: fp16 scale d, 32 x int8 q                         -> d * q              (34 bytes)
  (4-bit: element j < 16 is the low nibble of byte j, element j >= 16 the high nibble of byte j - 16.)

Kept quantized, a [rows, cols] matrix is split into arrays with rows first (`PACKED`): the quants
`qs` (uint8 [rows, cols / 2] for 4-bit, the blocks' 16 bytes each in GGUF order; int8 [rows, cols]
for Q8_0) and the float16 scales `d` (and mins `m`, Q4_1) [rows, cols / 32]. The fused kernels
(tvmattn/models/quant_matmul.py) read these arrays.
"""

from __future__ import annotations

import dataclasses

import numpy as np

BLOCK = 32
# type name -> (elements per block, bytes per block), as in GGML
LAYOUTS = {"F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34)}
FLOAT_TYPES = ("F32", "F16", "BF16")  # the unquantized types, the only ones vectors (norms, biases) may use
# block type -> its arrays kept quantized: (part name, numpy dtype, columns per block of 32 elements)
PACKED = {
    "Q4_0": (("qs", "uint8", 16), ("d", "float16", 1)),
    "Q4_1": (("qs", "uint8", 16), ("d", "float16", 1), ("m", "float16", 1)),
    "Q8_0": (("qs", "int8", 32), ("d", "float16", 1)),
}
QUANT_TYPES = tuple(PACKED)


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
    elif type_name in PACKED:
        n_elements = raw.size // LAYOUTS[type_name][1] * BLOCK
        values = split_blocks(raw, type_name, (n_elements // BLOCK, BLOCK)).dequantize()
    else:
        raise KeyError(type_name)
    return values.reshape(shape)


@dataclasses.dataclass(frozen=True, eq=False)
class QuantizedTensor:
    """A [rows, cols] matrix kept in a GGUF block format (`type_name` in PACKED): `parts` maps
    each of PACKED[type_name]'s part names to its array (rows first; see the module docstring)."""

    type_name: str
    shape: tuple[int, int]
    parts: dict[str, np.ndarray]

    def __post_init__(self):
        if self.type_name not in PACKED:
            raise ValueError(f"type_name={self.type_name!r}: expected one of {QUANT_TYPES}")
        rows, cols = self.shape
        if cols % BLOCK:
            raise ValueError(f"shape={self.shape}: the row length must be a multiple of {BLOCK}")
        for name, dtype, per_block in PACKED[self.type_name]:
            part = self.parts.get(name)
            want = (rows, cols // BLOCK * per_block)
            if part is None or part.dtype != np.dtype(dtype) or part.shape != want:
                got = None if part is None else (part.dtype, part.shape)
                raise ValueError(f"part {name!r}: expected {dtype} {want}, got {got}")

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts.values())

    def dequantize(self) -> np.ndarray:
        """The float32 [rows, cols] values."""
        rows, cols = self.shape
        d = self.parts["d"].astype(np.float32)[:, :, None]
        qs = self.parts["qs"].reshape(rows, cols // BLOCK, -1)
        if self.type_name == "Q8_0":
            values = d * qs.astype(np.float32)
        else:
            q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).astype(np.float32)
            if self.type_name == "Q4_0":
                values = d * (q - 8.0)
            else:
                values = d * q + self.parts["m"].astype(np.float32)[:, :, None]
        return values.reshape(rows, cols)

    def map_rows(self, fn) -> "QuantizedTensor":
        """The matrix with `fn` (a row permutation or selection of an array, rows first) applied
        to every part."""
        parts = {name: np.ascontiguousarray(fn(part)) for name, part in self.parts.items()}
        return QuantizedTensor(self.type_name, (parts["d"].shape[0], self.shape[1]), parts)

    def scales_problem(self) -> str | None:
        """None when every scale (and min) is finite (then every value is), else what is wrong."""
        for name in ("d", "m"):
            part = self.parts.get(name)
            if part is not None and not np.isfinite(part).all():
                bad = np.flatnonzero(~np.isfinite(part))
                row, block = (int(i) for i in np.unravel_index(bad[0], part.shape))
                return (f"{bad.size} non-finite {'scale' if name == 'd' else 'min'}(s) (NaN or Inf) in its "
                        f"{self.type_name} blocks, the first in row {row}, block {block}")
        return None


def concat_rows(tensors: list[QuantizedTensor]) -> QuantizedTensor:
    """The matrices stacked along the rows (all of one type and row length)."""
    first = tensors[0]
    if any(t.type_name != first.type_name or t.shape[1] != first.shape[1] for t in tensors):
        raise ValueError(f"cannot stack {[(t.type_name, t.shape) for t in tensors]}: type and row length must agree")
    parts = {name: np.concatenate([t.parts[name] for t in tensors]) for name in first.parts}
    return QuantizedTensor(first.type_name, (sum(t.shape[0] for t in tensors), first.shape[1]), parts)


def split_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> QuantizedTensor:
    """The [rows, cols] matrix of `type_name` (in PACKED) whose GGUF bytes are `raw` (uint8, any
    shape, exactly the matrix's bytes), kept quantized."""
    rows, cols = shape
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(rows, cols // BLOCK, LAYOUTS[type_name][1])
    parts = {"d": blocks[:, :, 0:2].copy().view("<f2").reshape(rows, -1).astype(np.float16)}
    if type_name == "Q4_1":
        parts["m"] = blocks[:, :, 2:4].copy().view("<f2").reshape(rows, -1).astype(np.float16)
    start = 4 if type_name == "Q4_1" else 2
    qs = blocks[:, :, start:].reshape(rows, -1)
    parts["qs"] = np.ascontiguousarray(qs.view(np.int8) if type_name == "Q8_0" else qs)
    return QuantizedTensor(type_name, (rows, cols), parts)
