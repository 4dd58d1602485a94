"""Page operations on the MLA pool [num_pages, page_size, qk_dim].

Rows move in chunks of `CopySchedule.vector` elements (16 bytes on CUDA, a whole row on the
CPU), one chunk a thread, as in page_ops.py; a slot position `pos` is page pos // page_size,
slot pos % page_size. With an FP8 `kv_dtype` the pool holds codes (tir_kernels.kv_quant, one
scale for the latent columns and one for the rotary ones): appending quantizes, debug_get_kv
dequantizes, copies move codes; elements are converted one by one (FP8 has no vector lanes in
TVM's arithmetic).
"""

from __future__ import annotations

from tvm.script import tirx as T

from .common import ceildiv, loop_kinds
from .config import MLAConfig
from .kv_quant import read_mla, write_mla
from .page_ops import num_blocks
from .schedules import CopySchedule, choose_copy_schedule


def _copy_schedule(config: MLAConfig, schedule: CopySchedule | None) -> CopySchedule:
    if not isinstance(config, MLAConfig):
        raise TypeError(f"config must be an MLAConfig, not {type(config).__name__}")
    sched = schedule or choose_copy_schedule(config, config.qk_dim)
    sched.check(config.qk_dim)
    return sched


def mla_transpose_append(config: MLAConfig, schedule: CopySchedule | None = None):
    """Append new latent rows to the MLA pool. Arguments in the contract's order:

    pages [P, page_size, qk_dim] (page dtype), kv [n, qk_dim], append_position_map [n] i32 (slot
    position of token i; negative = skip token i). FP8 pages store the code of x / scale.
    """
    sched = _copy_schedule(config, schedule)
    L = loop_kinds(config)
    dtype, ps, D = config.dtype, config.page_size, config.qk_dim
    convert = L.unroll if config.kv_fp8 else L.vector
    VEC, NT, CH = sched.vector, sched.threads, sched.chunks(D)

    @T.prim_func
    def tir_kv_cache_transpose_append_mla(pages_handle: T.handle, kv_handle: T.handle, position_map_handle: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int32()
        num_pages = T.int64()
        map_offset = T.int32()
        pages = T.match_buffer(pages_handle, (num_pages, ps, D), config.page_dtype)
        kv = T.match_buffer(kv_handle, (n, D), dtype)
        position_map = T.match_buffer(position_map_handle, (n,), "int32", elem_offset=map_offset)
        for bx in L.block(num_blocks(n * CH, NT), "x", outer=True):
            for tx in L.thread(NT, "x"):
                if bx * NT + tx < n * CH:
                    token = (bx * NT + tx) // CH
                    c = (bx * NT + tx) % CH
                    pos = position_map[token]
                    if pos >= 0:
                        for e in convert(VEC):
                            pages[pos // ps, pos % ps, c * VEC + e] = write_mla(config, pages, c * VEC + e,
                                                                                kv[token, c * VEC + e])

    return tir_kv_cache_transpose_append_mla.with_attr("global_symbol", "tir_kv_cache_transpose_append_mla")


def mla_copy_single_page(config: MLAConfig, schedule: CopySchedule | None = None):
    """Copy slots [0, copy_length) of page src to page tgt of the MLA pool.

    Arguments: pages [P, page_size, qk_dim] (page dtype: FP8 codes move as they are), src_page_id
    i64, tgt_page_id i64, copy_length i64.
    """
    sched = _copy_schedule(config, schedule)
    L = loop_kinds(config)
    dtype, ps, D = config.page_dtype, config.page_size, config.qk_dim
    VEC, CH = sched.vector, sched.chunks(D)
    ITEMS = ps * CH  # chunks of a whole page: (slot, chunk)
    NT = sched.threads_for(ITEMS)

    @T.prim_func
    def kv_cache_copy_single_page_mla(
        pages_handle: T.handle,
        src_page_id: T.int64,
        tgt_page_id: T.int64,
        copy_length: T.int64,
    ):
        T.func_attr({"tirx.noalias": True})
        num_pages = T.int64()
        pages = T.match_buffer(pages_handle, (num_pages, ps, D), dtype)
        for bx in L.block(ceildiv(ITEMS, NT), "x", outer=True):
            for tx in L.thread(NT, "x"):
                if bx * NT + tx < ITEMS:
                    slot = (bx * NT + tx) // CH
                    c = (bx * NT + tx) % CH
                    if T.Cast("int64", slot) < copy_length:
                        for e in L.vector(VEC):
                            pages[tgt_page_id, slot, c * VEC + e] = pages[src_page_id, slot, c * VEC + e]

    return kv_cache_copy_single_page_mla.with_attr("global_symbol", "kv_cache_copy_single_page_mla")


def mla_debug_get_kv(config: MLAConfig, num_layers: int, schedule: CopySchedule | None = None):
    """Read latent rows at given slot positions back into per-layer tensors (tests, debugging).

    Arguments: pages [P, page_size, qk_dim], position_map [len] i32, kv [num_layers, len, qk_dim],
    layer_id i64. Writes kv[layer_id, i] from slot position position_map[i] (FP8 pages:
    dequantized); other layers are untouched.
    """
    if not isinstance(num_layers, int) or num_layers <= 0:
        raise ValueError(f"num_layers={num_layers!r} is not supported: expected a positive integer")
    sched = _copy_schedule(config, schedule)
    L = loop_kinds(config)
    dtype, ps, D = config.dtype, config.page_size, config.qk_dim
    VEC, NT, CH = sched.vector, sched.threads, sched.chunks(D)
    convert = L.unroll if config.kv_fp8 else L.vector

    @T.prim_func
    def tir_kv_cache_debug_get_kv_mla(
        pages_handle: T.handle,
        position_map_handle: T.handle,
        kv_handle: T.handle,
        layer_id: T.int64,
    ):
        T.func_attr({"tirx.noalias": True})
        seq_len = T.int32()
        num_pages = T.int64()
        map_offset = T.int32()
        pages = T.match_buffer(pages_handle, (num_pages, ps, D), config.page_dtype)
        position_map = T.match_buffer(position_map_handle, (seq_len,), "int32", elem_offset=map_offset)
        kv = T.match_buffer(kv_handle, (num_layers, seq_len, D), dtype)
        for bx in L.block(num_blocks(seq_len * CH, NT), "x", outer=True):
            for tx in L.thread(NT, "x"):
                if bx * NT + tx < seq_len * CH:
                    token = (bx * NT + tx) // CH
                    c = (bx * NT + tx) % CH
                    pos = position_map[token]
                    for e in convert(VEC):
                        kv[layer_id, token, c * VEC + e] = read_mla(config, pages, pos // ps, pos % ps, c * VEC + e)

    return tir_kv_cache_debug_get_kv_mla.with_attr("global_symbol", "tir_kv_cache_debug_get_kv_mla")


__all__ = [
    "MLASchedule",
    "choose_mla_schedule",
    "mla_copy_single_page",
    "mla_debug_get_kv",
    "mla_paged_decode",
    "mla_paged_prefill",
    "mla_transpose_append",
]
