"""--data-parallel-size at startup (data_parallel.py), through vLLM's own argument handling
(EngineArgs.create_engine_config runs the platform's check_and_update_config): replicas on one
host split the memory share, replicas on other hosts do not, and what a replica cannot carry
is refused with a message. Serving is in test_serving_data_parallel.py."""

from __future__ import annotations

import pytest

from vllm_metal.worker import DeviceMemory

GIB = 2**30


def smollm2_dir() -> str:
    from vllm_metal.model_paths import resolve_model_argument
    from vllm_metal.models.offline import OFFLINE_GGUF

    return resolve_model_argument(str(OFFLINE_GGUF["smollm2"]()))


def engine_config(model: str, **kw):
    """vLLM's config for these arguments; a refusal comes wrapped in pydantic's ValidationError
    (a ValueError) carrying the platform's message."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model, max_model_len=256, **kw).create_engine_config()


@pytest.mark.parametrize("dp, local, share", [
    (1, None, 0.8),      # no data parallelism: untouched
    (2, None, 0.4),      # two replicas on this host
    (4, None, 0.2),
    (2, 1, 0.8),         # this host holds one of two replicas (the other Mac holds the second)
    (4, 2, 0.4),
])
def test_replicas_on_one_host_split_the_memory_share(dp, local, share):
    extra = {} if local is None else {"data_parallel_size_local": local}
    config = engine_config(smollm2_dir(), data_parallel_size=dp, gpu_memory_utilization=0.8, **extra)
    assert config.cache_config.gpu_memory_utilization == pytest.approx(share)
    assert config.parallel_config.distributed_executor_backend == "uni"


def test_the_replicas_budgets_together_stay_within_one_share():
    """What each replica's worker computes from its share (DeviceMemory.kv_cache_budget): the
    sum over the replicas of one host stays within the user's --gpu-memory-utilization of the
    memory, whatever the weights' size, on Apple (margin) and on the CPU."""
    for margin in (0, 1 * GIB):
        for weights in (GIB // 5, 2 * GIB):
            memory = DeviceMemory(limit=32 * GIB, in_use=weights, available=30 * GIB,
                                  margin=margin, source="test")
            one = memory.kv_cache_budget(0.9, None, 0)
            for replicas in (2, 3, 4):
                each = memory.kv_cache_budget(0.9 / replicas, None, 0)
                # all the replicas' caches and weights fit in the whole share (a byte of
                # float rounding per replica)
                assert replicas * (each + weights + margin) <= 0.9 * 32 * GIB + replicas
                assert each < one


def test_a_mixture_of_experts_model_is_refused_with_data_parallelism(tmp_path):
    pytest.importorskip("transformers")
    from qwen3_5_checkpoint import write_tokenizer
    from test_models_qwen3_moe import write_checkpoint

    write_checkpoint(tmp_path, seed=0, vocab_size=320, bos_token_id=1, eos_token_id=2)
    write_tokenizer(tmp_path, 320)
    engine_config(str(tmp_path), data_parallel_size=1)  # served alone
    with pytest.raises(ValueError, match="data parallelism with a mixture-of-experts"):
        engine_config(str(tmp_path), data_parallel_size=2)


def test_the_ray_data_parallel_backend_is_refused():
    """(Without Ray installed vLLM refuses it first: the check is called directly.)"""
    from types import SimpleNamespace

    from vllm_metal.data_parallel import refusal

    def config(backend):
        return SimpleNamespace(model_config=SimpleNamespace(is_moe=False), parallel_config=SimpleNamespace(
            data_parallel_size=2, data_parallel_backend=backend))

    assert refusal(config("mp")) is None
    what, hint = refusal(config("ray"))
    assert "--data-parallel-backend ray" in what and "--headless" in hint

