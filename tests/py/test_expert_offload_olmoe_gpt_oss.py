"""Expert streaming (models/expert_offload.py) for OLMoE and gpt-oss: with a cache of 25%
of the experts, greedy tokens equal the fully resident model's (itself checked against
transformers in test_models_olmoe.py / test_models_gpt_oss*.py), from safetensors and
from GGUF blocks: OLMoE with and without norm_topk_prob; gpt-oss with dense and MXFP4
experts (biases resident, softmax over the top-k, the clamped SwiGLU). A prompt longer
than the cache makes a layer run in rounds."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")

import test_models_gpt_oss as gpt_oss  # noqa: E402
import test_models_gpt_oss_gguf as gpt_oss_gguf  # noqa: E402
import test_models_olmoe as olmoe  # noqa: E402
from vllm_metal.models import load_model  # noqa: E402
from vllm_metal.models.expert_offload import OffloadConfig, StreamedBiasedSwitchGLU  # noqa: E402
from vllm_metal.models.generate import greedy_generate  # noqa: E402

VOCAB = 320
QUARTER = OffloadConfig.parse({"cache_fraction": 0.25})


def _generate(loaded):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, VOCAB, n).tolist() for n in (5, 30, 2)]
    return greedy_generate(loaded, prompts, 10, block_size=4, prefill_chunk=32, stop_ids=[])


def _assert_streamed_matches_resident(path, num_experts, layers=2, **kw):
    want = _generate(load_model(str(path), **kw))
    assert all(len(set(w)) > 3 for w in want)  # not a degenerate repeat
    loaded = load_model(str(path), expert_offload=QUARTER, **kw)
    assert _generate(loaded) == want
    cache = loaded.expert_cache
    assert sum(p.slots for p in cache.pools) == layers * num_experts // 4
    assert cache.stats.misses > layers * num_experts  # a 25% cache re-reads experts
    return loaded


@pytest.mark.parametrize("overrides", [{}, {"norm_topk_prob": True, "num_experts_per_tok": 3}],
                         ids=["no-renorm", "renorm-top3"])
def test_olmoe_safetensors_and_gguf(tmp_path, overrides):
    config, _ = olmoe.write_checkpoint(tmp_path / "hf", seed=0, vocab_size=VOCAB, **overrides)
    _assert_streamed_matches_resident(tmp_path / "hf", 8, dtype="float32")
    gguf_path = olmoe.write_gguf(tmp_path / "hf", config, tmp_path / "olmoe.gguf", "Q8_0")
    loaded = _assert_streamed_matches_resident(gguf_path, 8, dtype="float32")
    s = loaded.expert_cache.stats  # Q8_0: 34 bytes per 32 weights, three [I, H] projections
    assert s.bytes_streamed == s.misses * 3 * config.intermediate_size * config.hidden_size // 32 * 34


def test_gpt_oss_dense_safetensors_and_mxfp4_gguf(tmp_path):
    config, _ = gpt_oss.write_checkpoint(tmp_path / "hf", seed=6, vocab_size=VOCAB)
    loaded = _assert_streamed_matches_resident(tmp_path / "hf", 8, dtype="float32")
    assert all(isinstance(layer.mlp.experts, StreamedBiasedSwitchGLU)
               for layer in loaded.model.layers)
    gguf_path = tmp_path / "gpt-oss.gguf"
    gpt_oss_gguf.write_gguf(tmp_path / "hf", config, gguf_path, "MXFP4")
    loaded = _assert_streamed_matches_resident(gguf_path, 8, dtype="float32")
    s = loaded.expert_cache.stats  # MXFP4: 17 bytes per 32 weights
    assert s.bytes_streamed == s.misses * 3 * config.intermediate_size * config.hidden_size // 32 * 17


def test_gpt_oss_mxfp4_safetensors(tmp_path):
    config, _ = gpt_oss.write_mxfp4_checkpoint(tmp_path, seed=6, vocab_size=VOCAB)
    loaded = _assert_streamed_matches_resident(tmp_path, 8, dtype="float32")
    s = loaded.expert_cache.stats  # read: published blocks (16 bytes) + scales (1) per 32 weights
    per_expert = 3 * config.intermediate_size * config.hidden_size // 32 * 17
    assert s.bytes_streamed == s.misses * per_expert
