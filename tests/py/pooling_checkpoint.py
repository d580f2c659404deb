"""Tiny random-weight Qwen3 checkpoints saved by transformers, for the pooling tests
(head size 64: one the Metal kernels take, so they also serve on the emulator):
a Qwen3-Embedding-style embedder (Qwen3ForCausalLM, last-token pooling, Matryoshka)
and a Qwen3ForSequenceClassification cross-encoder (one label: a relevance score),
each with the byte-level test tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from qwen3_5_checkpoint import write_tokenizer

VOCAB = 320
SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, vocab_size=VOCAB, max_position_embeddings=512,
             bos_token_id=1, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False,
             rope_parameters={"rope_type": "default", "rope_theta": 1e6})


def _randomize(model, seed: int) -> None:
    """Weights larger than the init's 0.02, so tokens and positions move the outputs."""
    import torch

    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (1.0 if "embed" in name else 2.0 / p.shape[-1] ** 0.5))


def write_embedder(out_dir, seed: int = 0, **config_extra) -> Path:
    """Qwen3ForCausalLM served with --runner pooling (vLLM's embed conversion)."""
    import torch
    import transformers

    out = Path(out_dir)
    config = transformers.Qwen3Config(**SIZES)
    model = transformers.Qwen3ForCausalLM(config).to(torch.float32).eval()
    _randomize(model, seed)
    model.save_pretrained(out, safe_serialization=True)
    write_tokenizer(out, VOCAB)
    _merge_config(out, dict(torch_dtype="float32", **config_extra))
    return out


def write_classifier(out_dir, seed: int = 1, num_labels: int = 1) -> Path:
    """Qwen3ForSequenceClassification: the decoder plus a score layer on the last token."""
    import torch
    import transformers

    out = Path(out_dir)
    config = transformers.Qwen3Config(**SIZES, num_labels=num_labels)
    model = transformers.Qwen3ForSequenceClassification(config).to(torch.float32).eval()
    _randomize(model, seed)
    model.save_pretrained(out, safe_serialization=True)
    write_tokenizer(out, VOCAB)
    _merge_config(out, dict(torch_dtype="float32"))
    return out


def _merge_config(out: Path, extra: dict) -> None:
    path = out / "config.json"
    config = json.loads(path.read_text())
    config.update(extra)
    path.write_text(json.dumps(config, indent=2))


GEMMA_WINDOW = 65  # the bidirectional window transformers derives from sliding_window 128
GEMMA_POSITIONS = 512


def write_embeddinggemma(out_dir, seed: int = 5, hidden: int = 64, projection: int = 128) -> Path:
    """An EmbeddingGemma-style sentence-transformers model: a random Gemma3TextModel with
    bidirectional attention saved by transformers, then the modules google/embeddinggemma-300m
    lists: mean Pooling, Dense hidden -> projection -> hidden (no bias, Identity), Normalize."""
    import torch
    import transformers
    from safetensors.torch import save_file

    out = Path(out_dir)
    config = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=128,
        query_pre_attn_scalar=24, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        use_bidirectional_attention=True, max_position_embeddings=GEMMA_POSITIONS, bos_token_id=1, eos_token_id=0,
        pad_token_id=0, rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    model = transformers.Gemma3TextModel(config).to(torch.float32).eval()
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # gemma norms scale by 1 + w
            p.copy_(0.1 * torch.randn_like(p) if "norm" in name else
                    torch.randn_like(p) * (1.0 if "embed" in name else 2.0 / p.shape[-1] ** 0.5))
    model.save_pretrained(out, safe_serialization=True)
    write_tokenizer(out, VOCAB)
    _merge_config(out, dict(torch_dtype="float32"))
    modules = [("", "sentence_transformers.models.Transformer"), ("1_Pooling", "sentence_transformers.models.Pooling"),
               ("2_Dense", "sentence_transformers.models.Dense"), ("3_Dense", "sentence_transformers.models.Dense"),
               ("4_Normalize", "sentence_transformers.models.Normalize")]
    (out / "modules.json").write_text(json.dumps(
        [{"idx": i, "name": str(i), "path": p, "type": t} for i, (p, t) in enumerate(modules)], indent=2))
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": hidden, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
         "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}))
    for folder, (n_in, n_out) in (("2_Dense", (hidden, projection)), ("3_Dense", (projection, hidden))):
        (out / folder).mkdir()
        (out / folder / "config.json").write_text(json.dumps(
            {"in_features": n_in, "out_features": n_out, "bias": False,
             "activation_function": "torch.nn.modules.linear.Identity"}))
        weight = torch.randn(n_out, n_in) / n_in ** 0.5
        save_file({"linear.weight": weight.contiguous()}, str(out / folder / "model.safetensors"))
    (out / "4_Normalize").mkdir()
    return out


def embeddinggemma_reference(model_dir, token_ids: list[int]) -> np.ndarray:
    """transformers' Gemma3TextModel on CPU torch, then sentence-transformers' modules in
    NumPy: mean over the tokens, the two Dense layers, L2 normalisation."""
    import torch
    import transformers
    from safetensors.numpy import load_file

    model = transformers.Gemma3TextModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        h = model(input_ids=torch.tensor([token_ids])).last_hidden_state[0].double().numpy()
    v = h.mean(axis=0)
    for folder in ("2_Dense", "3_Dense"):
        v = load_file(str(Path(model_dir) / folder / "model.safetensors"))["linear.weight"].astype(np.float64) @ v
    return v / np.linalg.norm(v)
