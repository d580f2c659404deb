"""LoRA on the model (no server): a packed batch mixing adapters and the base gives
every sequence the logits of the base checkpoint with its adapter merged in NumPy
(W + scale * B @ A); slot reuse, eviction and reload; the adapter checks."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from lora_checkpoint import base_weights, write_adapter, write_merged
from vllm_metal.models import load_model
from vllm_metal.models.generate import KVPool, SeqChunk, build_step
from vllm_metal.models.testing import tiny_config, write_random_checkpoint

LAYERS = 2


def lora_config(max_loras=2, max_rank=16, max_cpu_loras=None):
    return SimpleNamespace(max_loras=max_loras, max_lora_rank=max_rank,
                           max_cpu_loras=max_cpu_loras or max_loras)


def request(lid, path):
    return SimpleNamespace(lora_int_id=lid, lora_name=f"a{lid}", lora_path=str(path),
                           load_inplace=False)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def setup(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"lora_{request.param}")
    cfg = tiny_config(request.param, num_hidden_layers=LAYERS, tie_word_embeddings=False)
    base = write_random_checkpoint(cfg, tmp / "base", seed=1)
    w = base_weights(base)
    adapters = {
        1: write_adapter(tmp / "a1", w, LAYERS, r=8, alpha=16, seed=11),
        # attention only, a per-module rank and alpha (rank_pattern / alpha_pattern)
        2: write_adapter(tmp / "a2", w, LAYERS, r=4, alpha=4, seed=12,
                         targets=("q_proj", "v_proj", "o_proj"), rank_pattern={"v_proj": 2},
                         alpha_pattern={"o_proj": 12}),
        # rank-stabilised (rsLoRA): alpha / sqrt(r), here 2 where alpha / r would be 0.5
        3: write_adapter(tmp / "a3", w, LAYERS, r=16, alpha=8, seed=13, layers=[1],
                         targets=("gate_proj", "up_proj", "down_proj", "k_proj"), use_rslora=True),
    }
    merged = {lid: write_merged(base, tmp / f"m{lid}", d) for lid, d in adapters.items()}
    return SimpleNamespace(tmp=tmp, base=base, merged=merged)


def prefill_logits(loaded, prompts, lora=None, loras=None):
    """All prompts in one packed prefill step; logits of every position per prompt.
    loras: the adapter id of each prompt (0 = base)."""
    pool = KVPool(loaded.spec, 64, 4)
    tables = [[] for _ in prompts]
    chunks = []
    for i, p in enumerate(prompts):
        pool.allocate(tables[i], len(p))
        chunks.append(SeqChunk(p, 0, tables[i], "all"))
    step = build_step(chunks, pool.kv_caches, 4)
    if lora is not None:
        ids = [f"r{i}" for i in range(len(prompts))]
        for rid, lid in zip(ids, loras):
            lora.request_added(rid, request(lid, "") if lid else None)
        lora.begin_step(ids, np.array(step.ctx.cu_seqlens_q))
    try:
        logits = loaded.model(step.input_ids, step.ctx)
        mx.eval(logits)
    finally:
        if lora is not None:
            lora.end_step()
            lora.requests_removed(ids)
    out, row = [], 0
    logits = np.array(logits)
    for p in prompts:
        out.append(logits[row:row + len(p)])
        row += len(p)
    return out


PROMPTS = [[5, 9, 30, 7, 2, 44], [3, 3, 8], [100, 17, 56, 90, 12], [7, 1, 2, 3]]


def merged_logits(setup, lid, prompt):
    loaded = load_model(str(setup.base if lid == 0 else setup.merged[lid]), "float32")
    return prefill_logits(loaded, [prompt])[0]


def test_mixed_batch_equals_merged_checkpoints(setup):
    loaded = load_model(str(setup.base), "float32")
    from vllm_metal.lora.manager import LoraManager

    lora = LoraManager(loaded.model, lora_config(max_loras=3))
    for lid in (1, 2, 3):
        assert lora.add(request(lid, setup.tmp / f"a{lid}"))
    loras = [1, 0, 2, 3]
    got = prefill_logits(loaded, PROMPTS, lora, loras)
    for prompt, lid, g in zip(PROMPTS, loras, got):
        want = merged_logits(setup, lid, prompt)
        base = merged_logits(setup, 0, prompt)
        # the adapter moves the logits well beyond the tolerance
        assert np.abs(want - base).max() > 1e-2 or lid == 0
        np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-4, err_msg=f"adapter {lid}")


def test_slots_are_reused_and_adapters_reload_after_cpu_eviction(setup):
    loaded = load_model(str(setup.base), "float32")
    from vllm_metal.lora.manager import LoraManager

    lora = LoraManager(loaded.model, lora_config(max_loras=1, max_cpu_loras=1))
    for lid in (1, 2):  # the second add evicts the first from the CPU cache
        lora.add(request(lid, setup.tmp / f"a{lid}"))
    assert lora.list() == {2}
    for lid in (1, 2, 1, 3, 0):  # one slot: each step's adapter replaces the last
        # a request's lora_request carries the path: an evicted adapter is read again
        lora.request_added("x", request(lid, setup.tmp / f"a{lid}") if lid else None)
        got = _prefill_one(lora, loaded, PROMPTS[0])
        np.testing.assert_allclose(got, merged_logits(setup, lid, PROMPTS[0]), rtol=1e-4, atol=1e-4)
    assert lora.remove(3) and 3 not in lora.list()


def _prefill_one(lora, loaded, prompt):
    """One prefill of request "x" (its lora_request set by the caller, with the real
    path, so a CPU-evicted adapter reloads from it)."""
    pool = KVPool(loaded.spec, 64, 4)
    table = []
    pool.allocate(table, len(prompt))
    step = build_step([SeqChunk(prompt, 0, table, "all")], pool.kv_caches, 4)
    lora.begin_step(["x"], np.array(step.ctx.cu_seqlens_q))
    try:
        logits = loaded.model(step.input_ids, step.ctx)
        mx.eval(logits)
    finally:
        lora.end_step()
    return np.array(logits)


@pytest.mark.parametrize("change, message", [
    (dict(r=32), "rank 32 exceeds --max-lora-rank 16"),
    (dict(targets=("q_proj", "lm_head")), "target module .*lm_head is not one the model has"),
    (dict(layers=[5]), "the model has 2 layers"),
    (dict(shape=True), "do not match the model's projection"),
])
def test_bad_adapters_are_refused_naming_the_problem(setup, tmp_path, change, message):
    loaded = load_model(str(setup.base), "float32")
    from vllm_metal.lora.manager import LoraManager

    lora = LoraManager(loaded.model, lora_config())
    change = dict(change)  # the parametrized dict is shared by both models
    w = dict(base_weights(setup.base))
    w["model.layers.5.self_attn.q_proj.weight"] = w["model.layers.0.self_attn.q_proj.weight"]
    w["model.layers.0.lm_head.weight"] = np.zeros((4, 4), np.float32)
    if change.pop("shape", False):
        w["model.layers.0.self_attn.q_proj.weight"] = np.zeros((7, 9), np.float32)
    targets = change.pop("targets", ("q_proj",))
    if "lm_head" in targets:
        _write_lm_head_adapter(tmp_path / "bad", w)
    else:
        write_adapter(tmp_path / "bad", w, LAYERS, r=change.pop("r", 4), alpha=8, seed=0,
                      targets=targets, **change)
    with pytest.raises(ValueError, match=message):
        lora.add(request(9, tmp_path / "bad"))
    assert lora.list() == set()


def _write_lm_head_adapter(out, w):
    write_adapter(out, w, LAYERS, r=4, alpha=8, seed=0, targets=("q_proj",))
    t = mx.load(str(out / "adapter_model.safetensors"))
    t["base_model.model.lm_head.lora_A.weight"] = mx.zeros((4, 64))
    t["base_model.model.lm_head.lora_B.weight"] = mx.zeros((300, 4))
    mx.save_safetensors(str(out / "adapter_model.safetensors"), t)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_gguf_base_in_block_form_equals_the_merged_dequantized_weights(tmp_path, qtype):
    """The base stays in GGUF blocks (the delta is added to gguf_matmul's output); the
    reference is the same file dequantized at load (linear="mlx") with W + scale*B@A
    written into the dense weights."""
    from vllm_metal.lora.manager import LoraManager
    from vllm_metal.models.testing import write_tiny_gguf

    cfg = tiny_config("llama", num_hidden_layers=LAYERS, tie_word_embeddings=False)
    path = tmp_path / "m.gguf"
    dense = write_tiny_gguf(cfg, path, seed=3, qtype=qtype)
    deltas = write_adapter(tmp_path / "a", dense, LAYERS, r=8, alpha=16, seed=5, magnitude=2.0)

    loaded = load_model(str(path), "float32", int8_activations=False)
    assert loaded.model.layers[0].self_attn.q_proj.is_blocks
    lora = LoraManager(loaded.model, lora_config(max_loras=1))
    lora.add(request(1, tmp_path / "a"))
    lora.request_added("x", request(1, tmp_path / "a"))
    got = _prefill_one(lora, loaded, PROMPTS[0])
    base = prefill_logits(loaded, [PROMPTS[0]])[0]  # no row slot: the base model

    ref = load_model(str(path), "float32", linear="mlx")
    for module, (a, b, scale) in deltas.items():
        _, layer, i, parent, proj = module.split(".")
        lin = getattr(getattr(ref.model.layers[int(i)], parent), proj)
        w = np.array(lin.weight).astype(np.float64) + scale * (b @ a)
        lin.weight = mx.array(w.astype(np.float32))
    want = prefill_logits(ref, [PROMPTS[0]])[0]
    assert np.abs(want - base).max() > 1e-2  # the adapter matters beyond the tolerance
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)


def test_mixed_batch_on_the_metal_kernels_in_the_emulator(tmp_path):
    """Every op of the LoRA forward (lora_apply included) on its Metal kernel, emulated;
    the references run on the CPU kernels. Head size 64: one the Metal attention takes."""
    from vllm_metal import ops
    from vllm_metal.lora.manager import LoraManager

    cfg = tiny_config("llama", hidden_size=128, intermediate_size=192, num_hidden_layers=LAYERS,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                      tie_word_embeddings=False)
    base = write_random_checkpoint(cfg, tmp_path / "base", seed=2)
    w = base_weights(base)
    deltas = {lid: write_adapter(tmp_path / f"a{lid}", w, LAYERS, r=4 * lid, alpha=8, seed=lid,
                                 magnitude=2.0) for lid in (1, 2)}
    loras = [2, 0, 1]
    # a prefill step (per-op plan) and one of 7 tokens (the fused plan's size: with
    # adapters the layer still runs the per-op plan, lora_apply after each mat-mul)
    prompts = PROMPTS[:3] + [[4], [8, 2], [6, 1, 9, 3]]
    loras = loras + loras
    merged = {0: base} | {lid: write_merged(base, tmp_path / f"m{lid}", d) for lid, d in deltas.items()}
    want = [prefill_logits(load_model(str(merged[lid]), "float32"), [p])[0]
            for p, lid in zip(prompts, loras)]
    previous = ops.kernel_backend()
    ops.set_kernel_backend("emulated")
    try:
        loaded = load_model(str(base), "float32")
        lora = LoraManager(loaded.model, lora_config(max_loras=2))
        for lid in (1, 2):
            lora.add(request(lid, tmp_path / f"a{lid}"))
        got = prefill_logits(loaded, prompts[:3], lora, loras[:3])
        got += prefill_logits(loaded, prompts[3:], lora, loras[3:])
    finally:
        ops.set_kernel_backend(previous)
    for g, w_, lid in zip(got, want, loras):
        np.testing.assert_allclose(g, w_, rtol=2e-4, atol=2e-4, err_msg=f"adapter {lid}")


def test_steps_with_and_without_adapters_run_the_fused_layers(setup, monkeypatch):
    """--enable-lora costs base-only steps nothing: they run the fused decoder layers on
    the base projections; a step with an adapter runs them too, with its slots (the
    per-op path, VLLM_METAL_FUSED_LAYERS=0, gives the same numbers)."""
    from vllm_metal.lora.manager import LoraManager
    from vllm_metal.models import fused_layers

    plain = load_model(str(setup.base), "float32")
    want = prefill_logits(plain, PROMPTS[:2])
    assert plain.model.__dict__.get("_fused_plan")  # the fused path runs on this model
    loaded = load_model(str(setup.base), "float32")
    lora = LoraManager(loaded.model, lora_config())
    lora.add(request(1, setup.tmp / "a1"))
    got = prefill_logits(loaded, PROMPTS[:2], lora, [0, 0])
    assert loaded.model.__dict__.get("_fused_plan")
    for g, w_ in zip(got, want):
        np.testing.assert_array_equal(g, w_)
    calls = []
    real = fused_layers._core.decoder_layer
    monkeypatch.setattr(fused_layers._core, "decoder_layer",
                        lambda *a, **k: calls.append(a[-1].lora) or real(*a, **k))
    mixed = prefill_logits(loaded, PROMPTS[:2], lora, [1, 0])
    assert calls == [True] * LAYERS  # the fused op, given the adapters
    np.testing.assert_allclose(mixed[1], want[1], rtol=1e-4, atol=1e-4)  # the base row
    np.testing.assert_allclose(mixed[0], merged_logits(setup, 1, PROMPTS[0]), rtol=1e-4, atol=1e-4)
    monkeypatch.setenv("VLLM_METAL_FUSED_LAYERS", "0")
    per_op = load_model(str(setup.base), "float32")
    lora_per_op = LoraManager(per_op.model, lora_config())
    lora_per_op.add(request(1, setup.tmp / "a1"))
    for g, w_ in zip(mixed, prefill_logits(per_op, PROMPTS[:2], lora_per_op, [1, 0])):
        np.testing.assert_allclose(g, w_, rtol=1e-5, atol=1e-5)


def test_an_adapter_for_a_projection_the_layer_lacks_is_refused(setup, tmp_path):
    """A layer without a dense MLP (sparse MoE) has no gate/up/down to adapt."""
    from vllm_metal.lora.manager import LoraManager

    loaded = load_model(str(setup.base), "float32")
    mlp = loaded.model.layers[1].mlp
    del mlp["gate_proj"]  # stands in for a MoE block: no dense gate_proj in layer 1
    lora = LoraManager(loaded.model, lora_config())
    write_adapter(tmp_path / "a", base_weights(setup.base), LAYERS, r=4, alpha=8, seed=0,
                  targets=("gate_proj",))
    with pytest.raises(ValueError, match="layer 1 has no dense gate_proj"):
        lora.add(request(1, tmp_path / "a"))


@pytest.mark.parametrize("backend", ["native", "emulated"])
def test_batch_invariant_mode_holds_with_adapters(tmp_path, backend):
    """VLLM_BATCH_INVARIANT=1 (docs/serving.md) with LoRA: each prompt's logits in a batch
    mixing two adapters and the base equal its logits alone, bitwise, on the CPU kernels
    and on the emulated Metal ones; a base prompt beside adapter rows equals it in a step
    with no adapter (which runs without the LoRA hook)."""
    from vllm_metal import ops
    from vllm_metal.lora.manager import LoraManager

    cfg = tiny_config("llama", num_hidden_layers=LAYERS, tie_word_embeddings=False, head_dim=64)
    base = write_random_checkpoint(cfg, tmp_path / "base", seed=1)
    w = base_weights(base)
    write_adapter(tmp_path / "a1", w, LAYERS, r=8, alpha=16, seed=11)
    write_adapter(tmp_path / "a2", w, LAYERS, r=4, alpha=4, seed=12, targets=("q_proj", "v_proj", "o_proj"))
    previous = ops.kernel_backend(), ops.batch_invariant()
    ops.set_kernel_backend(backend)
    ops.set_batch_invariant(True)
    try:
        loaded = load_model(str(base), "float32")
        lora = LoraManager(loaded.model, lora_config(max_loras=2))
        for lid in (1, 2):
            assert lora.add(request(lid, tmp_path / f"a{lid}"))
        loras = [1, 0, 2, 0]
        batched = prefill_logits(loaded, PROMPTS, lora, loras)
        for prompt, lid, got in zip(PROMPTS, loras, batched):
            alone = prefill_logits(loaded, [prompt], lora, [lid])[0] if lid else prefill_logits(loaded, [prompt])[0]
            assert np.array_equal(got, alone), f"adapter {lid}: {np.abs(got - alone).max()}"
    finally:
        ops.set_kernel_backend(previous[0])
        ops.set_batch_invariant(previous[1])
