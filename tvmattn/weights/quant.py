"""GGML tensors in numpy: dequantization (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K) -> float32,
and block-quantized matrices kept quantized (`QuantizedTensor`, split into separate arrays).

Block layouts (little-endian), each block covering 32 consecutive elements of a row:
  Q4_0: fp16 scale d, 16 bytes of nibbles                 -> d * (q - 8)        (18 bytes)
  Q4_1: fp16 scale d, fp16 min m, 16 bytes of nibbles     -> d * q + m          (20 bytes)
  Q5_0: fp16 scale d, 4 bytes qh, 16 bytes of nibbles     -> d * (q - 16)       (22 bytes)
  Q8_0: fp16 scale d, 32 x int8 q                         -> d * q              (34 bytes)
  (4-bit: element j < 16 is the low nibble of byte j, element j >= 16 the high nibble of byte j - 16;
  Q5_0: those nibbles are q's low 4 bits, its 5th bit is bit j % 8 of qh byte j // 8.)
K-quants: super-blocks of 256 elements (`BLOCK_ELEMS`), sub-blocks with scales of their own:
  Q4_K (144 bytes): fp16 d, fp16 dmin, 12 bytes of eight 6-bit scales sc and mins m, 128 bytes of
       nibbles; sub-block j (32 elements) -> d * sc_j * q - dmin * m_j. Byte 32 g + l holds element
       64 g + l in its low nibble and 64 g + 32 + l in its high one. Scales: for j < 4, sc_j = s[j] & 63,
       m_j = s[j + 4] & 63; for j >= 4, sc_j = (s[j + 4] & 15) | (s[j - 4] >> 6) << 4 and
       m_j = (s[j + 4] >> 4) | (s[j] >> 6) << 4.
  Q6_K (210 bytes): 128 bytes ql (low 4 bits), 64 bytes qh (high 2 bits), 16 int8 scales, fp16 d;
       sub-block j (16 elements) -> d * sc_j * (q - 32). Element 128 h + 32 i + l (h < 2, i < 4,
       l < 32): low bits in byte 64 h + 32 (i % 2) + l of ql (low nibble for i < 2, else high), high
       bits (qh[32 h + l] >> 2 i) & 3.

Kept quantized, a [rows, cols] matrix is split into arrays with rows first (`PACKED`, shapes from
`part_shapes`): the quants `qs` (uint8 [rows, cols / 2] for 4-bit, the blocks' 16 bytes each in
GGUF order; int8 [rows, cols] for Q8_0) and the float16 scales `d` (and mins `m`, Q4_1)
[rows, cols / 32]; Q5_0: `qs` as Q4_0's, `qh` uint8 [rows, cols / 8] (the blocks' 4 bytes), `d`;
Q4_K: `qs` as GGUF's, the 6-bit scales and mins unpacked to uint8 `sc`, `mn` [rows, cols / 32],
fp16 `d`, `dmin` [rows, cols / 256]; Q6_K: `ql`, `qh`, int8 `sc`, fp16 `d` as GGUF's. The fused
kernels (tvmattn/quant/) read these arrays.
"""

from __future__ import annotations

import dataclasses

import numpy as np

BLOCK = 32  # elements per block of the 32-element types; sub-block of the Q4_K scales
SUPER_BLOCK = 256  # elements per K-quant super-block
# type name -> (elements per block, bytes per block), as in GGML
LAYOUTS = {"F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22),
           "Q8_0": (32, 34),
           "Q4_K": (256, 144), "Q6_K": (256, 210)}
FLOAT_TYPES = ("F32", "F16", "BF16")  # the unquantized types, the only ones vectors (norms, biases) may use
# block type -> its arrays kept quantized: (part name, numpy dtype, columns per block of BLOCK_ELEMS elements)
PACKED = {
    "Q4_0": (("qs", "uint8", 16), ("d", "float16", 1)),
    "Q4_1": (("qs", "uint8", 16), ("d", "float16", 1), ("m", "float16", 1)),
    "Q5_0": (("qs", "uint8", 16), ("d", "float16", 1), ("qh", "uint8", 4)),
    "Q8_0": (("qs", "int8", 32), ("d", "float16", 1)),
    "Q4_K": (("qs", "uint8", 128), ("sc", "uint8", 8), ("mn", "uint8", 8), ("d", "float16", 1),
             ("dmin", "float16", 1)),
    "Q6_K": (("ql", "uint8", 128), ("qh", "uint8", 64), ("sc", "int8", 16), ("d", "float16", 1)),
}
QUANT_TYPES = tuple(PACKED)
BLOCK_ELEMS = {name: LAYOUTS[name][0] for name in PACKED}  # elements a row's block of PACKED columns covers


def part_shapes(type_name: str, rows: int, cols: int) -> list[tuple[str, str, tuple[int, int]]]:
    """(name, numpy dtype, shape) of each kept array of a [rows, cols] `type_name` matrix, in order."""
    blocks = cols // BLOCK_ELEMS[type_name]
    return [(name, dtype, (rows, blocks * per_block)) for name, dtype, per_block in PACKED[type_name]]


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
        elems = BLOCK_ELEMS[type_name]
        n_elements = raw.size // LAYOUTS[type_name][1] * elems
        values = split_blocks(raw, type_name, (n_elements // elems, elems)).dequantize()
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
        if cols % BLOCK_ELEMS[self.type_name]:
            raise ValueError(f"shape={self.shape}: the row length must be a multiple of {BLOCK_ELEMS[self.type_name]}")
        for name, dtype, want in part_shapes(self.type_name, rows, cols):
            part = self.parts.get(name)
            if part is None or part.dtype != np.dtype(dtype) or part.shape != want:
                got = None if part is None else (part.dtype, part.shape)
                raise ValueError(f"part {name!r}: expected {dtype} {want}, got {got}")

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts.values())

    def dequantize(self) -> np.ndarray:
        """The float32 [rows, cols] values."""
        rows, cols = self.shape
        if self.type_name == "Q4_K":
            return _dequantize_q4_k(self.parts, rows, cols)
        if self.type_name == "Q6_K":
            return _dequantize_q6_k(self.parts, rows, cols)
        d = self.parts["d"].astype(np.float32)[:, :, None]
        qs = self.parts["qs"].reshape(rows, cols // BLOCK, -1)
        if self.type_name == "Q8_0":
            values = d * qs.astype(np.float32)
        elif self.type_name == "Q5_0":
            low = np.concatenate([qs & 0x0F, qs >> 4], axis=2)
            qh = self.parts["qh"].reshape(rows, cols // BLOCK, 4)
            high = np.unpackbits(qh, axis=2, bitorder="little")  # bit j of the block's 32 -> element j
            values = d * ((low | (high << 4)).astype(np.float32) - 16.0)
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
        for name in ("d", "m", "dmin"):
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
    elems, nbytes_ = LAYOUTS[type_name]
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(rows, cols // elems, nbytes_)

    def half(start: int) -> np.ndarray:  # the fp16 field at `start` of every block, [rows, blocks]
        return blocks[:, :, start:start + 2].copy().view("<f2").reshape(rows, -1).astype(np.float16)

    def tail(start: int, stop: int) -> np.ndarray:  # bytes start..stop of every block, [rows, blocks * n]
        return np.ascontiguousarray(blocks[:, :, start:stop].reshape(rows, -1))

    if type_name == "Q4_K":
        sc, mn = unpack_q4_k_scales(blocks[:, :, 4:16])
        parts = {"qs": tail(16, 144), "sc": sc.reshape(rows, -1), "mn": mn.reshape(rows, -1), "d": half(0),
                 "dmin": half(2)}
    elif type_name == "Q6_K":
        parts = {"ql": tail(0, 128), "qh": tail(128, 192), "sc": tail(192, 208).view(np.int8), "d": half(208)}
    elif type_name == "Q5_0":
        parts = {"qs": tail(6, 22), "qh": tail(2, 6), "d": half(0)}
    else:
        parts = {"d": half(0)}
        if type_name == "Q4_1":
            parts["m"] = half(2)
        qs = tail(4 if type_name == "Q4_1" else 2, nbytes_)
        parts["qs"] = qs.view(np.int8) if type_name == "Q8_0" else qs
    return QuantizedTensor(type_name, (rows, cols), parts)


def unpack_q4_k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit scales and mins of Q4_K blocks: packed uint8 [..., 12] -> (sc, m) uint8 [..., 8]."""
    s = packed.astype(np.uint8)
    low_sc, low_m = s[..., 0:4] & 63, s[..., 4:8] & 63
    high_sc = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
    high_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return (np.concatenate([low_sc, high_sc], axis=-1).astype(np.uint8),
            np.concatenate([low_m, high_m], axis=-1).astype(np.uint8))


def _dequantize_q4_k(parts: dict[str, np.ndarray], rows: int, cols: int) -> np.ndarray:
    """Q4_K kept arrays -> float32 [rows, cols]: d * sc * q - dmin * m per 32-element sub-block."""
    supers = cols // SUPER_BLOCK
    qs = parts["qs"].reshape(rows, supers, 4, 32)  # [.., group g, l]: elements 64 g + l, 64 g + 32 + l
    q = np.stack([qs & 15, qs >> 4], axis=3).reshape(rows, supers, 8, 32).astype(np.float32)
    d = parts["d"].astype(np.float32).reshape(rows, supers, 1, 1)
    dmin = parts["dmin"].astype(np.float32).reshape(rows, supers, 1, 1)
    scale = d * parts["sc"].reshape(rows, supers, 8, 1).astype(np.float32)  # exact: 11 x 6 bits
    low = dmin * parts["mn"].reshape(rows, supers, 8, 1).astype(np.float32)
    return (scale * q - low).reshape(rows, cols)


def _dequantize_q6_k(parts: dict[str, np.ndarray], rows: int, cols: int) -> np.ndarray:
    """Q6_K kept arrays -> float32 [rows, cols]: (d * sc) * (q - 32) per 16-element sub-block."""
    supers = cols // SUPER_BLOCK
    ql = parts["ql"].reshape(rows, supers, 2, 2, 32)  # [.., half h, i % 2, l]
    qh = parts["qh"].reshape(rows, supers, 2, 1, 32)  # [.., half h, -, l]
    low = np.concatenate([ql & 15, ql >> 4], axis=3)  # [.., h, i, l]: i = 0, 1 low nibbles; 2, 3 high
    high = (qh >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 1, 4, 1)) & 3
    q = ((low | (high << 4)).astype(np.int16) - 32).astype(np.float32).reshape(rows, supers, 16, 16)
    d = parts["d"].astype(np.float32).reshape(rows, supers, 1, 1)
    scale = d * parts["sc"].reshape(rows, supers, 16, 1).astype(np.float32)  # exact: 11 x 8 bits
    return (scale * q).reshape(rows, cols)
