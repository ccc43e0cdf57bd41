// Sampled decoding's draw on the GPU (launch_sample, kernels.cuh): the token that a uniform u draws from a logits row
// under the semantics of the host's sample_logits (cpp/engine/sampling.h), so that a sampled step sends 8 bytes back,
// as a greedy one does, instead of the whole row. Test: CudaSampling.* (tests/cpp/test_cuda_sampling.cu) against
// sample_logits on the same rows and uniforms.
//
// Three launches, each over the row in fixed chunks (at most kMaxChunks blocks), the last block of each finishing the
// step (a done-counter, as the argmax's):
//  1. pass1: every chunk's weight sum exp((x - max) / T) (double) and its last token with weight; with a filter
//     (top_k, or top_p's probe of the 1,024 largest) also a histogram of the top 12 bits of each logit's order key.
//     Its last block either draws at once (no filter: the chunk where the running weight passes u x total, then the
//     token inside it), or finds the bin where the K largest end: if the bins above and that bin hold at most
//     kMaxCands logits they are the candidates, else pass2 refines.
//  2. pass2: a histogram of the next 12 key bits of the logits in that bin, the same choice (too many near-equal
//     logits even then: the host draws).
//  3. collect: the candidates (key at or above the threshold) into a list; its last block sorts them (larger logit
//     first, the lower id among equal ones), keeps the first K, and applies top_p and the draw as sample_logits does.
// The host draws instead (status kSampleOnHost, the row still in device memory) where sample_logits would go past what
// this holds: top_k above kSampleMaxTopK, and a top_p whose nucleus is not within the 1,024 largest logits (a flat
// row: sample_logits's bucketed nucleus in token-id order).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cuda/cuda_check.h"
#include "kernels.cuh"

namespace metalattn::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxChunks = 128;    // blocks of a pass (one wave)
constexpr int kBins = 4096;        // 12 key bits a histogram pass
constexpr int kMaxCands = 4096;    // candidates one block sorts in shared memory (32 KB)
constexpr int kNucleusProbe = 1024;  // top_p alone looks among this many largest logits (sample_logits's probe)
static_assert(kSampleMaxTopK <= kNucleusProbe && kNucleusProbe <= 4 * kThreads, "the draw holds 4 candidates a thread");

enum Stage : int { kStageNone = 0, kStageRefine = 1, kStageCollect = 2 };

struct Work {
  double chunk_sum[kMaxChunks];
  int chunk_last[kMaxChunks];
  unsigned int hist[kBins];
  unsigned long long cand[kMaxCands];
  double total;           // the whole row's weight (top_p alone)
  unsigned int done;      // blocks finished in the current pass (zero between passes)
  unsigned int n_cand;
  unsigned int key_lo;    // candidates: order key >= key_lo
  unsigned int prefix;    // pass2: the bin (top 12 key bits) it refines
  unsigned int above;     // logits in the bins above it
  int stage;
};

struct Row {
  const float* x;
  int n;
  int chunk;  // logits a block
  int k;      // the candidates wanted: top_k, or the nucleus probe; 0 without a filter
};

// Larger float -> larger key (-0 counted as +0, as the host's comparisons do); NaN never reaches it.
__device__ __forceinline__ unsigned int order_key(float v) {
  const unsigned int b = __float_as_uint(v + 0.f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float key_value(unsigned int k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}
__device__ __forceinline__ float weight(float v, float m, float inv_t) {
  return isnan(v) ? 0.f : expf((v - m) * inv_t);
}

// Inclusive scan over the block's threads (thread order); `sm` holds 32 values.
template <class T>
__device__ T block_scan(T v, T* sm) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const T y = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += y;
  }
  __syncthreads();
  if (lane == 31) sm[warp] = v;
  __syncthreads();
  if (warp == 0) {
    T w = lane < n_warps ? sm[lane] : T(0);
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const T y = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += y;
    }
    sm[lane] = w;
  }
  __syncthreads();
  if (warp > 0) v += sm[warp - 1];
  __syncthreads();
  return v;
}
template <class T>
__device__ T block_min(T v, T* sm) {
  for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sm[threadIdx.x >> 5] = v;
  __syncthreads();
  v = sm[0];
  for (int w = 1; w < static_cast<int>(blockDim.x >> 5); ++w) v = min(v, sm[w]);
  __syncthreads();
  return v;
}
template <class T>
__device__ T block_max(T v, T* sm) {
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sm[threadIdx.x >> 5] = v;
  __syncthreads();
  v = sm[0];
  for (int w = 1; w < static_cast<int>(blockDim.x >> 5); ++w) v = max(v, sm[w]);
  __syncthreads();
  return v;
}

// True in every thread of the block that finished the pass last (the others' writes are then visible to it).
__device__ bool last_block(Work* w) {
  __shared__ bool is_last;
  __threadfence();  // every thread's writes of this pass before the block counts itself done
  __syncthreads();
  if (threadIdx.x == 0) {
    is_last = atomicAdd(&w->done, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!is_last) return false;
  __threadfence();
  if (threadIdx.x == 0) w->done = 0u;
  return true;
}

__device__ void finish(SampleResult* out, DecodeIO* io, int token, int status) {
  out->token = token;
  out->status = status;
  if (io != nullptr && status == kSampleDrawn) io->token = token;
}

// The largest logit the argmax left (or the row's special cases): false when the step is already decided.
__device__ bool row_max(const ArgmaxResult* best, SampleResult* out, DecodeIO* io, float* m) {
  const ArgmaxResult b = *best;
  if (b.token == kNoIndex || b.value == -INFINITY) {  // every logit NaN, or NaN or -inf
    if (blockIdx.x == 0 && threadIdx.x == 0) finish(out, io, -1, kSampleNoCandidate);
    return false;
  }
  if (b.value == INFINITY) {  // the first +inf logit takes all the mass
    if (blockIdx.x == 0 && threadIdx.x == 0) finish(out, io, static_cast<int>(b.token), kSampleDrawn);
    return false;
  }
  *m = b.value;
  return true;
}

// Thread t owns bins [kBins - 16 (t + 1), kBins - 16 t): scanning the threads counts from the top bin down. The bin
// where the count above plus its own reaches k, and that count above (min(k, count) when fewer logits than k).
__device__ void find_bin(const unsigned int* hist, int k, unsigned int* bin, unsigned int* above) {
  __shared__ unsigned int sm[32];
  __shared__ unsigned int s_bin, s_above, s_total;
  const int hi = kBins - 16 * static_cast<int>(threadIdx.x);
  unsigned int mine = 0;
  for (int b = hi - 16; b < hi; ++b) mine += __ldcg(&hist[b]);
  const unsigned int incl = block_scan(mine, sm);
  if (threadIdx.x == blockDim.x - 1) s_total = incl;
  __syncthreads();
  const unsigned int want = min(static_cast<unsigned int>(k), s_total);
  const unsigned int excl = incl - mine;
  if (excl < want && incl >= want) {
    unsigned int acc = excl;
    for (int b = hi - 1; b >= hi - 16; --b) {
      const unsigned int h = __ldcg(&hist[b]);
      if (acc + h >= want) {
        s_bin = b;
        s_above = acc;
        break;
      }
      acc += h;
    }
  }
  __syncthreads();
  *bin = s_bin;
  *above = s_above;
}

// The first token in chunk c (index order) whose running weight, from `run0` before it, passes target; -1 if rounding
// leaves none, then the chunk's last token with weight.
__device__ int walk_chunk(const Row& r, int c, float m, float inv_t, double run0, double target) {
  __shared__ double dsm[32];
  __shared__ int ism[32];
  const int lo = c * r.chunk, hi = min(r.n, lo + r.chunk);
  const int per = (r.chunk + kThreads - 1) / kThreads;
  const int a = lo + threadIdx.x * per, b = min(hi, a + per);
  double mine = 0;
  for (int i = a; i < b; ++i) mine += weight(r.x[i], m, inv_t);
  double run = run0 + block_scan(mine, dsm) - mine;
  int found = INT32_MAX, last = -1;
  for (int i = a; i < b; ++i) {
    const float wi = weight(r.x[i], m, inv_t);
    run += wi;
    if (wi > 0.f) {
      last = i;
      if (run > target && found == INT32_MAX) found = i;
    }
  }
  found = block_min(found, ism);
  return found != INT32_MAX ? found : block_max(last, ism);
}

__global__ void __launch_bounds__(kThreads) sample_pass1(Row r, const ArgmaxResult* best, SampleArgs a, Work* w,
                                                          SampleResult* out, DecodeIO* io) {
  __shared__ unsigned int hist[kBins];
  __shared__ double dsm[32];
  __shared__ int ism[32];
  float m;
  if (!row_max(best, out, io, &m)) return;
  const bool filtered = r.k > 0;
  if (filtered)
    for (int b = threadIdx.x; b < kBins; b += kThreads) hist[b] = 0u;
  __syncthreads();
  const int lo = blockIdx.x * r.chunk, hi = min(r.n, lo + r.chunk);
  double sum = 0;
  int last = -1;
  for (int i = lo + threadIdx.x; i < hi; i += kThreads) {
    const float v = r.x[i];
    const float wi = weight(v, m, a.inv_t);
    sum += wi;
    if (wi > 0.f) last = i;
    if (filtered && !isnan(v)) atomicAdd(&hist[order_key(v) >> 20], 1u);
  }
  sum = block_scan(sum, dsm);  // the last thread holds the chunk's sum
  last = block_max(last, ism);
  if (threadIdx.x == kThreads - 1) w->chunk_sum[blockIdx.x] = sum;
  if (threadIdx.x == 0) w->chunk_last[blockIdx.x] = last;
  if (filtered) {
    __syncthreads();
    for (int b = threadIdx.x; b < kBins; b += kThreads)
      if (hist[b] != 0u) atomicAdd(&w->hist[b], hist[b]);
  }
  if (!last_block(w)) return;

  // The running weight over the chunks in index order (one chunk a thread: kMaxChunks <= kThreads).
  const int g = gridDim.x;
  const double cs = threadIdx.x < g ? __ldcg(&w->chunk_sum[threadIdx.x]) : 0.0;
  const double incl = block_scan(cs, dsm);
  __shared__ double s_total;
  if (threadIdx.x == kThreads - 1) s_total = incl;
  __syncthreads();
  const double total = s_total;
  if (!filtered) {
    const double target = a.u * total;
    const int c = block_min(threadIdx.x < g && incl > target ? static_cast<int>(threadIdx.x) : INT32_MAX, ism);
    __shared__ double s_before;  // the running weight before chunk c
    if (static_cast<int>(threadIdx.x) == c) s_before = incl - cs;
    __syncthreads();
    const int token = c != INT32_MAX
                          ? walk_chunk(r, c, m, a.inv_t, s_before, target)
                          // rounding left the sum at the target: the last token with weight
                          : block_max(threadIdx.x < g ? __ldcg(&w->chunk_last[threadIdx.x]) : -1, ism);
    if (threadIdx.x == 0) finish(out, io, token, kSampleDrawn);
    return;
  }
  unsigned int bin, above;
  find_bin(w->hist, r.k, &bin, &above);
  const unsigned int in_bin = __ldcg(&w->hist[bin]);
  __syncthreads();
  for (int b = threadIdx.x; b < kBins; b += kThreads) w->hist[b] = 0u;
  if (threadIdx.x == 0) {
    w->total = total;
    if (above + in_bin <= kMaxCands) {
      w->stage = kStageCollect;
      w->key_lo = bin << 20;
    } else {
      w->stage = kStageRefine;
      w->prefix = bin;
      w->above = above;
    }
  }
}

// The logits of pass1's bin by their next 12 key bits.
__global__ void __launch_bounds__(kThreads) sample_pass2(Row r, SampleArgs a, Work* w, SampleResult* out,
                                                          DecodeIO* io) {
  __shared__ unsigned int hist[kBins];
  if (w->stage != kStageRefine) return;  // every block alike: no counter to keep
  const unsigned int prefix = w->prefix;
  for (int b = threadIdx.x; b < kBins; b += kThreads) hist[b] = 0u;
  __syncthreads();
  const int lo = blockIdx.x * r.chunk, hi = min(r.n, lo + r.chunk);
  for (int i = lo + threadIdx.x; i < hi; i += kThreads) {
    const float v = r.x[i];
    if (isnan(v)) continue;
    const unsigned int k = order_key(v);
    if ((k >> 20) == prefix) atomicAdd(&hist[(k >> 8) & (kBins - 1)], 1u);
  }
  __syncthreads();
  for (int b = threadIdx.x; b < kBins; b += kThreads)
    if (hist[b] != 0u) atomicAdd(&w->hist[b], hist[b]);
  if (!last_block(w)) return;
  const unsigned int above0 = w->above;
  unsigned int bin, above;
  find_bin(w->hist, r.k - static_cast<int>(above0), &bin, &above);
  const unsigned int in_bin = __ldcg(&w->hist[bin]);
  __syncthreads();
  for (int b = threadIdx.x; b < kBins; b += kThreads) w->hist[b] = 0u;
  if (threadIdx.x == 0) {
    if (above0 + above + in_bin <= kMaxCands) {
      w->stage = kStageCollect;
      w->key_lo = (prefix << 20) | (bin << 8);
    } else {  // more than kMaxCands logits within 2^-15 of each other around the K-th: the host orders them
      w->stage = kStageNone;
      finish(out, io, -1, kSampleOnHost);
    }
  }
}

// The candidates, sorted; then top_k / top_p and the draw, as sample_logits does them.
__global__ void __launch_bounds__(kThreads) sample_collect(Row r, const ArgmaxResult* best, SampleArgs a, Work* w,
                                                           SampleResult* out, DecodeIO* io) {
  __shared__ unsigned long long c[kMaxCands];
  __shared__ double dsm[32];
  __shared__ int ism[32];
  if (w->stage != kStageCollect) return;
  const unsigned int key_lo = w->key_lo;
  const int lo = blockIdx.x * r.chunk, hi = min(r.n, lo + r.chunk);
  for (int i = lo + threadIdx.x; i < hi; i += kThreads) {
    const float v = r.x[i];
    if (isnan(v)) continue;
    const unsigned int k = order_key(v);
    if (k >= key_lo) {
      const unsigned int slot = atomicAdd(&w->n_cand, 1u);
      // Ascending order of (~key, id): larger logit first, the lower id among equal ones.
      if (slot < kMaxCands) w->cand[slot] = (static_cast<unsigned long long>(~k) << 32) | static_cast<unsigned int>(i);
    }
  }
  if (!last_block(w)) return;
  const int count = min(static_cast<int>(__ldcg(&w->n_cand)), kMaxCands);
  int size = 32;
  while (size < count) size <<= 1;
  for (int j = threadIdx.x; j < size; j += kThreads) c[j] = j < count ? __ldcg(&w->cand[j]) : ~0ull;
  __syncthreads();
  if (threadIdx.x == 0) {
    w->n_cand = 0u;
    w->stage = kStageNone;
  }
  for (int k = 2; k <= size; k <<= 1)  // bitonic sort
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < size; i += kThreads) {
        const int p = i ^ j;
        if (p > i) {
          const unsigned long long x = c[i], y = c[p];
          if ((x > y) == ((i & k) == 0)) {
            c[i] = y;
            c[p] = x;
          }
        }
      }
      __syncthreads();
    }

  const float m = best->value;
  const int kc = min(r.k, count);  // the candidates the filter keeps (fewer where fewer logits are not NaN)
  // Four consecutive candidates a thread: their weights and running weight.
  float wj[4];
  double run[4];
  double mine = 0;
  for (int q = 0; q < 4; ++q) {
    const int j = 4 * threadIdx.x + q;
    wj[q] = j < kc ? expf((key_value(~static_cast<unsigned int>(c[j] >> 32)) - m) * a.inv_t) : 0.f;
    mine += wj[q];
    run[q] = mine;
  }
  const double before = block_scan(mine, dsm) - mine;
  for (int q = 0; q < 4; ++q) run[q] += before;
  __shared__ double s_kept_all;
  if (threadIdx.x == kThreads - 1) s_kept_all = run[3];
  __syncthreads();
  const bool top_k = a.top_k > 0;
  const double total = top_k ? s_kept_all : w->total;
  // top_p: the fewest candidates whose weight reaches top_p of the total.
  int keep = kc;
  if (a.top_p < 1.0) {
    int first = INT32_MAX;
    for (int q = 0; q < 4; ++q) {
      const int j = 4 * threadIdx.x + q;
      if (j < kc && run[q] / total >= a.top_p) first = min(first, j);
    }
    first = block_min(first, ism);
    if (first == INT32_MAX && !top_k && kc < r.n) {  // a flat row: sample_logits's bucketed nucleus, on the host
      if (threadIdx.x == 0) finish(out, io, -1, kSampleOnHost);
      return;
    }
    if (first != INT32_MAX) keep = first + 1;
  }
  __shared__ double s_kept;
  if (4 * static_cast<int>(threadIdx.x) <= keep - 1 && keep - 1 < 4 * static_cast<int>(threadIdx.x) + 4)
    s_kept = run[keep - 1 - 4 * threadIdx.x];
  __syncthreads();
  const double target = a.u * (a.top_p < 1.0 ? s_kept : total);
  int found = INT32_MAX, last = -1;
  for (int q = 0; q < 4; ++q) {
    const int j = 4 * threadIdx.x + q;
    if (j < keep && wj[q] > 0.f) {
      last = j;
      if (run[q] > target) found = min(found, j);
    }
  }
  found = block_min(found, ism);
  const int pick = found != INT32_MAX ? found : block_max(last, ism);
  if (threadIdx.x == 0) finish(out, io, static_cast<int>(c[pick] & 0xffffffffu), kSampleDrawn);
}

}  // namespace

size_t sample_work_bytes() { return sizeof(Work); }

void launch_sample(const float* logits, int n, const ArgmaxResult* best, const SampleArgs& a, void* work,
                   SampleResult* out, DecodeIO* io, cudaStream_t s) {
  if (n < 1 || !(a.inv_t > 0.f) || !(a.top_p > 0.0 && a.top_p <= 1.0) || !(a.u >= 0.0 && a.u < 1.0) || a.top_k < 0 ||
      a.top_k > kSampleMaxTopK)
    throw EngineError("launch_sample: bad arguments");
  Row r;
  r.x = logits;
  r.n = n;
  r.chunk = kThreads * std::max(4, (n + kThreads * kMaxChunks - 1) / (kThreads * kMaxChunks));
  const int top_k = a.top_k > 0 && a.top_k < n ? a.top_k : 0;
  r.k = top_k > 0 ? top_k : a.top_p < 1.0 ? std::min(kNucleusProbe, n) : 0;
  SampleArgs b = a;
  b.top_k = top_k;
  const int grid = (n + r.chunk - 1) / r.chunk;
  Work* w = static_cast<Work*>(work);
  sample_pass1<<<grid, kThreads, 0, s>>>(r, best, b, w, out, io);
  CUDA_CHECK(cudaGetLastError());
  if (r.k == 0) return;
  sample_pass2<<<grid, kThreads, 0, s>>>(r, b, w, out, io);
  CUDA_CHECK(cudaGetLastError());
  sample_collect<<<grid, kThreads, 0, s>>>(r, best, b, w, out, io);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace metalattn::cuda
