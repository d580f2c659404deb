"""load_model: a local checkpoint -> PagedCausalLM with its KV-cache spec.

Sources:
- a directory with config.json and model*.safetensors: mlx-lm's own loader
  (mlx_lm.utils.load_model: sanitize, MLX-quantized checkpoints, ...);
- a .gguf file, or a directory prepare_gguf_dir made (config.json + model.gguf):
  gguf_loader; matrices stay in GGUF block form (memory ~ file size).

linear: "gguf" (default) runs GGUF matrices on ops.gguf_matmul straight from
their blocks (GGUFLinear / GGUFEmbedding); dense layers follow the device
(linear_choice.py: MLX's matmul on the GPU, gguf_matmul as type F32/F16/BF16
on the CPU). "mlx" is the reference path: GGUF weights dequantized at load,
mlx-lm's nn.Linear (MLX matmul). MLX-quantized checkpoints keep their
QuantizedLinear layers either way.

dtype: the requested one, else the checkpoint's own: the dtype most of the
weights are stored in (a float16 checkpoint whose config says bfloat16 stays
float16), gguf_loader.native_dtype for GGUF. Never upcast implicitly.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from vllm_metal.models.architectures import architecture_of, layer_sliding_windows, mlx_lm_classes, mlx_lm_config
from vllm_metal.models.gguf_linear import install_block_weights
from vllm_metal.models.gguf_loader import GGUF_FILE_IN_DIR
from vllm_metal.models.linear_choice import choose_dense_layers
from vllm_metal.models.moe import install_expert_blocks
from vllm_metal.models.paged_model import PagedCausalLM
from vllm_metal.models.stage_loading import evaluate_parameters

_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def _dtype(name: str) -> mx.Dtype:
    if name not in _DTYPES:
        raise ValueError(f"[vllm-metal] dtype must be one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


def _dtype_name(dtype: mx.Dtype) -> str:
    return {v: k for k, v in _DTYPES.items()}[dtype]


_LINEARS = ("gguf", "mlx")


def load(model_path: str, dtype: str | None = None, *, linear: str = "gguf", expert_offload=None):
    """-> LoadedModel; see vllm_metal.models.load_model."""
    if linear not in _LINEARS:
        raise ValueError(f"[vllm-metal] linear must be one of {_LINEARS}, got {linear!r}")
    path = Path(model_path).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _load_gguf(path, None, dtype, linear, expert_offload)
    if not path.is_dir():
        raise FileNotFoundError(f"[vllm-metal] model path not found: {model_path}")
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"[vllm-metal] {model_path} has no config.json")
    ggufs = [path / GGUF_FILE_IN_DIR] if (path / GGUF_FILE_IN_DIR).exists() else []
    if ggufs and not list(path.glob("model*.safetensors")):
        return _load_gguf(ggufs[0], path, dtype, linear, expert_offload)
    hf_config = json.loads((path / "config.json").read_text())
    if expert_offload is not None and _is_encoder(hf_config):
        _refuse_offload(hf_config)
    if _is_encoder(hf_config):
        return _load_encoder(path, hf_config, dtype, linear)
    if _is_qwen3_5(hf_config):
        from vllm_metal.models import qwen3_5_loader

        return qwen3_5_loader.load_safetensors(path, dtype, linear, expert_offload)
    return _load_safetensors(path, dtype, linear, expert_offload)


def _refuse_offload(hf_config: dict):
    raise ValueError(f"[vllm-metal] moe_expert_offload: not for {hf_config.get('architectures')} "
                     f"(streamed: Qwen3-MoE and Qwen3.5-MoE, safetensors or GGUF)")


def _is_qwen3_5(config: dict) -> bool:
    # hybrid (gated delta net + attention): its own model and loader, models/qwen3_5_*.py
    from vllm_metal.models.qwen3_5_paged import MODEL_TYPES

    return config.get("model_type") in MODEL_TYPES


def _is_encoder(config: dict) -> bool:
    # BERT family, EmbeddingGemma: bidirectional, no KV cache, pooling only (models/bert.py,
    # models/gemma3_encoder.py)
    from vllm_metal.models.encoder_archs import ENCODER_ARCHITECTURES

    return bool(set(config.get("architectures") or []) & ENCODER_ARCHITECTURES)


def _load_encoder(path: Path, hf_config: dict, dtype: str | None, linear: str,
                  gguf_path: Path | None = None):
    from vllm_metal.models import LoadedModel, ModelSpec, bert_gguf
    from vllm_metal.models.bert import load_encoder

    from vllm_metal.models.encoder_archs import GEMMA3_ENCODER_ARCHITECTURES
    from vllm_metal.models.gemma3_encoder import load_gemma3_encoder

    target = _dtype(dtype or "float32")
    if set(hf_config.get("architectures") or []) & GEMMA3_ENCODER_ARCHITECTURES:
        model = load_gemma3_encoder(path, target, linear)
        kv_heads, head_dim = model.config.num_key_value_heads, model.config.head_dim
    elif gguf_path is not None:
        model = bert_gguf.load_encoder(gguf_path, hf_config, target, linear)
        kv_heads = model.config.num_attention_heads
        head_dim = model.config.hidden_size // model.config.num_attention_heads
    else:
        model = load_encoder(path, target, linear)
        kv_heads = model.config.num_attention_heads
        head_dim = model.config.hidden_size // model.config.num_attention_heads
    c = model.config
    spec = ModelSpec(num_layers=c.num_hidden_layers, num_kv_heads=kv_heads,
                     head_dim=head_dim, dtype=_dtype_name(target),
                     sliding_window_per_layer=[0] * c.num_hidden_layers, vocab_size=c.vocab_size,
                     architecture=hf_config["architectures"][0])
    return LoadedModel(model=model, spec=spec, hf_config=hf_config, eos_token_ids=[])


def _load_safetensors(path: Path, dtype: str | None, linear: str, expert_offload=None):
    from mlx_lm.utils import load_config, load_model as mlx_lm_load_model

    hf_config = json.loads((path / "config.json").read_text())
    config = load_config(path)  # config.json + generation_config's eos_token_id
    arch = architecture_of(config)
    if expert_offload is not None:
        from vllm_metal.models.expert_offload import check_safetensors_layout

        check_safetensors_layout(path, hf_config)
    # a *ForSequenceClassification checkpoint holds a score layer instead of lm_head:
    # the body loads into the causal LM, the score layer comes from score_weights()
    lm, _ = mlx_lm_load_model(path, lazy=True, strict=not is_sequence_classifier(hf_config),
                              model_config=mlx_lm_config(config),
                              get_model_classes=lambda config: mlx_lm_classes(arch))
    if arch.model_type == "gpt_oss":  # MXFP4 experts kept aside by its sanitize
        from vllm_metal.models.gpt_oss import install_mxfp4_experts

        install_mxfp4_experts(lm)
    stored = _stored_dtype(lm)  # dtypes only: reads no weight
    target = _dtype(dtype) if dtype else stored
    cache = None
    if expert_offload is not None:  # before anything reads them: the experts stay on disk
        from vllm_metal.models import expert_offload as offload

        cache = offload.install(lm, expert_offload, directory=path, dtype=target)
    loaded = _finish(lm, config, hf_config, target, _eos_ids(config.get("eos_token_id")), linear)
    loaded.expert_cache = cache
    return loaded


def is_sequence_classifier(hf_config: dict) -> bool:
    return any(a.endswith("ForSequenceClassification") for a in hf_config.get("architectures") or [])


def score_weights(model_path: str):
    """(weight [num_labels, hidden], bias or None) of a checkpoint's score layer as
    float32 NumPy arrays, or None when it has none (safetensors checkpoints only)."""
    from safetensors import safe_open

    path = Path(model_path).expanduser()
    if not path.is_dir():
        return None
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:  # reads only the tensors asked for
            names = set(f.keys())
            if "score.weight" in names:
                weight = f.get_tensor("score.weight").float().numpy()
                bias = f.get_tensor("score.bias").float().numpy() if "score.bias" in names else None
                return weight, bias
    return None


def _load_gguf(gguf_path: Path, directory: Path | None, dtype: str | None, linear: str,
               expert_offload=None):
    from vllm_metal.models import bert_gguf, gguf_loader

    ckpt = gguf_loader.GGUFCheckpoint(str(gguf_path))
    if bert_gguf.is_bert(ckpt):  # an encoder (models/bert_gguf.py)
        hf_config = bert_gguf.hf_config(ckpt)
        if expert_offload is not None:
            _refuse_offload(hf_config)
        return _load_encoder(directory or gguf_path, hf_config, dtype, linear, gguf_path=gguf_path)
    if directory is not None:
        hf_config = json.loads((directory / "config.json").read_text())
    else:
        hf_config = gguf_loader.hf_config(ckpt)
    if expert_offload is not None and linear != "gguf":
        raise ValueError("[vllm-metal] moe_expert_offload: GGUF experts stream in block form "
                         "(linear='gguf'), not on the dequantized reference path")
    if _is_qwen3_5(hf_config):
        from vllm_metal.models import qwen3_5_loader

        return qwen3_5_loader.load_gguf(gguf_path, hf_config, dtype, linear, expert_offload)
    target = _dtype(dtype or gguf_loader.native_dtype(ckpt))
    arch = architecture_of(hf_config)
    model_class, args_class = mlx_lm_classes(arch)
    lm = model_class(args_class.from_dict(mlx_lm_config(hf_config)))
    cache = None
    if expert_offload is not None:  # the expert tensors are never read at load
        from vllm_metal.models import expert_offload as offload

        cache = offload.install(lm, expert_offload, ckpt=ckpt)
        weights = gguf_loader.load_weights(offload.hide_gguf_experts(ckpt), hf_config, target,
                                           blocks=True)
    else:
        weights = gguf_loader.load_weights(ckpt, hf_config, target, blocks=linear == "gguf")
    if hasattr(lm, "sanitize"):
        weights = lm.sanitize(weights)
    if arch.model_type == "gpt_oss":  # experts under mlp.experts, with biases
        from vllm_metal.models.gpt_oss import hold_expert_blocks

        weights = hold_expert_blocks(lm, weights)
    weights = install_expert_blocks(lm, weights)
    weights = install_block_weights(lm, weights)
    lm.load_weights(list(weights.items()), strict=True)
    if arch.model_type == "gpt_oss":
        from vllm_metal.models.gpt_oss import install_mxfp4_experts

        install_mxfp4_experts(lm)
    lm.eval()
    loaded = _finish(lm, hf_config, hf_config, target, gguf_loader.eos_token_ids(ckpt), linear)
    loaded.expert_cache = cache
    return loaded


def _stored_dtype(lm) -> mx.Dtype:
    """The float dtype holding most parameters (quantized weights count by their scales)."""
    counts = Counter()
    for _, p in tree_flatten(lm.parameters()):
        if mx.issubdtype(p.dtype, mx.floating):
            counts[p.dtype] += p.size
    return counts.most_common(1)[0][0] if counts else mx.float32


def _finish(lm, config: dict, hf_config: dict, dtype: mx.Dtype, eos_ids: list[int], linear: str):
    from vllm_metal.models import LoadedModel, ModelSpec

    choose_dense_layers(lm, linear)
    model = PagedCausalLM.adapt(lm, config)
    model.set_dtype(dtype)
    model.fold_norm_offsets()
    model.eval()
    evaluate_parameters(model)  # a pipeline stage's layers only (stage_loading.py)

    attn = model.layers[0].self_attn
    spec = ModelSpec(
        num_layers=len(model.layers),
        num_kv_heads=attn.num_kv_heads,
        head_dim=attn.head_dim,
        dtype=_dtype_name(dtype),
        sliding_window_per_layer=layer_sliding_windows(config),
        vocab_size=int(config["vocab_size"]),
        architecture=architecture_of(config).hf_architecture,
    )
    return LoadedModel(model=model, spec=spec, hf_config=hf_config, eos_token_ids=eos_ids)


def _eos_ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]
