// Bindings of the fused CPU decoder layer (ops/decoder_layer.h) and of silu_and_mul.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "bindings/bindings.h"
#include "bindings/common.h"
#include "mlx/array.h"
#include "ops/decoder_layer.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace mx = mlx::core;
namespace vm = vllm_metal;
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
      .def("weight_names", &vm::DecoderLayerSpec::weight_names,
           "The order decoder_layer takes its weights in.");
  m.def(
      "decoder_layer",
      [](const mx::array& x, const mx::array& positions, const mx::array& slot_mapping,
         const mx::array& block_tables, const mx::array& seq_lens, const mx::array& cu_seqlens_q,
         const mx::array& key_cache, const mx::array& value_cache, const mx::array& rope_table,
         const std::vector<mx::array>& weights, const vm::DecoderLayerSpec& spec,
         const StreamArg& s) {
        return vm::decoder_layer(x, positions, slot_mapping, block_tables, seq_lens,
                                 cu_seqlens_q, key_cache, value_cache, rope_table, weights, spec,
                                 to_stream_or_device(s));
      },
      "x"_a, "positions"_a, "slot_mapping"_a, "block_tables"_a, "seq_lens"_a, "cu_seqlens_q"_a,
      "key_cache"_a, "value_cache"_a, "rope_table"_a, "weights"_a, "spec"_a, nb::kw_only(),
      "stream"_a = nb::none(),
      "One pre-norm llama-family decoder layer on the CPU as one node:\n"
      "x [T, hidden] -> out [T, hidden]: the residual stream in, the residual stream out\n"
      "(x + attention + MLP). The step's keys and values are written into key_cache and\n"
      "value_cache IN PLACE at eval (vLLM's KV-cache contract; each cache must own its\n"
      "buffer alone). Metadata as paged_attention and reshape_and_cache take it; weights\n"
      "in spec.weight_names() order. Native CPU backend only.");
}

}  // namespace vllm_metal::bindings
