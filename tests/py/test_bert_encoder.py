"""BERT-family encoders (vllm_metal.models.bert) against transformers on CPU torch:
all-MiniLM-L6-v2 with real weights (mean-pooled normalised embeddings, as
sentence-transformers computes them), random-weight BERT and XLM-R configs on the CPU
kernels and the emulated Metal kernels, a batch of 64 mixed-length inputs against each
input alone, cross-encoder scores, bad input."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from pooling_reference import minilm_dir_or_skip
from vllm_metal.models.bert import EncoderConfig, load_encoder

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def packed(seqs):
    ids = np.concatenate([np.asarray(s, np.int32) for s in seqs])
    cu = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int32)
    return ids, cu


def mean_pooled(hidden, cu):
    """sentence-transformers' Pooling(mean) + Normalize on packed rows."""
    h = np.asarray(hidden, np.float64)
    out = np.stack([h[s:e].mean(0) for s, e in zip(cu[:-1], cu[1:])])
    return out / np.linalg.norm(out, axis=1, keepdims=True)


def cosines(a, b):
    return np.sum(a * b, axis=1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def torch_hidden(model, seqs, token_types=None):
    out = []
    with torch.no_grad():
        for i, s in enumerate(seqs):
            kw = {} if token_types is None else {
                "token_type_ids": torch.tensor(np.asarray(token_types[i])[None])}
            out.append(model(torch.tensor([list(s)]), **kw).last_hidden_state[0].numpy())
    return np.concatenate(out)


@pytest.fixture(scope="module")
def minilm():
    directory = minilm_dir_or_skip()
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    reference = transformers.AutoModel.from_pretrained(directory).eval()
    return load_encoder(directory), tokenizer, reference


TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "a",
    "Apple silicon runs vLLM through Metal kernels; Linux runs them in an emulator.",
    "Embeddings for retrieval-augmented generation, computed next to the chat model " * 6,
]


def test_minilm_embeddings_match_transformers(minilm):
    model, tokenizer, reference = minilm
    seqs = [tokenizer(t)["input_ids"] for t in TEXTS]
    ids, cu = packed(seqs)
    got = mean_pooled(model(ids, cu), cu)
    want = mean_pooled(torch_hidden(reference, seqs), cu)
    assert cosines(got, want).min() >= 0.9999
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_batch_of_64_mixed_lengths_gives_each_input_what_it_gives_alone(minilm):
    model, _, _ = minilm
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 80, size=64)
    lengths[:3] = (1, 128, 2)
    seqs = [np.concatenate([[101], rng.integers(1000, 30000, n - 1), [102]])[:n] for n in lengths]
    ids, cu = packed(seqs)
    batch = np.asarray(model(ids, cu))
    for i in (0, 1, 2, 17, 40, 63):
        alone = np.asarray(model(*packed([seqs[i]])))
        np.testing.assert_allclose(batch[cu[i]:cu[i + 1]], alone, atol=2e-5, rtol=1e-4)
    # and all 64 pooled embeddings against transformers, one input at a time
    want = mean_pooled(torch_hidden(minilm[2], seqs[:16]), cu[:17])
    assert cosines(mean_pooled(batch[:cu[16]], cu[:17]), want).min() >= 0.9999


def _random_checkpoint(tmp_path, cls_name, config_cls, **overrides):
    torch.manual_seed(0)
    kw = dict(vocab_size=211, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              intermediate_size=96, max_position_embeddings=80, type_vocab_size=2)
    kw.update(overrides)
    config = getattr(transformers, config_cls)(**kw)
    model = getattr(transformers, cls_name)(config).eval()
    with torch.no_grad():  # LayerNorms and biases away from their 1 / 0 initial values
        for name, p in model.named_parameters():
            if "LayerNorm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path, safe_serialization=True)
    return model


ARCHS = [
    ("BertModel", "BertConfig", {}),
    ("BertModel", "BertConfig", {"hidden_act": "gelu_new", "num_attention_heads": 2}),
    ("XLMRobertaModel", "XLMRobertaConfig", {"pad_token_id": 1, "type_vocab_size": 1}),
]


@pytest.mark.parametrize("arch", ARCHS, ids=["bert", "bert-gelu_new-2heads", "xlm-roberta"])
def test_random_weights_match_transformers(backend, tmp_path, arch):
    cls_name, config_cls, overrides = arch
    reference = _random_checkpoint(tmp_path, cls_name, config_cls, **overrides)
    model = load_encoder(tmp_path)
    rng = np.random.default_rng(1)
    seqs = [rng.integers(2, 211, n) for n in (5, 1, 13, 40 if backend == "native" else 9)]
    types = None
    if reference.config.type_vocab_size > 1:  # a cross-encoder's pair layout: 0s then 1s
        types = [(np.arange(len(s)) >= len(s) // 2).astype(np.int32) for s in seqs]
    ids, cu = packed(seqs)
    got = np.asarray(model(ids, cu, None if types is None else np.concatenate(types)))
    want = torch_hidden(reference, seqs, types)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    assert cosines(mean_pooled(got, cu), mean_pooled(want, cu)).min() >= 0.9999


@pytest.mark.parametrize("arch", [("BertForSequenceClassification", "BertConfig"),
                                  ("XLMRobertaForSequenceClassification", "XLMRobertaConfig")],
                         ids=["bert", "xlm-roberta"])
@pytest.mark.parametrize("num_labels", [1, 3])
def test_cross_encoder_scores_match_transformers(tmp_path, arch, num_labels):
    cls_name, config_cls = arch
    extra = {"pad_token_id": 1} if "XLM" in cls_name else {}
    reference = _random_checkpoint(tmp_path, cls_name, config_cls, num_labels=num_labels, **extra)
    model = load_encoder(tmp_path)
    assert model.config.num_labels == num_labels
    rng = np.random.default_rng(2)
    # query / document pairs: [CLS] q [SEP] d [SEP], token types 0 then 1
    pairs = [(rng.integers(5, 211, a), rng.integers(5, 211, b)) for a, b in ((3, 9), (7, 2), (1, 30))]
    seqs = [np.concatenate([[2], q, [3], d, [3]]) for q, d in pairs]
    types = [np.concatenate([np.zeros(len(q) + 2), np.ones(len(d) + 1)]).astype(np.int32)
             for q, d in pairs]
    ids, cu = packed(seqs)
    got = np.asarray(model.scores(model(ids, cu, np.concatenate(types)), cu))
    with torch.no_grad():
        want = np.concatenate([reference(torch.tensor([list(s)]),
                                         token_type_ids=torch.tensor([list(t)])).logits.numpy()
                               for s, t in zip(seqs, types)])
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_hidden_states_source_interface(tmp_path):
    # the pooling runner's view: packed rows picked out, 0-based positions from the context
    from types import SimpleNamespace

    _random_checkpoint(tmp_path, "XLMRobertaModel", "XLMRobertaConfig", pad_token_id=1)
    model = load_encoder(tmp_path)
    assert model.causal is False
    seqs = [np.arange(3, 9), np.arange(20, 24)]
    ids, cu = packed(seqs)
    ctx = SimpleNamespace(cu_seqlens_q=mx.array(cu),
                          positions=mx.array(np.concatenate([np.arange(6), np.arange(4)])))
    rows = mx.array([0, 5, 6, 9], mx.int32)
    got = model.hidden_states(mx.array(ids), ctx, rows)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(model(ids, cu))[[0, 5, 6, 9]])
    # rows=None (a MEAN / ALL step): every packed row, in order
    every = model.hidden_states(mx.array(ids), ctx, None)
    np.testing.assert_array_equal(np.asarray(every), np.asarray(model(ids, cu)))


def test_bad_input(tmp_path):
    _random_checkpoint(tmp_path, "BertModel", "BertConfig")
    model = load_encoder(tmp_path)
    with pytest.raises(ValueError, match="longer than the model's 80"):
        model(np.ones(81, np.int32), [0, 81])
    with pytest.raises(ValueError, match="cu_seqlens must rise from 0 to 4"):
        model(np.ones(4, np.int32), [0, 3])
    with pytest.raises(ValueError, match="not a supported encoder"):
        EncoderConfig.from_dict({"architectures": ["LlamaForCausalLM"]})
    with pytest.raises(ValueError, match="absolute position"):
        EncoderConfig.from_dict({"architectures": ["BertModel"],
                                 "position_embedding_type": "relative_key"})
