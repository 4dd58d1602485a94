"""Linear layers and embeddings whose weights stay in a GGUF block format, for the Llama model.

`QuantLinear` (instead of nn.Linear) and `QuantEmbedding` (instead of nn.Embedding; it also
serves a tied LM head, `QuantEmbedding.lm_head`) hold the block arrays of
tvmattn.weights.quant.PACKED as parameters named `weight_<part>` (for example
`model.layers.0.mlp.down_proj.weight_qs`, uint8 [N, K/2], and `...weight_d`, float16 [N, K/32])
and call the fused kernels of matmul.py: the GEMV for a statically single token (decode),
the GEMM otherwise (prefill, batch_prefill, batch_decode, batch_verify); on CUDA a decode
batch (`[batch, 1, K]`, symbolic batch: decode_step, batch_decode) is marked `few_tokens`
and runs the GEMV in passes; a CUDA prompt's product dequantizes W first and multiplies it
densely, summing in float32 (`quant.matmul.dequantizes_first`). `QuantLinear(x, residual=r)`
returns r + x W^T, the add inside the kernel where the CUDA GEMV runs it (llama's o_proj and
down_proj), else a separate add;
`norm=` (llama's qkv and gate_up projections take their RMSNorm) and `swiglu=True` (down_proj
takes the gate_up output) likewise.
Activations are float32 on the CPU and float16 on CUDA (the kernels' target: the target
scope the model is exported in).

`weight_formats` (plan_weight_formats) says which layers stay quantized: a map from a layer's
parameter prefix (`model.layers.0.self_attn.qkv_proj`, `model.embed_tokens`, `lm_head`) to its
block type. `packed_part` makes a layer's parameter arrays from the HF tensors it is built of.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Mapping

import numpy as np
import tvm
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from ..weights.quant import PACKED, QUANT_TYPES, QuantizedTensor, concat_rows, part_shapes
from .config import QuantMatmulConfig
from .matmul import dequantizes_first, kernel, uses_cuda_gemv

PART_PREFIX = "weight_"
PROLOGUE_MAX_TOKENS = 4  # a GEMV takes the norm / gate in its kernel for static token counts up to this
_FLOAT32_PRODUCTS = contextvars.ContextVar("tvmattn_float32_products", default=False)


@contextlib.contextmanager
def float32_products():
    """Layers exported inside this context multiply in float32 on the CPU even where the target
    has AVX512-BF16 (QuantMatmulConfig.bf16_products=False). A verify step's rows run the GEMM,
    a decode step's the GEMV (float32 products): in float32 both round alike, so verified drafts
    give plain greedy decoding's tokens; with bfloat16 products a near tie could flip."""
    token = _FLOAT32_PRODUCTS.set(True)
    try:
        yield
    finally:
        _FLOAT32_PRODUCTS.reset(token)


def _kernel(config: QuantMatmulConfig):
    """kernel(config) under the target in scope, made once per config and target: the schedule
    depends on the target's features (AVX-512, AVX512-BF16: quant.cpu.choose_schedule)."""
    target = tvm.target.Target.current(allow_none=True)
    return _kernel_for_target(config, "" if target is None else str(target))


@functools.lru_cache(maxsize=None)
def _kernel_for_target(config: QuantMatmulConfig, _target: str):
    return kernel(config)


def _parameters(module: nn.Module, fmt: str, rows: int, cols: int) -> None:
    for name, dtype, shape in part_shapes(fmt, rows, cols):
        setattr(module, PART_PREFIX + name, nn.Parameter(shape, dtype))


def kernel_target() -> str:
    """The kernels' target kind: "cuda" inside a CUDA target's scope (the model is exported in
    its library's target scope), else "llvm"."""
    current = tvm.target.Target.current(allow_none=True)
    return "cuda" if current is not None and current.kind.name == "cuda" else "llvm"


def _matmul(module: nn.Module, fmt: str, rows: int, cols: int, x: nn.Tensor,
            residual: nn.Tensor | None = None, norm: nn.RMSNorm | None = None, swiglu: bool = False) -> nn.Tensor:
    """x [..., cols] -> [..., rows] (x's dtype: float32 on llvm, float16 on cuda) through the fused
    kernel (on CUDA over a prompt's tokens: W dequantized, then a dense matmul); residual [..., rows]: returns residual + the product; norm: the product of norm(x);
    swiglu: x is [..., 2 cols] (gate, up), the product of silu(gate) * up. The residual is added
    inside the kernel where it takes one (`uses_cuda_gemv`: the decode GEMV), the norm and the gate
    where it runs for a static count of at most PROLOGUE_MAX_TOKENS tokens (the `decode` function);
    elsewhere they are ops of their own around it."""
    lead = list(x.shape[:-1])
    tokens = 1
    for d in lead:
        tokens = tokens * d
    static = tokens if isinstance(tokens, int) else None
    # [batch, 1, cols] with a symbolic batch: a decode step's few rows (decode_step, batch_decode)
    few = kernel_target() == "cuda" and static is None and len(lead) == 2 and isinstance(lead[1], int) and lead[1] == 1
    # float32_products: only where the CPU GEMM could multiply in bfloat16 (else the same kernel)
    exact = _FLOAT32_PRODUCTS.get() and kernel_target() == "llvm" and static != 1
    config = QuantMatmulConfig(fmt, rows, cols, tokens=static, target=kernel_target(), dtype=str(x.dtype),
                               few_tokens=few, bf16_products=not exact)
    fused = uses_cuda_gemv(config)
    # the prologue only where one pass of the GEMV covers every token (the single-token decode):
    # a decode batch's passes each wait on the staged prologue, which made a batch step slower
    # than separate norm and gate kernels (docs/performance.md)
    in_kernel = fused and static is not None and static <= PROLOGUE_MAX_TOKENS
    if fused:
        prologue = "none" if not in_kernel else "rms_norm" if norm is not None else "swiglu" if swiglu else "none"
        eps = float(norm.epsilon) if prologue == "rms_norm" else config.eps
        config = dataclasses.replace(config, residual=residual is not None, prologue=prologue, eps=eps)
    if norm is not None and not in_kernel:
        x = norm(x)
    elif swiglu and not in_kernel:
        gate, up = op.split(x, 2, axis=-1)
        x = op.silu(gate) * up
    in_cols = 2 * cols if in_kernel and swiglu else cols
    flat = op.reshape(x, (tokens, in_cols))
    parts = [getattr(module, PART_PREFIX + name) for name, _, _ in PACKED[fmt]]
    if dequantizes_first(config):
        dequantize = QuantMatmulConfig(fmt, rows, cols, op="dequantize", target=config.target, dtype=config.dtype)
        weight = op.tensor_ir_op(_kernel(dequantize), dequantize.name, args=parts,
                                 out=nn.Tensor.placeholder((rows, cols), config.dtype))
        # float32 sums, as the fused kernels' (dlight's Matmul tensorizes it with float32
        # accumulators; with a float16 output its SIMT schedule sums in float16)
        out = op.matmul(flat, op.permute_dims(weight), out_dtype="float32")
        if config.dtype != "float32":
            out = out.astype(config.dtype)
    else:
        extra = [norm.weight] if in_kernel and norm is not None else []
        extra += [op.reshape(residual, (tokens, rows))] if fused and residual is not None else []
        out = op.tensor_ir_op(_kernel(config), config.name, args=[flat, *parts, *extra],
                              out=nn.Tensor.placeholder((tokens, rows), config.dtype))
    out = op.reshape(out, (*lead, rows))
    return residual + out if residual is not None and not fused else out


class QuantLinear(nn.Module):
    """y = x @ W.T (+ bias) with W [out_features, in_features] kept in block type `fmt`."""

    def __init__(self, in_features: int, out_features: int, fmt: str, bias: bool = False):
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        _parameters(self, fmt, out_features, in_features)
        self.bias = nn.Parameter((out_features,), "float32") if bias else None

    def to(self, dtype: str | None = None) -> None:
        """The block arrays keep their dtypes; the bias takes the activations' dtype."""
        if dtype is not None and self.bias is not None:
            self.bias.to(dtype)

    def forward(self, x: nn.Tensor, residual: nn.Tensor | None = None, norm: nn.RMSNorm | None = None,
                swiglu: bool = False) -> nn.Tensor:
        """(residual +) f(x) @ W.T (+ bias), f: norm (an nn.RMSNorm without bias), or the SwiGLU gate
        of x = [gate, up] (swiglu), or nothing; each inside the kernel where it can (see _matmul)."""
        if norm is not None and (swiglu or getattr(norm, "bias", None) is not None):
            raise ValueError("QuantLinear: norm takes an RMSNorm without bias, and not with swiglu")
        if self.bias is not None:
            y = _matmul(self, self.fmt, self.out_features, self.in_features, x, norm=norm, swiglu=swiglu) + self.bias
            return y if residual is None else residual + y
        return _matmul(self, self.fmt, self.out_features, self.in_features, x, residual, norm, swiglu)


class QuantEmbedding(nn.Module):
    """The token table [num, dim] kept in block type `fmt`: lookup (forward) and, when the LM head
    is tied to it, logits = h @ table.T (lm_head)."""

    def __init__(self, num: int, dim: int, fmt: str):
        self.num, self.dim, self.fmt = num, dim, fmt
        self.dtype = "float32"  # of the rows it returns (the activations'): set by to()
        _parameters(self, fmt, num, dim)

    def to(self, dtype: str | None = None) -> None:
        """The block arrays keep their dtypes; the rows looked up come in `dtype`."""
        if dtype is not None:
            self.dtype = dtype

    def forward(self, ids: nn.Tensor) -> nn.Tensor:
        """ids [n] int32 (each in [0, num): the caller checks) -> [n, dim] in the activations' dtype."""
        config = QuantMatmulConfig(self.fmt, self.num, self.dim, op="take", target=kernel_target(), dtype=self.dtype)
        parts = [getattr(self, PART_PREFIX + name) for name, _, _ in PACKED[self.fmt]]
        return op.tensor_ir_op(_kernel(config), config.name, args=[ids, *parts],
                               out=nn.Tensor.placeholder((ids.shape[0], self.dim), self.dtype))

    def lm_head(self, h: nn.Tensor) -> nn.Tensor:
        """h [..., dim] -> logits [..., num], in h's dtype."""
        return _matmul(self, self.fmt, self.num, self.dim, h)


# ---------------------------------------------------------------------------- weights


def plan_weight_formats(sources: Mapping[str, tuple[str, ...]], tensors: Mapping[str, object]) -> dict[str, str]:
    """Which layers stay quantized: parameter prefix -> block type, for every `<prefix>.weight`
    parameter of `sources` (parameter name -> the HF tensors it is made of) whose HF tensors are
    all QuantizedTensors of one type in QUANT_TYPES; the others are dequantized."""
    formats = {}
    for name, names in sources.items():
        if not name.endswith(".weight") or any(n not in tensors for n in names):
            continue
        values = [tensors[n] for n in names]
        kinds = {v.type_name if isinstance(v, QuantizedTensor) else None for v in values}
        if len(kinds) == 1 and next(iter(kinds)) in QUANT_TYPES:
            formats[name[:-len(".weight")]] = next(iter(kinds))
    return formats


def split_part_name(name: str) -> tuple[str, str] | None:
    """`<prefix>.weight_<part>` -> (prefix, part), else None."""
    prefix, _, last = name.rpartition(".")
    if not last.startswith(PART_PREFIX):
        return None
    return prefix, last[len(PART_PREFIX):]


def packed_part(values: list, fmt: str, part: str) -> np.ndarray:
    """The array `part` of the block-type `fmt` matrix made of `values` (QuantizedTensors, stacked
    along the rows). Raises ValueError naming the problem (a dequantized or other-type input)."""
    if not all(isinstance(v, QuantizedTensor) for v in values):
        raise ValueError(f"expected {fmt} blocks, got a dequantized tensor")
    stacked = values[0] if len(values) == 1 else concat_rows(values)
    if stacked.type_name != fmt:
        raise ValueError(f"expected {fmt} blocks, got {stacked.type_name}")
    return stacked.parts[part]


def dequantized(value) -> np.ndarray:
    """A tensor as a float32-or-float array (a QuantizedTensor dequantized)."""
    return value.dequantize() if isinstance(value, QuantizedTensor) else np.asarray(value)
