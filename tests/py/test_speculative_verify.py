"""Speculative decoding's verification (sampling/verify.py) and its sampling batch.

The kept tokens must follow the target's own distribution: chi-square tests over
many independently seeded requests, each checking one draft, against vLLM's filtered
softmax; the same statistic catches a wrong rule. Greedy rows keep exactly the drafts
that are their argmax. The batch gives each draft position the parameters of the
request at that output index (penalties over the drafts before it, min_tokens, its
own random numbers)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from vllm import SamplingParams

from sampling_reference import chi_square_p, filtered_probs
from vllm_metal.sampling import Sampler, SamplingTable, gather_batch
from vllm_metal.sampling.batch import gather_draft_batch
from vllm_metal.sampling.draw import draw
from vllm_metal.sampling.rng import accept_uniforms, uniforms
from vllm_metal.sampling.verify import kept_tokens

V = 12
DRAWS = 6000
LOGITS = np.array([2.0, 1.5, 1.4, 1.0, 0.7, 0.5, 0.0, -0.3, -1.0, -1.5, -2.5, -4.0], np.float32)


def one_draft_each(params: SamplingParams, draft: int, draws: int = DRAWS, seed: int = 0):
    """`draws` requests, each with one draft: 2 rows each (the draft's row, the bonus row)."""
    table = SamplingTable(V, rows=draws, seed=seed)
    for r in range(draws):
        table.add(r, f"r{r}", params, [0], 1)
    rows = np.arange(draws, dtype=np.int32)
    b = gather_draft_batch(table, rows, np.zeros(draws, np.int32), [[draft]] * draws)
    x = mx.broadcast_to(mx.array(LOGITS)[None], (2 * draws, V))
    return b, x


def outputs_of(result, draws: int) -> list[list[int]]:
    cu = np.arange(draws + 1) * 2
    return kept_tokens(np.array(result.tokens), np.array(result.kept), cu)


@pytest.mark.parametrize("kw,draft", [
    (dict(temperature=1.0), 0),  # the likeliest token
    (dict(temperature=1.0), 5),
    (dict(temperature=0.7), 9),  # unlikely: mostly rejected
    (dict(temperature=1.0, top_k=4), 2),
    (dict(temperature=1.0, top_k=4), 7),  # outside the top 4: never kept
    (dict(temperature=1.2, top_p=0.8, min_p=0.05), 3),
], ids=lambda v: str(v))
def test_kept_tokens_follow_the_target_distribution(kw, draft):
    b, x = one_draft_each(SamplingParams(**kw), draft)
    outs = outputs_of(Sampler()(x, b), DRAWS)
    probs = filtered_probs(LOGITS, kw.get("temperature", 1.0), kw.get("top_k", 0),
                           kw.get("top_p", 1.0), kw.get("min_p", 0.0))
    first = np.bincount([o[0] for o in outs], minlength=V)
    assert first[probs == 0].sum() == 0
    assert chi_square_p(first, probs) > 1e-4, (first, (probs * DRAWS).round(1))
    # a kept draft is followed by the bonus row's own draw
    bonus = np.bincount([o[1] for o in outs if len(o) == 2], minlength=V)
    assert all(len(o) == 1 or o[0] == draft for o in outs)
    if bonus.sum() > 200:
        assert chi_square_p(bonus, probs) > 1e-4, (bonus, probs)
    kept = sum(len(o) == 2 for o in outs) / DRAWS
    assert abs(kept - probs[draft]) < 5 * np.sqrt(probs[draft] * (1 - probs[draft]) / DRAWS) + 1e-9


def wrong_rule_first_tokens(params: SamplingParams, draft: int) -> np.ndarray:
    """A plausible bug: a rejected draft replaced by a draw from the full target (the
    draft not taken out), i.e. the draft comes out too often."""
    b, x = one_draft_each(params, draft)
    x = x[0::2]
    _, weights = (x, mx.exp(x - mx.max(x, axis=-1, keepdims=True)))
    p = np.array(weights / mx.sum(weights, axis=-1, keepdims=True))[:, draft]
    keep = b.accept_uniforms[0::2] < p
    own = np.array(draw(weights, b.uniforms[0::2]))
    return np.where(keep, draft, own)


def test_a_wrong_rule_is_detected():
    first = np.bincount(wrong_rule_first_tokens(SamplingParams(temperature=1.0), 1), minlength=V)
    probs = filtered_probs(LOGITS, 1.0)
    with pytest.raises(AssertionError):
        assert chi_square_p(first, probs) > 1e-4


def test_greedy_rows_keep_drafts_while_they_are_the_argmax():
    table = SamplingTable(V, rows=4)
    for r in range(3):
        table.add(r, f"r{r}", SamplingParams(temperature=0.0), [0], 1)
    drafts = [[0, 0, 5], [3], []]  # argmax of LOGITS is 0
    b = gather_draft_batch(table, np.arange(3, dtype=np.int32), np.zeros(3, np.int32), drafts)
    x = np.tile(LOGITS, (7, 1))
    x[2, 4] = 9.0  # request 0's third row prefers 4 over its draft 5
    result = Sampler()(mx.array(x), b)
    outs = kept_tokens(np.array(result.tokens), np.array(result.kept), np.array([0, 4, 6, 7]))
    assert outs == [[0, 0, 4], [0], [0]]


def test_kept_tokens_stops_at_the_first_rejection():
    tokens = np.array([5, 6, 7, 8, 1, 2, 3], np.int32)
    kept = np.array([True, False, True, False, True, True, False])
    assert kept_tokens(tokens, kept, np.array([0, 4, 7])) == [[5, 6], [1, 2, 3]]


def test_each_draft_row_has_the_parameters_of_its_output_index():
    params = SamplingParams(temperature=1.0, seed=7, frequency_penalty=0.5,
                            repetition_penalty=1.3, min_tokens=3, stop_token_ids=[9])
    table = SamplingTable(V, rows=2)
    table.add(0, "a", params, [1, 2, 4], 2)  # prompt [1, 2], output so far [4]
    history = {"a": [1, 2, 4]}
    drafts = [[4, 6]]
    b = gather_draft_batch(table, np.array([0], np.int32), np.array([1], np.int32), drafts,
                           history.__getitem__)
    for j in range(3):  # row j: output [4] + drafts[:j], at output index 1 + j
        table_j = SamplingTable(V, rows=2)
        table_j.add(0, "a", params, [1, 2, 4, *drafts[0][:j]], 2)
        ref = gather_batch(table_j, np.array([0], np.int32), np.array([1 + j], np.int32),
                           {"a": [1, 2, 4, *drafts[0][:j]]}.__getitem__)
        np.testing.assert_array_equal(b.output_tokens[j, :1 + j], ref.output_tokens[0, :1 + j])
        assert (b.output_tokens[j, 1 + j:] == V).all()
        np.testing.assert_array_equal(b.prompt_tokens[j], ref.prompt_tokens[0])
        assert b.uniforms[j] == uniforms(np.array([7], np.uint64), np.array([1 + j]))[0]
        assert b.accept_uniforms[j] == accept_uniforms(np.array([7], np.uint64), np.array([1 + j]))[0]
    # min_tokens=3: output indices 1 and 2 may not stop, index 3 may
    banned_rows = set(b.banned[0][b.banned[1] == 9].tolist())
    assert banned_rows == {0, 1}
    np.testing.assert_array_equal(b.draft_tokens, [4, 6, -1])
