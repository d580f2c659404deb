"""A tiny random-weight Qwen3.5 text checkpoint as `vllm serve` reads one, plus its
reference: mlx-lm's own qwen3_5 TextModel loaded from the same files.

    ckpt = write_checkpoint(dir)              # config.json, model.safetensors (HF layout),
                                              # tokenizer.json (byte-level BPE), generation_config
    ref = reference_model(ckpt)               # mlx-lm's model, its own loader and sanitize
                                              # (qwen3_5_moe's for MOE_CONFIG checkpoints)
    tokens = greedy(ref, prompt_ids, n)       # mlx-lm's forward + its own caches
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

VOCAB = 320
CONFIG = dict(
    model_type="qwen3_5_text", architectures=["Qwen3_5ForCausalLM"],
    hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=VOCAB,
    rms_norm_eps=1e-6, linear_num_value_heads=4, linear_num_key_heads=2,
    linear_key_head_dim=32, linear_value_head_dim=16, linear_conv_kernel_dim=4,
    full_attention_interval=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    tie_word_embeddings=False, max_position_embeddings=1024, hidden_act="silu",
    bos_token_id=1, eos_token_id=0, dtype="float32",
    rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0,
                     "partial_rotary_factor": 0.25, "mrope_interleaved": True},
)
# Qwen3.5-MoE: every MLP a sparse MoE block (8 experts, top-2) plus a gated shared expert
MOE_CONFIG = dict(
    CONFIG, model_type="qwen3_5_moe_text", architectures=["Qwen3_5MoeForCausalLM"],
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=48, norm_topk_prob=True, decoder_sparse_step=1,
)
# Norms Qwen3.5 checkpoints store zero-centred (the model multiplies by 1 + w);
# mlx-lm's sanitize adds the 1 back when the conv weights are in HF layout.
_CENTRED_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight",
                  "model.norm.weight", ".q_norm.weight", ".k_norm.weight")


def random_model(seed: int = 0, config: dict = CONFIG):
    """mlx-lm's TextModel with random weights (livelier gates than its init, and
    non-trivial norms, so state and every weight matter to the tokens)."""
    from mlx_lm.models import qwen3_5

    mx.random.seed(seed)
    model = qwen3_5.TextModel(qwen3_5.TextModelArgs.from_dict(config))
    for layer in model.model.layers:
        if layer.is_linear:
            gdn = layer.linear_attn
            gdn.dt_bias = mx.random.normal((gdn.num_v_heads,))
            gdn.norm.weight = 1 + 0.1 * mx.random.normal(gdn.norm.weight.shape)
        layer.input_layernorm.weight = 1 + 0.1 * mx.random.normal((config["hidden_size"],))
        if config.get("num_experts"):  # sharper routing: the top-k choice varies by token
            layer.mlp.gate.weight = 4 * layer.mlp.gate.weight
    model.model.embed_tokens.weight = 0.5 * model.model.embed_tokens.weight
    mx.eval(model.parameters())
    return model


def hf_weights(model, expert_layout: str = "fused") -> dict[str, np.ndarray]:
    """The model's parameters named and laid out as an HF Qwen3.5 text checkpoint. MoE
    experts: "fused" as the published Qwen3.5-MoE checkpoints (experts.gate_up_proj
    [E, 2I, H], experts.down_proj [E, H, I]) or "per_expert" (experts.{e}.*_proj.weight)."""
    out = {}
    for name, value in tree_flatten(model.parameters()):
        v = np.array(value.astype(mx.float32))
        if name.endswith("conv1d.weight"):  # mlx [C, K, 1] -> HF [C, 1, K]
            v = np.moveaxis(v, 2, 1)
        elif name.endswith(_CENTRED_NORMS):
            v = v - 1.0
        out[name] = v
    return experts_to_hf(out, expert_layout)


def experts_to_hf(out: dict, expert_layout: str = "fused") -> dict:
    """mlx-lm's stacked switch_mlp experts in `out` renamed and laid out as HF's."""
    for name in [n for n in out if n.endswith(".switch_mlp.gate_proj.weight")]:
        prefix = name[:-len(".switch_mlp.gate_proj.weight")]
        projs = {p: out.pop(f"{prefix}.switch_mlp.{p}.weight")
                 for p in ("gate_proj", "up_proj", "down_proj")}
        if expert_layout == "fused":
            out[f"{prefix}.experts.gate_up_proj"] = np.concatenate(
                [projs["gate_proj"], projs["up_proj"]], axis=1)
            out[f"{prefix}.experts.down_proj"] = projs["down_proj"]
        else:
            for p, w in projs.items():
                for e in range(w.shape[0]):
                    out[f"{prefix}.experts.{e}.{p}.weight"] = w[e]
    return out


_MTP_GGUF_NEXTN = {"fc": "eh_proj", "pre_fc_norm_embedding": "enorm",
                   "pre_fc_norm_hidden": "hnorm", "norm": "shared_head_norm"}
_MTP_GGUF_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
                   "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                   "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                   "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
                   "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def random_mtp_weights(config: dict, seed: int) -> dict[str, np.ndarray]:
    """A random MTP block (mtp.*) as Qwen3.5 checkpoints store it: fc [H, 2H], the pre-fc
    and final norms and the layer's norms zero-centred, one full-attention layer."""
    from mlx_lm.models import qwen3_5

    mx.random.seed(seed + 1000)
    args = qwen3_5.TextModelArgs.from_dict(config)
    h = config["hidden_size"]
    layer = qwen3_5.DecoderLayer(args, args.full_attention_interval - 1)
    if config.get("num_experts"):  # sharper routing, as random_model's
        layer.mlp.gate.weight = 4 * layer.mlp.gate.weight
    out = experts_to_hf({f"mtp.layers.0.{k}": np.array(v.astype(mx.float32))
                         for k, v in tree_flatten(layer.parameters())})
    out["mtp.fc.weight"] = np.array(mx.random.normal((h, 2 * h)) / np.sqrt(2 * h))
    for name in ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
                 "mtp.norm.weight"):
        out[name] = np.zeros(h, np.float32)
    for name in list(out):  # non-trivial norms, stored as w - 1
        if name.endswith(("norm.weight", "norm_embedding.weight", "norm_hidden.weight")):
            out[name] = np.array(0.1 * mx.random.normal(out[name].shape))
    return out


def write_tokenizer(out: Path, vocab_size: int = VOCAB) -> None:
    """A byte-level BPE tokenizer (the GGUF test vocabulary), saved as transformers does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from vllm_metal.models.testing import byte_level_vocab

    tokens, _, merges = byte_level_vocab(vocab_size)
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                     merges=[tuple(m.split(" ")) for m in merges])
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   bos_token="<|im_start|>", pad_token="<|endoftext|>")
    fast.save_pretrained(str(out))


def write_checkpoint(out_dir, seed: int = 0, config: dict = CONFIG, *,
                     vision_language: bool = False, expert_layout: str = "fused",
                     mtp: bool = False) -> Path:
    """vision_language: laid out as the published Qwen3.5 checkpoints are
    (Qwen3_5ForConditionalGeneration: text config nested, language-model weights under
    model.language_model., a vision tower -- here one stand-in tensor). mtp: with a random
    MTP block (mtp.*, mtp_num_hidden_layers 1), which mlx-lm's reference ignores."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = random_model(seed, config)
    weights = hf_weights(model, expert_layout)
    if mtp:
        weights.update(random_mtp_weights(config, seed))
        config = dict(config, mtp_num_hidden_layers=1)
    moe = bool(config.get("num_experts"))
    if vision_language:
        weights = {("model.language_model." + k[len("model."):]) if k.startswith("model.") else k: v
                   for k, v in weights.items()}
        weights["model.visual.patch_embed.proj.weight"] = np.ones((8, 3, 2, 2, 2), np.float32)
        text = {k: v for k, v in config.items() if k not in ("architectures", "tie_word_embeddings")}
        config = {"model_type": "qwen3_5_moe" if moe else "qwen3_5",
                  "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe
                                    else "Qwen3_5ForConditionalGeneration"],
                  "text_config": text, "tie_word_embeddings": config["tie_word_embeddings"],
                  "eos_token_id": config["eos_token_id"], "bos_token_id": config["bos_token_id"]}
    mx.save_safetensors(str(out / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": config["eos_token_id"], "bos_token_id": config["bos_token_id"]}))
    write_tokenizer(out, model.args.vocab_size)
    return out


def reference_model(checkpoint_dir):
    """mlx-lm's qwen3_5.TextModel from the checkpoint, through mlx-lm's own loader; for a
    MoE checkpoint mlx-lm's qwen3_5_moe.Model (its own expert sanitize, fused layout only)."""
    from mlx_lm.models import qwen3_5, qwen3_5_moe
    from mlx_lm.utils import load_model

    def classes(config):
        if config.get("num_experts") or config.get("text_config", {}).get("num_experts"):
            return qwen3_5_moe.Model, qwen3_5_moe.ModelArgs
        return qwen3_5.TextModel, qwen3_5.TextModelArgs

    model, _ = load_model(Path(checkpoint_dir), get_model_classes=classes)
    return model


def greedy(model, prompt: list[int], steps: int) -> list[int]:
    """mlx-lm's forward with its own caches: prefill, then one token at a time."""
    cache = model.make_cache()
    out = model(mx.array([prompt]), cache=cache)
    tokens = []
    for _ in range(steps):
        tokens.append(int(mx.argmax(out[0, -1]).item()))
        out = model(mx.array([[tokens[-1]]]), cache=cache)
    return tokens


# ---- packed batches without a server --------------------------------------------------

def run_packed_greedy(loaded, prompts: list[list[int]], steps: int, *, chunk: int = 5,
                      block_size: int = 4) -> tuple[list[list[int]], list[np.ndarray]]:
    """Greedy decoding of all prompts together through our packed forward: each step
    packs the decode rows first, then a prefill chunk of at most `chunk` tokens of every
    request still prefilling, so decodes and chunked prefills share steps. Returns the
    tokens and the logits rows of each request."""
    from dataclasses import fields

    from vllm_metal.models.generate import SeqChunk, build_step
    from vllm_metal.models.qwen3_5_paged import HybridContext

    model, spec = loaded.model, loaded.spec
    dtype = getattr(mx, spec.dtype)
    max_len = max(len(p) for p in prompts) + steps
    blocks_per_seq = -(-max_len // block_size)
    shape = (blocks_per_seq * len(prompts), block_size, spec.num_kv_heads, spec.head_dim)
    kv = [None if lin else (mx.zeros(shape, dtype), mx.zeros(shape, dtype)) for lin in model.is_linear]
    pools = model.make_state_pools(len(prompts) + 1, dtype)
    # request i: blocks taken from the end, state slot len - i (neither is the identity)
    tables = [list(range((len(prompts) - 1 - i) * blocks_per_seq, (len(prompts) - i) * blocks_per_seq))
              for i in range(len(prompts))]
    tokens = [list(p) for p in prompts]
    done = [0] * len(prompts)  # tokens computed
    out = [[] for _ in prompts]
    logits_rows = [[] for _ in prompts]
    while any(len(o) < steps for o in out):
        live = [i for i in range(len(prompts)) if len(out[i]) < steps]
        decodes = [i for i in live if done[i] >= len(prompts[i])]
        prefills = [i for i in live if done[i] < len(prompts[i])]
        order = decodes + prefills
        chunks = []
        for i in order:
            n = 1 if i in decodes else min(chunk, len(prompts[i]) - done[i])
            last = done[i] + n == len(tokens[i])
            chunks.append(SeqChunk(tokens[i][done[i]:done[i] + n], done[i], tables[i],
                                   "last" if last else "none"))
        packed = build_step(chunks, kv, block_size)
        c = packed.ctx
        ctx = HybridContext(
            **{f.name: getattr(c, f.name) for f in fields(c)},
            cu_seqlens_state=c.cu_seqlens_q,
            state_slots=mx.array([len(prompts) - i for i in order], dtype=mx.int32),
            has_initial_state=mx.array([int(done[i] > 0) for i in order], dtype=mx.int32),
            state_pools=pools)
        logits = model(packed.input_ids, ctx)
        kv = ctx.kv_caches
        row = 0
        for i, ch in zip(order, chunks):
            done[i] += len(ch.tokens)
            if ch.logits == "last":
                values = np.array(logits[row].astype(mx.float32))
                row += 1
                logits_rows[i].append(values)
                out[i].append(int(values.argmax()))
                tokens[i].append(out[i][-1])
    return out, logits_rows


# ---- the same weights as a llama.cpp "qwen35" GGUF ------------------------------------

def _grouped_to_tiled(w: np.ndarray, num_k: int, num_v: int, axis: int = 0) -> np.ndarray:
    """llama.cpp's value-head order: [Hk, r, D] -> [r, Hk, D] along `axis` (head-major)."""
    w = np.moveaxis(w, axis, 0)
    rest = w.shape[1:]
    per_head = w.shape[0] // num_v
    w = w.reshape(num_k, num_v // num_k, per_head, *rest).swapaxes(0, 1).reshape(-1, *rest)
    return np.moveaxis(w, 0, axis)


def write_gguf(model, path, config: dict = CONFIG, *, qtype: str = "F32", mtp: bool = False):
    """model (mlx-lm TextModel) as llama.cpp's converter writes it: norms 1 + w (mlx-lm's
    multiplier), ssm_a = -exp(A_log), conv1d [C, K], value heads in tiled order; `mtp`
    adds an MTP layer blk.{n} with nextn tensors and qwen35.nextn_predict_layers = 1.
    A MoE config writes a "qwen35moe" file: router ffn_gate_inp, experts ffn_*_exps
    [E, rows, cols] (in `qtype` too), shared expert ffn_*_shexp, its gate
    ffn_gate_inp_shexp as a vector [hidden] (llama.cpp's shape)."""
    import gguf

    from vllm_metal.models.testing import add_byte_level_tokenizer

    moe = bool(config.get("num_experts"))
    arch = "qwen35moe" if moe else "qwen35"
    n = config["num_hidden_layers"]
    hk, hv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    dk, dv = config["linear_key_head_dim"], config["linear_value_head_dim"]
    key_dim = hk * dk
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n + int(mtp))
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    if moe:
        w.add_expert_count(config["num_experts"])
        w.add_expert_used_count(config["num_experts_per_tok"])
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_key_length(config["head_dim"])
    w.add_value_length(config["head_dim"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rp = config["rope_parameters"]
    w.add_rope_freq_base(rp["rope_theta"])
    w.add_rope_dimension_count(int(config["head_dim"] * rp["partial_rotary_factor"]))
    w.add_array(f"{arch}.rope.dimension_sections", list(rp["mrope_section"]) + [0])
    w.add_uint32(f"{arch}.full_attention_interval", config["full_attention_interval"])
    w.add_ssm_conv_kernel(config["linear_conv_kernel_dim"])
    w.add_ssm_state_size(dk)
    w.add_ssm_group_count(hk)
    w.add_ssm_time_step_rank(hv)
    w.add_ssm_inner_size(hv * dv)
    w.add_vocab_size(config["vocab_size"])
    if mtp:
        w.add_uint32(f"{arch}.nextn_predict_layers", 1)
    add_byte_level_tokenizer(w, config)

    qt = gguf.GGMLQuantizationType[qtype]
    block = gguf.GGML_QUANT_SIZES[qt][0]

    def add(name, value):
        value = np.ascontiguousarray(value, dtype=np.float32)
        if value.ndim in (2, 3) and qtype != "F32" and value.shape[-1] % block == 0:
            w.add_tensor(name, gguf.quants.quantize(value, qt), raw_dtype=qt)
        else:
            w.add_tensor(name, value)

    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
             "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "linear_attn.in_proj_qkv": "attn_qkv",
             "linear_attn.in_proj_z": "attn_gate", "linear_attn.in_proj_b": "ssm_beta",
             "linear_attn.in_proj_a": "ssm_alpha", "linear_attn.norm": "ssm_norm",
             "linear_attn.out_proj": "ssm_out", "linear_attn.conv1d": "ssm_conv1d",
             "mlp.gate": "ffn_gate_inp", "mlp.switch_mlp.gate_proj": "ffn_gate_exps",
             "mlp.switch_mlp.up_proj": "ffn_up_exps", "mlp.switch_mlp.down_proj": "ffn_down_exps",
             "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
             "mlp.shared_expert.up_proj": "ffn_up_shexp",
             "mlp.shared_expert.down_proj": "ffn_down_shexp",
             "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
    tile = lambda x, axis=0: _grouped_to_tiled(x, hk, hv, axis)  # noqa: E731
    for name, value in tree_flatten(model.parameters()):
        v = np.array(value.astype(mx.float32))
        if name == "model.embed_tokens.weight":
            add("token_embd.weight", v)
            continue
        if name == "model.norm.weight":
            add("output_norm.weight", v)
            continue
        if name == "lm_head.weight":
            add("output.weight", v)
            continue
        _, _, i, rest = name.split(".", 3)
        module, _, param = rest.rpartition(".")
        if rest == "linear_attn.A_log":
            add(f"blk.{i}.ssm_a", tile(-np.exp(v)))
        elif rest == "linear_attn.dt_bias":
            add(f"blk.{i}.ssm_dt.bias", tile(v))
        else:
            if module in ("linear_attn.in_proj_qkv", "linear_attn.conv1d"):
                if module == "linear_attn.conv1d":
                    v = v[:, :, 0]  # [C, K]
                v = np.concatenate([v[:2 * key_dim], tile(v[2 * key_dim:])])
            elif module in ("linear_attn.in_proj_z", "linear_attn.in_proj_a", "linear_attn.in_proj_b"):
                v = tile(v)
            elif module == "linear_attn.out_proj":
                v = tile(v, axis=1)
            elif module == "mlp.shared_expert_gate":
                v = v[0]  # [1, hidden] -> [hidden]
            add(f"blk.{i}.{names[module]}.{param}", v)
    if mtp:  # random_mtp_weights(config, 0) (write_checkpoint's block) as llama.cpp lays it out
        for name, v in random_mtp_weights(config, 0).items():
            name = name[len("mtp."):]
            if name.endswith("norm.weight") or name.endswith(("norm_embedding.weight",
                                                             "norm_hidden.weight")):
                v = v + 1.0  # stored 1 + w
            if name.startswith("layers.0."):
                module, param = name[len("layers.0."):].rsplit(".", 1)
                add(f"blk.{n}.{_MTP_GGUF_LAYER[module]}.{param}", v)
            else:
                module, param = name.rsplit(".", 1)
                add(f"blk.{n}.nextn.{_MTP_GGUF_NEXTN[module]}.{param}", v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
