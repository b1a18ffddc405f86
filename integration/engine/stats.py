"""The capacity report (``LLMEngine.stats()``) and its bookkeeping: step counters and the timeline of
every ended request."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Optional

import torch

from minipaged_ops import quantized

from .outputs import RequestMetrics
from .sequence import Status

__all__ = ["EndedRequest", "StatsLog"]


@dataclass(frozen=True)
class EndedRequest:
    metrics: RequestMetrics
    num_output_tokens: int  # of its longest completion
    reason: str  # "finished" (stop or length), "aborted" or "error"


class StatsLog:
    def __init__(self):
        self.counters: Counter = Counter()
        self.ended: list[EndedRequest] = []

    def record_end(self, metrics: RequestMetrics, num_output_tokens: int, reason: str) -> None:
        self.ended.append(EndedRequest(metrics, num_output_tokens, reason))

    def report(self, pool, scheduler, num_queued_adds: int, window_s: Optional[float] = None) -> dict:
        """``LLMEngine.stats()``: queues (``num_queued_adds``: added, not yet taken by a step), pool
        use, prefix-cache hit rate, preemptions, the counters and :meth:`latencies`."""
        usage = pool.usage()
        sched, c = scheduler, self.counters
        states = {status: {s.request.request_id for s in queue} for status, queue in
                  ((Status.RUNNING, sched.running), (Status.WAITING, sched.waiting), (Status.SWAPPED, sched.swapped))}
        return {
            "running": len(states[Status.RUNNING]),
            "waiting": len(states[Status.WAITING] - states[Status.RUNNING]) + num_queued_adds,
            "swapped": len(states[Status.SWAPPED]),
            **self.latencies(window_s),
            "active_tokens": usage["tokens_logical"],
            "blocks_total": usage["blocks_total"],
            "blocks_used": usage["blocks_used"],
            "block_utilisation": usage["tokens_stored"] / (usage["blocks_used"] * pool.block_size)
            if usage["blocks_used"] else 0.0,
            "shared_blocks": usage["blocks_shared"],
            "prefix_cache_queries": sched.prompt_tokens_looked_up,
            "prefix_cache_hits": sched.prompt_tokens_cached,
            "prefix_cache_hit_rate": sched.prompt_tokens_cached / sched.prompt_tokens_looked_up
            if sched.prompt_tokens_looked_up else 0.0,
            "prefill_tokens_computed": c["prefill_tokens_computed"],
            "decode_tokens_computed": c["decode_tokens_computed"],
            "prompt_tokens": c["prompt_tokens"],
            "generation_tokens": c["generation_tokens"],
            "preemptions": sched.num_preemptions,
            "swapped_blocks_out": sched.swapped_blocks_out,
            "steps": c["steps"],
            "failed_steps": c["failed_steps"],
            "kv_cache_dtype": quantized.cache_dtype_name(pool.dtype),
            "kv_bytes_per_block": pool.bytes_per_block,
            "kv_bytes_in_use": usage["kv_bytes_used"],
            "peak_kv_bytes": c["peak_blocks_used"] * pool.bytes_per_block,
        }

    def latencies(self, window_s: Optional[float] = None) -> dict:
        """Counts of ended requests by how they ended, and latency percentiles (seconds), over the
        requests that ended in the last ``window_s`` seconds (None: all). Queue time and TTFT count
        every request that got that far, aborted and errored ones included (their wait was real);
        TPOT and end-to-end latency count finished ones only (an abort cuts them short)."""
        since = -float("inf") if window_s is None else time.perf_counter() - window_s
        ended = [e for e in self.ended if e.metrics.finished_time is not None and e.metrics.finished_time >= since]
        done = [e for e in ended if e.reason == "finished"]
        queue = [e.metrics.first_scheduled_time - e.metrics.arrival_time for e in ended
                 if e.metrics.first_scheduled_time is not None]
        ttft = [e.metrics.first_token_time - e.metrics.arrival_time for e in ended if e.metrics.first_token_time is not None]
        e2e = [e.metrics.finished_time - e.metrics.arrival_time for e in done]
        tpot = [(e.metrics.finished_time - e.metrics.first_token_time) / (e.num_output_tokens - 1) for e in done
                if e.metrics.first_token_time is not None and e.num_output_tokens > 1]
        return {
            "finished": len(done),
            "aborted": sum(e.reason == "aborted" for e in ended),
            "errored": sum(e.reason == "error" for e in ended),
            "queue_time_s": _percentiles(queue),
            "ttft_s": _percentiles(ttft),
            "tpot_s": _percentiles(tpot),
            "e2e_latency_s": _percentiles(e2e),
        }


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p95": None, "p99": None}
    t = torch.tensor(values, dtype=torch.float64)
    return {f"p{q}": float(t.quantile(q / 100)) for q in (50, 95, 99)}
