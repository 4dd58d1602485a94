import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import has_gpu, kernel_cache  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def kernels():
    """Session-wide cache of compiled kernels: kernels.get(generator, config, *args)."""
    return kernel_cache()


# Every kernel test runs for the CPU and, on the GPU machine, for CUDA.
TARGETS = [pytest.param("llvm", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=TARGETS)
def target(request):
    return request.param
