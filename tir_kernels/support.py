"""What the kernels support, in one place: dtypes, page sizes, head dims and targets.

Every layer above (the cache's options, a model library's build options, the command line)
validates against these facts instead of restating them, and so do the kernels' own checks:
`CAPABILITIES` lists what each kernel serves, and the generators and dispatchers read their
dtypes and archs from the constants below. This module imports no TVM at module level, so the
command line can check its arguments before paying for TVM's import.

Targets are written as strings: "llvm" (the CPU), "cuda" (a CUDA GPU whose arch is decided
later) or "cuda:sm_XY" (a CUDA GPU of compute capability X.Y); "auto" is accepted where a
caller asks for the target of this machine (`resolve_target`).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

DTYPES = ("float16", "bfloat16", "float32")
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
# The dtypes the tensor-core kernels (mma.sync on sm_80+, wgmma on sm_90) serve (and FlashInfer's
# modules are built for), and PTX's name of each (the type suffix of mma / wgmma / cvt); float32 runs on CUDA cores.
TENSOR_CORE_DTYPES = ("float16", "bfloat16")
PTX_DTYPE_NAMES = {"float16": "f16", "bfloat16": "bf16"}
MMA_MIN_SM = 80  # cp.async, ldmatrix(.trans) and bf16 mma.sync: sm_80 and newer
WGMMA_ARCHS = ("sm_90", "sm_90a")  # wgmma, setmaxnreg and mbarrier rings: Hopper only
PDL_MIN_SM = 90  # griddepcontrol (programmatic dependent launch): sm_90 and newer
TARGET_KINDS = ("llvm", "cuda")
TARGET_CHOICES = ("auto", "llvm", "cuda")  # plus "cuda:sm_XY"
# The FP8 formats a KV cache may store (pages of 1-byte codes, dequantized with a float32 scale
# per layer, K/V and KV head; tir_kernels.kv_quant), each with its largest finite value.
FP8_KV_DTYPES = ("float8_e4m3fn", "float8_e5m2")
FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
KV_DTYPES = DTYPES + FP8_KV_DTYPES
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
    """The numpy dtype of a dtype name ("bfloat16" and the FP8 formats are ml_dtypes')."""
    import numpy as np

    if name == "bfloat16" or name in FP8_KV_DTYPES:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def kv_dtype_problem(value) -> str | None:
    """None when `value` is a supported KV cache (page) dtype, else what was expected."""
    return None if value in KV_DTYPES else f"one of {KV_DTYPES}"


def is_fp8(dtype) -> bool:
    """Whether a dtype name is one of the FP8 KV formats."""
    return dtype in FP8_KV_DTYPES


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


def sm_of(target) -> int:
    """The SM version a CUDA target names ("sm_90a" -> 90): of a tvm Target (its arch), or of a
    target string ("cuda:sm_XY"; "cuda" alone: DEFAULT_CUDA_ARCH's). 0 for another kind of
    target, or a tvm Target without an sm_XY arch."""
    if isinstance(target, str):
        name = TargetName.parse(target)
        arch = name.cuda_arch if name.is_cuda else ""
    else:
        arch = str(target.attrs.get("arch", "")) if target.kind.name == "cuda" and target.attrs is not None else ""
    digits = arch[3:].rstrip("a") if arch.startswith("sm_") else ""
    return int(digits) if digits.isdigit() else 0


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


@dataclasses.dataclass(frozen=True)
class Capability:
    """What one kernel serves. dtypes: its element types; cpu: whether it runs on the CPU
    ("llvm"); min_sm: the smallest CUDA compute capability it runs on (None: no CUDA build);
    archs: exactly these CUDA archs instead (None: min_sm and newer); head_dims, page_sizes and
    notes: the limits it adds to the config's (AttentionConfig / MLAConfig), in words."""

    dtypes: tuple
    cpu: bool
    min_sm: int | None
    archs: tuple | None = None
    head_dims: str = f"multiples of 16 up to {MAX_HEAD_DIM}"
    page_sizes: str = f"powers of two from 1 to {MAX_PAGE_SIZE}"
    notes: str = ""

    def serves_target(self, target: str) -> bool:
        """Whether a target string ("llvm", "cuda", "cuda:sm_XY") is one this kernel runs on."""
        name = TargetName.parse(target)
        if not name.is_cuda:
            return self.cpu
        if self.min_sm is None:
            return False
        if self.archs is not None:
            return name.cuda_arch in self.archs
        return int(name.cuda_arch[3:].rstrip("a")) >= self.min_sm


_ALL_CUDA = 0  # min_sm of a kernel that runs on every CUDA arch
# kernel (the generator's module) -> what it serves. The dispatchers (decode.paged_decode,
# prefill.paged_prefill and the other prefills, mla.mla_paged_prefill, mla.mla_paged_decode_auto)
# take the first of their kernels that serves a config and say why they passed over the others.
CAPABILITIES = {
    "decode": Capability(DTYPES, cpu=True, min_sm=_ALL_CUDA, notes="v_head_dim = head_dim (CUDA cores)"),
    "decode_tc": Capability(TENSOR_CORE_DTYPES, cpu=False, min_sm=MMA_MIN_SM,
                            head_dims="32, 64, 128 and 256 (its inline RoPE rotates whole K rows per pass of the"
                                      " block's threads: schedules.tc_rope_pass_problem; 80, 96 and the other"
                                      " multiples of 16 run the CUDA-core decode)",
                            notes="v_head_dim = head_dim; GQA groups up to 16 (chosen by default for 3..16);"
                                  f" dependent launch from sm_{PDL_MIN_SM}"),
    "prefill": Capability(DTYPES, cpu=True, min_sm=_ALL_CUDA,
                          notes="CUDA cores; paged: v_head_dim = head_dim; ragged: any v_head_dim"),
    "prefill_sm80": Capability(TENSOR_CORE_DTYPES, cpu=False, min_sm=MMA_MIN_SM,
                               notes="mma.sync; inline RoPE (rotary_mode 1) runs the CUDA-core kernel"),
    "prefill_sm90": Capability(TENSOR_CORE_DTYPES, cpu=False, min_sm=90, archs=WGMMA_ARCHS,
                               head_dims="multiples of 64 up to 256 (head_dim and v_head_dim)", notes="wgmma"),
    "mla": Capability(DTYPES, cpu=True, min_sm=_ALL_CUDA, head_dims="latent_dim: multiples of 16 up to 1024;"
                      f" rope_dim: multiples of 16 up to {MAX_HEAD_DIM}", notes="CUDA cores (SIMT)"),
    "mla_tc": Capability(TENSOR_CORE_DTYPES, cpu=False, min_sm=MMA_MIN_SM,
                         head_dims="latent_dim: multiples of 32", notes="decode only; mma.sync"),
    "mla_sm90": Capability(TENSOR_CORE_DTYPES, cpu=False, min_sm=90, archs=WGMMA_ARCHS,
                           head_dims="latent_dim: multiples of 128 up to 512; latent_dim + rope_dim: multiples of 64",
                           notes="wgmma; the tiles must fit shared memory"),
    "merge": Capability(DTYPES, cpu=True, min_sm=_ALL_CUDA),
    "rotary": Capability(DTYPES, cpu=True, min_sm=_ALL_CUDA),
    "page_ops": Capability(DTYPES, cpu=True, min_sm=_ALL_CUDA),
    "mla_page_ops": Capability(DTYPES, cpu=True, min_sm=_ALL_CUDA),
    "sampling": Capability(DTYPES, cpu=True, min_sm=_ALL_CUDA, head_dims="none (logits [rows, vocab])",
                           page_sizes="none", notes="dtype: the logits' (float32 arithmetic); any vocabulary"
                           " (262,144 tested); one block per row on CUDA"),
}


class KernelChoice(NamedTuple):
    """A dispatcher's choice: `kernel`, a key of CAPABILITIES; `reason`, why the faster kernels
    before it were passed over for this config (None where the first choice serves it, or where
    the caller's schedule named the kernel)."""

    kernel: str
    reason: str | None = None
