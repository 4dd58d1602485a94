"""CUDA device functions that more than one kernel calls through `T.cuda.func_call`.

Each is a (name, source) pair: TVM emits a function's source once per module, by name.
The loads read through L2 (`__ldcg`): they read what other blocks of the same launch wrote
(split partials), which a block's L1 may hold stale.
"""

LDCG, LDCG_SRC = "tvmattn_ldcg", "__device__ __forceinline__ float tvmattn_ldcg(const float* p) { return __ldcg(p); }\n"
LDCG4, LDCG4_SRC = "tvmattn_ldcg4", """
// dst[0..3] <- the 4 floats at p (16-byte aligned), read through L2 (written by other blocks).
__device__ __forceinline__ void tvmattn_ldcg4(float* dst, const float* p) {
  float4 v = __ldcg(reinterpret_cast<const float4*>(p));
  dst[0] = v.x; dst[1] = v.y; dst[2] = v.z; dst[3] = v.w;
}
"""
FMA4, FMA4_SRC = "tvmattn_fma_ldcg4", """
// acc[0..3] += w * the 4 floats at p (16-byte aligned), read through L2 (written by other blocks).
__device__ __forceinline__ void tvmattn_fma_ldcg4(float* acc, const float* p, float w) {
  float4 v = __ldcg(reinterpret_cast<const float4*>(p));
  acc[0] += w * v.x; acc[1] += w * v.y; acc[2] += w * v.z; acc[3] += w * v.w;
}
"""


def arrival_counter(slots: int, tag: str = ""):
    """Name and CUDA source of a fused split merge's arrival function over `slots` counters: a
    module-scope __device__ array (zeroed when the module loads, as every __device__ variable
    without an initializer); arrive(slot, n), called by one thread of a split block after the
    block's partial is written and fenced, returns 1 to the n-th block to arrive, which resets
    the counter to 0 for the next launch (so no per-call memset). Launches of one module must not
    overlap in time (one stream, or graphs replayed in order)."""
    name, counters = f"tvmattn_decode_arrive{tag}_{slots}", f"tvmattn_decode_arrivals{tag}_{slots}"
    src = f"""
__device__ unsigned {counters}[{slots}];
__device__ __forceinline__ int {name}(int slot, int n) {{
  __threadfence();
  unsigned seen = atomicAdd(&{counters}[slot], 1u);
  if (seen + 1u < (unsigned)n) return 0;
  {counters}[slot] = 0u;
  __threadfence();
  return 1;
}}
"""
    return name, src
