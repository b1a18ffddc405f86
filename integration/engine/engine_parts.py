"""What an :class:`~.llm_engine.LLMEngine` holds, read as properties (benchmarks, tests, the
server's metrics): the KV pool's geometry, the tokenizer, the longest sequence, the sampler."""

from __future__ import annotations

__all__ = ["EngineParts"]


class EngineParts:
    """Mixed into LLMEngine, which sets ``pool``, ``request_table`` and ``step_runner``."""

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

    @property
    def tokenizer(self):
        return self.request_table.tokenizer

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt + generated) the engine runs."""
        return self.step_runner.max_model_len

    @property
    def sampler(self):  # a Sampler
        return self.step_runner.sampler

    @sampler.setter
    def sampler(self, sampler) -> None:  # a wrapper that records or fails (bench, fault injection)
        self.step_runner.sampler = sampler
