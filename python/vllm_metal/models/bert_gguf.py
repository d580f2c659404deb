"""BERT-family GGUF files (llama.cpp architecture "bert") served by the BERT encoder
(models/bert.py): the HF config, the WordPiece tokenizer and the weights, from the file.

llama.cpp's layout, per its converter: token_embd, position_embd, token_types,
token_embd_norm; per block attn_q / attn_k / attn_v (or a fused attn_qkv), attn_output,
attn_output_norm, ffn_up, ffn_down, layer_output_norm, all with biases; post-LN as in HF.
Its vocabulary is written in "phantom space" form: a word-initial piece carries a leading
U+2581, a continuation piece drops BERT's "##", control tokens stay as they are.

Rerankers (pooling_type RANK) add llama.cpp's classification head: `cls` (dense, then
tanh) and `cls.output` (the label projection) on the first token, which is HF's
BertForSequenceClassification pooler + classifier; the labels' names, if any, in
`bert.classifier.output_labels`. They are served as that class (/score, /rerank).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

ARCHITECTURE = "bert"
_PHANTOM = "\u2581"
_CONTROL = 3  # gguf.TokenType.CONTROL
_RANK_POOLING = 4  # gguf.PoolingType.RANK
# ours (models/bert.py) <- llama.cpp's classification head
_HEAD = {"classifier.pooler": "cls", "classifier.out": "cls.output"}


def is_bert(ckpt) -> bool:
    return ckpt.architecture == ARCHITECTURE


def is_reranker(ckpt) -> bool:
    """A RANK file: a cross-encoder whose scores come from the classification head."""
    value = ckpt.metadata.get(f"{ARCHITECTURE}.pooling_type")
    return value is not None and int(value) == _RANK_POOLING


def hf_config(ckpt) -> dict:
    """A BertModel config.json from the file's metadata and tensor shapes."""
    meta = ckpt.metadata

    def get(key, default=None):
        return meta.get(f"{ARCHITECTURE}.{key}", default)

    missing = [n for n in _TOP.values() if n not in ckpt.tensors]
    if missing:
        raise ValueError(f"[vllm-metal] 'bert' GGUF without {', '.join(missing)}")
    if get("attention.causal", False):
        raise ValueError("[vllm-metal] a causal 'bert' GGUF is not an encoder this path serves")
    words = ckpt.tensors["token_embd.weight"].shape  # [vocab, hidden]
    positions = ckpt.tensors["position_embd.weight"].shape[0]
    types = ckpt.tensors["token_types.weight"].shape[0] if "token_types.weight" in ckpt.tensors else 1
    cfg = {
        "architectures": ["BertModel"],
        "model_type": "bert",
        "vocab_size": int(words[0]),
        "hidden_size": int(get("embedding_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": int(get("attention.head_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "max_position_embeddings": int(positions),
        "type_vocab_size": int(types),
        "layer_norm_eps": float(get("attention.layer_norm_epsilon", 1e-12)),
        "hidden_act": "gelu",
        "position_embedding_type": "absolute",
        "pad_token_id": int(meta.get("tokenizer.ggml.padding_token_id", 0)),
        "dtype": "float32",  # small encoders: weights dequantize to float32 (bert.load_encoder)
    }
    if is_reranker(ckpt):
        cfg.update(_classifier_config(ckpt, int(words[1])))
    return cfg


def _classifier_config(ckpt, hidden: int) -> dict:
    """BertForSequenceClassification's fields for a RANK file, from its head's shapes."""
    missing = [f"{t}.{k}" for t in _HEAD.values() for k in ("weight", "bias")
               if f"{t}.{k}" not in ckpt.tensors]
    if missing:  # llama.cpp also knows heads without the dense + tanh (jina v1): not served
        raise ValueError(f"[vllm-metal] a 'bert' reranker GGUF (pooling_type RANK) without "
                         f"{', '.join(missing)}: served heads are cls (dense + tanh) then cls.output")
    dense = tuple(ckpt.tensors["cls.weight"].shape)
    out = tuple(ckpt.tensors["cls.output.weight"].shape)  # [labels, hidden]
    if dense != (hidden, hidden) or len(out) != 2 or out[1] != hidden:
        raise ValueError(f"[vllm-metal] reranker head shapes cls {list(dense)}, cls.output "
                         f"{list(out)} do not fit hidden size {hidden}")
    labels = list(ckpt.metadata.get(f"{ARCHITECTURE}.classifier.output_labels") or [])
    if labels and len(labels) != out[0]:
        raise ValueError(f"[vllm-metal] {len(labels)} classifier.output_labels for a cls.output "
                         f"of {out[0]} rows")
    labels = labels or [f"LABEL_{i}" for i in range(out[0])]
    return {"architectures": ["BertForSequenceClassification"],
            "id2label": {str(i): str(name) for i, name in enumerate(labels)},
            "label2id": {str(name): i for i, name in enumerate(labels)}}


def vocab(ckpt) -> list[str]:
    """The WordPiece vocabulary (BERT's vocab.txt order) from the file's phantom-space one."""
    tokens = ckpt.metadata["tokenizer.ggml.tokens"]
    kinds = ckpt.metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    out = []
    for tok, kind in zip(tokens, kinds):
        if tok.startswith(_PHANTOM):
            out.append(tok[len(_PHANTOM):])
        elif int(kind) == _CONTROL:
            out.append(tok)
        else:
            out.append("##" + tok)
    return out


def write_tokenizer(out: Path, ckpt) -> None:
    """vocab.txt and transformers' BERT tokenizer files (lower-casing as the file says;
    llama.cpp's default for BERT is to lower-case)."""
    import transformers

    if ckpt.metadata.get("tokenizer.ggml.model") != ARCHITECTURE:
        raise ValueError(f"[vllm-metal] a 'bert' GGUF with tokenizer "
                         f"{ckpt.metadata.get('tokenizer.ggml.model')!r} (expected WordPiece, 'bert')")
    words = vocab(ckpt)
    ids = {w: i for i, w in enumerate(words)}
    meta = ckpt.metadata
    special = {}
    for key, name in (("unknown", "unk_token"), ("seperator", "sep_token"), ("padding", "pad_token"),
                      ("bos", "cls_token"), ("mask", "mask_token")):
        value = meta.get(f"tokenizer.ggml.{key}_token_id")
        if value is not None:
            special[name] = words[int(value)]
    if "cls_token" not in special:
        value = meta.get("tokenizer.ggml.cls_token_id")
        if value is not None:
            special["cls_token"] = words[int(value)]
    lower = bool(meta.get("tokenizer.ggml.normalizer.lowercase", True))
    tok = transformers.BertTokenizer(vocab=ids, do_lower_case=lower, **special)
    tok.model_max_length = int(ckpt.tensors["position_embd.weight"].shape[0])
    tok.save_pretrained(str(out))
    (out / "vocab.txt").write_text("".join(w + "\n" for w in words), encoding="utf-8")


# ours (models/bert.py) <- GGUF, per block
_BLOCK = {"attn_out": "attn_output", "attn_norm": "attn_output_norm", "up": "ffn_up",
          "down": "ffn_down", "out_norm": "layer_output_norm"}
_TOP = {"embeddings.word.weight": "token_embd.weight",
        "embeddings.position.weight": "position_embd.weight",
        "embeddings.norm.weight": "token_embd_norm.weight",
        "embeddings.norm.bias": "token_embd_norm.bias"}


def weights(ckpt, num_layers: int, dtype=mx.float32) -> dict[str, mx.array]:
    """models/bert.py's parameter names -> dequantized tensors of the file."""
    out = {ours: ckpt.dense(name, dtype) for ours, name in _TOP.items()}
    if "token_types.weight" in ckpt.tensors:
        out["embeddings.token_type.weight"] = ckpt.dense("token_types.weight", dtype)
    else:  # a single segment: adds nothing
        out["embeddings.token_type.weight"] = mx.zeros((1, out["embeddings.word.weight"].shape[1]), dtype)
    for i in range(num_layers):
        blk = f"blk.{i}."
        for kind in ("weight", "bias"):
            if blk + f"attn_qkv.{kind}" in ckpt.tensors:
                out[f"layers.{i}.qkv.{kind}"] = ckpt.dense(blk + f"attn_qkv.{kind}", dtype)
            else:
                out[f"layers.{i}.qkv.{kind}"] = mx.concatenate(
                    [ckpt.dense(blk + f"attn_{p}.{kind}", dtype) for p in "qkv"], axis=0)
            for ours, name in _BLOCK.items():
                out[f"layers.{i}.{ours}.{kind}"] = ckpt.dense(blk + f"{name}.{kind}", dtype)
    if is_reranker(ckpt):
        for ours, name in _HEAD.items():
            for kind in ("weight", "bias"):
                out[f"{ours}.{kind}"] = ckpt.dense(f"{name}.{kind}", dtype)
    return out


def load_encoder(gguf_path: str | Path, hf_cfg: dict, dtype=mx.float32, linear: str = "gguf"):
    """models/bert.EncoderModel with the file's weights."""
    from vllm_metal.models.bert import EncoderConfig, EncoderModel
    from vllm_metal.models.gguf_loader import GGUFCheckpoint
    from vllm_metal.models.linear_choice import choose_dense_layers

    ckpt = GGUFCheckpoint(str(gguf_path))
    config = EncoderConfig.from_dict(hf_cfg)
    model = EncoderModel(config)
    model.load_weights(list(weights(ckpt, config.num_hidden_layers, dtype).items()), strict=True)
    choose_dense_layers(model, linear)
    mx.eval(model.parameters())
    return model
