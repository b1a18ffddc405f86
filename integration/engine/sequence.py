"""The engine's records of a request and of each of its sequences (one per completion)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

from ..kv_pool import SwappedKV
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .sampling_params import SamplingParams

__all__ = ["Request", "Sequence", "Status"]


class Status(Enum):
    WAITING = "waiting"  # holds no blocks: to be (re)computed from num_computed = 0 or a prefix hit
    RUNNING = "running"  # holds blocks for its first num_computed tokens
    SWAPPED = "swapped"  # its blocks are in host memory (preemption_mode="swap")
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int  # arrival order (ties between equal priorities: the older first)
    priority: int  # lower runs first under scheduling_policy="priority"
    seed: int  # completion i draws from seed + i
    metrics: RequestMetrics
    eos_token_ids: frozenset
    seqs: list["Sequence"] = field(default_factory=list)
    forked: bool = False  # n > 1: the completions exist once the prompt's first token is sampled
    failures: int = 0  # steps in a row that failed with this request in them
    prompt_logprobs: Optional[list] = None
    constraint: Optional[object] = None  # a CompiledConstraint (SamplingParams.structured_outputs)

    def output(self) -> RequestOutput:
        outs = [seq.output() for seq in self.seqs]
        if self.params.n > len(outs):  # aborted before the completions were forked
            outs += [CompletionOutput(i, [], outs[0].finish_reason) for i in range(len(outs), self.params.n)]
        finished = all(o.finish_reason is not None for o in outs)
        prompt_logprobs = None if self.prompt_logprobs is None else list(self.prompt_logprobs)
        return RequestOutput(self.request_id, list(self.prompt_token_ids), outs, finished, self.metrics, prompt_logprobs)


@dataclass(eq=False)
class Sequence:
    """One completion: its token ids (prompt, then generated) and how many are in the cache."""

    seq_id: str  # its id in the block manager
    request: Request
    index: int
    token_ids: list[int]
    num_computed: int = 0  # leading tokens whose K/V are in the cache
    status: Status = Status.WAITING
    finish_reason: Optional[str] = None
    stop_reason: Optional[object] = None
    logprobs: Optional[list] = None
    detokenizer: Optional[object] = None  # an IncrementalDetokenizer, with an engine tokenizer
    swapped_kv: Optional[SwappedKV] = None
    matcher: Optional[object] = None  # a SequenceMatcher: the constraint's state after output_ids

    # the sampler's view (SamplingRow)
    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.request.prompt_token_ids):]

    @property
    def seed(self) -> int:
        return self.request.seed + self.index

    @property
    def eos_token_ids(self) -> frozenset:
        return self.request.eos_token_ids

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    def output(self) -> CompletionOutput:
        text = None if self.detokenizer is None else self.detokenizer.text
        return CompletionOutput(self.index, list(self.output_ids), self.finish_reason,
                                None if self.logprobs is None else list(self.logprobs), text, self.stop_reason)
