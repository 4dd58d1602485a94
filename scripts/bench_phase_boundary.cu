// The cost of a dependency between two phases of a decode step on the GPU, four ways:
//   kernels          one kernel a phase, launched in a CUDA graph;
//   kernels + PDL    the same with programmatic dependent launch (griddepcontrol.wait first);
//   barrier (fence)  one persistent kernel, phases separated by a software grid barrier: an
//                    arrival counter (__threadfence, atomicAdd, a volatile spin, __threadfence);
//   barrier (acq/rel) the same counter with red.release.gpu / ld.acquire.gpu and no full fences;
//   barrier (flags)  no shared counter: each block stores its own flag (st.release.gpu) and
//                    polls every block's (ld.acquire.gpu, one thread a flag), so no atomics queue
//                    at one L2 address.
// Two more ways load each phase's weight columns into registers before the dependency, as the
// library's kernels do before griddepcontrol.wait: "PDL + regs" (kernels + PDL) and "flags +
// regs" (the flags barrier, the next phase's weights loaded before it waits).
// (A grid barrier needs every block resident at once: one or half a block an SM here.)
// Each phase is a GEMV of the vector the previous phase wrote (N floats, read from L2 by every
// block) with an N x N fp16 weight (the block's columns), or nothing but the dependency ("empty":
// each block reads one float the previous phase wrote and writes one).
// Build: nvcc -O3 -arch=sm_90 -o bench_phase_boundary scripts/bench_phase_boundary.cu
// Run:   ./bench_phase_boundary [phases]   (default 150; prints us a phase for each way, and the
//        largest difference between the ways' final vectors: they compute the same phases)
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cuda_bench_common.cuh"  // (CHECK, PDL, warp sums, a block's columns)

constexpr int N = 576;  // SmolLM2's hidden size
constexpr int THREADS = 128;

__device__ void gemv_phase(const float* __restrict__ x, float* __restrict__ out, const half* __restrict__ w) {
  __shared__ float xs[N];
  int c0, c1;
  block_range(N, c0, c1);
  stage_x<N, THREADS>(xs, x);
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int c = c0 + warp; c < c1; c += THREADS / 32) {
    float acc = 0.f;
    for (int k = lane; k < N; k += 32) acc += __half2float(w[(size_t)c * N + k]) * xs[k];
    acc = warp_sum(acc);
    if (lane == 0) out[c] = acc * (1.0f / N) + 1.0f;
  }
  __syncthreads();
}

constexpr int WARPS = THREADS / 32;
constexpr int K_PER_LANE = N / 32;
constexpr int COLS_PER_WARP = 3;  // a block's columns in registers: grids of at least 48 blocks

struct WeightRegs { half v[COLS_PER_WARP][K_PER_LANE]; };

__device__ __forceinline__ void load_weights(WeightRegs& r, const half* __restrict__ w) {
  int c0, c1;
  block_range(N, c0, c1);
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int j = 0; j < COLS_PER_WARP; ++j) {
    int c = min(c0 + warp + j * WARPS, c1 - 1);  // (clamped: columns past c1 are not written)
#pragma unroll
    for (int i = 0; i < K_PER_LANE; ++i) r.v[j][i] = w[(size_t)max(c, 0) * N + lane + 32 * i];
  }
}

__device__ void gemv_regs_phase(const float* __restrict__ x, float* __restrict__ out, const WeightRegs& r) {
  __shared__ float xs[N];
  int c0, c1;
  block_range(N, c0, c1);
  stage_x<N, THREADS>(xs, x);
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int j = 0; j < COLS_PER_WARP; ++j) {
    int c = c0 + warp + j * WARPS;
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < K_PER_LANE; ++i) acc += __half2float(r.v[j][i]) * xs[lane + 32 * i];
    acc = warp_sum(acc);
    if (lane == 0 && c < c1) out[c] = acc * (1.0f / N) + 1.0f;
  }
  __syncthreads();
}

__global__ void step_regs_kernel(const float* x, float* out, const half* w) {
  WeightRegs r;
  load_weights(r, w);
  pdl_wait(); pdl_launch();
  gemv_regs_phase(x, out, r);
}

__device__ void empty_phase(const float* __restrict__ x, float* __restrict__ out) {
  if (threadIdx.x == 0) out[blockIdx.x] = __ldcg(x + (blockIdx.x + 1) % gridDim.x) + 1.0f;
  __syncthreads();
}

__device__ __forceinline__ void phase(int empty, const float* x, float* out, const half* w) {
  if (empty) empty_phase(x, out); else gemv_phase(x, out, w);
}

__global__ void step_kernel(const float* x, float* out, const half* w, int pdl, int empty) {
  if (pdl) { pdl_wait(); pdl_launch(); }
  phase(empty, x, out, w);
}

__device__ unsigned arrivals;  // grows by gridDim.x a barrier

__device__ __forceinline__ void barrier_fence(unsigned target) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(&arrivals, 1u);
    volatile unsigned* a = &arrivals;
    while ((int)(*a - target) < 0) { }
    __threadfence();
  }
  __syncthreads();
}

__device__ __forceinline__ void barrier_acq_rel(unsigned target) {
  __syncthreads();
  if (threadIdx.x == 0) {
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" :: "l"(&arrivals) : "memory");
    unsigned seen;
    do { asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(&arrivals) : "memory"); }
    while ((int)(seen - target) < 0);
  }
  __syncthreads();
}

__device__ unsigned flags[1024];  // a block's count of barriers passed, across launches

__device__ __forceinline__ void barrier_flags(unsigned target) {
  __syncthreads();
  if (threadIdx.x == 0) asm volatile("st.release.gpu.global.u32 [%0], %1;" :: "l"(flags + blockIdx.x), "r"(target) : "memory");
  for (int b = threadIdx.x; b < gridDim.x; b += THREADS) {
    unsigned seen;
    do { asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(flags + b) : "memory"); }
    while ((int)(seen - target) < 0);
  }
  __syncthreads();
}

__global__ void persistent_flags_kernel(float* bufs, const half* w, int phases, unsigned base, int empty, int regs) {
  WeightRegs r;
  if (regs && !empty) load_weights(r, w);
  for (int p = 0; p < phases; ++p) {
    const float* x = bufs + (p % 2) * N;
    float* out = bufs + ((p + 1) % 2) * N;
    if (empty) empty_phase(x, out);
    else if (regs) gemv_regs_phase(x, out, r);
    else gemv_phase(x, out, w + (size_t)(p % 8) * N * N);
    if (p + 1 < phases) {
      if (regs && !empty) load_weights(r, w + (size_t)((p + 1) % 8) * N * N);
      barrier_flags(base + p + 1);
    }
  }
}

__global__ void persistent_kernel(float* bufs, const half* w, int phases, unsigned base, int acq_rel, int empty) {
  unsigned target = base;
  for (int p = 0; p < phases; ++p) {
    phase(empty, bufs + (p % 2) * N, bufs + ((p + 1) % 2) * N, w + (size_t)(p % 8) * N * N);
    if (p + 1 < phases) {
      target += gridDim.x;
      if (acq_rel) barrier_acq_rel(target); else barrier_fence(target);
    }
  }
}

int main(int argc, char** argv) {
  int phases = argc > 1 ? atoi(argv[1]) : 150;
  int sms; CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  std::vector<half> hw((size_t)8 * N * N);
  for (size_t i = 0; i < hw.size(); ++i) hw[i] = __float2half(((i * 2654435761u) % 1000) / 1000.0f - 0.5f);
  half* w; float* bufs;
  CHECK(cudaMalloc(&w, hw.size() * sizeof(half)));
  CHECK(cudaMemcpy(w, hw.data(), hw.size() * sizeof(half), cudaMemcpyHostToDevice));
  CHECK(cudaMalloc(&bufs, 2 * N * sizeof(float)));
  std::vector<float> ones(2 * N, 1.0f);
  cudaStream_t s; CHECK(cudaStreamCreate(&s));
  cudaEvent_t e0, e1; CHECK(cudaEventCreate(&e0)); CHECK(cudaEventCreate(&e1));
  const int reps = 50;
  auto reset = [&]() { CHECK(cudaMemcpy(bufs, ones.data(), 2 * N * sizeof(float), cudaMemcpyHostToDevice)); };
  auto last = [&]() { std::vector<float> v(N); CHECK(cudaMemcpy(v.data(), bufs + (phases % 2) * N, N * 4, cudaMemcpyDeviceToHost)); return v; };
  auto timed = [&](auto&& launch) {  // us a phase; launch() runs all phases once
    for (int i = 0; i < 5; ++i) launch();
    CHECK(cudaEventRecord(e0, s));
    for (int i = 0; i < reps; ++i) launch();
    CHECK(cudaEventRecord(e1, s)); CHECK(cudaEventSynchronize(e1));
    float ms; CHECK(cudaEventElapsedTime(&ms, e0, e1));
    return 1e3f * ms / reps / phases;
  };
  unsigned epoch = 0;  // the flags only grow, across all the flags-barrier launches
  for (int empty = 0; empty < 2; ++empty) {
    for (int blocks : {sms, sms / 2}) {
      constexpr int WAYS = 7;
      float us[WAYS]; std::vector<float> out[WAYS];
      for (int way = 0; way < 3; ++way) {  // a graph of `phases` kernels: plain, PDL, PDL + regs
        int pdl = way > 0, regs = way == 2;
        if (regs && empty) { us[way] = NAN; out[way] = out[1]; continue; }
        cudaGraph_t g; cudaGraphExec_t ge;
        CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
        for (int p = 0; p < phases; ++p) {
          const float* x = bufs + (p % 2) * N;
          const half* wp = w + (size_t)(p % 8) * N * N;
          if (regs) launch_pdl(s, step_regs_kernel, blocks, THREADS, pdl, x, bufs + ((p + 1) % 2) * N, wp);
          else launch_pdl(s, step_kernel, blocks, THREADS, pdl, x, bufs + ((p + 1) % 2) * N, wp, pdl, empty);
        }
        CHECK(cudaStreamEndCapture(s, &g));
        CHECK(cudaGraphInstantiate(&ge, g, 0));
        reset(); CHECK(cudaGraphLaunch(ge, s)); CHECK(cudaStreamSynchronize(s)); out[way] = last();
        us[way] = timed([&] { CHECK(cudaGraphLaunch(ge, s)); });
      }
      unsigned base = 0; CHECK(cudaMemcpyToSymbol(arrivals, &base, sizeof(base)));
      for (int acq = 0; acq < 2; ++acq) {
        auto launch = [&] {
          persistent_kernel<<<blocks, THREADS, 0, s>>>(bufs, w, phases, base, acq, empty);
          base += (unsigned)blocks * (phases - 1);
        };
        reset(); launch(); CHECK(cudaStreamSynchronize(s)); out[3 + acq] = last();
        us[3 + acq] = timed(launch);
      }
      for (int regs = 0; regs < 2; ++regs) {
        if (regs && empty) { us[6] = NAN; out[6] = out[5]; continue; }
        auto launch = [&] {
          persistent_flags_kernel<<<blocks, THREADS, 0, s>>>(bufs, w, phases, epoch, empty, regs);
          epoch += phases - 1;
        };
        reset(); launch(); CHECK(cudaStreamSynchronize(s)); out[5 + regs] = last();
        us[5 + regs] = timed(launch);
      }
      double diff = 0;  // every way computes the same phases from the same start
      for (int v = 1; v < WAYS; ++v) for (int i = 0; i < N; ++i) diff = fmax(diff, fabs((double)out[v][i] - out[0][i]));
      printf("%s phases, %d blocks of %d threads, %d phases: us a phase: kernels %.2f, kernels + PDL %.2f, "
             "PDL + regs %.2f, barrier (fence) %.2f, barrier (acq/rel) %.2f, barrier (flags) %.2f, "
             "flags + regs %.2f; max |diff| %.3g\n", empty ? "empty" : "GEMV",
             blocks, THREADS, phases, us[0], us[1], us[2], us[3], us[4], us[5], us[6], diff);
    }
  }
  return 0;
}
