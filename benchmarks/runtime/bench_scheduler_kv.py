"""Time per scheduler step in KV-block management: vLLM's own KV-cache manager
against the C++ one (what `vllm serve` runs), in vLLM's real scheduler, side by side
in one run.

Each cell: N requests arrive together (shared system prompts, multi-turn repeats;
scheduler_trace.make_workload), max_num_seqs = N and a pool that holds them all, so
the steady state has N running requests. Reported per step, over the steps where at
least 90 % of N run: time inside the KV-cache manager's methods (allocate, lookup,
cache, free, stats) and the whole step (schedule + update_from_output).

    .venv/bin/python benchmarks/runtime/bench_scheduler_kv.py [--running 64 256 1024]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scheduler_trace as trace  # noqa: E402


def cell(cls, n: int, *, seed: int, max_tokens: int):
    wl = trace.make_workload(seed=seed, num_requests=n, block_size=16, num_blocks=0, max_running=n, chunk=0,
                             system_len=(64, 256), user_len=(16, 128), max_tokens=(max_tokens, max_tokens),
                             arrivals_per_step=1e9)
    num_blocks = sum(-(-(len(r.prompt) + r.max_tokens) // 16) for r in wl.requests) + 16
    vc = trace.engine_config(max_num_seqs=n, max_num_batched_tokens=max(8192, 2 * n), max_model_len=2048)
    s = trace.make_scheduler(cls, vc, num_blocks)
    logs = trace.run(s, wl, trace.block_hasher(vc), timed=True)
    steady = [lg for lg in logs if lg.decisions[-1][0] >= 0.9 * n]
    return (statistics.mean(lg.block_seconds for lg in steady) * 1e3,
            statistics.mean(lg.step_seconds for lg in steady) * 1e3, len(steady))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--running", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_metal.scheduler import MetalScheduler

    print(f"# {platform.processor() or platform.machine()}, python {platform.python_version()}")
    print("| running | vLLM manager ms/step | C++ manager ms/step | ratio | vLLM step ms | ours step ms | steps |")
    print("|---|---|---|---|---|---|---|")
    for n in args.running:
        theirs = cell(Scheduler, n, seed=args.seed, max_tokens=args.max_tokens)
        ours = cell(MetalScheduler, n, seed=args.seed, max_tokens=args.max_tokens)
        print(f"| {n} | {theirs[0]:.3f} | {ours[0]:.3f} | {theirs[0] / ours[0]:.1f}x | {theirs[1]:.2f} | "
              f"{ours[1]:.2f} | {ours[2]} |", flush=True)


if __name__ == "__main__":
    main()
