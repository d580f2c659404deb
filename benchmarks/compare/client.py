"""Streaming OpenAI /v1/completions client: per request, time to first token and
the arrival time of every streamed chunk; token counts from the server's usage."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import httpx

from workload import Request


@dataclass
class Result:
    ok: bool
    start: float
    ttft: float = float("nan")      # seconds to the first streamed token
    end: float = float("nan")
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""

    @property
    def tpot(self) -> float:
        """Seconds per output token after the first."""
        if self.output_tokens < 2:
            return float("nan")
        return (self.end - self.start - self.ttft) / (self.output_tokens - 1)


async def one(client: httpx.AsyncClient, base: str, model: str, req: Request, extra: dict) -> Result:
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, **extra}
    res = Result(ok=False, start=time.perf_counter())
    chunks = 0
    try:
        async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                msg = json.loads(line[6:])
                if msg.get("choices") and msg["choices"][0].get("text"):
                    if chunks == 0:
                        res.ttft = time.perf_counter() - res.start
                    chunks += 1
                if msg.get("usage"):
                    res.prompt_tokens = msg["usage"].get("prompt_tokens", 0)
                    res.output_tokens = msg["usage"].get("completion_tokens", 0)
        res.end = time.perf_counter()
        res.output_tokens = res.output_tokens or chunks
        res.prompt_tokens = res.prompt_tokens or req.prompt_tokens
        res.ok = chunks > 0
    except httpx.HTTPError as e:
        res.error = repr(e)
    return res


async def run_cell(base: str, model: str, requests: list[Request], concurrency: int,
                   extra: dict, max_seconds: float) -> tuple[list[Result], float]:
    """Sends `requests` with at most `concurrency` in flight; no new request starts
    after max_seconds. Returns the results and the wall time."""
    sem = asyncio.Semaphore(concurrency)
    t0 = time.perf_counter()

    # A fresh connection per request: llama-server (cpp-httplib) closes kept-alive
    # connections on its own schedule, and a request sent on one as it closes failed
    # ("Server disconnected without sending a response", 2 of 12 at c=1 on 2026-12-04).
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0),
                                 limits=httpx.Limits(max_connections=concurrency + 4,
                                                     max_keepalive_connections=0)) as client:
        async def guarded(req):
            async with sem:
                if time.perf_counter() - t0 > max_seconds:
                    return None
                return await one(client, base, model, req, extra)

        results = await asyncio.gather(*(guarded(r) for r in requests))
    return [r for r in results if r is not None], time.perf_counter() - t0
