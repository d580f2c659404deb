"""Structured outputs through `vllm serve` on the offline SmolLM2 model.

vLLM compiles each request's grammar (xgrammar by default; guidance and outlines on
request) and hands the runner a per-step bitmask, which ops.apply_token_bitmask applies
before sampling. Every output is checked against its constraint independently (json +
jsonschema, re.fullmatch, the choice list); unconstrained requests in the same batch must
give the tokens they give alone. Async scheduling (the default) and sync both run.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import re

import jsonschema
import pytest

from serving_harness import Server
from test_serving import smollm2_gguf

pytestmark = [pytest.mark.slow, pytest.mark.serving]

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12},
                   "age": {"type": "integer", "minimum": 0, "maximum": 150}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
PHONE = r"[0-9]{3}-[0-9]{4}"
COLOURS = ["red", "green", "blue"]
# xgrammar's EBNF (GBNF-style): a colour, a space, a small number
GRAMMAR = 'root ::= ("red" | "green" | "blue") " " [1-9] [0-9]?'
LARK = 'start: COLOUR " " NUMBER\nCOLOUR: "red" | "green" | "blue"\nNUMBER: /[1-9][0-9]?/'
PICK = r"(red|green|blue) [1-9][0-9]?"  # what both grammars accept


@pytest.fixture(scope="module", params=["async", "sync"])
def server(request):
    extra = [] if request.param == "async" else ["--no-async-scheduling"]
    s = Server(smollm2_gguf(), "smollm2", ["--max-model-len", "512", "--max-num-seqs", "8",
                                           "--num-gpu-blocks-override", "128"] + extra)
    yield s
    s.stop()


def _text(r) -> str:
    assert r["status"] == 200, r
    choice = r["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def test_json_schema_output_fits_the_schema(server):
    r = server.chat("Describe a person as JSON with a name and an age.", max_tokens=80,
                    response_format={"type": "json_schema",
                                     "json_schema": {"name": "person", "schema": PERSON}})
    assert r["choices"][0]["finish_reason"] == "stop", r
    jsonschema.validate(json.loads(_text(r)), PERSON)


def test_json_object_output_is_an_object(server):
    r = server.chat('Return {"ok": true} as JSON.', max_tokens=120,
                    response_format={"type": "json_object"})
    assert r["choices"][0]["finish_reason"] == "stop", r
    assert isinstance(json.loads(_text(r)), dict)


@pytest.mark.parametrize("constraint, check", [
    ({"regex": PHONE}, lambda t: re.fullmatch(PHONE, t)),
    ({"choice": COLOURS}, lambda t: t in COLOURS),
    ({"grammar": GRAMMAR}, lambda t: re.fullmatch(PICK, t)),
])
def test_completion_follows_its_constraint(server, constraint, check):
    r = server.complete("My favourite thing:", max_tokens=20, structured_outputs=constraint)
    text = _text(r)
    assert check(text), text


def test_a_lark_grammar_goes_to_guidance(server):
    """xgrammar cannot parse Lark: vLLM's auto mode hands it to guidance, same mask."""
    text = _text(server.complete("Pick:", max_tokens=20, structured_outputs={"grammar": LARK}))
    assert re.fullmatch(PICK, text), text


def test_the_outlines_backend_serves_a_regex():
    s = Server(smollm2_gguf(), "smollm2", ["--max-model-len", "256", "--max-num-seqs", "4",
                                           "--num-gpu-blocks-override", "32",
                                           "--structured-outputs-config", '{"backend": "outlines"}'])
    try:
        text = _text(s.complete("Pick:", max_tokens=20, structured_outputs={"regex": PICK}))
        assert re.fullmatch(PICK, text), text
    finally:
        s.stop()


def test_sampled_constrained_output_is_seeded_and_scored(server):
    kw = dict(max_tokens=20, temperature=1.0, top_p=0.95, seed=7, logprobs=2,
              presence_penalty=0.2, structured_outputs={"regex": PHONE})
    first, again = server.complete("Call me at", **kw), server.complete("Call me at", **kw)
    text = _text(first)
    assert re.fullmatch(PHONE, text), text
    assert text == _text(again)
    lp = first["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == first["usage"]["completion_tokens"]
    assert all(x <= 0 and x > -1e30 for x in lp["token_logprobs"])  # sampled: allowed, finite


def test_constrained_and_free_requests_share_a_batch(server):
    """The masks go to their own rows: free requests answer as they do alone."""
    free = ["The capital of France is", "1, 2, 3, 4,", "Water boils at", "def add(a, b):"]
    alone = [_text(server.complete(p, max_tokens=12)) for p in free]
    jobs = [("free", p, {}) for p in free] + [
        ("choice", "Colour:", {"structured_outputs": {"choice": COLOURS}}),
        ("regex", "Phone:", {"structured_outputs": {"regex": PHONE}}),
        ("schema", "Person:", {"response_format": {"type": "json_schema", "json_schema": {
            "name": "person", "schema": PERSON}}, "max_tokens": 80}),
        ("grammar", "Pick:", {"structured_outputs": {"grammar": GRAMMAR}}),
    ]
    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda j: (j[0], _text(server.complete(j[1], **{"max_tokens": 12, **j[2]}))),
                                jobs))
    assert [t for kind, t in results if kind == "free"] == alone
    got = dict((kind, t) for kind, t in results if kind != "free")
    assert got["choice"] in COLOURS
    assert re.fullmatch(PHONE, got["regex"]), got["regex"]
    jsonschema.validate(json.loads(got["schema"]), PERSON)
    assert re.fullmatch(PICK, got["grammar"]), got["grammar"]
