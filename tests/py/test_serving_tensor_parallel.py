"""--tensor-parallel-size 2 served on loopback: two worker processes under vLLM's
multiprocessing executor, the tensors on MLX's ring (mlx_ring.py). Reference: the same
checkpoint served by one process; greedy tokens must match exactly."""

from __future__ import annotations

import concurrent.futures as cf

import httpx
import numpy as np
import psutil
import pytest

from serving_harness import Server

VOCAB = 320
ARGS = ["--dtype", "float32", "--max-model-len", "128", "--max-num-seqs", "8",
        "--num-gpu-blocks-override", "48", "--max-num-batched-tokens", "32"]
# concurrent requests of different lengths: decodes share steps with chunked prefills
JOBS = [(np.random.default_rng(n).integers(3, VOCAB, n).tolist(), m)
        for n, m in [(3, 12), (41, 8), (17, 10), (29, 6), (8, 14), (60, 9)]]


def tiny_llama(out_dir, **overrides):
    from qwen3_5_checkpoint import write_tokenizer
    from vllm_metal.models.testing import tiny_config, write_random_checkpoint

    cfg = tiny_config("llama", **{**dict(hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                         vocab_size=VOCAB, tie_word_embeddings=False), **overrides})
    out = write_random_checkpoint(cfg, out_dir, seed=3)
    write_tokenizer(out, VOCAB)
    return out


def complete(server, prompt, max_tokens):
    """The greedy tokens of one request and the logprob of each."""
    r = server.client.post("/v1/completions", json={
        "model": server.name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "return_token_ids": True, "ignore_eos": True, "logprobs": 1})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def serve_jobs(checkpoint, extra_args, args=ARGS, jobs=JOBS, env=None):
    """Every job at once on a fresh server; -> [(tokens, logprobs)], the server (stopped).
    Asserts the server leaves no process behind."""
    server = Server(str(checkpoint), "tiny", args + extra_args, env=env)
    procs = [server.proc, *psutil.Process(server.proc.pid).children(recursive=True)]
    try:
        with cf.ThreadPoolExecutor(len(jobs)) as pool:
            return list(pool.map(lambda j: complete(server, *j), jobs)), server
    finally:
        server.stop()
        # the API server, the engine core and every worker are gone
        assert not psutil.wait_procs(procs, timeout=20)[1], "processes left behind"


@pytest.mark.slow
@pytest.mark.parametrize("scheduling", ["--async-scheduling", "--no-async-scheduling"])
def test_tensor_parallel_greedy_matches_one_process(tmp_path, scheduling):
    checkpoint = tiny_llama(tmp_path / "llama")
    one, _ = serve_jobs(checkpoint, [scheduling])
    two, server = serve_jobs(checkpoint, [scheduling, "--tensor-parallel-size", "2"])
    log = server.log_path.read_text()
    assert "rank 1 joined the MLX ring" in log
    assert "fused layers      no: tensor parallel" in log
    for (tokens1, lp1), (tokens2, lp2) in zip(one, two):
        assert tokens2 == tokens1
        # the all-sum adds the two halves of each projection in another order
        np.testing.assert_allclose(lp2, lp1, atol=1e-3)


def refused(checkpoint, extra_args) -> str:
    with pytest.raises(RuntimeError) as e:
        Server(str(checkpoint), "tiny", ARGS + extra_args, startup_timeout=240)
    return str(e.value)


@pytest.mark.slow
def test_heads_the_size_does_not_divide_are_refused(tmp_path):
    checkpoint = tiny_llama(tmp_path / "llama", num_attention_heads=6, num_key_value_heads=3,
                            hidden_size=192)
    assert "--tensor-parallel-size 2 does not divide the model's 3 KV heads" in refused(
        checkpoint, ["--tensor-parallel-size", "2"])


@pytest.mark.slow
def test_two_nodes_as_documented_for_two_macs(tmp_path):
    """docs/distributed.md's two-Mac commands, both "Macs" on this machine: node 0
    serves, node 1 runs headless; each names its ring address."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from serving_harness import START_METHOD, free_port

    checkpoint = tiny_llama(tmp_path / "llama")
    one, _ = serve_jobs(checkpoint, [])
    master = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
              "--master-port", str(free_port())]

    def node_env() -> dict:
        return {"VLLM_HOST_IP": "127.0.0.1", "VLLM_METAL_RING_ADDRESS": f"127.0.0.1:{free_port()}"}

    vllm = Path(sys.executable).with_name("vllm")
    with open(tmp_path / "node1.log", "w") as log:
        node1 = subprocess.Popen([str(vllm), "serve", str(checkpoint), *ARGS, *master, "--node-rank", "1",
                                  "--headless"], stdout=log, stderr=subprocess.STDOUT,
                                 env={**START_METHOD, **os.environ, **node_env()}, start_new_session=True)
        try:
            two, server = serve_jobs(checkpoint, master + ["--node-rank", "0"], env=node_env())
        finally:
            os.killpg(node1.pid, signal.SIGTERM)  # a headless node outlives the head node
            try:
                node1.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(node1.pid, signal.SIGKILL)
                node1.wait()
    assert "rank 1 joined the MLX ring" in (tmp_path / "node1.log").read_text()
    assert [t for t, _ in two] == [t for t, _ in one]


@pytest.mark.slow
def test_a_worker_killed_mid_serve_stops_the_engine_and_every_worker(tmp_path):
    """vLLM's executor sees the worker die and shuts the engine down: the other worker
    (blocked in a ring all-sum) and the engine core exit at once, the streamed request in
    flight never finishes, and the API server exits once its connection closes (it does
    not send that stream an error: docs/distributed.md)."""
    import signal
    import threading

    server = Server(str(tiny_llama(tmp_path / "llama")), "tiny", ARGS + ["--tensor-parallel-size", "2"])
    try:
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
        assert results and '"finish_reason":"length"' not in results[0][1]
        server.proc.wait(timeout=60)  # exits by itself once the connection is closed
        assert "died unexpectedly" in server.log_path.read_text()
    finally:
        server.stop()
