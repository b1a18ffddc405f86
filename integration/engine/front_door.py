"""The engine's front door: what callers, on any thread, hand an :class:`~.llm_engine.LLMEngine`.

A caller never enters the step loop: requests and aborts become commands, queued under one lock
and applied in order at the next step boundary, so ``add_request`` and ``abort_request`` return
at once even while another thread steps. The door is also the one place that knows which ids
are taken (a request's id stays taken until its final output has been returned, so a late
abort can never reach a newer request of the same id) and which outputs are owed to whom:
``generate()`` runs steps on behalf of its own prompts and keeps the other requests' outputs
here for the next ``step()``.

:func:`build_request` checks a request before anything is queued, so a rejected request leaves
no trace.
"""

from __future__ import annotations

import itertools
import random
import threading
import time

import torch

from .outputs import RequestMetrics, RequestOutput
from .sampling_params import SamplingParams
from .sequence import Request

__all__ = ["FrontDoor", "build_request", "is_int"]


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def build_request(engine, request_id, prompt_token_ids, params, priority) -> Request:
    """Validate a request against ``engine`` (reading only what never changes) and build its
    record; raises ValueError naming what is wrong."""
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams):
        raise ValueError(f"add_request: params must be a SamplingParams, got {type(params).__name__}")
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"add_request: request_id must be a non-empty str, got {request_id!r}")
    if not is_int(priority):
        raise ValueError(f"add_request: priority must be an int, got {priority!r}")
    if isinstance(prompt_token_ids, torch.Tensor):
        prompt_token_ids = prompt_token_ids.tolist()
    try:
        prompt = [int(t) for t in prompt_token_ids]
    except (TypeError, ValueError):
        raise ValueError(f"add_request: prompt_token_ids of {request_id!r} must be a list of ints") from None
    if not prompt:
        raise ValueError(f"add_request: the prompt of {request_id!r} is empty")
    vocab = engine.config.vocab_size
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"add_request: prompt of {request_id!r} has token ids outside [0, {vocab}): {bad[:5]}")
    if len(prompt) >= engine.max_model_len:
        raise ValueError(
            f"add_request: the prompt of {request_id!r} has {len(prompt)} tokens; at most {engine.max_model_len - 1} "
            f"fit (max_position_embeddings {engine.max_position_embeddings}, pool of {engine.num_blocks} blocks "
            f"of {engine.block_size} tokens), leaving room for one generated token")
    if params.n > engine.scheduler.max_num_seqs:
        raise ValueError(f"add_request: n={params.n} exceeds max_num_seqs={engine.scheduler.max_num_seqs}")
    if params.stop and engine.tokenizer is None:
        raise ValueError("add_request: SamplingParams.stop needs the engine's tokenizer: LLMEngine(..., tokenizer=...)")
    return Request(request_id, prompt, params, arrival=0, priority=priority, seed=0,
                   metrics=RequestMetrics(time.perf_counter()), eos_token_ids=engine.eos_token_ids)


class FrontDoor:
    """The command queue, the ids in use, the seeds, and the outputs kept for the next step().

    ``seed`` seeds the generator that gives every request without ``SamplingParams.seed`` its own.
    """

    def __init__(self, seed: int):
        self._lock = threading.Lock()
        self._commands: list[tuple[str, object]] = []  # ("add", Request) | ("abort", id), applied in order
        self._live_ids: set[str] = set()  # added, final output not yet returned by step()
        self._seeds = random.Random(seed)
        self._arrivals = itertools.count()
        self._stash: list[RequestOutput] = []  # outputs generate() keeps for the next step()
        self._awaited: set[str] = set()  # ids a generate() call waits on (another thread's step may end them)
        self._owed: list[RequestOutput] = []  # their outputs, made by another caller's step
        self._dropped: set[str] = set()  # generate() requests abandoned by an exception: never reported

    # ------------------------------------------------------------------ callers' side

    def queue(self, requests: list[Request], awaited: bool = False) -> None:
        """Queue validated requests for the next step boundary, all or none (``awaited``: by a
        generate() call, which gets their outputs whoever's step makes them)."""
        with self._lock:
            ids = [r.request_id for r in requests]
            taken = [i for i in ids if i in self._live_ids]
            if taken or len(set(ids)) != len(ids):
                raise ValueError(f"add_request: request_id {(taken or ids)[0]!r} is already in use by a request "
                                 "whose final output has not been returned yet")
            for req in requests:
                req.arrival = next(self._arrivals)
                req.seed = req.params.seed if req.params.seed is not None else self._seeds.getrandbits(62)
                self._live_ids.add(req.request_id)
                self._commands.append(("add", req))
            if awaited:
                self._awaited.update(ids)

    def abort(self, request_id: str) -> None:
        """Queue an abort of a live request; unknown or finished ids are ignored."""
        with self._lock:
            if request_id in self._live_ids:
                self._commands.append(("abort", request_id))

    def has_live_requests(self) -> bool:
        with self._lock:
            return bool(self._live_ids)

    def num_queued_adds(self) -> int:
        """Requests added but not yet taken by a step."""
        with self._lock:
            return sum(kind == "add" for kind, _ in self._commands)

    def next_arrival(self) -> int:
        """A number no other arrival gets (``generate()`` names its requests with one)."""
        return next(self._arrivals)

    # ------------------------------------------------------------------ the step loop's side

    def take_commands(self) -> list[tuple[str, object]]:
        """The queued commands, in order, emptying the queue."""
        with self._lock:
            commands, self._commands = self._commands, []
        return commands

    def requeue(self, commands: list[tuple[str, object]]) -> None:
        """Commands taken but not applied (a step boundary interrupted): back to the queue's front,
        in order."""
        with self._lock:
            self._commands[:0] = commands

    def keep(self, output: RequestOutput) -> None:
        """An output generate() received for a request not its own: the generate() call awaiting
        it takes it, else the next step() returns it."""
        with self._lock:
            (self._owed if output.request_id in self._awaited else self._stash).append(output)

    def take_owed(self, request_ids) -> list[RequestOutput]:
        """The outputs of a generate() call's requests that another caller's step made."""
        with self._lock:
            taken = [o for o in self._owed if o.request_id in request_ids]
            self._owed = [o for o in self._owed if o.request_id not in request_ids]
        return taken

    def deliver(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """step()'s outputs: the kept ones first, those a generate() call awaits set aside for it;
        the finished ones free their ids."""
        with self._lock:
            outputs, self._stash = self._stash + outputs, []
            self._owed += [o for o in outputs if o.request_id in self._awaited]
            outputs = [o for o in outputs if o.request_id not in self._awaited]
            self._live_ids.difference_update(o.request_id for o in outputs if o.finished)
        return outputs

    def release(self, request_ids) -> None:
        """Free the ids of requests whose final outputs generate() has returned."""
        with self._lock:
            self._live_ids.difference_update(request_ids)
            self._awaited.difference_update(request_ids)

    def abandon(self, request_ids: list[str], returned) -> None:
        """A failed generate(): ``returned`` ids are free (and those whose final output waits in
        the owed ones); the others are aborted at the next step and never reported (their ids are
        freed when the abort goes through)."""
        owed = self.take_owed(request_ids)
        with self._lock:
            returned = set(returned) | {o.request_id for o in owed if o.finished}
            self._awaited.difference_update(request_ids)
            self._live_ids.difference_update(returned)
            self._dropped.update(i for i in request_ids if i not in returned)
            self._commands.extend(("abort", i) for i in request_ids if i not in returned)

    def without_dropped(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Outputs minus those of requests a failed generate() abandoned (whose ids are free once
        their abort has gone through)."""
        if not self._dropped:
            return outputs
        kept = []
        with self._lock:
            for out in outputs:
                if out.request_id not in self._dropped:
                    kept.append(out)
                elif out.finished:
                    self._dropped.discard(out.request_id)
                    self._live_ids.discard(out.request_id)
        return kept
