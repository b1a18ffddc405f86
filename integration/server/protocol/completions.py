"""The body of ``POST /v1/completions``."""

from __future__ import annotations

from typing import Optional, Union

from pydantic import Field

from .common import SamplingFields


class CompletionRequest(SamplingFields):
    # a text, a list of token ids, or a batch of either
    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: Optional[int] = Field(default=None, ge=0)
    echo: bool = False
    best_of: Optional[int] = Field(default=None, ge=1)  # only best_of == n: every completion made is returned
