"""Test harness: random paged batches, device tensors, index views, and a kernel cache.

Used by every kernel test; the same harness runs TVM's own kernels (tests/test_tvm_anchor.py)
to show that it agrees with them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import tvm
import tvm_ffi

import tir_kernels
from tir_kernels import AttentionConfig

# The module, not the function that `tir_kernels.build` names once read.
tir_build = importlib.import_module("tir_kernels.build")

NP_DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
# Value written into page slots no request owns: a kernel that reads a wrong slot
# produces a large, visible error.
JUNK = 300.0


# Paged attention kernel cases, shared by the decode and prefill tests:
# (num_qo_heads, num_kv_heads, head_dim, page_size, dtype, sliding), sampled so that every
# dtype, GQA group 1..16, head dim 64/128/256 and page size 1/16/64 appears.
PAGED_CASES = [
    (8, 8, 128, 16, "float16", False),
    (8, 4, 64, 1, "float32", False),
    (8, 2, 128, 16, "bfloat16", False),
    (16, 2, 256, 64, "float16", False),
    (16, 1, 64, 16, "float16", False),
    (32, 4, 128, 64, "float32", True),
    (4, 2, 256, 1, "bfloat16", True),
    (8, 1, 128, 16, "float16", True),
    (4, 2, 80, 8, "float16", False),  # a head dim that is not a power of two (Phi-2 style)
]


def slow_except(cases, *keep, first: int = 0, unpack: bool = False):
    """`cases` for pytest.mark.parametrize with every case but the first `first` ones and those
    in `keep` marked slow: the default tier runs those, `-m slow` the rest. A kept case is named
    by its value or by the id of its pytest.param; unpack: each case is a tuple of the values of
    several argument names."""
    param_set = type(pytest.param(None))

    def named(case, key) -> bool:
        if isinstance(case, param_set):
            return key == case.id or key == case.values or (len(case.values) == 1 and key == case.values[0])
        return key == case

    missing = [key for key in keep if not any(named(case, key) for case in cases)]
    if missing:
        raise ValueError(f"slow_except: {missing} are not among the cases")
    out = []
    for i, case in enumerate(cases):
        if i < first or any(named(case, key) for key in keep):
            out.append(case)
        elif isinstance(case, param_set):
            out.append(pytest.param(*case.values, marks=(*case.marks, pytest.mark.slow), id=case.id))
        else:
            out.append(pytest.param(*(case if unpack else (case,)), marks=pytest.mark.slow))
    return out


SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")


PROJECT_ROOT = Path(__file__).resolve().parents[1]


def project_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child Python that imports the project: the project root
    first on PYTHONPATH, ahead of what is there (where the GPU machine finds TVM), plus `extra`."""
    path = os.pathsep.join(p for p in (str(PROJECT_ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def compiles_with_nvcc(source: str, folder, cubin: bool = False) -> None:
    """The CUDA source compiles for sm_90, to PTX (with `cubin` through ptxas too), where nvcc is
    present (without a GPU TVM only writes the source, which the GPU machine compiles when the
    library loads)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return
    path = Path(folder) / "kernels.cu"
    path.write_text(source)
    out, stage = (Path(folder) / "kernels.cubin", "-cubin") if cubin else (Path(folder) / "kernels.ptx", "--ptx")
    done = subprocess.run([nvcc, "-arch=sm_90", stage, "-w", "-o", str(out), str(path)], capture_output=True,
                          text=True, timeout=600)
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert done.returncode == 0, f"nvcc: {errors[:5] or done.stderr[-3000:]}"


def load_script(name: str):
    """The module of scripts/<name>.py, imported as <name>_under_test (registered in sys.modules:
    dataclasses look their module up there)."""
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", os.path.join(SCRIPTS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def paged_case_id(case) -> str:
    hq, hkv, d, ps, dtype, sliding = case
    return f"hq{hq}-hkv{hkv}-d{d}-ps{ps}-{dtype}" + ("-sliding" if sliding else "")


def device_for(config: AttentionConfig) -> tvm.runtime.Device:
    return tvm.cuda(0) if config.is_gpu else tvm.cpu(0)


def has_gpu() -> bool:
    try:
        return bool(tvm.cuda(0).exist)
    except Exception:  # noqa: BLE001 - no CUDA runtime at all
        return False


def to_dtype(x, dtype: str) -> np.ndarray:
    return np.asarray(x, dtype=np.float64).astype(NP_DTYPES[dtype])


def randn(rng: np.random.Generator, shape, dtype: str) -> np.ndarray:
    return to_dtype(rng.standard_normal(shape), dtype)


def tensor(array: np.ndarray, device) -> tvm.runtime.Tensor:
    return tvm.runtime.tensor(np.ascontiguousarray(array), device=device)


def index_view(array, device, offset: int = 7) -> tvm.runtime.Tensor:
    """An int32 tensor that is a view with a non-zero element offset into a larger buffer,
    as the cache packs all index arrays into one device buffer."""
    array = np.ascontiguousarray(array, dtype=np.int32)
    backing = np.full(array.size + offset + 5, -123456, dtype=np.int32)
    backing[offset : offset + array.size] = array.ravel()
    base = tvm.runtime.tensor(backing, device=device)
    return base._create_view(array.shape, "int32", offset * 4)


def empty(shape, dtype: str, device, fill: float = np.nan) -> tvm.runtime.Tensor:
    """Output tensor poisoned with `fill`, so unwritten elements show up."""
    return tvm.runtime.tensor(np.full(shape, fill, dtype=NP_DTYPES.get(dtype, dtype)), device=device)


@dataclasses.dataclass
class PagedBatch:
    """Per-request K/V laid into a shared page pool with shuffled page ids.

    k[i], v[i]: [len_i, Hkv, D] of request i in the kernel dtype (the unpaged truth).
    pages [P, 2, Hkv, page_size, D]; page_indptr [B+1]; page_indices [nnz];
    last_page_len [B]. With a sliding window, `sink` / `window_offset` give each request's
    visible tokens: the first sink[i], then everything from window_offset[i] on.
    """

    k: list
    v: list
    pages: np.ndarray
    page_indptr: np.ndarray
    page_indices: np.ndarray
    last_page_len: np.ndarray
    sink: np.ndarray | None = None
    window_offset: np.ndarray | None = None

    @property
    def batch(self) -> int:
        return len(self.k)

    def visible(self, i: int):
        """(k, v) of the tokens request i attends to, in order."""
        if self.sink is None:
            return self.k[i], self.v[i]
        keep = np.r_[0 : self.sink[i], self.window_offset[i] : len(self.k[i])]
        return self.k[i][keep], self.v[i][keep]

    def length_info(self) -> np.ndarray:
        if self.sink is None:
            return self.last_page_len
        return np.stack([self.last_page_len, self.window_offset, self.sink]).astype(np.int32)


def make_paged_batch(rng, lengths, num_kv_heads, head_dim, page_size, dtype, spare_pages=3,
                     sliding=False) -> PagedBatch:
    """Random K/V for requests of the given lengths, paged with shuffled page ids."""
    ks = [randn(rng, (n, num_kv_heads, head_dim), dtype) for n in lengths]
    vs = [randn(rng, (n, num_kv_heads, head_dim), dtype) for n in lengths]
    pages_per_req = [-(-n // page_size) for n in lengths]
    total = sum(pages_per_req) + spare_pages
    pages = np.full((total, 2, num_kv_heads, page_size, head_dim), JUNK, dtype=np.float64)
    order = rng.permutation(total)
    indptr, indices, last = [0], [], []
    cursor = 0
    for n, k, v, npg in zip(lengths, ks, vs, pages_per_req):
        ids = order[cursor : cursor + npg]
        cursor += npg
        for slot in range(n):
            page = ids[slot // page_size]
            pages[page, 0, :, slot % page_size] = k[slot]
            pages[page, 1, :, slot % page_size] = v[slot]
        indices.extend(ids.tolist())
        indptr.append(len(indices))
        last.append(n - (npg - 1) * page_size if npg else 0)
    batch = PagedBatch(ks, vs, to_dtype(pages, dtype), np.array(indptr, np.int32),
                       np.array(indices, np.int32), np.array(last, np.int32))
    if sliding:
        # Sinks of 0..4 tokens, then a window that starts somewhere after them; the
        # offset is a paged position, so requests shorter than the sink keep everything.
        sink = np.array([min(int(rng.integers(0, 5)), n) for n in lengths], np.int32)
        offset = np.array([int(rng.integers(s, max(s, n - 1) + 1)) if n else 0 for s, n in zip(sink, lengths)], np.int32)
        batch.sink, batch.window_offset = sink, offset
    return batch


# On-disk build cache of CPU kernels, shared by the tests of a session, by pytest-xdist's
# workers and by later sessions. An entry is the exported shared library of one compiled
# PrimFunc, named by a hash of the function's TVMScript and target (`<digest>-<symbol>.so`), in a
# folder per toolchain (TVM, tvm_ffi, tir_kernels' lowering pipeline, the machine), so a changed
# kernel never meets a stale entry. Generating a kernel (parsing its TVMScript) costs about as
# much as compiling it, so KernelCache.get also records which entry a (generator, config, args)
# gave, under a hash that covers tir_kernels' sources and the generator's module. Exporting costs
# about what the JIT of an in-memory module costs: a miss is no slower than a plain build. CUDA
# builds are not cached on disk (their device code depends on the GPU and on how the CUDA
# compiler is hooked at run time).
KERNEL_CACHE_SWITCH = "TVMATTN_TEST_KERNEL_CACHE"  # "0": build every kernel, cache nothing on disk
STALE_DAYS = 14  # toolchain folders untouched this long are removed


def kernel_cache_root() -> Path:
    """$TVMATTN_CACHE/kernels, else ~/.cache/tvmattn/kernels."""
    return Path(os.environ.get("TVMATTN_CACHE", Path.home() / ".cache" / "tvmattn")) / "kernels"


def _digest(*parts) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part if isinstance(part, bytes) else str(part).encode())
        h.update(b"\0")
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def kernel_cache_dir() -> Path:
    """The folder of this toolchain's entries (created), stale sibling folders removed."""
    salt = _digest(tvm.__version__, tvm_ffi.__version__, platform.machine(), Path(tir_build.__file__).read_bytes())
    root = kernel_cache_root()
    folder = root / salt[:16]
    folder.mkdir(parents=True, exist_ok=True)
    for other in root.iterdir():
        with contextlib.suppress(OSError):
            if other != folder and other.is_dir() and time.time() - other.stat().st_mtime > STALE_DAYS * 86400:
                for entry in other.iterdir():
                    entry.unlink()
                other.rmdir()
    return folder


@functools.lru_cache(maxsize=None)
def _source_digest(path: str) -> str:
    """Hash of tir_kernels' sources (and data), and of `path` where it lies outside them."""
    package = Path(tir_kernels.__file__).parent
    files = sorted(f for f in package.rglob("*") if f.suffix in (".py", ".json"))
    if path and Path(path).parent != package:
        files.append(Path(path))
    return _digest(*(part for f in files for part in (f.relative_to(f.anchor), f.read_bytes())))


def _caching() -> bool:
    return os.environ.get(KERNEL_CACHE_SWITCH) != "0"


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock on `path` (created), so that concurrent workers build an entry once."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _load(path: Path, name: str):
    try:
        return tvm.runtime.load_module(str(path))[name]
    except Exception:  # noqa: BLE001 - a damaged or missing entry is rebuilt
        return None


def _write_atomically(path: Path, write) -> bool:
    """write(tmp) into a temporary file beside `path`, then rename it to `path`; False where
    the cache is unwritable."""
    try:
        handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}-", suffix=path.suffix)
        os.close(handle)
    except OSError:
        return False
    try:
        write(tmp)
        os.replace(tmp, path)
        return True
    except Exception:  # noqa: BLE001
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return False


def _entry(func, target) -> tuple[str, str]:
    """(file name, symbol) of the entry of func compiled for target."""
    name = str(func.attrs["global_symbol"]) if func.attrs and "global_symbol" in func.attrs else "main"
    return f"{_digest(name, target, func.script())}-{name}.so", name


def build_cached(func, config):
    """tir_kernels.build(func, config) through the on-disk cache: the same callable, loaded
    from the entry of (func, target), which is compiled and exported first where missing."""
    target = config.tvm_target()
    if target.kind.name != "llvm" or not _caching():
        return _plain_build(func, config)
    file, name = _entry(func, target)
    path = kernel_cache_dir() / file
    if path.exists() and (fn := _load(path, name)) is not None:
        return fn
    with _locked(path.with_suffix(".lock")):
        if path.exists() and (fn := _load(path, name)) is not None:
            return fn
        module = tvm.compile(tvm.IRModule({name: func}), target=target, tir_pipeline=tir_build.PIPELINE)
        if not _write_atomically(path, module.export_library):
            return module[name]
    fn = _load(path, name)
    return module[name] if fn is None else fn


_plain_build = tir_build.build


def install_build_cache() -> None:
    """Route `tir_kernels.build` (which the runtime's kernel sets call) through build_cached."""
    tir_kernels.build = build_cached


def build_generated(generator, config, *args):
    """build_cached(generator(config, *args), config), without generating the function where an
    earlier build of the same (generator, config, args) under the same sources left its entry."""
    described = f"{generator.__module__}.{generator.__qualname__}\0{config!r}\0{args!r}"
    if config.tvm_target().kind.name != "llvm" or not _caching() or " at 0x" in described:
        return build_cached(generator(config, *args), config)
    source = getattr(sys.modules.get(generator.__module__), "__file__", "") or ""
    ref = kernel_cache_dir() / f"{_digest(_source_digest(source), described)}.ref"
    with contextlib.suppress(OSError, ValueError):
        file, name = ref.read_text().split()
        if (fn := _load(ref.parent / file, name)) is not None:
            return fn
    func = generator(config, *args)
    fn = build_cached(func, config)
    file, name = _entry(func, config.tvm_target())
    if (ref.parent / file).exists():
        _write_atomically(ref, lambda tmp: Path(tmp).write_text(f"{file} {name}\n"))
    return fn


def shared_folder(tmp_path_factory, name: str, fill) -> Path:
    """The folder `name` of this test run, filled once by fill(folder) and then shared by every
    test module and every pytest-xdist worker (its temporary folders lie side by side): what
    several modules build alike, such as a model library, is built once."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    shared = base / "shared"
    shared.mkdir(exist_ok=True)
    folder, done = shared / name, shared / f"{name}.done"
    with _locked(shared / f"{name}.lock"):
        if not done.exists():
            if folder.exists():  # left by a fill that failed
                shutil.rmtree(folder)
            folder.mkdir()
            fill(folder)
            done.touch()
    return folder


class KernelCache:
    """Builds each (generator, config, extra) once per test session (through build_generated)."""

    def __init__(self):
        self._built = {}

    def get(self, generator, config: AttentionConfig, *args):
        key = (generator.__module__, generator.__name__, config, args)
        if key not in self._built:
            self._built[key] = build_generated(generator, config, *args)
        return self._built[key]


@functools.lru_cache(maxsize=None)
def kernel_cache() -> KernelCache:
    return KernelCache()
