"""Joining the tensor-parallel process group, with timeouts short enough to surface a dead or
hung rank as an error.

Three groups, one job each:

* the default group exists only to rendezvous: it waits ``startup_timeout_s`` for every rank to
  start (importing torch and loading a model take a while);
* ``control`` (gloo, on the host): the driver's one broadcast per step. The driver's side of it
  times out after ``timeout_s``; a worker's side waits as long as the driver stays idle (a day), and
  a driver that dies closes the connection, which ends the worker at once;
* ``compute`` (gloo on CPU, NCCL on CUDA): the model's all-reduces and the logits gather, with
  ``timeout_s`` on every rank, so a rank that stops answering mid-step fails the step.

(transformers starts its group with a 2-hour timeout: a hung worker would hang the server for two
hours.) Gloo applies a group's timeout per operation and per process, which is what lets the two
sides of ``control`` differ.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["TPGroup", "free_port", "join_group", "launched_by_torchrun", "leave_group", "rendezvous_store"]

WORKER_IDLE_TIMEOUT_S = 24 * 3600  # a worker waits this long for the driver's next step


@dataclass(frozen=True)
class TPGroup:
    """This process's place in the tensor-parallel group."""

    rank: int
    world_size: int
    device: torch.device
    control: object  # gloo group of the per-step broadcast
    compute: object  # the model's collectives (gloo on CPU, NCCL on CUDA)
    timeout_s: float

    @property
    def is_driver(self) -> bool:
        return self.rank == 0


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launched_by_torchrun() -> bool:
    """Whether this process is one rank of a ``torchrun`` (or any ``env://``) launch."""
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def rendezvous_store(rank: int, world_size: int, host: str, port: int, timeout_s: float):
    """The key-value store the ranks meet in: rank 0 hosts it, except under torchrun, whose agent
    already does (``TORCHELASTIC_USE_AGENT_STORE``). Keys live under ``minipaged/``."""
    hosted_by_agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0 and not hosted_by_agent,
                          timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
    return dist.PrefixStore("minipaged/", store)


def backend_for(device: torch.device) -> str:
    if device.type == "cuda":
        return "nccl"
    if device.type == "cpu":
        return "gloo"
    raise ValueError(f"tensor_parallel_size > 1 runs on cpu (gloo) or cuda (NCCL) devices, got {device}")


def join_group(rank: int, world_size: int, device, store, *, timeout_s: float = 60.0,
               startup_timeout_s: float = 600.0) -> TPGroup:
    """Join the group as ``rank`` of ``world_size`` through ``store`` (:func:`rendezvous_store`).
    On CUDA, ``device`` is this rank's GPU."""
    device = torch.device(device)
    backend = backend_for(device)
    if dist.is_initialized():
        raise RuntimeError("tensor_parallel_size > 1: a torch.distributed process group is already initialised in "
                           "this process; minipaged starts and owns its own (destroy the other one first)")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("gloo", store=dist.PrefixStore("group/", store), rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=startup_timeout_s))
    idle = WORKER_IDLE_TIMEOUT_S if rank else timeout_s
    control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=idle))
    compute = dist.new_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    return TPGroup(rank, world_size, device, control, compute, timeout_s)


def leave_group() -> None:
    """Destroy every group this process joined (idempotent)."""
    if dist.is_initialized():
        dist.destroy_process_group()
