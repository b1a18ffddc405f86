"""Rank 0 of a tensor-parallel engine: the worker processes it starts, the broadcast it sends
before every forward, and the clear error it raises when a worker is gone.

:func:`start_engine` is what ``LLMEngine.from_pretrained(path, tensor_parallel_size=N)`` calls:

* on one machine it starts ranks 1 .. N-1 as fresh interpreters (``python -m`` the worker module,
  so a user's script needs no ``if __name__ == "__main__"`` guard), meets them on a free loopback
  port and returns the engine of rank 0;
* under ``torchrun`` (every process runs the same command) rank 0 returns the engine and every
  other rank serves the driver's steps until it stops, then exits the process (``SystemExit(0)``):
  a serving script needs no branch of its own.

The engine (:class:`TensorParallelLLMEngine`) is an ``LLMEngine`` whose pool records its moves
(``pool_moves.DriverKVPool``) and whose model sends, just before each forward, one message with
those moves and the forward's arguments; every worker then runs the same forward.

Failure: a worker that dies makes the next collective fail at once ("connection closed"), one that
hangs makes it time out after ``timeout_s``; either way the step raises
:class:`TensorParallelError` naming the rank, and so does every later step (the ranks are out of
step for good: shut the engine down and start a new one). ``shutdown()``, leaving a ``with``
block, and interpreter exit stop the workers; a worker whose driver died exits by itself.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from typing import Optional

import torch

from ..engine.llm_engine import LLMEngine
from .channel import StepChannel, to_host
from .group import TPGroup, free_port, join_group, launched_by_torchrun, leave_group, rendezvous_store
from .pool_moves import DriverKVPool
from .sharding import all_reduce_max, check_shardable, collective_seconds
from . import worker
from .worker import RankSpec, load_shard, serve_steps, share_cpu

__all__ = ["TensorParallelError", "TensorParallelLLMEngine", "start_engine"]

DEFAULT_TIMEOUT_S = 60.0  # a step's collectives: how long a hung worker can stall the driver
DEFAULT_STARTUP_TIMEOUT_S = 600.0  # every rank joined and loaded its share


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died, hung or failed: the engine cannot run another step."""


class _Workers:
    """The worker processes rank 0 started (none under torchrun), and what became of them."""

    def __init__(self, spec: Optional[RankSpec]):
        self.processes: dict[int, subprocess.Popen] = {}
        if spec is None:
            return
        for rank in range(1, spec.world_size):
            command = [sys.executable, "-m", worker.__name__, str(rank), json.dumps(asdict(spec))]
            self.processes[rank] = subprocess.Popen(command, stdin=subprocess.DEVNULL)

    def describe_failures(self, store=None) -> list[str]:
        """One line per worker that has exited, with the error it left in ``store`` if any."""
        lines = []
        for rank, process in self.processes.items():
            if process.poll() is None:
                continue
            text = ""
            if store is not None and store.check([f"error/{rank}"]):
                text = ": " + store.get(f"error/{rank}").decode(errors="replace").strip()
            lines.append(f"worker rank {rank} (pid {process.pid}) exited with code {process.returncode}{text}")
        return lines

    def wait_for(self, store, keys: list[str], timeout_s: float, what: str) -> None:
        """Wait until every key is set in ``store``, failing at once if a worker exits."""
        deadline = time.monotonic() + timeout_s
        while True:
            failed = self.describe_failures(store)
            if failed:
                raise TensorParallelError(f"tensor-parallel start failed while {what}: " + "; ".join(failed))
            if store.check(keys):
                return
            if time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel start: the workers were not done {what} after "
                                          f"{timeout_s:.0f} s (startup_timeout_s)")
            time.sleep(0.05)

    def stop(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the workers to exit, then kill those that did not (a
        worker holds nothing worth a gentler end: its state is a copy of the driver's)."""
        deadline = time.monotonic() + timeout_s
        for process in self.processes.values():
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


class _Driver:
    """Rank 0's side of the group: sends each step, notices failures, stops the workers."""

    def __init__(self, group: TPGroup, workers: _Workers, store, threads: int):
        self.group, self.workers, self.store = group, workers, store
        self.threads = threads  # this process's torch threads before the engine took its share
        self.channel = StepChannel(group.control)
        self.failure: Optional[str] = None
        self.closed = False

    def check_usable(self) -> None:
        if self.closed:
            raise TensorParallelError("the tensor-parallel engine was shut down")
        if self.failure is not None:
            raise TensorParallelError(self.failure)

    def send(self, message) -> None:
        self.check_usable()
        self.channel.send(message)

    def fail(self, error: BaseException) -> TensorParallelError:
        """Record that the ranks are out of step after ``error`` and explain it."""
        time.sleep(0.2)  # a dying worker's exit code and message arrive just after its socket closes
        failed = self.workers.describe_failures(self.store)
        cause = "; ".join(failed) if failed else f"{type(error).__name__}: {str(error).strip().splitlines()[0]}"
        self.failure = (f"tensor-parallel step failed ({cause}); the ranks are out of step, so this engine cannot "
                        "run another step: shutdown() it and start a new one")
        return TensorParallelError(self.failure)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.shutdown)
        stopping = self.failure is None
        if stopping:
            try:
                self.channel.send(("stop",))
            except Exception:  # a worker already gone: killing the others below is all that is left
                stopping = False
        self.workers.stop(timeout_s if stopping else 0.0)  # out of step: the workers cannot read a stop
        leave_group()
        torch.set_num_threads(self.threads)


class TensorParallelLLMEngine(LLMEngine):
    """An :class:`LLMEngine` on rank 0 of a tensor-parallel group (built by :func:`start_engine`).

    ``num_blocks`` and ``kv_cache_memory`` are per rank: every rank's pool holds the same blocks
    for its ``num_kv_heads / N`` heads, so ``kv_bytes_per_block`` (in ``stats()``) is one rank's.
    """

    def __init__(self, model, *args, tensor_parallel_driver: _Driver, **kwargs):
        self._tp = tensor_parallel_driver
        # fp8 scales calculated from the first batch: the maxima over every rank's heads
        self.kv_pool_class = functools.partial(DriverKVPool,
                                               amax_all_reduce=all_reduce_max(tensor_parallel_driver.group.compute))
        super().__init__(model, *args, **kwargs)
        self._send_hook = model.register_forward_pre_hook(self._send_step, with_kwargs=True)

    @property
    def tensor_parallel_size(self) -> int:
        return self._tp.group.world_size

    @property
    def worker_pids(self) -> tuple[int, ...]:
        """Process ids of the workers this engine started (empty under torchrun)."""
        return tuple(p.pid for p in self._tp.workers.processes.values())

    def _send_step(self, module, args, kwargs):
        """Before the driver's forward: the step's pool moves and forward arguments, to every worker."""
        if args or kwargs.get("minipaged_step") is None:
            raise TensorParallelError("a tensor-parallel model runs only inside its engine's step(): its workers "
                                      "join every forward through the engine's broadcast")
        call = {k: v for k, v in kwargs.items() if k not in ("minipaged_kv_caches", "minipaged_kv_scales")}
        self._tp.send(("step", self.pool.take_moves(), to_host(call)))

    def run_model(self, meta) -> torch.Tensor:
        self._tp.check_usable()
        try:
            return super().run_model(meta)
        except TensorParallelError:
            raise
        except BaseException as error:  # mid-collective: the ranks no longer agree on what comes next
            failure = self._tp.fail(error)
            if not isinstance(error, Exception):  # Ctrl-C stays Ctrl-C; the next step says why it cannot run
                raise
            raise failure from error

    def stats(self, window_s: Optional[float] = None) -> dict:
        """``LLMEngine.stats()`` plus ``tensor_parallel_size``, ``kv_bytes_per_rank`` (one rank's
        pool) and the driver's seconds in collectives (``collective_seconds``: the per-step
        broadcast and the model's all-reduces and gather, host time)."""
        report = super().stats(window_s)
        report["tensor_parallel_size"] = self.tensor_parallel_size
        report["kv_bytes_per_rank"] = self.pool.usage()["kv_bytes_pool"]
        report["collective_seconds"] = {"broadcast": self._tp.channel.seconds, "model": collective_seconds()}
        return report

    def shutdown(self) -> None:
        """Stop the workers and leave the process group (idempotent; also at interpreter exit).
        Waits for a step running in another thread: a stop sent mid-step would meet the
        workers inside that step's collectives."""
        with self.step_lock:
            self._send_hook.remove()
            self._tp.shutdown()


def start_engine(path, tensor_parallel_size: int, *, dtype=None, device=None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
                 **engine_args) -> TensorParallelLLMEngine:
    """Rank 0's engine over ``tensor_parallel_size`` ranks (see the module docstring).

    ``timeout_s``: how long a step waits for a silent rank before it fails; ``startup_timeout_s``:
    for every rank to start and load its share. On CPU every rank on this machine, this process
    included, takes ``cores / ranks`` torch threads."""
    from transformers import AutoConfig

    check_shardable(AutoConfig.from_pretrained(os.fspath(path), local_files_only=True), tensor_parallel_size)
    device_type = torch.device(device).type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(dtype, torch.dtype):  # the workers get it as text
        dtype = str(dtype).removeprefix("torch.")
    if launched_by_torchrun():
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if world_size != tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size} but torchrun started {world_size} processes "
                             "(--nnodes x --nproc-per-node must equal it)")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        spec = RankSpec(os.fspath(path), dtype, device_type, world_size, os.environ["MASTER_ADDR"],
                        int(os.environ["MASTER_PORT"]), timeout_s, startup_timeout_s)
        workers = _Workers(None)
    else:
        if device_type == "cuda" and torch.cuda.device_count() < tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size} needs one GPU per rank; this machine has "
                             f"{torch.cuda.device_count()} (across machines, launch with torchrun)")
        rank, local_rank = 0, 0
        spec = RankSpec(os.fspath(path), dtype, device_type, tensor_parallel_size, "127.0.0.1", free_port(),
                        timeout_s, startup_timeout_s)
        workers = _Workers(spec)
    threads = share_cpu(spec, int(os.environ.get("LOCAL_WORLD_SIZE", 1 if launched_by_torchrun() else spec.world_size)))
    try:
        store = rendezvous_store(rank, spec.world_size, spec.host, spec.port, startup_timeout_s)
        group = join_group(rank, spec.world_size, spec.device(local_rank), store, timeout_s=timeout_s,
                           startup_timeout_s=startup_timeout_s)
        model, tokenizer = load_shard(spec, group)
        if rank != 0:  # a torchrun worker: serve, then end the process as rank 0 asked
            store.set(f"loaded/{rank}", "1")
            serve_steps(group, model, StepChannel(group.control))
            leave_group()
            raise SystemExit(0)
        driver = _Driver(group, workers, store, threads)
        engine_args.setdefault("tokenizer", tokenizer)  # as LLMEngine.from_pretrained: the folder's unless given
        engine = TensorParallelLLMEngine(model, tensor_parallel_driver=driver, **engine_args)
        keys = [f"loaded/{r}" for r in range(1, spec.world_size)]
        if workers.processes:
            workers.wait_for(store, keys, startup_timeout_s, "loading the model")
        else:
            store.wait(keys)
        driver.send(("pool", engine.num_blocks, engine.block_size, engine_args.get("kv_cache_dtype", "auto"),
                     bool(engine_args.get("calculate_kv_scales", False))))
    except BaseException:
        workers.stop(5.0)
        leave_group()
        torch.set_num_threads(threads)
        raise
    atexit.register(driver.shutdown)  # the driver, not the engine: dropping the engine still stops them at exit
    return engine

