"""LoRA on SmolLM2-135M-Instruct Q4_1 from GGUF (offline package): the weights stay in
block form and a random PEFT adapter's delta is added to gguf_matmul's output; the
reference is the same file dequantized at load with W + scale * B @ A merged in NumPy."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from lora_checkpoint import write_adapter
from vllm_metal.models.offline import OfflineModelMissing, smollm2_gguf

try:
    SMOLLM2 = smollm2_gguf()
except OfflineModelMissing as e:
    pytestmark = pytest.mark.skip(reason=str(e))
    SMOLLM2 = None

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 30]


def logits_of(loaded, prompt, lora=None):
    from vllm_metal.models.generate import KVPool, SeqChunk, build_step

    pool = KVPool(loaded.spec, 8, 16)
    table = []
    pool.allocate(table, len(prompt))
    step = build_step([SeqChunk(prompt, 0, table, "all")], pool.kv_caches, 16)
    if lora is not None:
        lora.begin_step(["x"], np.array(step.ctx.cu_seqlens_q))
    try:
        out = loaded.model(step.input_ids, step.ctx)
        mx.eval(out)
    finally:
        if lora is not None:
            lora.end_step()
    return np.array(out)


@pytest.mark.slow
def test_smollm2_q4_1_with_an_adapter_equals_the_merged_dequantized_model(tmp_path):
    from vllm_metal.lora.manager import LoraManager
    from vllm_metal.models import load_model

    ref = load_model(str(SMOLLM2), "float32", linear="mlx")
    layers = ref.model.layers
    weights = {}
    for i, layer in enumerate(layers):
        for parent in ("self_attn", "mlp"):
            for name, mod in getattr(layer, parent).children().items():
                if name.endswith("_proj"):
                    weights[f"model.layers.{i}.{parent}.{name}.weight"] = np.array(mod.weight)
    # every projection of the first and last layers, attention of one in the middle
    deltas = write_adapter(tmp_path / "a", weights, len(layers), r=8, alpha=16, seed=7,
                           layers=[0, len(layers) - 1], magnitude=2.0)
    deltas |= write_adapter(tmp_path / "b", weights, len(layers), r=8, alpha=16, seed=8,
                            layers=[14], targets=("q_proj", "v_proj"), magnitude=2.0)
    # one adapter dir holding both sets
    import shutil

    t = dict(mx.load(str(tmp_path / "a" / "adapter_model.safetensors")))
    t |= mx.load(str(tmp_path / "b" / "adapter_model.safetensors"))
    mx.save_safetensors(str(tmp_path / "a" / "adapter_model.safetensors"), t)
    shutil.rmtree(tmp_path / "b")

    base = logits_of(ref, PROMPT)
    for module, (a, b, scale) in deltas.items():
        _, _, i, parent, proj = module.split(".")
        lin = getattr(getattr(layers[int(i)], parent), proj)
        lin.weight = mx.array((np.array(lin.weight).astype(np.float64)
                               + scale * (b @ a)).astype(np.float32))
    want = logits_of(ref, PROMPT)
    del ref

    loaded = load_model(str(SMOLLM2), "float32", int8_activations=False)
    assert loaded.model.layers[0].self_attn.q_proj.is_blocks
    lora = LoraManager(loaded.model, SimpleNamespace(max_loras=1, max_lora_rank=8, max_cpu_loras=1))
    req = SimpleNamespace(lora_int_id=1, lora_name="a", lora_path=str(tmp_path / "a"),
                          load_inplace=False)
    lora.add(req)
    lora.request_added("x", req)
    got = logits_of(loaded, PROMPT, lora)
    assert np.abs(want - base).max() > 0.1  # the adapter moves the logits
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 1e-4, err
    assert (got.argmax(-1) == want.argmax(-1)).all()


@pytest.mark.slow
def test_smollm2_q4_1_with_a_llama_cpp_gguf_adapter_equals_the_merged_dequantized_model(tmp_path):
    """The adapter as llama.cpp's converter writes it for this llama-arch model: lora_b
    of attn_q / attn_k in the permuted row order of the file's own Q/K."""
    from lora_checkpoint import write_gguf_adapter
    from vllm_metal.lora.manager import LoraManager
    from vllm_metal.models import load_model

    ref = load_model(str(SMOLLM2), "float32", linear="mlx")
    layers = ref.model.layers
    attn = layers[0].self_attn
    weights = {}
    for i, layer in enumerate(layers):
        for parent in ("self_attn", "mlp"):
            for name, mod in getattr(layer, parent).children().items():
                if name.endswith("_proj"):
                    weights[f"model.layers.{i}.{parent}.{name}.weight"] = np.array(mod.weight)
    deltas = write_gguf_adapter(tmp_path / "a.gguf", weights, len(layers), arch="llama", r=8,
                                alpha=16, seed=17, layers=[0, 14, len(layers) - 1],
                                magnitude=2.0, n_heads=attn.num_heads, n_kv_heads=attn.num_kv_heads)
    base = logits_of(ref, PROMPT)
    for module, (a, b, scale) in deltas.items():
        _, _, i, parent, proj = module.split(".")
        lin = getattr(getattr(layers[int(i)], parent), proj)
        lin.weight = mx.array((np.array(lin.weight).astype(np.float64)
                               + scale * (b @ a)).astype(np.float32))
    want = logits_of(ref, PROMPT)
    del ref

    loaded = load_model(str(SMOLLM2), "float32", int8_activations=False)
    assert loaded.model.layers[0].self_attn.q_proj.is_blocks
    lora = LoraManager(loaded.model, SimpleNamespace(max_loras=1, max_lora_rank=8, max_cpu_loras=1))
    req = SimpleNamespace(lora_int_id=1, lora_name="a", lora_path=str(tmp_path / "a.gguf"),
                          load_inplace=False)
    lora.add(req)
    lora.request_added("x", req)
    got = logits_of(loaded, PROMPT, lora)
    assert np.abs(want - base).max() > 0.1  # the adapter moves the logits
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 1e-4, err
    assert (got.argmax(-1) == want.argmax(-1)).all()
