"""Tensor-parallel shards (models/tensor_parallel.py) and the platform's refusals.

The shard test runs two processes joined by MLX's ring on loopback (tensor_parallel_rank.py),
each holding half the heads and MLP columns; reference: the same model unsharded in this
process. Dense safetensors and GGUF blocks (Q8_0: the splits fall on whole blocks), both in one
pair of rank processes. Qwen3.5's split: test_tensor_parallel_qwen3_5.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from serving_harness import free_port  # a port no other test worker takes
from vllm_metal.models import load_model
from vllm_metal.models.tensor_parallel import TensorParallelError, shard_model
from vllm_metal.models.testing import run_packed, tiny_config, write_random_checkpoint, write_tiny_gguf
from vllm_metal.platform import UnsupportedConfiguration, _refuse_unsupported_tensor_parallel

HERE = Path(__file__).parent
SHAPE = dict(hidden_size=128, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, tie_word_embeddings=False)


def run_two_ranks(models: list[str], tmp_path: Path) -> list[list[np.ndarray]]:
    """Per model: each sequence's logits from two ranks (one pair of processes for all)."""
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{free_port()}"], [f"127.0.0.1:{free_port()}"]]))
    out = tmp_path / "logits.npz"
    procs = [subprocess.Popen([sys.executable, str(HERE / "tensor_parallel_rank.py"), str(out), *models],
                              env={**os.environ, "MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in (0, 1)]
    try:
        for p in procs:
            output, _ = p.communicate(timeout=120)
            assert p.returncode == 0, output
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    data = np.load(out)
    return [[data[f"m{j}_{i}"] for i in range(sum(k.startswith(f"m{j}_") for k in data.files))]
            for j in range(len(models))]


def reference(model: str) -> list[np.ndarray]:
    sys.path.insert(0, str(HERE))
    from tensor_parallel_rank import SEQUENCES

    return run_packed(load_model(model, "float32"), SEQUENCES)


def test_two_ranks_give_the_unsharded_logits(tmp_path):
    """llama from safetensors and Q8_0 GGUF, and a Qwen3-MoE (its experts split by columns:
    tensor_parallel_moe.py)."""
    from test_models_qwen3_moe import write_checkpoint as write_qwen3_moe

    cfg = tiny_config("llama", **SHAPE)
    models = [str(write_random_checkpoint(cfg, tmp_path / "ckpt", seed=5)), str(tmp_path / "m.gguf"),
              str(tmp_path / "moe")]
    write_tiny_gguf(cfg, models[1], seed=5, qtype="Q8_0")
    write_qwen3_moe(tmp_path / "moe", seed=5, vocab_size=320)
    for model, sharded in zip(models, run_two_ranks(models, tmp_path), strict=True):
        for got, want in zip(sharded, reference(model), strict=True):
            np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)


def test_a_split_through_gguf_blocks_is_refused(tmp_path):
    # Q4_K blocks hold 256 columns: o_proj's 256 input columns cannot go 128 to each rank
    cfg = tiny_config("llama", **dict(SHAPE, hidden_size=256, intermediate_size=512, head_dim=64))
    write_tiny_gguf(cfg, tmp_path / "m.gguf", seed=5, qtype="Q4_K")
    loaded = load_model(str(tmp_path / "m.gguf"), "float32")
    with pytest.raises(TensorParallelError, match="o_proj: its Q4_K blocks hold 256 columns"):
        shard_model(loaded.model, 0, 2, mx.distributed.init())


def test_heads_the_size_does_not_divide_are_refused_at_load(tmp_path):
    cfg = tiny_config("llama", **dict(SHAPE, num_attention_heads=6, num_key_value_heads=3, hidden_size=192))
    loaded = load_model(str(write_random_checkpoint(cfg, tmp_path / "ckpt")), "float32")
    with pytest.raises(TensorParallelError, match="does not divide the model's 3 KV heads"):
        shard_model(loaded.model, 0, 2, mx.distributed.init())


def _config(size=2, *, archs=("LlamaForCausalLM",), heads=4, kv_heads=2, speculative=None, lora=None,
            runner="generate", linear_heads=None):
    text = SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads)
    if linear_heads is not None:  # Qwen3.5's linear attention: (key heads, value heads)
        text.linear_num_key_heads, text.linear_num_value_heads = linear_heads
    model = SimpleNamespace(runner_type=runner, hf_config=SimpleNamespace(architectures=list(archs)),
                            hf_text_config=text)
    return SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=size),
                           speculative_config=speculative, lora_config=lora, model_config=model)


def test_tensor_parallel_configurations_pass():
    _refuse_unsupported_tensor_parallel(_config())
    _refuse_unsupported_tensor_parallel(_config(4, heads=8, kv_heads=4))
    _refuse_unsupported_tensor_parallel(_config(archs=("Qwen3_5ForCausalLM",), linear_heads=(16, 32)))


@pytest.mark.parametrize("kw, words", [
    # SmolLM2-135M: 9 attention heads, 3 KV heads
    (dict(heads=9, kv_heads=3), "does not divide the model's 9 attention heads"),
    (dict(heads=4, kv_heads=1), "does not divide the model's 1 KV heads"),
    (dict(speculative=SimpleNamespace(method="draft_model")),
     r"with speculative decoding \(draft_model\) is not supported; supported: ngram"),
    (dict(lora=object()), "with LoRA.*--pipeline-parallel-size carries it"),
    (dict(runner="pooling"), "with --runner pooling"),
    # Qwen3.5: each rank keeps whole linear-attention heads too
    (dict(archs=("Qwen3_5ForCausalLM",), linear_heads=(3, 6)),
     "does not divide the model's 3 linear-attention key heads"),
])
def test_unsupported_tensor_parallel_configurations_are_refused(kw, words):
    with pytest.raises(UnsupportedConfiguration, match=words):
        _refuse_unsupported_tensor_parallel(_config(**kw))


def test_ring_addresses(monkeypatch):
    from vllm_metal.mlx_ring import ring_address

    monkeypatch.delenv("VLLM_METAL_RING_ADDRESS", raising=False)
    host, port = ring_address(0, several_hosts=False).split(":")
    assert host == "127.0.0.1" and int(port) > 0
    monkeypatch.setenv("VLLM_METAL_RING_ADDRESS", "10.0.0.2:18300")
    assert ring_address(1, several_hosts=True) == "10.0.0.2:18301"  # a host's second worker
    monkeypatch.setenv("VLLM_METAL_RING_ADDRESS", "10.0.0.2")
    with pytest.raises(ValueError, match="must be host:port"):
        ring_address(0, several_hosts=True)


def test_olmoe_whole_width_qk_norms_are_refused_at_load(tmp_path):
    """OLMoE normalises all heads' q (and k) together: a rank's half of the heads cannot."""
    from test_models_olmoe import write_checkpoint as write_olmoe

    write_olmoe(tmp_path / "olmoe", seed=1)
    loaded = load_model(str(tmp_path / "olmoe"), "float32")
    with pytest.raises(TensorParallelError, match="layer 0: q/k norms over all heads together"):
        shard_model(loaded.model, 0, 2, mx.distributed.init())


@pytest.mark.parametrize("parallel, words", [
    (dict(enable_expert_parallel=True), r"--enable-expert-parallel.*splits every expert's columns"),
    (dict(distributed_executor_backend="ray"), r"--distributed-executor-backend ray.*--nnodes"),
])
def test_expert_parallelism_and_other_executors_are_refused(parallel, words):
    from vllm_metal.platform import _refuse_unsupported

    config = _config()
    config.parallel_config = SimpleNamespace(**{
        **dict(tensor_parallel_size=2, pipeline_parallel_size=1, data_parallel_size=1, world_size=2,
               distributed_executor_backend="mp", enable_expert_parallel=False), **parallel})
    config.cache_config = SimpleNamespace(prefix_caching_hash_algo="sha256")
    config.kv_transfer_config = None
    config.observability_config = SimpleNamespace(kv_cache_metrics=False)
    with pytest.raises(UnsupportedConfiguration, match=words):
        _refuse_unsupported(config)
