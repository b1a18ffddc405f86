"""The FastAPI app: OpenAI's /v1/completions, /v1/chat/completions and /v1/models, and vLLM's
/health, /metrics, /tokenize, /detokenize and /version, on an :class:`AsyncLLMEngine`.

Bad requests get HTTP 400 with an OpenAI error object naming the field; a client that goes away
(mid-stream or while waiting for a whole response) aborts its requests; a shutdown refuses new
requests and ends those in flight (``app.state.in_flight``, see :mod:`.shutdown`)."""

from __future__ import annotations

import asyncio
import time
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect
from prometheus_client import CONTENT_TYPE_LATEST

from ..engine.async_engine import EngineDeadError
from .metrics import ServerMetrics
from .protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, RequestError, TokenizeRequest,
                       error_body, message_dicts)
from .responses import Formatter, GenerationError, ServerShuttingDown, collect, stream_events
from .serving import Serving, close_all
from .shutdown import InFlight


def build_app(engine, served_model_name: str, *, model_path: Optional[str] = None) -> FastAPI:
    """The server's app on ``engine`` (an AsyncLLMEngine whose LLMEngine has a tokenizer)."""
    from minipaged_ops import __version__

    if engine.tokenizer is None:
        raise ValueError("build_app: the engine needs a tokenizer (LLMEngine(..., tokenizer=...) or from_pretrained)")
    llm = engine.engine
    serving = Serving(engine, served_model_name, max_model_len=llm.max_model_len,
                      vocab_size=llm.model.get_input_embeddings().num_embeddings,
                      default_sampling=_generation_defaults(llm.model))
    metrics = ServerMetrics(served_model_name)
    engine.add_stat_logger(metrics)
    in_flight = InFlight()
    app = FastAPI(title="minipaged", version=__version__)
    app.state.engine, app.state.metrics, app.state.serving, app.state.in_flight = engine, metrics, serving, in_flight
    created = int(time.time())

    @app.exception_handler(RequestError)
    async def request_error(_, e: RequestError):
        return JSONResponse(error_body(e.message, e.param), status_code=e.status_code)

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

    async def respond(raw: Request, formatter: Formatter, prompts, params, request):
        in_flight.check_open()
        streams = await serving.start(prompts, params, request.priority, formatter.id)  # refusals: HTTP errors
        prompt_tokens = sum(len(p) for p in prompts)
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            events = stream_events(formatter, in_flight.pieces(streams), len(prompts) * params.n, prompt_tokens,
                                   include_usage)
            return _AbortingStreamingResponse(events, media_type="text/event-stream",
                                              background=BackgroundTask(close_all, streams))
        try:
            choices = await _until_disconnected(raw.receive, collect(formatter, in_flight.pieces(streams)))
        finally:
            close_all(streams)
        if choices is None:  # the client is gone; its requests were aborted
            return Response(status_code=499)
        return JSONResponse(formatter.response(choices, prompt_tokens))

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw: Request):
        serving.check_model(request.model)
        prompts = serving.completion_prompts(request)
        max_tokens = request.max_tokens if request.max_tokens is not None else 16  # OpenAI's default
        params = serving.sampling_params(request, max(map(len, prompts)), request.logprobs, max_tokens)
        formatter = Formatter(serving, f"cmpl-{_hex()}", False, params.n, request.logprobs)
        return await respond(raw, formatter, prompts, params, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw: Request):
        serving.check_model(request.model)
        prompt = serving.chat_prompt(request)
        if request.top_logprobs is not None and not request.logprobs:
            raise RequestError("top_logprobs needs logprobs set to true", "top_logprobs")
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        params = serving.sampling_params(request, len(prompt), logprobs, max_tokens)
        formatter = Formatter(serving, f"chatcmpl-{_hex()}", True, params.n, logprobs)
        return await respond(raw, formatter, [prompt], params, request)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": created,
                                            "owned_by": "minipaged", "root": model_path or served_model_name,
                                            "parent": None, "max_model_len": llm.max_model_len}]}

    @app.get("/health")
    async def health():
        try:
            engine.check_health()
        except EngineDeadError as e:
            return JSONResponse(error_body(str(e), kind="internal_server_error"), status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics():
        if engine.is_running:
            metrics.update_from_stats(await engine.stats())
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest):
        serving.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise RequestError("give either prompt or messages", "prompt")
        if request.messages is not None:
            tokens = serving.apply_chat_template(message_dicts(request.messages), request.add_generation_prompt)
        else:
            tokens = serving.tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)
        strs = serving.tokenizer.convert_ids_to_tokens(tokens) if request.return_token_strs else None
        return {"count": len(tokens), "max_model_len": llm.max_model_len, "tokens": tokens, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest):
        serving.check_model(request.model)
        bad = [t for t in request.tokens if not 0 <= t < serving.vocab_size]
        if bad:
            raise RequestError(f"tokens has ids outside [0, {serving.vocab_size}): {bad[:5]}", "tokens")
        return {"prompt": serving.tokenizer.decode(request.tokens)}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    return app


def _hex() -> str:
    import uuid

    return uuid.uuid4().hex


def _generation_defaults(model) -> dict:
    """The sampling fields the checkpoint's generation_config sets explicitly (vLLM's default)."""
    config = getattr(model, "generation_config", None)
    if config is None:
        return {}
    set_fields = config.to_diff_dict()
    names = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
             "repetition_penalty": "repetition_penalty"}
    return {ours: set_fields[theirs] for theirs, ours in names.items() if set_fields.get(theirs) is not None}


async def _wait_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _until_disconnected(receive, coro):
    """``await coro``, unless the client disconnects first: then it is cancelled (aborting its
    requests) and the result is None."""
    work, gone = asyncio.ensure_future(coro), asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, gone):
            if not task.done():
                task.cancel()
        await asyncio.gather(work, gone, return_exceptions=True)
    return None if work.cancelled() else work.result()  # re-raises what the work raised


class _AbortingStreamingResponse(StreamingResponse):
    """A stream that ends — and closes its generator, which aborts the requests — as soon as the
    client disconnects, even while no token is being sent (Starlette alone notices only on the
    next write)."""

    async def __call__(self, scope, receive, send):
        try:
            await _until_disconnected(receive, super().__call__(scope, receive, send))
        except ClientDisconnect:  # noticed by Starlette on a write: gone all the same
            pass
        finally:
            await self.body_iterator.aclose()
            if self.background is not None:  # runs even when the stream was cut short
                await self.background()
