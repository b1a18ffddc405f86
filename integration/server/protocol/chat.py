"""The body of ``POST /v1/chat/completions``, and its messages as a chat template takes them."""

from __future__ import annotations

from typing import Optional, Union

from pydantic import ConfigDict, Field

from .common import RequestError, SamplingFields, Strict


class ContentPart(Strict):
    type: str
    text: Optional[str] = None


class ChatMessage(Strict):
    model_config = ConfigDict(strict=True, extra="allow")  # name, tool_call_id, ...: kept for the template
    role: str
    content: Optional[Union[str, list[ContentPart]]] = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0)
    add_generation_prompt: bool = True
    chat_template_kwargs: Optional[dict] = None
    tools: Optional[list[dict]] = None
    tool_choice: Optional[Union[str, dict]] = None
    parallel_tool_calls: Optional[bool] = None


def message_dicts(messages: list[ChatMessage]) -> list[dict]:
    """Messages as the chat template takes them; a list of content parts becomes its text."""
    out = []
    for i, m in enumerate(messages):
        d = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            if any(p.type != "text" or p.text is None for p in m.content):
                raise RequestError(f"messages[{i}].content: only text parts are supported", f"messages.{i}.content")
            d["content"] = "".join(p.text for p in m.content)
        elif m.content is None:
            d["content"] = ""
        out.append(d)
    return out
