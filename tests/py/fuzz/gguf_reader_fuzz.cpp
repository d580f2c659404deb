// libFuzzer target of the GGUF reader: any byte string either parses or throws
// GGUFError; the sanitizers catch out-of-bounds reads, overflows and leaks.
// Built and run (bounded) by tests/py/test_gguf_fuzz.py.
#include <cstddef>
#include <cstdint>

#include "runtime/gguf_reader.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace g = vllm_metal::gguf;
  for (bool strict : {true, false}) {
    try {
      g::ReadOptions o;
      o.require_supported_types = strict;
      auto f = g::GGUFFile::parse(data, size, o);
      // touch everything the parser handed out
      size_t sum = 0;
      for (const auto& t : f->tensors()) {
        if (t.nbytes) sum += t.data[0] + t.data[t.nbytes - 1];
        sum += static_cast<size_t>(t.num_elements());
      }
      for (const auto& kv : f->metadata()) {
        const g::Value& v = kv.second;
        if (v.type == g::ValueType::kArray && v.count && v.elem_type != g::ValueType::kString) {
          sum += static_cast<size_t>(v.array_float(v.count - 1) != 0);
        }
      }
      if (sum == 1) return 0;  // keep `sum` observable
    } catch (const g::GGUFError&) {
    }
  }
  return 0;
}
