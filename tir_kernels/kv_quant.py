"""FP8 K/V pages: how kernels write (quantize) and read (dequantize) them, and where the scales live.

A cache whose `kv_dtype` is an FP8 format ("float8_e4m3fn", "float8_e5m2") stores each K or V
element as the 1-byte code of `x / scale` (saturated to the format's largest finite value,
rounded to nearest even) and reads it back as `code * scale`. Scales are float32, one per
(K or V, KV head) of a layer; an MLA layer has two, one for the latent part of its rows
(columns below latent_dim, also the values) and one for the rotary key part (the rest): the
latent is normalized, the rotary part is not, so their ranges differ.

The scales live in the pool itself: the last page of a layer's pool (`pages[num_pages - 1]`)
is never handed out by the cache's allocator and holds, as 4 little-endian bytes, the scale of
(kv, head) at `pages[-1, kv, head, 0, 0:4]` (MLA: the latent scale at `pages[-1, 0, 0:4]`, the
rotary part's at `pages[-1, 0, 4:8]`). So every kernel keeps
the contract's arguments (TVM's, which has no FP8 cache): a layer's pages carry their scales, a
CUDA graph or a fork needs nothing more, and the host writes them once
(`tvmattn.runtime` `PagedKVCache(kv_scales=...)`).

The codes are converted bit by bit, not with TIR casts: TVM 0.27's LLVM codegen converts FP8
subnormals (and zero: code 0 reads as 2**-7 in e4m3fn) wrongly in both directions, and the CUDA
codegen's casts are correct but would make the CPU tests check different arithmetic from the
GPU's. Reading widens the code into an fp16 bit pattern (e5m2 is the top byte of an fp16;
e4m3fn's exponent and mantissa shift into fp16's, the missing bias is a factor 2**8 folded into
the scale), exact for every finite code, subnormals included. Writing rounds in integer
arithmetic on the float32 bits (normal range) or on the exactly scaled value (subnormals).
"""

from __future__ import annotations

import tvm
from tvm.script import tirx as T

from .support import FP8_MAX, is_fp8

# e4m3fn: code bits into fp16 exponent/mantissa bits leave a factor 2**(15 - 7).
_WIDEN_FACTOR = {"float8_e4m3fn": 256.0, "float8_e5m2": 1.0}
# (exponent bias, mantissa bits) of each format
_FORMAT = {"float8_e4m3fn": (7, 3), "float8_e5m2": (15, 2)}


def _lanes_of(dtype: str, lanes: int) -> str:
    return dtype if lanes == 1 else f"{dtype}x{lanes}"


def _const(value, dtype: str, lanes: int):
    scalar = tvm.tirx.const(value, dtype)
    return scalar if lanes == 1 else T.broadcast(scalar, lanes)


def decode_code(code, fmt: str, lanes: int = 1):
    """The float32 value of FP8 code(s) `code` (a `fmt` expression of `lanes` lanes), times
    _WIDEN_FACTOR[fmt]'s inverse: callers multiply by `scale * _WIDEN_FACTOR[fmt]`
    (`widened_scale`). Exact for every finite code."""
    u16 = _lanes_of("uint16", lanes)
    bits = T.Cast(u16, T.reinterpret(_lanes_of("uint8", lanes), code))
    if fmt == "float8_e5m2":
        half = bits << _const(8, "uint16", lanes)
    else:
        half = ((bits & _const(0x7F, "uint16", lanes)) << _const(7, "uint16", lanes)) | (
            (bits & _const(0x80, "uint16", lanes)) << _const(8, "uint16", lanes))
    return T.Cast(_lanes_of("float32", lanes), T.reinterpret(_lanes_of("float16", lanes), half))


def encode_value(x, fmt: str):
    """The FP8 code (a `fmt` scalar expression) of float32 `x`: saturated to +-FP8_MAX[fmt],
    rounded to nearest even (subnormals included). NaN is not expected (its code is unspecified)."""
    bias, mbits = _FORMAT[fmt]
    top = T.float32(FP8_MAX[fmt])
    xc = T.min(T.max(x, -top), top)
    u = T.reinterpret("uint32", xc)
    sign = (u >> T.uint32(24)) & T.uint32(0x80)
    a = u & T.uint32(0x7FFFFFFF)
    shift = 23 - mbits
    # normal range: round the float32 mantissa to mbits bits (a carry moves into the exponent)
    rounded = a + T.uint32((1 << (shift - 1)) - 1) + ((a >> T.uint32(shift)) & T.uint32(1))
    normal = (rounded >> T.uint32(shift)) - T.uint32((127 - bias) << mbits)
    # subnormal range: |x| / 2**(1 - bias - mbits) (exact), rounded to an integer, half to even
    v = T.reinterpret("float32", a) * T.float32(2.0 ** (bias - 1 + mbits))
    whole = T.Cast("uint32", v)
    frac = v - T.Cast("float32", whole)
    up = T.Select(frac > T.float32(0.5), T.uint32(1),
                  T.Select(frac == T.float32(0.5), whole & T.uint32(1), T.uint32(0)))
    min_normal_bits = (127 + 1 - bias) << 23
    code = T.Select(a >= T.uint32(min_normal_bits), normal, whole + up) | sign
    return T.reinterpret(fmt, T.Cast("uint8", code))


def read_scale(byte):
    """The float32 whose 4 little-endian bytes are byte(0)..byte(3) (FP8 elements of a page)."""
    word = T.uint32(0)
    for i in range(4):
        word = word | (T.Cast("uint32", T.reinterpret("uint8", byte(i))) << T.uint32(8 * i))
    return T.reinterpret("float32", word)


def kv_scale(pages, kv, head):
    """The scale of (kv: 0 = K, 1 = V, KV head `head`) of a paged MHA pool [P, 2, Hkv, ps, D],
    read from its last page."""
    last = pages.shape[0] - 1
    return read_scale(lambda i: pages[last, kv, head, 0, i])


def mla_scale(pages, part: int = 0):
    """A scale of an MLA latent pool [P, ps, qk_dim], read from its last page: part 0 that of the
    latent columns, part 1 that of the rotary key columns."""
    last = pages.shape[0] - 1
    return read_scale(lambda i: pages[last, 0, 4 * part + i])


def mla_column_scale(config, pages, d):
    """The scale of column d of an MLA row (d: an int32 expression; the rotary part starts at
    config.latent_dim)."""
    if config.rope_dim == 0:
        return mla_scale(pages, 0)
    return T.Select(d < config.latent_dim, mla_scale(pages, 0), mla_scale(pages, 1))


def widened_scale(scale, fmt: str):
    """scale * _WIDEN_FACTOR[fmt]: the factor that turns decode_code's value into code * scale."""
    return scale * T.float32(_WIDEN_FACTOR[fmt])


def dequantize(code, scale, fmt: str, lanes: int = 1):
    """code * scale as float32 (lanes wide): `scale` is the plain (not widened) float32 scale."""
    factor = widened_scale(scale, fmt)
    return decode_code(code, fmt, lanes) * (factor if lanes == 1 else T.broadcast(factor, lanes))


def quantize(x, scale, fmt: str):
    """The FP8 code of float32 x / scale (encode_value)."""
    return encode_value(x / scale, fmt)


def read_kv(config, pages, kv, head, page, slot, d, out_dtype=None, lanes: int = 1):
    """Element(s) [page, kv, head, slot, d] of an MHA pool as out_dtype (default the config's
    dtype): the stored value where the pages are not FP8, else the dequantized code."""
    out = out_dtype or config.dtype
    value = pages[page, kv, head, slot, d]
    if not is_fp8(config.kv_dtype):
        return value if out == config.page_dtype else T.Cast(_lanes_of(out, lanes), value)
    deq = dequantize(value, kv_scale(pages, kv, head), config.kv_dtype, lanes)
    return deq if out == "float32" else T.Cast(_lanes_of(out, lanes), deq)


def write_kv(config, pages, kv, head, value):
    """What to store into an MHA pool at (kv, head): `value` (the dtype) itself, or its FP8 code."""
    if not is_fp8(config.kv_dtype):
        return value
    return quantize(T.Cast("float32", value), kv_scale(pages, kv, head), config.kv_dtype)


def read_mla(config, pages, page, slot, d, out_dtype=None):
    """Element [page, slot, d] of an MLA pool as out_dtype (read_kv's rules; FP8: the scale of
    column d's part, mla_column_scale)."""
    out = out_dtype or config.dtype
    value = pages[page, slot, d]
    if not is_fp8(config.kv_dtype):
        return value if out == config.page_dtype else T.Cast(out, value)
    deq = dequantize(value, mla_column_scale(config, pages, d), config.kv_dtype)
    return deq if out == "float32" else T.Cast(out, deq)


def write_mla(config, pages, d, value):
    """What to store into column d of an MLA pool: `value` itself, or its FP8 code."""
    if not is_fp8(config.kv_dtype):
        return value
    return quantize(T.Cast("float32", value), mla_column_scale(config, pages, d), config.kv_dtype)


# The factor fp8_chunk_function's unscaled chunks multiply each code's value by (callers fold its
# inverse into the scales): e5m2's largest code (57344) would overflow fp16 once inline RoPE
# rotates a pair of them; times 2**-8 every e5m2 value (subnormals included: 2**-24 is fp16's
# smallest) stays exact.
FP8_TILE_FACTOR = {"float8_e4m3fn": 1.0, "float8_e5m2": 2.0 ** -8}


def _pair_conversion(fmt: str, dtype: str, scaled: bool) -> tuple:
    """(union member, C statements) turning `__half2 h` (two codes' values) into the union word
    `w` of two `dtype` elements: times FP8_TILE_FACTOR[fmt], or with `scaled` times `scale`."""
    member = "__half2 h;" if dtype == "float16" else "__nv_bfloat162 b;"
    if scaled:
        pack = "w.h = __floats2half2_rn(f.x, f.y);" if dtype == "float16" else "w.b = __floats2bfloat162_rn(f.x, f.y);"
        return member, "float2 f = __half22float2(h); f.x *= scale; f.y *= scale; " + pack
    factor = FP8_TILE_FACTOR[fmt]
    widen = f"h = __hmul2(h, __float2half2_rn({factor!r}f)); " if factor != 1.0 else ""
    return member, widen + ("w.h = h;" if dtype == "float16"
                            else "float2 f = __half22float2(h); w.b = __floats2bfloat162_rn(f.x, f.y);")


def _widen_body(name: str, fmt: str, convert: str) -> str:
    """C statements: `words[2]` (8 codes) -> the 16 bytes at dst."""
    kind = {"float8_e4m3fn": "__NV_E4M3", "float8_e5m2": "__NV_E5M2"}[fmt]
    return f"""  unsigned out[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {{
    const __nv_fp8x2_storage_t pair = (__nv_fp8x2_storage_t)((words[k >> 1] >> (16 * (k & 1))) & 0xFFFFu);
    __half2 h = __half2(__nv_cvt_fp8x2_to_halfraw2(pair, {kind}));
    {name}_word w;
    {convert}
    out[k] = w.u;
  }}
  *reinterpret_cast<uint4*>(dst) = make_uint4(out[0], out[1], out[2], out[3]);
"""


def fp8_chunk_function(fmt: str, dtype: str, scaled: bool = False):
    """Name and CUDA source (for T.cuda.func_call) of the FP8 chunk load of the tensor-core
    kernels: name(dst, src) reads the 8 codes at src (8 bytes of a page row, 8-byte aligned)
    and stores 8 `dtype` (float16 / bfloat16) elements at dst (16 bytes of shared memory, the
    tile chunk the dtype's pages would have been copied into): each code's value times
    FP8_TILE_FACTOR[fmt] (exact: every FP8 value is an fp16 one, the hardware's pair conversion
    is exact, and bfloat16 goes through float); with `scaled`, name(dst, src, scale) stores
    code * scale instead (computed in float32, rounded to the dtype)."""
    name = f"tvmattn_fp8_chunk_{fmt}_{dtype}" + ("_scaled" if scaled else "")
    member, convert = _pair_conversion(fmt, dtype, scaled)
    params = "void* dst, const void* src" + (", float scale" if scaled else "")
    src = f"""
union {name}_word {{ unsigned u; {member} }};
__device__ __forceinline__ void {name}({params}) {{
  const uint2 raw = __ldg(reinterpret_cast<const uint2*>(src));
  const unsigned words[2] = {{raw.x, raw.y}};
{_widen_body(name, fmt, convert)}}}
"""
    return name, src


# fp8_fetch_function's: words[0..1] <- the 8 bytes at src (8-byte aligned), read-only path
FP8_FETCH, FP8_FETCH_SRC = "tvmattn_fp8_fetch", """
__device__ __forceinline__ void tvmattn_fp8_fetch(unsigned* words, const void* src) {
  const uint2 raw = __ldg(reinterpret_cast<const uint2*>(src));
  words[0] = raw.x;
  words[1] = raw.y;
}
"""


def fp8_store_function(fmt: str, dtype: str, scaled: bool = False):
    """Name and CUDA source of the second half of fp8_chunk_function, for a load issued earlier
    by FP8_FETCH: name(dst, w0, w1) (with `scaled`: name(dst, w0, w1, scale)) stores the values
    of the 8 codes in words w0, w1 (little-endian: the first code in w0's low byte) as
    fp8_chunk_function does."""
    name = f"tvmattn_fp8_store_{fmt}_{dtype}" + ("_scaled" if scaled else "")
    member, convert = _pair_conversion(fmt, dtype, scaled)
    params = "void* dst, unsigned w0, unsigned w1" + (", float scale" if scaled else "")
    src = f"""
union {name}_word {{ unsigned u; {member} }};
__device__ __forceinline__ void {name}({params}) {{
  const unsigned words[2] = {{w0, w1}};
{_widen_body(name, fmt, convert)}}}
"""
    return name, src
