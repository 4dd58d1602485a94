"""Fused decode ops of a decoder layer: what they compute (their schedules: fused_schedules.py).

In a decode step (one new token per sequence, `[batch, 1, hidden]`) every kernel of a layer is a
launch, and the step is launch-bound. Relax's FuseOps already puts a residual add into the
projection before it (o_proj, down_proj), but never a reduction into another: an RMSNorm and the
projection after it, and the MLP's SiLU * mul, stay kernels of their own. The ops here take them
into the projection:

- `rms_norm_matmul`: y = rms_norm(x, g) W^T (+ bias), the norm of each row computed in the
  kernel (the qkv projection after the input norm);
- `rms_norm_matmul_swiglu`: y = silu(h W_gate^T) * (h W_up^T), h = rms_norm(x, g), with
  W = [W_gate; W_up] (the gate_up projection after the post-attention norm).

- `matmul_swiglu`: y = silu(x W_gate^T) * (x W_up^T), the norm a kernel before it: a batched
  decode step's gate_up on tensor cores with SiLU * mul as its epilogue (fused_decode's
  batched_swiglu: the export takes it where tensor_core_matmul's kernel serves the weight).

The norm is TVM's (topi rms_norm): float32 sum of squares, the normalized row rounded to the
activations' dtype; the product sums in float32 and rounds once. Blocks, by name (the schedules
find them so): `rms_sumsq` (the rows' sums of squares), `rms_rstd` (1 / RMS per row), `rms_norm`
(the normalized row), `NT_matmul` (`[rows, 1, cols]`; SwiGLU: the gate half, and `NT_matmul_up`
the up half), `T_epilogue` (rounding, bias, SiLU * mul).

`fused_decode(enabled, single_row_only)` is the switch the export runs under
(BuildOptions.fused_layers): the model uses these ops for its decode shapes where it is on, or,
with single_row_only, only where the batch is a static 1 (the `decode` function). CUDA builds
take single_row_only (unless BuildOptions.fused_batch_layers): at batch > 1 the fused GEMV,
which takes the rows one after the other, and the tensor-core norm_matmul from batch 16 on were
slower than the plain projections after a separate norm (docs/performance.md).
"""

from __future__ import annotations

import contextlib
import contextvars

from tvm import te, tirx

_FUSED = contextvars.ContextVar("tvmattn_fused_decode", default=(True, False))  # (enabled, single_row_only)
_BATCHED_SWIGLU = contextvars.ContextVar("tvmattn_batched_swiglu", default=False)
_ONE = tirx.const(1, "int64")
BLOCKS = ("rms_sumsq", "rms_rstd", "rms_norm", "NT_matmul", "T_epilogue")
UP_BLOCK = "NT_matmul_up"  # SwiGLU's up half (NT_matmul: its gate half)


@contextlib.contextmanager
def fused_decode(enabled: bool, single_row_only: bool = False, batched_swiglu: bool = False):
    """Models exported inside this context use the fused decode ops (enabled; with
    single_row_only at a static batch of 1 only) or the plain ops; with batched_swiglu, where a
    decode step's gate_up has no fused op (a symbolic batch), `matmul_swiglu` after the norm."""
    token = _FUSED.set((bool(enabled), bool(single_row_only)))
    swiglu = _BATCHED_SWIGLU.set(bool(batched_swiglu))
    try:
        yield
    finally:
        _FUSED.reset(token)
        _BATCHED_SWIGLU.reset(swiglu)


def batched_swiglu_enabled(rows) -> bool:
    """Whether models exported now write a decode step of `rows` sequences' gate_up and SiLU *
    mul as one `matmul_swiglu` (a symbolic batch, inside fused_decode(..., batched_swiglu=True))."""
    return _BATCHED_SWIGLU.get() and not isinstance(rows, int)


def fused_decode_enabled(rows=None) -> bool:
    """Whether models exported now use the fused decode ops for a decode step of `rows`
    sequences (an int, or a symbolic batch; see fused_decode)."""
    enabled, single_row_only = _FUSED.get()
    return enabled and (not single_row_only or (isinstance(rows, int) and rows == 1))


def _normed(x: te.Tensor, g: te.Tensor, eps: float) -> te.Tensor:
    """x [B, 1, K], g [K] -> rms_norm(x, g) [B, K] in x's dtype (topi's rms_norm: float32 inside)."""
    rows, _, k_dim = x.shape
    k = te.reduce_axis((0, k_dim), "k")
    sumsq = te.compute((rows,), lambda b: te.sum(x[b, 0, k].astype("float32") * x[b, 0, k].astype("float32"),
                                                 axis=k), name="rms_sumsq")
    inv_k = tirx.const(1.0 / int(k_dim), "float32")
    rstd = te.compute((rows,), lambda b: tirx.rsqrt(sumsq[b] * inv_k + tirx.const(eps, "float32")), name="rms_rstd")
    return te.compute((rows, k_dim), lambda b, i: (rstd[b] * x[b, 0, i].astype("float32")
                                                   * g[i].astype("float32")).astype(x.dtype), name="rms_norm")


def _matmul(row, rows, k_dim, w: te.Tensor, first_row: int, cols: int, name: str) -> te.Tensor:
    """The activations' rows (row(b, k): element k of row b < rows, of k_dim) times rows first_row
    .. first_row + cols of w [N, K] (transposed) -> [rows, 1, cols] float32."""
    r = te.reduce_axis((0, k_dim), "k")
    offset = tirx.const(first_row, "int64")
    return te.compute((rows, _ONE, tirx.const(cols, "int64")),
                      lambda b, s, j: te.sum(row(b, r).astype("float32") * w[offset + j, r].astype("float32"),
                                             axis=r), name=name)


def _swiglu(row, rows, k_dim, w: te.Tensor, dtype: str, op: str) -> te.Tensor:
    """silu(gate) * up in dtype, gate and up the activations' rows (as _matmul's) times w's first
    and second halves of rows; op names the caller in the error for an odd row count."""
    n = int(w.shape[0])
    if n % 2:
        raise ValueError(f"{op}: w has {n} rows, expected gate and up halves")
    gate = _matmul(row, rows, k_dim, w, 0, n // 2, "NT_matmul")
    up = _matmul(row, rows, k_dim, w, n // 2, n // 2, UP_BLOCK)

    def swiglu(b, s, j):
        return (gate[b, s, j] * tirx.sigmoid(gate[b, s, j]) * up[b, s, j]).astype(dtype)

    return te.compute(gate.shape, swiglu, name="T_epilogue")


def matmul_swiglu(x: te.Tensor, w: te.Tensor) -> te.Tensor:
    """x [B, 1, K], w [2 I, K] (gate rows, then up rows) -> silu(x w_gate^T) * (x w_up^T)
    [B, 1, I] in x's dtype: the MLP's gate_up with its SiLU * mul, the norm before it a kernel of
    its own (tensor_core_matmul's "swiglu" kernel in the batched steps)."""
    rows, _, k_dim = x.shape
    return _swiglu(lambda b, k: x[b, 0, k], rows, k_dim, w, x.dtype, "matmul_swiglu")


def rms_norm_matmul(x: te.Tensor, g: te.Tensor, w: te.Tensor, bias: te.Tensor | None = None, *,
                    eps: float) -> te.Tensor:
    """x [B, 1, K], g [K], w [N, K], bias [N] or None (all the activations' dtype) ->
    rms_norm(x, g) w^T (+ bias) [B, 1, N] in x's dtype."""
    normed = _normed(x, g, eps)
    rows, k_dim = normed.shape
    mm = _matmul(lambda b, k: normed[b, k], rows, k_dim, w, 0, int(w.shape[0]), "NT_matmul")
    if bias is None:
        return te.compute(mm.shape, lambda b, s, j: mm[b, s, j].astype(x.dtype), name="T_epilogue")
    return te.compute(mm.shape, lambda b, s, j: (mm[b, s, j] + bias[j].astype("float32")).astype(x.dtype),
                      name="T_epilogue")


def rms_norm_matmul_swiglu(x: te.Tensor, g: te.Tensor, w: te.Tensor, *, eps: float) -> te.Tensor:
    """x [B, 1, K], g [K], w [2 I, K] (gate rows, then up rows) -> silu(h w_gate^T) * (h w_up^T)
    [B, 1, I] in x's dtype, h = rms_norm(x, g)."""
    normed = _normed(x, g, eps)
    rows, k_dim = normed.shape
    return _swiglu(lambda b, k: normed[b, k], rows, k_dim, w, x.dtype, "rms_norm_matmul_swiglu")
