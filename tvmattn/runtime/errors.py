"""The error the cache raises for bad input, and the shared checks that raise it.

Every public method of the cache validates its arguments before it changes anything; a
failed check raises `KVCacheError` (a `ValueError`) whose message names the argument, what
was expected and what came, and leaves the cache exactly as it was (a call that abandons a
forward step in progress rolls the step back first; see PagedKVCache).
"""

from __future__ import annotations

import math

import numpy as np
import tvm
import tvm_ffi


class KVCacheError(ValueError):
    """Bad input to the paged KV cache (the cache is left unchanged)."""


def check(condition: bool, message: str) -> None:
    """Raise KVCacheError(message) unless `condition`."""
    if not condition:
        raise KVCacheError(message)


def check_int(name: str, value, low: int | None = None, high: int | None = None) -> int:
    """`value` as an int, checked to lie in [low, high] (either bound optional)."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise KVCacheError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if low is not None and value < low:
        raise KVCacheError(f"{name} must be at least {low}, got {value}")
    if high is not None and value > high:
        raise KVCacheError(f"{name} must be at most {high}, got {value}")
    return value


def check_finite(name: str, value) -> float:
    """`value` as a finite float (an int or float, not a bool), else KVCacheError."""
    if type(value) is float and math.isfinite(value):  # the per-layer fast path
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise KVCacheError(f"{name} must be a finite number, got {value!r}")
    if not math.isfinite(value):
        raise KVCacheError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def as_tensor(name: str, value) -> tvm_ffi.Tensor:
    """A TVM tensor for `value` (a tvm.runtime.Tensor, or a contiguous DLPack tensor)."""
    if isinstance(value, tvm_ffi.Tensor):
        return value
    if not hasattr(value, "__dlpack__"):
        raise KVCacheError(f"{name} must be a tvm.runtime.Tensor or a DLPack tensor, got {type(value).__name__}")
    is_contiguous = getattr(value, "is_contiguous", None)  # torch; numpy has flags instead
    flags = getattr(value, "flags", None)
    if (callable(is_contiguous) and not is_contiguous()) or (flags is not None and not flags["C_CONTIGUOUS"]):
        raise KVCacheError(f"{name} must be a contiguous (row-major, compact) tensor, got a strided view")
    try:
        return tvm.runtime.from_dlpack(value)
    except Exception as error:  # noqa: BLE001 - any DLPack refusal becomes the cache's error
        raise KVCacheError(f"{name}: this DLPack tensor cannot be used (it must be contiguous, on a CPU or CUDA "
                           f"device): {error}") from None


def check_tensor(name: str, tensor, shape: tuple, dtype: str, device) -> tvm_ffi.Tensor:
    """`tensor` as a Tensor of exactly `shape`, `dtype` and `device`, else KVCacheError.

    Cheap enough for the per-layer calls (a tuple compare, a dtype and a device compare).
    """
    tensor = as_tensor(name, tensor)
    if tensor.shape != shape:
        raise KVCacheError(f"{name} must have shape {shape}, got {tensor.shape}")
    if tensor.dtype != dtype:
        raise KVCacheError(f"{name} must have dtype {dtype}, got {tensor.dtype}")
    if tensor.device != device:
        raise KVCacheError(f"{name} must be on {device}, got {tensor.device}")
    return tensor
