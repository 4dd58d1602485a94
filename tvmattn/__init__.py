"""tvmattn: TVM-native paged attention for LLM inference.

The kernels live in the sibling package `tir_kernels` (generators from a validated
`AttentionConfig` to TIR PrimFuncs, for CUDA and the CPU). This package holds what is
built on top of them: the Python paged KV cache `PagedKVCache` (tvmattn.cache, with its page
allocator, sequence table, host planning and attention backends) and the
`python -m tvmattn demo` smoke run (`tvmattn.demo`).
"""

__version__ = "0.1.0"

from .cache import CacheOptions as CacheOptions
from .cache import PagedKVCache as PagedKVCache
from .errors import KVCacheError as KVCacheError
from .ffi import install_vm_builtins as install_vm_builtins  # importing tvmattn registers tvmattn.*
from .ffi import uninstall_vm_builtins as uninstall_vm_builtins
