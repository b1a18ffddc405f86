"""``POST /v1/completions``: prompts as text or token ids, with ``echo`` (the prompt and, with
``logprobs``, its log-probs before the completion; ``max_tokens`` 0: the prompt alone), as vLLM
answers lm-eval's loglikelihood requests."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ..protocol import CompletionRequest, RequestError
from ..protocol.documented import ERRORS, STREAMED, CompletionResponse
from ..protocol.refused import COMPLETION_FIELDS, check_fields
from ..respond import new_id, respond, serving_of, shape_of
from ..responses import Formatter
from ..sampling import check_logprobs, sampling_params

router = APIRouter(responses=ERRORS)


@router.post("/v1/completions", response_model=None, responses={200: {"model": CompletionResponse, **STREAMED}})
async def completions(request: CompletionRequest, raw: Request):
    check_fields(request, COMPLETION_FIELDS)
    serving = serving_of(raw)
    serving.check_model(request.model)
    if request.best_of is not None and request.best_of != request.n:
        raise RequestError(f"best_of other than n is not supported (best_of={request.best_of}, n={request.n}): "
                           "every completion made is returned", "best_of")
    check_logprobs(serving, request.logprobs, "logprobs")
    plan = serving.output_plan(request)
    prompts, texts = serving.completion_prompts(request)
    max_tokens = request.max_tokens if request.max_tokens is not None else 16  # OpenAI's default
    if max_tokens < (0 if request.echo else 1):
        raise RequestError(f"max_tokens must be at least {0 if request.echo else 1}"
                           f"{'' if request.echo else ' (0 only with echo)'}, got {max_tokens}", "max_tokens")
    drop_output = max_tokens == 0  # the engine makes one token, which is not shown
    echo_logprobs = request.logprobs if request.echo else None
    asked = [k for k in (echo_logprobs, request.prompt_logprobs) if k is not None]
    params = sampling_params(serving, request, max(map(len, prompts)), max_tokens=max(max_tokens, 1),
                             logprobs=request.logprobs, prompt_logprobs=max(asked) if asked else None, plan=plan)
    await serving.compile_constraint(plan)
    shape = shape_of(request, chat=False, n=params.n, logprobs=request.logprobs, echo=request.echo,
                     drop_output=drop_output)
    return await respond(raw, Formatter(serving, new_id("cmpl"), shape, prompts, texts), params, request)
