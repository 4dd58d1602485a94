"""A GGUF file's skeleton (metadata and tensor specs, no data) and random weights in its shapes.

For speed measurements where the real file cannot travel (the GPU machine takes 64 MiB of
carried files; SmolLM2's Q4_1 GGUF is 98 MB): `skeleton` keeps every key/value field (config,
tokenizer, chat template) and each tensor's name, shape and block type, a JSON file of a few MB;
`write_random` writes a GGUF with those fields and tensors, seeded random values quantized into
each tensor's own block type by gguf's quantizers (vectors near 1, matrices N(0, 1 / columns)).

    python -m tvmattn.weights.random_gguf skeleton MODEL.gguf OUT.json
    python -m tvmattn.weights.random_gguf write OUT.json RANDOM.gguf [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

# fields the reader reports and the writer writes by itself
_OWN_FIELDS = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture")


def skeleton(path: str) -> dict:
    """{"architecture", "fields": [[key, value type, item type or None, value]], "tensors":
    [[name, GGUF shape (ne0 first), type name]]} of the GGUF at `path`."""
    import gguf

    reader = gguf.GGUFReader(path)
    fields = []
    arch = None
    for key, field in reader.fields.items():
        value = field.contents()
        if key == "general.architecture":
            arch = value
        if key in _OWN_FIELDS:
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY and len(field.types) > 1 else None
        fields.append([key, vtype.name, sub.name if sub is not None else None, value])
    tensors = [[t.name, [int(d) for d in t.shape], t.tensor_type.name] for t in reader.tensors]
    return {"architecture": arch, "fields": fields, "tensors": tensors}


def write_random(skel: dict, path: str, seed: int = 0) -> None:
    """A GGUF at `path` with skel's fields and tensors, random values in each tensor's type."""
    import gguf

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, skel["architecture"])
    for key, vtype, sub, value in skel["fields"]:
        writer.add_key_value(key, value, gguf.GGUFValueType[vtype], gguf.GGUFValueType[sub] if sub else None)
    for name, shape, type_name in skel["tensors"]:
        kind = gguf.GGMLQuantizationType[type_name]
        rows_first = tuple(reversed(shape))
        if len(shape) == 1:
            values = (1.0 + 0.1 * rng.standard_normal(rows_first)).astype(np.float32)
        else:
            values = (rng.standard_normal(rows_first) / np.sqrt(shape[0])).astype(np.float32)
        if kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            writer.add_tensor(name, values.astype(np.float32 if kind == gguf.GGMLQuantizationType.F32 else np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    a = sub.add_parser("skeleton")
    a.add_argument("gguf")
    a.add_argument("out")
    b = sub.add_parser("write")
    b.add_argument("skeleton")
    b.add_argument("out")
    b.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "skeleton":
        with open(args.out, "w") as f:
            json.dump(skeleton(args.gguf), f)
    else:
        with open(args.skeleton) as f:
            write_random(json.load(f), args.out, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
