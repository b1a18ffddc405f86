"""OpenAI's response shapes for /v1/completions and /v1/chat/completions, whole and as the
chunks of a stream, with what vLLM adds (``stop_reason``, ``prompt_logprobs``, per-chunk usage).
What a request asked to see beyond its completions is its :class:`Shape`."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Optional

from .logprob_shapes import chat_logprobs, completion_logprobs, vllm_prompt_logprobs


@dataclass
class Choice:
    """One completion as it accumulates: index in the response is prompt * n + completion."""

    index: int
    text: str = ""
    token_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # (token id, {token id: log-prob}) per token
    finish_reason: Optional[str] = None
    stop_reason: object = None


@dataclass(frozen=True)
class Shape:
    """What one request's response shows besides its completions."""

    chat: bool
    n: int = 1
    logprobs: Optional[int] = None  # the most likely tokens shown per token; None: no log-probs
    echo: bool = False  # completions: each choice starts with its prompt (text, and log-probs if asked)
    drop_output: bool = False  # echo with max_tokens 0: the prompt alone (the engine's one token is dropped)
    prompt_logprobs: Optional[int] = None  # vLLM's prompt_logprobs field, with this many most likely
    as_token_ids: bool = False  # return_tokens_as_token_ids: tokens shown as "token_id:<id>"
    include_usage: bool = False  # stream_options.include_usage
    continuous_usage: bool = False  # stream_options.continuous_usage_stats (with include_usage)


@dataclass(frozen=True)
class Output:
    """What a response shows of one piece of one completion."""

    token_ids: list
    text: str
    entries: list
    finish_reason: Optional[str]
    stop_reason: object


class Formatter:
    """Builds one request's bodies, given its prompts (token ids) and, to echo, their texts."""

    def __init__(self, serving, request_id: str, shape: Shape, prompts: list, prompt_texts=None, tools=None):
        self.serving, self.id, self.shape = serving, request_id, shape
        self.tools = tools  # a chat request's ToolReplies (None: no tools): content and tool_calls
        self.prompts, self.prompt_texts = prompts, prompt_texts
        self.prompt_logprobs: dict[int, list] = {}  # prompt index -> the engine's prompt log-probs
        self.created = int(time.time())
        self.object = "chat.completion" if shape.chat else "text_completion"

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.serving.served_model_name}

    def index(self, prompt_index: int, completion_index: int) -> int:
        return prompt_index * self.shape.n + completion_index

    def label(self, token: int) -> str:
        return f"token_id:{token}" if self.shape.as_token_ids else self.serving.token_text(token)

    # ------------------------------------------------------------------ pieces in

    def take(self, prompt_index: int, piece) -> None:
        """Keep what a piece brings for the whole prompt (its log-probs, once computed)."""
        if piece.prompt_logprobs is not None:
            self.prompt_logprobs[prompt_index] = piece.prompt_logprobs

    def output(self, prompt_index: int, c, first: bool) -> Output:
        """What to show of completion delta ``c`` of prompt ``prompt_index``; ``first``: its
        choice's first (where an echo puts the prompt)."""
        entries = [] if c.logprobs is None else list(zip(c.token_ids, c.logprobs))
        out = Output(list(c.token_ids), c.text, entries, c.finish_reason, c.stop_reason)
        if self.shape.drop_output:
            out = Output([], "", [], c.finish_reason and ("length" if c.finish_reason != "abort" else "abort"), None)
        if first and self.shape.echo:
            out = Output(out.token_ids, self.prompt_texts[prompt_index] + out.text,
                         self._prompt_entries(prompt_index) + out.entries, out.finish_reason, out.stop_reason)
        return out

    def _prompt_entries(self, prompt_index: int) -> list:
        ids, lps = self.prompts[prompt_index], self.prompt_logprobs.get(prompt_index)
        return list(zip(ids, lps if lps is not None else [None] * len(ids)))

    # ------------------------------------------------------------------ bodies out

    def format_logprobs(self, entries, text_start: int = 0):
        if self.shape.logprobs is None:
            return None
        if self.shape.chat:
            return chat_logprobs(entries, self.label, self.shape.logprobs)
        return completion_logprobs(entries, self.label, self.shape.logprobs, text_start)

    def _vllm_prompt_logprobs(self, prompt_index: int):
        if self.shape.prompt_logprobs is None:
            return None
        return vllm_prompt_logprobs(self.prompts[prompt_index], self.prompt_logprobs.get(prompt_index), self.label,
                                    self.shape.prompt_logprobs)

    def response(self, choices: list[Choice]) -> dict:
        body = self._head(self.object)
        body["choices"] = []
        for c in sorted(choices, key=lambda c: c.index):
            choice = {"index": c.index}
            finish_reason = c.finish_reason
            if self.shape.chat and self.tools is not None:
                choice["message"], finish_reason = self.tools.message(c.text, c.finish_reason)
            elif self.shape.chat:
                choice["message"] = {"role": "assistant", "content": c.text}
            else:
                choice["text"] = c.text
            choice["logprobs"] = self.format_logprobs(c.logprobs)
            choice["finish_reason"] = finish_reason
            choice["stop_reason"] = c.stop_reason
            if not self.shape.chat and self.shape.prompt_logprobs is not None:
                choice["prompt_logprobs"] = self._vllm_prompt_logprobs(c.index // self.shape.n)
            body["choices"].append(choice)
        if self.shape.chat and self.shape.prompt_logprobs is not None:
            body["prompt_logprobs"] = self._vllm_prompt_logprobs(0)
        body["usage"] = usage(self.prompt_tokens(), sum(len(c.token_ids) for c in choices))
        return body

    def prompt_tokens(self, prompt_index: Optional[int] = None) -> int:
        if prompt_index is not None:
            return len(self.prompts[prompt_index])
        return sum(len(p) for p in self.prompts)

    def chunk(self, index: int, out: Optional[Output], text_start: int = 0, completion_tokens: int = 0) -> str:
        """A streamed chunk of choice ``index``; ``out`` None: the chat role chunk that opens it."""
        body = self._head("chat.completion.chunk" if self.shape.chat else "text_completion")
        choice = {"index": index}
        text = None if out is None else out.text
        finish_reason = None if out is None else out.finish_reason
        if self.shape.chat and self.tools is not None and out is not None:
            choice["delta"], finish_reason = self.tools.delta(index, text if text or not finish_reason else None,
                                                              finish_reason)
        elif self.shape.chat:
            role = out is None
            choice["delta"] = {"role": "assistant", "content": ""} if role else (
                {} if not text and out.finish_reason else {"content": text})
        else:
            choice["text"] = text or ""
        choice["logprobs"] = None if out is None else self.format_logprobs(out.entries, text_start)
        choice["finish_reason"] = finish_reason
        choice["stop_reason"] = None if out is None else out.stop_reason
        body["choices"] = [choice]
        if self.shape.include_usage:
            body["usage"] = usage(self.prompt_tokens(index // self.shape.n), completion_tokens) \
                if self.shape.continuous_usage else None
        return sse(body)

    def usage_chunk(self, completion_tokens: int) -> str:
        body = self._head("chat.completion.chunk" if self.shape.chat else "text_completion")
        body["choices"] = []
        body["usage"] = usage(self.prompt_tokens(), completion_tokens)
        return sse(body)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"
