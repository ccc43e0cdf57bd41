// nanobind glue: translates types only. Weights arrive as numpy views of the memory-mapped GGUF and are
// borrowed (kept alive here), never copied; logits go out as fresh numpy arrays.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cpu/bandwidth.h"
#include "cpu/kernels.h"
#include "cpu/reference.h"
#include "cpu/thread_pool.h"
#include "engine/engine.h"
#include "engine/sampling.h"

namespace nb = nanobind;
using namespace nb::literals;
using metalattn::EngineError;

namespace {

using ByteMatrix = nb::ndarray<const uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using FloatVector = nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using TokenArray = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using DoubleVector = nb::ndarray<const double, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Int64Vector = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using FloatArray = nb::ndarray<nb::numpy, float>;

FloatArray new_float_array(std::initializer_list<size_t> shape) {
  size_t n = 1;
  for (size_t s : shape) n *= s;
  float* data = new float[n];
  nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<float*>(p); });
  return FloatArray(data, shape.size(), shape.begin(), owner);
}

// A fresh float array of the given shape when wanted (its data pointer for the engine to fill), else (None, null).
std::pair<nb::object, float*> optional_float_array(bool wanted, std::initializer_list<size_t> shape) {
  if (!wanted) return {nb::none(), nullptr};
  FloatArray a = new_float_array(shape);
  float* data = a.data();
  return {nb::cast(a), data};
}

// Owns the engine plus references to every numpy array it borrows.
class PyEngine {
 public:
  PyEngine(nb::dict config, nb::dict matrices, nb::dict norms, const std::string& device, int n_threads, bool debug) {
    metalattn::ModelSpec s;
    s.n_layers = nb::cast<int>(config["n_layers"]);
    s.d_model = nb::cast<int>(config["d_model"]);
    s.d_ff = nb::cast<int>(config["d_ff"]);
    s.n_heads = nb::cast<int>(config["n_heads"]);
    s.n_kv_heads = nb::cast<int>(config["n_kv_heads"]);
    s.head_dim = nb::cast<int>(config["head_dim"]);
    s.vocab = nb::cast<int>(config["vocab_size"]);
    s.n_ctx = nb::cast<int>(config["n_ctx"]);
    if (config.contains("n_seq")) s.n_seq = nb::cast<int>(config["n_seq"]);
    s.rope_base = nb::cast<float>(config["rope_base"]);
    s.rms_eps = nb::cast<float>(config["rms_eps"]);
    // The architecture description (gguf_model.ARCHITECTURES); absent keys keep the plain Llama layer.
    auto opt = [&](const char* key) -> nb::object { return config.contains(key) ? config[key] : nb::none(); };
    if (!opt("rope_style").is_none()) s.rope_style = static_cast<metalattn::RopeStyle>(nb::cast<int>(opt("rope_style")));
    if (!opt("activation").is_none()) s.activation = static_cast<metalattn::Activation>(nb::cast<int>(opt("activation")));
    if (!opt("embed_scale").is_none()) s.embed_scale = nb::cast<float>(opt("embed_scale"));
    if (!opt("attn_scale").is_none()) s.attn_scale = nb::cast<float>(opt("attn_scale"));
    if (!opt("attn_bias").is_none()) s.attn_bias = nb::cast<bool>(opt("attn_bias"));
    if (!opt("qk_norm").is_none()) s.qk_norm = nb::cast<bool>(opt("qk_norm"));
    if (!opt("post_norms").is_none()) s.post_norms = nb::cast<bool>(opt("post_norms"));
    if (!opt("layers").is_none()) {  // [(rope_base, rope_scale, window)] per layer
      for (nb::handle h : nb::cast<nb::list>(opt("layers"))) {
        nb::tuple t = nb::cast<nb::tuple>(h);
        s.layers.push_back({nb::cast<float>(t[0]), nb::cast<float>(t[1]), nb::cast<int>(t[2])});
      }
    }

    metalattn::ModelWeights w;
    w.layers.resize(s.n_layers);
    auto matrix = [&](const std::string& name) {
      if (!matrices.contains(name.c_str())) throw EngineError("missing tensor " + name);
      nb::tuple t = nb::cast<nb::tuple>(matrices[name.c_str()]);  // (ggml_type, rows, cols, uint8 array)
      ByteMatrix a = nb::cast<ByteMatrix>(t[3]);
      metalattn::WeightView v;
      v.type = static_cast<metalattn::GgmlType>(nb::cast<uint32_t>(t[0]));
      v.rows = nb::cast<int64_t>(t[1]);
      v.cols = nb::cast<int64_t>(t[2]);
      if (metalattn::row_bytes(v.type, v.cols) == 0)
        throw EngineError("tensor " + name + " has an unsupported type (ggml type " +
                          std::to_string(static_cast<uint32_t>(v.type)) + ")");
      if (a.shape(0) != static_cast<size_t>(v.rows) || a.shape(1) != metalattn::row_bytes(v.type, v.cols))
        throw EngineError("tensor " + name + ": byte array shape does not match its type and dimensions");
      v.data = a.data();
      matrices_.push_back(a);
      return v;
    };
    // A float vector of n values, or null where the file has none (validate_model says whether it must).
    auto vec = [&](const std::string& name, int n) -> const float* {
      if (!norms.contains(name.c_str())) return nullptr;
      FloatVector a = nb::cast<FloatVector>(norms[name.c_str()]);
      if (a.shape(0) != static_cast<size_t>(n))
        throw EngineError("tensor " + name + " must have " + std::to_string(n) + " floats, has " +
                          std::to_string(a.shape(0)));
      norms_.push_back(a);
      return a.data();
    };
    auto norm = [&](const std::string& name) {
      const float* v = vec(name, s.d_model);
      if (v == nullptr) throw EngineError("missing tensor " + name);
      return v;
    };
    w.tok_embd = matrix("token_embd.weight");
    w.output = matrix("output.weight");
    w.output_norm = norm("output_norm.weight");
    w.rope_freqs = vec("rope_freqs.weight", s.head_dim / 2);
    const int qd = s.n_heads * s.head_dim, kvd = s.n_kv_heads * s.head_dim;
    for (int l = 0; l < s.n_layers; ++l) {
      const std::string p = "blk." + std::to_string(l) + ".";
      metalattn::LayerWeights& L = w.layers[l];
      L.attn_norm = norm(p + "attn_norm.weight");
      L.ffn_norm = norm(p + "ffn_norm.weight");
      L.wq = matrix(p + "attn_q.weight");
      L.wk = matrix(p + "attn_k.weight");
      L.wv = matrix(p + "attn_v.weight");
      L.wo = matrix(p + "attn_output.weight");
      L.w_gate = matrix(p + "ffn_gate.weight");
      L.w_up = matrix(p + "ffn_up.weight");
      L.w_down = matrix(p + "ffn_down.weight");
      L.bq = vec(p + "attn_q.bias", qd);
      L.bk = vec(p + "attn_k.bias", kvd);
      L.bv = vec(p + "attn_v.bias", kvd);
      L.q_norm = vec(p + "attn_q_norm.weight", s.head_dim);
      L.k_norm = vec(p + "attn_k_norm.weight", s.head_dim);
      L.post_attn_norm = vec(p + "post_attention_norm.weight", s.d_model);
      L.post_ffn_norm = vec(p + "post_ffw_norm.weight", s.d_model);
    }
    nb::gil_scoped_release release;  // uploading weights to a GPU can take a while
    engine_ = std::make_unique<metalattn::Engine>(s, w, device, n_threads, debug);
  }

  metalattn::Engine& e() { return *engine_; }

 private:
  std::vector<ByteMatrix> matrices_;
  std::vector<FloatVector> norms_;
  std::unique_ptr<metalattn::Engine> engine_;
};

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "metalattn C++ core: the CPU and CUDA inference backends";
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const metalattn::TokenRangeError& e) {
      nb::object cls = nb::module_::import_("metalattn.errors").attr("TokenError");
      PyErr_SetString(cls.ptr(), e.what());
    } catch (const metalattn::ContextOverflow& e) {
      nb::object cls = nb::module_::import_("metalattn.errors").attr("ContextOverflowError");
      PyErr_SetString(cls.ptr(), e.what());
    } catch (const metalattn::BackendUnsupported& e) {
      nb::object cls = nb::module_::import_("metalattn.errors").attr("BackendUnsupportedError");
      PyErr_SetString(cls.ptr(), e.what());
    } catch (const metalattn::NonFiniteLogits& e) {
      nb::object cls = nb::module_::import_("metalattn.errors").attr("NonFiniteError");
      PyErr_SetString(cls.ptr(), e.what());
    } catch (const EngineError& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });

  m.def("cuda_compiled", &metalattn::cuda_compiled, "True when this build contains the CUDA backend.");
  m.def("cuda_device_count", &metalattn::cuda_device_count, "Number of usable CUDA devices (0 without CUDA).");
  m.def("cpu_isa", [] { return std::string(metalattn::cpu::isa_name(metalattn::cpu::selected_isa())); },
        "The CPU kernel path in use: avx512, avx2 or scalar (METALATTN_CPU_ISA forces one).");
  m.def("cuda_device_name", &metalattn::cuda_device_name, "The current GPU's name (empty without CUDA or a device).");
  m.def("cuda_device_memory_used", &metalattn::cuda_device_memory_used,
        "Bytes of device memory in use on the current GPU (0 without CUDA).");
  m.def("cuda_copy_bandwidth", [] {
    nb::gil_scoped_release release;
    return metalattn::cuda_copy_bandwidth();
  }, "Device-to-device copy bandwidth in bytes/s, counting bytes read and written (0 without CUDA).");
  m.def("physical_cores", &metalattn::cpu::ThreadPool::physical_cores);
  m.def("dequantize",
        [](ByteMatrix rows, uint32_t type, int64_t cols) {
          const auto t = static_cast<metalattn::GgmlType>(type);
          if (metalattn::row_bytes(t, cols) == 0 || cols % metalattn::block_elems(t) != 0 ||
              rows.shape(1) != metalattn::row_bytes(t, cols))
            throw EngineError("dequantize: the byte rows do not hold rows of " + std::to_string(cols) + " " +
                              metalattn::type_name(t) + " weights");
          FloatArray out = new_float_array({rows.shape(0), static_cast<size_t>(cols)});
          for (size_t r = 0; r < rows.shape(0); ++r)
            metalattn::ref::dequantize_row(t, rows.data() + r * rows.shape(1), out.data() + r * cols, cols);
          return out;
        },
        "rows"_a, "ggml_type"_a, "cols"_a,
        "The C++ reference dequantizer (the scalar CPU path) over uint8 rows: float32 [rows, cols].");
  m.def("sample_logits",
        [](FloatVector logits, double temperature, int64_t top_k, double top_p, double u) {
          nb::gil_scoped_release release;
          return metalattn::sample_logits(logits.data(), static_cast<int64_t>(logits.shape(0)),
                                          {temperature, top_k, top_p}, u);
        },
        "logits"_a, "temperature"_a, "top_k"_a, "top_p"_a, "u"_a,
        "The token the uniform u in [0, 1) draws from float32 logits (temperature, top_k 0 = off, top_p 1 = off); "
        "metalattn.sampling.sample is the checked entry point.");
  m.def("log_probs",
        [](FloatVector logits, int64_t token, int64_t k) {
          metalattn::LogProbs lp;
          {
            nb::gil_scoped_release release;
            lp = metalattn::log_probs(logits.data(), static_cast<int64_t>(logits.shape(0)), token, k);
          }
          nb::list top;
          for (size_t j = 0; j < lp.top.size(); ++j) top.append(nb::make_tuple(lp.top_ids[j], lp.top[j]));
          return nb::make_tuple(lp.token, top);
        },
        "logits"_a, "token"_a, "k"_a,
        "(log-probability of `token`, [(id, log-probability)] of the k most likely, best first) under the float32 "
        "logits' softmax.");
  m.def("cpu_read_bandwidth",
        [](int n_threads, size_t bytes, int repeats) {
          nb::gil_scoped_release release;
          return metalattn::cpu::measure_read_bandwidth(n_threads, bytes, repeats);
        },
        "n_threads"_a = 0, "bytes"_a = size_t{512} << 20, "repeats"_a = 3,
        "Bytes/s the CPU backend's threads read from memory (best of `repeats`).");

  nb::class_<PyEngine>(m, "Engine")
      .def(nb::init<nb::dict, nb::dict, nb::dict, const std::string&, int, bool>(), "config"_a, "matrices"_a,
           "norms"_a, "device"_a = "cpu", "n_threads"_a = 0, "debug"_a = false)
      .def_prop_ro("device", [](PyEngine& p) { return std::string(p.e().device()); })
      .def_prop_ro("pos", [](PyEngine& p) { return p.e().pos(); })
      .def_prop_ro("n_ctx", [](PyEngine& p) { return p.e().spec().n_ctx; })
      .def_prop_ro("n_seq", [](PyEngine& p) { return p.e().n_seq(); })
      .def("slot_pos", [](PyEngine& p, int slot) { return p.e().slot_pos(slot); }, "slot"_a,
           "Tokens in the KV cache of sequence slot `slot`.")
      .def("truncate_slot", [](PyEngine& p, int slot, int n) { p.e().truncate_slot(slot, n); }, "slot"_a, "n"_a,
           "Keeps the first n tokens of slot `slot`'s KV cache.")
      .def("forward_prompt_slot",
           [](PyEngine& p, int slot, TokenArray tokens, bool want_logits) {
             const int n = static_cast<int>(tokens.shape(0));
             auto [logits, out] = optional_float_array(want_logits, {static_cast<size_t>(p.e().spec().vocab)});
             metalattn::ArgmaxResult r;
             {
               nb::gil_scoped_release release;
               r = p.e().forward_prompt_slot(slot, tokens.data(), n, out, nullptr);
             }
             return std::make_tuple(r.token, logits);
           },
           "slot"_a, "tokens"_a, "want_logits"_a = false,
           "Runs a prompt on sequence slot `slot`; returns (argmax token, last logits or None).")
      .def("forward_batch",
           [](PyEngine& p, TokenArray tokens, TokenArray slots, bool want_logits) {
             const size_t n = tokens.shape(0);
             if (slots.shape(0) != n) throw EngineError("forward_batch: tokens and slots differ in length");
             auto [logits, out] = optional_float_array(want_logits && n > 0, {n, static_cast<size_t>(p.e().spec().vocab)});
             std::vector<metalattn::ArgmaxResult> r(n);
             {
               nb::gil_scoped_release release;
               p.e().forward_batch(tokens.data(), slots.data(), static_cast<int>(n), out, r.data());
             }
             nb::list ids;
             for (const auto& x : r) ids.append(x.token);
             return std::make_tuple(ids, logits);
           },
           "tokens"_a, "slots"_a, "want_logits"_a = false,
           "One decode step for several sequences: row i feeds tokens[i] to slot slots[i] (distinct). Returns "
           "(argmax token per row, logits [n, vocab] or None).")
      .def("forward_batch_sample",
           [](PyEngine& p, TokenArray tokens, TokenArray slots, DoubleVector temperature, Int64Vector top_k,
              DoubleVector top_p, DoubleVector u, bool want_logits) {
             const size_t n = tokens.shape(0);
             if (slots.shape(0) != n || temperature.shape(0) != n || top_k.shape(0) != n || top_p.shape(0) != n ||
                 u.shape(0) != n)
               throw EngineError("forward_batch_sample: every argument needs one entry a row");
             std::vector<metalattn::SamplingParams> params(n);
             for (size_t i = 0; i < n; ++i) params[i] = {temperature(i), top_k(i), top_p(i)};
             auto [logits, out] = optional_float_array(want_logits && n > 0, {n, static_cast<size_t>(p.e().spec().vocab)});
             std::vector<metalattn::ArgmaxResult> r(n);
             {
               nb::gil_scoped_release release;
               p.e().forward_batch_sample(tokens.data(), slots.data(), static_cast<int>(n), params.data(), u.data(),
                                          out, r.data());
             }
             nb::list ids;
             for (const auto& x : r) ids.append(x.token);
             return std::make_tuple(ids, logits);
           },
           "tokens"_a, "slots"_a, "temperature"_a, "top_k"_a, "top_p"_a, "u"_a, "want_logits"_a = false,
           "forward_batch, each row with temperature > 0 drawn by its uniform u from its logits (as sample_logits; "
           "on CUDA on the device); the others greedy. Returns (token per row, logits [n, vocab] or None).")
      .def_prop_ro("vocab_size", [](PyEngine& p) { return p.e().spec().vocab; })
      .def_prop_ro("kernels_per_token", [](PyEngine& p) { return p.e().kernels_per_token(); })
      .def("reset", [](PyEngine& p) { p.e().reset(); })
      .def("truncate", [](PyEngine& p, int n) { p.e().truncate(n); }, "n"_a,
           "Keeps the first n tokens of the KV cache (0 <= n <= pos); the next token goes to position n.")
      .def("forward_token_greedy",
           [](PyEngine& p, int32_t token) {
             nb::gil_scoped_release release;
             return p.e().forward_token_greedy(token).token;
           },
           "token"_a, "Runs one token; returns the argmax token id computed on the device.")
      .def("forward_token_greedy_value",
           [](PyEngine& p, int32_t token) {
             metalattn::ArgmaxResult r;
             {
               nb::gil_scoped_release release;
               r = p.e().forward_token_greedy(token);
             }
             return std::make_tuple(r.token, r.value);
           },
           "token"_a, "As forward_token_greedy, returning (token id, its logit).")
      .def("forward_tokens_greedy",
           [](PyEngine& p, int32_t token, int n) {
             std::vector<metalattn::ArgmaxResult> r(n > 0 ? n : 0);
             {
               nb::gil_scoped_release release;
               p.e().forward_tokens_greedy(token, n, r.data());
             }
             nb::list ids;
             for (const auto& x : r) ids.append(x.token);
             return ids;
           },
           "token"_a, "n"_a,
           "n greedy steps from token (1 <= n <= 64), each step's argmax fed to the next on the device; returns the "
           "n token ids. The GPU runs the steps back to back.")
      .def("forward_token",
           [](PyEngine& p, int32_t token) {
             FloatArray out = new_float_array({static_cast<size_t>(p.e().spec().vocab)});
             {
               nb::gil_scoped_release release;
               p.e().forward_token(token, out.data());
             }
             return out;
           },
           "token"_a, "Runs one token; returns its logits (float32, vocab).")
      .def("forward_token_sample",
           [](PyEngine& p, int32_t token, double temperature, int64_t top_k, double top_p, double u) {
             nb::gil_scoped_release release;
             return p.e().forward_token_sample(token, {temperature, top_k, top_p}, u);
           },
           "token"_a, "temperature"_a, "top_k"_a, "top_p"_a, "u"_a,
           "Runs one token; returns the next token that the uniform u in [0, 1) draws from its logits (as "
           "sample_logits does; the CUDA backend draws on the GPU, 8 bytes back).")
      .def("forward_tokens_sample",
           [](PyEngine& p, int32_t token, int n, double temperature, int64_t top_k, double top_p, DoubleVector u) {
             if (n < 1 || static_cast<size_t>(n) != u.shape(0))
               throw EngineError("forward_tokens_sample: one uniform a step");
             std::vector<int64_t> out(n);
             int done = 0;
             {
               nb::gil_scoped_release release;
               done = p.e().forward_tokens_sample(token, n, {temperature, top_k, top_p}, u.data(), out.data());
             }
             nb::list ids;
             for (int i = 0; i < done; ++i) ids.append(out[i]);
             return ids;
           },
           "token"_a, "n"_a, "temperature"_a, "top_k"_a, "top_p"_a, "u"_a,
           "Up to n sampled steps from token, u[i] drawing step i's token (as forward_token_sample), each drawn token "
           "fed to the next step on the device; returns the tokens of the steps done (n, or fewer where a draw had to "
           "be made on the host: go on from the last one).")
      .def("forward_token_debug",
           [](PyEngine& p, int32_t token) {
             const auto& s = p.e().spec();
             FloatArray hidden = new_float_array({static_cast<size_t>(s.n_layers + 1), static_cast<size_t>(s.d_model)});
             FloatArray logits = new_float_array({static_cast<size_t>(s.vocab)});
             {
               nb::gil_scoped_release release;
               p.e().forward_token_debug(token, hidden.data(), logits.data());
             }
             return std::make_tuple(hidden, logits);
           },
           "token"_a, "Runs one token; returns (residual stream after embedding and each layer, logits).")
      .def("forward_prompt",
           [](PyEngine& p, TokenArray tokens) {
             nb::gil_scoped_release release;
             return p.e().forward_prompt(tokens.data(), static_cast<int>(tokens.shape(0)), nullptr, nullptr).token;
           },
           "tokens"_a, "Runs a prompt layer by layer; returns the argmax after the last token.")
      .def("forward_prompt_logits",
           [](PyEngine& p, TokenArray tokens, bool all) {
             const int n = static_cast<int>(tokens.shape(0));
             const size_t vocab = static_cast<size_t>(p.e().spec().vocab);
             FloatArray out = all ? new_float_array({static_cast<size_t>(n > 0 ? n : 0), vocab}) : new_float_array({vocab});
             {
               nb::gil_scoped_release release;
               if (all)
                 p.e().forward_prompt(tokens.data(), n, nullptr, out.data());
               else
                 p.e().forward_prompt(tokens.data(), n, out.data(), nullptr);
             }
             return out;
           },
           "tokens"_a, "all"_a = false,
           "Runs a prompt; returns the last token's logits (vocab) or, with all=True, every token's (n x vocab).")
      .def("memory_info", [](PyEngine& p) {
        const metalattn::MemoryInfo m = p.e().memory_info();
        nb::dict d;
        d["weights"] = m.weights;
        d["kv_cache"] = m.kv_cache;
        d["scratch"] = m.scratch;
        return d;
      });
}
