"""logprob_token_ids and prompt_logprob_token_ids against NumPy references: the
scores of the requested ids in every logprobs mode, rows with ids next to rows with
top-n logprobs and rows with none, and prompt rows scored over chunked prefills."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from vllm import SamplingParams

from sampling_reference import log_softmax
from test_sampling_processing import V, batch_of, rand_logits
from vllm_metal.sampling import Sampler, SamplingTable
from vllm_metal.sampling.prompt_logprobs import PromptLogprobs


def _mixed_batch():
    params = [SamplingParams(temperature=0, logprob_token_ids=[3, 7, 60]),
              SamplingParams(temperature=0, logprobs=5),
              SamplingParams(temperature=0),
              SamplingParams(temperature=2.0, seed=1, logprob_token_ids=[10])]
    return params, batch_of(params, [[1, 2, 3]] * 4, [2] * 4)[1]


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits", "processed_logprobs",
                                  "processed_logits"])
def test_logprob_token_ids_score_those_ids_in_every_mode(mode):
    params, b = _mixed_batch()
    logits = rand_logits(4, seed=21)
    r = Sampler(mode)(mx.array(logits), b)
    ids, lps, ranks = (np.array(a) for a in r.logprobs)
    tokens = np.array(r.tokens)
    assert ids.shape == (4, 6) and lps.shape == (4, 6)  # 1 + max(5 top, 3 ids)
    # the reference scores of each row: raw, or after temperature (processed; greedy
    # rows keep their logits)
    temp = np.array([1.0, 1.0, 1.0, 2.0])[:, None] if mode.startswith("processed") else 1.0
    scaled = logits.astype(np.float64) / temp
    ref = log_softmax(scaled) if mode.endswith("logprobs") else scaled
    for i in (0, 3):
        want = params[i].logprob_token_ids
        k = len(want)
        assert ids[i, 0] == tokens[i] and ids[i, 1:1 + k].tolist() == want
        np.testing.assert_allclose(lps[i, :1 + k], ref[i, [tokens[i], *want]], rtol=1e-5,
                                   atol=1e-5)
        assert np.isneginf(lps[i, 1 + k:]).all() and not ids[i, 1 + k:].any()  # padding
        assert ranks[i] == (ref[i] >= ref[i, tokens[i]]).sum()
    # the top-n row keeps its top 5; the row that asked for nothing stays zero
    assert ids[1, 1:].tolist() == np.argsort(-ref[1])[:5].tolist()
    np.testing.assert_allclose(lps[1], ref[1, ids[1]], rtol=1e-5, atol=1e-5)
    assert not ids[2].any() and not lps[2].any()


def test_a_batch_of_only_token_ids_matches_vllms_torch_sampler():
    from vllm_metal.sampling.torch_sampler import TorchSampler

    params = [SamplingParams(temperature=0, logprob_token_ids=[5, 9]),
              SamplingParams(temperature=0, logprob_token_ids=[1, 2, 3, 63])]
    _, b = batch_of(params, [[1, 2, 3]] * 2, [2] * 2, for_reference=True)
    logits = rand_logits(2, seed=4)
    ours = Sampler()(mx.array(logits), b)
    theirs = TorchSampler()(mx.array(logits), b)
    assert np.array(ours.tokens).tolist() == np.array(theirs.tokens).tolist()
    # vLLM's V1 sampler pads with -inf too; its padded ids are 0 as ours
    for a, c in zip(ours.logprobs, theirs.logprobs):
        np.testing.assert_allclose(np.array(a), np.array(c), rtol=1e-5, atol=1e-5)


def test_prompt_logprob_token_ids_over_two_chunks_next_to_top_n_prompt_logprobs():
    prompt = [5, 9, 1, 7, 7, 3, 2]
    ids = np.array([[4, 9, -1], [1, 1, 2], [7, 0, -1], [60, -1, -1], [3, 5, 8]], np.int32)
    scored_ids = SamplingParams(temperature=0, prompt_logprob_token_ids=ids,
                                prompt_logprob_start=1)  # rows 1..5 of the prompt
    top = SamplingParams(temperature=0, prompt_logprobs=2)
    table = SamplingTable(V, rows=2)
    table.add(0, "ids", scored_ids, prompt, len(prompt))
    table.add(1, "top", top, prompt, len(prompt))
    pl = PromptLogprobs(table)
    logits = rand_logits(len(prompt), seed=13)  # the same prompt: the same logits
    got_ids, got_top = {}, {}
    for lo, hi in ((0, 3), (3, 7)):  # two prefill chunks of both requests
        n = hi - lo
        extra = pl.plan(np.array([0, 1], np.int32), np.array([0, n, 2 * n], np.int32),
                        np.concatenate([np.arange(lo, hi), np.arange(lo, hi)]).astype(np.int32))
        packed = np.concatenate([logits[lo:hi], logits[lo:hi]])
        scored = pl.score(mx.array(packed[extra]) if len(extra) else None, "raw_logprobs")
        mx.eval(pl.arrays(scored))
        got_ids.update(pl.collect_token_ids(scored))
        got_top.update(pl.collect(scored))
        if lo == 0:
            # the ids request computes rows 1 and 2 only; the top-n request 0..2
            assert len(extra) == 2 + 3
            assert not got_ids and not got_top
    ref = log_softmax(logits.astype(np.float64))
    want = np.where(ids >= 0, ref[1 + np.arange(5)[:, None], np.maximum(ids, 0)], -np.inf)
    out = got_ids["ids"].numpy()
    assert out.shape == (5, 3) and out.dtype == np.float32
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    assert got_top["top"].logprob_token_ids[:, 0].tolist() == prompt[1:]
    assert "ids" not in got_top and "top" not in got_ids


def test_prompt_logprob_token_ids_in_logits_mode_are_the_raw_logits():
    prompt = [3, 4, 5, 6]
    ids = np.array([[1, 2], [3, -1], [0, 63]], np.int32)
    table = SamplingTable(V, rows=1)
    table.add(0, "a", SamplingParams(prompt_logprob_token_ids=ids), prompt, len(prompt))
    pl = PromptLogprobs(table)
    logits = rand_logits(4, seed=2)
    extra = pl.plan(np.array([0], np.int32), np.array([0, 4], np.int32), np.arange(4, dtype=np.int32))
    got = pl.collect_token_ids(pl.score(mx.array(logits[extra]), "raw_logits"))["a"].numpy()
    want = np.where(ids >= 0, logits[np.arange(3)[:, None], np.maximum(ids, 0)], -np.inf)
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_a_resumed_request_does_not_score_its_prompt_ids_again():
    table = SamplingTable(V, rows=1)
    table.add(0, "a", SamplingParams(prompt_logprob_token_ids=np.array([[1], [2]], np.int32)),
              [5, 9, 1], 3, resumed=True)
    pl = PromptLogprobs(table)
    extra = pl.plan(np.array([0], np.int32), np.array([0, 5], np.int32), np.arange(5, dtype=np.int32))
    assert len(extra) == 0 and pl.collect_token_ids(pl.score(None, "raw_logprobs")) == {}
