"""The capacity report's bookkeeping: step counters and the timeline of every ended request."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Optional

import torch

from .outputs import RequestMetrics

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
