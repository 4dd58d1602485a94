"""Compile a generated PrimFunc for its config's target."""

from __future__ import annotations

import tvm

from .config import AttentionConfig


def build(func: tvm.tirx.PrimFunc, config: AttentionConfig):
    """Compile `func` for `config.tvm_target()`; returns the callable packed function.

    Without a GPU driver a CUDA build embeds CUDA source that TVM compiles when loaded.
    """
    name = str(func.attrs["global_symbol"]) if func.attrs and "global_symbol" in func.attrs else "main"
    module = tvm.compile(tvm.IRModule({name: func}), target=config.tvm_target())
    return module[name]
