"""Our BlockPool against vLLM 0.33's KVCacheManager/BlockPool on the same trace, side by side.

One workload (chat-like requests: shared system prompts, repeated prompts,
multi-turn follow-ups that extend an earlier request's prompt and output) is
run by one small scheduler loop (`run_trace`: chunked prefill, decode, recompute
preemption when a step's blocks do not fit, FIFO admission) over two allocator
backends:

    vllm:  vllm.v1.core.kv_cache_manager.KVCacheManager (one full-attention group),
           Request objects with vLLM's block hasher (sha256, vLLM's default):
           get_computed_blocks / allocate_slots / free / append_output_token_ids
    ours:  vllm_metal._core.BlockPool + BlockHashChain, driven from Python the
           same way (find_cached_prefix / count_free / touch / allocate /
           cache_full_blocks / free / append)

Both backends make the same decisions, step for step (tests/py/
test_block_pool_vllm_trace.py replays traces through both and compares every
hit, block id, free queue and cached set). Reported per scheduler step at
1, 8, 64, 256 running requests: the whole step, and the allocator's part (the
step minus a backend that allocates nothing), with ratio = vllm / ours (> 1:
ours is faster). Micro-benchmarks: allocate + free of 16 blocks; hashing a
2,048-token prompt; finding its cached prefix.

    .venv/bin/python benchmarks/runtime/bench_block_pool.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass, field

# ---------------------------------------------------------------------------------
# the workload and the scheduler loop (shared by the benchmark and the trace test)


@dataclass
class TraceRequest:
    rid: str
    prompt: list[int]
    max_tokens: int
    arrival_step: int
    # filled by run_trace
    output: list[int] = field(default_factory=list)
    num_computed: int = 0
    handle: object = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)


def output_token(rid_index: int, i: int, vocab: int) -> int:
    """The i-th sampled token of request rid_index: fixed in advance, so a
    follow-up request can quote an earlier request's output."""
    return (rid_index * 7919 + i * 104729 + 17) % vocab


@dataclass
class Workload:
    requests: list[TraceRequest]
    block_size: int
    num_blocks: int
    max_running: int
    chunk: int  # prefill tokens per request per step
    reset_steps: tuple[int, ...] = ()

    def fresh(self) -> list[TraceRequest]:
        return [TraceRequest(r.rid, list(r.prompt), r.max_tokens, r.arrival_step) for r in self.requests]


def make_workload(
    *,
    seed: int,
    num_requests: int,
    block_size: int,
    num_blocks: int,
    max_running: int,
    chunk: int,
    system_len: tuple[int, int],
    user_len: tuple[int, int],
    max_tokens: tuple[int, int],
    arrivals_per_step: float,
    num_systems: int = 4,
    vocab: int = 32000,
    reset_steps: tuple[int, ...] = (),
) -> Workload:
    rng = random.Random(seed)

    def rand_tokens(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    systems = [rand_tokens(rng.randint(*system_len)) for _ in range(num_systems)]
    requests: list[TraceRequest] = []
    for i in range(num_requests):
        kind = rng.random()
        if kind < 0.15 and requests:
            # multi-turn: an earlier conversation, its answer, a new user turn
            j = rng.randrange(len(requests))
            parent = requests[j]
            answer = [output_token(j, k, vocab) for k in range(parent.max_tokens)]
            prompt = parent.prompt + answer + rand_tokens(rng.randint(*user_len))
        elif kind < 0.25 and requests:
            prompt = list(requests[rng.randrange(len(requests))].prompt)  # a repeat
        elif kind < 0.3:
            prompt = rand_tokens(rng.randint(*user_len))  # no system prompt
        else:
            prompt = systems[rng.randrange(num_systems)] + rand_tokens(rng.randint(*user_len))
        requests.append(
            TraceRequest(f"req-{i}", prompt, rng.randint(*max_tokens), int(i / arrivals_per_step))
        )
    return Workload(requests, block_size, num_blocks, max_running, chunk, tuple(reset_steps))


def run_trace(backend, workload: Workload, *, on_event=None, time_steps: bool = False,
              max_steps: int | None = None) -> dict:
    """Runs the workload to completion (or max_steps) on `backend`.
    on_event(kind, request, info) sees every decision; returns counters (and
    per-step seconds if time_steps)."""
    vocab_index = {r.rid: i for i, r in enumerate(workload.requests)}
    requests = workload.fresh()
    by_step: dict[int, list[TraceRequest]] = {}
    for r in requests:
        by_step.setdefault(r.arrival_step, []).append(r)
    waiting: deque[TraceRequest] = deque()
    running: list[TraceRequest] = []
    stats = {"steps": 0, "admitted": 0, "hit_tokens": 0, "preempted": 0, "finished": 0, "resets": 0}
    step_seconds: list[float] = []
    step_running: list[int] = []
    resets = set(workload.reset_steps)
    emit = on_event or (lambda kind, r, info: None)
    step = 0
    remaining = len(requests)
    clock = time.perf_counter
    while remaining > 0 and (max_steps is None or step < max_steps):
        t0 = clock()
        for r in by_step.get(step, ()):
            backend.new_request(r)
            waiting.append(r)
        if step in resets:
            ok = backend.reset()
            stats["resets"] += ok
            emit("reset", None, ok)
        # 1) running requests: their next prefill chunk or one decode token
        for r in list(running):
            n = min(workload.chunk, r.num_tokens - r.num_computed)
            if backend.extend(r, n):
                r.num_computed += n
                emit("extend", r, n)
            else:
                backend.free(r)  # recompute preemption: back to the head of the queue
                r.num_computed = 0
                running.remove(r)
                waiting.appendleft(r)
                stats["preempted"] += 1
                emit("preempt", r, None)
        # 2) admission, FIFO, while blocks and running slots last
        while waiting and len(running) < workload.max_running:
            r = waiting[0]
            admitted = backend.admit(r, workload.chunk)
            if admitted is None:
                emit("wait", r, None)
                break
            hit, n = admitted
            r.num_computed = hit + n
            waiting.popleft()
            running.append(r)
            stats["admitted"] += 1
            stats["hit_tokens"] += hit
            emit("admit", r, hit)
        # 3) sampling: requests whose tokens are all computed get one more
        still = []
        for r in running:
            if r.num_computed == r.num_tokens:
                tok = output_token(vocab_index[r.rid], len(r.output), 32000)
                r.output.append(tok)
                backend.append_token(r, tok)
                if len(r.output) >= r.max_tokens:
                    backend.free(r)
                    stats["finished"] += 1
                    remaining -= 1
                    emit("finish", r, None)
                    continue
            still.append(r)
        if time_steps:
            step_seconds.append(clock() - t0)
            step_running.append(len(running))
        running = still
        emit("step", None, step)
        step += 1
    stats["steps"] = step
    stats["unfinished"] = remaining
    stats["step_seconds"] = step_seconds
    stats["step_running"] = step_running  # requests running during each step
    return stats


# ---------------------------------------------------------------------------------
# backends


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class MetalBackend:
    """vllm_metal._core.BlockPool driven the way vLLM's KVCacheManager drives its pool."""

    name = "ours"

    def __init__(self, num_blocks: int, block_size: int, *, seed: int = 0, enable_events: bool = False):
        from vllm_metal import _core

        self._core = _core
        self.pool = _core.BlockPool(num_blocks, block_size, enable_events=enable_events)
        self.block_size = block_size
        self.seed = seed

    def new_request(self, r: TraceRequest) -> None:
        chain = self._core.BlockHashChain(self.block_size, seed=self.seed)
        chain.append(r.prompt)
        # hash chain, block ids, number of cached blocks, number of hashed tokens
        r.handle = [chain, [], 0, len(r.prompt)]

    def _cache(self, h, num_tokens: int) -> None:
        # Cache the blocks that are full, computed and hashed (vLLM's cache_blocks).
        num_full = min(num_tokens, h[3]) // self.block_size
        if num_full > h[2]:
            self.pool.cache_full_blocks(h[1], h[0], h[2], num_full)
            h[2] = num_full

    def admit(self, r: TraceRequest, chunk: int):
        pool, h = self.pool, r.handle
        hit_blocks = pool.find_cached_prefix(h[0])
        hit = len(hit_blocks) * self.block_size
        n = min(chunk, r.num_tokens - hit)
        need = cdiv(hit + n, self.block_size) - len(hit_blocks)
        if need + pool.count_free(hit_blocks) > pool.num_free_blocks:
            return None
        pool.touch(hit_blocks)
        h[1] = hit_blocks + pool.allocate(need)
        h[2] = len(hit_blocks)
        self._cache(h, hit + n)
        return hit, n

    def extend(self, r: TraceRequest, n: int) -> bool:
        h = r.handle
        total = r.num_computed + n
        need = cdiv(total, self.block_size) - len(h[1])
        if need > 0:
            if need > self.pool.num_free_blocks:
                return False
            h[1] += self.pool.allocate(need)
        if min(total, h[3]) // self.block_size > h[2]:
            self._cache(h, total)
        return True

    def append_token(self, r: TraceRequest, token: int) -> None:
        h = r.handle
        h[0].append(token)
        h[3] += 1

    def free(self, r: TraceRequest) -> None:
        h = r.handle
        self.pool.free(h[1][::-1])  # tail first, as vLLM frees
        h[1] = []
        h[2] = 0

    def reset(self) -> bool:
        return self.pool.reset_prefix_cache()

    # observations for the trace test
    def block_ids(self, r: TraceRequest) -> list[int]:
        return list(r.handle[1])

    def free_queue(self) -> list[int]:
        return self.pool.free_queue()

    def cached_blocks(self) -> set[int]:
        return {b for b in range(self.pool.num_blocks) if self.pool.is_cached(b)}


class VllmBackend:
    """vLLM 0.33's KVCacheManager with one full-attention KV-cache group."""

    name = "vllm"

    def __init__(self, num_blocks: int, block_size: int, *, max_model_len: int = 1 << 20,
                 enable_events: bool = False):
        import torch
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.request import Request

        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float16)
        config = KVCacheConfig(
            num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)]
        )
        self.manager = KVCacheManager(
            config, max_model_len=max_model_len, scheduler_block_size=block_size,
            hash_block_size=block_size, enable_caching=True, enable_kv_cache_events=enable_events,
        )
        self.pool = self.manager.block_pool
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(block_size, sha256)
        self._request = Request
        self._params = SamplingParams(max_tokens=1 << 20)

    def new_request(self, r: TraceRequest) -> None:
        r.handle = self._request(r.rid, list(r.prompt), self._params, None, block_hasher=self._hasher)

    def admit(self, r: TraceRequest, chunk: int):
        req = r.handle
        req.num_computed_tokens = 0
        blocks, hit, _ = self.manager.get_computed_blocks(req)
        n = min(chunk, req.num_tokens - hit)
        if self.manager.allocate_slots(req, n, hit, blocks) is None:
            return None
        req.num_computed_tokens = hit + n
        return hit, n

    def extend(self, r: TraceRequest, n: int) -> bool:
        req = r.handle
        if self.manager.allocate_slots(req, n) is None:
            return False
        req.num_computed_tokens += n
        return True

    def append_token(self, r: TraceRequest, token: int) -> None:
        r.handle.append_output_token_ids(token)

    def free(self, r: TraceRequest) -> None:
        self.manager.free(r.handle)

    def reset(self) -> bool:
        return self.manager.reset_prefix_cache()

    def block_ids(self, r: TraceRequest) -> list[int]:
        return list(self.manager.get_block_ids(r.rid)[0])

    def free_queue(self) -> list[int]:
        return [b.block_id for b in self.pool.free_block_queue.get_all_free_blocks()]

    def cached_blocks(self) -> set[int]:
        return {b.block_id for b in self.pool.blocks if b.block_hash is not None}


class NullBackend:
    """Allocates nothing: the scheduler loop's own cost, subtracted from both."""

    name = "loop"

    def __init__(self, num_blocks: int, block_size: int):
        pass

    def new_request(self, r):
        r.handle = None

    def admit(self, r, chunk):
        return 0, min(chunk, r.num_tokens)

    def extend(self, r, n):
        return True

    def append_token(self, r, token):
        pass

    def free(self, r):
        pass

    def reset(self):
        return True


# ---------------------------------------------------------------------------------
# measuring


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load_average() -> str:
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "n/a"


def steady_workload(running: int, *, seed: int, quick: bool) -> Workload:
    """Chat traffic keeping about `running` requests in flight (block size 16)."""
    bs = 16
    max_tokens = (16, 128)
    mean_life = 72 + 4  # decode steps + about two prefill chunks
    num_requests = max((2 if quick else 4) * running, 8)  # steady state for about 1-3 lifetimes
    per_request_blocks = (384 + 160 + 72) // bs + 1
    return make_workload(
        seed=seed, num_requests=num_requests, block_size=bs,
        num_blocks=int(running * per_request_blocks * 1.1) + 64,
        max_running=running, chunk=256,
        system_len=(256, 512), user_len=(32, 288), max_tokens=max_tokens,
        arrivals_per_step=running / mean_life * 1.5,
    )


def time_trace(backend_cls, workload: Workload, reps: int) -> dict:
    """Per repetition, the median step time in steady state (steps running at
    least 3/4 of max_running requests); the best repetition is reported (the
    machine is shared: other processes only ever add time), as is the whole run."""
    per_step, totals = [], []
    floor = max(1, workload.max_running * 3 // 4)
    for _ in range(reps):
        backend = backend_cls(workload.num_blocks, workload.block_size)
        t0 = time.perf_counter()
        stats = run_trace(backend, workload, time_steps=True)
        totals.append(time.perf_counter() - t0)
        steady = [t for t, n in zip(stats["step_seconds"], stats["step_running"]) if n >= floor]
        per_step.append(statistics.median(steady or stats["step_seconds"]))
    return {"step_s": min(per_step), "run_s": min(totals), "stats": stats}


def bench_traces(quick: bool, reps: int) -> list[dict]:
    rows = []
    for running in (1, 8, 64, 256):
        w = steady_workload(running, seed=running, quick=quick)
        res = {name: time_trace(cls, w, reps) for name, cls in
               (("loop", NullBackend), ("vllm", VllmBackend), ("ours", MetalBackend))}
        loop = res["loop"]["step_s"]
        v, o = res["vllm"]["step_s"], res["ours"]["step_s"]
        va, oa = max(v - loop, 1e-9), max(o - loop, 1e-9)
        s = res["ours"]["stats"]
        rows.append({
            "bench": "trace", "running": running, "requests": len(w.requests), "num_blocks": w.num_blocks,
            "steps": s["steps"], "hit_tokens": s["hit_tokens"], "preempted": s["preempted"],
            "loop_us": loop * 1e6, "vllm_step_us": v * 1e6, "ours_step_us": o * 1e6,
            "vllm_alloc_us": va * 1e6, "ours_alloc_us": oa * 1e6,
            "ratio_step": v / o, "ratio_alloc": va / oa,
        })
    return rows


def measure(fn, reps: int, min_seconds: float = 0.05) -> float:
    """Seconds per call: the best of `reps` timed batches."""
    fn()
    n = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        if time.perf_counter() - t0 >= min_seconds / 4:
            break
        n *= 2
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t0) / n)
    return min(samples)


def bench_micro(reps: int) -> list[dict]:
    from vllm_metal import _core

    bs, nblocks = 16, 4096
    rows = []
    vb = VllmBackend(nblocks, bs)
    ours = _core.BlockPool(nblocks, bs)

    def vllm_alloc_free():
        blocks = vb.pool.get_new_blocks(16)
        vb.pool.free_blocks(reversed(blocks))

    def ours_alloc_free():
        ours.free(ours.allocate(16)[::-1])

    rows.append(("allocate+free 16 blocks", measure(vllm_alloc_free, reps), measure(ours_alloc_free, reps)))

    rng = random.Random(5)
    prompt = [rng.randrange(32000) for _ in range(2048)]
    tr = TraceRequest("p", prompt, 1, 0)

    def vllm_hash():
        vb.new_request(tr)  # the Request constructor hashes the prompt's 128 blocks

    def ours_hash():
        _core.BlockHashChain(bs, seed=0).append(prompt)

    rows.append(("hash a 2048-token prompt", measure(vllm_hash, reps), measure(ours_hash, reps)))

    # Cache the prompt's blocks in both pools, then time the lookup alone.
    vb.new_request(tr)
    vb.admit(tr, 2048)
    vb.free(tr)
    req = tr.handle
    mb = MetalBackend(nblocks, bs)
    mb.new_request(tr)
    mb.admit(tr, 2048)
    mb.free(tr)
    chain = tr.handle[0]

    def vllm_lookup():
        vb.manager.get_computed_blocks(req)

    def ours_lookup():
        mb.pool.find_cached_prefix(chain)

    rows.append(("find cached prefix, 2048 tokens (127 hits)", measure(vllm_lookup, reps), measure(ours_lookup, reps)))
    return [{"bench": "micro", "op": name, "vllm_us": v * 1e6, "ours_us": o * 1e6, "ratio": v / o}
            for name, v, o in rows]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="shorter traces, 3 repetitions")
    ap.add_argument("--json", metavar="PATH", help="also write the run as one JSON document")
    ap.add_argument("--reps", type=int, default=0, help="repetitions (default 7, quick 3)")
    args = ap.parse_args()
    reps = args.reps or (3 if args.quick else 7)

    import vllm  # noqa: F401  (import cost outside the timings)

    header = {
        "machine": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
        "vllm": __import__("vllm").__version__, "load_before": load_average(), "reps": reps,
        "quick": args.quick,
    }
    print(f"# bench_block_pool  {header['machine']}, {header['cores']} cores, Python {header['python']}, "
          f"vLLM {header['vllm']}, load {header['load_before']}")
    micro = bench_micro(reps)
    print(f"\n{'micro-benchmark':46s} {'vllm us':>10s} {'ours us':>10s} {'vllm/ours':>10s}")
    for m in micro:
        print(f"{m['op']:46s} {m['vllm_us']:10.2f} {m['ours_us']:10.2f} {m['ratio']:10.1f}")
    traces = bench_traces(args.quick, reps)
    print("\nper scheduler step in steady state (median step, best of reps), block size 16;\n"
          "alloc = step - loop (the scheduler loop with a backend that allocates nothing)")
    print(f"{'running':>7s} {'reqs':>5s} {'blocks':>6s} {'loop us':>8s} {'vllm us':>9s} {'ours us':>9s} "
          f"{'ratio':>6s} {'vllm alloc':>10s} {'ours alloc':>10s} {'ratio':>6s} {'hit tok':>8s} {'preempt':>7s}")
    for t in traces:
        print(f"{t['running']:7d} {t['requests']:5d} {t['num_blocks']:6d} {t['loop_us']:8.1f} "
              f"{t['vllm_step_us']:9.1f} {t['ours_step_us']:9.1f} {t['ratio_step']:6.1f} "
              f"{t['vllm_alloc_us']:10.1f} {t['ours_alloc_us']:10.1f} {t['ratio_alloc']:6.1f} "
              f"{t['hit_tokens']:8d} {t['preempted']:7d}")
    header["load_after"] = load_average()
    print(f"\nload after: {header['load_after']}")
    print("\n# JSON")
    for row in [header, *micro, *traces]:
        print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "micro": micro, "traces": traces}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
