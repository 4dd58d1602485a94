"""The MLA PrimFuncs of the contract, shared by the MLA decode and prefill kernels.

`decode_contract_func` and `prefill_contract_func` wrap a kernel macro into the PrimFunc whose
parameters, argument order and global symbol are the contract's (`mla.mla_paged_decode` /
`mla.mla_paged_prefill`): the CUDA-core kernel (mla_simt.py) and the tensor-core ones (mla_tc.py,
mla_sm90.py) differ only in the macro.
"""

from __future__ import annotations

from tvm.script import tirx as T

from .config import MLAConfig

DECODE_SYMBOL = "batch_decode_paged_kv_mla"
PREFILL_SYMBOL = "batch_prefill_paged_kv_mla"


def decode_contract_func(config: MLAConfig, split_kernel, num_splits, merge_splits):
    """The contract's MLA decode PrimFunc (`mla_paged_decode`'s arguments and symbol) around a
    kernel body: split_kernel(Q, pages, page_indptr, page_indices, length_info, out, lse, o_part,
    lse_part, sm_scale) writes each (request, head)'s output, or with num_splits(B) > 1 its
    split's FP32 state into the workspace o_part / lse_part, which merge_splits(o_part, lse_part,
    out, lse) then merges (merge_splits None: split_kernel merges them itself, as mla_sm90's decode
    does). Shared by the CUDA-core / CPU kernel and the tensor-core ones."""
    dtype, ps, H, D_QK, D_L = config.dtype, config.page_size, config.num_heads, config.qk_dim, config.latent_dim

    @T.prim_func
    def batch_decode_paged_kv_mla(
        q_handle: T.handle,
        pages_handle: T.handle,
        page_indptr_handle: T.handle,
        page_indices_handle: T.handle,
        length_info_handle: T.handle,
        o_handle: T.handle,
        lse_handle: T.handle,
        sm_scale: T.float32,
    ):
        T.func_attr({"tirx.noalias": True})
        B = T.int32()
        num_pages = T.int64()
        nnz_pages = T.int32()
        indptr_offset = T.int32()
        indices_offset = T.int32()
        length_offset = T.int32()
        Q = T.match_buffer(q_handle, (B, H, D_QK), dtype)
        # No elem_offset on pages: with one, TVM cannot prove 16-byte alignment and gathers.
        pages = T.match_buffer(pages_handle, (num_pages, ps, D_QK), config.page_dtype)
        page_indptr = T.match_buffer(page_indptr_handle, (B + 1,), "int32", elem_offset=indptr_offset)
        page_indices = T.match_buffer(page_indices_handle, (nnz_pages,), "int32", elem_offset=indices_offset)
        length_info = T.match_buffer(length_info_handle, (B,), "int32", elem_offset=length_offset)
        out = T.match_buffer(o_handle, (B, H, D_L), dtype)
        lse = T.match_buffer(lse_handle, (B, H), "float32")
        # Split partials: FP32 output and LSE per split (workspace; unused when one split).
        o_part = T.alloc_buffer((num_splits(B) * B * H * D_L,), "float32")
        lse_part = T.alloc_buffer((num_splits(B) * B * H,), "float32")
        split_kernel(Q, pages, page_indptr, page_indices, length_info, out, lse, o_part, lse_part, sm_scale)
        if merge_splits is not None:
            if num_splits(B) > 1:
                merge_splits(o_part, lse_part, out, lse)  # in FP32, per (request, head)

    return batch_decode_paged_kv_mla.with_attr("global_symbol", DECODE_SYMBOL)


def prefill_contract_func(config: MLAConfig, kernel, align: int = -1):
    """The contract's MLA prefill PrimFunc (`mla_paged_prefill`'s arguments and symbol) around
    kernel(Q, qo_indptr, pages, page_indptr, page_indices, length_info, out, lse, causal,
    sm_scale, B); align: of q and pages (16 for 16-byte copies; -1: TVM's default). Shared by the
    CUDA-core / CPU kernel and mla_sm90's tensor-core one."""
    dtype, ps, H, D_QK, D_L = config.dtype, config.page_size, config.num_heads, config.qk_dim, config.latent_dim

    @T.prim_func
    def batch_prefill_paged_kv_mla(
        q_handle: T.handle,
        qo_indptr_handle: T.handle,
        pages_handle: T.handle,
        page_indptr_handle: T.handle,
        page_indices_handle: T.handle,
        length_info_handle: T.handle,
        o_handle: T.handle,
        lse_handle: T.handle,
        causal: T.int32,
        sm_scale: T.float32,
    ):
        T.func_attr({"tirx.noalias": True})
        B = T.int32()
        total_q = T.int32()
        num_pages = T.int64()
        nnz_pages = T.int32()
        qo_indptr_offset = T.int32()
        indptr_offset = T.int32()
        indices_offset = T.int32()
        length_offset = T.int32()
        Q = T.match_buffer(q_handle, (total_q, H, D_QK), dtype, align=align)
        qo_indptr = T.match_buffer(qo_indptr_handle, (B + 1,), "int32", elem_offset=qo_indptr_offset)
        # No elem_offset on pages: with one, TVM cannot prove 16-byte alignment and gathers.
        pages = T.match_buffer(pages_handle, (num_pages, ps, D_QK), config.page_dtype, align=align)
        page_indptr = T.match_buffer(page_indptr_handle, (B + 1,), "int32", elem_offset=indptr_offset)
        page_indices = T.match_buffer(page_indices_handle, (nnz_pages,), "int32", elem_offset=indices_offset)
        length_info = T.match_buffer(length_info_handle, (B,), "int32", elem_offset=length_offset)
        out = T.match_buffer(o_handle, (total_q, H, D_L), dtype)
        lse = T.match_buffer(lse_handle, (total_q, H), "float32")
        kernel(Q, qo_indptr, pages, page_indptr, page_indices, length_info, out, lse, causal, sm_scale, B)

    return batch_prefill_paged_kv_mla.with_attr("global_symbol", PREFILL_SYMBOL)
