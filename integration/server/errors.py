"""Every error the app answers, as an OpenAI error object: refused requests (400 naming the
field), the engine's failures (500), a shutdown (503)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from ..engine.async_engine import EngineDeadError
from .protocol import RequestError, error_body
from .responses import GenerationError, ServerShuttingDown


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    async def request_error(_, e: RequestError):
        return JSONResponse(error_body(e.message, e.param, e.kind, e.code), status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = loc[0] if loc else None
        where = ".".join(loc) or "body"
        return JSONResponse(error_body(f"{where}: {first.get('msg', 'invalid request')}", param), status_code=400)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_, e: EngineDeadError):
        return JSONResponse(error_body(str(e), kind="internal_server_error"), status_code=500)

    @app.exception_handler(GenerationError)
    async def generation_failed(_, e: GenerationError):
        return JSONResponse(error_body(str(e), kind="internal_server_error"), status_code=500)

    @app.exception_handler(ServerShuttingDown)
    async def shutting_down(_, e: ServerShuttingDown):
        return JSONResponse(error_body(str(e), kind=e.kind), status_code=503)

    @app.exception_handler(ValueError)  # the engine refusing what the checks above let through
    async def engine_refused(_, e: ValueError):
        return JSONResponse(error_body(str(e)), status_code=400)

    @app.exception_handler(Exception)  # anything else (a piece the engine could not make): OpenAI's shape
    async def internal_error(_, e: Exception):
        return JSONResponse(error_body(str(e) or type(e).__name__, kind="internal_server_error"), status_code=500)
