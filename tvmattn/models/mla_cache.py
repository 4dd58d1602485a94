"""The nn-level MLA (multi-head latent attention) cache of a model library: creates tvmattn's
PagedKVCache with every layer MLA and emits the fine-grained calls of TVM's KV-cache API that
a DeepSeek-style layer makes (MLC-LLM's order, the cache first).

`TvmattnMLACache.create(spec, ...)` adds the MLA kernels (tir_kernels generators) to the module
being built and emits `tvmattn.paged_attention_kv_cache_create` in TVM's positional layout
(tvmattn.runtime.ffi.CreateArgs) as TVM's TIRPagedKVCache does for attn_kind "mla":
num_kv_heads 1, qk_head_dim = latent + rope, v_head_dim = latent, every layer AttnKind.MLA,
RoPE mode none (the model rotates q_pe and k_pe itself), the ragged prefill at the model's own
head dims (H key heads, nope + rope / v_head_dim), the MLA paged prefill in the MLA slot, merge
functions at the latent width (cascade levels of the cross attention) and at v_head_dim
(merge_attn_output_inplace), the MLA page operations; the MHA-only slots are empty. The MLA
paged decode rides in the create call's 29th argument (tvmattn's extensions), and so does the
pages' FP8 format where MLACacheSpec.kv_dtype sets one (the option ("kv_dtype", format), as in
TvmattnKVCache's: the append quantizes the latent rows, the MLA kernels dequantize them).

Calls (tensors [b, s, ...] as the model holds them, flattened to [b * s, ...] for the cache):
- `append_mla_kv(layer, kv [b, s, latent + rope])` -> the cache (thread it through: later calls
  take the returned object, so the append stays before them in the dataflow);
- `self_attention(layer, q [b, s, H, dqk], k [b, s, H, dqk], v [b, s, H, dv], sm_scale)` -> o
  [b, s, H, dv], lse [b, s, H] f32: causal among the step's tokens;
- `cross_attention(layer, q [b, s, H, latent + rope], sm_scale)` -> o [b, s, H, latent], lse:
  absorbed queries over the cached rows (the history; in decode steps also the step's rows);
- `merge_attn_output_inplace(o1, lse1, o2, lse2)` -> (o, lse) merged (base-2 LSE);
- `query_positions(n)` -> [n] int32: the RoPE position of each of the step's tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import tvm
from tvm import relax as rx
from tvm import tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn.llm.kv_cache import RopeMode

import tir_kernels
from tir_kernels import AttentionConfig, MLAConfig

from ..runtime.ffi import EXTENSIONS_TAG, AttnKind, CreateArgs
from .kv_cache import CREATE, _kernel, _spec, compiled_cache_config

PREFIX = "tvmattn.attention_kv_cache_"


@dataclasses.dataclass(frozen=True)
class MLACacheSpec:
    """What an MLA library's cache holds, fixed at compile time.

    num_heads: query heads; latent_dim: kv_lora_rank (the cached latent, also the output width
    of the absorbed attention); rope_dim: qk_rope_head_dim (the cached rotated key part);
    qk_nope_head_dim / v_head_dim: the model's own head dims of the un-absorbed self attention.
    page_size is compiled into the kernels: create_paged_kv_cache must be called with it.
    kv_dtype: the latent pages' element type: "" (dtype) or an FP8 format, whose scales are two
    per layer ([num_layers, 2, 1]: index 0 the latent columns, index 1 the rope columns).
    """

    num_layers: int
    num_heads: int
    latent_dim: int
    rope_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    dtype: str
    target: str
    page_size: int = 16
    rope_theta: float = 10000.0
    kv_dtype: str = ""

    def mla_config(self) -> MLAConfig:
        """The latent attention's kernels: pages [P, page_size, latent + rope]."""
        return MLAConfig(self.num_heads, latent_dim=self.latent_dim, rope_dim=self.rope_dim, dtype=self.dtype,
                         page_size=self.page_size, target=self.target, kv_dtype=self.kv_dtype)

    def self_attention_config(self) -> AttentionConfig:
        """The ragged prefill among new tokens: H query and H key heads, nope + rope / v_head_dim."""
        return AttentionConfig(self.num_heads, self.num_heads, self.qk_nope_head_dim + self.rope_dim,
                               v_head_dim=self.v_head_dim, dtype=self.dtype, page_size=self.page_size,
                               target=self.target)

    def to_dict(self) -> dict[str, Any]:
        return {"attention": "mla", **dataclasses.asdict(self)}


def _library_kernels(spec: MLACacheSpec) -> dict[str, rx.Expr]:
    """CreateArgs field -> the kernel (or spec) compiled into the library (or [] where unused)."""
    mla, ragged = spec.mla_config(), spec.self_attention_config()
    unused = {field: rx.Tuple([]) for field in (
        "transpose_append_mha", "prefill_paged", "decode_paged", "prefill_paged_sliding", "decode_paged_sliding",
        "tree_paged", "tree_ragged", "split_rotary", "compact_copy")}
    return {
        **unused,
        "transpose_append_mla": _kernel(tir_kernels.mla_transpose_append(mla), "tvmattn_transpose_append_mla"),
        "prefill_ragged": _spec(tir_kernels.ragged_prefill(ragged), "tvmattn_prefill_ragged_mla_self"),
        "mla_prefill": _spec(tir_kernels.mla_paged_prefill(mla), "tvmattn_prefill_paged_mla"),
        "merge": rx.Tuple([_kernel(tir_kernels.merge_state(mla), "tvmattn_merge_state_latent"),
                           _kernel(tir_kernels.merge_state(ragged), "tvmattn_merge_state_mla_output")]),
        "copy_single_page": _kernel(tir_kernels.mla_copy_single_page(mla), "tvmattn_copy_single_page_mla"),
        "debug_get_kv": _kernel(tir_kernels.mla_debug_get_kv(mla, spec.num_layers), "tvmattn_debug_get_kv_mla"),
    }


def _extensions(spec: MLACacheSpec) -> rx.Tuple:
    """The create call's 29th argument: the MLA paged decode (TVM's create call has no slot for
    one; TVM's cache runs its MLA prefill in decode steps too) and, for FP8 latent pages, the
    option ("kv_dtype", format)."""
    decode = _spec(tir_kernels.mla_paged_decode(spec.mla_config()), "tvmattn_decode_paged_mla")
    options = [tvm.ir.StringImm("kv_dtype"), tvm.ir.StringImm(spec.kv_dtype)] if spec.kv_dtype else []
    return rx.Tuple([tvm.ir.StringImm(EXTENSIONS_TAG), tvm.ir.StringImm("decode_paged_mla"), decode, *options])


def _flat(x: nn.Tensor) -> tuple[nn.Tensor, tuple]:
    """[b, s, *rest] -> ([b * s, *rest], (b, s))."""
    b, s, *rest = x.shape
    return nn.op.reshape(x, (b * s, *rest)), (b, s)


class TvmattnMLACache(nn.Object):
    """tvmattn's PagedKVCache with MLA layers as an nn object (see the module docstring)."""

    @classmethod
    def create(cls, spec: MLACacheSpec, max_batch_size: tirx.Var, max_total_seq_len: tirx.Var,
               prefill_chunk_size: tirx.Var, page_size: tirx.Var, support_sliding_window: tirx.Var,
               name: str = "paged_kv_cache") -> "TvmattnMLACache":
        """Emit the creation of the cache (inside a function being exported); page_size must be
        spec.page_size at run time (match-cast, as TvmattnKVCache.create)."""
        cache_config = compiled_cache_config([max_batch_size, max_total_seq_len, prefill_chunk_size, page_size,
                                              support_sliding_window], spec.page_size)
        args = CreateArgs(
            cache_config=cache_config,
            layer_indptr=rx.ShapeExpr([0, spec.num_layers]),
            num_qo_heads=rx.prim_value(spec.num_heads),
            num_kv_heads=rx.prim_value(1),
            qk_head_dim=rx.prim_value(spec.latent_dim + spec.rope_dim),
            v_head_dim=rx.prim_value(spec.latent_dim),
            attn_kinds=rx.ShapeExpr([int(AttnKind.MLA)] * spec.num_layers),
            enable_kv_transfer=rx.prim_value(False),
            rope_mode=rx.prim_value(int(RopeMode.NONE)),
            rope_scale=rx.prim_value(1.0),
            rope_theta=rx.prim_value(float(spec.rope_theta)),
            rope_ext_factors=rx.prim_value(0),
            init=rx.op.zeros((), spec.dtype),
            **_library_kernels(spec),
        )
        return cls(_expr=rx.call_pure_packed(CREATE, *args.positional(), _extensions(spec), ty_args=rx.AnyType()),
                   _name=name)

    def append_mla_kv(self, layer_id: int, kv: nn.Tensor) -> "TvmattnMLACache":
        flat, _ = _flat(kv)
        return TvmattnMLACache(_expr=rx.call_pure_packed(PREFIX + "append_mla_kv", self._expr,
                                                         rx.prim_value(layer_id), flat._expr, ty_args=rx.AnyType()),
                               _name="paged_kv_cache")

    def _attention(self, name: str, args: list, n, heads: int, width: int, dtype: str, shape: tuple):
        bb = rx.BlockBuilder.current()
        result = bb.emit(rx.call_dps_packed(
            PREFIX + name, [self._expr, *args],
            out_ty=[rx.TensorType((n, heads, width), dtype), rx.TensorType((n, heads), "float32")]), name)
        o = nn.Tensor(_expr=bb.emit(rx.TupleGetItem(result, 0)))
        lse = nn.Tensor(_expr=bb.emit(rx.TupleGetItem(result, 1)))
        return nn.op.reshape(o, (*shape, heads, width)), nn.op.reshape(lse, (*shape, heads))

    def self_attention(self, layer_id: int, q: nn.Tensor, k: nn.Tensor, v: nn.Tensor,
                       sm_scale: float) -> tuple[nn.Tensor, nn.Tensor]:
        (q, shape), (k, _), (v, _) = _flat(q), _flat(k), _flat(v)
        n, heads, _ = q.shape
        args = [rx.prim_value(layer_id), rx.prim_value(sm_scale), q._expr, k._expr, v._expr]
        return self._attention("self_attention", args, n, heads, v.shape[2], q.dtype, shape)

    def cross_attention(self, layer_id: int, q: nn.Tensor, latent_dim: int,
                        sm_scale: float) -> tuple[nn.Tensor, nn.Tensor]:
        q, shape = _flat(q)
        n, heads, _ = q.shape
        args = [rx.prim_value(layer_id), rx.prim_value(sm_scale), q._expr]
        return self._attention("cross_attention", args, n, heads, latent_dim, q.dtype, shape)

    def merge_attn_output_inplace(self, o1: nn.Tensor, lse1: nn.Tensor, o2: nn.Tensor,
                                  lse2: nn.Tensor) -> tuple[nn.Tensor, nn.Tensor]:
        (o1, shape), (lse1, _), (o2, _), (lse2, _) = _flat(o1), _flat(lse1), _flat(o2), _flat(lse2)
        n, heads, width = o1.shape
        bb = rx.BlockBuilder.current()
        result = bb.emit(rx.call_pure_packed(
            PREFIX + "merge_attn_output_inplace", self._expr, o1._expr, lse1._expr, o2._expr, lse2._expr,
            ty_args=rx.TupleType([o1._expr.ty, lse1._expr.ty])), "merged")
        o = nn.Tensor(_expr=bb.emit(rx.TupleGetItem(result, 0)))
        lse = nn.Tensor(_expr=bb.emit(rx.TupleGetItem(result, 1)))
        return nn.op.reshape(o, (*shape, heads, width)), nn.op.reshape(lse, (*shape, heads))

    def query_positions(self, n: tirx.PrimExpr) -> nn.Tensor:
        return nn.Tensor(_expr=rx.BlockBuilder.current().emit(rx.call_pure_packed(
            PREFIX + "get_query_positions", self._expr, ty_args=rx.TensorType((n,), "int32")), "query_positions"))
