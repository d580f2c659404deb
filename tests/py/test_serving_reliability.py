"""Reliability of one real `vllm serve` (SmolLM2 offline GGUF) shared by the whole module:
hostile input, clients that vanish at concurrency 32, a soak, a chat-input fuzzer, and last,
SIGTERM under load (docs/reliability.md holds the figures).

Every hostile request must get a 4xx with an error body, and the server must then answer
a normal request exactly as before (the greedy answer recorded at start-up is the
reference). The soak size is small by default; VLLM_METAL_SOAK=full runs the issue's
2,000 requests at concurrency 64.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from serving_harness import Server, runner_hook

pytestmark = [pytest.mark.slow, pytest.mark.serving]

ROOT = Path(__file__).resolve().parents[2]
CHAT_CORPUS = ROOT / "tests/fuzz_corpus/chat"
MAX_MODEL_LEN = 512
MAX_NUM_SEQS = 32
SERVER_ARGS = ["--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(MAX_NUM_SEQS),
               "--num-gpu-blocks-override", "192", "--max-num-batched-tokens", "512",
               "--shutdown-timeout", "20"]
# every non-empty step's start (monotonic s) and scheduled tokens, one line each
STEP_LOG_HOOK = """
import os, time

def wrap(execute_model):
    path = os.environ["VLLM_METAL_TEST_STEP_LOG"]

    def timed(self, scheduler_output):
        n = scheduler_output.total_num_scheduled_tokens
        if n:
            with open(path, "a") as f:
                f.write(f"{time.monotonic()} {n}\\n")
        return execute_model(self, scheduler_output)
    return timed
"""
REFERENCE_PROMPT = "The capital of France is"


def smollm2_gguf() -> str:
    from vllm_metal.models.offline import OFFLINE_GGUF

    return str(OFFLINE_GGUF["smollm2"]())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    hook = tmp_path_factory.mktemp("hook")
    (hook / "sitecustomize.py").write_text(runner_hook(STEP_LOG_HOOK))
    steps = hook / "steps.log"
    env = {"PYTHONPATH": os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]),
           "VLLM_METAL_TEST_STEP_LOG": str(steps)}
    s = Server(smollm2_gguf(), "smollm2", SERVER_ARGS, env=env)
    s.step_log = steps
    s.reference = s.complete(REFERENCE_PROMPT, max_tokens=6)["choices"][0]["text"]
    yield s
    s.stop()


def assert_serves_normally(server) -> None:
    r = server.complete(REFERENCE_PROMPT, max_tokens=6)
    assert r["status"] == 200, r
    assert r["choices"][0]["text"] == server.reference


def metrics(server) -> dict[str, float]:
    """vllm: gauges and counters, label sets summed (finished_reason kept apart)."""
    out: dict[str, float] = {}
    for line in server.client.get("/metrics").text.splitlines():
        if not line.startswith("vllm:") or "_bucket" in line:
            continue
        name, value = line.rsplit(" ", 1)
        key = name.split("{")[0]
        if key == "vllm:request_success_total":
            key += ":" + name.split('finished_reason="')[1].split('"')[0]
        out[key] = out.get(key, 0.0) + float(value)
    return out


def wait_idle(server, timeout=60.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if (m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
                and m["vllm:kv_cache_usage_perc"] == 0):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"not idle after {timeout} s: running "
                                 f"{m['vllm:num_requests_running']}, waiting "
                                 f"{m['vllm:num_requests_waiting']}, KV usage {m['vllm:kv_cache_usage_perc']}")
        time.sleep(0.25)


# ---- 1. hostile input -------------------------------------------------------------------

CMP, CHAT = "/v1/completions", "/v1/chat/completions"
WRONG = {"a": [1]}  # an object where a scalar or a list belongs


def cmp(**kw):
    return {"model": "smollm2", "prompt": "Hi", "max_tokens": 2, **kw}


def chat(**kw):
    return {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **kw}


def raw(text: str) -> bytes:
    return text.encode()


BASE_RAW = '{"model": "smollm2", "prompt": "Hi", "max_tokens": 2, %s}'
# (id, path, body: dict -> JSON, bytes -> sent as is, expected status, a fragment of the error)
HOSTILE = [
    ("malformed-json", CMP, b'{"model": "smollm2", "prompt": ', 400, "JSON"),
    ("body-is-a-list", CMP, b"[1, 2]", 400, "dictionary"),
    ("body-is-a-string", CHAT, b'"hi"', 400, "dictionary"),
    ("body-is-null", CMP, b"null", 400, "required"),
    ("empty-body", CMP, b"", 400, "required"),
    ("invalid-utf8", CMP, b'{"model": "smollm2", "prompt": "\xff\xfe\xc3", "max_tokens": 2}', 400, ""),
    ("invalid-utf8-chat", CHAT,
     b'{"model": "smollm2", "messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, ""),
    ("lone-surrogate", CMP, raw(BASE_RAW % '"suffix": null, "echo": false, "n": 1').replace(
        b'"Hi"', b'"a\\ud800b"'), 400, ""),
    ("lone-surrogate-chat", CHAT, raw(json.dumps(chat())).replace(b'"Hi"', b'"a\\udfffb"'), 400, ""),
    ("json-nested-100000-deep", CMP,
     b'{"model": "smollm2", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, ""),
    ("chat-content-nested-5000-deep", CHAT, raw(json.dumps(chat())).replace(
        b'"Hi"', b"[" * 5000 + b"]" * 5000), 400, ""),
    ("chat-content-part-nested", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": [{"type": "text", "text": "x"}]}]}]), 400, "text"),
    ("chat-content-part-unknown-type", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "banana", "x": 1}]}]), 400, ""),
    ("temperature-NaN", CMP, raw(BASE_RAW % '"temperature": NaN'), 400, "temperature"),
    ("temperature-Infinity", CMP, raw(BASE_RAW % '"temperature": Infinity'), 400, "temperature"),
    ("top_p-NaN", CMP, raw(BASE_RAW % '"top_p": NaN'), 400, "top_p"),
    ("min_p-NaN", CMP, raw(BASE_RAW % '"min_p": NaN'), 400, "min_p"),
    ("presence_penalty-NaN", CMP, raw(BASE_RAW % '"presence_penalty": NaN'), 400, "presence_penalty"),
    ("repetition_penalty-Infinity", CMP, raw(BASE_RAW % '"repetition_penalty": Infinity'), 400,
     "repetition_penalty"),
    ("max_tokens=-1", CMP, cmp(max_tokens=-1), 400, "max_tokens"),
    ("max_tokens=0", CMP, cmp(max_tokens=0), 400, "max_tokens"),
    ("max_tokens=1e12", CMP, cmp(max_tokens=10**12), 400, "max_tokens"),
    ("max_tokens=2**63", CMP, cmp(max_tokens=2**63), 400, "max_tokens"),
    ("max_completion_tokens=-1", CHAT, chat(max_completion_tokens=-1), 400, "max_tokens"),
    ("n=0", CMP, cmp(n=0), 400, "n must"),
    ("n=-1", CHAT, chat(n=-1), 400, "n must"),
    ("n=1e6", CMP, cmp(n=10**6), 400, "n must"),
    ("n=2**63", CMP, cmp(n=2**63), 400, "n must"),
    ("logprobs=-1", CMP, cmp(logprobs=-1), 400, "logprobs"),
    ("logprobs=1e6", CMP, cmp(logprobs=10**6), 400, "logprobs"),
    ("top_logprobs=21", CHAT, chat(logprobs=True, top_logprobs=21), 400, "logprobs"),
    ("prompt_logprobs=1e6", CMP, cmp(prompt_logprobs=10**6), 400, "logprobs"),
    ("top_k=-5", CMP, cmp(top_k=-5), 400, "top_k"),
    ("min_tokens>max_tokens", CMP, cmp(min_tokens=10**9), 400, "min_tokens"),
    ("seed=2**64", CMP, cmp(seed=2**64), 400, "seed"),
    ("prompt-token-out-of-vocab", CMP, cmp(prompt=[10**7]), 400, "vocab"),
    ("prompt-token-2**40", CMP, cmp(prompt=[2**40]), 400, "vocab"),
    ("prompt-token-negative", CMP, cmp(prompt=[-1]), 400, "prompt"),
    ("logit_bias-out-of-vocab", CMP, cmp(logit_bias={"10000000": 5}), 400, "logit_bias"),
    ("logit_bias-negative-id", CHAT, chat(logit_bias={"-1": 5}), 400, "logit_bias"),
    ("logit_bias-not-an-id", CMP, cmp(logit_bias={"abc": 5}), 400, "logit_bias"),
    ("stop_token_ids-out-of-vocab", CMP, cmp(stop_token_ids=[10**7]), 400, "stop_token_ids"),
    ("stop_token_ids-negative", CMP, cmp(stop_token_ids=[-1]), 400, "stop_token_ids"),
    ("allowed_token_ids-out-of-vocab", CMP, cmp(allowed_token_ids=[10**7]), 400, "allowed_token_ids"),
    ("allowed_token_ids-empty", CMP, cmp(allowed_token_ids=[]), 400, "allowed_token_ids"),
    ("empty-prompt", CMP, cmp(prompt=""), 400, "prompt"),
    ("empty-prompt-list", CMP, cmp(prompt=[]), 400, "prompt"),
    ("empty-token-prompt", CMP, cmp(prompt=[[]]), 400, "empty"),
    ("empty-messages", CHAT, chat(messages=[]), 400, "empty"),
    ("role-not-a-string", CHAT, chat(messages=[{"role": 5, "content": "hi"}]), 400, "role"),
    ("unknown-model", CMP, cmp(model="nope"), 404, "nope"),
    ("unknown-model-chat", CHAT, chat(model="nope"), 404, "nope"),
    ("prompt-at-max_model_len", CMP, cmp(prompt=[1] * MAX_MODEL_LEN, max_tokens=1), 400, "max_tokens"),
    ("prompt-one-over-max_model_len", CMP, {"model": "smollm2", "prompt": [1] * (MAX_MODEL_LEN + 1)},
     400, "context length"),
    ("prompt-100000-tokens", CMP, cmp(prompt=[1] * 100_000), 400, "context length"),
    ("prompt-1.2M-characters", CMP, cmp(prompt="hello " * 200_000), 400, "context length"),
    ("10000-prompts", CMP, cmp(prompt=["hi"] * 10_000, max_tokens=1), 400, "prompt"),
    ("1000-stop-strings", CMP, cmp(stop=[f"s{i}" for i in range(1000)]), 400, "stop"),
    ("1000-stop-strings-chat", CHAT, chat(stop=["x" * 1000 + str(i) for i in range(1000)]), 400, "stop"),
    ("image-for-a-text-model", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1:1/x.png"}}]}]), 400, "multimodal"),
    ("invalid-json-schema", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "bogus"}}}), 400, ""),
    ("invalid-regex", CMP, cmp(structured_outputs={"regex": "(((("}), 400, "regex"),
    ("tool-choice-names-no-tool", CHAT, chat(
        tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        tool_choice={"type": "function", "function": {"name": "g"}}), 400, "tool"),
    ("untrusted-chat-template", CHAT, chat(chat_template="{% for i in range(10**9) %}x{% endfor %}"),
     400, "chat template"),
    ("chat_template_kwargs-clash", CHAT, chat(chat_template_kwargs={"messages": 5}), 400, "messages"),
    ("stream_options-without-stream", CMP, cmp(stream_options={"include_usage": True}), 400, "stream"),
]
# a wrong type for every field of each endpoint (bool, int, float, str, list and object fields)
for _f in ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed",
           "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
           "logit_bias", "stop_token_ids", "stream", "echo", "min_p", "ignore_eos", "prompt_logprobs",
           "response_format", "allowed_token_ids", "bad_words", "suffix", "user", "priority",
           "skip_special_tokens", "truncate_prompt_tokens", "include_stop_str_in_output",
           "return_token_ids", "structured_outputs"]:
    HOSTILE.append((f"wrong-type-{_f}", CMP, cmp(**{_f: WRONG}), 400, ""))
for _f in ["messages", "max_tokens", "max_completion_tokens", "temperature", "n", "stop", "tools",
           "tool_choice", "logprobs", "top_logprobs", "response_format", "seed", "chat_template",
           "add_generation_prompt", "continue_final_message", "documents", "parallel_tool_calls",
           "reasoning_effort", "stream"]:
    HOSTILE.append((f"chat-wrong-type-{_f}", CHAT, chat(**{_f: WRONG}), 400, ""))


@pytest.mark.parametrize("path, body, status, fragment", [h[1:] for h in HOSTILE],
                         ids=[h[0] for h in HOSTILE])
def test_hostile_request_gets_a_4xx_and_the_server_serves_on(server, path, body, status, fragment):
    if isinstance(body, bytes):
        r = server.client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = server.client.post(path, json=body)
    assert r.status_code == status, r.text[:500]
    err = r.json()
    message = err["error"]["message"] if "error" in err else str(err["detail"])
    assert message and fragment.lower() in message.lower(), message[:500]
    assert_serves_normally(server)


@pytest.mark.parametrize("body, check", [
    # accepted edge cases: valid requests, answered correctly
    (cmp(prompt=[1] * (MAX_MODEL_LEN - 1), max_tokens=1), lambda r: r["usage"]["completion_tokens"] == 1),
    (cmp(top_k=10**9, temperature=0), lambda r: r["choices"][0]["finish_reason"] == "length"),
    (cmp(logit_bias={str(i): -100 for i in range(49152) if i != 1000}, return_token_ids=True,
         temperature=1.0, max_tokens=3), lambda r: r["choices"][0]["token_ids"] == [1000] * 3),
    # custom roles are vLLM's feature (CustomChatCompletionMessageParam): the template renders them
    (chat(messages=[{"role": "wizard", "content": "hi"}]), lambda r: r["choices"][0]["message"]),
    (chat(messages=[{"role": "user", "content": ""}]), lambda r: r["choices"][0]["message"]),
    # vLLM's front end clamps logit_bias to [-100, 100] (NaN becomes -100) as OpenAI does
    (raw(BASE_RAW.replace('"max_tokens": 2', '"max_tokens": 3') % '"logit_bias": {"1000": Infinity, '
         '"1001": NaN}, "temperature": 1.0, "return_token_ids": true'),
     lambda r: r["choices"][0]["token_ids"] == [1000] * 3),
    (raw(BASE_RAW % '"logit_bias": {"1000": -1e300}, "temperature": 0'),
     lambda r: r["choices"][0]["finish_reason"] == "length"),
], ids=["prompt-one-under-max_model_len", "top_k-1e9", "logit_bias-whole-vocabulary",
        "logit_bias-infinity-and-NaN-clamped", "logit_bias-1e300-clamped",
        "custom-role", "empty-message"])
def test_edge_requests_that_are_valid_are_served(server, body, check):
    if isinstance(body, bytes):
        r = server.client.post(CMP, content=body, headers={"content-type": "application/json"})
    else:
        r = server.client.post(CHAT if "messages" in body else CMP, json=body)
    assert r.status_code == 200, r.text[:500]
    assert check(r.json()), r.json()
    assert_serves_normally(server)


def test_hostile_requests_through_the_openai_client(server):
    import openai

    client = openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0)
    cases = [
        (openai.BadRequestError, lambda: client.completions.create(model="smollm2", prompt="Hi", max_tokens=-1)),
        (openai.BadRequestError, lambda: client.completions.create(model="smollm2", prompt="Hi", n=0)),
        (openai.BadRequestError, lambda: client.completions.create(
            model="smollm2", prompt="Hi", max_tokens=2, logit_bias={"10000000": 1})),
        (openai.BadRequestError, lambda: client.completions.create(
            model="smollm2", prompt="Hi", max_tokens=2, extra_body={"stop_token_ids": [10**7]})),
        (openai.BadRequestError, lambda: client.completions.create(
            model="smollm2", prompt=[1] * (MAX_MODEL_LEN + 1))),
        (openai.BadRequestError, lambda: client.chat.completions.create(
            model="smollm2", messages=[], max_tokens=2)),
        (openai.BadRequestError, lambda: client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Hi"}], logprobs=True, top_logprobs=50)),
        (openai.BadRequestError, lambda: list(client.chat.completions.create(  # refused before streaming
            model="smollm2", messages=[{"role": "user", "content": "Hi"}], stream=True, max_tokens=-3))),
        (openai.NotFoundError, lambda: client.chat.completions.create(
            model="gpt-4", messages=[{"role": "user", "content": "Hi"}])),
    ]
    for error, call in cases:
        with pytest.raises(error) as e:
            call()
        assert e.value.status_code < 500 and e.value.message
    text = client.completions.create(model="smollm2", prompt=REFERENCE_PROMPT, max_tokens=6,
                                     temperature=0).choices[0].text
    assert text == server.reference


# ---- 2. clients that vanish -------------------------------------------------------------

LONG_PROMPT = "Describe the history of the Roman empire in detail, with dates. " * 30  # ~400 tokens


async def _drop_after_first_chunk(client, i):
    async with client.stream("POST", CMP, json={
            "model": "smollm2", "prompt": f"Story {i}: once upon a time", "max_tokens": 400,
            "ignore_eos": True, "stream": True}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                return True  # leaving the block closes the connection


async def _drop_during_prefill(client, i):
    try:
        await asyncio.wait_for(client.post(CMP, json={
            "model": "smollm2", "prompt": f"{i} " + LONG_PROMPT, "max_tokens": 50}), timeout=0.3)
    except asyncio.TimeoutError:
        return True  # cancelled: httpx closes the connection


async def _drop_while_queued(client, i, after):
    try:
        await asyncio.wait_for(client.post(CMP, json={
            "model": "smollm2", "prompt": f"Item {i}:", "max_tokens": 300, "ignore_eos": True}),
            timeout=after)
    except asyncio.TimeoutError:
        return True


async def _vanish(base: str):
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as client:
        await asyncio.gather(*(_drop_after_first_chunk(client, i) for i in range(32)))
        await asyncio.gather(*(_drop_during_prefill(client, i) for i in range(32)))
        # 64 at once with 32 rows: half wait in the queue when they are dropped
        await asyncio.gather(*(_drop_while_queued(client, i, 1.5) for i in range(64)))


def test_vanished_clients_are_aborted_and_their_blocks_freed(server):
    before = wait_idle(server)
    asyncio.run(_vanish(server.base))
    after = wait_idle(server, timeout=60)
    completed = sum(after[k] - before[k] for k in after if k.startswith("vllm:request_success_total:")
                    and not k.endswith("abort"))
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    # a request the engine ran to its end would count as finished (length) even with its
    # client gone: none did, so every one was aborted in the engine (or never reached it),
    # and far fewer tokens came out than were asked for
    assert completed == 0, {k: v - before[k] for k, v in after.items() if "success" in k}
    assert generated < 0.25 * (32 * 400 + 32 * 50 + 64 * 300), generated
    print(f"vanished clients: 128 dropped, {generated:.0f} tokens generated of "
          f"{32 * 400 + 32 * 50 + 64 * 300} asked; running, waiting and KV usage back to 0")
    assert_serves_normally(server)


# ---- 3. soak ----------------------------------------------------------------------------

def soak_size() -> tuple[int, int]:
    return (2000, 64) if os.environ.get("VLLM_METAL_SOAK") == "full" else (96, 32)


def tree_rss(pid: int) -> int:
    p = psutil.Process(pid)
    procs = [p, *p.children(recursive=True)]
    total = 0
    for q in procs:
        try:
            total += q.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


WORDS = "the a river city light stone music number garden window ocean paper".split()


def soak_job(rng: random.Random, i: int) -> dict:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.choice([3, 20, 60, 150])))
    kw = {"max_tokens": rng.choice([1, 8, 32, 64]), "ignore_eos": True}
    kind = rng.random()
    if kind < 0.3:
        kw.update(temperature=0)
    elif kind < 0.6:
        kw.update(temperature=0.8, top_p=0.9, top_k=40, seed=i)
    elif kind < 0.8:
        kw.update(temperature=1.0, min_p=0.05, presence_penalty=0.5, repetition_penalty=1.1)
    else:
        kw.update(temperature=0.7, logprobs=2, stop=["river city"])
    return {"prompt": prompt, **kw}


async def _soak_one(client, job, stream, drop, results):
    body = {"model": "smollm2", **job, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if drop:
        try:
            await asyncio.wait_for(client.post(CMP, json={**body, "stream": False}),
                                   timeout=random.uniform(0.05, 1.0))
            results.append(("done-before-drop", job, None))
        except asyncio.TimeoutError:
            results.append(("dropped", job, None))
        return
    if not stream:
        r = await client.post(CMP, json=body)
        assert r.status_code == 200, r.text
        j = r.json()
        results.append(("ok", job, (j["usage"]["completion_tokens"], j["choices"][0]["finish_reason"])))
        return
    finish, usage, chunks = None, None, 0
    async with client.stream("POST", CMP, json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if d.get("usage"):
                usage = d["usage"]["completion_tokens"]
            for c in d["choices"]:
                chunks += 1
                finish = c.get("finish_reason") or finish
    results.append(("ok", job, (usage, finish)))


async def _soak(base, jobs, concurrency, results, progress):
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency)
    sem = asyncio.Semaphore(concurrency)
    rng = random.Random(7)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:
        async def one(i, job):
            async with sem:
                await _soak_one(client, job, rng.random() < 0.5, rng.random() < 0.1, results)
                progress.append(time.monotonic())
        await asyncio.gather(*(one(i, j) for i, j in enumerate(jobs)))


def test_soak_loses_nothing_leaks_nothing_and_never_stalls(server, record_property):
    n, concurrency = soak_size()
    rng = random.Random(1)
    jobs = [soak_job(rng, i) for i in range(n)]
    wait_idle(server)
    before = metrics(server)
    server.step_log.write_text("")
    results, progress, rss = [], [], []
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            rss.append((time.monotonic(), tree_rss(server.proc.pid)))
            stop.wait(0.5)

    sampler = threading.Thread(target=sample)
    start = time.monotonic()
    sampler.start()
    try:
        asyncio.run(_soak(server.base, jobs, concurrency, results, progress))
    finally:
        stop.set()
        sampler.join()
    elapsed = time.monotonic() - start
    after = wait_idle(server)

    # nothing lost or truncated: every finished response has its token count and finish reason
    done = [r for r in results if r[0] == "ok"]
    assert len(results) == n
    for _, job, (tokens, finish) in done:
        assert finish in ("length", "stop"), (job, tokens, finish)
        if finish == "length":
            assert tokens == job["max_tokens"], (job, tokens)
        else:
            assert "stop" in job and tokens <= job["max_tokens"], (job, tokens)
    completed = sum(after[k] - before[k] for k in after if k.startswith("vllm:request_success_total:")
                    and not k.endswith("abort"))
    assert completed >= len(done)  # the engine finished at least every request answered
    # RSS of the process tree: last quarter against the first, by time
    t0, t1 = rss[0][0], rss[-1][0]
    q = (t1 - t0) / 4
    first = statistics.mean(v for t, v in rss if t <= t0 + q)
    last = statistics.mean(v for t, v in rss if t >= t1 - q)
    growth = (last - first) / first
    # step durations: the gap from a step's start to the next one's under load, against the
    # median step of the same size (a 512-token prefill takes ~8x a decode step here: a
    # stall is a step far slower than its peers, not a big step)
    steps = [tuple(map(float, line.split())) for line in server.step_log.read_text().splitlines()]
    gaps = [(b[0] - a[0], a[1]) for a, b in zip(steps, steps[1:])]
    size = [(1, 32), (33, 128), (129, 320), (321, 512)]

    def bucket(tokens):
        return next(i for i, (lo, hi) in enumerate(size) if lo <= tokens <= hi)

    medians = {i: statistics.median([g for g, n in gaps if bucket(n) == i])
               for i in {bucket(n) for _, n in gaps}}
    ratios = [g / medians[bucket(n)] for g, n in gaps]
    worst_ratio = max(ratios)
    median = statistics.median(g for g, _ in gaps)
    worst = max(g for g, _ in gaps)
    figures = dict(requests=n, concurrency=concurrency, completed=len(done),
                   dropped=sum(r[0] == "dropped" for r in results), lost=0, seconds=round(elapsed, 1),
                   rss_first_mib=round(first / 2**20), rss_last_mib=round(last / 2**20),
                   rss_growth_pct=round(100 * growth, 2), steps=len(steps),
                   median_step_ms=round(1000 * median, 1), worst_step_ms=round(1000 * worst, 1),
                   median_step_ms_by_size={f"{size[i][0]}-{size[i][1]}": round(1000 * m, 1)
                                           for i, m in sorted(medians.items())},
                   worst_step_ratio_same_size=round(worst_ratio, 2),
                   worst_step_ratio_any_size=round(worst / median, 1))
    print("soak figures:", json.dumps(figures))
    record_property("soak", figures)
    assert growth < 0.05, figures
    assert worst_ratio < 10, figures
    assert_serves_normally(server)


# ---- 5. chat-input fuzzer through the server's preprocessing ---------------------------

def _tokenizer():
    from transformers import AutoTokenizer

    from vllm_metal.models import prepare_gguf_dir

    return AutoTokenizer.from_pretrained(prepare_gguf_dir(smollm2_gguf()))


def _check_chat_input(server, tokenizer, messages) -> None:
    """/tokenize renders the chat template and tokenizes in the server: a 4xx or the tokens
    the HF tokenizer gives for the same template, never a 5xx."""
    body = json.dumps({"model": "smollm2", "messages": messages}, ensure_ascii=True).encode()
    r = server.client.post("/tokenize", content=body, headers={"content-type": "application/json"})
    assert r.status_code < 500, (messages, r.text[:500])
    if r.status_code != 200:
        assert r.json()["error"]["message"]
        return
    # vLLM hands a "string"-format template (SmolLM2's) a part list as its non-empty texts
    # joined by "\n"
    flat = [{**m, "content": "\n".join(p["text"] for p in m["content"] if p["text"])}
            if isinstance(m["content"], list) else m for m in messages]
    try:
        want = tokenizer.apply_chat_template(flat, tokenize=True, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - the server accepted what the reference cannot render
        raise AssertionError(f"the server rendered what HF rejects: {messages!r}")
    if hasattr(want, "keys"):  # a BatchEncoding
        want = want["input_ids"]
    assert r.json()["tokens"] == list(want), messages


def _save_crash(messages) -> Path:
    CHAT_CORPUS.mkdir(parents=True, exist_ok=True)
    path = CHAT_CORPUS / f"crash-{abs(hash(json.dumps(messages))):x}.json"
    path.write_text(json.dumps(messages))
    return path


def test_chat_fuzz_corpus_replays(server):
    tokenizer = _tokenizer()
    files = sorted(CHAT_CORPUS.glob("*.json"))
    assert files
    for p in files:
        _check_chat_input(server, tokenizer, json.loads(p.read_text()))
    assert_serves_normally(server)


def test_chat_fuzzer_random_messages(server):
    """Random roles, unicode (surrogates, controls, NUL, RTL, emoji, template syntax) and
    part lists as messages; a failing input is kept in tests/fuzz_corpus/chat."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    tokenizer = _tokenizer()
    text = st.one_of(
        st.text(max_size=200),
        st.text(alphabet=st.sampled_from(list("{}%#<>|\\\"'\n\r\t\x00\u202e\ufeff\U0001f600"
                                              "<|im_start|><|im_end|>")), max_size=60),
        st.binary(max_size=100).map(lambda b: b.decode("utf-8", "replace")),
        st.binary(max_size=60).map(lambda b: b.decode("latin-1")))
    # not "developer": vLLM rewrites it to a merged system message for templates without it
    role = st.sampled_from(["user", "assistant", "system", "tool", "wizard", ""])
    content = st.one_of(text, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}),
                                       max_size=3))
    message = st.fixed_dictionaries({"role": role, "content": content})
    executions = int(os.environ.get("VLLM_METAL_CHAT_FUZZ_EXAMPLES", "150"))

    failing = []

    @settings(max_examples=executions, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(message, min_size=1, max_size=4))
    def run(messages):
        try:
            _check_chat_input(server, tokenizer, messages)
        except AssertionError:
            failing.append(messages)  # Hypothesis runs the shrunk example last
            raise

    try:
        run()
    except AssertionError as e:
        raise AssertionError(f"kept as {_save_crash(failing[-1])}: {e}") from None
    # and a few through generation (the same preprocessing, then the engine)
    rng = random.Random(3)
    for _ in range(5):
        junk = bytes(rng.randrange(256) for _ in range(40)).decode("utf-8", "replace")
        r = server.client.post(CHAT, json=chat(messages=[{"role": "user", "content": junk}]))
        assert r.status_code == 200, r.text[:300]
    assert_serves_normally(server)


# ---- 4. SIGTERM under load (last: it stops the module's server) ------------------------

def test_sigterm_under_load_drains_then_exits_leaving_no_child(server):
    """--shutdown-timeout 20: in-flight requests finish, new ones get a 503 or find the
    port closed, and the whole process tree is gone."""
    children = psutil.Process(server.proc.pid).children(recursive=True)
    assert children  # the engine core process
    results = []

    def one(i):
        try:
            r = httpx.post(f"{server.base}{CMP}", timeout=60, json={
                "model": "smollm2", "prompt": f"Count {i}:", "max_tokens": 40, "ignore_eos": True})
            results.append((r.status_code, r.json()))
        except httpx.HTTPError as e:
            results.append(("error", repr(e)))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while metrics(server)["vllm:num_requests_running"] < 16 and time.monotonic() < deadline:
        time.sleep(0.05)
    sent = time.monotonic()
    os.kill(server.proc.pid, signal.SIGTERM)  # the API server only, as a process manager does
    late = []
    for _ in range(20):
        try:
            late.append(httpx.post(f"{server.base}{CMP}", timeout=10, json=cmp()).status_code)
        except httpx.HTTPError:
            late.append("closed")
        time.sleep(0.05)
    for t in threads:
        t.join(60)
    server.proc.wait(timeout=40)
    took = time.monotonic() - sent
    assert took < 20 + 15, took
    assert [r[0] for r in results] == [200] * 16, results
    assert all(r[1]["usage"]["completion_tokens"] == 40 for r in results)
    # refused, never served: a 503 while the engine drains (vllm_metal.drain_refusal; vLLM
    # alone answers 500 there), then a closed connection once uvicorn stops
    assert all(s in (503, "closed") for s in late), late
    assert 503 in late, late
    gone = psutil.wait_procs(children, timeout=10)[1]
    assert not gone, f"left behind: {gone}"
