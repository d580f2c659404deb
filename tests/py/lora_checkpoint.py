"""Random PEFT LoRA adapters for the tiny test checkpoints, and the merged
checkpoints they are checked against (W + scale * B @ A computed in NumPy)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np

PROJECTIONS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
               "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# Qwen3.5's gated delta net projections (targets beyond the default seven)
PARENTS = dict(PROJECTIONS, in_proj_qkv="linear_attn", in_proj_z="linear_attn",
               out_proj="linear_attn")


def base_weights(checkpoint) -> dict[str, np.ndarray]:
    w = mx.load(str(Path(checkpoint) / "model.safetensors"))
    return {k: np.array(v.astype(mx.float32)) for k, v in w.items()}


def write_adapter(out_dir, weights: dict, num_layers: int, *, r: int, alpha: float, seed: int,
                  targets=tuple(PROJECTIONS), layers=None, rank_pattern=None, alpha_pattern=None,
                  magnitude: float = 1.0, modules=None, use_rslora: bool = False) -> dict:
    """adapter_config.json + adapter_model.safetensors with PEFT's key names. Returns
    module name ("model.layers.0.self_attn.q_proj") -> (A [r, in], B [out, r], scale),
    float64, the scale as PEFT defines it (alpha / r, per-module patterns; alpha / sqrt(r)
    with use_rslora).
    modules: the module names to adapt (e.g. a MoE layer's "model.layers.0.mlp.experts.3.up_proj"),
    in place of layers x targets."""
    rng = np.random.default_rng(seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rank_pattern, alpha_pattern = rank_pattern or {}, alpha_pattern or {}
    tensors, deltas = {}, {}
    if modules is None:
        modules = [f"model.layers.{layer}.{PARENTS[proj]}.{proj}"
                   for layer in (range(num_layers) if layers is None else layers)
                   for proj in targets]
    for module in modules:
        if module + ".weight" not in weights:  # e.g. q_proj of a linear-attention layer
            continue
        w = weights[module + ".weight"]
        rank = next((v for k, v in rank_pattern.items() if module.endswith(k)), r)
        a_ = next((v for k, v in alpha_pattern.items() if module.endswith(k)), alpha)
        a = rng.standard_normal((rank, w.shape[1])) / np.sqrt(w.shape[1])
        b = rng.standard_normal((w.shape[0], rank)) * magnitude * np.abs(w).mean()
        a, b = a.astype(np.float32), b.astype(np.float32)
        tensors[f"base_model.model.{module}.lora_A.weight"] = a
        tensors[f"base_model.model.{module}.lora_B.weight"] = b
        deltas[module] = (a.astype(np.float64), b.astype(np.float64),
                          a_ / (np.sqrt(rank) if use_rslora else rank))
    config = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(targets),
              "bias": "none", "task_type": "CAUSAL_LM", "rank_pattern": rank_pattern,
              "alpha_pattern": alpha_pattern, "use_rslora": use_rslora}
    (out / "adapter_config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(out / "adapter_model.safetensors"),
                        {k: mx.array(v) for k, v in tensors.items()})
    return deltas


def write_merged(base_dir, out_dir, deltas: dict) -> Path:
    """The base checkpoint with W + scale * B @ A in place of each adapted W (NumPy,
    float64, stored float32); config and tokenizer copied."""
    base, out = Path(base_dir), Path(out_dir)
    shutil.copytree(base, out, ignore=shutil.ignore_patterns("model.safetensors"))
    weights = base_weights(base)
    for module, (a, b, scale) in deltas.items():
        key = module + ".weight"
        weights[key] = (weights[key].astype(np.float64) + scale * (b @ a)).astype(np.float32)
    mx.save_safetensors(str(out / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()})
    return out


def write_gguf_adapter(path, weights: dict, num_layers: int, *, arch: str, r: int, alpha: float | None,
                       seed: int, n_heads: int, n_kv_heads: int, targets=tuple(PROJECTIONS),
                       layers=None, magnitude: float = 1.0, b_dtype=np.float16, extra=None) -> dict:
    """A llama.cpp GGUF LoRA file (general.type adapter, adapter.lora.alpha, tensors
    blk.N.<tensor>.weight.lora_a [r, in] / .lora_b [out, r] in NumPy order), laid out as
    llama.cpp's converter does: for arch "llama" lora_b's q/k rows permuted per head like
    the base weights. lora_b is stored in `b_dtype`. Returns module -> (A, B, scale) in HF
    row order, float64, B as stored (rounded), scale alpha / r (1 when alpha is None, not
    written, or 0, as llama.cpp reads it). extra: more (key, uint32 list) metadata."""
    import gguf

    from vllm_metal.models.gguf_loader import _BLOCK_NAMES, permute_rows

    gguf_name = {v: k for k, v in _BLOCK_NAMES.items()}
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_type("adapter")
    writer.add_string("adapter.type", "lora")
    if alpha is not None:
        writer.add_float32("adapter.lora.alpha", float(alpha))
    for key, values in (extra or {}).items():
        writer.add_array(key, list(values))
    scale = alpha / r if alpha else 1.0
    deltas = {}
    for layer in (range(num_layers) if layers is None else layers):
        for proj in targets:
            module = f"model.layers.{layer}.{PROJECTIONS[proj]}.{proj}"
            w = weights[module + ".weight"]
            a = (rng.standard_normal((r, w.shape[1])) / np.sqrt(w.shape[1])).astype(np.float32)
            b = (rng.standard_normal((w.shape[0], r)) * magnitude * np.abs(w).mean()).astype(b_dtype)
            stored_b = b
            if arch == "llama" and proj in ("q_proj", "k_proj"):
                stored_b = permute_rows(b, n_heads if proj == "q_proj" else n_kv_heads)
            name = f"blk.{layer}.{gguf_name[f'{PROJECTIONS[proj]}.{proj}']}.weight"
            writer.add_tensor(name + ".lora_a", a)
            writer.add_tensor(name + ".lora_b", np.ascontiguousarray(stored_b))
            deltas[module] = (a.astype(np.float64), b.astype(np.float64), scale)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return deltas


def write_two_adapters(out_dir, base, num_layers: int) -> dict:
    """Adapters a1 (rank 8, every projection) and a2 (rank 4, q/v/down) in out_dir/a1 and
    out_dir/a2, strong enough to change greedy tokens; -> name -> write_adapter's deltas."""
    out, w = Path(out_dir), base_weights(base)
    return {"a1": write_adapter(out / "a1", w, num_layers, r=8, alpha=16, seed=41, magnitude=2.0),
            "a2": write_adapter(out / "a2", w, num_layers, r=4, alpha=8, seed=42, magnitude=2.0,
                                targets=("q_proj", "v_proj", "down_proj"))}


def merged_greedy(base, out_dir, deltas: dict, prompts: dict, max_tokens: int) -> dict:
    """name -> greedy tokens of prompts[name] on the base ("base") or on the base with
    deltas[name] merged (written to out_dir/m_<name>); asserts each adapter changes them."""
    from vllm_metal.models import load_model
    from vllm_metal.models.generate import greedy_generate

    want = {}
    for name, prompt in prompts.items():
        ckpt = base if name == "base" else write_merged(base, Path(out_dir) / f"m_{name}", deltas[name])
        want[name] = greedy_generate(load_model(str(ckpt), "float32"), [prompt], max_tokens,
                                     stop_ids=[])[0]
    assert len({tuple(v) for v in want.values()}) == len(want)  # each adapter matters
    return want
