// Every CUDA call goes through these: a failure becomes metalattn::EngineError carrying the
// CUDA error string and the call site, never an abort.
#pragma once
#include <cuda_runtime.h>

#include <string>

#include "metalattn/model.h"

namespace metalattn::cuda {

[[noreturn]] inline void throw_cuda_error(cudaError_t err, const char* what, const char* file, int line) {
  cudaGetLastError();  // reset a non-sticky error (e.g. out of memory) so later launch checks do not see it again
  throw EngineError(std::string("CUDA error: ") + cudaGetErrorString(err) + " (" + cudaGetErrorName(err) + ") in " +
                    what + " at " + file + ":" + std::to_string(line));
}

}  // namespace metalattn::cuda

#define CUDA_CHECK(call)                                                                       \
  do {                                                                                         \
    const cudaError_t ma_err_ = (call);                                                        \
    if (ma_err_ != cudaSuccess) ::metalattn::cuda::throw_cuda_error(ma_err_, #call, __FILE__, __LINE__); \
  } while (0)

// After a kernel launch: launch-configuration errors surface at once.
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())
