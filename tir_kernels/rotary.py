"""Split of the fused QKV projection into q, k, v, with RoPE applied to q and k.

Rotate-half RoPE over the whole head dim with the config's constant theta and scale and
optional Llama-3 frequency scaling (`common.rope_value`), computed in FP32.

CUDA: one thread per chunk of a head row, each computing the cos and sin of its elements. CPU:
one task per token, which computes the token's head_dim/2 cos and sin values once
(`common.rope_angle`) and rotates every q and k head with them (the per-element cos / sin are
libm calls on the CPU, which dominated a decode step's split when computed per head); the
tokens are a parallel loop only from CPU_PARALLEL_TOKENS on (a parallel region costs a wake-up
of the thread pool, more than a few tokens' work).
"""

from __future__ import annotations

from tvm.script import tirx as T

from .common import loop_kinds, rope_angle, rope_rotate, rope_value
from .config import AttentionConfig
from .kv_quant import write_kv
from .page_ops import num_blocks
from .schedules import CopySchedule, choose_copy_schedule

# CPU: fewer tokens than this are split in a serial loop (a decode step's one token costs less
# than waking the thread pool)
CPU_PARALLEL_TOKENS = 16


def _setup(config: AttentionConfig, schedule: CopySchedule | None, generator: str):
    """(D, Hq, Hkv, dtype, copy schedule, loop kinds) of a split generator."""
    D = config.head_dim
    if config.v_head_dim != D:
        raise ValueError(f"v_head_dim={config.v_head_dim} is not supported by {generator}: expected head_dim={D}")
    sched = schedule or choose_copy_schedule(config, D)
    sched.check(D)
    return D, config.num_qo_heads, config.num_kv_heads, config.dtype, sched, loop_kinds(config)


def _rotate_or_copy_macro(config: AttentionConfig, sched: CopySchedule, L, vector_store: bool = True):
    """rotate_or_copy; vector_store=False stores element by element (a store that quantizes to
    FP8: TVM's CUDA vectorizer has no lanes of its integer arithmetic)."""
    D, dtype, VEC = config.head_dim, config.dtype, sched.vector
    store_loop = L.vector if vector_store else L.unroll
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
        for e in store_loop(VEC):
            store_(e, buf[e])

    return rotate_or_copy


def _cpu_tokens_macro(config: AttentionConfig):
    """CPU: tokens(n_, qkv_, positions_, rotate_, store_q_, store_k_, store_v_, keep_kv_) moves
    the heads of each token s of qkv_ [n_, Hq + 2*Hkv, D]: query heads to store_q_(s, h, d,
    value), key heads to store_k_ and value heads to store_v_ (only where keep_kv_(s)), q and k
    rotated to positions_[s] (where rotate_) with one table of cos / sin per token. The tokens
    are a parallel loop from CPU_PARALLEL_TOKENS on, else a serial one."""
    D, Hq, Hkv, dtype = config.head_dim, config.num_qo_heads, config.num_kv_heads, config.dtype
    half = D // 2
    theta, scale, scaling = T.float32(config.rope_theta), T.float32(config.rope_scale), config.rope_scaling

    @T.macro
    def heads(store_, qkv_, s_, first_, count_, cos_, sin_, rotate_):
        for h in T.serial(count_):
            if rotate_:
                for j in T.vectorized(half):
                    store_(s_, h, j, T.Cast(dtype, rope_rotate(lambda i: qkv_[s_, first_ + h, i], j, cos_[j], sin_[j],
                                                               D)))
                    store_(s_, h, j + half, T.Cast(dtype, rope_rotate(lambda i: qkv_[s_, first_ + h, i], j + half,
                                                                      cos_[j], sin_[j], D)))
            else:
                for d in T.vectorized(D):
                    store_(s_, h, d, qkv_[s_, first_ + h, d])

    @T.macro
    def token(s_, qkv_, positions_, rotate_, store_q_, store_k_, store_v_, keep_kv_):
        cos_t = T.alloc_buffer((half,), "float32")  # (on the stack: common.CPU_SCRATCH_SCOPE)
        sin_t = T.alloc_buffer((half,), "float32")
        if rotate_:
            for j in T.serial(half):
                angle = rope_angle(j, positions_[s_], D, theta, scale, scaling)
                cos_t[j] = T.cos(angle)
                sin_t[j] = T.sin(angle)
        heads(store_q_, qkv_, s_, 0, Hq, cos_t, sin_t, rotate_)
        if keep_kv_(s_):
            heads(store_k_, qkv_, s_, Hq, Hkv, cos_t, sin_t, rotate_)
            heads(store_v_, qkv_, s_, Hq + Hkv, Hkv, cos_t, sin_t, False)

    @T.macro
    def tokens(n_, qkv_, positions_, rotate_, store_q_, store_k_, store_v_, keep_kv_):
        if n_ >= CPU_PARALLEL_TOKENS:
            for s in T.parallel(n_):
                token(s, qkv_, positions_, rotate_, store_q_, store_k_, store_v_, keep_kv_)
        else:
            for s in T.serial(n_):
                token(s, qkv_, positions_, rotate_, store_q_, store_k_, store_v_, keep_kv_)

    return tokens


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
    cpu_tokens = _cpu_tokens_macro(config)

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
        if not L.gpu:
            cpu_tokens(n, qkv, position_map, apply_rope > 0, lambda s, h, d, val: T.buffer_store(q, val, [s, h, d]),
                       lambda s, h, d, val: T.buffer_store(k, val, [s, h, d]),
                       lambda s, h, d, val: T.buffer_store(v, val, [s, h, d]), lambda s: True)
        else:
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
    FP8 pages (config.kv_dtype) store the code of the (rotated) value / scale (kv_quant.write_kv).
    """
    D, Hq, Hkv, dtype, sched, L = _setup(config, schedule, "split_rotary_append")
    VEC, CH, NT, ps = sched.vector, sched.chunks(D), sched.threads, config.page_size
    H = Hq + 2 * Hkv
    ROW = H * CH  # chunks per token
    rotate_or_copy = _rotate_or_copy_macro(config, sched, L)
    rotate_or_copy_k = _rotate_or_copy_macro(config, sched, L, vector_store=not config.kv_fp8)
    v_loop = L.unroll if config.kv_fp8 else L.vector
    cpu_tokens = _cpu_tokens_macro(config)

    def slot_of(slot, kv, h, d):
        """The page index of element d of head h of K (kv 0) or V (kv 1) in page slot `slot`."""
        return [slot // ps, kv, h, slot % ps, d]

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
        pages = T.match_buffer(pages_handle, (num_pages, 2, Hkv, ps, D), config.page_dtype)
        append_map = T.match_buffer(append_position_map_handle, (n,), "int32", elem_offset=map_offset)
        if not L.gpu:
            cpu_tokens(n, qkv, position_map, apply_rope > 0, lambda s, h, d, val: T.buffer_store(q, val, [s, h, d]),
                       lambda s, h, d, val: T.buffer_store(pages, write_kv(config, pages, 0, h, val),
                                                           slot_of(append_map[s], 0, h, d)),
                       lambda s, h, d, val: T.buffer_store(pages, write_kv(config, pages, 1, h, val),
                                                           slot_of(append_map[s], 1, h, d)),
                       lambda s: append_map[s] >= 0)
        else:
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
                                rotate_or_copy_k(lambda e, val: T.buffer_store(
                                    pages, write_kv(config, pages, 0, h - Hq, val),
                                    [slot // ps, 0, h - Hq, slot % ps, c * VEC + e]),
                                    qkv, s, h, c, position_map[s], apply_rope > 0)
                        elif slot >= 0:
                            for e in v_loop(VEC):
                                pages[slot // ps, 1, h - Hq - Hkv, slot % ps, c * VEC + e] = write_kv(
                                    config, pages, 1, h - Hq - Hkv, qkv[s, h, c * VEC + e])

    return tir_split_rotary_append.with_attr("global_symbol", "tir_split_rotary_append")
