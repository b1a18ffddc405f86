"""One step of the engine, all or nothing: the scheduler reserves the step's chunks, the planner
packs them into one ``[1, total_tokens]`` forward, the model runs it, and the commit takes what
the forward gave (prompt logprobs, the sampler's tokens, finished and forked sequences).

Whatever raises inside a step rolls it back from the snapshot taken before it
(:meth:`StepRunner.roll_back`): its sequences are requeued as for a recompute, and since every
draw is a function of the sequence's seed and position, redoing the step gives the same tokens.
A step stands once its outputs are posted to the front door: what raises after that (Ctrl-C)
undoes nothing, and the outputs wait there for their callers. If the rollback itself fails, the
engine's state no longer holds together: the step raises :class:`EngineDeadError`.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from ..planner import StepMetadata, plan_step
from .front_door import EngineDeadError
from .request_table import RequestTable
from .rollback import StepSnapshot
from .sequence import Request, Sequence, Status
from .speculative.speculator import Speculator, num_accepted, verify_rows
from .stats import StatsLog

__all__ = ["MAX_FAILURES", "StepRunner"]

# a request that fails this many steps in a row, the last one alone, ends with finish_reason "error"
MAX_FAILURES = 3


class StepRunner:
    """Executes the steps the scheduler reserves. ``max_model_len``: a sequence this long
    finishes with finish_reason "length"; ``sampler`` may be replaced (to record or fail);
    ``speculator``: counts what verify chunks (speculative proposals) kept."""

    def __init__(self, pool, scheduler, sampler, stats_log: StatsLog, request_table: RequestTable, *,
                 max_model_len: int, device, speculator: Speculator | None = None):
        self.pool, self.scheduler, self.sampler, self.speculator = pool, scheduler, sampler, speculator
        self.stats_log, self.request_table = stats_log, request_table
        self.max_model_len, self.device = max_model_len, device

    def run(self, run_model: Callable[[StepMetadata], torch.Tensor]) -> list[Request]:
        """Schedule, plan, ``run_model(meta)`` (the logits of ``meta.logits_indices``) and commit
        one step, posting its outputs last; returns the requests that changed. If anything raises
        before the outputs are posted, the step is rolled back and the exception re-raised."""
        scheduled: list = []
        snapshot = StepSnapshot(self.scheduler, self.stats_log)
        posted: list = []  # True once the outputs are in: from then on the step stands
        try:
            self.scheduler.schedule(scheduled)
            if not scheduled:
                return []
            snapshot.add_sequences(scheduled)
            counters = self.stats_log.counters
            counters["peak_blocks_used"] = max(counters["peak_blocks_used"], self.pool.blocks_in_use)
            self.pool.apply_copies()
            meta = plan_step(self.pool.block_manager, [c for _, c in scheduled], self.device)
            changed = self._commit(scheduled, meta, run_model(meta))
            for seq, _ in scheduled:
                seq.request.failures = 0
            self.request_table.report(changed, posted)
        except BaseException as failure:
            if not posted:
                self._roll_back_or_die(scheduled, snapshot, failure)
            raise
        return changed

    def _roll_back_or_die(self, scheduled: list, snapshot: StepSnapshot, failure: BaseException) -> None:
        try:
            self.roll_back(scheduled, snapshot)
        except BaseException as err:  # half undone: no later step could be trusted
            raise EngineDeadError(
                f"a step failed ({failure!r}) and rolling it back failed too ({err!r}): the engine's requests, "
                "KV blocks and counters no longer agree, so it takes no more calls; build a new engine") from err

    def _commit(self, scheduled: list, meta: StepMetadata, logits: torch.Tensor) -> list[Request]:
        """Count, sample and accept the step's tokens; returns the requests that changed."""
        c = self.stats_log.counters
        c["steps"] += 1
        for seq, chunk in scheduled:
            seq.num_computed += len(chunk.token_ids)
            decode = (len(chunk.token_ids) == 1 or chunk.num_proposals) and seq.output_ids
            c["decode_tokens_computed" if decode else "prefill_tokens_computed"] += len(chunk.token_ids)
        rows, seqs = [], []
        verified = []  # (sequence, verify chunk, index of its first row among seqs)
        first_rows = {i: first for i, first, _ in meta.all_logits_rows}
        for row, i in zip(meta.sample_rows, meta.sampled):
            seq, chunk = scheduled[i]
            if chunk.num_proposals:  # a row per position: each drawn as if the proposals before it were kept
                verified.append((seq, chunk, len(seqs)))
                rows.extend(range(first_rows[i], first_rows[i] + len(chunk.token_ids)))
                seqs.extend(verify_rows(seq, chunk.token_ids[1:]))
                continue
            if not seq.request.forked and seq.params.n > 1:
                self.fork(seq)
            # the prompt's first sample is drawn for every completion of the request
            for s in seq.request.seqs if seq.index == 0 and not seq.output_ids else [seq]:
                if s.status == Status.RUNNING and s.num_uncomputed == 0:
                    rows.append(row)
                    seqs.append(s)
        # the sampler works in place: no copy when each row is sampled once and none is read after
        every_row = rows == list(range(logits.shape[0])) and not meta.all_logits_rows
        sampled = self.sampler(logits if every_row else logits[rows], seqs) if seqs else []
        self.record_prompt_logprobs(meta, scheduled, logits)
        now = time.perf_counter()  # after the sampler's device sync
        changed: dict[str, Request] = {}
        verify_positions = {first + j for _, chunk, first in verified for j in range(len(chunk.token_ids))}
        for j, (seq, token) in enumerate(zip(seqs, sampled)):
            if j not in verify_positions:
                self._emit(seq, token, now, changed)
        for seq, chunk, first in verified:
            self._emit_verified(seq, chunk, sampled[first:first + len(chunk.token_ids)], now, changed)
        for req in changed.values():
            if all(s.status == Status.FINISHED for s in req.seqs):
                self.request_table.complete(req, now)
        return list(changed.values())

    def _emit(self, seq: Sequence, token, now: float, changed: dict) -> None:
        req = seq.request
        changed[req.request_id] = req
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
            self.stats_log.counters["prompt_tokens"] += len(req.prompt_token_ids)
        self.stats_log.counters["generation_tokens"] += 1
        self.accept(seq, token)

    def _emit_verified(self, seq: Sequence, chunk, tokens: list, now: float, changed: dict) -> None:
        """A verify chunk: the proposals the drawn tokens agree with, then the first drawn token
        that differs (or follows them all), one by one until one ends the sequence; the cache is
        cut back to the tokens kept (their K/V were written by this step)."""
        proposals = chunk.token_ids[1:]
        kept = num_accepted([t.token_id for t in tokens], proposals)
        self.speculator.record(len(proposals), kept)
        for token in tokens[:kept + 1]:
            if seq.status != Status.RUNNING:
                break  # an earlier token ended it (stop, max_tokens): nothing past it is emitted
            self._emit(seq, token, now, changed)
        if seq.status == Status.RUNNING:
            seq.num_computed = chunk.start + 1 + kept
            self.pool.block_manager.truncate(seq.seq_id, seq.num_computed)

    def record_prompt_logprobs(self, meta: StepMetadata, scheduled: list, logits: torch.Tensor) -> None:
        for i, first, count in meta.all_logits_rows:
            seq, chunk = scheduled[i]
            if chunk.num_proposals:
                continue  # a verify chunk's rows are drawn from, not prompt logprobs
            have, prompt = seq.request.prompt_logprobs, seq.prompt_token_ids
            # row j is position chunk.start + j; its logits give the logprob of the next prompt token
            lo = len(have) - 1 - chunk.start
            hi = min(count, len(prompt) - 1 - chunk.start)
            if hi <= lo:
                continue
            targets = prompt[chunk.start + lo + 1:chunk.start + hi + 1]
            have.extend(self.sampler.prompt_logprobs(logits[first + lo:first + hi], targets, seq.params.prompt_logprobs))

    def accept(self, seq: Sequence, sampled) -> None:
        """Append a sampled token to ``seq`` and finish it if the token ends it."""
        params, token = seq.params, sampled.token_id
        seq.token_ids.append(token)
        if seq.matcher is not None:
            seq.matcher.advance([token])
        if seq.logprobs is not None:
            seq.logprobs.append(sampled.logprobs)
        stop_str = seq.detokenizer.push(token) if seq.detokenizer is not None else None
        finish = self.request_table.finish
        if token in params.stop_token_ids:
            seq.stop_reason = token
            finish(seq, "stop")
        elif token in seq.eos_token_ids and not params.ignore_eos:
            finish(seq, "stop")
        elif stop_str is not None:
            seq.stop_reason = stop_str
            finish(seq, "stop")
        elif seq.matcher is not None and seq.matcher.is_terminated:  # the constraint is complete
            finish(seq, "stop")
        elif len(seq.output_ids) >= params.max_tokens or len(seq.token_ids) >= self.max_model_len:
            finish(seq, "length")

    def fork(self, parent: Sequence) -> None:
        """n > 1: the other completions share the prompt's blocks (copy-on-write later)."""
        req = parent.request
        req.forked = True
        for i in range(1, req.params.n):
            matcher = None if parent.matcher is None else parent.matcher.fork()
            child = self.request_table.new_sequence(req, i, list(parent.token_ids), matcher)
            child.num_computed = parent.num_computed
            child.status = Status.RUNNING
            self.pool.block_manager.fork(parent.seq_id, child.seq_id)
            req.seqs.append(child)
            self.scheduler.running.append(child)

    def roll_back(self, scheduled: list, snapshot: StepSnapshot) -> None:
        """Undo a failed step: its sequences go back to waiting as if preempted for recompute,
        with the tokens, logprobs and text they had before it. A request that failed alone after
        failing before ends with finish_reason "error"."""
        table = self.request_table
        snapshot.restore(scheduled, self.scheduler, table.unfinished, self.stats_log, table.replay_detokenizer)
        self.stats_log.counters["failed_steps"] += 1
        requests = {id(seq.request): seq.request for seq, _ in scheduled}.values()
        for req in requests:
            req.failures = req.failures + 1 if len(requests) == 1 else min(req.failures + 1, MAX_FAILURES - 1)
            if req.failures >= MAX_FAILURES:
                table.end(req, "error")
