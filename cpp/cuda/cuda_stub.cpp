// Linked instead of the CUDA backend when the build found no nvcc (METALATTN_CUDA=OFF, or AUTO without the toolkit).
#include "metalattn/backend.h"

namespace metalattn {

bool cuda_compiled() { return false; }
int cuda_device_count() { return 0; }
std::unique_ptr<Backend> make_cuda_backend(const ModelSpec&, const ModelWeights&, bool) {
  throw EngineError("this build of metalattn has no CUDA backend (rebuild with the CUDA toolkit's nvcc on PATH)");
}

std::string cuda_device_name() { return {}; }
size_t cuda_device_memory_used() { return 0; }
double cuda_copy_bandwidth() { return 0.0; }

}  // namespace metalattn
