"""What every endpoint's request shares: the OpenAI error object, the strict base model, and the
sampling fields of /v1/completions and /v1/chat/completions (OpenAI's, then vLLM's extras)."""

from __future__ import annotations

from typing import Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class RequestError(Exception):
    """A request the server refuses, answered with an OpenAI error object naming ``param``."""

    def __init__(self, message: str, param: Optional[str] = None, status_code: int = 400,
                 code: Optional[str] = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status_code, self.code, self.kind = message, param, status_code, code, kind


def error_body(message: str, param: Optional[str] = None, kind: str = "invalid_request_error",
               code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class Strict(BaseModel):
    # strict: a str where a number belongs (or a bool where an int does) is refused, not coerced;
    # an unknown field is refused too (nothing sent is silently ignored)
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk (with include_usage)


class SamplingFields(Strict):
    """What both endpoints take: OpenAI's sampling fields, then vLLM's extras. Other fields are
    kept (``model_extra``) for :func:`.refused.check_fields` to refuse by name."""

    # (documented as closed: a field this model does not name is refused, see .refused)
    model_config = ConfigDict(strict=True, extra="allow", json_schema_extra={"additionalProperties": False})

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
    logit_bias: Optional[dict[str, float]] = None  # {token id as text: bias in [-100, 100]}
    # informational: accepted, nothing to do with the answer
    user: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    store: Optional[bool] = None
    service_tier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    safety_identifier: Optional[str] = None
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
    prompt_logprobs: Optional[int] = Field(default=None, ge=0)
    return_tokens_as_token_ids: bool = False
    # the output's shape (see server/output_plan.py): OpenAI's response_format, vLLM's structured_outputs
    response_format: Optional[dict] = None
    structured_outputs: Optional[dict] = None
