"""--tensor-parallel-size 2 served on loopback: two worker processes under vLLM's
multiprocessing executor, the tensors on MLX's ring (mlx_ring.py). Reference: the same
checkpoint served by one process (parallel_reference.py, shared with the pipeline tests);
greedy tokens must match exactly, with n-gram speculation on. One TP server serves the
comparison and then has a worker killed; the two-node form runs sync scheduling, the first server async (vLLM's
default), so both schedulings are compared. A size that does not divide the heads is
refused by the platform before any process starts (test_tensor_parallel.py). The hybrid
Qwen3.5-MoE is compared with mlx-lm's own model on the same checkpoint."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import psutil
import pytest

from parallel_reference import (ARGS, SYNC, assert_same_greedy, one_process_reference, run_jobs,
                                serve_jobs, shared_tiny_llama)
from serving_harness import START_METHOD, Server, free_port

pytestmark = pytest.mark.slow


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
# prompts that repeat themselves: the n-gram proposer drafts from them
REPEATING = [([5, 9, 30] * 8, 20), ([3, 8, 200, 3] * 6, 20), ([40, 41, 42, 43] * 6, 20)]


@pytest.fixture(scope="module")
def tp2():
    """TP=2 with async scheduling and n-gram speculation; the last test of the module kills
    one of its workers."""
    server = Server(str(shared_tiny_llama()), "tiny", ARGS + [
        "--tensor-parallel-size", "2", "--speculative-config", json.dumps(NGRAM)])
    yield server
    server.stop()


def _metric(server, name: str) -> float:
    m = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", server.client.get("/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


def test_tensor_parallel_greedy_matches_one_process(tp2):
    """Random prompts (few drafts), then repeating ones (drafts kept and rejected): the
    verify steps take rank 0's tokens and kept drafts on both ranks."""
    from vllm_metal.models import load_model
    from vllm_metal.models.generate import greedy_generate

    one = one_process_reference()
    two = run_jobs(tp2)
    log = tp2.log_path.read_text()
    assert "rank 1 joined the MLX ring" in log
    assert "fused layers      no: tensor parallel" in log
    assert "/ 2 workers on this host" in log  # each rank budgets half of the host's memory
    # the all-sum adds the two halves of each projection in another order
    assert_same_greedy(one, two, atol=1e-3)
    model = load_model(str(shared_tiny_llama()), "float32")
    want = [greedy_generate(model, [prompt], n, stop_ids=[])[0] for prompt, n in REPEATING]
    assert [tokens for tokens, _ in run_jobs(tp2, REPEATING)] == want
    drafts = _metric(tp2, "vllm:spec_decode_num_draft_tokens_total")
    accepted = _metric(tp2, "vllm:spec_decode_num_accepted_tokens_total")
    assert 0 < accepted < drafts, (accepted, drafts)


def test_tensor_parallel_hybrid_qwen3_5_moe_matches_mlx_lm(tmp_path):
    """The hybrid Qwen3.5-MoE with each rank holding half the attention heads, half the
    linear-attention heads (and their state slots) and half the columns of every expert
    and of the shared expert, concurrent requests with chunked prefills beside decodes,
    async scheduling (vLLM's default), n-gram speculation. (The dense Qwen3.5's MLP split
    is compared rank by rank in test_tensor_parallel_qwen3_5.py.)
    Reference: mlx-lm's own model on the same files, request by request."""
    import numpy as np
    from qwen3_5_checkpoint import greedy, reference_model, write_checkpoint
    from test_tensor_parallel_qwen3_5 import MOE_SHAPE

    checkpoint = write_checkpoint(tmp_path / "qwen3_5_moe", seed=6, config=MOE_SHAPE)
    rng = np.random.default_rng(7)
    jobs = [(rng.integers(3, 320, n).tolist(), m) for n, m in [(5, 12), (45, 8), (20, 10), (33, 6)]]
    # and n-gram drafts on prompts that repeat: rejected drafts take each rank's state back,
    # and under async scheduling no prefix-cache checkpoint lands where they were
    jobs += [(p, 16) for p, _ in REPEATING]
    two, server = serve_jobs(checkpoint, ["--tensor-parallel-size", "2",
                                          "--speculative-config", json.dumps(NGRAM)], jobs=jobs)
    assert "rank 1 joined the MLX ring" in server.log_path.read_text()
    reference = reference_model(checkpoint)
    for (tokens, _), (prompt, n) in zip(two, jobs, strict=True):
        assert tokens == greedy(reference, prompt, n)


def test_two_nodes_as_documented_for_two_macs(tmp_path):
    """docs/distributed.md's two-Mac commands, both "Macs" on this machine: node 0
    serves, node 1 runs headless; each names its ring address. Sync scheduling here."""
    checkpoint = shared_tiny_llama()
    master = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
              "--master-port", str(free_port())] + SYNC

    def node_env() -> dict:
        return {"VLLM_HOST_IP": "127.0.0.1", "VLLM_METAL_RING_ADDRESS": f"127.0.0.1:{free_port()}"}

    vllm = Path(sys.executable).with_name("vllm")
    with open(tmp_path / "node1.log", "w") as log:
        node1 = subprocess.Popen([str(vllm), "serve", str(checkpoint), *ARGS, *master, "--node-rank", "1",
                                  "--headless"], stdout=log, stderr=subprocess.STDOUT,
                                 env={**START_METHOD, **os.environ, **node_env()}, start_new_session=True)
        try:
            two, _ = serve_jobs(checkpoint, master + ["--node-rank", "0"], env=node_env())
        finally:
            os.killpg(node1.pid, signal.SIGTERM)  # a headless node outlives the head node
            try:
                node1.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(node1.pid, signal.SIGKILL)
                node1.wait()
    assert "rank 1 joined the MLX ring" in (tmp_path / "node1.log").read_text()
    assert_same_greedy(one_process_reference(), two, atol=1e-3)


def test_a_worker_killed_mid_serve_stops_the_engine_and_every_worker(tp2):
    """vLLM's executor sees the worker die and shuts the engine down: the other worker
    (blocked in a ring all-sum) and the engine core exit, the streamed request in flight
    ends with an error event (vLLM's EngineDeadError), and the API server exits by itself."""
    server = tp2
    procs = psutil.Process(server.proc.pid).children(recursive=True)
    worker = next(p for p in procs if "Worker_TP1" in " ".join(p.cmdline()) + p.name())
    results, lines, first = [], [], threading.Event()

    def request():  # streamed: the worker is killed once tokens flow
        try:
            with httpx.stream("POST", f"{server.base}/v1/completions", timeout=20, json={
                    "model": "tiny", "prompt": [5, 6, 7], "max_tokens": 120, "ignore_eos": True,
                    "stream": True}) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    first.set()
            results.append((r.status_code, "\n".join(lines)))
        except httpx.HTTPError as e:
            results.append(("closed", repr(e)))
        first.set()

    thread = threading.Thread(target=request)
    thread.start()
    assert first.wait(60)
    worker.send_signal(signal.SIGKILL)
    # within vLLM's own shutdown path: seconds here, once over 30 s in a fresh-clone run
    # of the whole suite on 2 busy cores; a hang would leave them for good
    assert not psutil.wait_procs(procs, timeout=90)[1], "engine or worker left running"
    thread.join(60)
    assert results and results[0][0] == 200, results
    stream = results[0][1]
    assert '"finish_reason":"length"' not in stream
    # the stream is told, not just cut: its last event before [DONE] is an error
    # (vLLM's EngineDeadError, reported as a 500)
    events = [line for line in stream.splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and '"error"' in events[-2], stream[-500:]
    assert '"InternalServerError"' in events[-2] and '"code": 500' in events[-2], events[-2]
    server.proc.wait(timeout=60)  # exits by itself
    assert "died unexpectedly" in server.log_path.read_text()
