"""pooling.Pooler on its own: every pooling type over prompts split into chunks and
packed with other requests gives what NumPy gives on the whole prompt's hidden states."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.pooling_params import PoolingParams

from vllm_metal.pooling import Pooler, PoolingError, score_classifier

H = 8


def _config(seq="LAST", tok="ALL", **hf):
    pooler = SimpleNamespace(seq_pooling_type=seq, tok_pooling_type=tok, logit_mean=None, logit_sigma=None)
    return SimpleNamespace(pooler_config=pooler, head_dtype=torch.float32,
                           hf_config=SimpleNamespace(num_labels=hf.get("num_labels", 1)))


def _run(pooler, prompts: dict[str, int], budget: int, hidden: dict[str, np.ndarray]):
    """Schedules the prompts in steps of at most `budget` tokens (vLLM's chunked prefill,
    several requests a step) and returns each request's output."""
    done, out = {r: 0 for r in prompts}, {}
    while len(out) < len(prompts):
        left, req_ids, cu, positions = budget, [], [0], []
        for r, n in prompts.items():
            if r in out or done[r] >= n or left == 0:
                continue
            k = min(left, n - done[r])
            req_ids.append(r)
            positions += range(done[r], done[r] + k)
            cu.append(cu[-1] + k)
            left -= k
        plan = pooler.plan(req_ids, np.array(cu), np.array(positions))
        packed = np.concatenate([hidden[r][done[r]:done[r] + (cu[i + 1] - cu[i])]
                                 for i, r in enumerate(req_ids)])
        for i, r in enumerate(req_ids):
            done[r] += cu[i + 1] - cu[i]
        for r, o in zip(req_ids, pooler.pool(plan, packed[plan.rows])):
            if o is not None:
                assert done[r] == prompts[r]  # only a finished prompt has an output
                out[r] = o.numpy()
    return out


@pytest.mark.parametrize("method", ["LAST", "MEAN", "CLS"])
def test_sequence_pooling_across_chunks(method):
    rng = np.random.default_rng(0)
    prompts = {"a": 1, "b": 13, "c": 40, "d": 7}
    hidden = {r: rng.standard_normal((n, H)).astype(np.float32) for r, n in prompts.items()}
    pooler = Pooler(_config(method))
    for r, n in prompts.items():
        pooler.add(r, PoolingParams(task="embed", use_activation=True), n)
    got = _run(pooler, prompts, budget=6, hidden=hidden)
    for r, h in hidden.items():
        v = {"LAST": h[-1], "MEAN": h.mean(0), "CLS": h[0]}[method]
        np.testing.assert_allclose(got[r], v / np.linalg.norm(v), rtol=1e-5, atol=1e-6)


def test_token_embed_dimensions_and_no_normalisation():
    rng = np.random.default_rng(1)
    prompts = {"a": 9, "b": 3}
    hidden = {r: rng.standard_normal((n, H)).astype(np.float32) for r, n in prompts.items()}
    pooler = Pooler(_config())
    pooler.add("a", PoolingParams(task="token_embed", use_activation=True, dimensions=5), 9)
    pooler.add("b", PoolingParams(task="token_embed", use_activation=False), 3)
    got = _run(pooler, prompts, budget=4, hidden=hidden)
    a = hidden["a"][:, :5]
    np.testing.assert_allclose(got["a"], a / np.linalg.norm(a, axis=1, keepdims=True), rtol=1e-5)
    np.testing.assert_allclose(got["b"], hidden["b"], rtol=1e-6)


def test_classifier_softmax_over_labels():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((3, H)).astype(np.float32)
    hidden = {"a": rng.standard_normal((5, H)).astype(np.float32)}
    pooler = Pooler(_config("LAST", num_labels=3), score_classifier(w, None, torch.float32))
    assert pooler.supported_tasks() == ("classify", "token_classify")
    pooler.add("a", PoolingParams(task="classify", use_activation=True), 5)
    got = _run(pooler, {"a": 5}, budget=2, hidden=hidden)["a"]
    logits = w @ hidden["a"][-1]
    np.testing.assert_allclose(got, np.exp(logits) / np.exp(logits).sum(), rtol=1e-5)


def test_a_task_the_model_does_not_serve_and_skipped_tokens_are_refused():
    pooler = Pooler(_config("MEAN"))
    with pytest.raises(PoolingError, match="classify"):
        pooler.add("x", PoolingParams(task="classify"), 4)
    pooler.add("y", PoolingParams(task="embed", use_activation=True), 8)
    with pytest.raises(PoolingError, match="needs every prompt token"):  # a prefix-cache hit
        pooler.plan(["y"], np.array([0, 4]), np.arange(4, 8))


def test_a_bidirectional_source_refuses_a_chunked_prompt():
    pooler = Pooler(_config("CLS"), causal=False)
    pooler.add("z", PoolingParams(task="embed", use_activation=True), 8)
    with pytest.raises(PoolingError, match="one step"):
        pooler.plan(["z"], np.array([0, 4]), np.arange(0, 4))
    pooler.plan(["z"], np.array([0, 8]), np.arange(0, 8))  # whole: fine


@pytest.mark.parametrize("method, whole", [("MEAN", True), ("CLS", False), ("LAST", False)])
def test_a_step_that_pools_every_row_needs_no_gather(method, whole):
    # the encoder runner hands a MEAN step's hidden states over ungathered (rows=None)
    pooler = Pooler(_config(method), causal=False)
    for r, n in (("a", 3), ("b", 5)):
        pooler.add(r, PoolingParams(task="embed", use_activation=True), n)
    plan = pooler.plan(["a", "b"], np.array([0, 3, 8]), np.array([0, 1, 2, 0, 1, 2, 3, 4]))
    assert plan.takes_all_rows(8) is whole
    assert plan.takes_all_rows(9) is False
