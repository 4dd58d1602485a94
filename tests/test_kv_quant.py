"""FP8 K/V codes (tir_kernels.kv_quant): the bit-level conversions against ml_dtypes, exhaustively."""

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm.script import tirx as T

from tir_kernels.kv_quant import dequantize, quantize, read_scale
from tir_kernels.support import FP8_KV_DTYPES, FP8_MAX

N = 1 << 16


def _convert_func(fmt: str):
    @T.prim_func
    def convert(x: T.Buffer((N,), "float32"), scale: T.Buffer((1,), "float32"), codes: T.Buffer((N,), fmt),
                all_codes: T.Buffer((256,), fmt), values: T.Buffer((256,), "float32"),
                vec_values: T.Buffer((256,), "float32"), scale_bytes: T.Buffer((4,), fmt),
                scale_back: T.Buffer((1,), "float32")):
        for i in range(N):
            codes[i] = quantize(x[i], scale[0], fmt)
        for i in range(256):
            values[i] = dequantize(all_codes[i], scale[0], fmt)
        for i in range(16):
            vec_values[T.ramp(i * 16, 1, 16)] = dequantize(all_codes[T.ramp(i * 16, 1, 16)], scale[0], fmt, 16)
        scale_back[0] = read_scale(lambda b: scale_bytes[b])

    return convert


@pytest.mark.parametrize("fmt", FP8_KV_DTYPES)
@pytest.mark.parametrize("scale", [1.0, 0.0123])
def test_fp8_codes_match_ml_dtypes(fmt, scale):
    """Writing rounds x / scale to nearest even and saturates; reading gives code * scale, for
    every finite code (subnormals and both zeros included), scalar and 16-lane vector."""
    np_fmt = getattr(ml_dtypes, fmt)
    rng = np.random.default_rng(0)
    every_half = np.arange(N // 2, dtype=np.uint16).view(np.float16).astype(np.float32)
    wide = (rng.standard_normal(N // 2) * 10.0 ** rng.uniform(-9, 6, N // 2)).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        x = np.concatenate([every_half, wide]) * np.float32(scale)
    x = np.nan_to_num(x, nan=0.0, posinf=1e30, neginf=-1e30).astype(np.float32)
    x[:4] = [scale * FP8_MAX[fmt] * 1.5, -scale * 1e9, 0.0, -0.0]
    module = tvm.compile(_convert_func(fmt), target="llvm")
    all_codes = np.arange(256, dtype=np.uint8).view(np_fmt)
    out = [tvm.runtime.tensor(np.zeros(N, np_fmt)), tvm.runtime.tensor(np.zeros(256, np.float32)),
           tvm.runtime.tensor(np.zeros(256, np.float32))]
    scale_back = tvm.runtime.tensor(np.zeros(1, np.float32))
    module(tvm.runtime.tensor(x), tvm.runtime.tensor(np.array([scale], np.float32)), out[0],
           tvm.runtime.tensor(all_codes), out[1], out[2],
           tvm.runtime.tensor(np.array([scale], np.float32).view(np.uint8).view(np_fmt)), scale_back)
    # float64 division, then ml_dtypes' round-to-nearest-even (the float32 quotient is exact enough:
    # compare codes of the float32 quotient, which is what the kernel rounds)
    quotient = (x / np.float32(scale)).astype(np.float32)
    expected = np.clip(quotient, -FP8_MAX[fmt], FP8_MAX[fmt]).astype(np_fmt)
    np.testing.assert_array_equal(out[0].numpy().view(np.uint8), expected.view(np.uint8))
    finite = np.isfinite(all_codes.astype(np.float32))
    reference = all_codes.astype(np.float64) * np.float32(scale)
    for values in (out[1].numpy(), out[2].numpy()):
        np.testing.assert_allclose(values[finite], reference[finite], rtol=1e-7, atol=0)
    assert scale_back.numpy()[0] == np.float32(scale)
