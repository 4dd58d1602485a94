"""Device-side building blocks of the Hopper (sm_90a) tensor-core kernels.

What the kernels need beyond TVMScript's `T.ptx[...]` dialect:
- register fences: an empty asm that takes a register by reference, so that nvcc keeps reads
  and writes of wgmma accumulator / operand registers between `wgmma.fence` and
  `wgmma.wait_group` (TVM's own `noop_barrier` crashes in codegen in 0.27);
- packing two fp32 values into one fp16x2 / bf16x2 register (the A operand of `O += P V`);
- the 128-byte-swizzled shared-memory layout that wgmma descriptors read, and the
  descriptor fields for K-major and MN-major operands;
- the pieces the warp-specialised kernels (prefill_sm90, mla_sm90) share: the producer's ring
  of shared buffers (`ring_producer`), the two wgmma products of a consumer warpgroup
  (`wgmma_scores`: S = Q K^T, `wgmma_accumulate`: O += P V) and a consumer thread's online
  softmax over the two rows it holds of a wgmma m64 accumulator (`row_softmax`).

A tile of R rows x W columns (W a multiple of 64 two-byte elements) is stored as W/64
"panels" of R x 64 elements; within a panel, row r occupies 128 bytes and its 16-byte chunk
c sits at chunk c ^ (r % 8) (the hardware's 128B swizzle, with panels 1024-byte aligned).
"""

from __future__ import annotations

from tvm.script import tirx as T

from .softmax import prob, rescale_factor
from .support import PTX_DTYPE_NAMES, TENSOR_CORE_DTYPES

PANEL = 64  # two-byte elements per 128-byte swizzled row
CHUNK = 8  # two-byte elements per 16-byte chunk
SWIZZLE_128B = 3  # encode_matrix_descriptor's code for the 128-byte swizzle
# Stride byte offset of a 128B-swizzled operand: 8 rows x 128 bytes, in 16-byte units.
SWIZZLE_SBO = 64

PTX_TYPE = {dtype: PTX_DTYPE_NAMES[dtype] for dtype in TENSOR_CORE_DTYPES}
FULL_WARP = 0xFFFFFFFF

# TVM emits a func_call's source once per function name: one source string per helper.
_FENCE_F32 = r"""
__device__ __forceinline__ void tvmattn_fence_f32(float& r) { asm volatile("" : "+f"(r) :: "memory"); }
"""
_FENCE_U32 = r"""
__device__ __forceinline__ void tvmattn_fence_u32(unsigned int& r) { asm volatile("" : "+r"(r) :: "memory"); }
"""
_PACK = {
    "float16": ("tvmattn_pack_half2", r"""
#include <cuda_fp16.h>
__device__ __forceinline__ unsigned int tvmattn_pack_half2(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<unsigned int*>(&h);
}
"""),
    "bfloat16": ("tvmattn_pack_bfloat162", r"""
#include <cuda_bf16.h>
__device__ __forceinline__ unsigned int tvmattn_pack_bfloat162(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<unsigned int*>(&h);
}
"""),
}


def fence_f32(reg):
    """Keep nvcc from moving accesses of fp32 register `reg` across a wgmma fence or wait."""
    return T.cuda.func_call("tvmattn_fence_f32", reg, source_code=_FENCE_F32)


def fence_u32(reg):
    """fence_f32 for a 32-bit integer register."""
    return T.cuda.func_call("tvmattn_fence_u32", reg, source_code=_FENCE_U32)


def pack2(dtype: str, lo, hi):
    """Two fp32 values -> one 32-bit register holding (dtype(lo), dtype(hi)), lo in the low half."""
    name, source = _PACK[dtype]
    return T.cuda.func_call(name, lo, hi, source_code=source, return_type="uint32")


def swizzled(rows: int, r, c):
    """Element offset of (r, c) in a 128B-swizzled tile of `rows` rows (c counts elements)."""
    return (c // PANEL) * rows * PANEL + r * PANEL + T.bitwise_xor((c % PANEL) // CHUNK, r % 8) * CHUNK + c % CHUNK


def panel_stride_16b(rows: int) -> int:
    """Distance between two 64-column panels of a tile of `rows` rows, in 16-byte units (the
    leading byte offset of an MN-major operand that spans several panels)."""
    return rows * PANEL * 2 // 16


def wgmma_name(m_n_k: str, dtype: str) -> str:
    """The wgmma mnemonic for fp32 accumulation of `dtype` operands, e.g. m_n_k = "m64n128k16"."""
    t = PTX_TYPE[dtype]
    return f"wgmma.mma_async.sync.aligned.{m_n_k}.f32.{t}.{t}"


def ring_barriers(stages: int, producer_arrivals: int, consumer_arrivals: int):
    """The ring's mbarriers set up, as the macro `init_ring(full_, empty_, wg_, tid_)`: thread 0 of
    warpgroup 0 initializes each stage's `full_` barrier for `producer_arrivals` arrivals and its
    `empty_` barrier for `consumer_arrivals`, fences the inits, and the whole CTA syncs."""

    @T.macro
    def init_ring(full_, empty_, wg_, tid_):
        if wg_ == 0 and tid_ == 0:
            for s in T.unroll(stages):
                T.ptx.mbarrier.init.shared.b64(full_.ptr_to([s]), T.uint32(producer_arrivals))
                T.ptx.mbarrier.init.shared.b64(empty_.ptr_to([s]), T.uint32(consumer_arrivals))
            T.ptx.fence.mbarrier_init.release.cluster()
        T.cuda.cta_sync()

    return init_ring


def ring_producer(stages: int):
    """The producer's ring of `stages` shared buffers, as the macro
    `produce_steps(full_, empty_, nkv_, copy_step_)`: copy_step_(t) issues step t's cp.async copies
    into buffer t % stages, after waiting for the consumers to free it (mbarrier `empty_`); the
    buffer is signalled full (mbarrier `full_`) once this thread's copies into it have landed
    (fence.proxy.async, then arrive), one step behind so that two steps' copies are in flight."""
    ST = stages

    @T.macro
    def produce_steps(full_, empty_, nkv_, copy_step_):
        for t in T.serial(nkv_):
            if t >= ST:
                T.cuda.mbarrier_wait(empty_.ptr_to([t % ST]), ((t // ST) + 1) % 2)
            copy_step_(t)
            T.ptx["cp.async.commit_group"]()
            if t >= 1:
                T.ptx["cp.async.wait_group"](1)
                T.ptx["fence.proxy.async.shared::cta"]()
                T.ptx.mbarrier.arrive.shared.b64(full_.ptr_to([(t - 1) % ST]))
        if nkv_ > 0:
            T.ptx["cp.async.wait_group"](0)
            T.ptx["fence.proxy.async.shared::cta"]()
            T.ptx.mbarrier.arrive.shared.b64(full_.ptr_to([(nkv_ - 1) % ST]))

    return produce_steps


def row_softmax(ns: int, no: int, np_: int, dtype: str):
    """Macros `(quad_reduce, softmax)` of a consumer thread of a wgmma m64 tile, which holds two
    rows (r = 0, 1: the fragment's rows lane/4 and lane/4 + 8): ns fp32 scores, no fp32 outputs
    and np_ 16-bit pairs of P, element e of each group of 4 belonging to row e // 2.
    quad_reduce(buf_, idx_, op_): buf_[idx_] combined over the 4 lanes that share a row.
    softmax(sacc_, preg_, oacc_, m_, l_, scale_): online softmax step (base 2): new row maxima
    m_, l_ and oacc_ rescaled by exp2(old - new), P = exp2(S * scale_ - m_) packed into preg_."""
    NS, NO, NP = ns, no, np_

    @T.macro
    def quad_reduce(buf_, idx_, op_):
        buf_[idx_] = op_(buf_[idx_], T.tvm_warp_shuffle_xor(T.uint32(FULL_WARP), buf_[idx_], 1, 32, 32))
        buf_[idx_] = op_(buf_[idx_], T.tvm_warp_shuffle_xor(T.uint32(FULL_WARP), buf_[idx_], 2, 32, 32))

    @T.macro
    def softmax(sacc_, preg_, oacc_, m_, l_, scale_):
        row_max = T.alloc_local((2,), "float32")
        alpha = T.alloc_local((2,), "float32")
        for r in T.unroll(2):
            row_max[r] = m_[r]
        for i in T.unroll(NS // 4):
            for e in T.unroll(4):
                row_max[e // 2] = T.max(row_max[e // 2], sacc_[i * 4 + e] * scale_)
        for r in T.unroll(2):
            quad_reduce(row_max, r, T.max)
            alpha[r] = rescale_factor(m_[r], row_max[r])
            m_[r] = row_max[r]
            l_[r] = l_[r] * alpha[r]
        for i in T.unroll(NS // 4):
            for e in T.unroll(4):
                sacc_[i * 4 + e] = prob(sacc_[i * 4 + e] * scale_, m_[e // 2])
                l_[e // 2] = l_[e // 2] + sacc_[i * 4 + e]
        for i in T.unroll(NO // 4):
            for e in T.unroll(4):
                oacc_[i * 4 + e] = oacc_[i * 4 + e] * alpha[e // 2]
        for q in T.unroll(NP):
            preg_[q] = pack2(dtype, sacc_[q * 2], sacc_[q * 2 + 1])

    return quad_reduce, softmax


def wgmma_scores(name: str, ns: int, k_steps: int):
    """Macro `scores(smem_, sacc_, q_at_, k_at_)`: sacc_ (ns fp32 registers) <- Q K^T by the wgmma
    `name` (m64nNk16), over k_steps steps of 16 along the head dim; q_at_(kk) / k_at_(kk): element
    offsets in smem_ of step kk's 16 columns of the 128B-swizzled, K-major Q and K tiles."""

    @T.macro
    def scores(smem_, sacc_, q_at_, k_at_):
        desc_q = T.alloc_local((1,), "uint64")
        desc_k = T.alloc_local((1,), "uint64")
        T.ptx.wgmma.fence.sync.aligned()
        for kk in T.unroll(k_steps):
            T.cuda.wgmma.encode_matrix_descriptor(desc_q.ptr_to([0]), smem_.ptr_to([q_at_(kk)]), 1, SWIZZLE_SBO,
                                                  SWIZZLE_128B)
            T.cuda.wgmma.encode_matrix_descriptor(desc_k.ptr_to([0]), smem_.ptr_to([k_at_(kk)]), 1, SWIZZLE_SBO,
                                                  SWIZZLE_128B)
            T.ptx[name](*[sacc_[i] for i in range(ns)], desc_q[0], desc_k[0], T.bool(kk > 0), 1, 1, 0, 0)
        T.ptx.wgmma.commit_group.sync.aligned()
        T.ptx.wgmma.wait_group.sync.aligned(0)
        for i in T.unroll(ns):
            T.evaluate(fence_f32(sacc_[i]))

    return scores


def wgmma_accumulate(name: str, no: int, np_: int, k_steps: int, v_rows: int):
    """Macro `accumulate(smem_, oacc_, preg_, v_at_)`: oacc_ (no fp32 registers) += P V by the wgmma
    `name` (m64nNk16), P from registers (np_ 16-bit pairs), over k_steps steps of 16 keys;
    v_at_(kk): element offset in smem_ of step kk's 16 rows of the 128B-swizzled, MN-major V tile
    of v_rows rows (its 64-column panels v_rows * 64 elements apart)."""

    @T.macro
    def accumulate(smem_, oacc_, preg_, v_at_):
        desc_v = T.alloc_local((1,), "uint64")
        for q in T.unroll(np_):
            T.evaluate(fence_u32(preg_[q]))
        for i in T.unroll(no):
            T.evaluate(fence_f32(oacc_[i]))
        T.ptx.wgmma.fence.sync.aligned()
        for kk in T.unroll(k_steps):
            T.cuda.wgmma.encode_matrix_descriptor(desc_v.ptr_to([0]), smem_.ptr_to([v_at_(kk)]),
                                                  panel_stride_16b(v_rows), SWIZZLE_SBO, SWIZZLE_128B)
            T.ptx[name](*[oacc_[i] for i in range(no)], preg_[kk * 4], preg_[kk * 4 + 1], preg_[kk * 4 + 2],
                        preg_[kk * 4 + 3], desc_v[0], T.bool(True), 1, 1, 1)
        T.ptx.wgmma.commit_group.sync.aligned()
        T.ptx.wgmma.wait_group.sync.aligned(0)
        for i in T.unroll(no):
            T.evaluate(fence_f32(oacc_[i]))
        for q in T.unroll(np_):
            T.evaluate(fence_u32(preg_[q]))

    return accumulate
