"""Greedy token-exact parity with transformers (float32, CPU) on tiny random
weights: transformers saves the checkpoint, we load it, and the first 32 greedy
tokens of several prompts, decoded together in packed steps, equal
transformers' generate() run on each prompt alone."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from vllm_metal.models import load_model  # noqa: E402
from vllm_metal.models.generate import greedy_generate  # noqa: E402

NEW_TOKENS = 32
SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=256,
             bos_token_id=1, eos_token_id=None, pad_token_id=0)

HF_CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**SIZES, tie_word_embeddings=True,
                                              rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "qwen3": lambda: transformers.Qwen3Config(**SIZES, tie_word_embeddings=False,
                                              rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    # sliding window 6 < prompt + 32 tokens: the windowed layers really slide.
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **dict(SIZES, num_hidden_layers=3, num_key_value_heads=1), sliding_window=6,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        query_pre_attn_scalar=16, final_logit_softcapping=None, tie_word_embeddings=False),
}


def _random_hf_model(config, seed):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    # Larger than the init's 0.02: varied greedy tokens whose top-2 margins
    # (>= 1e-2 on these seeds) dwarf float32 rounding differences.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((0.0 if config.model_type == "gemma3_text" else 1.0) + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (1.0 if "embed" in name else 2.0 / p.shape[-1] ** 0.5))
    return model


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_greedy_tokens_match_transformers(tmp_path, name):
    config = HF_CONFIGS[name]()
    hf = _random_hf_model(config, seed=0)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, config.vocab_size, n).tolist() for n in (5, 11, 2)]

    want = []
    for p in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              do_sample=False, attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              pad_token_id=0)
        want.append(out[0, len(p):].tolist())

    loaded = load_model(str(tmp_path), "float32")
    got = greedy_generate(loaded, prompts, NEW_TOKENS, block_size=4, prefill_chunk=4, stop_ids=[])
    assert all(len(set(w)) > 4 for w in want)  # not a degenerate repeat
    assert got == want
