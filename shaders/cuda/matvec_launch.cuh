// Host side of the decode matvec launches, shared by matvec.cu and lm_head.cu: a launch's geometry, the one switch
// from a weight type to a kernel instantiation, and the shared-memory opt-in.
#pragma once
#include <string>

#include "cuda/cuda_check.h"
#include "kernels.cuh"
#include "matvec_weights.cuh"

namespace metalattn::cuda {
namespace {

struct Geometry {
  int tpr, threads, grid;
  size_t smem;
};

// The one switch from a weight type to a kernel instantiation: Family::get<T>() names the kernel for type T.
template <typename Family>
typename Family::Fn kernel_for(GgmlType t) {
  if (t == kWide8) return Family::template get<kWide8>();
  switch (t) {
    case GgmlType::Q4_0: return Family::template get<GgmlType::Q4_0>();
    case GgmlType::Q4_1: return Family::template get<GgmlType::Q4_1>();
    case GgmlType::Q8_0: return Family::template get<GgmlType::Q8_0>();
    case GgmlType::Q5_0: return Family::template get<GgmlType::Q5_0>();
    case GgmlType::Q5_1: return Family::template get<GgmlType::Q5_1>();
    case GgmlType::Q4_K: return Family::template get<GgmlType::Q4_K>();
    case GgmlType::Q5_K: return Family::template get<GgmlType::Q5_K>();
    case GgmlType::Q6_K: return Family::template get<GgmlType::Q6_K>();
    case GgmlType::F16: return Family::template get<GgmlType::F16>();
    case GgmlType::BF16: return Family::template get<GgmlType::BF16>();
    case GgmlType::F32: return Family::template get<GgmlType::F32>();
    default: break;
  }
  throw EngineError(std::string("matvec: unsupported weight type ") + gpu_type_name(t));
}

template <typename K>
K pick(int tpr, K k8, K k16, K k32) {
  return tpr == 8 ? k8 : tpr == 16 ? k16 : k32;
}

template <typename K>
void allow_smem(K kernel, size_t smem) {
  detail::allow_dynamic_smem(kernel, smem);
}

}  // namespace
}  // namespace metalattn::cuda
