"""Exact prefix caching for hybrid models, below the server: the scheduler's
StateCheckpointTable (state_checkpoints.py) and the runner's side (hybrid.HybridState:
checkpoint loads, chunks cut into passes where a state is saved) on a tiny random-weight
Qwen3.5. The served behaviour is in test_serving_qwen3_5.py."""

from __future__ import annotations

from dataclasses import fields
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from qwen3_5_checkpoint import write_checkpoint

from vllm_metal import hybrid, ops
from vllm_metal.state_checkpoints import PENDING_STEPS, StateCheckpointTable, StatePlan

B = 32  # tokens per block in these tests


# ---- the scheduler's table ------------------------------------------------------------

def request(rid: str, tokens: int, computed: int, tag: str = "p"):
    """A stand-in for vLLM's Request: block hashes of its full blocks (equal tags share
    the prefix)."""
    return SimpleNamespace(request_id=rid, num_computed_tokens=computed,
                           block_hashes=[f"{tag}{i}".encode() for i in range(tokens // B)])


def output(scheduled: dict[str, int], drafts: dict[str, list] | None = None):
    return SimpleNamespace(num_scheduled_tokens=scheduled, scheduled_spec_decode_tokens=drafts or {})


def test_chunk_ends_are_checkpointed_and_later_hits_trimmed_to_them():
    t = StateCheckpointTable(num_slots=4, block_size=B)
    a = request("a", 100, computed=70)  # scheduled [0, 70): last boundary 64
    plan = t.plan(output({"a": 70}), {"a": a})
    assert plan.loads == {} and plan.writes == {"a": [(64, 0)]}
    # another request sharing a's first 3 blocks: the state exists after 2 of them only
    b = request("b", 100, computed=0)
    assert t.usable_blocks(b, 3) == 2
    assert t.usable_blocks(request("c", 100, 0, tag="q"), 3) == 0  # other prefix


def test_a_hit_is_loaded_before_the_step_writes_and_its_junction_is_checkpointed():
    t = StateCheckpointTable(num_slots=1, block_size=B)  # one slot: the write must evict
    t.plan(output({"a": 40}), {"a": request("a", 40, computed=40)})  # state after 32
    b = request("b", 100, computed=0)
    assert t.usable_blocks(b, 3) == 1     # attention hit 96 tokens, state after 32
    t.admitted("b", 32)
    b.num_computed_tokens = 100           # scheduled [32, 100)
    plan = t.plan(output({"b": 68}), {"b": b})
    assert plan.loads == {"b": 0}
    # the junction (96, where b's attention hit ended) and the chunk's last boundary (96)
    assert plan.writes == {"b": [(96, 0)]} and t.stats["evictions"] == 1


def test_writes_wait_for_unknown_hashes_and_never_cover_drafts():
    t = StateCheckpointTable(num_slots=2, block_size=B)
    a = request("a", 63, computed=64)  # a decode reaching 64; the 64th token is not known yet
    plan = t.plan(output({"a": 1}), {"a": a})
    assert plan.writes == {"a": [(64, 0)]} and len(t) == 0 and t.num_pending == 1
    assert t.usable_blocks(request("b", 100, 0), 2) == 0  # not found while pending
    a.block_hashes.append(b"p1")                          # the token arrived
    t.plan(output({}), {})
    assert len(t) == 1 and t.usable_blocks(request("b", 100, 0), 2) == 2
    # speculative drafts past a boundary are never checkpointed
    d = request("d", 96, computed=99, tag="d")
    plan = t.plan(output({"d": 4}, {"d": [1, 2, 3]}), {"d": d})  # [95, 99): final up to 96
    assert plan.writes == {"d": [(96, 1)]}
    d2 = request("d2", 60, computed=66, tag="e")
    assert not t.plan(output({"d2": 4}, {"d2": [1, 2, 3]}), {"d2": d2}).writes  # ends at 63


def test_no_write_while_a_requests_drafts_are_unverified():
    """Async scheduling: step 2 is planned before step 1's drafts come back, with vLLM
    counting them as computed. Where step 2's chunk starts is unknown until then (the
    case a served hybrid model with n-gram drafts failed on: a write after 32 tokens
    planned for a chunk that was [28, 29))."""
    t = StateCheckpointTable(num_slots=2, block_size=B)
    a = request("a", 27, computed=28)  # step 1: [27, 28) and 3 drafts, as vLLM counts: 31
    a.num_computed_tokens = 31
    step1 = output({"a": 4}, {"a": [-1, -1, -1]})
    assert not t.plan(step1, {"a": a}).writes
    a.num_computed_tokens = 35             # step 2 planned: [31, 35) if every draft is kept
    step2 = output({"a": 4}, {"a": [-1, -1, -1]})
    assert not t.plan(step2, {"a": a}).writes  # 32 would be a boundary, if kept
    t.outputs_read(step1)                  # all three rejected: vLLM rolls back to 32
    t.outputs_read(step2)
    a.num_computed_tokens = 33 + 1         # step 3: [32, 33) plus one draft
    assert t.plan(output({"a": 2}, {"a": [-1]}), {"a": a}).writes == {}
    t.outputs_read(output({"a": 2}, {"a": [-1]}))
    a.num_computed_tokens = 65             # a prompt-like chunk, no drafts in flight: written
    assert t.plan(output({"a": 31}), {"a": a}).writes == {"a": [(64, 0)]}


def test_pending_writes_of_vanished_tokens_give_their_slot_back():
    t = StateCheckpointTable(num_slots=1, block_size=B)
    t.plan(output({"a": 1}), {"a": request("a", 31, computed=32)})
    assert t.num_pending == 1
    for _ in range(PENDING_STEPS + 1):
        t.plan(output({}), {})
    assert t.num_pending == 0 and t.stats["dropped"] == 1
    assert t.plan(output({"c": 40}), {"c": request("c", 40, 40, tag="c")}).writes == {"c": [(32, 0)]}


# ---- the runner's side on a model ------------------------------------------------------

@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    from vllm_metal.models import load_model

    return load_model(str(write_checkpoint(tmp_path_factory.mktemp("q"), seed=1)), "float32")


@pytest.fixture
def batch_invariant():
    """Row results independent of the batch, so a row computed in a smaller or larger
    step can be compared bit for bit."""
    before = ops.batch_invariant()
    ops.set_batch_invariant(True)
    yield
    ops.set_batch_invariant(before)


def kv_cache_config():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec

    attn = FullAttentionSpec(block_size=B, num_kv_heads=2, head_size=32, dtype=None)
    state = MambaSpec(block_size=256, shapes=((192, 3), (4, 16, 32)), dtypes=(None, None))
    groups = [KVCacheGroupSpec(["model.layers.3.self_attn.attn"], attn)]
    groups += [KVCacheGroupSpec([f"model.layers.{i}.linear_attn"], state) for i in range(3)]
    return SimpleNamespace(kv_cache_groups=groups, num_blocks=16)


class Runner:
    """The runner's hybrid path, by hand: HybridState + the packed forward."""

    def __init__(self, loaded, checkpoint_slots: int = 0):
        self.loaded = loaded
        self.state = hybrid.HybridState(loaded, kv_cache_config(), num_slots=4,
                                        checkpoint_slots=checkpoint_slots)
        spec = loaded.spec
        shape = (16, B, spec.num_kv_heads, spec.head_dim)
        self.kv = [None if lin else (mx.zeros(shape), mx.zeros(shape)) for lin in loaded.model.is_linear]

    def step(self, chunks: list[tuple[str, list[int], int, list[int]]], plan=None):
        """chunks: (request, its tokens, tokens already computed, block table); returns
        each request's last-row logits."""
        from vllm_metal.models.generate import SeqChunk, build_step
        from vllm_metal.models.qwen3_5_paged import HybridContext

        packed = build_step([SeqChunk(toks, start, table, "last") for _, toks, start, table in chunks],
                            self.kv, B)
        self.state.take_plan(plan)
        seq_lens = np.array([start + len(toks) for _, toks, start, _ in chunks])
        cu = np.concatenate([[0], np.cumsum([len(toks) for _, toks, _, _ in chunks])])
        slots, init, rounds = self.state.step([c[0] for c in chunks], seq_lens, cu)
        c = packed.ctx
        ctx = HybridContext(**{f.name: getattr(c, f.name) for f in fields(c)},
                            cu_seqlens_state=mx.array(cu.astype(np.int32)), state_slots=mx.array(slots),
                            has_initial_state=mx.array(init), state_pools=self.state.pools,
                            state_rounds=rounds)
        logits = self.loaded.model(packed.input_ids, ctx)
        self.kv = ctx.kv_caches
        mx.eval(logits, [(p.conv, p.ssm) for p in self.state.pools if p is not None])
        return np.array(logits)

    def state_of(self, rid: str):
        s = self.state.slot_of[rid]
        return [(np.array(p.conv[s]), np.array(p.ssm[s])) for p in self.state.pools if p is not None]

    def checkpoint(self, slot: int):
        return [(np.array(p.conv[slot]), np.array(p.ssm[slot]))
                for p in self.state.checkpoints if p is not None]


def same(a, b) -> bool:
    return all(np.array_equal(x, y) for pa, pb in zip(a, b) for x, y in zip(pa, pb))


def test_a_chunk_cut_at_checkpoints_computes_what_one_pass_does(loaded, batch_invariant):
    rng = np.random.default_rng(0)
    a, b = rng.integers(3, 300, 75).tolist(), rng.integers(3, 300, 20).tolist()
    plain = Runner(loaded)
    want = plain.step([("a", a, 0, [0, 1, 2]), ("b", b, 0, [3])])
    cut = Runner(loaded, checkpoint_slots=3)
    plan = StatePlan(writes={"a": [(32, 2), (64, 0)], "b": [(20, 1)]})  # b's at its chunk end
    got = cut.step([("a", a, 0, [0, 1, 2]), ("b", b, 0, [3])], plan)
    assert np.array_equal(got, want)
    assert same(cut.state_of("a"), plain.state_of("a")) and same(cut.state_of("b"), plain.state_of("b"))
    # each checkpoint is the state of exactly its prefix, computed on its own
    for tokens, slot in ((32, 2), (64, 0)):
        alone = Runner(loaded)
        alone.step([("x", a[:tokens], 0, [5, 6])])
        assert same(cut.checkpoint(slot), alone.state_of("x")), tokens
    assert same(cut.checkpoint(1), plain.state_of("b"))


def test_a_hit_resumes_from_the_checkpoint_as_if_computed_from_the_start(loaded, batch_invariant):
    rng = np.random.default_rng(1)
    prefix = rng.integers(3, 300, 64).tolist()
    a = prefix + rng.integers(3, 300, 10).tolist()
    c = prefix + rng.integers(3, 300, 9).tolist()  # the same 64 tokens, another suffix
    cached = Runner(loaded, checkpoint_slots=2)
    cached.step([("a", a, 0, [0, 1, 2])], StatePlan(writes={"a": [(64, 1)]}))
    # c adopts a's two cached blocks and the state after them, computes its last 9 tokens
    got = cached.step([("c", c[64:], 64, [0, 1, 3])], StatePlan(loads={"c": 1}))
    fresh = Runner(loaded)
    want = fresh.step([("c", c, 0, [7, 8, 9])])
    assert np.array_equal(got, want)
    assert same(cached.state_of("c"), fresh.state_of("c"))
    # decoding on from there stays identical
    tok = int(want[0].argmax())
    assert np.array_equal(cached.step([("c", [tok], 73, [0, 1, 3])]), fresh.step([("c", [tok], 73, [7, 8, 9])]))


def test_a_write_outside_the_chunk_or_without_checkpoints_is_refused(loaded):
    r = Runner(loaded, checkpoint_slots=1)
    with pytest.raises(RuntimeError, match="outside its chunk"):
        r.step([("a", [5] * 10, 0, [0])], StatePlan(writes={"a": [(32, 0)]}))
    with pytest.raises(RuntimeError, match="keeps none"):
        Runner(loaded).state.take_plan(StatePlan(loads={"a": 0}))
