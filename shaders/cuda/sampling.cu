// Sampled decoding's draw on the GPU (launch_sample, kernels.cuh): the token that a uniform u draws from a logits row
// under the semantics of the host's sample_logits (cpp/engine/sampling.h), so that a sampled step sends 8 bytes back,
// as a greedy one does, instead of the whole row. Test: CudaSampling.* (tests/cpp/test_cuda_sampling.cu) against
// sample_logits on the same rows and uniforms.
//
// Up to four launches over the row in fixed chunks (at most kMaxChunks blocks), the last block of each finishing its
// part (a done-counter, as the argmax's); the later ones return at once when an earlier one decided:
//  1. pass1: every chunk's weight exp((x - max) / T) (double) and its last token with weight. No filter: its last
//     block draws (the chunk where the running weight passes u x total, then the token inside it). With a filter also
//     a histogram (count and weight) of the top 11 bits of each logit's order key, and its last block finds the bin
//     where the selection ends: the K-th largest logit (top_k), or the logit where the weight from the top reaches
//     top_p of the total (top_p alone). The logits from that bin up become the candidates if at most kSortDirect;
//     else
//  2. pass2 refines that bin by the next 11 key bits, and decides the same way (candidates up to kMaxCands).
//  3. collect: the candidates into a list; its last block sorts them (larger logit first, the lower id among equal
//     ones) and applies top_k, top_p and the draw in that order, as sample_logits does. A top_p nucleus of more than
//     the 1,024 largest logits is drawn in token-id order instead (sample_logits's flat-row path): the list then gives
//     the nucleus's last token, and
//  4. index_draw draws as pass1 does without a filter, over the tokens up to that one in the sorted order. Past
//     kMaxCands logits in the nucleus only the band of the cut's bin is collected (the logits above it are counted
//     and weighed by the histograms).
// The host draws instead (status kSampleOnHost, the row still in device memory) where the cut's bin holds more than
// kMaxCands logits after both passes (near-equal logits by the thousand), and for a top_k above kSampleMaxTopK.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "cuda/cuda_check.h"
#include "kernels.cuh"

namespace metalattn::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxChunks = 128;      // blocks of a pass (one wave)
constexpr int kBinBits = 11;
constexpr int kBins = 1 << kBinBits;  // 11 key bits a histogram pass (the top 11, then the next 11)
constexpr int kBinsPerThread = kBins / kThreads;
constexpr int kShift1 = 32 - kBinBits, kShift2 = 32 - 2 * kBinBits;  // a key's pass-1 bin: key >> kShift1
// Weights are summed in the histograms as 2^-40 fixed point: integer sums do not depend on the order of the atomic
// adds, so a seeded draw is the same every run (float atomics changed the cut at rounding boundaries run to run). A
// weight is at most 1 (the largest logit's), so 2^23 logits sum below 2^63; each loses under 2^-40 of its value.
constexpr double kMassScale = 1099511627776.0;  // 2^40
constexpr int kMaxCands = 4096;      // candidates one block sorts in shared memory (32 KB)
constexpr int kSortDirect = 1024;    // the most candidates pass1 hands to collect (more: pass2 refines first)
constexpr int kCollectThreads = 1024;  // the collect kernel's blocks: its last one sorts the list
constexpr int kPerThread = kMaxCands / kCollectThreads;
constexpr int kNucleusProbe = 1024;  // a top_p nucleus of at most this many logits is drawn in logit order
static_assert(kMaxChunks <= kThreads, "pass1's last block scans one chunk a thread");
static_assert(kSampleMaxTopK <= kNucleusProbe && kNucleusProbe <= kMaxCands, "the selections fit the list");
static_assert(kMaxCands % kCollectThreads == 0, "the list in equal parts a thread");

enum Stage : int { kStageNone = 0, kStageRefine = 1, kStageCollect = 2, kStageIndexDraw = 3 };

struct Work {
  double chunk_sum[kMaxChunks];
  int chunk_last[kMaxChunks];
  unsigned int count[kBins];      // the current pass's histogram: logits a bin
  unsigned long long mass[kBins];  // and their weight, fixed point (kMassScale)
  unsigned long long cand[kMaxCands];
  double total;               // the whole row's weight
  float max;                  // the row's largest logit (pass1 copies it from `best` for the later passes)
  double mass_above;          // the logits above the current bin (all passes so far): their weight
  unsigned int count_above;   // and their number
  unsigned int done;          // blocks finished in the current pass (zero between passes)
  unsigned int n_cand;
  unsigned int prefix;        // pass2: the pass1 bin it refines
  unsigned int key_lo, key_hi;  // collect: order keys in [key_lo, key_hi]
  int band_only;              // collect: only the cut's bin; the logits above it are in count_above / mass_above
  unsigned int key_cut;       // index_draw: the nucleus's last logit (key, id) in the sorted order
  int id_cut;
  int stage;
};

struct Row {
  const float* x;
  int n;
  int chunk;  // logits a block
  int k;      // top_k (1 .. kSampleMaxTopK); 0: top_p alone, or no filter
  bool filtered;
};

// The nucleus of an index-order draw: every token up to (key, id) in the sorted order; `on` false: every token.
struct Cut {
  bool on;
  unsigned int key;
  int id;
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
__device__ __forceinline__ unsigned long long fixed_mass(float w) {
  return static_cast<unsigned long long>(static_cast<double>(w) * kMassScale);
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
// The block's min or max (op), in every thread; `sm` holds 32 values.
struct MinOp {
  template <class T>
  __device__ T operator()(T a, T b) const { return min(a, b); }
};
struct MaxOp {
  template <class T>
  __device__ T operator()(T a, T b) const { return max(a, b); }
};
template <class T, class Op>
__device__ T block_reduce(T v, T* sm, Op op) {
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sm[threadIdx.x >> 5] = v;
  __syncthreads();
  v = sm[0];
  for (int w = 1; w < static_cast<int>(blockDim.x >> 5); ++w) v = op(v, sm[w]);
  __syncthreads();
  return v;
}
template <class T>
__device__ T block_min(T v, T* sm) { return block_reduce(v, sm, MinOp{}); }
template <class T>
__device__ T block_max(T v, T* sm) { return block_reduce(v, sm, MaxOp{}); }

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
// `best` is read once a block: it may be mapped host memory (the batch's argmax results; a single sequence's draw
// reads the lm_head's device copy, ArgmaxScratch::last), where every load is a PCIe round trip; the later passes read
// pass1's copy in the work area (a read of `best` in every thread cost index_draw 15 of its 23 us at 151,936 logits).
__device__ bool row_max(const ArgmaxResult* best, SampleResult* out, DecodeIO* io, float* m) {
  __shared__ ArgmaxResult s_best;
  if (threadIdx.x == 0) s_best = *best;
  __syncthreads();
  const ArgmaxResult b = s_best;
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

__device__ __forceinline__ float cut_weight(const Row& r, int i, float m, float inv_t, const Cut& c) {
  const float v = r.x[i];
  if (c.on) {
    if (isnan(v)) return 0.f;
    const unsigned int k = order_key(v);
    if (k < c.key || (k == c.key && i > c.id)) return 0.f;
  }
  return weight(v, m, inv_t);
}

// The last block of pass1 (level 1) or pass2 (level 2): the cut's bin from this pass's histogram, and what comes next.
// The bin is where the running count from the top bin first reaches K (top_k), or the running weight reaches top_p of
// the row's weight `total` (top_p alone); each thread loads kBinsPerThread bins at once (thread t: bins
// [kBins - kBinsPerThread (t + 1), kBins - kBinsPerThread t), the top first) and the block scans their sums. Where
// rounding leaves no bin reaching it: the lowest bin holding a logit.
__device__ void choose(const Row& r, const SampleArgs& a, Work* w, int level, double total, SampleResult* out,
                       DecodeIO* io) {
  __shared__ unsigned int usm[32];
  __shared__ double dsm[32];
  __shared__ unsigned int s_bin, s_above, s_in_bin, s_count;
  __shared__ double s_mass_above, s_mass;
  const bool by_mass = r.k == 0;
  const unsigned int above0 = level == 1 ? 0u : w->count_above;
  const double mass0 = level == 1 ? 0.0 : w->mass_above;
  const int hi = kBins - kBinsPerThread * static_cast<int>(threadIdx.x);
  unsigned int cnt[kBinsPerThread];
  double ms[kBinsPerThread];
  unsigned int csum = 0;
  double msum = 0;
#pragma unroll
  for (int q = 0; q < kBinsPerThread; ++q) {
    cnt[q] = __ldcg(&w->count[hi - 1 - q]);
    ms[q] = by_mass ? static_cast<double>(__ldcg(&w->mass[hi - 1 - q])) / kMassScale : 0.0;
    csum += cnt[q];
    msum += ms[q];
  }
  const unsigned int cincl = block_scan(csum, usm);
  const double mincl = block_scan(msum, dsm);
  if (threadIdx.x == 0) s_bin = kBins;
  if (threadIdx.x == kThreads - 1) {
    s_count = cincl;
    s_mass = mincl;
  }
  __syncthreads();
  const unsigned int want_c = min(static_cast<unsigned int>(r.k) - above0, s_count);
  const double want_m = fmax(fmin(a.top_p * total - mass0, s_mass), 1e-300);
  unsigned int acc_c = cincl - csum;
  double acc_m = mincl - msum;
  if (by_mass ? (acc_m < want_m && mincl >= want_m) : (acc_c < want_c && cincl >= want_c)) {
#pragma unroll
    for (int q = 0; q < kBinsPerThread; ++q) {
      if (by_mass ? acc_m + ms[q] >= want_m : acc_c + cnt[q] >= want_c) {
        s_bin = hi - 1 - q;
        s_above = acc_c;
        s_mass_above = acc_m;
        s_in_bin = cnt[q];
        break;
      }
      acc_c += cnt[q];
      acc_m += ms[q];
    }
  }
  __syncthreads();
  if (s_bin == kBins) {  // rounding: the lowest bin holding a logit
    int low = kBins;
#pragma unroll
    for (int q = 0; q < kBinsPerThread; ++q)
      if (cnt[q] != 0u) low = hi - 1 - q;
    low = block_min(low, reinterpret_cast<int*>(usm));
#pragma unroll
    for (int q = 0; q < kBinsPerThread; ++q)
      if (hi - 1 - q == low) {
        s_bin = low;
        s_in_bin = cnt[q];
        s_above = s_count - cnt[q];
        s_mass_above = s_mass - ms[q];
      }
    __syncthreads();
  }
  for (int b = threadIdx.x; b < kBins; b += kThreads) {
    w->count[b] = 0u;
    w->mass[b] = 0ull;
  }
  if (threadIdx.x != 0) return;
  const unsigned int bin = s_bin, above = s_above, in_bin = s_in_bin;
  const unsigned int lo = level == 1 ? bin << kShift1 : (w->prefix << kShift1) | (bin << kShift2);
  const unsigned int hi_key = lo | ((1u << (level == 1 ? kShift1 : kShift2)) - 1u);
  w->count_above = above0 + above;
  w->mass_above = mass0 + s_mass_above;
  // Pass1 hands a list to collect only where it is short: the collect's bitonic sort of up to 4,096 candidates in
  // one block costs more than pass2's refinement (bins 2^11 times narrower) and a sort of at most 1,024.
  const unsigned int limit = level == 1 ? kSortDirect : kMaxCands;
  if (above0 + above + in_bin <= limit) {  // every candidate in the list
    w->stage = kStageCollect;
    w->key_lo = lo;
    w->key_hi = 0xffffffffu;
    w->band_only = 0;
  } else if (by_mass && in_bin <= limit && above0 + above >= kNucleusProbe) {  // a large nucleus: its cut's bin
    w->stage = kStageCollect;
    w->key_lo = lo;
    w->key_hi = hi_key;
    w->band_only = 1;
  } else if (level == 1) {
    w->stage = kStageRefine;
    w->prefix = bin;
  } else {  // thousands of logits within 2^-13 of each other at the cut: the host orders them
    w->stage = kStageNone;
    finish(out, io, -1, kSampleOnHost);
  }
}

// The first token in chunk c (index order) whose running weight, from `run0` before it, passes target; where rounding
// leaves none, the chunk's last token with weight.
__device__ int walk_chunk(const Row& r, int c, float m, float inv_t, const Cut& cut, double run0, double target) {
  __shared__ double dsm[32];
  __shared__ int ism[32];
  const int lo = c * r.chunk, hi = min(r.n, lo + r.chunk);
  const int per = (r.chunk + kThreads - 1) / kThreads;
  const int a = lo + threadIdx.x * per, b = min(hi, a + per);
  double mine = 0;
  for (int i = a; i < b; ++i) mine += cut_weight(r, i, m, inv_t, cut);
  double run = run0 + block_scan(mine, dsm) - mine;
  int found = INT32_MAX, last = -1;
  for (int i = a; i < b; ++i) {
    const float wi = cut_weight(r, i, m, inv_t, cut);
    run += wi;
    if (wi > 0.f) {
      last = i;
      if (run > target && found == INT32_MAX) found = i;
    }
  }
  found = block_min(found, ism);
  return found != INT32_MAX ? found : block_max(last, ism);
}

// Each block's chunk: its weight (under the cut) and last token with weight, into the work area.
__device__ void chunk_weight(const Row& r, float m, float inv_t, const Cut& cut, Work* w, unsigned int* count,
                             unsigned long long* mass) {
  __shared__ double dsm[32];
  __shared__ int ism[32];
  const int lo = blockIdx.x * r.chunk, hi = min(r.n, lo + r.chunk);
  double sum = 0;
  int last = -1;
  // A thread holds the bin of its last logits and their count and weight until a logit falls in another bin: rows
  // whose logits share a few bins (narrow or flat ones) would otherwise serialize a warp's atomics on one address.
  unsigned int run_bin = kBins, run_count = 0;
  unsigned long long run_mass = 0;
  auto flush = [&] {
    if (run_count == 0) return;
    atomicAdd(&count[run_bin], run_count);
    if (r.k == 0) atomicAdd(&mass[run_bin], run_mass);  // the weights only for a top_p cut
  };
  for (int i = lo + threadIdx.x; i < hi; i += kThreads) {
    const float wi = cut_weight(r, i, m, inv_t, cut);
    sum += wi;
    if (wi > 0.f) last = i;
    if (count != nullptr) {
      const float v = r.x[i];
      if (!isnan(v)) {
        const unsigned int b = order_key(v) >> kShift1;
        if (b != run_bin) {
          flush();
          run_bin = b;
          run_count = 0;
          run_mass = 0;
        }
        ++run_count;
        run_mass += fixed_mass(wi);
      }
    }
  }
  if (count != nullptr) flush();
  sum = block_scan(sum, dsm);  // the last thread holds the chunk's weight
  last = block_max(last, ism);
  if (threadIdx.x == kThreads - 1) w->chunk_sum[blockIdx.x] = sum;
  if (threadIdx.x == 0) w->chunk_last[blockIdx.x] = last;
}

// In the last block of a chunk_weight pass: the token that u draws in token-id order; returns the row's weight.
__device__ double index_draw(const Row& r, float m, float inv_t, const Cut& cut, double u, Work* w, SampleResult* out,
                             DecodeIO* io, bool draw) {
  __shared__ double dsm[32];
  __shared__ int ism[32];
  __shared__ double s_total, s_before;
  const int g = gridDim.x;
  const double cs = threadIdx.x < g ? __ldcg(&w->chunk_sum[threadIdx.x]) : 0.0;
  const double incl = block_scan(cs, dsm);
  if (threadIdx.x == kThreads - 1) s_total = incl;
  __syncthreads();
  const double total = s_total;
  if (!draw) return total;
  const double target = u * total;
  const int c = block_min(threadIdx.x < g && incl > target ? static_cast<int>(threadIdx.x) : INT32_MAX, ism);
  if (static_cast<int>(threadIdx.x) == c) s_before = incl - cs;
  __syncthreads();
  const int token = c != INT32_MAX
                        ? walk_chunk(r, c, m, inv_t, cut, s_before, target)
                        // rounding left the sum at the target: the last token with weight
                        : block_max(threadIdx.x < g ? __ldcg(&w->chunk_last[threadIdx.x]) : -1, ism);
  if (threadIdx.x == 0) finish(out, io, token, kSampleDrawn);
  return total;
}

__device__ void pass1_row(Row r, const ArgmaxResult* best, SampleArgs a, Work* w, SampleResult* out, DecodeIO* io) {
  __shared__ unsigned int count[kBins];
  __shared__ unsigned long long mass[kBins];
  float m;
  if (!row_max(best, out, io, &m)) return;
  if (r.filtered) {
    for (int b = threadIdx.x; b < kBins; b += kThreads) {
      count[b] = 0u;
      mass[b] = 0ull;
    }
    __syncthreads();
  }
  const Cut none{false, 0u, 0};
  chunk_weight(r, m, a.inv_t, none, w, r.filtered ? count : nullptr, mass);
  if (r.filtered) {
    __syncthreads();
    for (int b = threadIdx.x; b < kBins; b += kThreads)
      if (count[b] != 0u) {
        atomicAdd(&w->count[b], count[b]);
        if (r.k == 0) atomicAdd(&w->mass[b], mass[b]);
      }
  }
  if (!last_block(w)) return;
  const double total = index_draw(r, m, a.inv_t, none, a.u, w, out, io, !r.filtered);
  if (!r.filtered) return;
  if (threadIdx.x == 0) {
    w->total = total;
    w->max = m;
  }
  __syncthreads();
  choose(r, a, w, 1, total, out, io);
}

// The logits of pass1's bin by their next 11 key bits.
__device__ void pass2_row(Row r, const ArgmaxResult* best, SampleArgs a, Work* w, SampleResult* out, DecodeIO* io) {
  __shared__ unsigned int count[kBins];
  __shared__ unsigned long long mass[kBins];
  if (w->stage != kStageRefine) return;  // every block alike: no counter to keep
  const unsigned int prefix = w->prefix;
  const float m = w->max;
  for (int b = threadIdx.x; b < kBins; b += kThreads) {
    count[b] = 0u;
    mass[b] = 0ull;
  }
  __syncthreads();
  const int lo = blockIdx.x * r.chunk, hi = min(r.n, lo + r.chunk);
  for (int i = lo + threadIdx.x; i < hi; i += kThreads) {
    const float v = r.x[i];
    if (isnan(v)) continue;
    const unsigned int k = order_key(v);
    if ((k >> kShift1) == prefix) {
      const unsigned int b = (k >> kShift2) & (kBins - 1);
      atomicAdd(&count[b], 1u);
      if (r.k == 0) atomicAdd(&mass[b], fixed_mass(weight(v, m, a.inv_t)));
    }
  }
  __syncthreads();
  for (int b = threadIdx.x; b < kBins; b += kThreads)
    if (count[b] != 0u) {
      atomicAdd(&w->count[b], count[b]);
      if (r.k == 0) atomicAdd(&w->mass[b], mass[b]);
    }
  if (!last_block(w)) return;
  choose(r, a, w, 2, w->total, out, io);
}

// The candidates, sorted; then top_k / top_p and the draw, as sample_logits does them.
__device__ void collect_row(Row r, const ArgmaxResult* best, SampleArgs a, Work* w, SampleResult* out, DecodeIO* io) {
  __shared__ unsigned long long c[kMaxCands];
  __shared__ double dsm[32];
  __shared__ int ism[32];
  __shared__ double s_run_last, s_kept;
  __shared__ unsigned int s_n, s_base;
  if (w->stage != kStageCollect) return;
  const unsigned int key_lo = w->key_lo, key_hi = w->key_hi;
  const int lo = blockIdx.x * r.chunk, hi = min(r.n, lo + r.chunk);
  auto is_cand = [&](float v, unsigned int* key) {
    if (isnan(v)) return false;
    *key = order_key(v);
    return *key >= key_lo && *key <= key_hi;
  };
  // The block's candidates counted first, then one list slot range taken for all (one global atomic a block: a
  // counter that every candidate bumps serializes thousands of them at one L2 address).
  if (threadIdx.x == 0) s_n = 0u;
  __syncthreads();
  unsigned int key;
  for (int i = lo + threadIdx.x; i < hi; i += blockDim.x)
    if (is_cand(r.x[i], &key)) atomicAdd(&s_n, 1u);
  __syncthreads();
  if (threadIdx.x == 0) {
    s_base = s_n != 0u ? atomicAdd(&w->n_cand, s_n) : 0u;
    s_n = 0u;
  }
  __syncthreads();
  for (int i = lo + threadIdx.x; i < hi; i += blockDim.x)
    if (is_cand(r.x[i], &key)) {
      const unsigned int slot = s_base + atomicAdd(&s_n, 1u);
      // Ascending order of (~key, id): larger logit first, the lower id among equal ones.
      if (slot < kMaxCands) w->cand[slot] = (static_cast<unsigned long long>(~key) << 32) | static_cast<unsigned int>(i);
    }
  if (!last_block(w)) return;
  const int count = min(static_cast<int>(__ldcg(&w->n_cand)), kMaxCands);
  const bool band = w->band_only != 0;
  const unsigned int base_count = band ? w->count_above : 0u;
  const double base_mass = band ? w->mass_above : 0.0;
  int size = 32;
  while (size < count) size <<= 1;
  for (int j = threadIdx.x; j < size; j += blockDim.x) c[j] = j < count ? __ldcg(&w->cand[j]) : ~0ull;
  __syncthreads();
  if (threadIdx.x == 0) {
    w->n_cand = 0u;
    w->stage = kStageNone;
  }
  for (int k = 2; k <= size; k <<= 1)  // bitonic sort
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < size; i += blockDim.x) {
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

  const float m = w->max;
  const bool top_k = r.k > 0, top_p = a.top_p < 1.0;
  const int kc = top_k ? min(r.k, count) : count;  // the candidates the selection keeps
  // kPerThread consecutive candidates a thread: their weights and running weight (from the logits above the list).
  const int j0 = kPerThread * threadIdx.x;
  float wj[kPerThread];
  double mine = 0;
#pragma unroll
  for (int q = 0; q < kPerThread; ++q) {
    const int j = j0 + q;
    wj[q] = j < kc ? expf((key_value(~static_cast<unsigned int>(c[j] >> 32)) - m) * a.inv_t) : 0.f;
    mine += wj[q];
  }
  const double before = base_mass + block_scan(mine, dsm) - mine;
  if (threadIdx.x == blockDim.x - 1) s_run_last = before + mine;
  __syncthreads();
  const double total = top_k ? s_run_last : w->total;
  // top_p: the fewest candidates whose weight (with the logits above the list) reaches top_p of the total.
  int keep = kc;
  if (top_p) {
    int first = INT32_MAX;
    double run = before;
#pragma unroll
    for (int q = 0; q < kPerThread; ++q) {
      run += wj[q];
      if (j0 + q < kc && run / total >= a.top_p) first = min(first, j0 + q);
    }
    first = block_min(first, ism);
    if (first != INT32_MAX) keep = first + 1;
  }
  if (!top_k && top_p && base_count + keep > kNucleusProbe) {
    // sample_logits's flat-row nucleus: drawn in token-id order over every token up to candidate keep - 1
    if (threadIdx.x == 0) {
      w->key_cut = ~static_cast<unsigned int>(c[keep - 1] >> 32);
      w->id_cut = static_cast<int>(c[keep - 1] & 0xffffffffu);
      w->stage = kStageIndexDraw;
    }
    return;
  }
  double run = before;
#pragma unroll
  for (int q = 0; q < kPerThread; ++q) {
    run += wj[q];
    if (j0 + q == keep - 1) s_kept = run;
  }
  __syncthreads();
  const double target = a.u * (top_p ? s_kept : total);
  int found = INT32_MAX, last = -1;
  run = before;
#pragma unroll
  for (int q = 0; q < kPerThread; ++q) {
    const int j = j0 + q;
    run += wj[q];
    if (j < keep && wj[q] > 0.f) {
      last = j;
      if (run > target) found = min(found, j);
    }
  }
  found = block_min(found, ism);
  const int pick = found != INT32_MAX ? found : block_max(last, ism);
  if (threadIdx.x == 0) finish(out, io, static_cast<int>(c[pick] & 0xffffffffu), kSampleDrawn);
}

// A large top_p nucleus, in token-id order (sample_logits's flat-row path).
__device__ void index_draw_row(Row r, const ArgmaxResult* best, SampleArgs a, Work* w, SampleResult* out,
                               DecodeIO* io) {
  if (w->stage != kStageIndexDraw) return;
  const float m = w->max;
  const Cut cut{true, w->key_cut, w->id_cut};
  chunk_weight(r, m, a.inv_t, cut, w, nullptr, nullptr);
  if (!last_block(w)) return;
  index_draw(r, m, a.inv_t, cut, a.u, w, out, io, true);
  if (threadIdx.x == 0) w->stage = kStageNone;
}

// A launch's rows: grid row y draws from x + y * stride with a[y] (inv_t 0: the row is skipped), its argmax best[y],
// into out[y], with work[y]; io (single-row launches) takes the drawn token.
struct Launch {
  const float* x;
  int64_t stride;
  int n;
  int chunk;
  const ArgmaxResult* best;
  Work* work;
  SampleResult* out;
  DecodeIO* io;
  SampleArgs a[kSampleMaxRows];
};

template <void (*F)(Row, const ArgmaxResult*, SampleArgs, Work*, SampleResult*, DecodeIO*)>
__device__ __forceinline__ void for_row(const Launch& L) {
  const int y = blockIdx.y;
  const SampleArgs a = L.a[y];
  if (!(a.inv_t > 0.f)) return;
  Row r;
  r.x = L.x + y * L.stride;
  r.n = L.n;
  r.chunk = L.chunk;
  r.k = a.top_k > 0 && a.top_k < L.n ? a.top_k : 0;
  r.filtered = r.k > 0 || a.top_p < 1.0;
  F(r, L.best + y, a, L.work + y, L.out + y, L.io);
}

__global__ void __launch_bounds__(kThreads) sample_pass1(Launch L) { for_row<pass1_row>(L); }
__global__ void __launch_bounds__(kThreads) sample_pass2(Launch L) { for_row<pass2_row>(L); }
__global__ void __launch_bounds__(kCollectThreads) sample_collect(Launch L) { for_row<collect_row>(L); }
__global__ void __launch_bounds__(kThreads) sample_index_draw(Launch L) { for_row<index_draw_row>(L); }

}  // namespace

size_t sample_work_bytes() { return sizeof(Work); }

void launch_sample_rows(const float* x, int n, int64_t stride, int rows, const ArgmaxResult* best,
                        const SampleArgs* args, void* work, SampleResult* out, DecodeIO* io, cudaStream_t s) {
  if (n < 1 || rows < 1 || rows > kSampleMaxRows || (io != nullptr && rows != 1))
    throw EngineError("launch_sample: 1 to " + std::to_string(kSampleMaxRows) + " rows (io with one row only)");
  Launch L;
  L.x = x;
  L.stride = stride;
  L.n = n;
  L.chunk = kThreads * std::max(4, (n + kThreads * kMaxChunks - 1) / (kThreads * kMaxChunks));
  L.best = best;
  L.work = static_cast<Work*>(work);
  L.out = out;
  L.io = io;
  bool filtered = false, nucleus = false;  // some row with top_k or top_p; some with top_p alone
  for (int y = 0; y < kSampleMaxRows; ++y) L.a[y] = SampleArgs{0.f, 0, 1.0, 0.0};
  for (int y = 0; y < rows; ++y) {
    const SampleArgs& a = args[y];
    L.a[y] = a;
    if (a.inv_t == 0.f) continue;  // skipped
    if (!(a.inv_t > 0.f) || !(a.top_p > 0.0 && a.top_p <= 1.0) || !(a.u >= 0.0 && a.u < 1.0) || a.top_k < 0 ||
        a.top_k > kSampleMaxTopK)
      throw EngineError("launch_sample: bad arguments");
    const bool top_k = a.top_k > 0 && a.top_k < n;
    filtered |= top_k || a.top_p < 1.0;
    nucleus |= !top_k && a.top_p < 1.0;
  }
  const dim3 grid((n + L.chunk - 1) / L.chunk, rows);
  sample_pass1<<<grid, kThreads, 0, s>>>(L);
  CUDA_CHECK(cudaGetLastError());
  if (!filtered) return;
  sample_pass2<<<grid, kThreads, 0, s>>>(L);
  CUDA_CHECK(cudaGetLastError());
  sample_collect<<<grid, kCollectThreads, 0, s>>>(L);
  CUDA_CHECK(cudaGetLastError());
  if (!nucleus) return;
  sample_index_draw<<<grid, kThreads, 0, s>>>(L);
  CUDA_CHECK(cudaGetLastError());
}

void launch_sample(const float* x, int n, const ArgmaxResult* best, const SampleArgs& a, void* work, SampleResult* out,
                   DecodeIO* io, cudaStream_t s) {
  if (!(a.inv_t > 0.f)) throw EngineError("launch_sample: bad arguments");
  launch_sample_rows(x, n, 0, 1, best, &a, work, out, io, s);
}

}  // namespace metalattn::cuda
