"""A Qwen3-Reranker-style reranker: a tiny random Qwen3ForCausalLM served with
`--runner pooling --hf-overrides '{"architectures": ["Qwen3ForSequenceClassification"],
"classifier_from_token": [false, true], "is_original_qwen3_reranker": true}'` as vLLM
serves Qwen3-Reranker. /classify, /score and /rerank against transformers on CPU torch:
the softmax over the [false, true] logits of the last token."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pooling_checkpoint import VOCAB, write_embedder
from pooling_reference import _model
from serving_harness import Server

pytestmark = [pytest.mark.slow, pytest.mark.serving]

# single byte-level tokens of the test vocabulary, standing in for Qwen3-Reranker's "no", "yes"
FALSE, TRUE = "n", "y"
OVERRIDES = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": [FALSE, TRUE],
             "is_original_qwen3_reranker": True}
ARGS = ["--runner", "pooling", "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "16",
        "--kv-cache-memory-bytes", str(32 << 20), "--hf-overrides", json.dumps(OVERRIDES)]


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    model_dir = write_embedder(tmp_path_factory.mktemp("reranker"), seed=7)
    s = Server(str(model_dir), "reranker", ARGS)
    yield s, model_dir
    s.stop()


def _yes_probability(model_dir, token_ids: list[int]) -> float:
    """transformers: P(true) = softmax([logit_false, logit_true]) at the last token."""
    import torch
    from transformers import AutoTokenizer

    vocab = AutoTokenizer.from_pretrained(str(model_dir)).get_vocab()
    with torch.no_grad():
        logits = _model(str(model_dir))(input_ids=torch.tensor([token_ids])).logits[0, -1]
    pair = logits[[vocab[FALSE], vocab[TRUE]]].double()
    return float(torch.softmax(pair, dim=0)[1])


def test_classify_is_the_yes_no_softmax(reranker):
    server, model_dir = reranker
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, VOCAB, n).tolist() for n in (2, 19, 120)]
    r = server.client.post("/classify", json={"model": server.name, "input": prompts})
    assert r.status_code == 200, r.text
    got = [d["probs"] for d in sorted(r.json()["data"], key=lambda d: d["index"])]
    want = [_yes_probability(model_dir, p) for p in prompts]
    assert all(len(g) == 1 for g in got)  # one label, as vLLM's from_2_way_softmax makes it
    np.testing.assert_allclose([g[0] for g in got], want, atol=1e-5)
    assert max(want) - min(want) > 1e-3  # the inputs move the score


def test_score_and_rerank(reranker):
    from transformers import AutoTokenizer

    server, model_dir = reranker
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    query = "what is the capital of France"
    docs = ["Paris is the capital of France", "hello world", "the capital of it is in"]
    want = [_yes_probability(model_dir, tok(query, d)["input_ids"]) for d in docs]
    r = server.client.post("/score", json={"model": server.name, "queries": query, "documents": docs})
    assert r.status_code == 200, r.text
    scores = [d["score"] for d in sorted(r.json()["data"], key=lambda d: d["index"])]
    np.testing.assert_allclose(scores, want, atol=1e-5)
    r = server.client.post("/rerank", json={"model": server.name, "query": query, "documents": docs})
    assert r.status_code == 200, r.text
    ranked = r.json()["results"]
    assert [x["index"] for x in ranked] == list(np.argsort(want)[::-1])
    np.testing.assert_allclose([x["relevance_score"] for x in ranked], sorted(want, reverse=True), atol=1e-5)
    r = server.client.post("/v1/embeddings", json={"model": server.name, "input": "hello"})
    assert 400 <= r.status_code < 500
    assert server.alive()
