"""An OpenAI-compatible HTTP server on the engine (FastAPI + uvicorn; the ``serve`` extra).

    python -m minipaged_ops.serve --model /models/Qwen3-0.6B --port 8000
"""

from .app import build_app
from .cli import main
from .shutdown import GracefulServer

__all__ = ["GracefulServer", "build_app", "main"]
