"""vLLM's ``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info``."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ..protocol import DetokenizeRequest, RequestError, TokenizeRequest, message_dicts
from ..protocol.documented import ERRORS, DetokenizeResponse, TokenizeResponse
from ..respond import serving_of
from ..tokenizer_info import tokenizer_info as describe

router = APIRouter(responses=ERRORS)


@router.post("/tokenize", responses={200: {"model": TokenizeResponse}})
async def tokenize(request: TokenizeRequest, raw: Request):
    serving = serving_of(raw)
    serving.check_model(request.model)
    if (request.prompt is None) == (request.messages is None):
        raise RequestError("give either prompt or messages", "prompt")
    if request.messages is not None:
        tokens = serving.apply_chat_template(message_dicts(request.messages), request.add_generation_prompt)
    else:
        tokens = serving.tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)
    strs = serving.tokenizer.convert_ids_to_tokens(tokens) if request.return_token_strs else None
    return {"count": len(tokens), "max_model_len": serving.max_model_len, "tokens": tokens, "token_strs": strs}


@router.post("/detokenize", responses={200: {"model": DetokenizeResponse}})
async def detokenize(request: DetokenizeRequest, raw: Request):
    serving = serving_of(raw)
    serving.check_model(request.model)
    bad = [t for t in request.tokens if not 0 <= t < serving.vocab_size]
    if bad:
        raise RequestError(f"tokens has ids outside [0, {serving.vocab_size}): {bad[:5]}", "tokens")
    return {"prompt": serving.tokenizer.decode(request.tokens)}


@router.get("/tokenizer_info", responses={200: {"content": {"application/json": {"schema": {"type": "object"}}}}})
async def tokenizer_info(raw: Request):
    serving = serving_of(raw)
    return describe(serving.tokenizer, serving.chat_template)
