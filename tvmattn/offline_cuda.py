"""CUDA libraries that hold compiled GPU code, built on a machine without a GPU driver.

TVM compiles CUDA kernels to a cubin only when its CUDA runtime library
(`libtvm_runtime_cuda.so`) is loaded, and that library needs the driver's `libcuda.so.1`.
Without it, a CUDA build embeds CUDA *source*, which the GPU host must compile (with a full
TVM and NVRTC) every time the library loads. The fix used here: a stand-in `libcuda.so.1`
(built once with the C compiler into ~/.cache/tvmattn, every driver call answers
CUDA_ERROR_NO_DEVICE) on LD_LIBRARY_PATH lets TVM load its CUDA runtime; with
TVM_CUDA_COMPILE_MODE=nvcc the build then runs nvcc and `export_library` embeds a cubin
for the target's arch. Nothing is launched during a build, so the stand-in is never asked
to do real work.

The loader reads LD_LIBRARY_PATH when a process starts, so `python -m tvmattn compile` re-executes
itself once with the stand-in in place (`reexec_with_standin`).

`cuda_arch_problem` says before a build whether a CUDA arch can be compiled for: no CUDA toolkit
in use builds for archs older than sm_50, and the nvcc on PATH (which builds the cubins) lists
the archs it knows (`nvcc --list-gpu-code`). Asked to build for one it does not know, nvcc fails
only after the whole compile, and TVM's error then carries all the CUDA source.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

STANDIN_ENV = "TVMATTN_CUDA_STANDIN"  # set in the re-executed process
DRIVER_FUNCTIONS = ("cuDeviceGetName", "cuFuncSetAttribute", "cuLaunchKernelEx", "cuModuleGetFunction",
                    "cuModuleLoadData", "cuModuleUnload", "cuTensorMapEncodeTiled")
_SOURCE = """/* tvmattn build-time stand-in for libcuda.so.1: no device; see tvmattn/offline_cuda.py */
#define CUDA_ERROR_NO_DEVICE 100
%(stubs)s
int cuGetErrorName(int error, const char **name) { if (name) *name = "CUDA_ERROR_NO_DEVICE"; return 0; }
int cuGetErrorString(int error, const char **text) {
  if (text) *text = "no CUDA driver: tvmattn build-time stand-in (tvmattn/offline_cuda.py)";
  return 0;
}
"""


# the oldest arch the CUDA toolkits still in use (12.x and newer) compile for
MIN_CUDA_ARCH = 50


@functools.lru_cache(maxsize=None)
def nvcc_archs(nvcc: str) -> tuple[str, ...] | None:
    """The real archs ("sm_90", ...) that `nvcc` compiles for, or None when it cannot say."""
    try:
        done = subprocess.run([nvcc, "--list-gpu-code"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    archs = tuple(line.strip() for line in done.stdout.split() if line.strip().startswith("sm_"))
    return archs if done.returncode == 0 and archs else None


def cuda_arch_problem(arch: str) -> str | None:
    """Why this machine cannot build CUDA code for `arch` ("sm_90", "sm_90a"), or None. Without
    nvcc (the library then holds CUDA source, compiled where it loads) only the floor is checked."""
    base = arch[:-1] if arch.endswith("a") else arch
    if int(base[3:]) < MIN_CUDA_ARCH:
        return f"{arch} is older than any CUDA toolkit in use builds for (sm_{MIN_CUDA_ARCH} and newer)"
    nvcc = shutil.which("nvcc")
    archs = nvcc_archs(nvcc) if nvcc else None
    if archs is not None and base not in archs:
        return f"the nvcc on PATH ({nvcc}) cannot build for {arch}: it builds for {', '.join(archs)}"
    return None


def cache_dir() -> Path:
    return Path(os.environ.get("TVMATTN_CACHE") or Path.home() / ".cache" / "tvmattn") / "cuda-standin"


def has_cuda_runtime() -> bool:
    """Whether this process's TVM loaded its CUDA runtime (and so compiles kernels to cubins)."""
    import tvm_ffi

    return tvm_ffi.get_global_func("device_api.cuda", allow_missing=True) is not None


def standin_library() -> Path:
    """The stand-in libcuda.so.1 (built with `cc` on first use); raises RuntimeError without a C
    compiler or a writable cache folder."""
    folder = cache_dir()
    library = folder / "libcuda.so.1"
    if library.is_file():
        return library
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) to build the stand-in libcuda.so.1")
    stubs = "\n".join(f"int {name}(void) {{ return CUDA_ERROR_NO_DEVICE; }}" for name in DRIVER_FUNCTIONS)
    source = folder / f"standin.{os.getpid()}.c"
    partial = folder / f".libcuda.so.1.{os.getpid()}.partial"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        source.write_text(_SOURCE % {"stubs": stubs})
    except OSError as err:
        raise RuntimeError(f"cannot write the stand-in libcuda.so.1 into {folder} ({err.strerror or err}); set "
                           f"TVMATTN_CACHE to a writable folder") from None
    try:
        subprocess.run([compiler, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(partial), str(source)],
                       check=True, capture_output=True, text=True)
        partial.replace(library)
    except subprocess.CalledProcessError as err:
        raise RuntimeError(f"building the stand-in libcuda.so.1 failed: {err.stderr.strip()}") from None
    finally:
        source.unlink(missing_ok=True)
        partial.unlink(missing_ok=True)
    return library


def why_not_offline() -> str | None:
    """None when a stand-in build can embed cubins here, else the reason it cannot."""
    if os.environ.get(STANDIN_ENV):
        return "already running with the stand-in, and TVM still did not load its CUDA runtime"
    if shutil.which("nvcc") is None:
        return "nvcc is not on PATH"
    if shutil.which(os.environ.get("CC", "cc")) is None and shutil.which("gcc") is None:
        return "no C compiler (cc or gcc) for the stand-in libcuda.so.1"
    return None


def standin_env() -> dict[str, str]:
    """This process's environment plus the stand-in driver and nvcc compilation, for a process
    that must build CUDA libraries with cubins (builds the stand-in on first use)."""
    library = standin_library()
    env = dict(os.environ)
    env[STANDIN_ENV] = "1"
    env["TVM_CUDA_COMPILE_MODE"] = "nvcc"
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(library.parent), env.get("LD_LIBRARY_PATH")) if p)
    source_root = str(Path(__file__).resolve().parents[1])  # the child imports this very tvmattn
    env["PYTHONPATH"] = os.pathsep.join(p for p in (source_root, env.get("PYTHONPATH")) if p)
    return env


def reexec_with_standin(argv: list[str] | None = None) -> None:
    """Replace this process by `python ARGV` (default: this process's own sys.argv) with the
    stand-in driver and nvcc compilation (does not return). Call it before any work is done,
    from a command-line entry point; `python -m pkg` entry points pass ["-m", "pkg", ...]."""
    env = standin_env()
    sys.stdout.flush()
    sys.stderr.flush()
    argv = list(sys.argv) if argv is None else list(argv)
    os.execve(sys.executable, [sys.executable, *argv], env)


def gpu_code_form() -> str:
    """How a CUDA build in this process stores its kernels: "cubin" or "source"."""
    return "cubin" if has_cuda_runtime() else "source"
