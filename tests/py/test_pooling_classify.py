"""`vllm serve --runner pooling` of a Qwen3ForSequenceClassification cross-encoder (tiny
random weights, one label) against transformers on CPU torch: /classify, /score and
/rerank; and of a mean-pooling embedder with chunked prefill forced on (running sums
across chunks)."""

from __future__ import annotations

import numpy as np
import pytest

from pooling_checkpoint import VOCAB, write_classifier, write_embedder
from pooling_reference import classifier_logits, cosine, embedding
from serving_harness import Server

pytestmark = [pytest.mark.slow, pytest.mark.serving]

COMMON = ["--runner", "pooling", "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "16",
          "--kv-cache-memory-bytes", str(32 << 20)]


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    model_dir = write_classifier(tmp_path_factory.mktemp("classifier"))
    s = Server(str(model_dir), "reranker", COMMON)
    yield s, model_dir
    s.stop()


@pytest.fixture(scope="module")
def mean_embedder(tmp_path_factory):
    model_dir = write_embedder(tmp_path_factory.mktemp("mean"), seed=3)
    s = Server(str(model_dir), "mean", COMMON + [
        "--pooler-config", '{"pooling_type": "MEAN"}', "--enable-chunked-prefill",
        "--max-num-batched-tokens", "48"])
    yield s, model_dir
    s.stop()


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def test_classify_matches_transformers(classifier):
    server, model_dir = classifier
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, VOCAB, n).tolist() for n in (3, 20, 90)]
    r = server.client.post("/classify", json={"model": server.name, "input": prompts})
    assert r.status_code == 200, r.text
    for p, d in zip(prompts, sorted(r.json()["data"], key=lambda d: d["index"])):
        logit = classifier_logits(model_dir, p)
        np.testing.assert_allclose(d["probs"], _sigmoid(logit), atol=1e-5)  # one label: sigmoid
    raw = server.client.post("/classify", json={"model": server.name, "input": prompts[:1],
                                                "use_activation": False}).json()
    np.testing.assert_allclose(raw["data"][0]["probs"], classifier_logits(model_dir, prompts[0]), atol=1e-4)


def test_score_and_rerank_match_the_cross_encoder(classifier):
    from transformers import AutoTokenizer

    server, model_dir = classifier
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    query = "what is the capital of France"
    docs = ["Paris is the capital of France", "hello world", "the capital of it is in"]
    # the cross-encoder reads query and document as one sequence (the tokenizer's pair)
    want = [float(_sigmoid(classifier_logits(model_dir, tok(query, d)["input_ids"]))[0]) for d in docs]
    r = server.client.post("/score", json={"model": server.name, "queries": query, "documents": docs})
    assert r.status_code == 200, r.text
    scores = [d["score"] for d in sorted(r.json()["data"], key=lambda d: d["index"])]
    np.testing.assert_allclose(scores, want, atol=1e-5)
    r = server.client.post("/rerank", json={"model": server.name, "query": query, "documents": docs,
                                            "top_n": 2})
    assert r.status_code == 200, r.text
    ranked = r.json()["results"]
    assert [x["index"] for x in ranked] == list(np.argsort(want)[::-1][:2])
    np.testing.assert_allclose([x["relevance_score"] for x in ranked], sorted(want, reverse=True)[:2],
                               atol=1e-5)


def test_classifier_refuses_embeddings(classifier):
    server, _ = classifier
    r = server.client.post("/v1/embeddings", json={"model": server.name, "input": "hello"})
    assert 400 <= r.status_code < 500
    r = server.client.post("/pooling", json={"model": server.name, "input": "hello", "task": "embed"})
    assert 400 <= r.status_code < 500
    assert server.alive()


def test_mean_pooling_across_chunks(mean_embedder):
    server, model_dir = mean_embedder
    rng = np.random.default_rng(1)
    # 48-token budget: 100 and 200 tokens arrive in several chunks, batched with short ones
    prompts = [rng.integers(3, VOCAB, n).tolist() for n in (4, 100, 30, 200, 1)]
    r = server.client.post("/v1/embeddings", json={"model": server.name, "input": prompts})
    assert r.status_code == 200, r.text
    for p, d in zip(prompts, sorted(r.json()["data"], key=lambda d: d["index"])):
        assert cosine(d["embedding"], embedding(model_dir, p, "MEAN")) >= 0.9999
