"""Hypothesis: random operation sequences on the BatchPacker (add, extend,
step + sample or step + defer the samples (async scheduling) and resolve them
later, preempt and resume in both vLLM contracts, roll back, finish, and bad
input) against the pure-Python model in test_batch_packer.py. After every step
each packed array must equal the NumPy construction; after every rejected
operation the table and the last outputs must be unchanged. In the model a
deferred sample is a 0 in a request's token list until resolved; a list that
is replaced (roll back, resync, V2 resume) leaves its placeholders behind, as
the packer voids them."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis.database import DirectoryBasedExampleDatabase
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from test_batch_packer import (
    Group,
    Request,
    assert_outputs_equal,
    model_snapshot,
    outputs,
    reference_pack,
    snapshot,
)
from vllm_metal import _core

CONFIGS = [
    dict(groups=(Group(4),), mrope=0),
    dict(groups=(Group(16, 8), Group(8)), mrope=0),
    dict(groups=(Group(8, 4), Group(64, paged=False)), mrope=3),
]
MAX_LEN, MAX_REQS, MAX_TOKENS, NUM_BLOCKS = 48, 6, 40, 500


class PackerMachine(RuleBasedStateMachine):
    @initialize(cfg=st.sampled_from(CONFIGS), threshold=st.sampled_from([1, 24, 512]))
    def setup(self, cfg, threshold):
        self.groups = list(cfg["groups"])
        self.mrope = cfg["mrope"]
        self.threshold = threshold
        self.packer = _core.BatchPacker(
            max_num_reqs=MAX_REQS,
            max_num_batched_tokens=MAX_TOKENS,
            max_model_len=MAX_LEN,
            kv_groups=[g.spec(NUM_BLOCKS) for g in self.groups],
            mrope_num_dims=self.mrope,
            decode_min_total_context=threshold,
        )
        self.reqs: dict[str, Request] = {}
        self.next_block = 1
        self.next_id = 0
        self.last = None  # outputs of the last packed step
        self.pending = []  # deferred steps, oldest first: [(token list, index)] per batch row

    # ---- helpers -----------------------------------------------------------------

    def _fresh(self, count):
        ids = [(self.next_block + i) % NUM_BLOCKS for i in range(count)]
        self.next_block += count
        return ids

    def _blocks_for(self, num_tokens):
        """Fresh block ids covering num_tokens in every group."""
        return [self._fresh(-(-num_tokens // g.block_size) if g.paged else 1) for g in self.groups]

    def _extension(self, r, num_tokens):
        """New ids per group so that r covers num_tokens."""
        out = []
        for g, group in enumerate(self.groups):
            need = -(-num_tokens // group.block_size) if group.paged else 1
            out.append(self._fresh(max(0, need - len(r.blocks[g]))))
        return out

    def _mrope(self, data, n):
        if not self.mrope or not data.draw(st.booleans(), label="mrope"):
            return None, 0
        L = data.draw(st.integers(1, n), label="mrope_len")
        pos = data.draw(st.lists(st.integers(0, 60), min_size=self.mrope * L, max_size=self.mrope * L))
        return np.array(pos, np.int32).reshape(self.mrope, L), data.draw(st.integers(-5, 5))

    def _expect_rejected(self, call, *args, **kwargs):
        before = (snapshot(self.packer, self.reqs), len(self.packer))
        with pytest.raises(ValueError, match=r"^\[BatchPacker\] "):
            call(*args, **kwargs)
        assert (snapshot(self.packer, self.reqs), len(self.packer)) == before
        if self.last is not None:
            assert_outputs_equal(outputs(self.packer), self.last)

    def _pick(self, data):
        return data.draw(st.sampled_from(sorted(self.reqs)), label="req")

    # ---- operations ---------------------------------------------------------------

    @rule(data=st.data())
    def add(self, data):
        if len(self.reqs) >= 10:
            return
        rid = f"cmpl-{self.next_id:08x}-0"
        self.next_id += 1
        prompt = data.draw(st.lists(st.integers(0, 50000), min_size=1, max_size=30), label="prompt")
        computed = data.draw(st.integers(0, len(prompt) - 1), label="prefix_hit")
        blocks = self._blocks_for(computed + data.draw(st.integers(0, 4)))
        pos, delta = self._mrope(data, len(prompt))
        self.packer.add_request(rid, prompt, num_computed_tokens=computed, block_ids=tuple(blocks),
                                mrope_positions=pos, mrope_position_delta=delta)
        self.reqs[rid] = Request(list(prompt), len(prompt), computed, blocks, pos, delta)

    def _resolve_oldest(self, data):
        samples = self.pending.pop(0)
        tokens = data.draw(st.lists(st.integers(0, 50000), min_size=len(samples),
                                    max_size=len(samples)), label="resolved")
        for (lst, i), t in zip(samples, tokens):
            if lst is not None:
                lst[i] = t
        self.packer.resolve_deferred(np.array(tokens, np.int32))

    def _expected_sources(self, want, sched):
        newest = {id(lst): (i, b) for b, (lst, i) in enumerate(self.pending[-1]) if lst is not None} \
            if self.pending else {}
        drafts = {rid: len(d) for rid, _, d in sched}
        sources = np.full(want["num_tokens"], -1, np.int32)
        for b, rid in enumerate(want["req_ids"]):
            r = self.reqs[rid]
            i, prev = newest.get(id(r.tokens), (-1, -1))
            if r.computed <= i < want["seq_lens"][b] - drafts[rid]:
                sources[want["cu_seqlens_q"][b] + i - r.computed] = prev
        return sources

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def resolve(self, data):
        """The engine reads the oldest deferred step."""
        self._resolve_oldest(data)

    @rule(data=st.data())
    def step(self, data):  # with no requests: an empty step
        while len(self.pending) > 1:  # as the runner: only the newest may feed this step
            self._resolve_oldest(data)
        ids = data.draw(st.permutations(sorted(self.reqs)), label="order")
        sched, budget, extensions = [], MAX_TOKENS, {}
        for rid in ids:
            r = self.reqs[rid]
            left = len(r.tokens) - r.computed
            if len(sched) == MAX_REQS or left == 0 or not data.draw(st.booleans(), label="run"):
                continue
            drafts = []
            if left == 1:
                nd = data.draw(st.integers(0, min(2, MAX_LEN - r.computed - 1)), label="drafts")
                drafts = data.draw(st.lists(st.integers(0, 50000), min_size=nd, max_size=nd))
            q = min(left, data.draw(st.integers(1, 16), label="chunk")) + len(drafts)
            if q > budget:
                continue
            budget -= q
            sched.append((rid, q, drafts))
            extensions[rid] = self._extension(r, r.computed + q)
        # the step's cached-request deltas: new blocks, num_computed unchanged
        if extensions:
            self.packer.update_requests(
                list(extensions), [self.reqs[rid].computed for rid in extensions], list(extensions.values())
            )
            for rid, ext in extensions.items():
                for g, ids_ in enumerate(ext):
                    self.reqs[rid].blocks[g].extend(ids_)
        pad = data.draw(st.sampled_from([0, MAX_TOKENS]), label="pad")
        self.packer.pack({rid: q for rid, q, _ in sched}, {rid: d for rid, _, d in sched if d},
                         pad_tokens_to=pad)
        want = reference_pack(self.reqs, sched, self.groups, MAX_LEN, self.mrope, pad, self.threshold)
        got = outputs(self.packer)
        assert_outputs_equal(got, want)
        sources = self._expected_sources(want, sched)
        if (sources >= 0).any():
            event("inputs that are deferred samples")
            np.testing.assert_array_equal(np.array(self.packer.input_sources), sources)
        else:
            assert self.packer.num_input_sources == 0
        self.last = got

        by_id = {rid: (q, len(d)) for rid, q, d in sched}
        sampling = [rid for b, rid in enumerate(got["req_ids"]) if not got["discard_sampled"][b]]
        if (not any(d for _, _, d in sched) and all(len(self.reqs[r].tokens) < MAX_LEN for r in sampling)
                and data.draw(st.booleans(), label="defer")):
            # async scheduling: placeholders now, the tokens when the engine reads the step
            self.packer.defer_sampled()
            event("samples deferred")
            samples, computed = [], {}
            for b, rid in enumerate(got["req_ids"]):
                r = self.reqs[rid]
                computed[rid] = r.computed + by_id[rid][0]
                if got["discard_sampled"][b]:
                    samples.append((None, 0))
                    continue
                samples.append((r.tokens, len(r.tokens)))
                r.tokens.append(0)
            self.pending.append(samples)
            self.packer.update_requests(list(computed), list(computed.values()))
            for rid, c in computed.items():
                self.reqs[rid].computed = c
            return

        # the model samples: 1 + accepted drafts per row; partial chunks are discarded
        width = 3
        sampled = np.full((len(sched), width), -1, np.int32)
        computed = {}
        for b, rid in enumerate(got["req_ids"]):
            r = self.reqs[rid]
            q, nd = by_id[rid]
            if got["discard_sampled"][b]:
                computed[rid] = r.computed + q
                continue
            accepted = data.draw(st.integers(1, nd + 1), label="accepted")
            accepted = min(accepted, MAX_LEN - len(r.tokens))
            tokens = data.draw(st.lists(st.integers(0, 50000), min_size=accepted, max_size=accepted))
            sampled[b, :accepted] = tokens
            r.tokens.extend(tokens)
            computed[rid] = r.computed + q - nd - 1 + accepted
        self.packer.append_sampled(sampled)
        # the next step's deltas carry num_computed (vLLM corrects it after rejections)
        if computed:
            self.packer.update_requests(list(computed), list(computed.values()))
            for rid, c in computed.items():
                self.reqs[rid].computed = c
        # requests at max_model_len finish
        done = [rid for rid, r in self.reqs.items() if len(r.tokens) >= MAX_LEN]
        self.packer.remove_requests(done)
        for rid in done:
            del self.reqs[rid]

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def preempt_and_resume_v1(self, data):
        """V1: the state stays; on resume new block ids replace the old."""
        rid = self._pick(data)
        r = self.reqs[rid]
        c = data.draw(st.integers(0, len(r.tokens) - 1), label="prefix_hit")
        blocks = self._blocks_for(c)
        self.packer.update_requests([rid], [c], [tuple(blocks)], resumed_req_ids={rid})
        r.computed, r.blocks = c, blocks

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def preempt_and_resume_v2(self, data):
        """V2: the request leaves, then comes back as new with prompt + outputs."""
        rid = self._pick(data)
        r = self.reqs[rid]
        c = data.draw(st.integers(0, len(r.tokens) - 1), label="prefix_hit")
        blocks = self._blocks_for(c)
        if data.draw(st.booleans(), label="remove_first"):
            assert self.packer.remove_requests([rid]) == 1
            replace = False
        else:
            replace = True  # a re-sent id replaces the old state
        self.packer.add_request(rid, r.tokens, num_computed_tokens=c, block_ids=tuple(blocks),
                                prompt_len=r.prompt_len, mrope_positions=r.mrope,
                                mrope_position_delta=r.delta, replace=replace)
        r.computed, r.blocks = c, blocks
        r.tokens = list(r.tokens)  # a new request: placeholders of the old one are void

    @precondition(lambda self: any(len(r.tokens) > r.prompt_len for r in self.reqs.values()))
    @rule(data=st.data())
    def roll_back_outputs(self, data):
        """V1's num_output_tokens below the worker's count drops outputs."""
        rid = data.draw(st.sampled_from(sorted(k for k, r in self.reqs.items() if len(r.tokens) > r.prompt_len)))
        r = self.reqs[rid]
        keep = data.draw(st.integers(0, len(r.tokens) - r.prompt_len - 1), label="keep")
        r.tokens = r.tokens[: r.prompt_len + keep]  # a new list: its placeholders are void
        r.computed = min(r.computed, len(r.tokens) - 1) if len(r.tokens) > 1 else 0
        self.packer.update_requests([rid], [r.computed], num_output_tokens=[keep])

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def resync_tokens(self, data):
        """V1's all_token_ids replaces a request's tokens."""
        rid = self._pick(data)
        r = self.reqs[rid]
        outs = data.draw(st.lists(st.integers(0, 50000), max_size=MAX_LEN - r.prompt_len), label="outputs")
        r.tokens = r.tokens[: r.prompt_len] + outs
        r.computed = min(r.computed, len(r.tokens) - 1)
        self.packer.update_requests([rid], [r.computed], all_token_ids={rid: r.tokens})

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def finish(self, data):
        rid = self._pick(data)
        assert self.packer.remove_requests({rid, "never-seen"}) == 1
        del self.reqs[rid]

    # ---- bad input ---------------------------------------------------------------

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), kind=st.sampled_from(
        ["unknown_pack", "beyond_blocks", "beyond_tokens", "unknown_update", "outside_pool",
         "too_many_blocks", "duplicate_add", "too_long", "too_many_tokens", "append_again"]))
    def bad_input(self, data, kind):
        p = self.packer
        rid = self._pick(data)
        r = self.reqs[rid]
        paged = [g for g, group in enumerate(self.groups) if group.paged]
        if kind == "unknown_pack":
            self._expect_rejected(p.pack, {rid: 1, "ghost": 1})
        elif kind == "beyond_blocks":
            g = paged[0]
            room = len(r.blocks[g]) * self.groups[g].block_size - r.computed
            if room + 1 <= MAX_TOKENS:
                self._expect_rejected(p.pack, {rid: max(room + 1, 1)})
        elif kind == "beyond_tokens":
            self._expect_rejected(p.pack, {rid: len(r.tokens) - r.computed + 1})
        elif kind == "unknown_update":
            self._expect_rejected(p.update_requests, [rid, "ghost"], [r.computed, 0])
        elif kind == "outside_pool":
            ids = tuple([NUM_BLOCKS] if g == 0 else [] for g in range(len(self.groups)))
            self._expect_rejected(p.update_requests, [rid], [r.computed], [ids])
        elif kind == "too_many_blocks":
            ids = tuple([1] * (MAX_LEN // self.groups[g].block_size + 1) if g == 0 else []
                        for g in range(len(self.groups)))
            self._expect_rejected(p.update_requests, [rid], [0], [ids])
        elif kind == "duplicate_add":
            self._expect_rejected(p.add_request, rid, [1, 2, 3])
        elif kind == "too_long":
            self._expect_rejected(p.add_request, "new-id", list(range(MAX_LEN + 1)))
        elif kind == "too_many_tokens":
            self._expect_rejected(p.append_tokens, rid, [0] * (MAX_LEN - len(r.tokens) + 1))
        elif kind == "append_again":
            self._expect_rejected(p.append_sampled, np.zeros((max(1, p.num_seqs), 1), np.int32))

    # ---- invariants --------------------------------------------------------------

    @invariant()
    def table_matches_the_model(self):
        if not hasattr(self, "packer"):
            return
        assert len(self.packer) == len(self.reqs)
        assert sorted(self.packer.request_ids()) == sorted(self.reqs)
        assert snapshot(self.packer, self.reqs) == model_snapshot(self.reqs)


class KeptFailures(DirectoryBasedExampleDatabase):
    """Hypothesis' store of failing examples, checked in (tests/fuzz_corpus/packer): a new
    failure is shrunk and stored there as usual (commit what a failing run leaves); the
    files present when the run starts are replayed first and never deleted, so they stay
    as regression inputs once they pass (Hypothesis would drop them)."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self._kept = {p for p in Path(path).glob("*/*") if p.is_file()}

    def save(self, key: bytes, value: bytes) -> None:
        if not key.endswith((b".secondary", b".pareto")):  # the shrunk failure only
            super().save(key, value)

    def delete(self, key: bytes, value: bytes) -> None:
        if self._value_path(key, value) not in self._kept:
            super().delete(key, value)

    def move(self, src: bytes, dest: bytes, value: bytes) -> None:
        self.save(dest, value)
        self.delete(src, value)


CORPUS = Path(__file__).resolve().parents[2] / "tests/fuzz_corpus/packer"

PackerMachine.TestCase.settings = settings(
    # VLLM_METAL_FUZZ_EXAMPLES: a longer run (docs/reliability.md)
    max_examples=int(os.environ.get("VLLM_METAL_FUZZ_EXAMPLES", "200")),
    database=KeptFailures(str(CORPUS)),
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_packer_state_machine = PackerMachine.TestCase
