// Bindings of the fused CPU decoder layer (ops/decoder_layer.h) and of silu_and_mul.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "bindings/bindings.h"
#include "bindings/common.h"
#include "mlx/array.h"
#include "cpu/batch_invariant.h"
#include "ops/decoder_layer.h"
#include "ops/decoder_layer_plan.h"
#include "ops/dtype_names.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace mx = mlx::core;
namespace vm = vllm_metal;
using vllm_metal::bindings::parse_float_dtype;
using vllm_metal::bindings::StreamArg;
using vllm_metal::bindings::to_stream_or_device;

namespace vllm_metal::bindings {

void bind_decoder_layer(nb::module_& m) {
  nb::class_<vm::DecoderLayerSpec>(m, "DecoderLayerSpec",
                                   "What a fused decoder layer keeps from step to step.")
      .def(nb::init<>())
      .def_rw("hidden", &vm::DecoderLayerSpec::hidden)
      .def_rw("num_heads", &vm::DecoderLayerSpec::num_heads)
      .def_rw("num_kv_heads", &vm::DecoderLayerSpec::num_kv_heads)
      .def_rw("head_dim", &vm::DecoderLayerSpec::head_dim)
      .def_rw("intermediate", &vm::DecoderLayerSpec::intermediate)
      .def_rw("norm_eps", &vm::DecoderLayerSpec::norm_eps)
      .def_rw("qk_norm_eps", &vm::DecoderLayerSpec::qk_norm_eps)
      .def_rw("qkv_bias", &vm::DecoderLayerSpec::qkv_bias)
      .def_rw("o_bias", &vm::DecoderLayerSpec::o_bias)
      .def_rw("qk_norm", &vm::DecoderLayerSpec::qk_norm)
      .def_rw("sandwich", &vm::DecoderLayerSpec::sandwich)
      .def_rw("gelu", &vm::DecoderLayerSpec::gelu)
      .def_prop_rw(
          "types",
          [](const vm::DecoderLayerSpec& s) {
            std::vector<int> out;
            for (auto t : s.types) out.push_back(static_cast<int>(t));
            return out;
          },
          [](vm::DecoderLayerSpec& s, const std::vector<int>& types) {
            s.types.clear();
            for (int t : types) s.types.push_back(static_cast<gguf::GGMLType>(t));
          },
          "GGML type ids of q, k, v, o, gate, up, down (F32 0, F16 1, BF16 30 for dense)")
      .def_rw("rotary_dim", &vm::DecoderLayerSpec::rotary_dim)
      .def_rw("neox", &vm::DecoderLayerSpec::neox)
      .def_rw("rope_mscale", &vm::DecoderLayerSpec::rope_mscale)
      .def_rw("scale", &vm::DecoderLayerSpec::scale)
      .def_rw("sliding_window", &vm::DecoderLayerSpec::sliding_window)
      .def_rw("softcap", &vm::DecoderLayerSpec::softcap)
      .def_rw("exact", &vm::DecoderLayerSpec::exact)
      .def_rw("lora", &vm::DecoderLayerSpec::lora)
      .def_rw("num_experts", &vm::DecoderLayerSpec::num_experts,
              "> 0: a sparse MoE MLP (router + experts) instead of the gated MLP")
      .def_rw("top_k", &vm::DecoderLayerSpec::top_k)
      .def_rw("moe_renormalize", &vm::DecoderLayerSpec::moe_renormalize)
      .def_rw("expert_blocks", &vm::DecoderLayerSpec::expert_blocks,
              "the experts are GGUF blocks (fused_moe_gguf), else dense (fused_moe)")
      .def_prop_rw(
          "router_type",
          [](const vm::DecoderLayerSpec& s) { return static_cast<int>(s.router_type); },
          [](vm::DecoderLayerSpec& s, int t) { s.router_type = static_cast<gguf::GGMLType>(t); },
          "GGML type id of the router's weight")
      .def("weight_names", &vm::DecoderLayerSpec::weight_names,
           "The order decoder_layer takes its weights in.");
  m.def(
      "decoder_layer",
      [](const mx::array& x, const mx::array& positions, const mx::array& slot_mapping,
         const mx::array& block_tables, const mx::array& seq_lens, const mx::array& cu_seqlens_q,
         const mx::array& key_cache, const mx::array& value_cache, const mx::array& rope_table,
         const std::vector<mx::array>& weights, const vm::DecoderLayerSpec& spec,
         std::optional<int64_t> num_decode_seqs, std::optional<int64_t> max_seq_len,
         std::optional<int64_t> max_query_len, const StreamArg& s) {
        return vm::decoder_layer(x, positions, slot_mapping, block_tables, seq_lens,
                                 cu_seqlens_q, key_cache, value_cache, rope_table, weights, spec,
                                 num_decode_seqs, max_seq_len, max_query_len,
                                 to_stream_or_device(s));
      },
      "x"_a, "positions"_a, "slot_mapping"_a, "block_tables"_a, "seq_lens"_a, "cu_seqlens_q"_a,
      "key_cache"_a, "value_cache"_a, "rope_table"_a, "weights"_a, "spec"_a, nb::kw_only(),
      "num_decode_seqs"_a = nb::none(), "max_seq_len"_a = nb::none(),
      "max_query_len"_a = nb::none(), "stream"_a = nb::none(),
      "One pre-norm llama-family decoder layer as one node:\n"
      "x [T, hidden] -> out [T, hidden]: the residual stream in, the residual stream out\n"
      "(x + attention + MLP). The step's keys and values are written into key_cache and\n"
      "value_cache IN PLACE at eval (vLLM's KV-cache contract; each cache must own its\n"
      "buffer alone). Metadata as paged_attention and reshape_and_cache take it, with its\n"
      "planning hints (needed on the Metal plan when the metadata is lazy); weights in\n"
      "spec.weight_names() order. The native CPU backend runs the CPU kernels; a GPU\n"
      "stream and the emulated backend run the fused Metal plan.");
  m.def(
      "plan_decoder_layer",
      [](const vm::DecoderLayerSpec& spec, const std::string& dtype, int64_t tokens,
         int64_t num_seqs, int64_t num_blocks, int64_t block_size, int64_t max_blocks,
         int64_t num_decode_seqs, int64_t max_seq_len, int64_t max_query_len) {
        vm::DecoderLayerProblem p;
        p.spec = spec;
        p.dtype = parse_float_dtype(dtype);
        p.tokens = tokens;
        p.num_slots = num_blocks * block_size;
        vm::PagedAttentionProblem& a = p.attention;
        a.dtype = p.dtype;
        a.num_tokens = tokens;
        a.num_seqs = num_seqs;
        a.num_q_heads = spec.num_heads;
        a.num_kv_heads = spec.num_kv_heads;
        a.head_size = spec.head_dim;
        a.block_size = block_size;
        a.num_blocks = num_blocks;
        a.max_blocks = max_blocks;
        a.num_decode_seqs = num_decode_seqs;
        a.max_seq_len = max_seq_len;
        a.max_query_len = max_query_len;
        a.sliding_window = spec.sliding_window;
        a.scale = spec.scale;
        a.softcap = spec.softcap;
        a.batch_invariant = vm::cpu::batch_invariant();
        if (a.batch_invariant) a.partition_size = vm::kInvariantPartitionSize;
        std::vector<std::pair<std::vector<int>, std::string>> outputs;
        auto shapes = vm::decoder_layer_output_shapes(p);
        auto dtypes = vm::decoder_layer_output_dtypes(p);
        for (size_t i = 0; i < shapes.size(); ++i) {
          outputs.push_back({std::vector<int>(shapes[i].begin(), shapes[i].end()),
                             vm::dtype_name(dtypes[i])});
        }
        return std::make_pair(vm::plan_decoder_layer(p), outputs);
      },
      "spec"_a, "dtype"_a, "tokens"_a, "num_seqs"_a, "num_blocks"_a, "block_size"_a,
      "max_blocks"_a, "num_decode_seqs"_a, "max_seq_len"_a, "max_query_len"_a,
      "Kernel launches of decoder_layer's Metal plan and its outputs as (shape, dtype),\n"
      "slot order: the op's inputs (x .. rope_table, the weights), then the outputs.");
}

}  // namespace vllm_metal::bindings
