"""Structured outputs and tool calls through the server, with the real ``openai`` client: every
constrained answer is checked by ``jsonschema`` / ``json.loads`` / ``re.fullmatch``, forced tool
calls validate against their function's parameters, "auto" calls are parsed from a model scripted
to write one, and no tool-call markup reaches a streamed ``delta.content``."""

from __future__ import annotations

import json
import re
from typing import Literal

import pytest

pytest.importorskip("transformers")
pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")

from minipaged_ops import tiny  # noqa: E402
from minipaged_ops.integration import LLMEngine  # noqa: E402
from test_server import NAME, TIMEOUT, call, serving  # noqa: E402

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, CLOCK]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "size": {"enum": ["S", "M", "L"]}, "count": {"type": "integer",
                                                                                        "minimum": 0,
                                                                                        "maximum": 99}},
          "required": ["name", "size", "count"], "additionalProperties": False}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny.save_tiny_model(tmp_path_factory.mktemp("structured") / "model")


@pytest.fixture(scope="module")
def server(folder):
    llm = LLMEngine.from_pretrained(folder, num_blocks=128, block_size=16, max_num_seqs=16)
    # a random model spends its tokens on JSON whitespace where it may: vLLM's option against that
    with serving(llm, app_kwargs={"structured_outputs_config": {"disable_any_whitespace": True}}) as (url, _):
        yield url, openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)


def finished_json(choice_text, finish_reason, schema=None):
    if finish_reason == "length":
        return None
    value = json.loads(choice_text)
    if schema is not None:
        jsonschema.validate(value, schema)
    return value


# ---------------------------------------------------------------------------------- response_format


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("strict", [True, False])
def test_response_format_json_schema(server, stream, strict):
    _, client = server
    fmt = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA, "strict": strict}}
    ended = 0
    for seed in range(3):
        kwargs = dict(model=NAME, messages=ASK, max_tokens=60, temperature=1.0, seed=seed, response_format=fmt)
        if stream:
            text, finish = "", None
            for chunk in client.chat.completions.create(stream=True, **kwargs):
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                    finish = chunk.choices[0].finish_reason or finish
        else:
            choice = client.chat.completions.create(**kwargs).choices[0]
            text, finish = choice.message.content, choice.finish_reason
        ended += finished_json(text, finish, SCHEMA) is not None
    assert ended >= 2


def test_response_format_json_object_parses(server):
    _, client = server
    out = client.chat.completions.create(model=NAME, messages=ASK, max_tokens=80, temperature=0.8, seed=1, n=4,
                                         response_format={"type": "json_object"})
    parsed = [finished_json(c.message.content, c.finish_reason) for c in out.choices]
    assert all(p is None or isinstance(p, dict) for p in parsed)  # JSON mode: an object (the engine tests
    assert all(c.message.content.startswith("{") for c in out.choices)  # see it end; here it may run long)


def test_beta_parse_returns_a_pydantic_object(server):
    _, client = server

    class Forecast(pydantic.BaseModel):
        city: Literal["Paris", "Rome", "Oslo"]
        rain: bool
        level: Literal[1, 2, 3]

    out = client.beta.chat.completions.parse(model=NAME, messages=ASK, max_tokens=60, temperature=0,
                                             response_format=Forecast)
    parsed = out.choices[0].message.parsed
    assert isinstance(parsed, Forecast) and parsed.city in ("Paris", "Rome", "Oslo")


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("constraint,check", [
    ({"regex": r"[a-z]{2,5}@[a-z]{2,4}\.(com|org)"}, lambda t: re.fullmatch(r"[a-z]{2,5}@[a-z]{2,4}\.(com|org)", t)),
    ({"choice": ["yes", "no", "not sure"]}, lambda t: t in ("yes", "no", "not sure")),
    ({"grammar": 'root ::= "(" [0-9]{1,3} (("+" | "*") [0-9]{1,3}){0,2} ")"'},
     lambda t: re.fullmatch(r"\([0-9]{1,3}([+*][0-9]{1,3}){0,2}\)", t)),
    ({"json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
])
def test_structured_outputs_extra_on_both_endpoints(server, endpoint, constraint, check):
    _, client = server
    extra = {"structured_outputs": constraint}
    if endpoint == "completions":
        out = client.completions.create(model=NAME, prompt="The answer:", max_tokens=40, temperature=1.0, seed=3,
                                        n=3, extra_body=extra)
        texts = [(c.text, c.finish_reason) for c in out.choices]
    else:
        out = client.chat.completions.create(model=NAME, messages=ASK, max_tokens=40, temperature=1.0, seed=3, n=3,
                                             extra_body=extra)
        texts = [(c.message.content, c.finish_reason) for c in out.choices]
    assert sum(finish == "stop" for _, finish in texts) >= 2
    for text, finish in texts:
        if finish == "stop":
            assert check(text), text


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
])
def test_bad_constraints_are_400_naming_the_field(server, body, param):
    url, _ = server
    status, reply = call(url, "/v1/chat/completions", {"model": NAME, "messages": ASK, "max_tokens": 4, **body})
    assert status == 400, reply
    assert reply["error"]["param"].startswith(param), reply


# ---------------------------------------------------------------------------------- tools


def test_tools_and_tool_history_reach_the_chat_template(server, folder):
    from transformers import AutoTokenizer

    _, client = server
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21"}]
    for messages, tools in ((ASK, None), (ASK, TOOLS), (history, TOOLS)):
        extra = {} if tools is None else {"tools": tools, "tool_choice": "none"}
        out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=1, **extra)
        expected = tokenizer.apply_chat_template([{**m, "content": m["content"] or ""} for m in messages],
                                                 tools=tools, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)
        assert out.usage.prompt_tokens == len(expected)
        assert out.choices[0].message.tool_calls is None
    text = tokenizer.apply_chat_template(history, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert "<tool_response>\nsunny, 21\n</tool_response>" in text and '"name": "get_time"' in text


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["get_time", "get_weather", "required"])
def test_forced_tool_calls_validate_against_the_parameters(server, stream, choice):
    _, client = server
    tool_choice = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    kwargs = dict(model=NAME, messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=80, temperature=0.7,
                  seed=2)
    if stream:
        calls, finish, content = {}, None, ""
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for d in delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = d.id or call["id"]
                call["name"] += (d.function.name or "") if d.function else ""
                call["arguments"] += (d.function.arguments or "") if d.function else ""
            finish = chunk.choices[0].finish_reason or finish
        found = [calls[i] for i in sorted(calls)]
        assert content == ""
    else:
        message = client.chat.completions.create(**kwargs).choices[0]
        finish = message.finish_reason
        found = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in message.message.tool_calls or []]
        assert not message.message.content
    assert finish == ("tool_calls" if choice == "required" else "stop"), finish
    assert found and all(c["id"] for c in found)
    for c in found:
        assert choice == "required" or c["name"] == choice
        jsonschema.validate(json.loads(c["arguments"]), PARAMETERS[c["name"]])


# ---------------------------------------------------------------------------------- "auto"

PIECES = ["Let me check.", "<tool_call>\n", '{"name": "get_weather", ', '"arguments": {"city": ', '"Paris", ',
          '"unit": "c"}}', "\n</tool_call>"]


@pytest.fixture(scope="module")
def scripted():
    """A model that, after the chat's generation prompt, writes PIECES (each one token) then EOS."""
    tokenizer = tiny.tiny_tokenizer()
    tokenizer.add_tokens(PIECES)
    model = tiny.tiny_model("qwen3", vocab=len(tokenizer), eos_token_id=tokenizer.eos_token_id, max_positions=2048)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    start = tokenizer.apply_chat_template(ASK, tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                          return_dict=False)[-1]
    tiny.script_greedy(model, [start] + tokenizer.convert_tokens_to_ids(PIECES) + [tokenizer.eos_token_id])
    with serving(LLMEngine(model, num_blocks=64, block_size=16, tokenizer=tokenizer)) as (url, _):
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)


def test_auto_parses_the_models_tool_call(scripted):
    out = scripted.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, max_tokens=20, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "c"}
    plain = scripted.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, tool_choice="none",
                                             max_tokens=20, temperature=0).choices[0]
    assert plain.finish_reason == "stop" and plain.message.tool_calls is None
    assert plain.message.content == "".join(PIECES)  # "none": the text as written


def test_auto_streams_tool_calls_and_no_markup(scripted):
    pieces, calls, finish = [], [], None
    for chunk in scripted.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, max_tokens=20,
                                                  temperature=0, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if delta.content:
            pieces.append(delta.content)
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert not any("<tool" in p or "tool_call>" in p or '"name"' in p for p in pieces), pieces
    assert "".join(pieces) == "Let me check." and finish == "tool_calls"
    assert [(c.index, c.function.name) for c in calls] == [(0, "get_weather")] and calls[0].id
    assert json.loads(calls[0].function.arguments) == {"city": "Paris", "unit": "c"}
