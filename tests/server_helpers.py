"""What the server tests share: the app on uvicorn in a thread on a free 127.0.0.1 port (stopped
at the end), and a raw HTTP call with a timeout."""

import contextlib
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import uvicorn

from minipaged_ops.integration.engine.async_engine import AsyncLLMEngine
from minipaged_ops.integration.server import build_app

NAME = "tiny-qwen3"
TIMEOUT = 60


@contextlib.contextmanager
def serving(llm, name=NAME, app_kwargs=None, **engine_kwargs):
    """An AsyncLLMEngine on ``llm`` and the app (``build_app(..., **app_kwargs)``) on uvicorn in a
    thread, on a free port: yields (base URL, engine)."""
    engine = AsyncLLMEngine(llm, **engine_kwargs)
    app = build_app(engine, name, **(app_kwargs or {}))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + TIMEOUT
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", engine
    finally:
        server.should_exit = True
        thread.join(TIMEOUT)
        engine.shutdown()
        sock.close()
        assert not thread.is_alive()


def call(url, path, body=None, method=None, headers=None, data=None):
    """(status, parsed JSON or text) of a raw request; ``data``: raw bytes instead of ``body``."""
    if data is None and body is not None:
        data = json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method or ("POST" if data is not None else "GET"),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
            status, raw = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read().decode()
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw
