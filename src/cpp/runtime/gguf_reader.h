// GGUF reader: memory-mapped, validated, zero-copy (plain C++17, no MLX).
//
// Supports GGUF v2 and v3 (little-endian). Every length, count, offset and size
// is checked against the file before it is used, so a truncated, oversized,
// misaligned or inconsistent file raises GGUFError naming the problem and the
// byte offset; the parser never reads outside the mapping. Tensor data stays in
// the mapping: `tensor_data()` points into it (memory ≈ file size).
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "runtime/gguf_types.h"

namespace vllm_metal::gguf {

class GGUFError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Metadata value types (on-disk ids).
enum class ValueType : uint32_t {
  kU8 = 0,
  kI8 = 1,
  kU16 = 2,
  kI16 = 3,
  kU32 = 4,
  kI32 = 5,
  kF32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kU64 = 10,
  kI64 = 11,
  kF64 = 12,
};

const char* value_type_name(ValueType t);
// Bytes of one scalar of type t; 0 for strings and arrays.
size_t value_type_size(ValueType t);

// One metadata value. Scalars: `scalar` holds the little-endian bytes (read with
// as_*). Strings: `str`. Arrays: `elem_type`, `count` and either `raw` (packed
// scalars, count * value_type_size(elem_type) bytes) or `strings`. Arrays of
// arrays are refused at parse time (no GGUF producer writes them).
struct Value {
  ValueType type = ValueType::kU8;
  uint64_t scalar = 0;  // raw bits of a scalar, zero-extended
  std::string str;
  ValueType elem_type = ValueType::kU8;
  uint64_t count = 0;
  std::vector<uint8_t> raw;
  std::vector<std::string> strings;

  bool is_integer() const;        // scalar integer (any width) or bool
  int64_t as_int() const;         // integer scalars (u64 above INT64_MAX throws)
  uint64_t as_uint() const;       // non-negative integer scalars
  double as_float() const;        // f32/f64 and integer scalars
  bool as_bool() const;
  const std::string& as_string() const;
  // Element i of a numeric array as double / int64.
  double array_float(uint64_t i) const;
  int64_t array_int(uint64_t i) const;
};

struct TensorInfo {
  std::string name;
  GGMLType type = GGMLType::kF32;
  std::vector<int64_t> ne;     // GGUF order: ne[0] is the contiguous (innermost) axis
  uint64_t offset = 0;         // relative to the data section
  uint64_t nbytes = 0;
  const uint8_t* data = nullptr;  // into the mapping

  int64_t num_elements() const;
  // Row-major shape (NumPy / MLX order): reversed ne.
  std::vector<int64_t> shape() const;
};

struct ReadOptions {
  // Refuse tensors whose type our kernels cannot decode (IQ1_*, IQ2_*, TQ*,...).
  bool require_supported_types = true;
};

class GGUFFile {
 public:
  // Maps and validates `path`. Throws GGUFError.
  static std::shared_ptr<GGUFFile> open(const std::string& path, ReadOptions opts = {});
  // Parses a buffer the caller keeps alive (tests, fuzzing). Throws GGUFError.
  static std::shared_ptr<GGUFFile> parse(const uint8_t* data, size_t size,
                                         ReadOptions opts = {}, std::string label = "<buffer>");
  ~GGUFFile();
  GGUFFile(const GGUFFile&) = delete;
  GGUFFile& operator=(const GGUFFile&) = delete;

  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  uint64_t data_offset() const { return data_offset_; }  // file offset of the data section
  size_t file_size() const { return size_; }
  const std::string& path() const { return label_; }

  // Metadata in file order.
  const std::vector<std::pair<std::string, Value>>& metadata() const { return kv_; }
  const Value* find(const std::string& key) const;  // null when absent
  const Value& get(const std::string& key) const;   // throws GGUFError when absent

  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* find_tensor(const std::string& name) const;
  const TensorInfo& tensor(const std::string& name) const;  // throws GGUFError

 private:
  GGUFFile() = default;
  void parse_all(const ReadOptions& opts);

  const uint8_t* base_ = nullptr;
  size_t size_ = 0;
  void* mapping_ = nullptr;  // munmap on destruction when we mapped the file
  std::string label_;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  uint64_t data_offset_ = 0;
  std::vector<std::pair<std::string, Value>> kv_;
  std::unordered_map<std::string, size_t> kv_index_;
  std::vector<TensorInfo> tensors_;
  std::unordered_map<std::string, size_t> tensor_index_;
};

}  // namespace vllm_metal::gguf
