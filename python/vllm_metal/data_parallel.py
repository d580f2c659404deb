"""Data parallelism (--data-parallel-size N): vLLM's own replicas over our worker.

vLLM starts one engine-core process per replica (each a MetalWorker with its own model
copy and KV pool) and balances requests between them with its DP coordinator; across
hosts its --data-parallel-address / --data-parallel-rpc-port / --headless options connect
them. A dense model's replicas are independent: vLLM turns each engine's parallel config
back into DP=1 (ParallelConfig.reconfigure_for_independent_dp_rank), so the worker sees a
single process. What this module adds is what a Mac needs and vLLM cannot know:

- the replicas on one host share one unified memory (a GPU server has one device per
  replica), so each gets 1/N of --gpu-memory-utilization;
- what a replica cannot carry is refused at startup (refusal).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_metal.log import get_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = get_logger(__name__)


def replicas_on_this_host(vllm_config: VllmConfig) -> int:
    """Engine processes this `vllm serve` starts (--data-parallel-size-local, which vLLM
    sets to --data-parallel-size on a single host); 1 without data parallelism."""
    parallel = vllm_config.parallel_config
    if parallel.data_parallel_size <= 1:
        return 1
    return max(int(parallel.data_parallel_size_local), 1)


def refusal(vllm_config: VllmConfig) -> tuple[str, str] | None:
    """(what is not supported, what to do instead) for a data-parallel configuration
    that cannot run here, or None."""
    parallel = vllm_config.parallel_config
    if parallel.data_parallel_size <= 1:
        return None
    model = vllm_config.model_config
    if model is not None and model.is_moe:
        # vLLM runs MoE replicas in lockstep (DPEngineCoreProc: dummy batches while idle)
        # and splits the experts across the replicas' shared process group; our runner
        # keeps every expert in each replica and has no such group.
        return ("data parallelism with a mixture-of-experts model (vLLM shards its experts across "
                "replicas that step in lockstep; the Metal runner keeps whole experts per replica)",
                "run one `vllm serve` per replica behind a load balancer")
    if parallel.data_parallel_backend != "mp":
        return (f"--data-parallel-backend {parallel.data_parallel_backend} (Ray places replicas on GPUs)",
                "use the default mp backend, with `vllm serve --headless` on the other hosts")
    return None


def share_memory_between_replicas(vllm_config: VllmConfig) -> None:
    """Each local replica gets an equal share of --gpu-memory-utilization, so N replicas
    together fill what one would (a Mac's GPU and CPU share one memory). Replicas on
    other hosts are not counted: each Mac has its own memory. An explicit
    --kv-cache-memory-bytes stays per replica, as in vLLM."""
    replicas = replicas_on_this_host(vllm_config)
    if replicas == 1:
        return
    cache = vllm_config.cache_config
    whole = cache.gpu_memory_utilization
    cache.gpu_memory_utilization = whole / replicas
    logger.info("vllm-metal: %d data-parallel replicas share this host's memory: each gets "
                "--gpu-memory-utilization %.4g / %d = %.4g", replicas, whole, replicas,
                cache.gpu_memory_utilization)
