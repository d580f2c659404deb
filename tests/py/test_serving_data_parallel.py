"""`vllm serve --data-parallel-size 2` (data_parallel.py, docs/distributed.md): vLLM's own
replicas, one engine process each with a Metal worker and its own KV pool, and its DP
coordinator balancing the requests. On loopback, each process standing in for a Mac:
on the two-host (--headless) form, none of 64 concurrent requests lost, both replicas
serving, greedy outputs equal to one replica's; on one host, the memory share split and a
replica killed mid-serve failing the server fast with no process left behind. Three servers
in all (one replica, two "hosts", one host), each started once."""

from __future__ import annotations

import concurrent.futures as cf
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from serving_harness import Server, free_port

pytestmark = [pytest.mark.slow, pytest.mark.serving]

VLLM = str(Path(sys.executable).with_name("vllm"))
ARGS = ["--max-model-len", "256", "--max-num-seqs", "16", "--num-gpu-blocks-override", "128",
        "--max-num-batched-tokens", "256"]
# the same greedy tokens whatever else shares a step: a replica's batch differs from the
# single server's (test_serving_batch_invariance.py)
INVARIANT = {"VLLM_BATCH_INVARIANT": "1"}
PROMPTS = [f"Write the number {i} in words, then count from {i} to {i + 3}:" for i in range(64)]
MAX_TOKENS = 8
FULL_ANSWER = 230  # the killed-replica test's requests: a prompt of ~17 tokens + 230 < 256


def smollm2_gguf() -> str:
    from vllm_metal.models.offline import OFFLINE_GGUF

    return str(OFFLINE_GGUF["smollm2"]())


def complete_all(server: Server, prompts: list[str]) -> list[dict]:
    """The prompts sent at once (one thread each); every response, in prompt order."""
    def one(prompt):
        r = httpx.post(f"{server.base}/v1/completions", timeout=300, json={
            "model": server.name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
        return {"status": r.status_code, **r.json()}

    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def successes_per_engine(server: Server) -> dict[str, float]:
    """vllm:request_success_total summed per engine label (the replica index), from /metrics."""
    counts: dict[str, float] = {}
    for line in server.client.get("/metrics").text.splitlines():
        m = re.match(r'vllm:request_success_total\{(.*)\} ([0-9.e+]+)$', line)
        if m:
            engine = re.search(r'engine="(\d+)"', m.group(1)).group(1)
            counts[engine] = counts.get(engine, 0.0) + float(m.group(2))
    return counts


def texts(responses: list[dict]) -> list[str]:
    return [r["choices"][0]["text"] for r in responses]


@pytest.fixture(scope="module")
def reference():
    """One replica's greedy outputs for PROMPTS (its server stopped before the DP one starts:
    the two cores are not shared between them)."""
    s = Server(smollm2_gguf(), "smollm2", ARGS, env=INVARIANT)
    try:
        responses = complete_all(s, PROMPTS)
    finally:
        s.stop()
    assert all(r["status"] == 200 for r in responses), responses
    return texts(responses)


def test_two_hosts_on_loopback_64_concurrent_requests_none_lost_both_replicas_serve(reference):
    """The 2-Mac form of docs/distributed.md on loopback: a headless process holds replica 1,
    the API server's process replica 0. 64 concurrent requests: none lost, each replica takes
    a real part (the DP coordinator balances), outputs equal one replica's; each replica,
    alone on its "host", budgets the whole --gpu-memory-utilization."""
    rpc_port = free_port()  # where the API server's host waits for the replicas' handshake
    common = [*ARGS, "--data-parallel-size", "2", "--data-parallel-size-local", "1",
              "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(rpc_port),
              "--gpu-memory-utilization", "0.5"]
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"vllm-metal-serve-headless-{rpc_port}.log"
    with open(log_path, "w") as log:
        headless = subprocess.Popen(
            [VLLM, "serve", smollm2_gguf(), "--headless", "--data-parallel-start-rank", "1", *common],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={"VLLM_WORKER_MULTIPROC_METHOD": "fork", **os.environ, **INVARIANT})
    try:
        front = Server(smollm2_gguf(), "smollm2", common, env=INVARIANT)
        try:
            before = successes_per_engine(front)
            responses = complete_all(front, PROMPTS)
            assert [r["status"] for r in responses] == [200] * len(PROMPTS), responses
            assert all(r["usage"]["completion_tokens"] == MAX_TOKENS for r in responses)
            assert texts(responses) == reference
            after = successes_per_engine(front)
            served = {e: after[e] - before.get(e, 0.0) for e in after}
            assert set(served) == {"0", "1"}, served
            assert sum(served.values()) == len(PROMPTS), served
            # the coordinator balances: each replica takes a real part, not a stray request
            assert min(served.values()) >= len(PROMPTS) // 8, served
            budgets = kv_budgets(Path(front.log_path).read_text() + log_path.read_text())
            assert budgets == [("EngineCore_DP0", "0.5"), ("EngineCore_DP1", "0.5")], budgets
        finally:
            front.stop()
        # vLLM keeps a headless host's engines up when the API server goes; its operator
        # stops them: SIGTERM ends the engine and the process, nothing left behind
        children = psutil.Process(headless.pid).children(recursive=True)
        assert any("EngineCore_DP1" in p.name() for p in children), [p.name() for p in children]
        headless.terminate()
        assert headless.wait(timeout=60) is not None
        assert not psutil.wait_procs(children, timeout=15)[1], "a headless process was left behind"
    finally:
        if headless.poll() is None:
            os.killpg(headless.pid, 9)
            headless.wait()


def kv_budgets(log: str) -> list[tuple[str, str]]:
    """(replica, the --gpu-memory-utilization its worker cut its KV budget from), sorted,
    from the workers' startup summaries."""
    return sorted(re.findall(r"\((EngineCore_DP\d) pid=\d+\).*KV cache .* from a budget of .*"
                             r"--gpu-memory-utilization ([0-9.]+) of", log))


def test_a_replica_killed_mid_serve_fails_the_server_fast_and_leaves_no_process():
    """One host, `--data-parallel-size 2`: each replica's worker budgets half the memory
    share. Then SIGKILL of replica 1's engine with requests in flight on both replicas: the requests
    on replica 1 get an error, those on replica 0 end unfinished (vLLM aborts them as it
    shuts down), no request claims a full answer, the server exits by itself within a bounded
    time and no engine, coordinator or API-server process is left. Forked engines (the
    harness's Linux default): worker.py drops the API server's signal wakeup fd they inherit
    (docs/distributed.md)."""
    s = Server(smollm2_gguf(), "smollm2", [*ARGS, "--data-parallel-size", "2",
                                            "--gpu-memory-utilization", "0.5"])
    try:
        # two replicas on one host split its share: each worker budgets 0.25 of the memory
        budgets = kv_budgets(Path(s.log_path).read_text())
        assert budgets == [("EngineCore_DP0", "0.25"), ("EngineCore_DP1", "0.25")], budgets
        children = psutil.Process(s.proc.pid).children(recursive=True)
        victim = [p for p in children if "EngineCore_DP1" in p.name()]
        assert len(victim) == 1, [p.name() for p in children]
        results: dict[int, tuple] = {}
        decoding = threading.Event()  # a streamed request has its first tokens

        def one(i):
            # as many tokens as --max-model-len leaves: none can finish before the kill, however
            # fast the machine
            body = {"model": "smollm2", "prompt": PROMPTS[i], "max_tokens": FULL_ANSWER,
                    "ignore_eos": True, "temperature": 0, "stream": i % 2 == 1}
            try:
                with httpx.stream("POST", f"{s.base}/v1/completions", json=body, timeout=120) as r:
                    lines = []
                    for line in r.iter_lines():
                        lines.append(line)
                        if line.startswith("data: {"):
                            decoding.set()
                    results[i] = (r.status_code, "".join(lines))
            except httpx.HTTPError as e:
                results[i] = ("closed", repr(e))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        assert decoding.wait(60), "no request started decoding"
        time.sleep(0.5)  # both replicas mid-decode
        victim[0].kill()
        killed = time.monotonic()
        s.proc.wait(timeout=60)
        assert time.monotonic() - killed < 60
        for t in threads:
            t.join(30)
        assert len(results) == 8, results
        errors = 0
        for status, text in results.values():
            assert f'"completion_tokens":{FULL_ANSWER}' not in text.replace(" ", ""), text[-300:]
            errors += status == "closed" or status >= 500 or '"error"' in text
        assert errors >= 1, results
        assert "EngineCore_DP1 died unexpectedly" in Path(s.log_path).read_text() or \
            "engine core exited unexpectedly" in Path(s.log_path).read_text()
        assert not psutil.wait_procs(children, timeout=15)[1], "a process was left behind"
    finally:
        s.stop()
