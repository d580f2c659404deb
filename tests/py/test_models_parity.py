"""Our paged models against mlx-lm's own, on tiny random checkpoints.

Several sequences are packed into each step (prefill chunks of different
lengths, then decode rows first and prefill chunks behind them, then decode
steps), with a paged KV cache whose blocks are scattered; every logits row must
equal mlx-lm's model run on that sequence alone with its own KV cache. This is
what proves the attention swap, rope at per-token positions and the packing.
"""

from __future__ import annotations

import numpy as np
import pytest

import mlx.core as mx
from mlx.utils import tree_flatten

from vllm_metal.models import load_model
from vllm_metal.models.generate import KVPool, SeqChunk, build_step
from vllm_metal.models.gguf_linear import GGUFEmbedding, GGUFLinear
from vllm_metal.models.testing import (GGUF_LOGITS_TOLERANCE, SCHEDULES, TINY_CONFIGS,
                                       mlx_lm_reference, reference_logits, run_packed, tiny_config,
                                       write_random_checkpoint)

BLOCK_SIZE = 4

@pytest.mark.parametrize("fused", ["1", "0"], ids=["fused_layers", "per_op"])
@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_packed_paged_forward_matches_mlx_lm(tmp_path, monkeypatch, name, fused):
    """Both execution paths of the llama family: fused C++ layers and per-op MLX graphs."""
    monkeypatch.setenv("VLLM_METAL_FUSED_LAYERS", fused)
    cfg = tiny_config(name)
    ckpt = write_random_checkpoint(cfg, tmp_path / name, seed=1)
    ours = load_model(str(ckpt), "float32")
    ref = mlx_lm_reference(ckpt)
    rng = np.random.default_rng(2)
    sequences = [rng.integers(3, cfg["vocab_size"], sum(s)).tolist() for s in SCHEDULES]

    got = run_packed(ours, sequences, SCHEDULES)
    for seq, sched, logits in zip(sequences, SCHEDULES, got):
        want = reference_logits(ref, seq, sched)
        scale = np.abs(want).max()
        # Dense float32 weights take gguf_matmul as type F32: float32 sums, no 8-bit rounding.
        np.testing.assert_allclose(logits, want, rtol=0,
                                   atol=GGUF_LOGITS_TOLERANCE["F32"] * max(scale, 1.0),
                                   err_msg=f"{name}: sequence of schedule {sched}")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_dense_weights_run_on_gguf_matmul(tmp_path, dtype):
    """safetensors linear layers, embeddings and the tied lm_head become
    GGUFLinear / GGUFEmbedding on the same dense weights (types F32/F16/BF16);
    linear="mlx" keeps mlx-lm's modules and agrees."""
    import mlx.nn as nn

    cfg = tiny_config("qwen2")  # tied, q/k/v bias
    ckpt = write_random_checkpoint(cfg, tmp_path / "q", seed=4, dtype=dtype)
    ours = load_model(str(ckpt))
    mlx_path = load_model(str(ckpt), linear="mlx")
    attn = ours.model.layers[0].self_attn
    for m in (attn.q_proj, attn.o_proj, ours.model.layers[0].mlp.up_proj):
        assert isinstance(m, GGUFLinear) and not m.is_blocks and m.weight.dtype == getattr(mx, dtype)
    assert "bias" in attn.q_proj and "bias" not in attn.o_proj
    assert isinstance(ours.model.lm.model.embed_tokens, GGUFEmbedding)
    assert type(mlx_path.model.layers[0].self_attn.q_proj) is nn.Linear
    seq = [[5, 9, 12, 40, 7, 3, 8, 22, 31, 4, 17]]
    got = run_packed(ours, seq, [[9, 1, 1]])[0]
    want = run_packed(mlx_path, seq, [[9, 1, 1]])[0]
    tol = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 5e-2}[dtype]  # ours sums in float32
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * np.abs(want).max())


def test_logits_only_for_requested_rows(tmp_path):
    cfg = tiny_config("qwen3")
    ours = load_model(str(write_random_checkpoint(cfg, tmp_path / "q", seed=3)), "float32")
    pool = KVPool(ours.spec, 16, BLOCK_SIZE)
    tables = [[], []]
    for t, n in zip(tables, (6, 3)):
        pool.allocate(t, n)
    chunks = [SeqChunk(list(range(5, 11)), 0, tables[0], "last"),
              SeqChunk([7, 8, 9], 0, tables[1], "none")]
    packed = build_step(chunks, pool.kv_caches, BLOCK_SIZE)
    logits = ours.model(packed.input_ids, packed.ctx)
    assert logits.shape == (1, cfg["vocab_size"])
    assert packed.ctx.logits_indices.tolist() == [5]


def test_spec_of_gemma3_alternates_windows(tmp_path):
    cfg = tiny_config("gemma3", num_hidden_layers=4)
    loaded = load_model(str(write_random_checkpoint(cfg, tmp_path / "g")), "float32")
    assert loaded.spec.sliding_window_per_layer == [5, 0, 5, 0]
    assert loaded.spec.num_kv_heads == 1 and loaded.spec.head_dim == 16
    assert loaded.spec.architecture == "Gemma3ForCausalLM"
    assert loaded.eos_token_ids == [2]


@pytest.mark.parametrize("name", ["llama3", "gemma3"])
def test_forward_on_emulated_metal_kernels_matches_mlx_lm(tmp_path, name):
    """The whole forward on the Metal kernels (run by the MSL emulator)."""
    from vllm_metal import ops

    cfg = tiny_config(name, head_dim=64, num_hidden_layers=2)  # head sizes the Metal kernels take
    ckpt = write_random_checkpoint(cfg, tmp_path / name, seed=6)
    ours = load_model(str(ckpt), "float32")
    ref = mlx_lm_reference(ckpt)
    schedules = [[6, 1, 1], [1, 3, 1], [9, 1]]
    sequences = [list(range(10, 10 + sum(s))) for s in schedules]
    previous = ops.kernel_backend()
    ops.set_kernel_backend("emulated")
    try:
        got = run_packed(ours, sequences, schedules)
    finally:
        ops.set_kernel_backend(previous)
    for seq, sched, logits in zip(sequences, schedules, got):
        want = reference_logits(ref, seq, sched)
        np.testing.assert_allclose(logits, want, rtol=0, atol=5e-5 * max(np.abs(want).max(), 1.0))


def test_stored_dtype_is_kept_and_never_upcast(tmp_path):
    cfg = tiny_config("llama3")
    f32 = load_model(str(write_random_checkpoint(cfg, tmp_path / "f32", seed=7)), "float32")
    # float16 weights whose config says bfloat16 run in float16.
    f16_dir = write_random_checkpoint(cfg, tmp_path / "f16", seed=7, dtype="float16",
                                      config_dtype="bfloat16")
    f16 = load_model(str(f16_dir))
    assert f16.spec.dtype == "float16"
    assert f16.hf_config["torch_dtype"] == "bfloat16"
    assert {p.dtype for _, p in tree_flatten(f16.model.parameters())} == {mx.float16}
    bf16 = load_model(str(f16_dir), "bfloat16")
    assert bf16.spec.dtype == "bfloat16"

    sequences = [[5, 9, 12, 40, 7, 3, 8]]
    want = run_packed(f32, sequences, [[4, 1, 1, 1]])[0]
    for loaded, tol in ((f16, 2e-2), (bf16, 1e-1)):
        got = run_packed(loaded, sequences, [[4, 1, 1, 1]])[0]
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, rtol=0, atol=tol * np.abs(want).max())


def test_mlx_quantized_checkpoint_matches_mlx_lm(tmp_path):
    """MLX-quantized safetensors (config "quantization") load through mlx-lm's
    loader; our attention keeps its QuantizedLinear projections."""
    import json

    import mlx.nn as nn

    cfg = tiny_config("qwen3")
    src = write_random_checkpoint(cfg, tmp_path / "dense", seed=8)
    model = mlx_lm_reference(src)
    nn.quantize(model, group_size=32, bits=4)
    out = tmp_path / "q4"
    out.mkdir()
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps(dict(cfg, quantization={"group_size": 32, "bits": 4})))

    ours = load_model(str(out))
    assert ours.spec.dtype == "float32"
    assert isinstance(ours.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    sequences = [[5, 9, 12, 40, 7, 3, 8]]
    got = run_packed(ours, sequences, [[4, 1, 1, 1]])[0]
    want = reference_logits(mlx_lm_reference(out), sequences[0], [4, 1, 1, 1])
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())
