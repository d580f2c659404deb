#include "runtime/gguf_reader.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>

namespace vllm_metal::gguf {

namespace {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" read as a little-endian u32
constexpr uint32_t kMaxDims = 4;
constexpr uint64_t kDefaultAlignment = 32;
constexpr uint64_t kMaxAlignment = uint64_t(1) << 30;

// Bounds-checked little-endian cursor over the file bytes.
class Cursor {
 public:
  Cursor(const uint8_t* base, size_t size, const std::string& label)
      : base_(base), size_(size), label_(label) {}

  size_t pos() const { return pos_; }
  size_t remaining() const { return size_ - pos_; }

  [[noreturn]] void fail(const std::string& what) const { fail_at(pos_, what); }
  [[noreturn]] void fail_at(size_t at, const std::string& what) const {
    throw GGUFError("[gguf] " + label_ + ": " + what + " (at byte " + std::to_string(at) + ")");
  }

  void need(uint64_t n, const char* what) const {
    if (n > remaining()) {
      fail("file is truncated: " + std::string(what) + " needs " + std::to_string(n) +
           " bytes, " + std::to_string(remaining()) + " left");
    }
  }
  template <typename T>
  T read(const char* what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, base_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  const uint8_t* take(uint64_t n, const char* what) {
    need(n, what);
    const uint8_t* p = base_ + pos_;
    pos_ += n;
    return p;
  }
  std::string read_string(const char* what) {
    uint64_t n = read<uint64_t>(what);
    const uint8_t* p = take(n, what);
    return std::string(reinterpret_cast<const char*>(p), n);
  }

 private:
  const uint8_t* base_;
  size_t size_;
  size_t pos_ = 0;
  const std::string& label_;
};

bool valid_value_type(uint32_t t) { return t <= 12; }

// Strict UTF-8 (no overlongs, surrogates or code points past U+10FFFF).
bool valid_utf8(const std::string& s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t i = 0, n = s.size();
  while (i < n) {
    unsigned c = p[i];
    size_t len;
    uint32_t cp;
    if (c < 0x80) { ++i; continue; }
    if ((c & 0xE0) == 0xC0) { len = 2; cp = c & 0x1F; }
    else if ((c & 0xF0) == 0xE0) { len = 3; cp = c & 0x0F; }
    else if ((c & 0xF8) == 0xF0) { len = 4; cp = c & 0x07; }
    else return false;
    if (n - i < len) return false;
    for (size_t j = 1; j < len; ++j) {
      if ((p[i + j] & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (p[i + j] & 0x3F);
    }
    if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) ||
        cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
      return false;
    }
    i += len;
  }
  return true;
}

void read_scalar(Cursor& c, ValueType t, Value& v, const std::string& key) {
  size_t at = c.pos();
  size_t n = value_type_size(t);
  const uint8_t* p = c.take(n, "metadata value");
  uint64_t bits = 0;
  std::memcpy(&bits, p, n);
  if (t == ValueType::kBool && bits > 1) {
    c.fail_at(at, "metadata '" + key + "': bool value must be 0 or 1, got " +
                      std::to_string(bits));
  }
  v.scalar = bits;
}

Value read_value(Cursor& c, uint32_t type_id, const std::string& key) {
  if (!valid_value_type(type_id)) {
    c.fail("metadata '" + key + "' has unknown value type " + std::to_string(type_id));
  }
  Value v;
  v.type = static_cast<ValueType>(type_id);
  switch (v.type) {
    case ValueType::kString:
      v.str = c.read_string("metadata string");
      break;
    case ValueType::kArray: {
      uint32_t et = c.read<uint32_t>("array element type");
      if (!valid_value_type(et)) {
        c.fail("metadata '" + key + "' is an array of unknown value type " + std::to_string(et));
      }
      v.elem_type = static_cast<ValueType>(et);
      if (v.elem_type == ValueType::kArray) {
        c.fail("metadata '" + key + "' is an array of arrays, which is not supported");
      }
      v.count = c.read<uint64_t>("array length");
      if (v.elem_type == ValueType::kString) {
        // each string needs at least its 8-byte length: bounds the allocation
        if (v.count > c.remaining() / 8) {
          c.fail("metadata '" + key + "': array of " + std::to_string(v.count) +
                 " strings does not fit in the file");
        }
        v.strings.reserve(v.count);
        for (uint64_t i = 0; i < v.count; ++i) v.strings.push_back(c.read_string("array string"));
      } else {
        size_t es = value_type_size(v.elem_type);
        if (v.count > c.remaining() / es) {
          c.fail("metadata '" + key + "': array of " + std::to_string(v.count) + " " +
                 value_type_name(v.elem_type) + " does not fit in the file");
        }
        const uint8_t* p = c.take(v.count * es, "array data");
        v.raw.assign(p, p + v.count * es);
        if (v.elem_type == ValueType::kBool) {
          for (uint8_t b : v.raw) {
            if (b > 1) c.fail("metadata '" + key + "': bool array element must be 0 or 1");
          }
        }
      }
      break;
    }
    default:
      read_scalar(c, v.type, v, key);
  }
  return v;
}

template <typename T>
T load_raw(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

double scalar_as_double(ValueType t, const uint8_t* p) {
  switch (t) {
    case ValueType::kU8: return load_raw<uint8_t>(p);
    case ValueType::kI8: return load_raw<int8_t>(p);
    case ValueType::kU16: return load_raw<uint16_t>(p);
    case ValueType::kI16: return load_raw<int16_t>(p);
    case ValueType::kU32: return load_raw<uint32_t>(p);
    case ValueType::kI32: return load_raw<int32_t>(p);
    case ValueType::kF32: return load_raw<float>(p);
    case ValueType::kBool: return load_raw<uint8_t>(p);
    case ValueType::kU64: return static_cast<double>(load_raw<uint64_t>(p));
    case ValueType::kI64: return static_cast<double>(load_raw<int64_t>(p));
    case ValueType::kF64: return load_raw<double>(p);
    default: throw GGUFError("[gguf] value is not numeric");
  }
}

bool is_int_type(ValueType t) {
  switch (t) {
    case ValueType::kU8: case ValueType::kI8: case ValueType::kU16: case ValueType::kI16:
    case ValueType::kU32: case ValueType::kI32: case ValueType::kU64: case ValueType::kI64:
    case ValueType::kBool:
      return true;
    default:
      return false;
  }
}

int64_t scalar_as_int(ValueType t, const uint8_t* p) {
  switch (t) {
    case ValueType::kU8: return load_raw<uint8_t>(p);
    case ValueType::kI8: return load_raw<int8_t>(p);
    case ValueType::kU16: return load_raw<uint16_t>(p);
    case ValueType::kI16: return load_raw<int16_t>(p);
    case ValueType::kU32: return load_raw<uint32_t>(p);
    case ValueType::kI32: return load_raw<int32_t>(p);
    case ValueType::kBool: return load_raw<uint8_t>(p);
    case ValueType::kI64: return load_raw<int64_t>(p);
    case ValueType::kU64: {
      uint64_t u = load_raw<uint64_t>(p);
      if (u > uint64_t(std::numeric_limits<int64_t>::max())) {
        throw GGUFError("[gguf] u64 value " + std::to_string(u) + " does not fit in int64");
      }
      return static_cast<int64_t>(u);
    }
    default: throw GGUFError(std::string("[gguf] value of type ") + value_type_name(t) +
                             " is not an integer");
  }
}

}  // namespace

const char* value_type_name(ValueType t) {
  static const char* names[] = {"u8",  "i8",   "u16",    "i16",   "u32", "i32", "f32",
                                "bool", "string", "array", "u64", "i64", "f64"};
  auto i = static_cast<uint32_t>(t);
  return i <= 12 ? names[i] : "unknown";
}

size_t value_type_size(ValueType t) {
  switch (t) {
    case ValueType::kU8: case ValueType::kI8: case ValueType::kBool: return 1;
    case ValueType::kU16: case ValueType::kI16: return 2;
    case ValueType::kU32: case ValueType::kI32: case ValueType::kF32: return 4;
    case ValueType::kU64: case ValueType::kI64: case ValueType::kF64: return 8;
    default: return 0;
  }
}

bool Value::is_integer() const { return is_int_type(type); }

int64_t Value::as_int() const {
  return scalar_as_int(type, reinterpret_cast<const uint8_t*>(&scalar));
}

uint64_t Value::as_uint() const {
  if (type == ValueType::kU64) return scalar;
  int64_t v = as_int();
  if (v < 0) throw GGUFError("[gguf] value " + std::to_string(v) + " is negative");
  return static_cast<uint64_t>(v);
}

double Value::as_float() const {
  if (type == ValueType::kString || type == ValueType::kArray) {
    throw GGUFError(std::string("[gguf] value of type ") + value_type_name(type) +
                    " is not a number");
  }
  return scalar_as_double(type, reinterpret_cast<const uint8_t*>(&scalar));
}

bool Value::as_bool() const {
  if (type != ValueType::kBool) {
    throw GGUFError(std::string("[gguf] value of type ") + value_type_name(type) +
                    " is not a bool");
  }
  return scalar != 0;
}

const std::string& Value::as_string() const {
  if (type != ValueType::kString) {
    throw GGUFError(std::string("[gguf] value of type ") + value_type_name(type) +
                    " is not a string");
  }
  return str;
}

double Value::array_float(uint64_t i) const {
  if (type != ValueType::kArray || i >= count || elem_type == ValueType::kString) {
    throw GGUFError("[gguf] not a numeric array element");
  }
  return scalar_as_double(elem_type, raw.data() + i * value_type_size(elem_type));
}

int64_t Value::array_int(uint64_t i) const {
  if (type != ValueType::kArray || i >= count || elem_type == ValueType::kString) {
    throw GGUFError("[gguf] not a numeric array element");
  }
  return scalar_as_int(elem_type, raw.data() + i * value_type_size(elem_type));
}

int64_t TensorInfo::num_elements() const {
  int64_t n = 1;
  for (int64_t d : ne) n *= d;  // validated at parse time not to overflow
  return n;
}

std::vector<int64_t> TensorInfo::shape() const { return {ne.rbegin(), ne.rend()}; }

GGUFFile::~GGUFFile() {
  if (mapping_) munmap(mapping_, size_);
}

std::shared_ptr<GGUFFile> GGUFFile::open(const std::string& path, ReadOptions opts) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    throw GGUFError("[gguf] cannot open " + path + ": " + std::strerror(errno));
  }
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw GGUFError("[gguf] " + path + " is not a regular file");
  }
  size_t size = static_cast<size_t>(st.st_size);
  if (size < 24) {
    ::close(fd);
    throw GGUFError("[gguf] " + path + ": file is truncated: " + std::to_string(size) +
                    " bytes is smaller than a GGUF header (24 bytes)");
  }
  void* m = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (m == MAP_FAILED) {
    throw GGUFError("[gguf] cannot map " + path + ": " + std::strerror(errno));
  }
  std::shared_ptr<GGUFFile> f(new GGUFFile());
  f->mapping_ = m;
  f->base_ = static_cast<const uint8_t*>(m);
  f->size_ = size;
  f->label_ = path;
  f->parse_all(opts);
  return f;
}

std::shared_ptr<GGUFFile> GGUFFile::parse(const uint8_t* data, size_t size, ReadOptions opts,
                                          std::string label) {
  std::shared_ptr<GGUFFile> f(new GGUFFile());
  f->base_ = data;
  f->size_ = size;
  f->label_ = std::move(label);
  f->parse_all(opts);
  return f;
}

void GGUFFile::parse_all(const ReadOptions& opts) {
  Cursor c(base_, size_, label_);
  uint32_t magic = c.read<uint32_t>("magic");
  if (magic != kMagic) c.fail_at(0, "not a GGUF file (bad magic)");
  version_ = c.read<uint32_t>("version");
  if (version_ == 1) c.fail_at(4, "GGUF version 1 is not supported (need 2 or 3)");
  if (version_ != 2 && version_ != 3) {
    if ((version_ & 0xffff) == 0 && version_ != 0) {
      c.fail_at(4, "big-endian GGUF files are not supported");
    }
    c.fail_at(4, "unsupported GGUF version " + std::to_string(version_) + " (need 2 or 3)");
  }
  uint64_t n_tensors = c.read<uint64_t>("tensor count");
  uint64_t n_kv = c.read<uint64_t>("metadata count");
  // Lower bounds on the encoded size keep the reservations proportional to the file.
  if (n_kv > c.remaining() / 13) {
    c.fail_at(16, "metadata count " + std::to_string(n_kv) + " does not fit in the file");
  }
  if (n_tensors > c.remaining() / 24) {
    c.fail_at(8, "tensor count " + std::to_string(n_tensors) + " does not fit in the file");
  }

  kv_.reserve(n_kv);
  for (uint64_t i = 0; i < n_kv; ++i) {
    size_t at = c.pos();
    std::string key = c.read_string("metadata key");
    if (key.empty()) c.fail_at(at, "metadata key " + std::to_string(i) + " is empty");
    if (!valid_utf8(key)) c.fail_at(at, "metadata key " + std::to_string(i) + " is not valid UTF-8");
    uint32_t t = c.read<uint32_t>("metadata value type");
    Value v = read_value(c, t, key);
    if (!kv_index_.emplace(key, kv_.size()).second) {
      c.fail_at(at, "duplicate metadata key '" + key + "'");
    }
    kv_.emplace_back(std::move(key), std::move(v));
  }

  alignment_ = kDefaultAlignment;
  if (const Value* a = find("general.alignment")) {
    if (a->type != ValueType::kU32) {
      throw GGUFError("[gguf] " + label_ + ": general.alignment must be u32, got " +
                      value_type_name(a->type));
    }
    uint64_t al = a->scalar;
    if (al == 0 || (al & (al - 1)) != 0 || al > kMaxAlignment) {
      throw GGUFError("[gguf] " + label_ + ": general.alignment must be a power of two, got " +
                      std::to_string(al));
    }
    alignment_ = al;
  }

  tensors_.reserve(n_tensors);
  for (uint64_t i = 0; i < n_tensors; ++i) {
    size_t at = c.pos();
    TensorInfo t;
    t.name = c.read_string("tensor name");
    if (t.name.empty()) c.fail_at(at, "tensor " + std::to_string(i) + " has an empty name");
    if (!valid_utf8(t.name)) {
      c.fail_at(at, "tensor " + std::to_string(i) + " name is not valid UTF-8");
    }
    const std::string tn = "tensor '" + t.name + "'";
    uint32_t n_dims = c.read<uint32_t>("tensor dimension count");
    if (n_dims == 0 || n_dims > kMaxDims) {
      c.fail(tn + " has " + std::to_string(n_dims) + " dimensions (need 1 to 4)");
    }
    int64_t elements = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      uint64_t ne = c.read<uint64_t>("tensor dimension");
      if (ne > uint64_t(std::numeric_limits<int64_t>::max()) ||
          __builtin_mul_overflow(elements, static_cast<int64_t>(ne), &elements)) {
        c.fail(tn + " has too many elements");
      }
      t.ne.push_back(static_cast<int64_t>(ne));
    }
    uint32_t type_id = c.read<uint32_t>("tensor type");
    TypeInfo ti = type_info(type_id);
    if (!ti.name) c.fail(tn + " has unknown type id " + std::to_string(type_id));
    if (opts.require_supported_types && !ti.supported) {
      c.fail(tn + " has type " + ti.name + ", which is not supported (supported: " +
             supported_type_names() + ")");
    }
    t.type = static_cast<GGMLType>(type_id);
    if (t.ne[0] % ti.block_size != 0) {
      c.fail(tn + " of type " + ti.name + ": first dimension " + std::to_string(t.ne[0]) +
             " is not a multiple of the block size " + std::to_string(ti.block_size));
    }
    uint64_t blocks = static_cast<uint64_t>(elements) / ti.block_size;
    if (__builtin_mul_overflow(blocks, uint64_t(ti.type_size), &t.nbytes)) {
      c.fail(tn + " is too large");
    }
    t.offset = c.read<uint64_t>("tensor offset");
    if (t.offset % alignment_ != 0) {
      c.fail(tn + " offset " + std::to_string(t.offset) + " is not a multiple of the alignment " +
             std::to_string(alignment_));
    }
    if (!tensor_index_.emplace(t.name, tensors_.size()).second) {
      c.fail_at(at, "duplicate tensor name '" + t.name + "'");
    }
    tensors_.push_back(std::move(t));
  }

  uint64_t header_end = c.pos();
  data_offset_ = (header_end + alignment_ - 1) / alignment_ * alignment_;
  if (!tensors_.empty() && data_offset_ > size_) {
    throw GGUFError("[gguf] " + label_ + ": file is truncated: the data section starts at " +
                    std::to_string(data_offset_) + ", past the end of the file (" +
                    std::to_string(size_) + " bytes)");
  }
  // Bounds and overlap: every tensor lies inside the file, none overlaps another.
  std::vector<size_t> order(tensors_.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return tensors_[a].offset < tensors_[b].offset; });
  uint64_t prev_end = 0;
  const TensorInfo* prev = nullptr;
  for (size_t i : order) {
    TensorInfo& t = tensors_[i];
    uint64_t avail = size_ - data_offset_;
    if (t.offset > avail || t.nbytes > avail - t.offset) {
      throw GGUFError("[gguf] " + label_ + ": file is truncated: tensor '" + t.name +
                      "' needs bytes [" + std::to_string(data_offset_ + t.offset) + ", " +
                      std::to_string(data_offset_ + t.offset + t.nbytes) +
                      ") but the file has " + std::to_string(size_) + " bytes");
    }
    if (prev && t.offset < prev_end && t.nbytes > 0) {
      throw GGUFError("[gguf] " + label_ + ": tensors '" + prev->name + "' and '" + t.name +
                      "' overlap");
    }
    t.data = base_ + data_offset_ + t.offset;
    if (t.nbytes > 0) {
      prev_end = t.offset + t.nbytes;
      prev = &t;
    }
  }
}

const Value* GGUFFile::find(const std::string& key) const {
  auto it = kv_index_.find(key);
  return it == kv_index_.end() ? nullptr : &kv_[it->second].second;
}

const Value& GGUFFile::get(const std::string& key) const {
  const Value* v = find(key);
  if (!v) throw GGUFError("[gguf] " + label_ + ": no metadata key '" + key + "'");
  return *v;
}

const TensorInfo* GGUFFile::find_tensor(const std::string& name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

const TensorInfo& GGUFFile::tensor(const std::string& name) const {
  const TensorInfo* t = find_tensor(name);
  if (!t) throw GGUFError("[gguf] " + label_ + ": no tensor '" + name + "'");
  return *t;
}

}  // namespace vllm_metal::gguf
