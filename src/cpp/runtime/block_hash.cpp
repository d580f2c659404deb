#include "runtime/block_hash.h"

#include <algorithm>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>

namespace vllm_metal::runtime {

namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "block hashes read tokens as little-endian bytes");

inline uint64_t rotl(uint64_t x, int b) { return (x << b) | (x >> (64 - b)); }

inline uint64_t load_le64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Streaming SipHash-2-4: absorbs bytes and 64-bit words without buffering the
// message, so a block is hashed straight from the token array.
class SipHasher {
 public:
  SipHasher(uint64_t k0, uint64_t k1, bool wide) {
    v0_ = k0 ^ 0x736f6d6570736575ULL;
    v1_ = k1 ^ 0x646f72616e646f6dULL;
    v2_ = k0 ^ 0x6c7967656e657261ULL;
    v3_ = k1 ^ 0x7465646279746573ULL;
    if (wide) v1_ ^= 0xee;
  }

  void write(const void* data, size_t size) {
    const auto* p = static_cast<const uint8_t*>(data);
    length_ += size;
    if (tail_size_ > 0) {
      while (size > 0 && tail_size_ < 8) {
        tail_ |= static_cast<uint64_t>(*p++) << (8 * tail_size_++);
        --size;
      }
      if (tail_size_ < 8) return;
      compress(tail_);
      tail_ = 0;
      tail_size_ = 0;
    }
    for (; size >= 8; size -= 8, p += 8) compress(load_le64(p));
    for (; size > 0; --size) tail_ |= static_cast<uint64_t>(*p++) << (8 * tail_size_++);
  }

  void write_u64(uint64_t v) {
    if (tail_size_ == 0) {
      length_ += 8;
      compress(v);
    } else {
      write(&v, sizeof(v));
    }
  }

  uint64_t finish64() {
    finish_message();
    v2_ ^= 0xff;
    rounds(4);
    return v0_ ^ v1_ ^ v2_ ^ v3_;
  }

  BlockHash finish128() {
    finish_message();
    v2_ ^= 0xee;
    rounds(4);
    BlockHash h;
    h.lo = v0_ ^ v1_ ^ v2_ ^ v3_;
    v1_ ^= 0xdd;
    rounds(4);
    h.hi = v0_ ^ v1_ ^ v2_ ^ v3_;
    return h;
  }

 private:
  void sip_round() {
    v0_ += v1_;
    v1_ = rotl(v1_, 13);
    v1_ ^= v0_;
    v0_ = rotl(v0_, 32);
    v2_ += v3_;
    v3_ = rotl(v3_, 16);
    v3_ ^= v2_;
    v0_ += v3_;
    v3_ = rotl(v3_, 21);
    v3_ ^= v0_;
    v2_ += v1_;
    v1_ = rotl(v1_, 17);
    v1_ ^= v2_;
    v2_ = rotl(v2_, 32);
  }
  void rounds(int n) {
    for (int i = 0; i < n; ++i) sip_round();
  }
  void compress(uint64_t m) {
    v3_ ^= m;
    rounds(2);
    v0_ ^= m;
  }
  void finish_message() {
    compress(tail_ | (static_cast<uint64_t>(length_ & 0xff) << 56));
  }

  uint64_t v0_, v1_, v2_, v3_;
  uint64_t tail_ = 0;  // pending bytes of a partial word, little-endian
  size_t tail_size_ = 0;
  uint64_t length_ = 0;
};

// Second key word from the seed (splitmix64's finalizer), so one 64-bit seed
// keys all 128 bits.
uint64_t derive_k1(uint64_t seed) {
  uint64_t z = seed + 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Tags keep a root hash and a block hash from ever hashing the same message.
constexpr uint64_t kTagRoot = 0x746f6f722d6d6c76ULL;   // "vlm-root"
constexpr uint64_t kTagBlock = 0x6b636f6c622d6d76ULL;  // "vm-block"

BlockHash root_hash(uint64_t seed, uint64_t request_key) {
  SipHasher h(seed, derive_k1(seed), true);
  h.write_u64(kTagRoot);
  h.write_u64(request_key);
  return h.finish128();
}

}  // namespace

BlockHash siphash24_128(uint64_t k0, uint64_t k1, const void* data, size_t size) {
  SipHasher h(k0, k1, true);
  h.write(data, size);
  return h.finish128();
}

uint64_t siphash24_64(uint64_t k0, uint64_t k1, const void* data, size_t size) {
  SipHasher h(k0, k1, false);
  h.write(data, size);
  return h.finish64();
}

uint64_t default_block_hash_seed() {
  static const uint64_t seed = [] {
    std::random_device rd;
    return (static_cast<uint64_t>(rd()) << 32) ^ static_cast<uint64_t>(rd());
  }();
  return seed;
}

BlockHash hash_block_tokens(uint64_t seed, const BlockHash& parent, const int32_t* tokens,
                            size_t num_tokens, const BlockExtraKey* extra, size_t num_extra) {
  // Message: tag | parent | token count | tokens (int32 LE) | extra count | (key, offset)*.
  // Every variable-length part is preceded by its length, so no two different
  // blocks serialize to the same bytes.
  SipHasher h(seed, derive_k1(seed), true);
  h.write_u64(kTagBlock);
  h.write_u64(parent.lo);
  h.write_u64(parent.hi);
  h.write_u64(num_tokens);
  h.write(tokens, num_tokens * sizeof(int32_t));
  h.write_u64(num_extra);
  for (size_t i = 0; i < num_extra; ++i) {
    h.write_u64(extra[i].key);
    h.write_u64(static_cast<uint64_t>(extra[i].offset));
  }
  return h.finish128();
}

BlockHashChain::BlockHashChain(int32_t block_size, uint64_t seed, uint64_t request_key)
    : block_size_(block_size), seed_(seed), request_key_(request_key) {
  if (block_size <= 0) {
    throw std::invalid_argument("[BlockHashChain] block_size must be > 0, got " +
                                std::to_string(block_size));
  }
  root_ = root_hash(seed, request_key);
  pending_.reserve(static_cast<size_t>(block_size));
}

void BlockHashChain::add_extra_key(int64_t offset, int64_t length, uint64_t key) {
  const int64_t first_open = static_cast<int64_t>(hashes_.size()) * block_size_;
  if (length <= 0) {
    throw std::invalid_argument("[BlockHashChain] extra key length must be > 0, got " +
                                std::to_string(length));
  }
  if (offset < first_open) {
    throw std::invalid_argument(
        "[BlockHashChain] extra key at token " + std::to_string(offset) +
        " covers a block already hashed: offsets must be >= " + std::to_string(first_open) +
        " (" + std::to_string(hashes_.size()) + " full blocks hashed)");
  }
  if (!spans_.empty() && offset < spans_.back().offset) {
    throw std::invalid_argument("[BlockHashChain] extra keys must come in offset order: got " +
                                std::to_string(offset) + " after " +
                                std::to_string(spans_.back().offset));
  }
  spans_.push_back({offset, length, key});
}

void BlockHashChain::hash_pending_block() {
  const int64_t start = static_cast<int64_t>(hashes_.size()) * block_size_;
  const int64_t end = start + block_size_;
  block_extra_.clear();
  while (first_live_span_ < spans_.size() &&
         spans_[first_live_span_].offset + spans_[first_live_span_].length <= start) {
    ++first_live_span_;
  }
  for (size_t i = first_live_span_; i < spans_.size() && spans_[i].offset < end; ++i) {
    const BlockExtraKey& s = spans_[i];
    if (s.offset + s.length > start) block_extra_.push_back({s.offset - start, s.length, s.key});
  }
  const BlockHash& parent = hashes_.empty() ? root_ : hashes_.back();
  hashes_.push_back(hash_block_tokens(seed_, parent, pending_.data(), pending_.size(),
                                      block_extra_.data(), block_extra_.size()));
  pending_.clear();
}

size_t BlockHashChain::append(const int32_t* tokens, size_t num_tokens) {
  const size_t before = hashes_.size();
  const size_t bs = static_cast<size_t>(block_size_);
  num_tokens_ += static_cast<int64_t>(num_tokens);
  while (num_tokens > 0) {
    const size_t take = std::min(bs - pending_.size(), num_tokens);
    pending_.insert(pending_.end(), tokens, tokens + take);
    tokens += take;
    num_tokens -= take;
    if (pending_.size() == bs) hash_pending_block();
  }
  return hashes_.size() - before;
}

}  // namespace vllm_metal::runtime
