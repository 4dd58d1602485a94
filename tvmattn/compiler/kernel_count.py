"""The kernels a compiled decode step launches, per decoder layer and by kind.

Read from a model library's Relax module after the model pipeline (`pipeline.relax_pipeline`,
before VM code generation): there every device kernel is a call of a PrimFunc (host-side shape
functions left out) and the KV cache's attention is one packed call per layer. Kinds:
- "projection": a matmul / GEMV kernel (float `NT_matmul`, fused or not, and the kept-quantized
  `quant_matmul_*`), whatever it fuses before or after the product;
- "norm": an RMSNorm of its own;
- "elementwise": anything else of the model (SiLU * mul, residual adds, casts, the embedding);
- "cache append" and "attention": what one attention call of the KV cache launches in a decode
  step. tvmattn's cache (runtime/forward.py, decode path) runs one kernel, "attention", where the
  library carries `decode_append` (the split, RoPE, page append and paged decode together); else
  the split + RoPE + page append as one kernel where it carries `split_rotary_append` (two,
  split_rotary and transpose_append, where it does not), then one paged-decode kernel; TVM's
  stock cache call is counted as one "attention" launch (its own launches are not visible here).

A kernel belongs to the layer whose parameter it reads (`model_layers_<i>_...`), or the cache
call's layer id; a kernel that reads no layer parameter belongs to the layer of the kernel before
it ("embed" before the first layer, "head" after the last layer's final norm / LM head reads).
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter

import tvm
from tvm import relax, tirx

KINDS = ("projection", "norm", "elementwise", "cache append", "attention")
TVMATTN_ATTENTION = "tvmattn.attention_kv_cache_attention_with_fused_qkv"
STOCK_ATTENTION = "vm.builtin.attention_kv_cache_attention_with_fused_qkv"
_LAYER_PARAM = re.compile(r"^model_layers_(\d+)_")
_HEAD_PARAM = re.compile(r"^(model_norm|lm_head|model_embed_tokens)")


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch of a step: `name` (the PrimFunc, or the cache's kernel), `kind` (KINDS)
    and `segment` (a layer index, or "embed" / "head")."""

    name: str
    kind: str
    segment: int | str


def kernel_kind(name: str) -> str:
    """The kind (KINDS, less the cache's) of a model kernel from its PrimFunc name."""
    if "matmul" in name or "gemv" in name:
        return "projection"
    if "norm" in name:
        return "norm"
    return "elementwise"


def _is_host(func: tirx.PrimFunc) -> bool:
    attrs = func.attrs or {}
    return any("is_host_func" in str(key) for key in attrs.keys())


def _bindings(func: relax.Function):
    body = func.body
    for block in body.blocks:
        yield from block.bindings


def _var_names(args) -> list[str]:
    return [arg.name for arg in args if isinstance(arg, relax.Var)]


def step_launches(mod: tvm.IRModule, function: str) -> list[Launch]:
    """The launches of `function` (e.g. "decode", "batch_decode", "decode_step") of a lowered
    library module `mod`, in order. Raises KeyError when `mod` has no such function."""
    gvars = {gv.name_hint: gv for gv in mod.get_global_vars()}
    if function not in gvars:
        raise KeyError(f"function {function!r} is not in the module (it has {sorted(gvars)})")
    fused_append = any("split_rotary_append" in name for name in gvars)
    decode_append = any("decode_append" in name for name in gvars)
    launches: list[Launch] = []
    segment: int | str = "embed"
    seen_layer = False
    for binding in _bindings(mod[gvars[function]]):
        call = binding.value
        if not isinstance(call, relax.Call):
            continue
        if isinstance(call.op, relax.GlobalVar) and isinstance(mod[call.op], tirx.PrimFunc):
            if _is_host(mod[call.op]):
                continue
            names = _var_names(call.args)
            layers = {int(m.group(1)) for m in map(_LAYER_PARAM.match, names) if m}
            if layers:
                segment, seen_layer = min(layers), True
            elif seen_layer and any(_HEAD_PARAM.match(n) for n in names):
                segment = "head"
            launches.append(Launch(call.op.name_hint, kernel_kind(call.op.name_hint), segment))
        elif isinstance(call.op, relax.ExternFunc) and call.op.global_symbol in (TVMATTN_ATTENTION, STOCK_ATTENTION):
            layer = call.args[1]
            segment = int(layer.value)
            seen_layer = True
            if call.op.global_symbol == STOCK_ATTENTION:
                launches.append(Launch("stock_attention_with_fused_qkv", "attention", segment))
                continue
            if decode_append:
                launches.append(Launch("decode_append", "attention", segment))
                continue
            appends = ["split_rotary_append"] if fused_append else ["split_rotary", "transpose_append"]
            launches += [Launch(name, "cache append", segment) for name in appends]
            launches.append(Launch("decode_paged", "attention", segment))
    return launches


@dataclasses.dataclass(frozen=True)
class StepCount:
    """Launch counts of one step: `per_layer` (layer index -> kind -> count), `embed`, `head`."""

    per_layer: dict[int, dict[str, int]]
    embed: dict[str, int]
    head: dict[str, int]

    @property
    def total(self) -> int:
        return sum(sum(c.values()) for c in [*self.per_layer.values(), self.embed, self.head])

    def layer_total(self, layer: int) -> int:
        return sum(self.per_layer[layer].values())

    def uniform_layer(self) -> dict[str, int] | None:
        """The per-kind count every layer shares, or None where layers differ."""
        counts = list(self.per_layer.values())
        return dict(counts[0]) if counts and all(c == counts[0] for c in counts) else None


def count_step(mod: tvm.IRModule, function: str) -> StepCount:
    """Launches of `function` counted per layer and kind (see step_launches)."""
    per_layer: dict[int, Counter] = {}
    other = {"embed": Counter(), "head": Counter()}
    for launch in step_launches(mod, function):
        if isinstance(launch.segment, int):
            per_layer.setdefault(launch.segment, Counter())[launch.kind] += 1
        else:
            other[launch.segment][launch.kind] += 1
    return StepCount({k: dict(v) for k, v in sorted(per_layer.items())}, dict(other["embed"]), dict(other["head"]))
