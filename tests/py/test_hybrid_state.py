"""The runner side of hybrid models (vllm_metal/hybrid.py), without a server: vLLM's KV
cache specs and groups for Qwen3.5, block-size alignment, state slots taken, carried,
freed and reused, and the memory the state takes from the budget."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from qwen3_5_checkpoint import CONFIG, write_checkpoint

from vllm_metal import hybrid
from vllm_metal.models import load_model


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_model(str(write_checkpoint(tmp_path_factory.mktemp("q"), seed=0)), "float32")


def vllm_config(block_size=16, dtype="float32", max_model_len=128, tensor_parallel_size=1):
    import torch
    from transformers import Qwen3_5TextConfig

    cache = SimpleNamespace(block_size=block_size, mamba_page_size_padded=None, mamba_block_size=None,
                            enable_prefix_caching=True, mamba_cache_mode="align")
    model = SimpleNamespace(hf_text_config=Qwen3_5TextConfig(**{k: v for k, v in CONFIG.items()
                                                                  if k != "architectures"}),
                            dtype=getattr(torch, dtype), max_model_len=max_model_len)
    return SimpleNamespace(cache_config=cache, model_config=model,
                           parallel_config=SimpleNamespace(tensor_parallel_size=tensor_parallel_size))


def test_block_size_alignment_makes_one_page_size():
    cfg = vllm_config()
    # conv [192, 3] float32 + ssm [4, 16, 32] float32; K and V of 2 heads x 32 float32
    state, attn_per_token = 192 * 3 * 4 + 4 * 16 * 32 * 4, 2 * 2 * 32 * 4
    hybrid.align_block_size(cfg)
    assert cfg.cache_config.block_size == 32  # 16 tokens (8 KiB) < 10.25 KiB <= 32 tokens
    assert cfg.cache_config.mamba_page_size_padded == 32 * attn_per_token >= state
    half = vllm_config(dtype="bfloat16")
    hybrid.align_block_size(half)  # conv state in bfloat16, ssm float32: 9344 B vs 256 B/token
    assert half.cache_config.block_size == 48
    # one tensor-parallel rank of 2: half the KV heads and half the linear-attention heads,
    # conv [96, 3] + ssm [2, 16, 32] float32 = 5248 B vs 1 KV head: 256 B per token
    rank = vllm_config(tensor_parallel_size=2)
    hybrid.align_block_size(rank)
    assert rank.cache_config.block_size == 32
    assert rank.cache_config.mamba_page_size_padded == 32 * 256


def test_prefix_caching_stays_as_asked_with_one_state_block_per_request():
    cfg = vllm_config()
    cfg.cache_config.mamba_cache_mode = "align"  # what vLLM's hybrid config hook may choose
    hybrid.configure_prefix_caching(cfg)
    c = cfg.cache_config
    # the state groups declare the attention block size, so vLLM hashes every block
    assert (c.enable_prefix_caching, c.mamba_cache_mode, c.mamba_block_size) == (True, "none", 16)
    off = vllm_config()
    off.cache_config.enable_prefix_caching = False
    hybrid.configure_prefix_caching(off)
    assert off.cache_config.mamba_block_size == 128  # max_model_len: vLLM's "none" mode


def test_kv_cache_spec_groups(loaded):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    cfg = vllm_config()
    hybrid.align_block_size(cfg)
    specs = hybrid.kv_cache_spec(loaded, cfg.cache_config, 128)
    assert isinstance(specs["model.layers.3.self_attn.attn"], FullAttentionSpec)
    states = [specs[f"model.layers.{i}.linear_attn"] for i in range(3)]
    assert all(isinstance(s, MambaSpec) for s in states)
    assert states[0].shapes == ((192, 3), (4, 16, 32)) and states[0].block_size == 32
    assert {s.page_size_bytes for s in specs.values()} == {32 * 512}  # one page size
    small = vllm_config()  # alignment skipped: a clear error, not a silent overflow
    with pytest.raises(ValueError, match="smaller than one request's state"):
        hybrid.kv_cache_spec(loaded, small.cache_config, 128)


def kv_cache_config(loaded):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec

    attn = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=None)
    state = MambaSpec(block_size=128, shapes=((192, 3), (4, 16, 32)), dtypes=(None, None))
    groups = [KVCacheGroupSpec([f"model.layers.{i}.linear_attn"], state) for i in range(3)]
    groups.insert(1, KVCacheGroupSpec(["model.layers.3.self_attn.attn"], attn))
    return SimpleNamespace(kv_cache_groups=groups, num_blocks=40)


def step(state, reqs: dict[str, tuple[int, int]]):
    """reqs: id -> (start, query_len) in batch order."""
    ids = list(reqs)
    q = [reqs[r][1] for r in ids]
    seq_lens = np.array([reqs[r][0] + reqs[r][1] for r in ids])
    slots, init, _rounds = state.step(ids, seq_lens, np.concatenate([[0], np.cumsum(q)]))
    return slots, init


def test_slots_are_taken_carried_freed_and_reused(loaded):
    state = hybrid.HybridState(loaded, kv_cache_config(loaded), num_slots=2)
    assert state.attention_group == 1 and state.is_state_group == [True, False, True, True]
    assert len([p for p in state.pools if p is not None]) == 3
    assert state.pools[0].conv.shape == (2, 192, 3) and state.pools[0].ssm.shape == (2, 4, 16, 32)
    slots, init = step(state, {"a": (0, 5), "b": (0, 3)})  # two first chunks
    assert sorted(slots.tolist()) == [0, 1] and init.tolist() == [0, 0]
    slot_a = int(slots[0])
    slots, init = step(state, {"a": (5, 1), "b": (3, 4)})  # a decodes, b's second chunk
    assert init.tolist() == [1, 1] and int(slots[0]) == slot_a
    with pytest.raises(RuntimeError, match="no free state slot"):
        step(state, {"c": (0, 2)})
    state.release(["a"])  # finished or preempted: its slot is free again
    slots, init = step(state, {"c": (0, 2)})
    assert int(slots[0]) == slot_a and init.tolist() == [0]  # reused, starting from zeros
    # a preempted request restarts at token 0: recomputed in a fresh slot, never resumed
    state.release(["b"])
    slots, init = step(state, {"b": (0, 7)})
    assert init.tolist() == [0]


def test_resuming_without_state_is_refused(loaded):
    state = hybrid.HybridState(loaded, kv_cache_config(loaded), num_slots=2)
    step(state, {"a": (0, 4)})
    with pytest.raises(RuntimeError, match="covers 4 tokens"):
        step(state, {"a": (6, 1)})  # e.g. a prefix-cache hit past what was computed
    with pytest.raises(RuntimeError, match="covers 0 tokens"):
        step(state, {"new": (16, 2)})


def test_state_memory_comes_out_of_the_budget(loaded):
    from vllm_metal import kv_plan

    per_slot = 192 * 3 * 4 + 4 * 16 * 32 * 4
    sizing = kv_plan.size(loaded, block_size=32, max_num_seqs=8, speculative=False)
    assert sizing.state_bytes == 8 * per_slot * 3
    assert kv_plan.size(loaded, block_size=32, max_num_seqs=8, speculative=True).state_bytes == 2 * 8 * per_slot * 3
    # the pools HybridState allocates are the ones the geometry counted
    state = hybrid.HybridState(loaded, kv_cache_config(loaded), num_slots=8, checkpoint_slots=5)
    pools = [p for p in state.pools if p is not None]
    assert sum(p.conv.nbytes + p.ssm.nbytes for p in pools) == sizing.state_bytes
    # prefix caching's checkpoints: counted the same way
    checkpoints = [p for p in state.checkpoints if p is not None]
    assert sum(p.conv.nbytes + p.ssm.nbytes for p in checkpoints) == 5 * per_slot * 3 \
        == kv_plan.checkpoint_bytes(loaded, block_size=32, slots=5)


def test_worker_budget_leaves_room_for_the_state():
    from vllm_metal.worker import MetalWorker

    runner = SimpleNamespace(state_memory_bytes=lambda: 1000, kv_budget_share=lambda: 1.0)
    worker = SimpleNamespace(cache_config=SimpleNamespace(kv_cache_memory_bytes=5000,
                                                          gpu_memory_utilization=0.9),
                             model_runner=runner, _workers_on_this_host=1)
    assert MetalWorker.determine_available_memory(worker) == 4000  # blocks + state = asked
    worker.cache_config.kv_cache_memory_bytes = 800
    with pytest.raises(ValueError, match="does not cover the 1000 bytes"):
        MetalWorker.determine_available_memory(worker)
