"""Our Qwen3.5 text model (gated delta layers on ops.causal_conv1d / ops.gated_delta_rule
with slot state) against mlx-lm's own Qwen3.5 forward, random-weight tiny checkpoint:
token-exact greedy decoding, chunked prefill, two requests interleaved over one pool."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

qwen3_5 = pytest.importorskip("mlx_lm.models.qwen3_5")

from vllm_metal.models import qwen3_5 as ours  # noqa: E402

CONFIG = dict(
    model_type="qwen3_5_text", hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=97,
    rms_norm_eps=1e-6, linear_num_value_heads=4, linear_num_key_heads=2,
    linear_key_head_dim=32, linear_value_head_dim=16, linear_conv_kernel_dim=4,
    full_attention_interval=4, tie_word_embeddings=False,
    rope_parameters={"type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0,
                     "partial_rotary_factor": 0.25},
)
PROMPT = [5, 17, 3, 88, 42, 1, 9, 60, 23, 71, 4]
STEPS = 12


@pytest.fixture(scope="module")
def models():
    mx.random.seed(0)
    args = qwen3_5.TextModelArgs.from_dict(CONFIG)
    reference = qwen3_5.TextModel(args)
    # livelier gates than the default init, so the state matters to the tokens
    for layer in reference.model.layers:
        if layer.is_linear:
            layer.linear_attn.dt_bias = mx.random.normal((args.linear_num_value_heads,))
    mx.eval(reference.parameters())
    return reference, ours.from_mlx_lm(reference, num_slots=4)


def greedy(model, cache, prompt, steps, chunks=None):
    """Greedy tokens and the logits of every step (prefill in `chunks`)."""
    tokens, logits = [], []
    chunks = chunks or [len(prompt)]
    start = 0
    for n in chunks:
        out = model(mx.array([prompt[start:start + n]]), cache=cache)
        start += n
    for _ in range(steps):
        last = out[0, -1]
        logits.append(np.array(last))
        tokens.append(int(mx.argmax(last).item()))
        out = model(mx.array([[tokens[-1]]]), cache=cache)
    return tokens, np.stack(logits)


def test_greedy_tokens_match_mlx_lm(models, backend):
    # backend "emulated": the linear-attention layers run the Metal kernels
    reference, model = models
    ref_tokens, ref_logits = greedy(reference, reference.make_cache(), PROMPT, STEPS)
    linear = [l.linear_attn for l in model.model.layers if l.is_linear]
    assert linear and all(isinstance(l, ours.GatedDeltaNet) for l in linear)
    assert all(isinstance(l.self_attn.rope, ours.InterleavedMrope)
               for l in model.model.layers if not l.is_linear)
    tokens, logits = greedy(model, model.make_cache(slot=2), PROMPT, STEPS)
    assert float(mx.abs(model.pools[0].ssm[2]).max().item()) > 0  # our state slot was used
    assert tokens == ref_tokens
    np.testing.assert_allclose(logits, ref_logits, atol=2e-4, rtol=1e-4)
    assert len(set(tokens)) > 1  # not a degenerate checkpoint


@pytest.mark.parametrize("chunks", [[1] * len(PROMPT), [2, 7, 2], [3, 8]],
                         ids=["token-by-token", "2-7-2", "3-8"])
def test_chunked_prefill_matches_one_prefill(models, chunks):
    reference, model = models
    ref_tokens, _ = greedy(reference, reference.make_cache(), PROMPT, 6)
    tokens, _ = greedy(model, model.make_cache(slot=1), PROMPT, 6, chunks=chunks)
    assert tokens == ref_tokens


def test_interleaved_requests_keep_their_slots(models):
    _, model = models
    prompts = [PROMPT, [7, 7, 30, 2]]
    solo = [greedy(model, model.make_cache(slot=3), p, 5)[0] for p in prompts]
    caches = [model.make_cache(slot=0), model.make_cache(slot=1)]
    outs = [model(mx.array([p]), cache=c) for p, c in zip(prompts, caches)]
    got = [[], []]
    for _ in range(5):
        for i in (1, 0):  # alternate, B first
            token = int(mx.argmax(outs[i][0, -1]).item())
            got[i].append(token)
            outs[i] = model(mx.array([[token]]), cache=caches[i])
    assert got == solo
