"""The tvmattn.* global functions: TVM's KV-cache API, over tvm_ffi, on tvmattn's cache.

Every call goes through `tvm.get_global_func("tvmattn.<name>")`, so arguments arrive as FFI
values (Shape, Array, int, float, Tensor) and the cache as an opaque object, exactly as a model
library or a C++ host would pass them. The cache is created by
`tvmattn.paged_attention_kv_cache_create` with TVM's 28 positional arguments and our kernels.
"""

from __future__ import annotations

import numpy as np
import pytest
import reference as ref
import test_interop
import tvm
from harness import device_for, randn, tensor
from test_interop import RopeMode
from tvm.runtime import ShapeTuple

from tir_kernels import (
    AttentionConfig,
    compact_copy,
    copy_single_page,
    debug_get_kv,
    default_sm_scale,
    merge_state,
    paged_decode,
    paged_prefill,
    ragged_prefill,
    split_rotary,
    split_rotary_append,
    transpose_append,
)
from tvmattn.runtime.cache import PagedKVCache
from tvmattn.runtime.errors import KVCacheError
from tvmattn.runtime.ffi import CreateArgs, library_kernel_slots

NUM_LAYERS = 2
HQ, HKV, D, PAGE_SIZE, DTYPE = 8, 2, 64, 16, "float16"
RESERVED_SEQS, TOKEN_CAPACITY, PREFILL_CHUNK = 8, 1024, 256
SM_SCALE = default_sm_scale(D)

# The contract's API table (docs/interface.md) plus the two creation functions.
API_NAMES = [
    "paged_attention_kv_cache_create",
    "create_paged_kv_cache",
    "kv_state_clear",
    "kv_state_add_sequence",
    "kv_state_remove_sequence",
    "kv_state_fork_sequence",
    "kv_state_popn",
    "kv_state_begin_forward",
    "kv_state_end_forward",
    "kv_state_cancel_forward",
    "attention_kv_cache_enable_sliding_window_for_seq",
    "attention_kv_cache_commit_accepted_token_tree_nodes",
    "attention_kv_cache_empty",
    "attention_kv_cache_get_num_available_pages",
    "attention_kv_cache_get_total_sequence_length",
    "attention_kv_cache_get_query_positions",
    "attention_kv_cache_debug_get_kv",
    "attention_kv_cache_debug_get_kv_mla",
    "attention_kv_cache_attention_with_fused_qkv",
    "attention_kv_cache_self_attention",
    "attention_kv_cache_cross_attention",
    "attention_kv_cache_append_mla_kv",
    "attention_kv_cache_merge_attn_output_inplace",
]


def api(name: str):
    return tvm.get_global_func(f"tvmattn.{name}")


def config_for(target: str) -> AttentionConfig:
    return AttentionConfig(HQ, HKV, D, dtype=DTYPE, page_size=PAGE_SIZE, target=target)


def create_args(kernels, config: AttentionConfig, rope_mode: RopeMode = RopeMode.NONE, **changes) -> CreateArgs:
    """TVM's positional create call with our kernels; `changes` replace named positions."""
    def ours(generator, *extra):
        return kernels.get(generator, config, *extra)

    fields = dict(
        cache_config=ShapeTuple([RESERVED_SEQS, TOKEN_CAPACITY, PREFILL_CHUNK, PAGE_SIZE, 0]),
        layer_indptr=ShapeTuple([0, NUM_LAYERS]),
        num_qo_heads=HQ,
        num_kv_heads=HKV,
        qk_head_dim=D,
        v_head_dim=D,
        attn_kinds=ShapeTuple([0] * NUM_LAYERS),
        enable_kv_transfer=False,
        rope_mode=int(rope_mode),
        rope_scale=config.rope_scale,
        rope_theta=config.rope_theta,
        rope_ext_factors=None,
        init=tvm.runtime.empty((), DTYPE, device=device_for(config)),
        transpose_append_mha=ours(transpose_append),
        transpose_append_mla=None,
        prefill_ragged=["tirx", ours(ragged_prefill)],
        prefill_paged=["tirx", ours(paged_prefill)],
        decode_paged=["tirx", ours(paged_decode)],
        prefill_paged_sliding=[],
        decode_paged_sliding=[],
        tree_paged=[],
        tree_ragged=[],
        mla_prefill=[],
        merge=[ours(merge_state)],
        split_rotary=ours(split_rotary),
        copy_single_page=ours(copy_single_page),
        debug_get_kv=ours(debug_get_kv, NUM_LAYERS),
        compact_copy=ours(compact_copy),
    )
    fields.update(changes)
    return CreateArgs(**fields)


@pytest.fixture
def cache(kernels, target):
    return api("paged_attention_kv_cache_create")(*create_args(kernels, config_for(target)).positional())


def test_every_api_function_is_registered():
    missing = [name for name in API_NAMES if tvm.get_global_func(f"tvmattn.{name}", allow_missing=True) is None]
    assert not missing


@pytest.mark.parametrize("rope_mode", [RopeMode.NONE, RopeMode.NORMAL, RopeMode.INLINE], ids=lambda m: m.name.lower())
def test_interop_scenario_through_tvmattn_api(kernels, target, rope_mode, monkeypatch):
    """tests/test_interop.py's scenario (prefill, chunked prefill, decode, forks inside a page
    and at the end, popn, remove; outputs and cached K/V against the float64 reference), with
    every vm.builtin.<name> call replaced by tvmattn.<name>: our cache, same arguments."""
    monkeypatch.setattr(test_interop, "builtin", api)
    test_interop.test_tvm_cache_with_our_kernels(kernels, target, rope_mode)


@pytest.mark.slow
def test_interop_sliding_window_through_tvmattn_api(kernels, target, monkeypatch):
    """tests/test_interop.py's sliding-window scenario (windows with attention sinks, our
    sliding-window kernels in slots 18/19), through tvmattn.<name> on our cache."""
    monkeypatch.setattr(test_interop, "builtin", api)
    test_interop.test_tvm_cache_sliding_window(kernels, target)


def test_create_returns_the_python_cache(cache):
    """The opaque FFI object comes back as the very Python object, with TVM's answers."""
    assert isinstance(cache, PagedKVCache)
    assert api("attention_kv_cache_empty")(cache) is True
    assert api("attention_kv_cache_get_total_sequence_length")(cache) == 0
    pages = api("attention_kv_cache_get_num_available_pages")(cache)
    assert isinstance(pages, int) and pages >= TOKEN_CAPACITY // PAGE_SIZE


def test_sequence_functions_and_queries(cache, target):
    """Shapes and plain Python sequences both work as id/length lists; queries return ints,
    bools and tensors; pages come back when sequences go."""
    initial_pages = api("attention_kv_cache_get_num_available_pages")(cache)
    for seq_id in (3, 9):
        api("kv_state_add_sequence")(cache, seq_id)
    assert api("attention_kv_cache_empty")(cache) is False

    api("kv_state_begin_forward")(cache, ShapeTuple([3, 9]), ShapeTuple([20, 5]))
    expected = np.r_[np.arange(20), np.arange(5)]
    np.testing.assert_array_equal(api("attention_kv_cache_get_query_positions")(cache).numpy(), expected)
    fused_qkv_step(cache, target, [20, 5])
    api("kv_state_end_forward")(cache)
    assert api("attention_kv_cache_get_total_sequence_length")(cache) == 25
    assert api("attention_kv_cache_get_num_available_pages")(cache) == initial_pages - 3

    api("kv_state_fork_sequence")(cache, 3, 4, 18)
    api("kv_state_popn")(cache, 9, 2)
    api("kv_state_begin_forward")(cache, [4, 9, 3], (1, 1, 1))  # Array / tuple instead of Shape
    np.testing.assert_array_equal(api("attention_kv_cache_get_query_positions")(cache).numpy(), [18, 3, 20])
    fused_qkv_step(cache, target, [1, 1, 1])
    api("kv_state_end_forward")(cache)
    assert api("attention_kv_cache_get_total_sequence_length")(cache) == 19 + 4 + 21

    api("kv_state_clear")(cache)
    assert api("attention_kv_cache_empty")(cache) is True
    assert api("attention_kv_cache_get_num_available_pages")(cache) == initial_pages


def fused_qkv_step(cache, target, lengths, seed=0):
    """attention_with_fused_qkv on every layer with random data (outputs not checked here)."""
    dev = device_for(config_for(target))
    rng = np.random.default_rng(seed)
    for layer in range(NUM_LAYERS):
        qkv = tensor(randn(rng, (sum(lengths), HQ + 2 * HKV, D), DTYPE), dev)
        o = tvm.runtime.empty((sum(lengths), HQ, D), DTYPE, device=dev)
        api("attention_kv_cache_attention_with_fused_qkv")(cache, layer, SM_SCALE, qkv, o)


def test_self_cross_attention_and_merge(cache, target):
    """A chunk of new tokens after a history: ragged self-attention over the chunk plus paged
    cross-attention over the history, merged through the API, equals causal attention over all.
    (As in TVM, self_attention does not append the chunk's K/V to the cache.)"""
    dev = device_for(config_for(target))
    rng = np.random.default_rng(3)
    history, chunk = 21, 6
    api("kv_state_add_sequence")(cache, 0)
    k_hist = [randn(rng, (history, HKV, D), DTYPE) for _ in range(NUM_LAYERS)]
    v_hist = [randn(rng, (history, HKV, D), DTYPE) for _ in range(NUM_LAYERS)]
    api("kv_state_begin_forward")(cache, ShapeTuple([0]), ShapeTuple([history]))
    for layer in range(NUM_LAYERS):  # the history, appended by attention_with_fused_qkv
        q = randn(rng, (history, HQ, D), DTYPE)
        qkv = tensor(np.concatenate([q, k_hist[layer], v_hist[layer]], axis=1), dev)
        o = tvm.runtime.empty((history, HQ, D), DTYPE, device=dev)
        api("attention_kv_cache_attention_with_fused_qkv")(cache, layer, SM_SCALE, qkv, o)
    api("kv_state_end_forward")(cache)

    api("kv_state_begin_forward")(cache, ShapeTuple([0]), ShapeTuple([chunk]))
    for layer in range(NUM_LAYERS):
        q = randn(rng, (chunk, HQ, D), DTYPE)
        k, v = randn(rng, (chunk, HKV, D), DTYPE), randn(rng, (chunk, HKV, D), DTYPE)
        o_self = tvm.runtime.empty((chunk, HQ, D), DTYPE, device=dev)
        lse_self = tvm.runtime.empty((chunk, HQ), "float32", device=dev)
        o_cross = tvm.runtime.empty((chunk, HQ, D), DTYPE, device=dev)
        lse_cross = tvm.runtime.empty((chunk, HQ), "float32", device=dev)
        api("attention_kv_cache_self_attention")(cache, layer, SM_SCALE, tensor(q, dev), tensor(k, dev), tensor(v, dev),
                                                 o_self, lse_self)
        api("attention_kv_cache_cross_attention")(cache, layer, SM_SCALE, tensor(q, dev), o_cross, lse_cross)
        merged = api("attention_kv_cache_merge_attn_output_inplace")(cache, o_self, lse_self, o_cross, lse_cross)
        assert len(merged) == 2 and merged[0].same_as(o_self) and merged[1].same_as(lse_self)

        keys = np.concatenate([k_hist[layer], k])
        values = np.concatenate([v_hist[layer], v])
        expected_o, expected_lse = ref.attention(q, keys, values, SM_SCALE, causal=True)
        rtol, atol = ref.TOLERANCES[DTYPE]
        np.testing.assert_allclose(o_self.numpy().astype(np.float64), expected_o, rtol=rtol, atol=atol,
                                   err_msg=f"layer {layer}")
        np.testing.assert_allclose(lse_self.numpy(), expected_lse, rtol=ref.LSE_TOLERANCE[0], atol=ref.LSE_TOLERANCE[1])
    api("kv_state_cancel_forward")(cache)  # nothing was written: the step has nothing to keep

    k_out = tvm.runtime.empty((NUM_LAYERS, history, HKV, D), DTYPE, device=dev)
    v_out = tvm.runtime.empty((NUM_LAYERS, history, HKV, D), DTYPE, device=dev)
    api("attention_kv_cache_debug_get_kv")(cache, 0, 0, history, k_out, v_out)
    np.testing.assert_array_equal(k_out.numpy(), np.stack(k_hist))
    np.testing.assert_array_equal(v_out.numpy(), np.stack(v_hist))


def test_named_create(kernels, target):
    """tvmattn.create_paged_kv_cache takes PagedKVCache's keyword arguments as a Map."""
    config = config_for(target)
    slot_kernels = library_kernel_slots(create_args(kernels, config))  # slot name -> spec / function
    options = dict(num_layers=NUM_LAYERS, num_qo_heads=HQ, num_kv_heads=HKV, qk_head_dim=D, dtype=DTYPE,
                   page_size=PAGE_SIZE, max_num_sequences=4, max_total_seq_len=256, prefill_chunk_size=64,
                   device=device_for(config), kernels=slot_kernels)
    cache = api("create_paged_kv_cache")(options)
    assert isinstance(cache, PagedKVCache)
    api("kv_state_add_sequence")(cache, 1)
    api("kv_state_begin_forward")(cache, ShapeTuple([1]), ShapeTuple([17]))
    fused_qkv_step(cache, target, [17])
    api("kv_state_end_forward")(cache)
    assert api("attention_kv_cache_get_total_sequence_length")(cache) == 17

    with pytest.raises(KVCacheError, match="unknown options.*'num_heads'"):
        api("create_paged_kv_cache")({**options, "num_heads": 8})


# ---------------------------------------------------------------------------------------------
# Errors surface as Python exceptions with the cache's message
# ---------------------------------------------------------------------------------------------
def test_cache_errors_surface(cache):
    api("kv_state_add_sequence")(cache, 0)
    with pytest.raises(KVCacheError, match="7"):
        api("kv_state_remove_sequence")(cache, 7)
    with pytest.raises(KVCacheError, match="0"):
        api("kv_state_add_sequence")(cache, 0)
    with pytest.raises(KVCacheError, match="append_lengths"):
        api("kv_state_begin_forward")(cache, ShapeTuple([0]), ShapeTuple([1, 2]))
    with pytest.raises(KVCacheError, match="seq_ids must be a shape or a sequence of integers"):
        api("kv_state_begin_forward")(cache, 1.5, ShapeTuple([1]))
    # The failed calls left the cache as it was.
    assert api("attention_kv_cache_get_total_sequence_length")(cache) == 0
    api("kv_state_remove_sequence")(cache, 0)
    assert api("attention_kv_cache_empty")(cache)


def test_not_a_cache():
    with pytest.raises(KVCacheError, match=r"tvmattn\.kv_state_clear: argument 0 must be a tvmattn PagedKVCache"):
        api("kv_state_clear")(tvm.runtime.empty((1,), "float32"))


@pytest.mark.parametrize("name, args, message", [
    ("attention_kv_cache_debug_get_kv_mla", (0, 0, 1, None), "this cache has no MLA layers"),
    ("attention_kv_cache_append_mla_kv", (0, None), "append_mla_kv: no forward step"),
])
def test_mla_functions_on_an_mha_cache(cache, name, args, message):
    """MLA caches: tests/test_cache_mla.py."""
    with pytest.raises(KVCacheError, match=message):
        api(name)(cache, *args)


@pytest.mark.parametrize("change, message", [
    (dict(attn_kinds=ShapeTuple([1, 0])), "attn_kinds mixes MLA layers with MHA"),
    (dict(attn_kinds=ShapeTuple([0, 2])), r"attn_kinds\[1\] is LINEAR"),
    (dict(enable_kv_transfer=True), "enable_kv_transfer"),
    (dict(rope_ext_factors=tvm.runtime.empty((32,), "float32")), "rope_ext_factors"),
    (dict(layer_indptr=ShapeTuple([0, 1, 2])), "one pipeline stage"),
    (dict(cache_config=ShapeTuple([8, 1024, 256])), "cache_config"),
    (dict(rope_mode=5), "rope_mode"),
], ids=["mla-and-mha", "linear", "kv-transfer", "rope-ext-factors", "pipeline", "cache-config", "rope-mode"])
def test_unsupported_create_options(kernels, change, message):
    args = create_args(kernels, config_for("llvm"), **change).positional()
    with pytest.raises(KVCacheError, match=message):
        api("paged_attention_kv_cache_create")(*args)


def test_create_argument_count(kernels):
    args = create_args(kernels, config_for("llvm")).positional()
    with pytest.raises(KVCacheError, match="expected 28 or 29 positional arguments .* got 27"):
        api("paged_attention_kv_cache_create")(*args[:27])
    assert isinstance(api("paged_attention_kv_cache_create")(*args, None), PagedKVCache)


def test_create_extension_kernels(kernels):
    """A 29th argument tagged "tvmattn_extensions" adds tvmattn's own kernels (split_rotary_append,
    run by decode steps); without it a create call's cache runs split_rotary + transpose_append."""
    config = config_for("llvm")
    args = create_args(kernels, config).positional()
    create = api("paged_attention_kv_cache_create")
    fused = kernels.get(split_rotary_append, config)
    cache = create(*args, ["tvmattn_extensions", "split_rotary_append", fused])
    assert cache.kernels.split_rotary_append is not None
    assert create(*args).kernels.split_rotary_append is None
    assert create(*args, ["something TVM reserves"]).kernels.split_rotary_append is None
    with pytest.raises(KVCacheError, match="unknown tvmattn_extensions slots \\['fused_everything'\\]"):
        create(*args, ["tvmattn_extensions", "fused_everything", fused])
    with pytest.raises(KVCacheError, match="slot/kernel pairs"):
        create(*args, ["tvmattn_extensions", "split_rotary_append"])
