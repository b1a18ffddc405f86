"""What :class:`AsyncLLMEngine` hands its callers: per request a :class:`RequestStream` of
:class:`RequestDelta` pieces, each holding what its completions gained since the last piece."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Callable, Optional

from .front_door import EngineDeadError  # (defined there: LLMEngine raises it too)

__all__ = ["CompletionDelta", "EngineDeadError", "RequestDelta", "RequestStream"]


@dataclass
class CompletionDelta:
    """What one completion gained since its last piece."""

    index: int
    token_ids: list[int]  # sampled since the last piece
    text: str  # released text since the last piece ("" when the engine has no tokenizer)
    logprobs: Optional[list[dict[int, float]]]  # one dict per token in token_ids, when asked for
    finish_reason: Optional[str]  # "stop" | "length" | "abort" | "error"; None while running
    stop_reason: object = None  # the stop string or token id that ended it, if any
    num_tokens: int = 0  # generated so far, in all


@dataclass
class RequestDelta:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionDelta]  # the completions with something new
    finished: bool
    metrics: object  # the engine's RequestMetrics (perf_counter times)
    # SamplingParams(prompt_logprobs=k): the engine's list ([None, {token id: log-prob}, ...]), in
    # the first piece after the whole prompt is computed (so before or with the first token)
    prompt_logprobs: Optional[list] = None


_CLOSED = object()  # what close() hands a reader waiting on the queue


class RequestStream:
    """One request's pieces, in the order the engine made them: ``async for piece in stream``.
    :meth:`close` (idempotent) aborts the request unless it has finished, and ends the iteration
    (of a reader waiting in another task too); the engine thread feeds the queue and keeps, per
    completion, how much it has handed over."""

    def __init__(self, request_id: str, on_close: Callable[[], None]):
        self.request_id, self.on_close = request_id, on_close
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False
        self.closed = False
        # per completion, token ids and characters of text handed over (engine thread only)
        self.sent_tokens: dict[int, int] = {}
        self.sent_text: dict[int, int] = {}
        self.sent_prompt_logprobs = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> "RequestDelta":
        if self.finished or self.closed:
            raise StopAsyncIteration
        piece = await self.queue.get()
        if piece is _CLOSED:
            raise StopAsyncIteration
        if isinstance(piece, BaseException):
            self.finished = True
            raise piece
        self.finished = piece.finished
        return piece

    def close(self) -> None:
        if not self.finished and not self.closed:
            self.closed = True
            self.on_close()  # the engine stops feeding the queue: a reader waiting on it gets _CLOSED
            try:
                self.loop.call_soon_threadsafe(self.queue.put_nowait, _CLOSED)
            except RuntimeError:  # that loop is closed: nobody waits there
                pass

    def delta(self, out) -> Optional[RequestDelta]:
        """What the engine's RequestOutput ``out`` (cumulative) has that this stream has not yet
        handed over; None when nothing (called in the engine thread)."""
        deltas = []
        for c in out.outputs:
            sent = self.sent_tokens.get(c.index, 0)
            text = getattr(c, "text", None) or ""
            sent_text = self.sent_text.get(c.index, 0)
            if len(c.token_ids) == sent and len(text) == sent_text and c.finish_reason is None:
                continue
            logprobs = None if c.logprobs is None else list(c.logprobs[sent:])
            deltas.append(CompletionDelta(c.index, list(c.token_ids[sent:]), text[sent_text:], logprobs,
                                          c.finish_reason, getattr(c, "stop_reason", None), len(c.token_ids)))
            self.sent_tokens[c.index] = len(c.token_ids)
            self.sent_text[c.index] = len(text)
        prompt_logprobs = getattr(out, "prompt_logprobs", None)
        if self.sent_prompt_logprobs or prompt_logprobs is None or len(prompt_logprobs) < len(out.prompt_token_ids):
            prompt_logprobs = None
        self.sent_prompt_logprobs |= prompt_logprobs is not None
        if not deltas and not out.finished and prompt_logprobs is None:
            return None
        return RequestDelta(out.request_id, out.prompt_token_ids, deltas, out.finished, out.metrics, prompt_logprobs)
