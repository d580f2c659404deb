"""draft_model.DraftModel on its own: its cache filled by the target's packed steps, its
greedy drafts against the model's own greedy continuation (models/generate.py), and a
request's room (max_model_len, the blocks it holds) respected, never writing elsewhere."""

from __future__ import annotations

from dataclasses import fields

import mlx.core as mx
import numpy as np
import pytest

from vllm_metal.draft_model import DraftModel, draft_share
from vllm_metal.models import load_model
from vllm_metal.models.generate import SeqChunk, build_step, greedy_generate
from vllm_metal.models.testing import tiny_config, write_random_checkpoint

BLOCK = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = tiny_config("llama", eos_token_id=None)
    return str(write_random_checkpoint(cfg, tmp_path_factory.mktemp("draft"), seed=7))


def prefill(draft: DraftModel, prompts, tables) -> None:
    """The target's step over the prompts, as the runner hands it to the draft."""
    step = build_step([SeqChunk(p, 0, t) for p, t in zip(prompts, tables)], draft.kv_caches, BLOCK)
    ctx = {f.name: getattr(step.ctx, f.name) for f in fields(step.ctx)}
    mx.eval(draft.forward_step(step.input_ids, ctx), draft.kv_caches)


def test_drafts_are_the_models_greedy_continuation(checkpoint):
    draft = DraftModel(checkpoint, "float32", num_speculative_tokens=3, max_model_len=64)
    draft.allocate(BLOCK, num_blocks=32, max_num_seqs=4)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 300, n).tolist() for n in (5, 9, 12)]
    # each request: its prompt in the cache, then a sampled token not yet in it
    tables = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17]]
    prefill(draft, prompts, tables)
    sampled = [17, 250, 3]
    held = np.array([len(t) for t in tables])
    padded = np.zeros((3, max(held)), np.int32)
    for i, t in enumerate(tables):
        padded[i, :len(t)] = t
    got = draft.propose(np.array(sampled), np.array([len(p) for p in prompts]), padded, held)
    want = greedy_generate(load_model(checkpoint, "float32"), [p + [s] for p, s in zip(prompts, sampled)],
                           3, block_size=BLOCK, stop_ids=[])
    assert got.tolist() == want


def test_drafts_stop_at_the_blocks_a_request_holds_and_at_max_model_len(checkpoint):
    draft = DraftModel(checkpoint, "float32", num_speculative_tokens=3, max_model_len=11)
    draft.allocate(BLOCK, num_blocks=16, max_num_seqs=4)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
    tables = [[3, 4], [5, 6, 7]]  # request 0: 8 slots, its new token at 6: two drafts fit
    prefill(draft, prompts, tables)
    untouched = [np.array(k) for k, _ in draft.kv_caches]  # block 0 belongs to no one here
    got = draft.propose(np.array([20, 21]), np.array([6, 9]), np.array([[3, 4, 0], [5, 6, 7]], np.int32),
                        np.array([2, 3]))
    # request 0: positions 6, 7 in its blocks (2 drafts, not k = 3); request 1: only position
    # 9 before max_model_len - 1 (1 draft); two passes in all
    assert (got >= 0).tolist() == [[True, True], [True, False]]
    for (k, _), before in zip(draft.kv_caches, untouched):
        assert np.array_equal(np.array(k)[0], before[0])


def test_a_hybrid_draft_is_refused_and_the_share_splits_the_budget(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from qwen3_5_checkpoint import write_checkpoint

    with pytest.raises(ValueError, match="hybrid"):
        DraftModel(str(write_checkpoint(tmp_path / "q", seed=0)), "float32", 2, 64)
    assert draft_share(3, 1) == 0.75
