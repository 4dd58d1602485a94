"""FlashInfer modules built ahead of time: where they live, and loading them.

A configuration (`FlashInferConfig`: dtype, head dims, inline RoPE, CUDA arch) names one
folder `build/flashinfer/<key>/` (or `$TVMATTN_FLASHINFER_DIR/<key>/`) holding:
- `decode.so`: paged decode on CUDA cores (`batch_decode_plan`, `batch_decode_run`);
- `prefill_fa2.so`: FA2 prefill (`batch_prefill_plan`, `batch_prefill_ragged_run`,
  `batch_prefill_paged_run`), also the tensor-core decode (a prefill with one query per request);
- `prefill_fa3.so`: the same for the Hopper FA3 kernels (optional);
- `manifest.json`: the configuration, the FlashInfer and tvm-ffi versions built against.

The modules are plain tvm-ffi shared libraries: loading them needs neither FlashInfer nor
torch, only `tvm_ffi` (`tvm_ffi.load_module`) and the CUDA driver. Head counts and page size
are runtime arguments of the plan functions, so one folder serves every model with these dtypes
and head dims. `python -m tvmattn.flashinfer.build` builds them (see build.py).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from pathlib import Path

from tir_kernels.support import TENSOR_CORE_DTYPES

FLASHINFER_VERSION = "0.7.2.post1"
KINDS = ("decode", "prefill_fa2", "prefill_fa3")
# exported function name prefix per kind (the names TVM gives FlashInfer functions in a library)
PREFIX = {"decode": "batch_decode", "prefill_fa2": "batch_prefill", "prefill_fa3": "batch_prefill"}
HEAD_DIMS = (64, 128, 256)
DTYPES = TENSOR_CORE_DTYPES  # FlashInfer's attention kernels run on tensor cores


@dataclasses.dataclass(frozen=True)
class FlashInferConfig:
    """What a set of FlashInfer modules is specialised for."""

    dtype: str = "float16"
    qk_head_dim: int = 128
    v_head_dim: int = 128
    inline_rope: bool = False
    arch: str = "sm_90a"

    def problem(self) -> str | None:
        """Why FlashInfer cannot serve this configuration (None: it can)."""
        if self.dtype not in DTYPES:
            return f"dtype {self.dtype} (FlashInfer modules are built for {', '.join(DTYPES)})"
        if self.qk_head_dim != self.v_head_dim:
            return f"qk_head_dim={self.qk_head_dim} differs from v_head_dim={self.v_head_dim}"
        if self.qk_head_dim not in HEAD_DIMS:
            return f"head dim {self.qk_head_dim} (FlashInfer supports {HEAD_DIMS})"
        major = arch_major_minor(self.arch)
        if major is None or major < 80:
            return f"arch {self.arch} (FlashInfer needs sm_80 or newer)"
        return None

    def key(self) -> str:
        """The folder name: a digest of the configuration and the FlashInfer version."""
        fields = dict(dataclasses.asdict(self), flashinfer=FLASHINFER_VERSION)
        digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]
        return f"{self.dtype}-d{self.qk_head_dim}-{'rope' if self.inline_rope else 'norope'}-{self.arch}-{digest}"

    def cuda_arch_list(self) -> str:
        """FLASHINFER_CUDA_ARCH_LIST for this arch ("9.0" builds sm_90a)."""
        number = arch_major_minor(self.arch)
        return f"{number // 10}.{number % 10}"


def arch_major_minor(arch: str) -> int | None:
    """80 for "sm_80", 90 for "sm_90a"; None when it is not an sm_XY name."""
    digits = arch.removeprefix("sm_").rstrip("a").rstrip("f")
    return int(digits) if arch.startswith("sm_") and digits.isdigit() else None


def root() -> Path:
    """The folder of all built configurations."""
    env = os.environ.get("TVMATTN_FLASHINFER_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "build" / "flashinfer"


def folder(config: FlashInferConfig, base: Path | None = None) -> Path:
    return (base or root()) / config.key()


def module_path(config: FlashInferConfig, kind: str, base: Path | None = None) -> Path:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return folder(config, base) / f"{kind}.so"


def available(config: FlashInferConfig, kinds=("decode", "prefill_fa2"), base: Path | None = None) -> bool:
    return all(module_path(config, kind, base).is_file() for kind in kinds)


class FlashInferModulesMissing(RuntimeError):
    """The FlashInfer modules of a configuration are not built."""


def missing_message(config: FlashInferConfig, kind: str, base: Path | None = None) -> str:
    return (f"FlashInfer module {kind!r} for {config} is not built ({module_path(config, kind, base)} is missing); "
            f"build it with `python -m tvmattn.flashinfer.build --dtype {config.dtype} --head-dim "
            f"{config.qk_head_dim} --arch {config.arch}{' --inline-rope' if config.inline_rope else ''}"
            f"{' --fa3' if kind == 'prefill_fa3' else ''}` (needs flashinfer-python, see pyproject's "
            "flashinfer extra), or use the TIR backend")


@dataclasses.dataclass(frozen=True)
class Functions:
    """The plan and run functions of one module kind."""

    kind: str
    plan: object
    run: object = None  # decode
    ragged_run: object = None  # prefill
    paged_run: object = None  # prefill


def load(config: FlashInferConfig, kind: str, base: Path | None = None) -> Functions:
    """The functions of a built module; FlashInferModulesMissing when it is not built."""
    path = module_path(config, kind, base)
    if not path.is_file():
        raise FlashInferModulesMissing(missing_message(config, kind, base))
    return _load(str(path), kind)


@functools.lru_cache(maxsize=None)
def _load(path: str, kind: str) -> Functions:
    module = _module(path)
    prefix = PREFIX[kind]
    plan = _adapt(kind, f"{prefix}_plan", module[f"{prefix}_plan"])
    if kind == "decode":
        return Functions(kind, plan, run=module[f"{prefix}_run"])
    return Functions(kind, plan, ragged_run=module[f"{prefix}_ragged_run"], paged_run=module[f"{prefix}_paged_run"])


FA3_PLAN_ARGS = 16  # FA3's plan ends at window_left: no fixed_split_size .. uniform_q_len


def _adapt(kind: str, function: str, func):
    """FA3's plan takes the FA2 plan's first 16 arguments only; the backends pass FA2's list."""
    if kind == "prefill_fa3" and function.endswith("_plan"):

        def plan(*args):
            return func(*args[:FA3_PLAN_ARGS])

        return plan
    return func


NAME_PREFIX = "tvmattn.flashinfer"


def function_name(config: FlashInferConfig, kind: str, function: str) -> str:
    """A name for one function of a built module, resolved at run time by `resolve` (how a model
    library refers to the modules that ship beside it): "tvmattn.flashinfer/<key>/<kind>/<function>"."""
    return f"{NAME_PREFIX}/{config.key()}/{kind}/{PREFIX[kind]}_{function}"


def resolve(name: str):
    """The function a `function_name` names, loaded from build/flashinfer (or
    $TVMATTN_FLASHINFER_DIR); FlashInferModulesMissing when the module is not there."""
    parts = str(name).split("/")
    if len(parts) != 4 or parts[0] != NAME_PREFIX or parts[2] not in KINDS:
        raise ValueError(f"not a FlashInfer function name: {name!r} (expected {NAME_PREFIX}/<key>/<kind>/<function>)")
    _, key, kind, function = parts
    path = root() / key / f"{kind}.so"
    if not path.is_file():
        raise FlashInferModulesMissing(
            f"FlashInfer module {kind!r} of configuration {key} is not built ({path} is missing); build it with "
            "`python -m tvmattn.flashinfer.build` for that dtype, head dim and arch, or set TVMATTN_FLASHINFER_DIR "
            "to the folder holding it")
    return _adapt(kind, function, _module(str(path))[function])


@functools.lru_cache(maxsize=None)
def _module(path: str):
    import tvm_ffi

    return tvm_ffi.load_module(path)


def manifest(config: FlashInferConfig, base: Path | None = None) -> dict | None:
    path = folder(config, base) / "manifest.json"
    return json.loads(path.read_text()) if path.is_file() else None
