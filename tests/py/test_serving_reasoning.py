"""`vllm serve --reasoning-parser` and thinking_token_budget, on the tiny random-weight
Qwen3.5 checkpoint with single-token <think>/</think> (marker_checkpoint.py).

The budget is checked token-exactly against mlx-lm's own forward of the same weights: with
budget N and a prompt that ends inside a thinking section, greedy output is the first N
tokens of the unbudgeted reference, then </think> (forced), then the reference's
continuation of prompt + those tokens + </think>. Chat responses split reasoning from
content at the forced </think>. Budgeted and free requests share batches; seeded sampling
draws the same tokens before the forced end as without a budget.
"""

from __future__ import annotations

import concurrent.futures as cf
import json

import mlx.core as mx
import pytest

from marker_checkpoint import MARKER_IDS, write_marker_checkpoint
from qwen3_5_checkpoint import greedy, reference_model
from serving_harness import Server
from test_thinking_budget import reference_forced

pytestmark = [pytest.mark.slow, pytest.mark.serving]

THINK, END = MARKER_IDS["<think>"], MARKER_IDS["</think>"]
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "128", "--max-num-seqs", "8",
               "--num-gpu-blocks-override", "32", "--max-num-batched-tokens", "64"]
PROMPTS = [[5, 17, 3, 88, 42, 1, 9, 60, 23, 71, 4, THINK],
           [40, 41, 42, 43, 44, 100, 120, 7, THINK],
           [200, 13, 77, 9, 31, 31, 64, THINK, 90, 91]]  # two thinking tokens in the prompt


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_marker_checkpoint(tmp_path_factory.mktemp("qwen3_5_markers"))


@pytest.fixture(scope="module")
def reference(checkpoint):
    return reference_model(checkpoint)


@pytest.fixture(scope="module")
def server(checkpoint):
    s = Server(str(checkpoint), "tiny-think", [*SERVER_ARGS, "--reasoning-parser", "qwen3"])
    yield s
    s.stop()


def complete_ids(server, prompt: list[int], max_tokens: int, **kw) -> dict:
    r = server.client.post("/v1/completions", json={
        "model": server.name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "return_token_ids": True, "ignore_eos": True, **kw})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def budgeted_reference(model, prompt: list[int], budget: int, n: int) -> list[int]:
    """mlx-lm's greedy decoding, one token at a time, with the token the step-by-step
    walker of test_thinking_budget.py forces taking the argmax's place."""
    cache = model.make_cache()
    out = model(mx.array([prompt]), cache=cache)
    tokens, gen = list(prompt), []
    for _ in range(n):
        forced = reference_forced(tokens, budget, [THINK], [END], [END])
        t = forced if forced is not None else int(mx.argmax(out[0, -1]).item())
        gen.append(t)
        tokens.append(t)
        out = model(mx.array([[t]]), cache=cache)
    return gen


@pytest.mark.parametrize("budget", [0, 1, 5, 12])
def test_budget_forces_the_end_after_exactly_n_thinking_tokens(server, reference, budget):
    prompt = PROMPTS[0]
    free = greedy(reference, prompt, 20)
    assert END not in free  # without a budget the model keeps thinking (a valid test)
    assert complete_ids(server, prompt, 20)["token_ids"] == free
    got = complete_ids(server, prompt, 20, thinking_token_budget=budget)["token_ids"]
    assert got[:budget] == free[:budget] and got[budget] == END
    assert got == budgeted_reference(reference, prompt, budget, 20)


def test_thinking_tokens_of_the_prompt_count(server, reference):
    prompt = PROMPTS[2]  # <think> then two tokens
    got = complete_ids(server, prompt, 10, thinking_token_budget=4)["token_ids"]
    assert got[2] == END
    assert got == budgeted_reference(reference, prompt, 4, 10)
    # already over the budget: the first token is the end
    assert complete_ids(server, prompt, 4, thinking_token_budget=1)["token_ids"][0] == END


def test_a_prompt_outside_thinking_is_not_forced(server, reference):
    prompt = PROMPTS[0][:-1] + [THINK, 9, END]  # a closed section
    got = complete_ids(server, prompt, 12, thinking_token_budget=0)["token_ids"]
    assert got == greedy(reference, prompt, 12)


def test_budgeted_and_free_requests_share_batches(server, reference):
    jobs = [(p, b) for p in PROMPTS for b in (None, 0, 3, 8)]
    want = [greedy(reference, p, 16) if b is None else budgeted_reference(reference, p, b, 16)
            for p, b in jobs]

    def run(job):
        p, b = job
        extra = {} if b is None else {"thinking_token_budget": b}
        return complete_ids(server, p, 16, **extra)["token_ids"]

    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(run, jobs))
    for job, g, w in zip(jobs, got, want):
        assert g == w, job


def test_seeded_sampling_before_the_forced_end_is_unchanged(server):
    kw = dict(temperature=1.0, top_p=0.9, seed=11, logprobs=1)
    free = complete_ids(server, PROMPTS[1], 16, **kw)
    got = complete_ids(server, PROMPTS[1], 16, thinking_token_budget=6, **kw)
    assert got["token_ids"][:6] == free["token_ids"][:6] and got["token_ids"][6] == END
    lps = got["logprobs"]["token_logprobs"]
    assert lps[:6] == pytest.approx(free["logprobs"]["token_logprobs"][:6], abs=1e-4)
    assert -1e30 < lps[6] <= 0  # the model's own logprob of the forced token


def chat(server, max_tokens: int, **kw) -> dict:
    r = server.client.post("/v1/chat/completions", json={
        "model": server.name, "messages": [{"role": "user", "content": "what is the capital"}],
        "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True,
        "ignore_eos": True, **kw})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def check_reasoning_split(server, checkpoint) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(checkpoint))
    choice = chat(server, 16, thinking_token_budget=5)
    ids = choice["token_ids"]
    assert ids[5] == END and END not in ids[6:]
    msg = choice["message"]
    reasoning = msg.get("reasoning") or msg.get("reasoning_content")
    assert reasoning == tok.decode(ids[:5])
    assert msg["content"] == tok.decode(ids[6:])
    # streamed: the same split, delta by delta
    parts = {"reasoning": "", "content": ""}
    with server.client.stream("POST", "/v1/chat/completions", json={
            "model": server.name, "messages": [{"role": "user", "content": "what is the capital"}],
            "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stream": True,
            "thinking_token_budget": 5}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    delta = choice["delta"]
                    parts["reasoning"] += delta.get("reasoning") or delta.get("reasoning_content") or ""
                    parts["content"] += delta.get("content") or ""
    assert parts == {"reasoning": reasoning, "content": msg["content"]}


def test_chat_splits_reasoning_from_content_qwen3(server, checkpoint):
    check_reasoning_split(server, checkpoint)


def test_chat_splits_reasoning_from_content_deepseek_r1(checkpoint):
    s = Server(str(checkpoint), "tiny-think", [*SERVER_ARGS, "--reasoning-parser", "deepseek_r1",
                                                "--no-async-scheduling"])
    try:
        check_reasoning_split(s, checkpoint)
    finally:
        s.stop()


def test_a_budget_without_a_reasoning_parser_is_a_400(checkpoint):
    s = Server(str(checkpoint), "tiny-think", SERVER_ARGS)
    try:
        r = s.client.post("/v1/completions", json={"model": s.name, "prompt": PROMPTS[0],
                                                   "max_tokens": 4, "thinking_token_budget": 2})
        assert r.status_code == 400 and "thinking_token_budget" in r.text, r.text
        assert s.alive()
    finally:
        s.stop()
