"""A tensor-parallel rank: load this rank's share of the model, then run the driver's steps.

Rank 0 (the driver) runs the engine; every other rank runs :func:`serve_steps`: receive the step's
message, replay its pool moves, run the same forward on its own heads (the collectives inside the
model meet the driver's), repeat until the driver says stop. A worker holds no scheduler, block
manager or sampler, and never looks at the logits.

Two ways to start one: :func:`main`, a process the driver started on this machine, and a
``torchrun`` rank > 0 running the same command as rank 0 (see ``driver.start_engine``).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Optional

import torch

from minipaged_ops import quantized
from minipaged_ops.block_manager import KVBlockManager

from ..attention import ATTN_IMPLEMENTATION
from ..kv_pool import KVPool, kv_geometry
from .channel import StepChannel, to_device
from .group import TPGroup, join_group, leave_group, rendezvous_store
from .pool_moves import WorkerMoves
from .sharding import all_reduce_max, shard_model

__all__ = ["RankSpec", "load_shard", "serve_steps", "share_cpu"]


@dataclass(frozen=True)
class RankSpec:
    """What every rank needs to join the group and load its share (the driver passes it to the
    workers it starts as JSON)."""

    model_path: str
    dtype: Optional[str]
    device_type: str  # "cpu" or "cuda"; rank r of a spawned group uses cuda:r
    world_size: int
    host: str
    port: int
    timeout_s: float
    startup_timeout_s: float

    def device(self, local_rank: int) -> torch.device:
        return torch.device("cuda", local_rank) if self.device_type == "cuda" else torch.device("cpu")


def share_cpu(spec: RankSpec, local_ranks: int) -> int:
    """On CPU, ranks on one machine split its cores: each takes ``cores / local_ranks`` threads
    (all of them each would oversubscribe the cores, and the ranks wait on each other every layer).
    Returns the thread count before."""
    before = torch.get_num_threads()
    if spec.device_type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_ranks))
    return before


def load_shard(spec: RankSpec, group: TPGroup):
    """``(model, tokenizer)``: the model loaded on the host, cut to this rank's share, then moved
    to this rank's device (the device only ever holds the share)."""
    from ..engine.loading import load_pretrained

    model, tokenizer = load_pretrained(spec.model_path, dtype=spec.dtype, device="cpu")
    shard_model(model, group.rank, group.world_size, group.compute)
    model = model.to(group.device)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return model, tokenizer


@torch.inference_mode()
def serve_steps(group: TPGroup, model, channel: StepChannel) -> None:
    """The worker loop. Messages: ``("pool", num_blocks, block_size, kv_cache_dtype,
    calculate_kv_scales)`` (once, first),
    ``("step", moves, forward_kwargs)`` and ``("stop",)``."""
    pool = moves = None
    while True:
        message = channel.receive()
        kind = message[0]
        if kind == "stop":
            return
        if kind == "pool":
            _, num_blocks, block_size, kv_cache_dtype, calculate_kv_scales = message
            dtype = quantized.cache_dtype(kv_cache_dtype, next(model.parameters()).dtype)
            # the block manager only sizes the pool: the driver's decides where every token goes
            pool = KVPool(kv_geometry(model), KVBlockManager(num_blocks, block_size), dtype=dtype,
                          device=group.device, calculate_kv_scales=calculate_kv_scales,
                          amax_all_reduce=all_reduce_max(group.compute))
            moves = WorkerMoves(pool)
        elif kind == "step":
            _, step_moves, kwargs = message
            moves.replay(step_moves)
            model(**to_device(kwargs, group.device), minipaged_kv_caches=pool.kv_caches,
                  minipaged_kv_scales=pool.kv_scales)
        else:
            raise ValueError(f"tensor-parallel worker: unknown message {kind!r}")


def main(argv=None) -> int:
    """Entry point of a worker the driver started (``python -m ...distributed.worker RANK SPEC``,
    SPEC as JSON): a fresh interpreter, so the user's script is never re-imported. A failure is
    left in the store (``error/RANK``) for the driver to report, and ends the process with 1."""
    rank, spec = int(argv[0]), RankSpec(**json.loads(argv[1]))
    _exit_with_parent()
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # rank 0 shows the loading once
    store = None
    try:
        store = rendezvous_store(rank, spec.world_size, spec.host, spec.port, spec.startup_timeout_s)
        group = join_group(rank, spec.world_size, spec.device(rank), store, timeout_s=spec.timeout_s,
                           startup_timeout_s=spec.startup_timeout_s)
        share_cpu(spec, spec.world_size)
        model, _ = load_shard(spec, group)
        store.set(f"loaded/{rank}", "1")
        serve_steps(group, model, StepChannel(group.control))
        leave_group()
        return 0
    except BaseException as error:
        sys.stderr.write(f"minipaged tensor-parallel worker rank {rank} failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        if store is not None:
            try:
                store.set(f"error/{rank}", f"{type(error).__name__}: {error}")
            except Exception:  # the driver (and its store) may be gone already
                pass
        return 1


def _exit_with_parent() -> None:
    """End this worker when the driver's process is gone (killed before it could stop us)."""
    parent = os.getppid()

    def watch():
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="minipaged-parent-watch", daemon=True).start()


if __name__ == "__main__":
    os._exit(main(sys.argv[1:]))  # os._exit: no interpreter teardown waiting on the process group
