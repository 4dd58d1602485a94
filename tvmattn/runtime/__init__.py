"""The runtime: the Python paged KV cache and what it is made of.

Layers, bottom up: errors.py (KVCacheError and argument checks), pages.py (page allocator),
sequences.py (sequence table: fork, popn, sliding windows), plan.py (host planning of one
forward into index arrays) and upload.py (their copy to the device), backends.py and
kernels.py (which kernel serves which attention role), forward.py (the per-layer launches),
cache.py (`PagedKVCache`, the public object) and ffi.py (the `tvmattn.*` packed functions in
the argument order of TVM's attention backend, and the Relax VM builtins).
"""

from .cache import CacheOptions as CacheOptions
from .cache import PagedKVCache as PagedKVCache
from .errors import KVCacheError as KVCacheError
from .ffi import install_vm_builtins as install_vm_builtins  # importing this registers tvmattn.*
from .ffi import uninstall_vm_builtins as uninstall_vm_builtins
