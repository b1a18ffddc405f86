"""``GET /v1/models`` and ``GET /v1/models/{model}``."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ..protocol.documented import ERRORS, ModelCard, ModelList
from ..respond import serving_of

router = APIRouter(responses=ERRORS)


@router.get("/v1/models", responses={200: {"model": ModelList}})
async def models(raw: Request):
    return {"object": "list", "data": [serving_of(raw).model_card()]}


@router.get("/v1/models/{model:path}", responses={200: {"model": ModelCard}})
async def model(model: str, raw: Request):
    serving = serving_of(raw)
    serving.check_model(model)
    return serving.model_card()
