"""A decode step's whole MLP for one token as one CUDA kernel (`fused_mlp_kernel`).

What it computes, x [1, 1, H] the residual stream, g [H] the post-attention norm's weight,
W_gu [2 I, H] (gate rows, then up rows) and W_d [H, I], all in the activations' dtype:

    n = rms_norm(x, g)                     (float32 inside, rounded to the dtype: fused_decode's norm)
    h = silu(n W_gate^T) * (n W_up^T)      (float32 sums, rounded once: fused_decode's SwiGLU)
    y = x + (h W_d^T)                      (float32 sums; the product rounded, then the add, as the
                                            unfused down_proj + residual)

Why: at batch 1 every kernel of a step is a dependent phase, and a phase costs about as much as
its work (docs/performance.md, "phase boundary"). The plain MLP is two phases (norm + gate_up +
SiLU * mul, then down_proj + residual); this kernel is one.

How (`FusedMLPSchedule`): block b owns `cols` intermediate columns c0 = b cols, ...; its warps
take cols / warps columns each. Before the grid-dependency wait (the leading loops marked
PREFETCH_ATTR, compiler/dependent_launch.py: weights are read-only) every thread loads its share
of the block's weights into registers: a warp's gate and up rows (each lane `vec` consecutive
elements at a time) and, for each of the thread's output rows r = t, t + threads, ..., the `cols`
elements W_d[r, c0 ..]. After the wait each block normalizes x into shared memory, computes its
columns of h (warp sums by shuffles), multiplies them by its W_d slice and adds the partial
outputs into a module-scope float32 accumulator with `red.global.add` (ACC_SRC). The last block
to arrive (cuda_funcs.arrival_counter) reads the accumulator through L2, writes y and zeroes it
for the next launch, so nothing outside the kernel clears it. Launches of one module must not
overlap in time (one stream, or graphs replayed in order), as for the decode kernels' merges.

Float32 additions from different blocks land in any order, so y may differ from the two-kernel
MLP's in the last bit of the float32 sum (before its rounding to the dtype).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools

from tvm import tirx
from tvm.script import tirx as T

from tir_kernels.cuda_funcs import arrival_counter

from .dependent_launch import PREFETCH_ATTR, WEIGHTS_BEFORE_WAIT_ATTR

_ENABLED = contextvars.ContextVar("tvmattn_fused_mlp", default=False)
FULL_WARP = 0xFFFFFFFF
FUSED_MLP_DTYPES = ("float16", "bfloat16")
# a thread's weights in registers: what the register file leaves for the rest of the kernel
MAX_WEIGHT_BYTES_PER_THREAD = 256
# blocks resident at once that a model's kernel may have: 132 SMs (H100, H200) of two 256-thread
# blocks (on a GPU with fewer SMs the later blocks load their weights after the wait: slower, as right)
RESIDENT_BLOCKS = 264


def _acc_source(hidden: int):
    """Name and CUDA source of the module-scope float32 accumulator of `hidden` outputs, one
    function (TVM emits a source once per name): acc(i, v, 0) adds v to output i (a
    red.global.add) and returns 0; acc(i, 0, 1) returns output i read through L2 and zeroes it."""
    name, acc = f"tvmattn_mlp_acc_{hidden}", f"tvmattn_mlp_accumulator_{hidden}"
    src = f"""
__device__ float {acc}[{hidden}];
__device__ __forceinline__ float {name}(int i, float v, int take) {{
  if (take) {{
    float sum = __ldcg({acc} + i);
    {acc}[i] = 0.0f;
    return sum;
  }}
  asm volatile("red.global.add.f32 [%0], %1;" :: "l"({acc} + i), "f"(v) : "memory");
  return 0.0f;
}}
"""
    return name, src


# Weight loads that stay before the grid wait. The compiler turns a read-only __restrict__
# argument's loads into ld.global.nc, which ptxas then sinks past griddepcontrol.wait to their
# first use (seen in the SASS); a plain ld.global stays where it is written.
def _load_before_wait(nbytes: int):
    """Name and CUDA source of load(dst, src): nbytes (4, 8 or 16; src aligned to it) into dst."""
    regs = nbytes // 4
    vec = "" if regs == 1 else f".v{regs}"
    outs = ", ".join(f"%{i}" for i in range(regs))
    binds = ", ".join(f'"=r"(v[{i}])' for i in range(regs))
    name = f"tvmattn_load_before_wait_{nbytes}"
    src = f"""
// {nbytes} bytes at src into dst (ld.global, not .nc: ptxas keeps it ahead of griddepcontrol.wait)
__device__ __forceinline__ void {name}(void* dst, const void* src) {{
  unsigned v[{regs}];
  asm volatile("ld.global{vec}.b32 {{{outs}}}, [%{regs}];" : {binds} : "l"(src));
#pragma unroll
  for (int i = 0; i < {regs}; ++i) reinterpret_cast<unsigned*>(dst)[i] = v[i];
}}
"""
    return name, src


# x, written by the kernel before: read through L2 with a coherent load (a .nc load of it, which
# the compiler emits for a __restrict__ argument the kernel does not write, ptxas may hoist above
# griddepcontrol.wait: seen in the SASS)
LDCG16, LDCG16_SRC = "tvmattn_ldcg_16", """
__device__ __forceinline__ unsigned short tvmattn_ldcg_16(const void* p) {
  return __ldcg(reinterpret_cast<const unsigned short*>(p));
}
"""
@dataclasses.dataclass(frozen=True)
class FusedMLPSchedule:
    """cols: intermediate columns a block (a multiple of warps, dividing the intermediate size);
    threads: a block's threads (a multiple of 32); vec: elements a lane loads at a time from a gate
    or up row (2, 4 or 8; 32 vec divides the hidden size)."""

    cols: int
    threads: int = 256
    vec: int = 2

    def __post_init__(self):
        if self.threads % 32 or not 32 <= self.threads <= 1024:
            raise ValueError(f"threads={self.threads!r}: expected a multiple of 32 in 32..1024")
        if self.vec not in (2, 4, 8):
            raise ValueError(f"vec={self.vec!r}: expected 2, 4 or 8")
        if self.cols < 1 or self.cols % self.warps:
            raise ValueError(f"cols={self.cols!r}: expected a positive multiple of the {self.warps} warps")

    @property
    def warps(self) -> int:
        return self.threads // 32

    def weight_bytes_per_thread(self, hidden: int, dtype_bytes: int = 2) -> int:
        """Bytes of weights a thread holds in registers (gate and up rows, its W_d rows' columns)."""
        gate_up = 2 * (self.cols // self.warps) * (hidden // 32)
        down = -(-hidden // self.threads) * self.cols
        return (gate_up + down) * dtype_bytes


def check_fused_mlp(hidden: int, intermediate: int, dtype: str, schedule: FusedMLPSchedule) -> None:
    """ValueError naming what the kernel cannot take."""
    if dtype not in FUSED_MLP_DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {FUSED_MLP_DTYPES}")
    if hidden % (32 * schedule.vec):
        raise ValueError(f"hidden={hidden}: expected a multiple of 32 * vec = {32 * schedule.vec}")
    if intermediate % schedule.cols or schedule.cols % 8:
        raise ValueError(f"cols={schedule.cols}: expected a multiple of 8 dividing intermediate={intermediate}")


def choose_fused_mlp_schedule(hidden: int, intermediate: int, dtype: str, blocks_limit: int) -> FusedMLPSchedule | None:
    """The schedule of a one-token MLP of these sizes, or None where the kernel does not pay: its
    blocks must all be resident at once (at most `blocks_limit`, the device's SMs times the blocks
    an SM holds) and each thread's weights fit MAX_WEIGHT_BYTES_PER_THREAD, so that every weight is
    in registers before the grid wait (a model whose MLP streams megabytes gains nothing from one
    phase less). The fewest columns a block (the most blocks), then the fewest threads, that fit."""
    if dtype not in FUSED_MLP_DTYPES:
        return None
    vec = next((v for v in (8, 4, 2) if hidden % (32 * v) == 0), None)
    if vec is None:
        return None
    for cols in (8, 16, 32, 64):
        if intermediate % cols or intermediate // cols > blocks_limit:
            continue
        for threads in (256, 512):  # more threads a block: fewer W_d rows a thread
            if cols % (threads // 32) == 0:
                schedule = FusedMLPSchedule(cols=cols, threads=threads, vec=vec)
                if schedule.weight_bytes_per_thread(hidden) <= MAX_WEIGHT_BYTES_PER_THREAD:
                    return schedule
    return None


def fused_mlp_kernel(hidden: int, intermediate: int, dtype: str, eps: float,
                     schedule: FusedMLPSchedule) -> tirx.PrimFunc:
    """The PrimFunc (x [1, 1, H], g [H], w_gu [2 I, H], w_d [H, I], y [1, 1, H]) of the module
    docstring, all in `dtype`."""
    check_fused_mlp(hidden, intermediate, dtype, schedule)
    H, I, C, NT, V = hidden, intermediate, schedule.cols, schedule.threads, schedule.vec
    WARPS = schedule.warps
    CW = C // WARPS              # columns a warp
    P = H // (32 * V)            # vectors a lane of a gate or up row
    R = -(-H // NT)              # rows a thread: of x (its norm), of W_d and of y
    BLOCKS = I // C
    f32 = "float32"
    acc, acc_src = _acc_source(H)
    arrive, arrive_src = arrival_counter(1, tag="_mlp")
    inv_h = 1.0 / H
    row_load, row_load_src = _load_before_wait(2 * V)   # a lane's vector of a gate or up row
    col_load, col_load_src = _load_before_wait(16)      # 8 columns of a W_d row

    @T.prim_func
    def fused_mlp(x: T.Buffer((1, 1, H), dtype), g: T.Buffer((H,), dtype), w_gu: T.Buffer((2 * I, H), dtype),
                  w_d: T.Buffer((H, I), dtype), y: T.Buffer((1, 1, H), dtype)):
        T.func_attr({"tirx.noalias": True})
        for bx in T.thread_binding(BLOCKS, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                xs = T.alloc_shared((H,), f32)       # n, the normalized row
                hs = T.alloc_shared((C,), f32)       # the block's columns of h
                sums = T.alloc_shared((WARPS,), f32)
                last = T.alloc_shared((1,), "int32")
                w_row = T.alloc_local((2 * CW * P * V,), dtype)  # the warp's gate rows, then its up rows
                wd = T.alloc_local((R * C,), dtype)
                part = T.alloc_local((2,), f32)
                x_own = T.alloc_local((R,), f32)  # x[i NT + tx], the thread's elements
                is_last = T.alloc_local((1,), "int32")
                warp = T.meta_var(tx // 32)
                lane = T.meta_var(tx % 32)
                c0 = T.meta_var(bx * C)
                # the weights into registers, before the grid wait (PREFETCH_ATTR)
                for _p in T.serial(1, annotations={PREFETCH_ATTR: 1}):
                    for j in T.unroll(CW):
                        for p in T.unroll(P):
                            for half in T.unroll(2):  # the gate row, then the up row
                                T.evaluate(T.cuda.func_call(
                                    row_load, T.address_of(w_row[(half * CW + j) * P * V + p * V]),
                                    T.address_of(w_gu[half * I + c0 + warp * CW + j, (p * 32 + lane) * V]),
                                    source_code=row_load_src))
                    for r in T.unroll(R):
                        for k8 in T.unroll(C // 8):
                            T.evaluate(T.cuda.func_call(col_load, T.address_of(wd[r * C + k8 * 8]),
                                                        T.address_of(w_d[T.min(r * NT + tx, H - 1), c0 + k8 * 8]),
                                                        source_code=col_load_src))
                # n = rms_norm(x, g): the sum of squares by warp shuffles, then over the warps
                part[0] = T.float32(0)
                for i in T.unroll(R):
                    if i * NT + tx < H:
                        x_own[i] = T.Cast(f32, T.reinterpret(dtype, T.cuda.func_call(
                            LDCG16, T.address_of(x[0, 0, i * NT + tx]), source_code=LDCG16_SRC, return_type="uint16")))
                        part[0] = part[0] + x_own[i] * x_own[i]
                for s in T.unroll(5):
                    part[0] = part[0] + T.tvm_warp_shuffle_xor(T.uint32(FULL_WARP), part[0], 16 >> s, 32, 32)
                if lane == 0:
                    sums[warp] = part[0]
                T.tvm_storage_sync("shared")
                part[0] = T.float32(0)
                for w in T.unroll(WARPS):
                    part[0] = part[0] + sums[w]
                part[1] = T.rsqrt(part[0] * T.float32(inv_h) + T.float32(eps))
                for i in T.unroll(R):
                    if i * NT + tx < H:
                        xs[i * NT + tx] = T.Cast(f32, T.Cast(dtype, part[1] * x_own[i] * T.Cast(f32, g[i * NT + tx])))
                T.tvm_storage_sync("shared")
                # the warp's columns of h
                for j in T.unroll(CW):
                    part[0] = T.float32(0)
                    part[1] = T.float32(0)
                    for p in T.unroll(P):
                        for v in T.unroll(V):
                            part[0] = part[0] + T.Cast(f32, w_row[(j * P + p) * V + v]) * xs[(p * 32 + lane) * V + v]
                            part[1] = part[1] + T.Cast(f32, w_row[((CW + j) * P + p) * V + v]) * xs[(p * 32 + lane) * V + v]
                    for s in T.unroll(5):
                        part[0] = part[0] + T.tvm_warp_shuffle_xor(T.uint32(FULL_WARP), part[0], 16 >> s, 32, 32)
                        part[1] = part[1] + T.tvm_warp_shuffle_xor(T.uint32(FULL_WARP), part[1], 16 >> s, 32, 32)
                    if lane == 0:
                        hs[warp * CW + j] = T.Cast(f32, T.Cast(dtype, part[0] * T.sigmoid(part[0]) * part[1]))
                T.tvm_storage_sync("shared")
                # the block's partial outputs into the accumulator
                for r in T.unroll(R):
                    if r * NT + tx < H:
                        part[0] = T.float32(0)
                        for k in T.unroll(C):
                            part[0] = part[0] + T.Cast(f32, wd[r * C + k]) * hs[k]
                        T.evaluate(T.cuda.func_call(acc, r * NT + tx, part[0], 0, source_code=acc_src, return_type=f32))
                T.tvm_storage_sync("shared")  # the block's reds issued; arrive fences them, then counts
                if tx == 0:
                    last[0] = T.cuda.func_call(arrive, 0, BLOCKS, source_code=arrive_src, return_type="int32")
                T.tvm_storage_sync("shared")
                is_last[0] = last[0]
                if is_last[0] == 1:  # every block's partial is in: y, and the accumulator zeroed
                    for r in T.unroll(R):
                        if r * NT + tx < H:
                            part[0] = T.cuda.func_call(acc, r * NT + tx, T.float32(0), 1, source_code=acc_src,
                                                        return_type=f32)
                            y[0, 0, r * NT + tx] = T.Cast(dtype, x_own[r] + T.Cast(f32, T.Cast(dtype, part[0])))

    return fused_mlp.with_attr(WEIGHTS_BEFORE_WAIT_ATTR, True)


@contextlib.contextmanager
def fused_mlp(enabled: bool):
    """Models exported inside this context write a decode step's MLP for one token as one
    `fused_mlp_kernel` where `model_schedule` gives a schedule (BuildOptions.fused_mlp)."""
    token = _ENABLED.set(bool(enabled))
    try:
        yield
    finally:
        _ENABLED.reset(token)


def model_schedule(rows, hidden: int, intermediate: int, dtype: str) -> FusedMLPSchedule | None:
    """The schedule of the MLP of a decode step of `rows` sequences (an int, or a symbolic batch)
    in a model exported now: inside fused_mlp(True), a static batch of 1, else None."""
    if not _ENABLED.get() or not (isinstance(rows, int) and rows == 1):
        return None
    return choose_fused_mlp_schedule(hidden, intermediate, dtype, RESIDENT_BLOCKS)


@functools.lru_cache(maxsize=None)
def model_kernel(hidden: int, intermediate: int, dtype: str, eps: float, schedule: FusedMLPSchedule) -> tirx.PrimFunc:
    """fused_mlp_kernel marked scheduled (the pipeline's schedule rules leave it alone) and
    opaque (never fused with its neighbours), one object per configuration (one function in
    the library for every layer)."""
    func = fused_mlp_kernel(hidden, intermediate, dtype, eps, schedule)
    return func.with_attr("tirx.is_scheduled", True).with_attr("op_pattern", 8)


__all__ = ["RESIDENT_BLOCKS", "fused_mlp", "model_kernel", "model_schedule", "FUSED_MLP_DTYPES", "FusedMLPSchedule", "check_fused_mlp", "choose_fused_mlp_schedule", "fused_mlp_kernel"]
