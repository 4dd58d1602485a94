"""The paged decode PrimFunc of the contract, shared by the decode kernels.

`decode_func(config, kernel)` wraps a kernel macro into the PrimFunc whose parameters, argument
order and global symbol are the contract's (`decode.paged_decode`'s docstring lists them): the
CUDA-core kernel (decode_simt.py) and the tensor-core one (decode_tc.py) differ only in the macro.
`decode_append_func(config, kernel)` is the PrimFunc of tvmattn's own decode with the append
(`decode.paged_decode_append`), which takes the step's qkv instead of q.
"""

from __future__ import annotations

from tvm.script import tirx as T

from .common import length_info_shape
from .config import AttentionConfig


def check_config(config: AttentionConfig, generator: str = "paged_decode") -> None:
    """ValueError unless the decode kernels serve `config`'s head dims (v_head_dim = head_dim)."""
    if config.v_head_dim != config.head_dim:
        raise ValueError(
            f"v_head_dim={config.v_head_dim} is not supported by {generator}: expected head_dim={config.head_dim}"
        )


DECODE_SYMBOL = "batch_decode_paged_kv"


def decode_func(config: AttentionConfig, kernel):
    """The paged decode PrimFunc of the contract (paged_decode's docstring lists its
    parameters) around `kernel`, a macro taking the matched buffers and scalars in order:
    kernel(Q, pages, page_indptr, page_indices, length_info, k_rope_pos_offset,
    q_rope_position, O, lse, rotary_mode, rope_scale, rope_theta, sm_scale)."""
    dtype, ps, D = config.dtype, config.page_size, config.head_dim
    Hq, Hkv, sliding = config.num_qo_heads, config.num_kv_heads, config.sliding_window

    @T.prim_func
    def batch_decode_paged_kv(
        q_handle: T.handle,
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
    ):
        T.func_attr({"tirx.noalias": True})
        B = T.int32()
        num_pages = T.int64()
        nnz_pages = T.int32()
        indptr_offset = T.int32()
        indices_offset = T.int32()
        length_offset = T.int32()
        k_pos_offset = T.int32()
        q_pos_offset = T.int32()
        Q = T.match_buffer(q_handle, (B, Hq, D), dtype)
        # No elem_offset on pages: with one, TVM cannot prove 16-byte alignment and gathers.
        pages = T.match_buffer(pages_handle, (num_pages, 2, Hkv, ps, D), config.page_dtype)
        page_indptr = T.match_buffer(page_indptr_handle, (B + 1,), "int32", elem_offset=indptr_offset)
        page_indices = T.match_buffer(page_indices_handle, (nnz_pages,), "int32", elem_offset=indices_offset)
        length_info = T.match_buffer(length_info_handle, length_info_shape(B, sliding), "int32",
                                     elem_offset=length_offset)
        k_rope_pos_offset = T.match_buffer(k_rope_pos_offset_handle, (B,), "int32", elem_offset=k_pos_offset)
        q_rope_position = T.match_buffer(q_rope_position_handle, (B,), "int32", elem_offset=q_pos_offset)
        O = T.match_buffer(o_handle, (B, Hq, D), dtype)  # noqa: E741 - the contract's name
        lse = T.match_buffer(lse_handle, (B, Hq), "float32")
        kernel(Q, pages, page_indptr, page_indices, length_info, k_rope_pos_offset, q_rope_position, O, lse,
               rotary_mode, rope_scale, rope_theta, sm_scale)

    return batch_decode_paged_kv.with_attr("global_symbol", DECODE_SYMBOL)


DECODE_APPEND_SYMBOL = "tvmattn_decode_append_paged_kv"


def decode_append_func(config: AttentionConfig, kernel):
    """The PrimFunc of the decode with the append (`decode.paged_decode_append`'s docstring lists
    its parameters) around `kernel`, a macro taking the matched buffers and scalars in order:
    kernel(QKV, pages, page_indptr, page_indices, length_info, q_rope_position, append_position,
    O, lse, apply_rope, sm_scale)."""
    dtype, ps, D = config.dtype, config.page_size, config.head_dim
    Hq, Hkv = config.num_qo_heads, config.num_kv_heads

    @T.prim_func
    def decode_append_paged_kv(
        qkv_handle: T.handle,
        pages_handle: T.handle,
        page_indptr_handle: T.handle,
        page_indices_handle: T.handle,
        length_info_handle: T.handle,
        q_rope_position_handle: T.handle,
        append_position_handle: T.handle,
        o_handle: T.handle,
        lse_handle: T.handle,
        apply_rope: T.int64,
        sm_scale: T.float32,
    ):
        T.func_attr({"tirx.noalias": True})
        B = T.int32()
        num_pages = T.int64()
        nnz_pages = T.int32()
        indptr_offset = T.int32()
        indices_offset = T.int32()
        length_offset = T.int32()
        q_pos_offset = T.int32()
        append_offset = T.int32()
        QKV = T.match_buffer(qkv_handle, (B, Hq + 2 * Hkv, D), dtype)
        pages = T.match_buffer(pages_handle, (num_pages, 2, Hkv, ps, D), config.page_dtype)
        page_indptr = T.match_buffer(page_indptr_handle, (B + 1,), "int32", elem_offset=indptr_offset)
        page_indices = T.match_buffer(page_indices_handle, (nnz_pages,), "int32", elem_offset=indices_offset)
        length_info = T.match_buffer(length_info_handle, (B,), "int32", elem_offset=length_offset)
        q_rope_position = T.match_buffer(q_rope_position_handle, (B,), "int32", elem_offset=q_pos_offset)
        append_position = T.match_buffer(append_position_handle, (B,), "int32", elem_offset=append_offset)
        O = T.match_buffer(o_handle, (B, Hq, D), dtype)  # noqa: E741 - the contract's name
        lse = T.match_buffer(lse_handle, (B, Hq), "float32")
        kernel(QKV, pages, page_indptr, page_indices, length_info, q_rope_position, append_position, O, lse,
               apply_rope, sm_scale)

    return decode_append_paged_kv.with_attr("global_symbol", DECODE_APPEND_SYMBOL)
