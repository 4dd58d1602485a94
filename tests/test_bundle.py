"""Specification of the library bundle's integrity (OUT.so + OUT.params.npz + OUT.runtime.json,
written and read by tvmattn/bundle.py).

- `compile_model` records the size and sha256 of the library and the parameters in
  OUT.runtime.json ("files"); `Generator` checks them before loading anything, so a truncated or
  replaced file is a GenerateError ("... is N bytes, the bundle recorded M: truncated or
  replaced; recompile"), never a SIGBUS. A bundle without the record (built before it existed)
  still loads.
- Every broken bundle file (params, runtime.json, library) is a GenerateError naming the file
  and the problem; `python -m tvmattn generate` prints `error: ...` and exits 2.
- Logits that are not finite stop generation with an error naming the step.
- The write is atomic (Ctrl-C during the renames is held until the bundle is whole), and partial
  files left by a killed compile are removed by the next one.
- A chat template that is no Jinja, or fails on the prompt, is an error naming it.

A tiny random GGUF model (tests/test_weights.py, with a separate lm_head) is compiled for llvm
once per module; each test corrupts a copy of it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

from test_weights import write_tiny_gguf  # noqa: E402

from tvmattn.__main__ import main  # noqa: E402
from tvmattn.build import compile_model  # noqa: E402
from tvmattn.bundle import PARAMS_SUFFIX, RUNTIME_SUFFIX, sidecar  # noqa: E402
from tvmattn.generate import GenerateError, Generator  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [40, 77, 120, 9, 33, 260]
VOCAB = 268  # tests/test_weights.py tiny_vocab()


def quiet(_message: str) -> None:
    pass


@pytest.fixture(scope="module")
def built(tiny_library) -> Path:
    """OUT.so of a tiny model compiled for llvm (its params and runtime.json beside it): conftest's
    tiny_library (untied: its embedding and LM head are separate parameters), compiled once per
    session; tests that break a bundle break a copy of it."""
    return tiny_library[1]


@pytest.fixture
def bundle(built, tmp_path) -> Path:
    """A private copy of the compiled bundle to corrupt: its OUT.so."""
    for path in (built, sidecar(built, PARAMS_SUFFIX), sidecar(built, RUNTIME_SUFFIX)):
        shutil.copy(path, tmp_path / path.name)
    return tmp_path / built.name


# ---------------------------------------------------------------- helpers that break a bundle

def params_of(library: Path) -> Path:
    return sidecar(library, PARAMS_SUFFIX)


def runtime_of(library: Path) -> Path:
    return sidecar(library, RUNTIME_SUFFIX)


def read_runtime(library: Path) -> dict:
    return json.loads(runtime_of(library).read_text())


def write_runtime(library: Path, runtime: dict) -> None:
    runtime_of(library).write_text(json.dumps(runtime))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def record(path: Path) -> dict:
    """What runtime.json records of a bundle file."""
    return {"bytes": path.stat().st_size, "sha256": sha256(path)}


def rerecord(library: Path) -> None:
    """Make the runtime.json record match the files as they are now (a corruption the record cannot see)."""
    runtime = read_runtime(library)
    runtime["files"] = {"library": record(library), "params": record(params_of(library))}
    write_runtime(library, runtime)


def truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def edit_params(library: Path, edit) -> None:
    """Rewrite OUT.params.npz as edit(dict of arrays) and re-record it."""
    with np.load(params_of(library)) as stored:
        arrays = {key: stored[key] for key in stored.files}
    edit(arrays)
    np.savez(params_of(library), **arrays)
    rerecord(library)


def param_index(library: Path, name: str) -> int:
    return [p["name"] for p in read_runtime(library)["metadata"]["params"]].index(name)


def edit_settings(**changes):
    def edit(library: Path) -> None:
        runtime = read_runtime(library)
        runtime["settings"].update(changes)
        write_runtime(library, runtime)
    return edit


def drop_key(*keys):
    def edit(library: Path) -> None:
        runtime = read_runtime(library)
        target = runtime
        for key in keys[:-1]:
            target = target[key]
        del target[keys[-1]]
        write_runtime(library, runtime)
    return edit


def set_key(value, *keys):
    def edit(library: Path) -> None:
        runtime = read_runtime(library)
        target = runtime
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value
        write_runtime(library, runtime)
    return edit


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tvmattn", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)


def expect_cli_error(library: Path, capsys, *fragments: str) -> None:
    """`python -m tvmattn generate --lib library` prints `error: ...` with the fragments and exits 2."""
    capsys.readouterr()
    assert main(["generate", "--lib", str(library), "--prompt", "hello", "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in errors[0], err


# ---------------------------------------------------------------- 1. the size and checksum record

def test_compile_records_size_and_sha256_of_library_and_params(built):
    files = read_runtime(built)["files"]
    assert files == {"library": record(built), "params": record(params_of(built))}


TRUNCATIONS = {"to 100 KB": lambda size: 100 * 1024, "to half": lambda size: size // 2,
               "by one byte": lambda size: size - 1}


@pytest.mark.parametrize("truncation", [pytest.param(t, marks=pytest.mark.slow) if t != "to half" else t
                                        for t in TRUNCATIONS])
def test_truncated_library_is_an_error_not_a_crash(bundle, truncation):
    """Loading a truncated .so used to kill the process with SIGBUS: run it in a child process."""
    size = bundle.stat().st_size
    keep = TRUNCATIONS[truncation](size)
    truncate(bundle, keep)
    done = run_cli("generate", "--lib", str(bundle), "--prompt", "hello")
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert f"error: {bundle} is {keep} bytes, the bundle recorded {size}: truncated or replaced; recompile" \
        in done.stderr


def test_truncated_params_are_reported_by_size(bundle):
    size = params_of(bundle).stat().st_size
    truncate(params_of(bundle), size // 2)
    with pytest.raises(GenerateError, match=f"{params_of(bundle)} is {size // 2} bytes, the bundle recorded {size}"):
        Generator(bundle)


@pytest.mark.parametrize("which", ["library", "params"])
def test_a_modified_file_of_the_same_size_fails_the_checksum(bundle, which):
    path = bundle if which == "library" else params_of(bundle)
    flip_byte(path, path.stat().st_size // 2)
    with pytest.raises(GenerateError, match=rf"{path}: its sha256 .* differs from the one the bundle recorded"):
        Generator(bundle)


def test_a_bundle_without_the_record_still_loads(bundle):
    """Bundles compiled before the record existed load; their files are still checked as they load."""
    drop_key("files")(bundle)
    tokens = Generator(bundle).generate_tokens([PROMPT], max_new_tokens=3).tokens[0]
    assert len(tokens) <= 3


def test_an_unrecorded_truncated_library_is_an_error_not_a_crash(bundle):
    drop_key("files")(bundle)
    truncate(bundle, bundle.stat().st_size // 2)
    done = run_cli("generate", "--lib", str(bundle), "--prompt", "hello")
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert f"error: {bundle}: truncated" in done.stderr


# ---------------------------------------------------------------- 2. every broken file is a GenerateError

def params_truncated_rerecorded(library):
    truncate(params_of(library), params_of(library).stat().st_size // 2)
    rerecord(library)


def params_junk(library):
    params_of(library).write_bytes(b"not a zip file" * 100)
    rerecord(library)


def params_data_corrupt(library):
    flip_byte(params_of(library), params_of(library).stat().st_size // 2)
    rerecord(library)


def params_header_corrupt(library):
    data = params_of(library).read_bytes()
    start = data.index(b"\x93NUMPY")  # the first array's .npy header
    params_of(library).write_bytes(data[:start + 12] + b"!!!!" + data[start + 16:])
    rerecord(library)


def params_missing_array(library):
    edit_params(library, lambda arrays: arrays.pop("p3"))


def params_wrong_dtype(library):
    edit_params(library, lambda arrays: arrays.update(p0=arrays["p0"].astype(np.float64)))


def params_wrong_shape(library):
    edit_params(library, lambda arrays: arrays.update(p0=arrays["p0"][:-1]))


def runtime_not_json(library):
    runtime_of(library).write_text('{"metadata": ')


def runtime_not_utf8(library):
    runtime_of(library).write_bytes(b"\xff\xfe\x00junk")


def runtime_not_an_object(library):
    runtime_of(library).write_text("[1, 2]")


def library_junk(library):
    library.write_bytes(os.urandom(library.stat().st_size))


def library_junk_rerecorded(library):
    library.write_bytes(os.urandom(4096))
    rerecord(library)


def library_empty_rerecorded(library):
    library.write_bytes(b"")
    rerecord(library)


def metadata_of_another_build(library):
    runtime = read_runtime(library)
    runtime["metadata"]["params"][0]["name"] = "renamed.weight"
    write_runtime(library, runtime)


BROKEN = {
    # OUT.params.npz
    "params truncated, record rewritten": (params_truncated_rerecorded, PARAMS_SUFFIX, "not a readable .npz file"),
    "params junk, record rewritten": (params_junk, PARAMS_SUFFIX, "not a readable .npz file"),
    "params data corrupt, record rewritten": (params_data_corrupt, PARAMS_SUFFIX, "array 'p"),
    "params .npy header corrupt": (params_header_corrupt, PARAMS_SUFFIX, "array 'p0'"),
    "params missing an array": (params_missing_array, PARAMS_SUFFIX, "has no array 'p3'"),
    "params wrong dtype": (params_wrong_dtype, PARAMS_SUFFIX, "is float64, the library needs float32"),
    "params wrong shape": (params_wrong_shape, PARAMS_SUFFIX, "the library needs [268, 64]"),
    # OUT.runtime.json
    "runtime not JSON": (runtime_not_json, RUNTIME_SUFFIX, "not valid JSON"),
    "runtime not UTF-8": (runtime_not_utf8, RUNTIME_SUFFIX, "not valid JSON"),
    "runtime not an object": (runtime_not_an_object, RUNTIME_SUFFIX, "expected a JSON object, got a list"),
    "runtime without settings": (drop_key("settings"), RUNTIME_SUFFIX, "'settings' is missing"),
    "runtime without metadata": (drop_key("metadata"), RUNTIME_SUFFIX, "'metadata' is missing"),
    "settings without page size": (drop_key("settings", "page_size"), RUNTIME_SUFFIX,
                                   "settings.page_size is missing"),
    "page size 0": (edit_settings(page_size=0), RUNTIME_SUFFIX,
                    "settings.page_size must be a power of two from 1 to 128, got 0"),
    "page size negative": (edit_settings(page_size=-16), RUNTIME_SUFFIX, "must be a power of two from 1 to 128, got -16"),
    "page size not a power of two": (edit_settings(page_size=12), RUNTIME_SUFFIX,
                                     "settings.page_size must be a power of two from 1 to 128, got 12"),
    "page size a string": (edit_settings(page_size="16"), RUNTIME_SUFFIX, "got '16'"),
    "page size not the compiled one": (edit_settings(page_size=32), RUNTIME_SUFFIX,
                                       "settings.page_size 32 differs from the page size compiled into the library, 16"),
    "batch size a float": (edit_settings(max_batch_size=2.0), RUNTIME_SUFFIX, "settings.max_batch_size"),
    "context window negative": (edit_settings(context_window=-1), RUNTIME_SUFFIX, "settings.context_window"),
    "params list not a list": (set_key({}, "metadata", "params"), RUNTIME_SUFFIX, "metadata.params should be a list"),
    "unknown param dtype": (set_key("float8", "metadata", "params", 0, "dtype"), RUNTIME_SUFFIX,
                            "metadata.params[0].dtype"),
    "target not a string": (set_key(7, "metadata", "build_options", "target"), RUNTIME_SUFFIX,
                            "metadata.build_options.target should be a string"),
    "record not an object": (set_key("abc", "files"), RUNTIME_SUFFIX, "'files' should be an object"),
    "record without sha256": (drop_key("files", "library", "sha256"), RUNTIME_SUFFIX, "files.library.sha256"),
    "stop ids not a list": (set_key(2, "stop_token_ids"), RUNTIME_SUFFIX, "'stop_token_ids' should be a list"),
    "tokenizer not a string": (set_key(5, "tokenizer"), RUNTIME_SUFFIX, "'tokenizer' should be a string"),
    "tokenizer invalid": (set_key("{}", "tokenizer"), RUNTIME_SUFFIX, "the tokenizer does not load"),
    "chat template not Jinja": (set_key("{% for m in messages %}{{ m }}", "chat_template"), RUNTIME_SUFFIX,
                                "'chat_template' is not a valid Jinja template (line 1: "),
    # OUT.so
    "library junk, record kept": (library_junk, ".so", "differs from the one the bundle recorded"),
    "library junk, record rewritten": (library_junk_rerecorded, ".so", "is not a shared library"),
    "library empty, record rewritten": (library_empty_rerecorded, ".so", "is not a shared library"),
    "runtime of another build": (metadata_of_another_build, ".so", "come from different builds"),
}


@pytest.mark.parametrize("name", list(BROKEN))
def test_a_broken_bundle_is_a_generate_error_naming_the_file(bundle, name, capsys):
    corrupt, suffix, problem = BROKEN[name]
    corrupt(bundle)
    named = bundle if suffix == ".so" else sidecar(bundle, suffix)
    with pytest.raises(GenerateError) as caught:
        Generator(bundle)
    assert str(named) in str(caught.value) and problem in str(caught.value), str(caught.value)
    expect_cli_error(bundle, capsys, str(named), problem)


@pytest.fixture(scope="module")
def foreign_libraries(tmp_path_factory) -> dict[str, Path]:
    """Valid TVM libraries that are no model library: a TIR function and a Relax VM program."""
    import tvm
    from tvm import relax, te

    folder = tmp_path_factory.mktemp("foreign")
    a = te.placeholder((4,), name="a", dtype="float32")
    b = te.compute((4,), lambda i: a[i] + 1.0, name="b")
    tvm.compile(te.create_prim_func([a, b]), target="llvm").export_library(str(folder / "tir.so"))
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4,), "float32"))
    with bb.function("main", [x]):
        bb.emit_func_output(x)
    tvm.compile(bb.get(), target="llvm").export_library(str(folder / "relax.so"))
    return {"tir": folder / "tir.so", "relax": folder / "relax.so"}


@pytest.mark.parametrize("kind", ["tir", "relax"])
def test_a_library_that_is_no_model_library_is_an_error(bundle, foreign_libraries, kind, capsys):
    shutil.copy(foreign_libraries[kind], bundle)
    rerecord(bundle)
    with pytest.raises(GenerateError, match=f"{bundle}: not a tvmattn model library"):
        Generator(bundle)
    expect_cli_error(bundle, capsys, str(bundle), "not a tvmattn model library")


@pytest.mark.parametrize("template, problem", [
    ("{{ raise_exception('only one user message') }}", "the chat template refuses the prompt: only one user message"),
    ("{{ messages[0].nothing.deeper }}", "the chat template does not render (UndefinedError: "),
    ("{{ 1 / 0 }}", "the chat template does not render (ZeroDivisionError: "),
])
def test_a_chat_template_that_fails_to_render_is_a_generate_error(bundle, template, problem, capsys):
    """A template that parses but fails on the prompt (it is code) is an error naming it."""
    set_key(template, "chat_template")(bundle)
    generator = Generator(bundle)
    with pytest.raises(GenerateError) as caught:
        generator.generate("hello", max_new_tokens=2)
    assert problem in str(caught.value)
    assert generator.generate("hello", max_new_tokens=2, chat=False).tokens  # without the template it works
    expect_cli_error(bundle, capsys, problem)


@pytest.mark.parametrize("stage", ["loading the bundle", "prefill", "decode"])
def test_ctrl_c_while_generating_is_one_line_and_leaves_the_bundle_as_it_was(built, stage):
    """Ctrl-C while the bundle loads, in the prefill or in a decode step (inside the VM, mid-step;
    tests/ctrl_c.py interrupts exactly there): one line, exit status 130, the bundle unchanged."""
    import ctrl_c
    from test_cli import expect_interrupted

    before = {path: path.read_bytes() for path in (built, params_of(built), runtime_of(built))}
    done = ctrl_c.run(stage, ["generate", "--lib", str(built), "--prompt", "hello", "--max-new-tokens", "8"])
    expect_interrupted(done, stage)
    assert {path: path.read_bytes() for path in before} == before


# ---------------------------------------------------------------- 3. non-finite logits

def test_logits_that_are_not_finite_stop_at_prefill(bundle, capsys):
    index = param_index(bundle, "model.norm.weight")
    edit_params(bundle, lambda arrays: arrays[f"p{index}"].__setitem__(3, np.nan))
    with pytest.raises(GenerateError, match="logits are not finite at step 0 \\(prefill\\) of prompt 0"):
        Generator(bundle).generate_tokens([PROMPT], max_new_tokens=4)
    expect_cli_error(bundle, capsys, "logits are not finite at step 0")


def test_logits_that_are_not_finite_stop_at_the_decode_step(bundle):
    """The embedding row of the first generated token is inf: prefill is fine, decode step 1 is not."""
    generator = Generator(bundle)
    generator.stop_ids = set()
    first = generator.generate_tokens([PROMPT], max_new_tokens=1).tokens[0][0]
    assert first not in PROMPT
    index = param_index(bundle, "model.embed_tokens.weight")
    edit_params(bundle, lambda arrays: arrays[f"p{index}"].__setitem__(first, np.inf))
    generator = Generator(bundle)
    generator.stop_ids = set()
    with pytest.raises(GenerateError, match="logits are not finite at step 1 \\(decode\\) of prompt 0"):
        generator.generate_tokens([PROMPT], max_new_tokens=4)


@pytest.mark.parametrize("token", [VOCAB, -1])
def test_token_ids_outside_the_vocabulary_are_refused(built, token):
    """The embedding lookup does not check its indices (TVM's "fast" take): the Generator does."""
    with pytest.raises(GenerateError, match=f"prompt 1: token id {token} is outside the vocabulary \\[0, {VOCAB}\\)"):
        Generator(built).generate_tokens([PROMPT, [5, token]], max_new_tokens=2)


# ---------------------------------------------------------------- 4. atomic writes, stale partial files

class FakeExecutable:
    """Stands in for the compiler's output, so that only the write stage runs for real."""

    def export_library(self, path: str, **_kwargs) -> None:
        Path(path).write_bytes(b"\x7fELF" + b"\0" * 60)


@pytest.fixture
def fake_compile(monkeypatch):
    monkeypatch.setattr("tvmattn.models.compile_module", lambda mod, options: FakeExecutable())


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path, np.random.default_rng(11), tied=False)
    return path


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_compile_removes_partial_files_of_dead_compiles(tmp_path, tiny_gguf, fake_compile):
    dead = dead_pid()
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]) as alive:
        try:
            stale = [tmp_path / f".out.so.{dead}.partial.so", tmp_path / f".out.params.npz.{dead}.partial.npz",
                     tmp_path / f".out.runtime.json.{dead}.partial"]
            kept = [tmp_path / f".out.so.{alive.pid}.partial.so",  # a compile still running
                    tmp_path / f".other.so.{dead}.partial.so",  # another output's
                    tmp_path / ".out.so.notapid.partial.so"]
            for path in stale + kept:
                path.write_bytes(b"half")
            lines: list[str] = []
            compile_model(str(tiny_gguf), tmp_path / "out.so", target="llvm", log=lines.append)
        finally:
            alive.kill()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["out.so", "out.params.npz", "out.runtime.json"] + [p.name for p in kept])
    assert any(f"removed {stale[0]}" in line and f"process {dead}" in line for line in lines), lines


def test_a_compile_interrupted_while_writing_leaves_no_partial_output(tmp_path, tiny_gguf, fake_compile):
    """Ctrl-C after the parameters were written: no new file, no partial file, the earlier build intact."""
    earlier = {name: f"earlier {name}".encode() for name in ("out.so", "out.params.npz", "out.runtime.json")}
    for name, data in earlier.items():
        (tmp_path / name).write_bytes(data)

    def interrupt_after_params(line: str) -> None:
        if line.startswith("[compile] parameters:"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        compile_model(str(tiny_gguf), tmp_path / "out.so", target="llvm", log=interrupt_after_params)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == earlier


def test_ctrl_c_during_the_renames_completes_the_bundle_first(tmp_path, tiny_gguf, fake_compile, monkeypatch):
    """Ctrl-C while the files are renamed into place is held until the last rename: the bundle is
    the new one, whole (its record matches its files), never a new library beside old records."""
    import signal

    for name in ("out.so", "out.params.npz", "out.runtime.json"):
        (tmp_path / name).write_bytes(b"earlier " + name.encode())
    replace = Path.replace

    def interrupted_replace(self, target):
        if Path(target).name == "out.so":
            # Ctrl-C as the library is renamed; raise_signal runs the handler before it returns
            # (os.kill may reach another thread, and the handler then runs a moment later)
            signal.raise_signal(signal.SIGINT)
        return replace(self, target)

    monkeypatch.setattr(Path, "replace", interrupted_replace)
    # Python's own SIGINT handler, as in a user's process (an earlier test in this worker may
    # have left another one); restored afterwards
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            compile_model(str(tiny_gguf), tmp_path / "out.so", target="llvm", log=quiet)
    finally:
        signal.signal(signal.SIGINT, previous)
    library = tmp_path / "out.so"
    assert read_runtime(library)["files"] == {"library": record(library), "params": record(params_of(library))}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.params.npz", "out.runtime.json", "out.so"]


# ---------------------------------------------------------------- 5, 6. the parameters file, the log

def test_parameters_load_with_numpy(built):
    runtime = read_runtime(built)
    with np.load(params_of(built)) as stored:
        assert stored.files == [f"p{i}" for i in range(len(runtime["metadata"]["params"]))]
        for i, param in enumerate(runtime["metadata"]["params"]):
            assert list(stored[f"p{i}"].shape) == param["shape"] and stored[f"p{i}"].dtype == param["dtype"]


def test_compile_log_says_what_each_slow_stage_does_and_writes(tmp_path, tiny_gguf, fake_compile):
    lines: list[str] = []
    compile_model(str(tiny_gguf), tmp_path / "out.so", target="llvm", log=lines.append)
    text = "\n".join(lines)
    assert "Fast mode segfaults" in text and "token ids" in text  # the TVM warning, explained
    size = (tmp_path / "out.params.npz").stat().st_size
    assert f"[compile] library: {(tmp_path / 'out.so').stat().st_size} bytes" in text
    assert f"[compile] parameters: {len(read_runtime(tmp_path / 'out.so')['metadata']['params'])} arrays, " \
           f"{size / 1e6:.1f} MB" in text
    assert "[compile] write: " in text

