"""Build FlashInfer's attention modules ahead of time, with FlashInfer's own JIT generator.

    python -m tvmattn.flashinfer.build [--dtype float16] [--head-dim 128] [--arch sm_90a]
        [--inline-rope] [--fa3] [--jobs 1] [--flashinfer-path DIR] [--force]

Writes `decode.so` and `prefill_fa2.so` (and `prefill_fa3.so` with --fa3) into
build/flashinfer/<key>/ (see modules.py); a module already there is not rebuilt. Object files
and FlashInfer's generated sources stay in build/flashinfer-work/<key>/ (not needed to run).

Needs, on the build machine only: `flashinfer-python==0.7.2.post1` installed without its
dependencies plus torch, numpy, packaging, einops, ninja, requests, tqdm, click, tabulate,
nvidia-ml-py (and nvidia-curand for --fa3: its curand_kernel.h), and nvcc; no GPU. The
flashinfer package may live in a separate folder (--flashinfer-path or
$TVMATTN_FLASHINFER_PYTHONPATH), so that the project's own environment keeps its pinned
apache-tvm-ffi and torch. The modules compile against this environment's tvm-ffi headers (the
project's pin) and link against a stand-in libcuda.so (tvmattn.offline_cuda), so they load
wherever that tvm-ffi and a CUDA driver are present.

The work runs in a child process, since FlashInfer reads its settings (arch list, workspace)
from the environment when it is imported.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from .modules import DTYPES, FLASHINFER_VERSION, HEAD_DIMS, KINDS, PREFIX, FlashInferConfig, folder, module_path

_EXPORT = re.compile(r"^(\s*TVM_FFI_DLL_EXPORT_TYPED_FUNC\()([A-Za-z0-9_]+)(,.*)$")
_SCALARS = dict(additional_tensor_names=[], additional_tensor_dtypes=[],
                additional_scalar_names=["sm_scale", "rope_rcp_scale", "rope_rcp_theta"],
                additional_scalar_dtypes=["double", "double", "double"])


def work_folder(config: FlashInferConfig, base: Path | None = None) -> Path:
    out = folder(config, base)
    return out.parent.parent / f"{out.parent.name}-work" / out.name


def build(config: FlashInferConfig, kinds=("decode", "prefill_fa2"), *, base: Path | None = None, jobs: int = 1,
          flashinfer_path: str | None = None, force: bool = False, verbose: bool = False) -> dict:
    """Build the missing modules of `kinds` for `config`; returns {kind: seconds} of those built."""
    problem = config.problem()
    if problem is not None:
        raise ValueError(f"FlashInfer cannot serve this configuration: {problem}")
    todo = [kind for kind in kinds if force or not module_path(config, kind, base).is_file()]
    if not todo:
        return {}
    if shutil.which("nvcc") is None:
        raise RuntimeError("nvcc is not on PATH: building FlashInfer modules needs the CUDA toolkit")
    env = _child_env(config, base, jobs, flashinfer_path, "prefill_fa3" in todo)
    request = json.dumps({"config": _fields(config), "kinds": todo,
                          "base": str(base) if base else None, "verbose": verbose})
    subprocess.run([sys.executable, "-m", "tvmattn.flashinfer.build", "--child", request], env=env, check=True)
    times = json.loads((folder(config, base) / "manifest.json").read_text())["build_seconds"]
    return {kind: times[kind] for kind in todo}


def _fields(config: FlashInferConfig) -> dict:
    return {field: getattr(config, field) for field in config.__dataclass_fields__}


def _child_env(config: FlashInferConfig, base, jobs: int, flashinfer_path: str | None, fa3: bool) -> dict:
    from tvmattn import offline_cuda

    work = work_folder(config, base)
    lib = work / "lib"
    lib.mkdir(parents=True, exist_ok=True)
    link = lib / "libcuda.so"
    if not link.exists():
        link.symlink_to(offline_cuda.standin_library())
    env = dict(os.environ)
    flashinfer_path = flashinfer_path or env.get("TVMATTN_FLASHINFER_PYTHONPATH")
    source_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (source_root, flashinfer_path, env.get("PYTHONPATH")) if p)
    if flashinfer_path:
        env["PATH"] = os.pathsep.join((str(Path(flashinfer_path) / "bin"), env.get("PATH", "")))  # ninja
    env["CUDA_HOME"] = str(cuda_home())
    env["FLASHINFER_CUDA_ARCH_LIST"] = config.cuda_arch_list()
    env["FLASHINFER_WORKSPACE_BASE"] = str(work)
    env["FLASHINFER_EXTRA_LDFLAGS"] = f"-L{lib}"
    env["MAX_JOBS"] = str(jobs)
    if fa3:
        include = _curand_include(flashinfer_path)
        if include:
            env["FLASHINFER_EXTRA_CUDAFLAGS"] = f"-I{include}"
    return env


def cuda_home() -> Path:
    """The CUDA toolkit folder (the one with lib64/libcudart.so); $CUDA_HOME first."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda",
                  str(Path(shutil.which("nvcc")).resolve().parents[1])]
    for candidate in filter(None, candidates):
        if any((Path(candidate) / lib / "libcudart.so").exists() for lib in ("lib64", "lib")):
            return Path(candidate)
    raise RuntimeError(f"no CUDA toolkit with libcudart.so in {[c for c in candidates if c]}; set CUDA_HOME")


def _curand_include(flashinfer_path: str | None) -> str | None:
    """The include folder holding curand_kernel.h (the nvidia-curand wheel's), if not in the toolkit."""
    toolkit = cuda_home() / "include" / "curand_kernel.h"
    if toolkit.is_file():
        return None
    roots = [Path(p) for p in (flashinfer_path, *sys.path) if p]
    for folder_ in roots:
        for candidate in (folder_ / "nvidia").glob("*/include/curand_kernel.h"):
            return str(candidate.parent)
        candidate = folder_ / "nvidia" / "curand" / "include" / "curand_kernel.h"
        if candidate.is_file():
            return str(candidate.parent)
    raise RuntimeError("curand_kernel.h not found: install the nvidia-curand wheel (FA3 prefill includes it)")


# -- the child process


def _rename_exports(sources, prefix: str) -> None:
    """Give the module's exported functions TVM's names (`<prefix>_plan`, ...)."""
    for path in sources:
        path = Path(path)
        if not path.name.endswith("_binding.cu"):
            continue
        lines = path.read_text().splitlines(keepends=True)
        changed = False
        for i, line in enumerate(lines):
            match = _EXPORT.match(line)
            if match and not match.group(2).startswith(prefix + "_"):
                lines[i] = f"{match.group(1)}{prefix}_{match.group(2)}{match.group(3)}\n"
                changed = True
        if changed:
            path.write_text("".join(lines))


def _spec(config: FlashInferConfig, kind: str):
    import torch
    from flashinfer import jit

    dtype = getattr(torch, config.dtype)
    common = dict(dtype_q=dtype, dtype_kv=dtype, dtype_o=dtype, idtype=torch.int32, head_dim_qk=config.qk_head_dim,
                  head_dim_vo=config.v_head_dim, pos_encoding_mode=int(config.inline_rope), **_SCALARS)
    uri = f"tvmattn_{kind}_{config.key()}"
    if kind == "decode":
        return jit.gen_customize_batch_decode_module(
            uri=uri, variant_name="DefaultAttention<false, false, false, false>",
            variant_decl="#include <flashinfer/attention/variants.cuh>", **common)
    if kind == "prefill_fa2":
        return jit.gen_customize_batch_prefill_module(
            backend="fa2", uri=uri, variant_name="DefaultAttention<false, false, false, false>",
            variant_decl="#include <flashinfer/attention/variants.cuh>", **common)
    return jit.gen_customize_batch_prefill_module(
        backend="fa3", uri=uri, variant_name="DefaultAttention<false>",
        variant_decl="#include <flashinfer/attention/hopper/variants.cuh>", **common)


def _child(request: dict) -> None:
    import tvm_ffi

    config = FlashInferConfig(**request["config"])
    base = Path(request["base"]) if request["base"] else None
    out = folder(config, base)
    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {"build_seconds": {}}
    for kind in request["kinds"]:
        spec = _spec(config, kind)
        _rename_exports(spec.sources, PREFIX[kind])
        print(f"[tvmattn.flashinfer] building {kind} for {config.key()} ...", file=sys.stderr, flush=True)
        start = time.time()
        spec.build(verbose=request["verbose"])
        seconds = round(time.time() - start, 1)
        shutil.copyfile(spec.jit_library_path, out / f".{kind}.so.partial")
        (out / f".{kind}.so.partial").replace(out / f"{kind}.so")
        print(f"[tvmattn.flashinfer] {kind}: {seconds} s", file=sys.stderr, flush=True)
        manifest["build_seconds"][kind] = seconds
        manifest.update(config=_fields(config), flashinfer=FLASHINFER_VERSION, tvm_ffi=tvm_ffi.__version__,
                        exports={k: PREFIX[k] for k in KINDS})
        manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tvmattn.flashinfer.build", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float16", choices=DTYPES)
    parser.add_argument("--head-dim", type=int, default=128, choices=HEAD_DIMS)
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--inline-rope", action="store_true")
    parser.add_argument("--fa3", action="store_true", help="also build the Hopper FA3 prefill (slow: ~9 min on 2 cores)")
    parser.add_argument("--only", choices=KINDS, action="append", help="build only these kinds")
    parser.add_argument("--jobs", type=int, default=1, help="parallel nvcc jobs (default 1)")
    parser.add_argument("--flashinfer-path", help="folder holding the flashinfer package (pip --target)")
    parser.add_argument("--out", type=Path, help="root of the built configurations (default build/flashinfer)")
    parser.add_argument("--force", action="store_true")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(json.loads(args.child))
        return 0
    config = FlashInferConfig(args.dtype, args.head_dim, args.head_dim, args.inline_rope, args.arch)
    kinds = args.only or ["decode", "prefill_fa2"] + (["prefill_fa3"] if args.fa3 else [])
    try:
        times = build(config, kinds, base=args.out, jobs=args.jobs, flashinfer_path=args.flashinfer_path,
                      force=args.force, verbose=args.verbose)
    except (ValueError, RuntimeError, subprocess.CalledProcessError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps({"folder": str(folder(config, args.out)), "built_seconds": times}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
