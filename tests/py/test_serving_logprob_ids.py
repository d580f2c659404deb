"""logprob_token_ids and prompt_logprob_token_ids through `vllm serve` on the offline
SmolLM2 model, async scheduling (the default) and sync.

The reference is the same server's top-n logprobs (greedy, so the same tokens): a
token's logprob at a position is the same whether it comes back as one of the top n
or as one of the requested ids. The server runs batch-invariant (VLLM_BATCH_INVARIANT=1)
so that the prefix cache and the batch leave the logits bit-identical and the values
can be compared tightly. prompt_logprob_token_ids goes through vLLM's
/inference/v1/generate (--enable-scale-out), its scores as a base64 .npy array.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import io

import numpy as np
import pytest

from serving_harness import Server
from test_serving import smollm2_gguf

pytestmark = [pytest.mark.slow, pytest.mark.serving]

TOP = 20  # vLLM's default --max-logprobs
TOL = 1e-5  # bit-identical logits; the JSON floats round
PROMPT = "The capital of France is"


@pytest.fixture(scope="module", params=["async", "sync"])
def server(request):
    extra = [] if request.param == "async" else ["--no-async-scheduling"]
    s = Server(smollm2_gguf(), "smollm2", ["--max-model-len", "512", "--max-num-seqs", "8",
                                           "--num-gpu-blocks-override", "128",
                                           "--enable-scale-out"] + extra,
               env={"VLLM_BATCH_INVARIANT": "1"})
    yield s
    s.stop()


def _chat(server, **kw) -> dict:
    r = server.chat("Name a colour.", max_tokens=6, return_tokens_as_token_ids=True, **kw)
    assert r["status"] == 200, r
    return r


def _positions(r) -> list[dict[int, float]]:
    """Per generated position: token id -> logprob of every entry the response lists."""
    out = []
    for c in r["choices"][0]["logprobs"]["content"]:
        entries = {int(c["token"].split(":")[1]): c["logprob"]}
        entries.update({int(t["token"].split(":")[1]): t["logprob"] for t in c["top_logprobs"]})
        out.append(entries)
    return out


def _sampled(r) -> list[int]:
    return [int(c["token"].split(":")[1]) for c in r["choices"][0]["logprobs"]["content"]]


def test_chat_logprob_token_ids_match_the_top_n_logprobs(server):
    top = _chat(server, logprobs=True, top_logprobs=TOP)
    first = _positions(top)[0]
    ids = sorted(first, key=first.get, reverse=True)[2:7]  # five ids of the first top 20
    got = _chat(server, logprobs=True, logprob_token_ids=ids)
    assert _sampled(got) == _sampled(top)  # greedy: the same tokens
    for pos, (want, content) in enumerate(zip(_positions(top),
                                              got["choices"][0]["logprobs"]["content"])):
        listed = {int(t["token"].split(":")[1]): t["logprob"] for t in content["top_logprobs"]}
        # exactly the ids, plus the sampled token (vLLM lists it too)
        assert set(listed) - {_sampled(top)[pos]} == set(ids) - {_sampled(top)[pos]}
        assert set(ids) <= set(listed)
        for t, lp in listed.items():
            if t in want:
                assert lp == pytest.approx(want[t], abs=TOL), (pos, t)
            else:  # outside the top 20: below all of them
                assert lp <= min(want.values()) + TOL, (pos, t)
    # at the first position all five are in the top 20: every value was compared
    assert set(ids) <= set(_positions(top)[0])


def test_completion_logprob_token_ids_with_others_in_the_batch(server):
    """An ids request next to a top-n request and a plain one: each gives what it gives
    alone."""
    ids = [13, 28, 314, 1345]
    reqs = [dict(logprobs=1, logprob_token_ids=ids), dict(logprobs=3), dict()]

    def run(kw):
        r = server.complete(PROMPT, max_tokens=8, **kw)
        assert r["status"] == 200, r
        return r["choices"][0]

    alone = [run(kw) for kw in reqs]
    with cf.ThreadPoolExecutor(6) as pool:
        together = list(pool.map(run, reqs * 2))
    for i, c in enumerate(together):
        ref = alone[i % 3]
        assert c["text"] == ref["text"]
        if ref["logprobs"] is None:
            assert c["logprobs"] is None
            continue
        np.testing.assert_allclose(c["logprobs"]["token_logprobs"],
                                   ref["logprobs"]["token_logprobs"], atol=TOL)
        for a, b in zip(c["logprobs"]["top_logprobs"], ref["logprobs"]["top_logprobs"]):
            assert a.keys() == b.keys()
            np.testing.assert_allclose(list(a.values()), [b[k] for k in a], atol=TOL)
    # the ids request lists 4 entries (+ the sampled token when it is not one of them)
    assert all(len(t) >= 4 for t in alone[0]["logprobs"]["top_logprobs"])


def _generate(server, token_ids, **sampling) -> dict:
    r = server.client.post("/inference/v1/generate", json={
        "model": server.name, "token_ids": token_ids,
        "sampling_params": {"max_tokens": 2, "temperature": 0, **sampling}})
    assert r.status_code == 200, r.text
    return r.json()


def _npy(b64: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(b64)), allow_pickle=False)


def test_prompt_logprob_token_ids_match_the_prompt_logprobs(server):
    tok = server.client.post("/tokenize", json={"model": server.name, "prompt": PROMPT * 3})
    prompt = tok.json()["tokens"]
    ref = _generate(server, prompt, prompt_logprobs=TOP)["prompt_logprobs"]  # [None, {id: lp}...]
    start = 2
    rows = []
    for i in range(start, len(prompt) - 1):  # row i predicts prompt token i + 1
        listed = sorted(ref[i + 1], key=lambda t: ref[i + 1][t]["logprob"], reverse=True)
        rows.append([prompt[i + 1], int(listed[0]), int(listed[3])] + ([-1] if i % 2 else [5]))
    got = _generate(server, prompt, prompt_logprob_token_ids=rows, prompt_logprob_start=start)
    scores = _npy(got["prompt_token_id_logprobs"])
    assert scores.shape == (len(rows), 4) and scores.dtype == np.float32
    for r, (i, row) in enumerate(zip(range(start, len(prompt) - 1), rows)):
        want = {int(t): v["logprob"] for t, v in ref[i + 1].items()}
        for c, t in enumerate(row):
            if t == -1:
                assert np.isneginf(scores[r, c])
            elif t in want:
                assert scores[r, c] == pytest.approx(want[t], abs=TOL), (r, c)
            else:
                assert scores[r, c] <= min(want.values()) + TOL
    # the prompt's own tokens: every one listed by prompt_logprobs
    np.testing.assert_allclose(scores[:, 0], [ref[i + 1][str(prompt[i + 1])]["logprob"]
                                              for i in range(start, len(prompt) - 1)], atol=TOL)
    assert got["prompt_logprobs"] is None  # only the ids were asked for


def test_bad_ids_are_a_400_from_vllm_and_the_engine_lives(server):
    r = server.client.post("/v1/chat/completions", json={
        "model": server.name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
        "logprobs": True, "logprob_token_ids": [10**7]})
    assert r.status_code == 400 and "logprob_token_ids" in r.text
    assert server.complete("Hi", max_tokens=2)["status"] == 200
