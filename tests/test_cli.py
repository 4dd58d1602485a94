"""Specification of the command line's argument checks (`python -m tvmattn ...`,
scripts/compile.py): every argument is checked while parsing, before TVM is imported or a
library is loaded, and a bad one ends as `error: ...` naming it, with exit status 2.

What a new user runs into in the first hour ends the same way, or works: output paths, CUDA
archs and the target's device checked before compiling (never after a minute of it), an
unwritable cache or --dump-ir folder, a GGUF with impossible sizes, prompt bytes that are no
UTF-8, and Ctrl-C at any stage (one line `error: interrupted (Ctrl-C)`, exit status 130, no
partial bundle left behind).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import ctrl_c
import numpy as np
import pytest

from tir_kernels import support
from tvmattn.__main__ import INTERRUPTED, INTERRUPTED_MESSAGE, main
from tvmattn.offline_cuda import nvcc_archs

ROOT = Path(__file__).resolve().parents[1]
GENERATE = ["generate", "--lib", "missing.so", "--prompt", "hi"]
COMPILE = ["compile", "--model", "smollm2-135m", "-o", "x.so"]


@pytest.mark.parametrize("args, message", [
    (GENERATE + ["--temperature", "nan"], "argument --temperature: expected a number in [0, 100], got 'nan'"),
    (GENERATE + ["--temperature", "inf"], "argument --temperature"),
    (GENERATE + ["--temperature", "-0.5"], "argument --temperature"),
    (GENERATE + ["--seed", "-1"], "argument --seed: expected an integer >= 0, got -1"),
    (GENERATE + ["--seed", "1.5"], "argument --seed: expected an integer, got '1.5'"),
    (GENERATE + ["--max-new-tokens", "0"], "argument --max-new-tokens: expected an integer >= 1, got 0"),
    (GENERATE + ["--top-p", "0"], "argument --top-p: expected a number in (0, 1]"),
    (GENERATE + ["--top-p", "1.5"], "argument --top-p"),
    (["generate", "--lib", "model.bin", "--prompt", "hi"], "argument --lib: 'model.bin': expected a library file"),
    (["smollm2", "--max-new-tokens", "0"], "argument --max-new-tokens"),
    (["smollm2", "--target", "rocm"], "argument --target: target='rocm' is not supported"),
    (["smollm2", "--gguf", "/no/such.gguf"], "argument --gguf: '/no/such.gguf': expected an existing .gguf file"),
    (COMPILE + ["--page-size", "0"], "argument --page-size: page_size=0 is not supported"),
    (COMPILE + ["--page-size", "256"], "a power of two from 1 to 128"),
    (COMPILE + ["--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
    (COMPILE + ["--cuda-arch", "hopper"], "argument --cuda-arch: 'hopper' is not a CUDA arch"),
    (COMPILE + ["--context-window", "-4"], "argument --context-window: expected an integer >= 1, got -4"),
    (["compile", "--model", "/no/such/model", "-o", "x.so"], "argument --model: '/no/such/model': no such file"),
    (["demo", "--target", "cuda:90"], "argument --target: target='cuda:90' is not supported"),
    (["demo", "--seed", "x"], "argument --seed: expected an integer, got 'x'"),
])
def test_bad_arguments_are_refused_while_parsing(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_every_option_has_a_help_line_with_its_default():
    from tvmattn.__main__ import parser

    commands = parser()._subparsers._group_actions[0].choices
    for name, command in commands.items():
        for action in command._actions:
            assert action.help, f"{name} {action.option_strings} has no help line"
    text = commands["compile"].format_help()
    assert "(default: 16)" in text and "(default: auto)" in text and "(default: tvmattn)" in text
    assert "(default: 1.0)" in commands["generate"].format_help()  # --top-p


def test_help_does_not_import_tvm():
    """`python -m tvmattn --help` answers without importing TVM (which takes seconds)."""
    for args in (["--help"], ["compile", "--help"], ["generate", "--help"]):
        done = subprocess.run([sys.executable, "-X", "importtime", "-m", "tvmattn", *args], capture_output=True,
                              text=True, cwd=ROOT, timeout=60)
        assert done.returncode == 0 and "usage:" in done.stdout
        imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines() if "|" in line}
        assert "tvm" not in imported and "tvm_ffi" not in imported


def test_scripts_compile_is_the_compile_command():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "compile.py"), "--help"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and "--prefill-chunk" in done.stdout and "(default: 4)" in done.stdout


def test_compile_quantization_defaults_to_auto_and_says_so():
    from tvmattn.__main__ import parser

    text = " ".join(parser()._subparsers._group_actions[0].choices["compile"].format_help().split())
    help_line = text.split("--quantization {auto,keep,f16,f32}", 2)[2].split("--page-size", 1)[0]
    assert "(default: auto)" in help_line and "auto: keep for a GGUF" in help_line


@pytest.mark.parametrize("flag,argument,default,value", [("--unfused-layers", "fused_layers", True, False),
                                                          ("--dependent-launch", "dependent_launch", None, True),
                                                          ("--no-dependent-launch", "dependent_launch", None, False),
                                                          ("--tensor-core-matmul", "tensor_core_matmul", None, True),
                                                          ("--no-tensor-core-matmul", "tensor_core_matmul", None, False),
                                                          ("--float32-cpu-products", "cpu_bf16", True, False),
                                                          ("--no-decode-append", "decode_append", True, False),
                                                          ("--fused-batch-layers", "fused_batch_layers", False, True)])
def test_compile_passes_its_build_flags_on(tmp_path, monkeypatch, flag, argument, default, value):
    """Each build flag reaches compile_model as its argument: the default without it (None: the
    target's own), the flag's value with it."""
    import tvmattn.build

    seen = {}
    monkeypatch.setattr(tvmattn.build, "compile_model", lambda *a, **kw: seen.update(kw))
    for flags, expected in (([], default), ([flag], value)):
        assert main(["compile", "--model", str(tmp_path), "--output", str(tmp_path / "m.so"), *flags]) == 0
        assert seen[argument] is expected


def test_compile_refuses_dependent_launch_off_hopper(config_json, tmp_path, capsys):
    """--dependent-launch needs CUDA sm_90+: the CPU (command line) and sm_80 (compile_model) are
    refused by name, before the model is loaded."""
    from tvmattn.build import BuildError, compile_model

    assert main(["compile", "--model", str(config_json), "-o", str(tmp_path / "m.so"), "--dependent-launch",
                 "--target", "llvm"]) == 2
    out, err = capsys.readouterr()
    one_error(err, "--dependent-launch: programmatic dependent launch needs a CUDA target of sm_90 or newer, "
                   "got 'llvm'")
    assert "loading model" not in out + err
    lines: list[str] = []
    with pytest.raises(BuildError, match="--dependent-launch: .* got 'cuda:sm_80'"):
        compile_model(str(config_json), tmp_path / "m.so", target="cuda:sm_80", dependent_launch=True,
                      log=lines.append)
    with pytest.raises(BuildError, match="--dependent-launch must be a bool or None, got 'yes'"):
        compile_model(str(config_json), tmp_path / "m.so", target="cuda:sm_90", dependent_launch="yes",
                      log=lines.append)
    assert not any("loading model" in line for line in lines), lines


def test_compile_refuses_tensor_core_matmul_where_it_cannot_run(config_json, tmp_path, capsys):
    """--tensor-core-matmul needs CUDA sm_80+ and the small-batch rules: the CPU (command line),
    sm_75 and --no-small-batch-matmul (compile_model) are refused by name before the model loads."""
    from tvmattn.build import BuildError, compile_model
    from tvmattn.models import BuildOptions

    assert main(["compile", "--model", str(config_json), "-o", str(tmp_path / "m.so"), "--tensor-core-matmul",
                 "--target", "llvm"]) == 2
    out, err = capsys.readouterr()
    one_error(err, "--tensor-core-matmul: target 'llvm': the tensor-core matmul is a CUDA kernel")
    assert "loading model" not in out + err
    lines: list[str] = []
    with pytest.raises(BuildError, match="--tensor-core-matmul: target 'cuda:sm_75': .* needs sm_80 or newer"):
        compile_model(str(config_json), tmp_path / "m.so", target="cuda:sm_75", tensor_core_matmul=True,
                      log=lines.append)
    with pytest.raises(BuildError, match="--tensor-core-matmul: it replaces small_batch_matmul's CUDA-core rule"):
        compile_model(str(config_json), tmp_path / "m.so", target="cuda:sm_90", tensor_core_matmul=True,
                      small_batch_matmul=False, log=lines.append)
    with pytest.raises(BuildError, match="--tensor-core-matmul must be a bool or None, got 'yes'"):
        compile_model(str(config_json), tmp_path / "m.so", target="cuda:sm_90", tensor_core_matmul="yes",
                      log=lines.append)
    assert not any("loading model" in line for line in lines), lines
    with pytest.raises(ValueError, match="tensor_core_matmul='yes' is not supported: expected a bool or None"):
        BuildOptions(target="cuda:sm_90", dtype="float16", tensor_core_matmul="yes")
    with pytest.raises(ValueError, match="tensor_core_matmul=True is not supported: target 'cuda:sm_75'"):
        BuildOptions(target="cuda:sm_75", dtype="float16", tensor_core_matmul=True)


@pytest.mark.parametrize("target,small_batch_matmul,default", [("cuda:sm_90", True, True), ("cuda:sm_80", True, True),
                                                               ("cuda:sm_75", True, False), ("llvm", True, False),
                                                               ("cuda:sm_90", False, False)])
def test_tensor_core_matmul_is_on_wherever_the_target_takes_it(target, small_batch_matmul, default):
    """BuildOptions' default (None) becomes True where the kernel can run, False elsewhere; an
    explicit False stays off."""
    from tvmattn.models import BuildOptions

    dtype = "float32" if target == "llvm" else "float16"
    assert BuildOptions(target=target, dtype=dtype, small_batch_matmul=small_batch_matmul).tensor_core_matmul is default
    assert BuildOptions(target=target, dtype=dtype, tensor_core_matmul=False).tensor_core_matmul is False


# ---------------------------------------------------------------- the first hour: errors before compiling

def one_error(err: str, *fragments: str) -> None:
    """stderr holds exactly one `error: ...` line (argparse's start with the program's name),
    with every fragment, and no traceback."""
    errors = [line for line in err.splitlines() if line.startswith("error: ") or ": error: " in line]
    assert len(errors) == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in errors[0], err


def run_cli(*args, env=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tvmattn", *args], capture_output=True, cwd=ROOT, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.fixture
def config_json(tmp_path) -> Path:
    """A tiny Llama config.json (no weights): compile's model when the model does not matter."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
                                "num_key_value_heads": 2, "num_hidden_layers": 1, "intermediate_size": 96,
                                "vocab_size": 64, "max_position_embeddings": 256, "rms_norm_eps": 1e-6}))
    return path


def test_compile_output_checked_while_parsing(tmp_path, capsys):
    (tmp_path / "taken.so").mkdir()
    (tmp_path / "clash.runtime.json").mkdir()
    for output, message in ((tmp_path / "taken.so", "that is a folder"),
                            (tmp_path / "clash.so", "clash.runtime.json', which the bundle writes beside it, is a folder"),
                            (Path("/proc/tvmattn-test.so"), "folder '/proc' is not writable")):
        with pytest.raises(SystemExit) as exit_:
            main(["compile", "--model", "smollm2-135m", "-o", str(output)])
        assert exit_.value.code == 2
        err = " ".join(capsys.readouterr().err.split())
        assert f"argument -o/--output: '{output}': " in err and message in err, err


def test_compile_model_checks_output_and_dump_folder_before_loading(config_json, tmp_path):
    """The Python API checks what the command line checks, before the model is loaded."""
    from tvmattn.build import BuildError, compile_model

    for kwargs, message in (({"out_path": "/proc/x.so"}, "not writable"),
                            ({"out_path": tmp_path, "dump_ir": None}, "must end in .so"),
                            ({"out_path": tmp_path / "x.so", "dump_ir": "/proc/ir"}, "--dump-ir '/proc/ir'"),
                            ({"out_path": tmp_path / "x.so", "dump_ir": config_json}, "--dump-ir")):
        lines: list[str] = []
        with pytest.raises(BuildError, match=message):
            compile_model(str(config_json), target="llvm", log=lines.append, **kwargs)
        assert not any("loading model" in line for line in lines), lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


@pytest.mark.parametrize("args, message", [
    (["--cuda-arch", "sm_12"], "argument --cuda-arch: sm_12 is older than any CUDA toolkit in use builds for"),
    (["--target", "cuda:sm_12"], "argument --target: sm_12 is older"),
    (["--target", "cuda:sm_35a"], "argument --target: sm_35a is older"),
])
def test_cuda_archs_no_toolkit_builds_are_refused_while_parsing(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["compile", "--model", "smollm2-135m", "-o", "x.so", *args])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_a_cuda_arch_this_nvcc_cannot_build_is_refused_before_compiling(config_json, tmp_path):
    from tvmattn.build import BuildError, compile_model

    known = nvcc_archs(shutil.which("nvcc"))
    unknown = next(f"sm_{n}" for n in range(99, 50, -1) if f"sm_{n}" not in known)
    done = run_cli("compile", "--model", str(config_json), "-o", str(tmp_path / "x.so"), "--cuda-arch", unknown)
    assert done.returncode == 2
    one_error(done.stderr.decode(), f"argument --cuda-arch: the nvcc on PATH", f"cannot build for {unknown}")
    lines: list[str] = []
    with pytest.raises(BuildError, match=f"--target cuda:{unknown}: the nvcc on PATH"):
        compile_model(str(config_json), tmp_path / "x.so", target=f"cuda:{unknown}", log=lines.append)
    assert lines == []


@pytest.mark.skipif(support.present_cuda_arch() is not None, reason="this machine has a GPU")
def test_main_job_on_cuda_without_a_gpu_fails_before_compiling(tmp_path):
    start = time.perf_counter()
    done = run_cli("smollm2", "--target", "cuda", env={"TVMATTN_CACHE": str(tmp_path)})
    assert done.returncode == 2
    one_error(done.stderr.decode(), "--target cuda: this machine has no CUDA GPU", "python -m tvmattn compile")
    assert b"compiling" not in done.stderr and not list(tmp_path.iterdir())
    assert time.perf_counter() - start < 60


@pytest.mark.parametrize("cache", ["/proc/tvmattn-cache", "a-file"])
def test_an_unwritable_cache_folder_is_an_error(tmp_path, cache):
    weights = tmp_path / "w.gguf"
    weights.write_bytes(b"GGUF")  # checked only when it is compiled
    if cache == "a-file":
        cache = tmp_path / "a-file"
        cache.write_text("not a folder")
    done = run_cli("smollm2", "--gguf", str(weights), "--target", "llvm", env={"TVMATTN_CACHE": str(cache)})
    assert done.returncode == 2
    one_error(done.stderr.decode(), "the library cache:", "set TVMATTN_CACHE to a writable folder")


def test_prompt_bytes_that_are_not_utf8_are_refused_while_parsing(capsys):
    done = subprocess.run([sys.executable, "-m", "tvmattn", "generate", "--lib", "x.so", "--prompt", b"caf\xe9"],
                          capture_output=True, cwd=ROOT, timeout=120)
    assert done.returncode == 2
    one_error(done.stderr.decode(), "argument --prompt: not valid text: byte 0xe9 at character 3 is not UTF-8")
    with pytest.raises(SystemExit) as exit_:
        main(["smollm2", "--prompt", "\udcff"])  # what Python makes of the byte 0xff in argv
    assert exit_.value.code == 2 and "byte 0xff" in capsys.readouterr().err


def test_a_gguf_with_zero_heads_is_an_error(tmp_path, monkeypatch, capsys):
    gguf = pytest.importorskip("gguf")
    from test_weights import write_tiny_gguf

    add_head_count = gguf.GGUFWriter.add_head_count
    monkeypatch.setattr(gguf.GGUFWriter, "add_head_count", lambda self, count: add_head_count(self, 0))
    path = tmp_path / "zero-heads.gguf"
    write_tiny_gguf(path, np.random.default_rng(0))
    assert main(["compile", "--model", str(path), "-o", str(tmp_path / "x.so"), "--target", "llvm"]) == 2
    one_error(capsys.readouterr().err, str(path), "'llama.attention.head_count' must be positive, got 0")


# ---------------------------------------------------------------- the first hour: Ctrl-C
# Each test interrupts the command at a named stage, deterministically (tests/ctrl_c.py: the
# child sends itself SIGINT when it reaches the stage), and checks that nothing was lost.

@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    pytest.importorskip("gguf")
    from test_weights import write_tiny_gguf

    path = tmp_path_factory.mktemp("cli-gguf") / "tiny.gguf"
    write_tiny_gguf(path, np.random.default_rng(3))
    return path


def expect_interrupted(done: subprocess.CompletedProcess, stage: str) -> None:
    """The child reached `stage`, was interrupted there and ended as one line, exit status 130."""
    assert f"{ctrl_c.MARKER} {stage}" in done.stderr, done.stderr  # the stage was reached
    assert done.returncode == INTERRUPTED, done.stderr
    one_error(done.stderr, "interrupted (Ctrl-C)")
    assert done.stderr.rstrip().endswith(INTERRUPTED_MESSAGE), done.stderr


def files_under(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("stage", [
    "importing",
    "loading the weights",
    pytest.param("exporting the Relax module", marks=pytest.mark.slow),
    "scheduling inside tvm.compile",  # a KeyboardInterrupt inside Python that TVM's C++ called
])
def test_ctrl_c_while_the_main_job_compiles_is_one_line_and_leaves_the_cache_empty(tiny_gguf, tmp_path, stage):
    done = ctrl_c.run(stage, ["smollm2", "--target", "llvm", "--gguf", str(tiny_gguf)],
                      env={"TVMATTN_CACHE": str(tmp_path)})
    expect_interrupted(done, stage)
    assert files_under(tmp_path) == {}  # no library, no partial file: a later run compiles afresh


@pytest.mark.parametrize("stage", [
    "writing the library",
    pytest.param("writing the parameters", marks=pytest.mark.slow),
])
def test_ctrl_c_while_compile_writes_leaves_the_earlier_bundle_as_it_was(tiny_gguf, tmp_path, stage):
    """An interrupted write leaves no partial file and the earlier bundle untouched (the compiler
    itself is replaced by a stand-in here: only the writing stages run)."""
    for name in ("out.so", "out.params.npz", "out.runtime.json"):
        (tmp_path / name).write_bytes(f"earlier {name}".encode())
    earlier = files_under(tmp_path)
    done = ctrl_c.run(stage, ["compile", "--model", str(tiny_gguf), "-o", str(tmp_path / "out.so"),
                              "--target", "llvm"], fake_compile=True)
    expect_interrupted(done, stage)
    assert files_under(tmp_path) == earlier


@pytest.fixture
def main_job_cache(tiny_library, tmp_path, monkeypatch) -> tuple[Path, Path, list[str]]:
    """(TVMATTN_CACHE folder, cached library, the main job's command) for conftest's tiny_library:
    the cache holds that bundle where `smollm2 --gguf GGUF --quantization f32` looks for it
    (tiny_library's weights are dequantized to float32, as f32 asks), so the job answers at once."""
    from tvmattn.bundle import bundle_files
    from tvmattn.quickstart import library_path

    gguf, built = tiny_library
    monkeypatch.setenv("TVMATTN_CACHE", str(tmp_path))
    library = library_path("llvm", gguf, gguf.stem, "f32")
    library.parent.mkdir(parents=True)
    for source, copy in zip(bundle_files(built), bundle_files(library)):
        shutil.copy(source, copy)
    command = ["smollm2", "--target", "llvm", "--gguf", str(gguf), "--quantization", "f32", "--prompt", "hello",
               "--max-new-tokens", "8"]
    return tmp_path, library, command


def test_ctrl_c_while_the_main_job_answers_keeps_its_cached_library(main_job_cache):
    """Ctrl-C in the prefill and in a decode step (inside the VM, mid-step): one line, 130; the
    cache is as it was, and the next run answers from the same library."""
    folder, library, command = main_job_cache
    before = files_under(folder)
    for stage in ("prefill", "decode"):
        done = ctrl_c.run(stage, command, env={"TVMATTN_CACHE": str(folder)})
        expect_interrupted(done, stage)
        assert files_under(folder) == before, stage
    done = run_cli(*command, env={"TVMATTN_CACHE": str(folder)})
    assert done.returncode == 0, done.stderr
    assert f"using the compiled library {library}" in done.stderr.decode() and done.stdout.strip()
