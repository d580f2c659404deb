"""vLLM's schedulers with their KV-cache manager on the C++ runtime.

The platform names one of these in ``scheduler_config.scheduler_cls`` (vLLM's
hook for a platform's scheduler; a user's own ``--scheduler-cls`` wins):
MetalAsyncScheduler under async scheduling (vLLM's default), MetalScheduler
without. Each is vLLM's class unchanged, except that every KV block is
allocated, cached, hit, evicted and freed by ``_core.KvCacheManager`` through
CoreKVCacheManager (kv_cache_manager.py), which answers the calls vLLM's own
manager would.
"""

from __future__ import annotations

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_metal.kv_cache_manager import CoreKVCacheManager
from vllm_metal.log import get_logger

logger = get_logger(__name__)


class _CoreBlocks:
    def __init__(self, vllm_config, kv_cache_config, *args, **kwargs) -> None:
        super().__init__(vllm_config, kv_cache_config, *args, **kwargs)
        # The base class built vLLM's manager; it is replaced before any request
        # arrives, so nothing was ever allocated from it.
        self.kv_cache_manager = CoreKVCacheManager(
            kv_cache_config,
            self.max_model_len,
            enable_caching=self.cache_config.enable_prefix_caching,
            log_stats=self.log_stats,
            enable_kv_cache_events=self.enable_kv_cache_events,
            watermark=self.scheduler_config.watermark,
        )

    def shutdown(self) -> None:
        stats = self.kv_cache_manager.pool.stats
        logger.info("vllm-metal: the C++ block pool allocated %d blocks, cached %d, evicted %d; "
                    "prefix lookups hit %d tokens", stats.allocated, stats.stored, stats.evicted,
                    stats.hit_tokens)
        super().shutdown()


class MetalScheduler(_CoreBlocks, Scheduler):
    pass


class MetalAsyncScheduler(_CoreBlocks, AsyncScheduler):
    pass
