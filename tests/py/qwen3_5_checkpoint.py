"""A tiny random-weight Qwen3.5 text checkpoint as `vllm serve` reads one, plus its
reference: mlx-lm's own qwen3_5 TextModel loaded from the same files.

    ckpt = write_checkpoint(dir)              # config.json, model.safetensors (HF layout),
                                              # tokenizer.json (byte-level BPE), generation_config
    ref = reference_model(ckpt)               # mlx-lm's model, its own loader and sanitize
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
    model.model.embed_tokens.weight = 0.5 * model.model.embed_tokens.weight
    mx.eval(model.parameters())
    return model


def hf_weights(model) -> dict[str, np.ndarray]:
    """The model's parameters named and laid out as an HF Qwen3.5 text checkpoint."""
    out = {}
    for name, value in tree_flatten(model.parameters()):
        v = np.array(value.astype(mx.float32))
        if name.endswith("conv1d.weight"):  # mlx [C, K, 1] -> HF [C, 1, K]
            v = np.moveaxis(v, 2, 1)
        elif name.endswith(_CENTRED_NORMS):
            v = v - 1.0
        out[name] = v
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


def write_checkpoint(out_dir, seed: int = 0, config: dict = CONFIG) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = random_model(seed, config)
    mx.save_safetensors(str(out / "model.safetensors"),
                        {k: mx.array(v) for k, v in hf_weights(model).items()})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": config["eos_token_id"], "bos_token_id": config["bos_token_id"]}))
    write_tokenizer(out, config["vocab_size"])
    return out


def reference_model(checkpoint_dir):
    """mlx-lm's qwen3_5.TextModel from the checkpoint, through mlx-lm's own loader."""
    from mlx_lm.models import qwen3_5
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(checkpoint_dir),
                          get_model_classes=lambda config: (qwen3_5.TextModel, qwen3_5.TextModelArgs))
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
