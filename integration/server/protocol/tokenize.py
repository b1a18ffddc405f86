"""The bodies of vLLM's ``POST /tokenize`` and ``POST /detokenize``."""

from __future__ import annotations

from typing import Optional

from .chat import ChatMessage
from .common import Strict


class TokenizeRequest(Strict):
    """A text prompt, or chat messages through the template."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(Strict):
    model: Optional[str] = None
    tokens: list[int]
