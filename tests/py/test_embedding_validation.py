"""embedding_validation: /v1/embeddings bodies validated completion-first give what vLLM's own
five-member union gives (the same model, fields and errors), and `vllm serve`'s API server
builds its route with it."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import TypeAdapter, ValidationError

from vllm_metal import embedding_validation

MSG = {"role": "user", "content": "hi"}
BODIES = [
    {"model": "m", "input": "hello"},
    {"input": ["a", "b"], "encoding_format": "base64", "dimensions": 8},
    {"input": [101, 2023, 102]},
    {"input": [[101, 7, 102], [101, 102], []]},
    {"input": []},
    {"input": [[]]},
    {"input": "x", "truncate_prompt_tokens": 4, "unknown_field": 1},
    {"messages": [MSG]},
    {"messages": [[MSG], [MSG, MSG]]},
    {"input": [MSG]},
    {"input": [[MSG]]},
    {"input": "text", "messages": [MSG]},
    # refused, by vLLM's union either way
    {"input": 5},
    {"input": [1, "a"]},
    {"input": [{"x": 1}]},
    {"input": [[1], ["a"]]},
    {"model": 3, "input": "a"},
    {},
    {"input": "a", "normalize": True},
    {"input": "a", "dimensions": "many"},
    "not a body",
]


def outcome(adapter, body):
    try:
        r = adapter.validate_python(body)
    except ValidationError as e:
        return "error", e.errors(include_url=False)
    except Exception as e:  # noqa: BLE001 (vLLM's removed-parameter refusal)
        return type(e).__name__, str(e)
    return type(r).__name__, r.model_dump(exclude={"request_id"})  # a random default


@pytest.mark.parametrize("body", BODIES, ids=range(len(BODIES)))
def test_completion_first_gives_what_vllms_union_gives(body):
    from vllm.entrypoints.pooling.embed.protocol import EmbeddingRequest

    fast = embedding_validation.fast_embedding_request(EmbeddingRequest)
    assert embedding_validation.installed(fast) and not embedding_validation.installed(EmbeddingRequest)
    assert outcome(TypeAdapter(fast), body) == outcome(TypeAdapter(EmbeddingRequest), body)


def test_the_token_id_fast_path_skips_the_chat_members(monkeypatch):
    # a token-id batch never reaches the union (whose chat members check every element)
    from vllm.entrypoints.pooling.embed import protocol

    def refuse(*a, **k):
        raise AssertionError("chat member validated")

    monkeypatch.setattr(protocol.EmbeddingChatInputRequest, "normalize_input_messages", refuse)
    fast = TypeAdapter(embedding_validation.fast_embedding_request(protocol.EmbeddingRequest))
    calls = []
    original = protocol.EmbeddingCompletionRequest.model_validate.__func__
    monkeypatch.setattr(protocol.EmbeddingCompletionRequest, "model_validate",
                        classmethod(lambda cls, d: calls.append(d) or original(cls, d)))
    r = fast.validate_python({"input": [[1, 2], [3]]})
    assert type(r) is protocol.EmbeddingCompletionRequest and len(calls) == 1


INSTALL = """
import sys
import vllm.entrypoints.launchers.api_server.entry  # what `vllm serve`'s API server runs
{before}
import vllm_metal
vllm_metal.register_general()  # vLLM's general plugin hook, as `vllm serve` calls it
from vllm_metal import embedding_validation
from vllm.entrypoints.pooling.embed import api_router
print(embedding_validation.installed(api_router.create_embedding.__annotations__["request"]))
"""


@pytest.mark.parametrize("router_first,want", [(False, "True"), (True, "False")],
                         ids=["plugin first", "router first"])
def test_the_served_route_is_built_with_it(router_first, want):
    before = "from vllm.entrypoints.pooling.embed import api_router" if router_first else ""
    out = subprocess.run([sys.executable, "-c", INSTALL.format(before=before)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == want
