"""`vllm serve file.gguf --runner pooling` of a BERT GGUF (llama.cpp architecture "bert",
models/bert_gguf.py): all-MiniLM-L6-v2's safetensors written here as llama.cpp's converter
lays them out (phantom-space WordPiece vocabulary, separate q/k/v, pooling_type MEAN), in
F32 and F16, against transformers on CPU torch on the safetensors (sentence-transformers'
all-MiniLM: mean over the tokens, normalised). Text input goes through the tokenizer made
from the file, so a wrong vocabulary conversion shows too. A reranker file (pooling_type RANK,
llama.cpp's cls / cls.output head) written from a random BertForSequenceClassification is
served on /score and /rerank against that cross-encoder in transformers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pooling_reference import minilm_dir_or_skip
from serving_harness import Server
from test_serving_encoder import check_score_and_rerank, write_random_cross_encoder

pytestmark = [pytest.mark.slow, pytest.mark.serving]

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

ARGS = ["--runner", "pooling", "--dtype", "float32", "--max-num-seqs", "32"]
TEXTS = ["A man is eating food.", "Tokenization of unaffable émigrés costs 12,345 dollars!",
         "the quick brown fox " * 40]

# HF (BertModel, without "bert." / "embeddings." / "encoder.layer.N.") -> llama.cpp
_TOP = {"embeddings.word_embeddings.weight": "token_embd.weight",
        "embeddings.position_embeddings.weight": "position_embd.weight",
        "embeddings.token_type_embeddings.weight": "token_types.weight",
        "embeddings.LayerNorm.weight": "token_embd_norm.weight",
        "embeddings.LayerNorm.bias": "token_embd_norm.bias"}
# BertForSequenceClassification's head -> llama.cpp's (written for RANK files only)
_HEAD = {"pooler.dense.weight": "cls.weight", "pooler.dense.bias": "cls.bias",
         "classifier.weight": "cls.output.weight", "classifier.bias": "cls.output.bias"}
_BLOCK = {"attention.self.query": "attn_q", "attention.self.key": "attn_k",
          "attention.self.value": "attn_v", "attention.output.dense": "attn_output",
          "attention.output.LayerNorm": "attn_output_norm", "intermediate.dense": "ffn_up",
          "output.dense": "ffn_down", "output.LayerNorm": "layer_output_norm"}


def _gguf_name(hf: str) -> str | None:
    if hf in _TOP:
        return _TOP[hf]
    parts = hf.split(".")  # encoder.layer.N.<module...>.weight|bias
    if parts[:2] != ["encoder", "layer"]:
        return None
    module = ".".join(parts[3:-1])
    return f"blk.{parts[2]}.{_BLOCK[module]}.{parts[-1]}" if module in _BLOCK else None


def write_bert_gguf(model_dir, path, qtype: str, pooling=None) -> None:
    """A BERT directory's safetensors (config.json, vocab.txt) as a llama.cpp "bert" GGUF;
    matrices in `qtype` (F32 / F16); pooling MEAN, or RANK with the classification head."""
    pooling = gguf.PoolingType.MEAN if pooling is None else pooling
    from safetensors.numpy import load_file

    config = json.loads((model_dir / "config.json").read_text())
    w = gguf.GGUFWriter(str(path), "bert")
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_layer_norm_eps(config["layer_norm_eps"])
    w.add_causal_attention(False)
    w.add_pooling_type(pooling)
    # the vocabulary in llama.cpp's phantom-space form
    words = (model_dir / "vocab.txt").read_text(encoding="utf-8").splitlines()
    control = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"}
    tokens, types = [], []
    for word in words:
        if word in control:
            tokens.append(word)
            types.append(gguf.TokenType.CONTROL)
        else:
            tokens.append(word[2:] if word.startswith("##") else "\u2581" + word)
            types.append(gguf.TokenType.NORMAL)
    w.add_tokenizer_model("bert")
    w.add_token_list(tokens)
    w.add_token_types(types)
    for key, word in (("bos", "[CLS]"), ("eos", "[SEP]"), ("unk", "[UNK]"), ("sep", "[SEP]"),
                      ("pad", "[PAD]"), ("mask", "[MASK]")):
        getattr(w, f"add_{key}_token_id")(words.index(word))
    weights = load_file(str(model_dir / "model.safetensors"))
    for hf, value in weights.items():
        name = _gguf_name(hf.removeprefix("bert."))
        if pooling == gguf.PoolingType.RANK:
            name = name or _HEAD.get(hf.removeprefix("bert."))
        if name is None:
            continue
        value = value.astype(np.float32)
        if qtype == "F16" and value.ndim == 2 and not name.startswith(("position", "token_types")):
            value = value.astype(np.float16)
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("qtype", ["F32", "F16"])
def test_served_bert_gguf_matches_transformers(tmp_path, qtype):
    model_dir = minilm_dir_or_skip()
    path = tmp_path / f"minilm-{qtype}.gguf"
    write_bert_gguf(model_dir, path, qtype)
    reference = transformers.AutoModel.from_pretrained(str(model_dir)).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    if qtype == "F16":  # the reference sees the weights the file holds
        with torch.no_grad():
            for name, p in reference.named_parameters():
                target = _gguf_name(name)
                if p.ndim == 2 and target and not target.startswith(("position", "token_types")):
                    p.copy_(p.half().float())
    server = Server(str(path), "bert-gguf", ARGS)
    try:
        r = server.client.post("/v1/embeddings", json={"model": server.name, "input": TEXTS})
        assert r.status_code == 200, r.text
        got = [np.array(d["embedding"]) for d in sorted(r.json()["data"], key=lambda d: d["index"])]
        for text, g in zip(TEXTS, got):
            ids = tokenizer(text).input_ids
            with torch.no_grad():
                hidden = reference(torch.tensor([ids])).last_hidden_state[0]
            want = torch.nn.functional.normalize(hidden.mean(0), dim=0).numpy()
            cos = float(g @ want / np.linalg.norm(g) / np.linalg.norm(want))
            assert cos >= 0.9999, (text, cos)
        assert r.json()["usage"]["prompt_tokens"] == sum(len(tokenizer(t).input_ids) for t in TEXTS)
        # over the position table: a 400, and the engine lives on
        r = server.client.post("/v1/embeddings", json={"model": server.name, "input": "word " * 600})
        assert r.status_code == 400, r.text
        r = server.client.post("/v1/embeddings", json={"model": server.name, "input": TEXTS[0]})
        assert r.status_code == 200, r.text
    finally:
        server.stop()


def test_served_bert_reranker_gguf_matches_cross_encoder(tmp_path):
    model = write_random_cross_encoder(tmp_path / "hf")
    path = tmp_path / "reranker-F32.gguf"
    write_bert_gguf(tmp_path / "hf", path, "F32", pooling=gguf.PoolingType.RANK)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    server = Server(str(path), "bert-reranker-gguf", ARGS)
    try:
        check_score_and_rerank(server, model, tokenizer)
        # a reranker serves no embeddings: a 4xx, and the engine lives on
        r = server.client.post("/v1/embeddings", json={"model": server.name, "input": "x"})
        assert 400 <= r.status_code < 500, r.text
        r = server.client.post("/score", json={"model": server.name, "queries": "q", "documents": ["d"]})
        assert r.status_code == 200, r.text
    finally:
        server.stop()
