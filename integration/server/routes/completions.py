"""``POST /v1/completions``."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ..protocol import CompletionRequest
from ..respond import new_id, respond, serving_of
from ..responses import Formatter

router = APIRouter()


@router.post("/v1/completions")
async def completions(request: CompletionRequest, raw: Request):
    serving = serving_of(raw)
    serving.check_model(request.model)
    plan = serving.output_plan(request)
    prompts = serving.completion_prompts(request)
    max_tokens = request.max_tokens if request.max_tokens is not None else 16  # OpenAI's default
    params = serving.sampling_params(request, max(map(len, prompts)), request.logprobs, max_tokens, plan)
    await serving.compile_constraint(plan)
    formatter = Formatter(serving, new_id("cmpl"), False, params.n, request.logprobs)
    return await respond(raw, formatter, prompts, params, request)
