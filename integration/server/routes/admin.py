"""vLLM's ``GET /health``, ``/metrics`` and ``/version``: open even when an API key is set."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from ...engine.async_engine import EngineDeadError
from ..protocol import error_body
from ..protocol.documented import ErrorResponse

router = APIRouter()


@router.get("/health", response_class=Response, responses={503: {"model": ErrorResponse, "description": "the engine has stopped"}})
async def health(raw: Request):
    try:
        raw.app.state.engine.check_health()
    except EngineDeadError as e:
        return JSONResponse(error_body(str(e), kind="internal_server_error"), status_code=503)
    return Response(status_code=200)


@router.get("/metrics", responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
async def prometheus_metrics(raw: Request):
    engine, metrics = raw.app.state.engine, raw.app.state.metrics
    if engine.is_running:
        metrics.update_from_stats(await engine.stats())
    return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


@router.get("/version")
async def version():
    from minipaged_ops import __version__

    return {"version": __version__}
