"""The engine's front door: what callers, on any thread, hand an :class:`~.llm_engine.LLMEngine`.

A caller never enters the step loop: requests and aborts become commands, queued under one lock
and applied in order at the next step boundary, so ``add_request`` and ``abort_request`` return
at once even while another thread steps. The door is also the one place that knows which ids
are taken (a request's id stays taken until its final output has been returned, so a late
abort can never reach a newer request of the same id) and which outputs are owed to whom:
every step posts its outputs here, the final ones of a ``generate()`` call's requests for that
call, the rest for the next ``step()``. And it is where a dead engine refuses every later call.

:func:`build_request` checks a request before anything is queued, so a rejected request leaves
no trace.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from typing import Optional

import torch

from .outputs import RequestMetrics, RequestOutput
from .sampling_params import SamplingParams
from .sequence import Request

__all__ = ["EngineDeadError", "FrontDoor", "build_request", "is_int"]


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
    for name in ("logprobs", "prompt_logprobs"):
        asked = getattr(params, name)
        if asked is not None and asked > engine.max_logprobs:
            raise ValueError(f"add_request: {name}={asked} exceeds the engine's max_logprobs={engine.max_logprobs}")
    outside = [t for t, _ in params.logit_bias if t >= vocab]
    if outside:
        raise ValueError(f"add_request: logit_bias of {request_id!r} has token ids outside [0, {vocab}): {outside[:5]}")
    if params.stop and engine.tokenizer is None:
        raise ValueError("add_request: SamplingParams.stop needs the engine's tokenizer: LLMEngine(..., tokenizer=...)")
    constraint = None
    if params.structured_outputs is not None:
        if engine.tokenizer is None:
            raise ValueError("add_request: SamplingParams.structured_outputs needs the engine's tokenizer: "
                             "LLMEngine(..., tokenizer=...)")
        constraint = engine.grammars.compile(params.structured_outputs)  # ValueError naming the field
    return Request(request_id, prompt, params, arrival=0, priority=priority, seed=0,
                   metrics=RequestMetrics(time.perf_counter()), eos_token_ids=engine.eos_token_ids,
                   constraint=constraint)


class EngineDeadError(RuntimeError):
    """The engine can take no more calls: its thread has stopped (``AsyncLLMEngine``), or a
    failed step could not be undone and its state no longer holds together (``LLMEngine``)."""


class FrontDoor:
    """The command queue, the ids in use, the seeds, and the outputs owed to callers.

    ``seed`` seeds the generator that gives every request without ``SamplingParams.seed`` its own.
    A step hands its outputs here (:meth:`post`) before anything else can interrupt it; they wait
    until their caller takes them, so an interrupt between a step and its caller loses none.
    """

    def __init__(self, seed: int):
        self._lock = threading.Lock()
        self._commands: list[tuple[str, object]] = []  # ("add", Request) | ("abort", id), applied in order
        self._live_ids: set[str] = set()  # added, final output not yet taken
        self._seeds = random.Random(seed)
        self._arrivals = itertools.count()
        self._stepped: list[RequestOutput] = []  # posted, for the next step()
        self._awaited: set[str] = set()  # ids a generate() call waits on (whoever's step ends them)
        self._finals: dict[str, RequestOutput] = {}  # their final outputs, until that call takes them
        self._dropped: set[str] = set()  # generate() requests abandoned by an exception: never reported
        self._dead: Optional[EngineDeadError] = None  # once set, the engine takes no more calls

    # ------------------------------------------------------------------ callers' side

    def queue(self, requests: list[Request], awaited: bool = False) -> None:
        """Queue validated requests for the next step boundary, all or none (``awaited``: by a
        generate() call, which gets their outputs whoever's step makes them)."""
        with self._lock:
            self._check_alive()
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
            self._check_alive()
            return bool(self._live_ids)

    def num_queued_adds(self) -> int:
        """Requests added but not yet taken by a step."""
        with self._lock:
            self._check_alive()
            return sum(kind == "add" for kind, _ in self._commands)

    def next_arrival(self) -> int:
        """A number no other arrival gets (``generate()`` names its requests with one)."""
        return next(self._arrivals)

    def take_stepped(self) -> list[RequestOutput]:
        """step()'s outputs: all those posted that no generate() call awaits; the finished ones
        free their ids."""
        with self._lock:
            outputs, self._stepped = self._stepped, []
            self._live_ids.difference_update(o.request_id for o in outputs if o.finished)
        return outputs

    def finals(self, request_ids) -> dict[str, RequestOutput]:
        """The final outputs posted so far of a generate() call's requests (left here until
        :meth:`release`, so that an interrupted generate() loses none)."""
        with self._lock:
            return {i: self._finals[i] for i in request_ids if i in self._finals}

    def release(self, request_ids) -> None:
        """A generate() call has all its final outputs: its ids are free."""
        with self._lock:
            for i in request_ids:
                self._finals.pop(i, None)
            self._live_ids.difference_update(request_ids)
            self._awaited.difference_update(request_ids)

    def abandon(self, request_ids: list[str]) -> None:
        """A failed generate(): its ids whose final output is in are free; the others are aborted
        at the next step and never reported (their ids are freed when the abort goes through)."""
        with self._lock:
            ended = {i for i in request_ids if self._finals.pop(i, None) is not None}
            self._awaited.difference_update(request_ids)
            self._live_ids.difference_update(ended)
            self._dropped.update(i for i in request_ids if i not in ended)
            self._commands.extend(("abort", i) for i in request_ids if i not in ended)

    def check_alive(self) -> None:
        """Raise :class:`EngineDeadError` if the engine has stopped taking calls."""
        with self._lock:
            self._check_alive()

    def _check_alive(self) -> None:
        if self._dead is not None:  # a fresh error per caller, one message
            raise EngineDeadError(*self._dead.args) from self._dead.__cause__

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

    def post(self, outputs: list[RequestOutput], receipt: Optional[list] = None) -> None:
        """A step's outputs (or a request ended between steps): owed from now on, to the
        generate() call awaiting them (final ones only) or else to the next step(); those of
        requests a failed generate() abandoned are dropped (freeing the id once final).
        ``receipt`` gets True appended, in the same locked stretch, once they are in: a step
        interrupted after that must not be undone."""
        with self._lock:
            for out in outputs:
                rid = out.request_id
                if rid in self._dropped:
                    if out.finished:
                        self._dropped.discard(rid)
                        self._live_ids.discard(rid)
                elif rid in self._awaited:
                    if out.finished:
                        self._finals[rid] = out
                else:
                    self._stepped.append(out)
            if receipt is not None:
                receipt.append(True)

    def kill(self, error: EngineDeadError) -> None:
        """Take no more calls: from now on they raise ``error`` (its message and cause)."""
        with self._lock:
            if self._dead is None:
                self._dead = error
