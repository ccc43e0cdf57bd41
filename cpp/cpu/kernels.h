// CPU matvec/matmul kernels with runtime ISA dispatch (AVX-512 VNNI, AVX2, scalar).
// The scalar ISA uses float activations and is exactly metalattn::ref (reference.h); the SIMD ISAs
// quantize activations to int16 once per input vector (block_q16_act) and use exact integer dot products
// (16-bit multiplies) for quantized weights, float FMA for F32/F16/BF16 weights. Int16, not int8: SmolLM2's
// activations have outlier channels that int8 blocks of 32 resolve too coarsely (top-1 agreement with the
// float64 reference drops to ~96%; int16 keeps it at 100%).
#pragma once
#include <cstdint>

#include "metalattn/backend.h"
#include "metalattn/model.h"

namespace metalattn::cpu {

enum class Isa { Scalar = 0, Avx2 = 1, Avx512 = 2 };

Isa best_isa();              // the best this CPU supports (and this build compiled)
Isa selected_isa();          // best_isa(), unless METALATTN_CPU_ISA=scalar|avx2|avx512 forces one
                             // (throws EngineError if the forced one is not supported here)
bool isa_supported(Isa isa);
const char* isa_name(Isa isa);

// Activations quantized to int16 in blocks of 32: x[j] ~= d * qs[j] with d = amax / 32767 (round to nearest,
// |qs| <= 32767); s = d * sum(qs) (for Q4_1's min term).
struct block_q16_act {
  float d;
  float s;
  int16_t qs[32];
};

// n must be a multiple of 32. out holds n/32 blocks.
void quantize_acts(Isa isa, const float* x, int64_t n, block_q16_act* out);

// True when matvec/matmul on this ISA and weight type read xq (so the caller must fill it).
bool uses_quantized_acts(Isa isa, GgmlType weight_type);

// y[r] = w[r,:] . x for r in [r0, r1). xq = quantize_acts(x) when uses_quantized_acts(), else may be null.
void matvec(Isa isa, const WeightView& w, const float* x, const block_q16_act* xq, float* y, int64_t r0, int64_t r1);

// Y[t*ldy + r] = w[r,:] . X[t*w.cols + :] for t < n_tok, r in [r0, r1). Xq: n_tok rows of w.cols/32 blocks.
// Weight blocks are decoded once per tile of tokens, so prefill reads each weight once per layer.
void matmul(Isa isa, const WeightView& w, const float* X, const block_q16_act* Xq, int n_tok, float* Y, int64_t ldy,
            int64_t r0, int64_t r1);

// Lane rows: Q4_0 matrices repacked once for the AVX2 single-token matvec, the decode path's hottest loop. Each full
// group of 8 blocks of a row becomes its 8 fp16 scales in the group tiles' lane order followed by 4 x 32 bytes whose
// 32-bit lane L holds 4 quant bytes of block kLaneBlock[L] (the same 144 bytes); a row's partial last group stays in
// GGUF order. So every block's integer sum lands in its own lane without the group tiles' lane folds, scale gathers
// and 128-bit inserts, and the float operations per row are exactly the group tiles' (matvec_lane_rows gives the
// bits matvec gives on the GGUF rows). The activations are packed once per input vector (pack_lane_acts).
bool lane_rows_supported(Isa isa, GgmlType type);  // AVX2 and Q4_0
// out: w.rows * w.row_stride() bytes, the repacked rows (w.cols % 32 == 0).
void pack_lane_rows(Isa isa, const WeightView& w, uint8_t* out);
size_t lane_acts_bytes(int64_t cols);
// out: lane_acts_bytes(cols) bytes, 32-byte aligned; xq: cols / 32 blocks of one token.
void pack_lane_acts(Isa isa, const block_q16_act* xq, int64_t cols, void* out);
// y[r] = w[r,:] . x for r in [r0, r1), `packed` viewing pack_lane_rows' output, acts from pack_lane_acts(quantize(x)).
void matvec_lane_rows(Isa isa, const WeightView& packed, const void* acts, float* y, int64_t r0, int64_t r1);

// Slot rows: Q4_0 / Q4_1 / Q8_0 matrices repacked once for the 8-token tiles (slot_tiles.h) that batched
// decode steps (8+ rows) and prompts run: each row as its fp16 scales, its fp16 mins (Q4_1), then its quant bytes with
// the 16-bit words of each pair of blocks interleaved (the same number of bytes as the GGUF row). The tiles give the
// bits matvec and matmul give on the GGUF rows (the group tiles' integer block sums and float operations).
// The fewest tokens for which the slot tiles beat matmul on the GGUF rows (group tiles) on this ISA; 0 without them.
// Hot 1536 x 576 Q4_1, 1 thread: AVX-512 3 tokens 33 vs 25 GMAC/s, 4: 43 vs 35 (2: 22 vs 28); AVX2 6: 33 vs 29 (4: 24
// vs 31).
int slot_min_tokens(Isa isa);
bool slot_rows_supported(Isa isa, const WeightView& w);  // AVX-512, AVX2; Q4_0, Q4_1, Q8_0; even blocks a row
// out: w.rows * w.row_stride() bytes.
void pack_slot_rows(Isa isa, const WeightView& w, uint8_t* out);
// Y[t*ldy + r] = w[r,:] . X_t for t < n_tok, r in [r0, r1), `packed` viewing pack_slot_rows' output (type, rows and
// cols of w), Xq: n_tok rows of w.cols/32 blocks.
void matmul_slot_rows(Isa isa, const WeightView& packed, const block_q16_act* Xq, int n_tok, float* Y, int64_t ldy,
                      int64_t r0, int64_t r1);

// The backend's other vector loops (vec_ops.h), compiled per ISA like the kernels above.
// gate[i] = act(gate[i]) * up[i]: SiLU, or with gelu the tanh form of GELU.
void glu(Isa isa, bool gelu, float* gate, const float* up, int64_t n);
// ref::argmax, vectorised (every logit NaN throws NonFiniteLogits, as ref does).
ArgmaxResult argmax_logits(Isa isa, const float* x, int n);
// Sampling weights: w[i] = exp((x[i] - m) * inv_t) (0 for NaN and -inf), their sum in double (engine/sampling.cpp).
double exp_weights(Isa isa, const float* x, int64_t n, float m, float inv_t, float* w);
// Attention of the query heads that share one KV head over the backend's cache layout, one piece of the context at a
// time (vec_ops.h, attend_piece): `one` for a single query token, `tile` for kQueryTile consecutive prompt tokens.
// Each piece leaves per (token, head) an unnormalized output and its (max, sum of exp); attention_fold merges the
// pieces in order and attention_finish divides. Pieces are the same on every path (kAttentionPiece positions from
// position 0), so a prompt, token-by-token decode, a batch and any thread count give the same values.
constexpr int kQueryTile = 4;
constexpr int kAttentionPiece = 512;
// k_t and v: one KV head's fp16 caches (IEEE half bits; K transposed in blocks of 16 positions, V row-major).
using AttendFn = void (*)(const float* q, int q_stride, const uint16_t* k_t, int k_cap, const uint16_t* v,
                          int v_stride, int n_pos0, int window, int from, int to, int head_dim, float scale,
                          float* scores, int scores_stride, float* out, int out_stride, float* ml);
struct AttendFns {
  AttendFn one = nullptr;
  AttendFn tile = nullptr;
};
// group: query heads per KV head, 1 to 8 (EngineError otherwise).
AttendFns attend_fns(Isa isa, int group);
// The running (o, ml) of a (token, head) before its first piece: o = 0, (max, sum) = (-inf, 0).
void attention_begin(float* o, float* ml, int head_dim);
// Merges one piece (o_i: head_dim unnormalized outputs; ml_i: its max and sum of exp) into the running (o, ml):
// o = o e^(m - M) + o_i e^(m_i - M), l likewise, M = max(m, m_i). Compiled once (not per ISA), so every path rounds
// alike.
void attention_fold(float* o, float* ml, const float* o_i, const float* ml_i, int head_dim);
// out = o / l of a folded (o, ml); a token that saw no position (l = 0) cannot happen (it sees its own).
void attention_finish(const float* o, const float* ml, int head_dim, float* out);

}  // namespace metalattn::cpu
