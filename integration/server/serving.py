"""From an OpenAI request to engine requests: the model name, the prompts as token ids (vLLM's
rules: ``tokenizer.encode(text)`` with the tokenizer's defaults, a chat through
``apply_chat_template(messages, add_generation_prompt=True)``), the SamplingParams, and the
pieces of every prompt's generation merged into one stream. Everything is checked before the
first request reaches the engine, so a bad request changes nothing."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
import uuid
from typing import AsyncIterator, Optional

from ..engine import SamplingParams
from .output_plan import OutputPlan, plan_outputs
from .protocol import ChatCompletionRequest, CompletionRequest, RequestError, SamplingFields, message_dicts


class Serving:
    """What the endpoints share: the engine, its tokenizer and the model's limits."""

    def __init__(self, engine, served_model_name: str, *, max_model_len: int, vocab_size: int,
                 default_sampling: Optional[dict] = None, model_path: Optional[str] = None, max_logprobs: int = 20,
                 chat_template: Optional[str] = None, auto_tool_choice: bool = True,
                 disable_any_whitespace: bool = False):
        self.engine = engine
        self.auto_tool_choice = auto_tool_choice  # tool_choice "auto": the model's own calls are parsed
        self.disable_any_whitespace = disable_any_whitespace  # JSON constraints' default
        self.tokenizer = engine.tokenizer
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        # the model's generation_config sets the defaults of what a request leaves out, as in vLLM
        self.default_sampling = dict(default_sampling or {})
        self.params_fields = {f.name for f in dataclasses.fields(SamplingParams)}
        self.max_logprobs = max_logprobs  # the engine's cap
        # --chat-template: replaces the tokenizer's own
        self.chat_template = chat_template if chat_template is not None else getattr(self.tokenizer, "chat_template", None)
        self._token_text: dict[int, str] = {}
        self.model_path = model_path
        self.created = int(time.time())

    def model_card(self) -> dict:
        """The served model as /v1/models lists it."""
        return {"id": self.served_model_name, "object": "model", "created": self.created, "owned_by": "minipaged",
                "root": self.model_path or self.served_model_name, "parent": None,
                "max_model_len": self.max_model_len}

    # ------------------------------------------------------------------ checks and prompts

    def check_model(self, name: Optional[str]) -> None:
        if name is not None and name != self.served_model_name:
            raise RequestError(f"The model `{name}` does not exist; this server serves `{self.served_model_name}`.",
                               "model", status_code=404, code="model_not_found")

    def completion_prompts(self, request: CompletionRequest) -> tuple[list[list[int]], list[str]]:
        """The prompts as token ids, and as text (a text prompt as given, token ids decoded: what
        an echo shows)."""
        prompt = request.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise RequestError("prompt must not be empty", "prompt")
        prompts, texts = [], []
        for i, p in enumerate(prompt):
            ids = self.tokenizer.encode(p) if isinstance(p, str) else list(p)
            where = "prompt" if len(prompt) == 1 else f"prompt.{i}"
            if not ids:
                raise RequestError(f"{where} must not be empty", "prompt")
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestError(f"{where} has token ids outside [0, {self.vocab_size}): {bad[:5]}", "prompt")
            self._check_length(len(ids), "prompt")
            prompts.append(ids)
            texts.append(p if isinstance(p, str) else self.tokenizer.decode(ids))
        return prompts, texts

    def chat_prompt(self, request: ChatCompletionRequest, tools: Optional[list] = None) -> list[int]:
        if not request.messages:
            raise RequestError("messages must not be empty", "messages")
        kwargs = dict(request.chat_template_kwargs or {})
        if tools is not None:
            kwargs["tools"] = tools
        ids = self.apply_chat_template(message_dicts(request.messages), request.add_generation_prompt, kwargs)
        self._check_length(len(ids), "messages")
        return ids

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, kwargs=None) -> list[int]:
        if self.chat_template is None:
            raise RequestError("this model's tokenizer has no chat template (give one with --chat-template); use "
                               "/v1/completions", "messages")
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                     tokenize=True, return_dict=False,
                                                     **{**(kwargs or {}), "chat_template": self.chat_template})
        except Exception as e:  # a template that raises on these messages (jinja's raise_exception)
            raise RequestError(f"the chat template failed on these messages: {e}", "messages") from None
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def _check_length(self, n: int, param: str) -> None:
        if n >= self.max_model_len:
            raise RequestError(f"This model's maximum context length is {self.max_model_len} tokens; the prompt has "
                               f"{n} tokens, leaving no room for a completion.", param, code="context_length_exceeded")

    # ------------------------------------------------------------------ running

    def output_plan(self, request: SamplingFields) -> OutputPlan:
        """The request's constraint and tool plan (``output_plan``); RequestError naming the field."""
        names = ("response_format", "structured_outputs", "tools", "tool_choice", "parallel_tool_calls")
        return plan_outputs({name: getattr(request, name, None) for name in names},
                            auto_tool_choice=self.auto_tool_choice, disable_any_whitespace=self.disable_any_whitespace)

    async def compile_constraint(self, plan: OutputPlan) -> None:
        """Compile the plan's constraint now, on a worker thread (the engine finds it cached), so
        that one that does not compile is refused naming its field."""
        grammars = self.engine.engine.grammars
        if plan.constraint is None or grammars is None:
            return
        try:
            await asyncio.to_thread(grammars.compile, plan.constraint)
        except ValueError as e:
            raise RequestError(f"{plan.source}: {e}", plan.source) from None

    def token_text(self, token_id: int) -> str:
        """One token decoded on its own (for logprobs), cached."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    async def start(self, prompts: list[list[int]], params: SamplingParams, priority: int, prefix: str) -> list:
        """Queue one engine request per prompt; their RequestStreams. If the engine refuses one
        (or has stopped), those already queued are aborted and the error raised: before any
        response has begun, so it still becomes an HTTP error."""
        base = f"{prefix}-{uuid.uuid4().hex}"
        streams = []
        try:
            for i, p in enumerate(prompts):
                streams.append(await self.engine.add_request(f"{base}-{i}", p, params, priority=priority))
        except ValueError as e:  # what only the engine knows (n > max_num_seqs, say)
            close_all(streams)
            message = str(e)
            param = next((name for name in ("n", "priority", "prompt") if re.search(rf"\b{name}\b", message)), None)
            raise RequestError(message, param) from None
        except BaseException:
            close_all(streams)
            raise
        return streams


def close_all(streams) -> None:
    """Abort whichever of ``streams`` has not finished (idempotent)."""
    for s in streams:
        s.close()


async def merge(streams) -> AsyncIterator[tuple[int, object]]:
    """``(prompt index, RequestDelta)`` of every stream as pieces come. Leaving the iteration (or
    an error) aborts every request still running."""
    try:
        if len(streams) == 1:
            async for piece in streams[0]:
                yield 0, piece
            return
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(i, stream):
            try:
                async for piece in stream:
                    queue.put_nowait((i, piece))
                queue.put_nowait((i, done))
            except Exception as e:  # noqa: BLE001 (re-raised by the consumer below)
                queue.put_nowait((i, e))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        close_all(streams)
