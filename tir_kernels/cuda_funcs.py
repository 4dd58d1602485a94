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
