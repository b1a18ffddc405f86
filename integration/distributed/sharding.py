"""Split a loaded transformers decoder across the ranks of a tensor-parallel group.

Which layer splits how comes from the model itself: transformers ships a tensor-parallel plan for
each architecture (``config.base_model_tp_plan``; Qwen3's: q/k/v and gate/up ``"colwise"``, o and
down ``"rowwise"``, the per-head q/k norms replicated). We read that plan, and apply it ourselves
with plain tensors and ``torch.distributed`` collectives instead of through
``from_pretrained(..., tp_plan="auto")``. That path does run our attention on CPU/gloo (checked: same
logits), but:

* it needs ``accelerate`` installed (a dependency we would add for this alone);
* its parameters become DTensors whose ``shape`` and ``Linear.out_features`` stay the full,
  unsharded sizes, so the KV pool, which reads each rank's kv heads from the attention modules,
  would see every head;
* it starts its own process group with a 2-hour timeout when none exists, and its entry point
  moved between the releases we support (``tp_plan=`` in 5.17, ``distributed_config=`` later);
* its lm_head gathers the whole vocabulary's logits to every rank; only the driver samples.

Here a split layer is a plain ``nn.Linear`` holding its rank's slice, so ``out_features``, heads
and shapes are this rank's, and the attention code and kernels need no change:

* ``colwise`` (q/k/v, gate/up): rows ``[r * out / N, (r + 1) * out / N)`` of the weight, the
  output is this rank's heads / features; no communication.
* ``rowwise`` (o, down): the matching input columns; partial products are summed with one
  ``all_reduce``, then the bias (once).
* the input embedding and lm_head are split by vocabulary (as vLLM does): each rank looks up
  the ids in its range (``all_reduce`` of the embeddings) and computes its range's logits, which
  are gathered on rank 0 only (the driver, the one rank that samples).

Two all-reduces per layer, one for the embeddings and one gather of the sampled rows' logits per
step: what vLLM and transformers do too.
"""

from __future__ import annotations

import re
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..linear16 import linear  # F.linear, 16-bit weights in float32 arithmetic where the CPU needs it

__all__ = ["all_reduce_max", "check_shardable", "collective_seconds", "shard_model", "tp_plan"]

_collective_seconds = 0.0  # this process's host time in the model's collectives


def collective_seconds() -> float:
    """Seconds this process has spent in the split layers' all-reduces and gather (host time;
    on CUDA the collectives are asynchronous, so this is the time to launch them)."""
    return _collective_seconds


def _timed(collective, *args, **kwargs) -> None:
    global _collective_seconds
    start = time.perf_counter()
    collective(*args, **kwargs)
    _collective_seconds += time.perf_counter() - start

def all_reduce_max(group):
    """A function that replaces a tensor by its elementwise maximum over ``group``'s ranks (an
    8-bit pool's fp8 scales: ``kv_pool.LayerScales``)."""
    return lambda t: _timed(dist.all_reduce, t, op=dist.ReduceOp.MAX, group=group)


_COLWISE, _ROWWISE = "colwise", "rowwise"
_REPLICATED = ("replicated_with_grad_allreduce", "replicate")  # every rank keeps the whole parameter


def tp_plan(model: nn.Module) -> dict[str, str]:
    """The model's own tensor-parallel plan, ``{module pattern: style}`` with patterns relative to
    the base model (``"layers.*.self_attn.q_proj"``). A clear error when it has none."""
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    if not plan:
        raise ValueError(f"tensor_parallel_size > 1: {type(model).__name__} ships no tensor-parallel plan "
                         "(config.base_model_tp_plan); only models with one can be split")
    unknown = {s for s in plan.values() if s not in (_COLWISE, _ROWWISE, *_REPLICATED)}
    if unknown:
        raise ValueError(f"tensor_parallel_size > 1: {type(model).__name__}'s tensor-parallel plan uses styles "
                         f"{sorted(unknown)}; supported: colwise, rowwise, replicated")
    return plan


def check_shardable(config, world_size: int) -> None:
    """Every split dimension must divide by ``world_size``: whole heads per rank, whole MLP slices."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive int, got {world_size!r}")
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, name, None)
        if value is not None and value % world_size:
            raise ValueError(f"tensor_parallel_size={world_size}: the model's {name}={value} does not divide by it; "
                             f"each rank must hold a whole {name.replace('num_', '').replace('_size', '')} share "
                             f"(choose a tensor_parallel_size that divides {value})")


def shard_model(model: nn.Module, rank: int, world_size: int, group=None) -> nn.Module:
    """Replace the model's layers in place by this rank's slices (see the module docstring).
    ``group``: the process group of the tensor-parallel ranks (None: the default group)."""
    check_shardable(model.config, world_size)  # world_size 1 still splits: a one-rank group runs the same code
    plan = {re.compile(re.escape(p).replace(r"\*", r"\d+") + "$"): s for p, s in tp_plan(model).items()}
    base = model.base_model
    split = 0
    for name, module in list(base.named_modules()):
        style = next((s for pattern, s in plan.items() if pattern.match(name)), None)
        if style in (_COLWISE, _ROWWISE):
            if type(module) is not nn.Linear:
                raise ValueError(f"tensor_parallel_size > 1: {name} is a {type(module).__name__}; the {style} split "
                                 "applies to nn.Linear layers only")
            cls = ColumnParallelLinear if style == _COLWISE else RowParallelLinear
            _replace(base, name, cls.split(module, rank, world_size, group))
            split += 1
    if split == 0:
        raise ValueError(f"tensor_parallel_size > 1: no layer of {type(model).__name__} matched its tensor-parallel plan")
    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is embeddings.weight
    parallel_embeddings = VocabParallelEmbedding(embeddings, rank, world_size, group)
    model.set_input_embeddings(parallel_embeddings)
    if head is not None:
        model.set_output_embeddings(ParallelLMHead.split(head, rank, world_size, group,
                                                   weight=parallel_embeddings.weight if tied else None))
    return model


def _replace(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, new)


def _own(t: torch.Tensor) -> torch.Tensor:
    """A slice in memory of its own: a view (even a contiguous one) would keep the whole unsplit
    tensor alive. A Parameter passed in (the tied embeddings) is kept as it is."""
    return t if isinstance(t, nn.Parameter) else t.clone(memory_format=torch.contiguous_format)


def _linear_like(cls, source: nn.Linear, weight: torch.Tensor, bias, in_features: int, out_features: int):
    """An ``nn.Linear`` of class ``cls`` holding the given (already sliced) parameters; nn.Linear's
    own constructor would allocate and initialise a weight only to throw it away."""
    layer = cls.__new__(cls)
    nn.Module.__init__(layer)
    layer.in_features, layer.out_features = in_features, out_features
    layer.weight = nn.Parameter(_own(weight), requires_grad=False)
    layer.bias = None if bias is None else nn.Parameter(_own(bias), requires_grad=False)
    return layer


class ColumnParallelLinear(nn.Linear):
    """This rank's rows of a Linear: its share of the output features (whole heads for q/k/v)."""

    @classmethod
    def split(cls, source: nn.Linear, rank: int, world_size: int, group=None) -> "ColumnParallelLinear":
        out = source.out_features // world_size
        rows = slice(rank * out, (rank + 1) * out)
        bias = None if source.bias is None else source.bias.detach()[rows]
        return _linear_like(cls, source, source.weight.detach()[rows], bias, source.in_features, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Linear):
    """This rank's input columns of a Linear; the partial outputs are summed over the group."""

    @classmethod
    def split(cls, source: nn.Linear, rank: int, world_size: int, group=None) -> "RowParallelLinear":
        width = source.in_features // world_size
        columns = slice(rank * width, (rank + 1) * width)
        bias = None if source.bias is None else source.bias.detach()
        layer = _linear_like(cls, source, source.weight.detach()[:, columns], bias, width, source.out_features)
        layer.group = group
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = linear(x, self.weight)
        _timed(dist.all_reduce, out, group=self.group)
        return out if self.bias is None else out + self.bias  # the bias once, after the sum


def _vocab_range(vocab: int, rank: int, world_size: int) -> tuple[int, int, int]:
    """(start, end, rows per rank): every rank holds ``ceil(vocab / N)`` rows, the last ones padded."""
    per_rank = -(-vocab // world_size)
    start = min(rank * per_rank, vocab)
    return start, min(start + per_rank, vocab), per_rank


def _padded_rows(weight: torch.Tensor, start: int, end: int, per_rank: int) -> torch.Tensor:
    rows = weight.detach()[start:end]
    if end - start == per_rank:
        return _own(rows)
    return torch.cat([rows, rows.new_zeros(per_rank - (end - start), rows.shape[1])])


class VocabParallelEmbedding(nn.Module):
    """This rank's range of the vocabulary; ids outside it look up zeros, and the sum over the
    group gives every rank every id's embedding."""

    def __init__(self, source: nn.Embedding, rank: int, world_size: int, group=None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = source.num_embeddings, source.embedding_dim
        self.padding_idx = source.padding_idx
        self.start, self.end, per_rank = _vocab_range(source.num_embeddings, rank, world_size)
        self.weight = nn.Parameter(_padded_rows(source.weight, self.start, self.end, per_rank), requires_grad=False)
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        outside = (input_ids < self.start) | (input_ids >= self.end)
        local = (input_ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside[..., None], 0)
        _timed(dist.all_reduce, out, group=self.group)
        return out


class ParallelLMHead(nn.Linear):
    """This rank's vocabulary range of the logits; rank 0 gathers the whole row, the other ranks
    return their own part (only rank 0 samples)."""

    @classmethod
    def split(cls, source: nn.Linear, rank: int, world_size: int, group=None, weight=None) -> "ParallelLMHead":
        vocab = source.out_features
        start, end, per_rank = _vocab_range(vocab, rank, world_size)
        if weight is None:
            weight = _padded_rows(source.weight, start, end, per_rank)
        bias = None if source.bias is None else _padded_rows(source.bias[:, None], start, end, per_rank)[:, 0]
        layer = _linear_like(cls, source, weight, bias, source.in_features, per_rank)
        if isinstance(weight, nn.Parameter):
            layer.weight = weight  # tied to the input embeddings, as in the unsplit model
        layer.vocab_size, layer.rank, layer.world_size, layer.group = vocab, rank, world_size, group
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = linear(x, self.weight, self.bias).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world_size)] if self.rank == 0 else None
        _timed(dist.gather, local, parts, dst=dist.get_global_rank(self.group, 0) if self.group is not None else 0,
                    group=self.group)
        if self.rank != 0:
            return local
        return torch.cat(parts, -1)[..., : self.vocab_size]
