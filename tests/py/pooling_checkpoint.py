"""Tiny random-weight Qwen3 checkpoints saved by transformers, for the pooling tests
(head size 64: one the Metal kernels take, so they also serve on the emulator):
a Qwen3-Embedding-style embedder (Qwen3ForCausalLM, last-token pooling, Matryoshka)
and a Qwen3ForSequenceClassification cross-encoder (one label: a relevance score),
each with the byte-level test tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

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
