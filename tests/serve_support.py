"""A tiny random-weight library bundle for the serving tests, compiled once per test session
(tests/test_serve_engine.py and tests/test_serve_http.py share it), and `serve_process`: the
`serve` command in a child process, once it answers /health."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from harness import project_env

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_process(args: list[str], env: dict | None = None, timeout: float = 120) -> tuple[subprocess.Popen, str]:
    """(process, url): `python -m tvmattn serve ARGS --port P` on 127.0.0.1, started with the
    project on PYTHONPATH (and `env`), once /health answers 200 (AssertionError with the
    server's output if it exits, or after `timeout` seconds). The caller ends the process."""
    import httpx

    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "tvmattn", "serve", *args, "--port", str(port)],
                               env=project_env(**(env or {})),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise AssertionError(f"the server exited ({process.returncode}): {process.stdout.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"the server did not answer /health within {timeout} s")
        time.sleep(0.2)
