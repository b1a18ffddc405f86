"""The request bodies the server accepts, in OpenAI's shapes (and vLLM's extras), one module per
endpoint family, and the OpenAI error object it answers bad ones with. Responses are plain dicts
built in ``responses.py``."""

from .chat import ChatCompletionRequest, ChatMessage, ContentPart, message_dicts
from .common import RequestError, SamplingFields, StreamOptions, Strict, error_body
from .completions import CompletionRequest
from .tokenize import DetokenizeRequest, TokenizeRequest

__all__ = ["ChatCompletionRequest", "ChatMessage", "CompletionRequest", "ContentPart", "DetokenizeRequest",
           "RequestError", "SamplingFields", "StreamOptions", "Strict", "TokenizeRequest", "error_body",
           "message_dicts"]
