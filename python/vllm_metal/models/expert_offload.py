"""--additional-config '{"moe_expert_offload": {...}}': MoE experts stay on disk.

The option (one of the three sizes):
  cache_gb        the expert cache's size in GiB (all pools together);
  cache_fraction  the share of all the model's experts the cache holds (0 < f <= 1);
  cache_experts   how many experts (gate + up + down of one expert of one layer) it holds;
  prefetch        read the next layer's likely experts in the background (default false:
                  it lost on this machine, docs/benchmarks.md#moe-expert-streaming);
  prefetch_guess  "router" (default: the next layer's router on this layer's input) or
                  "last" (the experts the next layer used in the previous step);
  policy          "lru" (default) or "fifo" (for measuring what LRU buys).

At load, each MoE layer's mlx-lm `switch_mlp` (stacked expert weights) is replaced by
a `StreamedSwitchGLU` holding only where each expert's bytes are in the checkpoint:
safetensors header offsets (per-expert tensors `mlp.experts.{e}.{proj}.weight`, or
stacked `mlp.switch_mlp.{proj}.weight` [E, ...] whose expert e is one contiguous
slice), or a GGUF file's tensor data offsets (ffn_*_exps [E, rows, cols] in block
form, expert e is bytes [e * n / E, (e + 1) * n / E)). The expert tensors are never
read at load; expert_cache.py reads them on demand into a bounded pool.

gpt-oss (its `mlp.experts`, SwitchGLU with biases and the clamped SwiGLU) streams too:
transformers' dense gate_up_proj [E, H, 2I] / down_proj [E, I, H] or MXFP4
*_blocks / *_scales (expert e one contiguous slice of each), converted per expert as
models/gpt_oss.py does at load (gate / up interleaved; MXFP4 repacked into GGUF
blocks), or a GGUF file's ffn_*_exps. Its expert biases ([E, I], [E, H]: 1 / H of the
weights) stay resident, as the router does.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from vllm_metal.models.expert_cache import (ExpertBytes, ExpertCache, ExpertPool, ProjSpec,
                                            StreamedExperts)

OPTION = "moe_expert_offload"
_SIZES = ("cache_gb", "cache_fraction", "cache_experts")
_KEYS = set(_SIZES) | {"prefetch", "prefetch_guess", "policy"}
_PROJS = ("gate_proj", "up_proj", "down_proj")
_GGUF_PROJS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
_FLOAT_DTYPES = {"F32", "F16", "BF16"}


@dataclass(frozen=True)
class OffloadConfig:
    cache_gb: float | None = None
    cache_fraction: float | None = None
    cache_experts: int | None = None
    prefetch: bool = False
    prefetch_guess: str = "router"
    policy: str = "lru"

    @classmethod
    def parse(cls, value) -> "OffloadConfig":
        """The option's value (a dict) checked; ValueError with a message otherwise."""
        if not isinstance(value, dict):
            raise ValueError(f"[vllm-metal] {OPTION} must be an object like {{\"cache_gb\": 4}}, "
                             f"got {value!r}")
        unknown = set(value) - _KEYS
        if unknown:
            raise ValueError(f"[vllm-metal] {OPTION}: unknown keys {sorted(unknown)}; "
                             f"known: {sorted(_KEYS)}")
        given = [k for k in _SIZES if value.get(k) is not None]
        if len(given) != 1:
            raise ValueError(f"[vllm-metal] {OPTION} needs exactly one of {list(_SIZES)}, "
                             f"got {given or 'none'}")
        size = value[given[0]]
        if isinstance(size, bool) or not isinstance(size, (int, float)) or size <= 0:
            raise ValueError(f"[vllm-metal] {OPTION}.{given[0]} must be a positive number, "
                             f"got {size!r}")
        if given[0] == "cache_fraction" and size > 1:
            raise ValueError(f"[vllm-metal] {OPTION}.cache_fraction must be in (0, 1], got {size}")
        if given[0] == "cache_experts" and int(size) != size:
            raise ValueError(f"[vllm-metal] {OPTION}.cache_experts must be an integer, got {size}")
        policy = value.get("policy", "lru")
        if policy not in ("lru", "fifo"):
            raise ValueError(f"[vllm-metal] {OPTION}.policy must be 'lru' or 'fifo', got {policy!r}")
        prefetch = value.get("prefetch", False)
        if not isinstance(prefetch, bool):
            raise ValueError(f"[vllm-metal] {OPTION}.prefetch must be true or false, got {prefetch!r}")
        guess = value.get("prefetch_guess", "router")
        if guess not in ("router", "last"):
            raise ValueError(f"[vllm-metal] {OPTION}.prefetch_guess must be 'router' or 'last', "
                             f"got {guess!r}")
        return cls(**{given[0]: size}, prefetch=prefetch, prefetch_guess=guess, policy=policy)

    @classmethod
    def from_additional(cls, additional: dict | None) -> "OffloadConfig | None":
        value = (additional or {}).get(OPTION)
        return None if value is None else cls.parse(value)


class StreamedSwitchGLU(nn.Module):
    """Stands where mlx-lm's SwitchGLU was: no parameters, the layer's experts on disk."""

    def __init__(self, streamed: StreamedExperts):
        super().__init__()
        self.streamed = streamed
        self.exact = True  # GGUF experts: float32 activations (gguf_linear.set_exact_activations)

    def run(self, x, logits, *, top_k: int, scoring: str, renormalize: bool):
        self.streamed.exact = self.exact
        return self.streamed.run(x, logits, top_k=top_k, scoring=scoring, renormalize=renormalize)


class _Bias(nn.Module):
    def __init__(self, bias: mx.array):
        super().__init__()
        self.bias = bias


class StreamedBiasedSwitchGLU(StreamedSwitchGLU):
    """gpt-oss's experts on disk: only the biases are parameters (gate_proj.bias, ...: the
    names mlx-lm's SwitchGLU gives them, so a GGUF file's biases load into them)."""

    def __init__(self, streamed: StreamedExperts, biases: list):
        super().__init__(streamed)
        self.gate_proj, self.up_proj, self.down_proj = (_Bias(b) for b in biases)
        streamed.activation = "swiglu_oai"

    def run(self, x, logits, *, top_k: int, scoring: str, renormalize: bool):
        self.streamed.biases = (self.gate_proj.bias, self.up_proj.bias, self.down_proj.bias)
        return super().run(x, logits, top_k=top_k, scoring=scoring, renormalize=renormalize)


def _refuse(msg: str):
    raise ValueError(f"[vllm-metal] {OPTION}: {msg}")


# ---- where the experts are ---------------------------------------------------------
def _safetensors_index(directory: Path) -> dict:
    """name -> (path, absolute offset, nbytes, dtype, shape) over every *.safetensors, under
    the text model's names (a vision + language checkpoint's language_model prefix dropped)."""
    from vllm_metal.models.qwen3_5_loader import text_weight_name

    index = {}
    for file in sorted(directory.glob("*.safetensors")):
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            name = text_weight_name(name)
            if name is not None:
                index[name] = (str(file), 8 + n + start, end - start, info["dtype"],
                               tuple(info["shape"]))
    return index


def _safetensors_layer(index: dict, layer: int, num_experts: int) -> list:
    """Expert e of `layer` -> [ExpertBytes gate, up, down] (+ the per-expert shapes)."""
    pre = f"model.layers.{layer}.mlp"
    for proj in _PROJS:
        for quant in (f"{pre}.experts.0.{proj}.scales", f"{pre}.switch_mlp.{proj}.scales"):
            if quant in index:
                _refuse(f"{quant}: MLX-quantized experts cannot be streamed yet; serve a "
                        f"float16/bfloat16 checkpoint or a GGUF file")
    fused = _fused_layer(index, pre, num_experts)
    if fused is not None:
        return fused
    out = [[None] * 3 for _ in range(num_experts)]
    shapes = [None] * 3
    for j, proj in enumerate(_PROJS):
        stacked = index.get(f"{pre}.switch_mlp.{proj}.weight")
        for e in range(num_experts):
            if stacked is not None:
                path, off, nbytes, dtype, shape = stacked
                if len(shape) != 3 or shape[0] != num_experts:
                    _refuse(f"{pre}.switch_mlp.{proj}.weight has shape {shape}, expected "
                            f"[{num_experts}, rows, cols]")
                per = nbytes // num_experts
                where, shape = (path, off + e * per, per, dtype), tuple(shape[1:])
            else:
                name = f"{pre}.experts.{e}.{proj}.weight"
                if name not in index:
                    others = sorted(n for n in index if n.startswith(f"{pre}.") and "expert" in n)
                    _refuse(f"layer {layer}: expert layout unknown (no {name} nor "
                            f"{pre}.switch_mlp.{proj}.weight; found e.g. {others[:3]})")
                path, off, nbytes, dtype, shape = index[name]
                where = (path, off, nbytes, dtype)
            if where[3] not in _FLOAT_DTYPES:
                _refuse(f"layer {layer} {proj}: expert dtype {where[3]} cannot be streamed "
                        f"(supported: {sorted(_FLOAT_DTYPES)})")
            out[e][j] = ExpertBytes(*where)
            if shapes[j] is None:
                shapes[j] = shape
    return out, shapes


def _fused_layer(index: dict, pre: str, num_experts: int):
    """HF's fused layout (the published Qwen3.5-MoE checkpoints): experts.gate_up_proj
    [E, 2I, H] (expert e's gate rows, then its up rows: two contiguous halves of its
    slice) and experts.down_proj [E, H, I]; None when the layer is not in it."""
    gate_up, down = index.get(f"{pre}.experts.gate_up_proj"), index.get(f"{pre}.experts.down_proj")
    if gate_up is None and down is None:
        return None
    if gate_up is None or down is None:
        _refuse(f"{pre}.experts: gate_up_proj and down_proj must both be present")
    for (path, off, nbytes, dtype, shape), name in ((gate_up, "gate_up_proj"), (down, "down_proj")):
        if len(shape) != 3 or shape[0] != num_experts or dtype not in _FLOAT_DTYPES:
            _refuse(f"{pre}.experts.{name}: expected [{num_experts}, rows, cols] in "
                    f"{sorted(_FLOAT_DTYPES)}, got {shape} {dtype}")
    gpath, goff, gbytes, gdtype, gshape = gate_up
    dpath, doff, dbytes, ddtype, dshape = down
    gper, dper = gbytes // num_experts, dbytes // num_experts
    out = [[ExpertBytes(gpath, goff + e * gper, gper // 2, gdtype),
            ExpertBytes(gpath, goff + e * gper + gper // 2, gper // 2, gdtype),
            ExpertBytes(dpath, doff + e * dper, dper, ddtype)] for e in range(num_experts)]
    half = (gshape[1] // 2, gshape[2])
    return out, [half, half, tuple(dshape[1:])]


_NP = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def _gpt_oss_layer(index: dict, layer: int, num_experts: int):
    """gpt-oss: expert e -> [its gate_up slice, its down slice] (+ the MXFP4 scales'), the
    converter to the three slot arrays, their specs, the GGUF types (MXFP4) or None, I."""
    from vllm_metal.models.gpt_oss import MXFP4_TYPE_ID, mxfp4_to_gguf_blocks

    pre = f"model.layers.{layer}.mlp.experts"
    names = [f"{pre}.gate_up_proj", f"{pre}.down_proj"]
    mxfp4 = f"{pre}.gate_up_proj_blocks" in index
    if mxfp4:
        names = [f"{n}{suffix}" for n in names for suffix in ("_blocks", "_scales")]
    infos = []
    for name in names:
        if name not in index:
            others = sorted(n for n in index if n.startswith(f"{pre}."))
            _refuse(f"layer {layer}: expert layout unknown (no {name}; found e.g. {others[:3]})")
        path, off, nbytes, dtype, shape = index[name]
        if shape[0] != num_experts or (not mxfp4 and dtype not in _FLOAT_DTYPES) or \
                (mxfp4 and dtype != "U8"):
            _refuse(f"{name}: expected [{num_experts}, ...] in "
                    f"{'U8' if mxfp4 else sorted(_FLOAT_DTYPES)}, got {shape} {dtype}")
        infos.append((path, off, nbytes // num_experts, dtype, tuple(shape[1:])))
    where = [[ExpertBytes(p, off + e * per, per, "blocks" if mxfp4 else dt)
              for p, off, per, dt, _ in infos] for e in range(num_experts)]
    if mxfp4:
        (_, _, _, _, gu_shape), _, (_, _, _, _, d_shape), _ = infos
        inter, hidden = gu_shape[0] // 2, d_shape[0]

        def convert(bufs):
            gu_b, gu_s, d_b, d_s = (mx.array(np.frombuffer(b, np.uint8)) for b in bufs)
            gu = mxfp4_to_gguf_blocks(gu_b.reshape(infos[0][4]), gu_s.reshape(infos[1][4]))
            d = mxfp4_to_gguf_blocks(d_b.reshape(infos[2][4]), d_s.reshape(infos[3][4]))
            return [gu[0::2].reshape(-1), gu[1::2].reshape(-1), d.reshape(-1)]

        per_gu = inter * gu_shape[1] * 17
        specs = (ProjSpec((per_gu,), mx.uint8), ProjSpec((per_gu,), mx.uint8),
                 ProjSpec((hidden * d_shape[1] * 17,), mx.uint8))
        return where, convert, specs, (MXFP4_TYPE_ID,) * 3, inter
    (_, _, _, gdt, (hidden, two_i)), (_, _, _, ddt, _) = infos

    def convert(bufs):
        def arr(b, dt, shape):
            a = mx.array(np.frombuffer(b, _NP[dt]))
            return (a.view(mx.bfloat16) if dt == "BF16" else a).reshape(shape)
        gu = arr(bufs[0], gdt, (hidden, two_i))  # x @ gu: gate, up interleaved on the last axis
        return [mx.contiguous(gu[:, 0::2].T), mx.contiguous(gu[:, 1::2].T),
                mx.contiguous(arr(bufs[1], ddt, (two_i // 2, hidden)).T)]

    return where, convert, (two_i // 2, hidden), None, two_i // 2


def _gguf_layer(ckpt, layer: int, num_experts: int):
    core = ckpt._core_file
    if core is None:
        _refuse("GGUF streaming needs the C++ GGUF reader (this build has none)")
    infos = {t.name: t for t in core.tensors}
    out = [[None] * 3 for _ in range(num_experts)]
    types, sizes = [], []
    for j, g in enumerate(_GGUF_PROJS):
        name = f"blk.{layer}.{g}.weight"
        t = infos.get(name)
        if t is None:
            _refuse(f"layer {layer}: expert layout unknown (no {name})")
        shape = tuple(t.shape)
        if len(shape) != 3 or shape[0] != num_experts:
            _refuse(f"{name} has shape {shape}, expected [{num_experts}, rows, cols]")
        if not ckpt._core.gguf_type_info(int(t.type))[3]:
            _refuse(f"{name}: GGML type {t.type_name} is not one our kernels decode")
        per = int(t.nbytes) // num_experts
        for e in range(num_experts):
            out[e][j] = ExpertBytes(ckpt.path, int(core.data_offset) + int(t.offset) + e * per,
                                    per, "blocks")
        types.append(int(t.type))
        sizes.append((per,))
    return out, tuple(types), sizes, int(infos[f"blk.{layer}.ffn_gate_exps.weight"].shape[1])


def check_safetensors_layout(directory: Path, hf_config: dict) -> None:
    """Before mlx-lm reads the checkpoint: every MoE layer's experts are where we look,
    else a refusal naming the tensor (rather than mlx-lm's KeyError)."""
    from vllm_metal.models.qwen3_5_loader import text_config

    hf_config = text_config(hf_config)
    n = int(hf_config.get("num_experts") or hf_config.get("num_local_experts") or 0)
    if n == 0:
        _refuse(f"{hf_config.get('architectures')} has no mixture-of-experts layers to stream")
    skip = set(hf_config.get("mlp_only_layers") or [])
    step = int(hf_config.get("decoder_sparse_step") or 1)
    index = _safetensors_index(directory)
    gpt_oss = hf_config.get("model_type") == "gpt_oss"
    for i in range(int(hf_config["num_hidden_layers"])):
        if i not in skip and (i + 1) % step == 0:
            (_gpt_oss_layer if gpt_oss else _safetensors_layer)(index, i, n)


def hide_gguf_experts(ckpt):
    """A view of `ckpt` without the expert tensors, so gguf_loader.load_weights never reads them."""

    class _NoExperts:
        def __getattr__(self, name):
            return getattr(ckpt, name)

    view = _NoExperts()
    view.tensors = {n: t for n, t in ckpt.tensors.items()  # biases (gpt-oss) stay
                    if not any(n.endswith(f".{g}.weight") for g in _GGUF_PROJS)}
    return view


# ---- install -------------------------------------------------------------------------
def _moe_layers(lm: nn.Module) -> list:
    """(index, mlp, attribute) of every layer whose MLP has mlx-lm's stacked experts
    (switch_mlp; gpt-oss: experts beside a router)."""
    out = []
    for i, layer in enumerate(lm.model.layers):
        mlp = getattr(layer, "mlp", None)
        if hasattr(mlp, "switch_mlp"):
            out.append((i, mlp, "switch_mlp"))
        elif hasattr(mlp, "router") and hasattr(mlp, "experts"):
            out.append((i, mlp, "experts"))
    return out


def _slot_counts(cfg: OffloadConfig, groups: dict, expert_bytes: dict, top_k: int) -> dict:
    """signature -> slots: the budget shared by the groups in proportion to their bytes."""
    total_experts = sum(len(layers) * n for layers, n in groups.values())
    total_bytes = sum(len(layers) * n * expert_bytes[s] for s, (layers, n) in groups.items())
    out = {}
    for sig, (layers, n) in groups.items():
        share = len(layers) * n * expert_bytes[sig] / total_bytes
        if cfg.cache_gb is not None:
            slots = int(cfg.cache_gb * 2**30 * share // expert_bytes[sig])
        elif cfg.cache_fraction is not None:
            slots = math.ceil(cfg.cache_fraction * len(layers) * n - 1e-9)
        else:
            slots = int(cfg.cache_experts * len(layers) * n // total_experts)
        slots = min(slots, len(layers) * n)
        if slots < top_k:
            need = top_k * expert_bytes[sig]
            _refuse(f"the cache holds {slots} experts of {len(layers)} layers, fewer than one "
                    f"layer's top-k ({top_k}): give it at least {top_k} experts "
                    f"({need / 2**30:.4f} GiB, cache_experts {top_k * len(groups)})")
        out[sig] = slots
    return out


def install(lm: nn.Module, cfg: OffloadConfig, *, directory: Path | None = None, ckpt=None,
            dtype: mx.Dtype = mx.float32) -> ExpertCache:
    """Replace every MoE layer's switch_mlp of `lm` by a StreamedSwitchGLU over a shared
    ExpertCache (safetensors in `directory`, or the GGUF checkpoint `ckpt`)."""
    layers = _moe_layers(lm)
    if not layers:
        _refuse("the model has no mixture-of-experts layers to stream")
    args = lm.args if hasattr(lm, "args") else None
    first = layers[0][1]
    num_experts = int(getattr(args, "num_experts", 0) or getattr(args, "num_local_experts", 0)
                      or first.num_experts)
    top_k = int(getattr(first, "top_k", 0) or first.num_experts_per_tok)
    index = _safetensors_index(directory) if ckpt is None else None
    found, sigs, groups, expert_bytes = {}, {}, {}, {}
    for i, mlp, attr in layers:
        act = type(getattr(getattr(mlp, attr), "activation", None)).__name__
        if act not in (("SwigluOAI", "NoneType") if attr == "experts" else ("SwiGLU", "NoneType")):
            _refuse(f"layer {i}: expert activation {act} is not SwiGLU")
        convert = None
        if ckpt is None and attr == "experts":
            where, convert, specs, gg, inter = _gpt_oss_layer(index, i, num_experts)
            if gg is None:
                specs = tuple(ProjSpec(s, dtype) for s in (specs, specs, specs[::-1]))
                sig = ("dense", tuple(s.shape for s in specs), str(dtype))
            else:
                sig = ("gguf", gg, tuple(s.shape for s in specs))
        elif ckpt is None:
            where, shapes = _safetensors_layer(index, i, num_experts)
            specs = tuple(ProjSpec(s, dtype) for s in shapes)
            sig, gg = ("dense", tuple(shapes), str(dtype)), None
            inter = 0
        else:
            where, types, sizes, inter = _gguf_layer(ckpt, i, num_experts)
            specs = tuple(ProjSpec(s, mx.uint8) for s in sizes)
            sig, gg = ("gguf", types, tuple(sizes)), types
        found[i] = (where, specs, gg, inter, convert)
        sigs[i] = sig
        groups.setdefault(sig, ([], num_experts))[0].append(i)
        expert_bytes[sig] = sum(math.prod(s.shape) * s.dtype.size for s in specs)
    slots = _slot_counts(cfg, groups, expert_bytes, top_k)
    pools = {sig: ExpertPool(slots[sig], found[groups[sig][0][0]][1], policy=cfg.policy)
             for sig in groups}
    cache = ExpertCache(list(pools.values()), prefetch=cfg.prefetch, guess=cfg.prefetch_guess)
    prev = None
    for i, mlp, attr in layers:
        where, _, gg, inter, convert = found[i]
        streamed = StreamedExperts(cache, pools[sigs[i]], i, where, num_experts, gg, inter,
                                   convert)
        if attr == "experts":  # gpt-oss: the biases stay (loaded already, or later from GGUF)
            old = mlp.experts
            streamed.gate = mlp.router
            mlp.experts = StreamedBiasedSwitchGLU(
                streamed, [p.bias for p in (old.gate_proj, old.up_proj, old.down_proj)])
        else:
            streamed.gate = mlp.gate  # the module FusedMoeBlock keeps: its weights load later
            mlp.switch_mlp = StreamedSwitchGLU(streamed)
        cache.layers.append(streamed)
        if prev is not None:
            prev.next = streamed
        prev = streamed
    return cache
