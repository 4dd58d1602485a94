"""Random weights of a Llama-family config, every matrix in one GGUF block type.

For speed measurements of a model shape whose real weights are absent (or cannot travel to
the machine that measures): `random_block_tensors(config, "Q4_0", seed)` draws the model's
tensors directly as blocks (`QuantizedTensor`s of random quants and scales; no float matrix is
quantized, so a 1B-parameter model takes seconds), under the Hugging Face names and shapes
every reader returns (`common.expected_shapes`). A library that keeps the blocks
(`--quantization keep`) and a float one built from the same tensors dequantized hold the same
weights, so their logits can be compared.

Values: the quants uniform over their range, each block's scale drawn around the value that
gives the matrix a standard deviation of about 1 / sqrt(in_features) (1 for the token
embedding, as `build.random_params`), a Q4_1 block's min centring it on 0; vectors
(the norms' weights) float32 near 1.
"""

from __future__ import annotations

import numpy as np

from .common import expected_shapes
from .quant import BLOCK, QuantizedTensor, part_shapes

# block type -> the standard deviation of its quants, drawn uniformly over a range symmetric about
# the block's zero (n values: sqrt((n^2 - 1) / 12)): Q4_0 q - 8 in [-7, 7], Q4_1 q in [0, 15] (its
# min centres them), Q8_0 q in [-127, 127]
RANDOM_BLOCK_TYPES = {"Q4_0": float(np.sqrt((15 ** 2 - 1) / 12)), "Q4_1": float(np.sqrt((16 ** 2 - 1) / 12)),
                      "Q8_0": float(np.sqrt((255 ** 2 - 1) / 12))}


def random_block_matrix(rows: int, cols: int, type_name: str, std: float, rng: np.random.Generator
                        ) -> QuantizedTensor:
    """A [rows, cols] `type_name` matrix of random quants whose values have a standard deviation
    of about `std` (each block's scale varies by up to 25%); cols a multiple of 32."""
    if type_name not in RANDOM_BLOCK_TYPES:
        raise ValueError(f"type_name={type_name!r}: expected one of {sorted(RANDOM_BLOCK_TYPES)}")
    if cols % BLOCK:
        raise ValueError(f"cols={cols}: must be a multiple of {BLOCK}")
    parts = {}
    (_, _, shape), *_ = part_shapes(type_name, rows, cols)  # the quants' (first) part
    if type_name == "Q4_0":  # two nibbles a byte, each in [1, 15]
        low, high = (rng.integers(1, 16, size=shape, dtype=np.uint8) for _ in range(2))
        parts["qs"] = low | (high << 4)
    elif type_name == "Q4_1":  # uniform bytes: both nibbles uniform in [0, 15]
        parts["qs"] = rng.integers(0, 256, size=shape, dtype=np.uint8)
    else:  # Q8_0: -128 left out, as GGML's quantizer does
        parts["qs"] = rng.integers(-127, 128, size=shape, dtype=np.int8)
    d = std / RANDOM_BLOCK_TYPES[type_name] * rng.uniform(0.75, 1.25, size=(rows, cols // BLOCK))
    parts["d"] = d.astype(np.float16)
    if type_name == "Q4_1":  # d * q + m, q in [0, 15]: m = -7.5 d centres the values on 0
        parts["m"] = (-7.5 * parts["d"].astype(np.float32)).astype(np.float16)
    return QuantizedTensor(type_name, (rows, cols), parts)


def random_block_tensors(config: dict, type_name: str, seed: int = 0) -> dict[str, np.ndarray | QuantizedTensor]:
    """Every tensor a Llama-family HF `config` dict calls for (no biases): matrices as random
    `type_name` blocks (RANDOM_BLOCK_TYPES), vectors float32 near 1; seeded by `seed`."""
    if type_name not in RANDOM_BLOCK_TYPES:
        raise ValueError(f"type_name={type_name!r}: expected one of {sorted(RANDOM_BLOCK_TYPES)}")
    rng = np.random.default_rng(seed)
    required, _ = expected_shapes(config)
    tensors: dict[str, np.ndarray | QuantizedTensor] = {}
    for name, shape in required.items():
        if len(shape) == 1:
            tensors[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            continue
        rows, cols = shape
        if cols % BLOCK:
            raise ValueError(f"{name}: {cols} columns, not a multiple of the {type_name} block ({BLOCK})")
        std = 1.0 if name == "model.embed_tokens.weight" else cols ** -0.5
        tensors[name] = random_block_matrix(rows, cols, type_name, std, rng)
    return tensors
