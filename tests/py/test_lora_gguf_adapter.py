"""llama.cpp GGUF LoRA adapter files on the model (no server): a random adapter written
as llama.cpp's converter lays it out (llama q/k lora_b rows permuted) gives the logits
of the base with W + scale * B @ A merged in NumPy (HF row order), on safetensors and
GGUF bases; bad files are refused naming the problem."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from lora_checkpoint import base_weights, write_adapter, write_gguf_adapter, write_merged
from test_lora_model import PROMPTS, lora_config, prefill_logits
from vllm_metal.lora.manager import LoraManager
from vllm_metal.models import load_model
from vllm_metal.models.testing import tiny_config, write_random_checkpoint, write_tiny_gguf

LAYERS = 2


def request(lid, path):
    return SimpleNamespace(lora_int_id=lid, lora_name=f"g{lid}", lora_path=str(path),
                           load_inplace=False)


def run(loaded, lora, prompts, loras):
    return prefill_logits(loaded, prompts, lora, loras)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_gguf_adapter_on_a_safetensors_base_equals_the_merged_checkpoint(tmp_path, model_type):
    cfg = tiny_config(model_type, num_hidden_layers=LAYERS, tie_word_embeddings=False)
    base = write_random_checkpoint(cfg, tmp_path / "base", seed=1)
    heads = dict(n_heads=cfg["num_attention_heads"], n_kv_heads=cfg["num_key_value_heads"])
    deltas = write_gguf_adapter(tmp_path / "g1.gguf", base_weights(base), LAYERS, arch=model_type,
                                r=8, alpha=16, seed=5, magnitude=2.0, **heads)
    # a PEFT adapter in the same batch: both kinds share the slots
    peft = write_adapter(tmp_path / "p2", base_weights(base), LAYERS, r=4, alpha=8, seed=6,
                         targets=("q_proj", "k_proj"))
    loaded = load_model(str(base), "float32")
    lora = LoraManager(loaded.model, lora_config(max_loras=2))
    lora.add(request(1, tmp_path / "g1.gguf"))
    lora.add(request(2, tmp_path / "p2"))
    loras = [1, 0, 2]
    got = run(loaded, lora, PROMPTS[:3], loras)
    for prompt, lid, g in zip(PROMPTS, loras, got):
        ckpt = base if lid == 0 else write_merged(base, tmp_path / f"m{lid}",
                                                  deltas if lid == 1 else peft)
        want = prefill_logits(load_model(str(ckpt), "float32"), [prompt])[0]
        if lid:
            base_logits = prefill_logits(load_model(str(base), "float32"), [prompt])[0]
            assert np.abs(want - base_logits).max() > 1e-2  # the adapter moves the logits
        np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-4, err_msg=f"adapter {lid}")


def test_gguf_adapter_on_a_llama_gguf_base_equals_the_merged_dequantized_model(tmp_path):
    cfg = tiny_config("llama", num_hidden_layers=LAYERS, tie_word_embeddings=False)
    dense = write_tiny_gguf(cfg, tmp_path / "base.gguf", seed=3, qtype="Q8_0")
    deltas = write_gguf_adapter(tmp_path / "g.gguf", dense, LAYERS, arch="llama", r=8, alpha=4,
                                seed=9, magnitude=2.0, n_heads=cfg["num_attention_heads"],
                                n_kv_heads=cfg["num_key_value_heads"],
                                targets=("q_proj", "k_proj", "v_proj", "down_proj"))
    ref = load_model(str(tmp_path / "base.gguf"), "float32", linear="mlx")
    prompt = PROMPTS[0]
    base_logits = prefill_logits(ref, [prompt])[0]
    for module, (a, b, scale) in deltas.items():
        _, _, i, parent, proj = module.split(".")
        lin = getattr(getattr(ref.model.layers[int(i)], parent), proj)
        lin.weight = mx.array((np.array(lin.weight).astype(np.float64)
                               + scale * (b @ a)).astype(np.float32))
    want = prefill_logits(ref, [prompt])[0]
    assert np.abs(want - base_logits).max() > 1e-2

    loaded = load_model(str(tmp_path / "base.gguf"), "float32", int8_activations=False)
    assert loaded.model.layers[0].self_attn.q_proj.is_blocks
    lora = LoraManager(loaded.model, lora_config(max_loras=1))
    lora.add(request(1, tmp_path / "g.gguf"))
    got = run(loaded, lora, [prompt], [1])[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("alpha", [None, 0.0])
def test_an_adapter_without_alpha_has_a_scale_of_one(tmp_path, alpha):
    """llama.cpp's reading of a file without adapter.lora.alpha (or with 0): B @ A unscaled,
    so an adapter trained for scale 1 is neither dropped nor scaled by 0."""
    cfg = tiny_config("qwen3", num_hidden_layers=LAYERS, tie_word_embeddings=False)
    base = write_random_checkpoint(cfg, tmp_path / "base", seed=1)
    deltas = write_gguf_adapter(tmp_path / "g.gguf", base_weights(base), LAYERS, arch="qwen3", r=8,
                                alpha=alpha, seed=5, n_heads=cfg["num_attention_heads"],
                                n_kv_heads=cfg["num_key_value_heads"], targets=("q_proj", "down_proj"))
    assert {scale for _, _, scale in deltas.values()} == {1.0}
    loaded = load_model(str(base), "float32")
    lora = LoraManager(loaded.model, lora_config(max_loras=1))
    lora.add(request(1, tmp_path / "g.gguf"))
    got = run(loaded, lora, PROMPTS[:1], [1])[0]
    want = prefill_logits(load_model(str(write_merged(base, tmp_path / "m", deltas)), "float32"), PROMPTS[:1])[0]
    base_logits = prefill_logits(load_model(str(base), "float32"), PROMPTS[:1])[0]
    assert np.abs(want - base_logits).max() > 1e-2  # the adapter moves the logits
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_bad_gguf_adapters_are_refused_naming_the_problem(tmp_path):
    import gguf

    cfg = tiny_config("llama", num_hidden_layers=LAYERS, tie_word_embeddings=False)
    base = write_random_checkpoint(cfg, tmp_path / "base", seed=1)
    w = base_weights(base)
    heads = dict(n_heads=cfg["num_attention_heads"], n_kv_heads=cfg["num_key_value_heads"])
    write_gguf_adapter(tmp_path / "qwen.gguf", w, LAYERS, arch="qwen3", r=4, alpha=4, seed=1, **heads)
    write_gguf_adapter(tmp_path / "big.gguf", w, LAYERS, arch="llama", r=32, alpha=4, seed=1,
                       targets=("v_proj",), **heads)
    write_gguf_adapter(tmp_path / "alora.gguf", w, LAYERS, arch="llama", r=4, alpha=4, seed=1,
                       extra={"adapter.alora.invocation_tokens": [5, 6]}, **heads)
    write_tiny_gguf(cfg, tmp_path / "model.gguf", seed=1)  # a model, not an adapter
    odd = gguf.GGUFWriter(str(tmp_path / "embd.gguf"), "llama")
    odd.add_type("adapter")
    odd.add_string("adapter.type", "lora")
    odd.add_tensor("token_embd.weight.lora_a", np.zeros((4, 300), np.float32))
    odd.add_tensor("token_embd.weight.lora_b", np.zeros((64, 4), np.float32))
    odd.write_header_to_file(), odd.write_kv_data_to_file(), odd.write_tensors_to_file()
    odd.close()
    loaded = load_model(str(base), "float32")
    lora = LoraManager(loaded.model, lora_config(max_loras=1))
    for lid, (name, message) in enumerate([
            ("qwen.gguf", "adapter architecture 'qwen3' does not match the model (llama)"),
            ("big.gguf", "rank 32 exceeds --max-lora-rank 16"),
            ("alora.gguf", "activated LoRA (adapter.alora.*) is not supported"),
            ("model.gguf", "not a GGUF LoRA adapter (general.type"),
            ("embd.gguf", "target tensor token_embd.weight is not one LoRA applies to")], 1):
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            lora.add(request(lid, tmp_path / name))
    assert lora.list() == set()
