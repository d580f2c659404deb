"""vLLM's scheduler with its own KV-cache manager against the same scheduler on the
C++ KvCacheManager (vllm_metal.scheduler.MetalScheduler, what `vllm serve` runs).

Both are fed one synthetic trace (benchmarks/runtime/scheduler_trace.py: shared
system prompts, multi-turn follow-ups quoting earlier answers, repeats, a pool small
enough to preempt, a prefix-cache reset) and must decide identically at every step:
scheduled requests, block ids, computed tokens, preemptions, finishes, KV usage and
prefix-cache statistics; with KV events on, the same events.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="needs vLLM 0.33")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "runtime"))
import scheduler_trace as trace  # noqa: E402


def workload(seed: int, num_requests: int = 70):
    return trace.make_workload(seed=seed, num_requests=num_requests, block_size=16, num_blocks=64, max_running=32,
                               chunk=64, system_len=(20, 90), user_len=(3, 70), max_tokens=(1, 40),
                               arrivals_per_step=2)


def replay(cls, wl, *, num_blocks: int, resets=(), **config):
    vc = trace.engine_config(max_num_seqs=32, max_num_batched_tokens=256, **config)
    s = trace.make_scheduler(cls, vc, num_blocks)
    events = []
    if vc.kv_events_config is not None and vc.kv_events_config.enable_kv_cache_events:
        take = s.kv_cache_manager.take_events

        def recording_take():
            got = take()
            events.extend(got)
            return got

        s.kv_cache_manager.take_events = recording_take
    logs = trace.run(s, wl, trace.block_hasher(vc), resets=resets)
    return s, [step.decisions for step in logs], events


def assert_same_decisions(ours, theirs):
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert a == b, f"step {i} differs"


@pytest.mark.parametrize("seed, num_blocks, caching, algo", [
    (1, 64, True, "sha256"),      # preempts
    (2, 200, True, "sha256_cbor"),
    (3, 40, True, "sha256"),      # preempts often
    (4, 64, False, "sha256"),
])
def test_every_scheduler_decision_equals_vllms_own_manager(seed, num_blocks, caching, algo):
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_metal.kv_cache_manager import CoreKVCacheManager
    from vllm_metal.scheduler import MetalScheduler

    wl = workload(seed)
    ours, our_log, _ = replay(MetalScheduler, wl, num_blocks=num_blocks, resets=(30, 90), enable_caching=caching,
                              hash_algo=algo)
    assert isinstance(ours.kv_cache_manager, CoreKVCacheManager)
    _, their_log, _ = replay(Scheduler, wl, num_blocks=num_blocks, resets=(30, 90), enable_caching=caching,
                             hash_algo=algo)
    assert_same_decisions(our_log, their_log)
    # the trace exercised what it is for
    stats = [step[-1] for step in our_log]
    hits = sum(s[5] for s in stats)
    assert (hits > 0) == caching
    if num_blocks <= 64:
        assert sum(len(step[3]) for step in our_log) > 0, "no preemption"
    # and every block came from the C++ pool, all returned at the end
    pool = ours.kv_cache_manager.pool
    assert pool.stats.allocated > 0
    assert pool.num_free_blocks == pool.num_usable_blocks


def test_kv_events_equal_vllms(monkeypatch):
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_metal.scheduler import MetalScheduler

    wl = workload(5, num_requests=40)
    _, our_log, ours = replay(MetalScheduler, wl, num_blocks=48, resets=(25,), enable_kv_events=True)
    _, their_log, theirs = replay(Scheduler, wl, num_blocks=48, resets=(25,), enable_kv_events=True)
    assert_same_decisions(our_log, their_log)
    kinds = {type(e).__name__ for e in theirs}
    assert {"BlockStored", "BlockRemoved"} <= kinds
    assert [repr(e) for e in ours] == [repr(e) for e in theirs]


def test_a_hash_algorithm_we_do_not_implement_is_refused_naming_it():
    from types import SimpleNamespace

    from vllm_metal.platform import UnsupportedConfiguration, _refuse_unsupported_kv_cache

    config = SimpleNamespace(cache_config=SimpleNamespace(prefix_caching_hash_algo="md5"),
                             kv_transfer_config=None, observability_config=SimpleNamespace(kv_cache_metrics=False))
    with pytest.raises(UnsupportedConfiguration, match=r"--prefix-caching-hash-algo md5 is not supported"):
        _refuse_unsupported_kv_cache(config)
    config.cache_config.prefix_caching_hash_algo = "sha256"
    _refuse_unsupported_kv_cache(config)  # one we do


def test_the_platform_names_our_schedulers():
    from vllm_metal.scheduler import MetalAsyncScheduler, MetalScheduler

    assert trace.engine_config(max_num_seqs=4, max_num_batched_tokens=256,
                               async_scheduling=True).scheduler_config.get_scheduler_cls() is MetalAsyncScheduler
    assert trace.engine_config(max_num_seqs=4, max_num_batched_tokens=256,
                               async_scheduling=False).scheduler_config.get_scheduler_cls() is MetalScheduler
