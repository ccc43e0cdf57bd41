// Decode matvecs: one token per step, float activations, float accumulation, weights decoded on the fly
// (matvec_weights.cuh): fused RMSNorm + matvec (QKV with RoPE and the K/V append, gate/up with SiLU) and matvec +
// residual. The final norm + lm_head + argmax is lm_head.cu; the activation staging both use is norm_staging.cuh.
//
// Matvec geometry: a row group of TPR lanes (8, 16 or 32 consecutive lanes of a warp) owns one output row; lane
// `sub` of the group takes weight blocks sub, sub + TPR, ... of that row, reads each block's payload with 16-byte
// loads (consecutive lanes read consecutive blocks, so a group reads one contiguous span), and the group sums by
// xor-shuffles. A block of 128 (or 256) threads therefore covers 128/TPR rows. Each block stages the activation
// vector in shared memory once (recomputing RMSNorm from the residual, which is cheaper than a separate launch),
// after issuing the loads of its first weight blocks so their latency overlaps the staging.
#include <algorithm>
#include <cmath>
#include <string>

#include "cuda/cuda_check.h"
#include "kernels.cuh"
#include "matvec_launch.cuh"
#include "matvec_weights.cuh"
#include "norm_staging.cuh"
#include "trace.cuh"

namespace metalattn::cuda {

using detail::grid_dependency_wait;

METALATTN_TRACE_UNIT(matvec)

// ------------------------------------------------------------------ fused RMSNorm + matvec

// The PreAdd staging in one round trip to L2, for rows of at most 4 x blockDim.x columns (one 16-byte group a
// thread: Gemma 3's 640 at 256 or 512 threads): each thread loads its x and y values and the post-norm weights
// together, and one block reduction of four sums gives both norms: the post-norm's scale a = 1 / rms(y) from y.y,
// and the staged sum v = x + a y pw's from v.v = x.x + 2 a x.(y pw) + a^2 (y pw).(y pw). v itself is computed as
// stage_normed computes it, so x_next is bit for bit the same. Returns 1 / rms(v).
__device__ __forceinline__ float stage_pre_added(const float* x, const float* __restrict__ norm_w,
                                                 const NormPrefetch& nw, float eps, int cols, int n, float* x_s,
                                                 float4* red4, const PreAdd& add) {
  const bool vec = aligned16(x) && aligned16(add.y) && aligned16(add.w) && aligned16(add.x_next) && cols % 4 == 0;
  const int i = 4 * threadIdx.x;
  const float4 xv = load4<true>(x, i, cols, vec), yv = load4<true>(add.y, i, cols, vec);
  const float4 pw = load4<false>(add.w, i, cols, vec);
  const float4 yw = mul4(yv, pw);
  float4 s = make_float4(dot4(yv, yv), dot4(xv, xv), dot4(xv, yw), dot4(yw, yw));  // y.y, x.x, x.(y pw), (y pw).(y pw)
  s = detail::block_sum4(s, red4);
  const float a = 1.f / sqrtf(s.x / static_cast<float>(cols) + add.eps);
  const float vv = fmaxf(s.y + 2.f * a * s.z + a * a * s.w, 0.f);
  if (i < n) {
    const float4 v = make_float4(xv.x + yv.x * a * pw.x, xv.y + yv.y * a * pw.y, xv.z + yv.z * a * pw.z,
                                 xv.w + yv.w * a * pw.w);
    if (blockIdx.x == 0) store4(add.x_next, i, cols, vec, v);
    *reinterpret_cast<float4*>(x_s + smem_index(i)) = mul4(v, nw.w[0]);  // zero past cols: x, y and pw load 0 there
  }
  __syncthreads();
  if (norm_w == nullptr) return 1.f;
  return 1.f / sqrtf(vv / static_cast<float>(cols) + eps);
}

// Plain: y = the rows. Qkv: RoPE and the cache append (QkvTargets). SiluGlu: W = [gate; up] stacked, and each block
// takes the same units of both halves (its first warps gate rows u.., the rest up rows u..), so that y[u] =
// silu(gate_u) * up_u leaves the kernel finished and the down projection stages plain activations.
enum class NormOut : int { Plain = 0, Qkv = 1, SiluGlu = 2 };

struct NormMatvecArgs {
  NormOut mode = NormOut::Plain;
  bool gelu = false;   // SiluGlu: GELU (tanh form) in place of SiLU
  PreAdd pre;          // a residual add folded into the staging (see stage_normed)
  float* y = nullptr;  // Plain: the output rows; SiluGlu: the W.rows / 2 activations
  QkvTargets qkv;
  DevMatrix embed;           // Qkv with embed.payload set: x is row qkv.io->token of embed
  float* x_out = nullptr;    // ... and block 0 writes that row here (the residual stream)
};

// Blocks per lane loaded before the wait: at least 4 for quarter-warp rows (TPR 8), so that all blocks of a row of
// up to 32 (SmolLM2, Qwen2.5-0.5B, Gemma 3 widths) are in flight before the wait (small block types only).
// The one-wave kernel (norm_matvec_kernel_5) holds at most 2, so that 16-lane rows of up to 32 blocks fit 48 registers.
template <typename B>
constexpr int unroll_for(int tpr, int minb = 1) {
  return minb > 1 ? (B::kUnroll < 2 ? B::kUnroll : 2) : tpr == 8 && sizeof(B) <= 32 && B::kUnroll < 4 ? 4 : B::kUnroll;
}

// The body of the fused norm + matvec kernels below. PRE: the PreAdd variant (a.pre set), a separate instantiation so
// that the kernels of every other layer compile as if it did not exist (a runtime test cost Qwen2.5-0.5B-shaped
// decode 2.5% on the H100). MINB: see norm_matvec_kernel_5. PAIRS (SiluGlu only): each lane group computes one unit's
// gate and up rows together (norm_matvec_glu_pairs_kernel, norm_matvec_glu_pairs8_kernel), so a block covers
// rows_per_block units, not half as many.
template <typename B, int TPR, bool PRE, int MINB, bool PAIRS = false>
__device__ __forceinline__ void norm_matvec_body(const DevMatrix& W, const float* __restrict__ x,
                                                 const float* __restrict__ norm_w, float eps, const NormMatvecArgs& a) {
  extern __shared__ float4 smem_dyn[];
  float* x_s = reinterpret_cast<float*>(smem_dyn);
  __shared__ float red[32];
  __shared__ float y_s[512 / 8];
  const int rows_per_block = blockDim.x / TPR;
  const int local = threadIdx.x / TPR, sub = threadIdx.x % TPR;
  const int n = W.nb * 32;
  // SiluGlu: this block's units [unit0, unit0 + units_per_block) of both halves; rows past a half map to W.rows,
  // which every row test treats as absent.
  const int units = W.rows / 2, units_per_block = rows_per_block / 2, unit0 = blockIdx.x * units_per_block;
  const int glu_unit = unit0 + (local < units_per_block ? local : local - units_per_block);
  const int pair_unit = blockIdx.x * rows_per_block + local;  // PAIRS: this group's unit (gate row; up row + units)
  // Qkv: the rows in pair order (detail::qkv_pair_row), so that the two rows RoPE turns together are adjacent here.
  const int row = PAIRS ? (pair_unit < units ? pair_unit : W.rows)
                  : a.mode == NormOut::Qkv
                      ? detail::qkv_pair_row(blockIdx.x * rows_per_block + local, a.qkv.neox, a.qkv.q_dim,
                                             a.qkv.kv_dim, a.qkv.head_dim)
                  : a.mode != NormOut::SiluGlu ? blockIdx.x * rows_per_block + local
                  : glu_unit >= units          ? W.rows
                                               : glu_unit + (local < units_per_block ? 0 : units);

  KernelTrace trace(a.mode == NormOut::Qkv       ? kTraceQkv
                    : a.mode == NormOut::SiluGlu ? kTraceNormMatvec
                    : norm_w != nullptr          ? kTraceNormPlain
                                                 : kTracePlain);
  detail::launch_dependents();
  RowDotB<B, TPR, unroll_for<B>(TPR, MINB)> rd;
  RowDotPair<B, TPR, unroll_for<B>(TPR, MINB)> rp;
  if constexpr (PAIRS) rp.prefetch(W, row, row + units, sub);
  else rd.prefetch(W, row, sub);
  NormPrefetch nw;
  nw.load(norm_w, W.cols);
  // PreAdd in one round trip where the row fits a batch (stage_pre_added).
  const bool pre_one_pass = PRE && n <= 4 * static_cast<int>(blockDim.x);
  // QKV: the RoPE factors of the rows this thread stores (the position was written before this graph launch).
  const int pair = threadIdx.x;
  const int r0 = blockIdx.x * rows_per_block + 2 * pair;
  const bool stores_pair = a.mode == NormOut::Qkv && pair < rows_per_block / 2 && r0 < W.rows;
  float2 cs = make_float2(1.f, 0.f);
  if (stores_pair) {
    const QkvTargets& t = a.qkv;
    cs = detail::rope_factors(r0, t.io->pos, t.rope_table, t.q_dim, t.kv_dim, t.head_dim);
  }
  const float bias = a.mode == NormOut::Qkv && a.qkv.bias != nullptr && sub == 0 && row < W.rows ? a.qkv.bias[row] : 0.f;

  float scale = 1.f;
  if (a.embed.payload != nullptr) {
    // The token id was written before this graph launch (by the host or the previous step's argmax), and the
    // embedding is a weight, so the whole gather and the norm run before the wait.
    const int64_t token = a.qkv.io->token;
    float ss = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      const float v = i < W.cols ? detail::load_weight(a.embed, token, i) : 0.f;
      x_s[smem_index(i)] = v;
      ss += v * v;
    }
    const float total = detail::block_sum(ss, red);
    const float inv_rms = 1.f / sqrtf(total / static_cast<float>(W.cols) + eps);
    grid_dependency_wait();  // the previous step's kernels may still read x
    trace.released();
    for (int i = threadIdx.x; i < W.cols; i += blockDim.x) {
      const float v = x_s[smem_index(i)];
      if (blockIdx.x == 0) a.x_out[i] = v;
      x_s[smem_index(i)] = v * inv_rms * norm_w[i];
    }
    __syncthreads();
  } else {
    grid_dependency_wait();
    trace.released();
    if constexpr (PRE) {
      __shared__ float4 red4[32];
      scale = pre_one_pass ? stage_pre_added(x, norm_w, nw, eps, W.cols, n, x_s, red4, a.pre)
                           : stage_normed(x, norm_w, nw, eps, W.cols, n, x_s, red, a.pre);
    } else {
      scale = stage_normed(x, norm_w, nw, eps, W.cols, n, x_s, red);
    }
  }

  if constexpr (PAIRS) {
    const float2 gu = rp.finish(W, row, row + units, sub, x_s);
    const float g = gu.x * scale, up = gu.y * scale;
    if (sub == 0 && row < W.rows) {
      if (a.gelu) a.y[pair_unit] = detail::glu_unit(g, up, true);  // a store in each branch: see the SiluGlu epilogue
      else a.y[pair_unit] = detail::glu_unit(g, up, false);
    }
    return;
  }
  const float acc = rd.finish(W, row, sub, x_s) * scale;

  if (a.mode == NormOut::Plain) {
    if (sub == 0 && row < W.rows) a.y[row] = acc;
  } else if (a.mode == NormOut::SiluGlu) {
    if (sub == 0) y_s[local] = acc;
    __syncthreads();
    const int u = unit0 + threadIdx.x;
    if (threadIdx.x < units_per_block && u < units) {
      const float g = y_s[threadIdx.x], up = y_s[threadIdx.x + units_per_block];
      // A store in each branch, not one store of a selected value: that form changed the code of every norm + matvec
      // kernel (this body's), which were measured as they are.
      if (a.gelu) a.y[u] = detail::glu_unit(g, up, true);
      else a.y[u] = detail::glu_unit(g, up, false);
    }
  } else {
    if (sub == 0) y_s[local] = acc + bias;
    __syncthreads();
    if (stores_pair) {
      const QkvTargets& t = a.qkv;
      const bool gathered = t.neox && r0 < t.q_dim + t.kv_dim;  // a NeoX pair: rows i and i + head_dim/2
      detail::store_qkv_pair_rotated(detail::qkv_pair_row(r0, t.neox, t.q_dim, t.kv_dim, t.head_dim), y_s[2 * pair],
                                     y_s[2 * pair + 1], t.io->pos, cs, t.q_dim, t.kv_dim, t.head_dim, t.q_out,
                                     t.k_cache, t.v_cache, gathered ? t.head_dim / 2 : 1);
    }
  }
}

template <typename B, int TPR, bool PRE>
__global__ void __launch_bounds__(512) norm_matvec_kernel(DevMatrix W, const float* __restrict__ x,
                                                          const float* __restrict__ norm_w, float eps,
                                                          NormMatvecArgs a) {
  norm_matvec_body<B, TPR, PRE, 1>(W, x, norm_w, eps, a);
}

// 16-lane rows in 256-thread blocks, five resident per SM (48 registers, 2 blocks a lane before the wait), for matrices
// that one wave of norm_matvec_kernel does not cover (run_norm_matvec). Its own kernel, not a launch-bounds template
// argument of the one above: `__launch_bounds__(512, 1)` there let ptxas take 85-111 registers instead of 64 and cost
// SmolLM2-135M 7% (NOTES, "CUDA, session 14").
template <typename B>
__global__ void __launch_bounds__(256, 5) norm_matvec_kernel_5(DevMatrix W, const float* __restrict__ x,
                                                               const float* __restrict__ norm_w, float eps,
                                                               NormMatvecArgs a) {
  norm_matvec_body<B, 16, false, 5>(W, x, norm_w, eps, a);
}

// SiluGlu in the same 16-lane rows, each lane group computing one unit's gate and up rows together (RowDotPair: every
// x block read from shared memory once for both): a block of 16u threads covers u units (run_norm_matvec picks u),
// where norm_matvec_kernel_5 covers 8 rows, so fewer blocks stage and normalize x, for more weights each. Bounded for
// two blocks a SM of up to 22 units (two rows of 2 blocks a lane before the wait need more than kernel_5's 48
// registers).
constexpr int kGluPairsMaxThreads = 352;
template <typename B>
__global__ void __launch_bounds__(kGluPairsMaxThreads, 2) norm_matvec_glu_pairs_kernel(DevMatrix W,
                                                                                       const float* __restrict__ x,
                                                                                       const float* __restrict__ norm_w,
                                                                                       float eps, NormMatvecArgs a) {
  norm_matvec_body<B, 16, false, 4, true>(W, x, norm_w, eps, a);
}

// The same at 8 lanes, 32 units a block: the gate/up of matrices too large for one wave at 16 lanes (SmolLM2-1.7B's
// and Llama 3.2 1B's 16,384 rows as 256 blocks, not 512 of half units). H200 (NOTES, "CUDA, session 33"): the 1.7B
// shape 666.5 / 664.8 -> 656.7 / 656.8 us per token; alone, 16,384 x 2,048 gate/up 9.70 -> 9.28 us (Q4_0), 11.80 ->
// 11.08 (Q4_K), 13.40 -> 12.55 (Q6_K), but 12.81 -> 14.40 for a kWide8 stack, which keeps the unpaired kernel.
// Bounded for two resident a SM: the grid of those 16,384 rows is 256 blocks, just under two a SM, and at one a SM it
// runs in two waves (`__launch_bounds__(256, 1)` let ptxas take 133-160 registers: 742 us per token). Unbounded it
// stayed at two (Q4_0 121 registers); bounded (119) the 1.7B shape went 654.5 -> 647.9 us per token on the H200
// (NOTES, "CUDA, session 34"). The blocks a lane loads before the wait stay unroll_for's: four for Q4_0 and Q5_0
// beat two, three and five there.
template <typename B>
__global__ void __launch_bounds__(256, 2) norm_matvec_glu_pairs8_kernel(DevMatrix W, const float* __restrict__ x,
                                                                         const float* __restrict__ norm_w, float eps,
                                                                         NormMatvecArgs a) {
  norm_matvec_body<B, 8, false, 1, true>(W, x, norm_w, eps, a);
}

// ------------------------------------------------------------------ matvec + residual

// TPR 64 (two warps per row, 512 threads) serves wide matrices such as the down projection (48 blocks per row):
// each lane then sums at most one weight block after the wait instead of two; TPR 128 (matvec_residual_kernel_w4)
// the deepest rows where they fit one wave. U: the weight blocks each lane loads before the wait
// (launch_matvec_residual gives rows of more than two blocks a lane three).
// residual == nullptr: out = W . x (the O and down projections of post-norm models, whose sum waits for its norm).
template <typename B, int TPR, int U>
__device__ __forceinline__ void matvec_residual_body(const DevMatrix& W, const float* __restrict__ x,
                                                     const float* residual, float* out) {
  extern __shared__ float4 smem_dyn[];
  float* x_s = reinterpret_cast<float*>(smem_dyn);
  __shared__ float half_sums[TPR > 32 ? 512 / 32 : 1];  // a partial sum per warp of a multi-warp row
  const int rows_per_block = blockDim.x / TPR;
  const int local = threadIdx.x / TPR, sub = threadIdx.x % TPR;
  const int row = blockIdx.x * rows_per_block + local;

  KernelTrace trace(W.nb > 32 ? kTraceDown : kTraceResidual);
  detail::launch_dependents();
  RowDotB<B, TPR, U> rd;
  rd.prefetch(W, row, sub);
  grid_dependency_wait();
  trace.released();
  // The residual row is loaded now, in the same L2 round trip as the activations, not after the dot product.
  const float res = residual != nullptr && sub == 0 && row < W.rows ? __ldcg(residual + row) : 0.f;

  // x in 16-byte loads, kStageVec per thread per round trip to L2: one round trip up to 8,192 columns at 512
  // threads (the down projection's 4,864 took two with scalar loads; NOTES, "CUDA, session 14").
  const int n = W.nb * 32;
  const bool vec = aligned16(x) && W.cols % 4 == 0;
  for (int j0 = threadIdx.x; j0 < n / 4; j0 += kStageVec * blockDim.x) {
    float4 v[kStageVec];
#pragma unroll
    for (int u = 0; u < kStageVec; ++u) v[u] = load4<true>(x, 4 * (j0 + u * blockDim.x), W.cols, vec);
#pragma unroll
    for (int u = 0; u < kStageVec; ++u) {
      const int j = j0 + u * blockDim.x;
      if (j < n / 4) *reinterpret_cast<float4*>(x_s + smem_index(4 * j)) = v[u];
    }
  }
  __syncthreads();
  trace.mark(0);

  float acc = rd.finish(W, row, sub, x_s);
  if constexpr (TPR > 32) {
    const int warp = threadIdx.x / 32;
    if (threadIdx.x % 32 == 0) half_sums[warp] = acc;
    __syncthreads();
    if (sub == 0) {
      acc = half_sums[warp] + half_sums[warp + 1];
#pragma unroll
      for (int w = 2; w < TPR / 32; ++w) acc += half_sums[warp + w];
    }
  }
  trace.mark(1);
  if (sub == 0 && row < W.rows) out[row] = res + acc;
}

template <typename B, int TPR, int U = B::kUnroll>
__global__ void __launch_bounds__(512) matvec_residual_kernel(DevMatrix W, const float* __restrict__ x,
                                                              const float* residual, float* out) {
  matvec_residual_body<B, TPR, U>(W, x, residual, out);
}

// Four warps a row in 512-thread blocks, two blocks a SM (64 registers).
template <typename B, int U>
__global__ void __launch_bounds__(512, 2) matvec_residual_kernel_w4(DevMatrix W, const float* __restrict__ x,
                                                                    const float* residual, float* out) {
  matvec_residual_body<B, 128, U>(W, x, residual, out);
}
// ------------------------------------------------------------------ launch helpers

namespace {

// Decode matvecs are latency-bound: after the programmatic wait a block stages x and each lane sums its weight
// blocks, so a whole warp per row (each lane one or two 32-weight blocks at SmolLM2's widths) and 256 threads per
// block (x staged in one batch of loads, eight warps to hide the shared-memory latency of the dot products) make
// the dependent part shortest; the idle lanes of an 18-block row cost nothing that matters here.
constexpr int kMatvecTpr = 32;
Geometry matvec_geometry(const DevMatrix& W, int tpr = kMatvecTpr, int threads = 256) {
  Geometry g;
  g.tpr = tpr;
  g.threads = threads;
  const int rows_per_block = g.threads / g.tpr;
  g.grid = (W.rows + rows_per_block - 1) / rows_per_block;
  g.smem = static_cast<size_t>(W.nb) * kSmemBlockStride * sizeof(float);
  return g;
}
// The paired gate/up kernels' grid: a lane group per GLU unit (a gate row and its up row), not per row.
Geometry glu_pairs_geometry(const DevMatrix& W, Geometry g) {
  const int units_per_block = g.threads / g.tpr;
  g.grid = (W.rows / 2 + units_per_block - 1) / units_per_block;
  return g;
}

template <bool PRE, int TPR>
struct NormKernels {
  using Fn = void (*)(DevMatrix, const float*, const float*, float, NormMatvecArgs);
  template <GgmlType T>
  static Fn get() { return norm_matvec_kernel<typename BlkSel<T>::type, TPR, PRE>; }
};
struct NormKernels5 {
  using Fn = void (*)(DevMatrix, const float*, const float*, float, NormMatvecArgs);
  template <GgmlType T>
  static Fn get() { return norm_matvec_kernel_5<typename BlkSel<T>::type>; }
};
struct NormKernelsGluPairs8 {
  using Fn = void (*)(DevMatrix, const float*, const float*, float, NormMatvecArgs);
  template <GgmlType T>
  static Fn get() { return norm_matvec_glu_pairs8_kernel<typename BlkSel<T>::type>; }
};
struct NormKernelsGluPairs {
  using Fn = void (*)(DevMatrix, const float*, const float*, float, NormMatvecArgs);
  template <GgmlType T>
  static Fn get() { return norm_matvec_glu_pairs_kernel<typename BlkSel<T>::type>; }
};
// U: weight blocks per lane loaded before the wait, at least the type's own kUnroll.
template <int TPR, int U = 0>
struct ResidualKernels {
  using Fn = void (*)(DevMatrix, const float*, const float*, float*);
  template <GgmlType T>
  static Fn get() {
    using B = typename BlkSel<T>::type;
    return matvec_residual_kernel<B, TPR, (U > B::kUnroll ? U : B::kUnroll)>;
  }
};
template <int U>
struct ResidualKernelsW4 {
  using Fn = void (*)(DevMatrix, const float*, const float*, float*);
  template <GgmlType T>
  static Fn get() {
    using B = typename BlkSel<T>::type;
    return matvec_residual_kernel_w4<B, (U > B::kUnroll ? U : B::kUnroll)>;
  }
};
template <int TPR>
typename NormKernels<false, TPR>::Fn norm_kernel(const DevMatrix& W, bool pre) {
  return pre ? kernel_for<NormKernels<true, TPR>>(W.type) : kernel_for<NormKernels<false, TPR>>(W.type);
}

// The block types that fit the register-capped kernels (float blocks spill 150-300 bytes there).
bool quantized(GgmlType t) { return t != GgmlType::F32 && t != GgmlType::F16 && t != GgmlType::BF16; }

// Blocks of kernel k that are resident at once (one wave), and the rows they cover.
template <typename K>
int blocks_per_wave(K k, const Geometry& g) {
  int per_sm = 0;
  allow_smem(k, g.smem);
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, g.threads, g.smem));
  return std::max(per_sm, 1) * device_attribute(cudaDevAttrMultiProcessorCount);
}
template <typename K>
int64_t rows_per_wave(K k, const Geometry& g) {
  return static_cast<int64_t>(blocks_per_wave(k, g)) * (g.threads / g.tpr);
}

void run_norm_matvec(const DevMatrix& W, const float* x, const float* norm_w, float eps, const NormMatvecArgs& a,
                     cudaStream_t s) {
  // A whole warp per row keeps the part after the wait shortest (each lane one or two weight blocks), as long as
  // the rows fit about one wave of resident blocks: a later wave pays the launch, the wait, the staging and the
  // reduction again with HBM idle. Larger matrices take half a warp per row, or a quarter, in 256-thread blocks.
  // H100, us per token (NOTES, "CUDA, session 13"): Qwen2.5-0.5B's gate/up (9,728 rows, 2.3 waves at 32 lanes)
  // 612 -> 528 at 16 lanes (1.15 waves; 8 lanes, 0.6 waves but four blocks a lane, 578); SmolLM2-1.7B's gate/up
  // (16,384 rows) 1,003 -> 873 at 8 lanes (0.97 waves; 16 lanes, 1.9 waves, 907) and its QKV (6,144 rows, 1.45
  // waves) -> 16 lanes +3%; the one-wave gate/up of Gemma 3 270M and SmolLM2-135M lose 4-20% at fewer lanes.
  // SiluGlu at 32 lanes in 512 threads (16 rows per block): the gate/up matrix's 3072 rows as 192 blocks instead of
  // 384, each staging and normalizing x once for twice the rows. Measured in the decode chain (H100): 402 -> 390 us
  // per token; QKV at 512 threads was slower (391 -> 398) and O even, so they keep 256 (NOTES, "Fifth session").
  const bool pre = a.pre.y != nullptr;
  // A folded residual add (post-norm models: Gemma 3) makes every block stage two norms, so such a matrix takes the
  // most lanes a row (32, 16 or 8) whose 256-thread grid fits one block a SM, and the launch asks for no shared memory
  // beyond what one block needs (carveout 0): the driver then gives each SM the smallest configuration that holds
  // one block (on sm_90 8 KB, where these blocks take ~5 KB with the reserved 1 KB), so the block scheduler cannot
  // stack two blocks on one SM while others idle. H200, Gemma 3 270M shape: QKV 1,536 rows at 16 lanes (96 blocks) and gate/up 4,096 rows at 8 lanes
  // (128 blocks): 328.5 / 326.6 -> 305.6 / 305.8 us a token. Either lane count alone at the driver's carveout lost
  // (333, 349 us); carveout 0 on the other models' launches, whose grids hold several blocks a SM, lost 3-17%
  // (NOTES, "CUDA, session 36").
  if (pre && quantized(W.type)) {
    const int sms = device_attribute(cudaDevAttrMultiProcessorCount);
    for (const int tpr : {32, 16, 8}) {
      const Geometry g = matvec_geometry(W, tpr, 256);
      if (g.grid > sms) continue;
      const auto k = tpr == 32   ? norm_kernel<32>(W, true)
                     : tpr == 16 ? norm_kernel<16>(W, true)
                                 : norm_kernel<8>(W, true);
      allow_smem(k, g.smem);
      detail::launch_programmatic_ex(k, dim3(g.grid), dim3(g.threads), g.smem, s, dim3(1, 1, 1), 0, W, x, norm_w, eps,
                                     a);
      return;
    }
  }
  constexpr double kWaveSlack = 1.25;  // a last wave of a quarter of the SMs' blocks costs less than fewer lanes
  Geometry g = matvec_geometry(W, kMatvecTpr, a.mode == NormOut::SiluGlu ? 512 : 256);
  auto k = norm_kernel<kMatvecTpr>(W, pre);
  if (W.rows > kWaveSlack * static_cast<double>(rows_per_wave(k, g))) {
    g = matvec_geometry(W, 16, 256);
    k = norm_kernel<16>(W, pre);
    const int64_t wave16 = rows_per_wave(k, g);
    // Past one wave of the 64-register kernel (4 blocks a SM), the 48-register instantiation (5 a SM, 2 blocks a
    // lane before the wait) may still hold every row in one wave: Qwen2.5-0.5B's gate/up, 9,728 rows in 608 blocks
    // against 528 resident. H100, Qwen2.5-0.5B shape: 510 -> 482 us per token, the gate/up's share of the chain
    // 6.9 -> 5.4 us a layer (NOTES, "CUDA, session 14").
    const auto k5 = pre || !quantized(W.type) ? k : kernel_for<NormKernels5>(W.type);
    if (k5 != k && W.rows > wave16 && W.rows <= rows_per_wave(k5, g)) {
      k = k5;
      // The gate/up: the paired form, with the fewest units a block (even, at least 16) whose grid is at most two
      // blocks a SM, where that is one wave. Qwen2.5-0.5B's 4,864 units at 16 a block were 304 blocks (2.3 a SM) that
      // the scheduler stacked three deep on 85 SMs and left 14 idle (block log); at 20 a block they are 244. H200:
      // 406.8 -> 402.3 us a token (run ahead 400.0 -> 395.7); capping those at two a SM by shared memory lost (411),
      // as did 14 units at three a SM (417) and 38 at one a SM (415) (NOTES, "CUDA, session 36").
      if (a.mode == NormOut::SiluGlu) {
        const int units = W.rows / 2, two_a_sm = 2 * device_attribute(cudaDevAttrMultiProcessorCount);
        const int u = std::max(16, ((units + two_a_sm - 1) / two_a_sm + 1) / 2 * 2);
        const auto kp = kernel_for<NormKernelsGluPairs>(W.type);
        Geometry gp = g;
        gp.threads = 16 * u;
        gp = glu_pairs_geometry(W, gp);
        if (gp.threads <= kGluPairsMaxThreads && gp.grid <= blocks_per_wave(kp, gp)) {
          k = kp;
          g = gp;
        }
      }
    } else if (W.rows > kWaveSlack * static_cast<double>(wave16)) {
      g = matvec_geometry(W, 8, 256);
      k = norm_kernel<8>(W, pre);
      // The gate/up: the paired form (norm_matvec_glu_pairs8_kernel), but not for a kWide8 stack.
      if (a.mode == NormOut::SiluGlu && !pre && quantized(W.type) && W.type != kWide8) {
        k = kernel_for<NormKernelsGluPairs8>(W.type);
        g = glu_pairs_geometry(W, g);
      }
    }
  }
  allow_smem(k, g.smem);
  detail::launch_programmatic(k, dim3(g.grid), dim3(g.threads), g.smem, s, W, x, norm_w, eps, a);
}


}  // namespace

static void check_pre_add(const PreAdd& pre, const float* x) {
  if (pre.y != nullptr && (pre.w == nullptr || pre.x_next == nullptr || pre.x_next == x))
    throw EngineError("norm matvec: a folded residual add needs its norm weights and a separate output buffer");
}

void launch_norm_matvec(const DevMatrix& W, const float* x, const float* norm_w, float eps, float* y,
                        cudaStream_t s, const PreAdd& pre) {
  check_pre_add(pre, x);
  NormMatvecArgs a;
  a.mode = NormOut::Plain;
  a.y = y;
  a.pre = pre;
  run_norm_matvec(W, x, norm_w, eps, a, s);
}

void launch_norm_matvec_silu_glu(const DevMatrix& W, const float* x, const float* norm_w, float eps, float* act,
                                 cudaStream_t s, Activation act_fn, const PreAdd& pre) {
  // Every block takes units_per_block units of each half, so a grid of rows / rows-per-block blocks
  // covers exactly the units when the halves are equal.
  if (W.rows % 2 != 0) throw EngineError("gate/up matvec: the stacked matrix needs two equal halves");
  check_pre_add(pre, x);
  NormMatvecArgs a;
  a.mode = NormOut::SiluGlu;
  a.gelu = act_fn == Activation::GeluTanh;
  a.pre = pre;
  a.y = act;
  run_norm_matvec(W, x, norm_w, eps, a, s);
}

void launch_norm_matvec_qkv(const DevMatrix& W, const float* x, const float* norm_w, float eps, const QkvTargets& t,
                            cudaStream_t s) {
  if (W.rows != t.q_dim + 2 * t.kv_dim || t.head_dim % 2 != 0) throw EngineError("qkv matvec: bad geometry");
  NormMatvecArgs a;
  a.mode = NormOut::Qkv;
  a.qkv = t;
  run_norm_matvec(W, x, norm_w, eps, a, s);
}

void launch_embed_norm_matvec_qkv(const DevMatrix& emb, float* x, const DevMatrix& W, const float* norm_w, float eps,
                                  const QkvTargets& t, cudaStream_t s) {
  if (W.rows != t.q_dim + 2 * t.kv_dim || t.head_dim % 2 != 0) throw EngineError("qkv matvec: bad geometry");
  if (emb.cols != W.cols || norm_w == nullptr) throw EngineError("embedding + qkv matvec: bad geometry");
  NormMatvecArgs a;
  a.mode = NormOut::Qkv;
  a.qkv = t;
  a.embed = emb;
  a.x_out = x;
  run_norm_matvec(W, x, norm_w, eps, a, s);
}

namespace {
void run_matvec_residual(const DevMatrix& W, const float* x, const float* residual, float* out, cudaStream_t s) {
  // More weight blocks per row than a warp has lanes: two warps per row (see the kernel). Rows of more than two
  // blocks a lane (Qwen2.5-0.5B's down projection: 152 blocks over 64 lanes) load three a lane before the wait;
  // with two, the third came from HBM after the activations (H100, Qwen2.5-0.5B shape: 513 -> 503 us per token;
  // NOTES, "CUDA, session 14").
  // Such deep rows take four warps a row instead, two 512-thread blocks a SM, where one wave of those holds every
  // row: each SM then runs twice the warps on half the blocks a lane (H100, Qwen2.5-0.5B shape: 487 -> 471 us per
  // token; the 1.7B's down, 512 blocks of four rows, is two waves that way and lost 6%; NOTES, "CUDA, session 26").
  const bool wide = W.nb > kMatvecTpr, deep = W.nb > 2 * 2 * kMatvecTpr;
  if (deep && quantized(W.type)) {
    const Geometry g4 = matvec_geometry(W, 4 * kMatvecTpr, 512);
    const auto k4 = kernel_for<ResidualKernelsW4<2>>(W.type);
    if (g4.grid <= blocks_per_wave(k4, g4)) {
      allow_smem(k4, g4.smem);
      detail::launch_programmatic(k4, dim3(g4.grid), dim3(g4.threads), g4.smem, s, W, x, residual, out);
      return;
    }
  }
  Geometry g = wide ? matvec_geometry(W, 2 * kMatvecTpr, 512) : matvec_geometry(W);
  const auto k = deep   ? kernel_for<ResidualKernels<2 * kMatvecTpr, 3>>(W.type)
                 : wide ? kernel_for<ResidualKernels<2 * kMatvecTpr>>(W.type)
                        : kernel_for<ResidualKernels<kMatvecTpr>>(W.type);
  // A grid of at most two thirds of the SMs asks for more than half a SM's shared memory, so that no SM takes two
  // of its blocks: the block scheduler otherwise stacked 2-4 of them on some SMs while others ran none, and the
  // kernel ended with its most loaded SM (chain trace's block log: Gemma 3 270M's O projection, 80 blocks on 71 SMs,
  // done +1.38 us after the release where a SM ran one and +2.53 where it ran four). H100: Gemma 3 388.4/389.8 ->
  // 375.9/376.0 us a token, SmolLM2-135M 371.4/371.2 -> 366.3/367.0. Spread over nearly every SM (Qwen2.5-0.5B's O,
  // 112 blocks) it lost 0.9%: each such block's registers keep one of the next kernel's five gate/up blocks of that
  // SM from entering before the wait (NOTES, "CUDA, session 26").
  if (3 * g.grid <= 2 * device_attribute(cudaDevAttrMultiProcessorCount)) {
    const int sm_smem = device_attribute(cudaDevAttrMaxSharedMemoryPerMultiprocessor);
    g.smem = std::max(g.smem, static_cast<size_t>(sm_smem / 2 + 1024));
  }
  allow_smem(k, g.smem);
  detail::launch_programmatic(k, dim3(g.grid), dim3(g.threads), g.smem, s, W, x, residual, out);
}
}  // namespace

void launch_matvec_residual(const DevMatrix& W, const float* x, float* residual, cudaStream_t s) {
  run_matvec_residual(W, x, residual, residual, s);
}

// Gemma 3's O and down projections (ahead of their post-norms) took the plain norm + matvec kernel before: 3.07 us
// of the chain each on the H100 against 1.8 for this kernel's residual form at SmolLM2-135M (NOTES, session 25).
void launch_matvec(const DevMatrix& W, const float* x, float* y, cudaStream_t s) {
  run_matvec_residual(W, x, nullptr, y, s);
}

}  // namespace metalattn::cuda
