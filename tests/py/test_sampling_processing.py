"""The native sampler's deterministic parts against NumPy references, seeds
across batch compositions, logprobs, and vLLM's torch Sampler on the same logits."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from vllm import SamplingParams

from sampling_reference import log_softmax, penalized
from vllm_metal.sampling import Sampler, SamplingTable, gather_batch
from vllm_metal.sampling.processors import process
from vllm_metal.sampling.prompt_logprobs import PromptLogprobs

V = 64


def batch_of(params: list[SamplingParams], tokens: list[list[int]], prompt_lens: list[int],
             *, order=None, table=None, for_reference=False):
    """A table with one request per params (row i), gathered in `order`."""
    table = table or SamplingTable(V, rows=len(params), seed=0)
    ids = {}
    for i, (p, toks, plen) in enumerate(zip(params, tokens, prompt_lens)):
        table.add(i, f"r{i}", p, toks[:plen], plen)
        ids[f"r{i}"] = toks
    rows = np.array(order if order is not None else range(len(params)), np.int32)
    gen = np.array([len(tokens[r]) - prompt_lens[r] for r in rows], np.int32)
    return table, gather_batch(table, rows, gen, ids.__getitem__, for_reference=for_reference)


def rand_logits(n, seed=0):
    return np.random.default_rng(seed).normal(scale=2.0, size=(n, V)).astype(np.float32)


def test_penalties_and_logit_bias_match_numpy():
    params = [SamplingParams(temperature=0, repetition_penalty=1.4),
              SamplingParams(temperature=0, frequency_penalty=0.7, presence_penalty=0.3),
              SamplingParams(temperature=0, repetition_penalty=0.8, frequency_penalty=-0.5,
                             logit_bias={5: 3.0, 7: -2.5}),
              SamplingParams(temperature=0)]
    tokens = [[1, 2, 3, 9, 9, 4], [5, 6, 6, 6, 2], [7, 8, 5, 5, 1, 7], [3, 3]]
    plens = [3, 2, 4, 2]
    _, b = batch_of(params, tokens, plens)
    logits = rand_logits(4)
    got = np.array(process(mx.array(logits), b))
    for i, p in enumerate(params):
        want = logits[i].astype(np.float64).copy()
        for t, v in (p.logit_bias or {}).items():
            want[t] += v
        want = penalized(want, tokens[i][:plens[i]], tokens[i][plens[i]:], p.repetition_penalty,
                         p.frequency_penalty, p.presence_penalty)
        np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-5)


def test_min_tokens_bad_words_and_allowed_ids_mask_the_right_tokens():
    eos = 2
    p_min = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[11])
    p_min._all_stop_token_ids = {eos, 11}
    params = [p_min, p_min,
              SamplingParams(temperature=0, allowed_token_ids=[4, 8, 15]),
              SamplingParams(temperature=0)]
    params[3]._bad_words_token_ids = [[20], [30, 31], [40, 41, 42]]
    tokens = [[1, 1, 5], [1, 1, 5, 6, 7], [1], [1, 30, 40, 41]]  # r1 has 3 outputs: unmasked
    plens = [1, 1, 1, 2]
    _, b = batch_of(params, tokens, plens)
    x = np.array(process(mx.array(np.zeros((4, V), np.float32)), b))
    assert np.isneginf(x[0, [eos, 11]]).all() and np.isfinite(np.delete(x[0], [eos, 11])).all()
    assert np.isfinite(x[1]).all()
    assert np.flatnonzero(np.isfinite(x[2])).tolist() == [4, 8, 15]
    # output so far [40, 41]: single-token 20 always, 31 not (prefix 30 is in the prompt), 42 yes
    assert np.flatnonzero(np.isneginf(x[3])).tolist() == [20, 42]


def test_greedy_rows_take_the_argmax_of_the_processed_logits():
    params = [SamplingParams(temperature=0, logit_bias={9: 100.0}), SamplingParams(temperature=0)]
    _, b = batch_of(params, [[1], [1]], [1, 1])
    logits = rand_logits(2)
    tokens = np.array(Sampler()(mx.array(logits), b).tokens)
    assert tokens.tolist() == [9, int(np.argmax(logits[1]))]


def test_seeded_requests_draw_the_same_tokens_in_any_batch():
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    others = [SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=0),
              SamplingParams(temperature=1.2, min_p=0.1, seed=7)]
    logits = rand_logits(4, seed=3) * 0.2  # flat: many tokens in the nucleus
    runs = []
    for order in ([0], [0, 1, 2, 3], [3, 2, 0, 1], [1, 0]):
        params = [seeded] + others
        _, b = batch_of(params, [[1, 2, 3]] * 4, [3] * 4, order=order)
        x = mx.array(logits[[0] * len(order)])  # the seeded request's logits in every row
        tokens = np.array(Sampler()(x, b).tokens)
        runs.append(int(tokens[order.index(0)]))
    assert len(set(runs)) == 1
    # and the draw moves with the number of generated tokens (the key's step)
    draws = set()
    for n_out in range(12):
        _, b = batch_of([seeded], [[1, 2, 3] + [5] * n_out], [3])
        draws.add(int(np.array(Sampler()(mx.array(logits[:1]), b).tokens)[0]))
    assert len(draws) > 1


def test_logprobs_are_the_raw_log_softmax_with_vllm_ranks():
    params = [SamplingParams(temperature=0.9, logprobs=5, repetition_penalty=1.5),
              SamplingParams(temperature=0, logprobs=2), SamplingParams(temperature=0)]
    _, b = batch_of(params, [[1, 2, 3]] * 3, [2] * 3)
    logits = rand_logits(3, seed=5)
    r = Sampler()(mx.array(logits), b)
    ids, lps, ranks = (np.array(a) for a in r.logprobs)
    tokens = np.array(r.tokens)
    ref = log_softmax(logits)
    assert ids.shape == (3, 6) and lps.shape == (3, 6)
    assert not ids[2].any() and not lps[2].any()  # row 2 asked for none: left zero
    for i in range(2):
        assert ids[i, 0] == tokens[i]
        np.testing.assert_allclose(lps[i], ref[i, ids[i]], atol=1e-5)
        assert ids[i, 1:].tolist() == np.argsort(-ref[i])[:5].tolist()
        assert ranks[i] == (ref[i] >= ref[i, tokens[i]]).sum()


def test_prompt_logprobs_over_two_chunks():
    p = SamplingParams(temperature=0, prompt_logprobs=3)
    prompt = [5, 9, 1, 7, 7, 3]
    table = SamplingTable(V, rows=2)
    table.add(0, "a", p, prompt, len(prompt))
    pl = PromptLogprobs(table)
    logits = rand_logits(len(prompt), seed=9)
    got = None
    for lo, hi in ((0, 4), (4, 6)):  # two prefill chunks
        extra = pl.plan(np.array([0], np.int32), np.array([0, hi - lo], np.int32),
                        np.arange(lo, hi, dtype=np.int32))
        scored = pl.score(mx.array(logits[lo:hi][extra]) if len(extra) else None, "raw_logprobs")
        got = pl.collect(scored)
        assert ("a" in got) == (hi == len(prompt))
    ids, lps, ranks = (t.numpy() for t in got["a"][:3])
    ref = log_softmax(logits[:-1])
    assert ids.shape == (5, 4)
    assert ids[:, 0].tolist() == prompt[1:]
    np.testing.assert_allclose(lps[:, 0], ref[np.arange(5), prompt[1:]], atol=1e-5)
    assert ranks.tolist() == [int((ref[i] >= ref[i, prompt[i + 1]]).sum()) for i in range(5)]


@pytest.mark.parametrize("kw", [
    dict(temperature=0, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2),
    dict(temperature=0, logit_bias={3: 4.0}, allowed_token_ids=[3, 10, 20, 33]),
    dict(temperature=0, min_tokens=4, stop_token_ids=[0, 1, 2, 3, 4, 5]),
    dict(temperature=1.0, top_k=1),
])
def test_native_and_vllm_torch_samplers_agree_on_deterministic_requests(kw):
    from vllm_metal.sampling.torch_sampler import TorchSampler

    params = [SamplingParams(**kw, logprobs=3) for _ in range(3)]
    tokens = [[1, 2, 3, 4, 10, 10], [5, 6, 7], [3, 3, 3, 20]]
    _, b = batch_of(params, tokens, [3, 3, 2], for_reference=True)
    logits = rand_logits(3, seed=11)
    ours = Sampler()(mx.array(logits), b)
    theirs = TorchSampler()(mx.array(logits), b)
    assert np.array(ours.tokens).tolist() == np.array(theirs.tokens).tolist()
    for a, c in zip(ours.logprobs, theirs.logprobs):
        np.testing.assert_allclose(np.array(a), np.array(c), atol=1e-5)


def test_request_validation_passes_what_is_sampled_and_names_what_is_not():
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import StructuredOutputsParams

    from vllm_metal.request_validation import validate_sampling_params

    validate_sampling_params(SamplingParams(
        temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, n=2, seed=1, logprobs=3,
        prompt_logprobs=1, presence_penalty=0.5, frequency_penalty=0.1, repetition_penalty=1.1,
        logit_bias={1: 2.0}, allowed_token_ids=[1, 2], min_tokens=2, bad_words=["x"]))
    validate_sampling_params(SamplingParams(
        structured_outputs=StructuredOutputsParams(json_object=True)))  # the runner masks
    validate_sampling_params(SamplingParams(logprob_token_ids=[1, 2]))  # sampling/token_logprobs.py
    validate_sampling_params(SamplingParams(prompt_logprob_token_ids=np.array([[1, 2]], np.int32)))
    with pytest.raises(VLLMValidationError):
        validate_sampling_params("not sampling params")
    # the offline API passes logit_bias unclamped (HTTP clamps it to [-100, 100]): a value
    # that is not finite, or reaches infinity once divided by a temperature, would make the
    # row's softmax NaN
    validate_sampling_params(SamplingParams(logit_bias={1: -1e30, 2: 1e30}))
    for bad in (float("nan"), float("inf"), -1e39, 3e38, 1.01e30):
        with pytest.raises(VLLMValidationError, match="logit_bias") as e:
            validate_sampling_params(SamplingParams(logit_bias={1: 0.0, 7: bad}))
        assert e.value.parameter == "logit_bias" and "token 7" in str(e.value)


@pytest.mark.parametrize("temperature", [1.0, 0.5, 1e-4])
def test_the_largest_allowed_bias_samples_finite_logprobs(temperature):
    from vllm_metal.request_validation import MAX_LOGIT_BIAS

    # two tokens at the largest bias tie: one of them is drawn, its processed logprob finite
    # (bias, then temperature: past the bound the scaled logits reach infinity, the softmax
    # is NaN and another token comes out; at 1e30 float32 cannot hold the tie's log(1/2))
    params = [SamplingParams(temperature=temperature, seed=3, logprobs=2,
                             logit_bias={7: MAX_LOGIT_BIAS, 9: MAX_LOGIT_BIAS})]
    _, b = batch_of(params, [[1, 2]], [2])
    r = Sampler("processed_logprobs")(mx.array(rand_logits(1, seed=4)), b)
    token = int(np.array(r.tokens)[0])
    ids, lps, _ = (np.array(a) for a in r.logprobs)
    assert token in (7, 9) and ids[0, 0] == token
    assert np.isfinite(lps[0, 0]) and lps[0, 0] <= 0, lps


def test_a_resumed_request_does_not_send_its_prompt_logprobs_again():
    table = SamplingTable(V, rows=1)
    table.add(0, "a", SamplingParams(prompt_logprobs=2), [5, 9, 1], 3, resumed=True)
    pl = PromptLogprobs(table)
    extra = pl.plan(np.array([0], np.int32), np.array([0, 5], np.int32), np.arange(5, dtype=np.int32))
    assert len(extra) == 0 and pl.collect(pl.score(None, "raw_logprobs")) == {}
