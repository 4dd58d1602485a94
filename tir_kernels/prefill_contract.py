"""The two prefill PrimFuncs of the attention-backend contract, written once.

`paged_prefill` / `ragged_prefill` have three implementations (the CUDA-core kernel in
prefill_simt.py, the sm_80 mma.sync kernel in prefill_sm80.py, the Hopper wgmma kernel in
prefill_sm90.py). Each supplies a `kernel` macro; the functions here wrap it in the PrimFunc
with the contract's parameters (their docstrings list them), buffer matching and global
symbol, so the signature lives in one place.

The macro takes the matched buffers and scalars in the PrimFunc's order:
  paged:  kernel(Q, qo_indptr, pages, page_indptr, page_indices, length_info,
                 k_rope_pos_offset, q_rope_position, O, lse, causal, rotary, rope_scale,
                 rope_theta, sm_scale)
  ragged: kernel(Q, qo_indptr, K, V, kv_indptr, q_rope_position, k_rope_pos_offset, O, lse,
                 causal, rotary, rope_scale, rope_theta, sm_scale)
`rotary` is a Python bool when `rope_on_host` (the PrimFunc then holds two variants of the
kernel and picks one on the host from rotary_mode), else the run-time rotary_mode itself.
"""

from __future__ import annotations

from tvm.script import tirx as T

from .common import length_info_shape
from .config import AttentionConfig
from .masks import TreeMasks

DEFAULT_ALIGN = -1  # T.match_buffer's default


def paged_symbol(config: AttentionConfig) -> str:
    return "batch_prefill_paged_kv" + ("_sliding_window" if config.sliding_window else "")


RAGGED_SYMBOL = "batch_prefill_ragged_kv"


def paged_prefill_func(config: AttentionConfig, kernel, *, rope_on_host: bool = True, align: int = DEFAULT_ALIGN):
    """The paged prefill PrimFunc around `kernel` (see the module docstring)."""
    dtype, ps, D = config.dtype, config.page_size, config.head_dim
    Hq, Hkv, sliding = config.num_qo_heads, config.num_kv_heads, config.sliding_window

    @T.prim_func
    def batch_prefill_paged_kv(
        q_handle: T.handle,
        qo_indptr_handle: T.handle,
        pages_handle: T.handle,
        page_indptr_handle: T.handle,
        page_indices_handle: T.handle,
        length_info_handle: T.handle,
        k_rope_pos_offset_handle: T.handle,
        q_rope_position_handle: T.handle,
        o_handle: T.handle,
        lse_handle: T.handle,
        causal: T.int32,
        rotary_mode: T.int32,
        rope_scale: T.float32,
        rope_theta: T.float32,
        sm_scale: T.float32,
    ):
        T.func_attr({"tirx.noalias": True})
        B = T.int32()
        total_q = T.int32()
        num_pages = T.int64()
        nnz_pages = T.int32()
        qo_indptr_offset = T.int32()
        page_indptr_offset = T.int32()
        page_indices_offset = T.int32()
        length_offset = T.int32()
        k_pos_offset = T.int32()
        q_pos_offset = T.int32()
        Q = T.match_buffer(q_handle, (total_q, Hq, D), dtype, align=align)
        qo_indptr = T.match_buffer(qo_indptr_handle, (B + 1,), "int32", elem_offset=qo_indptr_offset)
        # No elem_offset on pages: with one, TVM cannot prove 16-byte alignment and gathers.
        pages = T.match_buffer(pages_handle, (num_pages, 2, Hkv, ps, D), config.page_dtype, align=align)
        page_indptr = T.match_buffer(page_indptr_handle, (B + 1,), "int32", elem_offset=page_indptr_offset)
        page_indices = T.match_buffer(page_indices_handle, (nnz_pages,), "int32", elem_offset=page_indices_offset)
        length_info = T.match_buffer(length_info_handle, length_info_shape(B, sliding), "int32",
                                     elem_offset=length_offset)
        k_rope_pos_offset = T.match_buffer(k_rope_pos_offset_handle, (B,), "int32", elem_offset=k_pos_offset)
        q_rope_position = T.match_buffer(q_rope_position_handle, (total_q,), "int32", elem_offset=q_pos_offset)
        O = T.match_buffer(o_handle, (total_q, Hq, D), dtype)
        lse = T.match_buffer(lse_handle, (total_q, Hq), "float32")
        if rope_on_host:
            if rotary_mode == 1:
                kernel(Q, qo_indptr, pages, page_indptr, page_indices, length_info, k_rope_pos_offset,
                       q_rope_position, O, lse, causal, True, rope_scale, rope_theta, sm_scale)
            else:
                kernel(Q, qo_indptr, pages, page_indptr, page_indices, length_info, k_rope_pos_offset,
                       q_rope_position, O, lse, causal, False, rope_scale, rope_theta, sm_scale)
        else:
            kernel(Q, qo_indptr, pages, page_indptr, page_indices, length_info, k_rope_pos_offset, q_rope_position,
                   O, lse, causal, rotary_mode, rope_scale, rope_theta, sm_scale)

    return batch_prefill_paged_kv.with_attr("global_symbol", paged_symbol(config))


def ragged_prefill_func(config: AttentionConfig, kernel, *, rope_on_host: bool = True, align: int = DEFAULT_ALIGN):
    """The ragged prefill PrimFunc around `kernel` (see the module docstring)."""
    dtype, D_QK, D_V = config.dtype, config.head_dim, config.v_head_dim
    Hq, Hkv = config.num_qo_heads, config.num_kv_heads

    @T.prim_func
    def batch_prefill_ragged_kv(
        q_handle: T.handle,
        qo_indptr_handle: T.handle,
        k_handle: T.handle,
        v_handle: T.handle,
        kv_indptr_handle: T.handle,
        q_rope_position_handle: T.handle,
        k_rope_pos_offset_handle: T.handle,
        o_handle: T.handle,
        lse_handle: T.handle,
        causal: T.int32,
        rotary_mode: T.int32,
        rope_scale: T.float32,
        rope_theta: T.float32,
        sm_scale: T.float32,
    ):
        T.func_attr({"tirx.noalias": True})
        B = T.int32()
        total_q = T.int32()
        total_kv = T.int32()
        qo_indptr_offset = T.int32()
        kv_indptr_offset = T.int32()
        q_pos_offset = T.int32()
        k_pos_offset = T.int32()
        Q = T.match_buffer(q_handle, (total_q, Hq, D_QK), dtype, align=align)
        qo_indptr = T.match_buffer(qo_indptr_handle, (B + 1,), "int32", elem_offset=qo_indptr_offset)
        K = T.match_buffer(k_handle, (total_kv, Hkv, D_QK), dtype, align=align)
        V = T.match_buffer(v_handle, (total_kv, Hkv, D_V), dtype, align=align)
        kv_indptr = T.match_buffer(kv_indptr_handle, (B + 1,), "int32", elem_offset=kv_indptr_offset)
        q_rope_position = T.match_buffer(q_rope_position_handle, (total_q,), "int32", elem_offset=q_pos_offset)
        k_rope_pos_offset = T.match_buffer(k_rope_pos_offset_handle, (B,), "int32", elem_offset=k_pos_offset)
        O = T.match_buffer(o_handle, (total_q, Hq, D_V), dtype)
        lse = T.match_buffer(lse_handle, (total_q, Hq), "float32")
        if rope_on_host:
            if rotary_mode == 1:
                kernel(Q, qo_indptr, K, V, kv_indptr, q_rope_position, k_rope_pos_offset, O, lse, causal, True,
                       rope_scale, rope_theta, sm_scale)
            else:
                kernel(Q, qo_indptr, K, V, kv_indptr, q_rope_position, k_rope_pos_offset, O, lse, causal, False,
                       rope_scale, rope_theta, sm_scale)
        else:
            kernel(Q, qo_indptr, K, V, kv_indptr, q_rope_position, k_rope_pos_offset, O, lse, causal, rotary_mode,
                   rope_scale, rope_theta, sm_scale)

    return batch_prefill_ragged_kv.with_attr("global_symbol", RAGGED_SYMBOL)


TREE_PAGED_SYMBOL = "tree_attn_paged_kv"
TREE_ROPE_MESSAGE = "rotary_mode=1: tree attention takes keys cached rotated (as TVM's tree kernels do)"


def tree_paged_prefill_func(config: AttentionConfig, kernel):
    """The token-tree paged prefill PrimFunc (TVM's `tree_attn_paged_kv` arguments) around a
    paged `kernel` macro, which gets `masks.TreeMasks` in place of the causal flag:

    q [total_q, Hq, D], qo_indptr [B+1], pages [P, 2, Hkv, page_size, D], page_indptr [B+1],
    page_indices [nnz], length_info [B], k_rope_pos_offset [B], q_rope_position [total_q],
    o [total_q, Hq, D], lse [total_q, Hq] f32, rotary_mode i32 (must be 0), rope_scale f32,
    rope_theta f32, sm_scale f32, tree_attn_mn_indptr [B+1] i32,
    tree_attn_mask [total_nodes, 2] i32 (each node's DFS interval).
    """
    dtype, ps, D = config.dtype, config.page_size, config.head_dim
    Hq, Hkv = config.num_qo_heads, config.num_kv_heads

    @T.prim_func
    def tree_attn_paged_kv(
        q_handle: T.handle,
        qo_indptr_handle: T.handle,
        pages_handle: T.handle,
        page_indptr_handle: T.handle,
        page_indices_handle: T.handle,
        length_info_handle: T.handle,
        k_rope_pos_offset_handle: T.handle,
        q_rope_position_handle: T.handle,
        o_handle: T.handle,
        lse_handle: T.handle,
        rotary_mode: T.int32,
        rope_scale: T.float32,
        rope_theta: T.float32,
        sm_scale: T.float32,
        tree_attn_mn_indptr_handle: T.handle,
        tree_attn_mask_handle: T.handle,
    ):
        T.func_attr({"tirx.noalias": True})
        B = T.int32()
        total_q = T.int32()
        num_pages = T.int64()
        nnz_pages = T.int32()
        total_nodes = T.int32()
        qo_indptr_offset = T.int32()
        page_indptr_offset = T.int32()
        page_indices_offset = T.int32()
        length_offset = T.int32()
        k_pos_offset = T.int32()
        q_pos_offset = T.int32()
        mn_indptr_offset = T.int32()
        mask_offset = T.int32()
        Q = T.match_buffer(q_handle, (total_q, Hq, D), dtype)
        qo_indptr = T.match_buffer(qo_indptr_handle, (B + 1,), "int32", elem_offset=qo_indptr_offset)
        pages = T.match_buffer(pages_handle, (num_pages, 2, Hkv, ps, D), config.page_dtype)
        page_indptr = T.match_buffer(page_indptr_handle, (B + 1,), "int32", elem_offset=page_indptr_offset)
        page_indices = T.match_buffer(page_indices_handle, (nnz_pages,), "int32", elem_offset=page_indices_offset)
        length_info = T.match_buffer(length_info_handle, (B,), "int32", elem_offset=length_offset)
        k_rope_pos_offset = T.match_buffer(k_rope_pos_offset_handle, (B,), "int32", elem_offset=k_pos_offset)
        q_rope_position = T.match_buffer(q_rope_position_handle, (total_q,), "int32", elem_offset=q_pos_offset)
        O = T.match_buffer(o_handle, (total_q, Hq, D), dtype)
        lse = T.match_buffer(lse_handle, (total_q, Hq), "float32")
        mn_indptr = T.match_buffer(tree_attn_mn_indptr_handle, (B + 1,), "int32", elem_offset=mn_indptr_offset)
        tree_mask = T.match_buffer(tree_attn_mask_handle, (total_nodes, 2), "int32", elem_offset=mask_offset)
        T.Assert(rotary_mode == 0, TREE_ROPE_MESSAGE)
        kernel(Q, qo_indptr, pages, page_indptr, page_indices, length_info, k_rope_pos_offset, q_rope_position, O,
               lse, TreeMasks(mn_indptr, tree_mask), False, rope_scale, rope_theta, sm_scale)

    return tree_attn_paged_kv.with_attr("global_symbol", TREE_PAGED_SYMBOL)


TREE_RAGGED_SYMBOL = "batch_tree_attn"


def tree_ragged_prefill_func(config: AttentionConfig, kernel):
    """The token-tree ragged prefill PrimFunc (TVM's `batch_tree_attn` arguments) around a
    ragged `kernel` macro, which gets `masks.TreeMasks` in place of the causal flag:

    q [total_q, Hq, Dqk], qo_indptr [B+1], k [total_kv, Hkv, Dqk], v [total_kv, Hkv, Dv],
    kv_indptr [B+1], q_rope_position [total_q], tree_attn_mn_indptr [B+1] i32,
    tree_attn_mask [total_nodes, 2] i32, o [total_q, Hq, Dv], lse [total_q, Hq] f32,
    rotary_mode i32 (must be 0), rope_scale f32, rope_theta f32, sm_scale f32.
    """
    dtype, D_QK, D_V = config.dtype, config.head_dim, config.v_head_dim
    Hq, Hkv = config.num_qo_heads, config.num_kv_heads

    @T.prim_func
    def batch_tree_attn(
        q_handle: T.handle,
        qo_indptr_handle: T.handle,
        k_handle: T.handle,
        v_handle: T.handle,
        kv_indptr_handle: T.handle,
        q_rope_position_handle: T.handle,
        tree_attn_mn_indptr_handle: T.handle,
        tree_attn_mask_handle: T.handle,
        o_handle: T.handle,
        lse_handle: T.handle,
        rotary_mode: T.int32,
        rope_scale: T.float32,
        rope_theta: T.float32,
        sm_scale: T.float32,
    ):
        T.func_attr({"tirx.noalias": True})
        B1 = T.int32()  # batch size + 1: no [B] argument here defines the batch size itself
        total_q = T.int32()
        total_kv = T.int32()
        total_nodes = T.int32()
        qo_indptr_offset = T.int32()
        kv_indptr_offset = T.int32()
        q_pos_offset = T.int32()
        mn_indptr_offset = T.int32()
        mask_offset = T.int32()
        Q = T.match_buffer(q_handle, (total_q, Hq, D_QK), dtype)
        qo_indptr = T.match_buffer(qo_indptr_handle, (B1,), "int32", elem_offset=qo_indptr_offset)
        K = T.match_buffer(k_handle, (total_kv, Hkv, D_QK), dtype)
        V = T.match_buffer(v_handle, (total_kv, Hkv, D_V), dtype)
        kv_indptr = T.match_buffer(kv_indptr_handle, (B1,), "int32", elem_offset=kv_indptr_offset)
        q_rope_position = T.match_buffer(q_rope_position_handle, (total_q,), "int32", elem_offset=q_pos_offset)
        mn_indptr = T.match_buffer(tree_attn_mn_indptr_handle, (B1,), "int32", elem_offset=mn_indptr_offset)
        tree_mask = T.match_buffer(tree_attn_mask_handle, (total_nodes, 2), "int32", elem_offset=mask_offset)
        O = T.match_buffer(o_handle, (total_q, Hq, D_V), dtype)
        lse = T.match_buffer(lse_handle, (total_q, Hq), "float32")
        # The ragged kernel reads the batch size, and (for RoPE, off here) each request's key
        # position offset, from a [B] buffer; the first B entries of kv_indptr serve as one.
        batch_view = T.decl_buffer((B1 - 1,), "int32", data=kv_indptr.data, elem_offset=kv_indptr_offset)
        T.Assert(rotary_mode == 0, TREE_ROPE_MESSAGE)
        kernel(Q, qo_indptr, K, V, kv_indptr, q_rope_position, batch_view, O, lse, TreeMasks(mn_indptr, tree_mask),
               False, rope_scale, rope_theta, sm_scale)

    return batch_tree_attn.with_attr("global_symbol", TREE_RAGGED_SYMBOL)
