// The final norm + lm_head + argmax of a decode step: few resident blocks stream the whole vocabulary's rows, each
// lane group of TPR lanes (matvec.cu's row geometry) one row a pass, and the argmax is reduced per block and then
// across blocks (detail::argmax_finish) so that only the token id and its logit leave the GPU. Tests:
// CudaFused.FinalNormLmHeadArgmax (every lane geometry) and CudaQuant.FusedQkvFfnAndLmHeadAtRealShapes (each type).
#include <algorithm>

#include "cuda/cuda_check.h"
#include "kernels.cuh"
#include "matvec_launch.cuh"
#include "matvec_weights.cuh"
#include "norm_staging.cuh"
#include "trace.cuh"

namespace metalattn::cuda {

using detail::grid_dependency_wait;

METALATTN_TRACE_UNIT(lm_head)

struct ArgmaxArgs {
  bool prefetch_l2 = false;      // the rows of later passes go to L2 before the wait (when they fit there)
  float* logits = nullptr;
  ArgmaxScratch am;
  ArgmaxResult* result = nullptr;
  DecodeIO* io_next = nullptr;
  int result_ring = 1;  // argmax_finish
};

// Few blocks, each looping over several row groups: the norm is staged and the argmax reduced once per block, not
// once per 32 rows, and the next group's weights are loaded while the current one is summed.
template <typename B, int TPR, int U = B::kUnroll>
__global__ void __launch_bounds__(256) norm_matvec_argmax_kernel(DevMatrix W, const float* __restrict__ x,
                                                                 const float* __restrict__ norm_w, float eps,
                                                                 ArgmaxArgs a) {
  extern __shared__ float4 smem_dyn[];
  float* x_s = reinterpret_cast<float*>(smem_dyn);
  __shared__ float red[32];
  __shared__ ArgmaxPartial am_red[32];
  const int rows_per_pass = blockDim.x / TPR;
  const int local = threadIdx.x / TPR, sub = threadIdx.x % TPR;
  const int stride = gridDim.x * rows_per_pass;
  int base = blockIdx.x * rows_per_pass;

  KernelTrace trace(kTraceLmHead);
  detail::launch_dependents();
  RowDotB<B, TPR, U> rd;
  rd.prefetch(W, base + local, sub);
  NormPrefetch nw;
  nw.load(norm_w, W.cols);
  // The rows of the later passes go to L2 now, while the kernels before still run: the lm_head is the one matrix
  // too large for its first pass to hide the rest of its reads.
  if (a.prefetch_l2) {
    const int pb = payload_bytes(W.type), sc = scale_count(W.type);
    for (int g = base + stride; g < W.rows; g += stride) {
      const int rows = min(rows_per_pass, W.rows - g);
      const char* pay = reinterpret_cast<const char*>(W.payload) + static_cast<int64_t>(g) * W.nb * pb;
      const int pay_bytes = rows * W.nb * pb;
      for (int off = threadIdx.x * 128; off < pay_bytes; off += blockDim.x * 128) prefetch_l2(pay + off);
      if (sc > 0) {
        const char* scl = reinterpret_cast<const char*>(W.scales) + static_cast<int64_t>(g) * W.nb * sc * 2;
        const int scl_bytes = rows * W.nb * sc * 2;
        for (int off = threadIdx.x * 128; off < scl_bytes; off += blockDim.x * 128) prefetch_l2(scl + off);
      }
      const int aw = aux_words(W.type);
      if (aw > 0) {
        const char* aux = reinterpret_cast<const char*>(W.aux) + static_cast<int64_t>(g) * W.nb * aw * 4;
        const int aux_bytes = rows * W.nb * aw * 4;
        for (int off = threadIdx.x * 128; off < aux_bytes; off += blockDim.x * 128) prefetch_l2(aux + off);
      }
    }
  }
  grid_dependency_wait();
  trace.released();
  const float scale = stage_normed(x, norm_w, nw, eps, W.cols, W.nb * 32, x_s, red);

  ArgmaxPartial best{0.f, kNoIndex};
  for (; base < W.rows; base += stride) {  // block-uniform: every lane takes part in the group shuffles
    RowDotB<B, TPR, U> next;
    next.prefetch(W, base + stride + local, sub);
    const int row = base + local;
    const float acc = rd.finish(W, row, sub, x_s) * scale;
    if (sub == 0 && row < W.rows) {
      a.logits[row] = acc;
      if (!isnan(acc) && detail::argmax_better(ArgmaxPartial{acc, static_cast<uint32_t>(row)}, best))
        best = ArgmaxPartial{acc, static_cast<uint32_t>(row)};
    }
    rd = next;
  }
  best = detail::block_argmax(best, am_red);
  detail::argmax_finish(best, a.am, a.result, a.io_next, a.result_ring);
}

namespace {

// The lm_head streams 49k+ rows through a few resident blocks (norm_matvec_argmax_kernel): fewer lanes per row
// keep more rows in flight per pass. Q8_0 rows (the lm_head of every model we run) take the fewest lanes whose
// blocks a lane before the wait (kUnroll 3, or 2 past 8 lanes: lm_head_two_blocks) cover the whole row: at 8 lanes x
// 3 blocks, Qwen2.5-0.5B's 28-block rows left 4 blocks to load after each pass's dots began. H200 (NOTES, "CUDA,
// session 33"): Qwen2.5-0.5B shape 411.5 / 411.9 -> 406.9 / 407.2 us per token at 16 lanes x 2 blocks, SmolLM2-1.7B
// 667.6 / 670.3 -> 663.0 / 663.0 at 32 x 2; 32 lanes x 1 block for Qwen's rows lost (412.5 / 412.2).
bool lm_head_two_blocks(const DevMatrix& W, int tpr) { return W.type == GgmlType::Q8_0 && tpr > 8 && W.nb <= 2 * tpr; }
Geometry lm_head_geometry(const DevMatrix& W) {
  Geometry g;
  g.tpr = W.type == GgmlType::Q8_0 ? (W.nb <= 24 ? 8 : W.nb <= 48 ? 16 : 32) : W.nb <= 32 ? 8 : W.nb <= 64 ? 16 : 32;
  g.threads = 256;
  g.grid = 0;  // chosen from occupancy at launch
  g.smem = static_cast<size_t>(W.nb) * kSmemBlockStride * sizeof(float);
  return g;
}

template <int TPR>
struct ArgmaxKernels {
  using Fn = void (*)(DevMatrix, const float*, const float*, float, ArgmaxArgs);
  template <GgmlType T>
  static Fn get() { return norm_matvec_argmax_kernel<typename BlkSel<T>::type, TPR>; }
};

// The lm_head kernel's row groups (rows_per_pass rows each); its grid is at most this many blocks.
constexpr int kArgmaxThreads = 256;
int argmax_row_groups(const DevMatrix& W) {
  const int rows_per_pass = kArgmaxThreads / lm_head_geometry(W).tpr;
  return (W.rows + rows_per_pass - 1) / rows_per_pass;
}

}  // namespace

int argmax_partials_needed(const DevMatrix& lm_head) {
  const int g = argmax_row_groups(lm_head);
  return g > kArgmaxMaxBlocks ? g : kArgmaxMaxBlocks;
}

void launch_norm_matvec_argmax(const DevMatrix& W, const float* x, const float* norm_w, float eps, float* logits,
                               const ArgmaxScratch& scratch, ArgmaxResult* result, DecodeIO* io_next,
                               cudaStream_t s, int result_ring) {
  if (result_ring < 1 || (result_ring & (result_ring - 1)) != 0)
    throw EngineError("argmax: the result ring must hold a power of two of slots");
  const Geometry g = lm_head_geometry(W);
  using Q8 = Blk<GgmlType::Q8_0>;
  const auto k = lm_head_two_blocks(W, g.tpr)
                     ? (g.tpr == 16 ? norm_matvec_argmax_kernel<Q8, 16, 2> : norm_matvec_argmax_kernel<Q8, 32, 2>)
                     : pick(g.tpr, kernel_for<ArgmaxKernels<8>>(W.type), kernel_for<ArgmaxKernels<16>>(W.type),
                            kernel_for<ArgmaxKernels<32>>(W.type));
  allow_smem(k, g.smem);
  // As many blocks as fit on the GPU at once, spread so that every block takes the same number of row groups.
  int per_sm = 0;
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, kArgmaxThreads, g.smem));
  const int groups = argmax_row_groups(W);
  const int resident = std::max(1, per_sm * device_attribute(cudaDevAttrMultiProcessorCount));
  const int passes = (groups + resident - 1) / resident;
  const int grid = (groups + passes - 1) / passes;
  if (grid > scratch.capacity) throw EngineError("argmax scratch too small");
  ArgmaxArgs a;
  // Prefetching the whole matrix to L2 pays only where it fits there with room to spare (SmolLM2's Q8_0 lm_head is
  // 28 MB of the H100's 50 MB); a larger one would evict its own lines and the KV cache.
  const int l2_bytes = device_attribute(cudaDevAttrL2CacheSize);
  const size_t matrix_bytes =
      static_cast<size_t>(W.rows) * W.nb * gpu_block_bytes(W.type);
  a.prefetch_l2 = matrix_bytes <= static_cast<size_t>(l2_bytes) * 3 / 5;
  a.logits = logits;
  a.am = scratch;
  a.result = result;
  a.io_next = io_next;
  a.result_ring = result_ring;
  detail::launch_programmatic(k, dim3(grid), dim3(kArgmaxThreads), g.smem, s, W, x, norm_w, eps, a);
}

}  // namespace metalattn::cuda
