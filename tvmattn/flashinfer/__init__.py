"""Optional FlashInfer backend: modules built ahead of time (build.py) and loaded without the
flashinfer package (modules.py), and views of the cache's pages as FlashInfer reads them
(views.py). The runtime above uses them: its backend classes are in tvmattn/runtime/backends.py,
the choice of backend in tvmattn/runtime/backend_choice.py; nothing here imports the runtime."""

from .modules import FlashInferConfig, FlashInferModulesMissing, available, load, module_path

__all__ = ["FlashInferConfig", "FlashInferModulesMissing", "available", "load", "module_path"]
