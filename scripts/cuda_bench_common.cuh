// Helpers of the CUDA benchmark programs in scripts/ (bench_phase_boundary.cu, bench_fused_mlp.cu,
// bench_l2_lookahead.cu).
#pragma once
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
  printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1); } } while (0)

// programmatic dependent launch: wait for the previous grid; let the next one be scheduled
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_launch() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// kernel<<<blocks, threads, 0, stream>>>(args...), launched with programmatic stream serialization
// where pdl (its blocks may start while the stream's previous kernel runs; they pdl_wait() for it)
template <typename Kernel, typename... Args>
void launch_pdl(cudaStream_t stream, Kernel kernel, int blocks, int threads, bool pdl, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = blocks;
  cfg.blockDim = threads;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = pdl;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  CHECK(cudaLaunchKernelEx(&cfg, kernel, args...));
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// the block's share [c0, c1) of n columns
__device__ __forceinline__ void block_range(int n, int& c0, int& c1) {
  int per = (n + gridDim.x - 1) / gridDim.x;
  c0 = min(n, (int)blockIdx.x * per);
  c1 = min(n, c0 + per);
}

// x's n floats (written by another grid: read through L2) into shared memory, for the whole block
template <int n, int threads>
__device__ __forceinline__ void stage_x(float* xs, const float* __restrict__ x) {
  for (int i = threadIdx.x; i < n; i += threads) xs[i] = __ldcg(x + i);
  __syncthreads();
}
