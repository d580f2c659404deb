"""`vllm serve --runner pooling` of a Qwen3-Embedding-style decoder (tiny random Qwen3,
last-token pooling, Matryoshka): /v1/embeddings, /pooling and /score against transformers
on CPU torch, a 64-input batch against each input alone, chunked prefill of long prompts
(token budget 64), and bad input answered with a 4xx while the engine lives on."""

from __future__ import annotations

import numpy as np
import pytest

from pooling_checkpoint import VOCAB, write_embedder
from pooling_reference import cosine, embedding
from serving_harness import Server

pytestmark = [pytest.mark.slow, pytest.mark.serving]

MAX_LEN = 256
ARGS = ["--runner", "pooling", "--dtype", "float32", "--max-model-len", str(MAX_LEN),
        "--max-num-seqs", "32", "--max-num-batched-tokens", "64", "--kv-cache-memory-bytes", str(64 << 20)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_embedder(tmp_path_factory.mktemp("embedder"), is_matryoshka=True)


@pytest.fixture(scope="module")
def server(model_dir):
    s = Server(str(model_dir), "embedder", ARGS)
    yield s
    s.stop()


def _ids(rng, n: int) -> list[int]:
    return rng.integers(3, VOCAB, n).tolist()


def _embed(server, inputs, **kw):
    r = server.client.post("/v1/embeddings", json={"model": server.name, "input": inputs, **kw})
    assert r.status_code == 200, r.text
    return [np.array(d["embedding"]) for d in sorted(r.json()["data"], key=lambda d: d["index"])]


def test_embeddings_match_transformers(server, model_dir):
    rng = np.random.default_rng(0)
    # 150 and 200 tokens: prefilled in chunks of at most 64 tokens
    prompts = [_ids(rng, n) for n in (1, 5, 17, 64, 150, 200)]
    got = _embed(server, prompts)
    for p, g in zip(prompts, got):
        want = embedding(model_dir, p, "LAST")
        assert g.shape == want.shape
        assert cosine(g, want) >= 0.9999
        assert abs(np.linalg.norm(g) - 1.0) < 1e-4


def test_text_input_and_matryoshka_dimensions(server, model_dir):
    from transformers import AutoTokenizer

    text = "what is the capital of France"
    ids = AutoTokenizer.from_pretrained(str(model_dir))(text)["input_ids"]
    full = _embed(server, text)[0]
    assert cosine(full, embedding(model_dir, ids)) >= 0.9999
    short = _embed(server, [text], dimensions=16)[0]
    assert short.shape == (16,)
    assert cosine(short, embedding(model_dir, ids, dimensions=16)) >= 0.9999
    # normalisation off: the raw last hidden state
    raw = _embed(server, [text], use_activation=False)[0]
    assert cosine(raw, embedding(model_dir, ids, normalize=False)) >= 0.9999
    assert abs(np.linalg.norm(raw) - np.linalg.norm(embedding(model_dir, ids, normalize=False))) < 1e-3


def test_batch_of_64_equals_each_alone(server):
    rng = np.random.default_rng(1)
    prompts = [_ids(rng, int(n)) for n in rng.integers(1, 120, 64)]
    together = _embed(server, prompts)
    for i in rng.choice(64, 8, replace=False):
        alone = _embed(server, [prompts[i]])[0]
        assert cosine(alone, together[i]) >= 0.99999


def test_pooling_endpoint_score_and_rerank(server, model_dir):
    from transformers import AutoTokenizer

    rng = np.random.default_rng(2)
    p = _ids(rng, 12)
    r = server.client.post("/pooling", json={"model": server.name, "input": [p], "task": "embed"})
    assert r.status_code == 200, r.text
    assert cosine(r.json()["data"][0]["data"], embedding(model_dir, p)) >= 0.9999
    # bi-encoder scoring: cosine similarity of the two embeddings
    q, docs = "what is the capital of France", ["Paris is the capital of France", "hello world"]
    ids = AutoTokenizer.from_pretrained(str(model_dir))
    want = [cosine(embedding(model_dir, ids(q)["input_ids"]), embedding(model_dir, ids(d)["input_ids"]))
            for d in docs]
    r = server.client.post("/score", json={"model": server.name, "queries": q, "documents": docs})
    assert r.status_code == 200, r.text
    scores = [d["score"] for d in sorted(r.json()["data"], key=lambda d: d["index"])]
    np.testing.assert_allclose(scores, want, atol=1e-4)
    r = server.client.post("/rerank", json={"model": server.name, "query": q, "documents": docs})
    assert r.status_code == 200, r.text
    ranked = r.json()["results"]
    assert [x["index"] for x in ranked] == list(np.argsort(want)[::-1])
    np.testing.assert_allclose([x["relevance_score"] for x in ranked], sorted(want, reverse=True), atol=1e-4)


@pytest.mark.parametrize("body, path", [
    ({"input": []}, "/v1/embeddings"),
    ({"input": ""}, "/v1/embeddings"),
    ({"input": [1.5, "x"]}, "/v1/embeddings"),
    ({"input": [{"text": "a"}]}, "/v1/embeddings"),
    ({"input": list(range(3, 3 + MAX_LEN + 10))}, "/v1/embeddings"),  # over max-model-len
    ({"input": "hello", "dimensions": 1000}, "/v1/embeddings"),
    ({"input": "hello"}, "/classify"),  # not a classification model
    ({"input": "hello", "task": "classify"}, "/pooling"),
    ({"input": "hello", "task": "token_embed"}, "/pooling"),  # not the served --pooler-config task
])
def test_bad_input_is_a_4xx_and_the_engine_lives(server, body, path):
    r = server.client.post(path, json={"model": server.name, **body})
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert server.alive()
    assert len(_embed(server, "still serving")[0]) == 64


def test_truncate_prompt_tokens(server, model_dir):
    ids = list(range(3, 3 + MAX_LEN + 10))  # over max-model-len: truncated, not refused
    left = _embed(server, [ids], truncate_prompt_tokens=100, truncation_side="left")[0]
    assert cosine(left, embedding(model_dir, ids[-100:])) >= 0.9999
    right = _embed(server, [ids], truncate_prompt_tokens=100, truncation_side="right")[0]
    assert cosine(right, embedding(model_dir, ids[:100])) >= 0.9999
