"""A real `vllm serve` process on loopback for the serving tests."""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx

# The import hook of runner_hook: sitecustomize code that, once vllm_metal.model_runner has
# been imported in the served process, replaces MetalModelRunner.execute_model by
# wrap(execute_model).
_RUNNER_HOOK = """
import builtins as _builtins, sys as _sys

_import = _builtins.__import__


def _hook(name, *args, **kwargs):
    module = _import(name, *args, **kwargs)
    mod = _sys.modules.get("vllm_metal.model_runner")
    if _builtins.__import__ is _hook and mod is not None and hasattr(mod, "MetalModelRunner"):
        _builtins.__import__ = _import
        mod.MetalModelRunner.execute_model = wrap(mod.MetalModelRunner.execute_model)
    return module


_builtins.__import__ = _hook
"""


def runner_hook(wrap_source: str) -> str:
    """sitecustomize.py source for a `vllm serve` process (put its folder on PYTHONPATH):
    wrap_source defines wrap(execute_model) -> a replacement of MetalModelRunner.execute_model,
    to observe each step from a test."""
    return textwrap.dedent(wrap_source) + _RUNNER_HOOK


# The engine core's start method. vLLM's CLI spawns it, and a spawned process imports
# vLLM, torch and transformers again: about half of a start-up (docs/startup.md). On
# Linux, where nothing in the API server touches a GPU, the servers of the tests fork it
# instead; macOS keeps spawn (fork is unsafe there once system frameworks are loaded).
# VLLM_WORKER_MULTIPROC_METHOD in the environment or in a test's env wins (test_serving.py
# keeps vLLM's spawn, the start-up users get).
START_METHOD = {} if sys.platform == "darwin" else {"VLLM_WORKER_MULTIPROC_METHOD": "fork"}

# seconds between /health polls while a server starts
HEALTH_POLL = 0.1


# Ports for the servers of the tests. A port the kernel hands out (bind to 0) comes from
# the ephemeral range, where it is free only until someone else's connection takes it; and
# with several pytest workers (scripts/test), two of them could be handed the same port
# before either server binds it. So each worker takes its own window below the ephemeral
# range (32768 up on Linux, 49152 up on macOS), from a random start, skipping ports in use;
# a server that still loses its port is restarted on another (Server).
_PORT_BASE, _PORTS_PER_WORKER = 20000, 1500
_port_offsets = itertools.count(random.randrange(_PORTS_PER_WORKER))


def _worker_index() -> int:
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")  # gw0, gw1, ... under xdist
    return int(name[2:]) % 8 if name[2:].isdigit() else 0


def free_port() -> int:
    window = _PORT_BASE + _worker_index() * _PORTS_PER_WORKER
    for _ in range(_PORTS_PER_WORKER):
        port = window + next(_port_offsets) % _PORTS_PER_WORKER
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {window}..{window + _PORTS_PER_WORKER - 1}")


class Server:
    def __init__(self, model: str, name: str | None, extra_args: list[str], env: dict | None = None,
                 startup_timeout: float = 600.0):
        """name: the --served-model-name; None passes none (the model argument names it)."""
        self.name, self._served_name = (model if name is None else name), name
        for attempt in range(3):
            self._start(model, extra_args, env)
            try:
                self._wait(startup_timeout)
                return
            except RuntimeError:
                if attempt == 2 or "Address already in use" not in self.tail():
                    raise
                self.client.close()  # the port was taken before the server bound it
                self.log.close()

    def _start(self, model: str, extra_args: list[str], env: dict | None) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"vllm-metal-serve-{self.port}.log"
        vllm = Path(sys.executable).with_name("vllm")
        naming = [] if self._served_name is None else ["--served-model-name", self._served_name]
        cmd = [str(vllm), "serve", model, *naming, "--host", "127.0.0.1", "--port", str(self.port),
               *extra_args]
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**START_METHOD, **os.environ, **(env or {})}, start_new_session=True)
        # idle connections are dropped after 1 s, well before uvicorn closes them (5 s): a
        # request sent on a connection the server is closing fails with "Server
        # disconnected without sending a response" (seen under load in a fresh-clone run)
        self.client = httpx.Client(base_url=self.base, timeout=300.0,
                                   limits=httpx.Limits(keepalive_expiry=1.0))

    def _wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                if self.client.get("/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(HEALTH_POLL)
        raise TimeoutError(f"vllm serve not healthy after {timeout} s:\n{self.tail()}")

    def tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-n:])
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None and self.client.get("/health").status_code == 200

    def complete(self, prompt, max_tokens=16, **kw) -> dict:
        r = self.client.post("/v1/completions", json={
            "model": self.name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **kw})
        return {"status": r.status_code, **r.json()}

    def chat(self, content: str, max_tokens=32, **kw) -> dict:
        r = self.client.post("/v1/chat/completions", json={
            "model": self.name, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0, **kw})
        return {"status": r.status_code, **r.json()}

    def stream(self, prompt, max_tokens=16):
        """Yields the text pieces of a streamed completion."""
        with self.client.stream("POST", "/v1/completions", json={
                "model": self.name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    yield json.loads(line[6:])["choices"][0]["text"]

    def stop(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
