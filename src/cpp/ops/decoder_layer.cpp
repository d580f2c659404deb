#include "ops/decoder_layer.h"

#include <algorithm>
#include <stdexcept>

#include "cpu/batch_invariant.h"
#include <string>

#include "cpu/decoder_layer.h"
#include "lora_args.h"
#include "cpu/paged_attention.h"
#include "cpu/reshape_and_cache.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "ops/dtype_names.h"
#include "ops/decoder_layer_plan.h"
#include "ops/kernel_backend.h"
#include "ops/paged_attention.h"

namespace vllm_metal {

namespace {

constexpr const char* kOp = "decoder_layer";
constexpr int kNumMeta = 9;  // x .. rope_table: the weights follow

[[noreturn]] void fail(const std::string& what) {
  throw std::invalid_argument(std::string("[") + kOp + "] " + what);
}

std::string shape_str(const mx::Shape& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

void expect(const mx::array& a, const char* what, mx::Dtype dtype, const mx::Shape& shape) {
  if (a.dtype() != dtype) {
    fail(std::string(what) + " must be " + dtype_name(dtype) + ", got " + dtype_name(a.dtype()));
  }
  if (a.shape() != shape) {
    fail(std::string(what) + " must have shape " + shape_str(shape) + ", got " +
         shape_str(a.shape()));
  }
}

// A projection's weight: uint8 blocks of `type` for [n, k], or a dense [n, k] float
// array whose dtype is the F32/F16/BF16 type named.
void expect_weight(const mx::array& w, const std::string& name, gguf::GGMLType type, int64_t n,
                   int64_t k) {
  gguf::TypeInfo ti = gguf::type_info(type);
  if (!ti.name || !ti.supported) {
    fail(name + ": type " + gguf::type_name(static_cast<uint32_t>(type)) + " is not supported");
  }
  if (k % ti.block_size != 0) {
    fail(name + ": " + std::to_string(k) + " columns are not a multiple of the " + ti.name +
         " block size");
  }
  const int64_t want = n * gguf::row_bytes(type, k);
  if (static_cast<int64_t>(w.nbytes()) != want) {
    fail(name + " must hold " + std::to_string(want) + " bytes for " + ti.name + " [" +
         std::to_string(n) + ", " + std::to_string(k) + "], got " + std::to_string(w.nbytes()));
  }
}

// What the MoE MLP takes (the per-op model's FusedMoeBlock without a shared expert).
void check_moe(const DecoderLayerSpec& s) {
  if (s.top_k < 1 || s.top_k > s.num_experts) {
    fail("top_k must be in [1, num_experts = " + std::to_string(s.num_experts) + "], got " +
         std::to_string(s.top_k));
  }
  if (s.lora || s.sandwich || s.gelu) {
    fail("an MoE layer takes no LoRA adapters, sandwich norms or GELU (the per-op path does)");
  }
  if (!s.expert_blocks) {
    for (int i = 4; i < 7; ++i) {
      const auto t = s.types[i];
      if (t != gguf::GGMLType::kF32 && t != gguf::GGMLType::kF16 && t != gguf::GGMLType::kBF16) {
        fail("dense experts must be F32, F16 or BF16 (expert_blocks for GGUF blocks)");
      }
    }
  }
}

void check(const std::vector<mx::array>& in, const DecoderLayerSpec& s) {
  const mx::array& x = in[0];
  if (x.ndim() != 2 || x.shape(1) != s.hidden) {
    fail("x must be [tokens, " + std::to_string(s.hidden) + "], got " + shape_str(x.shape()));
  }
  check_float_dtype(kOp, "x", x.dtype());
  const int t = x.shape(0);
  expect(in[1], "positions", mx::int32, {t});
  expect(in[2], "slot_mapping", mx::int64, {t});
  if (in[3].dtype() != mx::int32 || in[3].ndim() != 2) fail("block_tables must be int32 [seqs, blocks]");
  const int seqs = in[3].shape(0);
  expect(in[4], "seq_lens", mx::int32, {seqs});
  expect(in[5], "cu_seqlens_q", mx::int32, {seqs + 1});
  const mx::array& kc = in[6];
  if (kc.ndim() != 4 || kc.shape(2) != s.num_kv_heads || kc.shape(3) != s.head_dim) {
    fail("key_cache must be [blocks, block_size, " + std::to_string(s.num_kv_heads) + ", " +
         std::to_string(s.head_dim) + "], got " + shape_str(kc.shape()));
  }
  expect(kc, "key_cache", x.dtype(), kc.shape());
  expect(in[7], "value_cache", x.dtype(), kc.shape());
  expect(in[8], "rope_table", mx::uint32, {2, static_cast<int>(s.rotary_dim / 2)});
  if (s.rotary_dim <= 0 || s.rotary_dim % 2 || s.rotary_dim > s.head_dim) {
    fail("rotary_dim must be even and in (0, head_dim], got " + std::to_string(s.rotary_dim));
  }
  if (s.num_kv_heads <= 0 || s.num_heads % s.num_kv_heads) {
    fail("num_heads must be a multiple of num_kv_heads");
  }
  const auto names = s.weight_names();
  if (in.size() != kNumMeta + names.size()) {
    fail("expected " + std::to_string(names.size()) + " weights, got " +
         std::to_string(in.size() - kNumMeta));
  }
  if (s.types.size() != 7) fail("types must name the 7 projections' GGML types");
  const int hid = static_cast<int>(s.hidden), q = static_cast<int>(s.num_heads * s.head_dim);
  const int kv = static_cast<int>(s.num_kv_heads * s.head_dim);
  const int64_t proj[7][2] = {{q, hid}, {kv, hid}, {kv, hid}, {hid, q},
                              {s.intermediate, hid}, {s.intermediate, hid}, {hid, s.intermediate}};
  const mx::array* w = in.data() + kNumMeta;
  expect(w[0], "input_norm", x.dtype(), {hid});
  expect(w[1], "post_norm", x.dtype(), {hid});
  if (s.moe()) check_moe(s);
  // an MoE layer's experts are E stacked matrices of the same shapes
  const int64_t mats = s.moe() ? s.num_experts : 1;
  for (int i = 0; i < 7; ++i) {
    expect_weight(w[2 + i], names[2 + i], s.types[i], (i < 4 ? 1 : mats) * proj[i][0], proj[i][1]);
  }
  int next = 9;
  if (s.sandwich) {
    expect(w[next++], "attn_out_norm", x.dtype(), {hid});
    expect(w[next++], "mlp_out_norm", x.dtype(), {hid});
  }
  if (s.qkv_bias) {
    expect(w[next++], "q_bias", x.dtype(), {q});
    expect(w[next++], "k_bias", x.dtype(), {kv});
    expect(w[next++], "v_bias", x.dtype(), {kv});
  }
  if (s.o_bias) expect(w[next++], "o_bias", x.dtype(), {hid});
  if (s.qk_norm) {
    expect(w[next++], "q_norm", x.dtype(), {static_cast<int>(s.head_dim)});
    expect(w[next++], "k_norm", x.dtype(), {static_cast<int>(s.head_dim)});
  }
  if (s.moe()) expect_weight(w[next++], "router", s.router_type, s.num_experts, hid);
  if (s.lora) {
    expect(w[next++], "lora_row_slot", mx::int32, {t});
    const mx::array& a0 = w[next];
    if (a0.ndim() != 3 || a0.shape(1) < 1 || a0.shape(1) > LORA_MAX_RANK) {
      fail("q_lora_a must be [slots, rank in [1, " + std::to_string(LORA_MAX_RANK) + "], " +
           std::to_string(hid) + "], got " + shape_str(a0.shape()));
    }
    const int slots = a0.shape(0), rank = a0.shape(1);
    for (int i = 0; i < 7; ++i) {
      const int n = static_cast<int>(proj[i][0]), k = static_cast<int>(proj[i][1]);
      expect(w[next], names[next].c_str(), x.dtype(), {slots, rank, k});
      expect(w[next + 1], names[next + 1].c_str(), x.dtype(), {slots, n, rank});
      expect(w[next + 2], names[next + 2].c_str(), mx::float32, {slots});
      next += 3;
    }
  }
}

// The caches are updated in place, vLLM's contract for its KV cache: a buffer the
// runner owns and keeps, never a value. (Returning them as outputs would need MLX to
// donate them, which it never does for a primitive with several outputs: each output
// holds its own reference to the inputs.) So a cache must be a whole dense buffer: not a
// broadcast, a strided view or an offset slice of another array. (Reference counts cannot
// tell more: tasks still in flight and the step's own lazy handles hold the buffer too.)
void check_cache_is_writable(const mx::array& cache, const char* what) {
  const auto& data = cache.data_shared_ptr();
  if (!cache.flags().row_contiguous || cache.data_size() != cache.size() || !data ||
      cache.data<char>() != static_cast<const char*>(cache.buffer().raw_ptr())) {
    fail(std::string(what) + " is updated in place, so it must be a dense row-contiguous " +
         "array at the start of its buffer (not a broadcast, strided view or offset slice)");
  }
}

// Index of the weight `name` among spec.weight_names().
int weight_index(const DecoderLayerSpec& spec, const std::string& name) {
  const auto names = spec.weight_names();
  return static_cast<int>(std::find(names.begin(), names.end(), name) - names.begin());
}

}  // namespace

std::vector<std::string> DecoderLayerSpec::weight_names() const {
  std::vector<std::string> n = {"input_norm", "post_norm", "q_proj", "k_proj", "v_proj",
                                "o_proj",     "gate_proj", "up_proj", "down_proj"};
  if (moe()) {
    n[6] = "gate_exps";
    n[7] = "up_exps";
    n[8] = "down_exps";
  }
  if (sandwich) n.insert(n.end(), {"attn_out_norm", "mlp_out_norm"});
  if (qkv_bias) n.insert(n.end(), {"q_bias", "k_bias", "v_bias"});
  if (o_bias) n.push_back("o_bias");
  if (qk_norm) n.insert(n.end(), {"q_norm", "k_norm"});
  if (moe()) n.push_back("router");
  if (lora) {
    n.push_back("lora_row_slot");
    for (const char* p : {"q", "k", "v", "o", "gate", "up", "down"}) {
      for (const char* part : {"_lora_a", "_lora_b", "_lora_scale"}) {
        n.push_back(std::string(p) + part);
      }
    }
  }
  return n;
}

mx::array decoder_layer(const mx::array& x, const mx::array& positions,
                        const mx::array& slot_mapping, const mx::array& block_tables,
                        const mx::array& seq_lens, const mx::array& cu_seqlens_q,
                        const mx::array& key_cache, const mx::array& value_cache,
                        const mx::array& rope_table, const std::vector<mx::array>& weights,
                        const DecoderLayerSpec& spec, std::optional<int64_t> num_decode_seqs,
                        std::optional<int64_t> max_seq_len, std::optional<int64_t> max_query_len,
                        mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  const KernelBackend backend = default_kernel_backend();
  std::vector<mx::array> in = {x, positions, slot_mapping, block_tables, seq_lens,
                               cu_seqlens_q, key_cache, value_cache, rope_table};
  in.insert(in.end(), weights.begin(), weights.end());
  check(in, spec);
  // a step without tokens has nothing to run (a Metal plan of empty grids is not valid)
  if (x.shape(0) == 0) return mx::zeros(x.shape(), x.dtype(), stream);
  for (size_t i = 0; i < in.size(); ++i) {
    if (i != 6 && i != 7) in[i] = mx::contiguous(in[i], false, stream);  // caches: as given
  }
  auto p = std::make_shared<DecoderLayerProblem>();
  p->spec = spec;
  p->dtype = x.dtype();
  p->tokens = x.shape(0);
  p->num_slots = static_cast<int64_t>(key_cache.shape(0)) * key_cache.shape(1);
  if (spec.lora) {
    const mx::array& q_lora_a = in[kNumMeta + weight_index(spec, "q_lora_a")];
    p->lora_slots = q_lora_a.shape(0);
    p->lora_rank = q_lora_a.shape(1);
  }
  PagedAttentionProblem& a = p->attention;
  a.uses_kernels = backend == KernelBackend::kEmulated || stream.device == mx::Device::gpu;
  if (a.uses_kernels) {
    if (auto why = head_size_problem(spec.head_dim, true); !why.empty()) fail(why);
    a.dtype = x.dtype();
    a.num_tokens = p->tokens;
    a.num_seqs = seq_lens.shape(0);
    a.num_q_heads = spec.num_heads;
    a.num_kv_heads = spec.num_kv_heads;
    a.head_size = spec.head_dim;
    a.num_blocks = key_cache.shape(0);
    a.block_size = key_cache.shape(1);
    a.max_blocks = block_tables.shape(1);
    a.sliding_window = spec.sliding_window;
    a.scale = spec.scale;
    a.softcap = spec.softcap;
    a.batch_invariant = cpu::batch_invariant();  // fixed here: the plan and scratch agree
    if (a.batch_invariant) a.partition_size = kInvariantPartitionSize;
    PagedAttentionOptions hints;
    hints.num_decode_seqs = num_decode_seqs;
    hints.max_seq_len = max_seq_len;
    hints.max_query_len = max_query_len;
    resolve_paged_attention_hints(a, hints, block_tables, seq_lens, cu_seqlens_q);
    // the kernels skip a slot outside the cache (they cannot raise): refuse it now when
    // the table is already computed, as reshape_and_cache does
    const mx::array& slots = slot_mapping;
    if (slots.status() == mx::array::Status::available && slots.flags().row_contiguous) {
      const int64_t* sp = slots.data<int64_t>();
      const int64_t bad = cpu::find_out_of_range_slot(sp, slots.size(), p->num_slots);
      if (bad >= 0) {
        throw std::out_of_range(std::string("[") + kOp + "] slot_mapping[" + std::to_string(bad) +
                                "] = " + std::to_string(sp[bad]) + " is outside the cache's " +
                                std::to_string(p->num_slots) + " slots");
      }
    }
  }
  auto outputs = mx::array::make_arrays(decoder_layer_output_shapes(*p),
                                        decoder_layer_output_dtypes(*p),
                                        std::make_shared<DecoderLayer>(stream, backend, p), in);
  return outputs[0];
}

DecoderLayer::DecoderLayer(mx::Stream stream, KernelBackend backend,
                           std::shared_ptr<DecoderLayerProblem> p)
    : KernelPrimitive(stream, backend), problem_(std::move(p)) {}

KernelPlan DecoderLayer::plan(const std::vector<mx::array>&,
                              const std::vector<mx::array>&) const {
  return plan_decoder_layer(*problem_);
}

void DecoderLayer::allocate_outputs(const std::vector<mx::array>& inputs,
                                    std::vector<mx::array>& outputs) {
  check_cache_is_writable(inputs[6], "key_cache");
  check_cache_is_writable(inputs[7], "value_cache");
  KernelPrimitive::allocate_outputs(inputs, outputs);
}

void DecoderLayer::eval_native_cpu(const std::vector<mx::array>& inputs,
                                   std::vector<mx::array>& outputs) {
  const DecoderLayerSpec& s = problem_->spec;
  cpu::DecoderLayerRows a;
  a.elt = elt_of(inputs[0].dtype());
  a.tokens = inputs[0].shape(0);
  a.hidden = s.hidden;
  a.num_heads = s.num_heads;
  a.num_kv_heads = s.num_kv_heads;
  a.head_dim = s.head_dim;
  a.intermediate = s.intermediate;
  a.exact = s.exact;
  a.norm_eps = s.norm_eps;
  a.qk_norm_eps = s.qk_norm_eps;
  a.rotary_dim = s.rotary_dim;
  a.neox = s.neox;
  a.rope_mscale = s.rope_mscale;
  a.activation = s.gelu ? cpu::GatedActivation::kGeluTanh : cpu::GatedActivation::kSilu;
  const mx::array& kc = inputs[6];
  cpu::PagedAttentionParams& at = a.attention;
  at.num_seqs = inputs[4].shape(0);
  at.max_blocks = inputs[3].shape(1);
  at.num_blocks = kc.shape(0);
  at.block_size = kc.shape(1);
  at.scale = s.scale;
  at.sliding_window = s.sliding_window;
  at.softcap = s.softcap;

  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) encoder.set_input_array(in);
  for (auto& out : outputs) encoder.set_output_array(out);
  encoder.dispatch([a, inputs, outputs, s]() mutable {
    const int64_t num_slots = a.attention.num_blocks * a.attention.block_size;
    a.slot_mapping = inputs[2].data<int64_t>();
    const int64_t bad = cpu::find_out_of_range_slot(a.slot_mapping, a.tokens, num_slots);
    if (bad >= 0) {
      throw std::out_of_range(std::string("[") + kOp + "] slot_mapping[" + std::to_string(bad) +
                              "] = " + std::to_string(a.slot_mapping[bad]) +
                              " is outside the cache's " + std::to_string(num_slots) + " slots");
    }
    cpu::PagedAttentionParams& at = a.attention;
    at.block_tables = inputs[3].data<int32_t>();
    at.seq_lens = inputs[4].data<int32_t>();
    at.cu_seqlens_q = inputs[5].data<int32_t>();
    std::string err = cpu::check_paged_metadata(at.block_tables, at.seq_lens, at.cu_seqlens_q,
                                                at.num_seqs, at.max_blocks, at.num_blocks,
                                                at.block_size, a.tokens);
    if (!err.empty()) fail(err);
    a.x = inputs[0].data<void>();
    a.out = outputs[0].data<void>();
    a.positions = inputs[1].data<int32_t>();
    a.rope_table = inputs[8].data<uint32_t>();
    a.key_cache = const_cast<void*>(inputs[6].data<void>());  // in place, see above
    a.value_cache = const_cast<void*>(inputs[7].data<void>());
    const mx::array* w = inputs.data() + kNumMeta;
    a.input_norm = w[0].data<void>();
    a.post_norm = w[1].data<void>();
    const int64_t hid = s.hidden, q = s.num_heads * s.head_dim, kv = s.num_kv_heads * s.head_dim;
    const int64_t dims[7][2] = {{q, hid}, {kv, hid}, {kv, hid}, {hid, q},
                                {s.intermediate, hid}, {s.intermediate, hid},
                                {hid, s.intermediate}};
    cpu::LayerLinear* proj[7] = {&a.q, &a.k, &a.v, &a.o, &a.gate, &a.up, &a.down};
    for (int i = 0; i < 7; ++i) {
      *proj[i] = {s.types[i], w[2 + i].data<void>(), nullptr, dims[i][0], dims[i][1]};
    }
    int next = 9;
    if (s.sandwich) {
      a.attn_out_norm = w[next++].data<void>();
      a.mlp_out_norm = w[next++].data<void>();
    }
    if (s.qkv_bias) {
      a.q.bias = w[next++].data<void>();
      a.k.bias = w[next++].data<void>();
      a.v.bias = w[next++].data<void>();
    }
    if (s.o_bias) a.o.bias = w[next++].data<void>();
    if (s.qk_norm) {
      a.q_norm = w[next++].data<void>();
      a.k_norm = w[next++].data<void>();
    }
    if (s.moe()) {
      a.num_experts = s.num_experts;
      a.top_k = s.top_k;
      a.moe_renormalize = s.moe_renormalize;
      a.expert_blocks = s.expert_blocks;
      a.router = {s.router_type, w[next++].data<void>(), nullptr, s.num_experts, hid};
    }
    if (s.lora) {
      const int32_t* row_slot = w[next++].data<int32_t>();
      const int64_t slots = w[next].shape(0);
      a.lora_rank = w[next].shape(1);
      for (int64_t t = 0; t < a.tokens; ++t) {
        if (row_slot[t] < -1 || row_slot[t] >= slots) {
          fail("lora_row_slot[" + std::to_string(t) + "] = " + std::to_string(row_slot[t]) +
               " is out of range for " + std::to_string(slots) + " slots (-1 = no adapter)");
        }
      }
      a.lora_row_slot = row_slot;
      for (int i = 0; i < 7; ++i) {
        proj[i]->lora_a = w[next++].data<void>();
        proj[i]->lora_b = w[next++].data<void>();
        proj[i]->lora_scale = w[next++].data<float>();
      }
    }
    cpu::decoder_layer(a);
  });
}

}  // namespace vllm_metal
