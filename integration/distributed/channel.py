"""The driver's one broadcast per step: a pickled message in a fixed-size host buffer.

Every rank must issue the same collectives in the same order, so the workers learn everything a
step does from the driver before it runs: the pool moves the scheduler made (copy-on-write copies,
swaps out and in, in the order they happened) and the forward call itself (the frozen
``StepMetadata`` and the other arguments). They travel as one message, pickled into a buffer of
``capacity`` bytes whose first 8 bytes give the message's length. A message longer than the buffer
(thousands of tokens in one step) takes a second broadcast for the rest, and both sides then grow
the buffer to fit the next one; so a step costs one broadcast of a few KiB.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import fields, is_dataclass, replace

import torch
import torch.distributed as dist

__all__ = ["StepChannel", "to_device", "to_host"]

_HEADER = 8  # bytes of the length field


class StepChannel:
    """The sending (rank 0) or receiving end of the per-step broadcast over ``group``."""

    def __init__(self, group, *, capacity: int = 16 << 10):
        self.group = group
        self.src = dist.get_global_rank(group, 0)
        self.buffer = torch.zeros(capacity, dtype=torch.uint8)
        self.seconds = 0.0  # time spent in broadcasts, for the stats
        self.broadcasts = 0

    def send(self, message) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        size = len(data)
        head = self.buffer.numel() - _HEADER
        self.buffer[:_HEADER] = torch.tensor([size], dtype=torch.int64).view(torch.uint8)
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.buffer[_HEADER:_HEADER + min(size, head)] = payload[:head]
        self._broadcast(self.buffer)
        if size > head:
            self._broadcast(payload[head:].clone())
            self._grow(size)

    def receive(self):
        self._broadcast(self.buffer)
        size = int(self.buffer[:_HEADER].view(torch.int64))
        head = self.buffer.numel() - _HEADER
        data = self.buffer[_HEADER:_HEADER + min(size, head)].numpy().tobytes()
        if size > head:
            rest = torch.empty(size - head, dtype=torch.uint8)
            self._broadcast(rest)
            data += rest.numpy().tobytes()
            self._grow(size)
        return pickle.loads(data)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        start = time.perf_counter()
        dist.broadcast(tensor, self.src, group=self.group)
        self.seconds += time.perf_counter() - start
        self.broadcasts += 1

    def _grow(self, size: int) -> None:
        """Both ends grow the same way after the same oversized message, so they stay in step."""
        capacity = self.buffer.numel()
        while capacity - _HEADER < size:
            capacity *= 2
        self.buffer = torch.zeros(capacity, dtype=torch.uint8)


def to_host(value):
    """A message's tensors (also inside dicts and frozen dataclasses such as ``StepMetadata``) on
    the host, ready to pickle."""
    return to_device(value, "cpu")


def to_device(value, device):
    """The same, moved to ``device``: a worker's copy of the driver's forward arguments."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if is_dataclass(value) and not isinstance(value, type):
        moved = {f.name: to_device(getattr(value, f.name), device) for f in fields(value)
                 if isinstance(getattr(value, f.name), torch.Tensor)}
        return replace(value, **moved) if moved else value
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value
