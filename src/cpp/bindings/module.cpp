// vllm_metal._core: the nanobind module. Each area binds itself in its own
// file (bindings.h); no logic lives here.
#include <nanobind/nanobind.h>

#include "bindings/bindings.h"

NB_MODULE(_core, m) {
  m.doc() = "vllm-metal C++ runtime and ops";
  vllm_metal::bindings::bind_ops(m);
  vllm_metal::bindings::bind_runtime_pool(m);
  vllm_metal::bindings::bind_rope(m);
  vllm_metal::bindings::bind_runtime_packer(m);
  vllm_metal::bindings::bind_gguf(m);
  vllm_metal::bindings::bind_hybrid(m);
  vllm_metal::bindings::bind_decoder_layer(m);
  vllm_metal::bindings::bind_step_recording(m);
  vllm_metal::bindings::bind_structured_outputs(m);
  vllm_metal::bindings::bind_runtime_kv_manager(m);
  vllm_metal::bindings::bind_moe(m);
  vllm_metal::bindings::bind_encoder(m);
  vllm_metal::bindings::bind_lora(m);
}
