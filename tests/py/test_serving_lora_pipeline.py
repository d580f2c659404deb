"""LoRA under pipeline parallelism through `vllm serve`: each stage applies the adapters'
weights of its own layers (lora/manager.py: a stage checks and keeps only those), so a
batch mixing two adapters and the base gives each request the greedy tokens of the base
with its adapter merged in NumPy (W + scale * B @ A). The tiny llama's 3 layers split 2 + 1:
both adapters touch layers on both stages. Async scheduling (the default)."""

from __future__ import annotations

import concurrent.futures

import pytest

from lora_checkpoint import base_weights, merged_greedy, write_adapter, write_two_adapters
from parallel_reference import ARGS, tiny_llama
from serving_harness import Server

pytestmark = [pytest.mark.serving, pytest.mark.slow]

LAYERS = 3
PROMPTS = {"base": [5, 9, 30, 7, 2], "a1": [3, 8, 200, 41], "a2": [17, 56, 90, 12, 4, 61]}
MAX_TOKENS = 10


def test_each_request_equals_its_merged_checkpoint_across_two_stages(tmp_path):
    base = tiny_llama(tmp_path / "base")
    want = merged_greedy(base, tmp_path, write_two_adapters(tmp_path, base, LAYERS), PROMPTS, MAX_TOKENS)
    server = Server(str(base), "tiny", ARGS + [
        "--pipeline-parallel-size", "2", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
        "--lora-modules", f"a1={tmp_path / 'a1'}", f"a2={tmp_path / 'a2'}"],
        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    try:
        def run(name):
            r = server.client.post("/v1/completions", json={
                "model": "tiny" if name == "base" else name, "prompt": PROMPTS[name],
                "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]

        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:  # one batch
            got = dict(zip(PROMPTS, pool.map(run, PROMPTS)))
        assert got == want
        # an adapter whose shapes do not fit is refused by the stage holding the layer
        bad = write_adapter(tmp_path / "bad", base_weights(base), LAYERS, r=16, alpha=16, seed=43, layers=[2])
        assert bad
        r = server.client.post("/v1/load_lora_adapter", json={"lora_name": "bad",
                                                               "lora_path": str(tmp_path / "bad")})
        assert r.status_code == 400 and "exceeds --max-lora-rank 8" in r.text, r.text
        assert run("a1") == want["a1"]  # the engine lives
    finally:
        server.stop()
