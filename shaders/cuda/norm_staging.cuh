// Staging the activations of a decode matvec in shared memory: 16-byte loads through L2 (load4 / store4), the norm
// weights of the first batch loaded before the programmatic wait (NormPrefetch), and rmsnorm folded into the staging
// (stage_normed). Included by matvec.cu (the norm + matvec and residual kernels) and lm_head.cu (the final norm +
// lm_head); their tests are CudaMatvec / CudaFused.
#pragma once
#include <cstdint>

#include "kernels.cuh"
#include "matvec_weights.cuh"

namespace metalattn::cuda {

// Elements i..i+3 of p (i a multiple of 4), `fill` past cols: one 16-byte load where `vec` (p 16-byte aligned, cols a
// multiple of 4), else four. Activations come through L2 (`cg`: written by the kernel before), weights through the
// read-only path. A group wholly past cols returns at once: the staging loops take a fixed number of groups a thread
// (kNormGroups, kStageVec), most of them past the row at these widths, and each such group had gone down the four
// predicated scalar loads (H100: -1.5% a token at Qwen2.5-0.5B's shape, -1.2% Gemma 3's; NOTES, "CUDA, session 27").
template <bool kCg>
__device__ __forceinline__ float4 load4(const float* p, int i, int cols, bool vec, float fill = 0.f) {
  auto one = [&](int k) { return k < cols ? (kCg ? __ldcg(p + k) : __ldg(p + k)) : fill; };
  if (i >= cols) return make_float4(fill, fill, fill, fill);
  if (vec) {
    const float4* q = reinterpret_cast<const float4*>(p + i);
    return kCg ? __ldcg(q) : __ldg(q);
  }
  return make_float4(one(i), one(i + 1), one(i + 2), one(i + 3));
}
// Stores elements i..i+3 of v to p (those below cols), as load4 reads them.
__device__ __forceinline__ void store4(float* p, int i, int cols, bool vec, float4 v) {
  if (vec && i < cols) {
    *reinterpret_cast<float4*>(p + i) = v;
    return;
  }
  const float e[4] = {v.x, v.y, v.z, v.w};
  for (int k = 0; k < 4 && i + k < cols; ++k) p[i + k] = e[k];
}
__device__ __forceinline__ bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }
__device__ __forceinline__ float4 mul4(float4 a, float4 b) {
  return make_float4(a.x * b.x, a.y * b.y, a.z * b.z, a.w * b.w);
}
__device__ __forceinline__ float dot4(float4 a, float4 b) { return (a.x * b.x + a.y * b.y) + (a.z * b.z + a.w * b.w); }

// 16-byte groups of x a thread loads per round trip to L2 in stage_normed (8 x blockDim columns: one round trip for
// every model's width at 256 threads up to 2,048 columns), and of norm weights NormPrefetch holds over the wait.
// Four, as the residual kernel stages, would hold 16 more registers through the staging of the 48-register kernel.
constexpr int kNormGroups = 2;

// Norm weights of the first staging batch, loaded before the programmatic wait (they are weights, so this takes one
// L2 round trip out of the critical path).
struct NormPrefetch {
  float4 w[kNormGroups];
  __device__ __forceinline__ void load(const float* __restrict__ norm_w, int cols) {
    const bool vec = norm_w != nullptr && aligned16(norm_w) && cols % 4 == 0;
#pragma unroll
    for (int u = 0; u < kNormGroups; ++u) {
      const int i = 4 * (threadIdx.x + u * blockDim.x);
      w[u] = norm_w != nullptr ? load4<false>(norm_w, i, cols, vec, 1.f) : make_float4(1.f, 1.f, 1.f, 1.f);
    }
  }
};

// Stages x[0..n) (zero past `cols`) times the norm weights into the padded shared layout and returns rmsnorm's
// 1/rms (1 without norm_w), which the caller applies to its dot products: W.(x*w) / rms = W.rmsnorm(x), with no
// second pass over x_s. x is read through L2 (it was written by the kernel before) in 16-byte groups, kNormGroups a
// thread per round trip. With add.y set (PreAdd, kernels.cuh), x + rmsnorm(add.y) * add.w is staged instead of x, as
// add_normed_kernel computes it, and block 0 writes it to add.x_next. Ends with a barrier. (Scalar loads, eight a
// thread, took ~170 instructions a warp for Qwen2.5-0.5B's 896 columns, most of them predicates and branches around
// each element: NOTES, "CUDA, session 26".)
__device__ __forceinline__ float stage_normed(const float* x, const float* __restrict__ norm_w, const NormPrefetch& pre,
                                              float eps, int cols, int n, float* x_s, float* red,
                                              const PreAdd& add = PreAdd{}) {
  const bool vec = aligned16(x) && (norm_w == nullptr || aligned16(norm_w)) && cols % 4 == 0 &&
                   (add.y == nullptr || (aligned16(add.y) && aligned16(add.w) && aligned16(add.x_next)));
  // PreAdd (rows wider than stage_pre_added takes): y's reduction first, then the add as x is staged: two round
  // trips to L2 and one block reduction more than plain staging. (Loading x, y and the post-norm weights of the
  // first batch together ahead of the reduction, one round trip fewer but both reductions kept, measured slower on
  // the H100: Gemma 3 270M-shaped decode 1,853 -> 1,737 tok/s, NOTES.)
  float add_scale = 0.f;
  if (add.y != nullptr) {
    float sy = 0.f;
    for (int i = 4 * threadIdx.x; i < cols; i += 4 * blockDim.x) {
      const float4 v = load4<true>(add.y, i, cols, vec);
      sy += dot4(v, v);
    }
    add_scale = 1.f / sqrtf(detail::block_sum(sy, red) / static_cast<float>(cols) + add.eps);
  }
  float ss = 0.f;
  for (int j0 = threadIdx.x, batch = 0; j0 < n / 4; j0 += kNormGroups * blockDim.x, ++batch) {
    float4 v[kNormGroups], w[kNormGroups];
#pragma unroll
    for (int u = 0; u < kNormGroups; ++u) {
      const int i = 4 * (j0 + u * blockDim.x);
      v[u] = load4<true>(x, i, cols, vec);
      w[u] = batch == 0 ? pre.w[u] : norm_w != nullptr ? load4<false>(norm_w, i, cols, vec, 1.f)
                                                       : make_float4(1.f, 1.f, 1.f, 1.f);
    }
    if (add.y != nullptr) {
#pragma unroll
      for (int u = 0; u < kNormGroups; ++u) {
        const int i = 4 * (j0 + u * blockDim.x);
        if (i < cols) {
          const float4 y = load4<true>(add.y, i, cols, vec), aw = load4<false>(add.w, i, cols, vec);
          v[u] = make_float4(v[u].x + y.x * add_scale * aw.x, v[u].y + y.y * add_scale * aw.y,
                             v[u].z + y.z * add_scale * aw.z, v[u].w + y.w * add_scale * aw.w);
          if (blockIdx.x == 0) store4(add.x_next, i, cols, vec, v[u]);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kNormGroups; ++u) {
      const int i = 4 * (j0 + u * blockDim.x);
      if (i < n) {
        *reinterpret_cast<float4*>(x_s + smem_index(i)) = mul4(v[u], w[u]);
        ss += dot4(v[u], v[u]);
      }
    }
  }
  if (norm_w == nullptr) {
    __syncthreads();
    return 1.f;
  }
  const float total = detail::block_sum(ss, red);  // its barriers also publish x_s
  return 1.f / sqrtf(total / static_cast<float>(cols) + eps);
}

}  // namespace metalattn::cuda
