#include "ops/decoder_layer_plan.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <stdexcept>

#include "cpu/batch_invariant.h"
#include "decoder_layer_args.h"
#include "ops/dtype_names.h"
#include "ops/gguf_ops.h"
#include "ops/lora.h"
#include "ops/moe.h"
#include "ops/moe_gguf.h"
#include "ops/rms_norm.h"
#include "runtime/gguf_types.h"

namespace vllm_metal {

namespace {

constexpr const char* kSource = "decoder_layer";
constexpr int64_t kMaxRows = 8;      // decoder_layer.metal kLayerMaxRows
constexpr int64_t kMaxHead = 512;    // decoder_layer.metal kLayerMaxHead
constexpr uint32_t kMatvecThreads = 256;  // layer_matvec: 8 simdgroups of weight rows
constexpr uint32_t kLayerThreads = 256;   // layer_qkv, layer_gate_up
constexpr uint64_t kThreadgroupBytes = 32768;  // Metal's limit per threadgroup
constexpr uint64_t kStaticBytes = 1024;        // `red` of layer_qkv / layer_gate_up (8 x 32 floats)

uint64_t round16(uint64_t n) { return (n + 15) / 16 * 16; }

// Weight rows (of each matrix) one simdgroup of a mat-vec kernel owns (gguf_matvec_core.h).
uint32_t rows_per_simdgroup(const DecoderLayerArgs& a) {
  return 32 / a.lanes_per_row * a.rows_per_lane;
}

// The kernels' function constants, all of them on every launch (Metal leaves an
// unset constant undefined).
struct Constants {
  uint32_t type0 = 0, type1 = 0, type2 = 0;
  bool bias = false, qk_norm = false, neox = true, residual = false, sandwich = false,
       gelu = false, staged = false, projected = false, combine = false;
  std::vector<FunctionConstant> list() const {
    return {FunctionConstant::uint32(0, type0),   FunctionConstant::uint32(1, type1),
            FunctionConstant::uint32(2, type2),   FunctionConstant::boolean(3, bias),
            FunctionConstant::boolean(4, qk_norm), FunctionConstant::boolean(5, neox),
            FunctionConstant::boolean(6, residual), FunctionConstant::boolean(7, sandwich),
            FunctionConstant::boolean(8, gelu), FunctionConstant::boolean(9, staged),
            FunctionConstant::boolean(10, projected), FunctionConstant::boolean(11, combine)};
  }
};

uint32_t type_id(gguf::GGMLType t) { return static_cast<uint32_t>(t); }

// The array dtype of a dense (F32 / F16 / BF16) weight type.
mx::Dtype dense_dtype(gguf::GGMLType t) {
  return t == gguf::GGMLType::kF32 ? mx::float32
         : t == gguf::GGMLType::kF16 ? mx::float16
                                     : mx::bfloat16;
}

uint64_t encoded_row_bytes(gguf::GGMLType t, int64_t k) {
  return static_cast<uint64_t>(gguf::row_bytes(t, k));
}

KernelLaunch launch(const std::string& kernel, const std::string& dtype) {
  KernelLaunch l;
  l.source = kSource;
  l.kernel = kernel + "_" + dtype;
  return l;
}

// The caches are written in place: on Metal they are registered as written too, so
// the encoder orders attention's reads (and the next step's writes) after this write.
void bind_cache(KernelLaunch& l, int index, int slot) {
  l.bind(index, slot);
  l.buffers.back().read_before_in_place_write = true;
}

// Appends another op's plan with its array slots mapped onto the layer's (map[slot]).
void append_mapped(KernelPlan& plan, KernelPlan part, const std::vector<int>& map) {
  for (KernelLaunch& l : part) {
    for (auto& b : l.buffers) b.array_slot = map.at(b.array_slot);
    plan.push_back(std::move(l));
  }
}

}  // namespace

bool decoder_layer_fuses(const DecoderLayerProblem& p) {
  return !p.spec.lora && (p.tokens <= kMaxRows || p.attention.batch_invariant);
}

DecoderLayerSlots::DecoderLayerSlots(const DecoderLayerSpec& spec) : names(spec.weight_names()) {
  out = kWeights + static_cast<int>(names.size());
  q = out + 1;
  attn = out + 2;
  h = out + 3;
  act = out + 4;
  o = out + 5;
  d = out + 6;
  xn = out + 7;
  q_projected = out + 8;
  k_projected = out + 9;
  v_projected = out + 10;
  up = out + 11;
  partials = out + 12;
  logits = out + 15;
  logits_f32 = out + 16;
  moe_ids = out + 17;
  moe_weights = out + 18;
  moe_act = out + 19;
  moe_y = out + 20;
}

int DecoderLayerSlots::weight(const std::string& name) const {
  auto it = std::find(names.begin(), names.end(), name);
  return it == names.end() ? -1 : kWeights + static_cast<int>(it - names.begin());
}

std::vector<mx::Shape> decoder_layer_output_shapes(const DecoderLayerProblem& p) {
  const auto& s = p.spec;
  const int t = static_cast<int>(p.tokens), hid = static_cast<int>(s.hidden);
  if (!p.attention.uses_kernels) return {{t, hid}};  // the CPU kernels keep their own scratch
  const int hq = static_cast<int>(s.num_heads), hkv = static_cast<int>(s.num_kv_heads);
  const int dim = static_cast<int>(s.head_dim), inter = static_cast<int>(s.intermediate);
  const bool fused = decoder_layer_fuses(p), moe = s.moe();
  auto when = [](bool needed, mx::Shape shape) { return needed ? shape : mx::Shape{0}; };
  std::vector<mx::Shape> shapes = {{t, hid}, {t, hq * dim}, {t, hq, dim}, {t, hid},
                                   when(!moe, {t, inter}),                         // act
                                   when(s.sandwich || !fused, {t, hid}),           // o
                                   when(s.sandwich || !fused || moe, {t, hid}),    // d
                                   when(!fused || moe, {t, hid}),                  // xn
                                   when(!fused, {t, hq * dim}),
                                   when(!fused, {t, hkv * dim}),
                                   when(!fused, {t, hkv * dim}),
                                   when(!fused && !moe, {t, inter})};              // up
  for (const auto& shape : paged_attention_scratch_shapes(p.attention)) shapes.push_back(shape);
  const int e = static_cast<int>(s.num_experts), k = static_cast<int>(s.top_k);
  const bool cast = moe && p.dtype != mx::float32;  // the logits in float32 for the routing
  for (const mx::Shape& shape : {when(moe, {t, e}), when(cast, {t, e}), when(moe, {t, k}),
                                 when(moe, {t, k}), when(moe, {t * k, inter}),
                                 when(moe, {t * k, hid})}) {
    shapes.push_back(shape);
  }
  return shapes;
}

std::vector<mx::Dtype> decoder_layer_output_dtypes(const DecoderLayerProblem& p) {
  if (!p.attention.uses_kernels) return {p.dtype};
  std::vector<mx::Dtype> d(12, p.dtype);
  d.insert(d.end(), 3, mx::float32);  // the split-KV partials
  d.insert(d.end(), {p.dtype, mx::float32, mx::int32, mx::float32, mx::float32, mx::float32});
  return d;
}

KernelPlan plan_decoder_layer(const DecoderLayerProblem& p) {
  const DecoderLayerSpec& s = p.spec;
  if (s.head_dim > kMaxHead) {
    throw std::invalid_argument("[decoder_layer] the Metal kernels take head_dim up to 512");
  }
  const DecoderLayerSlots slot(s);
  const std::string dt = dtype_name(p.dtype);
  const uint32_t groups = ceil_div(p.tokens, kMaxRows);
  const uint64_t group_rows = static_cast<uint64_t>(std::min(p.tokens, kMaxRows));
  const uint64_t elt = mx::size_of(p.dtype);
  const int64_t q_width = s.num_heads * s.head_dim;
  const int x = DecoderLayerSlots::kX;
  // a disabled optional weight's buffer is bound to x (every buffer is bound)
  auto weight_or_x = [&](const char* name) {
    const int w = slot.weight(name);
    return w < 0 ? x : w;
  };

  DecoderLayerArgs base{};
  base.num_slots = p.num_slots;
  base.rows = static_cast<uint32_t>(p.tokens);
  base.num_heads = static_cast<uint32_t>(s.num_heads);
  base.num_kv_heads = static_cast<uint32_t>(s.num_kv_heads);
  base.head_dim = static_cast<uint32_t>(s.head_dim);
  base.rotary_half = static_cast<uint32_t>(s.rotary_dim / 2);
  // The mat-vec kernels' threadgroups stay at 256 threads (their registers: 8 rows of
  // accumulators and norms per thread); they sum an input row's squares with as many of
  // them as rms_norm would use, so up to hidden 1024 the RMS has rms_norm's bits, past it
  // (rms_norm: 512+ threads) it is summed by 256 threads instead.
  const uint32_t norm_threads = rms_norm_threads(s.hidden);
  base.norm_threads = std::min(norm_threads, kLayerThreads);
  base.head_norm_threads = rms_norm_threads(s.head_dim);  // <= 128 for head_dim <= 512
  base.eps = s.norm_eps;
  base.qk_eps = s.qk_norm_eps;
  base.mscale = s.rope_mscale;
  // a mat-vec over k inputs with n outputs, weights of `types`, in gguf_matvec's shape
  // for k (gguf_matvec_core.h: the same lanes per row and piece give its sums' order)
  auto matvec_args = [&](int64_t k, int64_t n, std::initializer_list<gguf::GGMLType> types) {
    DecoderLayerArgs a = base;
    a.k = static_cast<uint32_t>(k);
    a.n = static_cast<uint32_t>(n);
    a.chunks = ceil_div(k, 16);
    const GgufMatvecShape shape = gguf_matvec_shape(k);
    a.lanes_per_row = shape.lanes_per_row;
    a.rows_per_lane = shape.rows_per_lane;
    a.piece = shape.piece;
    uint64_t* bytes[3] = {&a.w0_row_bytes, &a.w1_row_bytes, &a.w2_row_bytes};
    int i = 0;
    for (auto t : types) *bytes[i++] = encoded_row_bytes(t, k);
    return a;
  };
  const bool fused = decoder_layer_fuses(p);
  KernelPlan plan;

  // norm -> q, k, v (or, long batches, the projections made by gguf_matmul) -> q/k norm
  // -> rope -> q out, k and v into the caches
  auto push_qkv = [&]() {
    KernelLaunch l = launch("layer_qkv", dt);
    Constants c;
    c.type0 = type_id(s.types[0]);
    c.type1 = type_id(s.types[1]);
    c.type2 = type_id(s.types[2]);
    c.bias = s.qkv_bias;
    c.qk_norm = s.qk_norm;
    c.neox = s.neox;
    c.projected = !fused;
    l.bind(0, x);
    l.bind(1, slot.weight("input_norm"));
    l.bind(2, slot.weight("q_proj"));
    l.bind(3, slot.weight("k_proj"));
    l.bind(4, slot.weight("v_proj"));
    l.bind(5, weight_or_x("q_bias"));
    l.bind(6, weight_or_x("k_bias"));
    l.bind(7, weight_or_x("v_bias"));
    l.bind(8, weight_or_x("q_norm"));
    l.bind(9, weight_or_x("k_norm"));
    l.bind(10, DecoderLayerSlots::kPositions);
    l.bind(11, DecoderLayerSlots::kRopeTable);
    l.bind(12, DecoderLayerSlots::kSlotMapping);
    l.bind(13, slot.q);
    bind_cache(l, 14, DecoderLayerSlots::kKeyCache);
    bind_cache(l, 15, DecoderLayerSlots::kValueCache);
    l.bind(17, fused ? x : slot.q_projected);
    l.bind(18, fused ? x : slot.k_projected);
    l.bind(19, fused ? x : slot.v_projected);
    // [rows][head_dim] floats for the head, and the normalised rows when they fit too
    const uint64_t tile = round16(4 * group_rows * s.head_dim);
    const uint64_t staged = round16(elt * group_rows * s.hidden);
    c.staged = fused && kStaticBytes + tile + staged <= kThreadgroupBytes;
    l.constants = c.list();
    l.threadgroup_memory = {tile, c.staged ? staged : 16};
    l.set_args(16, matvec_args(s.hidden, q_width, {s.types[0], s.types[1], s.types[2]}));
    l.grid = {static_cast<uint32_t>(s.num_heads + 2 * s.num_kv_heads), groups, 1};
    l.threadgroup = {kLayerThreads, 1, 1};
    plan.push_back(l);
  };

  // attention: paged_attention's own plan with its slots mapped onto ours. With
  // `fold_reduce`, a split-KV reduce is left out and its decode launch's arguments
  // returned (the o projection combines the partitions); nullopt when nothing splits.
  auto push_attention = [&](bool fold_reduce) -> std::optional<PagedAttentionArgs> {
    PagedAttentionProblem a = p.attention;
    a.q_token_stride = q_width;
    a.q_head_stride = s.head_dim;
    KernelPlan part = plan_paged_attention(a);
    std::optional<PagedAttentionArgs> split;
    for (size_t i = 0; i < part.size(); ++i) {
      if (part[i].kernel.rfind("paged_attention_reduce_", 0) != 0) continue;
      PagedAttentionArgs args;  // the reduce's arguments are its decode launch's
      std::memcpy(&args, part[i].args.data(), sizeof(args));
      split = args;
      if (fold_reduce) part.erase(part.begin() + static_cast<std::ptrdiff_t>(i));
      break;
    }
    append_mapped(plan, std::move(part),
                  {slot.q, DecoderLayerSlots::kKeyCache, DecoderLayerSlots::kValueCache,
                   DecoderLayerSlots::kBlockTables, DecoderLayerSlots::kSeqLens,
                   DecoderLayerSlots::kCuSeqlensQ,
                   x,  // sinks: none (has_sinks is off, the buffer is never read)
                   slot.attn, slot.partials,
                   slot.partials + 1, slot.partials + 2});
    return split;
  };

  // out = residual + [mlp_out_norm | attn_out_norm](y) (gemma), or residual + y (+ bias)
  auto push_add_norm = [&](int y, int residual, const char* weight, bool norm, int out) {
    KernelLaunch l = launch("layer_add_norm", dt);
    Constants c;
    c.sandwich = norm;
    c.bias = !norm && weight && slot.weight(weight) >= 0;
    l.constants = c.list();
    l.bind(0, y);
    l.bind(1, residual);
    l.bind(2, weight ? weight_or_x(weight) : x);
    l.bind(3, out);
    DecoderLayerArgs a = matvec_args(s.hidden, s.hidden, {});
    a.norm_threads = norm_threads;  // a row per threadgroup, as rms_norm
    l.set_args(4, a);
    l.grid = {static_cast<uint32_t>(p.tokens), 1, 1};
    l.threadgroup = {norm_threads, 1, 1};
    plan.push_back(l);
  };

  auto push_norm = [&](int in, const char* weight, int out) {
    RmsNormProblem n;
    n.dtype = p.dtype;
    n.rows = p.tokens;
    n.hidden = s.hidden;
    n.x_row_stride = s.hidden;
    n.eps = s.norm_eps;
    append_mapped(plan, plan_rms_norm(n), {in, slot.weight(weight), out});
  };

  // An MoE layer's MLP after h: the per-op model's kernels (rms_norm, the router's
  // gguf_matmul, fused_moe or fused_moe_gguf) in one plan, then out = h + y.
  auto push_moe = [&]() {
    push_norm(slot.h, "post_norm", slot.xn);
    GgufMatmulProblem router{s.router_type, p.dtype, p.tokens, s.num_experts, s.hidden};
    append_mapped(plan, plan_gguf_matmul(router), {slot.xn, slot.weight("router"), slot.logits});
    int logits = slot.logits;
    if (p.dtype != mx::float32) {  // the routing kernel reads float32 logits
      KernelLaunch l = launch("layer_to_float", dt);
      l.constants = Constants().list();
      l.bind(0, slot.logits);
      l.bind(1, slot.logits_f32);
      l.set_args(2, matvec_args(s.num_experts, s.num_experts, {}));
      l.grid = {ceil_div(uint64_t(p.tokens) * s.num_experts, 256), 1, 1};
      l.threadgroup = {256, 1, 1};
      plan.push_back(l);
      logits = slot.logits_f32;
    }
    auto shape = [&](auto m) {  // the fields MoeProblem and MoeGgufProblem share
      m.dtype = p.dtype;
      m.num_tokens = p.tokens;
      m.hidden = s.hidden;
      m.num_experts = s.num_experts;
      m.inter = s.intermediate;
      m.top_k = s.top_k;
      m.renormalize = s.moe_renormalize;
      return m;
    };
    KernelPlan part;
    if (s.expert_blocks) {
      MoeGgufProblem m = shape(MoeGgufProblem{});
      m.gate_type = s.types[4];
      m.up_type = s.types[5];
      m.down_type = s.types[6];
      part = plan_fused_moe_gguf(m);
    } else {
      MoeProblem m = shape(MoeProblem{});
      m.w_dtype = dense_dtype(s.types[4]);
      part = plan_fused_moe(m);
    }
    append_mapped(plan, std::move(part),
                  {slot.xn, logits, slot.weight("gate_exps"), slot.weight("up_exps"),
                   slot.weight("down_exps"), slot.d, slot.moe_ids, slot.moe_weights,
                   slot.moe_act, slot.moe_y});
    push_add_norm(slot.d, slot.h, nullptr, false, slot.out);
  };

  if (!fused) {
    // Long batches (prefill): the tiled mat-mul reads each weight once per 32 rows with
    // simdgroup matrices; small epilogues do what MLX's elementwise ops did between.
    static const char* const kLoraNames[7] = {"q", "k", "v", "o", "gate", "up", "down"};
    auto push_matmul = [&](int in, int proj, int64_t n, int64_t k, int out) {
      GgufMatmulProblem m{s.types[proj], p.dtype, p.tokens, n, k};
      append_mapped(plan, plan_gguf_matmul(m), {in, slot.weight(slot.names[2 + proj]), out});
      if (!s.lora) return;
      // out += its rows' adapter deltas, in place (each element is read and written by
      // one thread of lora_apply)
      LoraApplyProblem l{p.dtype, p.tokens, k, n, p.lora_rank, p.lora_slots};
      const std::string pre = kLoraNames[proj];
      append_mapped(plan, plan_lora_apply(l),
                    {out, in, slot.weight(pre + "_lora_a"), slot.weight(pre + "_lora_b"),
                     slot.weight(pre + "_lora_scale"), slot.weight("lora_row_slot"), out});
    };
    const int64_t kv_width = s.num_kv_heads * s.head_dim;
    push_norm(x, "input_norm", slot.xn);
    push_matmul(slot.xn, 0, q_width, s.hidden, slot.q_projected);
    push_matmul(slot.xn, 1, kv_width, s.hidden, slot.k_projected);
    push_matmul(slot.xn, 2, kv_width, s.hidden, slot.v_projected);
    push_qkv();
    push_attention(false);
    push_matmul(slot.attn, 3, s.hidden, q_width, slot.o);
    push_add_norm(slot.o, x, s.sandwich ? "attn_out_norm" : "o_bias", s.sandwich, slot.h);
    if (s.moe()) {
      push_moe();
      return plan;
    }
    push_norm(slot.h, "post_norm", slot.xn);
    push_matmul(slot.xn, 4, s.intermediate, s.hidden, slot.act);
    push_matmul(slot.xn, 5, s.intermediate, s.hidden, slot.up);
    {
      KernelLaunch l = launch("layer_act", dt);
      Constants c;
      c.gelu = s.gelu;
      l.constants = c.list();
      l.bind(0, slot.act);
      l.bind(1, slot.up);
      l.bind(2, slot.act);  // in place: each thread reads and writes its own element
      l.set_args(3, matvec_args(s.intermediate, s.intermediate, {}));
      l.grid = {ceil_div(uint64_t(p.tokens) * s.intermediate, 256), 1, 1};
      l.threadgroup = {256, 1, 1};
      plan.push_back(l);
    }
    push_matmul(slot.act, 6, s.hidden, s.intermediate, slot.d);
    push_add_norm(slot.d, slot.h, s.sandwich ? "mlp_out_norm" : nullptr, s.sandwich, slot.out);
    return plan;
  }

  // 1. norm -> q, k, v -> q/k norm -> rope -> q out, k and v into the caches
  push_qkv();
  // 2. attention; its split-KV reduce folds into 3. when the o projection's threadgroup
  // memory holds the staged rows and the partitions' (max, 1 / sum) per (row, head)
  const uint64_t o_staged = round16(elt * group_rows * q_width);
  const uint64_t o_stats = round16(4 * group_rows * (2 * s.num_heads + 1));
  const bool fold_fits = o_staged + o_stats <= kThreadgroupBytes;
  const std::optional<PagedAttentionArgs> split = push_attention(fold_fits);

  // the mat-vec with a residual (or bias) epilogue: o and down
  auto push_matvec = [&](int in, const char* w, gguf::GGMLType type, int64_t k,
                         const char* bias, bool residual, int res, int y, bool combine) {
    KernelLaunch l = launch("layer_matvec", dt);
    Constants c;
    c.type0 = type_id(type);
    c.bias = bias && slot.weight(bias) >= 0;
    c.residual = residual;
    c.combine = combine;
    const uint64_t stats = combine ? o_stats : 0;
    const uint64_t staged = round16(elt * group_rows * k);
    // its only threadgroup memory (fc_combine: the statistics, then the rows)
    c.staged = stats + staged <= kThreadgroupBytes;
    l.constants = c.list();
    l.threadgroup_memory = {c.staged ? stats + staged : 16};
    l.bind(0, in);
    l.bind(1, slot.weight(w));
    l.bind(2, bias ? weight_or_x(bias) : x);
    l.bind(3, res);
    l.bind(4, y);
    // the split decode launch's scratch and metadata (any buffer when not combining)
    l.bind(6, combine ? slot.partials : x);
    l.bind(7, combine ? slot.partials + 1 : x);
    l.bind(8, combine ? slot.partials + 2 : x);
    l.bind(9, combine ? DecoderLayerSlots::kSeqLens : x);
    l.bind(10, combine ? DecoderLayerSlots::kCuSeqlensQ : x);
    DecoderLayerArgs a = matvec_args(k, s.hidden, {type});
    if (combine) {
      a.staged_offset = static_cast<uint32_t>(stats / elt);
      a.attention = *split;
    }
    l.set_args(5, a);
    l.grid = {ceil_div(s.hidden, uint64_t{kMatvecThreads / 32} * rows_per_simdgroup(a)), groups,
              1};
    l.threadgroup = {kMatvecThreads, 1, 1};
    plan.push_back(l);
  };

  // 3. o projection: h = x + o (gemma: o, normed and added by the next kernel)
  push_matvec(slot.attn, "o_proj", s.types[3], q_width, "o_bias", !s.sandwich, x,
              s.sandwich ? slot.o : slot.h, split.has_value() && fold_fits);
  if (s.moe()) {
    push_moe();
    return plan;
  }

  // 4. [gemma: h = x + attn_out_norm(o)] -> norm -> act(gate) * up
  {
    KernelLaunch l = launch("layer_gate_up", dt);
    Constants c;
    c.type0 = type_id(s.types[4]);
    c.type1 = type_id(s.types[5]);
    c.sandwich = s.sandwich;
    c.gelu = s.gelu;
    const uint64_t staged = round16(elt * group_rows * s.hidden);
    c.staged = kStaticBytes + staged <= kThreadgroupBytes;
    l.constants = c.list();
    l.threadgroup_memory = {c.staged ? staged : 16};
    l.bind(0, s.sandwich ? slot.o : slot.h);
    l.bind(1, x);
    l.bind(2, weight_or_x("attn_out_norm"));
    l.bind(3, slot.weight("post_norm"));
    l.bind(4, slot.weight("gate_proj"));
    l.bind(5, slot.weight("up_proj"));
    l.bind(6, slot.act);
    l.bind(7, slot.h);  // written by gemma's variant only
    // rows_per_lane rows of gate and as many of up per lane: half gguf_matvec's count, so a
    // lane decodes as many rows as there (its registers), at least one of each
    DecoderLayerArgs a = matvec_args(s.hidden, s.intermediate, {s.types[4], s.types[5]});
    a.rows_per_lane = std::max<uint32_t>(1, a.rows_per_lane / 2);
    l.set_args(8, a);
    const uint32_t threads = kLayerThreads;
    l.grid = {ceil_div(s.intermediate, uint64_t{threads / 32} * rows_per_simdgroup(a)), groups, 1};
    l.threadgroup = {threads, 1, 1};
    plan.push_back(l);
  }

  // 5. down projection: out = h + down (gemma: down, then 6.)
  push_matvec(slot.act, "down_proj", s.types[6], s.intermediate, nullptr, !s.sandwich, slot.h,
              s.sandwich ? slot.d : slot.out, false);

  // 6. gemma: out = h + mlp_out_norm(down)
  if (s.sandwich) push_add_norm(slot.d, slot.h, "mlp_out_norm", true, slot.out);
  return plan;
}

}  // namespace vllm_metal
