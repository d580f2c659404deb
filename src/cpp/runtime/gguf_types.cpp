#include "runtime/gguf_types.h"

#include <cctype>

namespace vllm_metal::gguf {

namespace {

struct Entry {
  uint32_t id;
  TypeInfo info;
};

// Block geometry of every type GGUF files can carry (facts of the format).
constexpr Entry kTypes[] = {
    {0, {"F32", 1, 4, true}},
    {1, {"F16", 1, 2, true}},
    {2, {"Q4_0", 32, 18, true}},
    {3, {"Q4_1", 32, 20, true}},
    {6, {"Q5_0", 32, 22, true}},
    {7, {"Q5_1", 32, 24, true}},
    {8, {"Q8_0", 32, 34, true}},
    {9, {"Q8_1", 32, 40, false}},
    {10, {"Q2_K", 256, 84, true}},
    {11, {"Q3_K", 256, 110, true}},
    {12, {"Q4_K", 256, 144, true}},
    {13, {"Q5_K", 256, 176, true}},
    {14, {"Q6_K", 256, 210, true}},
    {15, {"Q8_K", 256, 292, false}},
    {16, {"IQ2_XXS", 256, 66, false}},
    {17, {"IQ2_XS", 256, 74, false}},
    {18, {"IQ3_XXS", 256, 98, true}},
    {19, {"IQ1_S", 256, 50, false}},
    {20, {"IQ4_NL", 32, 18, true}},
    {21, {"IQ3_S", 256, 110, true}},
    {22, {"IQ2_S", 256, 82, false}},
    {23, {"IQ4_XS", 256, 136, true}},
    {24, {"I8", 1, 1, false}},
    {25, {"I16", 1, 2, false}},
    {26, {"I32", 1, 4, false}},
    {27, {"I64", 1, 8, false}},
    {28, {"F64", 1, 8, false}},
    {29, {"IQ1_M", 256, 56, false}},
    {30, {"BF16", 1, 2, true}},
    {34, {"TQ1_0", 256, 54, false}},
    {35, {"TQ2_0", 256, 66, false}},
    {39, {"MXFP4", 32, 17, true}},
    {40, {"NVFP4", 64, 36, false}},
    {41, {"Q1_0", 128, 18, false}},
};

}  // namespace

TypeInfo type_info(uint32_t type_id) {
  for (const auto& e : kTypes) {
    if (e.id == type_id) return e.info;
  }
  return {};
}

std::string type_name(uint32_t type_id) {
  TypeInfo t = type_info(type_id);
  return t.name ? std::string(t.name) : "type " + std::to_string(type_id);
}

std::string type_kernel_name(GGMLType t) {
  std::string s = type_name(static_cast<uint32_t>(t));
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

bool parse_type_name(const std::string& name, GGMLType* out) {
  std::string up = name;
  for (auto& c : up) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  for (const auto& e : kTypes) {
    if (up == e.info.name) {
      *out = static_cast<GGMLType>(e.id);
      return true;
    }
  }
  return false;
}

std::string supported_type_names() {
  std::string s;
  for (const auto& e : kTypes) {
    if (!e.info.supported) continue;
    if (!s.empty()) s += ", ";
    s += e.info.name;
  }
  return s;
}

int64_t row_bytes(GGMLType t, int64_t n) {
  TypeInfo info = type_info(t);
  if (!info.name || n < 0 || n % info.block_size != 0) return -1;
  return n / info.block_size * info.type_size;
}

}  // namespace vllm_metal::gguf
