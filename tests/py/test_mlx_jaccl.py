"""VLLM_METAL_DISTRIBUTED_BACKEND (envs.py, mlx_ring.py, mlx_jaccl.py): the name parsed, a
backend this MLX build cannot run refused at startup and in the worker, and the JACCL
environment the workers set (MLX 0.32's names, from its jaccl Config::from_env). JACCL
itself never ran here: this Linux MLX has no JACCL (no RDMA over Thunderbolt)."""

from __future__ import annotations

import json
import os

import mlx.core as mx
import pytest

from vllm_metal import envs
from vllm_metal.mlx_jaccl import check_device_file, prepare_environment
from vllm_metal.platform import UnsupportedConfiguration, _refuse_unsupported, \
    _refuse_unusable_distributed_backend

JACCL_NAMES = ("MLX_IBV_DEVICES", "JACCL_IBV_DEVICES", "MLX_JACCL_COORDINATOR", "JACCL_COORDINATOR",
               "MLX_RANK", "JACCL_RANK")


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    for name in JACCL_NAMES + ("VLLM_METAL_DISTRIBUTED_BACKEND",):
        monkeypatch.delenv(name, raising=False)


def test_the_backend_name_is_parsed(monkeypatch):
    assert envs.VLLM_METAL_DISTRIBUTED_BACKEND == "ring"
    monkeypatch.setenv("VLLM_METAL_DISTRIBUTED_BACKEND", " JACCL ")
    assert envs.VLLM_METAL_DISTRIBUTED_BACKEND == "jaccl"
    monkeypatch.setenv("VLLM_METAL_DISTRIBUTED_BACKEND", "nccl")
    with pytest.raises(ValueError, match="VLLM_METAL_DISTRIBUTED_BACKEND: expected 'ring' or 'jaccl', got 'nccl'"):
        envs.VLLM_METAL_DISTRIBUTED_BACKEND
    with pytest.raises(UnsupportedConfiguration, match="VLLM_METAL_DISTRIBUTED_BACKEND: expected"):
        _refuse_unusable_distributed_backend()


def test_jaccl_is_refused_at_startup_where_mlx_cannot_run_it(monkeypatch):
    from test_pipeline_parallel import _config

    config = _config()  # PP=2
    config.cache_config = type("C", (), {"prefix_caching_hash_algo": "sha256"})()
    config.kv_transfer_config = None
    config.observability_config = type("O", (), {"kv_cache_metrics": False})()
    config.model_config = None
    _refuse_unsupported(config)  # the ring: fine
    monkeypatch.setenv("VLLM_METAL_DISTRIBUTED_BACKEND", "jaccl")
    if mx.distributed.is_available(backend="jaccl"):  # a Mac with RDMA over Thunderbolt
        _refuse_unsupported(config)
    else:  # this Linux build
        with pytest.raises(UnsupportedConfiguration, match="cannot run MLX's JACCL backend.*"
                                                           "VLLM_METAL_DISTRIBUTED_BACKEND=ring"):
            _refuse_unsupported(config)
    # either outcome, whatever this build has
    available = {"jaccl": False, "ring": True}
    monkeypatch.setattr(mx.distributed, "is_available", lambda backend="any": available[backend])
    with pytest.raises(UnsupportedConfiguration, match="JACCL"):
        _refuse_unusable_distributed_backend()
    available["jaccl"] = True
    _refuse_unusable_distributed_backend()


def test_a_worker_refuses_jaccl_before_joining(monkeypatch):
    from vllm_metal.mlx_ring import join_ring

    monkeypatch.setenv("VLLM_METAL_DISTRIBUTED_BACKEND", "jaccl")
    monkeypatch.setattr(mx.distributed, "is_available", lambda backend="any": backend != "jaccl")
    with pytest.raises(RuntimeError, match="VLLM_METAL_DISTRIBUTED_BACKEND=jaccl"):
        join_ring(0, 2, cpu_group=None, address="127.0.0.1:1")  # no gloo needed to refuse


def _device_file(tmp_path, devices, name="devices.json"):
    path = tmp_path / name
    path.write_text(json.dumps(devices))
    return str(path)


def test_the_jaccl_environment(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="needs MLX_IBV_DEVICES"):
        prepare_environment(1, 2, coordinator="10.0.0.1:18300")
    good = _device_file(tmp_path, [[None, "rdma_en5"], ["rdma_en5", None]])
    monkeypatch.setenv("MLX_IBV_DEVICES", good)
    monkeypatch.setenv("JACCL_RANK", "7")  # would win over MLX_RANK in MLX
    prepare_environment(1, 2, coordinator="10.0.0.1:18300")
    assert (os.environ["MLX_RANK"], os.environ["JACCL_RANK"]) == ("1", "1")
    assert os.environ["MLX_JACCL_COORDINATOR"] == "10.0.0.1:18300"  # rank 0's address
    monkeypatch.setenv("MLX_JACCL_COORDINATOR", "10.0.0.9:5000")  # the user's wins
    prepare_environment(0, 2, coordinator="10.0.0.1:18300")
    assert os.environ["MLX_JACCL_COORDINATOR"] == "10.0.0.9:5000"
    # JACCL_IBV_DEVICES is read first, as MLX does
    monkeypatch.setenv("JACCL_IBV_DEVICES", _device_file(tmp_path, [[None]], "one.json"))
    with pytest.raises(ValueError, match=r"JACCL_IBV_DEVICES=.*one.json: expected a 2 x 2"):
        prepare_environment(0, 2, coordinator="10.0.0.1:18300")


@pytest.mark.parametrize("devices, words", [
    ([[None, "rdma_en5"]], "expected a 2 x 2 list of lists"),
    ([[None, "rdma_en5"], ["rdma_en5"]], "expected a 2 x 2 list of lists"),
    ([["rdma_en2", "rdma_en5"], ["rdma_en5", None]], r"entry \[0\]\[0\] \(rank 0 to itself\) must be null"),
    ([[None, 5], ["rdma_en5", None]], r"entry \[0\]\[1\] must be a device name or null, got 5"),
])
def test_bad_device_files_are_refused_with_the_problem(tmp_path, devices, words):
    with pytest.raises(ValueError, match=words):
        check_device_file(_device_file(tmp_path, devices), 2)


def test_unreadable_device_files_are_refused(tmp_path):
    with pytest.raises(ValueError, match="cannot read the JACCL device file"):
        check_device_file(str(tmp_path / "missing.json"), 2)
    (tmp_path / "bad.json").write_text("[[null,")
    with pytest.raises(ValueError, match="not JSON"):
        check_device_file(str(tmp_path / "bad.json"), 2)
    # a ring of 3 (MLX_JACCL_RING): neighbours only, the rest null
    ring = [[None, "a", "b"], ["a", None, "c"], ["b", "c", None]]
    assert check_device_file(_device_file(tmp_path, ring), 3) == ring
