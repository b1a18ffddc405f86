"""The scheduler: which sequences compute which tokens this step, and who gives way when the
pool is short.

Each step it reserves slots, in order: the running decodes, then the running prefills, then
swapped sequences back in, then waiting sequences (chunked within ``max_num_batched_tokens``).
When a running sequence needs a block the pool lacks, the least important running sequence not
yet scheduled this step is preempted ("recompute": its blocks are freed, and it comes back
through the prefix cache or by recomputing; "swap": its blocks go to host memory). Importance is
arrival order ("fcfs") or ``(priority, arrival)`` ("priority"; lower first).

Progress: a sequence is brought in (swapped back or admitted) only if the pool keeps room for
every running sequence's next token besides it, and a swapped-in sequence computes in the step
that brings it back, so no sequence is brought in only to be pushed out again before it advances.
The most important running sequence is never a victim while another can give way, so any pool
that holds the largest single request finishes every workload.
"""

from __future__ import annotations

import bisect
import time
from typing import Callable

from ..kv_pool import KVPool
from ..planner import ScheduledChunk
from .speculative.speculator import Speculator
from .sequence import Sequence, Status

__all__ = ["Scheduler", "POLICIES", "PREEMPTION_MODES"]

POLICIES = ("fcfs", "priority")
PREEMPTION_MODES = ("recompute", "swap")


class Scheduler:
    def __init__(self, pool: KVPool, *, max_num_seqs: int, max_num_batched_tokens: int,
                 preemption_mode: str, policy: str, isolate_after: int, speculator: Speculator | None = None):
        self.pool = pool
        self.speculator = speculator  # None: no speculative decoding
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.policy = policy
        self.isolate_after = isolate_after
        self.waiting: list[Sequence] = []  # sorted by importance
        self.swapped: list[Sequence] = []  # sorted by importance
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.swapped_blocks_out = 0
        self.prompt_tokens_looked_up = 0
        self.prompt_tokens_cached = 0

    def key(self, seq: Sequence) -> tuple:
        """Sort key: the smallest is the most important."""
        req = seq.request
        return (req.priority, req.arrival, seq.index) if self.policy == "priority" else (req.arrival, seq.index)

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self._insert(self.waiting, seq)

    # ------------------------------------------------------------------ one step

    def schedule(self, scheduled: list[tuple[Sequence, ScheduledChunk]]) -> None:
        """Reserve slots for this step's chunks, appending ``(sequence, chunk)`` to ``scheduled`` as
        each is reserved (so a caller rolling back a failed step knows them all); decodes first.

        A request whose steps failed ``isolate_after`` times in a row runs alone (when the pool
        lets it), so that a failure that follows one request is pinned on it and no other."""
        suspect = next((s.request for s in self.waiting if s.request.failures >= self.isolate_after), None)
        if suspect is not None:
            self._admit(self.max_num_batched_tokens, scheduled, only=suspect)
            if scheduled:
                return
        bm = self.pool.block_manager
        budget = self.max_num_batched_tokens
        preemptions_before = self.num_preemptions
        done: set = set()
        by_importance = sorted(self.running, key=self.key)
        decodes = [s for s in by_importance if s.num_uncomputed == 1]
        prefills = [s for s in by_importance if s.num_uncomputed > 1]
        # prompt tokens this step (running prefills, or waiting ones with a free slot) make it compute-bound
        computes_prompts = bool(prefills) or bool(self.waiting) and self._slots_taken() < self.max_num_seqs
        if self.speculator is not None:
            self.speculator.retain({s.seq_id for s in self.running})
        speculate = self.speculator is not None and self.speculator.begin_step(len(decodes), computes_prompts)
        if speculate:
            self.speculator.prepare([s for s in decodes if _may_propose(s)], budget - 1)
        for seq in decodes + prefills:
            if seq.status != Status.RUNNING or budget == 0:
                continue
            want = min(seq.num_uncomputed, budget)
            while True:
                n = _largest(want, lambda m: bm.blocks_needed_to_append([(seq.seq_id, m)]), bm.num_free_blocks)
                if n:
                    break
                victim = max((s for s in self.running if s.seq_id not in done), key=self.key)
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.status == Status.RUNNING:
                proposals = self._proposals(seq, budget) if speculate and n == 1 == seq.num_uncomputed else []
                budget -= self._reserve(seq, n, scheduled, proposals)
                done.add(seq.seq_id)
        if self.num_preemptions == preemptions_before:  # the pool is short: bring nothing in
            budget = self._swap_in(budget, scheduled)
            if not self.swapped:
                self._admit(budget, scheduled)
        scheduled.sort(key=lambda item: len(item[1].token_ids) != 1)  # decodes lead: see planner

    def _swap_in(self, budget: int, scheduled: list) -> int:
        while self.swapped and budget > 0:
            seq = self.swapped[0]
            if self._slots_taken() + _width(seq.request) > self.max_num_seqs:
                break
            held = seq.token_ids[:seq.num_computed]
            n = min(seq.num_uncomputed, budget)
            need = self.pool.blocks_to_swap_in(held) + _blocks_to_grow(len(held), n, self.pool.block_size)
            if need + self._next_step_reserve() > self.pool.block_manager.num_free_blocks:
                break
            self.swapped.pop(0)
            self.pool.swap_in(seq.seq_id, held, seq.swapped_kv)
            seq.swapped_kv = None
            seq.status = Status.RUNNING
            self.running.append(seq)
            budget -= self._reserve(seq, n, scheduled)
        return budget

    def _admit(self, budget: int, scheduled: list, only=None) -> None:
        bm = self.pool.block_manager
        while budget > 0:
            seq = next((s for s in self.waiting if only is None or s.request is only), None)
            if seq is None:
                break
            req = seq.request
            if self._slots_taken() + _width(req) > self.max_num_seqs:
                break
            # prompt logprobs need the logits of every prompt token they lack: from the block
            # holding the first such token, cached tokens are recomputed (read, never rewritten)
            start = min(bm.cached_prefix_length(seq.token_ids),
                        _prompt_logprobs_from(seq) // bm.block_size * bm.block_size)
            room = bm.num_free_blocks - self._next_step_reserve()
            n = _largest(min(seq.num_uncomputed - start, budget),
                         lambda m: bm.blocks_needed_to_allocate([seq.token_ids[:start + m]]), room)
            if n == 0:
                break
            self.waiting.remove(seq)
            cached = bm.create_sequence(seq.seq_id, seq.token_ids[:start + n])
            assert cached >= start, (cached, start)
            self.prompt_tokens_looked_up += len(seq.token_ids)
            self.prompt_tokens_cached += cached
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = time.perf_counter()
                req.metrics.num_cached_tokens = cached
            seq.num_computed = start
            seq.status = Status.RUNNING
            self.running.append(seq)
            scheduled.append((seq, self._chunk(seq, seq.token_ids[start:start + n], start, cached - start)))
            budget -= n

    def _slots_taken(self) -> int:
        """Running sequences, counting a request that will fork at its first sample as all of them."""
        return sum(_width(seq.request) for seq in self.running)

    def _proposals(self, seq: Sequence, budget: int) -> list[int]:
        """A decoding sequence's speculative proposals that fit the step's token budget and leave
        the pool room for every running sequence's next token (speculation never preempts)."""
        if not _may_propose(seq):
            return []
        proposals = self.speculator.propose(seq, budget - 1)
        if not proposals:
            return []
        bm = self.pool.block_manager
        room = bm.num_free_blocks - self._next_step_reserve()
        base = bm.blocks_needed_to_append([(seq.seq_id, 1)])  # counted in the reserve already
        fits = _largest(len(proposals), lambda m: bm.blocks_needed_to_append([(seq.seq_id, 1 + m)]) - base, room)
        return proposals[:fits]

    def _reserve(self, seq: Sequence, n: int, scheduled: list, proposals: list[int] = ()) -> int:
        bm = self.pool.block_manager
        start = seq.num_computed
        new = seq.token_ids[start:start + n]
        if proposals:  # a verify chunk: the last token, then the proposals, taken back unless kept
            bm.append_token(seq.seq_id, new[0])
            bm.append_tokens(seq.seq_id, proposals, provisional=True)
            scheduled.append((seq, ScheduledChunk(seq.seq_id, new + list(proposals), start, all_logits=True,
                                                  num_proposals=len(proposals))))
            return n + len(proposals)
        if n == 1:
            bm.append_token(seq.seq_id, new[0])
        else:
            bm.append_tokens(seq.seq_id, new)
        scheduled.append((seq, self._chunk(seq, new, start)))
        return n

    def _chunk(self, seq: Sequence, new: list[int], start: int, cached: int = 0) -> ScheduledChunk:
        end = start + len(new)
        last_needed = len(seq.prompt_token_ids) - 2  # the row that gives the last prompt token's logprob
        all_logits = start <= last_needed and _prompt_logprobs_from(seq) <= min(end - 1, last_needed)
        return ScheduledChunk(seq.seq_id, new, start, sample=end == len(seq.token_ids), cached=cached,
                              all_logits=all_logits)

    def _next_step_reserve(self) -> int:
        """Blocks the running sequences need for one more token each."""
        return self.pool.block_manager.blocks_needed_to_append([(s.seq_id, 1) for s in self.running])

    # ------------------------------------------------------------------ moving sequences

    def preempt(self, seq: Sequence) -> None:
        """Take a running sequence off the pool (see the module docstring)."""
        self.running.remove(seq)
        self.num_preemptions += 1
        seq.request.metrics.num_preemptions += 1
        if self.preemption_mode == "swap" and seq.num_computed > 0:
            self.swapped_blocks_out += len(self.pool.block_manager.block_table(seq.seq_id))
            seq.swapped_kv = self.pool.swap_out(seq.seq_id)
            seq.status = Status.SWAPPED
            self._insert(self.swapped, seq)
        else:
            self.pool.block_manager.release_sequence(seq.seq_id)
            seq.num_computed = 0
            self.add(seq)

    def requeue(self, seq: Sequence, written: int) -> None:
        """Put a sequence of a failed step back to waiting, as if preempted for recompute; only
        its first ``written`` tokens' K/V may stay findable in the prefix cache."""
        self.discard(seq, written)
        self.add(seq)

    def discard(self, seq: Sequence, written: int = 0) -> None:
        """Forget a sequence: its blocks freed (keeping only its first ``written`` tokens
        findable), out of every queue."""
        bm = self.pool.block_manager
        if bm.has_sequence(seq.seq_id):
            bm.release_sequence(seq.seq_id, written=written)
        for queue in (self.running, self.waiting, self.swapped):
            if seq in queue:
                queue.remove(seq)
        seq.swapped_kv = None
        seq.num_computed = 0

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status == Status.RUNNING:
            self.pool.block_manager.release_sequence(seq.seq_id)
            self.running.remove(seq)
        elif seq.status == Status.WAITING:
            self.waiting.remove(seq)
        elif seq.status == Status.SWAPPED:
            self.swapped.remove(seq)
            seq.swapped_kv = None
        seq.status = Status.FINISHED
        seq.finish_reason = reason

    def _insert(self, queue: list[Sequence], seq: Sequence) -> None:
        keys = [self.key(s) for s in queue]
        queue.insert(bisect.bisect_right(keys, self.key(seq)), seq)


def _prompt_logprobs_from(seq: Sequence) -> int:
    """The first position whose logits the request's prompt logprobs still need (past the
    sequence's end: none)."""
    have = seq.request.prompt_logprobs
    if seq.index != 0 or have is None or len(have) >= len(seq.prompt_token_ids):
        return len(seq.token_ids)
    return len(have) - 1


def _width(req) -> int:
    """Running slots a sequence of ``req`` takes: n > 1 forks into n at its first sample."""
    return 1 if req.forked or req.params.n == 1 else req.params.n


def _largest(n: int, blocks_for: Callable[[int], int], room: int) -> int:
    """The largest ``m <= n`` with ``blocks_for(m) <= room`` (0: none); ``blocks_for`` grows with m."""
    if n <= 0 or blocks_for(n) <= room:
        return max(n, 0)
    lo, hi = 0, n - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if blocks_for(mid) <= room:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _blocks_to_grow(length: int, n: int, block_size: int) -> int:
    return -(-(length + n) // block_size) - -(-length // block_size)


def _may_propose(seq: Sequence) -> bool:
    """Whether a decoding sequence may speculate: not before its first token, which is sampled
    with the prompt (and forks n > 1 there)."""
    return bool(seq.output_ids) and (seq.params.n == 1 or seq.request.forked)
