"""MetalWorker: vLLM's worker interface over MetalModelRunner.

vLLM calls, in order: init_device, load_model, get_kv_cache_spec,
determine_available_memory, initialize_from_config, compile_or_warm_up_model,
then per step execute_model (submits the forward lazily, returns None) and
sample_tokens (evaluates, returns the tokens). The worker owns the memory
budget; the runner owns the model, the KV pool and the batch.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from dataclasses import dataclass

import psutil
import torch
from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase

from vllm_metal import envs
from vllm_metal.log import get_logger
from vllm_metal.startup_summary import summary

logger = get_logger(__name__)

# Apple: Metal memory the budget leaves free besides the weights: a step's activations,
# MLX's buffer cache and the driver's own allocations share the working set with them.
APPLE_MARGIN_BYTES = 1 << 30


@dataclass
class DeviceMemory:
    """What the KV-cache budget is cut from.

    limit: the memory this instance may fill (vLLM's "GPU memory"): Metal's recommended
    working set on Apple, the machine's RAM on the CPU. in_use: what it holds already
    (Apple: MLX's Metal buffers, i.e. the weights; CPU: the process's RSS). available:
    RAM the rest of the system leaves free (psutil), so the cache never pushes it to swap.
    """
    limit: int
    in_use: int
    available: int
    margin: int
    source: str

    @classmethod
    def measure(cls) -> "DeviceMemory":
        from vllm_metal.platform import metal_working_set

        available = psutil.virtual_memory().available
        working_set = metal_working_set()
        if working_set is not None:
            import mlx.core as mx

            return cls(working_set, mx.get_active_memory(), available, APPLE_MARGIN_BYTES,
                       "Metal recommended working set")
        rss = psutil.Process(os.getpid()).memory_info().rss
        return cls(psutil.virtual_memory().total, rss, available, 0, "system memory")

    def kv_cache_budget(self, utilization: float, requested: int | None, state: int) -> int:
        """KV blocks' bytes (state: bytes of hybrid state slots, also out of the budget)."""
        if requested is not None:
            budget = int(requested) - state
            if budget <= 0:
                raise ValueError(
                    f"[vllm-metal] --kv-cache-memory-bytes {requested} does not "
                    f"cover the {state} bytes of linear-attention state (max_num_seqs slots)")
            room = min(self.available, self.limit - self.in_use)
            if requested > room:
                raise ValueError(
                    f"[vllm-metal] --kv-cache-memory-bytes {requested} exceeds the "
                    f"{room} bytes of memory available ({self})")
            return budget
        allowed = int(self.limit * utilization)
        budget = min(allowed - self.in_use, self.available) - self.margin - state
        if budget <= 0:
            raise ValueError(
                f"[vllm-metal] no memory left for the KV cache: the worker uses {self.in_use} bytes "
                f"of the {allowed} allowed by --gpu-memory-utilization {utilization} ({self}); "
                "raise it or set --kv-cache-memory-bytes")
        return budget

    def shared_by(self, workers: int) -> "DeviceMemory":
        """This worker's part when `workers` workers of one engine (tensor or pipeline
        ranks) run on this host: a Mac has one memory for all of them, where a GPU server
        gives each its own device. Each worker then measures the same limit and free RAM,
        and would budget all of it; each gets an equal part instead, and pays its own
        weights (in_use) and margin from it."""
        if workers <= 1:
            return self
        return dataclasses.replace(self, limit=self.limit // workers, available=self.available // workers,
                                   source=f"{self.source} / {workers} workers on this host")

    def __str__(self) -> str:
        gib = 2**30
        return (f"{self.source} {self.limit / gib:.2f} GiB, in use {self.in_use / gib:.2f} GiB, "
                f"RAM available {self.available / gib:.2f} GiB, margin {self.margin / gib:.2f} GiB")


def _workers_on_this_host(cpu_group) -> int:
    """Workers of this engine (its torch.distributed world, gloo) on the same host as
    this one, by host name: every rank on one machine under the mp executor, one per Mac
    across Macs."""
    import torch.distributed as dist

    me = socket.gethostname()
    hosts: list[str | None] = [None] * dist.get_world_size(group=cpu_group)
    dist.all_gather_object(hosts, me, group=cpu_group)
    return hosts.count(me)


def _forget_inherited_signal_wakeup() -> None:
    """A process forked (VLLM_WORKER_MULTIPROC_METHOD=fork) from the API server, directly
    (a data-parallel replica's engine) or through its engine (a TP/PP worker), inherits
    the API server's asyncio signal wakeup fd: the SIGTERM vLLM sends a surviving worker
    or replica when another has died then also reads as the API server's own, which shuts
    down before the engine can fail the requests in flight (docs/distributed.md). Neither
    runs an event loop on its main thread: drop it (in a process of vLLM's only: a worker
    in the user's own process, the uni executor without multiprocessing, keeps the
    user's)."""
    import multiprocessing
    import signal
    import threading

    if multiprocessing.parent_process() is not None and \
            threading.current_thread() is threading.main_thread():
        signal.set_wakeup_fd(-1)


def _exit_with_parent() -> None:
    """A worker whose engine process is gone exits. vLLM's worker only closes its queues
    then, which a main thread blocked in MLX (a ring collective whose peer died: the
    evaluation waits for good) never notices; the engine's own kill of its workers dies
    with the engine when the engine stops first (a fatal error after a peer's death)."""
    import threading

    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="vllm-metal-parent-watch").start()


class MetalWorker(WorkerBase):
    def init_device(self) -> None:
        from vllm_metal.model_runner import MetalModelRunner

        self.device = torch.device("cpu")
        self._kv_budget = "not measured"  # determine_available_memory fills it in
        self._workers_on_this_host = 1  # _init_distributed counts them
        self.mlx_group = self._init_distributed()
        self.model_runner = MetalModelRunner(self.vllm_config, self.mlx_group)
        self._fail_at_step = envs.VLLM_METAL_TEST_FAIL_FORWARD_AT_STEP  # tests only; 0: never
        self._steps = 0  # non-empty steps executed

    def _init_distributed(self):
        """vLLM's parallel groups on gloo (its schedulers and samplers query them; with
        several workers its executor coordinates over them), and with several workers
        MLX's ring for the tensors (mlx_ring.py). -> the ring's group, or None."""
        from vllm.distributed import (
            ensure_model_parallel_initialized,
            init_distributed_environment,
        )
        from vllm.distributed.parallel_state import get_world_group

        parallel = self.parallel_config
        _forget_inherited_signal_wakeup()
        init_distributed_environment(
            world_size=parallel.world_size,
            rank=self.rank,
            distributed_init_method=self.distributed_init_method,
            local_rank=self.local_rank,
            backend="gloo",
        )
        ensure_model_parallel_initialized(parallel.tensor_parallel_size,
                                          parallel.pipeline_parallel_size)
        if parallel.world_size == 1:
            return None
        _exit_with_parent()
        self._workers_on_this_host = _workers_on_this_host(get_world_group().cpu_group)
        from vllm_metal.mlx_ring import join_ring, ring_address

        address = ring_address(self.local_rank, getattr(parallel, "nnodes", 1) > 1)
        return join_ring(self.rank, parallel.world_size, get_world_group().cpu_group, address)

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        self.model_runner.load_model()

    def get_model(self):
        return self.model_runner.model

    def get_kv_cache_spec(self):
        return self.model_runner.get_kv_cache_spec()

    def get_supported_kv_cache_layouts(self) -> list[str]:
        return ["LBNHC"]  # [num_blocks, block_size, kv_heads, head_size] per layer

    def set_kv_cache_layout(self, kv_cache_layout: str, cp_kv_cache_interleave_size: int) -> None:
        if kv_cache_layout != "LBNHC":
            raise ValueError(f"[vllm-metal] KV cache layout {kv_cache_layout} is not supported")

    def determine_available_memory(self) -> int:
        """Bytes for the KV cache: --kv-cache-memory-bytes, else the share
        (--gpu-memory-utilization) of the device's memory left after the weights."""
        cache = self.cache_config
        # Hybrid models keep per-request state outside vLLM's blocks: it comes out of
        # the same budget, so blocks + state stay within what was asked for.
        state = self.model_runner.state_memory_bytes()
        if state:
            logger.info("vllm-metal: %d bytes of the KV-cache budget go to state slots", state)
        memory = DeviceMemory.measure().shared_by(self._workers_on_this_host)
        budget = memory.kv_cache_budget(cache.gpu_memory_utilization, cache.kv_cache_memory_bytes, state)
        source = "--kv-cache-memory-bytes" if cache.kv_cache_memory_bytes else (
            f"--gpu-memory-utilization {cache.gpu_memory_utilization} of {memory}")
        self._kv_budget = f"{budget / 2**30:.2f} GiB ({source})"
        # a draft model's cache uses the same blocks: vLLM is offered the target's share
        share = self.model_runner.kv_budget_share()
        if share < 1.0:
            logger.info("vllm-metal: %.1f%% of the KV-cache budget goes to the draft model's cache",
                        100 * (1 - share))
            budget = int(budget * share)
        return budget

    def initialize_from_config(self, kv_cache_config) -> None:
        self.model_runner.initialize_kv_cache(kv_cache_config)

    def compile_or_warm_up_model(self) -> CompilationTimes:
        start = time.perf_counter()
        self.model_runner.warm_up()
        logger.info("%s\n  warm-up took %.2f s", summary(self.model_runner, self._kv_budget),
                    time.perf_counter() - start)
        return CompilationTimes(language_model=0.0, encoder=0.0)

    def get_supported_tasks(self):
        return self.model_runner.supported_tasks()

    def execute_model(self, scheduler_output):
        if self._fail_at_step and scheduler_output.total_num_scheduled_tokens:
            self._steps += 1
            if self._steps == self._fail_at_step:
                raise RuntimeError(f"[vllm-metal] injected fault in the forward of step {self._steps} "
                                   "(VLLM_METAL_TEST_FAIL_FORWARD_AT_STEP)")
        return self.model_runner.execute_model(scheduler_output)

    def sample_tokens(self, grammar_output):
        return self.model_runner.sample_tokens(grammar_output)

    def take_draft_token_ids(self):
        return self.model_runner.take_draft_token_ids()

    def get_cache_block_size_bytes(self) -> int:
        return self.model_runner.cache_block_size_bytes()

    def check_health(self) -> None:
        return None

    def synchronize_device(self) -> None:
        import mlx.core as mx

        mx.synchronize()

    def reset_mm_cache(self) -> None:
        return None

    def reset_encoder_cache(self) -> None:
        return None

    def shutdown(self) -> None:
        self.model_runner = None

    # LoRA (--enable-lora): the runner's lora.manager.LoraManager
    def _lora(self):
        lora = self.model_runner.lora if self.model_runner is not None else None
        if lora is None:
            raise ValueError("[vllm-metal] LoRA is not enabled: start with --enable-lora")
        return lora

    def add_lora(self, lora_request) -> bool:
        return self._lora().add(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self._lora().remove(lora_id)

    def pin_lora(self, lora_id: int) -> bool:
        return self._lora().pin(lora_id)

    def list_loras(self) -> set[int]:
        lora = self.model_runner.lora if self.model_runner is not None else None
        return lora.list() if lora is not None else set()

    def sleep(self, level: int = 1) -> None:
        logger.warning("sleep mode is not supported by vllm-metal; ignored")

    def wake_up(self, tags=None) -> None:
        return None
