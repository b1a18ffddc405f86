"""What the generating endpoints share once a request has become prompts and SamplingParams:
queue it, then answer with the whole response or a stream of server-sent events; a client that
goes away (mid-stream or while waiting for a whole response) aborts its requests."""

from __future__ import annotations

import asyncio
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect

from .events import collect, stream_events
from .responses import Formatter, Shape
from .serving import Serving, close_all
from .shutdown import InFlight


def serving_of(raw: Request) -> Serving:
    return raw.app.state.serving


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def shape_of(request, **fields) -> Shape:
    """The request's :class:`Shape`: ``fields``, and what every generating request may ask."""
    options = request.stream_options
    include_usage = bool(request.stream and options and options.include_usage)
    return Shape(prompt_logprobs=request.prompt_logprobs, as_token_ids=request.return_tokens_as_token_ids,
                 include_usage=include_usage, continuous_usage=include_usage and options.continuous_usage_stats,
                 **fields)


async def respond(raw: Request, formatter: Formatter, params, request):
    in_flight: InFlight = raw.app.state.in_flight
    in_flight.check_open()
    prompts = formatter.prompts
    streams = await serving_of(raw).start(prompts, params, request.priority, formatter.id)  # refusals: HTTP errors
    if request.stream:
        events = stream_events(formatter, in_flight.pieces(streams), len(prompts) * params.n)
        return AbortingStreamingResponse(events, media_type="text/event-stream",
                                         background=BackgroundTask(close_all, streams))
    try:
        choices = await until_disconnected(raw.receive, collect(formatter, in_flight.pieces(streams)))
    finally:
        close_all(streams)
    if choices is None:  # the client is gone; its requests were aborted
        return Response(status_code=499)
    return JSONResponse(formatter.response(choices))


async def _wait_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(receive, coro):
    """``await coro``, unless the client disconnects first: then it is cancelled (aborting its
    requests) and the result is None."""
    work, gone = asyncio.ensure_future(coro), asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, gone):
            if not task.done():
                task.cancel()
        await asyncio.gather(work, gone, return_exceptions=True)
    return None if work.cancelled() else work.result()  # re-raises what the work raised


class AbortingStreamingResponse(StreamingResponse):
    """A stream that ends — and closes its generator, which aborts the requests — as soon as the
    client disconnects, even while no token is being sent (Starlette alone notices only on the
    next write)."""

    async def __call__(self, scope, receive, send):
        try:
            await until_disconnected(receive, super().__call__(scope, receive, send))
        except ClientDisconnect:  # noticed by Starlette on a write: gone all the same
            pass
        finally:
            await self.body_iterator.aclose()
            if self.background is not None:  # runs even when the stream was cut short
                await self.background()
