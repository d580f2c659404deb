"""model_runner.apply_grammar_bitmask: vLLM's compacted masks reach the right rows.

vLLM sends one mask row per structured-output request, in its own order; the runner maps
each to its request's row of the step. Checked against a NumPy reading of the bits
(LSB first, a set bit allows).
"""

from types import SimpleNamespace

import mlx.core as mx
import numpy as np

from vllm_metal.model_runner import apply_grammar_bitmask


def _allowed(mask_row: np.ndarray, vocab: int) -> np.ndarray:
    bits = np.unpackbits(mask_row.astype("<i4").view(np.uint8), bitorder="little")
    return bits[:vocab].astype(bool)


def test_masks_go_to_their_requests_rows_in_any_order():
    rng = np.random.default_rng(0)
    vocab, req_ids = 100, ["a", "b", "c", "d"]
    logits = rng.standard_normal((4, vocab)).astype(np.float32)
    masks = rng.integers(-2**31, 2**31, (3, 4), dtype=np.int64).astype(np.int32)
    # vLLM's order: d, gone (not in this step), b
    out = GrammarOutput(["d", "gone", "b"], masks)
    got = np.array(apply_grammar_bitmask(mx.array(logits), req_ids, out, vocab))
    want = logits.copy()
    for mask_row, req in ((0, "d"), (2, "b")):
        row = req_ids.index(req)
        want[row, ~_allowed(masks[mask_row], vocab)] = -np.inf
    np.testing.assert_array_equal(got, want)
    assert np.isinf(got).any() and np.array_equal(got[[0, 2]], logits[[0, 2]])  # a, c untouched


def test_logits_past_the_masks_vocabulary_are_never_allowed():
    """A padded lm head: ids from vocab_size on get -inf, even where the mask's last word
    has bits set past the vocabulary (the backends leave them set)."""
    vocab, width = 40, 100
    logits = np.zeros((1, width), np.float32)
    masks = np.full((1, 2), -1, np.int32)  # everything allowed, 64 bits
    got = np.array(apply_grammar_bitmask(mx.array(logits), ["a"], GrammarOutput(["a"], masks), vocab))
    assert np.all(got[0, :vocab] == 0) and np.all(np.isneginf(got[0, vocab:]))


def test_no_request_of_the_step_in_the_masks_leaves_the_logits():
    logits = mx.ones((2, 64))
    out = apply_grammar_bitmask(logits, ["a", "b"], GrammarOutput(["x"], np.zeros((1, 2), np.int32)), 64)
    assert out is logits


def test_speculative_steps_mask_each_draft_position_from_its_block():
    """With drafts, vLLM gives each structured request a block of 1 + num_speculative_tokens
    rows (row j: after its first j drafts); the step has 1 + drafts rows per request."""
    rng = np.random.default_rng(1)
    vocab, stride = 70, 4
    req_ids = ["a", "b", "c"]
    cu = np.array([0, 3, 4, 8])  # a: 2 drafts, b: none, c: 3 drafts
    logits = rng.standard_normal((8, vocab)).astype(np.float32)
    masks = rng.integers(-2**31, 2**31, (2 * stride, 3), dtype=np.int64).astype(np.int32)
    out = GrammarOutput(["c", "a"], masks)  # b is free
    got = np.array(apply_grammar_bitmask(mx.array(logits), req_ids, out, vocab, cu, stride))
    want = logits.copy()
    for block, req in ((0, "c"), (1, "a")):
        s = req_ids.index(req)
        for j in range(cu[s + 1] - cu[s]):
            want[cu[s] + j, ~_allowed(masks[block * stride + j], vocab)] = -np.inf
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got[3], logits[3])


def GrammarOutput(req_ids, bitmask):  # noqa: N802 (stands in for vLLM's dataclass)
    return SimpleNamespace(structured_output_request_ids=req_ids, grammar_bitmask=bitmask)
