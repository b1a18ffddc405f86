"""``POST /v1/chat/completions``."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ..protocol import ChatCompletionRequest, RequestError
from ..respond import new_id, respond, serving_of
from ..responses import Formatter
from ..tool_replies import ToolReplies

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(request: ChatCompletionRequest, raw: Request):
    serving = serving_of(raw)
    serving.check_model(request.model)
    plan = serving.output_plan(request)
    prompt = serving.chat_prompt(request, plan.tools)
    if request.top_logprobs is not None and not request.logprobs:
        raise RequestError("top_logprobs needs logprobs set to true", "top_logprobs")
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    params = serving.sampling_params(request, len(prompt), logprobs, max_tokens, plan)
    await serving.compile_constraint(plan)
    formatter = Formatter(serving, new_id("chatcmpl"), True, params.n, logprobs,
                          ToolReplies(plan) if plan.tools is not None else None)
    return await respond(raw, formatter, [prompt], params, request)
