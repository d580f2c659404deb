"""A decoder LM served as a classifier from its own vocabulary (vLLM's "LLM as reranker"):
Qwen3-Reranker, mxbai-rerank-v2, bge-reranker-v2-gemma.

vLLM marks such a model with `method` and `classifier_from_token` in its config (from
--hf-overrides; for `is_original_qwen3_reranker` its Qwen3 config hook fills them in) and
builds the score layer from rows of the LM head at load time. We build the same layer:

    from_2_way_softmax   tokens [false, true]: one label, w = lm_head[true] - lm_head[false];
                         sigmoid(w . h) equals softmax over the two logits at the last token
    no_post_processing   one label per token: w = lm_head[tokens]

The rows come from the safetensors checkpoint (lm_head.weight, or the embeddings when
tied), the token ids from the served tokenizer.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

METHODS = ("from_2_way_softmax", "no_post_processing")


def classifier_method(hf_config) -> tuple[str, list[str]] | None:
    """(method, tokens) when vLLM's config asks for a classifier from tokens, else None."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    method = getattr(hf_config, "method", None) or getattr(text, "method", None)
    if method is None:
        return None
    tokens = getattr(hf_config, "classifier_from_token", None) or getattr(text, "classifier_from_token", None)
    if method not in METHODS:
        raise ValueError(f"[vllm-metal] classifier method {method!r} is not supported "
                         f"(supported: {', '.join(METHODS)})")
    if not tokens or (method == "from_2_way_softmax" and len(tokens) != 2):
        raise ValueError(f"[vllm-metal] classifier method {method} needs classifier_from_token "
                         f"({'[false, true]' if method == 'from_2_way_softmax' else 'one token per label'}), "
                         f"got {tokens!r}")
    return method, list(tokens)


def score_weight_from_tokens(model_path: str, method: str, token_ids: list[int],
                             tied: bool) -> np.ndarray:
    """The score layer [num_labels, hidden] (float32) built from LM-head rows."""
    rows = _lm_head_rows(Path(model_path), token_ids, tied)
    if method == "from_2_way_softmax":
        return (rows[1] - rows[0])[None, :]
    return rows


def _lm_head_rows(path: Path, token_ids: list[int], tied: bool) -> np.ndarray:
    from safetensors import safe_open

    wanted = ["model.embed_tokens.weight"] if tied else ["lm_head.weight", "model.embed_tokens.weight"]
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        raise ValueError(f"[vllm-metal] {path}: a classifier from tokens (classifier_from_token) is built "
                         "from a safetensors checkpoint's LM head; this checkpoint has none (GGUF?)")
    for name in wanted:
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                if name in set(f.keys()):
                    table = f.get_slice(name)
                    return np.stack([table[i:i + 1].float().numpy()[0] for i in token_ids])
    raise ValueError(f"[vllm-metal] {path}: no {' or '.join(wanted)} to build the classifier from")


def token_ids_of(tokenizer, tokens: list[str]) -> list[int]:
    """Each classifier token's id in the served tokenizer; a token it lacks is an error
    (convert_tokens_to_ids would map it to the unknown token silently)."""
    vocab = tokenizer.get_vocab()
    missing = [t for t in tokens if t not in vocab]
    if missing:
        raise ValueError(f"[vllm-metal] classifier_from_token {missing} not in the tokenizer's vocabulary")
    return [vocab[t] for t in tokens]
