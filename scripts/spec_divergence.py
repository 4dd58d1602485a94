"""Where a speculative answer first differs from plain greedy decoding, and how close plain
decoding's top two logits were there (a near tie that fp16 rounding can flip, or a real
difference). Usage: python scripts/spec_divergence.py LIB.so [--mode draft-model --width 2]."""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tvmattn.generate import Generator  # noqa: E402
from tvmattn.speculative import EXAMPLE_PROMPTS, SpeculativeOptions  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("lib")
    p.add_argument("--mode", default="draft-model")
    p.add_argument("--width", type=int, default=2)
    p.add_argument("--draft-len", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=48)
    args = p.parse_args()
    generator = Generator(args.lib)
    for name, text in EXAMPLE_PROMPTS.items():
        ids = generator.encode(text)
        plain = generator.generate_tokens([ids], max_new_tokens=args.max_new_tokens, keep_logits=True)
        options = SpeculativeOptions(args.mode, args.draft_len, args.width,
                                     args.lib if args.mode == "draft-model" else None)
        spec = generator.generate_tokens([ids], max_new_tokens=args.max_new_tokens, speculative=options)
        a, b = plain.tokens[0], spec.tokens[0]
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if first is None:
            print(f"{name}: identical ({len(a)} tokens)")
            continue
        logits = np.asarray(plain.logits[0][first], dtype=np.float64)
        top = np.argsort(logits)[::-1][:2]
        print(f"{name}: first difference at token {first}: plain {a[first]}, speculative {b[first]}; plain top-2 "
              f"{top.tolist()} logits {logits[top].round(4).tolist()} gap {logits[top[0]] - logits[top[1]]:.4f}; "
              f"plain logit of the speculative token {logits[b[first]]:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
