"""GGUF checkpoints: an HF-style config from the metadata, and the tensors
renamed to mlx-lm's parameter names: matrices kept in GGUF block form
(`GGUFWeight`, for GGUFLinear / GGUFEmbedding on ops.gguf_matmul), or every
tensor dequantized to a dense dtype (`load_weights(..., blocks=False)`, the
MLX-matmul reference path).

Reading uses the project's GGUF reader (`_core.GGUFFile`, memory-mapped):
`tensor_data` hands out the blocks as they are in the file (on Linux MLX
copies them once into its own memory, having no way to wrap the mapping; the
mapping is dropped after the load, so memory ~ file size), and
`ops.gguf_dequantize` makes dense tensors. Tensor types our kernels do not decode, or a build
without the reader, go through the `gguf` package's NumPy dequantizer (and so
are dense).

Q/K rows: llama.cpp's converter permutes the rows of attn_q / attn_k of the
"llama" architecture so that its rope can pair neighbouring dimensions
(GPT-J style). We undo that permutation at load, so every checkpoint, GGUF or
safetensors, is in HF layout and uses NeoX-style rope (pairs i, i + d/2). The
permutation moves whole rows and every row is a whole number of blocks, so
block-form Q/K are un-permuted by reordering their block rows: one copy of
just those two tensors per layer (for SmolLM2 8% of the file), made at load.
Keeping llama.cpp's layout and switching the rope to GPT-J pairing would save
that copy but give GGUF models a different Q/K (and KV-cache) layout from the
same model's safetensors, with every rope variant to be checked in both
pairings; one layout everywhere is worth 8%.
Gemma: llama.cpp stores its norm weights as 1 + w; we subtract the 1 back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
import mlx.core as mx
import numpy as np

from vllm_metal.models.stage_loading import outside_stage

_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
GGUF_FILE_IN_DIR = "model.gguf"  # in a prepared directory: a symlink to the file


@dataclass(frozen=True)
class _GGUFArch:
    model_type: str
    hf_architecture: str
    permuted_qk: bool           # llama.cpp permuted Q/K rows (rope pairs (2i, 2i+1))
    norm_shift: float = 0.0     # stored norm weight = w + norm_shift
    default_rope_base: float = 10_000.0


GGUF_ARCHS = {
    "llama": _GGUFArch("llama", "LlamaForCausalLM", permuted_qk=True),
    "qwen2": _GGUFArch("qwen2", "Qwen2ForCausalLM", permuted_qk=False, default_rope_base=1_000_000.0),
    "qwen3": _GGUFArch("qwen3", "Qwen3ForCausalLM", permuted_qk=False, default_rope_base=1_000_000.0),
    "qwen3moe": _GGUFArch("qwen3_moe", "Qwen3MoeForCausalLM", permuted_qk=False,
                          default_rope_base=1_000_000.0),
    # q/k/v/o biases, attention sinks, MXFP4 experts with biases (models/gpt_oss.py)
    "gpt-oss": _GGUFArch("gpt_oss", "GptOssForCausalLM", permuted_qk=False,
                         default_rope_base=150_000.0),
    # llama.cpp's olmoe: NeoX rope, Q/K not permuted by the converter
    "olmoe": _GGUFArch("olmoe", "OlmoeForCausalLM", permuted_qk=False),
    "gemma3": _GGUFArch("gemma3_text", "Gemma3ForCausalLM", permuted_qk=False, norm_shift=1.0,
                        default_rope_base=1_000_000.0),
}

# llama.cpp tensor names -> mlx-lm (HF) names.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # sparse MoE (qwen3moe): the router and the experts stacked [E, rows, cols]
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
}
_GEMMA3_BLOCK_NAMES = dict(
    _BLOCK_NAMES,
    ffn_norm="pre_feedforward_layernorm",
    post_attention_norm="post_attention_layernorm",
    post_ffw_norm="post_feedforward_layernorm",
)
_GPT_OSS_BLOCK_NAMES = dict(
    _BLOCK_NAMES,
    post_attention_norm="post_attention_layernorm",
    attn_sinks="self_attn.sinks",
    ffn_gate_inp="mlp.router",
    ffn_gate_exps="mlp.experts.gate_proj",
    ffn_up_exps="mlp.experts.up_proj",
    ffn_down_exps="mlp.experts.down_proj",
)
del _GPT_OSS_BLOCK_NAMES["ffn_norm"]
_SKIPPED = {"rope_freqs.weight"}  # llama3 rope factors: the config's rope_scaling carries them


@dataclass(frozen=True)
class GGUFWeight:
    """A matrix kept in GGUF block form."""
    blocks: mx.array  # uint8 [rows, row_bytes]: the file's bytes
    type_id: int      # GGML type id
    shape: tuple      # (rows, cols) = (out, in)


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type_name: str   # "Q4_1", "F32", ...
    type_id: int
    shape: tuple     # row-major (NumPy order): [rows, cols] for matrices


class GGUFCheckpoint:
    """Metadata and tensors of one GGUF file."""

    def __init__(self, path: str):
        self.path = str(path)
        self._core_file = None
        self._py_reader = None
        self._core = core = _core_module()
        if core is not None:
            self._core_file = core.GGUFFile.open(self.path, require_supported_types=False)
            self.metadata = dict(self._core_file.metadata)
            self.tensors = {t.name: GGUFTensor(t.name, t.type_name, int(t.type), tuple(t.shape))
                            for t in self._core_file.tensors}
        else:
            import gguf

            self._py_reader = gguf.GGUFReader(self.path)
            self._py_tensors = {t.name: t for t in self._py_reader.tensors}
            self.metadata = {k: f.contents() for k, f in self._py_reader.fields.items()
                             if not k.startswith("GGUF.")}
            self.tensors = {t.name: GGUFTensor(t.name, t.tensor_type.name, int(t.tensor_type),
                                               tuple(int(d) for d in reversed(t.shape)))
                            for t in self._py_reader.tensors}

    @property
    def architecture(self) -> str:
        return self.metadata["general.architecture"]

    def blocks(self, name: str) -> GGUFWeight | None:
        """The matrix `name` in block form (the file's bytes), or None when our
        kernels do not decode its type (or this build has no reader)."""
        t = self.tensors[name]
        # 2-D matrices, and 3-D stacks of expert matrices (MoE ffn_*_exps)
        if self._core_file is None or len(t.shape) not in (2, 3) or not self._core.gguf_type_info(t.type_id)[3]:
            return None
        return GGUFWeight(self._core_file.tensor_data(name), t.type_id, tuple(t.shape))

    def dense(self, name: str, dtype: mx.Dtype = mx.float32) -> mx.array:
        """The tensor dequantized to `dtype` (lazy when our kernels decode it)."""
        t = self.tensors[name]
        if self._core_file is not None:
            blocks = self._core_file.tensor_data(name)  # uint8 [rows, row_bytes]
            if self._core.gguf_type_info(t.type_id)[3]:
                from vllm_metal import ops

                return ops.gguf_dequantize(blocks, t.type_id, list(t.shape), _dtype_name(dtype))
            raw = np.asarray(blocks)
        else:
            raw = self._py_tensors[name].data
        return mx.array(numpy_dequantize(raw, t.type_id).reshape(t.shape)).astype(dtype)


def numpy_dequantize(raw: np.ndarray, type_id: int) -> np.ndarray:
    """The `gguf` package's reference dequantizer: float32 weights."""
    import gguf

    qtype = gguf.GGMLQuantizationType(type_id)
    return np.asarray(gguf.quants.dequantize(np.asarray(raw), qtype), dtype=np.float32)


def _core_module():
    try:
        from vllm_metal import _core
    except ImportError:
        return None
    return _core if hasattr(_core, "GGUFFile") and hasattr(_core, "gguf_dequantize") else None


def _dtype_name(dtype: mx.Dtype) -> str:
    return {v: k for k, v in _DTYPES.items()}[dtype]


def gguf_arch(ckpt: GGUFCheckpoint) -> _GGUFArch:
    arch = GGUF_ARCHS.get(ckpt.architecture)
    if arch is None:
        raise ValueError(f"[vllm-metal] GGUF architecture {ckpt.architecture!r} is not supported "
                         f"(supported: {', '.join(sorted(GGUF_ARCHS))})")
    return arch


def native_dtype(ckpt: GGUFCheckpoint) -> str:
    """The float dtype a GGUF checkpoint runs in when none is asked for.

    Block-quantized weights carry float16 scales, so float16; BF16 tensors mean
    bfloat16; a file of F32 tensors only stays float32. Gemma always runs in
    bfloat16: its activations overflow float16.
    """
    types = {t.type_name for t in ckpt.tensors.values()}
    if "BF16" in types or _is_gemma3(ckpt):
        return "bfloat16"
    if types <= {"F32"}:
        return "float32"
    return "float16"


def _is_gemma3(ckpt: GGUFCheckpoint) -> bool:
    return ckpt.architecture == "gemma3"


def hf_config(ckpt: GGUFCheckpoint) -> dict:
    """config.json content (HF names) of a GGUF checkpoint, from its metadata."""
    from vllm_metal.models import gguf_qwen35

    if gguf_qwen35.is_qwen35(ckpt):  # hybrid: its own names and layout (gguf_qwen35.py)
        return gguf_qwen35.hf_config(ckpt)
    arch = gguf_arch(ckpt)
    meta = ckpt.metadata
    prefix = ckpt.architecture

    def get(key, default=None):
        return meta.get(f"{prefix}.{key}", default)

    hidden = int(get("embedding_length"))
    n_layers = int(get("block_count"))
    n_heads = int(get("attention.head_count"))
    n_kv = get("attention.head_count_kv", n_heads)
    head_dim = int(get("attention.key_length") or hidden // n_heads)
    tokens = meta.get("tokenizer.ggml.tokens") or []
    vocab = int(get("vocab_size") or len(tokens) or ckpt.tensors["token_embd.weight"].shape[0])
    cfg = {
        "architectures": [arch.hf_architecture],
        "model_type": arch.model_type,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length") or get("expert_feed_forward_length")),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(n_kv),
        "head_dim": head_dim,
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _f32(get("rope.freq_base", arch.default_rope_base)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in ckpt.tensors,
        "dtype": native_dtype(ckpt),
    }
    for key in ("bos", "eos", "padding"):
        value = meta.get(f"tokenizer.ggml.{key}_token_id")
        if value is not None:
            cfg["pad_token_id" if key == "padding" else f"{key}_token_id"] = int(value)
    if arch.model_type == "llama":
        cfg["attention_bias"] = "blk.0.attn_q.bias" in ckpt.tensors
        cfg["hidden_act"] = "silu"
    if arch.model_type in ("qwen2", "qwen3", "qwen3_moe", "olmoe"):
        cfg["hidden_act"] = "silu"
    if arch.model_type == "qwen3_moe":
        # llama.cpp's qwen3moe graph: softmax router, top-k weights renormalized
        cfg.update(num_experts=int(get("expert_count")), num_experts_per_tok=int(get("expert_used_count")),
                   moe_intermediate_size=int(get("expert_feed_forward_length")), norm_topk_prob=True,
                   decoder_sparse_step=1, mlp_only_layers=[])
    if arch.model_type == "olmoe":
        # llama.cpp's olmoe graph: softmax router, top-k weights not renormalized
        cfg.update(num_experts=int(get("expert_count")), num_experts_per_tok=int(get("expert_used_count")),
                   intermediate_size=int(get("expert_feed_forward_length") or get("feed_forward_length")),
                   norm_topk_prob=False)
    scaling = _rope_scaling(ckpt, get, head_dim, cfg["rope_theta"])
    if scaling:
        cfg["rope_scaling"] = scaling
    if arch.model_type == "gpt_oss":
        _gpt_oss_config(cfg, get)
    if arch.model_type == "gemma3_text":
        _gemma3_config(cfg, get, hidden, n_heads, head_dim)
    return cfg


def _gpt_oss_config(cfg, get):
    """gpt-oss: even layers slide (llama.cpp's swa pattern 2), YaRN as the HF config (beta
    32 / 1, no truncation), router top-k then softmax (the architecture's, not a flag)."""
    n = cfg["num_hidden_layers"]
    cfg.update(num_local_experts=int(get("expert_count")),
               num_experts_per_tok=int(get("expert_used_count")),
               intermediate_size=int(get("expert_feed_forward_length")),
               sliding_window=int(get("attention.sliding_window", 128)),
               layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                            for i in range(n)],
               attention_bias=True, hidden_act="silu")
    scaling = cfg.pop("rope_scaling", None)
    factor = get("rope.scaling.factor")
    if scaling is None and factor:
        scaling = {"rope_type": "yarn", "factor": float(factor)}
    if scaling is not None:
        scaling.setdefault("original_max_position_embeddings",
                           int(get("rope.scaling.original_context_length", 4096)))
        scaling.setdefault("beta_fast", 32.0)
        scaling.setdefault("beta_slow", 1.0)
        scaling["truncate"] = False
        cfg["rope_parameters"] = dict(scaling, rope_theta=cfg["rope_theta"])
        cfg["rope_scaling"] = scaling


def _f32(value) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-05, not 9.99e-06)."""
    return float(str(np.float32(value)))


def _gemma3_config(cfg, get, hidden, n_heads, head_dim):
    n = cfg["num_hidden_layers"]
    cfg["sliding_window"] = int(get("attention.sliding_window", 512))
    pattern = get("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # per layer: True = sliding
        cfg["layer_types"] = ["sliding_attention" if s else "full_attention" for s in pattern]
    else:
        cfg["sliding_window_pattern"] = int(pattern)
        cfg["layer_types"] = ["full_attention" if (i + 1) % int(pattern) == 0 else "sliding_attention"
                              for i in range(n)]
    cfg["rope_local_base_freq"] = _f32(get("rope.freq_base_swa", 10_000.0))
    # llama.cpp scales queries by 1/sqrt(head_dim), except Gemma 3 27B (hidden/heads).
    cfg["query_pre_attn_scalar"] = hidden // n_heads if (n == 62 and hidden == 5376) else head_dim
    cfg["hidden_activation"] = "gelu_pytorch_tanh"
    cfg["final_logit_softcapping"] = get("final_logit_softcapping")
    cfg["attn_logit_softcapping"] = get("attn_logit_softcapping")


def _rope_scaling(ckpt, get, head_dim, base):
    kind = get("rope.scaling.type")
    factor = get("rope.scaling.factor")
    original = get("rope.scaling.original_context_length")
    if "rope_freqs.weight" in ckpt.tensors:
        return _llama3_scaling(ckpt.dense("rope_freqs.weight"), head_dim, base)
    if kind in (None, "none") or not factor or factor == 1.0:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        out = {"rope_type": "yarn", "factor": float(factor)}
        if original:
            out["original_max_position_embeddings"] = int(original)
        for src, dst in (("rope.scaling.yarn_beta_fast", "beta_fast"),
                         ("rope.scaling.yarn_beta_slow", "beta_slow")):
            if get(src) is not None:
                out[dst] = float(get(src))
        return out
    raise ValueError(f"[vllm-metal] GGUF rope scaling {kind!r} is not supported")


def _llama3_scaling(freq_factors: mx.array, head_dim: int, base: float) -> dict:
    """llama.cpp stores Llama 3.1+ rope scaling as per-pair wavelength factors;
    recover the llama3 parameters that produce them (Meta's published ones)."""
    factors = np.asarray(freq_factors.astype(mx.float32))
    factor = float(factors.max())
    cfg = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    wavelen = 2 * math.pi * base ** (np.arange(0, head_dim, 2) / head_dim)
    low_wl, high_wl = 8192 / 1.0, 8192 / 4.0
    smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
    expected = np.where(wavelen < high_wl, 1.0,
                        np.where(wavelen > low_wl, factor, 1 / ((1 - smooth) / factor + smooth)))
    if not np.allclose(expected, factors, rtol=1e-3):
        raise ValueError("[vllm-metal] GGUF rope_freqs do not match llama3 scaling "
                         "(factor, 1, 4, 8192); this rope is not supported")
    return cfg


def eos_token_ids(ckpt: GGUFCheckpoint) -> list[int]:
    """eos, plus end-of-turn tokens that end a chat reply."""
    meta = ckpt.metadata
    ids = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    if _is_gemma3(ckpt):
        tokens = meta.get("tokenizer.ggml.tokens") or []
        if "<end_of_turn>" in tokens:  # Gemma ends chat turns with it (HF generation_config)
            ids.append(tokens.index("<end_of_turn>"))
    out = []
    for i in ids:
        if i is not None and int(i) not in out:
            out.append(int(i))
    return out


def mlx_lm_name(gguf_name: str, model_type: str) -> str | None:
    """mlx-lm parameter name of a GGUF tensor; None for tensors we skip."""
    if gguf_name in _SKIPPED:
        return None
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk":
        table = {"gemma3_text": _GEMMA3_BLOCK_NAMES, "gpt_oss": _GPT_OSS_BLOCK_NAMES}.get(
            model_type, _BLOCK_NAMES)
        if parts[2] in table:
            if parts[2] == "attn_sinks":  # a parameter, not a layer: no .weight
                return f"model.layers.{parts[1]}.{table[parts[2]]}"
            return f"model.layers.{parts[1]}.{table[parts[2]]}.{parts[3]}"
    raise ValueError(f"[vllm-metal] unexpected GGUF tensor {gguf_name!r} for {model_type}")


def unpermute_rows(w: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's Q/K row permutation: within each head, rows
    (i, half) interleaved -> (half, i) as in HF checkpoints."""
    rows = w.shape[0]
    rest = w.shape[1:]
    d = rows // n_heads
    return w.reshape(n_heads, d // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def permute_rows(w, n_heads: int):
    """llama.cpp's permutation (HF -> GGUF layout); NumPy or MLX. For tests and tools."""
    rows = w.shape[0]
    rest = tuple(w.shape[1:])
    d = rows // n_heads
    return w.reshape(n_heads, 2, d // 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def load_weights(ckpt: GGUFCheckpoint, config: dict, dtype: mx.Dtype, *,
                 blocks: bool = False) -> dict[str, "mx.array | GGUFWeight"]:
    """Every tensor under its mlx-lm name, HF layout: matrices as GGUFWeight
    when `blocks` (and our kernels decode their type), everything else dense in
    `dtype`."""
    arch = gguf_arch(ckpt)
    weights = {}
    for name in ckpt.tensors:
        target = mlx_lm_name(name, arch.model_type)
        if target is None:
            continue
        if outside_stage(name):  # another pipeline stage's layer: never read (stage_loading.py)
            weights[target] = mx.zeros(ckpt.tensors[name].shape, dtype)
            continue
        # biases stay dense (gpt-oss's expert biases are 2-D [E, rows])
        w = ckpt.blocks(name) if blocks and not name.endswith(".bias") else None
        if w is None:
            if arch.norm_shift and name.endswith("norm.weight"):
                w = (ckpt.dense(name, mx.float32) - arch.norm_shift).astype(dtype)
            else:
                w = ckpt.dense(name, dtype)
        heads = None
        if arch.permuted_qk and ".attn_q." in name:
            heads = config["num_attention_heads"]
        elif arch.permuted_qk and ".attn_k." in name:
            heads = config["num_key_value_heads"]
        if heads is not None:
            if isinstance(w, GGUFWeight):  # whole rows of blocks move: a copy of this tensor
                w = GGUFWeight(mx.contiguous(unpermute_rows(w.blocks, heads)), w.type_id, w.shape)
            else:
                w = unpermute_rows(w, heads)
        weights[target] = w
    return weights
