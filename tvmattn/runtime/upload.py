"""Host -> device copies of a step's plan that do not block the host.

`Tensor.copyfrom(numpy)` on a CUDA tensor is a synchronous cudaMemcpy on the legacy default
stream: the host waits until every kernel queued before it has finished, so `begin_forward`
of step N+1 cannot start before the GPU has drained step N (at small batches most of
`begin_forward`'s time is this wait). `AsyncUploader` instead copies from pinned host
memory with cudaMemcpyAsync on the stream TVM launches kernels on (tvm_ffi's current stream for
the device): the copy runs after the kernels of earlier steps (which may still read the device
buffer) and before those of this step, and the host returns at once. Two staging buffers
alternate; an event recorded after each copy guards a buffer's reuse.

The CUDA runtime is reached through ctypes (`libcudart.so.*`, already loaded by TVM's CUDA
runtime). Where it cannot be used, `make_uploader` returns the synchronous `SyncUploader`. On
the CPU, `HostUploader` writes through a numpy alias of the buffer (Tensor.copyfrom's checks
cost more than the rest of a small decode step's planning).
"""

from __future__ import annotations

import ctypes
import glob
import os

import numpy as np
import tvm
import tvm_ffi

_CUDA_MEMCPY_HOST_TO_DEVICE = 1
_CUDA_EVENT_DISABLE_TIMING = 2


class SyncUploader:
    """copy(host int32 array [n], device int32 tensor of n or more elements): a blocking copy
    into the tensor's first n elements (CPU devices, or no CUDA runtime)."""

    def copy(self, host: np.ndarray, device_view) -> None:
        if device_view.shape != host.shape:
            device_view = device_view._create_view(host.shape, "int32", 0)
        device_view.copyfrom(host)


class HostUploader:
    """copy(host int32 array [n], CPU int32 tensor of n or more elements): a numpy assignment
    to its first n elements through a DLPack alias of the tensor, made once per tensor (the
    last one is kept: consecutive steps reuse it)."""

    def __init__(self):
        self._last = (None, None)  # (tensor, its numpy alias, flat)

    def copy(self, host: np.ndarray, device_view) -> None:
        tensor, alias = self._last
        if tensor is not device_view:
            alias = np.from_dlpack(device_view).reshape(-1)
            self._last = (device_view, alias)
        alias[: host.size] = host.reshape(-1)


def _load_cudart() -> ctypes.CDLL | None:
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    # TVM's wheel may carry its own copy next to libtvm_runtime_cuda.so
    for path in glob.glob(os.path.join(os.path.dirname(tvm.__file__), "**", "libcudart.so*"), recursive=True):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


class AsyncUploader:
    """Stream-ordered, non-blocking copies from two alternating pinned staging buffers:
    copy(host int32 array [n], device tensor) writes the tensor's first n elements."""

    def __init__(self, cudart: ctypes.CDLL, device):
        self._rt = cudart
        self._device = device
        self._staging: list[np.ndarray] = []
        self._events = [ctypes.c_void_p(), ctypes.c_void_p()]
        self._recorded = [False, False]
        self._next = 0
        for event in self._events:
            self._call("cudaEventCreateWithFlags", ctypes.byref(event), _CUDA_EVENT_DISABLE_TIMING)

    def _call(self, name: str, *args) -> None:
        status = getattr(self._rt, name)(*args)
        if status != 0:
            raise RuntimeError(f"{name} failed with CUDA error {status}")

    def _grow(self, size: int) -> None:
        """Two pinned staging buffers of at least `size` int32 elements."""
        for index in range(len(self._staging)):
            self._wait(index)
            self._call("cudaHostUnregister", ctypes.c_void_p(self._staging[index].ctypes.data))
        capacity = max(size, 1 << 14)
        self._staging = [np.empty(capacity, np.int32) for _ in range(2)]
        self._pointers = [ctypes.c_void_p(buffer.ctypes.data) for buffer in self._staging]  # (.ctypes is slow)
        for buffer in self._staging:
            self._call("cudaHostRegister", ctypes.c_void_p(buffer.ctypes.data), ctypes.c_size_t(buffer.nbytes), 0)

    def _wait(self, index: int) -> None:
        if self._recorded[index]:
            self._call("cudaEventSynchronize", self._events[index])
            self._recorded[index] = False

    def copy(self, host: np.ndarray, device_view) -> None:
        if not self._staging or host.size > self._staging[0].size:
            self._grow(2 * host.size)
        index, self._next = self._next, 1 - self._next
        self._wait(index)  # the copy that last read this staging buffer has run
        staging = self._staging[index]
        staging[: host.size] = host.ravel()
        stream = ctypes.c_void_p(tvm_ffi.get_raw_stream(self._device) or None)
        self._call("cudaSetDevice", self._device.index)
        self._call("cudaMemcpyAsync", ctypes.c_void_p(device_view.data_ptr()), self._pointers[index],
                   ctypes.c_size_t(host.nbytes), _CUDA_MEMCPY_HOST_TO_DEVICE, stream)
        self._call("cudaEventRecord", self._events[index], stream)
        self._recorded[index] = True

    def __del__(self):
        try:
            for index in range(len(self._staging)):
                self._wait(index)
                self._rt.cudaHostUnregister(ctypes.c_void_p(self._staging[index].ctypes.data))
            for event in self._events:
                self._rt.cudaEventDestroy(event)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def make_uploader(device):
    """HostUploader for the CPU; for a CUDA device AsyncUploader where the CUDA runtime is
    reachable; else SyncUploader."""
    if device.dlpack_device_type() == tvm.cpu(0).dlpack_device_type():
        return HostUploader()
    if device.dlpack_device_type() != tvm.cuda(0).dlpack_device_type():
        return SyncUploader()
    cudart = _load_cudart()
    if cudart is None:
        return SyncUploader()
    try:
        return AsyncUploader(cudart, device)
    except (RuntimeError, AttributeError):
        return SyncUploader()
