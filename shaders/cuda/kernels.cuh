// Device code interface of the CUDA backend: the GPU weight layout, the small structs kernels share with the
// host, and host-callable launch helpers (each launches one kernel on the given stream and checks the launch).
//
// Decode step, per token (all kernels read the token id and position from DecodeIO in device memory):
//   L x [ norm+QKV matvec (+RoPE +KV append; layer 0 also gathers the embedding row) -> attention
//         -> O matvec+residual -> norm+gate/up matvec+SiLU*up -> down matvec+residual ]  ->  final norm+lm_head+argmax
// that is 5 kernels per layer and 1 more: 5L + 1 launches, captured once as one CUDA graph per attention regime
// (one pass with all K/V rows in shared memory up to kAttnSinglePassMax positions, split over the context beyond);
// the host picks the graph by position. Each kernel starts early (programmatic dependent launch), loads what does
// not depend on the kernel before (weights, norm weights, RoPE factors, cached K/V rows), then waits.
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "cuda/cuda_check.h"
#include "metalattn/backend.h"
#include "metalattn/model.h"
#include "metalattn/quant.h"

namespace metalattn::cuda {

// Activations are staged in shared memory in 32-float blocks padded to 36 floats: the threads of a row group
// read consecutive weight blocks, and the padding spreads their 16-byte reads over all 32 banks.
constexpr int kSmemBlockStride = 36;

// GPU layout of a weight matrix: per row, nb = ceil(cols/32) blocks. Block payloads (the quants, or the raw
// F16/BF16/F32 values) lie contiguous and 16-byte aligned so each thread reads them with 16-byte loads; the fp16
// scales (d, or d and m for Q4_1) lie in a separate array, and the types with more than four bits per weight keep
// their extra bits (or fp32 scales) in a third array of 32-bit words, `aux`. Float rows are zero-padded to a
// multiple of 32. Weight j of a 4-bit payload is the low nibble of byte j (j < 16) or the high nibble of byte
// j - 16, as in Q4_0, for every type that has a nibble payload.
//
// Per 32 weights (GPU bytes per weight; the GGUF file's in brackets where it differs):
//   Q4_0   payload 16 B nibbles, scales d                                                    0.5625
//   Q4_1   payload 16 B nibbles, scales d, m                                                 0.625
//   Q8_0   payload 32 B int8, scales d                                                       1.0625
//   Q5_0   payload 16 B nibbles, scales d, aux 1 word: the inverted fifth bits (q5_aux_bit)  0.6875
//   Q5_1   payload 16 B nibbles, scales d, m, aux 1 word: the fifth bits (q5_aux_bit)         0.75
//   Q4_K   payload 16 B nibbles; scales: per 256-weight super-block its 16-byte header as the file stores it
//          (d, dmin, the twelve bytes of 6-bit scales and mins), i.e. 8 fp16 slots per 8 blocks, read with
//          one 16-byte load and decoded on the fly: d*sc and dmin*m stay exact in fp32             0.5625
//   Q5_K   as Q4_K, plus aux 1 word: the fifth bits (q5_aux_bit)                                0.6875
//   Q6_K   payload 16 B: the low nibbles; scales: d (fp16) and the block's two int8 sub-block scales
//          (slot 2: low byte sc of weights 0..15, high byte sc of 16..31); aux 2 words: the high two bits of
//          each weight, xor 2 (q6_aux_pos), so that nibble | bits << 4 sign-extends to q - 32     0.875 [0.8203]
//   kWide8 (an internal type: the stacks of mixed quantized types, and Q2_K / Q3_K): payload 32 B int8 q;
//          aux 4 words, fp32 s0, s1, m0, m1: weight j = s_h * q_j - m_h, h = j / 16. Holds every quantized
//          GGUF type exactly (the products d * sc of the K-quants are exact in fp32)          1.5
//   F16 / BF16 2, F32 4.
struct DevMatrix {
  GgmlType type = GgmlType::F32;
  int rows = 0;
  int cols = 0;
  int nb = 0;
  const uint8_t* payload = nullptr;  // rows * nb * payload_bytes(type)
  const uint16_t* scales = nullptr;  // rows * nb * scale_count(type) fp16 values; null for float types
  const uint32_t* aux = nullptr;     // rows * nb * aux_words(type); null for the types without
  // Q4_K / Q5_K: per block (d * sc, -dmin * m); Q6_K: (d * sc0, d * sc1), fp32 (exact). Read only by the few-token
  // prompt projections (prompt_mma.cu), whose registers cannot hold the super-block headers: 8 bytes per 32 weights
  // of device memory (0.25 B/weight), no decode traffic.
  const float2* mma_scales = nullptr;
};

// The GPU-only type of mixed-type stacks (see DevMatrix). Not a GGUF type id (those are below 64).
constexpr GgmlType kWide8 = static_cast<GgmlType>(0x1000);

__host__ __device__ inline int payload_bytes(GgmlType t) {
  if (t == kWide8) return 32;
  switch (t) {
    case GgmlType::Q4_0:
    case GgmlType::Q4_1:
    case GgmlType::Q5_0:
    case GgmlType::Q5_1:
    case GgmlType::Q4_K:
    case GgmlType::Q5_K:
    case GgmlType::Q6_K: return 16;
    case GgmlType::Q8_0: return 32;
    case GgmlType::F16:
    case GgmlType::BF16: return 64;
    case GgmlType::F32: return 128;
    default: return 0;
  }
}
// fp16 slots per 32-weight block (for Q4_K / Q5_K: on average; they hold 8 per 8-block super-block).
__host__ __device__ inline int scale_count(GgmlType t) {
  switch (t) {
    case GgmlType::Q4_0:
    case GgmlType::Q8_0:
    case GgmlType::Q5_0:
    case GgmlType::Q4_K:
    case GgmlType::Q5_K: return 1;
    case GgmlType::Q4_1:
    case GgmlType::Q5_1:
    case GgmlType::Q6_K: return 2;
    default: return 0;
  }
}
// 32-bit aux words per 32-weight block.
__host__ __device__ inline int aux_words(GgmlType t) {
  if (t == kWide8) return 4;
  switch (t) {
    case GgmlType::Q5_0:
    case GgmlType::Q5_1:
    case GgmlType::Q5_K: return 1;
    case GgmlType::Q6_K: return 2;
    default: return 0;
  }
}
// fp32 values per 32-weight block in DevMatrix::mma_scales.
__host__ __device__ inline int mma_scale_count(GgmlType t) {
  return t == GgmlType::Q4_K || t == GgmlType::Q5_K || t == GgmlType::Q6_K ? 2 : 0;
}
// GPU bytes of one 32-weight block that decode reads: payload, scales and aux together.
__host__ __device__ inline int gpu_block_bytes(GgmlType t) {
  return payload_bytes(t) + 2 * scale_count(t) + 4 * aux_words(t);
}
// True for the types whose scales array holds one 16-byte header per 8 blocks (a 256-weight super-block).
__host__ __device__ inline bool has_superblock_header(GgmlType t) { return t == GgmlType::Q4_K || t == GgmlType::Q5_K; }

// Bit of the aux word that holds the extra bit of weight j (0..31) of a Q5 block: bit 8k + i for weight 4i + k
// (i, k < 4: the low nibbles of payload word i) and bit 8k + 4 + i for weight 16 + 4i + k (its high nibbles), so that
// (aux >> i) & 0x01010101 puts the bits of payload word i's four low nibbles at the bottom of their bytes.
__host__ __device__ inline int q5_aux_bit(int j) {
  const int jj = j & 15;
  return 8 * (jj & 3) + (j >= 16 ? 4 : 0) + (jj >> 2);
}
// Aux word (0: weights 0..15, 1: 16..31) and bit of the two high bits of weight j of a Q6_K block: bits 8k + 2i,
// 8k + 2i + 1 for weight 4i + k (+ 16), so (aux >> 2i) & 0x03030303 lines them up with payload word i's nibbles.
__host__ __device__ inline int q6_aux_word(int j) { return j >> 4; }
__host__ __device__ inline int q6_aux_bit(int j) { return 8 * (j & 3) + 2 * ((j & 15) >> 2); }

const char* gpu_type_name(GgmlType t);  // type_name, and "WIDE8" for kWide8

// Host-side packed image of a DevMatrix, ready to copy to the device.
struct PackedMatrix {
  GgmlType type = GgmlType::F32;
  int rows = 0, cols = 0, nb = 0;
  std::vector<uint8_t> payload;
  std::vector<uint16_t> scales;
  std::vector<uint32_t> aux;
  std::vector<float> mma_scales;  // rows * nb * mma_scale_count(type)
};

// The type that holds every part exactly: their common type (kWide8 for Q2_K / Q3_K, which have no GPU layout of
// their own), Q8_0 for a mix of Q4_0, Q5_0 and Q8_0 (d * (q - 8) and d * (q - 16) are Q8_0 values with the same d),
// kWide8 for any other mix of quantized types, F32 for a mix with a float type.
GgmlType common_exact_type(const std::vector<const WeightView*>& parts);
// Stacks the rows of `parts` (equal cols) into one matrix of type `target` (from common_exact_type).
PackedMatrix pack_matrix(const std::vector<const WeightView*>& parts, GgmlType target);

// Token id and position of the decode step, in device memory. The final argmax writes the chosen token and
// pos + 1 back, so greedy decode needs no host-to-device write per token. Decode kernels read it BEFORE their
// programmatic wait; that is safe only because each step is one graph launch, which starts after the previous one
// (and its argmax's write) has completed: never launch decode steps back to back with programmatic launch.
struct DecodeIO {
  int32_t token;
  int32_t pos;
};

// One candidate of the argmax reduction; index kNoIndex marks "no candidate" (empty or all NaN).
struct ArgmaxPartial {
  float value;
  uint32_t index;
};
constexpr uint32_t kNoIndex = 0xffffffffu;

// Scratch of the two-stage argmax: per-block partials and the done-counter (zero between launches).
struct ArgmaxScratch {
  ArgmaxPartial* partials = nullptr;
  unsigned int* counter = nullptr;
  int capacity = 0;  // number of partials
  // Where set, each result is also written here (device memory): the sampled draw that follows reads it there, where
  // the result itself is mapped host memory (a PCIe round trip a read, ~3.5 us on the H200).
  ArgmaxResult* last = nullptr;
};

// Decode attention splits the context only when it is long (flash-decoding): up to kAttnSinglePassMax positions one
// block per head block (heads_per_block query heads of one KV head) does the whole softmax and writes the output
// directly; beyond that, attn_splits() blocks per head block (chosen from the position at run time, inside the
// kernel, since the graph is captured once) write partials, and the last one of each head block combines them.
// Scratch for the split case:
struct AttnScratch {
  float* o = nullptr;                  // [n_heads][max_splits][head_dim]: unnormalized partial outputs
  float* ml = nullptr;                 // [n_heads][max_splits][2]: running max, sum of exp
  unsigned int* counters = nullptr;    // [n_heads] done-counters (one per head block), zero between launches
  int max_splits = 1;
};
constexpr int kAttnSinglePassMax = 256;  // = the attention block size: one position per thread in the score pass
constexpr int kAttnMinChunk = 64;        // positions per split block once the context is split
constexpr int kMaxAttnSplits = 32;
// Query heads per decode attention block: 1 spreads the latency-bound work over n_heads SMs (the K/V rows of a KV
// head are then read by each of its query heads' blocks, from L2).
constexpr int kAttnDefaultHeadsPerBlock = 1;
__host__ __device__ inline int attn_splits(int n_pos, int max_splits) {
  if (n_pos <= kAttnSinglePassMax) return 1;
  const int s = (n_pos + kAttnMinChunk - 1) / kAttnMinChunk;
  return s < max_splits ? s : max_splits;
}
__host__ __device__ inline int attn_chunk(int n_pos, int n_splits) { return (n_pos + n_splits - 1) / n_splits; }
// The longest chunk any n_pos <= n_ctx gets (sizes the score buffer in shared memory).
__host__ __device__ inline int attn_chunk_cap(int n_ctx, int max_splits) {
  const int single = n_ctx < kAttnSinglePassMax ? n_ctx : kAttnSinglePassMax;
  const int split = attn_chunk(n_ctx, max_splits);
  const int cap = single > split ? single : split;
  return (cap + 3) / 4 * 4;  // keeps the buffers behind the scores 16-byte aligned
}
// Split capacity worth allocating for a context of n_ctx on a GPU with n_sms SMs.
inline int attn_max_splits(int n_ctx, int n_kv_heads, int n_sms) {
  int s = (n_ctx + kAttnMinChunk - 1) / kAttnMinChunk;
  s = s < kMaxAttnSplits ? s : kMaxAttnSplits;
  const int by_sms = n_sms / n_kv_heads;
  s = s < by_sms ? s : by_sms;
  return s < 1 ? 1 : s;
}

// Enables Programmatic Dependent Launch for the decode launches that follow (captured into the decode graph):
// each kernel then starts while its predecessor drains, prefetches its weights, and waits in
// grid_dependency_wait() before touching activations. Off unless set (the backend sets it while capturing).
void set_programmatic_launch(bool on);
bool programmatic_launch();

// An attribute of the current device (SM count, L2 size, shared memory a SM or a block), for launch geometry.
int device_attribute(cudaDeviceAttr attr);

// Chain trace (compile with -DMETALATTN_TRACE; off in every normal build): block 0 of each decode kernel records
// when it entered, when its programmatic wait returned and when it left, in %globaltimer nanoseconds, so the
// benchmark can show where one decode step's time goes inside the PDL chain.
constexpr int kTraceMarks = 4;
struct TraceRecord {
  unsigned long long enter, released, exit;
  unsigned long long mark[kTraceMarks];  // optional stamps inside a kernel (0 = not set)
  int kind;  // TraceKind
};
enum TraceKind : int {
  kTraceNormMatvec = 0,
  kTraceQkv = 1,
  kTraceResidual = 2,
  kTraceAttention = 3,
  kTraceLmHead = 4,
  kTraceDown = 5,  // matvec+residual over rows wider than a warp's blocks (the down projection)
  kTraceNormPlain = 6,  // the general path's norm + matvec into plain rows (its QKV projection)
  kTracePlain = 7,      // the general path's matvec into plain rows without a norm (post-norm models' O and down)
  kTraceKinds = 8
};
constexpr int kTraceCapacity = 1024;
// Clears the trace; returns false when the build has no trace.
bool trace_reset();
// The records since the last reset, in kernel order.
std::vector<TraceRecord> trace_read();
// Per TraceKind since the last reset: blocks run, and blocks released from the programmatic wait less than 1 us
// after they entered (their prefetch did not overlap the kernel before).
void trace_block_counts(unsigned* blocks, unsigned* late);

// ------------------------------------------------------------------ device helpers shared by the .cu files
namespace detail {

#ifdef METALATTN_TRACE
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
#endif

__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the next kernel of the stream (launched with the programmatic attribute) start now: it prefetches its
// weights and then blocks in grid_dependency_wait() until this grid has completed, so triggering early is safe.
__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// One GLU unit's output from its gate and up values: GELU-tanh(gate) * up (Gemma 3) or SiLU(gate) * up, the formulas
// of the CPU reference. Every decode GLU (glu_kernel, the fused gate/up kernels) computes it here.
__device__ __forceinline__ float glu_unit(float g, float up, bool gelu) {
  if (gelu) {
    const float t = 0.7978845608028654f * g * (1.f + 0.044715f * g * g);
    return 0.5f * g * (1.f + tanhf(t)) * up;
  }
  return g / (1.f + expf(-g)) * up;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// A softmax's first half by one warp (lane = threadIdx.x & 31): s[0..n) <- e^(s - max); returns (max, sum of the
// exponentials) in every lane. The caller divides.
__device__ __forceinline__ float2 warp_exp_of_max(float* s, int n, int lane) {
  float m = -INFINITY;
  for (int t = lane; t < n; t += 32) m = fmaxf(m, s[t]);
  m = warp_max(m);
  float l = 0.f;
  for (int t = lane; t < n; t += 32) {
    const float e = expf(s[t] - m);
    s[t] = e;
    l += e;
  }
  return make_float2(m, warp_sum(l));
}

// Sum over the block; every thread gets the total. `red` holds 32 floats.
__device__ __forceinline__ float block_sum(float v, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();  // red may still be read by a previous call
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float t = lane < n_warps ? red[lane] : 0.f;
  return warp_sum(t);
}

// Four sums over the block at once (one pair of barriers); every thread gets the totals. `red` holds 32 float4.
__device__ __forceinline__ float4 block_sum4(float4 v, float4* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = (blockDim.x + 31) >> 5;
  v = make_float4(warp_sum(v.x), warp_sum(v.y), warp_sum(v.z), warp_sum(v.w));
  __syncthreads();  // red may still be read by a previous call
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float4 t = lane < n_warps ? red[lane] : make_float4(0.f, 0.f, 0.f, 0.f);
  return make_float4(warp_sum(t.x), warp_sum(t.y), warp_sum(t.z), warp_sum(t.w));
}

// Scale and min (6 bits each) of sub-block j (0..7) from the 16-byte Q4_K / Q5_K header words h1..h3 (the twelve
// scale bytes; h0 is d | dmin << 16), as k_scale_min decodes them.
__host__ __device__ __forceinline__ void k_header_scale_min(uint32_t h1, uint32_t h2, uint32_t h3, int j, int* sc,
                                                           int* m) {
  const int sh = 8 * (j & 3);
  const uint32_t a = (h1 >> sh) & 0xffu, b = (h2 >> sh) & 0xffu, c = (h3 >> sh) & 0xffu;
  if (j < 4) {
    *sc = static_cast<int>(a & 63u);
    *m = static_cast<int>(b & 63u);
  } else {
    *sc = static_cast<int>((c & 15u) | ((a >> 6) << 4));
    *m = static_cast<int>((c >> 4) | ((b >> 6) << 4));
  }
}

// Element j of row `row` of W, decoded exactly as the reference does (the same float operations in the same order,
// so the value is bit for bit ref::dequantize_row's).
__device__ __forceinline__ float load_weight(const DevMatrix& W, int64_t row, int col) {
  const int64_t blk = row * W.nb + col / 32;
  const int j = col % 32;
  const uint8_t* p = W.payload + blk * payload_bytes(W.type);
  const int nib = j < 16 ? (p[j & 15] & 15) : (p[j & 15] >> 4);  // the nibble payloads' weight j
  if (W.type == kWide8) {
    const float s = __uint_as_float(W.aux[4 * blk + (j >> 4)]), m = __uint_as_float(W.aux[4 * blk + 2 + (j >> 4)]);
    return __fsub_rn(__fmul_rn(s, static_cast<float>(static_cast<int8_t>(p[j]))), m);
  }
  switch (W.type) {
    case GgmlType::Q4_0:
      return __half2float(__ushort_as_half(W.scales[blk])) * static_cast<float>(nib - 8);
    case GgmlType::Q4_1:
      return __half2float(__ushort_as_half(W.scales[2 * blk])) * static_cast<float>(nib) +
             __half2float(__ushort_as_half(W.scales[2 * blk + 1]));
    case GgmlType::Q8_0:
      return __half2float(__ushort_as_half(W.scales[blk])) * static_cast<float>(static_cast<int8_t>(p[j]));
    case GgmlType::Q5_0: {
      const int inv = (W.aux[blk] >> q5_aux_bit(j)) & 1;  // inverted fifth bit
      return __half2float(__ushort_as_half(W.scales[blk])) * static_cast<float>(nib - 16 * inv);
    }
    case GgmlType::Q5_1: {
      const int q = nib | static_cast<int>((W.aux[blk] >> q5_aux_bit(j)) & 1) << 4;
      return __half2float(__ushort_as_half(W.scales[2 * blk])) * static_cast<float>(q) +
             __half2float(__ushort_as_half(W.scales[2 * blk + 1]));
    }
    case GgmlType::Q4_K:
    case GgmlType::Q5_K: {
      const uint4 h = reinterpret_cast<const uint4*>(W.scales)[blk >> 3];
      int sc, m;
      k_header_scale_min(h.y, h.z, h.w, static_cast<int>(blk & 7), &sc, &m);
      const float dl = __half2float(__ushort_as_half(static_cast<uint16_t>(h.x & 0xffffu))) * static_cast<float>(sc);
      const float ml = __half2float(__ushort_as_half(static_cast<uint16_t>(h.x >> 16))) * static_cast<float>(m);
      int q = nib;
      if (W.type == GgmlType::Q5_K) q |= static_cast<int>((W.aux[blk] >> q5_aux_bit(j)) & 1) << 4;
      return __fsub_rn(__fmul_rn(dl, static_cast<float>(q)), ml);
    }
    case GgmlType::Q6_K: {
      const uint32_t sw = reinterpret_cast<const uint32_t*>(W.scales)[blk];
      const int sc = static_cast<int8_t>(static_cast<uint8_t>(sw >> (j < 16 ? 16 : 24)));
      const int h2 = static_cast<int>((W.aux[2 * blk + q6_aux_word(j)] >> q6_aux_bit(j)) & 3);  // high bits xor 2
      const int q = nib + 16 * (h2 & 1) - 32 * (h2 >> 1);                                      // = q6 - 32
      return __half2float(__ushort_as_half(static_cast<uint16_t>(sw & 0xffffu))) * static_cast<float>(sc) *
             static_cast<float>(q);
    }
    case GgmlType::F16: return __half2float(reinterpret_cast<const __half*>(p)[j]);
    case GgmlType::BF16: return __uint_as_float(static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[j]) << 16);
    case GgmlType::F32: return reinterpret_cast<const float*>(p)[j];
    default: return 0.f;
  }
}

// (cos, sin) by which QKV output rows r0, r0 + 1 turn at position pos; (1, 0) for v rows, which do not turn.
__device__ __forceinline__ float2 rope_factors(int r0, int pos, const float2* rope_table, int q_dim, int kv_dim,
                                               int head_dim) {
  if (r0 >= q_dim + kv_dim) return make_float2(1.f, 0.f);
  const int r = r0 < q_dim ? r0 : r0 - q_dim;
  return rope_table[static_cast<int64_t>(pos) * (head_dim / 2) + (r % head_dim) / 2];
}

// The QKV rows in pair order: rows 2i and 2i + 1 of a head in this order are the two that RoPE turns together by
// factor i, so the fused QKV kernel computes the pair in adjacent rows of a block. Interleaved pairs are the
// matrix rows themselves; NeoX pairs (i, i + head_dim/2) are gathered: pair-order row r of a q/k head is matrix
// row head + r/2 + (r odd ? head_dim/2 : 0). V rows keep their order.
__device__ __forceinline__ int qkv_pair_row(int r, bool neox, int q_dim, int kv_dim, int head_dim) {
  if (!neox || r >= q_dim + kv_dim) return r;
  const int j = r % head_dim;  // q_dim is a whole number of heads, so k heads start at multiples of head_dim too
  return r - j + (j >> 1) + (j & 1) * (head_dim / 2);
}

// The K/V cache holds fp16: each value is rounded to nearest even as it is appended (the CPU backend rounds alike)
// and read back exactly. kv_round gives the value a cache row holds, for kernels that use a row they also append.
__device__ __forceinline__ __half kv_store(float v) { return __float2half_rn(v); }
__device__ __forceinline__ float kv_round(float v) { return __half2float(__float2half_rn(v)); }
// 4 or 8 cache values from their raw bits (8 or 16 bytes loaded by the caller, with whatever cache policy it needs).
__device__ __forceinline__ float4 kv4(uint2 u) {
  const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&u.x));
  const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&u.y));
  return make_float4(a.x, a.y, b.x, b.y);
}
__device__ __forceinline__ void kv8(uint4 u, float4& lo, float4& hi) {
  lo = kv4(make_uint2(u.x, u.y));
  hi = kv4(make_uint2(u.z, u.w));
}
// 4 values as the cache holds them: their fp16 bits (to store as 8 bytes), or their fp32 values.
__device__ __forceinline__ uint2 kv_pack4(float4 v) {
  const __half2 a = __floats2half2_rn(v.x, v.y), b = __floats2half2_rn(v.z, v.w);
  return make_uint2(*reinterpret_cast<const uint32_t*>(&a), *reinterpret_cast<const uint32_t*>(&b));
}
__device__ __forceinline__ float4 kv_round4(float4 v) { return kv4(kv_pack4(v)); }

// Writes the pair of QKV output rows r0, r0 + step at position pos, turned by cs = rope_factors(...) of the pair
// (step 1: adjacent rows, the interleaved layout and V; head_dim / 2: a NeoX pair, r0 its first row).
// Rows [0, q_dim) go to q_row, [q_dim, q_dim + kv_dim) to the K cache, the rest (plain) to the V cache.
__device__ __forceinline__ void store_qkv_pair_rotated(int r0, float a, float b, int pos, float2 cs, int q_dim,
                                                       int kv_dim, int head_dim, float* q_row, __half* k_cache,
                                                       __half* v_cache, int step = 1) {
  const int64_t cache_row = static_cast<int64_t>(pos) * kv_dim;
  if (r0 >= q_dim + kv_dim) {
    __half* dst = v_cache + cache_row + (r0 - q_dim - kv_dim);
    dst[0] = kv_store(a);
    dst[1] = kv_store(b);
    return;
  }
  const float x = a * cs.x - b * cs.y, y = a * cs.y + b * cs.x;
  if (r0 < q_dim) {
    q_row[r0] = x;
    q_row[r0 + step] = y;
  } else {
    __half* dst = k_cache + cache_row + (r0 - q_dim);
    dst[0] = kv_store(x);
    dst[step] = kv_store(y);
  }
}

__device__ __forceinline__ void store_qkv_pair(int r0, float a, float b, int pos, const float2* rope_table,
                                               int q_dim, int kv_dim, int head_dim, float* q_row, __half* k_cache,
                                               __half* v_cache) {
  store_qkv_pair_rotated(r0, a, b, pos, rope_factors(r0, pos, rope_table, q_dim, kv_dim, head_dim), q_dim, kv_dim,
                         head_dim, q_row, k_cache, v_cache);
}

// Argmax order: NaN/empty never wins, larger value wins, ties go to the lower index (so -inf-only input
// yields its first -inf, and +inf beats everything finite).
__device__ __forceinline__ bool argmax_better(const ArgmaxPartial& a, const ArgmaxPartial& b) {
  if (a.index == kNoIndex) return false;
  if (b.index == kNoIndex) return true;
  return a.value > b.value || (a.value == b.value && a.index < b.index);
}

__device__ __forceinline__ ArgmaxPartial warp_argmax(ArgmaxPartial c) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    ArgmaxPartial other;
    other.value = __shfl_xor_sync(0xffffffffu, c.value, o);
    other.index = __shfl_xor_sync(0xffffffffu, c.index, o);
    if (argmax_better(other, c)) c = other;
  }
  return c;
}

// Argmax over the block; the result is valid in thread 0. `red` holds 32 partials.
__device__ __forceinline__ ArgmaxPartial block_argmax(ArgmaxPartial c, ArgmaxPartial* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = (blockDim.x + 31) >> 5;
  c = warp_argmax(c);
  __syncthreads();
  if (lane == 0) red[warp] = c;
  __syncthreads();
  if (warp == 0) {
    c = lane < n_warps ? red[lane] : ArgmaxPartial{0.f, kNoIndex};
    c = warp_argmax(c);
  }
  return c;
}

// Second stage of the two-stage argmax: each block posts its partial; the last block to finish reduces them,
// writes the result, optionally advances the decode IO, and re-arms the counter for the next launch.
// ring > 1 (a power of two) with io_next: the result goes to result[io_next->pos % ring], the slot of the position
// this step decoded, so that steps enqueued back to back (CudaBackend::forward_tokens_greedy) each leave their own.
__device__ __forceinline__ void argmax_finish(ArgmaxPartial block_best, const ArgmaxScratch& sc,
                                              ArgmaxResult* result, DecodeIO* io_next, int ring = 1) {
  __shared__ ArgmaxPartial red[32];
  __shared__ bool is_last;
  if (threadIdx.x == 0) {
    sc.partials[blockIdx.x] = block_best;
    __threadfence();
    is_last = atomicAdd(sc.counter, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  ArgmaxPartial c{0.f, kNoIndex};
  for (unsigned i = threadIdx.x; i < gridDim.x; i += blockDim.x) {
    ArgmaxPartial p{__ldcg(&sc.partials[i].value), __ldcg(&sc.partials[i].index)};
    if (argmax_better(p, c)) c = p;
  }
  c = block_argmax(c, red);
  if (threadIdx.x == 0) {
    if (io_next != nullptr && ring > 1) result += io_next->pos & (ring - 1);
    const ArgmaxResult r{c.index, c.index == kNoIndex ? __int_as_float(0x7fc00000) : c.value};
    *result = r;
    if (sc.last != nullptr) *sc.last = r;
    if (io_next != nullptr && c.index != kNoIndex) {
      io_next->token = static_cast<int32_t>(c.index);
      io_next->pos += 1;
    }
    *sc.counter = 0u;
  }
}

// 16 bytes global -> shared without passing through registers; completes at cp_async_wait_all().
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// Element j of row t of an operand row of `width` values, the input the tensor-core projections read (prompt_mma.cu,
// prompt_gemm.cu): per group of 4 values one 16-byte "slot" [hi x4 | lo x4] of fp16 (hi = fp16(v), lo = fp16(v - hi)),
// rows of 2 * width halves.
__device__ __forceinline__ void store_operand(float v, int64_t t, int j, int width, __half* out) {
  const __half h = __float2half_rn(v);
  __half* slot = out + t * 2 * width + (j / 4) * 8 + (j % 4);
  slot[0] = h;
  slot[4] = __float2half_rn(v - __half2float(h));
}

// Launches `kernel`, with Programmatic Dependent Launch while programmatic_launch() is on: the kernel is scheduled
// while its predecessor drains and must call grid_dependency_wait() before it touches what that predecessor writes.
// The blocks form thread-block clusters of `cluster` blocks where that is more than one; `carveout` (percent of the
// SM's shared memory, -1 for the driver's choice) is the launch's preferred shared-memory / L1 split.
template <typename... KernelArgs, typename... Args>
void launch_programmatic_ex(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t s,
                            dim3 cluster, int carveout, Args&&... args) {
  cudaLaunchAttribute attr[3];
  int n = 0;
  if (programmatic_launch()) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster.x * cluster.y * cluster.z > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = cluster.x;
    attr[n].val.clusterDim.y = cluster.y;
    attr[n++].val.clusterDim.z = cluster.z;
  }
  if (carveout >= 0) {
    attr[n].id = cudaLaunchAttributePreferredSharedMemoryCarveout;
    attr[n++].val.sharedMemCarveout = static_cast<unsigned>(carveout);
  }
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cfg.attrs = n > 0 ? attr : nullptr;
  cfg.numAttrs = n;
  CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}
template <typename... KernelArgs, typename... Args>
void launch_programmatic_clusters(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t s,
                                  dim3 cluster, Args&&... args) {
  launch_programmatic_ex(kernel, grid, block, smem, s, cluster, -1, std::forward<Args>(args)...);
}
template <typename... KernelArgs, typename... Args>
void launch_programmatic(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t s,
                         Args&&... args) {
  launch_programmatic_ex(kernel, grid, block, smem, s, dim3(1, 1, 1), -1, std::forward<Args>(args)...);
}

// Whether this block is the last of `n` to arrive at `counter` (all threads call it). Thread 0's acq_rel add after
// the barrier releases every thread's earlier stores (release is cumulative over the barrier) and, in the last block,
// acquires the other blocks' before the barrier lets its threads read them (through L2: __ldcg).
__device__ __forceinline__ bool last_block_to_arrive(unsigned* counter, unsigned n) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned old;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(counter) : "memory");
    last = old == n - 1;
  }
  __syncthreads();
  return last;
}

// Raises `kernel`'s dynamic shared memory limit to `smem` where the default is too little: without the opt-in a block's
// static and dynamic shared memory together must fit 48 KiB (a 512-thread trial of the split decode attention, 48,896
// dynamic bytes beside 410 static ones, failed to launch). Only ever raised: the limit belongs to the kernel function,
// and a graph captured earlier (another backend, a larger n_ctx) may launch it with more than this call needs.
template <typename K>
void allow_dynamic_smem(K kernel, size_t smem) {
  constexpr size_t kDefaultLimit = 48 * 1024;
  if (smem == 0) return;
  cudaFuncAttributes attr{};
  CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  if (smem + attr.sharedSizeBytes <= kDefaultLimit) return;
  const int limit = std::max(static_cast<int>(smem), attr.maxDynamicSharedSizeBytes);
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, limit));
}

}  // namespace detail

// ------------------------------------------------------------------ decode launches
// x[0..d) = row io->token of emb.
void launch_embed(const DevMatrix& emb, const DecodeIO* io, float* x, cudaStream_t s);

// A residual add folded into the staging of the next norm+matvec (post-norm architectures such as Gemma 3): the
// kernel's input is x + rmsnorm(y, w, eps) instead of x, and block 0 writes that sum to x_next (a different buffer
// than x: the other blocks are still reading x), which then carries the residual stream. Saves the add_normed launch
// between a post-normed projection and the next layer or half-layer.
struct PreAdd {
  const float* y = nullptr;  // nullptr: no add
  const float* w = nullptr;
  float eps = 0.f;
  float* x_next = nullptr;
};

// y = W . rmsnorm(x, norm_w, eps); norm_w == nullptr: plain y = W . x.
void launch_norm_matvec(const DevMatrix& W, const float* x, const float* norm_w, float eps, float* y, cudaStream_t s,
                        const PreAdd& pre = {});
// W = [gate; up] stacked (two halves of W.rows / 2 rows): act[u] = act_fn(g_u) * up_u with g, up = W . rmsnorm(x),
// act_fn SiLU or GELU (tanh form). The FFN's activation leaves this kernel finished, so the down projection stages
// it with plain loads.
void launch_norm_matvec_silu_glu(const DevMatrix& W, const float* x, const float* norm_w, float eps, float* act,
                                 cudaStream_t s, Activation act_fn = Activation::Silu, const PreAdd& pre = {});

// W = [wq; wk; wv] stacked. q_out = rope(q); k rows (roped) and v rows go to row io->pos of the layer's caches.
struct QkvTargets {
  const float2* rope_table = nullptr;  // [n_ctx][head_dim/2] (cos, sin)
  const DecodeIO* io = nullptr;
  int q_dim = 0, kv_dim = 0, head_dim = 0;
  const float* bias = nullptr;  // [q_dim + 2 kv_dim] (bq | bk | bv) added before RoPE, or null (Qwen 2 has them)
  bool neox = false;            // RoPE turns (i, i + head_dim/2) instead of (2i, 2i+1) (detail::qkv_pair_row)
  float* q_out = nullptr;
  __half* k_cache = nullptr;  // this layer: [n_ctx][kv_dim] fp16
  __half* v_cache = nullptr;
};
// The targets of one layer's fused QKV kernel without bias or NeoX pairs (set those fields after, where a model has
// them).
inline QkvTargets qkv_targets(const float2* rope_table, const DecodeIO* io, int q_dim, int kv_dim, int head_dim,
                              float* q_out, __half* k_cache, __half* v_cache) {
  QkvTargets t;
  t.rope_table = rope_table;
  t.io = io;
  t.q_dim = q_dim;
  t.kv_dim = kv_dim;
  t.head_dim = head_dim;
  t.q_out = q_out;
  t.k_cache = k_cache;
  t.v_cache = v_cache;
  return t;
}
void launch_norm_matvec_qkv(const DevMatrix& W, const float* x, const float* norm_w, float eps, const QkvTargets& t,
                            cudaStream_t s);
// The first layer's variant with the embedding gather folded in: x = row t.io->token of emb (written to x for the
// residual stream), then as launch_norm_matvec_qkv. The embedding row is gathered before the programmatic wait.
void launch_embed_norm_matvec_qkv(const DevMatrix& emb, float* x, const DevMatrix& W, const float* norm_w, float eps,
                                  const QkvTargets& t, cudaStream_t s);

// logits = W . rmsnorm(x); then argmax of the logits into *result (device or mapped-host pointer); if io_next is
// non-null, also io_next->token = argmax, io_next->pos += 1.
void launch_norm_matvec_argmax(const DevMatrix& W, const float* x, const float* norm_w, float eps, float* logits,
                               const ArgmaxScratch& scratch, ArgmaxResult* result, DecodeIO* io_next,
                               cudaStream_t s, int result_ring = 1);

// residual += W . x
void launch_matvec_residual(const DevMatrix& W, const float* x, float* residual, cudaStream_t s);
// y = W . x, with the geometry and staging of launch_matvec_residual
void launch_matvec(const DevMatrix& W, const float* x, float* y, cudaStream_t s);

// out[n_heads * head_dim] = attention of q (all heads, roped) over cache positions [0, io->pos] of one layer.
// n_ctx bounds the position (sizes shared memory); the scratch serves the long-context split. heads_per_block
// (a divisor of n_heads / n_kv_heads; 0 = kAttnDefaultHeadsPerBlock) sets how many query heads one block serves.
void launch_attention_decode(const float* q, const __half* k_cache, const __half* v_cache, const DecodeIO* io,
                             int n_heads, int n_kv_heads, int head_dim, int n_ctx, const AttnScratch& scratch,
                             float* out, cudaStream_t s, int heads_per_block = 0);

// The split decode attention on tensor cores (head_dim 64, 1 .. 8 query heads per KV head): one block per (KV head,
// split), the group's query heads as the rows of one 16-row tile, scores and P.V as fp16 MMAs with fp32 accumulation
// (q and the probabilities carried as hi + lo halves, K and V exact as cached). Same partials, combine and result
// as launch_attention_decode within float rounding. Serves contexts whose chunks fit kTcDecodeMaxChunk positions;
// tc_decode_attention_fits says whether (n_ctx, scratch) does.
constexpr int kTcDecodeMaxChunk = 256;
bool tc_decode_attention_fits(int n_heads, int n_kv_heads, int head_dim, int n_ctx, int max_splits);
void launch_attention_decode_tc(const float* q, const __half* k_cache, const __half* v_cache, const DecodeIO* io,
                                int n_heads, int n_kv_heads, int head_dim, int n_ctx, const AttnScratch& scratch,
                                float* out, cudaStream_t s);

// Short contexts, head_dim 64 (the decode graph's short regime): one block per query head with all K and V rows in
// shared memory (fp16: 512 positions take ~150 KB). Same result as launch_attention_decode within float rounding.
// io->pos + 1 must not exceed pos_cap (<= kShortAttnMaxPos; the kernel traps).
constexpr int kShortAttnMaxPos = 512;
void launch_attention_decode_short(const float* q, const __half* k_cache, const __half* v_cache, const DecodeIO* io,
                                   int n_heads, int n_kv_heads, int head_dim, int pos_cap, float* out,
                                   cudaStream_t s);

// Two-stage argmax of x[0..n) in one launch (last block reduces the per-block partials).
void launch_argmax(const float* x, int n, const ArgmaxScratch& scratch, ArgmaxResult* result, DecodeIO* io_next,
                   cudaStream_t s);
constexpr int kArgmaxMaxBlocks = 2048;  // partials capacity launch_argmax and the lm_head need at most
int argmax_partials_needed(const DevMatrix& lm_head);

// Sampled decoding's draw (sampling.cu): the token that uniform u draws from x[0..n) under sample_logits's semantics
// (cpp/engine/sampling.h), given the row's argmax `best` (as launch_argmax or the lm_head leave it; device or mapped
// memory). Writes *out (token and status) and, where drawn, io->token (io may be null). Status kSampleOnHost: the host
// draws from the row instead (more than 4,096 logits within 2^-13 of each other at the top_k / top_p cut);
// kSampleNoCandidate: every logit NaN or -inf. Up to four launches; `work` is sample_work_bytes() of device memory,
// zeroed once before the first launch (every launch leaves it so). top_k up to kSampleMaxTopK (0 or >= n: off).
constexpr int kSampleMaxTopK = 1024;
enum SampleStatus : int32_t { kSampleDrawn = 0, kSampleOnHost = 1, kSampleNoCandidate = 2 };
struct SampleArgs {
  float inv_t = 1.f;   // 1 / temperature, as sample_logits rounds it
  int top_k = 0;       // 0 or >= n: off
  double top_p = 1.0;  // 1: off
  double u = 0.0;      // [0, 1)
};
struct SampleResult {
  int32_t token;
  int32_t status;
};
size_t sample_work_bytes();
void launch_sample(const float* x, int n, const ArgmaxResult* best, const SampleArgs& a, void* work,
                   SampleResult* out, DecodeIO* io, cudaStream_t s);
// Up to kSampleMaxRows rows drawn in one launch set (a grid row each): row y of x (stride floats apart) with args[y]
// (inv_t 0: skipped), its argmax best[y], into out[y], with the y-th of `rows` work areas (each sample_work_bytes());
// io only for a single row. The same draws as launch_sample on each row (the draws do not depend on the order of
// the kernels' atomics: a seeded draw is the same every run).
constexpr int kSampleMaxRows = 16;
void launch_sample_rows(const float* x, int n, int64_t stride, int rows, const ArgmaxResult* best,
                        const SampleArgs* args, void* work, SampleResult* out, DecodeIO* io, cudaStream_t s);

// ------------------------------------------------------------------ prefill launches (prefill.cu)
// A prompt chunk runs layer by layer: the projections on tensor cores straight from the quantized weights
// (prompt_gemm.cu; prompt_mma.cu up to 64 tokens), with the kernels below between them. Their inputs are operand rows
// (store_operand: 2 * width halves per token, each value as fp16 hi + lo).
// x[t] = row tokens[t] of emb, t < n.
void launch_embed_rows(const DevMatrix& emb, const int32_t* tokens, int n, float* x, cudaStream_t s);
// out row t = the operand row of rmsnorm(x[t], w) (rows of d floats).
void launch_rmsnorm_to_half(const float* x, int n, int d, const float* w, float eps, __half* out, cudaStream_t s);
// qkv: n rows of (q_dim + 2 kv_dim) floats for positions pos0..pos0+n-1. Writes roped q rows to q_out and the
// roped k / plain v rows to the caches.
void launch_rope_append(const float* qkv, int n, int pos0, const float2* rope_table, int q_dim, int kv_dim,
                        int head_dim, float* q_out, __half* k_cache, __half* v_cache, cudaStream_t s);
// Causal attention of n queries (positions pos0..) over cache positions [0, pos0 + t]; out row t = the operand row
// of the q_dim outputs.
void launch_attention_prefill(const float* q, const __half* k_cache, const __half* v_cache, int n, int pos0,
                              int n_heads, int n_kv_heads, int head_dim, __half* out, cudaStream_t s);
// out row t = the operand row of silu(gate[t][i]) * up[t][i], i < d_ff; gate_up rows of 2*d_ff floats.
void launch_silu_to_half(const float* gate_up, int n, int d_ff, __half* out, cudaStream_t s);

// ------------------------------------------------------------------ prefill launches reading the start position
// from device memory (prefill.cu), so one captured prefill graph serves every start position. Same results as
// launch_rope_append / launch_attention_prefill with pos0 = *pos0.
void launch_rope_append_at(const float* qkv, int n, const int32_t* pos0, const float2* rope_table, int q_dim,
                           int kv_dim, int head_dim, float* q_out, __half* k_cache, __half* v_cache, cudaStream_t s);
// head_dim 64 runs on tensor cores (fp16 hi/lo operand pairs, fp32 accumulation), other head_dims on fp32 FMAs.
void launch_attention_prefill_at(const float* q, const __half* k_cache, const __half* v_cache, int n,
                                 const int32_t* pos0, int n_heads, int n_kv_heads, int head_dim, __half* out,
                                 cudaStream_t s);
// RoPE + KV append + causal attention of one chunk from the raw QKV projection rows (n rows of q_dim + 2 kv_dim
// floats): the cache rows pos0..pos0+n-1 get the roped k / plain v rows, out gets the attention as operand rows.
// head_dim 64 is one fused tensor-core kernel (q_scratch unused); others run launch_rope_append_at into q_scratch
// [n][q_dim] and then launch_attention_prefill_at.
void launch_rope_attention_prefill(const float* qkv, int n, const int32_t* pos0, const float2* rope_table,
                                   int n_heads, int n_kv_heads, int head_dim, __half* k_cache, __half* v_cache,
                                   float* q_scratch, __half* out, cudaStream_t s);

// ------------------------------------------------------------------ long prompts on tensor cores (prompt_gemm.cu)
// y[t] = W . x_t (or y[t] += W . x_t), t < n: one projection of a prompt chunk or batch group of any size, read
// straight from the quantized decode weights (every type of DevMatrix), the weights exact (floats as fp16 hi + lo),
// the operand rows as fp16 hi + lo on tensor cores, the block scales applied in fp32 after each block's MMAs.
struct PromptGemmArgs {
  DevMatrix W;                      // cols a multiple of 32 (as every DevMatrix)
  int n = 0;                        // tokens
  const __half* x_slots = nullptr;  // [n] operand rows of W.cols values (store_operand)
  float* y = nullptr;               // [n][W.rows]
  bool accumulate = false;          // y += W . x (the residual stream) instead of y = W . x
};
bool prompt_gemm_supported(GgmlType type);
void launch_prompt_gemm(const PromptGemmArgs& a, cudaStream_t s);

// ------------------------------------------------------------------ few-token prompts on tensor cores (prompt_mma.cu)
// For prompts of at most kPromptMmaMaxTokens tokens the backend runs each projection as one programmatic launch
// that reads the quantized decode weights directly: Y = W . X with the weights exact and X as fp16 hi + lo on tensor
// cores, fp32 accumulation; unlike prompt_gemm.cu it also takes fp32 rows to rmsnorm and fuses SiLU * up, and its
// blocks split K, which suits a few tokens.
constexpr int kPromptMmaMaxTokens = 32;
enum class PromptMmaOut : int {
  Store = 0,        // y[t][row] = (W . x_t)[row]
  AddResidual = 1,  // y[t][row] += (W . x_t)[row]
  SiluHalf = 2,     // W = [gate (d_ff rows); up (d_ff rows)]: out_slots row t = silu(gate . x_t) * (up . x_t)
};
struct PromptMmaArgs {
  DevMatrix W;               // any type prompt_mma_supported takes; cols a multiple of 32
  int n = 0;                 // tokens, 1..kPromptMmaMaxTokens
  // The input, exactly one of:
  const float* x = nullptr;  // [n][W.cols] fp32 rows, rmsnorm'ed here with norm_w (required) and eps
  const float* norm_w = nullptr;
  float eps = 0.f;
  const __half* x_slots = nullptr;  // [n] operand rows of W.cols values (store_operand)
  PromptMmaOut out_kind = PromptMmaOut::Store;
  float* y = nullptr;               // Store, AddResidual: [n][W.rows]
  __half* out_slots = nullptr;      // SiluHalf: [n] rows of d_ff values in the slot layout
  int d_ff = 0;                     // SiluHalf
};
// Causal attention of a prompt chunk of n <= kPromptMmaMaxTokens tokens at positions *pos0_dev.. (head_dim 64),
// from the raw QKV rows (plus the Q/K/V biases where given; RoPE on interleaved or NeoX pairs): appends the roped k
// and the v rows to the caches and writes the attention output in the slot layout (q_dim values per token). Keys are
// taken in tiles of 64, one after the other, so the backend uses it while pos0 + n <= kPromptFewAttnMaxKeys and the
// tensor-core prefill attention beyond.
constexpr int kPromptFewAttnMaxKeys = 256;
struct FewAttnArgs {
  const float* qkv = nullptr;  // [n][q_dim + 2 kv_dim]
  const float* bias = nullptr;  // [q_dim + 2 kv_dim] (bq | bk | bv) added to the raw rows, or null (Qwen 2 has them)
  bool neox = false;            // RoPE turns (i, i + 32) of a head instead of (2i, 2i + 1)
  int n = 0;
  const int32_t* pos0_dev = nullptr;  // written before the graph that reads it starts
  const float2* rope_table = nullptr;
  __half* k_cache = nullptr;  // this layer
  __half* v_cache = nullptr;
  int n_heads = 0, n_kv_heads = 0, head_dim = 0;
  __half* out_slots = nullptr;  // [n] rows of q_dim values
};
void launch_attention_prompt_few(const FewAttnArgs& a, cudaStream_t s);

// Whether launch_prompt_mma takes this weight type and width (d_ff: the SiluHalf output width, else 0) on the current
// device (its blocks need up to ~211 KiB of shared memory at d_ff 1536).
bool prompt_mma_supported(GgmlType type, int cols, int d_ff_or_zero);
void launch_prompt_mma(const PromptMmaArgs& a, cudaStream_t s);

}  // namespace metalattn::cuda
