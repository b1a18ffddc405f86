"""What a request asks of its output's shape: ``response_format`` (OpenAI), ``structured_outputs``
(vLLM's extra), ``tools`` with ``tool_choice`` and ``parallel_tool_calls``, turned into one
engine constraint and a plan for the tool calls. Everything is checked here, before the engine
sees the request; a refusal names the field.

- ``response_format``: ``text`` (nothing), ``json_object`` (JSON mode), ``json_schema`` (its
  ``schema`` enforced; ``strict`` true or false alike, as vLLM does: the grammar always holds).
- ``structured_outputs``: ``json``, ``regex``, ``choice``, ``grammar`` or ``json_object``, one of
  them (vLLM's names); not together with a ``response_format`` other than text.
- ``tool_choice``: "none" (tools reach the template, the text comes back as it is), "auto" (the
  default with tools: the model's ``<tool_call>`` blocks are parsed out), "required" or a named
  function (the output is forced to valid calls by a JSON-schema constraint, see ``tool_calls``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..engine import StructuredOutputsParams
from .protocol import RequestError
from .tool_calls import forced_schema

__all__ = ["OutputPlan", "plan_outputs"]

_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace")


@dataclass
class OutputPlan:
    constraint: Optional[StructuredOutputsParams] = None
    source: Optional[str] = None  # the request field the constraint comes from (named when it does not compile)
    tools: Optional[list[dict]] = None  # OpenAI's tool objects, for the chat template
    functions: list[dict] = field(default_factory=list)  # each tool's "function" object
    tool_choice: Optional[str] = None  # None (no tools), "none", "auto", "required" or a function's name
    parallel_tool_calls: bool = True

    @property
    def forced(self) -> bool:
        return self.tool_choice not in (None, "none", "auto")

    @property
    def parses_calls(self) -> bool:
        return self.tool_choice == "auto"


def plan_outputs(fields: dict, *, auto_tool_choice: bool = True, disable_any_whitespace: bool = False) -> OutputPlan:
    """``fields``: the request's ``response_format``, ``structured_outputs``, ``tools``,
    ``tool_choice`` and ``parallel_tool_calls`` as JSON values (absent or None: not given).
    ``auto_tool_choice``: the server parses the model's own calls (``--enable-auto-tool-choice``);
    ``disable_any_whitespace``: the server's default for JSON constraints (a request's
    ``structured_outputs.disable_any_whitespace`` overrides it)."""
    plan = OutputPlan(parallel_tool_calls=fields.get("parallel_tool_calls") is not False)
    constraint = _response_format(fields.get("response_format"), disable_any_whitespace)
    structured = _structured_outputs(fields.get("structured_outputs"), disable_any_whitespace)
    if constraint is not None and structured is not None:
        raise RequestError("give either response_format or structured_outputs, not both", "structured_outputs")
    plan.constraint = constraint or structured
    plan.source = "response_format" if constraint is not None else "structured_outputs"
    _plan_tools(plan, fields.get("tools"), fields.get("tool_choice"), auto_tool_choice)
    if plan.forced:
        if plan.constraint is not None:
            raise RequestError(f"tool_choice {plan.tool_choice!r} forces the output's shape; it cannot be combined "
                               "with response_format or structured_outputs", "tool_choice")
        plan.constraint = StructuredOutputsParams(
            json=forced_schema(plan.functions, plan.tool_choice, plan.parallel_tool_calls),
            disable_any_whitespace=disable_any_whitespace)
        plan.source = "tools"
    return plan


def _response_format(value, disable_any_whitespace: bool) -> Optional[StructuredOutputsParams]:
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise RequestError("response_format.type must be 'text', 'json_object' or 'json_schema'", "response_format")
    if value["type"] == "text":
        return None
    if value["type"] == "json_object":
        return StructuredOutputsParams(json_object=True, disable_any_whitespace=disable_any_whitespace)
    spec = value.get("json_schema")
    schema = spec.get("schema", spec.get("json_schema")) if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise RequestError("response_format.json_schema.schema must be a JSON schema object",
                           "response_format.json_schema")
    return _params("response_format.json_schema.schema", json=schema, disable_any_whitespace=disable_any_whitespace)


def _structured_outputs(value, disable_any_whitespace: bool) -> Optional[StructuredOutputsParams]:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RequestError("structured_outputs must be an object", "structured_outputs")
    unknown = sorted(k for k, v in value.items() if k not in _STRUCTURED_KEYS and v is not None)
    if unknown:
        raise RequestError(f"structured_outputs.{unknown[0]} is not supported (supported: "
                           f"{', '.join(_STRUCTURED_KEYS)})", f"structured_outputs.{unknown[0]}")
    given = {k: v for k, v in value.items() if v is not None}
    given.setdefault("disable_any_whitespace", disable_any_whitespace)
    return _params("structured_outputs", **given)


def _params(where: str, **kwargs) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kwargs)
    except ValueError as e:
        raise RequestError(f"{where}: {e}", where) from None


def _plan_tools(plan: OutputPlan, tools, tool_choice, auto_tool_choice: bool) -> None:
    if tools is None:
        if tool_choice not in (None, "none"):
            raise RequestError("tool_choice needs tools", "tool_choice")
        return
    if not isinstance(tools, list):
        raise RequestError("tools must be a list", "tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise RequestError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}", f"tools.{i}")
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise RequestError(f"tools[{i}].function.parameters must be a JSON schema object", f"tools.{i}")
        plan.functions.append(function)
    names = [f["name"] for f in plan.functions]
    if len(set(names)) != len(names):
        raise RequestError(f"tools: function names must be distinct, got {names}", "tools")
    plan.tools = tools
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name") if tool_choice.get("type") == "function" else None
        if name not in names:
            raise RequestError(f"tool_choice names function {name!r}, which is not among the tools {names}",
                               "tool_choice")
        tool_choice = name
    elif tool_choice not in ("none", "auto", "required"):
        raise RequestError("tool_choice must be 'none', 'auto', 'required' or "
                           "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
    if tool_choice in ("auto", "required") and not tools:
        raise RequestError(f"tool_choice {tool_choice!r} needs at least one tool", "tool_choice")
    if tool_choice == "auto" and not auto_tool_choice:
        raise RequestError('tool_choice "auto" needs the server started with --enable-auto-tool-choice',
                           "tool_choice")
    plan.tool_choice = tool_choice
