"""The promise of docs/serving.md, tested as a user would meet it: with VLLM_BATCH_INVARIANT=1 a
request gets the same tokens and bit-identical logprobs alone and inside any batch.

One `vllm serve` of the offline SmolLM2 model, async scheduling on (the default), chunked
prefill forced by a small token budget, prefix caching on and a KV pool small enough that
crowded compositions preempt (and later recompute) requests. The probes of issue 30 (seeded at
temperature 1.0 over the full vocabulary, with top-p and top-k, and greedy) are sent alone,
then inside random compositions of 1-32 other requests of random lengths, some sharing the
probes' prompts as cached prefixes. One probe's prompt is longer than the token budget, so it
is prefilled in chunks and, after its first run, starts from the prefix cache. A hook in the
server logs the request ids the scheduler preempts, starts from the cache or prefills in
chunks, so the test knows that probes themselves went through each.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import time

import numpy as np
import pytest

from serving_harness import Server, runner_hook

pytestmark = [pytest.mark.slow, pytest.mark.serving]

WORDS = ("river stone market garden winter engine letter window silver music bridge "
         "forest paper candle harbor mountain story morning copper lantern").split()

# a prompt longer than the token budget (96): prefilled in chunks on its first run, and
# later runs take its full blocks from the prefix cache
LONG_PROMPT = "A list of things: " + ", ".join(WORDS * 3) + "."

PROBES = [
    {"prompt": "Once upon a time", "max_tokens": 20, "seed": 1234, "temperature": 1.0},
    {"prompt": "Once upon a time", "max_tokens": 20, "seed": 99, "temperature": 1.0,
     "top_p": 0.9, "top_k": 50},
    {"prompt": "Count from 0 to 5:", "max_tokens": 12, "temperature": 0},
    {"prompt": LONG_PROMPT, "max_tokens": 12, "seed": 7, "temperature": 1.0},
]

# 56 blocks of 16 tokens: a crowded composition does not fit and some requests are preempted
SERVER_ARGS = ["--max-model-len", "512", "--max-num-seqs", "40", "--max-num-batched-tokens", "96",
               "--num-gpu-blocks-override", "56", "--enable-prefix-caching"]


# Logs, per step, the request ids the scheduler preempted, and new requests whose prompt
# starts from the prefix cache or is prefilled in chunks (sitecustomize on PYTHONPATH), so the
# test can tell that the probes themselves went through each.
SCHEDULE_LOG_HOOK = runner_hook(
    """
    import os


    def wrap(execute_model):
        log = open(os.environ["SCHEDULE_LOG"], "a")

        def logged(self, so):
            for rid in so.preempted_req_ids or ():
                log.write("preempted " + rid + "\\n")
            for new in so.scheduled_new_reqs:
                if new.num_computed_tokens > 0:
                    log.write("cached " + new.req_id + "\\n")
                scheduled = so.num_scheduled_tokens.get(new.req_id, 0)
                if new.num_computed_tokens + scheduled < len(new.prompt_token_ids or ()):
                    log.write("chunked " + new.req_id + "\\n")
            log.flush()
            return execute_model(self, so)

        return logged
    """
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from vllm_metal.models.offline import smollm2_gguf

    tmp = tmp_path_factory.mktemp("invariant-server")
    (tmp / "sitecustomize.py").write_text(SCHEDULE_LOG_HOOK)
    env = {"VLLM_BATCH_INVARIANT": "1", "SCHEDULE_LOG": str(tmp / "schedule.log"),
           "PYTHONPATH": os.pathsep.join([str(tmp), os.environ.get("PYTHONPATH", "")])}
    s = Server(str(smollm2_gguf()), "smollm2", SERVER_ARGS, env=env)
    s.schedule_log = tmp / "schedule.log"
    yield s
    s.stop()


def complete(server: Server, body: dict) -> dict:
    r = server.client.post("/v1/completions", json={"model": server.name, "logprobs": 2, **body})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    lp = choice["logprobs"]
    return {"text": choice["text"], "tokens": lp["tokens"], "logprobs": lp["token_logprobs"],
            "top": lp["top_logprobs"], "id": body["id"]}


def same_output(a: dict, b: dict) -> bool:
    return all(a[k] == b[k] for k in ("text", "tokens", "logprobs", "top"))


def random_other(rng: np.random.Generator) -> dict:
    """A request of random length and sampling; a third of them extend a probe's prompt, so
    they hit (or fill) the prefix cache the probes use."""
    words = " ".join(rng.choice(WORDS, size=int(rng.integers(2, 90))))
    prompt = (PROBES[int(rng.integers(0, 3))]["prompt"] + " " + words) if rng.random() < 0.33 else words
    body = {"prompt": prompt, "max_tokens": int(rng.integers(4, 24)),
            "temperature": float(rng.choice([0.0, 0.7, 1.0]))}
    if rng.random() < 0.5:
        body["seed"] = int(rng.integers(0, 2**31))
    if rng.random() < 0.3:  # wide nuclei and large k send these rows down other filter paths
        body["top_p"] = float(rng.choice([0.95, 0.999]))
    if rng.random() < 0.2:
        body["top_k"] = int(rng.choice([5, 5000]))
    return body


def test_probes_are_bit_identical_alone_and_in_random_compositions(server):
    alone = [complete(server, p) for p in PROBES]
    assert alone[0]["tokens"] != alone[1]["tokens"]  # the probes differ among themselves
    rng = np.random.default_rng(2026)
    probe_ids = []
    with cf.ThreadPoolExecutor(max_workers=40) as pool:
        for composition in range(10):
            others = [random_other(rng) for _ in range(int(rng.integers(1, 33)))]
            # the probes arrive amid the others, or last (the newest run first into preemption)
            cut = len(others) // 2 if composition % 2 else len(others)
            jobs = [pool.submit(complete, server, body) for body in others[:cut]]
            probe_jobs = [pool.submit(complete, server, p) for p in PROBES]
            jobs += [pool.submit(complete, server, body) for body in others[cut:]]
            got = [j.result() for j in probe_jobs]
            for j in jobs:
                j.result()
            for p, want, have in zip(PROBES, alone, got):
                where = f"composition {composition} ({len(others)} others), probe {p}"
                assert have["tokens"] == want["tokens"], where
                assert have["logprobs"] == want["logprobs"], where  # bitwise: floats compare exactly
                assert have["top"] == want["top"], where
            probe_ids += [have["id"] for have in got]
        # Preemption takes the newest running request (vLLM's FCFS policy): long requests
        # fill the pool first, the probes start last and are preempted as the others grow.
        long_ones = [{"prompt": " ".join(rng.choice(WORDS, size=30)), "max_tokens": 64,
                      "temperature": 0.0, "ignore_eos": True} for _ in range(14)]
        jobs = [pool.submit(complete, server, body) for body in long_ones]
        time.sleep(1.0)
        got = [j.result() for j in [pool.submit(complete, server, p) for p in PROBES]]
        for j in jobs:
            j.result()
        assert all(same_output(have, want) for have, want in zip(got, alone)), "after preemption"
        probe_ids += [have["id"] for have in got]
    logged = [line.split() for line in server.schedule_log.read_text().splitlines()]
    # the engine's request id extends the response's id
    def probes_that_were(event):
        return [pid for what, rid in logged if what == event for pid in probe_ids if rid.startswith(pid)]
    assert probes_that_were("preempted"), "no probe was preempted: the pool is too large"
    long_ids = probe_ids[3::len(PROBES)]
    # its prompt is prefilled in chunks unless the cache holds most of it (a later run's
    # remainder can fit one step): both happened to it within the compositions
    assert set(probes_that_were("chunked")) & set(long_ids), "the long probe was never chunked"
    assert set(probes_that_were("cached")) & set(long_ids), "the long probe never hit the prefix cache"
    # and alone again, after all that (prefix cache warm, preempted requests recomputed)
    assert all(same_output(a, b) for a, b in zip([complete(server, p) for p in PROBES], alone))
