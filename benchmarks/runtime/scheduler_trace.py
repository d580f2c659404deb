"""vLLM's real scheduler on a synthetic request trace, without a model.

Drives ``Scheduler.schedule`` / ``update_from_output`` in-process, with sampled
tokens fixed in advance (bench_block_pool.output_token), so two schedulers fed
the same trace must make the same decisions. Used by
tests/py/test_core_kv_cache_manager.py (vLLM's own KV-cache manager against the
C++ one, step by step) and by bench_scheduler_kv.py (time per step in block
management at 64-1,024 running requests).
"""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_block_pool  # noqa: E402  (its workloads and fixed output tokens)

make_workload = bench_block_pool.make_workload
output_token = bench_block_pool.output_token
VOCAB = 32000


@cache
def _tiny_checkpoint() -> str:
    from vllm_metal.models.testing import tiny_config, write_random_checkpoint

    out = tempfile.mkdtemp(prefix="sched-trace-")
    write_random_checkpoint(tiny_config("llama", max_position_embeddings=8192), out)
    return out


def engine_config(*, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int = 2048,
                  enable_caching: bool = True, async_scheduling: bool = False, hash_algo: str = "sha256",
                  enable_kv_events: bool = False):
    from vllm.config import KVEventsConfig
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=_tiny_checkpoint(), skip_tokenizer_init=True, max_model_len=max_model_len,
                      max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                      enable_prefix_caching=enable_caching, async_scheduling=async_scheduling,
                      prefix_caching_hash_algo=hash_algo,
                      kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null")
                      if enable_kv_events else None)
    return args.create_engine_config()


def kv_cache_config(vllm_config, num_blocks: int):
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=vllm_config.cache_config.block_size, num_kv_heads=2, head_size=16,
                             dtype=torch.float16)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)])


def make_scheduler(cls, vllm_config, num_blocks: int):
    from vllm.v1.structured_output import StructuredOutputManager

    vllm_config.cache_config.num_gpu_blocks = num_blocks  # what the engine sets after profiling
    return cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config(vllm_config, num_blocks),
               structured_output_manager=StructuredOutputManager(vllm_config),
               block_size=vllm_config.cache_config.block_size, log_stats=True)


def block_hasher(vllm_config):
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(fn)
    return get_request_block_hasher(vllm_config.cache_config.block_size, fn)


@dataclass
class StepLog:
    """Everything a scheduler decided in one step, as plain values."""

    decisions: list = field(default_factory=list)
    block_seconds: float = 0.0  # inside the KV-cache manager
    step_seconds: float = 0.0   # schedule() + update_from_output()


class _Timed:
    """Wraps the scheduler's KV-cache manager and adds up the time spent in its
    methods. Each method's wrapper is made once (the wrapping costs well under
    a microsecond per call, the same for both managers)."""

    def __init__(self, inner):
        self._inner = inner
        self.seconds = 0.0

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if not callable(attr) or isinstance(getattr(type(self._inner), name, None), property):
            return attr
        clock = time.perf_counter

        def timed(*a, **k):
            t = clock()
            out = attr(*a, **k)
            self.seconds += clock() - t
            return out

        setattr(self, name, timed)
        return timed


def run(scheduler, workload, hasher, *, max_steps: int = 100000, timed: bool = False, resets=()) -> list[StepLog]:
    """Feeds the workload's requests at their arrival steps; returns one StepLog
    per step until every request finished (or max_steps)."""
    from vllm import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    if timed:
        scheduler.kv_cache_manager = _Timed(scheduler.kv_cache_manager)
    index = {r.rid: i for i, r in enumerate(workload.requests)}
    pending = sorted(workload.requests, key=lambda r: r.arrival_step)
    logs: list[StepLog] = []
    step = 0
    while (pending or scheduler.has_requests()) and step < max_steps:
        while pending and pending[0].arrival_step <= step:
            r = pending.pop(0)
            scheduler.add_request(Request(r.rid, list(r.prompt), SamplingParams(max_tokens=r.max_tokens,
                                                                                 ignore_eos=True),
                                          None, block_hasher=hasher))
        if step in resets:
            scheduler.reset_prefix_cache()
        log = StepLog()
        t0 = time.perf_counter()
        so = scheduler.schedule()
        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            req = scheduler.requests[rid]
            # a token once the step reached the end of what the request holds (a
            # partial prefill chunk samples nothing); sync scheduling only
            done = req.num_computed_tokens >= req.num_tokens
            sampled.append([output_token(index[rid], len(req.output_token_ids), VOCAB)] if done else [])
        out = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                sampled_token_ids=sampled)
        outputs = scheduler.update_from_output(so, out)
        log.step_seconds = time.perf_counter() - t0
        cached = so.scheduled_cached_reqs
        log.decisions = [
            sorted((n.req_id, tuple(map(tuple, n.block_ids)), n.num_computed_tokens) for n in so.scheduled_new_reqs),
            sorted(zip(cached.req_ids, [None if b is None else tuple(map(tuple, b)) for b in cached.new_block_ids],
                       cached.num_computed_tokens)),
            sorted(so.num_scheduled_tokens.items()),
            sorted(so.preempted_req_ids or ()),
            sorted(so.finished_req_ids),
        ]
        stats = next((o.scheduler_stats for o in outputs.values() if o.scheduler_stats), None)
        if stats is not None:
            p = stats.prefix_cache_stats
            log.decisions.append((stats.num_running_reqs, stats.num_waiting_reqs, round(stats.kv_cache_usage, 9),
                                  p.requests, p.queries, p.hits, p.preempted_requests))
        if timed:
            log.block_seconds, scheduler.kv_cache_manager.seconds = scheduler.kv_cache_manager.seconds, 0.0
        logs.append(log)
        step += 1
    return logs
