"""Attention backends: how the cache calls an attention kernel, mirroring TVM's attn_backend.h.

One class per kernel role (paged prefill, ragged prefill, paged decode, tree-mask paged and
ragged prefill), each with `mha(...)`, `mla(...)` and a `begin_forward(...)` plan step, in two
flavours:
- TIR (`["tir", f]` or `["tirx", f]`, or a bare function): `f` is a compiled kernel with the
  contract's arguments (docs/interface.md); `mha`/`mla` call it in that order and
  `begin_forward` does nothing.
- FlashInfer (`["flashinfer", run, plan(, qk_head_dim, v_head_dim)]`): not available yet; the
  constructor raises KVCacheError.

The method arguments follow attn_backend.h (without the CUDA stream): note that `mha` of the
paged and ragged prefill takes `q_rope_position` before `k_rope_pos_offset`, while the kernels
take them the other way round.

`backend_from_spec(spec, role)` converts a spec for one role; `[]` or None means the role is
not provided (returns None).
"""

from __future__ import annotations

import enum

from .errors import KVCacheError


class RopeMode(enum.IntEnum):
    """Where RoPE is applied (TVM's RoPEMode): NONE never; NORMAL by split_rotary before the
    K/V are cached; INLINE inside the attention kernels (rotary_mode = 1), K cached unrotated."""

    NONE = 0
    NORMAL = 1
    INLINE = 2

    @classmethod
    def parse(cls, value) -> "RopeMode":
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        if isinstance(value, int) and not isinstance(value, bool) and value in cls._value2member_map_:
            return cls(value)
        raise KVCacheError(f'rope_mode must be "none", "normal" or "inline" (or 0, 1, 2), got {value!r}')


class AttnBackend:
    """A kernel of one role; `kind` is "tir" or "flashinfer"."""

    kind = "tir"

    def __init__(self, func):
        self.func = func

    def _unsupported(self, what: str):
        raise KVCacheError(f"{type(self).__name__}: {what} is not supported by this backend")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.func!r})"


class PagedPrefill(AttnBackend):
    """Prefill attention of packed queries over paged K/V."""

    def mha(self, depth, q, qo_indptr, pages, page_indptr, page_indices, length_info, q_rope_position,
            k_rope_pos_offset, causal, rope_mode, rotary_scale, rotary_theta, sm_scale, attn_output, attn_lse):
        self._unsupported("MHA")

    def mla(self, depth, q, qo_indptr, pages, page_indptr, page_indices, length_info, causal, sm_scale,
            attn_output, attn_lse):
        self._unsupported("MLA")

    def begin_forward(self, depth, qo_indptr, page_indptr, last_page_len, batch_size, total_qo_len, page_size,
                      num_qo_heads, num_kv_heads, qk_head_dim, v_head_dim, causal):
        """Plan step (host arrays are numpy int32); nothing to do for TIR kernels."""


class TIRPagedPrefill(PagedPrefill):
    def mha(self, depth, q, qo_indptr, pages, page_indptr, page_indices, length_info, q_rope_position,
            k_rope_pos_offset, causal, rope_mode, rotary_scale, rotary_theta, sm_scale, attn_output, attn_lse):
        self.func(q, qo_indptr, pages, page_indptr, page_indices, length_info, k_rope_pos_offset, q_rope_position,
                  attn_output, attn_lse, int(causal), int(rope_mode == RopeMode.INLINE), rotary_scale, rotary_theta,
                  sm_scale)

    def mla(self, depth, q, qo_indptr, pages, page_indptr, page_indices, length_info, causal, sm_scale,
            attn_output, attn_lse):
        self.func(q, qo_indptr, pages, page_indptr, page_indices, length_info, attn_output, attn_lse, int(causal),
                  sm_scale)


class RaggedPrefill(AttnBackend):
    """Prefill attention of packed queries over packed (ragged) K/V."""

    def mha(self, q, k, v, qo_indptr, kv_indptr, q_rope_position, k_rope_pos_offset, causal, rope_mode,
            rotary_scale, rotary_theta, sm_scale, attn_output, attn_lse):
        self._unsupported("MHA")

    def begin_forward(self, qo_indptr, kv_indptr, batch_size, total_qo_len, num_qo_heads, num_kv_heads,
                      qk_head_dim, v_head_dim, causal):
        """Plan step (host arrays are numpy int32); nothing to do for TIR kernels."""


class TIRRaggedPrefill(RaggedPrefill):
    def mha(self, q, k, v, qo_indptr, kv_indptr, q_rope_position, k_rope_pos_offset, causal, rope_mode,
            rotary_scale, rotary_theta, sm_scale, attn_output, attn_lse):
        self.func(q, qo_indptr, k, v, kv_indptr, q_rope_position, k_rope_pos_offset, attn_output, attn_lse,
                  int(causal), int(rope_mode == RopeMode.INLINE), rotary_scale, rotary_theta, sm_scale)


class PagedDecode(AttnBackend):
    """Decode attention (one query token per request) over paged K/V."""

    def mha(self, depth, q, pages, page_indptr, page_indices, length_info, k_rope_pos_offset, q_rope_position,
            rope_mode, rotary_scale, rotary_theta, sm_scale, attn_output, attn_lse):
        self._unsupported("MHA")

    def mla(self, depth, q, pages, page_indptr, page_indices, length_info, sm_scale, attn_output, attn_lse):
        self._unsupported("MLA")

    def begin_forward(self, depth, page_indptr, batch_size, page_size, num_qo_heads, num_kv_heads, qk_head_dim,
                      v_head_dim, rope_mode, q_dtype, kv_dtype):
        """Plan step (host arrays are numpy int32); nothing to do for TIR kernels."""


class TIRPagedDecode(PagedDecode):
    def mha(self, depth, q, pages, page_indptr, page_indices, length_info, k_rope_pos_offset, q_rope_position,
            rope_mode, rotary_scale, rotary_theta, sm_scale, attn_output, attn_lse):
        self.func(q, pages, page_indptr, page_indices, length_info, k_rope_pos_offset, q_rope_position,
                  attn_output, attn_lse, int(rope_mode == RopeMode.INLINE), rotary_scale, rotary_theta, sm_scale)

    def mla(self, depth, q, pages, page_indptr, page_indices, length_info, sm_scale, attn_output, attn_lse):
        self.func(q, pages, page_indptr, page_indices, length_info, attn_output, attn_lse, sm_scale)


class PagedPrefillTreeMask(AttnBackend):
    """Token-tree attention over paged K/V (a node sees the history and its ancestors)."""

    def mha(self, q, qo_indptr, pages, page_indptr, page_indices, length_info, k_rope_pos_offset,
            q_rope_position, tree_attn_mn_indptr, tree_attn_mask, rope_mode, rotary_scale, rotary_theta,
            sm_scale, attn_output, attn_lse):
        self._unsupported("MHA")

    def mla(self, q, qo_indptr, pages, page_indptr, page_indices, length_info, tree_attn_mn_indptr,
            tree_attn_mask, sm_scale, attn_output, attn_lse):
        self._unsupported("MLA")

    def begin_forward(self, page_indptr, last_page_len, qo_indptr, batch_size, page_size, num_qo_heads,
                      num_kv_heads, qk_head_dim, v_head_dim, rope_mode):
        """Plan step; nothing to do for TIR kernels."""


class TIRPagedPrefillTreeMask(PagedPrefillTreeMask):
    def mha(self, q, qo_indptr, pages, page_indptr, page_indices, length_info, k_rope_pos_offset,
            q_rope_position, tree_attn_mn_indptr, tree_attn_mask, rope_mode, rotary_scale, rotary_theta,
            sm_scale, attn_output, attn_lse):
        self.func(q, qo_indptr, pages, page_indptr, page_indices, length_info, k_rope_pos_offset, q_rope_position,
                  attn_output, attn_lse, int(rope_mode == RopeMode.INLINE), rotary_scale, rotary_theta, sm_scale,
                  tree_attn_mn_indptr, tree_attn_mask)


class RaggedPrefillTreeMask(AttnBackend):
    """Token-tree attention over packed K/V (the nodes of this forward)."""

    def mha(self, q, k, v, qo_indptr, kv_indptr, q_rope_position, tree_attn_mn_indptr, tree_attn_mask,
            rope_mode, rotary_scale, rotary_theta, sm_scale, attn_output, attn_lse):
        self._unsupported("MHA")

    def mla(self, q, compressed_kv, k_pe, qo_indptr, kv_indptr, tree_attn_mn_indptr, tree_attn_mask, sm_scale,
            attn_output, attn_lse):
        self._unsupported("MLA")

    def begin_forward(self, page_indptr, last_page_len, qo_indptr, batch_size, page_size, num_qo_heads,
                      num_kv_heads, qk_head_dim, v_head_dim, rope_mode):
        """Plan step; nothing to do for TIR kernels."""


class TIRRaggedPrefillTreeMask(RaggedPrefillTreeMask):
    def mha(self, q, k, v, qo_indptr, kv_indptr, q_rope_position, tree_attn_mn_indptr, tree_attn_mask,
            rope_mode, rotary_scale, rotary_theta, sm_scale, attn_output, attn_lse):
        self.func(q, qo_indptr, k, v, kv_indptr, q_rope_position, tree_attn_mn_indptr, tree_attn_mask,
                  attn_output, attn_lse, int(rope_mode == RopeMode.INLINE), rotary_scale, rotary_theta, sm_scale)


class _FlashInfer:
    """Mixin of the FlashInfer flavour: not available yet."""

    kind = "flashinfer"

    def __init__(self, run, plan, qk_head_dim: int = -1, v_head_dim: int = -1):
        raise KVCacheError(
            f"FlashInfer backend is not available yet ({type(self).__name__}); give a TIR kernel "
            '(["tirx", f]) or leave the slot empty to use tvmattn\'s own'
        )


class FlashInferPagedPrefill(_FlashInfer, PagedPrefill):
    pass


class FlashInferRaggedPrefill(_FlashInfer, RaggedPrefill):
    pass


class FlashInferPagedDecode(_FlashInfer, PagedDecode):
    pass


# role -> (TIR flavour, FlashInfer flavour or None). TVM has no FlashInfer tree-mask kernels.
FLAVOURS = {
    PagedPrefill: (TIRPagedPrefill, FlashInferPagedPrefill),
    RaggedPrefill: (TIRRaggedPrefill, FlashInferRaggedPrefill),
    PagedDecode: (TIRPagedDecode, FlashInferPagedDecode),
    PagedPrefillTreeMask: (TIRPagedPrefillTreeMask, None),
    RaggedPrefillTreeMask: (TIRRaggedPrefillTreeMask, None),
}


def backend_from_spec(spec, role: type) -> AttnBackend | None:
    """A backend of `role` (one of the FLAVOURS keys) from a spec.

    spec: None or [] (not provided: returns None); a function (TIR); ["tir" | "tirx", f];
    ["flashinfer", run, plan(, qk_head_dim, v_head_dim)]; or a backend of that role already.
    """
    if role not in FLAVOURS:
        raise KVCacheError(f"role must be one of {[r.__name__ for r in FLAVOURS]}, got {role!r}")
    tir, flashinfer = FLAVOURS[role]
    if spec is None:
        return None
    if isinstance(spec, role):
        return spec
    if isinstance(spec, AttnBackend):
        raise KVCacheError(f"a {role.__name__} backend is needed here, got {type(spec).__name__}")
    if callable(spec):
        return tir(spec)
    try:
        items = list(spec)
    except TypeError:
        raise KVCacheError(f"a {role.__name__} spec must be [], a function or a list, got {spec!r}") from None
    if not items:
        return None
    tag = str(items[0])
    if tag in ("tir", "tirx") and len(items) == 2 and callable(items[1]):
        return tir(items[1])
    if tag == "flashinfer" and flashinfer is not None and len(items) in (3, 5):
        return flashinfer(*items[1:])
    raise KVCacheError(
        f'a {role.__name__} spec must be [], ["tir" | "tirx", f] or ["flashinfer", run, plan(, qk_head_dim, '
        f"v_head_dim)], got {spec!r}"
    )
