// Bindings of the ops, their planners and the kernel backend switch. Thin:
// C++ functions bound by name, keyword arguments, a docstring each.
#include <nanobind/nanobind.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>

#include "bindings/bindings.h"
#include "bindings/common.h"
#include "cpu/batch_invariant.h"
#include "cpu/parallel.h"
#include "cpu/vec.h"
#include "mlx/array.h"
#include "mlx/utils.h"
#include "ops/emulator.h"
#include "ops/kernel_backend.h"
#include "ops/kernel_launch.h"
#include "ops/paged_attention.h"
#include "ops/reshape_and_cache.h"
#include "ops/rms_norm.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace mx = mlx::core;
namespace vm = vllm_metal;
using vllm_metal::bindings::parse_float_dtype;
using vllm_metal::bindings::StreamArg;
using vllm_metal::bindings::to_stream_or_device;

namespace {




void bind_launches(nb::module_& m) {
  nb::class_<vm::FunctionConstant>(m, "FunctionConstant")
      .def_ro("index", &vm::FunctionConstant::index)
      .def_prop_ro("type", [](const vm::FunctionConstant& c) {
        switch (c.type) {
          case vm::FunctionConstant::Type::kBool: return "bool";
          case vm::FunctionConstant::Type::kInt32: return "int32";
          case vm::FunctionConstant::Type::kUInt32: return "uint32";
          default: return "float32";
        }
      })
      .def_ro("bits", &vm::FunctionConstant::bits);
  nb::class_<vm::BufferBinding>(m, "BufferBinding")
      .def_ro("index", &vm::BufferBinding::index)
      .def_ro("array_slot", &vm::BufferBinding::array_slot)
      .def_ro("byte_offset", &vm::BufferBinding::byte_offset)
      .def_ro("read_before_in_place_write", &vm::BufferBinding::read_before_in_place_write);
  nb::class_<vm::KernelLaunch>(m, "KernelLaunch",
                               "One Metal kernel launch as data (see kernel_launch.h).")
      .def_ro("source", &vm::KernelLaunch::source)
      .def_ro("kernel", &vm::KernelLaunch::kernel)
      .def_ro("constants", &vm::KernelLaunch::constants)
      .def_ro("buffers", &vm::KernelLaunch::buffers)
      .def_ro("args_index", &vm::KernelLaunch::args_index)
      .def_prop_ro("args", [](const vm::KernelLaunch& l) {
        return nb::bytes(reinterpret_cast<const char*>(l.args.data()), l.args.size());
      })
      .def_ro("grid", &vm::KernelLaunch::grid)
      .def_ro("threadgroup", &vm::KernelLaunch::threadgroup)
      .def_ro("threadgroup_memory", &vm::KernelLaunch::threadgroup_memory);
}

void bind_planners(nb::module_& m) {
  m.def(
      "plan_rms_norm",
      [](const std::string& dtype, int64_t rows, int64_t hidden, bool fused_add, float eps) {
        vm::RmsNormProblem p;
        p.dtype = parse_float_dtype(dtype);
        p.rows = rows;
        p.hidden = hidden;
        p.x_row_stride = p.residual_row_stride = hidden;
        p.fused_add = fused_add;
        p.eps = eps;
        return vm::plan_rms_norm(p);
      },
      "dtype"_a, "rows"_a, "hidden"_a, "fused_add"_a = false, "eps"_a = 1e-6f,
      "Kernel launches of rms_norm for row-contiguous inputs.");
  m.def("metal_attention_head_sizes", &vm::metal_head_sizes,
        "Head sizes the Metal paged-attention kernels are built for.");
  m.def(
      "paged_attention_head_size_problem",
      [](int64_t head_size, bool metal) { return vm::head_size_problem(head_size, metal); },
      "head_size"_a, nb::kw_only(), "metal"_a,
      "Why paged_attention cannot take head_size ('' when it can); metal: on the Metal\n"
      "kernels (GPU or emulated) rather than the CPU kernel.");
  m.def(
      "plan_paged_attention",
      [](const std::string& dtype, int64_t num_tokens, int64_t num_seqs, int64_t num_q_heads,
         int64_t num_kv_heads, int64_t head_size, int64_t block_size, int64_t num_blocks,
         int64_t max_blocks, int64_t num_decode_seqs, int64_t max_seq_len,
         int64_t max_query_len, float scale, int64_t sliding_window, float softcap,
         bool has_sinks, int64_t partition_size) {
        vm::PagedAttentionProblem p;
        p.dtype = parse_float_dtype(dtype);
        p.num_tokens = num_tokens;
        p.num_seqs = num_seqs;
        p.num_q_heads = num_q_heads;
        p.num_kv_heads = num_kv_heads;
        p.head_size = head_size;
        p.block_size = block_size;
        p.num_blocks = num_blocks;
        p.max_blocks = max_blocks;
        p.q_token_stride = num_q_heads * head_size;
        p.q_head_stride = head_size;
        p.num_decode_seqs = num_decode_seqs;
        p.max_seq_len = max_seq_len;
        p.max_query_len = max_query_len;
        p.scale = scale;
        p.sliding_window = sliding_window;
        p.softcap = softcap;
        p.has_sinks = has_sinks;
        p.partition_size = partition_size;
        p.batch_invariant = vm::cpu::batch_invariant();
        return vm::plan_paged_attention(p);
      },
      "dtype"_a, "num_tokens"_a, "num_seqs"_a, "num_q_heads"_a, "num_kv_heads"_a, "head_size"_a,
      "block_size"_a, "num_blocks"_a, "max_blocks"_a, "num_decode_seqs"_a, "max_seq_len"_a,
      "max_query_len"_a, "scale"_a = 1.0f, "sliding_window"_a = 0, "softcap"_a = 0.0f,
      "has_sinks"_a = false, "partition_size"_a = 512,
      "Kernel launches of paged_attention for a contiguous q (slots: see paged_attention.h).");
  m.def(
      "plan_cache_write",
      [](const std::string& dtype, int64_t num_tokens, int64_t num_heads, int64_t head_size,
         int64_t num_slots, std::array<int64_t, 3> src_strides, bool copy_cache) {
        vm::CacheWriteProblem p;
        p.dtype = parse_float_dtype(dtype);
        p.num_tokens = num_tokens;
        p.num_heads = num_heads;
        p.head_size = head_size;
        p.num_slots = num_slots;
        for (int i = 0; i < 3; ++i) p.src_strides[i] = src_strides[i];
        p.copy_cache = copy_cache;
        return vm::plan_cache_write(p);
      },
      "dtype"_a, "num_tokens"_a, "num_heads"_a, "head_size"_a, "num_slots"_a, "src_strides"_a,
      "copy_cache"_a = false,
      "Kernel launches writing one cache (reshape_and_cache runs one per cache); strides in\n"
      "elements. Slots: 0 src, 1 cache, 2 slot_mapping, 3 cache_out.");

}

}  // namespace

namespace vllm_metal::bindings {

void bind_ops(nb::module_& m) {
  m.def(
      "rms_norm",
      [](const mx::array& x, const mx::array& weight, float eps, const StreamArg& s) {
        return vm::rms_norm(x, weight, eps, to_stream_or_device(s));
      },
      "x"_a, "weight"_a, "eps"_a, nb::kw_only(), "stream"_a = nb::none(),
      "x * rsqrt(mean(x**2, axis=-1) + eps) * weight, computed in float32.");
  m.def(
      "add_rms_norm",
      [](const mx::array& x, const mx::array& residual, const mx::array& weight, float eps,
         const StreamArg& s) {
        auto r = vm::add_rms_norm(x, residual, weight, eps, to_stream_or_device(s));
        return nb::make_tuple(r[0], r[1]);
      },
      "x"_a, "residual"_a, "weight"_a, "eps"_a, nb::kw_only(), "stream"_a = nb::none(),
      "h = x + residual (in x.dtype); returns (rms_norm(h, weight, eps), h).");
  m.def(
      "reshape_and_cache",
      [](const mx::array& key, const mx::array& value, const mx::array& key_cache,
         const mx::array& value_cache, const mx::array& slot_mapping, bool inplace,
         const StreamArg& s) {
        auto r = vm::reshape_and_cache(key, value, key_cache, value_cache, slot_mapping,
                                       inplace, to_stream_or_device(s));
        return nb::make_tuple(r[0], r[1]);
      },
      "key"_a, "value"_a, "key_cache"_a, "value_cache"_a, "slot_mapping"_a, nb::kw_only(),
      "inplace"_a = false, "stream"_a = nb::none(),
      "Write key/value [T, H, D] into the paged caches at slot_mapping (int64, < 0 skips);\n"
      "returns the updated (key_cache, value_cache). A cache still held elsewhere is copied\n"
      "first unless inplace=True (then its buffer is written: rebind the caches to the result).");
  m.def("cache_write_copies", &vm::cache_write_copies,
        "Whole KV-cache copies reshape_and_cache has made in this process (caches it could\n"
        "not update in place).");

  m.def(
      "paged_attention",
      [](const mx::array& q, const mx::array& key_cache, const mx::array& value_cache,
         const mx::array& block_tables, const mx::array& seq_lens, const mx::array& cu_seqlens_q,
         float scale, int64_t sliding_window, float softcap,
         const std::optional<mx::array>& sinks, std::optional<int64_t> num_decode_seqs,
         std::optional<int64_t> max_seq_len, std::optional<int64_t> max_query_len,
         const StreamArg& s) {
        vm::PagedAttentionOptions o;
        o.scale = scale;
        o.sliding_window = sliding_window;
        o.softcap = softcap;
        o.num_decode_seqs = num_decode_seqs;
        o.max_seq_len = max_seq_len;
        o.max_query_len = max_query_len;
        return vm::paged_attention(q, key_cache, value_cache, block_tables, seq_lens,
                                   cu_seqlens_q, o, sinks, to_stream_or_device(s));
      },
      "q"_a, "key_cache"_a, "value_cache"_a, "block_tables"_a, "seq_lens"_a, "cu_seqlens_q"_a,
      nb::kw_only(), "scale"_a, "sliding_window"_a = 0, "softcap"_a = 0.0f,
      "sinks"_a = nb::none(), "num_decode_seqs"_a = nb::none(), "max_seq_len"_a = nb::none(),
      "max_query_len"_a = nb::none(), "stream"_a = nb::none(),
      "Attention of packed rows q [T, Hq, D] (decode rows first) against the paged KV cache.\n"
      "seq_lens: context incl. new tokens; sliding_window: last W positions (0 = all);\n"
      "softcap: tanh soft-capping (0 = off); sinks: float32 [Hq] extra logits.");
  m.def(
      "set_kernel_backend",
      [](const std::string& name) { vm::set_default_kernel_backend(vm::parse_kernel_backend(name)); },
      "name"_a, "'native' (C++ CPU kernels / Metal) or 'emulated' (Metal kernels in mslemu).");
  m.def("kernel_backend", [] { return std::string(vm::kernel_backend_name(vm::default_kernel_backend())); });
  m.def("register_emulated_library", &vm::emulator::register_library, "source"_a, "so_path"_a,
        "Make the emulator-built kernels of src/metal/<source>.metal runnable.");
  m.def("has_emulated_library", &vm::emulator::has_library, "source"_a);
  m.def("set_num_threads", &vm::cpu::set_num_threads, "n"_a,
        "Threads of the CPU kernels (0 = all cores).");
  m.def("num_threads", &vm::cpu::num_threads);
  m.def("set_batch_invariant", &vm::cpu::set_batch_invariant, "on"_a,
        "Batch-invariant kernels: a row's result independent of the rest of the batch.");
  m.def("batch_invariant", &vm::cpu::batch_invariant);
  m.def("has_avx2_fma", &vm::cpu::has_avx2_fma);

  bind_launches(m);
  bind_planners(m);
}

}  // namespace vllm_metal::bindings
