"""The nn-level KV cache of a model library: creates tvmattn's PagedKVCache inside the
library and emits the `tvmattn.*` attention calls of the model's layers.

`TvmattnKVCache.create(...)` adds tvmattn's TIR kernels (tir_kernels generators) to the IRModule
being built, so they are compiled into the same library, and emits
`tvmattn.paged_attention_kv_cache_create` with TVM's positional layout (tvmattn.runtime.ffi.CreateArgs):
attention kernels as `["tirx", f]` backend specs, auxiliary kernels as functions. The cache
comes back to the VM as an opaque object (see tvmattn/ffi.py); `attention_with_fused_qkv`
emits `tvmattn.attention_kv_cache_attention_with_fused_qkv` on it. The process that runs the
library must have imported tvmattn (that registers the `tvmattn.*` functions).

Attention backend: tvmattn's TIR kernels by default; inside `attention_backend("flashinfer")`
(python -m tvmattn compile --attn-backend flashinfer) the ragged prefill, paged prefill and
paged decode slots are FlashInfer specs (decode on CUDA cores, as TVM's FlashInfer cache does;
prefill FA3 on sm_90a where its module is built, else FA2) naming the functions of the modules built by
`python -m tvmattn.flashinfer.build` (tvmattn.flashinfer.modules.function_name); the cache
loads them when the library creates it, from build/flashinfer or $TVMATTN_FLASHINFER_DIR, so
the modules ship beside the library (not inside it). The sliding-window and tree slots stay TIR.

`tvm_stock_kv_cache(...)` builds TVM's own `TIRPagedKVCache` with the same options (the
baseline); both objects offer the same `attention_with_fused_qkv(layer_id, qkv, num_qo_heads,
sm_scale)`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any

import tvm
from tvm import relax as rx
from tvm import tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache as StockPagedKVCache
from tvm.relax.frontend.nn.llm.kv_cache import RopeMode, TIRPagedKVCache

import tir_kernels
from tir_kernels import AttentionConfig, RopeScaling

from ..runtime.ffi import EXTENSIONS_TAG, AttnKind, CreateArgs

CREATE = "tvmattn.paged_attention_kv_cache_create"
ATTENTION_WITH_FUSED_QKV = "tvmattn.attention_kv_cache_attention_with_fused_qkv"
KV_CACHE_KINDS = ("tvmattn", "tvm")
ROPE_MODES = {"normal": RopeMode.NORMAL, "none": RopeMode.NONE}  # KVCacheSpec.rope_mode
ATTN_BACKENDS = ("tir", "flashinfer")
_ATTN_BACKEND = contextvars.ContextVar("tvmattn_attn_backend", default="tir")


@contextlib.contextmanager
def attention_backend(name: str):
    """Libraries exported inside this context run `name` ("tir" or "flashinfer") in their
    attention slots (see the module docstring)."""
    if name not in ATTN_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTN_BACKENDS}, got {name!r}")
    token = _ATTN_BACKEND.set(name)
    try:
        yield
    finally:
        _ATTN_BACKEND.reset(token)


def current_attention_backend() -> str:
    """The attention backend ("tir" or "flashinfer") of libraries exported now (see attention_backend)."""
    return _ATTN_BACKEND.get()


def attention_backend_record(spec: KVCacheSpec) -> dict[str, Any]:
    """What a library's metadata says of its attention kernels: {"name": "tir"} or, for FlashInfer,
    the module configuration (its folder under build/flashinfer) and the kinds it runs."""
    name = current_attention_backend()
    if name != "flashinfer":
        return {"name": name}
    from ..flashinfer.modules import FLASHINFER_VERSION

    prefill = _flashinfer_prefill_kind(_flashinfer_config(spec))
    return {"name": name, "flashinfer": FLASHINFER_VERSION, "modules": _flashinfer_config(spec).key(),
            "kinds": {"prefill_ragged": prefill, "prefill_paged": prefill, "decode_paged": "decode"}}


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
    """What a model library's cache holds, fixed at compile time.

    page_size is compiled into tvmattn's kernels: create_paged_kv_cache must be called with it.
    rope_theta / rope_scale / rope_scaling: RoPE applied to q and k before caching ("normal").
    sliding_window / sliding_layers: layers marked True are MHA_SLIDING in the create call's
    attn_kinds, with the window size as cache_config's 6th value (TVM's layer_sliding_window_size);
    () means every layer MHA. rope_mode: "normal" (the cache rotates q and k with rope_theta) or
    "none" (the model rotates them itself, e.g. with a RoPE base per layer, at the positions of
    `query_positions`).
    """

    num_layers: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    target: str  # "llvm" or "cuda:sm_XX"
    page_size: int = 16
    rope_theta: float = 10000.0
    rope_scale: float = 1.0
    rope_scaling: RopeScaling | None = None
    sliding_window: int = 0
    sliding_layers: tuple[bool, ...] = ()
    kv_dtype: str = ""  # the pages' element type: "" (dtype) or an FP8 format (tir_kernels.kv_quant)
    rope_mode: str = "normal"
    decode_append: bool = True  # pass decode_append where it serves the config (_extensions)

    def __post_init__(self):
        if self.rope_mode not in ROPE_MODES:
            raise ValueError(f"rope_mode={self.rope_mode!r}: expected one of {tuple(ROPE_MODES)}")
        object.__setattr__(self, "sliding_layers", tuple(bool(x) for x in self.sliding_layers))
        if self.sliding_layers and len(self.sliding_layers) != self.num_layers:
            raise ValueError(f"sliding_layers has {len(self.sliding_layers)} entries for {self.num_layers} layers")
        if any(self.sliding_layers) and self.sliding_window <= 0:
            raise ValueError(f"sliding_window={self.sliding_window!r}: sliding layers need a positive window")

    @property
    def attn_kinds(self) -> list[int]:
        """TVM's per-layer AttnKind values (MHA, or MHA_SLIDING for a sliding layer)."""
        sliding = self.sliding_layers or (False,) * self.num_layers
        return [int(AttnKind.MHA_SLIDING if s else AttnKind.MHA) for s in sliding]

    @property
    def has_sliding_layers(self) -> bool:
        return any(self.sliding_layers)

    def attention_config(self, sliding_window: bool = False) -> AttentionConfig:
        return AttentionConfig(
            num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            dtype=self.dtype, page_size=self.page_size, target=self.target, sliding_window=sliding_window,
            rope_theta=self.rope_theta, rope_scale=self.rope_scale, rope_scaling=self.rope_scaling,
            kv_dtype=self.kv_dtype,
        )

    def to_dict(self) -> dict[str, Any]:
        fields = dataclasses.asdict(self)
        fields["rope_scaling"] = None if self.rope_scaling is None else dataclasses.asdict(self.rope_scaling)
        fields["sliding_layers"] = list(self.sliding_layers)
        return fields


def _kernel(func: tirx.PrimFunc, name: str) -> rx.GlobalVar:
    """Add a PrimFunc to the module being built under a unique symbol `name` (marked scheduled:
    the GPU pipeline's default schedules must leave its thread mapping alone)."""
    func = func.with_attr("global_symbol", name).with_attr("tirx.is_scheduled", True)
    return rx.BlockBuilder.current().add_func(func, name)


def _spec(func: tirx.PrimFunc, name: str) -> rx.Tuple:
    return rx.Tuple([tvm.ir.StringImm("tirx"), _kernel(func, name)])


def flashinfer_problem(spec: KVCacheSpec) -> str | None:
    """Why a library of `spec` cannot run FlashInfer (None: it can; the modules must be built)."""
    if not isinstance(spec, KVCacheSpec):
        return "its layers are MLA (FlashInfer's MLA modules are not built)"
    arch = spec.target.partition(":")[2]
    if not spec.target.startswith("cuda") or not arch:
        return f"the target is {spec.target}, not a CUDA GPU arch"
    return _flashinfer_config(spec).problem()


def _flashinfer_config(spec: KVCacheSpec):
    from ..flashinfer.modules import FlashInferConfig

    arch = spec.target.partition(":")[2]
    return FlashInferConfig(spec.dtype, spec.head_dim, spec.head_dim, False, "sm_90a" if arch == "sm_90" else arch)


def _flashinfer_prefill_kind(config) -> str:
    """FlashInfer's Hopper prefill (FA3) on sm_90a where it is built, else FA2."""
    from ..flashinfer.modules import module_path

    return "prefill_fa3" if config.arch == "sm_90a" and module_path(config, "prefill_fa3").is_file() else "prefill_fa2"


def _flashinfer_specs(spec: KVCacheSpec) -> dict[str, rx.Expr]:
    """The FlashInfer specs of the attention slots: names of the built modules' functions."""
    from ..flashinfer.modules import FlashInferModulesMissing, function_name, missing_message, module_path

    config = _flashinfer_config(spec)
    for kind in ("decode", "prefill_fa2"):
        if not module_path(config, kind).is_file():
            raise FlashInferModulesMissing(missing_message(config, kind))

    def fi(kind: str, run: str) -> rx.Tuple:
        return rx.Tuple([tvm.ir.StringImm("flashinfer"), tvm.ir.StringImm(function_name(config, kind, run)),
                         tvm.ir.StringImm(function_name(config, kind, "plan"))])

    prefill = _flashinfer_prefill_kind(config)
    return {"prefill_ragged": fi(prefill, "ragged_run"), "prefill_paged": fi(prefill, "paged_run"),
            "decode_paged": fi("decode", "run")}


def _extensions(spec: KVCacheSpec) -> rx.Tuple:
    """The create call's 29th argument: tvmattn's own kernels beyond TVM's contract
    (runtime/ffi.py extension_slots): split_rotary_append, one launch per layer fewer in decode;
    decode_append (split_rotary_append and the decode in one launch, where the attention backend
    is TIR's and `tir_kernels.decode_append_problem` finds none), one fewer again; and, for FP8
    pages, the option ("kv_dtype", format) (TVM's create call has no page dtype)."""
    config = spec.attention_config(False)
    items = [tvm.ir.StringImm("split_rotary_append"),
             _kernel(tir_kernels.split_rotary_append(config), "tvmattn_split_rotary_append")]
    if spec.decode_append and current_attention_backend() == "tir" and tir_kernels.decode_append_problem(config) is None:
        items += [tvm.ir.StringImm("decode_append"),
                  _kernel(tir_kernels.paged_decode_append(config), "tvmattn_decode_append")]
    if spec.kv_dtype:
        items += [tvm.ir.StringImm("kv_dtype"), tvm.ir.StringImm(spec.kv_dtype)]
    return rx.Tuple([tvm.ir.StringImm(EXTENSIONS_TAG), *items])


def _library_kernels(spec: KVCacheSpec) -> dict[str, rx.Expr]:
    """CreateArgs field -> the kernel (or spec) compiled into the library, for each slot."""
    plain, sliding = spec.attention_config(False), spec.attention_config(True)
    attention = _flashinfer_specs(spec) if current_attention_backend() == "flashinfer" else {
        "prefill_ragged": _spec(tir_kernels.ragged_prefill(plain), "tvmattn_prefill_ragged"),
        "prefill_paged": _spec(tir_kernels.paged_prefill(plain), "tvmattn_prefill_paged"),
        "decode_paged": _spec(tir_kernels.paged_decode(plain), "tvmattn_decode_paged"),
    }
    return {
        "transpose_append_mha": _kernel(tir_kernels.transpose_append(plain), "tvmattn_transpose_append"),
        "transpose_append_mla": rx.Tuple([]),
        **attention,
        "prefill_paged_sliding": _spec(tir_kernels.paged_prefill(sliding), "tvmattn_prefill_paged_sliding"),
        "decode_paged_sliding": _spec(tir_kernels.paged_decode(sliding), "tvmattn_decode_paged_sliding"),
        "tree_paged": _spec(tir_kernels.tree_mask_paged_prefill(plain), "tvmattn_tree_attn_paged_kv"),
        "tree_ragged": rx.Tuple([]),  # run only by self_attention, which the models do not call
        "mla_prefill": rx.Tuple([]),
        "merge": rx.Tuple([_kernel(tir_kernels.merge_state(plain), "tvmattn_merge_state")]),
        "split_rotary": _kernel(tir_kernels.split_rotary(plain), "tvmattn_split_rotary"),
        "copy_single_page": _kernel(tir_kernels.copy_single_page(plain), "tvmattn_copy_single_page"),
        "debug_get_kv": _kernel(tir_kernels.debug_get_kv(plain, spec.num_layers), "tvmattn_debug_get_kv"),
        "compact_copy": _kernel(tir_kernels.compact_copy(plain), "tvmattn_compact_copy"),
    }


def compiled_cache_config(values: list, compiled_page_size: int, extra: list = ()) -> rx.Expr:
    """The create call's cache_config: values (max_batch_size, max_total_seq_len,
    prefill_chunk_size, page_size, support_sliding_window) + extra, match-cast to a shape whose
    page size is the one the kernels were compiled for (another fails at creation with the VM's
    shape-mismatch error)."""
    expected = [*values[:3], compiled_page_size, values[4], *extra]
    return rx.BlockBuilder.current().match_cast(rx.ShapeExpr([*values, *extra]), rx.ShapeType(expected),
                                                "cache_config_with_compiled_page_size")


class TvmattnKVCache(nn.Object):
    """tvmattn's PagedKVCache as an nn object (created by `create`, or a function parameter
    declared with `nn.spec.Object(object_type=TvmattnKVCache)`)."""

    @classmethod
    def create(cls, spec: KVCacheSpec, max_batch_size: tirx.Var, max_total_seq_len: tirx.Var,
               prefill_chunk_size: tirx.Var, page_size: tirx.Var, support_sliding_window: tirx.Var,
               name: str = "paged_kv_cache") -> "TvmattnKVCache":
        """Emit the creation of the cache (inside a function being exported).

        page_size must be spec.page_size at run time (the kernels are compiled for it): the
        cache configuration is match-cast to a shape with that page size, so another value
        fails at creation with the VM's shape-mismatch error."""
        # TVM's layer_sliding_window_size, read by MHA_SLIDING layers
        extra = [spec.sliding_window] if spec.has_sliding_layers else []
        cache_config = compiled_cache_config([max_batch_size, max_total_seq_len, prefill_chunk_size, page_size,
                                              support_sliding_window], spec.page_size, extra)
        args = CreateArgs(
            cache_config=cache_config,
            layer_indptr=rx.ShapeExpr([0, spec.num_layers]),
            num_qo_heads=rx.prim_value(spec.num_qo_heads),
            num_kv_heads=rx.prim_value(spec.num_kv_heads),
            qk_head_dim=rx.prim_value(spec.head_dim),
            v_head_dim=rx.prim_value(spec.head_dim),
            attn_kinds=rx.ShapeExpr(spec.attn_kinds),
            enable_kv_transfer=rx.prim_value(False),
            rope_mode=rx.prim_value(int(ROPE_MODES[spec.rope_mode])),
            rope_scale=rx.prim_value(float(spec.rope_scale)),
            rope_theta=rx.prim_value(float(spec.rope_theta)),
            rope_ext_factors=rx.prim_value(0),
            init=rx.op.zeros((), spec.dtype),
            **_library_kernels(spec),
        )
        return cls(_expr=rx.call_pure_packed(CREATE, *args.positional(), _extensions(spec), ty_args=rx.AnyType()),
                   _name=name)

    def attention_with_fused_qkv(self, layer_id: int, qkv: nn.Tensor, num_qo_heads: int,
                                 sm_scale: float) -> nn.Tensor:
        """qkv [b, s, Hq + 2 Hkv, D] (RoPE not applied) -> o [b, s, Hq, D]; appends k/v to the
        cache. b * s must equal the tokens of the step begun by kv_state_begin_forward."""
        b, s, heads, d = qkv.shape
        flat = nn.op.reshape(qkv, (b * s, heads, d))
        out = rx.BlockBuilder.current().emit(
            rx.call_dps_packed(
                ATTENTION_WITH_FUSED_QKV,
                [self._expr, rx.prim_value(layer_id), rx.prim_value(sm_scale), flat._expr],
                out_ty=rx.TensorType((b * s, num_qo_heads, d), qkv.dtype),
            ),
            "attention",
        )
        return nn.op.reshape(nn.Tensor(_expr=out), (b, s, num_qo_heads, d))


def query_positions(cache, n: tirx.PrimExpr) -> nn.Tensor:
    """[n] int32: the RoPE position of each of the step's n tokens (either cache kind)."""
    if isinstance(cache, TvmattnKVCache):
        return nn.Tensor(_expr=rx.BlockBuilder.current().emit(rx.call_pure_packed(
            "tvmattn.attention_kv_cache_get_query_positions", cache._expr, ty_args=rx.TensorType((n,), "int32")),
            "query_positions"))
    return cache.get_query_positions(n)


def tvm_stock_kv_cache(spec: KVCacheSpec, max_batch_size, max_total_seq_len, prefill_chunk_size, page_size,
                       support_sliding_window, name: str = "paged_kv_cache") -> TIRPagedKVCache:
    """TVM's own TIRPagedKVCache with TVM's kernels, configured like `spec` (page size at run time)."""
    rope_scaling = {} if spec.rope_scaling is None else {"rope_type": "llama3",
                                                           **dataclasses.asdict(spec.rope_scaling)}
    sliding = spec.sliding_layers or (False,) * spec.num_layers
    return TIRPagedKVCache(
        attn_kind=["mha_sliding" if s else "mha" for s in sliding],
        max_batch_size=max_batch_size,
        max_total_seq_len=max_total_seq_len,
        prefill_chunk_size=prefill_chunk_size,
        page_size=page_size,
        support_sliding_window=support_sliding_window,
        layer_partition=rx.ShapeExpr([0, spec.num_layers]),
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_qo_heads,
        num_key_value_heads=spec.num_kv_heads,
        qk_head_dim=spec.head_dim,
        v_head_dim=spec.head_dim,
        mla_original_qk_head_dim=0,
        mla_original_v_head_dim=0,
        rope_mode=ROPE_MODES[spec.rope_mode],
        rope_scale=spec.rope_scale,
        rope_theta=spec.rope_theta,
        rope_scaling=rope_scaling,
        rope_ext_factors=rx.prim_value(0),
        rotary_dim=spec.head_dim,
        enable_disaggregation=False,
        dtype=spec.dtype,
        target=AttentionConfig(spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, dtype=spec.dtype,
                               target=spec.target).tvm_target(),
        name=name,
        layer_sliding_window_size=spec.sliding_window if spec.has_sliding_layers else 1024,
    )


def kv_cache_object_type(kind: str) -> type:
    """The nn object type a model function's cache parameter is declared with."""
    return {"tvmattn": TvmattnKVCache, "tvm": StockPagedKVCache}[kind]
