"""A request's sampling fields into the engine's SamplingParams (vLLM's rules: the model's
generation_config sets the defaults of what a request leaves out; OpenAI's default temperature is
1), with every refusal naming the request's own field."""

from __future__ import annotations

import re
from typing import Optional

from ..engine import SamplingParams
from ..engine.sampling_params import LOGIT_BIAS_RANGE
from .protocol import RequestError, SamplingFields

# request field -> SamplingParams field, for the fields passed through when set
_PASSED = ("n", "seed", "presence_penalty", "frequency_penalty", "top_p", "min_p", "repetition_penalty", "min_tokens",
           "ignore_eos", "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens", "temperature")


def check_logprobs(serving, asked: Optional[int], param: str) -> None:
    """``asked`` top log-probs within the engine's cap (--max-logprobs), else refused naming ``param``."""
    if asked is not None and asked > serving.max_logprobs:
        raise RequestError(f"{param} must be at most {serving.max_logprobs} (the server's --max-logprobs), "
                           f"got {asked}", param)


def logit_bias(serving, request: SamplingFields) -> tuple:
    """OpenAI's ``{"token id": bias}`` as (token id, bias) pairs, checked against the vocabulary."""
    pairs = []
    for key, bias in (request.logit_bias or {}).items():
        if not re.fullmatch(r"\d+", key) or int(key) >= serving.vocab_size:
            raise RequestError(f"logit_bias keys must be token ids in [0, {serving.vocab_size}), got {key!r}",
                               "logit_bias")
        if not -LOGIT_BIAS_RANGE <= bias <= LOGIT_BIAS_RANGE:
            raise RequestError(f"logit_bias values must be in [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}], "
                               f"got {bias!r} for token {key}", "logit_bias")
        pairs.append((int(key), bias))
    return tuple(pairs)


def sampling_params(serving, request: SamplingFields, prompt_len: int, *, max_tokens: Optional[int],
                    logprobs: Optional[int] = None, prompt_logprobs: Optional[int] = None,
                    plan=None) -> SamplingParams:
    """``max_tokens`` None: up to the context's end; caps and ranges checked by the caller."""
    if request.stream and request.prompt_logprobs is not None:
        raise RequestError("prompt_logprobs is not available when stream is true", "prompt_logprobs")
    check_logprobs(serving, request.prompt_logprobs, "prompt_logprobs")
    room = serving.max_model_len - prompt_len
    kwargs = {"temperature": 1.0, **serving.default_sampling}  # OpenAI's default: sampling
    given = request.model_fields_set
    kwargs.update({name: getattr(request, name) for name in _PASSED
                   if name in given and getattr(request, name) is not None})
    kwargs["max_tokens"] = min(max_tokens, room) if max_tokens is not None else room
    if request.top_k is not None:
        kwargs["top_k"] = 0 if request.top_k == -1 else request.top_k
    if request.stop is not None:
        stop = [request.stop] if isinstance(request.stop, str) else list(request.stop)
        if stop:
            kwargs["stop"] = stop
    if logprobs is not None:
        kwargs["logprobs"] = logprobs
    if prompt_logprobs is not None:
        kwargs["prompt_logprobs"] = prompt_logprobs
    if plan is not None and plan.constraint is not None:  # (.output_plan: response_format, tools, ...)
        kwargs["structured_outputs"] = plan.constraint
    bias = logit_bias(serving, request)
    if bias:
        kwargs["logit_bias"] = bias
    defaults = type(request).model_fields
    for name in set(kwargs) - serving.params_fields:  # asked for the default: nothing to support
        if name in defaults and kwargs[name] == defaults[name].default:
            del kwargs[name]
    unsupported = sorted(set(kwargs) - serving.params_fields)
    if unsupported:
        raise RequestError(f"{unsupported[0]} is not supported by this engine", unsupported[0])
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as e:
        match = re.search(r"SamplingParams: (\w+)", str(e))
        raise RequestError(str(e), match.group(1) if match else None) from None
