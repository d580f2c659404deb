"""Tiny random checkpoints of every architecture, for tests and benchmarks.

    cfg = tiny_config("qwen3")
    write_random_checkpoint(cfg, dir)         # config.json + model.safetensors (mlx-lm names)
    dense = write_tiny_gguf(cfg, "m.gguf")    # llama.cpp names/layout, returns the weights it holds
    ref = mlx_lm_reference(dir)               # mlx-lm's own model of the same checkpoint
    err = gguf_parity_error("llama", "Q4_K", tmp)  # ours vs mlx-lm on the dequantized weights
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from vllm_metal.models.architectures import architecture_of, mlx_lm_classes, mlx_lm_config

_COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, vocab_size=300,
               max_position_embeddings=512, bos_token_id=1, eos_token_id=2)

TINY_CONFIGS = {
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"], rope_theta=10000.0,
                  tie_word_embeddings=True),
    "llama3": dict(model_type="llama", architectures=["LlamaForCausalLM"], rope_theta=500000.0,
                   tie_word_embeddings=False, attention_bias=True,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "mistral": dict(model_type="mistral", architectures=["MistralForCausalLM"], rope_theta=1e6,
                    tie_word_embeddings=False, sliding_window=None),
    "ministral": dict(model_type="ministral", architectures=["MinistralForCausalLM"], rope_theta=1e6,
                      tie_word_embeddings=False, sliding_window=7,
                      layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "ministral3": dict(model_type="ministral3", architectures=["Ministral3ForCausalLM"],
                       tie_word_embeddings=False,
                       rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                        "original_max_position_embeddings": 16, "beta_fast": 32.0,
                                        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                        "llama_4_scaling_beta": 0.1}),
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], rope_theta=1e6,
                  tie_word_embeddings=True, head_dim=None),
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], rope_theta=1e6,
                  tie_word_embeddings=False),
    "gemma3": dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], rope_theta=1e6,
                   rope_local_base_freq=10000.0, sliding_window=5, sliding_window_pattern=2,
                   query_pre_attn_scalar=24, hidden_activation="gelu_pytorch_tanh",
                   rms_norm_eps=1e-6, num_key_value_heads=1, tie_word_embeddings=True),
}


def tiny_config(name: str, **overrides) -> dict:
    cfg = dict(_COMMON)
    cfg.update(copy.deepcopy(TINY_CONFIGS[name]))
    cfg.update(overrides)
    if cfg.get("head_dim") is None:  # qwen2 derives it from hidden_size
        cfg.pop("head_dim", None)
    return cfg


def random_weights(config: dict, seed: int = 0, scale: float = 0.25) -> dict[str, np.ndarray]:
    """float32 weights under mlx-lm names; norm weights near 1 (near 0 for gemma's 1 + w)."""
    arch = architecture_of(config)
    model_class, args_class = mlx_lm_classes(arch)
    model = model_class(args_class.from_dict(mlx_lm_config(config)))
    rng = np.random.default_rng(seed)
    gemma = arch.block_style == "sandwich"
    out = {}
    for name, p in tree_flatten(model.parameters()):
        if name == "lm_head.weight" and config.get("tie_word_embeddings", gemma):
            continue
        w = rng.standard_normal(p.shape).astype(np.float32)
        if name.endswith("norm.weight"):
            w = (0.0 if gemma else 1.0) + 0.1 * w
        elif not name.endswith("embed_tokens.weight"):
            w = w * scale / np.sqrt(max(1, p.shape[-1]) / 16)
        out[name] = w
    return out


def write_random_checkpoint(config: dict, out_dir, *, seed: int = 0, dtype: str = "float32",
                            config_dtype: str | None = None) -> Path:
    """config.json + model.safetensors with weights stored in `dtype`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(config)
    cfg["torch_dtype"] = config_dtype or dtype
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    mx_dtype = getattr(mx, dtype)
    weights = {k: mx.array(v).astype(mx_dtype) for k, v in random_weights(config, seed).items()}
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    return out


def mlx_lm_reference(checkpoint_dir):
    """mlx-lm's own model of a checkpoint directory (its loader, its config handling)."""
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(checkpoint_dir), get_model_classes=lambda config: mlx_lm_classes(
        architecture_of(config)))
    return model


def reference_logits(model, tokens: list[int], chunks: list[int] | None = None) -> np.ndarray:
    """Logits [len(tokens), vocab] of mlx-lm's model fed `tokens` in chunks with its KV cache."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    chunks = chunks or [len(tokens)]
    out, start = [], 0
    for n in chunks:
        ids = mx.array(np.array(tokens[start:start + n], np.int32))[None]
        logits = model(ids, cache=cache)
        mx.eval(logits)
        out.append(np.array(logits[0].astype(mx.float32)))
        start += n
    assert start == len(tokens)
    return np.concatenate(out)


# Per sequence: the chunk sizes it is fed in, one chunk per step (1 = a decode step).
SCHEDULES = [
    [8, 5, 1, 1, 1, 1, 1],   # 2 prefill chunks, then decodes
    [3, 1, 1, 1, 1, 1, 1],   # short prompt; decodes from step 2 while others prefill
    [13, 1, 1, 1, 1, 1, 1],  # long single-chunk prefill (crosses the sliding windows)
    [2, 4, 9, 1, 1, 1],      # three prefill chunks
]


def run_packed(loaded, sequences, schedules=SCHEDULES, *, block_size=4, num_blocks=64, seed=0):
    """Feed every sequence through our model, packed: each step takes the next
    chunk of every unfinished sequence, decode rows first. Blocks are handed out
    in shuffled order. Returns per sequence the logits [len(seq), vocab] of
    every position."""
    from vllm_metal.models.generate import KVPool, SeqChunk, build_step

    rng = np.random.default_rng(seed)
    pool = KVPool(loaded.spec, num_blocks, block_size)
    rng.shuffle(pool.free)
    tables = [[] for _ in sequences]
    computed = [0] * len(sequences)
    out = [np.zeros((len(s), loaded.spec.vocab_size), np.float32) for s in sequences]
    for step in range(max(len(s) for s in schedules)):
        active = [i for i, s in enumerate(schedules) if step < len(s)]
        active.sort(key=lambda i: 0 if (schedules[i][step] == 1 and computed[i] > 0) else 1)
        chunks = []
        for i in active:
            n = schedules[i][step]
            pool.allocate(tables[i], computed[i] + n)
            chunks.append(SeqChunk(sequences[i][computed[i]:computed[i] + n], computed[i], tables[i], "all"))
        packed = build_step(chunks, pool.kv_caches, block_size)
        logits = loaded.model(packed.input_ids, packed.ctx)
        mx.eval(logits, packed.ctx.kv_caches)
        pool.kv_caches = packed.ctx.kv_caches
        logits = np.array(logits.astype(mx.float32))
        for row, (ci, j) in enumerate(packed.row_of_logit):
            i = active[ci]
            out[i][computed[i] + j] = logits[row]
        for i in active:
            computed[i] += schedules[i][step]
    return out


# ---- tiny GGUF files ----------------------------------------------------------------

_GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}


def byte_level_vocab(vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """A GPT-2 style byte-level BPE vocabulary: 3 specials, 256 byte symbols, merges."""
    def byte_symbols():
        keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
        symbols, extra = {}, 0
        for b in range(256):
            if b in keep:
                symbols[b] = chr(b)
            else:
                symbols[b] = chr(256 + extra)
                extra += 1
        return [symbols[b] for b in range(256)]

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + byte_symbols()
    merges: list[str] = []
    words = ["Ġthe", "Ġcapital", "ĠFrance", "ĠParis", "Ġis", "Ġof", "Ġwhat", "Ġhello", "Ġworld",
             "ing", "Ġand", "Ġto", "Ġin", "Ġit", "Ġa", "user", "assistant", "system"]
    for word in words:
        cur = word[0]
        for ch in word[1:]:
            new = cur + ch
            if new not in tokens and len(tokens) < vocab_size:
                merges.append(f"{cur} {ch}")
                tokens.append(new)
            cur = new
    n = len(tokens)
    while len(tokens) < vocab_size:  # pad with unused control tokens
        tokens.append(f"<|unused{len(tokens) - n}|>")
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials))
    return tokens, types, merges


# Types the gguf package quantizes; the others get random valid blocks (random
# bytes, float16 scales at these byte offsets, rescaled to the weight's RMS).
_QUANTIZABLE = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"}
_SCALE_OFFSETS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
                  "IQ4_NL": (0,), "IQ4_XS": (0,), "IQ3_S": (0,), "IQ3_XXS": (0,)}


def add_byte_level_tokenizer(w, config: dict) -> None:
    """A GGUF writer's tokenizer metadata: the byte-level vocabulary of the config's size,
    its bos and eos ids."""
    tokens, types, merges = byte_level_vocab(config["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(config["bos_token_id"])
    w.add_eos_token_id(config["eos_token_id"])


def _encode(stored: np.ndarray, qtype: str, rng) -> tuple[np.ndarray, np.ndarray]:
    """(blocks, what they decode to) for a 2-D float32 weight. Quantizable types
    quantize it; the others encode random valid blocks with its per-row RMS."""
    import gguf

    qt = gguf.GGMLQuantizationType[qtype]
    rows, cols = stored.shape
    if qtype in _QUANTIZABLE:
        blocks = gguf.quants.quantize(stored, qt)
        return blocks, gguf.quants.dequantize(blocks, qt).reshape(stored.shape)
    bs, ts = gguf.GGML_QUANT_SIZES[qt]
    raw = rng.integers(0, 256, size=(rows, cols // bs, ts), dtype=np.uint8)
    scales = []
    for off in _SCALE_OFFSETS[qtype]:
        mag = rng.uniform(0.5, 1.5, size=(rows, cols // bs)).astype(np.float32)
        scales.append((off, mag * rng.choice([-1.0, 1.0], size=mag.shape)))

    def with_scales(factor):
        for off, s in scales:
            v = (s * factor[:, None]).astype(np.float16)
            raw[:, :, off:off + 2] = v.view(np.uint8).reshape(rows, cols // bs, 2)
        blocks = raw.reshape(rows, -1)
        return blocks, gguf.quants.dequantize(blocks, qt).reshape(rows, cols)

    _, first = with_scales(np.ones(rows, np.float32))
    rms = lambda w: np.sqrt(np.mean(np.square(w, dtype=np.float64), axis=1)) + 1e-12  # noqa: E731
    return with_scales((rms(stored) / rms(first)).astype(np.float32))


def write_tiny_gguf(config: dict, path, *, seed: int = 0, qtype: str = "Q8_0",
                    chat_template: str | None = None,
                    pooling_type: str | None = None) -> dict[str, np.ndarray]:
    """A GGUF file of `config` as llama.cpp's converter lays it out (permuted llama
    Q/K rows, gemma norms stored as 1 + w, 2-D weights in `qtype` where their
    rows are a whole number of blocks, else F32); returns the dense float32
    weights it encodes under mlx-lm names, in HF layout. Any type our kernels
    decode: those the gguf package cannot quantize (K, IQ) hold random valid
    blocks with each weight row's RMS, so the weights are the blocks' own.
    pooling_type (MEAN, CLS, LAST, RANK): an embedding file's `<arch>.pooling_type`."""
    import gguf

    from vllm_metal.models.gguf_loader import permute_rows

    arch = architecture_of(config)
    gguf_arch = _GGUF_ARCH[arch.model_type]
    weights = random_weights(config, seed)
    qt = gguf.GGMLQuantizationType[qtype]
    rng = np.random.default_rng(seed + 1000)
    w = gguf.GGUFWriter(str(path), gguf_arch)
    n_heads, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // n_heads
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_freq_base(config["rope_theta"])
    w.add_vocab_size(config["vocab_size"])
    if arch.model_type == "gemma3_text":
        w.add_sliding_window(config["sliding_window"])
        w.add_sliding_window_pattern(config.get("sliding_window_pattern", 6))
    add_byte_level_tokenizer(w, config)
    w.add_add_bos_token(False)
    if chat_template:
        w.add_chat_template(chat_template)
    if pooling_type:
        w.add_pooling_type(gguf.PoolingType[pooling_type])

    dense = {}
    names = {v: k for k, v in _reverse_names(arch.model_type, config["num_hidden_layers"]).items()}
    for name, value in weights.items():
        gname = names[name]
        stored = value
        if arch.model_type == "gemma3_text" and name.endswith("norm.weight"):
            stored = value + 1.0
        if arch.model_type == "llama" and ".attn_q." in gname:
            stored = permute_rows(stored, n_heads)
        elif arch.model_type == "llama" and ".attn_k." in gname:
            stored = permute_rows(stored, n_kv)
        if stored.ndim == 2 and stored.shape[1] % gguf.GGML_QUANT_SIZES[qt][0] == 0 and qtype != "F32":
            blocks, roundtrip = _encode(stored, qtype, rng)
            w.add_tensor(gname, blocks, raw_dtype=qt)
        else:
            w.add_tensor(gname, stored.astype(np.float32))
            roundtrip = stored.astype(np.float32)
        # Back to what the checkpoint means, in HF layout.
        if arch.model_type == "llama" and ".attn_q." in gname:
            roundtrip = _unpermute_np(roundtrip, n_heads)
        elif arch.model_type == "llama" and ".attn_k." in gname:
            roundtrip = _unpermute_np(roundtrip, n_kv)
        if arch.model_type == "gemma3_text" and name.endswith("norm.weight"):
            roundtrip = roundtrip - 1.0
        dense[name] = roundtrip.astype(np.float32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dense


def _unpermute_np(w: np.ndarray, n_heads: int) -> np.ndarray:
    rows = w.shape[0]
    d = rows // n_heads
    return w.reshape(n_heads, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _reverse_names(model_type: str, n_layers: int) -> dict[str, str]:
    """GGUF name -> mlx-lm name for every tensor a model of this type can have."""
    from vllm_metal.models.gguf_loader import _BLOCK_NAMES, _GEMMA3_BLOCK_NAMES, _GLOBAL_NAMES

    table = _GEMMA3_BLOCK_NAMES if model_type == "gemma3_text" else _BLOCK_NAMES
    out = dict(_GLOBAL_NAMES)
    for i in range(n_layers):
        for g, m in table.items():
            for suffix in ("weight", "bias"):
                out[f"blk.{i}.{g}.{suffix}"] = f"model.layers.{i}.{m}.{suffix}"
    return out


def write_dense_checkpoint(config: dict, weights: dict[str, np.ndarray], out_dir) -> Path:
    """config.json + model.safetensors holding exactly `weights` (float32)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(dict(config, torch_dtype="float32"), indent=2))
    mx.save_safetensors(str(out / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()})
    return out


# ---- parity tolerances ----------------------------------------------------------------

# Logits of a tiny GGUF model (float32, linear layers on ops.gguf_matmul) against
# mlx-lm on the dequantized weights it encodes: the bound on
# max |ours - mlx-lm| / max(max |mlx-lm|, 1) per weight type. With float32
# activations (the default) every type is held to FLOAT_SUMS_TOLERANCE. With
# int8_activations, most quantized types multiply 8-bit activations on the CPU
# (llama.cpp's scheme, ~0.5% per matmul, amplified by the random weights), which
# dominates: the table is about 2x the worst error measure_gguf_tolerances()
# found (5 archs x 3 seeds; worst in the comment). Types this build multiplies with float32
# activations (Q2_K, Q3_K, IQ*: measured 1e-6) are held to FLOAT_SUMS_TOLERANCE
# until they move to 8 bits (probed at run time: uses_8bit_activations), then
# to their entry here.
# reordered float32 sums only: worst measured 1.1e-5 (llama Q4_K; the CPU attention sums
# q.k and P.V in key blocks, another order than mlx-lm's; 4e-6 with the per-key kernel)
FLOAT_SUMS_TOLERANCE = 3e-5
GGUF_LOGITS_TOLERANCE = {
    "F32": FLOAT_SUMS_TOLERANCE,    # 1.2e-6
    "F16": FLOAT_SUMS_TOLERANCE,    # 9.7e-7
    "BF16": FLOAT_SUMS_TOLERANCE,   # 9.8e-7
    "Q8_0": 3e-2,                   # 1.55e-2
    "Q4_0": 3.5e-2,                 # 1.78e-2
    "Q4_1": 3e-2,                   # 1.39e-2
    "Q5_0": 3e-2,                   # 1.52e-2
    "Q5_1": 3e-2,                   # 1.51e-2
    "Q2_K": 3e-2,                   # float32 on this build (4.2e-6); 8-bit: as the others
    "Q3_K": 3e-2,                   # float32 on this build (9.8e-7)
    "Q4_K": 7.5e-2,                 # 3.70e-2
    "Q5_K": 5e-2,                   # 2.33e-2
    "Q6_K": 3e-2,                   # 1.31e-2
    "IQ4_NL": 3e-2,                 # float32 on this build (1.3e-6)
    "IQ4_XS": 3e-2,                 # float32 on this build (1.0e-6)
    "IQ3_S": 3e-2,                  # float32 on this build (9.7e-7)
    "IQ3_XXS": 3e-2,                # float32 on this build (1.1e-6)
}


@functools.lru_cache(maxsize=None)
def uses_8bit_activations(qtype: str) -> bool:
    """Whether this build's gguf_matmul rounds activations of `qtype` to 8 bits:
    its result against float64 sums of the same dequantized weights."""
    from vllm_metal import ops

    rng = np.random.default_rng(0)
    blocks, dense = _encode(rng.standard_normal((8, 256)).astype(np.float32), qtype, rng)
    blocks = mx.array(np.ascontiguousarray(blocks).view(np.uint8).reshape(8, -1))
    x = rng.standard_normal((1, 256)).astype(np.float32)
    got = np.array(ops.gguf_matmul(mx.array(x), blocks, qtype, [8, 256]))[0]
    want = (x.astype(np.float64) @ dense.T.astype(np.float64))[0]
    return bool(np.abs(got - want).max() > 1e-4 * np.abs(want).max())


def gguf_logits_tolerance(qtype: str, int8_activations: bool = False) -> float:
    """The bound gguf_parity_error must meet for `qtype` on this build."""
    if not int8_activations or qtype in ("F32", "F16", "BF16") or not uses_8bit_activations(qtype):
        return FLOAT_SUMS_TOLERANCE
    return GGUF_LOGITS_TOLERANCE[qtype]


# Row lengths of every matrix are multiples of 256 here, so K and IQ types apply everywhere.
GGUF_PARITY_OVERRIDES = dict(hidden_size=256, intermediate_size=256, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=64, num_hidden_layers=2)


def gguf_parity_config(name: str) -> dict:
    """A tiny config whose matrices take every GGUF type (llama: untied, with
    attention bias, so q/k biases are un-permuted too)."""
    if name == "llama_untied_bias":
        cfg = tiny_config("llama", tie_word_embeddings=False, attention_bias=True,
                          **GGUF_PARITY_OVERRIDES)
    else:
        cfg = tiny_config(name, **GGUF_PARITY_OVERRIDES)
    if cfg["model_type"] == "gemma3_text":
        # GGUF has no query_pre_attn_scalar: llama.cpp scales by 1/sqrt(head_dim).
        cfg["query_pre_attn_scalar"] = cfg["head_dim"]
    if cfg["model_type"] == "qwen2":
        cfg.pop("head_dim")  # qwen2 derives it: 256 / 4
    return cfg


def gguf_parity_error(name: str, qtype: str, tmp_dir, *, seed: int = 4,
                      schedules=SCHEDULES, int8_activations: bool = False) -> float:
    """max |ours - mlx-lm| / max(max |mlx-lm|, 1) over every logits row of the
    SCHEDULES sequences, for a tiny `name` model written as a `qtype` GGUF."""
    cfg = gguf_parity_config(name)
    tmp_dir = Path(tmp_dir)
    path = tmp_dir / f"{name}-{qtype}-{seed}.gguf"
    dense = write_tiny_gguf(cfg, path, seed=seed, qtype=qtype)
    from vllm_metal.models import load_model

    ours = load_model(str(path), "float32", int8_activations=int8_activations)
    ref = mlx_lm_reference(write_dense_checkpoint(cfg, dense, tmp_dir / f"{path.stem}-dense"))
    rng = np.random.default_rng(seed + 1)
    sequences = [rng.integers(3, cfg["vocab_size"], sum(s)).tolist() for s in schedules]
    worst = 0.0
    for seq, sched, logits in zip(sequences, schedules, run_packed(ours, sequences, schedules)):
        want = reference_logits(ref, seq, sched)
        worst = max(worst, float(np.abs(logits - want).max() / max(np.abs(want).max(), 1.0)))
    return worst


def measure_gguf_tolerances(names=("llama", "llama_untied_bias", "qwen2", "qwen3", "gemma3"),
                            seeds=(4, 5, 6), qtypes=tuple(GGUF_LOGITS_TOLERANCE),
                            int8_activations: bool = True) -> dict:
    """The worst gguf_parity_error per type over archs and seeds (prints a table)."""
    import tempfile

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for qtype in qtypes:
            errs = [gguf_parity_error(n, qtype, tmp, seed=s, int8_activations=int8_activations)
                    for n in names for s in seeds]
            out[qtype] = max(errs)
            bound = gguf_logits_tolerance(qtype, int8_activations)
            print(f"{qtype:8s} worst {out[qtype]:.2e}  bound {bound:.0e}  "
                  f"8-bit activations: {uses_8bit_activations(qtype)}", flush=True)
    return out


def write_random_eagle3_head(out, target_hidden: int, target_vocab: int, *, seed: int = 0,
                             norm_before_residual: bool = True, speculators: bool = True,
                             draft_vocab: int = 120, aux=None, heads: int = 4, kv: int = 2,
                             intermediate: int = 96):
    """A random EAGLE3 head as wide as its target (it reads the target's embeddings), in
    the speculators format (or the original layout: midlayer.*), with a draft vocabulary
    of `draft_vocab` target ids (d2t); aux None: the target's default layers. Returns
    (directory, tensors, layer config, the target ids of the draft vocabulary)."""
    out = Path(out)
    rng = np.random.default_rng(seed)
    h = target_hidden
    d, inter = h // heads, intermediate

    def w(*shape, scale=0.2):
        return (rng.normal(size=shape) * scale).astype(np.float32)

    layer = "layers.0." if speculators else "midlayer."
    t = {"fc.weight": w(h, 3 * target_hidden),
         f"{layer}self_attn.q_proj.weight": w(heads * d, 2 * h),
         f"{layer}self_attn.k_proj.weight": w(kv * d, 2 * h),
         f"{layer}self_attn.v_proj.weight": w(kv * d, 2 * h),
         f"{layer}self_attn.o_proj.weight": w(h, heads * d),
         f"{layer}mlp.gate_proj.weight": w(inter, h), f"{layer}mlp.up_proj.weight": w(inter, h),
         f"{layer}mlp.down_proj.weight": w(h, inter),
         "norm.weight": 1 + w(h, scale=0.1), "lm_head.weight": w(draft_vocab, h, scale=0.5)}
    for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        t[f"{layer}{n}.weight"] = 1 + w(h, scale=0.1)
    keep = np.sort(rng.choice(target_vocab, draft_vocab, replace=False))
    t["d2t"] = (keep - np.arange(draft_vocab)).astype(np.int64)
    t2d = np.zeros(target_vocab, bool)
    t2d[keep] = True
    t["t2d"] = t2d
    layer_cfg = dict(model_type="llama", hidden_size=h, intermediate_size=inter,
                     num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv,
                     head_dim=d, rms_norm_eps=1e-5, vocab_size=target_vocab,
                     rope_theta=10000.0, max_position_embeddings=512, architectures=["LlamaForCausalLM"],
                     dtype="float32")
    if speculators:
        config = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
                  "torch_dtype": "float32",
                  "transformer_layer_config": layer_cfg, "draft_vocab_size": draft_vocab,
                  "norm_before_residual": norm_before_residual,
                  "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                         "proposal_methods": [{"proposal_type": "greedy",
                                                               "speculative_tokens": 3}],
                                         "verifier": {"name_or_path": "tiny-llama",
                                                      "architectures": ["LlamaForCausalLM"]}}}
    else:
        config = dict(layer_cfg, architectures=["LlamaForCausalLMEagle3"],
                      draft_vocab_size=draft_vocab)
    if aux is not None:
        config["eagle_aux_hidden_state_layer_ids"] = list(aux)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    mx.save_safetensors(str(out / "model.safetensors"),
                        {k: mx.array(v) for k, v in t.items()}, metadata={"format": "pt"})
    return out, t, layer_cfg, keep
