"""A PEFT adapter directory (adapter_config.json + adapter_model.safetensors) read
into float32 NumPy (A, B, scale) per target projection, checked against the model.

vLLM's PEFTHelper parses the config (lora_alpha / r, rsLoRA, rank_pattern,
alpha_pattern, unsupported features); the tensors are read with safetensors'
NumPy reader. Every problem is a ValueError naming it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import numpy as np

from vllm_metal.lora.http_status import REFUSED

# projection -> its parent module in mlx-lm's llama/qwen3/qwen3_5 layers (the last three:
# Qwen3.5's gated delta net; in_proj_b / in_proj_a are per-head gate scalars, not adapted)
TARGETS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp",
           "in_proj_qkv": "linear_attn", "in_proj_z": "linear_attn", "out_proj": "linear_attn"}

# base_model.model.model.layers.3.self_attn.q_proj.lora_A[.default].weight
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.*?)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")
_LAYER = re.compile(r"(?:^|\.)layers\.(?P<layer>\d+)\.(?P<parent>self_attn|mlp|linear_attn)\.(?P<proj>\w+)$")
# sparse-MoE MLPs: a routed expert's projection (vLLM's per-expert names) or the shared
# expert's (Qwen3.5-MoE); the key is "experts.E.gate_proj" / "shared_expert.gate_proj"
_MOE = re.compile(r"(?:^|\.)layers\.(?P<layer>\d+)\.mlp\.(?P<proj>(?:experts\.\d+|shared_expert)"
                  r"\.(?:gate_proj|up_proj|down_proj))$")


@dataclass
class LoraAdapter:
    name: str
    path: str
    # (layer, projection) -> (A float32 [r, in], B float32 [out, r], scale)
    weights: dict = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return max((a.shape[0] for a, _, _ in self.weights.values()), default=0)


def _read_safetensors(path: str) -> dict[str, np.ndarray]:
    """The file's tensors as float32 NumPy (bfloat16 widened by hand: NumPy has none)."""
    import json
    import struct

    with open(path, "rb") as f:
        header_len = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(header_len))
        data = f.read()
    kinds = {"F32": np.float32, "F16": np.float16, "F64": np.float64}
    out = {}
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        begin, end = meta["data_offsets"]
        raw = data[begin:end]
        dt = meta["dtype"]
        if dt == "BF16":
            bits = np.frombuffer(raw, np.uint16).astype(np.uint32) << 16
            arr = bits.view(np.float32)
        elif dt in kinds:
            arr = np.frombuffer(raw, kinds[dt]).astype(np.float32)
        else:
            raise ValueError(f"tensor {key} has dtype {dt}; adapters must be F32, F16 or BF16")
        out[key] = arr.reshape(meta["shape"])
    return out


def load_peft_adapter(name: str, path: str, shapes: dict, max_rank: int,
                      max_position_embeddings: int | None = None, stage: range | None = None,
                      num_layers: int | None = None) -> LoraAdapter:
    """shapes: (layer, projection) -> (in, out) of the model's projections; stage: the
    layers this model holds (a pipeline stage's), of the checkpoint's num_layers."""
    from vllm.lora.peft_helper import PEFTHelper

    where = f"{REFUSED}'{name}' ({path})"  # the API server answers 400 (http_status.py)
    config_path = os.path.join(path, "adapter_config.json")
    weights_path = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(config_path):
        # vLLM's own error: its API server answers 404 for it
        from vllm.exceptions import LoRAAdapterNotFoundError

        raise LoRAAdapterNotFoundError(name, path)
    if not os.path.isfile(weights_path):
        raise ValueError(f"{where}: adapter_model.safetensors not found")
    try:
        peft = PEFTHelper.from_local_dir(path, max_position_embeddings)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: bad adapter_config.json: {e}") from e
    problems = peft._validate_features()
    if peft.bias != "none":
        problems.append("adapter bias is not supported")
    if problems:
        raise ValueError(f"{where}: {' '.join(problems)}")
    try:
        tensors = _read_safetensors(weights_path)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise ValueError(f"{where}: unexpected tensor {key} (only lora_A / lora_B weights "
                             f"of {', '.join(TARGETS)} are supported)")
        pairs.setdefault(m["module"], {})[m["ab"]] = value
    adapter = LoraAdapter(name=name, path=path)
    num_layers = num_layers or 1 + max((l for l, _ in shapes), default=-1)
    stage = stage or range(num_layers)
    for module, ab in sorted(pairs.items()):
        m = _MOE.search(module) or _LAYER.search(module)
        if m is None or ("parent" in m.groupdict() and TARGETS.get(m["proj"]) != m["parent"]):
            raise ValueError(f"{where}: target module {module} is not one the model has "
                             f"(supported: {', '.join(TARGETS)} of each layer, and a MoE "
                             f"layer's mlp.experts.E.* / mlp.shared_expert.*)")
        if "A" not in ab or "B" not in ab:
            raise ValueError(f"{where}: {module} lacks its lora_{'B' if 'A' in ab else 'A'} weight")
        rank, scale = peft.get_rank_and_scaling(module.removeprefix("base_model.model."))
        a, b = ab["A"], ab["B"]
        if a.ndim == 2 and a.shape[0] != rank:
            raise ValueError(f"{where}: {module}: rank {a.shape[0]} in the weights, "
                             f"{rank} in adapter_config.json")
        add_checked(adapter, where, module, int(m["layer"]), m["proj"], a, b, float(scale),
                    shapes, max_rank, num_layers, stage)
    if not adapter.weights and len(stage) == num_layers:  # a stage may hold none of them
        raise ValueError(f"{where}: no LoRA weights in adapter_model.safetensors")
    return adapter


def add_checked(adapter: LoraAdapter, where: str, module: str, layer: int, proj: str,
                a: np.ndarray, b: np.ndarray, scale: float, shapes: dict, max_rank: int,
                num_layers: int, stage: range) -> None:
    """Checks one (A [r, in], B [out, r]) pair against the model's projection and
    --max-lora-rank, and stores it; a ValueError naming `module` otherwise. A layer of
    another pipeline stage is left to that stage."""
    if layer >= num_layers:
        raise ValueError(f"{where}: target module {module}: the model has {num_layers} layers")
    if layer not in stage:
        return
    if (layer, proj) not in shapes:  # e.g. a sparse-MoE layer has no dense gate/up/down
        what = proj if "." in proj else f"dense {proj}"  # experts.E.* / shared_expert.*
        raise ValueError(f"{where}: target module {module} is not one the model has "
                         f"(layer {layer} has no {what})")
    in_dim, out_dim = shapes[(layer, proj)]
    if a.ndim != 2 or b.ndim != 2 or a.shape != (a.shape[0], in_dim) \
            or b.shape != (out_dim, a.shape[0]):
        raise ValueError(f"{where}: {module}: lora_A {list(a.shape)} / lora_B {list(b.shape)} "
                         f"do not match the model's projection [in={in_dim}, out={out_dim}] "
                         f"(expected lora_A [r, {in_dim}], lora_B [{out_dim}, r])")
    rank = a.shape[0]
    if rank > max_rank:
        raise ValueError(f"{where}: {module}: rank {rank} exceeds --max-lora-rank {max_rank}")
    adapter.weights[(layer, proj)] = (a, b, float(scale))
