"""LoRA through `vllm serve` on a tiny random Qwen3-MoE whose experts stream through a
cache holding 25% of them: adapters on the routed experts (and attention) from
--lora-modules and /v1/load_lora_adapter; a concurrent batch mixing two adapters and the
base gives each request the greedy tokens of the base checkpoint with its adapter merged
in NumPy (run without LoRA, fully resident); an adapter for an expert the model lacks is
refused with a 400 naming the module, and the engine lives."""

from __future__ import annotations

import concurrent.futures
import json

import pytest

torch = pytest.importorskip("torch")

from lora_checkpoint import base_weights, write_adapter, write_merged  # noqa: E402
from qwen3_5_checkpoint import write_tokenizer  # noqa: E402
from serving_harness import Server  # noqa: E402
from test_models_qwen3_moe import write_checkpoint  # noqa: E402
from vllm_metal.models import load_model  # noqa: E402
from vllm_metal.models.generate import greedy_generate  # noqa: E402

pytestmark = [pytest.mark.serving, pytest.mark.slow]

VOCAB = 320
EXPERTS = 8
PROMPTS = {"base": [5, 9, 30, 7, 2, 44, 61], "e1": [3, 3, 8, 200, 17], "e2": [100, 17, 56, 90, 12, 4]}
MAX_TOKENS = 8


def experts(layer, ids, projs=("gate_proj", "up_proj", "down_proj")):
    return [f"model.layers.{layer}.mlp.experts.{e}.{p}" for e in ids for p in projs]


@pytest.fixture(scope="module")
def moe_lora_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serving_lora_moe")
    base = tmp / "base"
    config, _ = write_checkpoint(base, seed=3, vocab_size=VOCAB, num_experts=EXPERTS,
                                 bos_token_id=1, eos_token_id=2)
    write_tokenizer(base, VOCAB)
    w = base_weights(base)
    layers = config.num_hidden_layers
    deltas = {
        "e1": write_adapter(tmp / "e1", w, layers, r=8, alpha=16, seed=31, magnitude=2.0,
                            modules=["model.layers.0.self_attn.v_proj"]
                            + sum((experts(l, range(EXPERTS)) for l in range(layers)), [])),
        "e2": write_adapter(tmp / "e2", w, layers, r=4, alpha=8, seed=32, magnitude=2.0,
                            modules=experts(1, range(1, EXPERTS, 2))),
    }
    want = {}
    for name, prompt in PROMPTS.items():
        ckpt = base if name == "base" else write_merged(base, tmp / f"merged_{name}", deltas[name])
        want[name] = greedy_generate(load_model(str(ckpt), "float32"), [prompt], MAX_TOKENS,
                                     stop_ids=[])[0]
    assert len({tuple(v) for v in want.values()}) == len(want)  # each adapter matters
    bad = {"model.layers.0.mlp.experts.8.up_proj.weight": w["model.layers.0.mlp.experts.0.up_proj.weight"]}
    write_adapter(tmp / "bad", bad, 0, r=4, alpha=8, seed=0,
                  modules=["model.layers.0.mlp.experts.8.up_proj"])
    server = Server(str(base), "moe-tiny", [
        "--dtype", "float32", "--max-model-len", "128", "--max-num-seqs", "8",
        "--num-gpu-blocks-override", "64", "--enable-lora", "--max-loras", "2",
        "--max-lora-rank", "8", "--lora-modules", f"e1={tmp / 'e1'}",
        "--additional-config", json.dumps({"moe_expert_offload": {"cache_fraction": 0.25}})],
        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    try:
        yield server, tmp, want
    finally:
        server.stop()


def tokens(server, model: str, prompt: list[int]):
    r = server.client.post("/v1/completions", json={
        "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True})
    return r.status_code, (r.json()["choices"][0]["token_ids"] if r.status_code == 200 else r.text)


def test_mixed_batch_of_expert_adapters_equals_merged_checkpoints(moe_lora_server):
    server, tmp, want = moe_lora_server
    r = server.client.post("/v1/load_lora_adapter", json={"lora_name": "e2", "lora_path": str(tmp / "e2")})
    assert r.status_code == 200, r.text
    names = ["base", "e1", "e2"] * 2
    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
        got = list(pool.map(lambda n: tokens(server, "moe-tiny" if n == "base" else n, PROMPTS[n]),
                            names))
    for name, g in zip(names, got):
        assert g == (200, want[name]), name


def test_an_adapter_for_an_expert_the_model_lacks_is_refused(moe_lora_server):
    server, tmp, want = moe_lora_server
    r = server.client.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(tmp / "bad")})
    assert r.status_code == 400 and "layer 0 has no experts.8.up_proj" in r.text, r.text
    assert server.alive()
    assert tokens(server, "e1", PROMPTS["e1"]) == (200, want["e1"])
