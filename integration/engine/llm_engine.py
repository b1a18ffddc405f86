"""``LLMEngine``: continuous batching of a transformers decoder on the paged KV cache.

    from minipaged_ops.integration import LLMEngine, SamplingParams
    engine = LLMEngine(model, num_blocks=256, block_size=16)
    outs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=32))

Every :meth:`LLMEngine.step` is one iteration, all or nothing (``step_runner``): schedule, one
packed forward (:meth:`LLMEngine.run_model`), sample; a step that raises is rolled back, and
redoing it gives the same tokens. Between steps, ``request_table`` takes the queued requests in
and ends the aborted ones. A step's outputs wait at the front door until their caller takes them,
so an interrupt after a step loses none; a step whose rollback fails leaves an engine that raises
``EngineDeadError`` on every later call.

The front door (``add_request``, ``abort_request``, ``has_unfinished_requests``, ``stats``) may be
used from any thread while others step: requests and aborts are queued (``front_door``) and take
effect at the next step boundary; each ``generate()`` call gets its own outputs, whoever steps.
"""

from __future__ import annotations

import threading
from typing import Optional, Sequence as Seq

import torch

from minipaged_ops import quantized
from minipaged_ops.block_manager import KVBlockManager

from .. import _compat
from ..attention import ATTN_IMPLEMENTATION
from ..kv_pool import KVPool, check_full_attention, kv_geometry
from ..linear16 import widen_linears
from ..weight_quant import check_quantization, describe_weights
from .engine_args import check_engine_args, default_block_size, eos_token_ids, model_len, pool_blocks, text_config
from .engine_parts import EngineParts
from .front_door import EngineDeadError, FrontDoor, build_request
from .outputs import RequestOutput
from .request_table import RequestTable
from .sampler import Sampler
from .sampling_params import MAX_LOGPROBS, SamplingParams
from .scheduler import Scheduler
from .speculative.config import SpeculativeConfig
from .speculative.speculator import Speculator, make_proposer
from .stats import StatsLog
from .structured_outputs import GrammarCompilerCache
from .step_runner import MAX_FAILURES, StepRunner

__all__ = ["LLMEngine"]


class LLMEngine(EngineParts):
    """Continuous batching over a pool of ``num_blocks`` KV blocks.

    Args:
        model: a decoder-only transformers ``*ForCausalLM`` whose layers are all full attention;
            its attention implementation is set to ``"minipaged"`` (without the engine's step it
            falls back to SDPA, so ``model.generate`` keeps working).
        num_blocks: KV blocks per layer; None sizes the pool from ``kv_cache_memory``.
        block_size: token slots per block; None: the device's default (:func:`default_block_size`:
            64 on the CPU, whose decode reads longer runs faster, 16 on CUDA).
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
        max_logprobs: the most log-probabilities a request may ask for per token (``logprobs``,
            ``prompt_logprobs``); -1: the whole vocabulary. vLLM's default, 20.
        max_model_len: the longest sequence (prompt + generated); None: the model's positions or
            the pool's tokens, whichever is fewer. A pool sized from memory is sized for it.
        speculative_config: vLLM's, as a dict or its JSON text: ``{"method": "ngram",
            "num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min": m}`` or
            ``{"method": "draft_model", "model": PATH_OR_MODULE, "num_speculative_tokens": k}`` (see
            ``speculative``): decoding sequences propose up to k tokens (from their own history, or
            a smaller model's argmax on a pool of its own) and one forward keeps those the model
            agrees with; the tokens are those without it.
    """

    kv_pool_class = KVPool  # a tensor-parallel driver's engine uses a pool that records its moves

    def __init__(self, model, num_blocks: Optional[int] = None, block_size: Optional[int] = None, *,
                 kv_cache_memory=None, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 enable_prefix_caching: bool = True, preemption_mode: str = "recompute",
                 scheduling_policy: str = "fcfs", seed: int = 0, tokenizer=None, kv_cache_dtype: str = "auto",
                 calculate_kv_scales: bool = False, speculative_config=None, max_logprobs: int = MAX_LOGPROBS,
                 max_model_len: Optional[int] = None):
        check_engine_args(model, block_size=block_size, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens, preemption_mode=preemption_mode,
                          scheduling_policy=scheduling_policy, seed=seed, max_logprobs=max_logprobs,
                          max_model_len=max_model_len)
        config = text_config(model)
        check_full_attention(config, "LLMEngine")
        geometry = kv_geometry(model)
        param = next(model.parameters())
        self.model, self.config = model, config
        self.device, self.dtype = param.device, param.dtype
        block_size = default_block_size(self.device) if block_size is None else block_size
        self.kv_cache_dtype = quantized.cache_dtype(kv_cache_dtype, self.dtype)  # ValueError naming it
        quantized.check_calculate_kv_scales(calculate_kv_scales, kv_cache_dtype)
        self.max_position_embeddings = getattr(config, "max_position_embeddings", None) or 1 << 30
        self.speculative_config = SpeculativeConfig.parse(speculative_config)  # ValueError naming a bad key
        bytes_per_block = geometry.bytes_per_block(block_size, self.kv_cache_dtype)
        num_blocks = pool_blocks(num_blocks, kv_cache_memory, bytes_per_block=bytes_per_block, device=self.device,
                                 max_num_seqs=max_num_seqs, block_size=block_size,
                                 max_position_embeddings=min(self.max_position_embeddings, max_model_len or 1 << 62))
        max_model_len = model_len(max_model_len, max_position_embeddings=self.max_position_embeddings,
                                  pool_tokens=num_blocks * block_size)
        self.max_logprobs = config.vocab_size if max_logprobs == -1 else max_logprobs
        block_manager = KVBlockManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
        self.pool = self.kv_pool_class(geometry, block_manager, dtype=self.kv_cache_dtype, device=self.device,
                                       **({"calculate_kv_scales": True} if calculate_kv_scales else {}))
        self.stats_log = StatsLog()
        self.speculator = None if self.speculative_config is None else Speculator(
            self.speculative_config, self.stats_log.counters, max_model_len,
            make_proposer(self.speculative_config, target=model, num_blocks=num_blocks, block_size=block_size))
        self.scheduler = Scheduler(self.pool, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                   preemption_mode=preemption_mode, policy=scheduling_policy,
                                   isolate_after=MAX_FAILURES - 1, speculator=self.speculator)
        self.eos_token_ids = eos_token_ids(model)  # read when a request is built
        if self.device.type == "cpu":
            widen_linears(model)  # 16-bit weights at float32 speed where the CPU lacks 16-bit dot products
        self.weights = describe_weights(model)
        if _compat.attention_implementation(model) != ATTN_IMPLEMENTATION:
            model.set_attn_implementation(ATTN_IMPLEMENTATION)

        self._door = FrontDoor(seed)
        self.step_lock = threading.Lock()  # one step at a time; hold it to act between steps (stats, shutdown)
        self.request_table = RequestTable(self.scheduler, self.stats_log, self._door, tokenizer)
        # SamplingParams.structured_outputs: compiled at add_request, on the caller's thread
        self.grammars = None if tokenizer is None else GrammarCompilerCache(tokenizer, config.vocab_size,
                                                                            self.eos_token_ids)
        self.step_runner = StepRunner(self.pool, self.scheduler, Sampler(config.vocab_size, self.device),
                                      self.stats_log, self.request_table, max_model_len=max_model_len, device=self.device,
                                      speculator=self.speculator)

    @classmethod
    def from_pretrained(cls, path, *, dtype=None, device=None, tensor_parallel_size: int = 1,
                        quantization: Optional[str] = None, **engine_args) -> "LLMEngine":
        """An engine on the model and tokenizer in the local folder ``path`` (``AutoModelForCausalLM``
        + ``AutoTokenizer``, nothing downloaded; see :func:`.loading.load_pretrained`). ``dtype``:
        None keeps the checkpoint's; ``device``: None is CUDA when there is one. ``engine_args`` are
        this constructor's (a ``tokenizer=`` given there replaces the folder's).
        ``tensor_parallel_size=N > 1``: the engine of rank 0 of N processes, each holding 1/N of the
        model and of the KV cache (``num_blocks`` and ``kv_cache_memory`` per rank; see
        :func:`..distributed.start_engine`). ``quantization``: "int8" or "int4" weight-only (CPU; see
        :mod:`..weight_quant`), not with tensor parallelism."""
        check_quantization(quantization, tensor_parallel_size=tensor_parallel_size)
        if tensor_parallel_size != 1:
            from ..distributed import start_engine

            return start_engine(path, tensor_parallel_size, dtype=dtype, device=device, **engine_args)
        from .loading import load_pretrained

        model, tokenizer = load_pretrained(path, dtype=dtype, device=device, quantization=quantization)
        engine_args.setdefault("tokenizer", tokenizer)
        return cls(model, **engine_args)

    def shutdown(self) -> None:
        """Release what the engine started outside this process (a tensor-parallel engine's
        workers); nothing to do for a single-process engine. Also on leaving a ``with`` block."""

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

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
        """Whether some request added has not had its final output returned yet (EngineDeadError
        once the engine has stopped, see :meth:`check_health`)."""
        return self._door.has_live_requests()

    def check_health(self) -> None:
        """Raise EngineDeadError if the engine takes no more calls (a failed step could not be
        rolled back): then step, generate, add_request, stats and has_unfinished_requests raise it."""
        self._door.check_alive()

    def generate(self, prompts: Seq[Seq[int]], params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Run ``prompts`` (token id lists) to completion; outputs in the prompts' order.
        ``params``: one SamplingParams for all, or one per prompt. Outputs of other requests
        (added with :meth:`add_request`) are left for the next :meth:`step`."""
        if params is None or isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"generate: {len(params)} SamplingParams for {len(prompts)} prompts")
        base = f"generate-{self._door.next_arrival()}-"
        requests = [build_request(self, f"{base}{i}", p, sp, 0) for i, (p, sp) in enumerate(zip(prompts, params))]
        ids, bar, done = [r.request_id for r in requests], None, 0
        self._door.queue(requests, awaited=True)
        try:  # from here on, whatever raises (the bar too) leaves none of them running or holding its id
            bar = _progress(len(ids), use_tqdm)
            while True:  # whoever's step ends them, their final outputs wait at the door until released
                results = self._door.finals(ids)
                if bar is not None and len(results) > done:
                    bar.update(len(results) - done)
                done = len(results)
                if done == len(ids):
                    break
                self._step()
            self._door.release(ids)
        except BaseException:  # the unfinished ones are aborted at the next step and never reported
            self._door.abandon(ids)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in ids]

    def stats(self, window_s: Optional[float] = None) -> dict:
        """The capacity report: queues, pool use, prefix-cache hit rate, preemptions, and latency
        percentiles (seconds) over the requests that ended in the last ``window_s`` seconds (None:
        all), with finished, aborted and errored requests counted apart; the weights' format and
        bytes (``weight_format``, ``weight_bytes``). Safe from any thread
        (it waits for a running step to end)."""
        with self.step_lock:  # (EngineDeadError on a dead engine, from the door)
            report = {**self.stats_log.report(self.pool, self.scheduler, self._door.num_queued_adds(), window_s),
                      **self.weights}
            return report if self.speculator is None else {**report, **self.speculator.report()}

    # ------------------------------------------------------------------ one iteration

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, run one packed forward, sample. Returns the requests that
        changed (new tokens, finished, aborted or errored), with those of earlier steps that were
        interrupted before handing theirs out. If anything inside raises, the step is rolled back
        and the exception re-raised; the next step goes on. If the rollback fails too, it raises
        EngineDeadError, as does every later call."""
        self._step()
        return self._door.take_stepped()

    @torch.inference_mode()
    def _step(self) -> None:
        """One iteration; its outputs are posted to the door (whose callers take them)."""
        with self.step_lock:
            self._door.check_alive()
            try:
                self.request_table.apply(self._door.take_commands(), self._door.requeue)
            except BaseException:
                self.stats_log.counters["failed_steps"] += 1
                raise
            try:
                self.step_runner.run(self.run_model)  # a failed step is rolled back and re-raised
            except EngineDeadError as dead:  # its rollback failed: the door refuses every later call
                self._door.kill(dead)
                raise

    def run_model(self, meta) -> torch.Tensor:
        """The model on one packed step: logits of the rows ``meta.logits_indices`` names (the
        tensor-parallel engine wraps it to fail its workers cleanly)."""
        return self.model(
            input_ids=meta.input_ids[None], position_ids=meta.position_ids[None], use_cache=False,
            logits_to_keep=meta.logits_indices, minipaged_step=meta, minipaged_kv_caches=self.pool.kv_caches,
            minipaged_kv_scales=self.pool.kv_scales,
        ).logits[0]


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is optional
        return None
    return tqdm(total=total, desc="requests", unit="req")
