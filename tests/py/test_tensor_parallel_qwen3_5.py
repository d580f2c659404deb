"""Tensor parallelism for the hybrid Qwen3.5 (models/tensor_parallel_qwen3_5.py).

- Two processes joined by MLX's ring on loopback (tensor_parallel_rank.py), each with half
  the attention heads, half the linear-attention key/value heads (and their state slots)
  and half the MLP columns, decode several requests packed per step (decode rows beside
  chunked prefills); reference: the same model unsharded in this process. Safetensors and
  a GGUF in Q8_0 blocks (the column splits fall on whole blocks), one pair of processes.
- In one process: the two ranks' gated delta nets (group of one, so the all-sum is the
  identity) add up to the unsplit layer, and each rank's state pool holds exactly its
  heads' part of the unsplit layer's state.
- Qwen3.5-MoE the same way (safetensors and Q8_0 GGUF in the same pair of processes).
- Refusals: a head count or expert width the size does not divide, a GGUF split through a
  block (of a dense MLP or of the experts)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from qwen3_5_checkpoint import CONFIG, MOE_CONFIG, random_model, write_checkpoint, write_gguf
from test_tensor_parallel import run_two_ranks

from vllm_metal.models import load_model
from vllm_metal.models.qwen3_5_paged import gated_delta_net
from vllm_metal.models.tensor_parallel import TensorParallelError
from vllm_metal.models.tensor_parallel_qwen3_5 import shard_qwen3_5

HERE = Path(__file__).parent
# layers: linear, full, linear, full; 128 MLP columns: 64 per rank, two Q8_0 blocks
SHAPE = dict(CONFIG, intermediate_size=128, full_attention_interval=2,
             layer_types=["linear_attention", "full_attention"] * 2)


# Qwen3.5-MoE: 8 experts (top-2) of 64 columns and a shared expert of 64: 32 per rank, one
# Q8_0 block
MOE_SHAPE = dict(MOE_CONFIG, full_attention_interval=2, moe_intermediate_size=64,
                 shared_expert_intermediate_size=64,
                 layer_types=["linear_attention", "full_attention"] * 2)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("qwen35_tp") / "st", seed=4, config=SHAPE)


def reference(model: str) -> list[np.ndarray]:
    sys.path.insert(0, str(HERE))
    from tensor_parallel_rank import run

    return run(load_model(model, "float32"))


def test_two_ranks_give_the_unsharded_logits(tmp_path, checkpoint):
    """The dense Qwen3.5 and Qwen3.5-MoE (every expert and the shared expert split by
    columns, one all-sum per block), each from safetensors and a Q8_0 GGUF."""
    gguf = write_gguf(random_model(seed=4, config=SHAPE), tmp_path / "q8.gguf", config=SHAPE,
                      qtype="Q8_0")
    moe = write_checkpoint(tmp_path / "moe", seed=6, config=MOE_SHAPE)
    moe_gguf = write_gguf(random_model(seed=6, config=MOE_SHAPE), tmp_path / "moe-q8.gguf",
                          config=MOE_SHAPE, qtype="Q8_0")
    models = [str(checkpoint), str(gguf), str(moe), str(moe_gguf)]
    for model, sharded in zip(models, run_two_ranks(models, tmp_path), strict=True):
        want = reference(model)
        assert [len(w) for w in want] == [6] * 4  # one logits row per greedy step
        for got, w in zip(sharded, want, strict=True):
            np.testing.assert_allclose(got, w, atol=2e-4, rtol=1e-4)


def _state_ctx(pools, layer, lengths):
    cu = mx.array(np.concatenate([[0], np.cumsum(lengths)]), dtype=mx.int32)
    return SimpleNamespace(cu_seqlens_state=cu, state_rounds=None,
                           state_slots=mx.array([2, 0], dtype=mx.int32)[:len(lengths)],
                           has_initial_state=mx.zeros((len(lengths),), dtype=mx.int32),
                           state_pools={layer: pools[layer]})


def test_rank_halves_of_a_gated_delta_net_add_up_to_the_layer(checkpoint):
    whole = load_model(str(checkpoint), "float32")
    halves = [load_model(str(checkpoint), "float32") for _ in range(2)]
    one = mx.distributed.init()  # a group of one: the all-sums add nothing here
    for rank, half in enumerate(halves):
        shard_qwen3_5(half, rank, 2, one)
    x = mx.random.normal((9, SHAPE["hidden_size"]), key=mx.random.key(1))
    lengths = [6, 3]
    layer = 2  # a linear-attention layer
    outs, pools = [], []
    for loaded in [whole, *halves]:
        p = loaded.model.make_state_pools(3, mx.float32)
        ctx = _state_ctx(p, layer, lengths)
        outs.append(gated_delta_net(loaded.model.layers[layer].linear_attn, x, ctx, layer))
        mx.eval(outs[-1], ctx.state_pools[layer].conv, ctx.state_pools[layer].ssm)
        pools.append(ctx.state_pools[layer])
    np.testing.assert_allclose(np.array(outs[1] + outs[2]), np.array(outs[0]), atol=1e-5, rtol=1e-5)
    hv, dv, dk = 2, SHAPE["linear_value_head_dim"], SHAPE["linear_key_head_dim"]
    key_dim = SHAPE["linear_num_key_heads"] * dk
    conv, ssm = np.array(pools[0].conv), np.array(pools[0].ssm)  # [slots, C, K-1], [slots, Hv, Dv, Dk]
    for rank in (0, 1):
        hk_rows = np.arange(rank * dk, (rank + 1) * dk)  # one key head per rank
        channels = np.concatenate([hk_rows, key_dim + hk_rows,
                                   2 * key_dim + np.arange(rank * hv * dv, (rank + 1) * hv * dv)])
        np.testing.assert_allclose(np.array(pools[1 + rank].conv), conv[:, channels], atol=1e-6)
        np.testing.assert_allclose(np.array(pools[1 + rank].ssm),
                                   ssm[:, rank * hv:(rank + 1) * hv], atol=1e-6)
    assert halves[0].hybrid.state_shapes.conv == (len(channels), 3)
    assert halves[0].hybrid.state_shapes.ssm == (hv, dv, dk)


def test_a_size_that_does_not_divide_the_linear_heads_is_refused(tmp_path):
    cfg = dict(SHAPE, linear_num_key_heads=1, linear_num_value_heads=2)
    loaded = load_model(str(write_checkpoint(tmp_path / "st", config=cfg)), "float32")
    with pytest.raises(TensorParallelError, match="does not divide the model's 1 linear-attention key heads"):
        shard_qwen3_5(loaded, 0, 2, mx.distributed.init())


def test_a_split_through_gguf_blocks_is_refused(tmp_path):
    # intermediate 96: 48 columns per rank cut through a 32-column Q8_0 block of down_proj
    cfg = dict(SHAPE, intermediate_size=96)
    gguf = write_gguf(random_model(seed=1, config=cfg), tmp_path / "q8.gguf", config=cfg, qtype="Q8_0")
    loaded = load_model(str(gguf), "float32")
    with pytest.raises(TensorParallelError, match="layer 0 down_proj: its Q8_0 blocks hold 32 columns"):
        shard_qwen3_5(loaded, 0, 2, mx.distributed.init())


def test_a_moe_split_through_gguf_expert_blocks_is_refused(tmp_path):
    # 32 expert columns: 16 per rank cut through the 32-column Q8_0 blocks of the experts' down
    cfg = dict(MOE_SHAPE, moe_intermediate_size=32)
    gguf = write_gguf(random_model(seed=1, config=cfg), tmp_path / "q8.gguf", config=cfg, qtype="Q8_0")
    loaded = load_model(str(gguf), "float32")
    with pytest.raises(TensorParallelError, match="layer 0 mlp experts down_proj: its Q8_0 blocks hold 32"):
        shard_qwen3_5(loaded, 0, 2, mx.distributed.init())


def test_expert_columns_the_size_does_not_divide_are_refused(tmp_path):
    cfg = dict(MOE_SHAPE, shared_expert_intermediate_size=45)
    loaded = load_model(str(write_checkpoint(tmp_path / "moe", config=cfg)), "float32")
    with pytest.raises(TensorParallelError, match="does not divide the model's 45 shared-expert columns"):
        shard_qwen3_5(loaded, 0, 2, mx.distributed.init())
