"""Tool calls: the constraint that forces one (``tool_choice`` "required" or a named function),
and the parser that finds the model's own calls in its text (``tool_choice`` "auto").

Forced calls are vLLM's: a named function's output is its arguments, constrained by the
function's ``parameters`` schema; "required" outputs a JSON array of ``{"name", "parameters"}``
objects, one schema per tool (``maxItems`` 1 unless ``parallel_tool_calls``).

"auto" reads Hermes-style blocks, as Qwen3 and Hermes models write them (vLLM's ``hermes``
parser): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. Each well-formed block
becomes a call; a malformed one (not JSON, no name, arguments not an object, never closed) stays
in the text. :class:`ToolCallStream` does the same on a stream, holding back text that may be
the start of a block, so that no markup reaches ``delta.content``.
"""

from __future__ import annotations

import json
import uuid
from typing import Optional

__all__ = ["CALL_END", "CALL_START", "ToolCallStream", "forced_calls", "forced_schema", "parse_tool_calls",
           "tool_call"]

CALL_START, CALL_END = "<tool_call>", "</tool_call>"


def tool_call(name: str, arguments: str, index: Optional[int] = None) -> dict:
    """One call in OpenAI's shape (``index``: in a stream's delta); ``arguments`` is JSON text."""
    call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}
    return call if index is None else {"index": index, **call}


# ---------------------------------------------------------------------------------- forced calls


def forced_schema(tools: list[dict], choice, parallel: bool) -> dict:
    """The JSON schema the output must obey: ``choice`` is "required" or a function's name."""
    if choice != "required":
        return _parameters(next(t for t in tools if t["name"] == choice))
    items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t["name"]]},
                                               "parameters": _parameters(t)},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def forced_calls(text: str, choice) -> list[dict]:
    """The calls of a forced output (it parses: the constraint saw to that, unless it was cut)."""
    if choice != "required":
        return [tool_call(choice, text)]
    return [tool_call(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in json.loads(text)]


def _parameters(tool: dict) -> dict:
    return tool.get("parameters") or {"type": "object", "properties": {}}


# ---------------------------------------------------------------------------------- "auto"


def parse_tool_calls(text: str, limit: Optional[int] = None) -> tuple[Optional[str], list[dict]]:
    """(content, calls) of a whole output: the well-formed blocks (the first ``limit`` of them)
    become calls; the rest of the text is the content (None when only whitespace), as
    :class:`ToolCallStream` sends it. An output with no call is returned as it is."""
    stream = ToolCallStream(limit)
    pieces = [stream.feed(text), stream.finish()]
    calls = [c for _, found in pieces for c in found]
    content = "".join(c for c, _ in pieces)
    if not calls:
        return text, []
    for c in calls:
        del c["index"]
    return content if content.strip() else None, calls


class ToolCallStream:
    """Splits streamed text into content and tool calls. :meth:`feed` takes the next text and
    returns ``(content, calls)`` ready to send (calls with their stream ``index``); :meth:`finish`
    releases what was held back. Whitespace is held until text follows it: before a call, and
    at the end of an output with calls, it is dropped."""

    def __init__(self, limit: Optional[int] = None):
        self._limit = limit  # None: every call; 1: parallel_tool_calls=False
        self._held = ""  # content not sent yet: a possible CALL_START prefix, or trailing whitespace
        self._block: Optional[str] = None  # inside a block: its text so far
        self._gap = ""  # the whitespace before the open block (text again if the block is malformed)
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        out, calls = [], []
        text = self._held + text
        self._held = ""
        while text:
            if self._block is not None:
                text = self._block + text
                end = text.find(CALL_END)
                if end < 0:
                    self._block = text
                    break
                block, text, self._block = text[:end], text[end + len(CALL_END):], None
                call = self._call(block)
                if call is None:
                    out.append(self._gap + CALL_START + block + CALL_END)
                else:
                    calls.append(call)
                continue
            start = text.find(CALL_START) if self._room() else -1
            if start >= 0:
                before = text[:start].rstrip()
                out.append(before)
                self._gap, self._block, text = text[len(before):start], "", text[start + len(CALL_START):]
                continue
            keep = _partial_start(text) if self._room() else 0
            body, self._held = text[:len(text) - keep], text[len(text) - keep:]
            stripped = body.rstrip()  # whitespace waits: a call may follow
            self._held = body[len(stripped):] + self._held
            out.append(stripped)
            break
        return "".join(out), calls

    def finish(self) -> tuple[str, list[dict]]:
        """The held-back text (an unclosed block stays text; trailing whitespace after a call goes)."""
        content = self._held if not self.num_calls else self._held.rstrip()
        if self._block is not None:
            content += self._gap + CALL_START + self._block
        self._held, self._block = "", None
        return content, []

    def _room(self) -> bool:
        return self._limit is None or self.num_calls < self._limit

    def _call(self, block: str) -> Optional[dict]:
        try:
            data = json.loads(block)
        except json.JSONDecodeError:
            return None
        if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
            return None
        arguments = data.get("arguments", data.get("parameters", {}))
        if not isinstance(arguments, dict):
            return None
        call = tool_call(data["name"], json.dumps(arguments, ensure_ascii=False), self.num_calls)
        self.num_calls += 1
        return call


def _partial_start(text: str) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of CALL_START."""
    for n in range(min(len(CALL_START) - 1, len(text)), 0, -1):
        if CALL_START.startswith(text[-n:]):
            return n
    return 0
