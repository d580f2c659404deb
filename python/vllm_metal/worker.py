"""MetalWorker: vLLM's worker interface over MetalModelRunner.

vLLM calls, in order: init_device, load_model, get_kv_cache_spec,
determine_available_memory, initialize_from_config, compile_or_warm_up_model,
then per step execute_model (submits the forward lazily, returns None) and
sample_tokens (evaluates, returns the tokens). The worker owns the memory
budget; the runner owns the model, the KV pool and the batch.
"""

from __future__ import annotations

import logging
import os
import time

import psutil
import torch
from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase

logger = logging.getLogger(__name__)


class MetalWorker(WorkerBase):
    def init_device(self) -> None:
        from vllm_metal.model_runner import MetalModelRunner

        self.device = torch.device("cpu")
        self._init_single_process_distributed()
        self.model_runner = MetalModelRunner(self.vllm_config)

    def _init_single_process_distributed(self) -> None:
        # vLLM's schedulers and samplers query the (trivial) parallel groups.
        from vllm.distributed import (
            ensure_model_parallel_initialized,
            init_distributed_environment,
        )

        init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=self.distributed_init_method,
            local_rank=0,
            backend="gloo",
        )
        ensure_model_parallel_initialized(1, 1)

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
        """Bytes for the KV cache: --kv-cache-memory-bytes, else the share of
        system memory (--gpu-memory-utilization) left after the weights."""
        cache = self.cache_config
        available = psutil.virtual_memory().available
        # Hybrid models keep per-request state outside vLLM's blocks: it comes out of
        # the same budget, so blocks + state stay within what was asked for.
        state = self.model_runner.state_memory_bytes()
        if state:
            logger.info("vllm-metal: %d bytes of the KV-cache budget go to state slots", state)
        if cache.kv_cache_memory_bytes is not None:
            budget = int(cache.kv_cache_memory_bytes) - state
            if budget <= 0:
                raise ValueError(
                    f"[vllm-metal] --kv-cache-memory-bytes {cache.kv_cache_memory_bytes} does not "
                    f"cover the {state} bytes of linear-attention state (max_num_seqs slots)")
            if budget + state > available:
                raise ValueError(
                    f"[vllm-metal] --kv-cache-memory-bytes {cache.kv_cache_memory_bytes} exceeds the "
                    f"{available} bytes of memory available")
            return budget
        total = psutil.virtual_memory().total
        used_by_us = psutil.Process(os.getpid()).memory_info().rss
        budget = int(total * cache.gpu_memory_utilization) - used_by_us - state
        budget = min(budget, available - state)
        if budget <= 0:
            raise ValueError(
                f"[vllm-metal] no memory left for the KV cache: the worker uses {used_by_us} bytes "
                f"of the {int(total * cache.gpu_memory_utilization)} allowed by "
                f"--gpu-memory-utilization {cache.gpu_memory_utilization}; raise it or set "
                "--kv-cache-memory-bytes")
        return budget

    def initialize_from_config(self, kv_cache_config) -> None:
        self.model_runner.initialize_kv_cache(kv_cache_config)

    def compile_or_warm_up_model(self) -> CompilationTimes:
        start = time.perf_counter()
        self.model_runner.warm_up()
        logger.info("vllm-metal warm-up took %.2f s", time.perf_counter() - start)
        return CompilationTimes(language_model=0.0, encoder=0.0)

    def get_supported_tasks(self):
        return ("generate",)

    def execute_model(self, scheduler_output):
        return self.model_runner.execute_model(scheduler_output)

    def sample_tokens(self, grammar_output):
        return self.model_runner.sample_tokens(grammar_output)

    def take_draft_token_ids(self):
        return None

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

    def add_lora(self, lora_request) -> bool:
        raise ValueError("[vllm-metal] LoRA is not supported")

    def remove_lora(self, lora_id: int) -> bool:
        return False

    def pin_lora(self, lora_id: int) -> bool:
        return False

    def list_loras(self) -> set[int]:
        return set()

    def sleep(self, level: int = 1) -> None:
        logger.warning("sleep mode is not supported by vllm-metal; ignored")

    def wake_up(self, tags=None) -> None:
        return None
