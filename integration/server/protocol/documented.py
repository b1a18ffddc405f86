"""The answers' shapes as the OpenAPI schema documents them (``/openapi.json``, what schemathesis
checks every answer against): OpenAI's error object for every refusal, and the success bodies.
The routes build plain dicts; these models only describe them (extra keys allowed)."""

from __future__ import annotations

from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(_Open):
    message: str
    type: str
    param: Optional[str]
    code: Optional[str]


class ErrorResponse(_Open):
    error: ErrorDetail


class Usage(_Open):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class _Choice(_Open):
    index: int
    logprobs: Optional[dict[str, Any]]
    finish_reason: Optional[str]
    stop_reason: Union[int, str, None]


class _Response(_Open):
    id: str
    object: str
    created: int
    model: str
    usage: Usage


class CompletionChoice(_Choice):
    text: str


class CompletionResponse(_Response):
    choices: list[CompletionChoice]


class ChatMessageOut(_Open):
    role: str
    content: str


class ChatChoice(_Choice):
    message: ChatMessageOut


class ChatCompletionResponse(_Response):
    choices: list[ChatChoice]


class ModelCard(_Open):
    id: str
    object: str
    created: int
    owned_by: str


class ModelList(_Open):
    object: str
    data: list[ModelCard]


class TokenizeResponse(_Open):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]]


class DetokenizeResponse(_Open):
    prompt: str


def _error(description: str) -> dict:
    return {"model": ErrorResponse, "description": description}


# what every guarded route may answer besides its success
ERRORS = {400: _error("a refused request, naming the field"), 401: _error("a missing or wrong API key"),
          404: _error("an unknown model"), 413: _error("a body over the size limit"),
          500: _error("the engine failed"), 503: _error("the server is shutting down")}
# a generating route: JSON, or server-sent events when the request streams
STREAMED = {"content": {"text/event-stream": {"schema": {"type": "string"}}}}
