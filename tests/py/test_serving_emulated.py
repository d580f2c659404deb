"""`vllm serve` on the path a Mac runs: every op on its Metal kernel (here in the emulator,
VLLM_METAL_KERNELS=emulated), op by op (VLLM_METAL_FUSED_LAYERS=0, not the fused CPU
decoder layer), under async scheduling (vLLM's default: step N+1 is built and submitted
while step N computes). Tiny random-weight checkpoints keep the emulator fast.

A hook in the server (sitecustomize on PYTHONPATH) logs, per step, the whole-KV-cache
copies reshape_and_cache made (_core.cache_write_copies) and whether the previous step
was still waiting to be read when the step was built.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import textwrap

import pytest

from serving_harness import Server

pytestmark = [pytest.mark.slow, pytest.mark.serving]

EMULATED_GPU_PATH = {"VLLM_METAL_KERNELS": "emulated", "VLLM_METAL_FUSED_LAYERS": "0"}
# float32: vLLM's dtype "auto" would serve a float32 checkpoint in half precision
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "128", "--max-num-seqs", "8",
               "--num-gpu-blocks-override", "48",
               "--max-num-batched-tokens", "32"]
VOCAB = 320

STEP_LOG_HOOK = textwrap.dedent(
    """
    import builtins, os, sys

    _import = builtins.__import__

    def _install(mod):
        from vllm_metal import _core

        runner = mod.MetalModelRunner
        execute_model = runner.execute_model
        log = open(os.environ["KV_COPY_LOG"], "a")

        def logged_execute_model(self, so):
            in_flight = bool(self._deferred) and self._deferred[-1].tokens is None
            before = _core.cache_write_copies()
            out = execute_model(self, so)
            if so.total_num_scheduled_tokens:
                log.write(f"{_core.cache_write_copies() - before} {int(in_flight)}\\n")
                log.flush()
            return out

        runner.execute_model = logged_execute_model

    def _hook(name, *args, **kwargs):
        module = _import(name, *args, **kwargs)
        mod = sys.modules.get("vllm_metal.model_runner")
        if builtins.__import__ is _hook and mod is not None and hasattr(mod, "MetalModelRunner"):
            builtins.__import__ = _import
            _install(mod)
        return module

    builtins.__import__ = _hook
    """
)


def tiny_attention_checkpoint(name: str, out_dir):
    """A 2-layer checkpoint of `name` (llama, gemma3) with a head size the Metal kernels
    take, and a byte-level tokenizer."""
    from qwen3_5_checkpoint import write_tokenizer
    from vllm_metal.models.testing import tiny_config, write_random_checkpoint

    cfg = tiny_config(name, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, vocab_size=VOCAB)
    out = write_random_checkpoint(cfg, out_dir, seed=3)
    write_tokenizer(out, VOCAB)
    return out


def serve_emulated(checkpoint, name: str, tmp_path) -> tuple[Server, object]:
    (tmp_path / "sitecustomize.py").write_text(STEP_LOG_HOOK)
    log = tmp_path / "steps.log"
    env = {**EMULATED_GPU_PATH, "KV_COPY_LOG": str(log),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    return Server(str(checkpoint), name, SERVER_ARGS, env=env), log


def complete_ids(server, prompt: list[int], max_tokens: int) -> list[int]:
    r = server.client.post("/v1/completions", json={
        "model": server.name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "return_token_ids": True, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


# concurrent requests of different lengths: decodes share steps with chunked prefills
JOBS = [(list(range(5, 5 + n)), m) for n, m in [(3, 12), (41, 8), (17, 10), (29, 6), (8, 14)]]


def serve_concurrently(server) -> list[list[int]]:
    with cf.ThreadPoolExecutor(len(JOBS)) as pool:
        return list(pool.map(lambda j: complete_ids(server, *j), JOBS))


def test_async_steps_write_the_kv_cache_in_place(tmp_path):
    checkpoint = tiny_attention_checkpoint("llama", tmp_path / "llama")
    server, log = serve_emulated(checkpoint, "llama-tiny", tmp_path)
    try:
        got = serve_concurrently(server)
    finally:
        server.stop()
    assert [len(g) for g in got] == [m for _, m in JOBS]
    steps = [tuple(map(int, line.split())) for line in log.read_text().splitlines()]
    overlapped = [copies for copies, in_flight in steps if in_flight]
    # the previous step was still unread (computing) when most steps were built
    assert len(overlapped) >= 10, steps
    assert sum(copies for copies, _ in steps) == 0, f"KV-cache copies per step: {steps}"
