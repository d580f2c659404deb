#include "cpu/decoder_layer.h"

#include <vector>

#include "cpu/moe_gguf.h"
#include "cpu/reshape_and_cache.h"
#include "cpu/rms_norm.h"
#include "cpu/rope.h"

namespace vllm_metal::cpu {

namespace {

template <Elt E>
using S = typename EltTraits<E>::Storage;

int64_t elt_size(Elt e) { return e == Elt::kF32 ? 4 : 2; }

// y[r, :] += b (rounded to E), as MLX's `y + bias` after the matmul.
template <Elt E>
void add_bias_rows(void* yv, const void* bv, int64_t rows, int64_t n) {
  auto* y = static_cast<S<E>*>(yv);
  auto* b = static_cast<const S<E>*>(bv);
  for (int64_t r = 0; r < rows; ++r) {
    S<E>* yr = y + r * n;
    for (int64_t i = 0; i < n; ++i) {
      EltTraits<E>::store(yr + i, EltTraits<E>::load(yr + i) + EltTraits<E>::load(b + i));
    }
  }
}

#if defined(__x86_64__)
template <Elt E>
VLLM_METAL_AVX2 int64_t add_rows_avx2(const S<E>* a, const S<E>* b, S<E>* out, int64_t count) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) store8<E>(out + i, _mm256_add_ps(load8<E>(a + i), load8<E>(b + i)));
  return i;
}
#endif

// out = a + b, rounded to E (the residual add).
template <Elt E>
void add_rows(const void* av, const void* bv, void* outv, int64_t count) {
  auto* a = static_cast<const S<E>*>(av);
  auto* b = static_cast<const S<E>*>(bv);
  auto* out = static_cast<S<E>*>(outv);
  int64_t i = 0;
#if defined(__x86_64__)
  if (has_avx2_fma()) i = add_rows_avx2<E>(a, b, out, count);
#endif
  for (; i < count; ++i) {
    EltTraits<E>::store(out + i, EltTraits<E>::load(a + i) + EltTraits<E>::load(b + i));
  }
}

void add_bias(Elt e, void* y, const void* b, int64_t rows, int64_t n) {
  switch (e) {
    case Elt::kF32: return add_bias_rows<Elt::kF32>(y, b, rows, n);
    case Elt::kF16: return add_bias_rows<Elt::kF16>(y, b, rows, n);
    case Elt::kBF16: return add_bias_rows<Elt::kBF16>(y, b, rows, n);
  }
}

void add(Elt e, const void* a, const void* b, void* out, int64_t count) {
  switch (e) {
    case Elt::kF32: return add_rows<Elt::kF32>(a, b, out, count);
    case Elt::kF16: return add_rows<Elt::kF16>(a, b, out, count);
    case Elt::kBF16: return add_rows<Elt::kBF16>(a, b, out, count);
  }
}

GgufMatmul matmul_of(const DecoderLayerRows& a, const LayerLinear& l, const void* x, void* y) {
  GgufMatmul m;
  m.type = l.type;
  m.w = l.w;
  m.n = l.n;
  m.k = l.k;
  m.elt = a.elt;
  m.x = x;
  m.m = a.tokens;
  m.y = y;
  m.exact = a.exact;
  return m;
}

// y += the rows' LoRA deltas of x (in place), when the step has adapters.
void add_lora(const DecoderLayerRows& a, const LayerLinear& l, const void* x, void* y) {
  if (!a.lora_row_slot || !l.lora_a) return;
  LoraApplyRows r;
  r.elt = a.elt;
  r.y = y;
  r.x = x;
  r.a = l.lora_a;
  r.b = l.lora_b;
  r.scale = l.lora_scale;
  r.row_slot = a.lora_row_slot;
  r.out = y;
  r.rows = a.tokens;
  r.in_dim = l.k;
  r.out_dim = l.n;
  r.rank = a.lora_rank;
  lora_apply_rows(r);
}

void project(const DecoderLayerRows& a, const LayerLinear& l, const void* x, void* y) {
  gguf_matmul(matmul_of(a, l, x, y));
  if (l.bias) add_bias(a.elt, y, l.bias, a.tokens, l.n);
  add_lora(a, l, x, y);
}

// Projections of the same x in one pool job (q/k/v; gate/up).
template <int N>
void project_all(const DecoderLayerRows& a, const LayerLinear* const (&ls)[N], const void* x,
                 void* const (&ys)[N]) {
  GgufMatmul mats[N];
  for (int i = 0; i < N; ++i) mats[i] = matmul_of(a, *ls[i], x, ys[i]);
  gguf_matmul_group(mats, N);
  for (int i = 0; i < N; ++i) {
    if (ls[i]->bias) add_bias(a.elt, ys[i], ls[i]->bias, a.tokens, ls[i]->n);
    add_lora(a, *ls[i], x, ys[i]);
  }
}

// RMSNorm of dense rows [rows, width] of x into out (which may be x).
void norm(const DecoderLayerRows& a, const void* x, void* out, int64_t rows, int64_t width,
          const void* weight, float eps) {
  RmsNormRows n;
  n.elt = a.elt;
  n.x = x;
  n.weight = weight;
  n.out = out;
  n.rows = rows;
  n.hidden = width;
  n.x_row_stride = width;
  n.eps = eps;
  rms_norm_rows(n);
}

// Per-head RMSNorm (in place), then rope (in place) of [tokens, heads, head_dim].
void norm_and_rotate(const DecoderLayerRows& a, void* x, int64_t heads, const void* weight) {
  if (weight) norm(a, x, x, a.tokens * heads, a.head_dim, weight, a.qk_norm_eps);
  RopeRows r;
  r.elt = a.elt;
  r.x = x;
  r.out = x;
  r.positions = a.positions;
  r.table = a.rope_table;
  r.tokens = a.tokens;
  r.heads = heads;
  r.head_size = a.head_dim;
  r.rotary_dim = a.rotary_dim;
  r.x_token_stride = heads * a.head_dim;
  r.x_head_stride = a.head_dim;
  r.neox = a.neox;
  r.mscale = a.rope_mscale;
  rope_rows(r);
}

// y = fused_moe(xn, router(xn)) as the per-op model computes it: the router's logits
// rounded to elt (its gguf_matmul output), then the fused MoE kernel on them in float32.
// Dense experts are F32 / F16 / BF16 "blocks" to it (fused_moe_rows does the same).
void sparse_moe(const DecoderLayerRows& a, const void* xn, void* logits, float* logits_f32,
                int32_t* ids, float* weights, void* y) {
  gguf_matmul(matmul_of(a, a.router, xn, logits));
  to_floats(a.elt, logits, a.tokens * a.num_experts, logits_f32);
  MoeGgufRows r;
  r.elt = a.elt;
  r.x = xn;
  r.logits = logits_f32;
  r.w_gate = static_cast<const uint8_t*>(a.gate.w);
  r.w_up = static_cast<const uint8_t*>(a.up.w);
  r.w_down = static_cast<const uint8_t*>(a.down.w);
  r.gate_type = a.gate.type;
  r.up_type = a.up.type;
  r.down_type = a.down.type;
  r.out = y;
  r.ids = ids;
  r.weights = weights;
  r.num_tokens = a.tokens;
  r.hidden = a.hidden;
  r.num_experts = a.num_experts;
  r.inter = a.intermediate;
  r.top_k = a.top_k;
  r.renormalize = a.moe_renormalize;
  r.exact = a.expert_blocks ? a.exact : true;
  fused_moe_gguf_rows(r);
}

}  // namespace

void decoder_layer(const DecoderLayerRows& a) {
  const int64_t t = a.tokens, hidden = a.hidden, d = a.head_dim;
  if (t == 0) return;
  const int64_t q_width = a.num_heads * d, kv_width = a.num_kv_heads * d;
  const int64_t es = elt_size(a.elt);
  // scratch: xn [t, hidden] | q | k | v | attn | mlp [t, hidden] | gate [t, I] | up [t, I],
  // an MoE layer: logits [t, E] in elt and in float32, expert ids, routing weights [t, k]
  const bool moe = a.num_experts > 0;
  const int64_t e = a.num_experts, dense_i = moe ? 0 : a.intermediate;
  const int64_t sizes[] = {t * hidden * es, t * q_width * es,  t * kv_width * es,
                           t * kv_width * es, t * q_width * es, t * hidden * es,
                           t * dense_i * es,  t * dense_i * es, t * e * es,
                           t * e * 4,         t * a.top_k * 4,  t * a.top_k * 4};
  auto aligned = [](int64_t bytes) { return (bytes + 63) / 64 * 64; };
  static thread_local std::vector<uint8_t> scratch;
  int64_t total = 0;
  for (int64_t b : sizes) total += aligned(b);
  if (static_cast<int64_t>(scratch.size()) < total) scratch.resize(total);
  uint8_t* p = scratch.data();
  int next = 0;
  auto take = [&]() {
    void* r = p;
    p += aligned(sizes[next++]);
    return r;
  };
  void* xn = take();
  void* q = take();
  void* k = take();
  void* v = take();
  void* attn = take();
  void* mlp = take();
  void* gate = take();
  void* up = take();

  norm(a, a.x, xn, t, hidden, a.input_norm, a.norm_eps);

  project_all<3>(a, {&a.q, &a.k, &a.v}, xn, {q, k, v});
  norm_and_rotate(a, q, a.num_heads, a.q_norm);
  norm_and_rotate(a, k, a.num_kv_heads, a.k_norm);

  CacheScatter c;
  c.key = k;
  c.value = v;
  c.slot_mapping = a.slot_mapping;
  c.key_cache = a.key_cache;
  c.value_cache = a.value_cache;
  const int64_t strides[3] = {kv_width, d, 1};
  for (int i = 0; i < 3; ++i) c.key_strides[i] = c.value_strides[i] = strides[i];
  c.num_tokens = t;
  c.num_heads = a.num_kv_heads;
  c.head_size = d;
  c.num_slots = a.attention.num_blocks * a.attention.block_size;
  c.itemsize = es;
  scatter_into_cache(c);

  PagedAttentionParams at = a.attention;
  at.elt = a.elt;
  at.q = q;
  at.q_token_stride = q_width;
  at.q_head_stride = d;
  at.key_cache = a.key_cache;
  at.value_cache = a.value_cache;
  at.out = attn;
  at.num_tokens = t;
  at.num_q_heads = a.num_heads;
  at.num_kv_heads = a.num_kv_heads;
  at.head_size = d;
  paged_attention(at);

  project(a, a.o, attn, mlp);
  if (a.attn_out_norm) norm(a, mlp, mlp, t, hidden, a.attn_out_norm, a.norm_eps);
  // h = x + o (kept in out), xn = norm2(h)
  RmsNormRows n2;
  n2.elt = a.elt;
  n2.out = xn;
  n2.rows = t;
  n2.hidden = hidden;
  n2.x_row_stride = hidden;
  n2.eps = a.norm_eps;
  n2.x = mlp;
  n2.residual = a.x;
  n2.residual_row_stride = hidden;
  n2.weight = a.post_norm;
  n2.residual_out = a.out;
  rms_norm_rows(n2);

  if (moe) {
    void* logits = take();
    auto* logits_f32 = static_cast<float*>(take());
    auto* ids = static_cast<int32_t*>(take());
    auto* weights = static_cast<float*>(take());
    sparse_moe(a, xn, logits, logits_f32, ids, weights, mlp);
    add(a.elt, a.out, mlp, a.out, t * hidden);
    return;
  }
  project_all<2>(a, {&a.gate, &a.up}, xn, {gate, up});
  SiluAndMulRows s;
  s.elt = a.elt;
  s.gate = gate;
  s.up = up;
  s.out = gate;
  s.rows = t;
  s.cols = a.intermediate;
  s.gate_row_stride = s.up_row_stride = a.intermediate;
  s.activation = a.activation;
  silu_and_mul_rows(s);
  project(a, a.down, gate, mlp);
  if (a.mlp_out_norm) norm(a, mlp, mlp, t, hidden, a.mlp_out_norm, a.norm_eps);
  add(a.elt, a.out, mlp, a.out, t * hidden);
}

}  // namespace vllm_metal::cpu
