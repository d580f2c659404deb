"""Custom logits processors (`--logits-processors`) through `vllm serve` on the offline
SmolLM2 model: vLLM's V2 interface with the V2 runner contract (the default) and its V1
interface with VLLM_USE_V2_MODEL_RUNNER=0 (the interface vLLM's front end loads under
each), async scheduling (the default) and sync.

The processors are tests/py/sample_logits_processors.py, on the server's PYTHONPATH:
ForceToken(V2) makes a request with vllm_xargs {"force_token": id} produce only that id;
ForceTokenV2 with {"repeat_last": 1} repeats the last committed token it reads from the
request state; KeepTop (V1) makes a random request with {"keep_top": 1} draw what greedy
picks. Requests without arguments must give what they give alone.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
from pathlib import Path

import pytest

from serving_harness import Server
from test_serving import PROMPTS, smollm2_gguf

pytestmark = [pytest.mark.slow, pytest.mark.serving]

HERE = Path(__file__).resolve().parent
FORCED = 3681  # any id of the vocabulary


CONTRACTS = {  # runner contract -> (env, the processors vLLM's front end loads there)
    "v2": ({}, ["sample_logits_processors:ForceTokenV2"]),
    "v1": ({"VLLM_USE_V2_MODEL_RUNNER": "0"},
           ["sample_logits_processors:ForceToken", "sample_logits_processors:KeepTop"]),
}


@pytest.fixture(scope="module", params=["v2-async", "v2-sync", "v1-async", "v1-sync"])
def server(request):
    contract, mode = request.param.split("-")
    env, procs = CONTRACTS[contract]
    extra = [] if mode == "async" else ["--no-async-scheduling"]
    path = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    # batch-invariant: "the others are untouched" compares batched tokens with solo ones, which
    # only that mode promises (without it a near-tie may flip with the batch's composition)
    s = Server(smollm2_gguf(), "smollm2",
               ["--max-model-len", "512", "--max-num-seqs", "8", "--num-gpu-blocks-override", "128",
                "--logits-processors", *procs] + extra,
               env={**env, "PYTHONPATH": path, "VLLM_BATCH_INVARIANT": "1"})
    s.contract = contract
    yield s
    s.stop()


def _ids(server, prompt, **kw) -> list[int]:
    r = server.complete(prompt, max_tokens=6, logprobs=0, return_tokens_as_token_ids=True, **kw)
    assert r["status"] == 200, r
    return [int(t.split(":")[1]) for t in r["choices"][0]["logprobs"]["tokens"]]


def test_a_forced_request_gets_its_token_and_the_others_are_untouched(server):
    alone = [_ids(server, p) for p in PROMPTS[:4]]
    jobs = [(p, {}) for p in PROMPTS[:4]] + [(p, {"vllm_xargs": {"force_token": FORCED}})
                                             for p in PROMPTS[:4]]
    with cf.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda j: _ids(server, j[0], **j[1]), jobs))
    assert got[:4] == alone
    assert got[4:] == [[FORCED] * 6] * 4


def test_a_v2_processor_reads_the_request_state(server):
    if server.contract != "v2":
        pytest.skip("ForceTokenV2 is loaded with the V2 contract")
    last = server.client.post("/tokenize", json={"model": server.name,
                                                 "prompt": PROMPTS[1]}).json()["tokens"][-1]
    got = _ids(server, PROMPTS[1], vllm_xargs={"repeat_last": 1})
    assert got == [last] * 6  # each step forces the last committed token


def test_an_argmax_invariant_processor_runs_on_random_rows(server):
    if server.contract != "v1":
        pytest.skip("V2's interface has no argmax invariance")
    greedy = _ids(server, PROMPTS[3])
    kept = _ids(server, PROMPTS[3], temperature=1.5, seed=7, vllm_xargs={"keep_top": 1})
    free = [_ids(server, PROMPTS[3], temperature=1.5, seed=s) for s in (7, 8)]
    assert kept == greedy
    assert any(f != greedy for f in free)  # without it, this temperature wanders


def test_bad_processor_arguments_are_a_400_and_the_engine_lives(server):
    r = server.complete(PROMPTS[0], max_tokens=2, vllm_xargs={"force_token": -3})
    assert r["status"] == 400 and "force_token" in r["error"]["message"], r
    assert server.complete(PROMPTS[0], max_tokens=2)["status"] == 200
