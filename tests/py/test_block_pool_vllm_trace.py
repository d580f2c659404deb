"""Our BlockPool and vLLM 0.33's own prefix caching, replaying the same trace.

vLLM side: vllm.v1.core.kv_cache_manager.KVCacheManager (one full-attention
group) over vllm.v1.core.block_pool.BlockPool, with Request objects hashing
their blocks through vLLM's request block hasher (sha256). Our side: BlockPool +
BlockHashChain. One scheduler loop (benchmarks/runtime/bench_block_pool.py,
`run_trace`: chunked prefill, decode, recompute preemption, FIFO admission,
prefix-cache resets) drives both, and after every decision the two must agree
on: admission, the number of cached tokens found, every request's block ids,
the free queue (eviction order) and which blocks hold a cached prefix.
Hit tokens and eviction behaviour are thereby identical, not just similar.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.core.kv_cache_manager", reason="needs vLLM 0.33 and its CPU requirements")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_block_pool", ROOT / "benchmarks/runtime/bench_block_pool.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_block_pool"] = mod  # dataclasses resolve their module by name
    spec.loader.exec_module(mod)
    return mod


bench = _load_bench()


class Lockstep:
    """Records every decision of one backend, with the pool state after it."""

    def __init__(self, backend):
        self.backend = backend
        self.log: list[tuple] = []

    def __call__(self, kind, request, info):
        b = self.backend
        if kind in ("admit", "extend"):
            self.log.append((kind, request.rid, info, tuple(b.block_ids(request))))
        elif kind == "step":
            self.log.append(("state", info, tuple(b.free_queue()), frozenset(b.cached_blocks())))
        else:
            self.log.append((kind, request.rid if request is not None else None, info))


def replay_both(workload, max_steps=2000):
    """Runs the workload on both backends; returns (ours, vllm) logs and stats."""
    out = []
    for cls in (bench.MetalBackend, bench.VllmBackend):
        backend = cls(workload.num_blocks, workload.block_size)
        rec = Lockstep(backend)
        stats = bench.run_trace(backend, workload, on_event=rec, max_steps=max_steps)
        stats["pool"] = backend.pool
        out.append((rec.log, stats))
    return out


def assert_same(ours, theirs):
    (log_o, stats_o), (log_v, stats_v) = ours, theirs
    for i, (a, b) in enumerate(zip(log_o, log_v)):
        assert a == b, f"decision {i} differs:\n ours: {a}\n vllm: {b}\n after: {log_o[max(0, i - 3):i]}"
    assert len(log_o) == len(log_v)
    for s in (stats_o, stats_v):
        s.pop("step_seconds")
        s.pop("step_running")
    pool = stats_o.pop("pool")
    stats_v.pop("pool")
    assert stats_o == stats_v
    stats_o["evicted"] = pool.stats.evicted


def small_workload(seed, *, block_size=4, num_blocks=24, max_running=5, chunk=8, num_requests=60,
                   arrivals_per_step=1.0, pause=40):
    """Chat-like requests over a 50-token vocabulary (many shared blocks); the
    second half arrives `pause` steps late, so the pool drains and a prefix-cache
    reset (tried every 5 steps) succeeds in between."""
    w = bench.make_workload(
        seed=seed, num_requests=num_requests, block_size=block_size, num_blocks=num_blocks,
        max_running=max_running, chunk=chunk, system_len=(block_size, 4 * block_size + 3),
        user_len=(1, 3 * block_size), max_tokens=(1, 3 * block_size), arrivals_per_step=arrivals_per_step,
        num_systems=3, vocab=50, reset_steps=tuple(range(0, 1000, 5)),
    )
    for r in w.requests[num_requests // 2:]:
        r.arrival_step += pause
    return w


def test_trace_under_block_pressure_matches_vllm():
    # Tight pool: prefix hits, evictions, preemptions and a reset all happen.
    w = small_workload(1)
    ours, theirs = replay_both(w)
    assert_same(ours, theirs)
    stats = ours[1]
    assert stats["unfinished"] == 0, stats
    assert stats["hit_tokens"] > 500, stats
    assert stats["preempted"] > 10, stats
    assert stats["evicted"] > 10, stats
    assert stats["resets"] >= 2, stats  # at the start and in the pause


def test_trace_with_roomy_pool_and_block_size_16_matches_vllm():
    w = small_workload(2, block_size=16, num_blocks=300, max_running=8, chunk=64, num_requests=80)
    ours, theirs = replay_both(w)
    assert_same(ours, theirs)
    assert ours[1]["hit_tokens"] > 0
    assert ours[1]["preempted"] == 0


def test_benchmark_traces_match_vllm():
    # The exact traces bench_block_pool.py times (quick size, 8 running).
    w = bench.steady_workload(8, seed=8, quick=True)
    ours, theirs = replay_both(w)
    assert_same(ours, theirs)
    assert ours[1]["hit_tokens"] > 0


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    block_size=st.sampled_from([1, 2, 4, 8, 16]),
    num_blocks=st.integers(8, 120),
    max_running=st.integers(1, 8),
    chunk=st.integers(1, 40),
)
def test_random_traces_match_vllm(seed, block_size, num_blocks, max_running, chunk):
    w = small_workload(seed, block_size=block_size, num_blocks=num_blocks, max_running=max_running,
                       chunk=chunk, num_requests=25)
    # Let the longest request fit alone (an unfittable one stalls both sides alike;
    # max_steps would still end the replay, but a full run compares more).
    longest = max(len(r.prompt) + r.max_tokens for r in w.requests)
    w.num_blocks = max(w.num_blocks, bench.cdiv(longest, block_size) + 2)
    ours, theirs = replay_both(w, max_steps=600)
    assert_same(ours, theirs)


def test_events_match_vllm_in_count_and_kind():
    """Stored/removed events: one per block entering/leaving the cache on both sides."""
    w = small_workload(3)
    counts = []
    for cls in (bench.MetalBackend, bench.VllmBackend):
        backend = cls(w.num_blocks, w.block_size, enable_events=True)
        stored = removed = cleared = 0

        def on_event(kind, request, info, backend=backend):
            nonlocal stored, removed, cleared
            if kind != "step":
                return
            events = backend.pool.take_events()
            for e in events:
                k = getattr(e, "kind", type(e).__name__)
                if k in ("stored", "BlockStored"):
                    stored += 1 if k == "stored" else len(e.block_hashes)
                elif k in ("removed", "BlockRemoved"):
                    removed += 1 if k == "removed" else len(e.block_hashes)
                else:
                    cleared += 1

        bench.run_trace(backend, w, on_event=on_event)
        counts.append((stored, removed, cleared))
    assert counts[0] == counts[1]
    assert counts[0][1] > 0  # evictions happened
