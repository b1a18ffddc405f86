"""OpenAI's response shapes for /v1/completions and /v1/chat/completions, whole and streamed as
server-sent events (``data: {...}`` chunks, then the usage chunk with empty ``choices`` when
``stream_options.include_usage`` is set, then ``data: [DONE]``)."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional

from .protocol import error_body

logger = logging.getLogger(__name__)


@dataclass
class Choice:
    """One completion as it accumulates: index in the response is prompt * n + completion."""

    index: int
    text: str = ""
    token_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # (token id, {token id: log-prob}) per token
    finish_reason: Optional[str] = None


class Formatter:
    """Builds one endpoint's bodies. ``chat``: chat.completion shapes, else text_completion."""

    def __init__(self, serving, request_id: str, chat: bool, n: int, logprobs: Optional[int], tools=None):
        self.serving, self.id, self.chat, self.n, self.logprobs = serving, request_id, chat, n, logprobs
        self.tools = tools  # a chat request's ToolReplies (None: no tools): content and tool_calls
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.serving.served_model_name}

    def index(self, prompt_index: int, completion_index: int) -> int:
        return prompt_index * self.n + completion_index

    # ------------------------------------------------------------------ logprobs

    def format_logprobs(self, entries, text_start: int = 0):
        """``entries``: (token id, {token id: log-prob}) pairs; None when not asked for."""
        if self.logprobs is None:
            return None
        text_of = self.serving.token_text
        if self.chat:
            content = []
            for token, dist in entries:
                top = sorted(dist.items(), key=lambda kv: -kv[1])[:self.logprobs]
                content.append({"token": text_of(token), "logprob": dist[token],
                                "bytes": list(text_of(token).encode()),
                                "top_logprobs": [{"token": text_of(t), "logprob": lp, "bytes": list(text_of(t).encode())}
                                                 for t, lp in top]})
            return {"content": content}
        tokens, offsets, offset = [], [], text_start
        for token, _ in entries:
            tokens.append(text_of(token))
            offsets.append(offset)
            offset += len(tokens[-1])
        return {"tokens": tokens, "token_logprobs": [dist[token] for token, dist in entries],
                "top_logprobs": [{text_of(t): lp for t, lp in dist.items()} for _, dist in entries],
                "text_offset": offsets}

    # ------------------------------------------------------------------ whole responses

    def response(self, choices: list[Choice], prompt_tokens: int) -> dict:
        body = self._head(self.object)
        body["choices"] = []
        for c in sorted(choices, key=lambda c: c.index):
            choice = {"index": c.index}
            finish_reason = c.finish_reason
            if self.chat and self.tools is not None:
                choice["message"], finish_reason = self.tools.message(c.text, c.finish_reason)
            elif self.chat:
                choice["message"] = {"role": "assistant", "content": c.text}
            else:
                choice["text"] = c.text
            choice["logprobs"] = self.format_logprobs(c.logprobs)
            choice["finish_reason"] = finish_reason
            body["choices"].append(choice)
        body["usage"] = usage(prompt_tokens, sum(len(c.token_ids) for c in choices))
        return body

    # ------------------------------------------------------------------ streamed responses

    def chunk(self, index: int, text: Optional[str], entries, finish_reason, text_start: int,
              role: bool = False, include_usage: bool = False) -> str:
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        choice = {"index": index}
        if self.chat and self.tools is not None and not role:
            choice["delta"], finish_reason = self.tools.delta(index, text, finish_reason)
        elif self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        choice["logprobs"] = None if role else self.format_logprobs(entries, text_start)
        choice["finish_reason"] = finish_reason
        body["choices"] = [choice]
        if include_usage:
            body["usage"] = None
        return sse(body)

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> str:
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = []
        body["usage"] = usage(prompt_tokens, completion_tokens)
        return sse(body)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"


class GenerationError(RuntimeError):
    """The engine finished a completion with "error" (its failure repeated: see LLMEngine.step)."""


class ServerShuttingDown(RuntimeError):
    """A request refused, or ended before it finished, because the server is shutting down (an
    OpenAI error of type "service_unavailable"; HTTP 503 when the response has not begun)."""

    kind = "service_unavailable"


def _entries(c) -> list:
    return [] if c.logprobs is None else list(zip(c.token_ids, c.logprobs))


async def collect(formatter: Formatter, pieces: AsyncIterator) -> list[Choice]:
    """Every completion of a non-streamed request, whole."""
    choices: dict[int, Choice] = {}
    async for prompt_index, piece in pieces:
        for c in piece.outputs:
            choice = choices.setdefault(formatter.index(prompt_index, c.index), Choice(formatter.index(prompt_index, c.index)))
            choice.text += c.text
            choice.token_ids += c.token_ids
            choice.logprobs += _entries(c)
            choice.finish_reason = c.finish_reason or choice.finish_reason
            if c.finish_reason == "error":
                raise GenerationError(f"generation failed for choice {choice.index}")
    return list(choices.values())


async def stream_events(formatter: Formatter, pieces: AsyncIterator, num_choices: int, prompt_tokens: int,
                        include_usage: bool) -> AsyncIterator[str]:
    """The SSE body of a streamed response from :func:`.serving.merge`'s pieces; a failure mid-stream
    (the engine's, or this request's alone) becomes an error event before ``[DONE]``."""
    from ..engine.async_engine import EngineDeadError

    sent_chars = [0] * num_choices  # per choice: text sent so far (for text_offset)
    completion_tokens = 0
    if formatter.chat:  # the assistant's role first, as OpenAI streams it
        for index in range(num_choices):
            yield formatter.chunk(index, None, None, None, 0, role=True, include_usage=include_usage)
    try:
        async for prompt_index, piece in pieces:
            for c in piece.outputs:
                index = formatter.index(prompt_index, c.index)
                if c.finish_reason == "error":
                    raise GenerationError(f"generation failed for choice {index}")
                if not c.token_ids and not c.text and c.finish_reason is None:
                    continue
                completion_tokens += len(c.token_ids)
                text = None if formatter.chat and not c.text and c.finish_reason else c.text
                yield formatter.chunk(index, text, _entries(c), c.finish_reason, sent_chars[index],
                                      include_usage=include_usage)
                sent_chars[index] += len(c.text)
    except Exception as e:  # noqa: BLE001 - the response has begun: an error event, not a cut connection
        if not isinstance(e, (EngineDeadError, GenerationError, ServerShuttingDown)):  # unforeseen (a piece
            logger.exception("streamed response %s failed", formatter.id)  # the engine could not make, say)
        kind = ServerShuttingDown.kind if isinstance(e, ServerShuttingDown) else "internal_server_error"
        yield sse(error_body(str(e) or type(e).__name__, kind=kind))
        yield DONE
        return
    finally:
        await pieces.aclose()  # ends (aborts) whatever still runs when the stream is closed early
    if include_usage:
        yield formatter.usage_chunk(prompt_tokens, completion_tokens)
    yield DONE
