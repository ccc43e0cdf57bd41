// The CPU backend: the Llama forward pass over the kernels of kernels.h, parallel on a spinning thread pool.
// Decode runs five parallel regions per layer (QKV, attention, O+residual, gate/up, down+residual); the norms,
// RoPE and activation quantization between them touch a few KB and stay on the calling thread.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "cpu/kernels.h"
#include "cpu/reference.h"
#include "cpu/thread_pool.h"
#include "metalattn/backend.h"

namespace metalattn {
namespace {

using cpu::AttendFns;
using cpu::block_q16_act;
using cpu::Isa;
using cpu::kQueryTile;

// Rows per work item of a parallel projection: two items per thread, so a thread slowed by another process
// does not hold the others up, but large enough that re-packing the activations, which every kernel call does,
// stays small next to the weights the item streams (decode), and that the tiled matmul of a prompt keeps its
// packed activations for many rows (prefill); each item's first rows are read before its prefetch runs ahead,
// so fewer items also stream better (decode: 4 items a thread measured 3-5% slower than 2 on the 2-core Xeon).
// Multiples of 16 keep items on whole cache lines of output.
int64_t row_chunk(int64_t total_rows, int n_threads, int n_tok) {
  const int64_t items = 2 * n_threads;
  const int64_t chunk = (total_rows + items - 1) / items;
  return std::max<int64_t>((chunk + 15) / 16 * 16, n_tok == 1 ? 64 : 16);
}

// Prompt tokens processed per layer-major pass; longer prompts run in chunks (attention stays causal).
constexpr int kPromptChunk = 512;

// One projection in a fused parallel region: y = w . x (for each of n_tok tokens).
struct Projection {
  const WeightView* w;
  const float* x;           // n_tok x w->cols
  const block_q16_act* xq;   // n_tok x w->cols/32, or null
  float* y;                 // n_tok x ldy
  int64_t ldy;
  const WeightView* lane = nullptr;  // w as lane rows (kernels.h), used for one token when lane_acts is given
  const void* lane_acts = nullptr;
};

// RoPE with angles from a table: the same values ref::rope computes, without a pow/cos/sin per element. The
// interleaved (llama GGUF) layout turns pairs (2i, 2i+1), the NeoX layout pairs (i, i + head_dim/2).
void rope_from_table(float* v, int n_heads, int head_dim, RopeStyle style, const float* cos_row, const float* sin_row) {
  const int half = head_dim / 2;
  const int step = style == RopeStyle::Neox ? 1 : 2, other = style == RopeStyle::Neox ? half : 1;
  for (int h = 0; h < n_heads; ++h) {
    float* p = v + h * head_dim;
    for (int i = 0; i < half; ++i) {
      float* a = p + i * step;
      const float x = a[0], y = a[other];
      a[0] = x * cos_row[i] - y * sin_row[i];
      a[other] = x * sin_row[i] + y * cos_row[i];
    }
  }
}

class CpuBackend final : public Backend {
 public:
  CpuBackend(const ModelSpec& spec, const ModelWeights& w, int n_threads)
      : s_(spec), w_(w), isa_(cpu::selected_isa()), pool_(n_threads), attn_scale_(spec.attention_scale()) {
    validate_model(s_, w_);
    // calloc: pages of slots and positions never written are never touched (a server's idle slots cost no RSS).
    k_cap_ = (s_.n_ctx + 15) / 16 * 16;
    cache_elems_ = static_cast<size_t>(s_.n_seq) * s_.n_layers * k_cap_ * s_.kv_dim();
    k_cache_.reset(static_cast<uint16_t*>(std::calloc(cache_elems_, sizeof(uint16_t))));
    v_cache_.reset(static_cast<uint16_t*>(std::calloc(cache_elems_, sizeof(uint16_t))));
    if (!k_cache_ || !v_cache_)
      throw EngineError("cpu backend: cannot allocate the KV cache (" +
                        std::to_string(2 * cache_elems_ * sizeof(uint16_t) >> 20) + " MiB for " +
                        std::to_string(s_.n_seq) + " x " + std::to_string(s_.n_ctx) + " positions)");
    ensure_scratch(1);
    make_lane_rows();
    make_slot_rows();
    if (s_.head_dim % 16 != 0) throw EngineError("cpu backend: head_dim must be a multiple of 16");
    attend_ = cpu::attend_fns(isa_, s_.n_heads / s_.n_kv_heads);
    {
      // Per thread: one tile's scores (rows of k_cap), and its (token, head) rows' running outputs. The pieces'
      // outputs: a decoding row's, every KV head's and piece's, or per thread one tile's.
      const size_t tile_rows = static_cast<size_t>(pool_.size()) * kQueryTile * (s_.n_heads / s_.n_kv_heads);
      const size_t piece_rows =
          std::max((static_cast<size_t>(k_cap_) / cpu::kAttentionPiece + 1) * s_.n_heads, tile_rows);
      scores_.resize(tile_rows * k_cap_);
      run_out_.resize(tile_rows * s_.head_dim);
      run_ml_.resize(tile_rows * 2);
      piece_out_.resize(piece_rows * s_.head_dim);
      piece_ml_.resize(piece_rows * 2);
    }
    // One cos/sin table per distinct (base, scale) among the layers (Gemma 3 has two), shared by the layers using it.
    for (int l = 0; l < s_.n_layers; ++l) {
      const LayerSpec ls = s_.layer(l);
      int found = -1;
      for (size_t i = 0; i < rope_tables_.size(); ++i)
        if (rope_tables_[i].base == ls.rope_base && rope_tables_[i].scale == ls.rope_scale) found = static_cast<int>(i);
      if (found < 0) {
        found = static_cast<int>(rope_tables_.size());
        rope_tables_.push_back(make_rope_table(ls.rope_base, ls.rope_scale, w_.rope_freqs));
      }
      layer_rope_.push_back(found);
    }
  }

  // cos/sin of pos * scale * base^(-2i/head_dim) / factor[i] for every position and pair, the angle in double as
  // ref::rope computes it.
  struct RopeTable {
    float base, scale;
    std::vector<float> cos, sin;  // [n_ctx][head_dim/2]
  };
  RopeTable make_rope_table(float base, float scale, const float* factors) const {
    const int half = s_.head_dim / 2;
    RopeTable t{base, scale, {}, {}};
    t.cos.resize(static_cast<size_t>(s_.n_ctx) * half);
    t.sin.resize(t.cos.size());
    for (int pos = 0; pos < s_.n_ctx; ++pos)
      for (int i = 0; i < half; ++i) {
        double theta = static_cast<double>(pos) * scale * std::pow(static_cast<double>(base), -2.0 * i / s_.head_dim);
        if (factors != nullptr) theta /= factors[i];
        t.cos[static_cast<size_t>(pos) * half + i] = static_cast<float>(std::cos(theta));
        t.sin[static_cast<size_t>(pos) * half + i] = static_cast<float>(std::sin(theta));
      }
    return t;
  }

  // Single-token decode reads the layer matrices the AVX2 lane-row kernel takes (Q4_0) from a repacked copy
  // (kernels.h): the same results, ~1.2-1.4x the matvec speed. Prompts and batches keep reading the GGUF rows.
  void make_lane_rows() {
    size_t total = 0, acts = 0;
    for (const LayerWeights& L : w_.layers)
      for (const WeightView* w : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down})
        if (cpu::lane_rows_supported(isa_, w->type) && w->cols % kQuantBlock == 0) {
          total += (w->rows * w->row_stride() + 63) / 64 * 64;
          acts = std::max(acts, cpu::lane_acts_bytes(w->cols));
        }
    lane_.assign(w_.layers.size(), LaneLayer{});
    if (total == 0) return;
    lane_bytes_ = total;
    lane_store_.reset(static_cast<uint8_t*>(std::aligned_alloc(64, total)));
    lane_acts_.reset(static_cast<uint8_t*>(std::aligned_alloc(64, (acts + 63) / 64 * 64)));
    if (!lane_store_ || !lane_acts_) throw EngineError("cpu backend: cannot allocate the repacked Q4_0 rows");
    uint8_t* at = lane_store_.get();
    for (size_t l = 0; l < w_.layers.size(); ++l) {
      const LayerWeights& L = w_.layers[l];
      const WeightView* src[7] = {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down};
      WeightView* dst[7] = {&lane_[l].wq, &lane_[l].wk, &lane_[l].wv, &lane_[l].wo, &lane_[l].gate, &lane_[l].up,
                            &lane_[l].down};
      for (int i = 0; i < 7; ++i) {
        if (!cpu::lane_rows_supported(isa_, src[i]->type) || src[i]->cols % kQuantBlock != 0) continue;
        cpu::pack_lane_rows(isa_, *src[i], at);
        *dst[i] = WeightView{src[i]->type, at, src[i]->rows, src[i]->cols};
        at += (src[i]->rows * src[i]->row_stride() + 63) / 64 * 64;
      }
    }
  }

  // Batched decode steps (8+ rows) and prompts read the Q4_0 / Q4_1 / Q8_0 matrices (the layers and the lm_head) from
  // a repacked copy, slot rows (kernels.h): the same results as the GGUF rows, whose decode took ~40% of the 8-token
  // matmuls. Single tokens keep reading the GGUF rows (the group tiles stream them faster). On AVX2 prompts gain
  // nothing measurable from it (pp512 unchanged), so a model of one sequence slot, which never batches, keeps no copy.
  void make_slot_rows() {
    if (isa_ == Isa::Avx2 && s_.n_seq < 2) return;
    std::vector<const WeightView*> src;
    for (const LayerWeights& L : w_.layers)
      for (const WeightView* w : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down}) src.push_back(w);
    src.push_back(&w_.output);
    size_t total = 0;
    for (const WeightView* w : src)
      if (cpu::slot_rows_supported(isa_, *w) && slot_.count(w->data) == 0) {
        slot_[w->data] = WeightView{};  // placeholder: a matrix shared by two views is packed once
        total += (w->rows * w->row_stride() + 63) / 64 * 64;
      }
    if (total == 0) return;
    slot_bytes_ = total;
    slot_store_.reset(static_cast<uint8_t*>(std::aligned_alloc(64, total)));
    if (!slot_store_) throw EngineError("cpu backend: cannot allocate the repacked slot rows");
    uint8_t* at = slot_store_.get();
    for (const WeightView* w : src) {
      auto it = slot_.find(w->data);
      if (it == slot_.end() || it->second.data != nullptr) continue;
      cpu::pack_slot_rows(isa_, *w, at);
      it->second = WeightView{w->type, at, w->rows, w->cols};
      at += (w->rows * w->row_stride() + 63) / 64 * 64;
    }
  }
  // The slot-row view of w for an n-row pass (null for fewer rows than slot_min_tokens or where w has none).
  const WeightView* slot_of(const WeightView& w, int n) const {
    if (n < cpu::slot_min_tokens(isa_) || slot_.empty()) return nullptr;
    const auto it = slot_.find(w.data);
    return it == slot_.end() ? nullptr : &it->second;
  }

  // The lane-row view of w for a one-token pass (null when w has none), and the activations it needs packed from xq
  // (done once here, on the calling thread, for every projection of the region).
  const WeightView* lane_of(const WeightView& lane, int n) const {
    return n == 1 && lane.data != nullptr ? &lane : nullptr;
  }
  const void* pack_lane_acts(const WeightView* lane, const block_q16_act* xq) {
    if (lane == nullptr || xq == nullptr) return nullptr;
    cpu::pack_lane_acts(isa_, xq, lane->cols, lane_acts_.get());
    return lane_acts_.get();
  }

  const char* name() const override { return "cpu"; }
  const char* isa_name() const { return cpu::isa_name(isa_); }

  ArgmaxResult forward_token_greedy(int32_t token, int pos) override {
    return forward_prompt(&token, 1, pos, logits_one(), nullptr, 0);
  }

  void forward_token(int32_t token, int pos, float* logits) override {
    forward_prompt(&token, 1, pos, logits, nullptr, 0);
  }

  void forward_token_debug(int32_t token, int pos, float* hidden, float* logits) override {
    hidden_out_ = hidden;
    try {
      forward_prompt(&token, 1, pos, logits, nullptr, 0);
    } catch (...) {
      hidden_out_ = nullptr;
      throw;
    }
    hidden_out_ = nullptr;
  }

  ArgmaxResult forward_prompt(const int32_t* tokens, int n, int pos, float* last_logits, float* all_logits,
                              int slot) override {
    if (n <= 0) throw EngineError("forward_prompt: empty prompt");
    if (pos < 0 || pos + n > s_.n_ctx) throw EngineError("forward_prompt: positions past the context");
    if (slot < 0 || slot >= s_.n_seq) throw EngineError("forward_prompt: sequence slot out of range");
    for (int i = 0; i < n; ++i)
      if (tokens[i] < 0 || tokens[i] >= s_.vocab) throw EngineError("forward_prompt: token id out of range");
    for (int start = 0; start < n; start += kPromptChunk) {
      const int m = std::min(kPromptChunk, n - start);
      const bool last_chunk = start + m == n;
      float* chunk_last = last_chunk ? (last_logits ? last_logits : logits_one()) : nullptr;
      row_slot_.assign(m, slot);
      row_pos_.resize(m);
      for (int t = 0; t < m; ++t) row_pos_[t] = pos + start + t;
      run_chunk(tokens + start, m, all_logits ? all_logits + static_cast<int64_t>(start) * s_.vocab : nullptr,
                chunk_last);
    }
    if (all_logits) return cpu::argmax_logits(isa_, all_logits + static_cast<int64_t>(n - 1) * s_.vocab, s_.vocab);
    float* last = last_logits ? last_logits : logits_one();
    return cpu::argmax_logits(isa_, last, s_.vocab);
  }

  // The batch is one layer-major pass like a prompt chunk: its projections run as n-row matmuls (each weight
  // decoded once for all rows), attention per row over the row's own slot.
  void forward_batch(const int32_t* tokens, const int32_t* slots, const int32_t* pos, int n, float* logits,
                     ArgmaxResult* out) override {
    if (n <= 0 || n > s_.n_seq) throw EngineError("forward_batch: 1 to n_seq rows");
    for (int i = 0; i < n; ++i) {
      if (tokens[i] < 0 || tokens[i] >= s_.vocab) throw EngineError("forward_batch: token id out of range");
      if (slots[i] < 0 || slots[i] >= s_.n_seq) throw EngineError("forward_batch: sequence slot out of range");
      if (pos[i] < 0 || pos[i] >= s_.n_ctx) throw EngineError("forward_batch: position past the context");
    }
    row_slot_.assign(slots, slots + n);
    row_pos_.assign(pos, pos + n);
    if (logits == nullptr) {
      batch_logits_.resize(static_cast<size_t>(n) * s_.vocab);
      logits = batch_logits_.data();
    }
    run_chunk(tokens, n, logits, nullptr);
    // Rows over the threads; a row whose logits are all NaN is redone here, where its error may be thrown.
    std::vector<char> failed(n, 0);
    for_tokens(n, [&](int b, int e) {
      for (int i = b; i < e; ++i) {
        const float* row = logits + static_cast<int64_t>(i) * s_.vocab;
        try {
          out[i] = cpu::argmax_logits(isa_, row, s_.vocab);
        } catch (...) {
          failed[i] = 1;
        }
      }
    });
    for (int i = 0; i < n; ++i)
      if (failed[i]) out[i] = cpu::argmax_logits(isa_, logits + static_cast<int64_t>(i) * s_.vocab, s_.vocab);
  }

  MemoryInfo memory_info() const override {
    MemoryInfo m;
    m.weights = lane_bytes_ + slot_bytes_;  // the repacked rows; the GGUF weights themselves are read from the mmap
    m.kv_cache = 2 * cache_elems_ * sizeof(uint16_t);  // K and V, fp16
    m.scratch = (x_.size() + xn_.size() + q_.size() + k_.size() + v_.size() + att_.size() + tmp_.size() + gate_.size() +
                 up_.size() + logits_.size() + scores_.size() + batch_logits_.size() + piece_out_.size() +
                 piece_ml_.size() + run_out_.size() + run_ml_.size()) * sizeof(float) +
                xq_.size() * sizeof(block_q16_act);
    for (const RopeTable& t : rope_tables_) m.scratch += (t.cos.size() + t.sin.size()) * sizeof(float);
    return m;
  }

 private:
  float* logits_one() {
    if (logits_.empty()) logits_.resize(s_.vocab);
    return logits_.data();
  }

  void ensure_scratch(int n) {
    if (scratch_tokens_ >= n) return;
    scratch_tokens_ = n;
    const size_t d = s_.d_model, ff = s_.d_ff;
    x_.resize(n * d);
    xn_.resize(n * d);
    q_.resize(n * static_cast<size_t>(s_.q_dim()));
    k_.resize(n * static_cast<size_t>(s_.kv_dim()));
    v_.resize(n * static_cast<size_t>(s_.kv_dim()));
    att_.resize(n * static_cast<size_t>(s_.q_dim()));
    tmp_.resize(n * d);
    gate_.resize(n * ff);
    up_.resize(n * ff);
    xq_.resize(n * (std::max<size_t>({d, ff, static_cast<size_t>(s_.q_dim())}) / kQuantBlock));
  }

  // Runs fn(first_token, end_token) over the n tokens: on the calling thread for one token (decode: a few KB
  // of work, not worth a wake-up), split over the pool for a prompt.
  template <class F>
  void for_tokens(int n, F&& fn) {
    if (n == 1) return fn(0, 1);
    pool_.parallel([&](int ti, int nt) {
      int64_t b, e;
      cpu::split_range(n, ti, nt, 1, &b, &e);
      if (b < e) fn(static_cast<int>(b), static_cast<int>(e));
    });
  }

  bool needs_quantized(std::initializer_list<const WeightView*> ws) const {
    bool need = false;
    for (const WeightView* w : ws) need |= cpu::uses_quantized_acts(isa_, w->type);
    return need;
  }

  // out = rmsnorm(x) for n rows, then their int16 activations (xq_) when any of ws needs them: one parallel region.
  const block_q16_act* norm_quantize(const float* x, const float* weight, float* out, int n,
                                     std::initializer_list<const WeightView*> ws) {
    const bool quant = needs_quantized(ws);
    const int d = s_.d_model;
    const int64_t blocks = d / 32;
    for_tokens(n, [&](int b, int e) {
      for (int t = b; t < e; ++t) {
        ref::rmsnorm(x + static_cast<int64_t>(t) * d, weight, s_.rms_eps, d, out + static_cast<int64_t>(t) * d);
        if (quant) cpu::quantize_acts(isa_, out + static_cast<int64_t>(t) * d, d, xq_.data() + t * blocks);
      }
    });
    return quant ? xq_.data() : nullptr;
  }

  // Fills xq (n rows of cols/32 blocks) from x when any of the given weights needs quantized activations.
  const block_q16_act* quantize_if_needed(const float* x, int n, int64_t cols, std::initializer_list<const WeightView*> ws) {
    if (!needs_quantized(ws)) return nullptr;
    const int64_t blocks = cols / 32;
    for_tokens(n, [&](int b, int e) {
      for (int t = b; t < e; ++t) cpu::quantize_acts(isa_, x + t * cols, cols, xq_.data() + t * blocks);
    });
    return xq_.data();
  }

  // Runs several projections in one parallel region. Threads take row chunks from a shared counter rather than
  // fixed shares: on a busy machine a descheduled thread would otherwise hold up the whole region.
  void project(std::initializer_list<Projection> list, int n_tok) {
    const Projection* ps = list.begin();
    const int count = static_cast<int>(list.size());
    int64_t total = 0;
    const WeightView* slot[8] = {};
    for (int i = 0; i < count; ++i) {
      total += ps[i].w->rows;
      if (i < 8 && ps[i].xq != nullptr) slot[i] = slot_of(*ps[i].w, n_tok);
    }
    const int64_t chunk = row_chunk(total, pool_.size(), n_tok);
    std::atomic<int64_t> next{0};
    pool_.parallel([&](int, int) {
      for (;;) {
        const int64_t b = next.fetch_add(chunk, std::memory_order_relaxed);
        if (b >= total) break;
        const int64_t e = std::min(b + chunk, total);
        int64_t base = 0;
        for (int i = 0; i < count; ++i) {
          const Projection& p = ps[i];
          const int64_t lo = std::max(b - base, int64_t{0}), hi = std::min(e - base, p.w->rows);
          if (lo < hi) {
            if (n_tok == 1 && p.lane != nullptr && p.lane_acts != nullptr)
              cpu::matvec_lane_rows(isa_, *p.lane, p.lane_acts, p.y, lo, hi);
            else if (i < 8 && slot[i] != nullptr)
              cpu::matmul_slot_rows(isa_, *slot[i], p.xq, n_tok, p.y, p.ldy, lo, hi);
            else if (n_tok == 1)
              cpu::matvec(isa_, *p.w, p.x, p.xq, p.y, lo, hi);
            else
              cpu::matmul(isa_, *p.w, p.x, p.xq, n_tok, p.y, p.ldy, lo, hi);
          }
          base += p.w->rows;
        }
      }
    });
  }

  void embed(int32_t token, float* out) const {
    ref::dequantize_row(w_.tok_embd.type, w_.tok_embd.row(token), out, s_.d_model);
    if (s_.embed_scale != 1.f)
      for (int i = 0; i < s_.d_model; ++i) out[i] *= s_.embed_scale;
  }

  // out[t] = rmsnorm(x[t]) for n rows of `width`, then added into residual rows (post-norm architectures) or,
  // without a norm weight, x itself added.
  void add_residual(float* residual, float* x, const float* post_norm, int n) {
    const int d = s_.d_model;
    if (post_norm != nullptr)
      for_tokens(n, [&](int b, int e) {
        for (int t = b; t < e; ++t) ref::rmsnorm(x + static_cast<int64_t>(t) * d, post_norm, s_.rms_eps, d, x + static_cast<int64_t>(t) * d);
      });
    for (int64_t i = 0; i < static_cast<int64_t>(n) * d; ++i) residual[i] += x[i];
  }

  // n rows: row t is token tokens[t] of KV slot row_slot_[t] at position row_pos_[t] (a prompt chunk: one slot,
  // consecutive positions; a batch: one row per slot). Logits: every row's into all_logits (n x vocab) when given,
  // else the last row's into last_logits when given (an inner prompt chunk wants none).
  void run_chunk(const int32_t* tokens, int n, float* all_logits, float* last_logits) {
    ensure_scratch(n);
    const int d = s_.d_model, ff = s_.d_ff, qd = s_.q_dim(), kvd = s_.kv_dim(), hd = s_.head_dim;
    for (int t = 0; t < n; ++t) embed(tokens[t], x_.data() + static_cast<int64_t>(t) * d);
    if (hidden_out_) std::memcpy(hidden_out_, x_.data(), d * sizeof(float));

    for (int l = 0; l < s_.n_layers; ++l) {
      const LayerWeights& L = w_.layers[l];

      // Attention block.
      const LaneLayer& LL = lane_[l];
      const block_q16_act* xq = norm_quantize(x_.data(), L.attn_norm, xn_.data(), n, {&L.wq, &L.wk, &L.wv});
      {
        const WeightView *lq = lane_of(LL.wq, n), *lk = lane_of(LL.wk, n), *lv = lane_of(LL.wv, n);
        const void* la = pack_lane_acts(lq ? lq : lk ? lk : lv, xq);
        project({{&L.wq, xn_.data(), xq, q_.data(), qd, lq, la}, {&L.wk, xn_.data(), xq, k_.data(), kvd, lk, la},
                 {&L.wv, xn_.data(), xq, v_.data(), kvd, lv, la}},
                n);
      }
      const RopeTable& rt = rope_tables_[layer_rope_[l]];
      const LayerSpec ls = s_.layer(l);
      const int group = s_.n_heads / s_.n_kv_heads;
      // Row t's KV heads [h0, h1) and their query heads: biases, q/k norms, RoPE, then K and V into the row's slot,
      // each value rounded to fp16 (float_to_fp16_rne: the CUDA backend's __float2half_rn).
      auto prepare = [&](int t, int h0, int h1) {
        float *qt = &q_[t * qd], *kt = &k_[t * kvd], *vt = &v_[t * kvd];
        const int q0 = h0 * group * hd, q1 = h1 * group * hd, k0 = h0 * hd, k1 = h1 * hd;
        if (s_.attn_bias) {
          for (int i = q0; i < q1; ++i) qt[i] += L.bq[i];
          for (int i = k0; i < k1; ++i) kt[i] += L.bk[i];
          for (int i = k0; i < k1; ++i) vt[i] += L.bv[i];
        }
        if (s_.qk_norm) {
          for (int h = h0 * group; h < h1 * group; ++h) ref::rmsnorm(qt + h * hd, L.q_norm, s_.rms_eps, hd, qt + h * hd);
          for (int h = h0; h < h1; ++h) ref::rmsnorm(kt + h * hd, L.k_norm, s_.rms_eps, hd, kt + h * hd);
        }
        const int pos = row_pos_[t];
        const float* cs = &rt.cos[static_cast<size_t>(pos) * (hd / 2)];
        const float* sn = &rt.sin[static_cast<size_t>(pos) * (hd / 2)];
        rope_from_table(qt + q0, (h1 - h0) * group, hd, s_.rope_style, cs, sn);
        rope_from_table(kt + k0, h1 - h0, hd, s_.rope_style, cs, sn);
        uint16_t* kc = k_layer(row_slot_[t], l);
        for (int i = k0; i < k1; ++i) kc[k_index(i, pos)] = float_to_fp16_rne(kt[i]);
        for (int h = h0; h < h1; ++h) {  // KV head h's row pos
          uint16_t* vc = v_layer(row_slot_[t], l) + v_index(h * hd, pos);
          for (int j = 0; j < hd; ++j) vc[j] = float_to_fp16_rne(vt[h * hd + j]);
        }
      };
      if (n == 1) {
        attend_decode_row(l, ls.window, [&] { prepare(0, 0, s_.n_kv_heads); });
      } else {
        // A batch (every row in its own slot) prepares each (row, KV head) inside its attention job; rows of one slot
        // (a prompt chunk) read each other's K and V, so they are all prepared first.
        const bool own_slots = rows_in_own_slots(n);
        if (!own_slots)
          for (int t = 0; t < n; ++t) prepare(t, 0, s_.n_kv_heads);
        // One job per (tile, KV head): a tile is up to kQueryTile rows of one slot at consecutive positions (prompt
        // rows; a batch has one row per slot), and the query heads sharing the KV head run together, piece by piece.
        tiles_.clear();
        for (int t = 0; t < n;) {
          int c = 1;
          while (c < kQueryTile && t + c < n && row_slot_[t + c] == row_slot_[t] && row_pos_[t + c] == row_pos_[t] + c)
            ++c;
          tiles_.push_back({t, c});
          t += c;
        }
        const int jobs = static_cast<int>(tiles_.size()) * s_.n_kv_heads;
        std::atomic<int> next_job{0};
        pool_.parallel([&](int ti, int) {
          float* scores = scores_.data() + static_cast<size_t>(ti) * kQueryTile * group * k_cap_;
          for (int j; (j = next_job.fetch_add(1, std::memory_order_relaxed)) < jobs;) {
            const int kvh = j % s_.n_kv_heads;
            const Tile tile = tiles_[j / s_.n_kv_heads];
            if (own_slots) prepare(tile.row, kvh, kvh + 1);
            const uint16_t* kt = k_layer(row_slot_[tile.row], l) + static_cast<size_t>(kvh) * hd * k_cap_;
            const uint16_t* vc = v_layer(row_slot_[tile.row], l) + static_cast<size_t>(kvh) * hd * k_cap_;
            for (int t = tile.row; t < tile.row + tile.count;) {
              const int T = t + kQueryTile <= tile.row + tile.count ? kQueryTile : 1;
              attend_rows(ti, T, &q_[t * qd + kvh * group * hd], kt, vc, row_pos_[t] + 1, ls.window, scores,
                          &att_[t * qd + kvh * group * hd]);
              t += T;
            }
          }
        });
      }
      const block_q16_act* aq = quantize_if_needed(att_.data(), n, qd, {&L.wo});
      {
        const WeightView* lo = lane_of(LL.wo, n);
        project({{&L.wo, att_.data(), aq, tmp_.data(), d, lo, pack_lane_acts(lo, aq)}}, n);
      }
      add_residual(x_.data(), tmp_.data(), L.post_attn_norm, n);

      // Feed-forward block: down(act(gate x) * up x), then the post-FFN norm where the architecture has one.
      const block_q16_act* fq = norm_quantize(x_.data(), L.ffn_norm, xn_.data(), n, {&L.w_gate, &L.w_up});
      {
        const WeightView *lg = lane_of(LL.gate, n), *lu = lane_of(LL.up, n);
        const void* la = pack_lane_acts(lg ? lg : lu, fq);
        project({{&L.w_gate, xn_.data(), fq, gate_.data(), ff, lg, la}, {&L.w_up, xn_.data(), fq, up_.data(), ff, lu, la}},
                n);
      }
      const bool down_quant = needs_quantized({&L.w_down});
      for_tokens(n, [&](int b, int e) {  // the activation, then the down projection's int16 activations
        float* g = &gate_[static_cast<int64_t>(b) * ff];
        const float* u = &up_[static_cast<int64_t>(b) * ff];
        const int64_t count = static_cast<int64_t>(e - b) * ff;
        cpu::glu(isa_, s_.activation == Activation::GeluTanh, g, u, count);
        if (down_quant)
          for (int t = b; t < e; ++t)
            cpu::quantize_acts(isa_, &gate_[static_cast<int64_t>(t) * ff], ff, xq_.data() + t * (ff / 32));
      });
      const block_q16_act* hq = down_quant ? xq_.data() : nullptr;
      {
        const WeightView* ld = lane_of(LL.down, n);
        project({{&L.w_down, gate_.data(), hq, tmp_.data(), d, ld, pack_lane_acts(ld, hq)}}, n);
      }
      add_residual(x_.data(), tmp_.data(), L.post_ffn_norm, n);
      if (hidden_out_) std::memcpy(hidden_out_ + static_cast<size_t>(l + 1) * d, x_.data(), d * sizeof(float));
    }

    // Final norm and lm_head: every token when all logits are wanted, else only the last.
    const int first = all_logits ? 0 : n - 1;
    const int m = n - first;
    for (int t = first; t < n; ++t) ref::rmsnorm(&x_[t * d], w_.output_norm, s_.rms_eps, d, &xn_[(t - first) * d]);
    if (all_logits == nullptr && last_logits == nullptr) return;  // an inner chunk: the KV cache was the point
    float* out = all_logits ? all_logits : last_logits;
    const block_q16_act* oq = quantize_if_needed(xn_.data(), m, d, {&w_.output});
    project({{&w_.output, xn_.data(), oq, out, s_.vocab}}, m);
    if (all_logits && last_logits)
      std::memcpy(last_logits, all_logits + static_cast<int64_t>(n - 1) * s_.vocab, s_.vocab * sizeof(float));
  }

  // Whether no two of run_chunk's n rows share a KV slot.
  bool rows_in_own_slots(int n) {
    seen_slot_.assign(s_.n_seq, 0);
    for (int t = 0; t < n; ++t) {
      if (seen_slot_[row_slot_[t]]) return false;
      seen_slot_[row_slot_[t]] = 1;
    }
    return true;
  }

  // The attention pieces (cpu::kAttentionPiece positions each, from position 0) that rows at positions n_pos0 - 1 ..
  // n_last - 1 see, [first, end): a sliding window leaves out the pieces wholly before it.
  std::pair<int, int> attention_pieces(int n_pos0, int n_last, int window) const {
    const int lo = window > 0 ? std::max(0, n_pos0 - window) : 0;
    return {lo / cpu::kAttentionPiece, (n_last - 1) / cpu::kAttentionPiece + 1};
  }

  // T rows at consecutive positions (the first at n_pos0 - 1) of one KV head's query heads (q, row stride q_dim), piece
  // after piece with thread ti's scratch: each piece's outputs are folded into the running ones, then divided into
  // out (row stride q_dim).
  void attend_rows(int ti, int T, const float* q, const uint16_t* kt, const uint16_t* vc, int n_pos0, int window,
                   float* scores, float* out) {
    const int hd = s_.head_dim, group = s_.n_heads / s_.n_kv_heads, qd = s_.q_dim();
    const size_t per_thread = static_cast<size_t>(kQueryTile) * group;
    float *run_o = &run_out_[ti * per_thread * hd], *run_ml = &run_ml_[ti * per_thread * 2];
    float *piece_o = &piece_out_[ti * per_thread * hd], *piece_ml = &piece_ml_[ti * per_thread * 2];
    for (int r = 0; r < T * group; ++r) cpu::attention_begin(run_o + r * hd, run_ml + 2 * r, hd);
    const auto [first, end] = attention_pieces(n_pos0, n_pos0 + T - 1, window);
    for (int k = first; k < end; ++k) {
      (T == 1 ? attend_.one : attend_.tile)(q, qd, kt, k_cap_, vc, hd, n_pos0, window, k * cpu::kAttentionPiece,
                                            (k + 1) * cpu::kAttentionPiece, hd, attn_scale_, scores, k_cap_, piece_o,
                                            group * hd, piece_ml);
      for (int r = 0; r < T * group; ++r)
        cpu::attention_fold(run_o + r * hd, run_ml + 2 * r, piece_o + r * hd, piece_ml + 2 * r, hd);
    }
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < group; ++h)
        cpu::attention_finish(run_o + (t * group + h) * hd, run_ml + 2 * (t * group + h), hd, out + t * qd + h * hd);
  }

  // Layer l's attention of the single decoding row 0: one job a (KV head, piece), so that a long context spreads over
  // the threads whatever the KV heads (SmolLM2's 3 on 2 threads left one thread idle for a third of the attention,
  // most of a decode step at depth); prepare() writes the row's K and V first. The pieces' outputs are then folded in
  // order, as attend_rows folds them, so the values are those of every other path.
  template <class Prepare>
  void attend_decode_row(int l, int window, Prepare&& prepare) {
    const int hd = s_.head_dim, group = s_.n_heads / s_.n_kv_heads;
    prepare();
    const int n_pos = row_pos_[0] + 1;
    const auto [first, end] = attention_pieces(n_pos, n_pos, window);
    const int n_pieces = end - first, jobs = s_.n_kv_heads * n_pieces;
    std::atomic<int> next_job{0};
    pool_.parallel([&](int ti, int) {
      float* scores = scores_.data() + static_cast<size_t>(ti) * kQueryTile * group * k_cap_;
      for (int j; (j = next_job.fetch_add(1, std::memory_order_relaxed)) < jobs;) {
        const int kvh = j / n_pieces, k = first + j % n_pieces;
        const size_t head = static_cast<size_t>(kvh) * hd * k_cap_;  // the KV head's K and V
        attend_.one(&q_[kvh * group * hd], 0, k_layer(row_slot_[0], l) + head, k_cap_, v_layer(row_slot_[0], l) + head,
                    hd, n_pos, window, k * cpu::kAttentionPiece, (k + 1) * cpu::kAttentionPiece, hd, attn_scale_,
                    scores, k_cap_, &piece_out_[static_cast<size_t>(j) * group * hd], group * hd,
                    &piece_ml_[static_cast<size_t>(j) * group * 2]);
      }
    });
    float* run_o = run_out_.data();
    float* run_ml = run_ml_.data();
    for (int kvh = 0; kvh < s_.n_kv_heads; ++kvh)
      for (int h = 0; h < group; ++h) {
        cpu::attention_begin(run_o, run_ml, hd);
        for (int i = 0; i < n_pieces; ++i) {
          const size_t r = (static_cast<size_t>(kvh) * n_pieces + i) * group + h;
          cpu::attention_fold(run_o, run_ml, &piece_out_[r * hd], &piece_ml_[r * 2], hd);
        }
        cpu::attention_finish(run_o, run_ml, hd, &att_[(kvh * group + h) * hd]);
      }
  }

  void read_kv_rows(int layer, int slot, int pos0, int n, float* k, float* v) const override {
    check_kv_rows(s_, layer, slot, pos0, n);
    const int kv = s_.kv_dim();
    const uint16_t* kc = k_layer(slot, layer);
    const uint16_t* vc = v_layer(slot, layer);
    for (int t = 0; t < n; ++t)
      for (int i = 0; i < kv; ++i) {
        k[static_cast<size_t>(t) * kv + i] = fp16_to_float(kc[k_index(i, pos0 + t)]);
        v[static_cast<size_t>(t) * kv + i] = fp16_to_float(vc[v_index(i, pos0 + t)]);
      }
  }

  // Layer l of slot s, fp16 (IEEE half bits): K [kv_head][k_cap / 16][head_dim][16] (transposed by blocks, see
  // attend_scores), V [kv_head][k_cap][head_dim] (a head's rows contiguous: the P.V streams them; rows of all heads
  // interleaved, at a stride of kv_dim, were measured slower, NOTES "CPU, session 18").
  uint16_t* k_layer(int slot, int l) const {
    return k_cache_.get() + (static_cast<size_t>(slot) * s_.n_layers + l) * k_cap_ * s_.kv_dim();
  }
  uint16_t* v_layer(int slot, int l) const {
    return v_cache_.get() + (static_cast<size_t>(slot) * s_.n_layers + l) * k_cap_ * s_.kv_dim();
  }
  // Where value i of the K (V) row of position pos lies in a layer's cache: KV head i / head_dim, dimension
  // i % head_dim; K in the 16-position block of pos.
  size_t k_index(int i, int pos) const {
    const int hd = s_.head_dim;
    return static_cast<size_t>(i / hd) * hd * k_cap_ + static_cast<size_t>(pos / 16) * 16 * hd + 16 * (i % hd) + pos % 16;
  }
  size_t v_index(int i, int pos) const {
    const int hd = s_.head_dim;
    return (static_cast<size_t>(i / hd) * k_cap_ + pos) * hd + i % hd;
  }

  struct HalfFreeDeleter {
    void operator()(uint16_t* p) const { std::free(p); }
  };
  struct Tile {
    int row, count;
  };
  struct LaneLayer {  // a layer's matrices as lane rows (data null where the layer's type has none)
    WeightView wq, wk, wv, wo, gate, up, down;
  };
  struct ByteFreeDeleter {
    void operator()(uint8_t* p) const { std::free(p); }
  };

  ModelSpec s_;
  ModelWeights w_;
  Isa isa_;
  cpu::ThreadPool pool_;
  size_t k_cap_ = 0;        // positions per (slot, layer) in the caches: n_ctx rounded up to 16
  size_t cache_elems_ = 0;  // per cache (K or V): n_seq x n_layers x k_cap_ x kv_dim halves
  std::unique_ptr<uint16_t[], HalfFreeDeleter> k_cache_, v_cache_;
  std::vector<int32_t> row_slot_, row_pos_;  // run_chunk's rows
  std::vector<Tile> tiles_;
  std::vector<char> seen_slot_;
  int scratch_tokens_ = 0;
  std::vector<float> x_, xn_, q_, k_, v_, att_, tmp_, gate_, up_, logits_, scores_, batch_logits_;
  // Attention pieces' outputs and (max, sum of exp): attend_decode_row's [KV head][piece][query head] or attend_rows'
  // per thread [kQueryTile x group]; the running (folded) ones per thread.
  std::vector<float> piece_out_, piece_ml_, run_out_, run_ml_;
  std::vector<RopeTable> rope_tables_;
  std::vector<int> layer_rope_;  // index into rope_tables_ per layer
  std::vector<block_q16_act> xq_;
  float* hidden_out_ = nullptr;
  std::vector<LaneLayer> lane_;
  std::unique_ptr<uint8_t[], ByteFreeDeleter> lane_store_, lane_acts_;
  size_t lane_bytes_ = 0;
  std::unordered_map<const void*, WeightView> slot_;  // slot rows by the GGUF matrix's data pointer
  std::unique_ptr<uint8_t[], ByteFreeDeleter> slot_store_;
  size_t slot_bytes_ = 0;
  AttendFns attend_;
  float attn_scale_;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(const ModelSpec& spec, const ModelWeights& w, int n_threads) {
  return std::make_unique<CpuBackend>(spec, w, n_threads);
}

}  // namespace metalattn
