"""The main job, end to end: serve the offline default model with
`vllm serve`, ask the chat endpoint one question, print the answer, stop.

    python -m vllm_metal.demo [--question "..."] [--port 8765]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


def wait_until_healthy(base: str, server: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"vllm serve exited with code {server.returncode}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.1)  # a refused connection costs nothing; 1 s polls waited 0.5 s on average
    raise TimeoutError(f"vllm serve did not become healthy within {timeout:.0f} s")


def ask(base: str, model: str, question: str, max_tokens: int) -> str:
    body = json.dumps({
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "temperature": 0,
        "max_tokens": max_tokens,
    }).encode()
    req = urllib.request.Request(f"{base}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())["choices"][0]["message"]["content"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--question", default="What is the capital of France?")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the server")
    args = ap.parse_args()

    from vllm_metal.models.offline import OFFLINE_GGUF

    gguf = str(OFFLINE_GGUF["smollm2"]())
    model = "smollm2"
    vllm = Path(sys.executable).with_name("vllm")
    cmd = [str(vllm), "serve", gguf, "--served-model-name", model,
           "--host", "127.0.0.1", "--port", str(args.port),
           "--max-model-len", "2048", "--max-num-seqs", "16", "--kv-cache-memory-bytes", str(256 << 20),
           # let the engine stop by itself: with 0 (abort) vLLM kills it at once, and the
           # API server may log the dead engine as an error
           "--shutdown-timeout", "10"]
    print("$", " ".join(cmd), flush=True)
    server = subprocess.Popen(cmd, start_new_session=True)
    base = f"http://127.0.0.1:{args.port}"
    try:
        wait_until_healthy(base, server, args.timeout)
        answer = ask(base, model, args.question, args.max_tokens)
        print(f"\nQ: {args.question}\nA: {answer}\n", flush=True)
        return 0
    finally:
        if server.poll() is None:
            # The API server alone: it stops its engine process itself (a signal to
            # the whole group would kill the engine first and log a dead engine).
            server.send_signal(signal.SIGINT)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
