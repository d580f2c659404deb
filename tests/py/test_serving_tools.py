"""Tool calling through `vllm serve --enable-auto-tool-choice --tool-call-parser ...`, with
the openai client.

hermes on the offline SmolLM2 model, twice: with vLLM's default strict tool calling
(tool_choice "required" or a named function becomes an xgrammar structural tag in the
hermes format, <tool_call>{...}</tool_call>) and with VLLM_ENFORCE_STRICT_TOOL_CALLING=0
(vLLM's older path: a JSON schema of the calls, an array of {name, parameters}). Either way
the constraint is a grammar whose bitmask our runner applies. llama3_json on the tiny
Qwen3.5 checkpoint whose tokenizer has <|python_tag|> (the parser refuses a tokenizer
without it; SmolLM2's has none).

What each test exercises:
- required / named: the call is constrained, comes back parsed in message.tool_calls, and
  its arguments validate (jsonschema) against the tool's parameters (tools marked strict,
  so the arguments are constrained too, not only the envelope).
- auto: a tiny model never emits a tool call by itself, so the test forces the parser's
  format with a regex of its own (structured_outputs) while tool_choice stays "auto":
  what is exercised is vLLM's auto path, the parser extracting the call from free-form
  output, not the model's choice to call. Without the regex, the answer is plain content.
- every parser vLLM registers that constructs with our tokenizer (markers included)
  is listed and constructed; the few that do not need their model's own special tokens.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from marker_checkpoint import write_marker_checkpoint
from serving_harness import Server
from test_serving import smollm2_gguf

pytestmark = [pytest.mark.slow, pytest.mark.serving]

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,11}$"},
                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
        "required": ["zone"], "additionalProperties": False}
# patterns, not lengths: xgrammar lets a JSON string hold raw control characters, which the
# tiny random model emits and the parsers' json.loads refuses
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} tool",
                                           "parameters": schema, "strict": True}}
         for name, schema in SCHEMAS.items()]
LOOSE_TOOLS = [{"type": "function", "function": {k: v for k, v in t["function"].items()
                                                 if k != "strict"}} for t in TOOLS]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
SMALL = ["--max-num-seqs", "4", "--num-gpu-blocks-override", "128"]

# the hermes format, the arguments from the regex (tool_choice "auto")
HERMES_CALL = (r'<tool_call>\n\{"name": "get_weather", "arguments": '
               r'\{"city": "[A-Z][a-z]{2,8}", "unit": "(celsius|fahrenheit)"\}\}\n</tool_call>')
# llama3_json: the JSON object the parser finds in the text
LLAMA_CALL = (r'\{"name": "get_time", "parameters": \{"zone": "[A-Z]{3}"\}\}')


# name -> (tool-call parser, model, vLLM's strict tool calling (structural tags) on)
SERVERS = {"hermes": ("hermes", "smollm2", True),
           "hermes-json-schema": ("hermes", "smollm2", False),
           "llama3_json": ("llama3_json", "markers", True)}
# the parser's format, forced with tool_choice "auto": (regex, function it calls)
AUTO_CALLS = {"hermes": (HERMES_CALL, "get_weather"), "llama3_json": (LLAMA_CALL, "get_time")}


@pytest.fixture(scope="module", params=list(SERVERS))
def server(request, tmp_path_factory):
    parser, model, strict = SERVERS[request.param]
    env = {} if strict else {"VLLM_ENFORCE_STRICT_TOOL_CALLING": "0"}
    if model == "smollm2":
        path, args = smollm2_gguf(), ["--max-model-len", "1024"]
    else:
        path = str(write_marker_checkpoint(tmp_path_factory.mktemp("qwen3_5_markers")))
        args = ["--dtype", "float32", "--max-model-len", "512"]
    s = Server(path, model, [*args, *SMALL, "--enable-auto-tool-choice",
                             "--tool-call-parser", parser], env=env)
    s.parser = parser
    yield s
    s.stop()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0)


def ask(server, tool_choice, tools=TOOLS, max_tokens=120, parallel_tool_calls=openai.NOT_GIVEN,
        **extra):
    return client(server).chat.completions.create(
        model=server.name, messages=QUESTION, tools=tools, tool_choice=tool_choice,
        max_tokens=max_tokens, temperature=0, parallel_tool_calls=parallel_tool_calls,
        extra_body=extra or None).choices[0]


def check_calls(choice, names) -> list[dict]:
    """The parsed calls: each to one of `names`, its arguments valid for that tool."""
    calls = choice.message.tool_calls
    assert calls, (choice.finish_reason, choice.message.content)
    out = []
    for call in calls:
        assert call.type == "function" and call.function.name in names, call
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append({"name": call.function.name, "arguments": args})
    return out


def test_required_tool_call_is_parsed_and_valid(server):
    # one call: vLLM's llama format lets free text follow the calls, which the random
    # model fills (braces included, which the llama3_json parser then fails on)
    choice = ask(server, "required", parallel_tool_calls=False)
    assert len(check_calls(choice, set(SCHEMAS))) == 1


def test_required_with_parallel_calls_allowed(server):
    if server.parser == "llama3_json":
        pytest.skip("free text may follow the calls in vLLM's llama format (above)")
    check_calls(ask(server, "required"), set(SCHEMAS))


def test_named_tool_call_calls_that_function(server):
    choice = ask(server, {"type": "function", "function": {"name": "get_time"}})
    calls = check_calls(choice, {"get_time"})
    assert [c["name"] for c in calls] == ["get_time"]


def test_required_streamed_gives_the_same_call(server):
    whole = check_calls(ask(server, "required", parallel_tool_calls=False), set(SCHEMAS))
    names, args = {}, {}
    stream = client(server).chat.completions.create(
        model=server.name, messages=QUESTION, tools=TOOLS, tool_choice="required",
        max_tokens=120, temperature=0, stream=True, parallel_tool_calls=False)
    for chunk in stream:
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if d.function and d.function.name:
                names[d.index] = d.function.name
            if d.function and d.function.arguments:
                args[d.index] = args.get(d.index, "") + d.function.arguments
    streamed = [{"name": names[i], "arguments": json.loads(args[i])} for i in sorted(names)]
    assert streamed == whole


def test_auto_parses_a_call_in_the_parsers_format(server):
    regex, name = AUTO_CALLS[server.parser]
    choice = ask(server, "auto", tools=LOOSE_TOOLS, structured_outputs={"regex": regex})
    calls = check_calls(choice, {name})
    assert len(calls) == 1 and choice.finish_reason == "tool_calls"
    assert not (choice.message.content or "").strip()


def test_auto_without_a_call_is_plain_content(server):
    regex = "[A-Za-z ]{5,30}"
    choice = ask(server, "auto", tools=LOOSE_TOOLS, max_tokens=30,
                 structured_outputs={"regex": regex})
    assert not choice.message.tool_calls and choice.message.content


# vLLM 0.33's tool parsers that construct with the tiny checkpoint's tokenizer (the ones
# missing here need their model's own special tokens: deepseek_v3/v31, hy_v3/v4, jamba,
# lfm2, mistral); none needs CUDA.
CONSTRUCTS = ["apertus", "beam", "cohere_command3", "cohere_command4", "deepseek_v32",
              "deepseek_v4", "deepseek_v41", "dots", "ernie45", "functiongemma", "gemma4",
              "gigachat3", "glm45", "glm47", "granite", "granite-20b-fc", "granite4", "hermes",
              "hf", "hunyuan_a13b", "inkling", "internlm", "k2_horizon", "kimi_k2", "kimi_k3",
              "ling3", "llama3_json", "llama4_json", "llama4_pythonic", "longcat", "mimo",
              "minicpm5", "minimax_m2", "minimax_m3", "muse", "muse_glimmer", "musespark1x",
              "olmo3", "openai", "phi4_mini_json", "plamo3", "poolside_v1", "pythonic",
              "qwen3_coder", "qwen3_json", "qwen3_xml", "seed_oss", "step3", "step3p5", "step5",
              "xlam"]


@pytest.fixture(scope="module")
def marker_tokenizer(tmp_path_factory):
    from vllm.tokenizers import get_tokenizer

    from marker_checkpoint import write_marker_tokenizer

    out = tmp_path_factory.mktemp("marker_tokenizer")
    write_marker_tokenizer(out)
    return get_tokenizer(str(out))


@pytest.mark.parametrize("name", CONSTRUCTS)
def test_tool_parser_constructs_with_our_tokenizer(marker_tokenizer, name):
    from vllm.tool_parsers import ToolParserManager

    parser = ToolParserManager.get_tool_parser(name)(marker_tokenizer)
    assert parser.model_tokenizer is not None
