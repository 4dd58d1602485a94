// One decode-step MLP a layer (batch 1, SmolLM2's shapes: hidden 576, intermediate 1536, fp16
// weights), two ways, to learn whether fusing gate_up and down_proj into one kernel pays:
//   two kernels   gate_up with SiLU * mul (h = silu(Wg x) * (Wu x)), then down_proj with the
//                 residual (y = x + Wd h), chained by programmatic dependent launch; each block
//                 loads its weight columns into registers before griddepcontrol.wait;
//   one kernel    each block owns a slice of the intermediate columns: its rows of Wg and Wu and
//                 its columns of Wd (stored transposed, [intermediate, hidden]) are loaded into
//                 registers before the wait; after it the block computes its slice of h, multiplies
//                 it by its Wd columns and adds the partial y into a float32 accumulator with
//                 red.global.add (scalar, or the sm_90 vector form of 4 floats). Block 0 adds the
//                 residual. Three rotating vectors: layer L reads v[L % 3], accumulates into
//                 v[(L + 1) % 3] and zeroes v[(L + 2) % 3], which layer L - 1 read (complete once
//                 layer L's wait returns) and layer L + 1 only adds to after its own wait.
//   one kernel, last arrival: the same blocks add into a module-scope float32 accumulator and
//                 count their arrivals; the last block writes y = x + accumulator and zeroes it
//                 (the form a model library could take: y in its own buffer, nothing zeroed
//                 outside the kernel).
// Each layer has its own weights (all layers together exceed L2, as a model's do). Every way runs
// `layers` layers in one CUDA graph; the program prints us a layer and the largest difference
// between the ways' final vectors (float32 atomics add in any order: small, not zero).
// Build: nvcc -O3 -arch=sm_90 -o bench_fused_mlp scripts/bench_fused_mlp.cu
// Run:   ./bench_fused_mlp [layers]   (default 30)
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cuda_bench_common.cuh"  // (CHECK, PDL, warp sums, a block's columns)

constexpr int H = 576;   // hidden
constexpr int I = 1536;  // intermediate
constexpr int THREADS = 256;
constexpr int WARPS = THREADS / 32;
// a lane's pairs of a row of K elements: pair i holds elements 2 lane + 64 i and the next (half2)
constexpr int H_PAIRS = H / 64;  // 9
constexpr int I_PAIRS = I / 64;  // 24
constexpr int MAX_COLS = 16;     // intermediate columns a block of the fused kernel: 96 or more blocks
constexpr int Y_PAIR_ROUNDS = (H / 2 + THREADS - 1) / THREADS;  // scalar red: a thread's output pairs (2)

__device__ __forceinline__ float silu(float g) { return g / (1.0f + __expf(-g)); }

__device__ __forceinline__ half2 pair(const half* __restrict__ row, int i, int lane) {
  return *reinterpret_cast<const half2*>(row + 2 * lane + 64 * i);
}

// a row's pairs (H_PAIRS of them) against x staged in shared memory
__device__ __forceinline__ float dot_x(const half2* w, const float* xs, int lane) {
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < H_PAIRS; ++i) {
    float2 wf = __half22float2(w[i]);
    float2 xf = *reinterpret_cast<const float2*>(xs + 2 * lane + 64 * i);
    acc += wf.x * xf.x + wf.y * xf.y;
  }
  return acc;
}

// ---- two kernels ---------------------------------------------------------------------------
// gate_up: block b takes intermediate columns [b * per, ...), a warp a column at a time (at most
// 2 a warp: 96 or more blocks); wgu holds the gate rows, then the up rows ([2 I, H]).
constexpr int GU_COLS_PER_WARP = 2;

// the block's gate and up rows for its warps' columns, into registers (past the block's columns:
// its last column again, not written)
__device__ __forceinline__ void load_gate_up(half2 (&wg)[GU_COLS_PER_WARP][H_PAIRS], half2 (&wu)[GU_COLS_PER_WARP][H_PAIRS],
                                             const half* __restrict__ wgu, int c0, int c1, int warp, int lane) {
#pragma unroll
  for (int j = 0; j < GU_COLS_PER_WARP; ++j) {
    int c = min(c0 + warp + j * WARPS, max(c1 - 1, 0));
#pragma unroll
    for (int i = 0; i < H_PAIRS; ++i) {
      wg[j][i] = pair(wgu + (size_t)c * H, i, lane);
      wu[j][i] = pair(wgu + (size_t)(I + c) * H, i, lane);
    }
  }
}

// silu(gate) * up of one column from its rows' registers, x staged in xs (every lane gets it)
__device__ __forceinline__ float gate_up_value(const half2* wg, const half2* wu, const float* xs, int lane) {
  return silu(warp_sum(dot_x(wg, xs, lane))) * warp_sum(dot_x(wu, xs, lane));
}

__global__ void __launch_bounds__(THREADS, 2) gate_up_kernel(const float* x, float* h, const half* __restrict__ wgu) {
  int c0, c1;
  block_range(I, c0, c1);
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  half2 wg[GU_COLS_PER_WARP][H_PAIRS], wu[GU_COLS_PER_WARP][H_PAIRS];
  load_gate_up(wg, wu, wgu, c0, c1, warp, lane);
  pdl_wait(); pdl_launch();
  __shared__ float xs[H];
  stage_x<H, THREADS>(xs, x);
#pragma unroll
  for (int j = 0; j < GU_COLS_PER_WARP; ++j) {
    int c = c0 + warp + j * WARPS;
    float value = gate_up_value(wg[j], wu[j], xs, lane);
    if (lane == 0 && c < c1) h[c] = value;
  }
}

// down_proj + residual: block b takes hidden columns [b * per, ...), a warp a column (at most 1:
// 72 or more blocks); wd is [H, I].
__global__ void __launch_bounds__(THREADS, 2) down_kernel(const float* x, const float* h, float* y,
                                                          const half* __restrict__ wd) {
  int c0, c1;
  block_range(H, c0, c1);
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int c = c0 + warp;
  half2 w[I_PAIRS];
#pragma unroll
  for (int i = 0; i < I_PAIRS; ++i) w[i] = pair(wd + (size_t)min(c, max(c1 - 1, 0)) * I, i, lane);
  pdl_wait(); pdl_launch();
  if (c >= c1) return;
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < I_PAIRS; ++i) {
    float2 wf = __half22float2(w[i]);
    float2 hf = __ldcg(reinterpret_cast<const float2*>(h + 2 * lane + 64 * i));
    acc += wf.x * hf.x + wf.y * hf.y;
  }
  acc = warp_sum(acc);
  if (lane == 0) y[c] = __ldcg(x + c) + acc;
}

// ---- one kernel ----------------------------------------------------------------------------
__device__ __forceinline__ void red_add(float* p, float v) {
  asm volatile("red.global.add.f32 [%0], %1;" :: "l"(p), "f"(v) : "memory");
}
__device__ __forceinline__ void red_add4(float* p, float a, float b, float c, float d) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" :: "l"(p), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
}

// A block of the fused kernels: intermediate columns [b * per, ...) (per <= MAX_COLS); wdt is
// Wd transposed, [I, H]. VEC4: each thread adds 4 consecutive outputs with one vector red
// (threads < H / 4); else 2 consecutive outputs, one scalar red each, for Y_PAIR_ROUNDS rounds.
template <bool VEC4>
struct Slice {
  static constexpr int PAIRS = VEC4 ? 2 : Y_PAIR_ROUNDS;
  int c0, c1, warp, lane;
  half2 wg[GU_COLS_PER_WARP][H_PAIRS], wu[GU_COLS_PER_WARP][H_PAIRS];
  half2 wd[MAX_COLS][PAIRS];  // the block's Wd columns for the thread's outputs
  float2 part[PAIRS];         // the thread's outputs of the block's partial Wd h

  __device__ static int out(int p) {  // the first of the thread's output pair p
    return VEC4 ? 4 * threadIdx.x + 2 * p : 2 * (threadIdx.x + p * THREADS);
  }

  // the weights, before the grid wait
  __device__ __forceinline__ void load(const half* __restrict__ wgu, const half* __restrict__ wdt) {
    block_range(I, c0, c1);
    warp = threadIdx.x / 32; lane = threadIdx.x % 32;
    load_gate_up(wg, wu, wgu, c0, c1, warp, lane);
#pragma unroll
    for (int k = 0; k < MAX_COLS; ++k) {
      const half* row = wdt + (size_t)min(c0 + k, max(c1 - 1, 0)) * H;
#pragma unroll
      for (int p = 0; p < PAIRS; ++p) wd[k][p] = *reinterpret_cast<const half2*>(row + min(out(p), H - 2));
    }
  }

  // after the wait: x staged in xs, the block's slice of h, then the partial outputs
  __device__ __forceinline__ void partials(const float* x, float* xs, float* hs) {
    stage_x<H, THREADS>(xs, x);
#pragma unroll
    for (int j = 0; j < GU_COLS_PER_WARP; ++j) {
      int k = warp + j * WARPS;
      float value = gate_up_value(wg[j], wu[j], xs, lane);
      if (lane == 0 && k < MAX_COLS) hs[k] = c0 + k < c1 ? value : 0.f;
    }
    __syncthreads();
#pragma unroll
    for (int p = 0; p < PAIRS; ++p) part[p] = make_float2(0.f, 0.f);
#pragma unroll
    for (int k = 0; k < MAX_COLS; ++k)
#pragma unroll
      for (int p = 0; p < PAIRS; ++p) {
        float2 wf = __half22float2(wd[k][p]);
        part[p].x += wf.x * hs[k];
        part[p].y += wf.y * hs[k];
      }
  }

  __device__ __forceinline__ void add_residual(const float* xs) {
#pragma unroll
    for (int p = 0; p < PAIRS; ++p)
      if (out(p) < H) { part[p].x += xs[out(p)]; part[p].y += xs[out(p) + 1]; }
  }

  __device__ __forceinline__ void reduce_into(float* y) {
    if (VEC4) {
      if (out(0) < H) red_add4(y + out(0), part[0].x, part[0].y, part[1].x, part[1].y);
    } else {
#pragma unroll
      for (int p = 0; p < PAIRS; ++p)
        if (out(p) < H) { red_add(y + out(p), part[p].x); red_add(y + out(p) + 1, part[p].y); }
    }
  }
};

// rotating vectors: layer L reads v[L % 3], adds into v[(L + 1) % 3] (block 0 adds the residual),
// zeroes v[(L + 2) % 3]
template <bool VEC4>
__global__ void __launch_bounds__(THREADS, 2) fused_mlp_kernel(float* v, int layer, const half* __restrict__ wgu,
                                                               const half* __restrict__ wdt) {
  Slice<VEC4> slice;
  slice.load(wgu, wdt);
  pdl_wait(); pdl_launch();
  float* zero = v + ((layer + 2) % 3) * H;
  if (blockIdx.x == 0)
    for (int i = threadIdx.x; i < H; i += THREADS) zero[i] = 0.f;
  __shared__ float xs[H];
  __shared__ float hs[MAX_COLS];
  slice.partials(v + (layer % 3) * H, xs, hs);
  if (blockIdx.x == 0) slice.add_residual(xs);
  slice.reduce_into(v + ((layer + 1) % 3) * H);
}

// x and y as the two kernels' (nothing to zero outside the kernel): the blocks add into a
// module-scope float32 accumulator, then count their arrivals; the last to arrive writes
// y = x + accumulator and leaves the accumulator and the counter zero for the next layer
__device__ float mlp_acc[H];
__device__ unsigned mlp_arrivals;

__global__ void __launch_bounds__(THREADS, 2) fused_mlp_last_kernel(const float* x, float* y, const half* __restrict__ wgu,
                                                                    const half* __restrict__ wdt) {
  Slice<true> slice;
  slice.load(wgu, wdt);
  pdl_wait(); pdl_launch();
  __shared__ float xs[H];
  __shared__ float hs[MAX_COLS];
  __shared__ unsigned last;
  slice.partials(x, xs, hs);
  slice.reduce_into(mlp_acc);
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(&mlp_arrivals, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  for (int i = threadIdx.x; i < H; i += THREADS) {
    y[i] = xs[i] + __ldcg(mlp_acc + i);
    mlp_acc[i] = 0.f;
  }
  if (threadIdx.x == 0) mlp_arrivals = 0;
}

int main(int argc, char** argv) {
  int layers = argc > 1 ? atoi(argv[1]) : 30;
  int sms; CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  size_t gu_elems = (size_t)2 * I * H, d_elems = (size_t)H * I;
  std::vector<half> hgu(gu_elems * layers), hd(d_elems * layers), hdt(d_elems * layers);
  unsigned seed = 12345u;
  auto rnd = [&]() { seed = seed * 1664525u + 1013904223u; return ((seed >> 8) % 2001) / 1000.0f - 1.0f; };
  for (auto& w : hgu) w = __float2half(rnd() * 0.03f);  // small enough that 30 layers stay bounded
  for (int l = 0; l < layers; ++l)
    for (int r = 0; r < H; ++r)
      for (int c = 0; c < I; ++c) {
        half w = __float2half(rnd() * 0.02f);
        hd[l * d_elems + (size_t)r * I + c] = w;
        hdt[l * d_elems + (size_t)c * H + r] = w;
      }
  half *wgu, *wd, *wdt; float *bufs, *v;
  CHECK(cudaMalloc(&wgu, hgu.size() * sizeof(half)));
  CHECK(cudaMalloc(&wd, hd.size() * sizeof(half)));
  CHECK(cudaMalloc(&wdt, hdt.size() * sizeof(half)));
  CHECK(cudaMemcpy(wgu, hgu.data(), hgu.size() * sizeof(half), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(wd, hd.data(), hd.size() * sizeof(half), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(wdt, hdt.data(), hdt.size() * sizeof(half), cudaMemcpyHostToDevice));
  CHECK(cudaMalloc(&bufs, (2 * H + I) * sizeof(float)));  // two kernels: x / y ping-pong, then h
  CHECK(cudaMalloc(&v, 3 * H * sizeof(float)));            // one kernel: the three rotating vectors
  std::vector<float> x0(H);
  for (int i = 0; i < H; ++i) x0[i] = rnd();
  cudaStream_t s; CHECK(cudaStreamCreate(&s));
  cudaEvent_t e0, e1; CHECK(cudaEventCreate(&e0)); CHECK(cudaEventCreate(&e1));
  auto launch = [&](auto kernel, int blocks, auto... args) { launch_pdl(s, kernel, blocks, THREADS, true, args...); };
  auto graph_of = [&](auto&& body) {
    cudaGraph_t g; cudaGraphExec_t ge;
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    body();
    CHECK(cudaStreamEndCapture(s, &g));
    CHECK(cudaGraphInstantiate(&ge, g, 0));
    return ge;
  };
  auto timed = [&](cudaGraphExec_t ge) {  // us a layer
    const int reps = 100;
    for (int i = 0; i < 5; ++i) CHECK(cudaGraphLaunch(ge, s));
    CHECK(cudaEventRecord(e0, s));
    for (int i = 0; i < reps; ++i) CHECK(cudaGraphLaunch(ge, s));
    CHECK(cudaEventRecord(e1, s)); CHECK(cudaEventSynchronize(e1));
    float ms; CHECK(cudaEventElapsedTime(&ms, e0, e1));
    return 1e3f * ms / reps / layers;
  };
  auto result = [&](const float* p) {
    std::vector<float> out(H); CHECK(cudaMemcpy(out.data(), p, H * sizeof(float), cudaMemcpyDeviceToHost));
    return out;
  };
  std::vector<float> ref;  // the two kernels' final vector
  // the largest |value(i)| of i < H, NaN where one is not finite (fmax would skip a NaN)
  auto largest = [](auto value) {
    double m = 0;
    for (int i = 0; i < H; ++i) {
      double a = fabs((double)value(i));
      if (!std::isfinite(a)) return (double)NAN;
      m = fmax(m, a);
    }
    return m;
  };
  auto max_diff = [&](const float* p) {
    std::vector<float> out = result(p);
    return largest([&](int i) { return (double)out[i] - ref[i]; });
  };
  // two kernels: x in bufs[(l % 2) * H], y in the other half, h after them
  float* h = bufs + 2 * H;
  auto two = graph_of([&] {
    for (int l = 0; l < layers; ++l) {
      float* x = bufs + (l % 2) * H; float* y = bufs + ((l + 1) % 2) * H;
      launch(gate_up_kernel, sms, (const float*)x, h, (const half*)(wgu + l * gu_elems));
      launch(down_kernel, sms, (const float*)x, (const float*)h, y, (const half*)(wd + l * d_elems));
    }
  });
  CHECK(cudaMemcpy(bufs, x0.data(), H * sizeof(float), cudaMemcpyHostToDevice));
  CHECK(cudaGraphLaunch(two, s)); CHECK(cudaStreamSynchronize(s));
  ref = result(bufs + (layers % 2) * H);
  float us_two = timed(two);
  int fused_blocks = std::max((I + MAX_COLS - 1) / MAX_COLS, sms);
  double norm = largest([&](int i) { return ref[i]; });
  printf("hidden %d, intermediate %d, %d layers, %d SMs: two kernels (PDL, weights in registers before the wait) "
         "%.2f us a layer", H, I, layers, sms, us_two);
  for (int vec4 = 0; vec4 < 2; ++vec4) {
    auto kernel = vec4 ? fused_mlp_kernel<true> : fused_mlp_kernel<false>;
    auto one = graph_of([&] {
      for (int l = 0; l < layers; ++l)
        launch(kernel, fused_blocks, v, l, (const half*)(wgu + l * gu_elems), (const half*)(wdt + l * d_elems));
    });
    // v[0] = x0, v[1] = 0 (layer 0 accumulates into it), v[2] is zeroed by layer 0
    CHECK(cudaMemset(v, 0, 3 * H * sizeof(float)));
    CHECK(cudaMemcpy(v, x0.data(), H * sizeof(float), cudaMemcpyHostToDevice));
    CHECK(cudaGraphLaunch(one, s)); CHECK(cudaStreamSynchronize(s));
    double diff = max_diff(v + (layers % 3) * H);
    printf("; one kernel, %d blocks, %s red into rotating vectors %.2f us a layer (max |diff| %.3g of max |y| %.3g)",
           fused_blocks, vec4 ? "vector" : "scalar", timed(one), diff, norm);
  }
  auto last = graph_of([&] {
    for (int l = 0; l < layers; ++l)
      launch(fused_mlp_last_kernel, fused_blocks, (const float*)(bufs + (l % 2) * H), bufs + ((l + 1) % 2) * H,
             (const half*)(wgu + l * gu_elems), (const half*)(wdt + l * d_elems));
  });
  CHECK(cudaMemcpy(bufs, x0.data(), H * sizeof(float), cudaMemcpyHostToDevice));
  CHECK(cudaGraphLaunch(last, s)); CHECK(cudaStreamSynchronize(s));
  double diff = max_diff(bufs + (layers % 2) * H);
  printf("; one kernel, vector red, the last block to arrive writes y %.2f us a layer (max |diff| %.3g)",
         timed(last), diff);
  printf("\n");
  return 0;
}
