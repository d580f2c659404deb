"""LoRA under pipeline parallelism through `vllm serve`: each stage applies the adapters'
weights of its own layers (lora/manager.py: a stage checks and keeps only those), so a
batch mixing two adapters and the base gives each request the greedy tokens of the base
with its adapter merged in NumPy (W + scale * B @ A). The tiny llama's 3 layers split 2 + 1:
both adapters touch layers on both stages. Async scheduling (the default)."""

from __future__ import annotations

import concurrent.futures

import pytest

from lora_checkpoint import base_weights, write_adapter, write_merged
from parallel_reference import ARGS, tiny_llama
from serving_harness import Server
from vllm_metal.models import load_model
from vllm_metal.models.generate import greedy_generate

pytestmark = [pytest.mark.serving, pytest.mark.slow]

LAYERS = 3
PROMPTS = {"base": [5, 9, 30, 7, 2], "a1": [3, 8, 200, 41], "a2": [17, 56, 90, 12, 4, 61]}
MAX_TOKENS = 10


def test_each_request_equals_its_merged_checkpoint_across_two_stages(tmp_path):
    base = tiny_llama(tmp_path / "base")
    w = base_weights(base)
    deltas = {"a1": write_adapter(tmp_path / "a1", w, LAYERS, r=8, alpha=16, seed=41, magnitude=2.0),
              "a2": write_adapter(tmp_path / "a2", w, LAYERS, r=4, alpha=8, seed=42, magnitude=2.0,
                                  targets=("q_proj", "v_proj", "down_proj"))}
    want = {}
    for name, prompt in PROMPTS.items():
        ckpt = base if name == "base" else write_merged(base, tmp_path / f"m_{name}", deltas[name])
        want[name] = greedy_generate(load_model(str(ckpt), "float32"), [prompt], MAX_TOKENS,
                                     stop_ids=[])[0]
    assert len({tuple(v) for v in want.values()}) == len(want)  # each adapter matters
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
        bad = write_adapter(tmp_path / "bad", w, LAYERS, r=16, alpha=16, seed=43, layers=[2])
        assert bad
        r = server.client.post("/v1/load_lora_adapter", json={"lora_name": "bad",
                                                               "lora_path": str(tmp_path / "bad")})
        assert r.status_code == 400 and "exceeds --max-lora-rank 8" in r.text, r.text
        assert run("a1") == want["a1"]  # the engine lives
    finally:
        server.stop()
