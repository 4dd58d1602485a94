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


def split_rotary(config: AttentionConfig, schedule: CopySchedule | None = None):
    """Split-rotary PrimFunc, arguments in the contract's order:

    qkv [n, Hq + 2*Hkv, D] (heads: Hq query, then Hkv key, then Hkv value),
    q_rope_position_map [n] i32 (RoPE position of token i), q [n, Hq, D], k [n, Hkv, D],
    v [n, Hkv, D], apply_rope i64 (> 0: rotate q and k; else copy them unchanged).
    v is always a plain copy. One thread per chunk of a head row: copies are vector
    accesses; a rotated chunk is computed element by element and stored as one vector.
    """
    D, Hq, Hkv, dtype = config.head_dim, config.num_qo_heads, config.num_kv_heads, config.dtype
    if config.v_head_dim != D:
        raise ValueError(f"v_head_dim={config.v_head_dim} is not supported by split_rotary: expected head_dim={D}")
    sched = schedule or choose_copy_schedule(config, D)
    sched.check(D)
    L = loop_kinds(config)
    VEC, CH, NT = sched.vector, sched.chunks(D), sched.threads
    H = Hq + 2 * Hkv
    ROW = H * CH  # chunks per token
    theta, scale, scaling = T.float32(config.rope_theta), T.float32(config.rope_scale), config.rope_scaling

    @T.macro
    def rotate_or_copy(dst_, qkv_, s_, h_, dst_h_, c_, pos_, rotate_):
        """dst_[s_, dst_h_, chunk c_] <- chunk c_ of qkv_[s_, h_], rotated to pos_ when rotate_."""
        buf = T.alloc_buffer((VEC,), dtype, scope="local")
        if rotate_:
            for e in L.unroll(VEC):
                buf[e] = T.Cast(dtype, rope_value(lambda i: qkv_[s_, h_, i], c_ * VEC + e, pos_, D, theta, scale, scaling))
        else:
            for e in L.vector(VEC):
                buf[e] = qkv_[s_, h_, c_ * VEC + e]
        for e in L.vector(VEC):
            dst_[s_, dst_h_, c_ * VEC + e] = buf[e]

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
                        rotate_or_copy(q, qkv, s, h, h, c, position_map[s], apply_rope > 0)
                    elif h < Hq + Hkv:
                        rotate_or_copy(k, qkv, s, h, h - Hq, c, position_map[s], apply_rope > 0)
                    else:
                        for e in L.vector(VEC):
                            v[s, h - Hq - Hkv, c * VEC + e] = qkv[s, h, c * VEC + e]

    return tir_split_rotary.with_attr("global_symbol", "tir_split_rotary")
