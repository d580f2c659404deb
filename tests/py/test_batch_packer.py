"""BatchPacker (vllm_metal._core): packed arrays against a straightforward NumPy
construction, zero-copy views, bad input, and the SchedulerOutput adapter for
both vLLM model-runner contracts. The random-sequence properties are in
test_batch_packer_properties.py, which imports the model and reference below."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

from vllm_metal import _core

# ---- a pure-Python model of the request table + the NumPy reference ---------------


@dataclasses.dataclass
class Group:
    block_size: int
    kernel_block_size: int = 0  # 0 = block_size
    paged: bool = True

    @property
    def kernel(self) -> int:
        return self.kernel_block_size or self.block_size

    def spec(self, num_blocks: int) -> _core.KvGroupSpec:
        return _core.KvGroupSpec(
            self.block_size, kernel_block_size=self.kernel_block_size, num_blocks=num_blocks, paged=self.paged
        )


@dataclasses.dataclass
class Request:
    tokens: list[int]
    prompt_len: int
    computed: int
    blocks: list[list[int]]  # per group
    mrope: np.ndarray | None = None  # [dims, L]
    delta: int = 0


def snapshot(packer, reqs: dict[str, Request]) -> dict:
    """Everything the packer holds about the model's requests."""
    return {
        rid: (
            list(packer.token_ids(rid)),
            [list(b) for b in packer.block_ids(rid)],
            packer.num_computed_tokens(rid),
            packer.prompt_len(rid),
        )
        for rid in reqs
    }


def model_snapshot(reqs: dict[str, Request]) -> dict:
    return {rid: (list(r.tokens), [list(b) for b in r.blocks], r.computed, r.prompt_len) for rid, r in reqs.items()}


OUTPUT_NAMES = (
    "input_ids",
    "positions",
    "slot_mappings",
    "seq_lens",
    "cu_seqlens_q",
    "logits_indices",
    "cu_num_logits",
    "discard_sampled",
)
COUNT_NAMES = (
    "num_seqs",
    "num_tokens",
    "num_tokens_padded",
    "num_logits",
    "num_decode_like",
    "decode_context",
    "num_decodes",
    "num_decode_tokens",
    "num_prefills",
    "num_prefill_tokens",
    "max_query_len",
    "max_seq_len",
)


def outputs(packer) -> dict:
    """A copy of every output of the last packed step."""
    out = {name: np.array(getattr(packer, name)) for name in OUTPUT_NAMES}
    out["block_tables"] = [np.array(t) for t in packer.block_tables]
    out["req_ids"] = list(packer.req_ids)
    out["block_table_used_widths"] = list(packer.block_table_used_widths)
    out.update({name: getattr(packer, name) for name in COUNT_NAMES})
    return out


def reference_pack(
    reqs: dict[str, Request],
    sched: list[tuple[str, int, list[int]]],
    groups: list[Group],
    max_model_len: int,
    mrope_num_dims: int = 0,
    pad_tokens_to: int = 0,
    min_total_context: int = 512,
) -> dict:
    """sched: (req_id, num_scheduled_tokens, draft ids) in scheduling order."""
    decode = [s for s in sched if s[1] - len(s[2]) == 1]
    order = decode + [s for s in sched if s[1] - len(s[2]) != 1]
    T = sum(q for _, q, _ in order)
    Tp = max(T, pad_tokens_to)
    input_ids = np.zeros(Tp, np.int32)
    positions = np.zeros((mrope_num_dims, Tp) if mrope_num_dims else Tp, np.int32)
    slots = np.full((len(groups), Tp), -1, np.int64)
    widths = [-(-max_model_len // g.block_size) * (g.block_size // g.kernel) for g in groups]
    tables = [np.zeros((len(order), w), np.int32) for w in widths]
    seq_lens, cu_q, logits, cu_logits, discard = [], [0], [], [0], []
    used = [0] * len(groups)
    for b, (rid, q, drafts) in enumerate(order):
        r = reqs[rid]
        c, nd = r.computed, len(drafts)
        known = q - nd
        start = cu_q[-1]
        pos = np.arange(c, c + q)
        input_ids[start : start + q] = r.tokens[c : c + known] + list(drafts)
        if mrope_num_dims:
            for d in range(mrope_num_dims):
                L = 0 if r.mrope is None else r.mrope.shape[1]
                pre = r.mrope[d, np.minimum(pos, L - 1)] if L else pos
                positions[d, start : start + q] = np.where(pos < L, pre, pos + r.delta)
        else:
            positions[start : start + q] = pos
        for g, group in enumerate(groups):
            held = np.array(r.blocks[g], np.int64)
            k = group.block_size // group.kernel
            if group.paged:
                B = group.block_size
                slots[g, start : start + q] = held[pos // B] * B + pos % B
                need = -(-(c + q) // group.kernel)
            else:
                need = len(held) * k
            e = np.arange(need)
            tables[g][b, :need] = held[e // k] * k + e % k
            used[g] = max(used[g], need)
        seq_lens.append(c + q)
        cu_q.append(start + q)
        logits.extend(start + known - 1 + j for j in range(nd + 1))
        cu_logits.append(cu_logits[-1] + nd + 1)
        discard.append(c + known < len(r.tokens))
    ndl = len(decode)
    context = sum(seq_lens[:ndl])
    num_decodes = ndl if context >= min_total_context else 0
    qs = [q for _, q, _ in order]
    return {
        "input_ids": input_ids,
        "positions": positions,
        "slot_mappings": slots,
        "seq_lens": np.array(seq_lens, np.int32),
        "cu_seqlens_q": np.array(cu_q, np.int32),
        "logits_indices": np.array(logits, np.int32),
        "cu_num_logits": np.array(cu_logits, np.int32),
        "discard_sampled": np.array(discard, bool),
        "block_tables": tables,
        "req_ids": [s[0] for s in order],
        "block_table_used_widths": used,
        "num_seqs": len(order),
        "num_tokens": T,
        "num_tokens_padded": Tp,
        "num_logits": len(logits),
        "num_decode_like": ndl,
        "decode_context": context,
        "num_decodes": num_decodes,
        "num_decode_tokens": sum(qs[:num_decodes]),
        "num_prefills": len(order) - num_decodes,
        "num_prefill_tokens": sum(qs[num_decodes:]),
        "max_query_len": max(qs, default=0),
        "max_seq_len": max(seq_lens, default=0),
    }


def assert_outputs_equal(got: dict, want: dict) -> None:
    for name, value in want.items():
        if name == "block_tables":
            assert len(got[name]) == len(value)
            for g, (a, b) in enumerate(zip(got[name], value)):
                np.testing.assert_array_equal(a, b, err_msg=f"block_tables[{g}]")
        elif isinstance(value, np.ndarray):
            assert got[name].dtype == value.dtype, name
            np.testing.assert_array_equal(got[name], value, err_msg=name)
        else:
            assert got[name] == value, name


# ---- helpers ------------------------------------------------------------------------


def make_packer(groups=(Group(4),), *, max_num_reqs=8, max_tokens=64, max_model_len=64, num_blocks=100, **kw):
    return _core.BatchPacker(
        max_num_reqs=max_num_reqs,
        max_num_batched_tokens=max_tokens,
        max_model_len=max_model_len,
        kv_groups=[g.spec(num_blocks) for g in groups],
        **kw,
    )


def add(packer, reqs, rid, tokens, computed, blocks, **kw):
    packer.add_request(rid, tokens, num_computed_tokens=computed, block_ids=tuple(blocks), **kw)
    prompt_len = kw.get("prompt_len", -1)
    tokens = list(tokens)
    reqs[rid] = Request(tokens, len(tokens) if prompt_len < 0 else prompt_len, computed, [list(b) for b in blocks])
    if "mrope_positions" in kw:
        reqs[rid].mrope = np.asarray(kw["mrope_positions"])
        reqs[rid].delta = kw.get("mrope_position_delta", 0)


def check_step(packer, reqs, sched, groups, max_model_len=64, **kw):
    packer.pack({rid: q for rid, q, _ in sched}, {rid: d for rid, _, d in sched if d} or None,
                pad_tokens_to=kw.get("pad_tokens_to", 0))
    want = reference_pack(reqs, sched, list(groups), max_model_len, **kw)
    assert_outputs_equal(outputs(packer), want)


# ---- packed arrays ------------------------------------------------------------------


def test_decode_rows_first_then_prefill_chunks():
    p, reqs = make_packer(), {}
    add(p, reqs, "p", range(10, 16), 0, [[7, 3]])
    add(p, reqs, "d", range(20, 25), 4, [[5, 9]])
    check_step(p, reqs, [("p", 6, []), ("d", 1, [])], [Group(4)])
    # by hand, as in the C++ test
    np.testing.assert_array_equal(p.input_ids, [24, 10, 11, 12, 13, 14, 15])
    np.testing.assert_array_equal(p.slot_mapping, [36, 28, 29, 30, 31, 12, 13])
    assert p.req_ids == ["d", "p"]
    assert (p.num_decodes, p.num_prefills) == (0, 2)  # 5 tokens of decode context < 512


@pytest.mark.parametrize(
    "groups",
    [(Group(4),), (Group(16, 8), Group(32)), (Group(8, 2), Group(64, paged=False))],
    ids=["bs4", "bs16k8+bs32", "bs8k2+state"],
)
def test_chunks_drafts_groups_and_padding(groups):
    p, reqs = make_packer(groups), {}
    nblocks = [lambda n, g=g: -(-n // g.block_size) if g.paged else 1 for g in groups]
    add(p, reqs, "chunk", range(100, 140), 5, [list(range(1 + 10 * g, 1 + 10 * g + nb(37))) for g, nb in enumerate(nblocks)])
    add(p, reqs, "spec", range(200, 230), 29, [list(range(40 + 10 * g, 40 + 10 * g + nb(33))) for g, nb in enumerate(nblocks)])
    add(p, reqs, "dec", range(300, 310), 9, [list(range(70 + 5 * g, 70 + 5 * g + nb(10))) for g, nb in enumerate(nblocks)])
    check_step(p, reqs, [("chunk", 32, []), ("spec", 4, [7, 8, 9]), ("dec", 1, [])], groups, pad_tokens_to=40)


def test_mrope_positions():
    p, reqs = make_packer(mrope_num_dims=3), {}
    pre = np.array([[0, 1, 1, 1, 5], [0, 1, 2, 1, 5], [0, 1, 1, 2, 5]], np.int32)
    add(p, reqs, "v", range(8), 0, [[1, 2]], mrope_positions=pre, mrope_position_delta=-1)
    add(p, reqs, "t", range(3), 2, [[3]])
    check_step(p, reqs, [("v", 7, []), ("t", 1, [])], [Group(4)], mrope_num_dims=3, pad_tokens_to=10)
    assert p.positions.shape == (3, 10) and p.positions.flags.c_contiguous
    reqs["v"].computed = 7
    p.update_requests(["v"], [7])
    check_step(p, reqs, [("v", 1, [])], [Group(4)], mrope_num_dims=3)
    np.testing.assert_array_equal(p.positions[:, 0], [6, 6, 6])  # 7 + delta


def test_split_rule_binding():
    q = np.ones(8, np.int32)
    assert _core.split_decode_prefill(q, np.full(8, 64, np.int32), 8) == (8, 8, 0, 0)
    assert _core.split_decode_prefill(q, np.array([63] + [64] * 7, np.int32), 8) == (0, 0, 8, 8)
    for ctx, decodes in [(511, 0), (512, 1), (513, 1), (4096, 1)]:
        assert _core.split_decode_prefill(q[:1], np.array([ctx], np.int32), 1)[0] == decodes
    assert _core.split_decode_prefill(q[:2], np.array([300, 300], np.int32), 1)[0] == 0  # row 2 is prefill


def test_packer_applies_the_split_with_its_threshold():
    p, reqs = make_packer(max_model_len=1024, num_blocks=1000), {}
    for i in range(4):
        add(p, reqs, f"d{i}", range(128), 127, [list(range(i * 40, i * 40 + 32))])
    add(p, reqs, "c", range(600), 0, [list(range(200, 238))])
    p.pack({"c": 30, "d0": 1, "d1": 1, "d2": 1, "d3": 1})
    assert (p.num_decode_like, p.decode_context, p.num_decodes, p.num_decode_tokens) == (4, 512, 4, 4)
    assert (p.num_prefills, p.num_prefill_tokens) == (1, 30)
    p.pack({"c": 30, "d0": 1, "d1": 1, "d2": 1})
    assert (p.num_decode_like, p.num_decodes, p.num_prefills) == (3, 0, 4)
    q = make_packer(max_model_len=1024, decode_min_total_context=128)
    q.add_request("d", list(range(128)), num_computed_tokens=127, block_ids=(list(range(32)),))
    q.pack({"d": 1})
    assert q.num_decodes == 1


# ---- zero-copy outputs ------------------------------------------------------------


def test_views_are_read_only_zero_copy_and_keep_the_packer_alive():
    p, reqs = make_packer(), {}
    add(p, reqs, "a", range(10, 15), 0, [[7, 8]])
    p.pack({"a": 5})
    ids = p.input_ids
    assert not ids.flags.writeable
    with pytest.raises(ValueError):
        ids[0] = 1
    # a view of the packer's buffer: the next step shows through it
    p.append_sampled(np.array([[99]], np.int32))
    p.update_requests(["a"], [5])
    p.pack({"a": 1})
    assert ids[0] == 99
    again = p.input_ids
    assert again.__array_interface__["data"][0] == ids.__array_interface__["data"][0]
    del p
    assert list(again) == [99]  # the view owns a reference to the packer


def test_mlx_inputs_are_copies_of_the_views():
    from vllm_metal.scheduler_delta import mlx_inputs

    p, reqs = make_packer((Group(4), Group(8, 4))), {}
    add(p, reqs, "a", range(10, 19), 0, [[1, 2, 3], [4, 5]])
    p.pack({"a": 9})
    arrays = mlx_inputs(p)
    assert arrays["input_ids"].dtype == mx.int32 and arrays["slot_mappings"].dtype == mx.int64
    np.testing.assert_array_equal(np.array(arrays["slot_mappings"]), p.slot_mappings)
    (w0, w1) = p.block_table_used_widths
    assert (w0, w1) == (3, 3)  # 9 tokens: 3 blocks of 4, 3 kernel blocks of 4
    np.testing.assert_array_equal(np.array(arrays["block_tables"][1]), p.block_tables[1][:, :w1])
    assert not p.block_tables[1][:, w1:].any()
    before = np.array(arrays["input_ids"])
    p.append_sampled(np.array([[5]], np.int32))
    p.update_requests(["a"], [9])
    p.pack({"a": 1})
    np.testing.assert_array_equal(np.array(arrays["input_ids"]), before)  # copies: unchanged


# ---- bad input: a clear error and no change ----------------------------------------


def _state(p, reqs):
    return snapshot(p, reqs), outputs(p), len(p)


@pytest.mark.parametrize(
    "bad, message",
    [
        (lambda p: p.pack({"a": 1, "zzz": 1}), "unknown request id 'zzz' scheduled"),
        (lambda p: p.pack({"a": 9}), "9 tokens need 3 blocks of 4 in KV group 0, the block table holds 2"),
        (lambda p: p.pack({"b": 3}), "need 5 known tokens, the request has 4"),
        (lambda p: p.pack({"b": 2}, {"b": [5, 6]}), "expected 1 + drafts <= num_tokens"),
        (lambda p: p.pack({"a": 1}, pad_tokens_to=65), "exceeds max_num_batched_tokens 64"),
        (lambda p: p.update_requests(["a", "nope"], [1, 1]), "unknown request id 'nope'"),
        (lambda p: p.update_requests(["a", "b"], [1, 1], [([3],), ([100],)]), "block id 100 in KV group 0 is outside the pool [0, 100)"),
        (lambda p: p.update_requests(["a"], [1], [(list(range(20, 35)),)]), "would hold 17 blocks, the block table has room for 16"),
        (lambda p: p.update_requests(["a", "a"], [1, 2]), "appears twice"),
        (lambda p: p.update_requests(["b"], [0], [None], resumed_req_ids={"b"}), "no block ids came"),
        (lambda p: p.add_request("a", [1]), "request id 'a' is already in the table"),
        (lambda p: p.add_request("c", list(range(65))), "65 tokens exceed max_model_len 64"),
        (lambda p: p.add_request("c", [1, 2], num_computed_tokens=3), "num_computed_tokens must be in [0, 2], got 3"),
        (lambda p: p.add_request("c", [1], block_ids=([1], [2])), "expected block ids for 1 KV-cache groups, got 2"),
        (lambda p: p.append_tokens("b", list(range(62))), "exceeds max_model_len 64"),
        (lambda p: p.append_tokens("nope", [1]), "unknown request id 'nope'"),
        (lambda p: p.append_sampled(np.array([[1], [2]], np.int32)), "no packed step is waiting"),
        (lambda p: p.row_of("nope"), "unknown request id 'nope'"),
    ],
)
def test_bad_input_raises_and_changes_nothing(bad, message):
    p, reqs = make_packer(), {}
    add(p, reqs, "a", range(8), 0, [[1, 2]])
    add(p, reqs, "b", range(3), 2, [[3]])
    p.pack({"a": 8, "b": 1})
    p.append_sampled(np.array([[1], [2]], np.int32))  # b: decode row first
    reqs["b"].tokens.append(1)
    reqs["a"].tokens.append(2)
    p.append_tokens("a", [3])
    reqs["a"].tokens.append(3)
    before = _state(p, reqs)
    with pytest.raises(ValueError, match=r"^\[BatchPacker\] ") as err:
        bad(p)
    assert message in str(err.value)
    after = _state(p, reqs)
    assert after[0] == before[0] == model_snapshot(reqs)
    assert after[2] == before[2]
    assert_outputs_equal(after[1], before[1])


def test_wrong_types_are_type_errors():
    p = make_packer()
    with pytest.raises(TypeError, match="request ids must be str"):
        p.add_request(5, [1])
    p.add_request("a", [1, 2], block_ids=([1],))
    with pytest.raises(TypeError, match="must be a dict"):
        p.pack([("a", 1)])
    with pytest.raises(TypeError, match="must be a list"):
        p.update_requests({"a"}, [1])


def test_remove_ignores_unknown_ids_and_rows_are_reused():
    p = make_packer()
    p.add_request("a", [1, 2], block_ids=([1],))
    row = p.row_of("a")
    assert p.remove_requests({"a", "never-seen"}) == 1
    assert "a" not in p and len(p) == 0
    p.add_request("b", [1, 2], block_ids=([1],))
    assert p.row_of("b") != row  # the row is reused only after the next pack() ...
    p.pack({"b": 2})
    p.add_request("c", [1, 2], block_ids=([1],))
    assert p.row_of("c") == row  # ... so a packed step's rows keep their ids


def test_append_sampled_follows_batch_order_and_skips_partial_chunks():
    p, reqs = make_packer(), {}
    add(p, reqs, "c", range(10), 0, [[1, 2, 3]])
    add(p, reqs, "s", range(5), 4, [[4, 5]])
    p.pack({"c": 6, "s": 3}, {"s": [7, 7]})
    assert p.req_ids == ["s", "c"] and list(p.discard_sampled) == [False, True]
    p.append_sampled(np.array([[41, 42, -1], [9, 9, 9]], np.int32))
    assert list(p.token_ids("s")) == [0, 1, 2, 3, 4, 41, 42]
    assert list(p.token_ids("c")) == list(range(10))


def test_deferred_samples_through_the_binding():
    # async scheduling: step 2 is packed before step 1's tokens exist
    p, reqs = make_packer(), {}
    add(p, reqs, "a", range(4), 3, [[1, 3]])
    add(p, reqs, "b", range(10, 14), 3, [[2, 4]])
    p.pack({"a": 1, "b": 1})
    assert p.num_input_sources == 0 and len(p.input_sources) == 0
    p.defer_sampled()
    assert p.num_deferred_steps == 1 and list(p.token_ids("a")) == [0, 1, 2, 3, 0]
    p.update_requests(["a", "b"], [4, 4])
    p.pack({"b": 1, "a": 1})
    assert list(p.input_sources) == [1, 0]  # b was batch row 1 of step 1, a row 0
    with pytest.raises(ValueError, match="expected the 2 tokens"):
        p.resolve_deferred(np.array([5], np.int32))
    with pytest.raises(TypeError):
        p.resolve_deferred(np.array([[40, 41]], np.int32))  # one row of tokens per sequence
    p.resolve_deferred(np.array([40, 41], np.int32))
    assert list(p.token_ids("a")) == [0, 1, 2, 3, 40] and list(p.token_ids("b"))[-1] == 41
    with pytest.raises(ValueError, match="no step is waiting"):
        p.resolve_deferred(np.array([40, 41], np.int32))


# ---- the SchedulerOutput adapter (vLLM 0.33 contracts) ------------------------------


def _so(new=(), cached=None, scheduled=None, spec=None, finished=(), preempted=()):
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    scheduled = scheduled or {}
    return SchedulerOutput(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=cached or CachedRequestData.make_empty(),
        num_scheduled_tokens=dict(scheduled),
        total_num_scheduled_tokens=sum(scheduled.values()),
        scheduled_spec_decode_tokens=dict(spec or {}),
        scheduled_encoder_inputs={},
        finished_req_ids=set(finished),
        free_encoder_mm_hashes=[],
        preempted_req_ids=set(preempted),
    )


def _new(rid, prompt, blocks, computed=0, prefill=None):
    from vllm.v1.core.sched.output import NewRequestData

    return NewRequestData(
        req_id=rid,
        prompt_token_ids=list(prompt),
        mm_features=[],
        sampling_params=None,
        pooling_params=None,
        block_ids=tuple(list(b) for b in blocks),
        num_computed_tokens=computed,
        lora_request=None,
        prefill_token_ids=None if prefill is None else list(prefill),
    )


def _cached(entries, resumed=(), all_tokens=None):
    """entries: (req_id, num_computed, new_block_ids or None, num_output_tokens)"""
    from vllm.v1.core.sched.output import CachedRequestData

    return CachedRequestData(
        req_ids=[e[0] for e in entries],
        resumed_req_ids=set(resumed),
        new_token_ids=[],
        all_token_ids=dict(all_tokens or {}),
        new_block_ids=[None if e[2] is None else tuple(list(b) for b in e[2]) for e in entries],
        num_computed_tokens=[e[1] for e in entries],
        num_output_tokens=[e[3] for e in entries],
    )


@pytest.mark.parametrize("v2", [True, False], ids=["v2", "v1"])
def test_scheduler_output_adapter_through_preemption(v2):
    pytest.importorskip("vllm")
    from vllm_metal.scheduler_delta import SchedulerDelta

    p = make_packer()
    delta = SchedulerDelta(p, use_v2_model_runner=v2)
    A = Request(list(range(100, 110)), 10, 0, [[1, 2, 3]])
    B = Request(list(range(200, 206)), 6, 4, [[4, 5]])
    reqs = {"A": A, "B": B}

    def step(so, sched, sampled):
        """The model (reqs) already holds the state after this step's deltas."""
        delta.apply(so)
        assert_outputs_equal(outputs(p), reference_pack(reqs, sched, [Group(4)], 64))
        sampled = np.array(sampled, np.int32).reshape(p.num_seqs, -1)
        for b, rid in enumerate(p.req_ids):
            if not p.discard_sampled[b]:
                reqs[rid].tokens.extend(int(t) for t in sampled[b] if t >= 0)
        p.append_sampled(sampled)
        held = {rid: r for rid, r in reqs.items() if rid in p}  # V2 drops preempted requests
        assert model_snapshot(held) == snapshot(p, held)

    def new(rid, r, computed):
        return _new(rid, r.tokens[: r.prompt_len], r.blocks, computed, r.tokens if v2 else None)

    # 1: A's first chunk; B's prompt after a 4-token prefix hit
    step(_so(new=[new("A", A, 0), new("B", B, 4)], scheduled={"A": 8, "B": 2}),
         [("A", 8, []), ("B", 2, [])], [7, 8])
    assert B.tokens[-1] == 8 and A.tokens == list(range(100, 110))  # A's chunk was partial
    # 2: A's last chunk; B decodes, with a new block
    A.computed, B.computed = 8, 6
    B.blocks[0].append(6)
    step(_so(cached=_cached([("A", 8, None, 0), ("B", 6, [[6]], 1)]), scheduled={"A": 2, "B": 1}),
         [("A", 2, []), ("B", 1, [])], [11, 12])  # batch order: B, A
    # 3: B is preempted; A decodes
    A.computed = 10
    step(_so(cached=_cached([("A", 10, None, 1)]), scheduled={"A": 1}, preempted=["B"]),
         [("A", 1, [])], [13])
    assert ("B" in p) == (not v2)  # V1 keeps a preempted request's state
    # 4: B resumes on new blocks after a 4-token prefix hit; A verifies 2 drafts
    A.computed = 11
    A.blocks[0].append(11)
    B.computed, B.blocks = 4, [[9, 10]]
    spec = {"A": [55, 56]}
    if v2:
        so = _so(new=[new("B", B, 4)], cached=_cached([("A", 11, [[11]], 2)]),
                 scheduled={"A": 3, "B": 4}, spec=spec)
    else:
        so = _so(cached=_cached([("A", 11, [[11]], 2), ("B", 4, [[9, 10]], 2)], resumed=["B"]),
                 scheduled={"A": 3, "B": 4}, spec=spec)
    step(so, [("A", 3, [55, 56]), ("B", 4, [])], [[21, 22, -1], [31, -1, -1]])
    assert A.tokens[-3:] == [13, 21, 22] and B.tokens[-3:] == [8, 11, 31]
    # 5: A finishes; B decodes on a new block
    del reqs["A"]
    B.computed = 8
    B.blocks[0].append(12)
    step(_so(cached=_cached([("B", 8, [[12]], 3)]), scheduled={"B": 1}, finished=["A"]),
         [("B", 1, [])], [41])
    assert "A" not in p and len(p) == 1


def test_v1_rollback_and_all_token_ids():
    """V1: num_output_tokens below the worker's count drops outputs; all_token_ids
    (sent for requests not scheduled in the previous step) replaces the tokens."""
    pytest.importorskip("vllm")
    from vllm_metal.scheduler_delta import SchedulerDelta

    p = make_packer()
    delta = SchedulerDelta(p, use_v2_model_runner=False)
    delta.apply(_so(new=[_new("A", range(5), [[1, 2]])], scheduled={"A": 5}))
    p.append_sampled(np.array([[50]], np.int32))
    p.append_tokens("A", [51, 52])
    delta.apply(_so(cached=_cached([("A", 5, None, 1)]), scheduled={"A": 1}))
    assert list(p.token_ids("A")) == [0, 1, 2, 3, 4, 50]
    np.testing.assert_array_equal(p.input_ids, [50])
    p.append_sampled(np.array([[60]], np.int32))
    delta.apply(_so(cached=_cached([("A", 6, None, 2)], all_tokens={"A": [0, 1, 2, 3, 4, 70, 71]}),
                    scheduled={"A": 1}))
    np.testing.assert_array_equal(p.input_ids, [71])


@pytest.mark.parametrize("v2", [True, False], ids=["v2", "v1"])
def test_hooks_see_every_delta_and_correct_computed_tokens(v2):
    """The model runner's path (DeltaHooks): removals with every preempted id (V1 keeps them
    in the table), each added request's row, tokens and prompt length, and its corrected
    num_computed_tokens reaching the packer; without trim_outputs V1 keeps the outputs
    past vLLM's count."""
    pytest.importorskip("vllm")
    from vllm_metal.scheduler_delta import DeltaHooks, SchedulerDelta

    calls = []

    class Hooks(DeltaHooks):
        def requests_removed(self, removed, preempted):
            calls.append(("removed", sorted(removed), sorted(preempted)))

        def request_added(self, new, row, tokens, prompt_len):
            assert list(p.token_ids(new.req_id)) == tokens  # after the packer took it
            calls.append(("added", new.req_id, row, tokens, prompt_len))

        def computed_tokens(self, req_ids, computed):
            calls.append(("computed", req_ids, computed))
            return [c - 1 if r == "A" else c for r, c in zip(req_ids, computed)]  # e.g. a replay

    p = make_packer()
    delta = SchedulerDelta(p, use_v2_model_runner=v2, hooks=Hooks(), trim_outputs=False)
    delta.apply(_so(new=[_new("A", range(5), [[1, 2]]), _new("B", range(10, 13), [[3, 4]], prefill=range(10, 15))],
                    scheduled={"A": 5, "B": 5}))
    assert calls == [("removed", [], []), ("added", "A", p.req_rows[list(p.req_ids).index("A")], list(range(5)), 5),
                     ("added", "B", p.req_rows[list(p.req_ids).index("B")], list(range(10, 15)), 3)]
    p.append_sampled(np.array([[50], [60]], np.int32))
    p.append_tokens("A", [51])  # one more than vLLM counts: kept (no trimming)
    calls.clear()
    delta.apply(_so(cached=_cached([("A", 6, None, 1)]), scheduled={"A": 1}, finished=["C"], preempted=["B"]))
    assert calls == [("removed", ["B", "C"] if v2 else ["C"], ["B"]), ("computed", ["A"], [6])]
    assert ("B" in p) == (not v2)
    assert list(p.token_ids("A")) == [0, 1, 2, 3, 4, 50, 51]
    np.testing.assert_array_equal(p.input_ids, [50])  # position 5: the hook's 6 - 1
    np.testing.assert_array_equal(p.positions, [5])


def test_update_many_requests_with_blocks_in_several_groups():
    p, reqs = make_packer((Group(4), Group(8, 4))), {}
    add(p, reqs, "a", range(3), 0, [[1], [2]])
    add(p, reqs, "b", range(3), 0, [[3], [4]])
    add(p, reqs, "c", range(3), 0, [[5], [6]])
    p.update_requests(["a", "b", "c"], [0, 0, 0], [([7], [8]), None, ([9, 10], [])])
    assert p.block_ids("a") == [[1, 7], [2, 8]]
    assert p.block_ids("b") == [[3], [4]]
    assert p.block_ids("c") == [[5, 9, 10], [6]]
