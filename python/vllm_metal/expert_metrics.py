"""The expert cache's counters on vLLM's /metrics.

The cache lives in the engine-core process, /metrics is served by the API server.
vLLM 0.33 shares Prometheus values across processes only with several API servers
(PROMETHEUS_MULTIPROC_DIR, set before prometheus_client is imported), and its stats
path from the engine carries a fixed set of fields. So: the platform hook, which runs
in the API server while the config is built, picks a small stats file (its path rides
in additional_config to the engine core) and registers a collector on prometheus_client's
default registry; the runner rewrites the file (atomic rename) after each step whose
counters changed; a scrape reads it. With --api-server-count > 1 (a multiprocess
registry) the counters are not shown.
"""

from __future__ import annotations

import json
import os
import tempfile

STATS_KEY = "_vllm_metal_expert_stats_file"  # additional_config: the stats file's path
_registered: set = set()


def prepare(vllm_config) -> None:
    """In the API server: choose the stats file and expose it on /metrics (idempotent)."""
    additional = vllm_config.additional_config
    if STATS_KEY not in additional:
        additional[STATS_KEY] = os.path.join(tempfile.mkdtemp(prefix="vllm-metal-experts-"),
                                             "stats.json")
    path = additional[STATS_KEY]
    if path in _registered:
        return
    from prometheus_client import REGISTRY

    REGISTRY.register(ExpertStatsCollector(path))
    _registered.add(path)


class ExpertStatsCollector:
    """Prometheus collector over the stats file the engine core writes."""

    def __init__(self, path: str):
        self.path = path

    def describe(self):
        return []  # collected lazily: the file may not exist before the model loads

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        try:
            with open(self.path) as f:
                s = json.load(f)
        except (OSError, ValueError):
            s = dict(hits=0, misses=0, bytes_streamed=0, prefetched=0, prefetch_wasted=0)
        yield CounterMetricFamily("vllm_metal:moe_expert_cache_hits",
                                  "Expert lookups the MoE expert cache served", value=s["hits"])
        yield CounterMetricFamily("vllm_metal:moe_expert_cache_misses",
                                  "Expert lookups read from the checkpoint file", value=s["misses"])
        yield CounterMetricFamily("vllm_metal:moe_expert_bytes_streamed",
                                  "Bytes of expert weights read from disk", value=s["bytes_streamed"])
        yield CounterMetricFamily("vllm_metal:moe_expert_prefetched",
                                  "Misses whose bytes the background prefetch had read",
                                  value=s["prefetched"])
        yield CounterMetricFamily("vllm_metal:moe_expert_prefetch_wasted",
                                  "Experts the prefetch read that the layer did not use",
                                  value=s.get("prefetch_wasted", 0))
        total = s["hits"] + s["misses"]
        yield GaugeMetricFamily("vllm_metal:moe_expert_cache_hit_rate",
                                "Hits / lookups since start", value=s["hits"] / total if total else 0.0)


class StatsWriter:
    """In the engine core: the cache's counters to the stats file when they change."""

    def __init__(self, path: str, cache):
        self.path = path
        self.cache = cache
        self._last = None

    def write(self) -> None:
        s = self.cache.stats.as_dict()
        if s == self._last:
            return
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(s, f)
        os.replace(tmp, self.path)
        self._last = s
