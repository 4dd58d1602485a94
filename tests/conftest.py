"""Test tiers and shared builds.

Tiers: a plain `pytest` runs the default tier, a representative sample that CI runs; tests
marked `slow` (the exhaustive matrix) are deselected unless a `-m` expression is given
(`-m slow`, `-m "slow or not slow"` for everything) or the test is named by its node id. Tests
marked `gpu` skip where no CUDA GPU is present (`-m gpu` selects them all, slow ones included).

Builds: kernels compile once per session (the `kernels` fixture, the runtime's own caches) and
CPU kernels go through an on-disk cache shared by pytest-xdist's workers and later sessions
(harness.build_cached; $TVMATTN_CACHE/kernels, TVMATTN_TEST_KERNEL_CACHE=0 turns it off).
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import has_gpu, install_build_cache, kernel_cache, shared_folder  # noqa: E402

install_build_cache()


def _names_tests(config) -> bool:
    """Whether the command line names single tests (node ids), which then run whatever their marks."""
    return any("::" in str(arg) for arg in config.args)


def pytest_collection_modifyitems(config, items):
    if not config.option.markexpr and not _names_tests(config):
        slow = [item for item in items if item.get_closest_marker("slow")]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if not item.get_closest_marker("slow")]
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def kernels():
    """Session-wide cache of compiled kernels: kernels.get(generator, config, *args)."""
    return kernel_cache()


@pytest.fixture(scope="session")
def tiny_library(tmp_path_factory):
    """(GGUF path, library path) of the tiny random-weight Llama (test_weights.write_tiny_gguf,
    seed 11, a separate LM head) compiled for llvm with max batch size 4 and prefill chunk 64, its
    folder holding the GGUF and the bundle only: compiled once for every module (and xdist
    worker) that uses it (test_generate, test_speculative, test_bundle)."""

    def fill(folder):
        import numpy as np
        from test_weights import write_tiny_gguf

        from tvmattn.build import compile_model

        write_tiny_gguf(folder / "tiny.gguf", np.random.default_rng(11), tied=False)
        result = compile_model(str(folder / "tiny.gguf"), folder / "tiny.so", target="llvm", max_batch_size=4,
                               prefill_chunk=64, log=lambda _message: None)
        assert result.dtype == "float32" and result.target == "llvm" and result.library == folder / "tiny.so"

    folder = shared_folder(tmp_path_factory, "tiny-llama", fill)
    return folder / "tiny.gguf", folder / "tiny.so"


# Every kernel test runs for the CPU and, on the GPU machine, for CUDA.
TARGETS = [pytest.param("llvm", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=TARGETS)
def target(request):
    return request.param
