// Decode plumbing: the programmatic-launch switch, the chain trace's host side (trace.cuh), and the embedding and
// argmax kernels. The matvecs are in matvec.cu, the lm_head in lm_head.cu, the decode attention in decode_attention.cu.
#include <algorithm>
#include <cmath>
#include <string>

#include "cuda/cuda_check.h"
#include "kernels.cuh"
#include "trace.cuh"

namespace metalattn::cuda {

using detail::grid_dependency_wait;

// ------------------------------------------------------------------ launch plumbing

// Per host thread: a backend sets it around its own enqueues (ProgrammaticLaunchScope), and models driven from
// different threads must not switch it under each other's launches.
static thread_local bool g_programmatic = false;
void set_programmatic_launch(bool on) { g_programmatic = on; }
bool programmatic_launch() { return g_programmatic; }

int device_attribute(cudaDeviceAttr attr) {
  int device = 0, value = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&value, attr, device));
  return value;
}

// ------------------------------------------------------------------ chain trace, host side

#ifdef METALATTN_TRACE
static TraceState* g_trace = nullptr;  // device memory, allocated by the first reset
bool trace_reset() {
  if (g_trace == nullptr) {
    CUDA_CHECK(cudaMalloc(&g_trace, sizeof(TraceState)));
    trace_attach_matvec(g_trace);
    trace_attach_lm_head(g_trace);
    trace_attach_decode_attention(g_trace);
    trace_attach_arch(g_trace);
  }
  CUDA_CHECK(cudaMemset(g_trace, 0, sizeof(TraceState)));
  return true;
}
void trace_block_counts(unsigned* blocks, unsigned* late) {
  if (g_trace == nullptr) {
    for (int k = 0; k < kTraceKinds; ++k) blocks[k] = late[k] = 0;
    return;
  }
  CUDA_CHECK(cudaMemcpy(blocks, g_trace->blocks, kTraceKinds * sizeof(unsigned), cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaMemcpy(late, g_trace->late_blocks, kTraceKinds * sizeof(unsigned), cudaMemcpyDeviceToHost));
}
// The first min(*count, cap) entries of a device log array.
template <typename T>
static std::vector<T> read_log(const unsigned* count, const T* log, unsigned cap) {
  unsigned n = 0;
  CUDA_CHECK(cudaMemcpy(&n, count, sizeof(n), cudaMemcpyDeviceToHost));
  std::vector<T> r(std::min(n, cap));
  if (!r.empty()) CUDA_CHECK(cudaMemcpy(r.data(), log, r.size() * sizeof(T), cudaMemcpyDeviceToHost));
  return r;
}
std::vector<TraceRecord> trace_read() {
  if (g_trace == nullptr) return {};
  return read_log(&g_trace->count, g_trace->rec, kTraceCapacity);
}
std::vector<TraceBlock> trace_read_blocks() {
  if (g_trace == nullptr) return {};
  return read_log(&g_trace->block_count, g_trace->block_log, kTraceBlockCapacity);
}
#else
std::vector<TraceBlock> trace_read_blocks() { return {}; }
bool trace_reset() { return false; }
std::vector<TraceRecord> trace_read() { return {}; }
void trace_block_counts(unsigned* blocks, unsigned* late) {
  for (int k = 0; k < kTraceKinds; ++k) blocks[k] = late[k] = 0;
}
#endif

// ------------------------------------------------------------------ embedding, argmax

__global__ void embed_kernel(DevMatrix E, const DecodeIO* io, const int32_t* tokens, float* x) {
  detail::launch_dependents();
  grid_dependency_wait();
  const int t = blockIdx.x;
  const int token = tokens != nullptr ? tokens[t] : io->token;
  for (int i = threadIdx.x; i < E.cols; i += blockDim.x)
    x[static_cast<int64_t>(t) * E.cols + i] = detail::load_weight(E, token, i);
}

__global__ void __launch_bounds__(256) argmax_kernel(const float* __restrict__ x, int n, ArgmaxScratch sc,
                                                     ArgmaxResult* result, DecodeIO* io_next) {
  detail::launch_dependents();
  grid_dependency_wait();
  __shared__ ArgmaxPartial red[32];
  ArgmaxPartial c{0.f, kNoIndex};
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const ArgmaxPartial p{x[i], static_cast<uint32_t>(i)};
    if (!isnan(p.value) && detail::argmax_better(p, c)) c = p;
  }
  c = detail::block_argmax(c, red);
  detail::argmax_finish(c, sc, result, io_next);
}

void launch_embed(const DevMatrix& emb, const DecodeIO* io, float* x, cudaStream_t s) {
  detail::launch_programmatic(embed_kernel, dim3(1), dim3(256), 0, s, emb, io, static_cast<const int32_t*>(nullptr),
                              x);
}

void launch_embed_rows(const DevMatrix& emb, const int32_t* tokens, int n, float* x, cudaStream_t s) {
  embed_kernel<<<n, 256, 0, s>>>(emb, nullptr, tokens, x);
  CUDA_CHECK_LAUNCH();
}
void launch_argmax(const float* x, int n, const ArgmaxScratch& scratch, ArgmaxResult* result, DecodeIO* io_next,
                   cudaStream_t s) {
  int blocks = (n + 1023) / 1024;
  blocks = std::max(1, std::min(blocks, std::min(scratch.capacity, kArgmaxMaxBlocks)));
  detail::launch_programmatic(argmax_kernel, dim3(blocks), dim3(256), 0, s, x, n, scratch, result, io_next);
}


}  // namespace metalattn::cuda
