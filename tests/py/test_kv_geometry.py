"""KV pool geometry through the bindings: block counts and shapes, sizing before the
block count, state copies, kernel block splitting (checked on real arrays), refusals
that say what would fit, and the block count against vLLM 0.33's own KV cache planner
for the same layers."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_metal._core import (KvLayerSpec, align_kv_pages, choose_kernel_block_size, plan_kv_pool,
                              size_kv_pool, split_block_ids)

GiB = 1 << 30
DTYPE_SIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1}


def smollm2(n=30):
    return [KvLayerSpec.full_attention(num_kv_heads=3, head_dim=64, dtype="float16") for _ in range(n)]


def test_smollm2_in_one_gib():
    g = plan_kv_pool(smollm2(), block_size=16, memory_budget_bytes=GiB, max_model_len=8192)
    assert g.bytes_per_block == 30 * 2 * 16 * 3 * 64 * 2
    assert g.num_blocks == GiB // g.bytes_per_block == 2912
    assert (g.kernel_block_size, g.kernel_blocks_per_block, g.num_kernel_blocks) == (16, 1, 2912)
    assert g.total_bytes == g.kv_bytes == 2912 * g.bytes_per_block and g.state_bytes == 0
    assert g.max_tokens == 2911 * 16
    layer = g.layers[0]
    assert (layer.kind, layer.dtype, layer.sliding_window) == ("full_attention", "float16", 0)
    assert layer.cache_shape == [2912, 16, 3, 64] == layer.kernel_cache_shape
    assert layer.bytes == g.kv_bytes // 30 and layer.state_shapes == []


def test_layer_spec_factories():
    s = KvLayerSpec.sliding_window_attention(num_kv_heads=1, head_dim=256, sliding_window=512, dtype="bfloat16")
    assert (s.kind, s.num_kv_heads, s.head_dim, s.sliding_window, s.dtype) == ("sliding_window", 1, 256, 512, "bfloat16")
    lin = KvLayerSpec.linear_attention(states=[([3, 8192], "bfloat16"), ([32, 128, 128], "float32")])
    assert lin.kind == "linear_attention"
    g = plan_kv_pool([lin, KvLayerSpec.full_attention(2, 256)], block_size=64, memory_budget_bytes=GiB, max_num_seqs=8)
    assert g.layers[0].state_shapes == [[8, 3, 8192], [8, 32, 128, 128]]
    assert g.layers[0].state_dtypes == ["bfloat16", "float32"]
    assert g.state_bytes == 8 * (3 * 8192 * 2 + 32 * 128 * 128 * 4) == g.layers[0].bytes
    assert g.num_blocks == (GiB - g.state_bytes) // g.bytes_per_block
    assert g.layers[1].kernel_cache_shape == [g.num_blocks, 64, 2, 256]  # the kernels read any block size


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(block_size=0, memory_budget_bytes=GiB), r"block_size must be > 0, got 0"),
        (dict(block_size=48, kernel_block_size=32, memory_budget_bytes=GiB),
         r"kernel_block_size must divide block_size 48 \(or be 0: block_size\), got 32"),
        (dict(block_size=16), "need memory_budget_bytes > 0 or num_blocks > 0"),
        (dict(block_size=16, memory_budget_bytes=64 << 20, max_model_len=8192),
         r"holds 182 blocks .* = 2896 tokens, but one sequence of max_model_len = 8192 tokens needs 512 blocks "
         r"\+ the null block: a budget of at least 189112320 B \(180.35 MiB\) \(or max_model_len <= 2896\)"),
        (dict(block_size=16, num_blocks=1000, memory_budget_bytes=100 << 20), "at most 284 blocks fit"),
        (dict(block_size=16, num_blocks=100, max_model_len=4096), r"at least 257 blocks \(or max_model_len <= 1584\)"),
    ],
)
def test_refusals_say_what_would_fit(kwargs, message):
    with pytest.raises(ValueError, match=r"^\[kv_geometry\] .*" + message):
        plan_kv_pool(smollm2(), **kwargs)


def test_bad_layers_are_refused():
    with pytest.raises(ValueError, match="dtype must be 'float32', 'float16', 'bfloat16', 'int8' or 'uint8', got 'fp64'"):
        KvLayerSpec.full_attention(3, 64, dtype="fp64")
    with pytest.raises(ValueError, match=r"layer 1 \(sliding_window\): sliding_window must be > 0, got 0"):
        plan_kv_pool([*smollm2(1), KvLayerSpec.sliding_window_attention(3, 64, 0)], block_size=16, memory_budget_bytes=GiB)
    with pytest.raises(ValueError, match=r"layer 0 \(full_attention\): num_kv_heads must be > 0, got 0"):
        plan_kv_pool([KvLayerSpec.full_attention(0, 64)], block_size=16, memory_budget_bytes=GiB)
    with pytest.raises(ValueError, match="layers must not be empty"):
        plan_kv_pool([], block_size=16, memory_budget_bytes=GiB)
    lin = KvLayerSpec.linear_attention(states=[([32, 128, 128], "float32")])
    with pytest.raises(ValueError, match="max_num_seqs = 600 needs .* at most 512 sequences fit"):
        plan_kv_pool([lin], block_size=16, memory_budget_bytes=GiB, max_num_seqs=600)


def test_choose_kernel_block_size():
    # the kernels read vLLM's blocks as they are: any size, hybrid models' 528 included
    assert [choose_kernel_block_size(b) for b in (1, 8, 20, 48, 528)] == [1, 8, 20, 48, 528]
    assert choose_kernel_block_size(64, requested=16) == 16
    assert choose_kernel_block_size(64, requested=4) == 4
    with pytest.raises(ValueError, match="kernel_block_size must divide block_size 64"):
        choose_kernel_block_size(64, requested=24)


def gdn(conv_dtype="bfloat16"):
    return KvLayerSpec.linear_attention(states=[([3, 8192], conv_dtype), ([32, 128, 128], "float32")])


def test_sizing_before_the_block_count():
    """What the worker reports before vLLM counts the blocks equals what the plan then uses."""
    layers = [gdn(), gdn(), gdn(), KvLayerSpec.full_attention(2, 256, dtype="bfloat16")]
    s = size_kv_pool(layers, block_size=528, max_num_seqs=4, state_copies=2)
    per_seq = 3 * 8192 * 2 + 32 * 128 * 128 * 4
    assert (s.num_blocks, s.bytes_per_block) == (0, 2 * 528 * 2 * 256 * 2)
    assert s.state_bytes == 2 * 4 * 3 * per_seq and s.state_copies == 2
    assert (s.num_attention_layers, s.num_linear_layers) == (1, 3)
    g = plan_kv_pool(layers, block_size=528, num_blocks=10, max_num_seqs=4, state_copies=2)
    assert (g.bytes_per_block, g.state_bytes) == (s.bytes_per_block, s.state_bytes)
    assert g.layers[0].state_shapes == [[4, 3, 8192], [4, 32, 128, 128]]  # one pool; two of them
    assert g.layers[0].bytes == 2 * 4 * per_seq
    with pytest.raises(ValueError, match="state_copies must be >= 1, got 0"):
        size_kv_pool(layers, block_size=16, state_copies=0)


@pytest.mark.parametrize("base", [16, 32, 48])
def test_hybrid_pages_align_to_the_state(base):
    """vLLM's one page size: the smallest multiple of base whose attention page holds a state."""
    pages = align_kv_pages([gdn(), KvLayerSpec.full_attention(2, 256, dtype="bfloat16")], base)
    state, per_token = 3 * 8192 * 2 + 32 * 128 * 128 * 4, 2 * 2 * 256 * 2
    block = next(b for b in range(base, 1 << 20, base) if b * per_token >= state)
    assert (pages.block_size, pages.page_bytes, pages.state_page_bytes) == (block, block * per_token, state)
    with pytest.raises(ValueError, match="one page size needs attention layers of one size"):
        align_kv_pages([gdn(), KvLayerSpec.full_attention(2, 256), KvLayerSpec.full_attention(1, 256)], base)
    with pytest.raises(ValueError, match="aligning pages needs an attention layer"):
        align_kv_pages([gdn()], base)


def test_description():
    g = plan_kv_pool(smollm2(), block_size=16, num_blocks=32)  # 32 * 368640 B = 11.25 MiB
    assert g.description == "32 blocks of 16 tokens (512 tokens, 11.2 MiB)" == (
        f"32 blocks of 16 tokens (512 tokens, {32 * 368640 / 2**20:.1f} MiB)")
    h = plan_kv_pool([gdn(), KvLayerSpec.full_attention(2, 256)], block_size=528, num_blocks=10, max_num_seqs=2)
    assert h.description == (f"10 blocks of 528 tokens for 1 attention layers ({h.kv_bytes / 2**20:.1f} MiB), "
                             f"2 state slots for 1 linear-attention layers ({h.state_bytes / 2**20:.1f} MiB)")


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(0, 5), min_size=1, max_size=3),
    k=st.sampled_from([1, 2, 4, 8]),
    data=st.data(),
)
def test_split_block_ids_matches_numpy(shape, k, data):
    n = int(np.prod(shape))
    ids = np.array(data.draw(st.lists(st.integers(-1, 5000), min_size=n, max_size=n)), dtype=np.int32).reshape(shape)
    out = split_block_ids(ids, k)
    # The straightforward construction: each id b becomes b*k + [0, k), padding stays.
    expect = np.where(ids[..., None] < 0, ids[..., None], ids[..., None] * k + np.arange(k)).reshape(*shape[:-1], shape[-1] * k)
    assert out.dtype == np.int32 and out.shape == expect.shape
    np.testing.assert_array_equal(out, expect)


@settings(max_examples=40, deadline=None)
@given(block_size=st.sampled_from([8, 16, 32, 48, 64, 96, 128]), data=st.data())
def test_kernel_view_is_the_same_memory(block_size, data):
    """Reading slot (b, o) through the vLLM view and through the kernel view
    (expanded block table, kernel block size) gives the same element."""
    kernel_block_size = data.draw(st.sampled_from([kb for kb in (0, 8, 16, 32) if block_size % max(kb, 1) == 0]))
    g = plan_kv_pool([KvLayerSpec.full_attention(2, 4, dtype="float32")], block_size=block_size, num_blocks=6,
                     kernel_block_size=kernel_block_size)
    layer = g.layers[0]
    cache = np.arange(np.prod(layer.cache_shape), dtype=np.float32).reshape(layer.cache_shape)
    kernel = cache.reshape(layer.kernel_cache_shape)  # a view: no copy
    assert np.shares_memory(cache, kernel)
    kb, k = g.kernel_block_size, g.kernel_blocks_per_block
    table = np.array(data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=4)), dtype=np.int32)
    kernel_table = split_block_ids(table, k)
    for pos in range(len(table) * block_size):
        vllm_row = cache[table[pos // block_size], pos % block_size]
        kernel_row = kernel[kernel_table[pos // kb], pos % kb]
        np.testing.assert_array_equal(vllm_row, kernel_row)
        # and the slot number (slot_mapping) is the same either way
        assert table[pos // block_size] * block_size + pos % block_size == kernel_table[pos // kb] * kb + pos % kb


@settings(max_examples=100, deadline=None)
@given(
    layers=st.lists(
        st.tuples(st.sampled_from(["full", "sliding", "linear"]), st.integers(1, 8), st.sampled_from([64, 80, 128]),
                  st.sampled_from(list(DTYPE_SIZE))),
        min_size=1, max_size=6),
    block_size=st.sampled_from([8, 16, 32, 64, 528]),
    budget=st.integers(1 << 16, 1 << 34),
    max_num_seqs=st.integers(1, 16),
)
def test_budget_accounting(layers, block_size, budget, max_num_seqs):
    specs = []
    for kind, heads, dim, dtype in layers:
        if kind == "full":
            specs.append(KvLayerSpec.full_attention(heads, dim, dtype=dtype))
        elif kind == "sliding":
            specs.append(KvLayerSpec.sliding_window_attention(heads, dim, 4 * dim, dtype=dtype))
        else:
            specs.append(KvLayerSpec.linear_attention(states=[([3, heads * dim], dtype), ([heads, dim, dim], "float32")]))
    per_block = sum(2 * block_size * h * d * DTYPE_SIZE[t] for kind, h, d, t in layers if kind != "linear")
    per_seq = sum(3 * h * d * DTYPE_SIZE[t] + h * d * d * 4 for kind, h, d, t in layers if kind == "linear")
    state = per_seq * max_num_seqs
    try:
        g = plan_kv_pool(specs, block_size=block_size, memory_budget_bytes=budget, max_num_seqs=max_num_seqs)
    except ValueError as e:
        # refused only when not even the null block + one block (or the states) fit
        assert state > budget or (per_block and (budget - state) // per_block < 2), str(e)
        return
    assert g.bytes_per_block == per_block and g.state_bytes == state
    assert g.total_bytes <= budget
    if per_block:
        assert budget - g.total_bytes < per_block  # no whole block left over
        assert g.num_kernel_blocks == g.num_blocks * (block_size // g.kernel_block_size)
    else:
        assert g.num_blocks == 0
    assert sum(lg.bytes for lg in g.layers) == g.total_bytes


# ---- against vLLM's own planner -----------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_planner():
    pytest.importorskip("vllm.v1.core.kv_cache_planning", reason="needs vLLM 0.33 and its CPU requirements")
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    torch_dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                   "uint8": torch.uint8, "int8": torch.int8}

    def num_blocks(layers, block_size, budget):
        config = VllmConfig()
        config.cache_config.kv_cache_layout = "LBHNC"  # normally resolved by the engine core
        # Sliding-window layers as vLLM plans them with the hybrid allocator off:
        # full-attention allocation that remembers the window.
        specs = {
            f"model.layers.{i}.self_attn.attn": FullAttentionSpec(
                block_size=block_size, num_kv_heads=heads, head_size=dim, dtype=torch_dtype[dtype],
                sliding_window=window or None)
            for i, (heads, dim, dtype, window) in enumerate(layers)
        }
        groups = get_kv_cache_groups(config, specs)
        return get_kv_cache_config_from_groups(config, groups, budget).num_blocks

    return num_blocks


@settings(max_examples=40, deadline=None)
@given(
    layers=st.lists(st.tuples(st.integers(1, 8), st.sampled_from([64, 128, 256]),
                              st.sampled_from(["float16", "bfloat16", "float32"]), st.sampled_from([0, 0, 512])),
                    min_size=1, max_size=8),
    block_size=st.sampled_from([16, 32, 64]),
    budget=st.integers(1 << 24, 1 << 33),
)
def test_num_blocks_matches_vllm_planner(vllm_planner, layers, block_size, budget):
    specs = [KvLayerSpec.sliding_window_attention(h, d, w, dtype=t) if w else KvLayerSpec.full_attention(h, d, dtype=t)
             for h, d, t, w in layers]
    ours = plan_kv_pool(specs, block_size=block_size, memory_budget_bytes=budget, reserve_null_block=True)
    assert ours.num_blocks == vllm_planner(layers, block_size, budget)


def test_smollm2_matches_vllm_planner(vllm_planner):
    assert vllm_planner([(3, 64, "float16", 0)] * 30, 16, GiB) == 2912
