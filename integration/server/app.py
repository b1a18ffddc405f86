"""The FastAPI app: OpenAI's /v1/completions, /v1/chat/completions and /v1/models, and vLLM's
/health, /metrics, /tokenize, /detokenize and /version, on an :class:`AsyncLLMEngine`.

One router per endpoint family (``routes/``); what they share lives on ``app.state``: the engine,
the :class:`.serving.Serving` that turns requests into engine requests, the metrics, and the
responses in flight (see :mod:`.shutdown`). Errors are OpenAI error objects (:mod:`.errors`); the
API key and the body's size are checked before any route (:mod:`.guards`)."""

from __future__ import annotations

from typing import Optional

from fastapi import FastAPI

from .errors import install_error_handlers
from .guards import DEFAULT_MAX_BODY_BYTES, ApiKeyGuard, BodyLimit
from .metrics import ServerMetrics
from .routes import admin, chat, completions, models, tokenize
from .serving import Serving
from .shutdown import InFlight


def build_app(engine, served_model_name: str, *, model_path: Optional[str] = None,
              enable_auto_tool_choice: bool = True, structured_outputs_config: Optional[dict] = None,
              api_key: Optional[str] = None, chat_template: Optional[str] = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The server's app on ``engine`` (an AsyncLLMEngine whose LLMEngine has a tokenizer).
    ``api_key``: what the guarded routes need as ``Authorization: Bearer``; ``chat_template``: a
    Jinja template that replaces the tokenizer's; ``max_body_bytes``: larger bodies get 413.
    ``enable_auto_tool_choice``: tool_choice "auto" parses the model's Hermes-style tool calls
    (else it is refused, as vLLM does without --enable-auto-tool-choice). ``structured_outputs_config``:
    vLLM's server-wide options, ``{"disable_any_whitespace": bool}`` (JSON constraints without
    whitespace between tokens unless a request's structured_outputs says otherwise)."""
    config = dict(structured_outputs_config or {})
    unknown = sorted(set(config) - {"disable_any_whitespace"})
    if unknown or not isinstance(config.get("disable_any_whitespace", False), bool):
        raise ValueError(f"build_app: structured_outputs_config takes {{'disable_any_whitespace': bool}}, got {config}")
    from minipaged_ops import __version__

    if engine.tokenizer is None:
        raise ValueError("build_app: the engine needs a tokenizer (LLMEngine(..., tokenizer=...) or from_pretrained)")
    llm = engine.engine
    serving = Serving(engine, served_model_name, max_model_len=llm.max_model_len,
                      vocab_size=llm.model.get_input_embeddings().num_embeddings,
                      default_sampling=_generation_defaults(llm.model), model_path=model_path,
                      max_logprobs=llm.max_logprobs, chat_template=chat_template,
                      auto_tool_choice=enable_auto_tool_choice,
                      disable_any_whitespace=config.get("disable_any_whitespace", False))
    metrics = ServerMetrics(served_model_name)
    engine.add_stat_logger(metrics)
    app = FastAPI(title="minipaged", version=__version__)
    app.state.engine, app.state.metrics, app.state.serving, app.state.in_flight = engine, metrics, serving, InFlight()
    install_error_handlers(app)
    for family in (completions, chat, tokenize, models, admin):
        app.include_router(family.router)
    _document_the_app(app, served_model_name)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(ApiKeyGuard, api_key=api_key)  # the outermost: no body is read without the key
    return app


def _generation_defaults(model) -> dict:
    """The sampling fields the checkpoint's generation_config sets explicitly (vLLM's default)."""
    config = getattr(model, "generation_config", None)
    if config is None:
        return {}
    set_fields = config.to_diff_dict()
    names = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
             "repetition_penalty": "repetition_penalty"}
    return {ours: set_fields[theirs] for theirs, ours in names.items() if set_fields.get(theirs) is not None}


def _document_the_app(app: FastAPI, served_model_name: str) -> None:
    """FastAPI documents a 422 on every route with a body; this app answers those with 400 in
    OpenAI's shape (see .errors), which the routes document: the schema says so. And ``model``
    names the one model served (another is a 404)."""
    build = app.openapi

    def openapi() -> dict:
        schema = build()  # built once, then cached by FastAPI: the edits below are made once
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        for body in schema.get("components", {}).get("schemas", {}).values():
            if "model" in body.get("properties", {}):
                body["properties"]["model"] = {"anyOf": [{"enum": [served_model_name]}, {"type": "null"}],
                                               "title": "Model"}
        return schema

    app.openapi = openapi
