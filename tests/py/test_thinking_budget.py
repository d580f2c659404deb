"""thinking_token_budget without a server: the forced token of sampling/thinking_budget.py
against a step-by-step reference (a counter walked over the tokens as they come, the way
a reader of the contract would count), and the forcing in the native sampler.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from vllm_metal.sampling import Sampler, SamplingTable, gather_batch
from vllm_metal.sampling.thinking_budget import ThinkingBudget, force_tokens, last_index

START, END = 7, 8  # single-token markers
END_SEQ = [5, 6, END]  # a multi-token forced end ("... </think>")


def reference_forced(tokens: list[int], budget: int, start: list[int], natural: list[int],
                     end: list[int]) -> int | None:
    """Walks the tokens once: a section opens after `start`, closes after `natural`; inside,
    each token counts; the forced sequence advances one token per call."""
    inside, count, i = False, 0, 0
    while i < len(tokens):
        if tokens[i:i + len(start)] == start:
            inside, count, i = True, 0, i + len(start)
            continue
        if tokens[i:i + len(natural)] == natural:
            inside, count, i = False, 0, i + len(natural)
            continue
        if inside:
            count += 1
        i += 1
    if not inside or count < budget:
        return None
    for k in range(len(end) - 1, 0, -1):  # the forced sequence already under way
        if tokens[-k:] == end[:k]:
            return end[k]
    return end[0]


def test_last_index_finds_single_and_multi_token_patterns():
    ids = np.array([1, 2, 3, 1, 2, 4])
    assert last_index(ids, np.array([1, 2])) == 3
    assert last_index(ids, np.array([2])) == 4
    assert last_index(ids, np.array([4, 1])) == -1
    assert last_index(ids[:1], np.array([1, 2])) == -1


@pytest.mark.parametrize("end", [[END], END_SEQ], ids=["single_end", "sequence_end"])
def test_forced_token_matches_the_step_by_step_reference(end):
    """Random token streams with markers, grown one token at a time (the forced token
    appended whenever there is one, as the sampler would)."""
    rng = np.random.default_rng(0)
    tb = ThinkingBudget([START], [END], end)
    checked = forced_seen = 0
    for trial in range(200):
        budget = int(rng.integers(0, 6))
        tokens = list(rng.integers(0, 5, size=int(rng.integers(0, 4))))  # a prompt
        if rng.random() < 0.5:
            tokens.append(START)  # the prompt opens the section (Qwen3 chat templates)
        for _ in range(20):
            got = tb.forced_token(np.array(tokens, np.int64), budget)
            want = reference_forced(tokens, budget, [START], [END], end)
            assert got == want, (trial, tokens, budget)
            checked += 1
            forced_seen += got is not None
            nxt = got if got is not None else int(rng.choice([0, 1, 2, 3, 4, START, END],
                                                            p=[.18] * 5 + [.05, .05]))
            tokens.append(nxt)
    assert forced_seen > 100 and checked == 4000


def test_budget_n_gives_n_thinking_tokens_then_the_end():
    tb = ThinkingBudget([START], [END], [END])
    for budget in range(4):
        tokens = [1, 2, START]
        while tb.forced_token(np.array(tokens), budget) is None:
            tokens.append(3)
        assert len(tokens) - 3 == budget
        tokens.append(END)
        assert tb.forced_token(np.array(tokens), budget) is None  # the section is closed
        # thinking tokens in the prompt count: the budget is spent on them first
    assert tb.forced_token(np.array([START, 1, 1]), 2) == END


def test_rows_without_a_budget_are_never_forced():
    class P:
        def __init__(self, b):
            self.thinking_token_budget = b

    tb = ThinkingBudget([START], [END], [END], rows=2)
    tb.add(0, P(None))
    tb.add(5, P(1))  # grows
    rows = np.array([5, 0])
    assert tb.used(rows) and not tb.used(np.array([0]))
    toks = {"a": [START, 3], "b": [START, 3, 3, 3]}
    forced = tb.forced(rows, ["a", "b"], toks.__getitem__)
    assert forced[0].tolist() == [0] and forced[1].tolist() == [END]


class _Params:
    def __init__(self, **kw):
        self.temperature, self.top_k, self.top_p, self.min_p = 1.0, 0, 1.0, 0.0
        self.repetition_penalty, self.frequency_penalty, self.presence_penalty = 1.0, 0.0, 0.0
        self.min_tokens, self.logprobs, self.prompt_logprobs, self.seed = 0, None, None, None
        self.logit_bias = self.allowed_token_ids = self.bad_words_token_ids = None
        self.all_stop_token_ids, self.structured_outputs = set(), None
        self.__dict__.update(kw)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_sampler_draws_the_forced_token_and_raw_logprobs_stay_the_models(temperature):
    vocab = 16
    table = SamplingTable(vocab, rows=3)
    for row in range(3):
        table.add(row, f"r{row}", _Params(temperature=temperature, logprobs=2, seed=row), [1], 1)
    b = gather_batch(table, np.arange(3), np.array([4, 4, 4]))
    logits = mx.array(np.random.default_rng(1).normal(size=(3, vocab)).astype(np.float32))
    free = Sampler("raw_logprobs")(logits, b)
    b.forced = (np.array([1], np.int32), np.array([END], np.int32))
    out = Sampler("raw_logprobs")(logits, b)
    tokens = np.array(out.tokens)
    assert tokens[1] == END
    assert tokens[0] == np.array(free.tokens)[0] and tokens[2] == np.array(free.tokens)[2]
    ref = np.log(np.exp(np.array(logits[1])) / np.exp(np.array(logits[1])).sum())
    # the sampled token's raw logprob (column 0) is the model's, not the forcing's 0
    assert abs(float(np.array(out.logprobs[1])[1, 0]) - ref[END]) < 1e-4
    np.testing.assert_array_equal(np.array(out.logprobs[0])[[0, 2]],
                                  np.array(free.logprobs[0])[[0, 2]])


def test_force_tokens_keeps_other_rows():
    x = mx.array(np.arange(12, dtype=np.float32).reshape(3, 4))
    y = np.array(force_tokens(x, (np.array([2]), np.array([1]))))
    np.testing.assert_array_equal(y[:2], np.array(x)[:2])
    assert y[2, 1] == 0 and np.isneginf(y[2, [0, 2, 3]]).all()


def test_the_torch_reference_sampler_draws_the_forced_token_too():
    from vllm_metal.sampling.torch_sampler import TorchSampler

    table = SamplingTable(16, rows=2)
    for row in range(2):
        table.add(row, f"r{row}", _Params(temperature=0.8, seed=row), [1], 1)
    b = gather_batch(table, np.arange(2), np.array([3, 3]), for_reference=True)
    b.forced = (np.array([0], np.int32), np.array([END], np.int32))
    logits = mx.array(np.random.default_rng(2).normal(size=(2, 16)).astype(np.float32))
    logits[0, END] = -20.0  # the model would not choose it
    assert int(np.array(TorchSampler()(logits, b).tokens)[0]) == END
