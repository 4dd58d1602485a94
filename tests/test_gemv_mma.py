"""The tensor-core GEMV of kept GGUF blocks (tvmattn/quant/gemv_mma.py).

On the CPU: the permuted k of `real_k` covers each block once per lane; a numpy emulation of one
warp's m16n8k16 fragments, laid out as the PTX ISA's "Matrix Fragments for mma.m16n8k16" (.f16)
and filled as the kernel fills its registers (the quants' words, nibble halves, byte permutes and
float16 arithmetic), reproduces X W^T of the float16 weights; that arithmetic gives the float16 of
algorithms.dequantize_algorithm's weights for every quant value; the schedule's checks; the
kernel's parameters are gemv_kernel's; it builds for sm_90 (and its source compiles with nvcc,
where installed). On a GPU: against float64 X W^T of those float16 weights (and gemv_kernel's Y)
for odd row counts, K of whole and half groups of 4 blocks, and 2..64 tokens.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm

from harness import compiles_with_nvcc
from tvmattn.compiler.targets import cuda_target
from tvmattn.quant.algorithms import dequantize_algorithm
from tvmattn.quant.config import QuantMatmulConfig
from tvmattn.quant.gemv_cuda import choose_gemv_schedule, gemv_kernel
from tvmattn.quant.gemv_mma import (
    GROUP,
    MMA_GEMV_FORMATS,
    STEPS,
    WIDE_FROM_TOKENS,
    ZERO_PAIR,
    MMAGemvSchedule,
    choose_mma_gemv_layouts,
    choose_mma_gemv_schedule,
    mma_gemv_kernel,
    pair_selector,
    real_k,
)
from tvmattn.weights.quant import BLOCK, QuantizedTensor
from tvmattn.weights.random_blocks import random_block_matrix

ZERO = {"Q4_0": 8, "Q4_1": 0, "Q8_0": 0}  # the weights' zero point: W = d (q - z) (+ m)


# ---------------------------------------------------------------------------- numpy references

def byte_perm(x: np.ndarray, y: int, sel: int) -> np.ndarray:
    """CUDA's __byte_perm(x, y, sel) on uint32 arrays: result byte i is byte (sel >> 4 i) & 7 of
    the 8 bytes (x's 0..3, then y's)."""
    pool = [(x >> np.uint32(8 * b)) & np.uint32(0xFF) for b in range(4)]
    pool += [np.full_like(x, (y >> 8 * b) & 0xFF) for b in range(4)]
    return sum(pool[(sel >> 4 * i) & 7] << np.uint32(8 * i) for i in range(4)).astype(np.uint32)


def as_half2(bits: np.ndarray) -> np.ndarray:
    """uint32 [...] -> float16 [..., 2]: the low half first (as a .f16x2 register holds them)."""
    return np.ascontiguousarray(bits, dtype="<u4")[..., None].view("<f2")


def dequantize_pair(fmt: str, nibbles: np.ndarray, e: int, d: np.ndarray, m: np.ndarray | None) -> np.ndarray:
    """The kernel's DEQUANT_SRC in numpy float16 (whose +, - and * round once, as __hsub2 and
    __hmul2 do; __hfma2 as one rounding of the float64 d q + m, exact here): the half2 of bytes e,
    e+1 of `nibbles` (uint32 [...]), scales d and offsets m (float16 [...]) -> float16 [..., 2]."""
    magic = as_half2(byte_perm(nibbles, 0x64646464, pair_selector(e)))
    q = magic - as_half2(np.full(nibbles.shape, ZERO_PAIR[fmt], np.uint32))
    if m is None:
        return q * d[..., None]
    return (q.astype(np.float64) * d[..., None] + m[..., None]).astype(np.float16)


def block_words(blocks: QuantizedTensor) -> np.ndarray:
    """The quants as the kernel reads them: uint32 [N, NB, words], words 4 (4-bit) or 8 (Q8_0)."""
    rows, cols = blocks.shape
    return np.ascontiguousarray(blocks.parts["qs"]).view("<u4").reshape(rows, cols // BLOCK, -1)


def step_bytes(fmt: str, words: np.ndarray, idx: int) -> np.ndarray:
    """The word holding weights idx..idx+3 of each block, one quant a byte (the kernel's
    _step_bytes): 4-bit the nibble half, Q8_0 the signed byte + 128."""
    if fmt == "Q8_0":
        return words[..., idx // 4] ^ np.uint32(0x80808080)
    return (words[..., idx % 16 // 4] >> np.uint32(4 * (idx // 16))) & np.uint32(0x0F0F0F0F)


def rounded_weights(blocks: QuantizedTensor) -> np.ndarray:
    """float16 [N, K]: each weight d (q - z) (+ m) rounded once from its exact value (float64)."""
    rows, cols = blocks.shape
    fmt = blocks.type_name
    d = blocks.parts["d"].astype(np.float64)[:, :, None]
    if fmt == "Q8_0":
        q = blocks.parts["qs"].reshape(rows, -1, BLOCK).astype(np.float64)
    else:
        qs = blocks.parts["qs"].reshape(rows, -1, BLOCK // 2)
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).astype(np.float64) - ZERO[fmt]
    w = d * q + (blocks.parts["m"].astype(np.float64)[:, :, None] if fmt == "Q4_1" else 0.0)
    return w.reshape(rows, cols).astype(np.float16)


def library_weights(blocks: QuantizedTensor) -> np.ndarray:
    """float16 [N, K]: algorithms.dequantize_algorithm's weights (float32, built for the CPU) cast
    to float16 as the algorithm casts them for a float16 model."""
    rows, cols = blocks.shape
    config = QuantMatmulConfig(blocks.type_name, rows, cols, op="dequantize")
    fn = tvm.compile(dequantize_algorithm(config), target="llvm")
    out = tvm.runtime.tensor(np.zeros((rows, cols), np.float32))
    fn(*[tvm.runtime.tensor(blocks.parts[name]) for name, _, _ in config.part_shapes()], out)
    return out.numpy().astype(np.float16)


def emulate_warp(blocks: QuantizedTensor, x: np.ndarray) -> np.ndarray:
    """One warp's product of 16 rows and 8 tokens, as the kernel fills its registers:
    for each group of 4 blocks and mma step, lane (g, c)'s A registers (R0..R3) from its block's
    quant words and B registers (b0, b1) from X's words, placed in the logical A [16, 16] and
    B [16, 8] of m16n8k16 by the PTX ISA's fragment layout; D += A B in float64.
    blocks: 16 rows, K a multiple of 4 blocks; x: float16 [8, K]. Returns D [16, 8] float64."""
    fmt = blocks.type_name
    words = block_words(blocks)
    d = blocks.parts["d"]
    m = blocks.parts.get("m")
    xw = np.ascontiguousarray(x).view("<u4")  # [8, K / 2]
    acc = np.zeros((16, 8))
    for j in range(words.shape[1] // GROUP):
        for s in range(STEPS):
            a = np.zeros((16, 16))
            b = np.zeros((16, 8))
            for lane in range(32):
                g, c = lane // 4, lane % 4
                blk = GROUP * j + c
                idx = real_k(c, s, fmt)[0] - BLOCK * c
                regs = []  # R0 = (row g: idx, idx+1), R1 = (row g+8: ...), R2 = (row g: idx+2, idx+3), R3
                for e in (0, 2):
                    for row in (g, g + 8):
                        regs.append(dequantize_pair(fmt, step_bytes(fmt, words[row, blk], idx), e, d[row, blk],
                                                    None if m is None else m[row, blk]))
                # A: a0,a1 (g, 2c..2c+1), a2,a3 (g+8, 2c..), a4,a5 (g, 2c+8..2c+9), a6,a7 (g+8, 2c+8..)
                a[g, 2 * c:2 * c + 2], a[g + 8, 2 * c:2 * c + 2] = regs[0], regs[1]
                a[g, 2 * c + 8:2 * c + 10], a[g + 8, 2 * c + 8:2 * c + 10] = regs[2], regs[3]
                # B: b0,b1 (k 2c..2c+1, column g), b2,b3 (k 2c+8..2c+9, column g): X's words idx/2, idx/2 + 1
                base = blk * BLOCK // 2 + idx // 2
                b[2 * c:2 * c + 2, g] = as_half2(xw[g, base])
                b[2 * c + 8:2 * c + 10, g] = as_half2(xw[g, base + 1])
            acc += a @ b
    return acc


def exotic_blocks(fmt: str, rows: int, rng: np.random.Generator) -> QuantizedTensor:
    """Blocks holding every quant byte (each row: the 256 byte values in a shuffled order) with
    random scales (and offsets) of either sign over float16's range, subnormals included."""
    per_block = BLOCK if fmt == "Q8_0" else BLOCK // 2
    cols = 256 // per_block * BLOCK
    qs = np.stack([rng.permutation(256) for _ in range(rows)]).astype(np.uint8)

    def scales():
        magnitude = 2.0 ** rng.uniform(-20, 3, (rows, cols // BLOCK))
        return (magnitude * rng.choice([-1.0, 1.0], magnitude.shape)).astype(np.float16)

    parts = {"qs": qs.view(np.int8) if fmt == "Q8_0" else qs, "d": scales()}
    if fmt == "Q4_1":
        parts["m"] = scales()
    return QuantizedTensor(fmt, (rows, cols), parts)


# ---------------------------------------------------------------------------- the mapping and arithmetic

@pytest.mark.parametrize("fmt", MMA_GEMV_FORMATS)
def test_real_k_covers_each_block_once_per_lane(fmt):
    """Over a group's STEPS steps lane c's 4 weights a step are its block's 32, each once, and
    consecutive (two float16 pairs: one 32-bit word of X each)."""
    for c in range(GROUP):
        taken = [real_k(c, s, fmt) for s in range(STEPS)]
        assert sorted(sum(taken, [])) == list(range(BLOCK * c, BLOCK * (c + 1)))
        assert all(ks == list(range(ks[0], ks[0] + 4)) and ks[0] % 4 == 0 for ks in taken)


@pytest.mark.parametrize("fmt", MMA_GEMV_FORMATS)
def test_emulated_fragments_reproduce_the_product(fmt):
    """The numpy warp (emulate_warp) over random blocks of 16 rows and 3 groups gives X W^T of
    the float16 weights (float64 sums: equal but for the order of the sums)."""
    rng = np.random.default_rng(3)
    blocks = random_block_matrix(16, 3 * GROUP * BLOCK, fmt, 0.1, rng)
    x = rng.standard_normal((8, blocks.shape[1])).astype(np.float16)
    want = rounded_weights(blocks).astype(np.float64) @ x.astype(np.float64).T
    np.testing.assert_allclose(emulate_warp(blocks, x), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fmt", MMA_GEMV_FORMATS)
def test_float16_dequantization_is_the_library_s(fmt):
    """The magic-half arithmetic (byte permute, __hsub2, __hmul2 or __hfma2), on every quant byte
    with scales and offsets of either sign from subnormal to 8: Q4_0 and Q8_0 give exactly the
    float16 of dequantize_algorithm's float32 weights (d (q - z) is exact in float32, so that cast
    is the one rounding); Q4_1's fused d q + m rounds once, where the library rounds d q + m to
    float32 first: at most one float16 ulp apart, equal on GGUF-like offsets (m = -7.5 d)."""
    blocks = exotic_blocks(fmt, 64, np.random.default_rng(5))
    rows, cols = blocks.shape
    words = block_words(blocks)
    m = blocks.parts.get("m")
    got = np.zeros((rows, cols // BLOCK, BLOCK), np.float16)
    for s in range(STEPS):
        idx = real_k(0, s, fmt)[0]
        for e in (0, 2):
            got[:, :, idx + e:idx + e + 2] = dequantize_pair(fmt, step_bytes(fmt, words, idx), e, blocks.parts["d"], m)
    got = got.reshape(rows, cols)
    np.testing.assert_array_equal(got, rounded_weights(blocks))
    library = library_weights(blocks)
    if fmt != "Q4_1":
        np.testing.assert_array_equal(got, library)
        return
    ulp = np.abs(np.spacing(library.astype(np.float16))).astype(np.float64)
    assert (np.abs(got.astype(np.float64) - library) <= ulp).all()
    typical = random_block_matrix(64, 256, fmt, 0.1, np.random.default_rng(6))  # m = -7.5 d
    np.testing.assert_array_equal(rounded_weights(typical), library_weights(typical))


# ---------------------------------------------------------------------------- schedule and signature

@pytest.mark.parametrize("kwargs,message", [
    ({"warps": 3}, "warps=3"), ({"warps": 16}, "warps=16"), ({"warps": True}, "warps=True"),
    ({"token_tiles": 0}, "token_tiles=0"), ({"token_tiles": 8}, "token_tiles=8"),
    ({"token_tiles": 2.0}, "token_tiles=2.0"), ({"unroll": 3}, "unroll=3"), ({"unroll": 8}, "unroll=8"),
    ({"row_tiles": 3}, "row_tiles=3"), ({"row_tiles": 8}, "row_tiles=8"),
])
def test_schedule_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MMAGemvSchedule(**kwargs)


@pytest.mark.parametrize("k,warps", [(576, 8), (1536, 8), (8192, 8), (96, 1), (256, 2), (384, 2), (32, 1)])
def test_schedule_choice(k, warps):
    assert choose_mma_gemv_schedule(960, k) == MMAGemvSchedule(warps=warps, token_tiles=2)


@pytest.mark.parametrize("n,row_tiles", [(576, 1), (16383, 1), (16384, 2), (49152, 2), (128256, 2)])
def test_row_tiles_choice(n, row_tiles):
    """Two row tiles a block from ROW_TILES_FROM_N rows on (an LM head, a 1B model's gate_up)."""
    assert choose_mma_gemv_schedule(n, 2048).row_tiles == row_tiles


@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (16383, 2048), (64, 96)])
def test_wide_layout_from_32_tokens(n, k):
    """Below ROW_TILES_FROM_N rows, batches of WIDE_FROM_TOKENS tokens or more take 4 token tiles
    and 2 row tiles (the warps as below it); choose_mma_gemv_layouts gives both."""
    plan = choose_mma_gemv_schedule(n, k)
    wide = MMAGemvSchedule(warps=plan.warps, token_tiles=4, row_tiles=2)
    assert WIDE_FROM_TOKENS == 32
    assert choose_mma_gemv_schedule(n, k, 31) == plan and plan.token_tiles == 2 and plan.row_tiles == 1
    assert all(choose_mma_gemv_schedule(n, k, tokens) == wide for tokens in (32, 64, 256))
    assert choose_mma_gemv_layouts(n, k) == (plan, wide)


@pytest.mark.parametrize("n", [16384, 49152, 128256])
def test_one_layout_from_16384_rows(n):
    """From ROW_TILES_FROM_N rows (an LM head, a 1B gate_up) every count takes 2 token tiles and 2
    row tiles: no branch."""
    assert {choose_mma_gemv_schedule(n, 2048, tokens) for tokens in (1, 31, 32, 256)} == {
        MMAGemvSchedule(warps=8, token_tiles=2, row_tiles=2)}
    assert choose_mma_gemv_layouts(n, 2048)[1] is None


@pytest.mark.parametrize("kwargs,message", [
    ({"fmt": "Q5_0"}, "fmt='Q5_0'"), ({"fmt": "Q4_K"}, "fmt='Q4_K'"), ({"dtype": "float32"}, "dtype='float32'"),
    ({"k": 48}, "k=48"), ({"n": 0}, "n=0"),
])
def test_kernel_arguments_are_checked(kwargs, message):
    args = {"fmt": "Q4_0", "n": 64, "k": 96, "dtype": "float16", "plan": MMAGemvSchedule(), **kwargs}
    with pytest.raises(ValueError, match=message):
        mma_gemv_kernel(**args)


def signature(func: tvm.tirx.PrimFunc) -> str:
    """The `def func(...)` line of the PrimFunc's script: each parameter's name, shape and dtype."""
    return re.search(r"def func\(.*?\):", func.script(), re.S).group(0)


@pytest.mark.parametrize("fmt", MMA_GEMV_FORMATS)
@pytest.mark.parametrize("residual", [False, True])
def test_signature_is_gemv_kernel_s(fmt, residual):
    n, k = 1000, 96
    ours = mma_gemv_kernel(fmt, n, k, "float16", choose_mma_gemv_schedule(n, k), residual=residual)
    theirs = gemv_kernel(fmt, n, k, None, "float16", choose_gemv_schedule(n, k, None), residual=residual)
    assert signature(ours) == signature(theirs)
    extras = ["e0"] * (fmt == "Q4_1") + ["e1" if fmt == "Q4_1" else "e0"] * residual
    assert [param.name for param in ours.params] == ["x", "qs", "d", *extras, "y"]
    assert "n_tokens" in signature(ours)


# ---------------------------------------------------------------------------- CUDA source

@pytest.mark.parametrize("fmt", MMA_GEMV_FORMATS)
@pytest.mark.parametrize("residual", [False, True])
def test_builds_for_sm90(tmp_path, fmt, residual):
    """The kernel builds for sm_90 without a GPU (K = 576: a half group past the row's blocks;
    1000 rows: a partial row tile) as 16-byte loads, magic-half pairs and mma.sync; with nvcc on
    PATH its source compiles to a cubin."""
    if tvm.get_global_func("target.build.cuda", allow_missing=True) is None:
        pytest.skip("TVM built without CUDA codegen")
    plan = MMAGemvSchedule(warps=4, token_tiles=2)
    with cuda_target():
        source = tvm.compile(mma_gemv_kernel(fmt, 1000, 576, "float16", plan, residual=residual),
                             target=cuda_target()).mod.imports[0].inspect_source()
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in source
    assert "*(uint4*)(xw_ptr" in source and "*(uint4*)(qw_ptr" in source
    assert ("= tvmattn_dequant_pair_offset(" in source) == (fmt == "Q4_1") and "__byte_perm" in source
    assert "__launch_bounds__(128)" in source and "__syncthreads()" in source
    assert (("e1_ptr" if fmt == "Q4_1" else "e0_ptr") in source) == residual
    compiles_with_nvcc(source, tmp_path, cubin=True)


def test_wide_branch_is_a_second_kernel(tmp_path):
    """With `wide`, the function holds two kernels, the host launching the wide one from
    WIDE_FROM_TOKENS tokens (a 32-token tile: 4 token tiles' X registers); with nvcc on PATH both
    compile to a cubin."""
    if tvm.get_global_func("target.build.cuda", allow_missing=True) is None:
        pytest.skip("TVM built without CUDA codegen")
    narrow, wide = choose_mma_gemv_layouts(1000, 576)
    func = mma_gemv_kernel("Q4_1", 1000, 576, "float16", narrow, residual=True, wide=wide)
    script = func.script()
    assert "tvm_thread_invariant(n_tokens >= T.int64(32))" in script
    with cuda_target():
        built = tvm.compile(func, target=cuda_target())
    source = built.mod.imports[0].inspect_source()
    kernels = re.findall(r"__global__ void __launch_bounds__\((\d+)\) (\w+)\([^)]*\) \{", source)
    assert [threads for threads, _ in kernels] == ["256", "256"] and len({name for _, name in kernels}) == 2
    compiles_with_nvcc(source, tmp_path, cubin=True)


def test_every_format_in_one_module(tmp_path):
    """A kept-weight library mixes the formats (Q4_1 q/k/v beside a Q4_0 o_proj and a Q8_0 MLP):
    their kernels share one CUDA module, in which each helper function and type is defined once
    (TVM emits a helper's source once per function name, so two names must not carry the same
    definitions unguarded); with nvcc on PATH the module compiles to a cubin."""
    if tvm.get_global_func("target.build.cuda", allow_missing=True) is None:
        pytest.skip("TVM built without CUDA codegen")
    plan = MMAGemvSchedule(warps=4, token_tiles=2)
    names = [(f"gemv_{fmt}_{residual}", fmt, residual) for fmt in MMA_GEMV_FORMATS for residual in (False, True)]
    module = tvm.IRModule({name: mma_gemv_kernel(fmt, 192, 160, "float16", plan, residual=residual)
                           .with_attr("global_symbol", name) for name, fmt, residual in names})
    with cuda_target():
        source = tvm.compile(module, target=cuda_target()).mod.imports[0].inspect_source()
    kernels = set(re.findall(r"__global__ void __launch_bounds__\(\d+\) (\w+)\(", source))
    assert len(kernels) == len(names), kernels
    compiles_with_nvcc(source, tmp_path, cubin=True)


# ---------------------------------------------------------------------------- GPU

GPU_SHAPES = [(960, 576), (576, 1536), (2048, 8192), (1000, 96), (16384, 2048)]
GPU_TOKENS = (2, 7, 8, 16, 17, 31, 32, 64)  # the routed layouts: narrow below 32 tokens, wide from 32


@pytest.fixture(scope="module")
def built_gpu():
    """(fmt, n, k, residual, which) -> the compiled kernel ("mma" or the CUDA-core "gemv"), once."""
    cache = {}

    def get(fmt, n, k, residual, which):
        key = (fmt, n, k, residual, which)
        if key not in cache:
            narrow, wide = choose_mma_gemv_layouts(n, k)
            func = (mma_gemv_kernel(fmt, n, k, "float16", narrow, residual=residual, wide=wide)
                    if which == "mma" else
                    gemv_kernel(fmt, n, k, None, "float16", choose_gemv_schedule(n, k, None), residual=residual))
            cache[key] = tvm.compile(func, target=cuda_target())
        return cache[key]

    return get


def run_gpu(fn, blocks: QuantizedTensor, x: np.ndarray, r: np.ndarray | None) -> np.ndarray:
    dev = tvm.cuda(0)
    args = [tvm.runtime.tensor(x, device=dev)]
    args += [tvm.runtime.tensor(part, device=dev) for part in blocks.parts.values()]
    args += [] if r is None else [tvm.runtime.tensor(r, device=dev)]
    out = tvm.runtime.tensor(np.full((x.shape[0], blocks.shape[0]), np.nan, np.float16), device=dev)
    fn(*args, out)
    return out.numpy()


def bound(x: np.ndarray, w: np.ndarray, r: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(float64 X W^T (+ R), the tolerance test_quant_matmul.check_cuda gives a float16 Y: its
    rounding, 2^-11 relative, and 1e-5 of sum |X| |W| (+ |R|) for the float32 sums)."""
    want = x.astype(np.float64) @ w.astype(np.float64).T
    scale = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T
    if r is not None:
        want, scale = want + r, scale + np.abs(r.astype(np.float64))
    return want, 2.0 ** -11 * np.abs(want) + 1e-5 * scale + 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", MMA_GEMV_FORMATS)
@pytest.mark.parametrize("n,k", GPU_SHAPES)
@pytest.mark.parametrize("residual", [False, True])
def test_matches_float64_and_the_cuda_core_gemv(built_gpu, fmt, n, k, residual):
    """Y against float64 X W16^T (+ R), W16 the float16 weights the kernel multiplies, within
    check_cuda's tolerance, and against gemv_kernel's Y (float32 weights) within both tolerances
    and W16's rounding (2^-11 of sum |X| |W|); 2..64 tokens: partial token tiles, one and four
    thread-block rows, both of the routed function's kernels."""
    if k * n > 2048 * 8192 and residual:
        pytest.skip("the largest shape runs once, without the residual")
    rng = np.random.default_rng(n + k)
    blocks = random_block_matrix(n, k, fmt, k ** -0.5, rng)
    w16 = rounded_weights(blocks)
    w32 = blocks.dequantize()
    mma, gemv = built_gpu(fmt, n, k, residual, "mma"), built_gpu(fmt, n, k, residual, "gemv")
    for tokens in GPU_TOKENS:
        x = rng.standard_normal((tokens, k)).astype(np.float16)
        r = (rng.standard_normal((tokens, n)) * 4).astype(np.float16) if residual else None
        got = run_gpu(mma, blocks, x, r).astype(np.float64)
        assert np.isfinite(got).all()
        want, tol = bound(x, w16, r)
        assert (np.abs(got - want) <= tol).all(), (tokens, np.abs(got - want).max())
        other = run_gpu(gemv, blocks, x, r).astype(np.float64)
        want32, tol32 = bound(x, w32, r)
        rounding = 2.0 ** -11 * (np.abs(x).astype(np.float64) @ np.abs(w32).astype(np.float64).T)
        assert (np.abs(got - other) <= tol + tol32 + rounding).all(), (tokens, np.abs(got - other).max())


LAYOUTS = [MMAGemvSchedule(), MMAGemvSchedule(warps=8), MMAGemvSchedule(token_tiles=4, unroll=2),
           MMAGemvSchedule(warps=8, token_tiles=1, unroll=1), MMAGemvSchedule(warps=2, token_tiles=4),
           MMAGemvSchedule(warps=8, row_tiles=2, unroll=2), MMAGemvSchedule(warps=4, row_tiles=4, unroll=1),
           MMAGemvSchedule(warps=8, token_tiles=4, row_tiles=2, unroll=1)]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", MMA_GEMV_FORMATS)
@pytest.mark.parametrize("plan", LAYOUTS, ids=lambda plan: f"w{plan.warps}t{plan.token_tiles}u{plan.unroll}"
                                                          f"r{plan.row_tiles}")
def test_every_layout_gives_the_product(fmt, plan):
    """Each layout (warps, token tiles, unroll, row tiles) of one shape with a residual, against
    float64 X W16^T + R within check_cuda's tolerance: 1000 rows (a partial block of rows), K = 1536
    (12 groups: a warp's unrolled loop with a tail), 2 to 70 tokens (several token tiles)."""
    n, k = 1000, 1536
    fn = tvm.compile(mma_gemv_kernel(fmt, n, k, "float16", plan, residual=True), target=cuda_target())
    rng = np.random.default_rng(k)
    blocks = random_block_matrix(n, k, fmt, k ** -0.5, rng)
    w16 = rounded_weights(blocks)
    for tokens in (2, 17, 33, 70):
        x = rng.standard_normal((tokens, k)).astype(np.float16)
        r = (rng.standard_normal((tokens, n)) * 4).astype(np.float16)
        got = run_gpu(fn, blocks, x, r).astype(np.float64)
        want, tol = bound(x, w16, r)
        assert (np.abs(got - want) <= tol).all(), (tokens, np.abs(got - want).max())


# ---------------------------------------------------------------------------- bench_quant_gemv's plans

def test_bench_plans_parse_to_schedules():
    """scripts/bench_quant_gemv.py --mma-plans: w<warps>t<token tiles>u<unroll>r<row tiles>."""
    import argparse

    from harness import load_script

    parse_plan = load_script("bench_quant_gemv").parse_plan
    assert parse_plan("w8t2u4r2") == MMAGemvSchedule(warps=8, token_tiles=2, unroll=4, row_tiles=2)
    with pytest.raises(argparse.ArgumentTypeError, match="plan 'w8t2u4'"):
        parse_plan("w8t2u4")
    with pytest.raises(ValueError, match="row_tiles=3"):
        parse_plan("w8t2u4r3")


def test_bench_flags_a_kernel_off_the_float16_product():
    """bench_quant_gemv's `agrees`: a float16 Y of the product agrees, one output off by more than
    its rounding and the weights' does not."""
    torch = pytest.importorskip("torch")
    from harness import load_script

    agrees = load_script("bench_quant_gemv").agrees
    rng = np.random.default_rng(0)
    x = torch.tensor(rng.standard_normal((4, 96)))
    w = torch.tensor(rng.standard_normal((32, 96)) * 96 ** -0.5)
    want, scale = x @ w.T, x.abs() @ w.abs().T
    y = want.half()
    assert agrees(y, want, scale)
    wrong = y.clone()
    wrong[2, 5] += 0.01 * scale[2, 5].item() + 0.01
    assert not agrees(wrong, want, scale)
