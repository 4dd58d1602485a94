"""What a fused dequantize + matmul (or embedding lookup) kernel computes: `QuantMatmulConfig`,
and the names every variant shares.

Weights W [N, K] (N output features, K input features, whole blocks) arrive as the separate
arrays of tvmattn.weights.quant.PACKED, rows first (shapes: quant.part_shapes):
  Q4_0: qs uint8 [N, K/2], d float16 [N, K/32]                 w = d * (q - 8)
  Q4_1: qs uint8 [N, K/2], d float16 [N, K/32], m float16 [.]  w = d * q + m
  Q8_0: qs int8 [N, K],    d float16 [N, K/32]                 w = d * q
  Q4_K: qs uint8 [N, K/2], sc, mn uint8 [N, K/32], d, dmin float16 [N, K/256]
                                                               w = (d * sc) * q - dmin * mn
  Q6_K: ql uint8 [N, K/2], qh uint8 [N, K/4], sc int8 [N, K/16], d float16 [N, K/256]
                                                               w = (d * sc) * (q - 32)
  (nibble and bit orders: tvmattn/weights/quant.py.)
"""

from __future__ import annotations

import dataclasses

from ..weights.quant import BLOCK_ELEMS, QUANT_TYPES, part_shapes

OPS = ("matmul", "take", "dequantize")
PROLOGUES = ("none", "rms_norm", "swiglu")  # what a CUDA GEMV applies to X (QuantMatmulConfig.prologue)
TARGET_DTYPES = {"llvm": ("float32",), "cuda": ("float16", "float32")}  # activation dtypes per target


@dataclasses.dataclass(frozen=True)
class QuantMatmulConfig:
    """What a kernel computes.

    fmt: block type (QUANT_TYPES); n: output features (rows of W; for take, rows of the table);
    k: input features (a multiple of 32); tokens: for matmul, the static token count T, or None
    for a symbolic one (`n_tokens`, int64); op: "matmul", "take" or "dequantize" (W [N, K] in
    dtype: the CUDA prompt GEMMs' first half, `quant.matmul.dequantizes_first`); target: "llvm" or "cuda";
    dtype: the activations' (X, Y, E): float32 on llvm, float16 or float32 on cuda (products
    are summed in float32 either way); few_tokens: the symbolic token count is a decode batch
    (decode_step, batch_decode: a few rows), which CUDA runs as passes of its GEMV instead of
    dlight's Matmul tiles (llvm ignores it); residual: a matmul that also takes R [T, N] (dtype)
    and returns R + X W^T (only where `uses_cuda_gemv`: the model adds it separately elsewhere);
    prologue: what the CUDA GEMV applies to X first (only where `uses_cuda_gemv`, as residual):
    "rms_norm" (X -> X * rsqrt(mean(X^2) + eps) * G, taking G [K] after the parts; the layer's
    RMSNorm), "swiglu" (X [T, 2K] -> silu(X[:, :K]) * X[:, K:]; the MLP's gate), or "none";
    bf16_products: an llvm GEMM may multiply in bfloat16 where the target has AVX512-BF16
    (quant.cpu.choose_schedule); False keeps float32 products (a verify step's rows, whose logits
    must round as a decode step's: quant.linear.float32_products).
    """

    fmt: str
    n: int
    k: int
    tokens: int | None = None
    op: str = "matmul"
    target: str = "llvm"
    dtype: str = "float32"
    few_tokens: bool = False
    residual: bool = False
    prologue: str = "none"
    eps: float = 1e-5
    bf16_products: bool = True

    def __post_init__(self):
        if self.fmt not in QUANT_TYPES:
            raise ValueError(f"fmt={self.fmt!r}: expected one of {QUANT_TYPES}")
        for name in ("n", "k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r}: expected a positive integer")
        if self.k % BLOCK_ELEMS[self.fmt]:
            raise ValueError(f"k={self.k}: expected a multiple of {BLOCK_ELEMS[self.fmt]} (whole {self.fmt} blocks)")
        if self.tokens is not None and (not isinstance(self.tokens, int) or self.tokens <= 0):
            raise ValueError(f"tokens={self.tokens!r}: expected None (symbolic) or a positive integer")
        if self.op == "dequantize" and self.tokens is not None:
            raise ValueError(f"tokens={self.tokens!r}: a dequantize takes no tokens (expected None)")
        if self.op not in OPS:
            raise ValueError(f"op={self.op!r}: expected one of {OPS}")
        if self.target not in TARGET_DTYPES:
            raise ValueError(f"target={self.target!r}: expected one of {tuple(TARGET_DTYPES)}")
        few_ok = not self.few_tokens or (self.tokens is None and self.op == "matmul")
        if not isinstance(self.few_tokens, bool) or not few_ok:
            raise ValueError(f"few_tokens={self.few_tokens!r}: expected a bool, True only for symbolic matmul tokens")
        if not isinstance(self.residual, bool) or self.residual and self.op != "matmul":
            raise ValueError(f"residual={self.residual!r}: expected a bool, True only for a matmul")
        if self.dtype not in TARGET_DTYPES[self.target]:
            raise ValueError(f"dtype={self.dtype!r}: on {self.target} expected one of {TARGET_DTYPES[self.target]}")
        if self.prologue not in PROLOGUES or self.prologue != "none" and self.op != "matmul":
            raise ValueError(f"prologue={self.prologue!r}: expected one of {PROLOGUES} ('none' for a take)")
        if not isinstance(self.eps, float) or not self.eps > 0:
            raise ValueError(f"eps={self.eps!r}: expected a positive float")
        if not isinstance(self.bf16_products, bool):
            raise ValueError(f"bf16_products={self.bf16_products!r}: expected a bool")

    @property
    def name(self) -> str:
        """A symbol naming the kernel, e.g. quant_matmul_q4_1_3072x576_n (n: symbolic tokens, b:
        a symbolic decode batch; float16 activations add _f16; float32 products where bfloat16
        ones are allowed otherwise add _f32x)."""
        tokens = "" if self.op != "matmul" else f"_{self.tokens or ('b' if self.few_tokens else 'n')}"
        dtype = "" if self.dtype == "float32" else "_f16"
        residual = "_res" if self.residual else ""
        prologue = {"none": "", "rms_norm": "_norm", "swiglu": "_swiglu"}[self.prologue]
        products = "" if self.bf16_products else "_f32x"
        return f"quant_{self.op}_{self.fmt.lower()}_{self.n}x{self.k}{tokens}{dtype}{prologue}{residual}{products}"

    def part_shapes(self) -> list[tuple[str, str, tuple[int, int]]]:
        """(name, dtype, shape) of each weight array, in argument order."""
        return part_shapes(self.fmt, self.n, self.k)

