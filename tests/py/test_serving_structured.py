"""Structured outputs through `vllm serve` on the offline SmolLM2 model.

vLLM compiles each request's grammar (xgrammar by default; guidance and outlines on
request) and hands the runner a per-step bitmask, which ops.apply_token_bitmask applies
before sampling. Every output is checked against its constraint independently (json +
jsonschema with formats, re.fullmatch, the choice list, a recursive-descent parser of the
arithmetic grammar); requests in a batch of 16 must give the tokens they give alone. The
newer tests go through the `openai` client. A request of each kind, the batch and the
length stop run with async scheduling (the default) and sync; the schema set (structured_cases.py),
structural tags and bad input on the async server only (front end and grammars), so that
the file stays within a few minutes.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import re

import ast
import time

import jsonschema
import openai
import pytest

from serving_harness import Server
from structured_cases import ARITH_GRAMMAR, SCHEMAS, check_json, parse_arith
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
    # batch-invariant: "each request gives what it gives alone" is only promised in that mode
    # (without it a near-tie may flip with the batch's composition, which timing decides)
    s = Server(smollm2_gguf(), "smollm2", ["--max-model-len", "512", "--max-num-seqs", "16",
                                           "--num-gpu-blocks-override", "160"] + extra,
               env={"VLLM_BATCH_INVARIANT": "1"})
    s.mode = request.param
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    """The openai client on the same server."""
    with openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0,
                       timeout=120) as c:
        yield c


def _async_only(server):
    # front-end and grammar behaviour, not scheduling: one server is enough
    if server.mode != "async":
        pytest.skip("runs on the async server only")


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


# ---- through the openai client ------------------------------------------------------------

def _chat(client, content, max_tokens=100, **kw):
    return client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": content}], max_tokens=max_tokens,
        temperature=0, **kw).choices[0]


def _complete(client, prompt, max_tokens=100, **kw):
    return client.completions.create(model="smollm2", prompt=prompt, max_tokens=max_tokens,
                                     temperature=0, **kw).choices[0]


def _schema_jobs():
    """(api, name) for every schema: chat with response_format, completions with
    structured_outputs.json."""
    return [(api, name) for name in SCHEMAS for api in ("chat", "completions")]


def _run_schema(client, api, name):
    prompt, schema = SCHEMAS[name]
    if api == "chat":
        c = _chat(client, prompt + ", as JSON.", response_format={
            "type": "json_schema", "json_schema": {"name": name, "schema": schema}})
        return c.finish_reason, c.message.content
    c = _complete(client, prompt + " in JSON:", extra_body={"structured_outputs": {"json": schema}})
    return c.finish_reason, c.text


def test_every_schema_gives_valid_json_that_ends(server, client):
    """Each schema through both APIs, 16 at a time: every output parses, validates
    (formats included) and ends by itself."""
    _async_only(server)
    jobs = _schema_jobs()
    with cf.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda j: _run_schema(client, *j), jobs))
    bad = []
    for (api, name), (finish, text) in zip(jobs, results):
        try:
            assert finish == "stop", f"finish_reason {finish}"
            check_json(text, SCHEMAS[name][1])
        except (AssertionError, ValueError, jsonschema.ValidationError) as e:
            bad.append(f"{api}/{name}: {text!r}: {str(e).splitlines()[0]}")
    assert not bad, "\n".join(bad)
    assert len(SCHEMAS) >= 20


def _check_arith_ast(text: str) -> None:
    """The same expression read by Python: only integers and + - * / (parentheses vanish)."""
    allowed = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div)
    for node in ast.walk(ast.parse(text, mode="eval")):
        assert isinstance(node, allowed), (text, node)
        if isinstance(node, ast.Constant):
            assert type(node.value) is int, (text, node.value)


def test_arithmetic_grammar_gives_an_expression(server, client):
    _async_only(server)
    for prompt in ("2 + 3 * (4 - 1) =", "Write a sum:", "(7 * 8) / 2 - 1 =", "3*4="):
        c = _complete(client, prompt, max_tokens=60,
                      extra_body={"structured_outputs": {"grammar": ARITH_GRAMMAR}})
        assert c.finish_reason == "stop", c
        assert parse_arith(c.text) >= 1, c.text
        _check_arith_ast(c.text)


def test_the_arithmetic_checker_rejects_what_the_grammar_rejects():
    """The checker and xgrammar's own matcher agree, string by string."""
    from xgrammar import Grammar
    from xgrammar.testing import _is_grammar_accept_string

    grammar = Grammar.from_ebnf(ARITH_GRAMMAR)
    for good in ("1", "2+3", "(4 - 5) * 6", "((7))/8 - 90", "1+2+3+4", "1*2*3", "(1+2+3+4)+5"):
        parse_arith(good)
        assert _is_grammar_accept_string(grammar, good), good
    for bad in ("", "1 +", "(2", "2)", "01", "1234", "2 ** 3", "x", "-1", "1 2", "1  + 2",
                "1+2+3+4+5", "1*2*3*4", "1 ", " 1"):
        with pytest.raises(ValueError):
            parse_arith(bad)
        assert not _is_grammar_accept_string(grammar, bad), bad


PERSON_TAG = {"type": "tag", "begin": "<person>", "content": {
    "type": "json_schema", "json_schema": PERSON}, "end": "</person>"}


def test_structural_tag_forces_a_tagged_json_section(server, client):
    """response_format structural_tag (xgrammar's format): the whole answer is the tag,
    its content follows the schema."""
    _async_only(server)
    c = _chat(client, "Describe a person.", response_format={"type": "structural_tag",
                                                              "format": PERSON_TAG})
    m = re.fullmatch(r"<person>(.*)</person>", c.message.content, re.S)
    assert m, c.message.content
    check_json(m.group(1), PERSON)
    assert c.finish_reason == "stop"


def test_triggered_tag_at_least_once_then_stop(server, client):
    """triggered_tags with at_least_one and stop_after_first: one tagged section."""
    _async_only(server)
    tag = {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<person>"], "tags": [PERSON_TAG],
        "at_least_one": True, "stop_after_first": True}}
    c = _complete(client, "Who is Ann?", max_tokens=60,
                  extra_body={"structured_outputs": {"structural_tag": json.dumps(tag)}})
    m = re.fullmatch(r"<person>(.*)</person>", c.text, re.S)
    assert m, c.text
    check_json(m.group(1), PERSON)
    assert c.finish_reason == "stop"


def test_structural_tag_sequence_of_text_and_tag(server, client):
    """A sequence: fixed text, then the tagged section (through completions'
    structured_outputs.structural_tag, a JSON string)."""
    _async_only(server)
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "Answer: "},
        {"type": "tag", "begin": "<n>", "content": {"type": "json_schema", "json_schema": {
            "type": "integer", "minimum": 0, "maximum": 99}}, "end": "</n>"}]}}
    c = _complete(client, "How many legs has a spider?", max_tokens=40,
                  extra_body={"structured_outputs": {"structural_tag": json.dumps(tag)}})
    m = re.fullmatch(r"Answer: <n>(.*)</n>", c.text, re.S)
    assert m, c.text
    assert 0 <= check_json(m.group(1), {"type": "integer", "minimum": 0, "maximum": 99}) <= 99
    assert c.finish_reason == "stop"


def test_legacy_structural_tag_constrains_what_follows_a_trigger(server, client):
    """vLLM's older form (structures + triggers): free text until a trigger, then the
    section's schema. The prompt makes the model start the section."""
    _async_only(server)
    c = _complete(client, 'Example: <person>{"name": "Ann", "age": 30}</person>\n'
                  'Example: <person>{"name": "Bob", "age": 41}</person>\nExample:',
                  max_tokens=60, extra_body={"response_format": {
                      "type": "structural_tag", "triggers": ["<person>"],
                      "structures": [{"begin": "<person>", "schema": PERSON,
                                      "end": "</person>"}]}})
    sections = re.findall(r"<person>(.*?)</person>", c.text, re.S)
    assert sections, c.text
    for section in sections:
        check_json(section, PERSON)


# ---- a batch of 16, each as alone --------------------------------------------------------

MIXED = [
    ("free", "The capital of France is", {}),
    ("free", "1, 2, 3, 4,", {}),
    ("free", "Water boils at", {}),
    ("free", "def add(a, b):", {}),
    ("free", "The moon is", {}),
    ("free", "Once upon a time", {}),
    ("free", "import numpy as", {}),
    ("free", "Red, orange, yellow,", {}),
    ("regex", "Phone:", {"structured_outputs": {"regex": PHONE}}),
    ("choice", "Colour:", {"structured_outputs": {"choice": COLOURS}}),
    ("grammar", "Pick:", {"structured_outputs": {"grammar": GRAMMAR}}),
    ("arith", "Sum:", {"structured_outputs": {"grammar": ARITH_GRAMMAR}}),
    ("person", "Person:", {"structured_outputs": {"json": PERSON}}),
    ("movie", "Movie:", {"structured_outputs": {"json": SCHEMAS["movie"][1]}}),
    ("boolean", "Is it true?", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "b", "schema": SCHEMAS["boolean"][1]}}}),
    ("tag", "Tagged:", {"response_format": {"type": "structural_tag", "format": PERSON_TAG}}),
]


def _check_mixed(kind: str, text: str) -> None:
    if kind == "regex":
        assert re.fullmatch(PHONE, text), text
    elif kind == "choice":
        assert text in COLOURS, text
    elif kind == "grammar":
        assert re.fullmatch(PICK, text), text
    elif kind == "arith":
        parse_arith(text)
    elif kind in ("person", "movie"):
        check_json(text, PERSON if kind == "person" else SCHEMAS["movie"][1])
    elif kind == "boolean":
        check_json(text, SCHEMAS["boolean"][1])
    elif kind == "tag":
        m = re.fullmatch(r"<person>(.*)</person>", text, re.S)
        assert m, text
        check_json(m.group(1), PERSON)


def test_sixteen_mixed_requests_each_give_what_they_give_alone(server, client):
    """8 free and 8 constrained completions at once (greedy): the masks go to their own
    rows, so every request gives its solo text, and the constrained ones their constraint."""
    def run(job):
        _, prompt, kw = job
        c = _complete(client, prompt, max_tokens=150 if kw else 16, extra_body=kw)
        return c.finish_reason, c.text

    alone = [run(j) for j in MIXED]
    with cf.ThreadPoolExecutor(len(MIXED)) as pool:
        together = list(pool.map(run, MIXED))
    assert len(MIXED) == 16
    for (kind, _, _), (finish, text) in zip(MIXED, alone):
        if kind != "free":
            assert finish == "stop", (kind, text)
            _check_mixed(kind, text)
    assert together == alone


# ---- bad input ----------------------------------------------------------------------------

@pytest.mark.parametrize("structured, named", [
    # schemas (xgrammar rejects them; auto's fallback, guidance, names the fault)
    ({"json": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}},
     "invalid type: no-such-type"),
    ({"json": {"type": "object", "required": 5}}, "expected array for 'required'"),
    ({"json": {"$ref": "#/$defs/missing"}}, "/$defs/missing"),
    ({"json": "{not json"}, "invalid json"),
    ({"regex": "[a-"}, "invalid regex"),
    ({"regex": "a{5,2}"}, "invalid regex"),
    ({"grammar": 'root ::= "a" | undefined_rule'}, "undefined_rule"),
    ({"grammar": 'root ::= ("a" '}, "expected ')'"),
    ({"grammar": 'start: foo\nfoo: "a" bar'}, 'unknown name: "bar"'),  # Lark
    ({"structural_tag": '{"type": "structural_tag", "format": {"type": "nope"}}'},
     "structural_tag"),
])
def test_an_invalid_constraint_is_a_400_and_the_server_lives_on(server, client, structured,
                                                                named):
    _async_only(server)
    with pytest.raises(openai.BadRequestError) as e:
        _complete(client, "Hi", max_tokens=8, extra_body={"structured_outputs": structured})
    assert e.value.status_code == 400
    assert named in str(e.value).lower(), str(e.value)
    assert _complete(client, "The capital of France is", max_tokens=4).finish_reason == "length"


def test_an_invalid_response_format_schema_is_a_400(server, client):
    _async_only(server)
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, "Hi", max_tokens=8, response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": 7}}}}})
    assert "type must be a string" in str(e.value).lower(), str(e.value)
    assert _chat(client, "Hi", max_tokens=4).finish_reason == "length"


@pytest.mark.parametrize("structured", [
    {"regex": "[a-z]{300}"},
    {"json": {"type": "array", "items": {"type": "integer", "minimum": 10, "maximum": 99},
              "minItems": 200}},
    {"grammar": 'root ::= "<" [a-z]{150} ">"'},
])
def test_a_constraint_that_cannot_end_in_time_stops_at_max_tokens(server, client, structured):
    """The grammar's end lies beyond max_tokens: finish_reason "length" after exactly
    max_tokens tokens, in bounded time, and what came is a prefix the grammar allows."""
    t0 = time.monotonic()
    r = client.completions.create(model="smollm2", prompt="Go:", max_tokens=24, temperature=0,
                                  extra_body={"structured_outputs": structured})
    assert time.monotonic() - t0 < 60
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 24
    text = r.choices[0].text
    if "regex" in structured:
        assert re.fullmatch(r"[a-z]+", text), text
    elif "json" in structured:
        assert re.fullmatch(r"\[[\s0-9,]*", text), text
        assert all(10 <= int(x) <= 99 for x in re.findall(r"\d+(?=\s*,)", text)), text
    else:
        assert re.fullmatch(r"<[a-z]*", text), text


def test_structured_output_combines_with_prompt_logprobs_echo_and_n(server, client):
    """No sampling parameter is refused beside a grammar: prompt logprobs, echo, n and
    stop strings work with it (vLLM itself refuses none of them either)."""
    _async_only(server)
    r = client.completions.create(
        model="smollm2", prompt="Phone:", max_tokens=20, temperature=0.8, seed=3, n=2,
        logprobs=1, echo=True, extra_body={"structured_outputs": {"regex": PHONE},
                                           "prompt_logprobs": 1})
    assert len(r.choices) == 2
    for c in r.choices:
        assert c.text.startswith("Phone:")
        assert re.fullmatch(PHONE, c.text[len("Phone:"):]), c.text
    assert r.choices[0].model_extra.get("prompt_logprobs"), r.choices[0]
    # a stop string inside the grammar's language ends the output there
    r = client.completions.create(model="smollm2", prompt="Phone:", max_tokens=20, temperature=0.8,
                                  seed=3, stop=["-"], extra_body={"structured_outputs": {"regex": PHONE}})
    assert re.fullmatch(r"[0-9]{3}", r.choices[0].text) and r.choices[0].finish_reason == "stop", r.choices[0]
