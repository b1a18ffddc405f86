"""What the engine hands back: per request, per completion, and the request's timeline."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["CompletionOutput", "RequestMetrics", "RequestOutput"]


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    # "stop" | "length" | "abort" | "error" (failed three steps in a row); None while running
    finish_reason: Optional[str] = None
    logprobs: Optional[list[dict[int, float]]] = None  # per generated token: {token id: log-prob}
    text: Optional[str] = None  # with an engine tokenizer: the text released so far
    stop_reason: Optional[object] = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Times from ``time.perf_counter()``, stamped after the step's device work; None until they
    happen."""

    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # with SamplingParams(prompt_logprobs=k): [None, {token id: log-prob}, ...] per prompt token,
    # each dict holding the prompt's own token and the k most likely (once the prompt is computed)
    prompt_logprobs: Optional[list[Optional[dict[int, float]]]] = None
