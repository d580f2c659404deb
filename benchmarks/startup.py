#!/usr/bin/env python
"""Where the start-up of `vllm serve` goes: process start to the first answered
/v1/completions, split at log lines both processes print, wall and CPU seconds.

    benchmarks/startup.py                       # 3 runs of the default offline model
    benchmarks/startup.py --runs 5 --poll 1.0   # the test harness's old 1 s health polling
    # A/B, alternated: the engine core spawned (vLLM's CLI default) or forked
    benchmarks/startup.py --variant spawn:VLLM_WORKER_MULTIPROC_METHOD=spawn
                          --variant fork:VLLM_WORKER_MULTIPROC_METHOD=fork

A variant is `label[:KEY=VALUE[,KEY=VALUE...]]`: environment variables of its servers
(PYTHONPATH is prepended; POLL sets its /health polling interval). The runs alternate
between the variants (A B A B ...) so both see the same load on a shared machine. Each line of
the server's output is stamped when it arrives (PYTHONUNBUFFERED), so the phases have
millisecond resolution although vLLM's own timestamps have seconds. CPU seconds are
those of the server's process tree (psutil) when the first completion is answered:
on a machine shared with other work they move much less than wall seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

# (phase name, the log line that ends it), in the order they happen
MILESTONES = [
    ("imports + CLI (API server)", "non-default args"),
    ("config (API server)", "Resolved architecture"),
    ("engine core start", "Initializing a V1 LLM engine"),
    ("model load (engine core)", "vllm-metal loaded"),
    ("KV cache + warm-up", "init engine (profile"),
    ("API routes + app startup", "Application startup complete"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_cpu_seconds(pid: int) -> float:
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return float("nan")
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def one_start(model: str, extra: list[str], variant_env: dict, poll: float, debug: bool) -> dict:
    port = free_port()
    vllm = Path(sys.executable).with_name("vllm")
    cmd = [str(vllm), "serve", model, "--served-model-name", "m", "--host", "127.0.0.1",
           "--port", str(port), *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    variant_env = dict(variant_env)
    poll = float(variant_env.pop("POLL", poll))
    if "PYTHONPATH" in variant_env:
        variant_env["PYTHONPATH"] += os.pathsep + env.get("PYTHONPATH", "")
    env.update(variant_env)
    if debug:
        env["VLLM_LOGGING_LEVEL"] = "DEBUG"
    lines: list[tuple[float, str]] = []
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
                            start_new_session=True, bufsize=1)

    def read():
        for line in proc.stdout:
            lines.append((time.monotonic() - t0, line.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
    healthy = None
    try:
        while time.monotonic() - t0 < 600:
            if proc.poll() is not None:
                raise RuntimeError("vllm serve exited:\n" + "\n".join(l for _, l in lines[-40:]))
            try:
                if client.get("/health", timeout=2).status_code == 200:
                    healthy = time.monotonic() - t0
                    break
            except httpx.HTTPError:
                pass
            time.sleep(poll)
        r = client.post("/v1/completions", json={"model": "m", "prompt": "The capital of France is",
                                                 "max_tokens": 1, "temperature": 0})
        assert r.status_code == 200, r.text
        first = time.monotonic() - t0
        cpu = tree_cpu_seconds(proc.pid)
    finally:
        client.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        reader.join(timeout=5)
    marks = {}
    for name, needle in MILESTONES:
        marks[name] = next((t for t, l in lines if needle in l), None)
    return {"marks": marks, "healthy": healthy, "first_completion": first, "cpu": cpu,
            "lines": lines}


def phases(run: dict) -> list[tuple[str, float]]:
    out, prev = [], 0.0
    for name, _ in MILESTONES:
        t = run["marks"][name]
        if t is None:
            continue
        out.append((name, t - prev))
        prev = t
    out.append(("to /health 200 (polling)", run["healthy"] - prev))
    out.append(("first /v1/completions (1 token)", run["first_completion"] - run["healthy"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="default: the offline SmolLM2 GGUF the tests serve")
    ap.add_argument("--runs", type=int, default=3, help="runs per variant")
    ap.add_argument("--poll", type=float, default=0.05, help="seconds between /health polls")
    ap.add_argument("--variant", action="append", default=[],
                    help="label[:KEY=VALUE,...] (repeatable; see above)")
    ap.add_argument("--debug", action="store_true", help="VLLM_LOGGING_LEVEL=DEBUG")
    ap.add_argument("--log", help="write the stamped output of the last run here")
    ap.add_argument("--json", help="write all runs here")
    ap.add_argument("extra", nargs="*", help="extra `vllm serve` arguments (after --)")
    a = ap.parse_args()
    if a.model is None:
        from vllm_metal.models.offline import smollm2_gguf

        a.model = str(smollm2_gguf())
    extra = a.extra or ["--max-model-len", "512", "--max-num-seqs", "8", "--num-gpu-blocks-override", "64"]
    variants = []
    for v in a.variant or ["this checkout"]:
        label, _, pairs = v.partition(":")
        variants.append((label, dict(p.split("=", 1) for p in pairs.split(",") if p)))
    results: dict[str, list[dict]] = {label: [] for label, _ in variants}
    for i in range(a.runs):
        for label, variant_env in variants:
            run = one_start(a.model, extra, variant_env, a.poll, a.debug)
            results[label].append(run)
            print(f"run {i + 1} {label}: first completion {run['first_completion']:.2f} s, "
                  f"CPU {run['cpu']:.2f} s", flush=True)
            if a.log:
                Path(a.log).write_text("".join(f"{t:8.3f} {l}\n" for t, l in run["lines"]))
    print(f"\nmodel {Path(a.model).name}; args {' '.join(extra)}; /health polled every {a.poll} s "
          f"unless a variant says; variants: {'; '.join(a.variant) or 'this checkout'}; "
          f"median of {a.runs} runs per variant, alternated; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores\n")
    labels = [label for label, _ in variants]
    print("| phase (ends at the log line) | " + " | ".join(f"{l} (s)" for l in labels) + " |")
    print("|---|" + "---:|" * len(labels))
    names = [n for n, _ in phases(results[labels[0]][0])]
    for n in names:
        cells = []
        for l in labels:
            vals = [dict(phases(r)).get(n) for r in results[l]]
            vals = [v for v in vals if v is not None]
            cells.append(f"{statistics.median(vals):.2f}" if vals else "-")
        print(f"| {n} | " + " | ".join(cells) + " |")
    for key, title in (("first_completion", "**total: start to first completion (wall)**"),
                       ("cpu", "CPU seconds of the server's processes")):
        cells = [f"{statistics.median(r[key] for r in results[l]):.2f}" for l in labels]
        print(f"| {title} | " + " | ".join(cells) + " |")
    if a.json:
        Path(a.json).write_text(json.dumps({l: [{k: v for k, v in r.items() if k != "lines"}
                                                for r in rs] for l, rs in results.items()}, indent=1))


if __name__ == "__main__":
    main()
