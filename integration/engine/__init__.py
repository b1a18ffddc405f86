"""The serving engine: continuous batching on the paged KV cache.

``llm_engine`` coordinates the rooms below (``engine_args`` checks its arguments, ``engine_parts``
reads what it holds); ``front_door`` queues what callers on any thread hand it (requests, aborts),
checks requests and holds the outputs owed to them; ``request_table`` takes requests in at a step
boundary and ends them; ``step_runner`` runs one step, all or nothing; ``scheduler`` picks each
step's chunks; ``sampler`` turns logits into tokens (with ``logits_processing`` and
``seeded_draw``, and ``grammar_matcher`` for the constraints ``structured_outputs`` compiles) and
``logprobs`` into the log-probabilities reported; ``sequence`` and
``outputs`` are the records; ``stats`` the capacity report and its bookkeeping; ``rollback`` what
undoes a failed step; ``detokenizer`` turns tokens into text and finds stop strings;
``async_engine`` (with ``streams``) drives an engine from asyncio; ``loading`` reads a model folder;
``speculative`` proposes tokens (n-gram) and decides which the model keeps.
"""

from .async_engine import AsyncLLMEngine
from .front_door import EngineDeadError
from .llm_engine import LLMEngine
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .sampling_params import SamplingParams
from .structured_outputs import StructuredOutputsParams

__all__ = ["AsyncLLMEngine", "CompletionOutput", "EngineDeadError", "LLMEngine", "RequestMetrics", "RequestOutput",
           "SamplingParams", "StructuredOutputsParams"]
