"""``GET /v1/models``."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ..respond import serving_of

router = APIRouter()


@router.get("/v1/models")
async def models(raw: Request):
    return {"object": "list", "data": [serving_of(raw).model_card()]}
