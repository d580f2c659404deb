"""The runner's KV cache sizing comes from the runtime's geometry (kv_plan.py) and gives
vLLM the numbers the hand computation it replaced gave: bytes per block, the hybrid
models' state bytes off the budget, the K/V shapes and the summary line, for a llama, a
Gemma 3 (sliding-window layers) and a Qwen3.5 (hybrid, with and without speculative
decoding's saved state copies). The expected values are computed here from the HF
config alone."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import pytest

from qwen3_5_checkpoint import CONFIG as QWEN3_5, write_checkpoint
from vllm_metal.model_runner import MetalModelRunner
from vllm_metal.models import load_model
from vllm_metal.models.testing import tiny_config, write_random_checkpoint
from vllm_metal.worker import MetalWorker

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
MAX_NUM_SEQS = 4
MAX_MODEL_LEN = 128
NUM_BLOCKS = 37


def head_dim(cfg):
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def attention_layers(cfg) -> int:
    types = cfg.get("layer_types")
    return cfg["num_hidden_layers"] if "linear_num_value_heads" not in cfg else types.count("full_attention")


def expected_block_bytes(cfg, dtype, block_size) -> int:
    """K and V of one block over the layers with paged KV (sliding ones allocated in full)."""
    return 2 * block_size * cfg["num_key_value_heads"] * head_dim(cfg) * ITEMSIZE[dtype] * attention_layers(cfg)


def expected_state_bytes(cfg, dtype, speculative, slots=None) -> int:
    """Gated DeltaNet: conv [2*Hk*Dk + Hv*Dv, kernel - 1] in the model dtype and recurrent
    [Hv, Dv, Dk] float32 per slot and linear layer; max_num_seqs slots, twice when drafts
    save a copy (or `slots` slots)."""
    if "linear_num_value_heads" not in cfg:
        return 0
    hk, dk = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"]
    hv, dv = cfg["linear_num_value_heads"], cfg["linear_value_head_dim"]
    conv = (2 * hk * dk + hv * dv) * (cfg["linear_conv_kernel_dim"] - 1) * ITEMSIZE[dtype]
    linear = cfg["num_hidden_layers"] - attention_layers(cfg)
    if slots is None:
        slots = MAX_NUM_SEQS * (2 if speculative else 1)
    return (conv + hv * dv * dk * 4) * slots * linear


def runner_for(loaded, block_size, speculative=False, caching=False) -> MetalModelRunner:
    config = SimpleNamespace(
        model_config=SimpleNamespace(model="tiny", dtype=loaded.spec.dtype, max_model_len=MAX_MODEL_LEN),
        cache_config=SimpleNamespace(block_size=block_size, enable_prefix_caching=caching),
        scheduler_config=SimpleNamespace(async_scheduling=True, max_num_seqs=MAX_NUM_SEQS,
                                         max_num_batched_tokens=64),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        speculative_config=None)
    runner = MetalModelRunner(config)
    runner.loaded, runner.model = loaded, loaded.model
    if speculative:  # what the hybrid sizing reads of Speculation
        runner.speculation = SimpleNamespace(num_speculative_tokens=2, draft=None)
    return runner


def kv_cache_config(runner, block_size):
    """vLLM's KVCacheConfig shape for the model: one attention group; for hybrid models
    a state group per linear layer besides (as vLLM groups Qwen3.5)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec

    loaded = runner.loaded
    spec = loaded.spec
    attn = FullAttentionSpec(block_size=block_size, num_kv_heads=spec.num_kv_heads, head_size=spec.head_dim,
                             dtype=None)
    if loaded.hybrid is None:
        groups = [KVCacheGroupSpec(runner.layer_names(), attn)]
    else:
        shapes = loaded.hybrid.state_shapes
        state = MambaSpec(block_size=MAX_MODEL_LEN, shapes=(shapes.conv, shapes.ssm), dtypes=(None, None))
        groups = [KVCacheGroupSpec([f"model.layers.{i}.linear_attn"], state) for i in loaded.hybrid.linear_layers]
        groups.append(KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn" for i in loaded.hybrid.attention_layers],
                                       attn))
    return SimpleNamespace(kv_cache_groups=groups, num_blocks=NUM_BLOCKS)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("kv_plan")
    llama = tiny_config("llama")
    gemma3 = tiny_config("gemma3")
    qwen = dict(QWEN3_5)
    qwen_dir = write_checkpoint(d / "qwen3_5", seed=0)
    return {
        "llama-float32": (llama, load_model(str(write_random_checkpoint(llama, d / "llama")), "float32")),
        "gemma3-bfloat16": (gemma3, load_model(str(write_random_checkpoint(gemma3, d / "gemma3")), "bfloat16")),
        "qwen3_5-float32": (qwen, load_model(str(qwen_dir), "float32")),
        "qwen3_5-bfloat16": (qwen, load_model(str(qwen_dir), "bfloat16")),
    }


CASES = [("llama-float32", 16, False, True), ("gemma3-bfloat16", 16, False, False),
         ("qwen3_5-float32", 32, False, False), ("qwen3_5-float32", 32, False, True),
         ("qwen3_5-float32", 32, True, False), ("qwen3_5-bfloat16", 48, True, True)]


@pytest.mark.parametrize("name, block_size, speculative, caching", CASES,
                         ids=[f"{n}-B{b}{'-spec' if s else ''}{'-cache' if c else ''}" for n, b, s, c in CASES])
def test_worker_reports_and_allocates_what_the_config_implies(models, name, block_size, speculative, caching):
    cfg, loaded = models[name]
    dtype = loaded.spec.dtype
    if name.startswith("gemma3"):
        assert any(loaded.spec.sliding_window_per_layer)  # the case this model is here for
    runner = runner_for(loaded, block_size, speculative, caching)
    worker = SimpleNamespace(model_runner=runner, _workers_on_this_host=1,
                             cache_config=SimpleNamespace(kv_cache_memory_bytes=64 << 20, gpu_memory_utilization=0.9))
    per_block = expected_block_bytes(cfg, dtype, block_size)
    slots_bytes = expected_state_bytes(cfg, dtype, speculative)
    # hybrid prefix caching: VLLM_METAL_HYBRID_STATE_CHECKPOINTS (16) states more
    checkpoints = 16 if caching and loaded.hybrid is not None else 0
    checkpoint_bytes = expected_state_bytes(cfg, dtype, False, slots=checkpoints)
    state = slots_bytes + checkpoint_bytes

    # what the worker reports to vLLM
    assert MetalWorker.get_cache_block_size_bytes(worker) == per_block
    assert runner.state_memory_bytes() == state
    assert MetalWorker.determine_available_memory(worker) == (64 << 20) - state
    if loaded.hybrid is None:  # vLLM's own page size for the specs the runner declares
        pages = sum(s.page_size_bytes for s in runner.get_kv_cache_spec().values())
        assert pages == per_block

    # what it allocates for vLLM's block count
    runner.initialize_kv_cache(kv_cache_config(runner, block_size))
    shape = (NUM_BLOCKS, block_size, cfg["num_key_value_heads"], head_dim(cfg))
    kv = [c for c in runner.kv_caches if c is not None]
    assert len(runner.kv_caches) == cfg["num_hidden_layers"] and len(kv) == attention_layers(cfg)
    for k, v in kv:
        assert k.shape == v.shape == shape and k.dtype == v.dtype == getattr(mx, dtype)
    kv_mib = NUM_BLOCKS * per_block / 2**20
    if loaded.hybrid is None:
        want = f"{NUM_BLOCKS} blocks of {block_size} tokens ({NUM_BLOCKS * block_size} tokens, {kv_mib:.1f} MiB)"
    else:
        linear = cfg["num_hidden_layers"] - attention_layers(cfg)
        want = (f"{NUM_BLOCKS} blocks of {block_size} tokens for {attention_layers(cfg)} attention layers "
                f"({kv_mib:.1f} MiB), {MAX_NUM_SEQS} state slots for {linear} linear-attention layers "
                f"({slots_bytes / 2**20:.1f} MiB)")
        if checkpoints:
            want += f"; {checkpoints} prefix-cache state checkpoints ({checkpoint_bytes / 2**20:.1f} MiB)"
        assert runner.hybrid.num_slots == MAX_NUM_SEQS and (runner.hybrid.saved is not None) == speculative
        assert (runner.hybrid.checkpoints is not None) == bool(checkpoints)
    assert runner.kv_cache_description == want
    assert runner.packer is not None and runner.delta.packer is runner.packer
