"""What the kernels support, in one place: dtypes, page sizes, head dims and targets.

Every layer above (the cache's options, a model library's build options, the command line)
validates against these facts instead of restating them. This module imports no TVM at module
level, so the command line can check its arguments before paying for TVM's import.

Targets are written as strings: "llvm" (the CPU), "cuda" (a CUDA GPU whose arch is decided
later) or "cuda:sm_XY" (a CUDA GPU of compute capability X.Y); "auto" is accepted where a
caller asks for the target of this machine (`resolve_target`).
"""

from __future__ import annotations

import dataclasses

DTYPES = ("float16", "bfloat16", "float32")
# the 16-bit float dtypes: what tensor cores multiply (mma.sync, wgmma), and what FlashInfer's
# modules are built for
TENSOR_CORE_DTYPES = ("float16", "bfloat16")
TARGET_KINDS = ("llvm", "cuda")
TARGET_CHOICES = ("auto", "llvm", "cuda")  # plus "cuda:sm_XY"
MAX_HEAD_DIM = 256
MAX_PAGE_SIZE = 128
# The arch of a CUDA build when the target names none and no GPU is present to ask (the project's
# H200). A present GPU always wins: see `resolve_target`.
DEFAULT_CUDA_ARCH = "sm_90"


def page_size_problem(value) -> str | None:
    """None when `value` is a valid page size (a power of two from 1 to MAX_PAGE_SIZE), else
    what was expected."""
    valid = isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_PAGE_SIZE
    if valid and value & (value - 1) == 0:
        return None
    return f"a power of two from 1 to {MAX_PAGE_SIZE}"


def numpy_dtype(name: str):
    """The numpy dtype of a dtype name ("bfloat16" is ml_dtypes' bfloat16)."""
    import numpy as np

    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def dtype_problem(value) -> str | None:
    """None when `value` is a supported dtype name, else what was expected."""
    return None if value in DTYPES else f"one of {DTYPES}"


def is_cuda_arch(text) -> bool:
    """Whether text names a CUDA arch such as "sm_90" or "sm_90a"."""
    if not isinstance(text, str) or not text.startswith("sm_"):
        return False
    digits = text[3:-1] if text.endswith("a") else text[3:]
    return digits.isdigit() and len(digits) >= 2


@dataclasses.dataclass(frozen=True)
class TargetName:
    """A parsed target string: kind "llvm" or "cuda", and the CUDA arch when one is named."""

    kind: str
    arch: str | None = None

    @classmethod
    def parse(cls, text) -> "TargetName":
        """Parse "llvm", "cuda" or "cuda:sm_XY"; raises ValueError saying what was expected."""
        expected = '"llvm", "cuda" or "cuda:sm_XY" (for example "cuda:sm_90")'
        if not isinstance(text, str):
            raise ValueError(f"target={text!r} is not supported: expected {expected}")
        kind, _, arch = text.partition(":")
        if kind not in TARGET_KINDS or (kind == "llvm" and arch) or (arch and not is_cuda_arch(arch)):
            raise ValueError(f"target={text!r} is not supported: expected {expected}")
        return cls(kind, arch or None)

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def cuda_arch(self) -> str:
        """The arch to compile for (DEFAULT_CUDA_ARCH when none is named)."""
        return self.arch or DEFAULT_CUDA_ARCH

    def __str__(self) -> str:
        return f"cuda:{self.arch}" if self.arch else self.kind


def cuda_arch_of(device) -> str | None:
    """The arch of a CUDA tvm.runtime.Device ("sm_90" on an H200, "sm_80" on an A100), or None
    where that device does not exist."""
    if not device.exist:
        return None
    return "sm_" + device.compute_version.replace(".", "")


def present_cuda_arch() -> str | None:
    """The arch of this machine's first CUDA GPU, or None where TVM sees no CUDA device."""
    import tvm

    return cuda_arch_of(tvm.cuda(0))


def resolve_target(text: str, cuda_arch: str | None = None) -> str:
    """The concrete target string ("llvm" or "cuda:sm_XY") for a requested one.

    text: "auto" (CUDA where a GPU is present, else the CPU), "llvm", "cuda" or "cuda:sm_XY".
    cuda_arch: an arch to use when text names none. Otherwise the arch is read from the present
    GPU, else DEFAULT_CUDA_ARCH. Raises ValueError for a malformed or contradictory request.
    """
    if cuda_arch is not None and not is_cuda_arch(cuda_arch):
        raise ValueError(f"cuda_arch={cuda_arch!r} is not a CUDA arch: expected one like 'sm_90' or 'sm_80'")
    if text == "auto":
        present = present_cuda_arch()
        if present is None:
            return "llvm"
        return f"cuda:{cuda_arch or present}"
    name = TargetName.parse(text)
    if not name.is_cuda:
        return "llvm"
    if name.arch and cuda_arch and name.arch != cuda_arch:
        raise ValueError(f"target={text!r} and cuda_arch={cuda_arch!r} name different archs")
    return f"cuda:{name.arch or cuda_arch or present_cuda_arch() or DEFAULT_CUDA_ARCH}"
