"""The library bundle format: its one writer (used by tvmattn.build) and its one reader (used by
tvmattn.generate).

A bundle is OUT.so with two files beside it:
- OUT.params.npz: the packed parameters (`p0`, `p1`, ... in metadata["params"] order, in the
  library's dtype; uint8 / int8 block arrays for weights kept quantized), when the build had
  weights; an uncompressed .npz that `np.load` reads;
- OUT.runtime.json: {"metadata": the library's metadata (as its `_metadata` function returns
  it), "settings": {"max_batch_size", "context_window", "prefill_chunk", "page_size",
  "gpu_code"}, "model": the --model value, "params_file": "OUT.params.npz" or null,
  "tokenizer": `tokenizers` JSON or null, "chat_template": a Jinja template or null,
  "stop_token_ids": [ids], "files": {"library": {"bytes", "sha256"}, "params": {...} or null}}.

Writing (`write_bundle`): every file goes under a hidden temporary name (.NAME.PID.partial...)
first and is renamed at the end, the runtime file (which records the others' sizes and
checksums) last, with Ctrl-C held back during the renames; so an interrupted or failed build
leaves the earlier bundle as it was and no half-written output. Partial files of a build that
was killed while writing are removed by the next build of the same output
(`remove_stale_partials`). `output_problem` says before a build whether OUT can be written.

Reading (`open_bundle`, `load_params`, `load_tokenizer`): OUT.runtime.json is checked field by
field, OUT.so and OUT.params.npz against the recorded sizes and sha256 (bundles written before
the record existed still open), the library's ELF headers before dlopen sees it (a truncated
library would crash the process with SIGBUS), the chat template and the tokenizer as they load.
Every problem is a BundleError naming the file and what is wrong.

Importing this module imports neither TVM nor the models (the command line checks output paths
while parsing its arguments).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import json
import os
import signal
import struct
import threading
import time
import zipfile
import zlib
from pathlib import Path
from typing import Any, Callable

import numpy as np

from tir_kernels import support

RUNTIME_SUFFIX = ".runtime.json"
PARAMS_SUFFIX = ".params.npz"
# dtypes of library parameters: the float types, and the block arrays of weights kept quantized
PARAM_DTYPES = (*support.DTYPES, "uint8", "int8")
COMPILE_COMMAND = "python -m tvmattn compile"


class BundleError(ValueError):
    """A bundle that cannot be written or read: the message names the file and the problem."""


def sidecar(library: str | Path, suffix: str) -> Path:
    """OUT.so -> OUT<suffix> (OUT.params.npz, OUT.runtime.json)."""
    library = Path(library)
    stem = library.name[:-3] if library.name.endswith(".so") else library.name
    return library.with_name(stem + suffix)


def bundle_files(library: str | Path) -> tuple[Path, Path, Path]:
    """(OUT.so, OUT.params.npz, OUT.runtime.json)."""
    library = Path(library)
    return library, sidecar(library, PARAMS_SUFFIX), sidecar(library, RUNTIME_SUFFIX)


def is_complete(library: str | Path) -> bool:
    """Whether all three files of the bundle exist (a cache hit; `open_bundle` checks them)."""
    return all(path.is_file() for path in bundle_files(library))


def file_record(path: Path) -> dict[str, Any]:
    """What OUT.runtime.json records of a bundle file: {"bytes": size, "sha256": hex digest}."""
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    return {"bytes": path.stat().st_size, "sha256": digest}


# ---------------------------------------------------------------------- writing

def folder_problem(folder: str | Path) -> str | None:
    """Why no file can be created in `folder` (missing, not a folder, not writable), or None.
    Tried for real (a probe file created and removed): permission bits do not tell for root or
    for a read-only file system."""
    folder = Path(folder)
    if not folder.exists():
        return f"folder {str(folder)!r} does not exist"
    if not folder.is_dir():
        return f"{str(folder)!r} is not a folder"
    probe = folder / f".tvmattn-write-probe.{os.getpid()}.{threading.get_ident()}"
    try:
        probe.touch()
    except OSError as err:
        return f"folder {str(folder)!r} is not writable ({err.strerror or err})"
    probe.unlink(missing_ok=True)
    return None


def output_problem(library: str | Path) -> str | None:
    """Why a bundle cannot be written at OUT.so (a name that does not end in .so, a folder that
    is missing or not writable, a bundle file name taken by a folder), or None; checked before
    the build starts, not after it."""
    library = Path(library)
    if library.suffix != ".so":
        return "the library name must end in .so"
    for path in bundle_files(library):
        if path.is_dir():
            return ("that is a folder" if path == library else
                    f"{str(path)!r}, which the bundle writes beside it, is a folder")
    return folder_problem(library.absolute().parent)


def _partial(final: Path, pid: int) -> Path:
    """The hidden name process `pid` writes `final` under before renaming it (.so and .npz kept
    last: export_library picks its linker by the suffix, np.savez appends .npz)."""
    suffix = final.suffix if final.suffix in (".so", ".npz") else ""
    return final.with_name(f".{final.name}.{pid}.partial{suffix}")


def pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. PermissionError: another user's process
        return True
    return True


def remove_stale_partials(finals: tuple[Path, ...], log: Callable[[str], None] = print) -> list[Path]:
    """Delete the partial files of `finals` left by builds killed while writing (a build that
    is still running keeps its own); returns the deleted paths."""
    removed = []
    for final in finals:
        for path in final.parent.glob(f".{glob.escape(final.name)}.*.partial*"):
            pid_text = path.name[len(final.name) + 2:].split(".", 1)[0]
            if not pid_text.isdigit() or path != _partial(final, int(pid_text)):
                continue
            pid = int(pid_text)
            if pid == os.getpid() or pid_running(pid):
                continue
            path.unlink(missing_ok=True)
            removed.append(path)
            log(f"[compile] removed {path}: a partial file of process {pid}, which is no longer running")
    return removed


@contextlib.contextmanager
def interrupts_held():
    """Ctrl-C (SIGINT) held back inside and raised as KeyboardInterrupt on the way out: the
    bundle's renames run to their end. Only the main thread can hold it; elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[tuple] = []
    previous = signal.signal(signal.SIGINT, lambda *args: caught.append(args))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught and previous != signal.SIG_IGN:
        if callable(previous):
            previous(*caught[0])  # the handler that was there (Python's raises KeyboardInterrupt)
        raise KeyboardInterrupt


class _TimedLink:
    """export_library's default linker for a .so (tvm.support.cc.create_shared), timed."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __call__(self, output: str, objects: list[str], **kwargs: Any) -> Any:
        from tvm.support import cc

        start = time.perf_counter()
        try:
            return cc.create_shared(output, objects, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start


def _write_library(executable: Any, path: Path, target: str, log: Callable[[str], None]) -> None:
    """export_library into `path`, saying what takes the time: the host machine code is generated
    (LLVM) only now, then everything is linked."""
    log(f"[compile] writing the library: machine code generation ({target} host code, LLVM), then linking")
    start, link = time.perf_counter(), _TimedLink()
    executable.export_library(str(path), fcompile=link)
    seconds = time.perf_counter() - start
    size = path.stat().st_size
    log(f"[compile] library: {size} bytes ({size / 1e6:.1f} MB) in {seconds:.2f} s "
        f"(code generation {seconds - link.seconds:.2f} s, linking {link.seconds:.2f} s)")


def _write_params(params: list[np.ndarray], path: Path, log: Callable[[str], None]) -> None:
    """The parameters as an uncompressed .npz (`p0`, `p1`, ...), loadable by np.load."""
    total = sum(p.nbytes for p in params)
    log(f"[compile] writing the parameters: {len(params)} arrays, {total / 1e6:.1f} MB")
    start = time.perf_counter()
    np.savez(path, **{f"p{i}": p for i, p in enumerate(params)})
    size = path.stat().st_size
    log(f"[compile] parameters: {len(params)} arrays, {size / 1e6:.1f} MB in {time.perf_counter() - start:.2f} s")


def write_bundle(library: Path, executable: Any, params: list[np.ndarray] | None, metadata: dict[str, Any],
                 settings: dict[str, Any], model: str, runtime: dict[str, Any], target: str,
                 log: Callable[[str], None] = print) -> tuple[Path, Path | None, Path]:
    """Write the bundle of a compiled library (executable: what tvm.compile returns) ->
    (OUT.so, OUT.params.npz or None, OUT.runtime.json). runtime: {"tokenizer", "chat_template",
    "stop_token_ids"}; params None: a library without weights (a stale OUT.params.npz of an
    earlier build is removed). Atomic (see the module docstring); raises OSError."""
    library, params_file, runtime_file = bundle_files(library)
    remove_stale_partials((library, params_file, runtime_file), log)
    pid = os.getpid()
    temps: list[tuple[Path, Path]] = []
    try:
        tmp_library = _partial(library, pid)
        temps.append((tmp_library, library))
        _write_library(executable, tmp_library, target, log)
        tmp_params = None
        if params is not None:
            tmp_params = _partial(params_file, pid)
            temps.append((tmp_params, params_file))
            _write_params(params, tmp_params, log)
        checksum_start = time.perf_counter()
        files = {"library": file_record(tmp_library),
                 "params": file_record(tmp_params) if tmp_params is not None else None}
        log(f"[compile] checksums (sha256) of the library and the parameters: "
            f"{time.perf_counter() - checksum_start:.2f} s")
        tmp = _partial(runtime_file, pid)
        temps.append((tmp, runtime_file))
        tmp.write_text(json.dumps({"metadata": metadata, "settings": settings, "model": model,
                                   "params_file": params_file.name if params is not None else None,
                                   "files": files, **runtime}))
        with interrupts_held():
            for tmp, final in temps:  # the runtime file, which records the others, comes last
                tmp.replace(final)
            if params is None and params_file.exists():
                params_file.unlink()  # stale weights of an earlier build must not be picked up
    finally:
        for tmp, _ in temps:
            if tmp.exists():
                tmp.unlink()
    return library, params_file if params is not None else None, runtime_file


# ---------------------------------------------------------------------- reading

def _type_name(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", int: "an integer", float: "a number",
             bool: "a boolean"}
    return names.get(type(value), type(value).__name__)


class _RuntimeFields:
    """Typed reads of OUT.runtime.json: a missing or mistyped field is a BundleError naming the
    file and the field ('settings', settings.page_size, metadata.params[0].dtype)."""

    KINDS = {"an object": lambda v: isinstance(v, dict), "a list": lambda v: isinstance(v, list),
             "a string": lambda v: isinstance(v, str),
             "an integer": lambda v: isinstance(v, int) and not isinstance(v, bool)}

    def __init__(self, file: Path):
        self.file = file

    def error(self, problem: str) -> BundleError:
        return BundleError(f"{self.file}: {problem}; recompile the library")

    def get(self, container: dict, key: str, kind: str, where: str = "", optional: bool = False) -> Any:
        name = f"{where}.{key}" if where else repr(key)
        value = container.get(key)
        if value is None:
            if optional:
                return None
            raise self.error(f"{name} is missing")
        if not self.KINDS[kind](value):
            raise self.error(f"{name} should be {kind}, got {_type_name(value)}")
        return value

    def positive(self, container: dict, key: str, where: str) -> int:
        value = container.get(key)
        if value is None:
            raise self.error(f"{where}.{key} is missing")
        if not self.KINDS["an integer"](value) or value <= 0:
            raise self.error(f"{where}.{key} must be a positive integer, got {value!r}")
        return value


def chat_template_problem(template: str) -> str | None:
    """Why a chat template is no Jinja template (its syntax error, with the line), or None."""
    import jinja2

    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as err:
        return f"line {err.lineno}: {err.message}"
    return None


def read_runtime(file: Path) -> dict[str, Any]:
    """OUT.runtime.json, parsed and checked field by field; raises BundleError."""
    from .models.kv_cache import KV_CACHE_KINDS

    try:
        document = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise BundleError(f"{file}: not valid JSON ({err}); recompile the library") from None
    except OSError as err:
        raise BundleError(f"{file}: cannot be read ({err})") from None
    fields = _RuntimeFields(file)
    if not isinstance(document, dict):
        raise fields.error(f"expected a JSON object, got {_type_name(document)}")
    metadata = fields.get(document, "metadata", "an object")
    for index, param in enumerate(fields.get(metadata, "params", "a list", "metadata")):
        where = f"metadata.params[{index}]"
        if not isinstance(param, dict):
            raise fields.error(f"{where} should be an object, got {_type_name(param)}")
        fields.get(param, "name", "a string", where)
        shape = fields.get(param, "shape", "a list", where)
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise fields.error(f"{where}.shape should list sizes, got {shape!r}")
        dtype = fields.get(param, "dtype", "a string", where)
        if dtype not in PARAM_DTYPES:
            raise fields.error(f"{where}.dtype must be one of {PARAM_DTYPES}, got {dtype!r}")
    fields.get(fields.get(metadata, "build_options", "an object", "metadata"), "target", "a string",
               "metadata.build_options")
    kv_cache = fields.get(metadata, "kv_cache", "an object", "metadata")
    if fields.get(kv_cache, "kind", "a string", "metadata.kv_cache") not in KV_CACHE_KINDS:
        raise fields.error(f"metadata.kv_cache.kind must be one of {KV_CACHE_KINDS}, got {kv_cache['kind']!r}")
    compiled_page = fields.positive(kv_cache, "page_size", "metadata.kv_cache")
    fields.positive(fields.get(metadata, "model_config", "an object", "metadata"), "vocab_size",
                    "metadata.model_config")
    settings = fields.get(document, "settings", "an object")
    for key in ("max_batch_size", "context_window", "prefill_chunk"):
        fields.positive(settings, key, "settings")
    page_size = settings.get("page_size")
    if page_size is None:
        raise fields.error("settings.page_size is missing")
    if support.page_size_problem(page_size):
        raise fields.error(f"settings.page_size must be {support.page_size_problem(page_size)}, got {page_size!r}")
    if page_size != compiled_page:
        raise fields.error(f"settings.page_size {page_size} differs from the page size compiled into the "
                           f"library, {compiled_page}")
    for key in ("params_file", "tokenizer", "chat_template"):
        fields.get(document, key, "a string", optional=True)
    template = document.get("chat_template")
    problem = template and chat_template_problem(template)
    if problem:
        raise fields.error(f"'chat_template' is not a valid Jinja template ({problem})")
    stop_ids = fields.get(document, "stop_token_ids", "a list", optional=True) or []
    if not all(fields.KINDS["an integer"](t) for t in stop_ids):
        raise fields.error(f"'stop_token_ids' should list token ids, got {stop_ids!r}")
    files = fields.get(document, "files", "an object", optional=True) or {}  # absent from older bundles
    for role in ("library", "params") if files else ():
        entry = fields.get(files, role, "an object", "files", optional=role == "params")
        if entry is not None:
            fields.get(entry, "bytes", "an integer", f"files.{role}")
            digest = fields.get(entry, "sha256", "a string", f"files.{role}")
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise fields.error(f"files.{role}.sha256 should be 64 hex digits, got {digest!r}")
    return document


def verify_recorded(files: dict[Path, dict[str, Any]]) -> None:
    """Check each file against the size and sha256 OUT.runtime.json recorded of it (all sizes
    first: they are free); raises BundleError naming the file."""
    for path, recorded in files.items():
        size = path.stat().st_size
        if size != recorded["bytes"]:
            raise BundleError(f"{path} is {size} bytes, the bundle recorded {recorded['bytes']}: "
                              f"truncated or replaced; recompile")
    for path, recorded in files.items():
        digest = file_record(path)["sha256"]
        if digest != recorded["sha256"]:
            raise BundleError(f"{path}: its sha256 {digest[:16]}... differs from the one the bundle recorded "
                              f"({recorded['sha256'][:16]}...): modified or replaced; recompile")


def check_elf_library(path: Path) -> None:
    """A look at a library's ELF headers before dlopen sees it: a file that is no shared library
    is refused, and one cut short (which dlopen maps and then dies on with SIGBUS) too."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        header = f.read(64)
        if len(header) < 64 or header[:4] != b"\x7fELF" or header[4] != 2 or header[5] not in (1, 2):
            raise BundleError(f"{path} is not a shared library (no 64-bit ELF header); recompile")
        order = "<" if header[5] == 1 else ">"
        (e_type,) = struct.unpack_from(order + "H", header, 16)
        e_phoff, e_shoff = struct.unpack_from(order + "QQ", header, 32)
        e_phentsize, e_phnum, e_shentsize, e_shnum = struct.unpack_from(order + "HHHH", header, 54)
        if e_type != 3:  # ET_DYN
            raise BundleError(f"{path} is not a shared library (ELF type {e_type}); recompile")
        needed = max(e_phoff + e_phnum * e_phentsize, e_shoff + e_shnum * e_shentsize)
        if needed <= size and e_phentsize >= 48:
            f.seek(e_phoff)
            table = f.read(e_phnum * e_phentsize)
            for index in range(e_phnum):
                p_type, _, p_offset, _, _, p_filesz = struct.unpack_from(order + "IIQQQQ", table, index * e_phentsize)
                if p_type == 1:  # PT_LOAD: mapped from the file
                    needed = max(needed, p_offset + p_filesz)
    if needed > size:
        raise BundleError(f"{path}: truncated ({size} bytes, its ELF headers need {needed}); recompile")


def load_params(file: Path, specs: list[dict[str, Any]]) -> list[np.ndarray]:
    """The arrays `p0`, `p1`, ... of OUT.params.npz checked against metadata["params"] (count,
    shape, dtype); raises BundleError naming the file, the array and the problem."""
    if not zipfile.is_zipfile(file):
        raise BundleError(f"{file}: not a readable .npz file (no zip archive: truncated or corrupt); recompile")
    expected = [f"p{i}" for i in range(len(specs))]
    try:
        stored = np.load(file, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        raise BundleError(f"{file}: not a readable .npz file ({err}); recompile") from None
    params = []
    with stored:
        for key, spec in zip(expected, specs):
            what = f"array {key!r} (parameter {spec['name']!r})"
            if key not in stored.files:
                raise BundleError(f"{file} has no array {key!r} (parameter {spec['name']!r}): it holds "
                                  f"{len(stored.files)} arrays, the library needs {len(specs)}; recompile")
            try:
                value = stored[key]
            except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as err:
                raise BundleError(f"{file}: {what} does not read ({err}); recompile") from None
            dtype = support.numpy_dtype(spec["dtype"])
            if value.dtype != dtype and value.dtype.kind == "V" and value.dtype.itemsize == dtype.itemsize:
                value = value.view(dtype)  # np.save writes bfloat16 as raw 2-byte values
            if value.dtype != dtype:
                raise BundleError(f"{file}: {what} is {value.dtype}, the library needs {spec['dtype']}; recompile")
            if list(value.shape) != spec["shape"]:
                raise BundleError(f"{file}: parameter {spec['name']!r} has shape {list(value.shape)}, "
                                  f"the library needs {spec['shape']}; recompile")
            params.append(value)
        extra = sorted(set(stored.files) - set(expected))
        if extra:
            raise BundleError(f"{file} holds {len(stored.files)} arrays, the library needs {len(specs)} "
                              f"(extra: {', '.join(extra[:3])}); recompile")
    return params


@dataclasses.dataclass(frozen=True)
class Bundle:
    """An opened bundle: its three paths and OUT.runtime.json's checked document."""

    library: Path
    params_file: Path
    runtime_file: Path
    runtime: dict[str, Any]

    @property
    def metadata(self) -> dict[str, Any]:
        return self.runtime["metadata"]

    @property
    def settings(self) -> dict[str, Any]:
        return self.runtime["settings"]


def open_bundle(library: str | Path) -> Bundle:
    """The bundle of OUT.so, checked before anything is loaded: all its files present, the
    runtime file field by field, the recorded sizes and checksums (when recorded), the library's
    ELF headers. Raises BundleError naming the file and the problem."""
    library, params_file, runtime_file = bundle_files(library)
    for path in (library, runtime_file):
        if not path.is_file():
            raise BundleError(f"--lib {str(library)!r}: {path} is missing (build it with {COMPILE_COMMAND})")
    runtime = read_runtime(runtime_file)
    if runtime.get("params_file") is None or not params_file.is_file():
        raise BundleError(f"--lib {str(library)!r}: no weights ({params_file} is missing); "
                          f"compile from a .gguf file or a folder with safetensors")
    files = runtime.get("files")
    if files is not None:
        if files.get("params") is None:
            raise BundleError(f"{runtime_file}: files.params is missing, but the bundle has weights; recompile")
        verify_recorded({library: files["library"], params_file: files["params"]})
    check_elf_library(library)
    return Bundle(library, params_file, runtime_file, runtime)


def load_tokenizer(bundle: Bundle):
    """The bundle's `tokenizers.Tokenizer`, or None when it has none; raises BundleError."""
    text = bundle.runtime.get("tokenizer")
    if not text:
        return None
    import tokenizers

    try:
        return tokenizers.Tokenizer.from_str(text)
    except Exception as err:  # noqa: BLE001 - tokenizers raises a plain Exception
        raise BundleError(f"{bundle.runtime_file}: the tokenizer does not load ({err}); recompile") from None
