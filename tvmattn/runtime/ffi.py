"""TVM's KV-cache API over tvm_ffi: the `tvmattn.<name>` global functions and the opt-in
`vm.builtin.<name>` overrides.

This module owns the registration of every function of the KV-cache API table of
docs/interface.md as `tvmattn.<name>`, with the arguments of TVM's `vm.builtin.<name>` in the
same order, the cache first, plus `kv_state_cancel_forward(cache)` (tvmattn's own: abandon the
forward step in progress, see PagedKVCache's "Forward steps are transactions"). Two creation
functions exist:

- `tvmattn.paged_attention_kv_cache_create(*args)`: TVM's positional create call, 28 arguments
  (a 29th is accepted; TVM reserves it and ignores it, and so do we unless it is tvmattn's
  extension list, see `extension_slots`); see `CreateArgs` for every position. The
  attention kernels in positions 15..22 are backend specs (`[]`, `["tirx"|"tir", f]`,
  `["flashinfer", run, plan(, qk_dim, v_dim)]`) and the auxiliary functions plain packed
  functions; the cache is built to run exactly those (e.g. the kernels compiled into a model
  library). The dtype and device of the `init` tensor (position 12) are the cache's.
- `tvmattn.create_paged_kv_cache(options)`: named options, as a Map (a Python dict over the
  FFI) of `PagedKVCache` keyword arguments, e.g. `{"num_layers": 2, "num_qo_heads": 8, ...}`.

`install_vm_builtins()` makes a model library built with TVM's stock
`tvm.relax.frontend.nn.llm.TIRPagedKVCache` run on tvmattn's cache: it overrides the
`vm.builtin.*` names of the API table; `uninstall_vm_builtins()` puts TVM's functions back.

How a PagedKVCache travels through tvm_ffi and the Relax VM
-----------------------------------------------------------
`PagedKVCache` is a plain Python class. When it crosses the FFI (returned from a
Python-registered function, or passed as an argument), tvm_ffi finds no FFI type for it (it is
no Tensor, str, sequence, dict, callable, DLPack or FFI object) and falls back to wrapping it in
an `ffi.OpaquePyObject`: an FFI object (type index kTVMFFIOpaquePyObject) that holds a strong
reference to the Python object. The Relax VM stores that object in a register like any other
(TIRPagedKVCache's create call is typed `R.Any` and the model functions take the cache as
`R.Object`; the VM never looks inside). When the VM, or Python through a `tvm_ffi.Function`,
hands it to a Python-registered function or returns it to Python, tvm_ffi unwraps it to the very
same Python object, so the wrappers below receive the `PagedKVCache` itself. Consequences:

- The cache must stay non-callable and free of `__dlpack__` & co., or tvm_ffi would convert it
  into a Function or a Tensor instead of wrapping it.
- A C++ builtin given our cache fails with a type mismatch ("Expected `relax.vm.KVState` but
  got `ffi.OpaquePyObject`"); therefore install_vm_builtins() overrides every builtin of the
  table, and each override forwards a cache that is not ours (TVM's C++ cache) to TVM's
  original function, so caches of both kinds work side by side.
- The VM resolves the global functions it calls once, when a `relax.VirtualMachine` is created
  (`VirtualMachineImpl::InitFuncPool`): install the builtins BEFORE creating the VM; a VM
  created earlier keeps calling TVM's functions.
- Errors: the cache raises `KVCacheError` (a ValueError); its classes are registered with
  `tvm_ffi.register_error`, so an error raised inside a call made by the VM or through
  `tvm.get_global_func` reaches the Python caller as the same exception class with its message.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import operator
from typing import Any, Callable

import tvm_ffi

from .cache import PagedKVCache
from .errors import KVCacheError
from .kinds import AttnKind as AttnKind, parse_attn_kinds  # AttnKind: re-exported

PREFIX = "tvmattn."
VM_PREFIX = "vm.builtin."


def _register_error_classes(cls: type) -> None:
    """Make `cls` and its subclasses survive the trip through the FFI as themselves."""
    tvm_ffi.register_error(f"tvmattn.{cls.__name__}", cls)
    for sub in cls.__subclasses__():
        _register_error_classes(sub)


_register_error_classes(KVCacheError)


# --------------------------------------------------------------------------------------------
# FFI value conversion
# --------------------------------------------------------------------------------------------
def _ints(value, func: str, arg: str) -> list[int]:
    """A Shape / Array / list / tuple of integers as a list of Python ints."""
    try:
        return [operator.index(x) for x in value]
    except TypeError:
        raise KVCacheError(
            f"{PREFIX}{func}: {arg} must be a shape or a sequence of integers, got {value!r}"
        ) from None


def _py(value):
    """FFI containers (Map, Array) as Python dicts and lists, recursively."""
    if isinstance(value, (str, bytes)):
        return value
    if isinstance(value, tvm_ffi.Map) or isinstance(value, dict):
        return {str(k): _py(v) for k, v in value.items()}
    if isinstance(value, (tvm_ffi.Array, list, tuple)):
        return [_py(v) for v in value]
    return value


# --------------------------------------------------------------------------------------------
# The API table: name -> function(cache, *args), registered as tvmattn.<name>
# --------------------------------------------------------------------------------------------
API: dict[str, Callable[..., Any]] = {}
# The same functions without the cache check (for callers that already checked).
_UNCHECKED: dict[str, Callable[..., Any]] = {}


def _api(name: str):
    """Register `fn(cache, *args)` as API function `name`, checking that `cache` is ours."""

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(cache, *args):
            if not isinstance(cache, PagedKVCache):
                raise KVCacheError(
                    f"{PREFIX}{name}: argument 0 must be a tvmattn PagedKVCache, "
                    f"got {type(cache).__name__}"
                )
            return fn(cache, *args)

        API[name] = wrapper
        _UNCHECKED[name] = fn
        return wrapper

    return decorate


@_api("kv_state_clear")
def kv_state_clear(cache):
    cache.clear()


@_api("kv_state_add_sequence")
def kv_state_add_sequence(cache, seq_id):
    cache.add_sequence(seq_id)


@_api("kv_state_remove_sequence")
def kv_state_remove_sequence(cache, seq_id):
    cache.remove_sequence(seq_id)


@_api("kv_state_fork_sequence")
def kv_state_fork_sequence(cache, parent_id, child_id, fork_pos=-1):
    cache.fork_sequence(parent_id, child_id, fork_pos)


@_api("kv_state_popn")
def kv_state_popn(cache, seq_id, n):
    cache.popn(seq_id, n)


@_api("kv_state_begin_forward")
def kv_state_begin_forward(cache, seq_ids, append_lengths, token_tree_parent_ptr=None):
    name = "kv_state_begin_forward"
    parents = None
    if token_tree_parent_ptr is not None:
        parents = _ints(token_tree_parent_ptr, name, "token_tree_parent_ptr")
    cache.begin_forward(
        _int_seq(seq_ids, name, "seq_ids"), _int_seq(append_lengths, name, "append_lengths"), parents
    )


def _int_seq(value, func: str, arg: str):
    """A Shape as it is (the cache reads a Shape's ints without checking each), else _ints."""
    return value if type(value) is tvm_ffi.Shape else _ints(value, func, arg)


# The per-step and per-layer calls go straight to the cache's methods (same arguments, one
# Python call fewer on the way from the VM).
_api("kv_state_end_forward")(PagedKVCache.end_forward)
# tvmattn's own (TVM's cache has no way to abandon a step): roll the step in progress back.
_api("kv_state_cancel_forward")(PagedKVCache.cancel_forward)


@_api("attention_kv_cache_enable_sliding_window_for_seq")
def enable_sliding_window_for_seq(cache, seq_id, window_size, sink_size):
    cache.enable_sliding_window_for_seq(seq_id, window_size, sink_size)


@_api("attention_kv_cache_commit_accepted_token_tree_nodes")
def commit_accepted_token_tree_nodes(cache, seq_ids, leaf_indices):
    name = "attention_kv_cache_commit_accepted_token_tree_nodes"
    cache.commit_accepted_token_tree_nodes(
        _ints(seq_ids, name, "seq_ids"), _ints(leaf_indices, name, "leaf_indices")
    )


@_api("attention_kv_cache_empty")
def empty(cache) -> bool:
    return bool(cache.empty())


@_api("attention_kv_cache_get_num_available_pages")
def get_num_available_pages(cache) -> int:
    return int(cache.get_num_available_pages())


@_api("attention_kv_cache_get_total_sequence_length")
def get_total_sequence_length(cache) -> int:
    return int(cache.get_total_sequence_length())


@_api("attention_kv_cache_get_query_positions")
def get_query_positions(cache):
    return cache.get_query_positions()


@_api("attention_kv_cache_debug_get_kv")
def debug_get_kv(cache, seq_id, start, end, k, v):
    cache.debug_get_kv(seq_id, start, end, k, v)


_FUSED_QKV = PagedKVCache.attention_with_fused_qkv


def attention_with_fused_qkv(cache, layer_id, sm_scale, qkv, o):
    """The per-layer call of every step: _api's check of the cache without its *args packing."""
    if type(cache) is not PagedKVCache and not isinstance(cache, PagedKVCache):
        raise KVCacheError(f"{PREFIX}attention_kv_cache_attention_with_fused_qkv: argument 0 must be a tvmattn "
                           f"PagedKVCache, got {type(cache).__name__}")
    _FUSED_QKV(cache, layer_id, sm_scale, qkv, o)


API["attention_kv_cache_attention_with_fused_qkv"] = attention_with_fused_qkv
_UNCHECKED["attention_kv_cache_attention_with_fused_qkv"] = _FUSED_QKV


@_api("attention_kv_cache_attention_with_shared_kv")
def attention_with_shared_kv(cache, source_layer_id, sm_scale, q, k, v, o):
    cache.attention_with_shared_kv(source_layer_id, sm_scale, q, k, v, o)


@_api("attention_kv_cache_self_attention")
def self_attention(cache, layer_id, sm_scale, q, k, v, o, lse):
    cache.self_attention(layer_id, sm_scale, q, k, v, o, lse)


@_api("attention_kv_cache_cross_attention")
def cross_attention(cache, layer_id, sm_scale, q, o, lse):
    cache.cross_attention(layer_id, sm_scale, q, o, lse)


@_api("attention_kv_cache_merge_attn_output_inplace")
def merge_attn_output_inplace(cache, o1, lse1, o2, lse2):
    """Merges (o2, lse2) into (o1, lse1); returns [o1, lse1] as TVM's builtin does."""
    cache.merge_attn_output_inplace(o1, lse1, o2, lse2)
    return [o1, lse1]


@_api("attention_kv_cache_debug_get_kv_mla")
def debug_get_kv_mla(cache, seq_id, start, end, kv):
    cache.debug_get_kv_mla(seq_id, start, end, kv)


@_api("attention_kv_cache_append_mla_kv")
def append_mla_kv(cache, layer_id, kv):
    """Returns the cache, as TVM's builtin does (the model threads it through)."""
    cache.append_mla_kv(layer_id, kv)
    return cache


# --------------------------------------------------------------------------------------------
# Creation
# --------------------------------------------------------------------------------------------
ROPE_MODES = {0: "none", 1: "normal", 2: "inline"}


@dataclasses.dataclass(frozen=True)
class CreateArgs:
    """TVM's positional create call (`vm.builtin.paged_attention_kv_cache_create`,
    paged_kv_cache.cc); the field order IS the argument order.

    cache_config: [reserved_num_seqs, total_token_capacity, prefill_chunk_size, page_size,
      support_sliding_window(, layer_sliding_window_size)]; the last (default 1024, as TVM's) is
      the window of MHA_SLIDING layers.
    layer_indptr: [0, num_layers] (one pipeline stage; Disco groups are not supported).
    attn_kinds: per layer, AttnKind: MHA / MHA_SLIDING, or MLA for every layer.
    enable_kv_transfer must be False and rope_ext_factors not a tensor (both unsupported).
    init: a tensor whose dtype and device are the cache's.
    Attention slots (prefill_ragged .. mla_prefill) are backend specs; merge is an array of merge
    functions: the first merges cascade levels (at v_head_dim), a second (MLA caches) is
    merge_attn_output_inplace's. In an MLA cache, transpose_append_mla, mla_prefill,
    copy_single_page and debug_get_kv are the MLA layout's, and prefill_ragged is the
    self-attention's (at the model's own head dims).
    A 29th argument (TVM reserves it, unused) is accepted and ignored.
    """

    cache_config: Any
    layer_indptr: Any
    num_qo_heads: int
    num_kv_heads: int
    qk_head_dim: int
    v_head_dim: int
    attn_kinds: Any
    enable_kv_transfer: bool
    rope_mode: int
    rope_scale: float
    rope_theta: float
    rope_ext_factors: Any
    init: Any
    transpose_append_mha: Any
    transpose_append_mla: Any
    prefill_ragged: Any
    prefill_paged: Any
    decode_paged: Any
    prefill_paged_sliding: Any
    decode_paged_sliding: Any
    tree_paged: Any
    tree_ragged: Any
    mla_prefill: Any
    merge: Any
    split_rotary: Any
    copy_single_page: Any
    debug_get_kv: Any
    compact_copy: Any

    @classmethod
    def from_positional(cls, args) -> "CreateArgs":
        count = len(dataclasses.fields(cls))
        if len(args) not in (count, count + 1):
            raise KVCacheError(
                f"{PREFIX}paged_attention_kv_cache_create: expected {count} or {count + 1} "
                f"positional arguments (TVM's layout), got {len(args)}"
            )
        return cls(*args[:count])

    def positional(self) -> list:
        """The arguments in TVM's order (to call TVM's create, or ours, from named fields)."""
        return [getattr(self, field.name) for field in dataclasses.fields(self)]


# CreateArgs field -> PagedKVCache `kernels` slot name.
KERNEL_SLOTS = {
    "transpose_append_mha": "transpose_append",
    "transpose_append_mla": "transpose_append_mla",
    "mla_prefill": "prefill_paged_mla",
    "prefill_ragged": "prefill_ragged",
    "prefill_paged": "prefill_paged",
    "decode_paged": "decode_paged",
    "prefill_paged_sliding": "prefill_paged_sliding_window",
    "decode_paged_sliding": "decode_paged_sliding_window",
    "tree_paged": "tree_attn_paged_kv",
    "tree_ragged": "tree_attn_ragged",
    "split_rotary": "split_rotary",
    "copy_single_page": "copy_single_page",
    "debug_get_kv": "debug_get_kv",
    "compact_copy": "compact_copy",
}


def _create_error(what: str) -> KVCacheError:
    return KVCacheError(f"{PREFIX}paged_attention_kv_cache_create: {what}")


def cache_options(args: CreateArgs, library_kernels: bool = True) -> dict:
    """PagedKVCache keyword arguments for TVM's create call; unsupported options raise.

    library_kernels: run the kernels given in the call (True) or tvmattn's own kernels built for
    the cache's configuration (False; RoPE scaling baked into the given kernels is then lost).
    """
    config = _ints(args.cache_config, "paged_attention_kv_cache_create", "cache_config")
    if len(config) not in (5, 6):
        raise _create_error(
            "cache_config must be [reserved_num_seqs, total_token_capacity, prefill_chunk_size, "
            f"page_size, support_sliding_window(, layer_sliding_window_size)], got {config}"
        )
    layer_indptr = _ints(args.layer_indptr, "paged_attention_kv_cache_create", "layer_indptr")
    if len(layer_indptr) != 2 or layer_indptr[0] != 0:
        raise _create_error(f"layer_indptr must be [0, num_layers] (one pipeline stage), got {layer_indptr}")
    num_layers = layer_indptr[1]
    kinds = _ints(args.attn_kinds, "paged_attention_kv_cache_create", "attn_kinds")
    try:
        kinds = parse_attn_kinds(kinds, num_layers)
    except KVCacheError as error:
        raise _create_error(str(error)) from None
    if bool(args.enable_kv_transfer):
        raise _create_error("enable_kv_transfer (disaggregation) is not supported")
    if _is_tensor(args.rope_ext_factors):
        raise _create_error("rope_ext_factors (LongRoPE) is not supported")
    if int(args.rope_mode) not in ROPE_MODES:
        raise _create_error(f"rope_mode must be 0 (none), 1 (normal) or 2 (inline), got {args.rope_mode}")
    if not _is_tensor(args.init):
        raise _create_error(f"init (position 12) must be a tensor, got {type(args.init).__name__}")
    reserved_num_seqs, total_token_capacity, prefill_chunk_size, page_size, sliding = config[:5]
    options = dict(
        num_layers=num_layers,
        num_qo_heads=int(args.num_qo_heads),
        num_kv_heads=int(args.num_kv_heads),
        qk_head_dim=int(args.qk_head_dim),
        v_head_dim=int(args.v_head_dim),
        dtype=str(args.init.dtype),
        page_size=page_size,
        max_num_sequences=reserved_num_seqs,
        max_total_seq_len=total_token_capacity,
        prefill_chunk_size=prefill_chunk_size,
        rope_mode=ROPE_MODES[int(args.rope_mode)],
        rope_scale=float(args.rope_scale),
        rope_theta=float(args.rope_theta),
        support_sliding_window=bool(sliding),
        attn_kinds=kinds,
        layer_sliding_window_size=config[5] if len(config) == 6 else 1024,
        device=args.init.device,
    )
    if library_kernels:
        options["kernels"] = library_kernel_slots(args)
    return options


def library_kernel_slots(args: CreateArgs) -> dict:
    """The kernels of TVM's create call as PagedKVCache `kernels` slots."""
    slots = {}
    for field, slot in KERNEL_SLOTS.items():
        value = getattr(args, field)
        slots[slot] = _py(value) if isinstance(value, tvm_ffi.Array) else value
    if not len(args.merge):
        raise _create_error("merge (position 23) must hold at least the MHA merge function")
    slots["merge_state"] = args.merge[0]
    if len(args.merge) > 1:
        slots["merge_attn_output"] = args.merge[1]
    return slots


def _is_tensor(value) -> bool:
    return isinstance(value, tvm_ffi.Tensor)


EXTENSIONS_TAG = "tvmattn_extensions"
EXTENSION_SLOTS = ("split_rotary_append", "decode_append", "decode_paged_mla")
# options of the extensions argument (not kernels): PagedKVCache keyword arguments
EXTENSION_OPTIONS = ("kv_dtype",)


def extension_slots(args) -> dict:
    """tvmattn's own kernels in the create call's 29th argument (TVM reserves that position and
    ignores it): [EXTENSIONS_TAG, slot, kernel, slot, kernel, ...]; {} when it holds anything else."""
    if len(args) <= len(dataclasses.fields(CreateArgs)) or not isinstance(args[-1], tvm_ffi.Array):
        return {}
    items = list(args[-1])
    if not items or str(items[0]) != EXTENSIONS_TAG:
        return {}
    if len(items) % 2 != 1:
        raise _create_error(f"the {EXTENSIONS_TAG} argument must hold slot/kernel pairs, got {len(items) - 1} items")
    slots = {str(items[i]): items[i + 1] for i in range(1, len(items), 2)}
    unknown = sorted(set(slots) - set(EXTENSION_SLOTS) - set(EXTENSION_OPTIONS))
    if unknown:
        raise _create_error(f"unknown {EXTENSIONS_TAG} slots {unknown}; known: {list(EXTENSION_SLOTS)}")
    return slots


def paged_attention_kv_cache_create(*args, library_kernels: bool = True) -> PagedKVCache:
    """TVM's positional create call (see CreateArgs) -> PagedKVCache. A 29th argument tagged
    EXTENSIONS_TAG (model libraries built by tvmattn) adds tvmattn's own kernels."""
    options = cache_options(CreateArgs.from_positional(args), library_kernels)
    extensions = extension_slots(args)
    for name in EXTENSION_OPTIONS:
        if name in extensions:
            options[name] = str(extensions.pop(name))
    if library_kernels:
        options["kernels"].update(extensions)
    return PagedKVCache(**options)


def create_paged_kv_cache(options) -> PagedKVCache:
    """Named options (a Map / dict of PagedKVCache keyword arguments) -> PagedKVCache."""
    options = _py(options)
    if not isinstance(options, dict):
        raise KVCacheError(
            f"{PREFIX}create_paged_kv_cache: expected a map of named options, got {type(options).__name__}"
        )
    known = set(inspect.signature(PagedKVCache).parameters)
    unknown = sorted(set(options) - known)
    if unknown:
        raise KVCacheError(
            f"{PREFIX}create_paged_kv_cache: unknown options {unknown}; known: {sorted(known)}"
        )
    return PagedKVCache(**options)


CREATORS: dict[str, Callable[..., Any]] = {
    "paged_attention_kv_cache_create": paged_attention_kv_cache_create,
    "create_paged_kv_cache": create_paged_kv_cache,
}


def register_api() -> None:
    """Register tvmattn.<name> for every creator and API function (done on import)."""
    for name, fn in {**CREATORS, **API}.items():
        tvm_ffi.register_global_func(PREFIX + name, fn, override=True)


register_api()


# --------------------------------------------------------------------------------------------
# vm.builtin overrides
# --------------------------------------------------------------------------------------------
# TVM's functions replaced by install_vm_builtins(), to put back. The function registry is
# process-wide, so is this record of what was there before.
_originals: dict[str, Any] = {}


def _forwarding(name: str, ours: Callable[..., Any], original):
    """vm.builtin.<name>: our function for our cache, TVM's original for any other cache."""

    def builtin(*args):
        if args and isinstance(args[0], PagedKVCache):
            return ours(*args)
        if original is None:
            raise KVCacheError(f"{VM_PREFIX}{name}: only implemented for tvmattn's PagedKVCache")
        return original(*args)

    return builtin


def install_vm_builtins(library_kernels: bool = True) -> None:
    """Override the vm.builtin.* functions of the API table with tvmattn's.

    After this, `vm.builtin.paged_attention_kv_cache_create` builds a tvmattn PagedKVCache
    (running the kernels of the call when library_kernels, else tvmattn's own), and every
    other overridden builtin serves our caches and forwards TVM's C++ caches to TVM's function.
    Install before creating the relax.VirtualMachine (the VM looks functions up once). Calling
    it again only changes library_kernels.
    """
    for name in [*API, "paged_attention_kv_cache_create"]:
        if name not in _originals:
            _originals[name] = tvm_ffi.get_global_func(VM_PREFIX + name, allow_missing=True)
    create = functools.partial(paged_attention_kv_cache_create, library_kernels=library_kernels)
    tvm_ffi.register_global_func(VM_PREFIX + "paged_attention_kv_cache_create", create, override=True)
    for name in API:
        builtin = _forwarding(name, _UNCHECKED[name], _originals[name])
        tvm_ffi.register_global_func(VM_PREFIX + name, builtin, override=True)


def uninstall_vm_builtins() -> None:
    """Put TVM's vm.builtin.* functions back (no-op when not installed)."""
    while _originals:
        name, original = _originals.popitem()
        if original is None:
            tvm_ffi.remove_global_func(VM_PREFIX + name)
        else:
            tvm_ffi.register_global_func(VM_PREFIX + name, original, override=True)


def vm_builtins_installed() -> bool:
    return bool(_originals)
