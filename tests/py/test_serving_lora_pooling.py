"""LoRA with `vllm serve --runner pooling` on a Qwen3-Embedding-style decoder (tiny random
Qwen3, last-token pooling): /v1/embeddings with `model` naming an adapter equals
transformers' embedding of the base with that adapter merged in NumPy (W + scale * B @ A),
the base name gives the base's, and concurrent requests mixing two adapters and the base
(packed into shared steps) give each its own. An encoder with --enable-lora is refused at
startup."""

from __future__ import annotations

import concurrent.futures as cf

import numpy as np
import pytest

from lora_checkpoint import write_merged, write_two_adapters
from pooling_checkpoint import VOCAB, write_embedder
from pooling_reference import cosine, embedding
from serving_harness import Server

pytestmark = [pytest.mark.slow, pytest.mark.serving]

LAYERS = 2
ARGS = ["--runner", "pooling", "--dtype", "float32", "--max-model-len", "128",
        "--max-num-seqs", "16", "--kv-cache-memory-bytes", str(32 << 20),
        "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]


def _embed(server, model: str, inputs) -> list[np.ndarray]:
    r = server.client.post("/v1/embeddings", json={"model": model, "input": inputs})
    assert r.status_code == 200, r.text
    return [np.array(d["embedding"]) for d in sorted(r.json()["data"], key=lambda d: d["index"])]


def test_each_adapter_embeds_as_its_merged_checkpoint(tmp_path):
    base = write_embedder(tmp_path / "base")
    deltas = write_two_adapters(tmp_path, base, LAYERS)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, VOCAB, n).tolist() for n in (3, 17, 40)]
    models = {"embedder": base, **{n: write_merged(base, tmp_path / f"m_{n}", d)
                                   for n, d in deltas.items()}}
    want = {n: [embedding(path, p, "LAST") for p in prompts] for n, path in models.items()}
    for n in deltas:  # each adapter moves the embedding away from the base's
        assert max(cosine(a, b) for a, b in zip(want[n], want["embedder"])) < 0.99
    server = Server(str(base), "embedder", ARGS + [
        "--lora-modules", f"a1={tmp_path / 'a1'}", f"a2={tmp_path / 'a2'}"])
    try:
        for name in models:  # one model per request
            for g, w_ in zip(_embed(server, name, prompts), want[name]):
                assert cosine(g, w_) >= 0.9999, name
        jobs = [(name, i) for name in models for i in range(len(prompts))]
        with cf.ThreadPoolExecutor(len(jobs)) as pool:  # adapters and the base in shared steps
            got = list(pool.map(lambda j: _embed(server, j[0], [prompts[j[1]]])[0], jobs))
        for (name, i), g in zip(jobs, got):
            assert cosine(g, want[name][i]) >= 0.9999, (name, i)
        assert server.alive()
    finally:
        server.stop()


@pytest.mark.parametrize("archs", [["BertModel"], ["XLMRobertaModel"], ["Gemma3TextModel"]])
def test_lora_with_an_encoder_is_refused(archs):
    from types import SimpleNamespace

    from vllm_metal.platform import UnsupportedConfiguration, _refuse_unsupported_lora

    config = SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(architectures=archs)),
                             lora_config=SimpleNamespace(fully_sharded_loras=False))
    with pytest.raises(UnsupportedConfiguration, match="LoRA with the encoder"):
        _refuse_unsupported_lora(config)
    config.model_config.hf_config.architectures = ["Qwen3ForCausalLM"]  # a decoder embedder
    _refuse_unsupported_lora(config)
