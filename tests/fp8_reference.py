"""Host-side FP8 K/V for the tests, written independently of the kernels: codes by ml_dtypes
(round to nearest even, saturated), values in float64, scales laid into a pool's last page."""

import ml_dtypes
import numpy as np

FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


def np_fp8(fmt: str):
    return np.dtype(getattr(ml_dtypes, fmt))


def quantize(x, scale, fmt: str) -> np.ndarray:
    """FP8 codes of float32(x) / float32(scale), saturated (scale broadcast against x)."""
    quotient = np.asarray(x, np.float32) / np.asarray(scale, np.float32)
    return np.clip(quotient, -FP8_MAX[fmt], FP8_MAX[fmt]).astype(np_fp8(fmt))


# The CUDA kernels stage code * scale in the compute dtype (their MMA and shared-memory operands):
# in bfloat16 that keeps 8 significant bits of a scale that is no power of two, which moves a
# row's log-sum-exp by up to about 0.01 (the CPU kernels multiply in float32)
FP8_BF16_LSE_TOLERANCE = (1e-2, 2e-2)


def dequantize(codes, scale) -> np.ndarray:
    """float64 code * scale."""
    return np.asarray(codes).astype(np.float64) * np.asarray(scale, np.float32).astype(np.float64)


def with_scales(pool_codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """An MHA pool [P, 2, Hkv, ps, D] of codes plus a last page holding scales [2, Hkv] (float32,
    4 little-endian bytes at [P, kv, h, 0, 0:4])."""
    extra = np.zeros((1,) + pool_codes.shape[1:], pool_codes.dtype)
    raw = extra.view(np.uint8)
    raw[0, :, :, 0, :4] = np.asarray(scales, np.float32).reshape(2, -1, 1).view(np.uint8)
    return np.concatenate([pool_codes, extra])


def with_mla_scales(pool_codes: np.ndarray, scales) -> np.ndarray:
    """An MLA pool [P, ps, qk] of codes plus a last page holding its scales (latent, rope) as
    float32 at [P, 0, 0:4] and [P, 0, 4:8]."""
    extra = np.zeros((1,) + pool_codes.shape[1:], pool_codes.dtype)
    extra.view(np.uint8)[0, 0, :8] = np.asarray(scales, np.float32).reshape(2).view(np.uint8)
    return np.concatenate([pool_codes, extra])


def column_scales(scales, latent_dim: int, qk_dim: int) -> np.ndarray:
    """The scale of each column of an MLA row [qk_dim]: scales[0] below latent_dim, else scales[1]."""
    return np.where(np.arange(qk_dim) < latent_dim, np.float32(scales[0]), np.float32(scales[1])).astype(np.float32)


def random_scales(rng, num_kv_heads: int) -> np.ndarray:
    """Scales [2, Hkv] spread over two decades, so a wrong head or K/V index shows."""
    return (10.0 ** rng.uniform(-2.5, -1.5, (2, num_kv_heads))).astype(np.float32)
