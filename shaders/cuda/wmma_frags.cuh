// The 16 x 16 x 16 fp16 wmma fragments of the tensor-core attention kernels (prefill.cu, decode_attention.cu) and the
// hi + lo split that carries a float operand as two halves (v = hi + lo, about 21 bits; plain fp16 would put ~1e-3
// relative error on the scores and outputs). K and V multiply as the cache holds them (fp16, exact); accumulation is
// fp32.
#pragma once
#include <cuda_fp16.h>
#include <mma.h>

namespace metalattn::cuda {

namespace wm = nvcuda::wmma;
using FragA = wm::fragment<wm::matrix_a, 16, 16, 16, __half, wm::row_major>;
using FragBCol = wm::fragment<wm::matrix_b, 16, 16, 16, __half, wm::col_major>;
using FragBRow = wm::fragment<wm::matrix_b, 16, 16, 16, __half, wm::row_major>;
using FragAcc = wm::fragment<wm::accumulator, 16, 16, 16, float>;

__device__ __forceinline__ void split_half(float v, __half& hi, __half& lo) {
  hi = __float2half_rn(v);
  lo = __float2half_rn(v - __half2float(hi));
}

}  // namespace metalattn::cuda
