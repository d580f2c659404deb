"""BERT-family encoders (BERT, MiniLM, XLM-RoBERTa / BGE-M3 dense) on packed batches.

Many sequences of different lengths run as one packed batch of T rows: embeddings
(word + absolute position + token type, LayerNorm), then post-LN layers whose
attention is ``ops.varlen_attention`` (bidirectional, within each sequence). No padding
and no KV cache: a request's keys live for its forward only.

    model = load_encoder(directory)          # HF BertModel / sentence-transformers layout
    hidden = model(input_ids, cu_seqlens)    # [T, hidden] float32

XLM-RoBERTa numbers positions from padding_idx + 1 (HF's create_position_ids with no
padding). Cross-encoders (BertForSequenceClassification: pooler + classifier;
XLMRobertaForSequenceClassification: dense + tanh + out_proj on the first token) add
``scores``. Dense layers go where linear_choice puts them (gguf_matmul on the CPU).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from vllm_metal import ops
from vllm_metal.models.encoder_archs import BERT_ARCHITECTURES
from vllm_metal.models.gguf_linear import GGUFLinear

# ops.gelu: MLX's CPU erf / exp are scalar (GELU took a third of a MiniLM layer)
_ACTIVATIONS = {"gelu": ops.gelu, "gelu_new": lambda x: ops.gelu(x, approximate=True),
                "gelu_pytorch_tanh": lambda x: ops.gelu(x, approximate=True), "relu": nn.relu}
# the same GELUs as gguf_matmul's epilogue (GGUFLinear(x, activation=...))
_EPILOGUES = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}


def add_layer_norm(norm: nn.LayerNorm, x: mx.array, residual: mx.array) -> mx.array:
    """norm(x + residual). On the CPU one threaded pass (ops.layer_norm): MLX's CPU add and
    LayerNorm run on one thread each, while our GEMM and attention use every core. The GPU
    keeps MLX's add and its Metal LayerNorm (mx.fast.layer_norm), already one kernel each."""
    if mx.default_device() == mx.cpu:
        return ops.layer_norm(x, norm.weight, norm.bias, eps=norm.eps, residual=residual)
    return norm(x + residual)


@dataclass
class EncoderConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    position_offset: int = 0  # XLM-R / RoBERTa: padding_idx + 1
    classifier: str | None = None  # None | "bert" (pooler + classifier) | "roberta"
    num_labels: int = 0

    @classmethod
    def from_dict(cls, cfg: dict) -> "EncoderConfig":
        archs = cfg.get("architectures") or ["BertModel"]
        arch = archs[0]
        if arch not in BERT_ARCHITECTURES:
            raise ValueError(f"[vllm-metal] {arch} is not a supported encoder "
                             f"({', '.join(sorted(BERT_ARCHITECTURES))})")
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError("[vllm-metal] only absolute position embeddings are supported, got "
                             f"{cfg['position_embedding_type']!r}")
        act = cfg.get("hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"[vllm-metal] unsupported hidden_act {act!r}")
        roberta = cfg.get("model_type") in ("xlm-roberta", "roberta")
        classifier = None
        if arch.endswith("ForSequenceClassification"):
            classifier = "roberta" if roberta else "bert"
        return cls(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            intermediate_size=cfg["intermediate_size"],
            max_position_embeddings=cfg.get("max_position_embeddings", 512),
            type_vocab_size=cfg.get("type_vocab_size", 2),
            layer_norm_eps=cfg.get("layer_norm_eps", 1e-12), hidden_act=act,
            position_offset=cfg.get("pad_token_id", 1) + 1 if roberta else 0,
            classifier=classifier,
            num_labels=(len(cfg.get("id2label") or {}) or cfg.get("num_labels", 1))
            if classifier else 0)

    @property
    def max_tokens(self) -> int:
        """The longest sequence the position table holds."""
        return self.max_position_embeddings - self.position_offset


class _Embeddings(nn.Module):
    def __init__(self, c: EncoderConfig):
        super().__init__()
        self.word = nn.Embedding(c.vocab_size, c.hidden_size)
        self.position = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type = nn.Embedding(max(c.type_vocab_size, 1), c.hidden_size)
        self.norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def __call__(self, ids, positions, token_types):
        return add_layer_norm(self.norm, self.word(ids) + self.position(positions),
                              self.token_type(token_types))


class _Layer(nn.Module):
    def __init__(self, c: EncoderConfig):
        super().__init__()
        h = c.hidden_size
        self.heads = c.num_attention_heads
        self.head_dim = h // c.num_attention_heads
        self.qkv = nn.Linear(h, 3 * h)  # query, key, value fused at load
        self.attn_out = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=c.layer_norm_eps)
        self.up = nn.Linear(h, c.intermediate_size)
        self.down = nn.Linear(c.intermediate_size, h)
        self.out_norm = nn.LayerNorm(h, eps=c.layer_norm_eps)
        self.act = _ACTIVATIONS[c.hidden_act]
        self.epilogue = _EPILOGUES.get(c.hidden_act)

    def __call__(self, x, cu_seqlens):
        t = x.shape[0]
        qkv = self.qkv(x).reshape(t, 3, self.heads, self.head_dim)
        a = ops.varlen_attention(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens=cu_seqlens,
                                 scale=self.head_dim ** -0.5)
        x = add_layer_norm(self.attn_norm, self.attn_out(a.reshape(t, -1)), x)
        return add_layer_norm(self.out_norm, self.down(self.up_act(x)), x)

    def up_act(self, x):
        # on gguf_matmul (the CPU) GELU runs in the GEMM's epilogue with the bias; MLX's
        # nn.Linear (the GPU) keeps MLX's matmul and a separate (Metal) GELU
        if self.epilogue and isinstance(self.up, GGUFLinear):
            return self.up(x, activation=self.epilogue)
        return self.act(self.up(x))


class _Classifier(nn.Module):
    """The first token through dense + tanh, then a linear: BERT's pooler + classifier and
    RoBERTa's classification head (dense, out_proj) alike."""

    def __init__(self, c: EncoderConfig):
        super().__init__()
        self.pooler = nn.Linear(c.hidden_size, c.hidden_size)
        self.out = nn.Linear(c.hidden_size, c.num_labels)

    def __call__(self, first):
        return self.out(mx.tanh(self.pooler(first)))


class EncoderModel(nn.Module):
    """A BERT-family encoder over packed sequences; see the module docstring."""

    causal = False  # bidirectional: a prompt runs in one step (pooling.HiddenStateSource)

    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.config = config
        self.embeddings = _Embeddings(config)
        self.layers = [_Layer(config) for _ in range(config.num_hidden_layers)]
        if config.classifier:
            self.classifier = _Classifier(config)

    def positions_of(self, cu_seqlens: np.ndarray) -> np.ndarray:
        """Absolute positions of packed rows: 0.. per sequence, plus the model's offset."""
        cu = np.asarray(cu_seqlens, np.int64)
        lengths = np.diff(cu)
        if lengths.size and lengths.max() > self.config.max_tokens:
            raise ValueError(f"[vllm-metal] an input of {int(lengths.max())} tokens is longer "
                             f"than the model's {self.config.max_tokens}")
        starts = np.repeat(cu[:-1], lengths)
        return (np.arange(cu[-1]) - starts + self.config.position_offset).astype(np.int32)

    def __call__(self, input_ids, cu_seqlens, token_type_ids=None, positions=None) -> mx.array:
        """Final hidden states [T, hidden] of packed sequences.

        input_ids int [T]; cu_seqlens int32 [N + 1] (array-like); token_type_ids [T] or
        None (all 0); positions int32 [T] or None (0.. per sequence, plus the offset)."""
        cu_np = np.asarray(cu_seqlens, np.int32)
        ids = mx.array(input_ids).astype(mx.int32).reshape(-1)
        t = ids.shape[0]
        if cu_np.ndim != 1 or cu_np.size < 2 or cu_np[0] != 0 or cu_np[-1] != t \
                or np.any(np.diff(cu_np) < 0):
            raise ValueError(f"[vllm-metal] cu_seqlens must rise from 0 to {t}, got {cu_np.tolist()}")
        if positions is None:
            positions = self.positions_of(cu_np)
        positions = mx.array(positions).astype(mx.int32)
        types = (mx.zeros((t,), mx.int32) if token_type_ids is None
                 else mx.array(token_type_ids).astype(mx.int32).reshape(-1))
        if types.shape[0] != t or positions.shape != (t,):
            raise ValueError("[vllm-metal] token_type_ids and positions need one entry per token")
        cu = mx.array(cu_np)
        x = self.embeddings(ids, positions, types)
        for layer in self.layers:
            x = layer(x, cu)
        return x

    def scores(self, hidden: mx.array, cu_seqlens) -> mx.array:
        """Cross-encoder logits [N, num_labels] from the first token of each sequence."""
        if not self.config.classifier:
            raise ValueError("[vllm-metal] this encoder has no classification head")
        first = mx.array(np.asarray(cu_seqlens, np.int32)[:-1])
        return self.classifier(hidden[first])

    def torch_classifier(self, dtype):
        """The classification head as a torch function (first-token hidden states
        [n, hidden] -> logits [n, num_labels] in `dtype`), for vLLM's pooler heads."""
        import torch

        if not self.config.classifier:
            raise ValueError("[vllm-metal] this encoder has no classification head")

        def tensor(a):
            return torch.from_numpy(np.array(a.astype(mx.float32))).to(dtype)

        c = self.classifier
        w1, b1, w2, b2 = (tensor(c.pooler.weight), tensor(c.pooler.bias), tensor(c.out.weight),
                          tensor(c.out.bias))

        def classify(x):
            return torch.nn.functional.linear(torch.tanh(torch.nn.functional.linear(x.to(dtype), w1, b1)),
                                              w2, b2)

        return classify

    def hidden_states(self, input_ids, ctx, rows, token_type_ids=None) -> mx.array:
        """pooling.HiddenStateSource: hidden states at packed `rows` of the runner's batch,
        every row if None (ctx.cu_seqlens_q delimits whole prompts; ctx.positions are 0-based)."""
        cu = np.asarray(ctx.cu_seqlens_q, np.int32)
        positions = np.asarray(ctx.positions, np.int32) + self.config.position_offset
        hidden = self(input_ids, cu, token_type_ids, positions)
        return hidden if rows is None else hidden[mx.array(rows).astype(mx.int32)]


# ours <- HF names (after the "bert." / "roberta." prefix is dropped)
_RENAMES = [
    ("embeddings.word_embeddings.", "embeddings.word."),
    ("embeddings.position_embeddings.", "embeddings.position."),
    ("embeddings.token_type_embeddings.", "embeddings.token_type."),
    ("embeddings.LayerNorm.", "embeddings.norm."),
    ("attention.output.dense.", "attn_out."),
    ("attention.output.LayerNorm.", "attn_norm."),
    ("intermediate.dense.", "up."),
    ("output.dense.", "down."),
    ("output.LayerNorm.", "out_norm."),
    ("pooler.dense.", "classifier.pooler."),
    ("classifier.dense.", "classifier.pooler."),
    ("classifier.out_proj.", "classifier.out."),
]


def convert_weights(weights: dict[str, mx.array], config: EncoderConfig) -> dict[str, mx.array]:
    """HF state dict (BertModel, sentence-transformers, *ForSequenceClassification) -> ours."""
    out, qkv = {}, {}
    for name, w in weights.items():
        for prefix in ("bert.", "roberta.", "model."):
            if name.startswith(prefix):
                name = name[len(prefix):]
        if name.endswith("position_ids") or name.startswith(("lm_head.", "cls.")):
            continue
        if name.startswith("pooler.") and config.classifier != "bert":
            continue  # the embedding models' unused pooler
        if name == "classifier.weight" or name == "classifier.bias":
            name = "classifier.out." + name.split(".")[-1]
        name = name.replace("encoder.layer.", "layers.")
        for src, dst in _RENAMES:
            name = name.replace(src, dst)
        parts = name.split(".")
        if len(parts) == 6 and parts[2:4] == ["attention", "self"]:  # layers.i.attention.self.q.w
            qkv.setdefault((int(parts[1]), parts[5]), {})[parts[4]] = w
            continue
        out[name] = w
    for (i, kind), d in qkv.items():
        out[f"layers.{i}.qkv.{kind}"] = mx.concatenate([d["query"], d["key"], d["value"]], axis=0)
    return out


def load_encoder(directory: str | Path, dtype=mx.float32, linear: str = "gguf") -> EncoderModel:
    """An encoder from a directory with config.json and *.safetensors (HF / sentence-
    transformers layout). linear: see linear_choice ("gguf": our CPU GEMM on the CPU)."""
    from vllm_metal.models.linear_choice import choose_dense_layers

    directory = Path(directory)
    config = EncoderConfig.from_dict(json.loads((directory / "config.json").read_text()))
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"[vllm-metal] no *.safetensors in {directory}")
    weights = {}
    for f in files:
        weights.update(mx.load(str(f)))
    model = EncoderModel(config)
    converted = {k: v.astype(dtype) for k, v in convert_weights(weights, config).items()}
    model.load_weights(list(converted.items()), strict=True)
    choose_dense_layers(model, linear)
    mx.eval(model.parameters())
    return model
