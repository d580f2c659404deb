"""MLX's distributed group (mx.distributed) among vLLM's workers, for the tensors.

vLLM's executor starts the workers and joins them in torch.distributed (gloo) for
control. Each worker then names the address its ring listens on (ring_address), the
workers exchange the addresses over gloo, and each joins MLX's group as MLX_RANK = its
vLLM rank, on the backend VLLM_METAL_DISTRIBUTED_BACKEND names:

* ring (default, TCP): each writes the hostfile MLX reads (MLX_HOSTFILE: a JSON list, one
  list of "host:port" per rank);
* jaccl (RDMA over Thunderbolt 5): the user's device file (MLX_IBV_DEVICES), and rank 0's
  address as the coordinator unless MLX_JACCL_COORDINATOR names one (mlx_jaccl.py).
"""

from __future__ import annotations

import json
import os
import socket
import tempfile

import mlx.core as mx

from vllm_metal import envs
from vllm_metal.log import get_logger

logger = get_logger(__name__)


def _free_address(host: str) -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return f"{host}:{s.getsockname()[1]}"


def ring_address(local_rank: int, several_hosts: bool) -> str:
    """Where this worker's ring listens: VLLM_METAL_RING_ADDRESS host:port (port + local_rank,
    so one setting serves a host's workers), else a free port on this host's address
    (vLLM's get_ip, VLLM_HOST_IP) across hosts, on 127.0.0.1 on one host."""
    configured = envs.VLLM_METAL_RING_ADDRESS
    if configured:
        host, _, port = configured.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"[vllm-metal] VLLM_METAL_RING_ADDRESS must be host:port, got {configured!r}")
        return f"{host}:{int(port) + local_rank}"
    if several_hosts:
        from vllm.utils.network_utils import get_ip

        return _free_address(get_ip())
    return _free_address("127.0.0.1")


def join_ring(rank: int, world_size: int, cpu_group, address: str):
    """Every rank calls this together; -> the mx.distributed.Group of all ranks (on the
    ring, or on JACCL: VLLM_METAL_DISTRIBUTED_BACKEND).
    cpu_group: a torch.distributed (gloo) group of the same ranks; address: this rank's
    (ring_address)."""
    import torch.distributed as dist

    backend = envs.VLLM_METAL_DISTRIBUTED_BACKEND
    problem = backend_problem(backend)
    if problem:
        raise RuntimeError(problem)
    addresses: list[str | None] = [None] * world_size
    dist.all_gather_object(addresses, address, group=cpu_group)
    os.environ["MLX_RANK"] = str(rank)
    if backend == "jaccl":
        from vllm_metal.mlx_jaccl import prepare_environment

        prepare_environment(rank, world_size, coordinator=addresses[0])
        group = mx.distributed.init(strict=True, backend="jaccl")
    else:
        with tempfile.NamedTemporaryFile("w", prefix=f"vllm-metal-ring-{rank}-", suffix=".json",
                                         delete=False) as f:
            json.dump([[a] for a in addresses], f)
        os.environ["MLX_HOSTFILE"] = f.name
        try:
            group = mx.distributed.init(strict=True, backend="ring")
        finally:
            os.unlink(f.name)  # read by init
    if group.size() != world_size or group.rank() != rank:
        raise RuntimeError(f"[vllm-metal] MLX {backend} group joined as rank {group.rank()} of "
                           f"{group.size()}, expected {rank} of {world_size}")
    logger.info("vllm-metal: rank %d joined the MLX %s group %s", rank, backend, addresses)
    return group


def backend_problem(backend: str) -> str | None:
    """Why this MLX build cannot run `backend` (VLLM_METAL_DISTRIBUTED_BACKEND), or None.
    The platform refuses it at startup; join_ring checks again in each worker (a headless
    host's own MLX)."""
    if mx.distributed.is_available(backend=backend):
        return None
    if backend == "jaccl":
        return ("[vllm-metal] VLLM_METAL_DISTRIBUTED_BACKEND=jaccl: this MLX build cannot run "
                "MLX's JACCL backend (mx.distributed.is_available(backend='jaccl') is False; it "
                "needs macOS 26.2 or later with RDMA over Thunderbolt enabled, see "
                "docs/distributed.md); use VLLM_METAL_DISTRIBUTED_BACKEND=ring (TCP)")
    return (f"[vllm-metal] this MLX build has no {backend} backend (mx.distributed): tensor and "
            "pipeline parallelism need it")
