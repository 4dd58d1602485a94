"""Compile a model library: `python scripts/compile.py --model smollm2-135m -o smollm2.so`.

The same command as `python -m tvmattn compile` (see `--help` for every option and its default):
writes OUT.so, OUT.params.npz and OUT.runtime.json. Run the bundle with
`python -m tvmattn generate --lib OUT.so --prompt TEXT`. A CUDA build on a machine without a GPU
driver restarts itself once with a stand-in driver (tvmattn/offline_cuda.py) so that the
library embeds compiled cubins, not CUDA source.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tvmattn.__main__ import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["compile", *sys.argv[1:]]))
