"""``LLMEngine``: continuous batching of a transformers decoder on the paged KV cache.

    from minipaged_ops.integration import LLMEngine, SamplingParams
    engine = LLMEngine(model, num_blocks=256, block_size=16)
    outs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=32))

Every :meth:`LLMEngine.step` is one iteration: the scheduler picks the running decodes (oldest
first), then prefill chunks of partly computed and waiting sequences within
``max_num_batched_tokens``; the block manager reserves their slots (preempting the newest running
sequences when the pool is short); the planner packs them into one ``[1, total_tokens]`` forward
with ``position_ids``; logits are computed only for each sequence's last token and sampled.

A sequence is its token ids (prompt, then generated) and how many of them are in the cache, so a
prefill chunk, a decode and a recomputation after preemption are the same operation: compute
tokens ``num_computed ..`` and, if that reaches the end, sample the next one.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

import minipaged_ops
from minipaged_ops.block_manager import KVBlockManager

from . import _compat
from .step import ScheduledChunk, plan_step

__all__ = ["CompletionOutput", "LLMEngine", "RequestMetrics", "RequestOutput", "SamplingParams"]

ATTN_IMPLEMENTATION = "minipaged"
_PREEMPTION_MODES = ("recompute", "swap")


# ---------------------------------------------------------------------- public records


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. ``temperature=0`` is greedy; ``top_k=0`` and ``top_p=1`` turn
    those filters off; ``seed`` gives the request its own generator (completion ``i`` of ``n``
    draws from seed ``seed + i``); ``logprobs=k`` returns, per token, the ``k`` most likely tokens'
    log-probabilities and the chosen one's. ``ignore_eos``: EOS may still be sampled; it just does
    not end the request."""

    n: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    max_tokens: int = 16
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    logprobs: Optional[int] = None

    def __post_init__(self):
        def is_int(x):
            return isinstance(x, int) and not isinstance(x, bool)

        if not is_int(self.n) or self.n < 1:
            raise ValueError(f"SamplingParams: n must be an int >= 1, got {self.n!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not 0 <= self.temperature < math.inf:
            raise ValueError(f"SamplingParams: temperature must be a finite number >= 0, got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams: top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"SamplingParams: top_k must be an int >= 0 (0: off), got {self.top_k!r}")
        if self.seed is not None and not is_int(self.seed):
            raise ValueError(f"SamplingParams: seed must be an int or None, got {self.seed!r}")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"SamplingParams: max_tokens must be an int >= 1, got {self.max_tokens!r}")
        try:
            stops = tuple(self.stop_token_ids)
        except TypeError:
            raise ValueError(f"SamplingParams: stop_token_ids must be a sequence of ints, got {self.stop_token_ids!r}") from None
        if not all(is_int(t) and t >= 0 for t in stops):
            raise ValueError(f"SamplingParams: stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", stops)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"SamplingParams: ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs < 0):
            raise ValueError(f"SamplingParams: logprobs must be an int >= 0 or None, got {self.logprobs!r}")


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort"; None while running
    logprobs: Optional[list[dict[int, float]]] = None  # per generated token: {token id: log-prob}

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Times from ``time.perf_counter()``; None until they happen."""

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


# ---------------------------------------------------------------------- internal state

_WAITING, _RUNNING, _SWAPPED, _FINISHED = "waiting", "running", "swapped", "finished"


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    order: int  # arrival order: the newest running requests are preempted first
    metrics: RequestMetrics
    seqs: list = field(default_factory=list)
    forked: bool = False  # n > 1: the completions exist once the prompt's first token is sampled


@dataclass(eq=False)
class _Sequence:
    seq_id: str  # its id in the block manager
    request: _Request
    index: int
    token_ids: list[int]  # prompt, then generated
    num_computed: int = 0  # leading tokens whose K/V are in the cache
    status: str = _WAITING
    finish_reason: Optional[str] = None
    logprobs: Optional[list] = None
    generator: Optional[torch.Generator] = None
    swapped_kv: Optional[tuple] = None  # (keys, values) on the host, [layers, blocks, ...]

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.request.prompt_token_ids):]

    @property
    def priority(self) -> tuple:
        return (self.request.order, self.index)


# ---------------------------------------------------------------------- the engine


class LLMEngine:
    """Continuous batching over a :class:`KVBlockManager` of ``num_blocks`` blocks.

    Args:
        model: a decoder-only transformers ``*ForCausalLM`` whose layers are all full attention;
            its attention implementation is set to ``"minipaged"`` (without the engine's step it
            falls back to SDPA, so ``model.generate`` keeps working).
        num_blocks: KV blocks per layer; None sizes the pool from ``kv_cache_memory``.
        kv_cache_memory: bytes for all layers' keys and values, or a fraction in (0, 1] of free
            memory (device memory on CUDA, available RAM on CPU). Default 0.9 on CUDA, 0.2 on CPU;
            never more than ``max_num_seqs`` sequences of the model's maximum length need.
        max_num_seqs: sequences running at once; max_num_batched_tokens: tokens per step.
        preemption_mode: "recompute" (free the blocks, recompute prompt + generated later) or
            "swap" (copy the blocks to host memory and back).
    """

    def __init__(self, model, num_blocks: Optional[int] = None, block_size: int = 16, *,
                 kv_cache_memory=None, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 enable_prefix_caching: bool = True, preemption_mode: str = "recompute"):
        if not _compat.is_pretrained_model(model):
            raise ValueError(f"LLMEngine: model must be a transformers PreTrainedModel, got {type(model).__name__}")
        for name, value in (("block_size", block_size), ("max_num_seqs", max_num_seqs),
                            ("max_num_batched_tokens", max_num_batched_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LLMEngine: {name} must be a positive int, got {value!r}")
        if preemption_mode not in _PREEMPTION_MODES:
            raise ValueError(f"LLMEngine: preemption_mode must be one of {_PREEMPTION_MODES}, got {preemption_mode!r}")
        config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
        types = _compat.layer_types(config)
        if any(t != "full_attention" for t in types):
            raise ValueError(f"LLMEngine supports models whose layers are all full attention; this one has {sorted(set(types))}")
        self.model = model
        self.config = config
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.max_position_embeddings = getattr(config, "max_position_embeddings", None) or 1 << 30
        element = torch.empty((), dtype=self.dtype).element_size()
        self.kv_bytes_per_block = 2 * self.num_layers * self.num_kv_heads * block_size * self.head_dim * element
        if num_blocks is None:
            num_blocks = self._blocks_from_memory(kv_cache_memory)
        elif isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"LLMEngine: num_blocks must be a positive int or None, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.max_model_len = min(self.max_position_embeddings, num_blocks * block_size)
        self.block_manager = KVBlockManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
        shape = (num_blocks, self.num_kv_heads, block_size, self.head_dim)
        # empty, not zeros: the kernels read only slots below seq_lens, which were written first
        self.kv_caches = tuple((minipaged_ops.allocate_kv_cache(shape, self.dtype, self.device),
                                minipaged_ops.allocate_kv_cache(shape, self.dtype, self.device))
                               for _ in range(self.num_layers))
        eos = model.generation_config.eos_token_id if getattr(model, "generation_config", None) else None
        self.eos_token_ids = frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos)
        if getattr(model.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
            model.set_attn_implementation(ATTN_IMPLEMENTATION)

        self._requests: dict[str, _Request] = {}
        self._waiting: deque[_Sequence] = deque()
        self._swapped: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        self._aborted: list[_Request] = []  # reported by the next step()
        self._order = itertools.count()
        self._sampler = torch.Generator(device=self.device)
        self._sampler.manual_seed(0)
        self._finished_metrics: list[tuple[RequestMetrics, int]] = []
        self._counters = dict(steps=0, preemptions=0, prefill_tokens_computed=0, decode_tokens_computed=0,
                              prompt_tokens_looked_up=0, prompt_tokens_cached=0, peak_blocks_used=0,
                              swapped_blocks_out=0)

    # ------------------------------------------------------------------ requests

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: Optional[SamplingParams] = None) -> None:
        """Queue a request. Raises ValueError (changing nothing) for a bad one."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"add_request: params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"add_request: request_id must be a non-empty str, got {request_id!r}")
        if request_id in self._requests:
            raise ValueError(f"add_request: request_id {request_id!r} is already in use by an unfinished request")
        if isinstance(prompt_token_ids, torch.Tensor):
            prompt_token_ids = prompt_token_ids.tolist()
        try:
            prompt = [int(t) for t in prompt_token_ids]
        except (TypeError, ValueError):
            raise ValueError(f"add_request: prompt_token_ids of {request_id!r} must be a list of ints") from None
        if not prompt:
            raise ValueError(f"add_request: the prompt of {request_id!r} is empty")
        vocab = getattr(self.config, "vocab_size", None)
        bad = [t for t in prompt if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            raise ValueError(f"add_request: prompt of {request_id!r} has token ids outside [0, {vocab}): {bad[:5]}")
        if len(prompt) >= self.max_model_len:
            raise ValueError(
                f"add_request: the prompt of {request_id!r} has {len(prompt)} tokens; at most {self.max_model_len - 1} "
                f"fit (max_position_embeddings {self.max_position_embeddings}, pool of {self.num_blocks} blocks "
                f"of {self.block_size} tokens), leaving room for one generated token")
        if params.n > self.max_num_seqs:
            raise ValueError(f"add_request: n={params.n} exceeds max_num_seqs={self.max_num_seqs}")
        req = _Request(request_id, prompt, params, next(self._order), RequestMetrics(time.perf_counter()))
        req.seqs.append(self._new_sequence(req, 0, list(prompt)))
        self._requests[request_id] = req
        self._waiting.append(req.seqs[0])

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its blocks; the next :meth:`step` reports it with
        finish_reason "abort". Unknown or finished ids are ignored."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        for seq in req.seqs:
            if seq.status != _FINISHED:
                self._finish(seq, "abort")
        req.metrics.finished_time = time.perf_counter()
        self._aborted.append(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(self._aborted)

    def generate(self, prompts: Sequence[Sequence[int]], params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Run ``prompts`` (token id lists) to completion; outputs in the prompts' order.
        ``params``: one SamplingParams for all, or one per prompt."""
        if params is None or isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"generate: {len(params)} SamplingParams for {len(prompts)} prompts")
        base = f"generate-{next(self._order)}-"
        ids = [f"{base}{i}" for i in range(len(prompts))]
        added = []
        try:
            for rid, prompt, p in zip(ids, prompts, params):
                self.add_request(rid, prompt, p)
                added.append(rid)
        except ValueError:
            for rid in added:
                self.abort_request(rid)
            self._aborted = [r for r in self._aborted if r.request_id not in added]
            raise
        results: dict[str, RequestOutput] = {}
        bar = _progress(len(ids), use_tqdm)
        while len(results) < len(ids) and self.has_unfinished_requests():
            for out in self.step():
                if out.finished and out.request_id in added:
                    results[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [results[rid] for rid in ids]

    # ------------------------------------------------------------------ one iteration

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, run one packed forward, sample. Returns the requests that
        changed (new tokens, finished or aborted)."""
        chunks = self._schedule()
        outputs = [self._output(r) for r in self._aborted]
        if not chunks:
            self._aborted = []
            return outputs
        bm = self.block_manager
        self._counters["peak_blocks_used"] = max(self._counters["peak_blocks_used"], bm.num_blocks - bm.num_free_blocks)
        try:
            copies = bm.take_copies()
            if copies:
                mapping = torch.tensor(copies, dtype=torch.int64, device=self.device)
                for key_cache, value_cache in self.kv_caches:
                    minipaged_ops.copy_blocks(key_cache, value_cache, mapping)
            meta = plan_step(bm, [c for _, c in chunks], self.device)
            logits = self.model(
                input_ids=meta.input_ids[None], position_ids=meta.position_ids[None], use_cache=False,
                logits_to_keep=meta.logits_indices, minipaged_step=meta, minipaged_kv_caches=self.kv_caches,
            ).logits[0]
        except BaseException:  # KeyboardInterrupt, out of memory, a bad model: the engine stays usable
            self._roll_back(chunks)  # aborted requests stay queued for the next step's report
            raise
        self._aborted = []
        self._counters["steps"] += 1
        for seq, chunk in chunks:
            seq.num_computed += len(chunk.token_ids)
            kind = "decode_tokens_computed" if len(chunk.token_ids) == 1 and seq.output_ids else "prefill_tokens_computed"
            self._counters[kind] += len(chunk.token_ids)
        changed: dict[str, _Request] = {}
        now = time.perf_counter()
        greedy = logits.argmax(-1).tolist()  # one call for every row; sampled rows are redone below
        for row, i in enumerate(meta.sampled):
            seq = chunks[i][0]
            req = seq.request
            changed[req.request_id] = req
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            if not req.forked and req.params.n > 1:
                self._fork(seq)
            for s in req.seqs if seq.index == 0 and len(seq.output_ids) == 0 else [seq]:
                if s.status == _RUNNING and s.num_computed == len(s.token_ids):
                    params = s.request.params
                    plain = params.temperature == 0 and params.logprobs is None
                    self._accept(s, greedy[row] if plain else self._sample(logits[row], s))
        for req in changed.values():
            if all(s.status == _FINISHED for s in req.seqs):
                req.metrics.finished_time = now
                del self._requests[req.request_id]
                self._finished_metrics.append((req.metrics, max(len(s.output_ids) for s in req.seqs)))
            outputs.append(self._output(req))
        return outputs

    # ------------------------------------------------------------------ scheduling

    def _schedule(self) -> list[tuple[_Sequence, ScheduledChunk]]:
        """Reserve slots for this step's chunks: running decodes, then running prefills (oldest
        first, preempting the newest running sequences when the pool is short), then swapped and
        waiting sequences while blocks, ``max_num_seqs`` and the token budget allow."""
        bm = self.block_manager
        budget = self.max_num_batched_tokens
        preemptions_before = self._counters["preemptions"]
        scheduled: list[tuple[_Sequence, ScheduledChunk]] = []
        done: set = set()
        by_age = sorted(self._running, key=lambda s: s.priority)
        decodes = [s for s in by_age if len(s.token_ids) - s.num_computed == 1]
        prefills = [s for s in by_age if len(s.token_ids) - s.num_computed > 1]
        for seq in decodes + prefills:
            if seq.status != _RUNNING or budget == 0:
                continue
            n = min(len(seq.token_ids) - seq.num_computed, budget)
            while True:
                n = self._fit_append(seq, n)
                if n:
                    break
                victim = max((s for s in self._running if s.seq_id not in done), key=lambda s: s.priority)
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status != _RUNNING:
                continue
            start = seq.num_computed
            new = seq.token_ids[start:start + n]
            if n == 1:
                bm.append_token(seq.seq_id, new[0])
            else:
                bm.append_tokens(seq.seq_id, new)
            scheduled.append((seq, ScheduledChunk(seq.seq_id, new, start, start + n == len(seq.token_ids))))
            done.add(seq.seq_id)
            budget -= n

        if self._counters["preemptions"] > preemptions_before:  # the pool is short: admit nothing more
            return self._decodes_first(scheduled)
        while self._swapped:
            seq = self._swapped[0]
            if len(self._running) + 1 > self.max_num_seqs or not bm.can_allocate([seq.num_computed]):
                break
            self._swapped.popleft()
            self._swap_in(seq)
        while self._waiting and budget > 0 and not self._swapped:
            seq = self._waiting[0]
            req = seq.request
            width = 1 if req.forked or req.params.n == 1 else req.params.n
            if len(self._running) + width > self.max_num_seqs:
                break
            cached = bm.cached_prefix_length(seq.token_ids)
            n = self._fit_allocate(seq.token_ids, cached, min(len(seq.token_ids) - cached, budget))
            if n == 0:
                break
            self._waiting.popleft()
            got = bm.create_sequence(seq.seq_id, seq.token_ids[:cached + n])
            assert got == cached, (got, cached)
            self._counters["prompt_tokens_looked_up"] += len(seq.token_ids)
            self._counters["prompt_tokens_cached"] += cached
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = time.perf_counter()
                req.metrics.num_cached_tokens = cached
            seq.num_computed = cached
            seq.status = _RUNNING
            self._running.append(seq)
            new = seq.token_ids[cached:cached + n]
            scheduled.append((seq, ScheduledChunk(seq.seq_id, new, cached, cached + n == len(seq.token_ids))))
            budget -= n
        return self._decodes_first(scheduled)

    def _roll_back(self, scheduled: list[tuple[_Sequence, ScheduledChunk]]) -> None:
        """Undo a step whose forward failed: none of the K/V it was writing can be trusted, so its
        sequences go back to the waiting queue as if preempted for recompute (their outputs so far
        are kept), and blocks filled this step leave the prefix cache."""
        for seq, _ in reversed(scheduled):
            self.block_manager.release_sequence(seq.seq_id, written=seq.num_computed)
            self._running.remove(seq)
            seq.num_computed = 0
            seq.status = _WAITING
            self._waiting.appendleft(seq)

    @staticmethod
    def _decodes_first(scheduled: list) -> list:
        """One-token chunks lead the packed row: the planner sends them to the decode kernel."""
        return sorted(scheduled, key=lambda item: len(item[1].token_ids) != 1)

    def _fit_append(self, seq: _Sequence, n: int) -> int:
        """The largest ``m <= n`` tokens whose slots the pool can give ``seq`` now (0: none)."""
        bm = self.block_manager
        if bm.can_append([(seq.seq_id, n)]):
            return n
        lo, hi = 0, n - 1  # binary search: the need grows with m
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if bm.can_append([(seq.seq_id, mid)]):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _fit_allocate(self, tokens: list[int], cached: int, n: int) -> int:
        """The largest ``m <= n`` such that a sequence of ``tokens[:cached + m]`` fits (0: none)."""
        bm = self.block_manager
        if bm.can_allocate([tokens[:cached + n]]):
            return n
        lo, hi = 0, n - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if bm.can_allocate([tokens[:cached + mid]]):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _preempt(self, seq: _Sequence) -> None:
        """Take a running sequence off the pool: its blocks to the host ("swap") or nowhere
        ("recompute": it comes back through the prefix cache or by recomputing)."""
        bm = self.block_manager
        self._running.remove(seq)
        self._counters["preemptions"] += 1
        seq.request.metrics.num_preemptions += 1
        if self.preemption_mode == "swap" and seq.num_computed > 0:
            blocks = torch.tensor(bm.block_table(seq.seq_id), dtype=torch.int64, device=self.device)
            seq.swapped_kv = (torch.stack([k.index_select(0, blocks) for k, _ in self.kv_caches]).cpu(),
                              torch.stack([v.index_select(0, blocks) for _, v in self.kv_caches]).cpu())
            self._counters["swapped_blocks_out"] += len(blocks)
            bm.release_sequence(seq.seq_id)
            seq.status = _SWAPPED
            self._swapped.appendleft(seq)
        else:
            bm.release_sequence(seq.seq_id)
            seq.num_computed = 0
            seq.status = _WAITING
            self._waiting.appendleft(seq)

    def _swap_in(self, seq: _Sequence) -> None:
        bm = self.block_manager
        cached = bm.create_sequence(seq.seq_id, seq.token_ids[:seq.num_computed])
        first = cached // self.block_size  # blocks the prefix cache already holds need no copy
        blocks = torch.tensor(bm.block_table(seq.seq_id)[first:], dtype=torch.int64, device=self.device)
        keys, values = seq.swapped_kv
        for layer, (key_cache, value_cache) in enumerate(self.kv_caches):
            key_cache.index_copy_(0, blocks, keys[layer, first:].to(self.device))
            value_cache.index_copy_(0, blocks, values[layer, first:].to(self.device))
        seq.swapped_kv = None
        seq.status = _RUNNING
        self._running.append(seq)

    # ------------------------------------------------------------------ sampling

    def _new_sequence(self, req: _Request, index: int, token_ids: list[int]) -> _Sequence:
        seq = _Sequence(f"{req.request_id}#{index}", req, index, token_ids)
        if req.params.seed is not None:
            seq.generator = torch.Generator(device=self.device)
            seq.generator.manual_seed(req.params.seed + index)
        if req.params.logprobs is not None:
            seq.logprobs = []
        return seq

    def _fork(self, parent: _Sequence) -> None:
        """n > 1: the other completions share the prompt's blocks (copy-on-write later)."""
        req = parent.request
        req.forked = True
        for i in range(1, req.params.n):
            child = self._new_sequence(req, i, list(parent.token_ids))
            child.num_computed = parent.num_computed
            child.status = _RUNNING
            self.block_manager.fork(parent.seq_id, child.seq_id)
            req.seqs.append(child)
            self._running.append(child)

    def _sample(self, logits: torch.Tensor, seq: _Sequence) -> int:
        params = seq.request.params
        logits = logits.float()
        if params.temperature == 0:
            token = int(logits.argmax())
        else:
            scores = logits / params.temperature
            if params.top_k and params.top_k < scores.shape[-1]:
                kth = scores.topk(params.top_k).values[-1]
                scores = scores.masked_fill(scores < kth, -math.inf)
            if params.top_p < 1:
                sorted_scores, order = scores.sort(descending=True)
                cumulative = sorted_scores.softmax(-1).cumsum(-1)
                drop = cumulative - sorted_scores.softmax(-1) >= params.top_p  # keep the first past top_p
                scores = scores.scatter(0, order, sorted_scores.masked_fill(drop, -math.inf))
            probs = scores.softmax(-1)
            token = int(torch.multinomial(probs, 1, generator=seq.generator or self._sampler))
        if seq.logprobs is not None:
            logprobs = logits.log_softmax(-1)
            entry = {}
            if params.logprobs:
                top = logprobs.topk(params.logprobs)
                entry = dict(zip(top.indices.tolist(), top.values.tolist()))
            entry[token] = float(logprobs[token])
            seq.logprobs.append(entry)
        return token

    def _accept(self, seq: _Sequence, token: int) -> None:
        params = seq.request.params
        seq.token_ids.append(token)
        if token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos):
            self._finish(seq, "stop")
        elif len(seq.output_ids) >= params.max_tokens or len(seq.token_ids) >= self.max_model_len:
            self._finish(seq, "length")

    def _finish(self, seq: _Sequence, reason: str) -> None:
        if seq.status == _RUNNING:
            self.block_manager.release_sequence(seq.seq_id)
            self._running.remove(seq)
        elif seq.status == _WAITING:
            self._waiting.remove(seq)
        elif seq.status == _SWAPPED:
            self._swapped.remove(seq)
            seq.swapped_kv = None
        seq.status = _FINISHED
        seq.finish_reason = reason

    def _output(self, req: _Request) -> RequestOutput:
        outs = [CompletionOutput(s.index, list(s.output_ids), s.finish_reason,
                                 None if s.logprobs is None else list(s.logprobs)) for s in req.seqs]
        if req.params.n > len(outs):  # aborted before the completions were forked
            outs += [CompletionOutput(i, [], outs[0].finish_reason) for i in range(len(outs), req.params.n)]
        finished = all(o.finish_reason is not None for o in outs)
        return RequestOutput(req.request_id, list(req.prompt_token_ids), outs, finished, req.metrics)

    # ------------------------------------------------------------------ the capacity report

    def stats(self) -> dict:
        """The capacity report: queues, pool use, prefix-cache hit rate, preemptions, and latency
        percentiles (seconds) over the requests finished so far."""
        usage = self.block_manager.usage()
        c = self._counters
        states = {_RUNNING: set(), _WAITING: set(), _SWAPPED: set()}
        for req in self._requests.values():
            for s in req.seqs:
                if s.status in states:
                    states[s.status].add(req.request_id)
        metrics = [m for m, _ in self._finished_metrics]
        queue = [m.first_scheduled_time - m.arrival_time for m in metrics if m.first_scheduled_time is not None]
        ttft = [m.first_token_time - m.arrival_time for m in metrics if m.first_token_time is not None]
        e2e = [m.finished_time - m.arrival_time for m in metrics]
        tpot = [(m.finished_time - m.first_token_time) / (n - 1) for m, n in self._finished_metrics
                if m.first_token_time is not None and n > 1]
        return {
            "running": len(states[_RUNNING]),
            "waiting": len(states[_WAITING]),
            "swapped": len(states[_SWAPPED]),
            "finished": len(self._finished_metrics),
            "active_tokens": usage["tokens_logical"],
            "blocks_total": usage["blocks_total"],
            "blocks_used": usage["blocks_used"],
            "block_utilisation": usage["tokens_stored"] / (usage["blocks_used"] * self.block_size)
            if usage["blocks_used"] else 0.0,
            "shared_blocks": usage["blocks_shared"],
            "prefix_cache_hit_rate": c["prompt_tokens_cached"] / c["prompt_tokens_looked_up"]
            if c["prompt_tokens_looked_up"] else 0.0,
            "prefill_tokens_computed": c["prefill_tokens_computed"],
            "decode_tokens_computed": c["decode_tokens_computed"],
            "preemptions": c["preemptions"],
            "steps": c["steps"],
            "kv_bytes_per_block": self.kv_bytes_per_block,
            "kv_bytes_in_use": usage["blocks_used"] * self.kv_bytes_per_block,
            "peak_kv_bytes": c["peak_blocks_used"] * self.kv_bytes_per_block,
            "queue_time_s": _percentiles(queue),
            "ttft_s": _percentiles(ttft),
            "tpot_s": _percentiles(tpot),
            "e2e_latency_s": _percentiles(e2e),
        }

    # ------------------------------------------------------------------ sizing

    def _blocks_from_memory(self, kv_cache_memory) -> int:
        if kv_cache_memory is None:
            kv_cache_memory = 0.9 if self.device.type == "cuda" else 0.2
        if isinstance(kv_cache_memory, bool) or not isinstance(kv_cache_memory, (int, float)) or kv_cache_memory <= 0:
            raise ValueError(f"LLMEngine: kv_cache_memory must be bytes (int > 0) or a fraction in (0, 1], "
                             f"got {kv_cache_memory!r}")
        if isinstance(kv_cache_memory, float):
            if kv_cache_memory > 1:
                raise ValueError(f"LLMEngine: kv_cache_memory as a fraction must be in (0, 1], got {kv_cache_memory}")
            kv_cache_memory = int(kv_cache_memory * _free_memory(self.device))
        blocks = kv_cache_memory // self.kv_bytes_per_block
        if blocks < 1:
            raise ValueError(f"LLMEngine: kv_cache_memory={kv_cache_memory} bytes is less than one block "
                             f"({self.kv_bytes_per_block} bytes)")
        most = self.max_num_seqs * -(-self.max_position_embeddings // self.block_size)
        return int(min(blocks, most))


def _free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p95": None, "p99": None}
    t = torch.tensor(values, dtype=torch.float64)
    return {f"p{q}": float(t.quantile(q / 100)) for q in (50, 95, 99)}


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is optional
        return None
    return tqdm(total=total, desc="requests", unit="req")
