"""``LLMEngine``: continuous batching of a transformers decoder on the paged KV cache.

    from minipaged_ops.integration import LLMEngine, SamplingParams
    engine = LLMEngine(model, num_blocks=256, block_size=16)
    outs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=32))

Every :meth:`LLMEngine.step` is one iteration: the scheduler reserves this step's chunks, the
planner packs them into one ``[1, total_tokens]`` forward, the sampler turns the last token's
logits of each finished chunk into the next token. A step is all or nothing: whatever raises
inside it rolls it back (its requests are requeued as for a recompute, and since every draw is a
function of the sequence's seed and position, redoing the step gives the same tokens).

The front door (``add_request``, ``abort_request``, ``has_unfinished_requests``, ``stats``) may be
used from any thread while one thread steps: requests and aborts are queued (``front_door``) and
take effect at the next step boundary.
"""

from __future__ import annotations

import threading
import time
from typing import Optional, Sequence as Seq

import torch

from minipaged_ops import quantized
from minipaged_ops.block_manager import KVBlockManager

from .. import _compat
from ..attention import ATTN_IMPLEMENTATION
from ..kv_pool import KVPool, blocks_for_memory, check_full_attention, kv_geometry
from ..planner import plan_step
from .front_door import FrontDoor, build_request, is_int
from .outputs import RequestOutput
from .rollback import StepSnapshot
from .sampler import Sampler
from .sampling_params import SamplingParams
from .scheduler import POLICIES, PREEMPTION_MODES, Scheduler
from .sequence import Request, Sequence, Status
from .stats import StatsLog

__all__ = ["LLMEngine"]

# a request that fails this many steps in a row, the last one alone, ends with finish_reason "error"
MAX_FAILURES = 3


class LLMEngine:
    """Continuous batching over a pool of ``num_blocks`` KV blocks.

    Args:
        model: a decoder-only transformers ``*ForCausalLM`` whose layers are all full attention;
            its attention implementation is set to ``"minipaged"`` (without the engine's step it
            falls back to SDPA, so ``model.generate`` keeps working).
        num_blocks: KV blocks per layer; None sizes the pool from ``kv_cache_memory``.
        kv_cache_memory: bytes for all layers' keys and values, or a fraction in (0, 1] of free
            memory (device memory on CUDA, available RAM on CPU). Default 0.9 on CUDA, 0.2 on CPU;
            never more than ``max_num_seqs`` sequences of the model's maximum length need.
        max_num_seqs: sequences running at once; max_num_batched_tokens: tokens per step (at
            least ``max_num_seqs``, so that every running sequence can decode each step).
        preemption_mode: "recompute" (free the blocks, recompute prompt + generated later) or
            "swap" (copy the blocks to host memory and back).
        scheduling_policy: "fcfs" (arrival order) or "priority" (``add_request(priority=)``,
            lower first; under pressure the lowest-priority running request is preempted first).
        seed: seeds the generator of every request that brings no ``SamplingParams.seed``.
        tokenizer: gives each completion its ``text`` and enables ``SamplingParams.stop`` strings.
        kv_cache_dtype: "auto" (the model's dtype), or an 8-bit KV cache: "int8" (a scale per token
            and kv head), "fp8_e4m3" or "fp8_e5m2" (a scale per layer); see minipaged_ops.quantized.
        calculate_kv_scales: fp8: set each layer's scales from the first batch's absolute maximum
            (else 1.0).
    """

    kv_pool_class = KVPool  # a tensor-parallel driver's engine uses a pool that records its moves

    def __init__(self, model, num_blocks: Optional[int] = None, block_size: int = 16, *,
                 kv_cache_memory=None, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 enable_prefix_caching: bool = True, preemption_mode: str = "recompute",
                 scheduling_policy: str = "fcfs", seed: int = 0, tokenizer=None, kv_cache_dtype: str = "auto",
                 calculate_kv_scales: bool = False):
        if not _compat.is_pretrained_model(model):
            raise ValueError(f"LLMEngine: model must be a transformers PreTrainedModel, got {type(model).__name__}")
        for name, value in (("block_size", block_size), ("max_num_seqs", max_num_seqs),
                            ("max_num_batched_tokens", max_num_batched_tokens)):
            if not is_int(value) or value < 1:
                raise ValueError(f"LLMEngine: {name} must be a positive int, got {value!r}")
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"LLMEngine: max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({max_num_seqs}), or running sequences could not all decode in one step")
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"LLMEngine: preemption_mode must be one of {PREEMPTION_MODES}, got {preemption_mode!r}")
        if scheduling_policy not in POLICIES:
            raise ValueError(f"LLMEngine: scheduling_policy must be one of {POLICIES}, got {scheduling_policy!r}")
        if not is_int(seed):
            raise ValueError(f"LLMEngine: seed must be an int, got {seed!r}")
        config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
        check_full_attention(config, "LLMEngine")
        geometry = kv_geometry(model)
        param = next(model.parameters())
        self.model, self.config, self.tokenizer = model, config, tokenizer
        self.device, self.dtype = param.device, param.dtype
        self.kv_cache_dtype = quantized.cache_dtype(kv_cache_dtype, self.dtype)  # ValueError naming it
        quantized.check_calculate_kv_scales(calculate_kv_scales, kv_cache_dtype)
        self.max_position_embeddings = getattr(config, "max_position_embeddings", None) or 1 << 30
        if num_blocks is None:
            most = max_num_seqs * -(-self.max_position_embeddings // block_size)
            num_blocks = blocks_for_memory(kv_cache_memory, geometry.bytes_per_block(block_size, self.kv_cache_dtype),
                                           self.device, most=most, who="LLMEngine")
        elif not is_int(num_blocks) or num_blocks < 1:
            raise ValueError(f"LLMEngine: num_blocks must be a positive int or None, got {num_blocks!r}")
        block_manager = KVBlockManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
        self.pool = self.kv_pool_class(geometry, block_manager, dtype=self.kv_cache_dtype, device=self.device,
                                       **({"calculate_kv_scales": True} if calculate_kv_scales else {}))
        self.max_model_len = min(self.max_position_embeddings, num_blocks * block_size)
        self.scheduler = Scheduler(self.pool, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                   preemption_mode=preemption_mode, policy=scheduling_policy,
                                   isolate_after=MAX_FAILURES - 1)
        self.sampler = Sampler(config.vocab_size, self.device)
        eos = model.generation_config.eos_token_id if getattr(model, "generation_config", None) else None
        self.eos_token_ids = frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos)
        if _compat.attention_implementation(model) != ATTN_IMPLEMENTATION:
            model.set_attn_implementation(ATTN_IMPLEMENTATION)

        self._door = FrontDoor(seed)
        self.step_lock = threading.Lock()  # one step at a time; hold it to act between steps (stats, shutdown)
        self._requests: dict[str, Request] = {}  # applied and unfinished
        self._ended: list[Request] = []  # aborted or errored outside a step: reported by the next one
        self.stats_log = StatsLog()

    @classmethod
    def from_pretrained(cls, path, *, dtype=None, device=None, tensor_parallel_size: int = 1,
                        **engine_args) -> "LLMEngine":
        """An engine on the model and tokenizer in the local folder ``path`` (``AutoModelForCausalLM``
        + ``AutoTokenizer``, nothing downloaded; see :func:`.loading.load_pretrained`). ``dtype``:
        None keeps the checkpoint's; ``device``: None is CUDA when there is one. ``engine_args`` are
        this constructor's (a ``tokenizer=`` given there replaces the folder's).
        ``tensor_parallel_size=N > 1``: the engine of rank 0 of N processes, each holding 1/N of the
        model and of the KV cache (``num_blocks`` and ``kv_cache_memory`` per rank; see
        :func:`..distributed.start_engine`)."""
        if tensor_parallel_size != 1:
            from ..distributed import start_engine

            return start_engine(path, tensor_parallel_size, dtype=dtype, device=device, **engine_args)
        from .loading import load_pretrained

        model, tokenizer = load_pretrained(path, dtype=dtype, device=device)
        engine_args.setdefault("tokenizer", tokenizer)
        return cls(model, **engine_args)

    def shutdown(self) -> None:
        """Release what the engine started outside this process (a tensor-parallel engine's
        workers); nothing to do for a single-process engine. Also on leaving a ``with`` block."""

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ the pool, for readers

    @property
    def block_manager(self):
        return self.pool.block_manager

    @property
    def kv_caches(self):
        return self.pool.kv_caches

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def kv_bytes_per_block(self) -> int:
        return self.pool.bytes_per_block

    # ------------------------------------------------------------------ the front door

    def add_request(self, request_id: str, prompt_token_ids, params: Optional[SamplingParams] = None, *,
                    priority: int = 0) -> None:
        """Queue a request; it joins at the next step. Raises ValueError (changing nothing) for a
        bad one. Safe to call from any thread."""
        self._door.queue([build_request(self, request_id, prompt_token_ids, params, priority)])

    def abort_request(self, request_id: str) -> None:
        """Stop a request at the next step boundary and free its blocks; that step reports it
        with finish_reason "abort", and only then is its id free again. Unknown or finished ids
        are ignored. Safe to call from any thread."""
        self._door.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        """Whether some request added has not had its final output returned yet."""
        return self._door.has_live_requests()

    def generate(self, prompts: Seq[Seq[int]], params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Run ``prompts`` (token id lists) to completion; outputs in the prompts' order.
        ``params``: one SamplingParams for all, or one per prompt. Outputs of other requests
        (added with :meth:`add_request`) are kept for the next :meth:`step`."""
        if params is None or isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"generate: {len(params)} SamplingParams for {len(prompts)} prompts")
        base = f"generate-{self._door.next_arrival()}-"
        requests = [build_request(self, f"{base}{i}", p, sp, 0) for i, (p, sp) in enumerate(zip(prompts, params))]
        self._door.queue(requests)
        ids = [r.request_id for r in requests]
        results: dict[str, RequestOutput] = {}
        bar = _progress(len(ids), use_tqdm)
        try:
            while len(results) < len(ids):
                for out in self._step():
                    if out.request_id not in results and out.request_id in ids:
                        if out.finished:
                            results[out.request_id] = out
                            if bar is not None:
                                bar.update(1)
                    else:
                        self._door.keep_for_step(out)
        except BaseException:  # the unfinished ones are aborted at the next step and never reported
            self._door.abandon(ids, results)
            raise
        finally:
            if bar is not None:
                bar.close()
        self._door.release(ids)
        return [results[i] for i in ids]

    def stats(self, window_s: Optional[float] = None) -> dict:
        """The capacity report: queues, pool use, prefix-cache hit rate, preemptions, and latency
        percentiles (seconds) over the requests that ended in the last ``window_s`` seconds (None:
        all), with finished, aborted and errored requests counted apart. Safe from any thread
        (it waits for a running step to end)."""
        with self.step_lock:
            return self.stats_log.report(self.pool, self.scheduler, self._door.num_queued_adds(), window_s)

    # ------------------------------------------------------------------ one iteration

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, run one packed forward, sample. Returns the requests that
        changed (new tokens, finished, aborted or errored). If anything inside raises, the step is
        rolled back and the exception re-raised; the next step goes on."""
        return self._door.deliver(self._step())

    @torch.inference_mode()
    def _step(self) -> list[RequestOutput]:
        with self.step_lock:
            self._apply_commands()
            scheduled: list = []
            snapshot = StepSnapshot(self.scheduler, self.stats_log)
            try:
                self.scheduler.schedule(scheduled)
                changed = []
                if scheduled:
                    snapshot.add_sequences(scheduled)
                    self.stats_log.counters["peak_blocks_used"] = max(self.stats_log.counters["peak_blocks_used"],
                                                                      self.pool.blocks_in_use)
                    changed = self._run(scheduled)
            except BaseException:
                self._roll_back(scheduled, snapshot)  # requests ended before the step wait for the next one
                raise
            for seq, _ in scheduled:
                seq.request.failures = 0
            ended, self._ended = self._ended, []
            return self._door.without_dropped([req.output() for req in ended + changed])

    def _run(self, scheduled: list) -> list[Request]:
        """Compute and commit one step; returns the requests that changed."""
        self.pool.apply_copies()
        meta = plan_step(self.pool.block_manager, [c for _, c in scheduled], self.device)
        logits = self.run_model(meta)
        c = self.stats_log.counters
        c["steps"] += 1
        for seq, chunk in scheduled:
            seq.num_computed += len(chunk.token_ids)
            decode = len(chunk.token_ids) == 1 and seq.output_ids
            c["decode_tokens_computed" if decode else "prefill_tokens_computed"] += len(chunk.token_ids)
        rows, seqs = [], []
        for row, i in zip(meta.sample_rows, meta.sampled):
            seq = scheduled[i][0]
            if not seq.request.forked and seq.params.n > 1:
                self._fork(seq)
            # the prompt's first sample is drawn for every completion of the request
            for s in seq.request.seqs if seq.index == 0 and not seq.output_ids else [seq]:
                if s.status == Status.RUNNING and s.num_uncomputed == 0:
                    rows.append(row)
                    seqs.append(s)
        # the sampler works in place: no copy when each row is sampled once and none is read after
        every_row = rows == list(range(logits.shape[0])) and not meta.all_logits_rows
        sampled = self.sampler(logits if every_row else logits[rows], seqs) if seqs else []
        self._record_prompt_logprobs(meta, scheduled, logits)
        now = time.perf_counter()  # after the sampler's device sync
        changed: dict[str, Request] = {}
        for seq, token in zip(seqs, sampled):
            req = seq.request
            changed[req.request_id] = req
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
                c["prompt_tokens"] += len(req.prompt_token_ids)
            c["generation_tokens"] += 1
            self._accept(seq, token)
        for req in changed.values():
            if all(s.status == Status.FINISHED for s in req.seqs):
                req.metrics.finished_time = now
                del self._requests[req.request_id]
                self.stats_log.record_end(req.metrics, max(len(s.output_ids) for s in req.seqs), "finished")
        return list(changed.values())

    def run_model(self, meta) -> torch.Tensor:
        """The model on one packed step: logits of the rows ``meta.logits_indices`` names (the
        tensor-parallel engine wraps it to fail its workers cleanly)."""
        return self.model(
            input_ids=meta.input_ids[None], position_ids=meta.position_ids[None], use_cache=False,
            logits_to_keep=meta.logits_indices, minipaged_step=meta, minipaged_kv_caches=self.pool.kv_caches,
            minipaged_kv_scales=self.pool.kv_scales,
        ).logits[0]

    def _record_prompt_logprobs(self, meta, scheduled: list, logits: torch.Tensor) -> None:
        for i, first, count in meta.all_logits_rows:
            seq, chunk = scheduled[i]
            have, prompt = seq.request.prompt_logprobs, seq.prompt_token_ids
            # row j is position chunk.start + j; its logits give the logprob of the next prompt token
            lo = len(have) - 1 - chunk.start
            hi = min(count, len(prompt) - 1 - chunk.start)
            if hi <= lo:
                continue
            targets = prompt[chunk.start + lo + 1:chunk.start + hi + 1]
            have.extend(self.sampler.prompt_logprobs(logits[first + lo:first + hi], targets, seq.params.prompt_logprobs))

    def _accept(self, seq: Sequence, sampled) -> None:
        params, token = seq.params, sampled.token_id
        seq.token_ids.append(token)
        if seq.logprobs is not None:
            seq.logprobs.append(sampled.logprobs)
        stop_str = seq.detokenizer.push(token) if seq.detokenizer is not None else None
        if token in params.stop_token_ids:
            seq.stop_reason = token
            self._finish(seq, "stop")
        elif token in seq.eos_token_ids and not params.ignore_eos:
            self._finish(seq, "stop")
        elif stop_str is not None:
            seq.stop_reason = stop_str
            self._finish(seq, "stop")
        elif len(seq.output_ids) >= params.max_tokens or len(seq.token_ids) >= self.max_model_len:
            self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        if seq.detokenizer is not None:
            seq.detokenizer.finish()

    def _fork(self, parent: Sequence) -> None:
        """n > 1: the other completions share the prompt's blocks (copy-on-write later)."""
        req = parent.request
        req.forked = True
        for i in range(1, req.params.n):
            child = self._new_sequence(req, i, list(parent.token_ids))
            child.num_computed = parent.num_computed
            child.status = Status.RUNNING
            self.pool.block_manager.fork(parent.seq_id, child.seq_id)
            req.seqs.append(child)
            self.scheduler.running.append(child)

    def _roll_back(self, scheduled: list, snapshot: StepSnapshot) -> None:
        """Undo a failed step: its sequences go back to waiting as if preempted for recompute,
        with the tokens, logprobs and text they had before it. A request that failed alone after
        failing before ends with finish_reason "error"."""
        snapshot.restore(scheduled, self.scheduler, self._requests, self.stats_log, self._replay_detokenizer)
        self.stats_log.counters["failed_steps"] += 1
        requests = {id(seq.request): seq.request for seq, _ in scheduled}.values()
        for req in requests:
            req.failures = req.failures + 1 if len(requests) == 1 else min(req.failures + 1, MAX_FAILURES - 1)
            if req.failures >= MAX_FAILURES:
                self._end(req, "error")

    # ------------------------------------------------------------------ requests in and out

    def _apply_commands(self) -> None:
        for kind, item in self._door.take_commands():
            if kind == "add":
                req = item
                req.prompt_logprobs = [None] if req.params.prompt_logprobs is not None else None
                req.seqs.append(self._new_sequence(req, 0, list(req.prompt_token_ids)))
                self._requests[req.request_id] = req
                self.scheduler.add(req.seqs[0])
            elif item in self._requests:
                self._end(self._requests[item], "abort")

    def _new_sequence(self, req: Request, index: int, token_ids: list[int]) -> Sequence:
        seq = Sequence(f"{req.request_id}#{index}", req, index, token_ids)
        if req.params.logprobs is not None:
            seq.logprobs = []
        if self.tokenizer is not None:
            seq.detokenizer = self._detokenizer(req)
        return seq

    def _detokenizer(self, req: Request):
        from .detokenizer import IncrementalDetokenizer

        params = req.params
        return IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, stop=params.stop,
                                      include_stop_str_in_output=params.include_stop_str_in_output,
                                      skip_special_tokens=params.skip_special_tokens, min_tokens=params.min_tokens)

    def _replay_detokenizer(self, seq: Sequence):
        detokenizer = self._detokenizer(seq.request)
        for token in seq.output_ids:
            detokenizer.push(token)
        return detokenizer

    def _end(self, req: Request, reason: str) -> None:
        """End a request outside a step's commit (abort, error): free its blocks now, report it
        with the next step's outputs."""
        for seq in req.seqs:
            if seq.status != Status.FINISHED:
                self._finish(seq, reason)
        req.metrics.finished_time = time.perf_counter()
        del self._requests[req.request_id]
        self.stats_log.record_end(req.metrics, max(len(s.output_ids) for s in req.seqs),
                                  "aborted" if reason == "abort" else reason)
        self._ended.append(req)


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is optional
        return None
    return tqdm(total=total, desc="requests", unit="req")
