"""MLX's JACCL backend (RDMA over Thunderbolt 5) for the workers' group: its environment.

MLX 0.32 reads (mlx/distributed/jaccl, Config::from_env; the JACCL_* name wins over the
MLX_* one): MLX_RANK, MLX_IBV_DEVICES (a JSON file: row i names the RDMA device, e.g.
"rdma_en5", that connects rank i to each rank j, null for itself and for ranks it has no
cable to), MLX_JACCL_COORDINATOR (host:port rank 0 listens on to set the connections up)
and MLX_JACCL_RING (present: prefer a ring of neighbours to the full mesh). The device
file describes the user's cables and cannot be guessed: it is required. The rank is vLLM's;
the coordinator defaults to rank 0's ring address (mlx_ring.ring_address), which every
worker reaches already.
"""

from __future__ import annotations

import json
import os


def _either(*names: str) -> tuple[str, str] | None:
    """(name, value) of the first variable set, in MLX's order of preference."""
    for name in names:
        if os.environ.get(name):
            return name, os.environ[name]
    return None


def check_device_file(path: str, world_size: int, variable: str = "MLX_IBV_DEVICES") -> list:
    """The device matrix [world_size][world_size] of strings or null, each rank's own entry
    null; a ValueError naming the file and the problem otherwise."""
    where = f"[vllm-metal] {variable}={path}"
    try:
        with open(path) as f:
            devices = json.load(f)
    except OSError as e:
        raise ValueError(f"{where}: cannot read the JACCL device file ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(devices, list) or len(devices) != world_size or not all(
            isinstance(row, list) and len(row) == world_size for row in devices):
        raise ValueError(f"{where}: expected a {world_size} x {world_size} list of lists (one row per "
                         f"rank of the {world_size} workers, one entry per peer)")
    for i, row in enumerate(devices):
        for j, name in enumerate(row):
            if not (name is None or isinstance(name, str)):
                raise ValueError(f"{where}: entry [{i}][{j}] must be a device name or null, got {name!r}")
        if row[i] is not None:
            raise ValueError(f"{where}: entry [{i}][{i}] (rank {i} to itself) must be null")
    return devices


def prepare_environment(rank: int, world_size: int, coordinator: str) -> None:
    """Sets what MLX's JACCL init reads for vLLM's rank `rank`; coordinator: rank 0's
    host:port, used unless the user named one."""
    devices = _either("JACCL_IBV_DEVICES", "MLX_IBV_DEVICES")
    if devices is None:
        raise ValueError("[vllm-metal] VLLM_METAL_DISTRIBUTED_BACKEND=jaccl needs MLX_IBV_DEVICES: the "
                         "path of a JSON file naming the RDMA device between each pair of ranks "
                         "(docs/distributed.md)")
    check_device_file(devices[1], world_size, devices[0])
    os.environ["MLX_RANK"] = os.environ["JACCL_RANK"] = str(rank)  # JACCL_RANK would win
    if _either("JACCL_COORDINATOR", "MLX_JACCL_COORDINATOR") is None:
        os.environ["MLX_JACCL_COORDINATOR"] = coordinator
