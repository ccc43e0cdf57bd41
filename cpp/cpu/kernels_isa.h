// Internal: the per-ISA entry points behind kernels.cpp's dispatch. Each x86 ISA lives in its own
// translation unit compiled with its own -m flags, so nothing here may be called unless best_isa() allows it.
#pragma once
#include <cstdint>

#include "kernels.h"

namespace metalattn::cpu {

namespace scalar {
void quantize_acts(const float* x, int64_t n, block_q16_act* out);
void glu(bool gelu, float* g, const float* u, int64_t n);
ArgmaxResult argmax(const float* x, int n);
double exp_weights(const float* x, int64_t n, float m, float inv_t, float* w);
AttendFns attend_fns(int group);
}

#ifdef METALATTN_X86
// matvec is matmul with n_tok = 1: one code path, so the two agree bit for bit.
namespace avx2 {
void quantize_acts(const float* x, int64_t n, block_q16_act* out);
void glu(bool gelu, float* g, const float* u, int64_t n);
ArgmaxResult argmax(const float* x, int n);
double exp_weights(const float* x, int64_t n, float m, float inv_t, float* w);
AttendFns attend_fns(int group);
void matmul(const WeightView& w, const float* X, const block_q16_act* Xq, int n_tok, float* Y, int64_t ldy,
            int64_t r0, int64_t r1);
void pack_lane_rows(const WeightView& w, uint8_t* out);
size_t lane_acts_bytes(int64_t cols);
void pack_lane_acts(const block_q16_act* xq, int64_t cols, void* out);
void matvec_lane_rows(const WeightView& packed, const void* acts, float* y, int64_t r0, int64_t r1);
void pack_slot_rows(const WeightView& w, uint8_t* out);
void matmul_slot_rows(const WeightView& packed, const block_q16_act* Xq, int n_tok, float* Y, int64_t ldy, int64_t r0,
                      int64_t r1);
}  // namespace avx2
namespace avx512 {
void quantize_acts(const float* x, int64_t n, block_q16_act* out);
void glu(bool gelu, float* g, const float* u, int64_t n);
ArgmaxResult argmax(const float* x, int n);
double exp_weights(const float* x, int64_t n, float m, float inv_t, float* w);
AttendFns attend_fns(int group);
void matmul(const WeightView& w, const float* X, const block_q16_act* Xq, int n_tok, float* Y, int64_t ldy,
            int64_t r0, int64_t r1);
void pack_slot_rows(const WeightView& w, uint8_t* out);
void matmul_slot_rows(const WeightView& packed, const block_q16_act* Xq, int n_tok, float* Y, int64_t ldy, int64_t r0,
                      int64_t r1);
}  // namespace avx512
#endif

}  // namespace metalattn::cpu
