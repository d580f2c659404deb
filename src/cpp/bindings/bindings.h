// One bind_* function per area; module.cpp calls them all.
#pragma once

#include <nanobind/nanobind.h>

namespace vllm_metal::bindings {

void bind_ops(nanobind::module_& m);
void bind_runtime_pool(nanobind::module_& m);
void bind_rope(nanobind::module_& m);
void bind_runtime_packer(nanobind::module_& m);
void bind_gguf(nanobind::module_& m);
void bind_hybrid(nanobind::module_& m);
void bind_decoder_layer(nanobind::module_& m);
void bind_step_recording(nanobind::module_& m);
void bind_structured_outputs(nanobind::module_& m);
void bind_runtime_kv_manager(nanobind::module_& m);
void bind_moe(nanobind::module_& m);
void bind_encoder(nanobind::module_& m);
void bind_lora(nanobind::module_& m);

}  // namespace vllm_metal::bindings
