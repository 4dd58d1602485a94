"""A tiny random-weight library bundle for the serving tests, compiled once per test session
(tests/test_serve_engine.py and tests/test_serve_http.py share it)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

_BUILT: dict[str, Path] = {}


def tiny_library() -> Path:
    """The tiny Llama of tests/test_weights.py (byte-level BPE vocabulary, ChatML template),
    compiled for the CPU with max batch size 8, prefill chunk 64, context window 256."""
    # TVMATTN_SERVE_TEST_LIB: a library already compiled so (saves the compile when iterating)
    prebuilt = os.environ.get("TVMATTN_SERVE_TEST_LIB")
    if prebuilt:
        return Path(prebuilt)
    if "lib" not in _BUILT:
        from test_weights import write_tiny_gguf

        from tvmattn.build import compile_model

        folder = Path(tempfile.mkdtemp(prefix="tvmattn-serve-"))
        write_tiny_gguf(folder / "tiny.gguf", np.random.default_rng(7))
        result = compile_model(str(folder / "tiny.gguf"), folder / "tiny.so", target="llvm", max_batch_size=8,
                               prefill_chunk=64, log=lambda _message: None)
        _BUILT["lib"] = Path(result.library)
    return _BUILT["lib"]
