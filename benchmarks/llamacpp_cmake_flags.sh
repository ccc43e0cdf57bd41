# The CMake switches of every llama.cpp build the benchmarks use (the CUDA tools for sm_90, nothing else), sourced by
# benchmarks/build_llamacpp_carry.sh (built here and carried) and benchmarks/device/realshapes.sh (its fallback
# build on the device), so that both measure the same configuration.
LLAMACPP_CMAKE_FLAGS=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90
  -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_EXAMPLES=OFF
  -DLLAMA_BUILD_TESTS=OFF)
