"""Split of the fused QKV projection into q, k, v, with RoPE applied to q and k.

Rotate-half RoPE over the whole head dim with the config's constant theta and scale and
optional Llama-3 frequency scaling (`common.rope_value`), computed in FP32.
"""

from __future__ import annotations

from tvm.script import tirx as T

from .common import loop_kinds, rope_value
from .config import AttentionConfig
from .page_ops import num_blocks
from .schedules import CopySchedule, choose_copy_schedule


def _setup(config: AttentionConfig, schedule: CopySchedule | None, generator: str):
    """(D, Hq, Hkv, dtype, copy schedule, loop kinds) of a split generator."""
    D = config.head_dim
    if config.v_head_dim != D:
        raise ValueError(f"v_head_dim={config.v_head_dim} is not supported by {generator}: expected head_dim={D}")
    sched = schedule or choose_copy_schedule(config, D)
    sched.check(D)
    return D, config.num_qo_heads, config.num_kv_heads, config.dtype, sched, loop_kinds(config)


def _rotate_or_copy_macro(config: AttentionConfig, sched: CopySchedule, L):
    D, dtype, VEC = config.head_dim, config.dtype, sched.vector
    theta, scale, scaling = T.float32(config.rope_theta), T.float32(config.rope_scale), config.rope_scaling

    @T.macro
    def rotate_or_copy(store_, qkv_, s_, h_, c_, pos_, rotate_):
        """store_(e, value) of element c_ * VEC + e of qkv_[s_, h_], rotated to pos_ when rotate_."""
        buf = T.alloc_buffer((VEC,), dtype, scope="local")
        if rotate_:
            for e in L.unroll(VEC):
                buf[e] = T.Cast(dtype, rope_value(lambda i: qkv_[s_, h_, i], c_ * VEC + e, pos_, D, theta, scale, scaling))
        else:
            for e in L.vector(VEC):
                buf[e] = qkv_[s_, h_, c_ * VEC + e]
        for e in L.vector(VEC):
            store_(e, buf[e])

    return rotate_or_copy


def split_rotary(config: AttentionConfig, schedule: CopySchedule | None = None):
    """Split-rotary PrimFunc, arguments in the contract's order:

    qkv [n, Hq + 2*Hkv, D] (heads: Hq query, then Hkv key, then Hkv value),
    q_rope_position_map [n] i32 (RoPE position of token i), q [n, Hq, D], k [n, Hkv, D],
    v [n, Hkv, D], apply_rope i64 (> 0: rotate q and k; else copy them unchanged).
    v is always a plain copy. One thread per chunk of a head row: copies are vector
    accesses; a rotated chunk is computed element by element and stored as one vector.
    """
    D, Hq, Hkv, dtype, sched, L = _setup(config, schedule, "split_rotary")
    VEC, CH, NT = sched.vector, sched.chunks(D), sched.threads
    H = Hq + 2 * Hkv
    ROW = H * CH  # chunks per token
    rotate_or_copy = _rotate_or_copy_macro(config, sched, L)

    @T.prim_func
    def tir_split_rotary(
        qkv_handle: T.handle,
        q_rope_position_map_handle: T.handle,
        q_handle: T.handle,
        k_handle: T.handle,
        v_handle: T.handle,
        apply_rope: T.int64,
    ):
        T.func_attr({"tirx.noalias": True})
        n = T.int32()
        pos_offset = T.int32()
        qkv = T.match_buffer(qkv_handle, (n, H, D), dtype)
        position_map = T.match_buffer(q_rope_position_map_handle, (n,), "int32", elem_offset=pos_offset)
        q = T.match_buffer(q_handle, (n, Hq, D), dtype)
        k = T.match_buffer(k_handle, (n, Hkv, D), dtype)
        v = T.match_buffer(v_handle, (n, Hkv, D), dtype)
        for bx in L.block(num_blocks(n * ROW, NT), "x", outer=True):
            for tx in L.thread(NT, "x"):
                if bx * NT + tx < n * ROW:
                    s = (bx * NT + tx) // ROW
                    h = (bx * NT + tx) % ROW // CH
                    c = (bx * NT + tx) % CH
                    if h < Hq:
                        rotate_or_copy(lambda e, val: T.buffer_store(q, val, [s, h, c * VEC + e]),
                                       qkv, s, h, c, position_map[s], apply_rope > 0)
                    elif h < Hq + Hkv:
                        rotate_or_copy(lambda e, val: T.buffer_store(k, val, [s, h - Hq, c * VEC + e]),
                                       qkv, s, h, c, position_map[s], apply_rope > 0)
                    else:
                        for e in L.vector(VEC):
                            v[s, h - Hq - Hkv, c * VEC + e] = qkv[s, h, c * VEC + e]

    return tir_split_rotary.with_attr("global_symbol", "tir_split_rotary")


def split_rotary_append(config: AttentionConfig, schedule: CopySchedule | None = None):
    """split_rotary and transpose_append in one launch (tvmattn's own kernel, not in TVM's
    contract): q gets the (rotated) query heads, the (rotated) key heads and the value heads go
    straight into their page slots. Arguments:

    qkv [n, Hq + 2*Hkv, D], q_rope_position_map [n] i32, q [n, Hq, D],
    pages [P, 2, Hkv, page_size, D], append_position_map [n] i32 (slot of token i; negative:
    its k and v are not stored), apply_rope i64 (> 0: rotate q and k).
    """
    D, Hq, Hkv, dtype, sched, L = _setup(config, schedule, "split_rotary_append")
    VEC, CH, NT, ps = sched.vector, sched.chunks(D), sched.threads, config.page_size
    H = Hq + 2 * Hkv
    ROW = H * CH  # chunks per token
    rotate_or_copy = _rotate_or_copy_macro(config, sched, L)

    @T.prim_func
    def tir_split_rotary_append(
        qkv_handle: T.handle,
        q_rope_position_map_handle: T.handle,
        q_handle: T.handle,
        pages_handle: T.handle,
        append_position_map_handle: T.handle,
        apply_rope: T.int64,
    ):
        T.func_attr({"tirx.noalias": True})
        n = T.int32()
        num_pages = T.int64()
        pos_offset = T.int32()
        map_offset = T.int32()
        qkv = T.match_buffer(qkv_handle, (n, H, D), dtype)
        position_map = T.match_buffer(q_rope_position_map_handle, (n,), "int32", elem_offset=pos_offset)
        q = T.match_buffer(q_handle, (n, Hq, D), dtype)
        pages = T.match_buffer(pages_handle, (num_pages, 2, Hkv, ps, D), dtype)
        append_map = T.match_buffer(append_position_map_handle, (n,), "int32", elem_offset=map_offset)
        for bx in L.block(num_blocks(n * ROW, NT), "x", outer=True):
            for tx in L.thread(NT, "x"):
                if bx * NT + tx < n * ROW:
                    s = (bx * NT + tx) // ROW
                    h = (bx * NT + tx) % ROW // CH
                    c = (bx * NT + tx) % CH
                    slot = append_map[s]
                    if h < Hq:
                        rotate_or_copy(lambda e, val: T.buffer_store(q, val, [s, h, c * VEC + e]),
                                       qkv, s, h, c, position_map[s], apply_rope > 0)
                    elif h < Hq + Hkv:
                        if slot >= 0:
                            rotate_or_copy(lambda e, val: T.buffer_store(
                                pages, val, [slot // ps, 0, h - Hq, slot % ps, c * VEC + e]),
                                qkv, s, h, c, position_map[s], apply_rope > 0)
                    elif slot >= 0:
                        for e in L.vector(VEC):
                            pages[slot // ps, 1, h - Hq - Hkv, slot % ps, c * VEC + e] = qkv[s, h, c * VEC + e]

    return tir_split_rotary_append.with_attr("global_symbol", "tir_split_rotary_append")
