"""Fused dequantize + matmul and embedding lookup over GGUF blocks (tvmattn/models/quant_matmul.py).

Every kernel against dequantize-then-matmul in numpy: the blocks are made by gguf's own quantizer
(gguf.quants.quantize; for the K-quants, which it cannot quantize, random bytes with random finite
fp16 scales: every bit pattern of the other fields is a valid block) and dequantized for the
reference by gguf's own dequantizer, so the reference shares no code with the kernels or with
tvmattn.weights. Shapes are odd on purpose: row counts that are no multiple of the vector width or
of the row tile (37, 19) or whole GEMM tiles of 3 rows (48), K of 1, 2, 3 and 5 blocks (1, 2 and 3
super-blocks for the K-quants), 1 token (GEMV) and several (GEMM: a symbolic token count run with
1, 3, 8 and 17 tokens, and a static 5),
every vector width a host may have. Each kernel is built once per module.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import tvm
from harness import slow_except

gguf = pytest.importorskip("gguf")  # the reference's quantizer (absent on the GPU machine)

from tvmattn.compiler.targets import cuda_target, host_has_avx512, host_target  # noqa: E402
from tvmattn.quant.algorithms import gemv_algorithm, matmul_algorithm  # noqa: E402
from tvmattn.quant.config import QuantMatmulConfig  # noqa: E402
from tvmattn.quant.cpu import (  # noqa: E402
    GEMM_UNPACK_FORMATS,
    UNPACK_FORMATS,
    TABLE_GEMV_FORMATS,
    CPUSchedule,
    choose_schedule,
    dot_gemv,
    table_gemv,
    target_has_bf16,
    target_has_vnni,
    unpack_gemm,
    unpack_gemv,
)
from tvmattn.quant.matmul import (  # noqa: E402 - after the gguf check: tvmattn.weights imports gguf
    CUDA_DEQUANTIZE_MAX_BYTES,
    CUDA_FUSED_GEMM_MAX_TOKENS,
    dequantizes_first,
    kernel,
    schedule,
    uses_cuda_gemv,
    uses_mma_gemv,
)
from tvmattn.quant.gemv_cuda import GEMV_FORMATS, CUDAGemvSchedule, choose_gemv_schedule, gemv_kernel  # noqa: E402
from tvmattn.weights.quant import LAYOUTS, PACKED, QUANT_TYPES, QuantizedTensor, split_blocks  # noqa: E402

QT = gguf.GGMLQuantizationType
FORMATS = list(QUANT_TYPES)
K_QUANTS = ("Q4_K", "Q6_K")
SHAPES = [(37, 96), (64, 160), (19, 32), (48, 64)]  # (rows N, K): K = 3, 5, 1, 2 blocks
K_SHAPES = [(37, 768), (64, 512), (19, 256)]  # K = 3, 2, 1 super-blocks
CASES = [(fmt, rows, cols) for fmt in FORMATS for rows, cols in (K_SHAPES if fmt in K_QUANTS else SHAPES)]
TOKENS = (1, 3, 8, 17)
FP16_FIELDS = {"Q4_K": (0, 2), "Q6_K": (208,)}  # byte offsets of the fp16 scales in a GGUF block


def case_id(case) -> str:
    return "{}-{}x{}".format(*case)


def wide(fmt: str) -> int:
    """A row length of a few blocks of fmt."""
    return 512 if fmt in K_QUANTS else 160


@pytest.fixture(scope="module")
def built():
    """(config, schedule) -> compiled kernel, built once."""
    cache = {}

    def get(config: QuantMatmulConfig, plan: CPUSchedule | None = None):
        key = (config, plan)
        if key not in cache:
            cache[key] = tvm.compile(kernel(config, plan),
                                     target=host_target(avx512=bool(plan and (plan.lookup or plan.dot or plan.unpack))))
        return cache[key]

    return get


def quantized(fmt: str, rows: int, cols: int, seed: int) -> tuple[QuantizedTensor, np.ndarray]:
    """(the blocks split into arrays, gguf's own dequantization of them [rows, cols] float32)."""
    rng = np.random.default_rng(seed)
    if fmt in K_QUANTS:
        elems, size = LAYOUTS[fmt]
        raw = rng.integers(0, 256, (rows, cols // elems, size), dtype=np.uint8)
        for at in FP16_FIELDS[fmt]:
            scales = (rng.standard_normal((rows, cols // elems)) * rng.uniform(0.001, 0.1, (rows, 1)))
            raw[:, :, at:at + 2] = scales.astype("<f2")[..., None].view(np.uint8)
        raw = raw.reshape(rows, -1)
    else:
        w = (rng.standard_normal((rows, cols)) * rng.uniform(0.1, 3.0, (rows, 1))).astype(np.float32)
        raw = gguf.quants.quantize(w, QT[fmt])
    return split_blocks(raw, fmt, (rows, cols)), gguf.quants.dequantize(raw, QT[fmt]).astype(np.float32)


def run_matmul(fn, config: QuantMatmulConfig, blocks: QuantizedTensor, x: np.ndarray) -> np.ndarray:
    parts = [tvm.runtime.tensor(blocks.parts[name]) for name, _, _ in config.part_shapes()]
    out = tvm.runtime.tensor(np.full((x.shape[0], config.n), np.nan, np.float32))
    fn(tvm.runtime.tensor(x), *parts, out)
    return out.numpy()


def check(got: np.ndarray, x: np.ndarray, w: np.ndarray) -> None:
    want = x.astype(np.float64) @ w.astype(np.float64).T
    scale = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T  # bounds the rounding
    assert np.isfinite(got).all()
    assert (np.abs(got - want) <= 1e-6 * scale + 1e-6).all(), np.abs(got - want).max()


# The default tier: every format at its first shape; -m slow: every shape.
@pytest.mark.parametrize("fmt,rows,cols", slow_except(CASES, *(c for c in CASES if c[1] == 37), unpack=True),
                         ids=[case_id(c) for c in CASES])
def test_gemv_matches_dequantize_then_matmul(built, fmt, rows, cols):
    config = QuantMatmulConfig(fmt, rows, cols, tokens=1)
    blocks, w = quantized(fmt, rows, cols, seed=rows + cols)
    np.testing.assert_array_equal(blocks.dequantize(), w)  # our split agrees with gguf's blocks
    x = np.random.default_rng(1).standard_normal((1, cols)).astype(np.float32)
    check(run_matmul(built(config), config, blocks, x), x, w)


@pytest.mark.parametrize("fmt,rows,cols", slow_except(CASES, *(c for c in CASES if c[1] == 37), unpack=True),
                         ids=[case_id(c) for c in CASES])
def test_gemm_symbolic_tokens_matches_dequantize_then_matmul(built, fmt, rows, cols):
    config = QuantMatmulConfig(fmt, rows, cols, tokens=None)
    blocks, w = quantized(fmt, rows, cols, seed=2 * rows + cols)
    fn = built(config)
    for tokens in TOKENS:
        x = np.random.default_rng(tokens).standard_normal((tokens, cols)).astype(np.float32)
        check(run_matmul(fn, config, blocks, x), x, w)


@pytest.mark.parametrize("fmt", FORMATS)
def test_gemm_static_tokens(built, fmt):
    cols = 256 if fmt in K_QUANTS else 96
    config = QuantMatmulConfig(fmt, 37, cols, tokens=5)  # 5: not a multiple of the token tile
    blocks, w = quantized(fmt, 37, cols, seed=5)
    x = np.random.default_rng(5).standard_normal((5, cols)).astype(np.float32)
    check(run_matmul(built(config), config, blocks, x), x, w)


@pytest.mark.parametrize("lanes", [4, 8, 16])
@pytest.mark.parametrize("tokens", [1, None])
def test_every_vector_width(built, lanes, tokens):
    """The schedules of hosts with SSE (4 lanes), AVX2 (8) and AVX-512 (16), on this host."""
    fmt = "Q4_1"
    config = QuantMatmulConfig(fmt, 19, 96, tokens=tokens)
    plan = CPUSchedule(lanes=lanes, rows=4 if tokens else 2, chunk=8)
    blocks, w = quantized(fmt, 19, 96, seed=lanes)
    x = np.random.default_rng(lanes).standard_normal((1 if tokens else 6, 96)).astype(np.float32)
    check(run_matmul(built(config, plan), config, blocks, x), x, w)


needs_avx512 = pytest.mark.skipif(not host_has_avx512(), reason="the table lookup GEMV needs AVX-512")
LOOKUP_CASES = [(fmt, rows, cols, nr) for fmt in TABLE_GEMV_FORMATS
                for rows, cols in ((37, 96), (19, 32), (48, 64), (64, 160)) for nr in (1, 2, 4, 8)]


@needs_avx512
@pytest.mark.parametrize("fmt,rows,cols,nr", slow_except(LOOKUP_CASES, *(c for c in LOOKUP_CASES if c[1] == 37),
                                                        unpack=True), ids=["{}-{}x{}-r{}".format(*c) for c in LOOKUP_CASES])
def test_table_gemv_matches_dequantize_then_matmul(built, fmt, rows, cols, nr):
    """The 4-bit GEMV by 16-entry table lookup (AVX-512) under every row tile, odd row counts
    (tiles and chunks shrink to divisors of N) and 1 to 5 blocks a row."""
    config = QuantMatmulConfig(fmt, rows, cols, tokens=1)
    plan = CPUSchedule(lanes=16, rows=nr, chunk=2 * nr, lookup=True)
    blocks, w = quantized(fmt, rows, cols, seed=3 * rows + cols + nr)
    x = np.random.default_rng(nr).standard_normal((1, cols)).astype(np.float32)
    check(run_matmul(built(config, plan), config, blocks, x), x, w)


@needs_avx512
def test_table_gemv_is_chosen_and_looks_up_by_permutes():
    """Under an AVX-512 target the 4-bit GEMVs take the lookup (1-row tiles for long rows); its
    code is vpermps/vpermd on zmm registers, without the other path's int-to-float conversions.
    Without AVX-512 in scope (or no scope) they keep gemv_algorithm, and a lookup plan is refused."""
    avx512 = host_target(avx512=True)
    with avx512:
        for fmt in TABLE_GEMV_FORMATS:
            assert choose_schedule(QuantMatmulConfig(fmt, 960, 576, tokens=1)).lookup
        assert choose_schedule(QuantMatmulConfig("Q4_1", 576, 1536, tokens=1)).rows == 1
        for config in (QuantMatmulConfig("Q8_0", 960, 576, tokens=1), QuantMatmulConfig("Q4_1", 960, 576, tokens=4),
                       QuantMatmulConfig("Q4_1", 960, 576, op="take")):
            assert not choose_schedule(config).lookup
        config = QuantMatmulConfig("Q4_1", 64, 576, tokens=1)
        func = kernel(config)
    asm = tvm.tirx.build(func, target=avx512).inspect_source("s")
    assert "vperm" in asm and "%zmm" in asm
    assert "vcvtdq2ps" not in asm
    assert not choose_schedule(config).lookup
    with host_target():
        assert not choose_schedule(config).lookup
        with pytest.raises(ValueError, match="plan.lookup needs an AVX-512 target"):
            kernel(config, CPUSchedule(lookup=True))


def test_table_gemv_validation():
    with pytest.raises(ValueError, match="table_gemv computes one token"):
        table_gemv(QuantMatmulConfig("Q8_0", 8, 64, tokens=1), CPUSchedule(lookup=True))
    with pytest.raises(ValueError, match="table_gemv computes one token"):
        table_gemv(QuantMatmulConfig("Q4_1", 8, 64, tokens=2), CPUSchedule(lookup=True))


needs_vnni = pytest.mark.skipif(not target_has_vnni(host_target(avx512=True)),
                                reason="the int8 dot-product GEMV needs AVX-512 VNNI")
DOT_CASES = [(fmt, rows, cols, nr, digits) for fmt, rows, cols in CASES if fmt in UNPACK_FORMATS
             for nr in (1, 4) for digits in (1, 2)]


def round_x_to_int8_digits(x: np.ndarray, digits: int) -> tuple[np.ndarray, np.ndarray]:
    """(x [1, K] as `digits` int8 digits per 32 columns stand for it, float64; each column's dx).
    As llama.cpp's quantize_row_q8_0: dx = amax / 127, q1 = round(x * 127 / amax); a second digit
    q2 = round(256 (x * 127 / amax - q1)) within +-127, worth q2 / 256."""
    blocks = x.reshape(-1, 32).astype(np.float32)
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    t = blocks * np.where(amax > 0, np.float32(127.0) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.round(t).astype(np.float64)
    assert np.abs(q).max() <= 127
    if digits == 2:
        q += np.clip(np.round((t - np.round(t)) * np.float32(256.0)), -127, 127) / 256
    dx = (amax / np.float32(127.0)).astype(np.float64)
    return (dx * q).reshape(x.shape), np.broadcast_to(dx, blocks.shape).reshape(-1)


@needs_vnni
@pytest.mark.parametrize("fmt,rows,cols,nr,digits", slow_except(DOT_CASES, *(c for c in DOT_CASES if c[1] == 37),
                                                               unpack=True),
                         ids=["{}-{}x{}-r{}-d{}".format(*c) for c in DOT_CASES])
def test_dot_gemv_matches_the_product_with_int8_x(built, fmt, rows, cols, nr, digits):
    """The int8 dot-product GEMV (AVX-512 VNNI) computes the product of the weights with x rounded
    to 1 or 2 int8 digits per 32 columns (float32 sums of exact integer dots), and so stays within
    x's rounding of the float product: |Y - x W^T| <= sum_k |W[n, k]| * dx(k) / 2 (one digit) or
    / 512 (two), dx = amax / 127 of k's 32 columns (the stated accuracy of the int8 path)."""
    config = QuantMatmulConfig(fmt, rows, cols, tokens=1)
    plan = CPUSchedule(lanes=16, rows=nr, chunk=2 * nr, dot=digits)
    blocks, w = quantized(fmt, rows, cols, seed=5 * rows + cols + nr)
    rng = np.random.default_rng(nr + digits)
    x = (rng.standard_normal((1, cols)) * rng.uniform(0.01, 10.0, (1, cols // 32)).repeat(32, axis=1))
    if cols > 32:  # an all-zero block (dx = 0) beside the others
        x[0, :32] = 0.0
    x = x.astype(np.float32)
    got = run_matmul(built(config, plan), config, blocks, x)
    rounded, dx = round_x_to_int8_digits(x, digits)
    check(got, rounded, w)
    bound = np.abs(w).astype(np.float64) @ (dx / (2 if digits == 1 else 512))
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    assert (np.abs(got - exact) <= bound * (1 + 1e-3) + 1e-6 * (np.abs(x) @ np.abs(w).T)).all()
    if digits == 2:  # the second digit counts: one digit's rounding is far outside two digits' bound
        one, _ = round_x_to_int8_digits(x, 1)
        assert np.abs(one @ w.astype(np.float64).T - exact).max() > 4 * bound.max()


@needs_vnni
def test_dot_gemv_is_only_on_request_and_uses_vpdpbusd():
    """The int8 GEMV is never the host's choice (its rounding of x is not exact); a plan that asks
    for it gets code that multiplies by vpdpbusd, and is refused without AVX-512 in scope."""
    avx512 = host_target(avx512=True)
    config = QuantMatmulConfig("Q5_0", 64, 640, tokens=1)
    with avx512:
        for fmt in UNPACK_FORMATS:
            assert not choose_schedule(QuantMatmulConfig(fmt, 1024, 768, tokens=1)).dot
        func = kernel(config, CPUSchedule(rows=4, dot=2))
    asm = tvm.tirx.build(func, target=avx512).inspect_source("s")
    assert "vpdpbusd" in asm
    with host_target():
        with pytest.raises(ValueError, match="plan.dot needs an AVX-512 VNNI target"):
            kernel(config, CPUSchedule(dot=2))


UNPACK_CASES = [(fmt, rows, cols) for fmt, rows, cols in CASES if fmt in UNPACK_FORMATS]
GEMM_UNPACK_CASES = [(fmt, rows, cols) for fmt, rows, cols in CASES if fmt in GEMM_UNPACK_FORMATS]


@needs_avx512
@pytest.mark.parametrize("nr", [1, 4])
@pytest.mark.parametrize("fmt,rows,cols", slow_except(UNPACK_CASES, *(c for c in UNPACK_CASES if c[1] == 37),
                                                     unpack=True), ids=[case_id(c) for c in UNPACK_CASES])
def test_unpack_gemv_matches_dequantize_then_matmul(built, fmt, rows, cols, nr):
    """The GEMV that unpacks 32 weights a vector (AVX-512), float32: row tiles of 1 and 4, odd row
    counts (tiles and chunks shrink to divisors of N)."""
    config = QuantMatmulConfig(fmt, rows, cols, tokens=1)
    plan = CPUSchedule(lanes=16, rows=nr, chunk=2 * nr, unpack=True)
    blocks, w = quantized(fmt, rows, cols, seed=11 * rows + cols + nr)
    x = np.random.default_rng(nr).standard_normal((1, cols)).astype(np.float32)
    check(run_matmul(built(config, plan), config, blocks, x), x, w)


@needs_avx512
@pytest.mark.parametrize("fmt,rows,cols", slow_except(GEMM_UNPACK_CASES, *(c for c in GEMM_UNPACK_CASES if c[1] == 37),
                                                     unpack=True), ids=[case_id(c) for c in GEMM_UNPACK_CASES])
def test_unpack_gemm_matches_dequantize_then_matmul(built, fmt, rows, cols):
    """The prompt GEMM that unpacks 32 weights a vector (AVX-512): 1 to 17 tokens (whole tiles of
    4 and the one-token tail), row tiles of 3 and chunks that do not divide the rows evenly."""
    config = QuantMatmulConfig(fmt, rows, cols, tokens=None)
    plan = CPUSchedule(lanes=16, rows=3, token_tile=4, chunk=6, unpack=True)
    blocks, w = quantized(fmt, rows, cols, seed=7 * rows + cols)
    fn = built(config, plan)
    for tokens in TOKENS:
        x = np.random.default_rng(tokens).standard_normal((tokens, cols)).astype(np.float32)
        check(run_matmul(fn, config, blocks, x), x, w)


@needs_avx512
def test_unpack_is_chosen_under_avx512():
    """Under an AVX-512 target the GEMV (1-row tiles) and the GEMM of UNPACK_FORMATS unpack (the
    GEMM of the 4-bit formats too, with bfloat16 products only); other formats, lookups and
    targets without AVX-512 do not, and an unpack plan is refused there."""
    with host_target(avx512=True):
        for fmt in UNPACK_FORMATS:
            for tokens in (1, None):
                assert choose_schedule(QuantMatmulConfig(fmt, 960, 512, tokens=tokens)).unpack
            assert choose_schedule(QuantMatmulConfig(fmt, 960, 512, tokens=1)).rows == 1
    with host_target(avx512=True, bf16=False):  # float32 products: 4 x 4 tiles for rows past 1024 weights
        assert choose_schedule(QuantMatmulConfig("Q6_K", 640, 2048, tokens=None)).rows == 4
        assert not choose_schedule(QuantMatmulConfig("Q6_K", 640, 2048, tokens=None)).bf16
        assert not choose_schedule(QuantMatmulConfig("Q4_1", 960, 512, tokens=None)).unpack
    with host_target(avx512=True):
        for config in (QuantMatmulConfig("Q4_1", 960, 512, tokens=1), QuantMatmulConfig("Q8_0", 960, 512, op="take")):
            assert not choose_schedule(config).unpack
        for fmt in TABLE_GEMV_FORMATS:
            plan = choose_schedule(QuantMatmulConfig(fmt, 960, 512, tokens=None))
            assert plan.unpack == plan.bf16 == target_has_bf16(host_target(avx512=True))
    config = QuantMatmulConfig("Q8_0", 960, 512, tokens=None)
    assert not choose_schedule(config).unpack
    with host_target():
        assert not choose_schedule(config).unpack
        with pytest.raises(ValueError, match="plan.unpack needs an AVX-512 target"):
            kernel(config, CPUSchedule(lanes=16, unpack=True))
    with pytest.raises(ValueError, match="unpack_gemm computes several tokens"):
        unpack_gemm(QuantMatmulConfig("Q8_0", 8, 64, tokens=1), CPUSchedule(lanes=16, unpack=True))
    with pytest.raises(ValueError, match="unpack_gemm computes several tokens"):
        unpack_gemm(QuantMatmulConfig("Q4_0", 8, 64, op="take"), CPUSchedule(lanes=16, unpack=True))
    with pytest.raises(ValueError, match="unpack_gemv computes one token"):
        unpack_gemv(QuantMatmulConfig("Q4_0", 8, 64, tokens=1), CPUSchedule(lanes=16, unpack=True))
    with pytest.raises(ValueError, match="unpack_gemv computes one token"):
        unpack_gemv(QuantMatmulConfig("Q8_0", 8, 64, tokens=2), CPUSchedule(lanes=16, unpack=True))


needs_bf16 = pytest.mark.skipif(not target_has_bf16(host_target(avx512=True)),
                                reason="the bfloat16 products need AVX512-BF16")


def round_to_bf16(a: np.ndarray) -> np.ndarray:
    """float32 a rounded to bfloat16 (to nearest, ties to even), as float64 (finite values)."""
    bits = a.astype(np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


@needs_bf16
@pytest.mark.parametrize("fmt,rows,cols", slow_except(GEMM_UNPACK_CASES, *(c for c in GEMM_UNPACK_CASES if c[1] == 37),
                                                     unpack=True), ids=[case_id(c) for c in GEMM_UNPACK_CASES])
def test_unpack_gemm_bf16_is_the_product_of_the_rounded_operands(built, fmt, rows, cols):
    """The prompt GEMM with bfloat16 products (vdpbf16ps): the product of X and the dequantized W
    each rounded to bfloat16, summed in float32, so within its stated bound of the float product,
    |Y - X W^T| <= (2^-8 + 2^-16) sum_k |X W|; 1 to 17 tokens, row tiles of 3, uneven chunks."""
    config = QuantMatmulConfig(fmt, rows, cols, tokens=None)
    plan = CPUSchedule(lanes=16, rows=3, token_tile=4, chunk=6, unpack=True, bf16=True)
    blocks, w = quantized(fmt, rows, cols, seed=3 * rows + cols)
    fn = built(config, plan)
    for tokens in TOKENS:
        x = np.random.default_rng(tokens).standard_normal((tokens, cols)).astype(np.float32)
        got = run_matmul(fn, config, blocks, x)
        scale = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T
        rounded = round_to_bf16(x) @ round_to_bf16(w).T
        assert np.isfinite(got).all()
        assert (np.abs(got - rounded) <= 1e-6 * scale + 1e-6).all(), np.abs(got - rounded).max()
        exact = x.astype(np.float64) @ w.astype(np.float64).T
        assert (np.abs(got - exact) <= (2.0 ** -8 + 2.0 ** -16 + 1e-6) * scale + 1e-6).all()
        # the rounding is there: float32 products would sit far inside the bound of the rounded ones
        assert np.abs(got - exact).max() > 1e-3 * np.abs(rounded - exact).max()


@needs_bf16
def test_bf16_products_are_chosen_with_avx512_bf16_and_use_vdpbf16ps():
    """Under the host's AVX-512 target with AVX512-BF16, the prompt GEMM of UNPACK_FORMATS
    multiplies in bfloat16 (vdpbf16ps); host_target(bf16=False) keeps float32 products and
    refuses a bf16 plan; bf16 needs unpack."""
    config = QuantMatmulConfig("Q5_0", 48, 640, tokens=None)
    with host_target(avx512=True):
        assert choose_schedule(config).bf16
        assert not choose_schedule(QuantMatmulConfig("Q5_0", 48, 640, tokens=1)).bf16  # (decode: float32 GEMV)
        func = kernel(config)
    asm = tvm.tirx.build(func, target=host_target(avx512=True)).inspect_source("s")
    assert "vdpbf16ps" in asm
    with host_target(avx512=True, bf16=False):
        assert not choose_schedule(config).bf16
        with pytest.raises(ValueError, match="plan.bf16 needs an AVX512-BF16 target"):
            kernel(config, CPUSchedule(lanes=16, unpack=True, bf16=True))
    with pytest.raises(ValueError, match="bf16=True: expected a bool, True only with unpack=True"):
        CPUSchedule(lanes=16, bf16=True)


def export_one_layer_llama(target: str, dtype: str, down_proj: str, **options) -> tvm.IRModule:
    """The Relax module of a one-layer Llama (hidden 256) whose projections are kept as Q5_0 (qkv),
    Q4_K (o), Q6_K (gate_up) and `down_proj`, with a tied Q8_0 embedding."""
    from tvmattn.models import BuildOptions, ModelConfig, export_module

    hf = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 1,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "rms_norm_eps": 1e-5,
          "rope_theta": 100000.0, "tie_word_embeddings": True, "attention_bias": False}
    formats = {"model.embed_tokens": "Q8_0", "model.layers.0.self_attn.qkv_proj": "Q5_0",
               "model.layers.0.self_attn.o_proj": "Q4_K", "model.layers.0.mlp.gate_up_proj": "Q6_K",
               "model.layers.0.mlp.down_proj": down_proj}
    build = BuildOptions(target=target, dtype=dtype, page_size=16, weight_formats=tuple(sorted(formats.items())),
                         **options)
    return export_module(ModelConfig.from_hf(hf), build)[0]


@needs_bf16
def test_verify_multiplies_in_float32_inside_a_bfloat16_library():
    """A tiny Llama exported for the CPU with kept blocks and bfloat16 prompt products: its
    prompt functions call the bfloat16 GEMM, batch_verify the float32 one (`_f32x`), so a verify
    step's logits round as a decode step's and verified drafts give plain greedy tokens."""
    mod = export_one_layer_llama("llvm", "float32", down_proj="Q4_1", host_avx512=True)

    def gemms(function: str) -> set[str]:
        return set(re.findall(r"quant_matmul_\w+_n(?:_f32x)?\b", mod[function].script()))

    exact = {"quant_matmul_q5_0_512x256_n_f32x", "quant_matmul_q4_k_256x256_n_f32x",
             "quant_matmul_q6_k_1024x256_n_f32x", "quant_matmul_q4_1_256x512_n_f32x",
             "quant_matmul_q8_0_128x256_n_f32x"}
    assert gemms("batch_verify") == exact
    prompt = {name.removesuffix("_f32x") for name in exact}
    for function in ("batch_prefill", "batch_decode"):
        assert gemms(function) == prompt, function
    assert gemms("prefill") == prompt - {"quant_matmul_q8_0_128x256_n"}  # (the last token's logits: a GEMV)
    with host_target(avx512=True):
        for name in exact:
            fmt, rows, cols = re.match(r"quant_matmul_(\w+?)_(\d+)x(\d+)_n", name).groups()
            config = QuantMatmulConfig(fmt.upper(), int(rows), int(cols), tokens=None)
            assert choose_schedule(config).bf16 == (config.fmt in GEMM_UNPACK_FORMATS)
            assert not choose_schedule(dataclasses.replace(config, bf16_products=False)).bf16
    with pytest.raises(ValueError, match="bf16_products=1: expected a bool"):
        QuantMatmulConfig("Q4_0", 8, 64, bf16_products=1)


def test_dot_gemv_validation():
    with pytest.raises(ValueError, match="dot_gemv computes one token"):
        dot_gemv(QuantMatmulConfig("Q4_1", 8, 64, tokens=1), CPUSchedule(dot=2))
    with pytest.raises(ValueError, match="dot_gemv computes one token"):
        dot_gemv(QuantMatmulConfig("Q8_0", 8, 64, tokens=2), CPUSchedule(dot=2))
    with pytest.raises(ValueError, match="plan.dot=0"):
        dot_gemv(QuantMatmulConfig("Q8_0", 8, 64, tokens=1), CPUSchedule())


@pytest.mark.parametrize("fmt", FORMATS)
def test_take_reads_rows(built, fmt):
    config = QuantMatmulConfig(fmt, 37, wide(fmt), op="take")
    blocks, w = quantized(fmt, 37, wide(fmt), seed=9)
    ids = np.array([0, 36, 5, 5, 17], np.int32)
    parts = [tvm.runtime.tensor(blocks.parts[name]) for name, _, _ in config.part_shapes()]
    out = tvm.runtime.tensor(np.full((len(ids), wide(fmt)), np.nan, np.float32))
    built(config)(tvm.runtime.tensor(ids), *parts, out)
    np.testing.assert_array_equal(out.numpy(), w[ids])


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_writes_the_whole_matrix(built, fmt):
    config = QuantMatmulConfig(fmt, 37, wide(fmt), op="dequantize")
    assert config.name == f"quant_dequantize_{fmt.lower()}_37x{wide(fmt)}"
    blocks, w = quantized(fmt, 37, wide(fmt), seed=10)
    parts = [tvm.runtime.tensor(blocks.parts[name]) for name, _, _ in config.part_shapes()]
    out = tvm.runtime.tensor(np.full((37, wide(fmt)), np.nan, np.float32))
    built(config)(*parts, out)
    np.testing.assert_array_equal(out.numpy(), w)


def test_cuda_prompt_products_dequantize_first():
    """On CUDA a GEMM over a prompt's tokens (symbolic, not a decode batch; or more static tokens
    than the fused kernel keeps) dequantizes W and multiplies densely, unless W would take more
    than CUDA_DEQUANTIZE_MAX_BYTES (a tied LM head); the GEMVs, decode batches and the CPU keep
    their fused kernels."""
    def config(**kw):
        return QuantMatmulConfig(**{"fmt": "Q4_0", "n": 2048, "k": 8192, "target": "cuda", "dtype": "float16", **kw})

    assert dequantizes_first(config()) and dequantizes_first(config(tokens=CUDA_FUSED_GEMM_MAX_TOKENS + 1))
    assert dequantizes_first(config(fmt="Q6_K")) and dequantizes_first(config(dtype="float32"))
    assert not dequantizes_first(config(tokens=CUDA_FUSED_GEMM_MAX_TOKENS))
    assert not dequantizes_first(config(tokens=1, fmt="Q4_K"))  # dlight's GEMV, fused
    assert not dequantizes_first(config(few_tokens=True))
    assert not dequantizes_first(config(op="take"))
    assert not dequantizes_first(QuantMatmulConfig("Q4_0", 2048, 8192))  # llvm
    head = CUDA_DEQUANTIZE_MAX_BYTES // (2 * 2048)
    assert dequantizes_first(config(n=head, k=2048)) and not dequantizes_first(config(n=head + 1, k=2048))
    with pytest.raises(ValueError, match="tokens=4: a dequantize takes no tokens"):
        QuantMatmulConfig("Q4_0", 8, 64, op="dequantize", tokens=4)
    with pytest.raises(ValueError, match="residual=True: expected a bool, True only for a matmul"):
        QuantMatmulConfig("Q4_0", 8, 64, op="dequantize", residual=True)


def test_cuda_library_prompt_functions_call_dequantize_then_matmul():
    """A tiny Llama exported for CUDA with kept blocks of every type: prefill, batch_prefill and
    batch_verify dequantize each layer's W and multiply densely (on tensor cores, float32 sums);
    decode and batch_decode keep the fused GEMVs; prefill's last-token logits stay a GEMV."""
    mod = export_one_layer_llama("cuda", "float16", down_proj="Q4_0")

    def kernels(function: str) -> tuple[set[str], int]:
        script = mod[function].script()
        return set(re.findall(r"quant_\w+", script)), script.count("R.matmul")

    layers = {"quant_dequantize_q5_0_512x256_f16", "quant_dequantize_q4_k_256x256_f16",
              "quant_dequantize_q6_k_1024x256_f16", "quant_dequantize_q4_0_256x512_f16"}
    assert kernels("batch_prefill") == (layers | {"quant_dequantize_q8_0_128x256_f16"}, 5)
    assert kernels("batch_verify") == kernels("batch_prefill")
    assert kernels("prefill") == (layers | {"quant_matmul_q8_0_128x256_1_f16"}, 4)
    for function in ("decode", "batch_decode"):
        names, matmuls = kernels(function)
        assert matmuls == 0 and all(n.startswith("quant_matmul_") for n in names) and len(names) == 5, function


@pytest.mark.slow  # the whole CUDA Relax pipeline: dlight schedules every kernel of the library
def test_cuda_library_prompt_products_run_on_tensor_cores_in_float32():
    """The same library lowered: its dense prompt products run on tensor cores (dlight's Matmul:
    wmma) and sum in float32."""
    from tvmattn.compiler.pipeline import relax_pipeline

    mod = export_one_layer_llama("cuda", "float16", down_proj="Q4_0")
    target = cuda_target()
    with target:
        lowered = relax_pipeline(target)(mod)
    dense = {gv.name_hint: func.script() for gv, func in lowered.functions.items()
             if isinstance(func, tvm.tirx.PrimFunc) and re.fullmatch(r"fused_NT_matmul\d*_cast\d*", gv.name_hint)}
    assert len(dense) >= 4
    for name, script in dense.items():
        assert "wmma.matrix_a" in script and "tvm_fill_fragment" in script, name
        assert re.search(r"tvm_fill_fragment\([^\n]*T\.float32\(0", script), name  # float32 accumulators


def test_part_shapes_follow_the_block_layout():
    config = QuantMatmulConfig("Q4_1", 8, 64)
    assert config.part_shapes() == [("qs", "uint8", (8, 32)), ("d", "float16", (8, 2)), ("m", "float16", (8, 2))]
    assert [p[0] for p in QuantMatmulConfig("Q8_0", 8, 64).part_shapes()] == [p[0] for p in PACKED["Q8_0"]]
    assert QuantMatmulConfig("Q8_0", 8, 64).part_shapes()[0] == ("qs", "int8", (8, 64))
    assert QuantMatmulConfig("Q4_K", 8, 512).part_shapes() == [
        ("qs", "uint8", (8, 256)), ("sc", "uint8", (8, 16)), ("mn", "uint8", (8, 16)), ("d", "float16", (8, 2)),
        ("dmin", "float16", (8, 2))]
    assert QuantMatmulConfig("Q6_K", 8, 512).part_shapes() == [
        ("ql", "uint8", (8, 256)), ("qh", "uint8", (8, 128)), ("sc", "int8", (8, 32)), ("d", "float16", (8, 2))]


@pytest.mark.parametrize("tokens", [1, None])
def test_algorithm_is_unscheduled_and_schedule_marks_it(tokens):
    config = QuantMatmulConfig("Q4_0", 8, 64, tokens=tokens)
    func = gemv_algorithm(config, 8) if tokens == 1 else matmul_algorithm(config)
    assert "tirx.is_scheduled" not in (func.attrs or {})
    scheduled = schedule(func, config)
    assert scheduled.attrs["tirx.is_scheduled"] and int(scheduled.attrs["op_pattern"]) == 8


def test_gemv_lanes_must_divide_the_sub_block():
    with pytest.raises(ValueError, match="lanes=32 must divide the Q6_K sub-block of 16"):
        gemv_algorithm(QuantMatmulConfig("Q6_K", 8, 256, tokens=1), 32)


@pytest.mark.parametrize("kwargs,message", [
    ({"fmt": "Q5_1", "n": 8, "k": 64}, "fmt='Q5_1'"),
    ({"fmt": "Q4_1", "n": 8, "k": 48}, "k=48: expected a multiple of 32"),
    ({"fmt": "Q4_K", "n": 8, "k": 320}, "k=320: expected a multiple of 256"),
    ({"fmt": "Q5_K", "n": 8, "k": 256}, "fmt='Q5_K'"),
    ({"fmt": "Q4_1", "n": 0, "k": 64}, "n=0"),
    ({"fmt": "Q4_1", "n": 8, "k": 64, "tokens": 0}, "tokens=0"),
    ({"fmt": "Q4_1", "n": 8, "k": 64, "op": "gather"}, "op='gather'"),
    ({"fmt": "Q4_1", "n": 8, "k": 64, "target": "rocm"}, "target='rocm'"),
    ({"fmt": "Q4_1", "n": 8, "k": 64, "dtype": "float16"}, "dtype='float16': on llvm"),
    ({"fmt": "Q4_1", "n": 8, "k": 64, "target": "cuda", "dtype": "bfloat16"}, "dtype='bfloat16': on cuda"),
])
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        QuantMatmulConfig(**kwargs)


@pytest.mark.parametrize("kwargs,message", [
    ({"lanes": 12}, "lanes=12"), ({"rows": 0}, "rows=0"), ({"rows": 4, "chunk": 6}, "chunk=6"),
    ({"lanes": 8, "lookup": True}, "lookup=True"), ({"lookup": 1}, "lookup=1"),
    ({"lanes": 8, "unpack": True}, "unpack=True"), ({"lanes": 16, "dot": 2, "unpack": True}, "unpack=True"),
    ({"unpack": 1}, "unpack=1"),
    ({"dot": 3}, "dot=3"), ({"dot": True}, "dot=True"), ({"lanes": 16, "lookup": True, "dot": 2}, "dot=2"),
])
def test_schedule_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CPUSchedule(**kwargs)


def test_quantized_tensor_checks_its_parts():
    blocks, _ = quantized("Q4_1", 4, 64, seed=0)
    with pytest.raises(ValueError, match="part 'm'"):
        QuantizedTensor("Q4_1", (4, 64), {k: v for k, v in blocks.parts.items() if k != "m"})
    with pytest.raises(ValueError, match="part 'qs'"):
        QuantizedTensor("Q4_1", (4, 64), {**blocks.parts, "qs": blocks.parts["qs"][:, :16]})
    with pytest.raises(ValueError, match="type_name='Q5_K'"):
        QuantizedTensor("Q5_K", (4, 64), blocks.parts)
    k_blocks, _ = quantized("Q6_K", 4, 256, seed=0)
    with pytest.raises(ValueError, match="part 'qh'"):
        QuantizedTensor("Q6_K", (4, 256), {**k_blocks.parts, "qh": k_blocks.parts["qh"][:, :32]})


# ---------------------------------------------------------------------------- CUDA

SMOLLM2_SHAPES = [("Q4_1", 960, 576), ("Q4_1", 576, 1536), ("Q8_0", 49152, 576)]


@pytest.fixture(scope="module")
def built_cuda():
    """config -> the kernel compiled for CUDA, built once."""
    cache = {}

    def get(config: QuantMatmulConfig):
        if config not in cache:
            cache[config] = tvm.compile(kernel(config), target=cuda_target())
        return cache[config]

    return get


def run_cuda(fn, config: QuantMatmulConfig, blocks: QuantizedTensor, x: np.ndarray, residual=None,
             norm_weight=None) -> np.ndarray:
    """Y of the CUDA kernel, x (and the residual, the norm's weight) rounded to config.dtype first."""
    dev = tvm.cuda(0)
    parts = [tvm.runtime.tensor(blocks.parts[name], device=dev) for name, _, _ in config.part_shapes()]
    extra = [] if norm_weight is None else [tvm.runtime.tensor(norm_weight.astype(config.dtype), device=dev)]
    extra += [] if residual is None else [tvm.runtime.tensor(residual.astype(config.dtype), device=dev)]
    out = tvm.runtime.tensor(np.full((x.shape[0], config.n), np.nan, config.dtype), device=dev)
    fn(tvm.runtime.tensor(x.astype(config.dtype), device=dev), *parts, *extra, out)
    return out.numpy()


def check_cuda(got: np.ndarray, x: np.ndarray, w: np.ndarray, residual=None, rounded: bool = False) -> None:
    """Against float64 dequantize-then-matmul of the (rounded) x (plus the rounded residual): a
    float16 Y is within its own rounding (2^-11 relative) of the float32 sum, whose error the
    scale bounds. rounded: x is already the float64 input the kernel sees (a prologue's output)."""
    xr = x if rounded else x.astype(got.dtype).astype(np.float64)
    want = xr @ w.astype(np.float64).T
    scale = np.abs(xr) @ np.abs(w).astype(np.float64).T
    if residual is not None:
        rr = residual.astype(got.dtype).astype(np.float64)
        want, scale = want + rr, scale + np.abs(rr)
    rel = 2.0 ** -11 if got.dtype == np.float16 else 0.0
    assert np.isfinite(got).all()
    err = np.abs(got.astype(np.float64) - want)
    assert (err <= rel * np.abs(want) + 1e-5 * scale + 1e-6).all(), err.max()


@pytest.mark.parametrize("fmt", [f for f in GEMV_FORMATS if f not in K_QUANTS])
@pytest.mark.parametrize("tokens,token_tile,x_rows,rows_per_thread", [(1, 1, 1, 1), (None, 2, 5, 2), (1, 1, 1, 2)])
def test_cuda_gemv_arithmetic_on_the_cpu(monkeypatch, fmt, tokens, token_tile, x_rows, rows_per_thread):
    """The CUDA GEMV's own arithmetic (its quants made float32 through the 2^23 mantissa, each
    format's zero point and offset; passes of tokens over a block made float32 once; a thread's
    rows sharing X, the last past the 37 rows), its thread loops serial on the CPU, against
    float64 gguf dequantize-then-matmul: float32 sums, within 1e-5 of the magnitudes' product.
    test_gemv_kquant.py does the same for the K-quants."""
    from tvm.script import tirx as T

    from tvmattn.quant import gemv_cuda

    monkeypatch.setattr(T, "thread_binding", lambda extent, thread=None: T.serial(extent))
    monkeypatch.setattr(gemv_cuda, "magic_byte", gemv_cuda.magic_byte_by_shifts)  # PRMT is CUDA's
    rows, cols = 37, 96
    func = gemv_cuda.gemv_kernel(fmt, rows, cols, tokens, "float32",
                                 CUDAGemvSchedule(lanes=1, rows=1, token_tile=token_tile,
                                                  rows_per_thread=rows_per_thread))
    lib = tvm.compile(func, target="llvm")
    blocks, w = quantized(fmt, rows, cols, seed=rows + cols)
    x = np.random.default_rng(x_rows).standard_normal((x_rows, cols)).astype(np.float32)
    got = run_matmul(lib, QuantMatmulConfig(fmt, rows, cols, tokens=tokens), blocks, x)
    want = x.astype(np.float64) @ w.astype(np.float64).T
    scale = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T
    assert (np.abs(got - want) <= 1e-5 * scale + 1e-6).all(), np.abs(got - want).max()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,rows,cols", CASES + SMOLLM2_SHAPES, ids=[case_id(c) for c in CASES + SMOLLM2_SHAPES])
def test_cuda_gemv_matches_dequantize_then_matmul(built_cuda, fmt, rows, cols):
    config = QuantMatmulConfig(fmt, rows, cols, tokens=1, target="cuda", dtype="float16")
    blocks, w = quantized(fmt, rows, cols, seed=rows + cols)
    x = np.random.default_rng(1).standard_normal((1, cols)).astype(np.float32)
    check_cuda(run_cuda(built_cuda(config), config, blocks, x), x, w)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,rows,cols", CASES, ids=[case_id(c) for c in CASES])
def test_cuda_gemm_symbolic_tokens_matches_dequantize_then_matmul(built_cuda, fmt, rows, cols):
    config = QuantMatmulConfig(fmt, rows, cols, tokens=None, target="cuda", dtype="float16")
    blocks, w = quantized(fmt, rows, cols, seed=2 * rows + cols)
    fn = built_cuda(config)
    for tokens in (*TOKENS, 70):
        x = np.random.default_rng(tokens).standard_normal((tokens, cols)).astype(np.float32)
        check_cuda(run_cuda(fn, config, blocks, x), x, w)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_cuda_static_tokens_and_float32(built_cuda, fmt, dtype):
    cols = 256 if fmt in K_QUANTS else 96
    for tokens in (1, 5):
        config = QuantMatmulConfig(fmt, 37, cols, tokens=tokens, target="cuda", dtype=dtype)
        blocks, w = quantized(fmt, 37, cols, seed=5)
        x = np.random.default_rng(5).standard_normal((tokens, cols)).astype(np.float32)
        check_cuda(run_cuda(built_cuda(config), config, blocks, x), x, w)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_dequantize_writes_the_whole_matrix(built_cuda, fmt):
    config = QuantMatmulConfig(fmt, 37, wide(fmt), op="dequantize", target="cuda", dtype="float16")
    blocks, w = quantized(fmt, 37, wide(fmt), seed=10)
    dev = tvm.cuda(0)
    parts = [tvm.runtime.tensor(blocks.parts[name], device=dev) for name, _, _ in config.part_shapes()]
    out = tvm.runtime.tensor(np.full((37, wide(fmt)), np.nan, np.float16), device=dev)
    built_cuda(config)(*parts, out)
    np.testing.assert_array_equal(out.numpy(), w.astype(np.float16))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_take_reads_rows(built_cuda, fmt):
    config = QuantMatmulConfig(fmt, 37, wide(fmt), op="take", target="cuda", dtype="float16")
    blocks, w = quantized(fmt, 37, wide(fmt), seed=9)
    ids = np.array([0, 36, 5, 5, 17], np.int32)
    dev = tvm.cuda(0)
    parts = [tvm.runtime.tensor(blocks.parts[name], device=dev) for name, _, _ in config.part_shapes()]
    out = tvm.runtime.tensor(np.full((len(ids), wide(fmt)), np.nan, np.float16), device=dev)
    built_cuda(config)(tvm.runtime.tensor(ids, device=dev), *parts, out)
    np.testing.assert_array_equal(out.numpy(), w[ids].astype(np.float16))


def multiplied_weights(config: QuantMatmulConfig, blocks: QuantizedTensor, w: np.ndarray) -> np.ndarray:
    """The weights config's kernel multiplies: gemv_mma's (`uses_mma_gemv`) are each rounded once to
    float16 from the exact dequantized value (test_gemv_mma.rounded_weights), the CUDA-core GEMV's
    float32 ones are w."""
    if not uses_mma_gemv(config):
        return w
    from test_gemv_mma import rounded_weights

    return rounded_weights(blocks)


GEMV_CASES = [c for c in CASES if c[0] in ("Q4_0", "Q4_1", "Q8_0")] + [("Q4_1", 3072, 576), ("Q4_1", 576, 1536)]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,rows,cols", GEMV_CASES, ids=[case_id(c) for c in GEMV_CASES])
def test_cuda_decode_batch_matches_dequantize_then_matmul(built_cuda, fmt, rows, cols):
    """A decode batch (few_tokens) of 1 to 17 rows: for these formats in float16, gemv_mma's 8-token
    tiles on tensor cores (partial tiles), against the weights it multiplies (`multiplied_weights`)."""
    config = QuantMatmulConfig(fmt, rows, cols, tokens=None, target="cuda", dtype="float16", few_tokens=True)
    assert uses_cuda_gemv(config)
    blocks, w = quantized(fmt, rows, cols, seed=3 * rows + cols)
    fn = built_cuda(config)
    for tokens in (1, 2, 5, 16, 17):
        x = np.random.default_rng(tokens).standard_normal((tokens, cols)).astype(np.float32)
        check_cuda(run_cuda(fn, config, blocks, x), x, multiplied_weights(config, blocks, w))


RESIDUAL_CASES = [("Q4_1", 576, 576, 1), ("Q4_1", 576, 1536, None), ("Q4_0", 37, 96, 1), ("Q8_0", 19, 160, None),
                  ("Q8_0", 64, 160, 5)]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,rows,cols,tokens", RESIDUAL_CASES)
def test_cuda_gemv_adds_the_residual(built_cuda, fmt, rows, cols, tokens):
    """Y = R + X W^T in one kernel (o_proj and down_proj with the decoder layer's residual)."""
    config = QuantMatmulConfig(fmt, rows, cols, tokens=tokens, target="cuda", dtype="float16",
                               few_tokens=tokens is None, residual=True)
    blocks, w = quantized(fmt, rows, cols, seed=rows + 7 * cols)
    fn = built_cuda(config)
    for count in ((tokens,) if tokens else (1, 3, 16)):
        rng = np.random.default_rng(count)
        x = rng.standard_normal((count, cols)).astype(np.float32)
        r = (rng.standard_normal((count, rows)) * 4).astype(np.float32)
        check_cuda(run_cuda(fn, config, blocks, x, r), x, multiplied_weights(config, blocks, w), r)


PROLOGUE_CASES = [("Q4_1", 960, 576, 1, "rms_norm"), ("Q4_1", 3072, 576, None, "rms_norm"),
                  ("Q8_0", 37, 160, None, "rms_norm"), ("Q4_0", 19, 96, 3, "rms_norm"),
                  ("Q4_1", 576, 1536, 1, "swiglu"), ("Q4_1", 576, 1536, None, "swiglu"),
                  ("Q4_0", 64, 160, None, "swiglu"), ("Q8_0", 37, 96, 2, "swiglu")]


def prologue_reference(x: np.ndarray, prologue: str, norm_weight: np.ndarray | None, eps: float) -> np.ndarray:
    """What the kernel multiplies W by, in float64 from x rounded to float16: RMSNorm(x) * G, or
    silu(gate) * up of x = [gate, up]."""
    xr = x.astype(np.float16).astype(np.float64)
    if prologue == "rms_norm":
        g = norm_weight.astype(np.float16).astype(np.float64)
        return xr / np.sqrt((xr * xr).mean(-1, keepdims=True) + eps) * g
    gate, up = np.split(xr, 2, axis=-1)
    return gate / (1.0 + np.exp(-gate)) * up


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,rows,cols,tokens,prologue", PROLOGUE_CASES)
def test_cuda_gemv_prologues(built_cuda, fmt, rows, cols, tokens, prologue):
    """The layer's RMSNorm (qkv, gate_up) or SwiGLU gate (down_proj, with the residual) inside the
    GEMV, against the float64 reference of the op and then dequantize-then-matmul; K of 3, 5, 18
    and 48 blocks (lanes with no block of their own: their squares must not count)."""
    residual = prologue == "swiglu"
    config = QuantMatmulConfig(fmt, rows, cols, tokens=tokens, target="cuda", dtype="float16",
                               few_tokens=tokens is None, residual=residual, prologue=prologue, eps=1e-6)
    blocks, w = quantized(fmt, rows, cols, seed=rows + 11 * cols)
    fn = built_cuda(config)
    for count in ((tokens,) if tokens else (1, 3, 16)):
        rng = np.random.default_rng(count)
        width = 2 * cols if prologue == "swiglu" else cols
        x = (rng.standard_normal((count, width)) * 3).astype(np.float32)
        g = (1 + 0.5 * rng.standard_normal(cols)).astype(np.float32) if prologue == "rms_norm" else None
        r = (rng.standard_normal((count, rows)) * 4).astype(np.float32) if residual else None
        got = run_cuda(fn, config, blocks, x, r, g)
        check_cuda(got, prologue_reference(x, prologue, g, config.eps), w, r, rounded=True)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [f for f in GEMV_FORMATS if f not in K_QUANTS])
@pytest.mark.parametrize("prologue", ["none", "rms_norm", "swiglu"])
def test_cuda_gemv_two_rows_a_thread(fmt, prologue):
    """A thread computing two rows (`rows_per_thread=2`, chosen for large single-token products)
    with each prologue, the residual with SwiGLU and without a prologue; 1061 rows, so the last
    thread's second row is past the end."""
    rows, cols, residual = 1061, 256, prologue != "rms_norm"
    config = QuantMatmulConfig(fmt, rows, cols, tokens=1, target="cuda", dtype="float16",
                               residual=residual, prologue=prologue, eps=1e-6)
    plan = CUDAGemvSchedule(lanes=8, rows=4 if prologue == "none" else 64, token_tile=1, rows_per_thread=2)
    fn = tvm.compile(gemv_kernel(fmt, rows, cols, 1, "float16", plan, residual=residual, prologue=prologue,
                                 eps=1e-6), target=cuda_target())
    blocks, w = quantized(fmt, rows, cols, seed=rows + cols)
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((1, 2 * cols if prologue == "swiglu" else cols)) * 3).astype(np.float32)
    g = (1 + 0.5 * rng.standard_normal(cols)).astype(np.float32) if prologue == "rms_norm" else None
    r = (rng.standard_normal((1, rows)) * 4).astype(np.float32) if residual else None
    got = run_cuda(fn, config, blocks, x, r, g)
    if prologue == "none":
        check_cuda(got, x, w, r)
    else:
        check_cuda(got, prologue_reference(x, prologue, g, config.eps), w, r, rounded=True)


def test_cuda_gemv_routing():
    """Which CUDA matmuls run the GEMV of quant_gemv_cuda.py and which stay with dlight."""
    def cfg(fmt="Q4_1", n=960, k=576, **kw):
        return QuantMatmulConfig(fmt, n, k, target="cuda", dtype="float16", **kw)

    assert uses_cuda_gemv(cfg(tokens=1)) and uses_cuda_gemv(cfg(fmt="Q8_0", n=49152, tokens=1))
    assert uses_cuda_gemv(cfg(tokens=None, few_tokens=True))
    assert not uses_cuda_gemv(cfg(tokens=None))  # prefill: dlight's Matmul
    # a float16 decode batch of the 32-weight formats: the tensor-core GEMV, at any size (a 30 MB LM head)
    for fmt in ("Q4_0", "Q4_1", "Q8_0"):
        assert uses_mma_gemv(cfg(fmt=fmt, tokens=None, few_tokens=True))
    assert uses_mma_gemv(cfg(fmt="Q8_0", n=49152, tokens=None, few_tokens=True))
    assert uses_cuda_gemv(cfg(fmt="Q8_0", n=49152, tokens=None, few_tokens=True))  # (takes the residual)
    assert not uses_mma_gemv(cfg(tokens=1)) and not uses_mma_gemv(cfg(tokens=None))
    assert not uses_mma_gemv(cfg(fmt="Q5_0", tokens=None, few_tokens=True))
    assert not uses_mma_gemv(QuantMatmulConfig("Q4_1", 960, 576, target="cuda", dtype="float32", few_tokens=True))
    assert not uses_mma_gemv(cfg(tokens=None, few_tokens=True, prologue="rms_norm"))  # gemv_cuda's prologue
    # elsewhere a decode batch's weight over CUDA_GEMV_MAX_BATCH_WEIGHT_BYTES stays with dlight's Matmul
    assert not uses_cuda_gemv(cfg(fmt="Q5_0", n=49152, tokens=None, few_tokens=True))
    assert uses_cuda_gemv(cfg(fmt="Q4_K", k=768, tokens=1))  # (tests/test_gemv_kquant.py)
    assert not uses_cuda_gemv(QuantMatmulConfig("Q4_1", 960, 576, tokens=1))  # llvm
    assert cfg(tokens=None, few_tokens=True).name == "quant_matmul_q4_1_960x576_b_f16"
    with pytest.raises(ValueError, match="few_tokens=True"):
        cfg(tokens=1, few_tokens=True)
    assert cfg(tokens=1, residual=True).name == "quant_matmul_q4_1_960x576_1_f16_res"
    with pytest.raises(ValueError, match="residual=True needs the CUDA GEMV"):
        kernel(cfg(tokens=None, residual=True))  # a prefill matmul adds its residual separately
    with pytest.raises(ValueError, match="residual=True needs the CUDA GEMV"):
        kernel(QuantMatmulConfig("Q4_1", 960, 576, tokens=1, residual=True))
    with pytest.raises(ValueError, match="residual=1"):
        cfg(tokens=1, residual=1)
    assert cfg(tokens=None, few_tokens=True, prologue="rms_norm").name == "quant_matmul_q4_1_960x576_b_f16_norm"
    assert cfg(tokens=1, residual=True, prologue="swiglu").name == "quant_matmul_q4_1_960x576_1_f16_swiglu_res"
    with pytest.raises(ValueError, match="prologue='rms_norm' needs the CUDA GEMV"):
        kernel(cfg(tokens=None, prologue="rms_norm"))
    with pytest.raises(ValueError, match="prologue='gelu'"):
        cfg(tokens=1, prologue="gelu")
    with pytest.raises(ValueError, match="prologue='swiglu'"):
        QuantMatmulConfig("Q4_1", 960, 576, op="take", prologue="swiglu")
    with pytest.raises(ValueError, match="eps=0.0"):
        cfg(tokens=1, prologue="rms_norm", eps=0.0)


@pytest.mark.parametrize("k,lanes,rows", [(576, 32, 2), (1536, 32, 2), (96, 4, 16), (32, 1, 64), (160, 8, 8)])
def test_cuda_gemv_schedule_choice(k, lanes, rows):
    assert choose_gemv_schedule(960, k, 1) == CUDAGemvSchedule(lanes=lanes, rows=rows, token_tile=1)


@pytest.mark.parametrize("n,k,tokens,prologue,fmt,paired", [
    (16384, 2048, 1, "rms_norm", "Q4_0", True),  # Llama-1B's gate_up: 512 blocks of 32 rows
    (128256, 2048, 1, "none", "Q4_0", True),  # its LM head
    (3072, 2048, 1, "rms_norm", "Q4_0", False),  # its qkv: 96 blocks of 32 rows, too few
    (2048, 8192, 1, "swiglu", "Q4_0", False),  # its down_proj: 8 blocks a lane
    (16384, 2048, None, "none", "Q4_0", False),  # a decode batch
    (16384, 2048, 1, "none", "Q4_K", False),  # a K-quant
])
def test_cuda_gemv_pairs_rows_only_where_it_pays(n, k, tokens, prologue, fmt, paired):
    assert choose_gemv_schedule(n, k, tokens, prologue, fmt).rows_per_thread == (2 if paired else 1)


@pytest.mark.parametrize("kwargs,message", [
    ({"lanes": 3}, "lanes=3"), ({"rows": 0}, "rows=0"), ({"token_tile": 0}, "token_tile=0"),
    ({"rows_per_thread": 0}, "rows_per_thread=0"), ({"rows_per_thread": 2.0}, "rows_per_thread=2.0"),
    ({"lanes": 32, "rows": 33}, "1056: at most 1024"),
])
def test_cuda_gemv_schedule_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CUDAGemvSchedule(**kwargs)


def test_cuda_gemv_prologue_arguments_are_checked():
    """An unknown prologue, or one on blocks of partial warps (its block reduction works by warps)."""
    with pytest.raises(ValueError, match="prologue='gelu'"):
        gemv_kernel("Q4_1", 64, 96, 1, "float16", choose_gemv_schedule(64, 96, 1), prologue="gelu")
    with pytest.raises(ValueError, match="lanes \\* rows = 16: a prologue needs whole warps"):
        gemv_kernel("Q4_1", 64, 96, 1, "float16", CUDAGemvSchedule(lanes=4, rows=4, token_tile=1),
                    prologue="rms_norm")
    gemv_kernel("Q4_1", 64, 96, 1, "float16", CUDAGemvSchedule(lanes=4, rows=4, token_tile=1))  # no prologue: fine


def test_quant_linear_norm_takes_a_plain_rms_norm():
    """QuantLinear's norm= is an RMSNorm without bias, never with swiglu (checked before tracing)."""
    from tvm.relax.frontend import nn

    from tvmattn.quant.linear import QuantLinear

    layer = QuantLinear(64, 32, "Q4_1")
    with pytest.raises(ValueError, match="norm takes an RMSNorm without bias"):
        layer(None, norm=nn.RMSNorm(64, -1, 1e-5, bias=True))
    with pytest.raises(ValueError, match="and not with swiglu"):
        layer(None, norm=nn.RMSNorm(64, -1, 1e-5, bias=False), swiglu=True)


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
def test_cuda_gemv_source_loads_16_bytes_and_reduces_by_shuffles(fmt):
    """The CUDA source (no GPU needed to generate it): the quants and X in 16-byte vector loads,
    the lanes' sums by warp shuffles, 64 threads a block."""
    if tvm.get_global_func("target.build.cuda", allow_missing=True) is None:
        pytest.skip("TVM built without CUDA codegen")
    config = QuantMatmulConfig(fmt, 576, 576, tokens=1, target="cuda", dtype="float16", residual=True)
    source = tvm.compile(kernel(config), target=cuda_target()).mod.imports[0].inspect_source()
    assert "*(uint4*)(qw_ptr" in source or "*(int4*)(qw_ptr" in source
    assert "*(uint4*)(x_ptr" in source
    assert "__shfl_xor_sync" in source and "__launch_bounds__(64)" in source
    residual = "e1_ptr" if fmt == "Q4_1" else "e0_ptr"  # the extra arguments (m, r) or (r) read
    assert residual in source


def test_cuda_model_takes_the_gemv_and_fuses_the_residual():
    """A tiny Llama exported for CUDA with kept weights: decode (one token) and decode_step /
    batch_decode (a symbolic batch) call the GEMV, o_proj and down_proj with the residual in the
    kernel; decode's qkv also with its RMSNorm (a batch keeps them apart); prefill-like functions
    dequantize W for a dense matmul (quant.matmul.dequantizes_first), with all three apart."""
    from tvmattn.models import BuildOptions, ModelConfig, export_module

    hf = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "rms_norm_eps": 1e-5,
          "rope_theta": 100000.0, "tie_word_embeddings": True, "attention_bias": False}
    formats = {"model.embed_tokens": "Q8_0", "model.layers.0.self_attn.o_proj": "Q4_0",
               "model.layers.0.mlp.down_proj": "Q4_1", "model.layers.1.self_attn.qkv_proj": "Q4_1"}
    options = BuildOptions(target="cuda:sm_90", dtype="float16", page_size=16,
                           weight_formats=tuple(sorted(formats.items())))
    mod, _ = export_module(ModelConfig.from_hf(hf), options)
    names = {gv.name_hint for gv in mod.functions if gv.name_hint.startswith("quant_")}
    assert names == {
        "quant_matmul_q4_0_64x64_1_f16_res", "quant_matmul_q4_0_64x64_b_f16_res", "quant_dequantize_q4_0_64x64_f16",
        # layer 0's float gate_up is a fused decode op that applies SiLU * up itself
        # (compiler.fused_decode), so its kept down_proj takes no gate
        "quant_matmul_q4_1_64x128_1_f16_res", "quant_matmul_q4_1_64x128_b_f16_res",
        "quant_dequantize_q4_1_64x128_f16",
        "quant_matmul_q4_1_128x64_1_f16_norm", "quant_matmul_q4_1_128x64_b_f16", "quant_dequantize_q4_1_128x64_f16",
        "quant_matmul_q8_0_128x64_1_f16", "quant_matmul_q8_0_128x64_b_f16", "quant_dequantize_q8_0_128x64_f16",
        "quant_take_q8_0_128x64_f16"}


@pytest.mark.parametrize("fmt,tokens,few", slow_except(
    [("Q5_0", 1, False), ("Q5_0", None, True), ("Q5_0", None, False), ("Q4_K", 1, False), ("Q4_K", None, False),
     ("Q6_K", 1, False), ("Q6_K", None, False)], ("Q5_0", 1, False), unpack=True))
def test_cuda_source_builds_for_gemma_formats(fmt, tokens, few):
    """The CUDA source of Gemma 3's block formats at its shapes (K = 640 and 1024) builds for
    sm_90 without a GPU: one token and a decode batch take the GEMV of our own (Q5_0's fifth bits
    and Q6_K's high bits read as 32-bit words), a prefill dlight's rules."""
    if tvm.get_global_func("target.build.cuda", allow_missing=True) is None:
        pytest.skip("TVM built without CUDA codegen")
    k = 640 if fmt == "Q5_0" else 1024
    config = QuantMatmulConfig(fmt, 256, k, tokens=tokens, few_tokens=few, target="cuda", dtype="float16")
    source = tvm.compile(kernel(config), target=cuda_target()).mod.imports[0].inspect_source()
    assert "__global__" in source
    assert uses_cuda_gemv(config) == (tokens == 1 or few)
    if uses_cuda_gemv(config):
        assert ("qhw_ptr" in source) == (fmt in ("Q5_0", "Q6_K")) and "__shfl_xor_sync" in source
