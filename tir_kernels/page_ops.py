"""Page-pool kernels of the paged KV cache: append new tokens, copy a page, compact, read back.

Every kernel moves rows of head_dim values in chunks of `CopySchedule.vector` elements
(16 bytes per access on CUDA, a whole row on CPU); one thread moves one chunk. A slot
position `pos` of the pool means page `pos // page_size`, slot `pos % page_size`.
The pool is `pages [num_pages, 2, Hkv, page_size, D]` (index 0 = K, 1 = V), matched without
an element offset so that vector accesses stay provably aligned. With an FP8 `kv_dtype` the pool
holds codes: appending quantizes (kv_quant.write_kv), debug_get_kv dequantizes, the copies move
codes, one element per step where a conversion runs (TVM's vectorizer has no FP8 lanes on CUDA). Indices are written as
`c * VEC + e` with the chunk index `c` bound, never a bound `d0 = c * VEC`: TVM binds such
variables through a local slot and then cannot prove `d0` aligned, and emits gathers.
"""

from __future__ import annotations

from tvm.script import tirx as T

from .common import ceildiv, loop_kinds
from .config import AttentionConfig
from .kv_quant import read_kv, write_kv
from .schedules import CopySchedule, choose_copy_schedule


def num_blocks(items, threads: int):
    """Blocks for `items` work items, at least one (a CUDA grid of zero blocks fails to launch)."""
    return T.max(ceildiv(items, threads), 1)


def _schedule(config: AttentionConfig, schedule: CopySchedule | None) -> CopySchedule:
    sched = schedule or choose_copy_schedule(config, config.head_dim)
    sched.check(config.head_dim)
    return sched


def transpose_append(config: AttentionConfig, schedule: CopySchedule | None = None):
    """Append new K/V rows to the page pool. Arguments in the contract's order:

    pages [P, 2, Hkv, page_size, D], k [n, Hkv, D], v [n, Hkv, D],
    append_position_map [n] i32 (slot position of token i; negative = skip token i).
    FP8 pages store the code of x / scale (kv_quant: saturated, rounded to nearest even).
    """
    sched = _schedule(config, schedule)
    L = loop_kinds(config)
    dtype, ps, D, Hkv = config.dtype, config.page_size, config.head_dim, config.num_kv_heads
    page_dtype = config.page_dtype
    VEC, NT = sched.vector, sched.threads
    CH = sched.chunks(D)
    ROW = Hkv * CH  # chunks per token
    convert = L.unroll if config.kv_fp8 else L.vector

    @T.prim_func
    def tir_kv_cache_transpose_append(
        pages_handle: T.handle,
        k_handle: T.handle,
        v_handle: T.handle,
        position_map_handle: T.handle,
    ):
        T.func_attr({"tirx.noalias": True})
        n = T.int32()
        num_pages = T.int64()
        map_offset = T.int32()
        pages = T.match_buffer(pages_handle, (num_pages, 2, Hkv, ps, D), page_dtype)
        k = T.match_buffer(k_handle, (n, Hkv, D), dtype)
        v = T.match_buffer(v_handle, (n, Hkv, D), dtype)
        position_map = T.match_buffer(position_map_handle, (n,), "int32", elem_offset=map_offset)
        for bx in L.block(num_blocks(n * ROW, NT), "x", outer=True):
            for tx in L.thread(NT, "x"):
                if bx * NT + tx < n * ROW:
                    token = (bx * NT + tx) // ROW
                    h = (bx * NT + tx) % ROW // CH
                    c = (bx * NT + tx) % CH
                    pos = position_map[token]
                    if pos >= 0:
                        for e in convert(VEC):
                            pages[pos // ps, 0, h, pos % ps, c * VEC + e] = write_kv(config, pages, 0, h,
                                                                                     k[token, h, c * VEC + e])
                        for e in convert(VEC):
                            pages[pos // ps, 1, h, pos % ps, c * VEC + e] = write_kv(config, pages, 1, h,
                                                                                     v[token, h, c * VEC + e])

    return tir_kv_cache_transpose_append.with_attr("global_symbol", "tir_kv_cache_transpose_append")


def copy_single_page(config: AttentionConfig, schedule: CopySchedule | None = None):
    """Copy slots [0, copy_length) of K and V of every head from page src to page tgt.

    Arguments: pages [P, 2, Hkv, page_size, D], src_page_id i64, tgt_page_id i64, copy_length i64.
    """
    sched = _schedule(config, schedule)
    L = loop_kinds(config)
    dtype, ps, D, Hkv = config.page_dtype, config.page_size, config.head_dim, config.num_kv_heads
    VEC, CH = sched.vector, sched.chunks(D)
    ITEMS = 2 * Hkv * ps * CH  # chunks of a whole page: (kv, head, slot, chunk)
    NT = sched.threads_for(ITEMS)

    @T.prim_func
    def kv_cache_copy_single_page(
        pages_handle: T.handle,
        src_page_id: T.int64,
        tgt_page_id: T.int64,
        copy_length: T.int64,
    ):
        T.func_attr({"tirx.noalias": True})
        num_pages = T.int64()
        pages = T.match_buffer(pages_handle, (num_pages, 2, Hkv, ps, D), dtype)
        for bx in L.block(ceildiv(ITEMS, NT), "x", outer=True):
            for tx in L.thread(NT, "x"):
                if bx * NT + tx < ITEMS:
                    kv = (bx * NT + tx) // (Hkv * ps * CH)
                    h = (bx * NT + tx) // (ps * CH) % Hkv
                    slot = (bx * NT + tx) // CH % ps
                    c = (bx * NT + tx) % CH
                    if T.Cast("int64", slot) < copy_length:
                        for e in L.vector(VEC):
                            pages[tgt_page_id, kv, h, slot, c * VEC + e] = pages[src_page_id, kv, h, slot, c * VEC + e]

    return kv_cache_copy_single_page.with_attr("global_symbol", "kv_cache_copy_single_page")


def compact_copy(config: AttentionConfig, schedule: CopySchedule | None = None):
    """Move committed tokens within the pool, request by request, each request's copies in order.

    Arguments: pages [P, 2, Hkv, page_size, D], copy_length_indptr [b+1] i32,
    copy_src_dst_pos [2, n] i32 (row 0: source slot positions, row 1: destinations),
    batch_size i32. Copy t of request i (indptr[i] <= t < indptr[i+1]) moves K and V of every
    head from position src[t] to dst[t]. A destination may be an earlier copy's source of the
    same request: each thread owns one (K/V, head, chunk) and walks a request's copies in
    order, which is exactly the sequential semantics.
    """
    sched = _schedule(config, schedule)
    L = loop_kinds(config)
    dtype, ps, D, Hkv = config.page_dtype, config.page_size, config.head_dim, config.num_kv_heads
    VEC, CH = sched.vector, sched.chunks(D)
    ITEMS = 2 * Hkv * CH  # chunks of one token: (kv, head, chunk)
    NT = sched.threads_for(ITEMS)

    @T.prim_func
    def kv_cache_compact_kv_copy(
        pages_handle: T.handle,
        copy_length_indptr_handle: T.handle,
        copy_src_dst_pos_handle: T.handle,
        batch_size: T.int32,
    ):
        T.func_attr({"tirx.noalias": True})
        num_pages = T.int64()
        total_copies = T.int32()
        indptr_offset = T.int32()
        pos_offset = T.int32()
        pages = T.match_buffer(pages_handle, (num_pages, 2, Hkv, ps, D), dtype)
        copy_length_indptr = T.match_buffer(
            copy_length_indptr_handle, (batch_size + 1,), "int32", elem_offset=indptr_offset
        )
        copy_src_dst_pos = T.match_buffer(
            copy_src_dst_pos_handle, (2, total_copies), "int32", elem_offset=pos_offset
        )
        for b in L.block(T.max(batch_size, 1), "x", outer=True):
            for by in L.block(ceildiv(ITEMS, NT), "y"):
                for tx in L.thread(NT, "x"):
                    if b < batch_size and by * NT + tx < ITEMS:
                        kv = (by * NT + tx) // (Hkv * CH)
                        h = (by * NT + tx) // CH % Hkv
                        c = (by * NT + tx) % CH
                        for t in T.serial(copy_length_indptr[b + 1] - copy_length_indptr[b]):
                            src = copy_src_dst_pos[0, copy_length_indptr[b] + t]
                            dst = copy_src_dst_pos[1, copy_length_indptr[b] + t]
                            for e in L.vector(VEC):
                                pages[dst // ps, kv, h, dst % ps, c * VEC + e] = pages[src // ps, kv, h, src % ps, c * VEC + e]

    return kv_cache_compact_kv_copy.with_attr("global_symbol", "kv_cache_compact_kv_copy")


def debug_get_kv(config: AttentionConfig, num_layers: int, schedule: CopySchedule | None = None):
    """Read K/V at given slot positions back into per-layer tensors (tests and debugging).

    Arguments: pages [P, 2, Hkv, page_size, D], position_map [len] i32,
    k [num_layers, len, Hkv, D], v [num_layers, len, Hkv, D], layer_id i64.
    Writes k[layer_id, i] and v[layer_id, i] from slot position position_map[i] (FP8 pages:
    dequantized, code * scale, rounded to the dtype); other layers are untouched.
    """
    if not isinstance(num_layers, int) or num_layers <= 0:
        raise ValueError(f"num_layers={num_layers!r} is not supported: expected a positive integer")
    sched = _schedule(config, schedule)
    L = loop_kinds(config)
    dtype, ps, D, Hkv = config.dtype, config.page_size, config.head_dim, config.num_kv_heads
    page_dtype = config.page_dtype
    VEC, NT = sched.vector, sched.threads
    CH = sched.chunks(D)
    ROW = Hkv * CH
    convert = L.unroll if config.kv_fp8 else L.vector

    @T.prim_func
    def tir_kv_cache_debug_get_kv(
        pages_handle: T.handle,
        position_map_handle: T.handle,
        k_handle: T.handle,
        v_handle: T.handle,
        layer_id: T.int64,
    ):
        T.func_attr({"tirx.noalias": True})
        seq_len = T.int32()
        num_pages = T.int64()
        map_offset = T.int32()
        pages = T.match_buffer(pages_handle, (num_pages, 2, Hkv, ps, D), page_dtype)
        position_map = T.match_buffer(position_map_handle, (seq_len,), "int32", elem_offset=map_offset)
        k = T.match_buffer(k_handle, (num_layers, seq_len, Hkv, D), dtype)
        v = T.match_buffer(v_handle, (num_layers, seq_len, Hkv, D), dtype)
        for bx in L.block(num_blocks(seq_len * ROW, NT), "x", outer=True):
            for tx in L.thread(NT, "x"):
                if bx * NT + tx < seq_len * ROW:
                    token = (bx * NT + tx) // ROW
                    h = (bx * NT + tx) % ROW // CH
                    c = (bx * NT + tx) % CH
                    pos = position_map[token]
                    for e in convert(VEC):
                        k[layer_id, token, h, c * VEC + e] = read_kv(config, pages, 0, h, pos // ps, pos % ps,
                                                                     c * VEC + e)
                    for e in convert(VEC):
                        v[layer_id, token, h, c * VEC + e] = read_kv(config, pages, 1, h, pos // ps, pos % ps,
                                                                     c * VEC + e)

    return tir_kv_cache_debug_get_kv.with_attr("global_symbol", "tir_kv_cache_debug_get_kv")
