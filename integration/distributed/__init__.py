"""Tensor parallelism: one engine over N processes (one per device, across machines with
``torchrun``), each holding ``1/N`` of every layer's heads and MLP and of the KV cache.

    engine = LLMEngine.from_pretrained(path, tensor_parallel_size=2)   # spawns rank 1 here
    with engine:
        outs = engine.generate(prompts, SamplingParams(max_tokens=32))

Rooms: ``group`` (joining the process group, timeouts), ``sharding`` (cutting the model by the
plan transformers ships), ``channel`` (the driver's one broadcast per step), ``pool_moves`` (every
rank's KV pool in step with the driver's), ``worker`` (ranks 1 .. N-1), ``driver`` (rank 0: the
engine, starting and stopping the workers, failures).
"""

from .driver import TensorParallelError, TensorParallelLLMEngine, start_engine
from .sharding import check_shardable, shard_model

__all__ = ["TensorParallelError", "TensorParallelLLMEngine", "check_shardable", "shard_model", "start_engine"]
