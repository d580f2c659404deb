"""N-gram (prompt lookup) proposer of the C++ runtime (_core.ngram_propose and
BatchPacker.propose_ngram) against a brute-force reference written from vLLM's
NgramProposer contract, on random sequences over tiny vocabularies (so that
matches, ties and overlaps are frequent)."""

from __future__ import annotations

import importlib
import sys
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_metal import _core


def reference(tokens: list[int], min_n: int, max_n: int, k: int, max_model_len: int) -> list[int]:
    """vLLM's rule, quadratically: among all (n, s) with min_n <= n <= max_n and
    tokens[s:s+n] == tokens[-n:], s + n <= N - 1 (followed by a token), take the
    largest n, then the smallest s; propose what follows, at most k tokens and
    never past max_model_len."""
    num = len(tokens)
    candidates = [
        (n, s)
        for n in range(min_n, min(max_n, num) + 1)
        for s in range(0, num - n)
        if tokens[s : s + n] == tokens[num - n :]
    ]
    if not candidates:
        return []
    n, s = max(candidates, key=lambda c: (c[0], -c[1]))
    count = min(k, max_model_len - num)
    return tokens[s + n : s + n + count] if count > 0 else []


def random_case(rng: np.random.Generator) -> tuple[list[int], int, int, int, int]:
    vocab = int(rng.integers(1, 5))
    tokens = rng.integers(0, vocab, size=int(rng.integers(0, 48))).tolist()
    min_n = int(rng.integers(1, 5))
    max_n = min_n + int(rng.integers(0, 5))
    k = int(rng.integers(1, 7))
    max_model_len = max(1, len(tokens) + int(rng.integers(-2, 8)))
    return tokens, min_n, max_n, k, max_model_len


def test_hand_cases():
    # longest n wins: (3) first precedes 8, (2, 3) precedes 6
    t = [0, 3, 8, 8, 1, 2, 3, 6, 6, 6, 2, 3]
    assert _core.ngram_propose(t, 1, 1, 2, 100) == [8, 8]
    assert _core.ngram_propose(t, 1, 4, 2, 100) == [6, 6]
    assert _core.ngram_propose(t, 3, 4, 2, 100) == []
    # earliest occurrence wins
    assert _core.ngram_propose([1, 2, 10, 1, 2, 20, 1, 2], 2, 2, 1, 100) == [10]
    # continuation cut by the history's end, then by max_model_len
    assert _core.ngram_propose([1, 2, 3, 1, 2], 2, 2, 5, 100) == [3, 1, 2]
    assert _core.ngram_propose([1, 2, 3, 1, 2], 2, 2, 5, 7) == [3, 1]
    assert _core.ngram_propose([1, 2, 3, 1, 2], 2, 2, 5, 5) == []
    # 0 is an ordinary token; numpy input works too
    assert _core.ngram_propose(np.array([0, 4, 0], dtype=np.int32), 1, 1, 3, 100) == [4, 0]


def test_random_sequences_match_reference():
    rng = np.random.default_rng(2026)
    for _ in range(5000):
        case = random_case(rng)
        assert _core.ngram_propose(*case) == reference(*case), case


def load_vllm_matcher():
    """vLLM's matcher function, its module imported with a stand-in for numba (not
    installed: decorators that return the function, so it runs as plain Python).
    sys.modules and the parent package are left as they were."""
    name = "vllm.v1.spec_decode.ngram_proposer"
    stub = types.ModuleType("numba")
    stub.jit = stub.njit = lambda *a, **kw: a[0] if a and callable(a[0]) else (lambda f: f)
    stub.prange = range
    stub.get_num_threads = lambda: 1
    stub.set_num_threads = lambda n: None
    saved = {key: sys.modules.get(key) for key in ("numba", name)}
    parent = importlib.import_module("vllm.v1.spec_decode")
    had_attr, old_attr = hasattr(parent, "ngram_proposer"), getattr(parent, "ngram_proposer", None)
    sys.modules["numba"] = stub
    sys.modules.pop(name, None)
    try:
        return importlib.import_module(name)._find_longest_matched_ngram_and_propose_tokens
    finally:
        for key, module in saved.items():
            if module is None:
                sys.modules.pop(key, None)
            else:
                sys.modules[key] = module
        if had_attr:
            parent.ngram_proposer = old_attr
        elif hasattr(parent, "ngram_proposer"):
            delattr(parent, "ngram_proposer")


def test_vllm_function_agrees():
    """vLLM's own matcher agrees with the reference and with _core."""
    find = load_vllm_matcher()
    rng = np.random.default_rng(7)
    for _ in range(2000):
        tokens, min_n, max_n, k, max_model_len = random_case(rng)
        want = find(np.array(tokens, dtype=np.int32), min_n, max_n, max_model_len, k).tolist()
        assert reference(tokens, min_n, max_n, k, max_model_len) == want
        assert _core.ngram_propose(tokens, min_n, max_n, k, max_model_len) == want


@settings(max_examples=400, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2), max_size=40),
    min_n=st.integers(1, 4),
    extra=st.integers(0, 4),
    k=st.integers(1, 6),
    room=st.integers(-3, 8),
)
def test_hypothesis_matches_reference(tokens, min_n, extra, k, room):
    max_model_len = max(1, len(tokens) + room)
    args = (tokens, min_n, min_n + extra, k, max_model_len)
    assert _core.ngram_propose(*args) == reference(*args)


def test_long_history():
    rng = np.random.default_rng(5)
    t = rng.integers(100, 100_000, size=100_000).tolist()
    t[500:506] = [1, 2, 3, 4, 5, 6]
    t[506:509] = [7, 8, 9]
    t += [2, 3, 4, 5, 6]
    assert _core.ngram_propose(t, 2, 8, 3, 1 << 20) == [7, 8, 9]


@pytest.mark.parametrize(
    "min_n,max_n,k,max_model_len,msg",
    [(0, 2, 1, 10, "min_n"), (3, 2, 1, 10, "min_n=3 max_n=2"), (1, 2, 0, 10, "k >= 1"), (1, 2, 1, 0, "max_model_len")],
)
def test_bad_params(min_n, max_n, k, max_model_len, msg):
    with pytest.raises(ValueError, match=r"\[ngram\].*" + msg):
        _core.ngram_propose([1, 2, 1], min_n, max_n, k, max_model_len)


# ---- BatchPacker.propose_ngram ------------------------------------------------------


def make_packer(max_model_len: int = 128) -> _core.BatchPacker:
    return _core.BatchPacker(
        max_num_reqs=16,
        max_num_batched_tokens=256,
        max_model_len=max_model_len,
        kv_groups=[_core.KvGroupSpec(16)],
    )


def check_rows(packer, rows, histories, min_n, max_n, k, max_model_len):
    drafts, num_drafts = packer.propose_ngram(np.asarray(rows, dtype=np.int32), min_n, max_n, k, max_model_len)
    assert drafts.dtype == np.int32 and drafts.shape == (len(rows), k)
    assert num_drafts.dtype == np.int32 and num_drafts.shape == (len(rows),)
    for i, hist in enumerate(histories):
        want = reference(hist, min_n, max_n, k, max_model_len)
        assert num_drafts[i] == len(want), (i, hist)
        assert drafts[i, : len(want)].tolist() == want
        assert (drafts[i, len(want) :] == -1).all()


def test_packer_rows_match_reference():
    rng = np.random.default_rng(11)
    packer = make_packer()
    histories: dict[str, list[int]] = {}
    for i in range(12):
        vocab = int(rng.integers(1, 5))
        histories[f"r{i}"] = rng.integers(0, vocab, size=int(rng.integers(1, 60))).tolist()
        packer.add_request(f"r{i}", histories[f"r{i}"])
    for _ in range(50):
        # grow some histories as decoding would, then propose for a random subset (repeats allowed)
        for rid in rng.choice(list(histories), size=3):
            new = rng.integers(0, 3, size=int(rng.integers(1, 3))).tolist()
            if len(histories[rid]) + len(new) <= 128:
                packer.append_tokens(rid, new)
                histories[rid] += new
        ids = [str(x) for x in rng.choice(list(histories), size=int(rng.integers(1, 16)))]
        min_n = int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 4))
        k = int(rng.integers(1, 6))
        max_model_len = int(rng.integers(40, 140))
        rows = [packer.row_of(r) for r in ids]
        check_rows(packer, rows, [histories[r] for r in ids], min_n, max_n, k, max_model_len)
        for rid in ids:
            assert packer.token_ids(rid) == histories[rid]


def test_packer_history_is_current_tokens():
    packer = make_packer()
    packer.add_request("a", [1, 2, 3, 1, 2], prompt_len=3)
    row = packer.row_of("a")
    check_rows(packer, [row], [[1, 2, 3, 1, 2]], 1, 3, 4, 128)
    packer.update_requests(["a"], [0], num_output_tokens=[1])  # rollback to 1 2 3 1
    check_rows(packer, [row], [[1, 2, 3, 1]], 1, 3, 4, 128)
    drafts, num = packer.propose_ngram(np.array([row], dtype=np.int32), 1, 3, 4, 128)
    assert num.tolist() == [3] and drafts.tolist() == [[2, 3, 1, -1]]
    drafts, num = packer.propose_ngram(np.zeros(0, dtype=np.int32), 1, 3, 4, 128)
    assert drafts.shape == (0, 4) and num.shape == (0,)


def test_packer_bad_input():
    packer = make_packer()
    packer.add_request("a", [1, 2, 1, 2])
    packer.add_request("b", [3, 3, 3])
    rb = packer.row_of("b")
    packer.remove_requests(["b"])
    ra = packer.row_of("a")
    with pytest.raises(ValueError, match=rf"\[BatchPacker\] propose_ngram: row {rb} \(entry 1\) is not a live"):
        packer.propose_ngram(np.array([ra, rb], dtype=np.int32), 1, 2, 2, 64)
    with pytest.raises(ValueError, match=r"row 999"):
        packer.propose_ngram(np.array([999], dtype=np.int32), 1, 2, 2, 64)
    with pytest.raises(ValueError, match=r"row -1"):
        packer.propose_ngram(np.array([-1], dtype=np.int32), 1, 2, 2, 64)
    for bad in [(0, 2, 2, 64), (2, 1, 2, 64), (1, 2, 0, 64), (1, 2, -5, 64), (1, 2, 2, 0)]:
        with pytest.raises(ValueError, match=r"\[ngram\]"):
            packer.propose_ngram(np.array([ra], dtype=np.int32), *bad)
    # the packer still works
    drafts, num = packer.propose_ngram(np.array([ra], dtype=np.int32), 1, 2, 2, 64)
    assert num.tolist() == [2] and drafts.tolist() == [[1, 2]]
