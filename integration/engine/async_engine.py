"""``AsyncLLMEngine``: an :class:`LLMEngine` stepped by a thread of its own, for asyncio callers.

    engine = AsyncLLMEngine(LLMEngine.from_pretrained("/models/Qwen3-0.6B"))
    async for piece in engine.generate("Hello", SamplingParams(max_tokens=32), "req-1"):
        print(piece.outputs[0].text, end="")

One thread steps the engine; callers on the event loop hand their requests and aborts straight to
the engine's front door (thread-safe: they take effect at the next step boundary), which is the one
queue a request passes through. The thread sleeps on a condition while no request is live. Each
step's outputs are turned into pieces — what is new since the last piece of that request — and
handed to the waiting coroutine's event loop. Leaving the ``async for`` early (a client gone, a
task cancelled) aborts the request, which frees its blocks. If the thread stops (it died, or
:meth:`shutdown`), every waiter raises :class:`EngineDeadError`, its request is aborted, and
:meth:`check_health` raises: nothing hangs.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import AsyncIterator, Optional

from .streams import CompletionDelta, EngineDeadError, RequestDelta, RequestStream

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLMEngine", "CompletionDelta", "EngineDeadError", "RequestDelta", "RequestStream"]


class AsyncLLMEngine:
    """Drives ``engine`` from a thread of its own. ``stat_loggers``: objects with
    ``record(outputs, now)``, called in that thread after every step with the engine's
    RequestOutputs (for metrics). A step that raises is retried (the engine rolls a failed step
    back); ``max_step_failures`` failures in a row stop the thread, unless the last one ended a
    request with "error": the engine pins a failure that follows one request on that request (see
    LLMEngine.step), and those failed steps are its alone. But ``max_step_failures`` requests ended
    that way with no step succeeding in between stop it too: a model that fails on every input (a
    lost device or tensor-parallel worker) is a dead engine, not a run of bad prompts."""

    def __init__(self, engine, *, stat_loggers=(), max_step_failures: int = 3):
        if isinstance(max_step_failures, bool) or not isinstance(max_step_failures, int) or max_step_failures < 1:
            raise ValueError(f"AsyncLLMEngine: max_step_failures must be an int >= 1, got {max_step_failures!r}")
        self.engine = engine
        self.tokenizer = getattr(engine, "tokenizer", None)
        self.stat_loggers = list(stat_loggers)
        self.max_step_failures = max_step_failures
        self._wake = threading.Condition()  # guards the three below
        self._streams: dict[str, RequestStream] = {}  # request id -> its consumer, until its last piece is posted
        self._stopping = False
        self._dead = False  # set once when the thread stops: no stream is registered after that
        self.error: Optional[BaseException] = None  # why the thread stopped
        self._thread = threading.Thread(target=self._run, name="minipaged-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_pretrained(cls, path, *, dtype=None, device=None, stat_loggers=(), **engine_args) -> "AsyncLLMEngine":
        from .llm_engine import LLMEngine

        return cls(LLMEngine.from_pretrained(path, dtype=dtype, device=device, **engine_args), stat_loggers=stat_loggers)

    # ------------------------------------------------------------------ the caller's side

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self.error is None and not self._stopping

    def add_stat_logger(self, stat_logger) -> None:
        """Also call ``stat_logger.record(outputs, now)`` after every step from now on."""
        with self._wake:
            self.stat_loggers = [*self.stat_loggers, stat_logger]  # a new list: the thread may be iterating

    def check_health(self) -> None:
        if not self.is_running:
            raise EngineDeadError(f"the engine thread has stopped: {self.error!r}")

    async def add_request(self, request_id: str, prompt, params, *, priority: int = 0) -> "RequestStream":
        """Queue a request; returns its :class:`RequestStream` once the engine has taken it.
        ``prompt``: token ids, or a str encoded with the engine's tokenizer. Raises ValueError
        for a request the engine rejects (nothing queued), EngineDeadError if it has stopped."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("add_request: a text prompt needs an engine with a tokenizer; pass token ids")
            prompt = self.tokenizer.encode(prompt)
        prompt = list(prompt)
        constraint = getattr(params, "structured_outputs", None)
        if constraint is not None and self.engine.grammars is not None:
            # compiled (and cached) on a worker thread: neither this loop nor the engine's steps wait
            await asyncio.to_thread(self.engine.grammars.compile, constraint)
        self.check_health()
        stream = RequestStream(request_id, on_close=lambda: self._abort(request_id, stream))
        with self._wake:
            if self._dead:
                raise self._dead_error()
            if request_id in self._streams:  # (its last piece is on its way: the door may have freed the id)
                raise ValueError(f"add_request: request_id {request_id!r} is already in use by a request whose "
                                 "final output has not been returned yet")
            self._streams[request_id] = stream  # before the door: the next step may already report it
        try:
            self.engine.add_request(request_id, prompt, params, priority=priority)
        except BaseException:
            with self._wake:
                self._streams.pop(request_id, None)
            raise
        with self._wake:
            dead = self._dead
            self._wake.notify()
        if dead:  # the thread stopped meanwhile and failed the stream: the request must not wait to be stepped
            self.engine.abort_request(request_id)
        return stream

    async def generate(self, prompt, params, request_id: str, *, priority: int = 0) -> AsyncIterator[RequestDelta]:
        """:meth:`add_request`, then yield a :class:`RequestDelta` whenever the request has new
        tokens, the last one with ``finished=True``. Leaving the loop early, closing or cancelling
        the iterator aborts the request."""
        stream = await self.add_request(request_id, prompt, params, priority=priority)
        try:
            async for piece in stream:
                yield piece
        finally:
            stream.close()

    async def abort(self, request_id: str) -> None:
        """Abort a request (its blocks are freed); its iterator ends with finish_reason "abort"."""
        self.check_health()
        with self._wake:
            stream = self._streams.get(request_id)
        self._abort(request_id, stream, notify=True)

    async def stats(self, window_s=None) -> dict:
        """``engine.stats()`` (taken between two steps), without blocking the event loop."""
        self.check_health()
        return await asyncio.to_thread(lambda: self.engine.stats() if window_s is None
                                       else self.engine.stats(window_s=window_s))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the thread after its current step; waiters get EngineDeadError and their requests
        are aborted (ended by the LLMEngine's next step, if it is stepped again)."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ the engine thread

    def _dead_error(self) -> EngineDeadError:
        error = EngineDeadError(f"the engine thread has stopped: {self.error!r}")
        if not isinstance(self.error, EngineDeadError):
            error.__cause__ = self.error
        return error

    def _run(self) -> None:
        failures = pinned_since_success = 0
        try:
            errored = self.engine.stats()["errored"]  # requests the engine has ended with "error"
            while True:
                with self._wake:
                    while not (self._stopping or self.engine.has_unfinished_requests()):
                        self._wake.wait()
                    if self._stopping:
                        break
                try:
                    outputs = self.engine.step()
                except EngineDeadError:  # the engine itself is dead (its rollback failed): no retry
                    raise
                except Exception:
                    failures += 1
                    before, errored = errored, self.engine.stats()["errored"]
                    pinned_since_success += errored > before
                    if failures >= self.max_step_failures and (
                            errored == before or pinned_since_success >= self.max_step_failures):
                        raise
                    logger.exception("engine step failed (%d in a row); retrying", failures)
                    continue
                failures = 0
                # a step that only reported requests ended with "error" is not a success
                if any(c.finish_reason != "error" for out in outputs for c in out.outputs):
                    pinned_since_success = 0
                now = time.perf_counter()
                for stat_logger in self.stat_loggers:
                    try:
                        stat_logger.record(outputs, now)
                    except Exception:  # metrics must not stop the engine
                        logger.exception("stat logger %r failed", stat_logger)
                self._deliver(outputs)
            self.error = EngineDeadError("the engine was shut down")
        except BaseException as e:  # noqa: BLE001 (kept, then raised in every waiter)
            logger.exception("the engine thread died")
            self.error = e
        finally:
            self._fail_everyone()

    def _abort(self, request_id: str, stream: Optional[RequestStream], notify: bool = False) -> None:
        """Abort ``request_id`` if ``stream`` is still its consumer (an id can be reused once its
        request is over, and then belongs to someone else). From any thread."""
        with self._wake:
            if stream is None or self._streams.get(request_id) is not stream:
                return
            if not notify:
                del self._streams[request_id]  # nobody listens any more
        try:
            self.engine.abort_request(request_id)
        except Exception:  # noqa: BLE001 - an abort is a clean-up, called from finally blocks: nobody to tell
            logger.exception("aborting request %r failed", request_id)

    def _deliver(self, outputs) -> None:
        # one wake-up per event loop and step (call_soon_threadsafe writes to the loop's self-pipe);
        # a stream leaves _streams once its last piece is posted (else _fail_everyone wakes it)
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        with self._wake:
            streams = [(out, self._streams.get(out.request_id)) for out in outputs]
        for out, stream in streams:
            if stream is None:
                continue
            try:
                piece, last = stream.delta(out), out.finished
            except Exception as e:  # noqa: BLE001 - this request's fault: its consumer raises it, the rest go on
                logger.exception("request %r: its piece could not be made; it is aborted", out.request_id)
                piece, last = e, True
                if not out.finished:
                    self.engine.abort_request(out.request_id)
            if piece is not None:
                by_loop.setdefault(stream.loop, []).append((stream, piece, last))
        for loop, pieces in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, pieces)
            except RuntimeError:  # the consumers' event loop is closed: nobody will read them
                for stream in [stream for stream, _, last in pieces if not last]:
                    self.engine.abort_request(stream.request_id)
                pieces = [(stream, None, True) for stream, _, _ in pieces]
            with self._wake:
                for stream in [stream for stream, _, last in pieces if last]:
                    if self._streams.get(stream.request_id) is stream:
                        del self._streams[stream.request_id]

    def _fail_everyone(self) -> None:
        with self._wake:
            self._dead = True
            streams, self._streams = self._streams, {}
        error = self._dead_error()
        for stream in streams.values():
            try:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)
            except RuntimeError:  # that loop is closed: nobody waits there
                pass
        for request_id in streams:  # nobody reads them; the LLMEngine's next step (if any) ends them
            self.engine.abort_request(request_id)


def _put_all(pieces) -> None:
    """On a consumer's event loop: each piece into its stream's queue."""
    for stream, piece, _ in pieces:
        stream.queue.put_nowait(piece)
