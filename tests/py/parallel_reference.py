"""The one-process reference the tensor- and pipeline-parallel serving tests compare with:
a tiny random-weight llama served once per pytest run (cached), its greedy tokens and
logprobs for JOBS. Sync scheduling on the per-op path (VLLM_METAL_FUSED_LAYERS=0): the
path TP ranks and PP stages run; greedy tokens do not depend on either choice."""

from __future__ import annotations

import concurrent.futures as cf
import functools
import re
import tempfile
from pathlib import Path

import numpy as np
import psutil

from serving_harness import Server

VOCAB = 320
ARGS = ["--dtype", "float32", "--max-model-len", "128", "--max-num-seqs", "8",
        "--num-gpu-blocks-override", "48", "--max-num-batched-tokens", "32"]
# concurrent requests of different lengths: decodes share steps with chunked prefills
JOBS = [(np.random.default_rng(n).integers(3, VOCAB, n).tolist(), m)
        for n, m in [(3, 12), (41, 8), (17, 10), (29, 6), (8, 14), (60, 9)]]
SYNC = ["--no-async-scheduling"]
PER_OP = {"VLLM_METAL_FUSED_LAYERS": "0"}


def tiny_llama(out_dir, **overrides):
    from qwen3_5_checkpoint import write_tokenizer
    from vllm_metal.models.testing import tiny_config, write_random_checkpoint

    # 3 layers: pipeline stages of 2 and 1; 4 heads / 2 KV heads: whole heads per TP rank
    cfg = tiny_config("llama", **{**dict(hidden_size=128, intermediate_size=192, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                         vocab_size=VOCAB, tie_word_embeddings=False), **overrides})
    out = write_random_checkpoint(cfg, out_dir, seed=3)
    write_tokenizer(out, VOCAB)
    return out


@functools.cache
def shared_tiny_llama() -> Path:
    """One checkpoint for every module of the run (the reference is served from it)."""
    return tiny_llama(Path(tempfile.mkdtemp(prefix="vllm-metal-tiny-llama-")) / "llama")


def complete(server, prompt, max_tokens):
    """The greedy tokens of one request and the logprob of each."""
    r = server.client.post("/v1/completions", json={
        "model": server.name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "return_token_ids": True, "ignore_eos": True, "logprobs": 1})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def run_jobs(server, jobs=JOBS) -> list:
    """Every job at once on a running server -> [(tokens, logprobs)]."""
    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda j: complete(server, *j), jobs))


def serve_jobs(checkpoint, extra_args, args=ARGS, jobs=JOBS, env=None):
    """Every job at once on a fresh server; -> [(tokens, logprobs)], the server (stopped,
    its /metrics text as it ended kept in server.metrics). Asserts the server leaves no
    process behind."""
    server = Server(str(checkpoint), "tiny", args + extra_args, env=env)
    procs = [server.proc, *psutil.Process(server.proc.pid).children(recursive=True)]
    try:
        out = run_jobs(server, jobs)
        server.metrics = server.client.get("/metrics").text
        return out, server
    finally:
        server.stop()
        # the API server, the engine core and every worker are gone
        assert not psutil.wait_procs(procs, timeout=20)[1], "processes left behind"


@functools.cache
def one_process_reference() -> tuple:
    """The shared checkpoint's JOBS served by one process (once per run)."""
    out, _ = serve_jobs(shared_tiny_llama(), SYNC, env=PER_OP)
    return tuple(out)


def counter(metrics: str, name: str) -> float:
    """A Prometheus counter's value in a /metrics text, summed over its labels."""
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", metrics, re.M))


def assert_same_greedy(one, two, atol):
    for (tokens1, lp1), (tokens2, lp2) in zip(one, two, strict=True):
        assert tokens2 == tokens1
        np.testing.assert_allclose(lp2, lp1, atol=atol)
