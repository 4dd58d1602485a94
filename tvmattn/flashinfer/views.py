"""Zero-copy tensor views in the form FlashInfer's run functions need.

FlashInfer reads a tensor's data pointer and strides but ignores DLPack's `byte_offset`, so
the cache's index arrays (views into one uploaded buffer) are re-based: a view whose data
pointer already includes the offset and whose byte_offset is 0. The K and V of a page pool
`[num_pages, 2, H, page_size, D]` are strided views `[num_pages, H, page_size, D]` with strides
`(2*H*page_size*D, page_size*D, D, 1)`, V starting H*page_size*D elements after K.

The views are made through DLPack (a DLManagedTensor built with ctypes and imported with
`tvm_ffi.from_dlpack`); each holds a reference to its source tensor until TVM frees it.
"""

from __future__ import annotations

import ctypes
import itertools

import tvm_ffi


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32), ("dtype", _DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

_alive: dict[int, tuple] = {}  # manager_ctx -> (source tensor, managed struct, shape, strides)
_ids = itertools.count(1)


@_DELETER
def _free(managed_ptr):
    managed = ctypes.cast(managed_ptr, ctypes.POINTER(_DLManagedTensor)).contents
    _alive.pop(managed.manager_ctx, None)


_DTYPE_CODES = {"int": 0, "uint": 1, "float": 2, "bfloat": 4}


def _dtype(dtype) -> _DLDataType:
    text = str(dtype)
    for prefix in ("bfloat", "float", "uint", "int"):
        if text.startswith(prefix) and text[len(prefix):].isdigit():
            return _DLDataType(_DTYPE_CODES[prefix], int(text[len(prefix):]), 1)
    raise ValueError(f"unsupported dtype {dtype!r} for a FlashInfer view")


class _Producer:
    """A one-shot DLPack producer of a view (data pointer, shape, strides) of `source`."""

    def __init__(self, source, address: int, shape, strides):
        self.source, self.address, self.shape, self.strides = source, address, tuple(shape), tuple(strides)

    def __dlpack_device__(self):
        device = self.source.device
        return int(device.dlpack_device_type()), int(device.index)

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        ndim = len(self.shape)
        shape = (ctypes.c_int64 * ndim)(*self.shape)
        strides = (ctypes.c_int64 * ndim)(*self.strides)
        kind, index = self.__dlpack_device__()
        managed = _DLManagedTensor()
        managed.dl_tensor = _DLTensor(self.address, _DLDevice(kind, index), ndim, _dtype(self.source.dtype),
                                      ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64)),
                                      ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64)), 0)
        ctx = next(_ids)
        managed.manager_ctx = ctx
        managed.deleter = _free
        _alive[ctx] = (self.source, managed, shape, strides)
        return _capsule_new(ctypes.addressof(managed), b"dltensor", None)


def _contiguous_strides(shape) -> tuple:
    strides, step = [], 1
    for extent in reversed(shape):
        strides.append(step)
        step *= int(extent)
    return tuple(reversed(strides))


def _view(source, address: int, shape, strides):
    return tvm_ffi.from_dlpack(_Producer(source, address, shape, strides), require_alignment=0,
                               require_contiguous=False)


def rebased(tensor):
    """A view of `tensor` whose byte_offset is 0 (its data pointer holds the offset): same
    memory, shape and strides."""
    shape = tuple(int(x) for x in tensor.shape)
    strides = tensor.strides
    strides = tuple(int(x) for x in strides) if strides else _contiguous_strides(shape)
    return _view(tensor, int(tensor.data_ptr()), shape, strides)


def paged_kv_views(pages) -> tuple:
    """(K, V): strided views `[num_pages, H, page_size, D]` of a pool `[num_pages, 2, H, page_size, D]`."""
    shape = tuple(int(x) for x in pages.shape)
    if len(shape) != 5 or shape[1] != 2:
        raise ValueError(f"pages must be [num_pages, 2, H, page_size, D], got {list(shape)}")
    num_pages, _, heads, page_size, dim = shape
    inner = heads * page_size * dim
    element = _dtype(pages.dtype).bits // 8
    address = int(pages.data_ptr())
    view_shape, strides = (num_pages, heads, page_size, dim), (2 * inner, page_size * dim, dim, 1)
    return (_view(pages, address, view_shape, strides), _view(pages, address + inner * element, view_shape, strides))
