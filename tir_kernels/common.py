"""TIR building blocks shared by every kernel: loop kinds per target, RoPE, length accessors.

Kernels are written once. A `LoopKinds` object decides whether a loop is a CUDA grid or
thread axis or a CPU loop, so the CPU variant of a kernel is the same algorithm run with
one "thread" per block (see docs/design.md).
"""

from __future__ import annotations

import math

from tvm.script import tirx as T

from . import script_parser
from .config import AttentionConfig, RopeScaling

script_parser.install()

LOG2E = math.log2(math.e)
# Running-max start value and the LSE reported for a row that sees no key. Finite, so
# that merging two empty states never computes inf - inf.
EMPTY_LSE = -5.0e4


# 2**f on [-0.5, 0.5]: degree-6 fit of the relative error (1e-7 evaluated in float32, as exp2f)
_EXP2_POLY = (1.0, 0.6931472, 0.24022646, 0.05550329, 0.00961852, 0.0013399861, 0.00015337577)


def exp2_vector(x, terms=_EXP2_POLY):
    """2**x (float32) in arithmetic that LLVM vectorizes (exp2f is a library call per lane):
    x clamped to [-126, 126], 2**round(x) from the exponent bits times a polynomial of the rest
    (`terms`, lowest degree first). The CPU decode's probabilities and the CPU SiLU
    (models/cpu_elementwise.py); accurate to about 1e-7 relative (below 2**-126: 2**-126)."""
    xc = T.min(T.max(x, T.float32(-126.0)), T.float32(126.0))
    n = T.nearbyint(xc)
    f = xc - n
    poly = T.float32(terms[-1])
    for c in reversed(terms[:-1]):
        poly = poly * f + T.float32(c)
    return poly * T.reinterpret("float32", T.shift_left(T.Cast("int32", n) + 127, 23))


# The scope of the CPU kernels' scratch buffers (accumulators, tiles, rows in flight): "global",
# which TVM's LowerTVMBuiltin keeps on the stack when constant and under 1 KB. It sends every
# "local" CPU buffer, of any size, to a TVMBackendAllocWorkspace / FreeWorkspace pair at each
# entry of its loop, and such a buffer cannot live in registers.
CPU_SCRATCH_SCOPE = "global"

# Programmatic dependent launch (sm_90+): a PrimFunc carrying the attribute PDL_TAG (TVM's launch tag,
# misspelled there) has its kernels launched with it by build.PIPELINE; each of them calls
# grid_dependency_wait() before its first global memory access (build.py's docstring).
PDL_TAG = "tirx.use_programtic_dependent_launch"
GRID_WAIT, GRID_WAIT_SRC = "tvmattn_grid_dependency_wait", """
// Programmatic dependent launch (sm_90+): wait until the grids this launch depends on have
// completed and their memory is visible (at once where the launch had no such dependency).
__device__ __forceinline__ void tvmattn_grid_dependency_wait() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}
"""
LAUNCH_DEPENDENTS, LAUNCH_DEPENDENTS_SRC = "tvmattn_launch_dependents", """
// Programmatic dependent launch (sm_90+): this block no longer holds back the next launch of
// the stream (its blocks are scheduled once every block of this grid has said so or exited).
__device__ __forceinline__ void tvmattn_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
"""

PREFETCH_L2, PREFETCH_L2_SRC = "tvmattn_prefetch_l2", """
// A hint (sm_90+): the block's share of `bytes` bytes from `base` (bytes / blocks, whole 16-byte
// units, the last block the rest; at most `cap` bytes of it) starts streaming into L2, issued by
// one thread; no memory is read into the block and nothing waits for it.
__device__ __forceinline__ void tvmattn_prefetch_l2(const void* base, long long bytes, long long cap) {
  if (threadIdx.x != 0 || threadIdx.y != 0 || threadIdx.z != 0) return;
  const long long blocks = (long long)gridDim.x * gridDim.y * gridDim.z;
  const long long b = blockIdx.x + (long long)gridDim.x * (blockIdx.y + (long long)gridDim.y * blockIdx.z);
  const long long share = (bytes / blocks) & ~15LL;
  const long long begin = b * share;
  long long size = (b == blocks - 1 ? bytes - begin : share);
  if (size > cap) size = cap;
  // the instruction takes a 16-byte aligned address and a multiple of 16 bytes
  const unsigned long long first = reinterpret_cast<unsigned long long>(base) + begin;
  const unsigned long long aligned = (first + 15ULL) & ~15ULL;
  size = (size - (long long)(aligned - first)) & ~15LL;
  if (size < 16) return;
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(aligned), "r"((unsigned)size) : "memory");
}
"""


def grid_dependency_wait():
    """The call (a void expression for T.evaluate) that marks its kernel for programmatic
    dependent launch and waits for the stream's previous grids (build.py's docstring)."""
    return T.cuda.func_call(GRID_WAIT, source_code=GRID_WAIT_SRC)


def prefetch_l2(base, nbytes: int, cap: int):
    """The call (a void expression for T.evaluate) with which a block starts its share of the
    `nbytes` bytes at pointer `base` streaming into L2, at most `cap` bytes (PREFETCH_L2_SRC)."""
    return T.cuda.func_call(PREFETCH_L2, base, T.int64(nbytes), T.int64(cap), source_code=PREFETCH_L2_SRC)


def launch_dependents():
    """The call (a void expression for T.evaluate) that lets the stream's next launch start."""
    return T.cuda.func_call(LAUNCH_DEPENDENTS, source_code=LAUNCH_DEPENDENTS_SRC)


class LoopKinds:
    """Maps a kernel's logical grid and thread loops onto the target.

    CUDA: `block` / `thread` loops bind blockIdx / threadIdx. CPU: the outermost block loop
    is parallel, every other loop serial, and thread extents are expected to be 1.
    """

    def __init__(self, gpu: bool):
        self.gpu = gpu

    def block(self, extent, tag: str, outer: bool = False):
        if self.gpu:
            return T.thread_binding(extent, thread=f"blockIdx.{tag}")
        return T.parallel(extent) if outer else T.serial(extent)

    def thread(self, extent, tag: str):
        if self.gpu:
            return T.thread_binding(extent, thread=f"threadIdx.{tag}")
        return T.serial(extent)

    @property
    def local(self) -> str:
        """The scope of a thread's scratch buffers: "local" on CUDA, CPU_SCRATCH_SCOPE on the CPU."""
        return "local" if self.gpu else CPU_SCRATCH_SCOPE

    def vector(self, extent):
        """Innermost copy loop: 16-byte vector loads/stores on CUDA."""
        return T.vectorized(extent) if self.gpu else T.serial(extent)

    def unroll(self, extent):
        return T.unroll(extent) if self.gpu else T.serial(extent)


def loop_kinds(config: AttentionConfig) -> LoopKinds:
    return LoopKinds(config.is_gpu)


def rope_inv_freq(d, rotary_dim: int, theta, scaling: RopeScaling | None):
    """Inverse frequency of rotary pair `d % (rotary_dim/2)`, float32."""
    half = rotary_dim // 2
    exponent = T.Cast("float32", (d % half) * 2) / T.float32(rotary_dim)
    inv_freq = T.float32(1.0) / T.pow(T.Cast("float32", theta), exponent)
    if scaling is None:
        return inv_freq
    # Llama-3: keep high frequencies, divide low ones by `factor`, blend in between.
    span = scaling.high_freq_factor - scaling.low_freq_factor
    blend = T.max(
        T.float32(0.0),
        T.min(
            T.float32(1.0),
            inv_freq * T.float32(scaling.original_max_position_embeddings / (2 * math.pi * span))
            - T.float32(scaling.low_freq_factor / span),
        ),
    )
    return (T.float32(1.0) - blend) * inv_freq / T.float32(scaling.factor) + blend * inv_freq


def rope_angle(d, pos, rotary_dim: int, theta, scale, scaling: RopeScaling | None):
    """The rotation angle (float32) of element `d` (pair `d % (rotary_dim/2)`) at token position pos (int)."""
    return T.Cast("float32", pos) * T.Cast("float32", scale) * rope_inv_freq(d, rotary_dim, theta, scaling)


def rope_rotate(load, d, cos, sin, rotary_dim: int):
    """Element `d` of a rotate-half RoPE'd vector, float32, given the cos and sin of its angle
    (rope_angle). load(i) returns element i of the un-rotated vector."""
    half = rotary_dim // 2
    partner = T.if_then_else(
        d < half,
        T.float32(0.0) - T.Cast("float32", load(d + half)),
        T.Cast("float32", load(d - half)),
    )
    return cos * T.Cast("float32", load(d)) + sin * partner


def rope_value(load, d, pos, rotary_dim: int, theta, scale, scaling: RopeScaling | None):
    """Element `d` of a rotate-half RoPE'd vector, float32 (its cos and sin computed here).

    load(i) returns element i of the un-rotated vector; pos is the token position (int).
    """
    angle = rope_angle(d, pos, rotary_dim, theta, scale, scaling)
    return rope_rotate(load, d, T.cos(angle), T.sin(angle), rotary_dim)


def kv_chunk_len(num_pages, page_size: int, length_info, b, sliding_window: bool):
    """Visible KV tokens of request b: full pages plus the last page's used slots.

    With a sliding window, `length_info` is [3, batch] = (last_page_len,
    sliding_window_offset, sink_size): the first `sink_size` tokens of the paged sequence
    are kept and then everything from `sliding_window_offset` on.
    """
    if not sliding_window:
        return T.if_then_else(num_pages > 0, (num_pages - 1) * page_size + length_info[b], 0)
    return T.if_then_else(
        num_pages > 0,
        (num_pages - 1) * page_size + length_info[0, b] - length_info[1, b] + length_info[2, b],
        0,
    )


def paged_position(j, length_info, b, sliding_window: bool):
    """Slot in the paged sequence of the j-th visible KV token of request b."""
    if not sliding_window:
        return j
    return T.if_then_else(j < length_info[2, b], j, j - length_info[2, b] + length_info[1, b])


def length_info_shape(batch, sliding_window: bool):
    return (3, batch) if sliding_window else (batch,)


def ceildiv(a, b):
    return (a + b - 1) // b


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


__all__ = [
    "CPU_SCRATCH_SCOPE",
    "EMPTY_LSE",
    "LOG2E",
    "LoopKinds",
    "ceildiv",
    "is_power_of_two",
    "kv_chunk_len",
    "length_info_shape",
    "loop_kinds",
    "paged_position",
    "rope_angle",
    "rope_inv_freq",
    "rope_rotate",
    "rope_value",
]
