"""The KV-cache budget on Apple, from a faked Metal device on Linux.

MLX reports a 16 GB M-series Mac's GPU through mx.device_info(mx.gpu); the faked
numbers are of that shape (Metal's recommended working set is about 2/3 of the
unified memory on a 16 GB machine). The budget must fit the weights, the KV cache and
the margin inside the working set share vLLM's flags allow, and inside free RAM.
"""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import psutil
import pytest

from vllm_metal.platform import MetalPlatform
from vllm_metal.worker import MetalWorker
APPLE_MARGIN_BYTES = 2**30

GiB = 2**30
MEMORY = 16 * GiB
WORKING_SET = 11_453_251_584  # ~10.67 GiB, what Metal recommends on a 16 GB M-series Mac
WEIGHTS = 2 * GiB  # MLX's active memory after loading: the weights


def fake_mac(monkeypatch, *, available=9 * GiB, weights=WEIGHTS, rss=3 * GiB):
    info = {"device_name": "Apple M2", "architecture": "applegpu_g14g", "memory_size": MEMORY,
            "max_recommended_working_set_size": WORKING_SET, "max_buffer_length": 8 * GiB}
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    monkeypatch.setattr(mx, "device_info", lambda d=None: dict(info))
    monkeypatch.setattr(mx, "get_active_memory", lambda: weights)
    fake_ram(monkeypatch, total=MEMORY, available=available, rss=rss)


def fake_ram(monkeypatch, *, total, available, rss):
    monkeypatch.setattr(psutil, "virtual_memory",
                        lambda: SimpleNamespace(total=total, available=available))
    monkeypatch.setattr(psutil, "Process", lambda pid=None: SimpleNamespace(
        memory_info=lambda: SimpleNamespace(rss=rss)))


def budget(utilization=0.9, kv_cache_memory_bytes=None, state=0, share=1.0, workers=1):
    worker = SimpleNamespace(
        _workers_on_this_host=workers,
        cache_config=SimpleNamespace(gpu_memory_utilization=utilization,
                                     kv_cache_memory_bytes=kv_cache_memory_bytes),
        model_runner=SimpleNamespace(state_memory_bytes=lambda: state, kv_budget_share=lambda: share))
    return MetalWorker.determine_available_memory(worker)


def test_default_budget_on_a_16gb_mac_fits_the_working_set(monkeypatch):
    fake_mac(monkeypatch)
    got = budget()
    # 90% of the working set, less the weights and the margin (not 90% of the 16 GB)
    assert got == int(0.9 * WORKING_SET) - WEIGHTS - APPLE_MARGIN_BYTES
    assert got + WEIGHTS + APPLE_MARGIN_BYTES <= 0.9 * WORKING_SET
    assert 6.5 * GiB < got < 6.7 * GiB  # the old budget, min(0.9 x 16 GB - RSS, free RAM), was 9 GiB


def test_utilization_scales_the_working_set(monkeypatch):
    fake_mac(monkeypatch)
    assert budget(0.5) == int(0.5 * WORKING_SET) - WEIGHTS - APPLE_MARGIN_BYTES
    with pytest.raises(ValueError, match=r"--gpu-memory-utilization 0\.2.*Metal recommended working set"):
        budget(0.2)  # 2.1 GiB allowed, 2 GiB of weights and 1 GiB margin


def test_free_ram_caps_the_budget(monkeypatch):
    fake_mac(monkeypatch, available=4 * GiB)  # other apps hold the rest
    assert budget() == 4 * GiB - APPLE_MARGIN_BYTES


def test_a_draft_models_cache_comes_out_of_the_budget(monkeypatch):
    """Speculative decoding with a draft model: vLLM is offered the target's share of the
    blocks' budget, the draft's cache takes the rest (draft_model.draft_share)."""
    from vllm_metal.draft_model import draft_share

    fake_mac(monkeypatch)
    full = budget()
    share = draft_share(3000, 1000)
    assert share == 0.75
    assert budget(share=share) == int(full * share)


def test_state_slots_come_out_of_the_budget(monkeypatch):
    fake_mac(monkeypatch)
    assert budget(state=100 * 2**20) == int(0.9 * WORKING_SET) - WEIGHTS - APPLE_MARGIN_BYTES - 100 * 2**20


def test_explicit_kv_cache_bytes_must_fit_beside_the_weights(monkeypatch):
    fake_mac(monkeypatch)
    assert budget(kv_cache_memory_bytes=6 * GiB) == 6 * GiB  # utilization ignored, as in vLLM
    assert budget(kv_cache_memory_bytes=6 * GiB, state=GiB) == 5 * GiB
    fake_mac(monkeypatch, available=12 * GiB)
    with pytest.raises(ValueError, match=r"--kv-cache-memory-bytes 9663676416 exceeds the 9305767936 bytes"):
        budget(kv_cache_memory_bytes=9 * GiB)  # 9 + 2 GiB of weights > the working set


def test_tensor_or_pipeline_ranks_on_one_mac_split_its_memory(monkeypatch):
    """Two workers of one engine on one Mac (TP=2 or PP=2 under the mp executor) each
    measure the whole working set and free RAM: each gets half, less its own weights."""
    fake_mac(monkeypatch, available=12 * GiB)
    half = int(0.9 * (WORKING_SET // 2)) - WEIGHTS - APPLE_MARGIN_BYTES
    assert budget(workers=2) == half
    assert 2 * (budget(workers=2) + WEIGHTS) <= 0.9 * WORKING_SET
    fake_mac(monkeypatch, available=4 * GiB)  # free RAM is split too
    assert budget(workers=2) == 2 * GiB - APPLE_MARGIN_BYTES
    with pytest.raises(ValueError, match=r"/ 2 workers on this host"):
        budget(kv_cache_memory_bytes=3 * GiB, workers=2)  # per worker, as in vLLM: > 2 GiB free each


def test_device_total_memory_is_the_working_set(monkeypatch):
    fake_mac(monkeypatch)
    assert MetalPlatform.get_device_total_memory() == WORKING_SET


def test_cpu_budget_is_a_share_of_system_memory(monkeypatch):
    # no Metal GPU: vLLM's utilization of the machine's RAM less the process, capped by free RAM
    monkeypatch.setattr(mx.metal, "is_available", lambda: False)
    fake_ram(monkeypatch, total=MEMORY, available=20 * GiB, rss=GiB)
    assert budget() == int(0.9 * MEMORY) - GiB
    fake_ram(monkeypatch, total=MEMORY, available=8 * GiB, rss=GiB)
    assert budget() == 8 * GiB
    assert MetalPlatform.get_device_total_memory() == MEMORY
