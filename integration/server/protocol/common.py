"""What every endpoint's request shares: the OpenAI error object, the strict base model, and the
sampling fields of /v1/completions and /v1/chat/completions (OpenAI's, then vLLM's extras)."""

from __future__ import annotations

from typing import Optional, Union

from pydantic import BaseModel, ConfigDict


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
    # unknown fields are ignored, as OpenAI and vLLM do
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(Strict):
    include_usage: bool = False


class SamplingFields(Strict):
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
    # the output's shape (see server/output_plan.py): OpenAI's response_format, vLLM's structured_outputs
    response_format: Optional[dict] = None
    structured_outputs: Optional[dict] = None
