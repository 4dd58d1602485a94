// Does a latency-bound phase of a decode layer leave time to stream the next projection's weight
// into L2? Llama-3.2-1B's batch-1 layer as five PDL-chained kernels (fp16 weights, fp32
// activations): qkv GEMV, an attention-like kernel (32 blocks: history loaded before the wait,
// partials, a last-arrival merge), o_proj + residual, gate_up + SiLU * mul, down_proj + residual.
// The attention kernel lets its dependents start early (as decode_append does), so o_proj's
// blocks sit at their grid wait while it runs; the GEMVs let theirs start at exit (as the 1B
// library's do). With a lookahead of P MiB, o_proj's blocks first issue
// cp.async.bulk.prefetch.L2 for their share of the first P MiB of gate_up's weight, which the
// first gate_up blocks read. 16 layers, each its own weights (1.95 GB: nothing stays in L2 from
// one replay to the next), one CUDA graph a lookahead, replays alternating.
// Build: nvcc -O3 -arch=sm_90 -o bench_l2_lookahead scripts/bench_l2_lookahead.cu
// Run:   ./bench_l2_lookahead [reps] [MiB,MiB,...]   (default 30 and 0,8,16,24,32,40)
//        prints us a layer, the layer's weight bytes over that time, and each lookahead's
//        largest difference from the first's output (a hint changes no value: 0)
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cuda_bench_common.cuh"  // (CHECK, PDL and its launches, warp sums)

constexpr int HIDDEN = 2048, QKV = 3072, FFN = 8192, LAYERS = 16;
constexpr int HEAD_DIM = 64, KV_HEADS = 8, GROUP = 4, SPLITS = 4, KEYS_PER_SPLIT = 128;
constexpr int THREADS = 256, WARPS = THREADS / 32;

// one block's share of `bytes` from `base` into L2 (a hint; one thread; chunks of at most 64 KiB)
__device__ __forceinline__ void prefetch_share(const char* base, long long bytes) {
  if (threadIdx.x != 0 || base == nullptr || bytes < 16) return;
  long long share = (bytes / gridDim.x) & ~15LL, begin = blockIdx.x * share;
  long long size = blockIdx.x == gridDim.x - 1 ? ((bytes - begin) & ~15LL) : share;
  for (long long off = 0; off < size; off += 65536) {
    unsigned n = (unsigned)(size - off < 65536 ? size - off : 65536);
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(base + begin + off), "r"(n) : "memory");
  }
}

// y[r] = sum_k w[r, k] x[k] (+ resid[r]); SWIGLU: w holds (gate, up) row pairs, y[r] = silu(g) * u.
// A warp takes ROWS weight rows; each lane loads 16-byte vectors, all of a chunk before any math.
template <int K, int ROWS, bool SWIGLU>
__global__ void __launch_bounds__(THREADS) gemv(const half* w, const float* x, const float* resid, float* y,
                                                const char* lookahead, long long lookahead_bytes) {
  prefetch_share(lookahead, lookahead_bytes);
  pdl_wait();
  __shared__ float xs[K];
  for (int i = threadIdx.x; i < K; i += THREADS) xs[i] = __ldcg(x + i);
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const size_t row0 = ((size_t)blockIdx.x * WARPS + warp) * ROWS;
  constexpr int VECS = K / 8 / 32, CHUNK = VECS < 8 ? VECS : 8;  // 16-byte vectors a lane, per load round
  float acc[ROWS] = {};
  for (int c = 0; c < VECS; c += CHUNK) {
    uint4 v[ROWS][CHUNK];
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
      for (int i = 0; i < CHUNK; ++i)
        v[r][i] = *reinterpret_cast<const uint4*>(w + (row0 + r) * K + 8 * (lane + 32 * (c + i)));
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
      for (int i = 0; i < CHUNK; ++i) {
        const half2* h = reinterpret_cast<const half2*>(&v[r][i]);
        const float* xv = xs + 8 * (lane + 32 * (c + i));
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          float2 f = __half22float2(h[j]);
          acc[r] += f.x * xv[2 * j] + f.y * xv[2 * j + 1];
        }
      }
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r) acc[r] = warp_sum(acc[r]);
  if (lane != 0) return;
  if (SWIGLU) {
#pragma unroll
    for (int r = 0; r < ROWS; r += 2) {
      float g = acc[r], u = acc[r + 1];
      y[(row0 + r) / 2] = g / (1.f + __expf(-g)) * u;
    }
  } else {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) y[row0 + r] = acc[r] + (resid ? __ldcg(resid + row0 + r) : 0.f);
  }
}

// Attention-shaped latency: block (head, split) loads its 128 keys' K and V rows into shared
// memory before the wait, then scores its GROUP query heads (from qkv) against them, writes
// partials, and the last split of a head merges them (log-sum-exp) into att.
__global__ void __launch_bounds__(THREADS) attention(const float* qkv, const half* kv, float* part, float* lse,
                                                     int* arrivals, float* att) {
  __shared__ half ks[KEYS_PER_SPLIT][HEAD_DIM], vs[KEYS_PER_SPLIT][HEAD_DIM];
  __shared__ float q[GROUP][HEAD_DIM], s[GROUP][KEYS_PER_SPLIT];
  __shared__ int last;
  const int head = blockIdx.x / SPLITS, split = blockIdx.x % SPLITS;
  const half* src = kv + ((size_t)head * SPLITS + split) * 2 * KEYS_PER_SPLIT * HEAD_DIM;
  for (int i = threadIdx.x; i < KEYS_PER_SPLIT * HEAD_DIM / 8; i += THREADS) {
    reinterpret_cast<uint4*>(&ks[0][0])[i] = reinterpret_cast<const uint4*>(src)[i];
    reinterpret_cast<uint4*>(&vs[0][0])[i] = reinterpret_cast<const uint4*>(src + KEYS_PER_SPLIT * HEAD_DIM)[i];
  }
  pdl_launch();
  pdl_wait();
  for (int i = threadIdx.x; i < GROUP * HEAD_DIM; i += THREADS)
    q[i / HEAD_DIM][i % HEAD_DIM] = __ldcg(qkv + head * GROUP * HEAD_DIM + i) * 0.125f;
  __syncthreads();
  for (int i = threadIdx.x; i < GROUP * KEYS_PER_SPLIT; i += THREADS) {
    int g = i / KEYS_PER_SPLIT, j = i % KEYS_PER_SPLIT;
    float d = 0.f;
    for (int k = 0; k < HEAD_DIM; ++k) d += q[g][k] * __half2float(ks[j][k]);
    s[g][j] = d;
  }
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp < GROUP) {  // a warp a query head: softmax over the split's keys, then P V
    float m = -INFINITY;
    for (int j = lane; j < KEYS_PER_SPLIT; j += 32) m = fmaxf(m, s[warp][j]);
    for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    float l = 0.f;
    for (int j = lane; j < KEYS_PER_SPLIT; j += 32) { s[warp][j] = __expf(s[warp][j] - m); l += s[warp][j]; }
    l = warp_sum(l);
    __syncwarp();
    for (int d = lane; d < HEAD_DIM; d += 32) {
      float o = 0.f;
      for (int j = 0; j < KEYS_PER_SPLIT; ++j) o += s[warp][j] * __half2float(vs[j][d]);
      part[((size_t)blockIdx.x * GROUP + warp) * HEAD_DIM + d] = o / l;
    }
    if (lane == 0) lse[blockIdx.x * GROUP + warp] = m + logf(l);
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(arrivals + head, 1) == SPLITS - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  if (warp < GROUP) {
    float w[SPLITS], mx = -INFINITY, sum = 0.f;
    for (int t = 0; t < SPLITS; ++t) mx = fmaxf(mx, w[t] = __ldcg(lse + (head * SPLITS + t) * GROUP + warp));
    for (int t = 0; t < SPLITS; ++t) sum += (w[t] = __expf(w[t] - mx));
    for (int d = lane; d < HEAD_DIM; d += 32) {
      float o = 0.f;
      for (int t = 0; t < SPLITS; ++t)
        o += w[t] * __ldcg(part + (((size_t)head * SPLITS + t) * GROUP + warp) * HEAD_DIM + d);
      att[(head * GROUP + warp) * HEAD_DIM + d] = o / sum;
    }
  }
  if (threadIdx.x == 0) arrivals[head] = 0;
}

__global__ void fill(half* w, size_t n, unsigned seed, float scale) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    unsigned h = (unsigned)i * 2654435761u ^ seed;
    h ^= h >> 15; h *= 2246822519u; h ^= h >> 13;
    w[i] = __float2half(((h & 0xffff) / 65535.f - 0.5f) * scale);
  }
}

int main(int argc, char** argv) {
  int reps = argc > 1 ? atoi(argv[1]) : 30;
  std::vector<int> mibs = {0, 8, 16, 24, 32, 40};
  if (argc > 2) {
    mibs.clear();
    for (char* t = strtok(argv[2], ","); t; t = strtok(nullptr, ",")) mibs.push_back(atoi(t));
  }
  const size_t n_qkv = (size_t)QKV * HIDDEN, n_o = (size_t)HIDDEN * HIDDEN, n_gu = 2ull * FFN * HIDDEN,
               n_d = (size_t)HIDDEN * FFN, n_kv = (size_t)KV_HEADS * SPLITS * 2 * KEYS_PER_SPLIT * HEAD_DIM;
  const size_t per_layer = n_qkv + n_o + n_gu + n_d + n_kv;
  half* weights;
  CHECK(cudaMalloc(&weights, per_layer * LAYERS * sizeof(half)));
  fill<<<1024, 256>>>(weights, per_layer * LAYERS, 7u, 2.f / sqrtf((float)HIDDEN));
  float *x0, *x, *qkv, *att, *x2, *h, *part, *lse;
  int* arrivals;
  CHECK(cudaMalloc(&x0, HIDDEN * 4)); CHECK(cudaMalloc(&x, HIDDEN * 4)); CHECK(cudaMalloc(&qkv, QKV * 4));
  CHECK(cudaMalloc(&att, HIDDEN * 4)); CHECK(cudaMalloc(&x2, HIDDEN * 4)); CHECK(cudaMalloc(&h, FFN * 4));
  CHECK(cudaMalloc(&part, KV_HEADS * SPLITS * GROUP * HEAD_DIM * 4));
  CHECK(cudaMalloc(&lse, KV_HEADS * SPLITS * GROUP * 4));
  CHECK(cudaMalloc(&arrivals, KV_HEADS * 4)); CHECK(cudaMemset(arrivals, 0, KV_HEADS * 4));
  std::vector<float> hx(HIDDEN);
  for (int i = 0; i < HIDDEN; ++i) hx[i] = sinf(0.37f * i);
  CHECK(cudaMemcpy(x0, hx.data(), HIDDEN * 4, cudaMemcpyHostToDevice));
  CHECK(cudaDeviceSynchronize());

  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  std::vector<cudaGraphExec_t> graphs;
  for (int mib : mibs) {
    long long ahead = std::min((long long)mib << 20, (long long)(n_gu * sizeof(half)));
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    CHECK(cudaMemcpyAsync(x, x0, HIDDEN * 4, cudaMemcpyDeviceToDevice, s));
    for (int l = 0; l < LAYERS; ++l) {
      half* wq = weights + per_layer * l;
      half *wo = wq + n_qkv, *wgu = wo + n_o, *wd = wgu + n_gu, *kv = wd + n_d;
      const float* none = nullptr;
      launch_pdl(s, gemv<HIDDEN, 2, false>, QKV / (WARPS * 2), THREADS, true, (const half*)wq, (const float*)x, none,
                 qkv, (const char*)nullptr, 0LL);
      launch_pdl(s, attention, KV_HEADS * SPLITS, THREADS, true, (const float*)qkv, (const half*)kv, part, lse,
                 arrivals, att);
      launch_pdl(s, gemv<HIDDEN, 2, false>, HIDDEN / (WARPS * 2), THREADS, true, (const half*)wo, (const float*)att,
                 (const float*)x, x2, (const char*)wgu, ahead);
      launch_pdl(s, gemv<HIDDEN, 2, true>, 2 * FFN / (WARPS * 2), THREADS, true, (const half*)wgu, (const float*)x2,
                 none, h, (const char*)nullptr, 0LL);
      launch_pdl(s, gemv<FFN, 1, false>, HIDDEN / WARPS, THREADS, true, (const half*)wd, (const float*)h,
                 (const float*)x2, x, (const char*)nullptr, 0LL);
    }
    cudaGraph_t g;
    CHECK(cudaStreamEndCapture(s, &g));
    cudaGraphExec_t exec;
    CHECK(cudaGraphInstantiate(&exec, g, 0));
    graphs.push_back(exec);
  }
  std::vector<std::vector<float>> outs(mibs.size(), std::vector<float>(HIDDEN));
  std::vector<std::vector<float>> times(mibs.size());
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a)); CHECK(cudaEventCreate(&b));
  for (int r = 0; r < reps + 2; ++r)
    for (size_t v = 0; v < mibs.size(); ++v) {
      size_t i = (v + r) % mibs.size();  // alternate which lookahead goes first
      CHECK(cudaEventRecord(a, s));
      CHECK(cudaGraphLaunch(graphs[i], s));
      CHECK(cudaEventRecord(b, s));
      CHECK(cudaEventSynchronize(b));
      float ms;
      CHECK(cudaEventElapsedTime(&ms, a, b));
      if (r >= 2) times[i].push_back(ms);
      if (r == 0) CHECK(cudaMemcpy(outs[i].data(), x, HIDDEN * 4, cudaMemcpyDeviceToHost));
    }
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  printf("%s, L2 %d MiB, %d layers, %.1f MB of weights a layer, %d reps\n", prop.name, prop.l2CacheSize >> 20, LAYERS,
         per_layer * 2 / 1e6, reps);
  printf("lookahead MiB   us a layer (median)   min      GB/s (median)   max |diff|\n");
  for (size_t i = 0; i < mibs.size(); ++i) {
    std::vector<float> t = times[i];
    std::sort(t.begin(), t.end());
    float med = t[t.size() / 2] * 1000.f / LAYERS, lo = t[0] * 1000.f / LAYERS;
    float diff = 0.f;
    bool finite = true;
    for (int k = 0; k < HIDDEN; ++k) {
      diff = fmaxf(diff, fabsf(outs[i][k] - outs[0][k]));
      finite = finite && std::isfinite(outs[i][k]);
    }
    printf("%13d   %18.2f   %6.2f   %13.0f   %g%s\n", mibs[i], med, lo, per_layer * 2 / (med * 1e3), diff,
           finite ? "" : " (not finite)");
  }
  return 0;
}
