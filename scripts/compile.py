"""Compile a model library: `python scripts/compile.py --model smollm2-135m -o smollm2.so`.

The same command as `python -m tvmattn compile` (see `--help` for every option and its default):
writes OUT.so, OUT.params.npz and OUT.runtime.json. Run the bundle with
`python -m tvmattn generate --lib OUT.so --prompt TEXT`. A CUDA build on a machine without a GPU
driver restarts itself once with a stand-in driver (tvmattn/offline_cuda.py) so that the
library embeds compiled cubins, not CUDA source.

`--attn-backend flashinfer` (default `tir`) makes the library's cache run FlashInfer's modules for
its prefill and decode attention: build them first with `python -m tvmattn.flashinfer.build` (for
the model's dtype and head dim and the target's arch); they ship beside the library (the library
names them; the cache loads them from build/flashinfer or $TVMATTN_FLASHINFER_DIR when it is
created). A target FlashInfer cannot serve (the CPU, sm below 80, float32, other head dims) gets
the TIR kernels with a warning.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tvmattn.__main__ import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["compile", *sys.argv[1:]]))
