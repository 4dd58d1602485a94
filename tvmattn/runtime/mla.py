"""MLA layers of the cache: their kernels and the launches of their per-layer calls.

An MLA cache (every layer AttnKind.MLA) keeps one latent row per token, shared by all heads:
pages [num_pages, page_size, qk_head_dim] with qk_head_dim = d_latent + d_rope and
v_head_dim = d_latent (TVM's layout and head dims). The model calls, per layer, as TVM's cache
serves DeepSeek in MLC-LLM:
- append_mla_kv(kv [n, qk_head_dim]): the step's rows into their page slots;
- self_attention(q [n, H, d_qk'], k [n, H, d_qk'], v [n, H, d_v'], o [n, H, d_v'], lse): causal
  ragged prefill among the step's tokens at the model's own (not absorbed) head dims, e.g.
  192 / 128; no RoPE in the kernel;
- cross_attention(q [n, H, qk_head_dim], o [n, H, d_latent], lse): absorbed queries over the
  cached rows, no mask: in a decode step (every sequence appends one token) over the history
  and the step's rows (appended first, as TVM's cache plans decode steps), in other steps over
  the history only; cascade levels run as for MHA and merge at the latent width;
- merge_attn_output_inplace(o1, lse1, o2, lse2) at the self-attention's value width.

Kernels (`mla_kernel_set`): tir_kernels' MLA paged prefill and decode (the tensor-core decode of
mla_tc.py on CUDA sm_80+ for float16/bfloat16, else mla.py's; on sm_90 also mla_sm90's wgmma
decode, `ChosenMLADecode` picking one of the two per call), MLA page operations,
merge at the latent width; the self-attention's ragged prefill and the output merge are built
for the dims of the first call that needs them (once per process), unless the caller's kernels
fill those slots (a model library's, through TVM's create call).
"""

from __future__ import annotations

import dataclasses
import functools

import tir_kernels
from tir_kernels import AttentionConfig, MLAConfig
from tir_kernels.mla import choose_mla_decode_kernel, mla_paged_decode_auto
from tir_kernels.mla_sm90 import mla_paged_decode_wgmma, mla_wgmma_decode_problem

from .backends import PagedDecode, PagedPrefill, RaggedPrefill, RopeMode, TIRPagedDecode, backend_from_spec
from .errors import KVCacheError, check
from .forward import Step
from .kernels import KernelSet, _build, check_slot_names

# slot -> (generator, extra arguments): the MLA cache's kernels built from its MLAConfig.
_MLA_GENERATORS = {
    "transpose_append_mla": tir_kernels.mla_transpose_append,
    "prefill_paged_mla": tir_kernels.mla_paged_prefill,
    "decode_paged_mla": mla_paged_decode_auto,
    "merge_state": tir_kernels.merge_state,
    "copy_single_page": tir_kernels.mla_copy_single_page,
    "debug_get_kv": tir_kernels.mla_debug_get_kv,
}
MLA_ATTENTION_SLOTS = ("prefill_paged_mla", "decode_paged_mla")
# MHA-only slots an MLA cache never runs (TVM's create call leaves them [] or a placeholder).
MHA_ONLY_SLOTS = ("prefill_paged", "decode_paged", "prefill_paged_sliding_window", "decode_paged_sliding_window",
                  "tree_attn_paged_kv", "tree_attn_ragged", "transpose_append", "split_rotary", "compact_copy",
                  "split_rotary_append")


def mla_config(num_heads: int, qk_head_dim: int, v_head_dim: int, dtype: str, page_size: int,
               target: str, kv_dtype: str = "") -> MLAConfig:
    """The MLAConfig of a cache (d_latent = v_head_dim, d_rope = qk_head_dim - v_head_dim; kv_dtype:
    the pages' element type, "" = dtype, or an FP8 format)."""
    try:
        return MLAConfig(num_heads, latent_dim=v_head_dim, rope_dim=qk_head_dim - v_head_dim, dtype=dtype,
                         page_size=page_size, target=target, kv_dtype=kv_dtype)
    except ValueError as error:
        raise KVCacheError(f"no MLA kernels for this cache configuration (qk_head_dim={qk_head_dim} = latent + "
                           f"rope, v_head_dim={v_head_dim} = latent): {error}") from None


def mla_kernel_set(config: MLAConfig, num_layers: int, overrides: dict) -> KernelSet:
    """tvmattn's MLA kernels for `config` in every slot an MLA cache runs, except those in
    `overrides` (used as given; MHA-only slots there are ignored). copy_single_page and
    debug_get_kv hold the MLA layout's functions, as in TVM's create call for MLA caches."""
    check_slot_names(overrides)
    overrides = {slot: spec for slot, spec in overrides.items() if slot not in MHA_ONLY_SLOTS}
    built = {}
    for slot, generator in _MLA_GENERATORS.items():
        if slot in overrides:
            continue
        if slot == "decode_paged_mla" and mla_wgmma_decode_problem(config) is None:
            built[slot] = ChosenMLADecode(config, {"tc": _build(generator, config, ()),
                                                   "wgmma": _build(mla_paged_decode_wgmma, config, ())})
            continue
        extra = (num_layers,) if slot == "debug_get_kv" else ()
        func = _build(generator, config, extra)
        built[slot] = ["tirx", func] if slot in MLA_ATTENTION_SLOTS else func
    return KernelSet(**built, **overrides)


class ChosenMLADecode(TIRPagedDecode):
    """An MLA decode slot of built kernels by name ("tc", "wgmma"); each call runs the one
    `tir_kernels.mla.choose_mla_decode_kernel` names for its batch size (all built with the
    cache: nothing is compiled while serving)."""

    def __init__(self, config: MLAConfig, funcs: dict):
        super().__init__(funcs["tc"])
        self.config = config
        self.funcs = funcs

    def mla(self, depth, q, pages, page_indptr, page_indices, length_info, sm_scale, attn_output, attn_lse):
        func = self.funcs[choose_mla_decode_kernel(self.config, int(q.shape[0]))]
        func(q, pages, page_indptr, page_indices, length_info, attn_output, attn_lse, sm_scale)


@functools.lru_cache(maxsize=None)
def ragged_for(num_heads: int, qk_dim: int, v_dim: int, dtype: str, target: str):
    """tir_kernels' ragged prefill for MLA self-attention (H query and H key heads), built once."""
    try:
        config = AttentionConfig(num_heads, num_heads, qk_dim, v_dim, dtype=dtype, target=target)
    except ValueError as error:
        raise KVCacheError(f"self_attention: no ragged prefill kernel for q/k head dim {qk_dim} and v head dim "
                           f"{v_dim}: {error}") from None
    return backend_from_spec(["tirx", _build(tir_kernels.ragged_prefill, config, ())], RaggedPrefill)


@functools.lru_cache(maxsize=None)
def merge_for(num_heads: int, width: int, dtype: str, target: str):
    """tir_kernels' merge_state at `width` (any multiple of 16 up to the MLA latent limit)."""
    try:
        config = MLAConfig(num_heads, latent_dim=width, rope_dim=0, dtype=dtype, page_size=16, target=target)
    except ValueError as error:
        raise KVCacheError(f"merge_attn_output_inplace: no merge kernel for width {width}: {error}") from None
    return _build(tir_kernels.merge_state, config, ())


@dataclasses.dataclass(frozen=True)
class MLAKernels:
    """What an MLA cache's steps launch."""

    prefill: PagedPrefill  # .mla: cross-attention levels with queries of their own (causal = 0)
    decode: PagedDecode  # .mla: levels of one query per request
    transpose_append: object  # (pages, kv, append_position_map)
    merge: object  # merge_state at the latent width (cascade levels)
    ragged: RaggedPrefill | None  # self-attention; None: built for the dims of the first call
    merge_output: object  # merge_attn_output_inplace's function; None: built for the first call's width


def check_mla_kernels(kernels: KernelSet) -> MLAKernels:
    """The MLA backends and functions of a kernel set; KVCacheError names a missing or unusable slot."""
    backends = {}
    for slot, role in (("prefill_paged_mla", PagedPrefill), ("decode_paged_mla", PagedDecode)):
        backend = backend_from_spec(getattr(kernels, slot), role)
        check(backend is not None, f"kernels: slot {slot!r} is empty, but an MLA cache runs it")
        check(backend.kind == "tir", f"kernels: slot {slot!r}: only TIR kernels run MLA layers, got {backend.kind}")
        backends[slot] = backend
    for slot in ("transpose_append_mla", "merge_state", "copy_single_page"):
        check(callable(getattr(kernels, slot)), f"kernels: slot {slot!r} must be a function, "
              f"got {getattr(kernels, slot)!r}")
    ragged = backend_from_spec(kernels.prefill_ragged, RaggedPrefill)
    check(ragged is None or ragged.kind == "tir", "kernels: slot 'prefill_ragged': MLA self-attention runs TIR "
          "kernels only (FlashInfer's ragged prefill needs a plan of its own dims)")
    merge_output = kernels.merge_attn_output
    check(merge_output is None or callable(merge_output),
          f"kernels: slot 'merge_attn_output' must be a function, got {merge_output!r}")
    return MLAKernels(backends["prefill_paged_mla"], backends["decode_paged_mla"], kernels.transpose_append_mla,
                      kernels.merge_state, ragged, merge_output)


class MLAStep(Step):
    """The launches of one forward step of an MLA cache (see the module docstring). The plan is
    the MHA one: the same levels, run by the MLA kernels."""

    def __init__(self, plan, arrays, kernels, work: dict, rope, mla: MLAKernels):
        self._mla = mla
        super().__init__(plan, arrays, kernels, work, rope)

    def _level(self, depth: int, level):
        indptr, indices, info = level.page_indptr, level.page_indices, level.length_info
        if level.kernel == "decode":
            mla = self._mla.decode.mla

            def run(pages, q, o, lse, sm_scale):
                mla(depth, q, pages, indptr, indices, info, sm_scale, o, lse)
        else:
            mla, qo_indptr = self._mla.prefill.mla, level.qo_indptr

            def run(pages, q, o, lse, sm_scale):
                mla(depth, q, qo_indptr, pages, indptr, indices, info, False, sm_scale, o, lse)
        return run

    def append_mla_kv(self, pages, kv) -> None:
        self._mla.transpose_append(pages, kv, self._a.append_positions)

    def cross_attention(self, pages, q, o, lse, sm_scale: float) -> None:
        """In a decode step the levels after the append (history and the new rows), else the history."""
        levels = self._fused if self.decode else self._cross
        self._paged(levels, pages, q, o, lse, sm_scale, have_output=False)

    def mla_self_attention(self, ragged: RaggedPrefill, q, k, v, o, lse, sm_scale: float) -> None:
        a = self._a
        ragged.mha(q, k, v, a.append_indptr, a.append_indptr, a.q_positions, a.k_ragged_offset, True, RopeMode.NONE,
                   1.0, 1e4, sm_scale, o, lse)
