"""A head size the attention kernels of the serving path lack is refused when the model
loads, naming the model and the size; without the check the first forward, in warm-up,
would fail with an op error that names neither."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from vllm_metal import ops
from vllm_metal.model_runner import MetalModelRunner, check_attention_head_size
from vllm_metal.models.testing import tiny_config, write_random_checkpoint


def tiny_llama(out_dir, head_dim: int):
    cfg = tiny_config("llama", num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=head_dim)
    return write_random_checkpoint(cfg, out_dir / f"llama_d{head_dim}")


def runner_for(checkpoint) -> MetalModelRunner:
    # only what load_model reads before the head-size check
    config = SimpleNamespace(model_config=SimpleNamespace(model=str(checkpoint), dtype="float32"),
                             cache_config=None, scheduler_config=SimpleNamespace(async_scheduling=True),
                             parallel_config=SimpleNamespace(tensor_parallel_size=1,
                                                             pipeline_parallel_size=1))
    return MetalModelRunner(config)


@pytest.fixture
def emulated_kernels():
    previous = ops.kernel_backend()
    ops.set_kernel_backend("emulated")
    try:
        yield
    finally:
        ops.set_kernel_backend(previous)


def test_the_metal_path_refuses_an_unsupported_head_size_at_load(tmp_path, emulated_kernels):
    checkpoint = tiny_llama(tmp_path, 40)
    want = (rf"\[vllm-metal\] {re.escape(str(checkpoint))}: attention head size 40 is not supported "
            r"on the emulated Metal kernels \(the Metal kernels support head sizes 48, 64, 80, 96, "
            r"120, 128, 256, 512, got 40\)")
    with pytest.raises(ValueError, match=want):
        runner_for(checkpoint).load_model()


def test_the_cpu_path_takes_any_multiple_of_8_up_to_512():
    for d in (8, 40, 104, 512):
        check_attention_head_size("some/model", d)
    with pytest.raises(ValueError, match=r"some/model: attention head size 100 is not supported on "
                                         r"the CPU path \(head size must be a multiple of 8"):
        check_attention_head_size("some/model", 100)


def test_every_metal_head_size_passes_the_check(emulated_kernels):
    from vllm_metal import _core

    for d in _core.metal_attention_head_sizes():
        check_attention_head_size("some/model", d)
