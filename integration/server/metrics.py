"""Prometheus metrics under vLLM's names with a ``minipaged:`` prefix, from prometheus-client.

The engine keeps its own counts (tokens, prefix-cache lookups, preemptions) and queue lengths:
they are read from ``engine.stats()`` when ``/metrics`` is scraped, so there is one source of
truth. What it does not keep per token — the latency histograms and finished requests by reason —
comes from :meth:`ServerMetrics.record`, which the engine thread calls after every step with that
step's RequestOutputs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "minipaged:"
# vLLM's buckets (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)


# engine.stats() key -> (metric name, type, help)
FROM_STATS = {
    "running": ("num_requests_running", "gauge", "Requests with sequences in the running batch."),
    "waiting": ("num_requests_waiting", "gauge", "Requests waiting (or swapped out) to be scheduled."),
    "kv_cache_usage_perc": ("kv_cache_usage_perc", "gauge",
                            "KV-cache usage: blocks referenced by live sequences / all blocks (1 = full)."),
    "prompt_tokens": ("prompt_tokens", "counter", "Prompt tokens of requests that produced a token."),
    "generation_tokens": ("generation_tokens", "counter", "Generated tokens."),
    "prefix_cache_queries": ("prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("prefix_cache_hits", "counter", "Prompt tokens found in the prefix cache."),
    "preemptions": ("num_preemptions", "counter", "Preemptions of running sequences."),
    "weight_bytes": ("weight_bytes", "gauge", "Bytes of the model's parameters and buffers (its weights as held)."),
}
# with speculative decoding on (the keys are in engine.stats() only then)
SPEC_DECODE_STATS = {
    "spec_decode_num_drafts": "Verified chunks of speculative proposals.",
    "spec_decode_num_draft_tokens": "Speculative tokens proposed.",
    "spec_decode_num_accepted_tokens": "Speculative tokens accepted.",
}


@dataclass
class _Seen:
    """What the metrics have seen of one request so far."""

    tokens: int = 0
    last_token_time: Optional[float] = None


class ServerMetrics:
    """One registry per server (so tests can run several in one process)."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def counter(name, doc, extra=()):
            return Counter(PREFIX + name, doc, labels + list(extra), registry=r)

        def histogram(name, doc, buckets):
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.success = counter("request_success", "Finished requests, by finish reason.", ["finished_reason"])
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between a request's successive tokens.",
                             ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish of finished requests.",
                             REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.", REQUEST_BUCKETS)
        self.model_name = model_name
        self.stats: dict = {}  # the last engine.stats() (see update_from_stats)
        r.register(_FromStats(self))
        self._seen: dict[str, _Seen] = {}

    def record(self, outputs, now: float) -> None:
        """Count one step's outputs (called in the engine thread)."""
        for out in outputs:
            seen = self._seen.setdefault(out.request_id, _Seen())
            tokens = sum(len(c.token_ids) for c in out.outputs)
            m = out.metrics
            if tokens > seen.tokens:
                if seen.last_token_time is None:  # the first token(s) of this request
                    if m.first_token_time is not None:
                        self.ttft.observe(m.first_token_time - m.arrival_time)
                    if m.first_scheduled_time is not None:
                        self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
                else:
                    self.itl.observe(now - seen.last_token_time)
                seen.tokens, seen.last_token_time = tokens, now
            if out.finished:
                del self._seen[out.request_id]
                reasons = {c.finish_reason for c in out.outputs}
                reason = "abort" if "abort" in reasons else "error" if "error" in reasons else \
                    "stop" if "stop" in reasons else "length"
                self.success.labels(self.model_name, reason).inc()
                if reason in ("stop", "length") and m.finished_time is not None:
                    self.e2e.observe(m.finished_time - m.arrival_time)

    def update_from_stats(self, stats: dict) -> None:
        """Take ``engine.stats()`` (just before a scrape)."""
        total = stats.get("blocks_total") or 0
        self.stats = {**stats, "waiting": stats.get("waiting", 0) + stats.get("swapped", 0),
                      "kv_cache_usage_perc": stats.get("blocks_used", 0) / total if total else 0.0}

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _FromStats:
    """The metrics of :data:`FROM_STATS`, read from the last ``engine.stats()`` at scrape time."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def collect(self):
        for key, (name, kind, doc) in FROM_STATS.items():
            family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(PREFIX + name, doc,
                                                                                       labels=["model_name"])
            family.add_metric([self.metrics.model_name], self.metrics.stats.get(key, 0))
            yield family
        stats = self.metrics.stats
        if "spec_decode_num_drafts" in stats:
            yield from self._spec_decode(stats)
        # vLLM's cache_config_info: the KV cache's format and size as labels of a constant 1
        if "kv_cache_dtype" in stats:
            labels = {"cache_dtype": stats["kv_cache_dtype"], "num_blocks": str(stats["blocks_total"]),
                      "kv_bytes_per_block": str(stats["kv_bytes_per_block"])}
            family = GaugeMetricFamily(PREFIX + "cache_config_info", "The KV cache's configuration.",
                                       labels=["model_name", *labels])
            family.add_metric([self.metrics.model_name, *labels.values()], 1)
            yield family
        if "weight_format" in stats:  # the weights' format likewise (e.g. "int8", "bfloat16 (float32 arithmetic)")
            family = GaugeMetricFamily(PREFIX + "weight_format_info", "The format of the model's linear layers.",
                                       labels=["model_name", "weight_format"])
            family.add_metric([self.metrics.model_name, stats["weight_format"]], 1)
            yield family

    def _spec_decode(self, stats: dict):
        model = self.metrics.model_name
        for key, doc in SPEC_DECODE_STATS.items():
            family = CounterMetricFamily(PREFIX + key, doc, labels=["model_name"])
            family.add_metric([model], stats[key])
            yield family
        family = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                     "Speculative tokens accepted, by position in the proposal.",
                                     labels=["model_name", "position"])
        for pos, count in enumerate(stats["spec_decode_num_accepted_tokens_per_pos"]):
            family.add_metric([model, str(pos)], count)
        yield family
