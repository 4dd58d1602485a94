"""Specification of the main job (`python -m tvmattn smollm2`, tvmattn.quickstart) on every
target: the target is resolved once (the CUDA arch read from the present GPU), a CUDA library
asked for on a machine without a GPU driver is built with cubins in a child process, and on a
GPU machine the same code path compiles a small GGUF written here and answers with it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tir_kernels import support
from tvmattn.build import BuildError, resolve_target
from tvmattn.bundle import bundle_files, sidecar

ROOT = Path(__file__).resolve().parents[1]


def quiet(_message: str) -> None:
    pass


@pytest.mark.parametrize("requested", ["auto", "llvm", "cuda", "cuda:sm_80", "cuda:sm_90a"])
def test_a_resolved_target_resolves_to_itself(requested):
    """The main job resolves its target and hands it to compile_model, which resolves it again."""
    resolved = resolve_target(requested)
    assert resolve_target(resolved) == resolved


def test_the_cuda_arch_comes_from_the_present_gpu(monkeypatch):
    monkeypatch.setattr(support, "present_cuda_arch", lambda: "sm_80")  # an A100
    assert resolve_target("auto") == "cuda:sm_80"
    assert resolve_target("cuda") == "cuda:sm_80"
    assert resolve_target("cuda:sm_89") == "cuda:sm_89"  # a named arch wins
    assert resolve_target("cuda", "sm_86") == "cuda:sm_86"
    monkeypatch.setattr(support, "present_cuda_arch", lambda: None)  # a build machine without a GPU
    assert resolve_target("auto") == "llvm"
    assert resolve_target("cuda") == f"cuda:{support.DEFAULT_CUDA_ARCH}"
    with pytest.raises(BuildError, match="name different archs"):
        resolve_target("cuda:sm_90", "sm_80")
    with pytest.raises(BuildError, match="not supported"):
        resolve_target("cuda:90")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    pytest.importorskip("gguf")
    pytest.importorskip("tokenizers")
    from test_weights import write_tiny_gguf

    path = tmp_path_factory.mktemp("tiny-gguf") / "tiny.gguf"
    write_tiny_gguf(path, np.random.default_rng(7))
    return path


def run_main_job(cache: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tvmattn", "smollm2", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=900, env={**os.environ, "TVMATTN_CACHE": str(cache)})


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to compile CUDA kernels ahead of time")
def test_main_job_builds_a_cuda_library_without_a_gpu(tiny_gguf, tmp_path, monkeypatch):
    """`smollm2 --target cuda` on a CPU machine: one target resolution, cubins for the arch."""
    from tvmattn.offline_cuda import has_cuda_runtime
    from tvmattn.quickstart import cached_library

    if has_cuda_runtime():
        pytest.skip("this process has a CUDA driver: the GPU test covers it")
    monkeypatch.setenv("TVMATTN_CACHE", str(tmp_path))
    library = cached_library("cuda", log=quiet, weights=tiny_gguf)
    runtime = json.loads(sidecar(library, ".runtime.json").read_text())
    assert runtime["metadata"]["build_options"]["target"] == f"cuda:{support.DEFAULT_CUDA_ARCH}"
    assert runtime["settings"]["gpu_code"] == "cubin"
    assert b"__global__" not in library.read_bytes()  # no CUDA source to compile at load
    messages: list[str] = []
    assert cached_library("cuda", log=messages.append, weights=tiny_gguf) == library  # cached
    assert messages == [f"[smollm2] using the compiled library {library}"]
    # the command line says plainly, before looking for a library, that this machine cannot run it
    done = run_main_job(tmp_path, "--gguf", str(tiny_gguf), "--target", "cuda", "--max-new-tokens", "2")
    assert done.returncode == 2 and "this machine has no CUDA GPU" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "[smollm2]" not in done.stderr


def test_main_job_answers_with_a_small_gguf_on_the_cpu(tiny_gguf, tmp_path):
    done = run_main_job(tmp_path, "--gguf", str(tiny_gguf), "--target", "llvm", "--max-new-tokens", "4",
                        "--prompt", "hello", "--prompt", "world")
    assert done.returncode == 0, done.stderr
    assert "[0] hello" in done.stdout and "[1] world" in done.stdout
    assert "compiling tiny.gguf for llvm" in done.stderr and "tokens/s" in done.stderr


@pytest.fixture
def fake_builds(monkeypatch, tmp_path):
    """The main job's cache in tmp_path/cache, compile_model replaced by one that writes a bundle's
    three files at once; returns the list of libraries it was asked for."""
    import tvmattn.quickstart as quickstart

    monkeypatch.setenv("TVMATTN_CACHE", str(tmp_path / "cache"))
    built: list[Path] = []

    def fake_compile(weights, library, **_kwargs):
        built.append(Path(library))
        for path in bundle_files(library):
            path.write_bytes(b"x" * 1000)

    monkeypatch.setattr(quickstart, "compile_model", fake_compile)
    return built


def test_rebuild_compiles_again_and_cache_clear_empties_the_cache(tiny_gguf, fake_builds, capsys, tmp_path):
    from tvmattn.__main__ import main
    from tvmattn.quickstart import cached_libraries, cached_library, models_dir

    library = cached_library("llvm", log=quiet, weights=tiny_gguf)
    assert fake_builds == [library] and cached_libraries() == [library]
    assert cached_library("llvm", log=quiet, weights=tiny_gguf) == library and len(fake_builds) == 1  # cached
    messages: list[str] = []
    assert cached_library("llvm", log=messages.append, weights=tiny_gguf, rebuild=True) == library
    assert len(fake_builds) == 2 and messages[0].startswith("[smollm2] rebuilding tiny.gguf for llvm")
    alive = models_dir() / f".{library.name}.{os.getpid()}.partial.so"  # a build still running keeps its file
    alive.write_bytes(b"half")
    assert main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    assert f"{models_dir()}: 1 cached library" in out and f"{library.name}  0.0 MB" in out
    assert main(["cache", "clear"]) == 0
    assert "freed 0.0 MB" in capsys.readouterr().out
    assert cached_libraries() == [] and [p.name for p in models_dir().iterdir()] == [alive.name]
    cached_library("llvm", log=quiet, weights=tiny_gguf)
    assert len(fake_builds) == 3  # compiled again after the clear


@pytest.mark.gpu
def test_main_job_compiles_and_answers_on_the_gpu(tiny_gguf, tmp_path, monkeypatch):
    """On a GPU machine `--target auto` builds for the present GPU's arch (float16), and the
    logits each greedy token was chosen from match the independent float64 torch model's."""
    from test_model import TorchLlama

    from tvmattn.generate import Generator
    from tvmattn.quickstart import cached_library
    from tvmattn.weights import read_gguf

    arch = support.present_cuda_arch()
    monkeypatch.setenv("TVMATTN_CACHE", str(tmp_path))
    library = cached_library("auto", log=quiet, weights=tiny_gguf)
    runtime = json.loads(sidecar(library, ".runtime.json").read_text())
    assert runtime["metadata"]["build_options"]["target"] == f"cuda:{arch}"
    generator = Generator(library)
    generator.stop_ids = set()  # random weights: generate the full length
    prompt = [40, 77, 120, 9, 33, 260]
    result = generator.generate_tokens([prompt], max_new_tokens=6, keep_logits=True)
    tokens, logits = result.tokens[0], result.logits[0]
    loaded = read_gguf(tiny_gguf)
    expected = TorchLlama(loaded.hf_config, loaded.tensors).logits(prompt + tokens[:-1])[len(prompt) - 1:]
    # float16 activations vs float64: this random model amplifies rounding as it goes (its CPU
    # float16 build drifts the same way, a few percent of the largest logit by the sixth token);
    # a wrong attention read is off by the order of 100%
    error = np.abs(logits - expected).max(axis=-1) / np.abs(expected).max(axis=-1)
    assert error[0] <= 1e-2 and error.max() <= 0.15, error
    done = run_main_job(tmp_path, "--gguf", str(tiny_gguf), "--max-new-tokens", "4", "--prompt", "hello")
    assert done.returncode == 0, done.stderr
    assert f"using the compiled library {library}" in done.stderr and "tokens/s" in done.stderr
