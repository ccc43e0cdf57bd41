// The CUDA kernels of the general decode/prefill path: every architecture ModelSpec describes (Qwen 2 biases,
// Qwen 3 / Gemma 3 QK-norm, Gemma 3 post-norms, GELU, embedding scale, sliding windows with per-layer RoPE, NeoX
// RoPE, Llama 3 RoPE factors, head_dim up to kArchMaxHeadDim and any attention scale). The projections reuse the
// matvec launchers of kernels.cuh (and the tensor-core projections of prompt_gemm.cu), so every weight type they read
// works here; these kernels do what lies between the projections.
//
// Decode, per layer (cuda_backend.cu, enqueue_decode_general):
//   norm+QKV matvec (plain rows) -> arch_attention with the QKV finish fused in (bias, QK-norm, RoPE, K/V append)
//   -> O matvec + residual            (post-norms: O matvec, then add_normed)
//   -> norm+gate/up matvec + SiLU*up  (GELU: plain gate/up rows, then glu)
//   -> down matvec + residual         (post-norms: down matvec, then add_normed)
// plus one embedding kernel before the first layer and the final norm + lm_head + argmax after the last: 5 launches
// per layer (SiLU, no post-norms) to 8 (GELU and post-norms). Prompts run the same kernels around the tensor-core
// projections, with qkv_finish as its own launch over the chunk's tokens.
// Every kernel here launches programmatically while programmatic_launch() is on, triggers its dependents at once and
// calls grid_dependency_wait() in every block before it reads or writes anything a predecessor touches. Before that
// wait they load only weights, the position *pos0 (DecodeIO::pos or the prefill chunk's start, both written before the
// graph or launch sequence starts) and cache rows before *pos0 (written by earlier steps or chunks).
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "kernels.cuh"
#include "metalattn/model.h"

namespace metalattn::cuda {

constexpr int kArchMaxHeadDim = 256;  // head_dim: a multiple of 32, at most this

// The RoPE table of one (base, scale) pair and the optional per-pair factors (Llama 3 rope_freqs), [n_ctx][head_dim/2]
// (cos, sin) of pos * scale * base^(-2i/head_dim) / factors[i], the angle in double exactly as the CPU backend
// computes it.
std::vector<float2> rope_table_host(int n_ctx, int head_dim, float base, float scale, const float* factors);

// x[t][0..emb.cols) = row tokens[t] of emb times scale, t < n; with tokens null, n = 1 and the row is io->token.
void launch_embed_scaled(const DevMatrix& emb, const DecodeIO* io, const int32_t* tokens, int n, float scale, float* x,
                         cudaStream_t s);

// Rows of a batched decode step (Backend::forward_batch): row t is one token of KV slot slot[t] at position pos[t]
// (device arrays of n values, written before the graph or launch sequence starts). A layer's cache of slot s starts
// s * slot_stride floats past the layer's slot-0 cache (k_cache / v_cache below).
struct BatchRows {
  const int32_t* pos = nullptr;
  const int32_t* slot = nullptr;
  int64_t slot_stride = 0;
};

// From the raw projections of n tokens (rows of q_dim + 2 kv_dim floats: q heads, k heads, v heads) at positions
// *pos0 + t (or, with rows.pos, at rows.pos[t] in slot rows.slot[t]): adds the biases, RMS-normalizes each q and k head with q_norm / k_norm (eps), turns q and k by the RoPE
// table in the given style, writes q to q_out[t] and k, v to row *pos0 + t of the layer's caches.
struct QkvFinishArgs {
  const float* qkv = nullptr;         // [n][q_dim + 2 kv_dim]
  int n = 1;
  const int32_t* pos0 = nullptr;      // device memory
  const float* bias = nullptr;        // [q_dim + 2 kv_dim] (bq | bk | bv) or null
  const float* q_norm = nullptr;      // [head_dim] each, or both null (no QK-norm)
  const float* k_norm = nullptr;
  float eps = 0.f;
  const float2* rope_table = nullptr; // [n_ctx][head_dim/2]
  RopeStyle style = RopeStyle::Interleaved;
  int n_heads = 0, n_kv_heads = 0, head_dim = 0;
  float* q_out = nullptr;             // [n][q_dim]
  __half* k_cache = nullptr;          // this layer: [n_ctx][kv_dim] fp16 (kernels.cuh, kv_store)
  __half* v_cache = nullptr;
  BatchRows rows;                     // batch rows (pos0 unused), or rows.pos null
};
void launch_qkv_finish(const QkvFinishArgs& a, cudaStream_t s);

// Attention of n queries at positions *pos0 + t (t < n) over the layer's cache: query t sees positions
// [max(0, p - window + 1), p] (all of [0, p] with window 0), scores q.k * scale, any grouping of query heads over KV
// heads. One block per (query head, tile of queries); a decode step (n == 1) with max_splits > 1 also splits the
// visible positions over up to max_splits blocks per head (at least kArchAttnMinChunk positions each, chosen from the
// position at run time), and the last block of a head combines their partials.
// 32 positions a block (4 a warp): Gemma 3 270M-shaped decode (H100, session 13) 539.8 -> 508.7 us/token at depth
// 32, 544.4 -> 526.6 at 1,000, 550.2 -> 542.6 at 3,000 against 64 (16: 516.0, 543.0, 550.9).
constexpr int kArchAttnMinChunk = 32;
constexpr int kArchAttnMaxSplits = 64;
// Split capacity for a context of n_ctx positions.
inline int arch_attn_max_splits(int n_ctx) {
  const int s = (n_ctx + kArchAttnMinChunk - 1) / kArchAttnMinChunk;
  return s < 1 ? 1 : s > kArchAttnMaxSplits ? kArchAttnMaxSplits : s;
}
struct ArchAttnArgs {
  const float* q = nullptr;        // [n][q_dim], roped
  const __half* k_cache = nullptr;  // this layer: [n_ctx][kv_dim] fp16
  const __half* v_cache = nullptr;
  const int32_t* pos0 = nullptr;   // device memory
  int n = 1;
  // Batch rows: query t is row t at its own position over its own slot's cache (one query per block, no split;
  // pos0 unused), or rows.pos null.
  BatchRows rows;
  int n_heads = 0, n_kv_heads = 0, head_dim = 0;
  int window = 0;
  float scale = 0.f;
  // Decode split (n == 1 only; 1 = no split):
  int max_splits = 1;
  float* part_o = nullptr;          // [n_heads][max_splits][head_dim]
  float* part_ml = nullptr;         // [n_heads][max_splits][2]
  unsigned int* counters = nullptr; // [n_heads], zero between launches (the combining block re-arms it)
  // Output, one of: fp32 rows [n][q_dim], or the operand rows the tensor-core projections read (store_operand).
  float* out = nullptr;
  __half* out_half = nullptr;
  // Decode (n == 1) or batch rows with fused_finish: q and the position's k and v come raw, as the QKV projection
  // rows finish.qkv, and are finished here exactly as launch_qkv_finish does (finish's bias, QK-norm weights, eps,
  // RoPE table and style; finish.pos0 and finish.rows must equal pos0 and rows); the block of each KV head's first
  // query head that covers the position appends k and v to the caches. q (above) is then unused. One launch instead
  // of two per layer.
  bool fused_finish = false;
  QkvFinishArgs finish;
};
void launch_arch_attention(const ArchAttnArgs& a, cudaStream_t s);
// Decode with a short context (arch.cu): one query (n == 1, no batch rows) with its fused finish and fp32 output, every
// visible K/V row in shared memory, one block per query head, no split. arch_short_attention_cap: the most visible
// positions it serves for head_dim on this device (a multiple of 32 up to min(n_ctx, kShortAttnMaxPos)), 0 where it
// does not serve the head_dim (64, 128, 256) or fewer than 64 positions fit.
int arch_short_attention_cap(int head_dim, int n_ctx);
// The most positions whose blocks leave kShortAttnRoomBeside of an SM's shared memory to other kernels' blocks; 0
// where that is no fewer than arch_short_attention_cap. The backend runs the short kernel at this cap up to it, at
// the full cap past it. Gemma 3 (head_dim 256) on an H200: 160 positions (185 KB a block) against 192 (218 KB),
// 333 -> 321 us a token at depth 32. The block log puts the gain after the last layer, in the final norm + lm_head
// (65.0 -> 49.7 us a step), not in the attention (its share of the chain unchanged). Why is not known: more L1 for the
// lm_head (carveout 0) made it slower, not faster (NOTES, "CUDA, sessions 35 and 36").
constexpr size_t kShortAttnRoomBeside = 32 * 1024;
int arch_short_attention_cap_beside(int head_dim, int n_ctx);
void launch_arch_attention_short(const ArchAttnArgs& a, int pos_cap, cudaStream_t s);

// out[t] = argmax of logits row t (n rows of vocab floats): NaN never wins, ties go to the lower index, a row of
// nothing but NaN gives token kNoIndex.
void launch_rows_argmax(const float* logits, int n, int vocab, ArgmaxResult* out, cudaStream_t s);

// x[t] += rmsnorm(y[t]) * w for n rows of d floats (post-norm + residual); w null: x[t] += y[t].
void launch_add_normed(const float* y, const float* w, float eps, int n, int d, float* x, cudaStream_t s);

// The gated FFN's activation: gate_up rows of 2 d_ff floats [gate | up] -> act(gate) * up, act SiLU or the tanh
// form of GELU; out rows of d_ff floats, or (out null) operand rows (store_operand) in out_half.
void launch_glu(const float* gate_up, int n, int d_ff, Activation act, float* out, __half* out_half,
                cudaStream_t s);

}  // namespace metalattn::cuda
