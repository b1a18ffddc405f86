"""A request's pieces (from :func:`.serving.merge`) into its answer: the whole response
(:func:`collect`), or the server-sent events of a stream (:func:`stream_events`: ``data: {...}``
chunks, then the usage chunk with empty ``choices`` when ``stream_options.include_usage`` is set,
then ``data: [DONE]``)."""

from __future__ import annotations

import logging
from typing import AsyncIterator

from ..engine.async_engine import EngineDeadError
from .protocol import error_body
from .responses import DONE, Choice, Formatter, sse

logger = logging.getLogger(__name__)


class GenerationError(RuntimeError):
    """The engine finished a completion with "error" (its failure repeated: see LLMEngine.step)."""


class ServerShuttingDown(RuntimeError):
    """A request refused, or ended before it finished, because the server is shutting down (an
    OpenAI error of type "service_unavailable"; HTTP 503 when the response has not begun)."""

    kind = "service_unavailable"


async def outputs(formatter: Formatter, pieces: AsyncIterator, started: set) -> AsyncIterator:
    """(choice index, :class:`~.responses.Output`) of every completion delta in ``pieces``, in
    order; a choice not in ``started`` gets its first (where an echo puts the prompt)."""
    async for prompt_index, piece in pieces:
        formatter.take(prompt_index, piece)
        for c in piece.outputs:
            index = formatter.index(prompt_index, c.index)
            if c.finish_reason == "error":
                raise GenerationError(f"generation failed for choice {index}")
            yield index, formatter.output(prompt_index, c, first=index not in started)


async def collect(formatter: Formatter, pieces: AsyncIterator) -> list[Choice]:
    """Every completion of a non-streamed request, whole."""
    choices: dict[int, Choice] = {}
    async for index, out in outputs(formatter, pieces, choices.keys()):
        choice = choices.setdefault(index, Choice(index))
        choice.text += out.text
        choice.token_ids += out.token_ids
        choice.logprobs += out.entries
        choice.finish_reason = out.finish_reason or choice.finish_reason
        choice.stop_reason = out.stop_reason if out.stop_reason is not None else choice.stop_reason
    return list(choices.values())


async def stream_events(formatter: Formatter, pieces: AsyncIterator, num_choices: int) -> AsyncIterator[str]:
    """The SSE body of a streamed response; a failure mid-stream (the engine's, or this request's
    alone) becomes an error event before ``[DONE]``."""
    sent_chars = [0] * num_choices  # per choice: text sent so far (for text_offset)
    tokens = [0] * num_choices  # per choice: tokens sent so far
    started: set[int] = set()
    if formatter.shape.chat:  # the assistant's role first, as OpenAI streams it
        for index in range(num_choices):
            yield formatter.chunk(index, None)
    try:
        async for index, out in outputs(formatter, pieces, started):
            if not out.token_ids and not out.text and out.finish_reason is None:
                continue
            started.add(index)
            tokens[index] += len(out.token_ids)
            yield formatter.chunk(index, out, sent_chars[index], tokens[index])
            sent_chars[index] += len(out.text)
    except Exception as e:  # noqa: BLE001 - the response has begun: an error event, not a cut connection
        if not isinstance(e, (EngineDeadError, GenerationError, ServerShuttingDown)):  # unforeseen (a piece
            logger.exception("streamed response %s failed", formatter.id)  # the engine could not make, say)
        kind = ServerShuttingDown.kind if isinstance(e, ServerShuttingDown) else "internal_server_error"
        yield sse(error_body(str(e) or type(e).__name__, kind=kind))
        yield DONE
        return
    finally:
        await pieces.aclose()  # ends (aborts) whatever still runs when the stream is closed early
    if formatter.shape.include_usage:
        yield formatter.usage_chunk(sum(tokens))
    yield DONE
