"""503 for requests that arrive while the server drains after SIGTERM.

vLLM 0.33's API server keeps accepting connections during `--shutdown-timeout`: its
shutdown first stops the engine client's renderer (the thread pool that tokenizes and
renders chat templates), so a request that arrives then fails inside the renderer with
`RuntimeError: cannot schedule new futures after shutdown`, which vLLM's front end turns
into a 500. A load balancer reads a 500 as a broken server; a 503 says "not here, retry
elsewhere", which is what a draining server means.

The platform adds `DrainRefusal` to `--middleware` (platform.pre_register_and_update), so
every `vllm serve` has it. It answers POST requests with 503 once the renderer's pool is
shut down; requests already past rendering run to the end, and GETs (/health, /metrics,
/v1/models) stay vLLM's.
"""

from __future__ import annotations

import json
from http import HTTPStatus

DRAIN_MESSAGE = "the server is shutting down and accepts no new requests; retry on another instance"


def renderer_stopped(engine_client) -> bool:
    """True once the engine client's renderer pool is shut down (the first step of
    AsyncLLM.shutdown). Reads vLLM 0.33's _SwappableExecutor and the standard
    ThreadPoolExecutor's shutdown flag; test_serving_reliability's SIGTERM test fails if
    a vLLM upgrade moves them."""
    executor = getattr(getattr(engine_client, "renderer", None), "_executor", None)
    pool = getattr(executor, "_inner", executor)
    return bool(getattr(pool, "_shutdown", False))


def _error_body() -> bytes:
    # vLLM's ErrorResponse shape, as its own 503s (queue overflow) carry
    return json.dumps({"error": {
        "message": DRAIN_MESSAGE, "type": "ServiceUnavailableError", "param": None,
        "code": HTTPStatus.SERVICE_UNAVAILABLE.value}}).encode()


class DrainRefusal:
    """Pure ASGI middleware (no response buffering, so streams pass through untouched)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("method") == "POST" and self._draining(scope):
            body = _error_body()
            await send({"type": "http.response.start", "status": HTTPStatus.SERVICE_UNAVAILABLE.value,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode()),
                                    (b"retry-after", b"5"), (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)

    @staticmethod
    def _draining(scope) -> bool:
        app = scope.get("app")
        engine_client = getattr(getattr(app, "state", None), "engine_client", None)
        return engine_client is not None and renderer_stopped(engine_client)
