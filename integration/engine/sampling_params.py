"""``SamplingParams``: how one request is sampled (the names and meanings of vLLM's, which follow
the OpenAI completions API). Everything is checked at construction, so a bad request is refused
before it reaches a step."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from .structured_outputs import StructuredOutputsParams

__all__ = ["GREEDY_TEMPERATURE", "LOGIT_BIAS_RANGE", "MAX_LOGPROBS", "SamplingParams"]

# A temperature below this is greedy (vLLM's _SAMPLING_EPS): dividing by a subnormal overflows.
GREEDY_TEMPERATURE = 1e-5
# The most top log-probabilities a request may ask for per token: the engine's default cap
# (LLMEngine(max_logprobs=...), vLLM's default max_logprobs).
MAX_LOGPROBS = 20
LOGIT_BIAS_RANGE = 100.0  # OpenAI's: a bias is in [-100, 100]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request.

    Choosing: ``temperature`` below 1e-5 (the default 0) is greedy; otherwise the logits are divided
    by it and filtered by ``min_p`` (drop tokens less likely than ``min_p`` times the most likely
    one; 0: off), ``top_k`` (0 or -1: off) and ``top_p`` (1: off), in that order, as vLLM does.
    ``seed`` gives the request its own random stream (completion ``i`` of ``n`` uses ``seed + i``).

    Penalties (applied before the choice, greedy included): ``repetition_penalty`` (transformers'
    rule, 1: off) divides positive and multiplies negative logits of every token in the prompt or
    the output; ``presence_penalty`` and ``frequency_penalty`` (OpenAI's rule, in [-2, 2], 0: off)
    subtract ``presence * [count > 0] + frequency * count`` over the output tokens only.

    Stopping: ``max_tokens``; EOS (unless ``ignore_eos``) and ``stop_token_ids`` end the request, but
    not before ``min_tokens`` tokens (they are masked until then); ``stop`` strings (an engine with a
    tokenizer) end it when the text completes one, cut from the text unless
    ``include_stop_str_in_output``.

    ``logit_bias``: ``{token id: bias in [-100, 100]}`` (or pairs), added to the raw logits before
    the penalties and the choice (OpenAI's rule); kept as sorted ``(token id, bias)`` pairs.

    ``structured_outputs``: a :class:`~.structured_outputs.StructuredOutputsParams` (a JSON schema,
    JSON mode, a regex, a choice or a grammar) that every output obeys: tokens the constraint does
    not allow are masked before penalties, temperature and filters, and a completed constraint ends
    the completion with finish_reason "stop" (``max_tokens`` still cuts it: "length"). Needs the
    engine's tokenizer; a constraint that does not compile is refused at ``add_request``.

    Log-probabilities are of the raw model distribution (before the constraint's mask, penalties,
    logit_bias, temperature and filters): ``logprobs=k`` gives per output token the ``k`` most likely
    tokens and the chosen one; ``prompt_logprobs=k`` per prompt token from the second on its own and
    the ``k`` most likely (the engine caps ``k``: ``LLMEngine(max_logprobs=...)``).
    """

    n: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    max_tokens: int = 16
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    prompt_logprobs: Optional[int] = None
    stop: Union[str, Sequence[str], None] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: object = ()
    structured_outputs: Optional[StructuredOutputsParams] = None

    def __post_init__(self):
        _int("n", self.n, 1, None)
        _number("temperature", self.temperature, 0, None)
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams: top_p must be in (0, 1], got {self.top_p!r}")
        _int("top_k", self.top_k, -1, None, " (0 or -1: off)")
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if self.seed is not None:
            _int("seed", self.seed, None, None, " or None")
        _int("max_tokens", self.max_tokens, 1, None)
        _int("min_tokens", self.min_tokens, 0, self.max_tokens, " (at most max_tokens)")
        object.__setattr__(self, "stop_token_ids", _token_ids(self.stop_token_ids))
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"SamplingParams: {name} must be a bool, got {getattr(self, name)!r}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _int(name, getattr(self, name), 0, None, " or None")
        _number("presence_penalty", self.presence_penalty, -2, 2)
        _number("frequency_penalty", self.frequency_penalty, -2, 2)
        _number("repetition_penalty", self.repetition_penalty, 0, None)
        if self.repetition_penalty == 0:
            raise ValueError(f"SamplingParams: repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        _number("min_p", self.min_p, 0, 1)
        object.__setattr__(self, "stop", _stop_strings(self.stop))
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"SamplingParams: structured_outputs must be a StructuredOutputsParams or None, "
                             f"got {type(self.structured_outputs).__name__}")

    @property
    def greedy(self) -> bool:
        """True when the most likely token (after penalties and min_tokens) is always taken."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_logits_processing(self) -> bool:
        """True when the logits change before even a greedy choice (penalties or logit_bias)."""
        return self.has_penalties or bool(self.logit_bias)

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


def _int(name, value, lo, hi, note=""):
    if isinstance(value, bool) or not isinstance(value, int) or (lo is not None and value < lo) \
            or (hi is not None and value > hi):
        bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        bounds = "" if lo is None else " " + bounds
        raise ValueError(f"SamplingParams: {name} must be an int{bounds}{note}, got {value!r}")


def _number(name, value, lo, hi):
    """A finite real in [lo, hi] (hi None: unbounded); bools and NaN refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < lo or (hi is not None and value > hi):
        bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"SamplingParams: {name} must be a finite number {bounds}, got {value!r}")


def _token_ids(ids) -> tuple:
    try:
        ids = tuple(ids)
    except TypeError:
        raise ValueError(f"SamplingParams: stop_token_ids must be a sequence of ints, got {ids!r}") from None
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise ValueError(f"SamplingParams: stop_token_ids must be non-negative ints, got {ids!r}")
    return ids


def _stop_strings(stop) -> tuple:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    try:
        stop = tuple(stop)
    except TypeError:
        raise ValueError(f"SamplingParams: stop must be a str, a sequence of str or None, got {stop!r}") from None
    if not all(isinstance(s, str) and s for s in stop):
        raise ValueError(f"SamplingParams: stop must be non-empty strings, got {stop!r}")
    return tuple(dict.fromkeys(stop))  # one copy of each, first-seen order


def _logit_bias(bias) -> tuple:
    """``{token id: bias}`` or (token id, bias) pairs -> sorted pairs; ids non-negative ints, biases
    finite in [-100, 100]."""
    if bias is None:
        return ()
    try:
        pairs = list(bias.items()) if hasattr(bias, "items") else [tuple(p) for p in bias]
    except TypeError:
        raise ValueError(f"SamplingParams: logit_bias must be a dict {{token id: bias}}, got {bias!r}") from None
    out = {}
    for pair in pairs:
        if len(pair) != 2:
            raise ValueError(f"SamplingParams: logit_bias must be a dict {{token id: bias}}, got {bias!r}")
        token, value = pair
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"SamplingParams: logit_bias must be keyed by token ids (ints >= 0), got {token!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or abs(value) > LOGIT_BIAS_RANGE:
            raise ValueError(f"SamplingParams: logit_bias must be biases in [-{LOGIT_BIAS_RANGE:g}, "
                             f"{LOGIT_BIAS_RANGE:g}], got {value!r} for token {token}")
        out[token] = float(value)
    return tuple(sorted(out.items()))
