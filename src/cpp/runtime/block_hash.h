// Block hashes for prefix caching: a chained, keyed 128-bit hash of each full
// block of a token sequence (plain C++17, no MLX, no Python).
//
// hash(block i) = SipHash-2-4-128(key, hash(block i-1) | block tokens | extra keys)
// with hash(block -1) = the chain's root, itself a hash of the request key (a
// LoRA id, a cache salt: anything that must keep two otherwise equal prompts
// apart). Because each hash covers its parent, equal hashes mean equal whole
// prefixes, so a prefix lookup only compares one hash per block.
//
// The key comes from a 64-bit seed. The default seed is drawn at random once
// per process, so hashes cannot be predicted (and collisions cannot be crafted)
// from outside; pass a fixed seed to reproduce hashes across runs or processes,
// which gives up that protection (the trade vLLM makes for its xxhash option).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

namespace vllm_metal::runtime {

struct BlockHash {
  uint64_t lo = 0;
  uint64_t hi = 0;

  bool operator==(const BlockHash& o) const { return lo == o.lo && hi == o.hi; }
  bool operator!=(const BlockHash& o) const { return !(*this == o); }
};

struct BlockHashHasher {
  // The hash is already uniform: its low word is a good bucket index.
  size_t operator()(const BlockHash& h) const { return static_cast<size_t>(h.lo); }
};

// SipHash-2-4 with a 128-bit key (k0, k1) and 128-bit output (Aumasson and
// Bernstein's specification). Output bytes 0..7 are `lo`, 8..15 `hi`, little-endian.
BlockHash siphash24_128(uint64_t k0, uint64_t k1, const void* data, size_t size);
// The 64-bit-output variant, kept for the published test vectors.
uint64_t siphash24_64(uint64_t k0, uint64_t k1, const void* data, size_t size);

// The process-wide default seed: random, drawn on first use.
uint64_t default_block_hash_seed();

// An extra key covering tokens [offset, offset + length) of the sequence, such
// as a multimodal item's content hash over its placeholder tokens. Every block
// overlapping the span hashes (key, offset - block start), so the same item at
// another position inside equal tokens gives another hash.
struct BlockExtraKey {
  int64_t offset = 0;
  int64_t length = 0;
  uint64_t key = 0;
};

// The hash of one full block. `extra` lists the (key, offset relative to the
// block's first token) pairs of the spans overlapping the block, in span order.
BlockHash hash_block_tokens(uint64_t seed, const BlockHash& parent, const int32_t* tokens,
                            size_t num_tokens, const BlockExtraKey* extra, size_t num_extra);

// The chained hashes of one token sequence's full blocks, computed as tokens
// are appended (vLLM's Request.block_hashes). Tokens of a partial last block
// wait in a small buffer until the block fills.
class BlockHashChain {
 public:
  // block_size > 0 tokens per block. request_key separates sequences whose
  // tokens are equal but whose KV differs (LoRA adapter, cache salt).
  explicit BlockHashChain(int32_t block_size, uint64_t seed = default_block_hash_seed(),
                          uint64_t request_key = 0);

  // Declares an extra key over tokens [offset, offset + length). Spans must come
  // in non-decreasing offset order, have length > 0, and start at or after the
  // first token of the first block not yet hashed (num_blocks() * block_size).
  // Throws std::invalid_argument ("[BlockHashChain] ...") otherwise.
  void add_extra_key(int64_t offset, int64_t length, uint64_t key);

  // Appends tokens; hashes every block that becomes full. Returns the number
  // of new block hashes.
  size_t append(const int32_t* tokens, size_t num_tokens);

  int32_t block_size() const { return block_size_; }
  uint64_t seed() const { return seed_; }
  uint64_t request_key() const { return request_key_; }
  const BlockHash& root() const { return root_; }
  int64_t num_tokens() const { return num_tokens_; }
  size_t num_blocks() const { return hashes_.size(); }  // full, hashed blocks
  const BlockHash* data() const { return hashes_.data(); }
  const std::vector<BlockHash>& hashes() const { return hashes_; }

 private:
  void hash_pending_block();

  int32_t block_size_;
  uint64_t seed_;
  uint64_t request_key_;
  BlockHash root_;
  int64_t num_tokens_ = 0;
  std::vector<int32_t> pending_;  // [< block_size] tokens of the partial block
  std::vector<BlockHash> hashes_;  // [num_blocks]
  std::vector<BlockExtraKey> spans_;  // declared extra keys, by offset
  size_t first_live_span_ = 0;      // spans before it end before the next block
  std::vector<BlockExtraKey> block_extra_;  // scratch: spans of the block being hashed
};

}  // namespace vllm_metal::runtime

template <>
struct std::hash<vllm_metal::runtime::BlockHash> : vllm_metal::runtime::BlockHashHasher {};
