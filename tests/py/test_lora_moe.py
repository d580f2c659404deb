"""LoRA on a sparse-MoE model (lora/experts.py): adapters on the attention projections
and on the routed experts (PEFT modules mlp.experts.E.{gate,up,down}_proj), several in
one packed batch with the base. Each sequence's logits and greedy tokens equal the base
checkpoint with its adapter merged in NumPy (W + scale * B @ A per expert), on a tiny
random qwen3_moe checkpoint: safetensors (dense experts), its GGUF with Q8_0 experts in
block form (against the same file dequantized at load with the deltas merged), and both
with the experts streamed through a cache holding 25% of them."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")

from lora_checkpoint import base_weights, write_adapter, write_merged  # noqa: E402
from test_lora_model import PROMPTS, lora_config, prefill_logits, request  # noqa: E402
from test_models_qwen3_moe import write_checkpoint  # noqa: E402
from test_models_qwen3_moe_gguf import write_gguf  # noqa: E402
from vllm_metal.lora.manager import LoraManager  # noqa: E402
from vllm_metal.models import load_model  # noqa: E402
from vllm_metal.models.expert_offload import OffloadConfig  # noqa: E402
from vllm_metal.models.generate import greedy_generate  # noqa: E402

VOCAB = 320
EXPERTS = 8
PROJS = ("gate_proj", "up_proj", "down_proj")


def experts(layer, ids, projs=PROJS):
    return [f"model.layers.{layer}.mlp.experts.{e}.{p}" for e in ids for p in projs]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora_moe")
    config, _ = write_checkpoint(tmp / "base", seed=4, vocab_size=VOCAB, num_experts=EXPERTS)
    layers = config.num_hidden_layers
    w = base_weights(tmp / "base")
    attn = [f"model.layers.{l}.self_attn.{p}" for l in range(layers) for p in ("q_proj", "o_proj")]
    deltas = {
        # attention and every expert of every layer
        1: write_adapter(tmp / "a1", w, layers, r=8, alpha=16, seed=11, magnitude=2.0,
                         modules=attn + sum((experts(l, range(EXPERTS)) for l in range(layers)), [])),
        # experts only: half of layer 0's gate/up, layer 1's down projections at a smaller rank
        2: write_adapter(tmp / "a2", w, layers, r=4, alpha=8, seed=12, magnitude=2.0,
                         rank_pattern={"down_proj": 2},
                         modules=experts(0, range(0, EXPERTS, 2), ("gate_proj", "up_proj"))
                         + experts(1, range(EXPERTS), ("down_proj",))),
    }
    merged = {0: tmp / "base"} | {lid: write_merged(tmp / "base", tmp / f"m{lid}", d)
                                  for lid, d in deltas.items()}
    gguf_path = write_gguf(tmp / "base", config, tmp / "base-q8.gguf", "Q8_0")
    return SimpleNamespace(tmp=tmp, config=config, deltas=deltas, merged=merged, gguf=gguf_path)


def with_adapters(setup, source: str, stream: bool):
    path = setup.gguf if source == "gguf" else setup.tmp / "base"
    offload = OffloadConfig.parse({"cache_fraction": 0.25}) if stream else None
    loaded = load_model(str(path), "float32", expert_offload=offload)
    lora = LoraManager(loaded.model, lora_config(max_loras=2))
    for lid in (1, 2):
        assert lora.add(request(lid, setup.tmp / f"a{lid}"))
    return loaded, lora


def reference(setup, source: str, lid: int):
    """The base with adapter `lid` merged: the merged safetensors checkpoint, or for the
    GGUF base the same file dequantized at load with W + scale * B @ A written in."""
    if source == "safetensors":
        return load_model(str(setup.merged[lid]), "float32")
    ref = load_model(str(setup.gguf), "float32", linear="mlx")
    for module, (a, b, scale) in (setup.deltas[lid] if lid else {}).items():
        parts = module.split(".")
        layer = ref.model.layers[int(parts[2])]
        delta = scale * (b @ a)
        if parts[4] == "experts":
            sw = layer.mlp.switch_mlp
            lin = getattr(sw, parts[6])
            w = np.array(lin.weight).astype(np.float64)
            w[int(parts[5])] += delta
        else:
            lin = getattr(getattr(layer, parts[3]), parts[4])
            w = np.array(lin.weight).astype(np.float64) + delta
        lin.weight = mx.array(w.astype(np.float32))
    return ref


def greedy_packed(loaded, lora, prompts, loras, n):
    """n greedy tokens per prompt, every step one packed prefill of all the sequences
    (each with its adapter)."""
    seqs = [list(p) for p in prompts]
    for _ in range(n):
        logits = prefill_logits(loaded, seqs, lora, loras)
        for s, lg in zip(seqs, logits):
            s.append(int(lg[-1].argmax()))
    return [s[len(p):] for s, p in zip(seqs, prompts)]


SOURCES = [("safetensors", False), ("safetensors", True), ("gguf", False), ("gguf", True)]
IDS = ["safetensors", "safetensors-streamed", "gguf-q8_0", "gguf-q8_0-streamed"]


@pytest.mark.parametrize("source, stream", SOURCES, ids=IDS)
def test_mixed_batch_equals_merged_experts(setup, source, stream):
    loaded, lora = with_adapters(setup, source, stream)
    loras = [1, 0, 2, 1]
    got = prefill_logits(loaded, PROMPTS, lora, loras)
    refs = {lid: reference(setup, source, lid) for lid in (0, 1, 2)}
    for prompt, lid, g in zip(PROMPTS, loras, got):
        want = prefill_logits(refs[lid], [prompt])[0]
        base = prefill_logits(refs[0], [prompt])[0]
        assert lid == 0 or np.abs(want - base).max() > 1e-2  # the adapter matters
        # GGUF: dequantized weights against blocks, float32 sums in another order
        tol = 1e-4 if source == "safetensors" else 2e-4
        np.testing.assert_allclose(g, want, rtol=tol, atol=tol, err_msg=f"adapter {lid}")
    if stream:
        assert loaded.expert_cache.stats.misses > 0


def test_greedy_tokens_mixed_batch_equal_merged_and_solo(setup):
    """Two adapters and the base in one batch: each sequence's greedy tokens are its solo
    tokens and the merged checkpoint's (generated on the fused MoE op, KV cache decode)."""
    loaded, lora = with_adapters(setup, "safetensors", False)
    prompts, loras, n = PROMPTS[:3], [2, 0, 1], 8
    got = greedy_packed(loaded, lora, prompts, loras, n)
    for p, lid, g in zip(prompts, loras, got):
        assert greedy_packed(loaded, lora, [p], [lid], n)[0] == g
        want = greedy_generate(reference(setup, "safetensors", lid), [p], n, block_size=4,
                               prefill_chunk=4, stop_ids=[])[0]
        assert g == want, f"adapter {lid}"
    base = greedy_generate(reference(setup, "safetensors", 0), prompts[:1], n, block_size=4,
                           prefill_chunk=4, stop_ids=[])[0]
    assert got[0] != base  # adapter 2 changes the tokens


def test_steps_without_expert_adapters_run_the_fused_op(setup, monkeypatch, tmp_path):
    """The per-op path is taken only by steps whose rows' adapters hold expert weights (an
    attention-only adapter's step keeps the fused op, while expert adapters sit in slots)."""
    from vllm_metal.lora import experts as lora_experts

    loaded = load_model(str(setup.tmp / "base"), "float32")
    lora = LoraManager(loaded.model, lora_config(max_loras=3))
    for lid in (1, 2):
        lora.add(request(lid, setup.tmp / f"a{lid}"))
    w = base_weights(setup.tmp / "base")
    attn = write_adapter(tmp_path / "a3", w, setup.config.num_hidden_layers, r=4, alpha=8,
                         seed=3, magnitude=2.0, targets=("q_proj", "o_proj"))
    lora.add(request(3, tmp_path / "a3"))
    calls = []
    real = lora_experts.LoraMoeBlock._routed
    monkeypatch.setattr(lora_experts.LoraMoeBlock, "_routed",
                        lambda self, *a: calls.append(1) or real(self, *a))
    plain = prefill_logits(reference(setup, "safetensors", 0), PROMPTS[:2])
    got = prefill_logits(loaded, PROMPTS[:2], lora, [0, 0])
    assert calls == []
    for g, w_ in zip(got, plain):
        np.testing.assert_array_equal(g, w_)
    prefill_logits(loaded, PROMPTS[:2], lora, [1, 0])
    assert len(calls) == setup.config.num_hidden_layers
    calls.clear()
    got = prefill_logits(loaded, PROMPTS[:2], lora, [3, 0])  # slots 0 and 1 hold expert weights
    assert calls == []
    merged = write_merged(setup.tmp / "base", tmp_path / "m3", attn)
    want = prefill_logits(load_model(str(merged), "float32"), PROMPTS[:1])[0]
    np.testing.assert_allclose(got[0], want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got[1], plain[1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("module, shape, message", [
    ("model.layers.0.mlp.experts.8.gate_proj", None, "layer 0 has no experts.8.gate_proj"),
    ("model.layers.1.mlp.experts.2.down_proj", (5, 7), "experts.2.down_proj: lora_A .* do not match"),
    ("model.layers.0.mlp.shared_expert.up_proj", None, "layer 0 has no shared_expert.up_proj"),
    ("model.layers.0.mlp.experts.gate_up_proj", None, "mlp.experts.gate_up_proj is not one the model has"),
])
def test_bad_expert_adapters_are_refused_naming_the_module(setup, tmp_path, module, shape, message):
    loaded = load_model(str(setup.tmp / "base"), "float32")
    lora = LoraManager(loaded.model, lora_config())
    w = {module + ".weight": np.zeros(shape or (32, 64), np.float32)}
    write_adapter(tmp_path / "bad", w, 0, r=4, alpha=8, seed=0, modules=[module])
    with pytest.raises(ValueError, match=message):
        lora.add(request(9, tmp_path / "bad"))
    assert lora.list() == set()


def test_expert_adapter_on_a_dense_model_is_refused(tmp_path):
    from vllm_metal.models.testing import tiny_config, write_random_checkpoint

    base = write_random_checkpoint(tiny_config("qwen3", num_hidden_layers=2), tmp_path / "b", seed=0)
    loaded = load_model(str(base), "float32")
    lora = LoraManager(loaded.model, lora_config())
    w = {"model.layers.1.mlp.experts.0.up_proj.weight": np.zeros((32, 64), np.float32)}
    write_adapter(tmp_path / "bad", w, 0, r=4, alpha=8, seed=0,
                  modules=["model.layers.1.mlp.experts.0.up_proj"])
    with pytest.raises(ValueError, match="layer 1 has no experts.0.up_proj"):
        lora.add(request(1, tmp_path / "bad"))


def test_mlx_quantized_experts_equal_merged_dequantized(setup, tmp_path):
    """An MLX-quantized checkpoint (experts in QuantizedSwitchLinear: the base runs mlx-lm's
    gather_qmm block) with adapters equals the dequantized weights with the deltas merged,
    written as a dense checkpoint and run on the fused op."""
    import json

    from vllm_metal.models.moe import FusedMoeBlock

    # mlx-lm's layout: experts stacked [E, out, in] in switch_mlp; experts and q/o quantized
    hf = base_weights(setup.tmp / "base")
    layers, params, dense = setup.config.num_hidden_layers, {}, {}
    for key, value in hf.items():
        if ".mlp.experts." in key:
            continue
        params[key] = mx.array(value)
    for l in range(layers):
        for p in PROJS:
            params[f"model.layers.{l}.mlp.switch_mlp.{p}.weight"] = mx.array(np.stack(
                [hf[f"model.layers.{l}.mlp.experts.{e}.{p}.weight"] for e in range(EXPERTS)]))
    for key in list(params):
        if key.endswith((".q_proj.weight", ".o_proj.weight")) or ".switch_mlp." in key:
            stem = key.removesuffix(".weight")
            w, scales, biases = mx.quantize(params[key], group_size=32, bits=8)
            params[key], params[stem + ".scales"], params[stem + ".biases"] = w, scales, biases
            value = mx.dequantize(w, scales, biases, group_size=32, bits=8)
        else:
            value = params[key]
        if ".switch_mlp." in key:  # the dense reference: HF per-expert names
            for e in range(EXPERTS):
                dense[key.replace("switch_mlp", f"experts.{e}")] = np.array(value[e])
        else:
            dense[key] = np.array(value)
    quant = tmp_path / "q8"
    quant.mkdir()
    mx.save_safetensors(str(quant / "model.safetensors"), params)
    cfg = json.loads((setup.tmp / "base" / "config.json").read_text())
    (quant / "config.json").write_text(json.dumps(dict(cfg, quantization={"group_size": 32, "bits": 8})))
    (tmp_path / "dq").mkdir()
    mx.save_safetensors(str(tmp_path / "dq" / "model.safetensors"),
                        {k: mx.array(v) for k, v in dense.items()})
    (tmp_path / "dq" / "config.json").write_text(json.dumps(cfg))
    merged = {0: tmp_path / "dq"} | {lid: write_merged(tmp_path / "dq", tmp_path / f"m{lid}", d)
                                     for lid, d in setup.deltas.items()}

    loaded = load_model(str(quant), "float32")
    block = loaded.model.layers[0].mlp
    assert not isinstance(block, FusedMoeBlock) and "scales" in block.switch_mlp.gate_proj
    lora = LoraManager(loaded.model, lora_config(max_loras=2))
    for lid in (1, 2):
        lora.add(request(lid, setup.tmp / f"a{lid}"))
    loras = [2, 1, 0]
    got = prefill_logits(loaded, PROMPTS[:3], lora, loras)
    for prompt, lid, g in zip(PROMPTS, loras, got):
        ref = load_model(str(merged[lid]), "float32")
        assert isinstance(ref.model.layers[0].mlp, FusedMoeBlock)
        want = prefill_logits(ref, [prompt])[0]
        np.testing.assert_allclose(g, want, rtol=2e-4, atol=2e-4, err_msg=f"adapter {lid}")


def test_mixed_batch_on_the_metal_kernels_in_the_emulator(tmp_path):
    """The per-op expert path on Metal kernels, emulated (gguf_matmul on Q8_0 expert blocks,
    lora_apply, attention with head size 64, norms, rope); the reference, the dequantized
    file with the deltas merged, runs on the CPU kernels."""
    from vllm_metal import ops

    config, _ = write_checkpoint(tmp_path / "hf", seed=6, vocab_size=VOCAB, num_experts=4,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    path = write_gguf(tmp_path / "hf", config, tmp_path / "m.gguf", "Q8_0")
    w = base_weights(tmp_path / "hf")
    layers = config.num_hidden_layers
    deltas = {1: write_adapter(tmp_path / "a1", w, layers, r=4, alpha=8, seed=1, magnitude=2.0,
                               modules=sum((experts(l, range(4)) for l in range(layers)), [])),
              2: write_adapter(tmp_path / "a2", w, layers, r=8, alpha=8, seed=2, magnitude=2.0,
                               modules=["model.layers.1.self_attn.q_proj"] + experts(0, [1, 2]))}
    ns = SimpleNamespace(gguf=path, deltas=deltas)
    prompts, loras = PROMPTS[:3], [2, 0, 1]
    want = [prefill_logits(reference(ns, "gguf", lid), [p])[0] for p, lid in zip(prompts, loras)]
    base = prefill_logits(reference(ns, "gguf", 0), [prompts[0], prompts[2]])
    assert min(np.abs(want[0] - base[0]).max(), np.abs(want[2] - base[1]).max()) > 1e-2
    previous = ops.kernel_backend()
    ops.set_kernel_backend("emulated")
    try:
        loaded = load_model(str(path), "float32")
        lora = LoraManager(loaded.model, lora_config(max_loras=2))
        for lid in (1, 2):
            lora.add(request(lid, tmp_path / f"a{lid}"))
        got = prefill_logits(loaded, prompts, lora, loras)
    finally:
        ops.set_kernel_backend(previous)
    for g, w_, lid in zip(got, want, loras):
        np.testing.assert_allclose(g, w_, rtol=2e-4, atol=2e-4, err_msg=f"adapter {lid}")


def test_gpt_oss_attention_adapters_work_and_expert_adapters_are_refused(tmp_path):
    """gpt-oss: adapters on the (biased) attention projections equal the merged checkpoint;
    its experts (fused gate_up, clamped SwiGLU) take none: an expert module is refused,
    naming it."""
    from test_models_gpt_oss import write_checkpoint as write_gpt_oss

    config, _ = write_gpt_oss(tmp_path / "base", seed=2)
    w = base_weights(tmp_path / "base")
    layers = config.num_hidden_layers
    deltas = write_adapter(tmp_path / "a1", w, layers, r=4, alpha=8, seed=5, magnitude=2.0,
                           targets=("q_proj", "v_proj", "o_proj"))
    merged = write_merged(tmp_path / "base", tmp_path / "m1", deltas)
    loaded = load_model(str(tmp_path / "base"), "float32")
    lora = LoraManager(loaded.model, lora_config(max_loras=1))
    lora.add(request(1, tmp_path / "a1"))
    got = prefill_logits(loaded, PROMPTS[:2], lora, [1, 0])
    want = prefill_logits(load_model(str(merged), "float32"), PROMPTS[:1])[0]
    base = prefill_logits(load_model(str(tmp_path / "base"), "float32"), PROMPTS[:2])
    assert np.abs(want - base[0]).max() > 1e-2
    np.testing.assert_allclose(got[0], want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got[1], base[1], rtol=1e-4, atol=1e-4)
    module = "model.layers.0.mlp.experts.0.up_proj"
    write_adapter(tmp_path / "bad", {module + ".weight": np.zeros((8, config.hidden_size), np.float32)},
                  0, r=2, alpha=2, seed=0, modules=[module])
    with pytest.raises(ValueError, match="layer 0 has no experts.0.up_proj"):
        lora.add(request(2, tmp_path / "bad"))
