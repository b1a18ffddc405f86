"""What a step may change, saved before it runs, so that a failed step can be undone.

A step changes its sequences (tokens, logprobs, text, grammar state, finish), their requests
(completions forked at the first sample, prompt logprobs, timestamps, failures in a row, the
registry of unfinished requests) and the counters. :meth:`StepSnapshot.restore` puts all of that back and requeues the
step's sequences for recompute; the block manager forgets what the step wrote.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Optional

from .sequence import Request, Sequence
from .stats import StatsLog

__all__ = ["StepSnapshot"]


@dataclass(frozen=True)
class _SequenceState:
    seq: Sequence
    num_tokens: int
    num_computed: int
    num_logprobs: Optional[int]
    finish_reason: Optional[str]
    stop_reason: Optional[object]


@dataclass(frozen=True)
class _RequestState:
    req: Request
    failures: int
    num_seqs: int
    forked: bool
    first_token_time: Optional[float]
    finished_time: Optional[float]
    num_prompt_logprobs: Optional[int]


class StepSnapshot:
    def __init__(self, scheduler, stats_log: StatsLog):
        """Save the counters; call before the scheduler runs."""
        self._scheduler_counts = (scheduler.prompt_tokens_looked_up, scheduler.prompt_tokens_cached)
        self._counters = Counter(stats_log.counters)
        self._num_ended = len(stats_log.ended)
        self._seqs: list[_SequenceState] = []
        self._requests: list[_RequestState] = []

    def add_sequences(self, scheduled: list) -> None:
        """Save the scheduled sequences and their requests; call before the step computes."""
        requests: dict[int, Request] = {}
        for seq, _ in scheduled:
            self._seqs.append(_SequenceState(seq, len(seq.token_ids), seq.num_computed,
                                             None if seq.logprobs is None else len(seq.logprobs),
                                             seq.finish_reason, seq.stop_reason))
            requests[id(seq.request)] = seq.request
        for req in requests.values():
            self._requests.append(_RequestState(
                req, req.failures, len(req.seqs), req.forked, req.metrics.first_token_time, req.metrics.finished_time,
                None if req.prompt_logprobs is None else len(req.prompt_logprobs)))

    def restore(self, scheduled: list, scheduler, registry: dict, stats_log: StatsLog, replay_detokenizer) -> None:
        """Undo the step: every sequence reserved this step back to waiting, with what it had;
        requests back in ``registry`` (id -> unfinished request); ``replay_detokenizer(seq)``
        rebuilds a sequence's detokenizer for the tokens it has."""
        saved = {id(s.seq): s for s in self._seqs}
        for state in self._requests:
            req = state.req
            for child in req.seqs[state.num_seqs:]:  # forked this step
                scheduler.discard(child)
            del req.seqs[state.num_seqs:]
            req.forked = state.forked
            req.failures = state.failures
            req.metrics.first_token_time = state.first_token_time
            req.metrics.finished_time = state.finished_time
            if state.num_prompt_logprobs is not None:
                del req.prompt_logprobs[state.num_prompt_logprobs:]
            registry.setdefault(req.request_id, req)
        for seq, _ in scheduled:
            state = saved.get(id(seq))
            written = seq.num_computed if state is None else state.num_computed
            if state is not None and len(seq.token_ids) != state.num_tokens:
                del seq.token_ids[state.num_tokens:]
                if seq.matcher is not None:  # the grammar state goes back with the tokens
                    seq.matcher.rollback(seq.matcher.num_tokens - len(seq.output_ids))
                if seq.logprobs is not None:
                    del seq.logprobs[state.num_logprobs:]
                if seq.detokenizer is not None:
                    seq.detokenizer = replay_detokenizer(seq)
            if state is not None:
                seq.finish_reason, seq.stop_reason = state.finish_reason, state.stop_reason
            scheduler.requeue(seq, written=written)
        scheduler.prompt_tokens_looked_up, scheduler.prompt_tokens_cached = self._scheduler_counts
        stats_log.counters.clear()
        stats_log.counters.update(self._counters)
        del stats_log.ended[self._num_ended:]
