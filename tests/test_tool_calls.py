"""Tool calls without a server: the Hermes-style parser, whole and streamed in every split (no
markup ever reaches the content), the forced-call schemas checked with ``jsonschema``, and the
request fields' plan (``response_format``, ``structured_outputs``, ``tools``, ``tool_choice``)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
jsonschema = pytest.importorskip("jsonschema")

from minipaged_ops.integration.server.output_plan import plan_outputs  # noqa: E402
from minipaged_ops.integration.server.protocol import RequestError  # noqa: E402
from minipaged_ops.integration.server.tool_calls import (  # noqa: E402
    ToolCallStream, forced_calls, forced_schema, parse_tool_calls)

WEATHER = {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"], "additionalProperties": False}}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}},
                                           "required": ["zone"]}}
TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": TIME}]


def block(name, arguments):
    return '<tool_call>\n' + json.dumps({"name": name, "arguments": arguments}) + '\n</tool_call>'


# (text, expected content, expected [(name, arguments)])
CASES = [
    ("Let me check.\n" + block("get_weather", {"city": "Paris"}) + "\n" + block("get_time", {"zone": "CET"}),
     "Let me check.", [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]),
    (block("get_weather", {"city": "<tool_call>"}), None, [("get_weather", {"city": "<tool_call>"})]),
    ("Hi <tool_call>not json</tool_call> there", "Hi <tool_call>not json</tool_call> there", []),
    ("A " + block("f", {}) + " B <tool_call>{\"name\": 3}</tool_call>", 'A B <tool_call>{"name": 3}</tool_call>',
     [("f", {})]),
    ("x " + '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', 'x <tool_call>{"name": "f", "arguments": [1]}'
     '</tool_call>', []),
    ("cut short <tool_call>{\"name\": \"f\"", "cut short <tool_call>{\"name\": \"f\"", []),
    ("ends with a partial <tool_ca", "ends with a partial <tool_ca", []),
    ("plain text, no calls\n", "plain text, no calls\n", []),
]


def named(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("text,content,calls", CASES)
def test_parse_whole(text, content, calls):
    got_content, got_calls = parse_tool_calls(text)
    assert got_content == content and named(got_calls) == calls
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in got_calls)
    assert len({c["id"] for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize("text,content,calls", CASES)
@pytest.mark.parametrize("step", [1, 2, 5, 11])
def test_parse_streamed_in_every_split(text, content, calls, step):
    stream, sent, found = ToolCallStream(), [], []
    for i in range(0, len(text), step):
        piece, new = stream.feed(text[i:i + step])
        sent.append(piece)
        found += new
        if calls:  # markup of a well-formed call never goes out, not even a piece of it
            assert "<tool" not in "".join(sent) or content and "<tool" in content
    piece, new = stream.finish()
    sent.append(piece)
    assert named(found) == calls and [c["index"] for c in found] == list(range(len(calls)))
    assert ("".join(sent) or None) == content


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = block("get_weather", {"city": "Oslo"}) + block("get_time", {"zone": "UTC"})
    content, calls = parse_tool_calls(text, limit=1)
    assert named(calls) == [("get_weather", {"city": "Oslo"})] and content == block("get_time", {"zone": "UTC"})


@pytest.mark.parametrize("parallel", [True, False])
def test_forced_schemas(parallel):
    required = forced_schema([WEATHER, TIME], "required", parallel)
    good = [{"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "get_time", "parameters": {"zone": "X"}}]
    if parallel:
        jsonschema.validate(good, required)
        assert named(forced_calls(json.dumps(good), "required")) == [(g["name"], g["parameters"]) for g in good]
    else:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(good, required)
        jsonschema.validate(good[:1], required)
    for bad in ([], [{"name": "get_weather", "parameters": {"zone": "X"}}], [{"name": "nope", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required)
    assert forced_schema([WEATHER, TIME], "get_time", parallel) == TIME["parameters"]
    assert named(forced_calls('{"zone": "UTC"}', "get_time")) == [("get_time", {"zone": "UTC"})]


def test_plan_outputs_turns_fields_into_one_constraint():
    assert plan_outputs({}).constraint is None
    assert plan_outputs({"response_format": {"type": "text"}}).constraint is None
    assert plan_outputs({"response_format": {"type": "json_object"}}).constraint.json_object
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for strict in (True, False, None):
        plan = plan_outputs({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": schema, "strict": strict}}})
        assert plan.constraint.json == schema
    assert plan_outputs({"structured_outputs": {"regex": "a+"}}).constraint.regex == "a+"
    plan = plan_outputs({"tools": TOOLS})
    assert plan.tool_choice == "auto" and plan.parses_calls and plan.constraint is None
    plan = plan_outputs({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False})
    assert plan.forced and plan.constraint.json == forced_schema([WEATHER, TIME], "required", False)
    plan = plan_outputs({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    assert plan.tool_choice == "get_time" and plan.constraint.json == TIME["parameters"]
    plan = plan_outputs({"tools": TOOLS, "tool_choice": "none"})
    assert plan.tools == TOOLS and not plan.parses_calls and plan.constraint is None


@pytest.mark.parametrize("fields,param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools.0"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_plan_outputs_refuses_naming_the_field(fields, param):
    with pytest.raises(RequestError) as err:
        plan_outputs(fields)
    assert err.value.param == param


def test_auto_tool_choice_needs_the_flag():
    with pytest.raises(RequestError, match="enable-auto-tool-choice"):
        plan_outputs({"tools": TOOLS}, auto_tool_choice=False)
    assert plan_outputs({"tools": TOOLS, "tool_choice": "required"}, auto_tool_choice=False).forced
