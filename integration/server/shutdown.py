"""Stopping the server while responses are open.

Told to stop (SIGTERM, Ctrl-C), uvicorn closes its listening socket and then waits for every open
connection to finish: a stream with a large ``max_tokens`` kept the process alive until it had
generated them all. :class:`GracefulServer` lets the requests in flight run for a grace period
(``--shutdown-timeout``; 0 by default, as in vLLM: a stop is a stop) and then ends them through
:class:`InFlight`: each engine request is aborted, a stream gets an OpenAI error event saying that
the server is shutting down and ``[DONE]``, a whole response HTTP 503 with the same error. From the
first moment of the shutdown new requests are refused the same way. uvicorn's own
``timeout_graceful_shutdown`` remains the backstop, a little after the grace period, for a response
that cannot even write its last event (a client that stopped reading): it cancels its task."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from typing import AsyncIterator, Optional

import uvicorn

from .events import ServerShuttingDown
from .serving import close_all, merge

logger = logging.getLogger(__name__)

# after the grace period: how long ended responses get to write their last events before uvicorn
# cancels them (they need milliseconds; a client that does not read would need forever)
WRITE_LAST_EVENTS_S = 3.0
FORCED_LAST_EVENTS_S = 0.5  # the same after a second Ctrl-C, which asks for an exit now


class InFlight:
    """The engine requests of the responses being written, so that a shutdown can refuse new ones
    (:meth:`refuse_new`) and end these (:meth:`end_all`). One per app (``app.state.in_flight``)."""

    def __init__(self):
        self._open: dict[object, list] = {}  # a token per response -> its RequestStreams
        self.refusing = False
        self.ending = False

    def check_open(self) -> None:
        """Raise :class:`ServerShuttingDown` once the shutdown has begun."""
        if self.refusing:
            raise ServerShuttingDown("the server is shutting down and takes no new requests")

    async def pieces(self, streams) -> AsyncIterator[tuple[int, object]]:
        """:func:`.serving.merge` of ``streams``, known to :meth:`end_all` while it runs; raises
        :class:`ServerShuttingDown` if that cut it short."""
        token = object()
        self._open[token] = streams
        try:
            if self.ending:  # queued while the requests were being ended: it ends too
                close_all(streams)
            async for item in merge(streams):
                yield item
        finally:
            del self._open[token]
        if self.ending and any(s.closed and not s.finished for s in streams):
            raise ServerShuttingDown("the server is shutting down; this request was aborted before it finished")

    def refuse_new(self) -> None:
        self.refusing = True

    def end_all(self) -> None:
        """Abort every open response's requests: each response ends at once, with the error."""
        self.refusing = self.ending = True
        if self._open:
            logger.info("shutting down: ending %d open response(s)", len(self._open))
        for streams in list(self._open.values()):
            close_all(streams)  # wakes their readers; the engine thread aborts them between two steps


def check_shutdown_timeout(seconds, name: str) -> None:
    """A grace period is a finite number of seconds >= 0; else ValueError naming ``name``."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) \
            or not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"{name} must be a finite number of seconds >= 0, got {seconds!r}")


class GracefulServer(uvicorn.Server):
    """``uvicorn.Server`` for an app of :func:`.app.build_app`, whose shutdown does not wait for
    open responses longer than ``shutdown_timeout`` seconds (see the module's docstring). It sets
    ``config.timeout_graceful_shutdown`` (the backstop) from ``shutdown_timeout``."""

    def __init__(self, config: uvicorn.Config, shutdown_timeout: float = 0.0):
        check_shutdown_timeout(shutdown_timeout, "GracefulServer: shutdown_timeout")
        state = getattr(config.app, "state", None)
        if not isinstance(getattr(state, "in_flight", None), InFlight):
            raise ValueError("GracefulServer: config.app must be an app of build_app (it has no state.in_flight)")
        self.in_flight: InFlight = state.in_flight
        self.shutdown_timeout = float(shutdown_timeout)
        config.timeout_graceful_shutdown = self.shutdown_timeout + WRITE_LAST_EVENTS_S
        super().__init__(config)

    async def shutdown(self, sockets: Optional[list] = None) -> None:
        self.in_flight.refuse_new()
        timer = asyncio.get_running_loop().call_later(self.shutdown_timeout, self.in_flight.end_all)
        try:
            await super().shutdown(sockets)  # closes the listener, waits for the connections
        finally:
            timer.cancel()
        if self.force_exit:  # a second Ctrl-C: uvicorn waited for nothing
            self.in_flight.end_all()  # the responses still get their last events, if they can be written now
            if self.server_state.tasks:
                await asyncio.wait(set(self.server_state.tasks), timeout=FORCED_LAST_EVENTS_S)
            # uvicorn skips the app's shutdown too: its lifespan task, left waiting, would be cancelled
            # with a traceback in the log
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.lifespan.shutdown(), FORCED_LAST_EVENTS_S)
