"""The matmul of dense and MLX-quantized layers on the GPU path, checked on Linux.

The GPU decision is forced by replacing the device fact (linear_choice.model_runs_on_gpu);
the models then run here on MLX's CPU kernels, so what is checked is the choice of
modules and that the model built from them still matches mlx-lm's own forward.
"""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from vllm_metal.models import linear_choice, load_model
from vllm_metal.models.gguf_linear import GGUFEmbedding, GGUFLinear
from vllm_metal.models.testing import (mlx_lm_reference, reference_logits, run_packed, tiny_config,
                                       write_random_checkpoint)

SEQUENCE = [5, 9, 12, 40, 7, 3, 8]
SCHEDULE = [4, 1, 1, 1]


@pytest.fixture
def force_gpu(monkeypatch):
    monkeypatch.setattr(linear_choice, "model_runs_on_gpu", lambda: True)


@pytest.fixture
def force_cpu(monkeypatch):
    monkeypatch.setattr(linear_choice, "model_runs_on_gpu", lambda: False)


def module_types(loaded) -> set[type]:
    return {type(m) for _, m in loaded.model.named_modules()}


def assert_matches_mlx_lm(loaded, checkpoint):
    got = run_packed(loaded, [SEQUENCE], [SCHEDULE])[0]
    want = reference_logits(mlx_lm_reference(checkpoint), SEQUENCE, SCHEDULE)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


def test_the_decision():
    assert linear_choice.dense_layers_on_gguf_matmul("gguf", on_gpu=False)
    assert not linear_choice.dense_layers_on_gguf_matmul("gguf", on_gpu=True, batch_invariant=False)
    # batch-invariant mode: MLX's GEMM picks kernels by shape, gguf_matmul's do not
    assert linear_choice.dense_layers_on_gguf_matmul("gguf", on_gpu=True, batch_invariant=True)
    assert not linear_choice.dense_layers_on_gguf_matmul("mlx", on_gpu=True, batch_invariant=True)
    assert not linear_choice.dense_layers_on_gguf_matmul("mlx", on_gpu=False)
    assert not linear_choice.dense_layers_on_gguf_matmul("mlx", on_gpu=True)


def test_the_device_fact(monkeypatch):
    assert not linear_choice.model_runs_on_gpu()  # this Linux build: CPU only
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    assert linear_choice.model_runs_on_gpu()
    monkeypatch.setattr(mx.metal, "is_available", lambda: False)
    assert not linear_choice.model_runs_on_gpu()


def test_gpu_keeps_mlx_matmul_for_a_dense_checkpoint(tmp_path, force_gpu):
    ckpt = write_random_checkpoint(tiny_config("qwen2"), tmp_path / "dense", seed=4)
    loaded = load_model(str(ckpt))
    attn = loaded.model.layers[0].self_attn
    assert type(attn.q_proj) is nn.Linear and type(loaded.model.layers[0].mlp.up_proj) is nn.Linear
    assert type(loaded.model.lm.model.embed_tokens) is nn.Embedding
    assert not module_types(loaded) & {GGUFLinear, GGUFEmbedding}
    assert_matches_mlx_lm(loaded, ckpt)


def test_cpu_moves_a_dense_checkpoint_to_gguf_matmul(tmp_path, force_cpu):
    ckpt = write_random_checkpoint(tiny_config("qwen2"), tmp_path / "dense", seed=4)
    loaded = load_model(str(ckpt))
    assert isinstance(loaded.model.layers[0].self_attn.q_proj, GGUFLinear)
    assert isinstance(loaded.model.lm.model.embed_tokens, GGUFEmbedding)
    assert nn.Linear not in module_types(loaded)


@pytest.fixture
def mixed_quantized_checkpoint(tmp_path):
    """mlx-community style: attention 4-bit (config "quantization", scales in the file),
    the MLP left dense, as mlx-lm's per-layer recipes leave some layers."""
    cfg = tiny_config("qwen3")
    model = mlx_lm_reference(write_random_checkpoint(cfg, tmp_path / "dense", seed=8))
    nn.quantize(model, group_size=32, bits=4,
                class_predicate=lambda path, m: isinstance(m, nn.Linear) and ".mlp." not in path)
    out = tmp_path / "q4"
    out.mkdir()
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps(dict(cfg, quantization={"group_size": 32, "bits": 4})))
    return out


def test_gpu_keeps_quantized_matmul_and_mlx_matmul(mixed_quantized_checkpoint, force_gpu):
    loaded = load_model(str(mixed_quantized_checkpoint))
    layer = loaded.model.layers[0]
    assert type(layer.self_attn.q_proj) is nn.QuantizedLinear
    assert type(layer.mlp.up_proj) is nn.Linear
    assert not module_types(loaded) & {GGUFLinear, GGUFEmbedding}
    assert_matches_mlx_lm(loaded, mixed_quantized_checkpoint)


def test_cpu_keeps_quantized_matmul_and_moves_dense_layers(mixed_quantized_checkpoint, force_cpu):
    loaded = load_model(str(mixed_quantized_checkpoint))
    layer = loaded.model.layers[0]
    assert type(layer.self_attn.q_proj) is nn.QuantizedLinear
    assert isinstance(layer.mlp.up_proj, GGUFLinear)
    assert_matches_mlx_lm(loaded, mixed_quantized_checkpoint)


@pytest.mark.parametrize("gpu", [True, False], ids=["gpu", "cpu"])
def test_qwen3_5_loader_takes_the_same_decision(tmp_path, monkeypatch, gpu):
    from qwen3_5_checkpoint import greedy, reference_model, run_packed_greedy, write_checkpoint

    monkeypatch.setattr(linear_choice, "model_runs_on_gpu", lambda: gpu)
    ckpt = write_checkpoint(tmp_path / "q35", seed=0)
    loaded = load_model(str(ckpt), "float32")
    kinds = module_types(loaded)
    if gpu:
        assert nn.Linear in kinds and not kinds & {GGUFLinear, GGUFEmbedding}
    else:
        assert GGUFLinear in kinds and nn.Linear not in kinds
    prompt = [5, 17, 3, 88, 42, 1, 9]
    assert run_packed_greedy(loaded, [prompt], 6)[0][0] == greedy(reference_model(ckpt), prompt, 6)
