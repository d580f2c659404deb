"""LoRA through `vllm serve` (--enable-lora, --lora-modules, runtime load/unload) on a
tiny random llama: each request's greedy tokens equal those of the base checkpoint with
its adapter merged in NumPy (W + scale * B @ A), run without LoRA; a batch mixing three
adapters and the base gives each request its solo output; unload and reload while
serving; bad adapters and unknown names are refused and the engine lives."""

from __future__ import annotations

import concurrent.futures

import pytest

from lora_checkpoint import base_weights, write_adapter, write_gguf_adapter, write_merged
from serving_harness import Server
from test_serving_emulated import tiny_attention_checkpoint
from vllm_metal.models import load_model
from vllm_metal.models.generate import greedy_generate

pytestmark = [pytest.mark.serving, pytest.mark.slow]

LAYERS = 2
PROMPTS = {"base": [5, 9, 30, 7, 2, 44, 61], "a1": [3, 3, 8, 200, 17], "a2": [100, 17, 56, 90, 12, 4],
           "a3": [7, 1, 2, 3, 250, 9, 9, 31], "g1": [11, 40, 2, 9, 77], "g2": [60, 5, 5, 130, 8, 1]}
MAX_TOKENS = 8
LONG = 100  # tokens of the request that outlives its adapter's unload


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serving_lora")
    base = tiny_attention_checkpoint("llama", tmp / "base")
    w = base_weights(base)
    deltas = {
        "a1": write_adapter(tmp / "a1", w, LAYERS, r=8, alpha=16, seed=21, magnitude=2.0),
        "a2": write_adapter(tmp / "a2", w, LAYERS, r=4, alpha=8, seed=22, magnitude=2.0,
                            targets=("q_proj", "k_proj", "v_proj", "o_proj"),
                            rank_pattern={"k_proj": 2}),
        "a3": write_adapter(tmp / "a3", w, LAYERS, r=16, alpha=4, seed=23, magnitude=2.0,
                            targets=("gate_proj", "up_proj", "down_proj")),
    }
    # llama.cpp GGUF LoRA files (q/k lora_b rows in llama.cpp's permuted order)
    import json

    cfg = json.loads((base / "config.json").read_text())
    heads = dict(n_heads=cfg["num_attention_heads"], n_kv_heads=cfg["num_key_value_heads"])
    deltas["g1"] = write_gguf_adapter(tmp / "g1.gguf", w, LAYERS, arch="llama", r=8, alpha=16,
                                      seed=25, magnitude=2.0, **heads)
    deltas["g2"] = write_gguf_adapter(tmp / "g2.gguf", w, LAYERS, arch="llama", r=4, alpha=8,
                                      seed=26, magnitude=2.0, targets=("q_proj", "k_proj"), **heads)
    write_gguf_adapter(tmp / "qwen.gguf", w, LAYERS, arch="qwen3", r=4, alpha=8, seed=27, **heads)
    # references: the merged checkpoints run without LoRA (our model, in this process)
    want = {}
    for name, prompt in PROMPTS.items():
        ckpt = base if name == "base" else write_merged(base, tmp / f"merged_{name}", deltas[name])
        model = load_model(str(ckpt), "float32")
        want[name] = greedy_generate(model, [prompt], MAX_TOKENS, stop_ids=[])[0]
        if name == "a1":
            want["a1_long"] = greedy_generate(model, [prompt], LONG, stop_ids=[])[0]
    # each adapter changes the output
    assert len({tuple(want[n]) for n in PROMPTS}) == len(PROMPTS)
    for name in ("g1", "g2"):
        model = load_model(str(base), "float32")
        assert greedy_generate(model, [PROMPTS[name]], MAX_TOKENS, stop_ids=[])[0] != want[name]
    big = write_adapter(tmp / "too_big", w, LAYERS, r=32, alpha=32, seed=24, targets=("q_proj",))
    assert big
    server = Server(str(base), "llama-tiny", [
        "--dtype", "float32", "--max-model-len", "128", "--max-num-seqs", "8",
        "--num-gpu-blocks-override", "64", "--enable-lora", "--max-loras", "3",
        "--max-lora-rank", "16", "--max-cpu-loras", "4",
        "--lora-modules", f"a1={tmp / 'a1'}", f"a2={tmp / 'a2'}", f"g1={tmp / 'g1.gguf'}"],
        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    try:
        yield server, tmp, want
    finally:
        server.stop()


def tokens(server, model: str, prompt: list[int], max_tokens: int = MAX_TOKENS):
    r = server.client.post("/v1/completions", json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True})
    return r.status_code, (r.json()["choices"][0]["token_ids"] if r.status_code == 200 else r.text)


def model_name(name):
    return "llama-tiny" if name == "base" else name


def test_models_lists_the_adapters(lora_server):
    server, _, _ = lora_server
    ids = {m["id"] for m in server.client.get("/v1/models").json()["data"]}
    assert {"llama-tiny", "a1", "a2"} <= ids


def test_each_adapter_equals_its_merged_checkpoint(lora_server):
    server, _, want = lora_server
    for name in ("base", "a1", "a2"):
        assert tokens(server, model_name(name), PROMPTS[name]) == (200, want[name]), name


def test_runtime_load_then_a_mixed_batch_gives_each_request_its_solo_output(lora_server):
    server, tmp, want = lora_server
    r = server.client.post("/v1/load_lora_adapter",
                           json={"lora_name": "a3", "lora_path": str(tmp / "a3")})
    assert r.status_code == 200, r.text
    assert tokens(server, "a3", PROMPTS["a3"]) == (200, want["a3"])
    names = ["base", "a1", "a2", "a3"] * 2
    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
        got = list(pool.map(lambda n: tokens(server, model_name(n), PROMPTS[n]), names))
    for name, g in zip(names, got):
        assert g == (200, want[name]), name


def test_llama_cpp_gguf_adapters_from_lora_modules_and_runtime_load(lora_server):
    server, tmp, want = lora_server
    assert tokens(server, "g1", PROMPTS["g1"]) == (200, want["g1"])
    r = server.client.post("/v1/load_lora_adapter",
                           json={"lora_name": "g2", "lora_path": str(tmp / "g2.gguf")})
    assert r.status_code == 200, r.text
    assert tokens(server, "g2", PROMPTS["g2"]) == (200, want["g2"])
    r = server.client.post("/v1/load_lora_adapter",
                           json={"lora_name": "q", "lora_path": str(tmp / "qwen.gguf")})
    # a refusal: 400 with the worker's message (vLLM alone answers 500: lora/http_status.py)
    assert r.status_code == 400 and "adapter architecture 'qwen3' does not match" in r.text, r.text
    assert server.alive()
    assert tokens(server, "g1", PROMPTS["g1"]) == (200, want["g1"])


def test_unload_and_reload_while_serving(lora_server):
    server, tmp, want = lora_server
    r = server.client.post("/v1/unload_lora_adapter", json={"lora_name": "a2"})
    assert r.status_code == 200, r.text
    status, _ = tokens(server, "a2", PROMPTS["a2"])
    assert status == 404
    assert "a2" not in {m["id"] for m in server.client.get("/v1/models").json()["data"]}
    r = server.client.post("/v1/load_lora_adapter",
                           json={"lora_name": "a2", "lora_path": str(tmp / "a2")})
    assert r.status_code == 200, r.text
    assert tokens(server, "a2", PROMPTS["a2"]) == (200, want["a2"])


def test_bad_adapters_and_unknown_names_are_refused_and_the_engine_lives(lora_server):
    server, tmp, want = lora_server
    r = server.client.post("/v1/load_lora_adapter",
                           json={"lora_name": "big", "lora_path": str(tmp / "too_big")})
    assert r.status_code == 400 and "exceeds --max-lora-rank 16" in r.text, r.text
    r = server.client.post("/v1/load_lora_adapter",
                           json={"lora_name": "gone", "lora_path": str(tmp / "no-such-dir")})
    assert r.status_code == 404, r.text
    status, _ = tokens(server, "big", PROMPTS["a1"])
    assert status == 404
    status, _ = tokens(server, "no-such-adapter", PROMPTS["a1"])
    assert status == 404
    assert server.alive()
    assert tokens(server, "a1", PROMPTS["a1"]) == (200, want["a1"])


def test_a_bad_lora_module_stops_the_start_naming_the_problem(lora_server):
    _, tmp, _ = lora_server
    with pytest.raises(RuntimeError, match="vllm serve exited") as e:
        Server(str(tmp / "base"), "llama-tiny", [
            "--dtype", "float32", "--max-model-len", "128", "--num-gpu-blocks-override", "64",
            "--enable-lora", "--max-lora-rank", "16", "--lora-modules", f"big={tmp / 'too_big'}"])
    assert "rank 32 exceeds --max-lora-rank 16" in str(e.value)


def test_a_request_running_when_its_adapter_is_unloaded_finishes_with_it(lora_server):
    """Streamed: the unload is sent after the first tokens arrived, while the request runs."""
    import json

    server, tmp, want = lora_server
    got, unloaded = [], None
    with server.client.stream("POST", "/v1/completions", json={
            "model": "a1", "prompt": PROMPTS["a1"], "max_tokens": LONG, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": True}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            got += json.loads(line[6:])["choices"][0].get("token_ids") or []
            if unloaded is None:
                unloaded = server.client.post("/v1/unload_lora_adapter", json={"lora_name": "a1"})
                assert unloaded.status_code == 200, unloaded.text
                assert len(got) < LONG // 2  # the request is still running
    assert got == want["a1_long"]
    assert tokens(server, "a1", PROMPTS["a1"])[0] == 404
    r = server.client.post("/v1/load_lora_adapter",
                           json={"lora_name": "a1", "lora_path": str(tmp / "a1")})
    assert r.status_code == 200, r.text
    assert tokens(server, "a1", PROMPTS["a1"]) == (200, want["a1"])
