"""llama.cpp's GGUF LoRA adapter files read into the same per-module (A, B, scale)
as a PEFT directory (adapter.py), checked against the model.

The format, as llama.cpp's loader reads it:
- metadata general.type = "adapter", adapter.type = "lora", general.architecture the
  base model's, adapter.lora.alpha (float; absent or 0 means a scale of 1);
- per adapted tensor `<base tensor name>.lora_a` and `.lora_b` (blk.N.attn_q.weight.lora_a),
  ggml shapes a [in, r], b [r, out], i.e. NumPy A [r, in], B [out, r] as in PEFT;
- scale = alpha / r with r the pair's rank;
- norm-vector tensors (`*_norm.weight`) are ignored by llama.cpp; so here.
llama.cpp's converter permutes lora_b's rows of attn_q / attn_k for the "llama"
architecture exactly as it permutes the base weights; our loaders keep Q/K in HF row
order (models/gguf_loader.py), so those lora_b rows are un-permuted here.
"""

from __future__ import annotations

import re

import numpy as np

from vllm_metal.lora.adapter import TARGETS, LoraAdapter, add_checked
from vllm_metal.lora.http_status import REFUSED
from vllm_metal.log import get_logger

logger = get_logger(__name__)

_PAIR = re.compile(r"^(?P<base>.+)\.lora_(?P<ab>[ab])$")


def is_gguf_file(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _string(reader, key: str) -> str | None:
    field = reader.fields.get(key)
    return None if field is None else str(field.contents())


def _dense(tensor) -> np.ndarray:
    """float32 NumPy [rows, cols] of a GGUF tensor (float or block-quantized)."""
    from vllm_metal.models.gguf_loader import numpy_dequantize

    shape = tuple(int(n) for n in reversed(tensor.shape))  # ggml ne -> NumPy order
    return numpy_dequantize(tensor.data, int(tensor.tensor_type)).reshape(shape)


def _compatible(adapter_arch: str, model_arch) -> bool:
    from vllm_metal.models.gguf_loader import GGUF_ARCHS

    spec = GGUF_ARCHS.get(adapter_arch)
    if spec is None or model_arch is None:
        return False
    # llama.cpp converts mistral-style checkpoints as "llama" too
    return spec.model_type == model_arch.model_type or (
        adapter_arch == "llama" and model_arch.mlx_lm_module == "llama")


def _qwen35_target(base: str, num_layers: int) -> str | None:
    """mlx-lm name of a qwen35 adapter's target tensor (gguf_qwen35's names)."""
    from vllm_metal.models import gguf_qwen35

    try:
        return gguf_qwen35._name(base, num_layers)
    except ValueError:
        return None


def _qwen35_value_order(proj: str, a: np.ndarray, b: np.ndarray, linear_heads):
    """(a, b) of a qwen35 adapter in HF's grouped value-head order: llama.cpp's converter
    tiles the value heads of in_proj_qkv's V rows, in_proj_z's rows and out_proj's
    columns (models/gguf_qwen35.py), in the adapter's lora_b rows / lora_a columns too."""
    from vllm_metal.models.gguf_qwen35 import tiled_to_grouped

    num_k, num_v, dk, dv = linear_heads
    if num_v == num_k or proj not in ("in_proj_qkv", "in_proj_z", "out_proj"):
        return a, b
    heads = (tiled_to_grouped(num_k, num_v)[:, None] * dv + np.arange(dv)[None]).reshape(-1)
    if proj == "out_proj":
        if a.shape[1] != heads.size:
            return a, b  # a wrong shape: add_checked names it
        return a[:, heads], b
    offset = 2 * num_k * dk if proj == "in_proj_qkv" else 0
    if b.shape[0] != offset + heads.size:
        return a, b
    idx = np.arange(b.shape[0])
    idx[offset:] = heads + offset
    return a, b[idx]


def load_gguf_adapter(name: str, path: str, shapes: dict, max_rank: int, model_arch,
                      qk_heads: dict, linear_heads=None, stage: range | None = None,
                      num_layers: int | None = None) -> LoraAdapter:
    """shapes: (layer, projection) -> (in, out); stage: the layers this model holds (a
    pipeline stage's) of the checkpoint's num_layers; model_arch: models.architectures.
    Architecture of the base (None: Qwen3.5); qk_heads: {"q_proj": heads, "k_proj": kv
    heads}; linear_heads: Qwen3.5's (key heads, value heads, key dim, value dim)."""
    import gguf

    from vllm_metal.models.gguf_loader import GGUF_ARCHS, mlx_lm_name, unpermute_rows
    from vllm_metal.lora.adapter import _LAYER

    where = f"{REFUSED}'{name}' ({path})"  # the API server answers 400 (http_status.py)
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - any parse failure is a bad file
        raise ValueError(f"{where}: not a readable GGUF file: {e}") from e
    kind, adapter_type = _string(reader, "general.type"), _string(reader, "adapter.type")
    if kind != "adapter" or adapter_type != "lora":
        raise ValueError(f"{where}: not a GGUF LoRA adapter (general.type {kind!r}, "
                         f"adapter.type {adapter_type!r}; expected 'adapter' and 'lora')")
    arch = _string(reader, "general.architecture")
    qwen35 = model_arch is None  # Qwen3.5 (llama.cpp: "qwen35", "qwen35moe")
    if qwen35 and arch not in ("qwen35", "qwen35moe"):
        raise ValueError(f"{where}: adapter architecture {arch!r} does not match the model "
                         "(qwen3_5)")
    if not qwen35 and not _compatible(arch, model_arch):
        raise ValueError(f"{where}: adapter architecture {arch!r} does not match the model "
                         f"({model_arch.model_type})")
    if "adapter.alora.invocation_tokens" in reader.fields:
        raise ValueError(f"{where}: activated LoRA (adapter.alora.*) is not supported")
    alpha_field = reader.fields.get("adapter.lora.alpha")
    alpha = float(alpha_field.contents()) if alpha_field is not None else 0.0
    permuted = not qwen35 and GGUF_ARCHS[arch].permuted_qk

    pairs: dict[str, dict[str, object]] = {}
    for t in reader.tensors:
        m = _PAIR.match(t.name)
        if m is None:
            if t.name.endswith("_norm.weight"):  # as llama.cpp: norm deltas are not applied
                logger.warning("%s: ignoring %s (norm tensors are not applied)", where, t.name)
                continue
            raise ValueError(f"{where}: unexpected tensor {t.name} (only .lora_a / .lora_b "
                             "pairs are supported)")
        pairs.setdefault(m["base"], {})[m["ab"]] = t
    adapter = LoraAdapter(name=name, path=path)
    num_layers = num_layers or 1 + max((l for l, _ in shapes), default=-1)
    stage = stage or range(num_layers)
    for base, ab in sorted(pairs.items()):
        if not base.endswith(".weight"):
            target = None
        elif qwen35:
            target = _qwen35_target(base, num_layers)
        else:
            target = mlx_lm_name(base, model_arch.model_type)
        m = _LAYER.search(target.removesuffix(".weight")) if target else None
        if m is None or TARGETS.get(m["proj"]) != m["parent"]:
            raise ValueError(f"{where}: target tensor {base} is not one LoRA applies to "
                             "(supported: attn_q, attn_k, attn_v, attn_output, ffn_gate, "
                             "ffn_up, ffn_down of each block; on qwen35 attn_qkv, attn_gate, "
                             "ssm_out too)")
        if "a" not in ab or "b" not in ab:
            raise ValueError(f"{where}: {base} lacks its lora_{'b' if 'a' in ab else 'a'} tensor")
        a, b = _dense(ab["a"]), _dense(ab["b"])
        proj = m["proj"]
        if a.ndim == 2 and b.ndim == 2 and b.shape[1] != a.shape[0]:
            raise ValueError(f"{where}: {base}: lora_a rank {a.shape[0]} and lora_b rank "
                             f"{b.shape[1]} differ")
        if permuted and proj in qk_heads and b.ndim == 2:
            heads = qk_heads[proj]
            if b.shape[0] % (2 * heads):
                raise ValueError(f"{where}: {base}: lora_b has {b.shape[0]} rows, not a whole "
                                 f"number of {heads} heads")
            b = np.asarray(unpermute_rows(b, heads))
        if qwen35 and a.ndim == 2 and b.ndim == 2 and linear_heads is not None:
            a, b = _qwen35_value_order(proj, a, b, linear_heads)
        rank = a.shape[0] if a.ndim == 2 else 0
        scale = alpha / rank if alpha and rank else 1.0
        add_checked(adapter, where, base, int(m["layer"]), proj, a, b, scale, shapes, max_rank,
                    num_layers, stage)
    if not adapter.weights and len(stage) == num_layers:  # a stage may hold none of them
        raise ValueError(f"{where}: no LoRA tensors in the file")
    return adapter
