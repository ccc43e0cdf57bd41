// Chain trace of the decode kernels (METALATTN_TRACE builds only; benchmarks/device/trace.sh and bench_cuda's
// `trace` mode read it): where one decode step's time goes inside the kernel chain.
// Block 0, thread 0 of a traced kernel stamps enter (construction), released (after the programmatic wait) and exit
// (destruction, whichever return the kernel takes), with optional marks between. Per kernel kind, over all blocks:
// how many blocks ran, and how many were released from the programmatic wait less than 1 us after they entered
// (their weight prefetch could not overlap the kernel before).
#pragma once
#include <vector>

#include "kernels.cuh"

namespace metalattn::cuda {

// One block's stamps: kind, block index, SM, and enter / release / exit in %globaltimer ns.
struct TraceBlock {
  unsigned long long enter, released, exit;
  int kind, block, sm, pad;
};
constexpr int kTraceBlockCapacity = 1 << 16;

// One device allocation (made by the first trace_reset) that the traced kernels of every file write.
struct TraceState {
  TraceRecord rec[kTraceCapacity];
  unsigned int count;
  unsigned int blocks[kTraceKinds], late_blocks[kTraceKinds];
  // Every block of every traced kernel: its SM and its enter, release and exit stamps (bench_cuda's block log).
  TraceBlock block_log[kTraceBlockCapacity];
  unsigned int block_count;
};

// The block log of the last traced step (up to kTraceBlockCapacity blocks).
std::vector<TraceBlock> trace_read_blocks();

// The files with traced kernels; trace_reset points each file's copy of the state pointer at the one TraceState.
void trace_attach_matvec(TraceState* state);
void trace_attach_lm_head(TraceState* state);
void trace_attach_decode_attention(TraceState* state);
void trace_attach_arch(TraceState* state);

#ifdef METALATTN_TRACE
// Without relocatable device code each .cu file has its own copy of this pointer (null until trace_reset: nothing
// is recorded before that).
static __device__ TraceState* g_trace_state;

// Defines a file's attach function: METALATTN_TRACE_UNIT(matvec) -> trace_attach_matvec(TraceState*).
#define METALATTN_TRACE_UNIT(name)                                                   \
  void trace_attach_##name(TraceState* state) {                                      \
    CUDA_CHECK(cudaMemcpyToSymbol(g_trace_state, &state, sizeof(state)));            \
  }

struct KernelTrace {
  TraceState* st = nullptr;
  int slot = -1;
  int kind_ = 0;
  unsigned long long block_enter = 0, block_released = 0;
  __device__ explicit KernelTrace(int kind) : st(g_trace_state), kind_(kind) {
    if (st == nullptr) return;
    if (threadIdx.x == 0) block_enter = detail::global_ns();
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) {
      const unsigned s = atomicAdd(&st->count, 1u);
      if (s < kTraceCapacity) {
        slot = static_cast<int>(s);
        st->rec[slot].enter = detail::global_ns();
        st->rec[slot].kind = kind;
        for (int i = 0; i < kTraceMarks; ++i) st->rec[slot].mark[i] = 0;
      }
    }
  }
  __device__ void released() {
    if (st == nullptr || threadIdx.x != 0) return;
    const unsigned long long now = detail::global_ns();
    block_released = now;
    atomicAdd(&st->blocks[kind_], 1u);
    if (now - block_enter < 1000) atomicAdd(&st->late_blocks[kind_], 1u);
    if (slot >= 0) st->rec[slot].released = now;
  }
  __device__ void mark(int i) {
    if (slot >= 0) st->rec[slot].mark[i] = detail::global_ns();
  }
  __device__ ~KernelTrace() {
    if (slot >= 0) st->rec[slot].exit = detail::global_ns();
    if (st != nullptr && threadIdx.x == 0) {
      const unsigned i = atomicAdd(&st->block_count, 1u);
      if (i < kTraceBlockCapacity) {
        unsigned sm;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        TraceBlock& b = st->block_log[i];
        b.enter = block_enter;
        b.released = block_released;
        b.exit = detail::global_ns();
        b.kind = kind_;
        b.block = blockIdx.x + blockIdx.y * gridDim.x;
        b.sm = static_cast<int>(sm);
      }
    }
  }
};
#else
#define METALATTN_TRACE_UNIT(name)
struct KernelTrace {
  __device__ explicit KernelTrace(int) {}
  __device__ void released() {}
  __device__ void mark(int) {}
};
#endif

}  // namespace metalattn::cuda
