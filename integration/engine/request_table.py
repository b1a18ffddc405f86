"""The engine's unfinished requests: taking them in at a step boundary, making their sequences,
and ending them.

A request is in the table from the step that applies its "add" command until it ends: in a
step's commit when all its completions have finished (:meth:`RequestTable.complete`), or
outside one, by an abort or after failing too often (:meth:`RequestTable.end`). Ending a request
frees its blocks at once. Outputs go to the front door (:meth:`RequestTable.report`) the moment
they are made, where they wait for their callers.
"""

from __future__ import annotations

import logging
import time

from .sequence import Request, Sequence, Status
from .stats import StatsLog

__all__ = ["RequestTable"]

logger = logging.getLogger(__name__)


class RequestTable:
    """``unfinished``: request id -> request, for every request applied and not yet ended.
    ``front_door``: where outputs are posted. ``tokenizer``: when given, every sequence gets a
    detokenizer (text and stop strings)."""

    def __init__(self, scheduler, stats_log: StatsLog, front_door, tokenizer=None):
        self.scheduler, self.stats_log, self.tokenizer = scheduler, stats_log, tokenizer
        self.front_door = front_door
        self.unfinished: dict[str, Request] = {}

    def apply(self, commands, requeue) -> None:
        """The front door's commands, in order: ``("add", Request)`` or ``("abort", request_id)``
        (an id not in the table is ignored: it ended meanwhile). A request whose sequence cannot be
        made (its detokenizer raised on the prompt) ends at once with finish_reason "error"; the
        others go on. Whatever else raises here (Ctrl-C) hands the command it interrupted and those
        after it back to the queue (``requeue``) first, so that no request is lost with its id
        still taken; an error in an abort drops that abort alone (its request runs on)."""
        for i, (kind, item) in enumerate(commands):
            try:
                if kind == "add":
                    self._add(item)
                elif item in self.unfinished:
                    self.end(self.unfinished[item], "abort")
            except BaseException as err:
                requeue(commands[i + 1:] if isinstance(err, Exception) else commands[i:])
                raise

    def _add(self, req: Request) -> None:
        try:
            seq = self.new_sequence(req, 0, list(req.prompt_token_ids))
            failed = False
        except Exception:  # noqa: BLE001 - this request's own fault: it ends, the engine goes on
            logger.exception("request %r: its sequence could not be made; it ends with finish_reason 'error'",
                             req.request_id)
            seq, failed = _plain_sequence(req, 0, list(req.prompt_token_ids)), True
        req.prompt_logprobs = [None] if req.params.prompt_logprobs is not None else None
        try:
            req.seqs.append(seq)
            self.unfinished[req.request_id] = req
            self.scheduler.add(seq)
        except BaseException:  # interrupted: undone, so that the add, handed back, applies afresh
            self.scheduler.discard(seq)
            req.seqs[:] = [s for s in req.seqs if s is not seq]
            self.unfinished.pop(req.request_id, None)
            raise
        if failed:
            self.end(req, "error")

    def new_sequence(self, req: Request, index: int, token_ids: list[int], matcher=None) -> Sequence:
        """Completion ``index`` of ``req``, holding ``token_ids`` (the prompt, or a parent's tokens);
        ``matcher``: its grammar state (a parent's fork; None: a fresh one when the request has a
        constraint)."""
        seq = _plain_sequence(req, index, token_ids)
        if req.constraint is not None:
            from .grammar_matcher import SequenceMatcher

            seq.matcher = matcher if matcher is not None else SequenceMatcher(req.constraint)
        if req.params.logprobs is not None:
            seq.logprobs = []
        if self.tokenizer is not None:
            seq.detokenizer = self._detokenizer(req)
        return seq

    def replay_detokenizer(self, seq: Sequence):
        """A fresh detokenizer that has seen ``seq``'s generated tokens (a rolled-back sequence's)."""
        detokenizer = self._detokenizer(seq.request)
        for token in seq.output_ids:
            detokenizer.push(token)
        return detokenizer

    def _detokenizer(self, req: Request):
        from .detokenizer import IncrementalDetokenizer

        params = req.params
        return IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, stop=params.stop,
                                      include_stop_str_in_output=params.include_stop_str_in_output,
                                      skip_special_tokens=params.skip_special_tokens, min_tokens=params.min_tokens)

    def finish(self, seq: Sequence, reason: str, *, text_may_fail: bool = False) -> None:
        """End one completion: its blocks freed, its text released. ``text_may_fail``: a
        detokenizer that cannot finish its text is logged, not raised (outside a step, where
        nothing would undo a completion left half-ended)."""
        self.scheduler.finish(seq, reason)
        try:
            if seq.detokenizer is not None:
                seq.detokenizer.finish()
        except Exception:  # noqa: BLE001 - its text stays what was released
            if not text_may_fail:
                raise
            logger.exception("request %r: its text could not be finished; it ends all the same",
                             seq.request.request_id)

    def complete(self, req: Request, now: float) -> None:
        """A request whose completions have all finished in this step's commit."""
        req.metrics.finished_time = now
        del self.unfinished[req.request_id]
        self.stats_log.record_end(req.metrics, max(len(s.output_ids) for s in req.seqs), "finished")

    def report(self, requests: list[Request], receipt=None) -> None:
        """Post the outputs of ``requests`` to the front door (see FrontDoor.post: ``receipt``)."""
        self.front_door.post([req.output() for req in requests], receipt)

    def end(self, req: Request, reason: str) -> None:
        """End a request outside a step's commit (abort, error): free its blocks and report it
        now. It ends even if a detokenizer cannot finish its text (else it would stay half-ended,
        blocks freed but id taken, for good)."""
        for seq in req.seqs:
            if seq.status != Status.FINISHED:
                self.finish(seq, reason, text_may_fail=True)
        req.metrics.finished_time = time.perf_counter()
        del self.unfinished[req.request_id]
        try:
            self.report([req])
        finally:  # it has ended, whatever interrupts its report
            self.stats_log.record_end(req.metrics, max(len(s.output_ids) for s in req.seqs),
                                      "aborted" if reason == "abort" else reason)


def _plain_sequence(req: Request, index: int, token_ids: list[int]) -> Sequence:
    """Completion ``index`` of ``req`` with nothing attached; its id names it in the block manager."""
    return Sequence(f"{req.request_id}#{index}", req, index, token_ids)
