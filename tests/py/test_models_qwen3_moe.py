"""Qwen3-MoE (qwen3_moe) from safetensors, its sparse MLPs on ops.fused_moe: greedy
token-exact parity with transformers (float32, CPU) on a tiny random checkpoint
(2 layers, 8 experts, top-2, hidden 64), prompts decoded together in packed steps;
logits close to transformers' on a prompt; the MoE blocks really are swapped."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_models_transformers import NEW_TOKENS, SIZES, _random_hf_model  # noqa: E402
from vllm_metal.models import load_model  # noqa: E402
from vllm_metal.models.generate import greedy_generate  # noqa: E402
from vllm_metal.models.moe import FusedMoeBlock  # noqa: E402


def qwen3_moe_config(**overrides):
    sizes = dict(SIZES, intermediate_size=96)
    kw = dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
              decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
              rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    return transformers.Qwen3MoeConfig(**{**sizes, **kw, **overrides})


def write_checkpoint(path, seed=0, **overrides):
    config = qwen3_moe_config(**overrides)
    hf = _random_hf_model(config, seed=seed)
    hf.save_pretrained(path, safe_serialization=True)
    return config, hf


def hf_greedy(hf, prompts, n):
    """transformers' argmax, token by token over the whole sequence (no generate(): its
    min_new_tokens would mask the eos token, which a served ignore_eos request may pick)."""
    out = []
    for p in prompts:
        seq = list(p)
        with torch.no_grad():
            for _ in range(n):
                seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
        out.append(seq[len(p):])
    return out


@pytest.mark.parametrize("overrides", [{}, {"norm_topk_prob": False, "mlp_only_layers": [0]}],
                         ids=["renorm", "no-renorm-dense-layer0"])
def test_greedy_tokens_match_transformers(tmp_path, overrides):
    config, hf = write_checkpoint(tmp_path, **overrides)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, config.vocab_size, n).tolist() for n in (5, 11, 2)]
    want = hf_greedy(hf, prompts, NEW_TOKENS)

    loaded = load_model(str(tmp_path), "float32")
    moe = [type(layer.mlp) is FusedMoeBlock for layer in loaded.model.layers]
    assert moe == [i not in config.mlp_only_layers for i in range(config.num_hidden_layers)]
    got = greedy_generate(loaded, prompts, NEW_TOKENS, block_size=4, prefill_chunk=4, stop_ids=[])
    assert all(len(set(w)) > 4 for w in want)  # not a degenerate repeat
    assert got == want


def assert_prompt_logits_match(path, hf, vocab_size: int) -> None:
    """Every prompt position's logits, over two prefill chunks, equal transformers' (the
    checkpoint at path holds hf's weights)."""
    from vllm_metal.models.testing import run_packed

    tokens = np.random.default_rng(2).integers(3, vocab_size, 13).tolist()
    with torch.no_grad():
        want = hf(torch.tensor([tokens])).logits[0].numpy()
    loaded = load_model(str(path), "float32")
    got = run_packed(loaded, [tokens], schedules=[[8, 5]])[0]
    err = np.abs(got - want).max() / max(1.0, np.abs(want).max())
    assert err < 1e-4, err


def test_prompt_logits_match_transformers(tmp_path):
    config, hf = write_checkpoint(tmp_path, seed=3)
    assert_prompt_logits_match(tmp_path, hf, config.vocab_size)


@pytest.mark.slow
def test_emulated_metal_kernels_match_transformers(tmp_path):
    """Every op of the model (attention, norms, rope, fused_moe) on its Metal kernel in the
    emulator; head_dim 64, a size the Metal attention kernels take."""
    from vllm_metal import ops
    from vllm_metal.models.testing import run_packed

    config, hf = write_checkpoint(tmp_path, seed=4, num_attention_heads=2, num_key_value_heads=1,
                                  head_dim=64)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, config.vocab_size, n).tolist() for n in (6, 3)]
    want = hf_greedy(hf, prompts, 8)
    previous = ops.kernel_backend()
    ops.set_kernel_backend("emulated")
    try:
        loaded = load_model(str(tmp_path), "float32")
        got = greedy_generate(loaded, prompts, 8, block_size=4, prefill_chunk=4, stop_ids=[])
    finally:
        ops.set_kernel_backend(previous)
    assert got == want
