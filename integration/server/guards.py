"""What is checked before a request reaches its route, as ASGI middleware: the API key (vLLM's
``--api-key``: every ``/v1/*`` route and ``/tokenize``, ``/detokenize``, ``/tokenizer_info`` need
``Authorization: Bearer KEY``; ``/health``, ``/version`` and ``/metrics`` stay open) and the size
of the body (HTTP 413 past the limit, whether the client announced its length or not)."""

from __future__ import annotations

import hmac
import json
from typing import Optional

from starlette.exceptions import HTTPException

from .protocol import error_body

GUARDED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/tokenizer_info")
DEFAULT_MAX_BODY_BYTES = 32 << 20


async def _send_error(send, status: int, body: dict, headers=()) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": payload})


class ApiKeyGuard:
    """401 in OpenAI's shape unless the guarded routes get the key (compared in constant time)."""

    def __init__(self, app, api_key: Optional[str]):
        if api_key is not None and (not isinstance(api_key, str) or not api_key):
            raise ValueError(f"api_key must be a non-empty str or None, got {api_key!r}")
        self.app, self.key = app, None if api_key is None else api_key.encode()

    async def __call__(self, scope, receive, send):
        if self.key is None or scope["type"] != "http" or scope.get("method") == "OPTIONS" \
                or not scope["path"].startswith(GUARDED_PREFIXES):
            return await self.app(scope, receive, send)
        header = dict(scope.get("headers") or ()).get(b"authorization", b"")
        scheme, _, given = header.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.key):
            return await self.app(scope, receive, send)
        await _send_error(send, 401, error_body("Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                                                code="invalid_api_key"),
                          [(b"www-authenticate", b"Bearer")])


class _TooLarge(HTTPException):
    """Raised by the body's reader: the framework answers it as its own 413 (see .errors)."""

    def __init__(self, max_bytes: int):
        super().__init__(413, f"the request body is larger than the server's limit of {max_bytes} bytes")


class BodyLimit:
    """413 in OpenAI's shape for a body over ``max_bytes``: at once when Content-Length says so,
    else as soon as the bytes read pass it (before the route has answered)."""

    def __init__(self, app, max_bytes: int = DEFAULT_MAX_BODY_BYTES):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"max_body_bytes must be a positive int, got {max_bytes!r}")
        self.app, self.max_bytes = app, max_bytes

    def _error(self) -> dict:
        return error_body(_TooLarge(self.max_bytes).detail)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await _send_error(send, 413, self._error())
        seen, started = 0, False

        async def counted_receive():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise _TooLarge(self.max_bytes)
            return message

        async def watched_send(message):
            nonlocal started
            started |= message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, watched_send)
        except _TooLarge:
            if not started:
                await _send_error(send, 413, self._error())
