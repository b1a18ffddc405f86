"""A chat answer's message (whole) or deltas (streamed) when the request has tools: the model's
text split into ``content`` and ``tool_calls`` as its ``tool_choice`` says (see ``output_plan``
and ``tool_calls``).

- "auto": Hermes-style blocks become calls (``finish_reason`` "tool_calls" when a completion that
  stopped made any), the rest is content; streamed, no markup ever reaches ``delta.content``.
- a named function: the output is the call's arguments; streamed as the call's head (id, name)
  then its arguments as they come. ``finish_reason`` stays "stop", as OpenAI answers a named
  choice.
- "required": the output is a JSON array of calls, sent whole when it is complete
  (``finish_reason`` "tool_calls").
- "none": the text as it is.

A forced output cut by ``max_tokens`` is not a valid call: whole, it comes back as content,
with ``finish_reason`` "length"; streamed, a named call's arguments stop where it was cut
("length") and "required" sends what it held as content.
"""

from __future__ import annotations

from typing import Optional

from .output_plan import OutputPlan
from .tool_calls import ToolCallStream, forced_calls, parse_tool_calls, tool_call

__all__ = ["ToolReplies"]


class ToolReplies:
    def __init__(self, plan: OutputPlan):
        self.plan = plan
        self._streams: dict[int, ToolCallStream] = {}  # "auto", per choice
        self._held: dict[int, str] = {}  # "required", per choice: the array so far
        self._opened: set[int] = set()  # named: choices whose call head was sent

    def _limit(self) -> Optional[int]:
        return None if self.plan.parallel_tool_calls else 1

    # ------------------------------------------------------------------ whole

    def message(self, text: str, finish_reason: Optional[str]) -> tuple[dict, Optional[str]]:
        choice = self.plan.tool_choice
        calls: list = []
        content: Optional[str] = text
        if choice == "auto":
            content, calls = parse_tool_calls(text, self._limit())
        elif self.plan.forced and finish_reason == "stop":
            content, calls = None, forced_calls(text, choice)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        return message, _finish(choice, calls, finish_reason)

    # ------------------------------------------------------------------ streamed

    def delta(self, index: int, text: Optional[str], finish_reason: Optional[str]) -> tuple[dict, Optional[str]]:
        choice, text = self.plan.tool_choice, text or ""
        if choice == "auto":
            stream = self._streams.setdefault(index, ToolCallStream(self._limit()))
            content, calls = stream.feed(text)
            if finish_reason is not None:
                content += stream.finish()[0]
            return _delta(content, calls), _finish(choice, [None] * stream.num_calls, finish_reason)
        if choice == "required":
            held = self._held[index] = self._held.get(index, "") + text
            if finish_reason is None:
                return {}, None
            if finish_reason != "stop":
                return _delta(held, []), finish_reason
            calls = [{"index": i, **c} for i, c in enumerate(forced_calls(held, choice))]
            return _delta("", calls), _finish(choice, calls, finish_reason)
        if self.plan.forced:  # a named function: its head once, then the arguments as they come
            head = index not in self._opened
            self._opened.add(index)
            if head:
                call = tool_call(choice, text, 0)
            elif text:
                call = {"index": 0, "function": {"arguments": text}}
            else:
                return {}, finish_reason
            return _delta("", [call]), finish_reason
        return _delta(text, []), finish_reason


def _delta(content: str, calls: list) -> dict:
    delta = {}
    if content:
        delta["content"] = content
    if calls:
        delta["tool_calls"] = calls
    return delta


def _finish(choice, calls, finish_reason):
    if calls and finish_reason == "stop" and choice in ("auto", "required"):
        return "tool_calls"
    return finish_reason
