"""The request bodies the server accepts, in OpenAI's shapes (and vLLM's extras), and the OpenAI
error object it answers bad ones with. Responses are plain dicts built in ``completions.py``."""

from __future__ import annotations

from typing import Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class RequestError(Exception):
    """A request the server refuses, answered with an OpenAI error object naming ``param``."""

    def __init__(self, message: str, param: Optional[str] = None, status_code: int = 400):
        super().__init__(message)
        self.message, self.param, self.status_code = message, param, status_code


def error_body(message: str, param: Optional[str] = None, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


class _Strict(BaseModel):
    # strict: a str where a number belongs (or a bool where an int does) is refused, not coerced;
    # unknown fields are ignored, as OpenAI and vLLM do
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingFields(_Strict):
    """What both endpoints take: OpenAI's sampling fields, then vLLM's extras."""

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: int = 1
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    # vLLM's extras
    top_k: Optional[int] = None  # 0 or -1: off
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: int = 0
    ignore_eos: bool = False
    priority: int = 0
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True


class CompletionRequest(SamplingFields):
    # a text, a list of token ids, or a batch of either
    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: Optional[int] = Field(default=None, ge=0)
    echo: bool = False
    suffix: Optional[str] = None


class ContentPart(_Strict):
    type: str
    text: Optional[str] = None


class ChatMessage(_Strict):
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


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a text prompt, or chat messages through the template."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: Optional[str] = None
    tokens: list[int]


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
