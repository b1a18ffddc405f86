"""Every error the app answers, as an OpenAI error object: refused requests (400 naming the
field), unknown models and routes (404), wrong methods (405), bodies over the limit (413), a
missing or wrong API key (401), the engine's failures (500), a shutdown (503)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from ..engine.async_engine import EngineDeadError
from .protocol import RequestError, error_body
from .events import GenerationError, ServerShuttingDown


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    async def request_error(_, e: RequestError):
        return JSONResponse(error_body(e.message, e.param, e.kind, e.code), status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        if first.get("type") == "json_invalid":  # loc holds a character offset, not a field
            offset = first.get("loc", ("body", None))[-1]
            reason = (first.get("ctx") or {}).get("error", "invalid JSON")
            return JSONResponse(error_body(f"the body is not valid JSON: {reason} at character {offset}"),
                                status_code=400)
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = loc[0] if loc else None
        where = ".".join(loc) or "body"
        return JSONResponse(error_body(f"{where}: {first.get('msg', 'invalid request')}", param), status_code=400)

    @app.exception_handler(HTTPException)  # the framework's own: no such route, wrong method, ...
    async def http_error(request, e: HTTPException):
        where = f"{request.method} {request.url.path}"
        message = {404: f"Invalid URL ({where})", 405: f"Method not allowed ({where})"}.get(e.status_code, str(e.detail))
        return JSONResponse(error_body(message), status_code=e.status_code, headers=getattr(e, "headers", None))

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
