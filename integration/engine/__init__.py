"""The serving engine: continuous batching on the paged KV cache.

``llm_engine`` runs the loop; ``scheduler`` picks each step's chunks; ``sampler`` turns logits
into tokens; ``sequence`` and ``outputs`` are the records; ``stats`` the capacity report's
bookkeeping; ``rollback`` what undoes a failed step.
"""

from .llm_engine import LLMEngine
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .sampling_params import SamplingParams

__all__ = ["CompletionOutput", "LLMEngine", "RequestMetrics", "RequestOutput", "SamplingParams"]
