"""vLLM's schedulers with their KV-cache manager on the C++ runtime.

The platform names one of these in ``scheduler_config.scheduler_cls`` (vLLM's
hook for a platform's scheduler; a user's own ``--scheduler-cls`` wins):
MetalAsyncScheduler under async scheduling (vLLM's default), MetalScheduler
without. Each is vLLM's class unchanged, except that every KV block is
allocated, cached, hit, evicted and freed by ``_core.KvCacheManager`` through
CoreKVCacheManager (kv_cache_manager.py), which answers the calls vLLM's own
manager would. For hybrid models each SchedulerOutput also carries
``state_checkpoints`` (state_checkpoints.StatePlan), the runner's part of
prefix caching.
"""

from __future__ import annotations

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_metal.hybrid import checkpoint_slots
from vllm_metal.kv_cache_manager import CoreKVCacheManager
from vllm_metal.log import get_logger

logger = get_logger(__name__)


class _CoreBlocks:
    def __init__(self, vllm_config, kv_cache_config, *args, **kwargs) -> None:
        cache = vllm_config.cache_config
        caching = cache.enable_prefix_caching
        slots = checkpoint_slots(vllm_config) if kv_cache_config.has_mamba_layers else 0
        if slots:
            # vLLM's own Mamba manager, which the base class builds and we replace,
            # refuses caching outside its "align" mode; the engine's block hasher
            # (built after the scheduler) must still see caching on.
            cache.enable_prefix_caching = False
        try:
            super().__init__(vllm_config, kv_cache_config, *args, **kwargs)
        finally:
            cache.enable_prefix_caching = caching
        # The base class built vLLM's manager; it is replaced before any request
        # arrives, so nothing was ever allocated from it.
        self.kv_cache_manager = CoreKVCacheManager(
            kv_cache_config,
            self.max_model_len,
            enable_caching=caching,
            log_stats=self.log_stats,
            enable_kv_cache_events=self.enable_kv_cache_events,
            watermark=self.scheduler_config.watermark,
            state_checkpoint_slots=slots,
        )

    def schedule(self, *args, **kwargs):
        out = super().schedule(*args, **kwargs)
        table = self.kv_cache_manager.state_table
        if table is not None:
            # hybrid models: the checkpoint loads and writes the runner makes this step
            out.state_checkpoints = table.plan(out, self.requests)
        return out

    def update_from_output(self, scheduler_output, model_runner_output):
        out = super().update_from_output(scheduler_output, model_runner_output)
        table = self.kv_cache_manager.state_table
        if table is not None:
            table.outputs_read(scheduler_output)
        return out

    def shutdown(self) -> None:
        stats = self.kv_cache_manager.pool.stats
        logger.info("vllm-metal: the C++ block pool allocated %d blocks, cached %d, evicted %d; "
                    "prefix-cache hits adopted %d tokens", stats.allocated, stats.stored, stats.evicted,
                    self.kv_cache_manager.hit_tokens)
        table = self.kv_cache_manager.state_table
        if table is not None:
            logger.info("vllm-metal: hybrid prefix caching wrote %(writes)d state checkpoints, "
                        "loaded %(loads)d, evicted %(evictions)d, dropped %(dropped)d", table.stats)
        super().shutdown()


class MetalScheduler(_CoreBlocks, Scheduler):
    pass


class MetalAsyncScheduler(_CoreBlocks, AsyncScheduler):
    pass
