"""DrainRefusal: a 503 for POSTs once the engine client's renderer pool is shut down (the
first step of vLLM's SIGTERM drain); everything else passes through. The served behaviour
is test_serving_reliability's SIGTERM test."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
from vllm.renderers.base import _SwappableExecutor

from vllm_metal.drain_refusal import DRAIN_MESSAGE, DrainRefusal, renderer_stopped


async def _echo_app(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"served"})


def _app_with(executor):
    state = SimpleNamespace(engine_client=SimpleNamespace(renderer=SimpleNamespace(_executor=executor)))
    inner = DrainRefusal(_echo_app)

    async def app(scope, receive, send):
        # Starlette puts the application in scope["app"]; its state holds the engine client
        await inner({**scope, "app": SimpleNamespace(state=state)}, receive, send)

    return app


def _request(app, method: str, path: str) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.request(method, path, json={} if method == "POST" else None)

    return asyncio.run(go())


def test_vllm_renderer_pool_reads_as_stopped_only_after_shutdown():
    executor = _SwappableExecutor(max_workers=1)
    client = SimpleNamespace(renderer=SimpleNamespace(_executor=executor))
    assert not renderer_stopped(client)
    executor.shutdown(wait=True)
    assert renderer_stopped(client)
    assert not renderer_stopped(SimpleNamespace())  # no renderer yet: not draining


def test_posts_are_served_until_the_drain_then_get_a_503():
    executor = _SwappableExecutor(max_workers=1)
    app = _app_with(executor)
    assert _request(app, "POST", "/v1/completions").text == "served"
    executor.shutdown(wait=True)
    refused = _request(app, "POST", "/v1/completions")
    assert refused.status_code == 503
    assert refused.headers["retry-after"] == "5"
    error = json.loads(refused.content)["error"]
    assert error == {"message": DRAIN_MESSAGE, "type": "ServiceUnavailableError", "param": None,
                     "code": 503}
    # GETs (health, metrics, models) stay vLLM's
    assert _request(app, "GET", "/metrics").text == "served"


def test_the_platform_adds_it_to_vllm_serve_and_user_middleware_appends():
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_metal.platform import MetalPlatform

    parser = make_arg_parser(FlexibleArgumentParser())
    MetalPlatform.pre_register_and_update(parser)  # idempotent when vLLM already called it
    ours = "vllm_metal.drain_refusal.DrainRefusal"
    assert parser.parse_args(["m"]).middleware.count(ours) == 1
    assert parser.parse_args(["m", "--middleware", "x.Y"]).middleware == [ours, "x.Y"]
