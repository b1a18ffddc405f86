"""``POST /v1/chat/completions``: the messages through the model's chat template."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ..protocol import ChatCompletionRequest, RequestError
from ..protocol.documented import ERRORS, STREAMED, ChatCompletionResponse
from ..protocol.refused import CHAT_FIELDS, check_fields
from ..respond import new_id, respond, serving_of, shape_of
from ..responses import Formatter
from ..sampling import check_logprobs, sampling_params
from ..tool_replies import ToolReplies

router = APIRouter(responses=ERRORS)


@router.post("/v1/chat/completions", response_model=None, responses={200: {"model": ChatCompletionResponse, **STREAMED}})
async def chat_completions(request: ChatCompletionRequest, raw: Request):
    check_fields(request, CHAT_FIELDS)
    serving = serving_of(raw)
    serving.check_model(request.model)
    plan = serving.output_plan(request)
    prompt = serving.chat_prompt(request, plan.tools)
    if request.top_logprobs is not None and not request.logprobs:
        raise RequestError("top_logprobs needs logprobs set to true", "top_logprobs")
    check_logprobs(serving, request.top_logprobs, "top_logprobs")
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    for name, value in (("max_completion_tokens", request.max_completion_tokens), ("max_tokens", request.max_tokens)):
        if value is not None and value < 1:
            raise RequestError(f"{name} must be at least 1, got {value}", name)
    params = sampling_params(serving, request, len(prompt), max_tokens=max_tokens, logprobs=logprobs,
                             prompt_logprobs=request.prompt_logprobs, plan=plan)
    await serving.compile_constraint(plan)
    shape = shape_of(request, chat=True, n=params.n, logprobs=logprobs)
    formatter = Formatter(serving, new_id("chatcmpl"), shape, [prompt],
                          tools=ToolReplies(plan) if plan.tools is not None else None)
    return await respond(raw, formatter, params, request)
