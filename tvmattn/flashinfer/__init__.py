"""Optional FlashInfer backend: modules built ahead of time (build.py) and loaded without the
flashinfer package (modules.py); the backend classes are in tvmattn/runtime/backends.py."""

from .modules import FlashInferConfig, FlashInferModulesMissing, available, load, module_path

__all__ = ["FlashInferConfig", "FlashInferModulesMissing", "available", "load", "module_path"]
