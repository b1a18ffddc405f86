"""The fields a request may name that this server does not implement. One that would change the
answer is refused (HTTP 400 naming it) unless it holds its do-nothing value; a field no table
knows is refused as unrecognized (OpenAI's rule) rather than ignored. The README lists them."""

from __future__ import annotations

from .common import RequestError

_NULL = (None,)

# field -> the values that ask for nothing (sending those is accepted)
COMPLETION_FIELDS = {
    "suffix": (None, ""),
}
CHAT_FIELDS = {
    "audio": _NULL,
    "modalities": (None, ["text"]),
    "prediction": _NULL,
    "functions": (None, []),
    "function_call": (None, "none"),
    "reasoning_effort": _NULL,
    "verbosity": _NULL,
    "web_search_options": _NULL,
}
# vLLM's extras this server lacks (on either endpoint): named, so that the refusal says why
VLLM_FIELDS = {name: _NULL for name in (
    "use_beam_search", "length_penalty", "allowed_token_ids", "bad_words", "truncate_prompt_tokens",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
    "guided_whitespace_pattern", "logits_processors", "prompt_embeds", "continue_final_message",
    "chat_template", "documents", "mm_processor_kwargs", "spaces_between_special_tokens")}


def check_fields(request, table: dict) -> None:
    """Refuse (RequestError naming it) the first field of ``request`` that ``table`` or
    :data:`VLLM_FIELDS` lists with a value that asks for something, or that nobody knows."""
    for name, value in (request.model_extra or {}).items():
        allowed = table.get(name, VLLM_FIELDS.get(name))
        if allowed is None:
            raise RequestError(f"Unrecognized request argument supplied: {name}", name)
        if value not in allowed:
            raise RequestError(f"{name} is not supported by this server (only {_shown(allowed)} is accepted)", name)


def _shown(values) -> str:
    import json

    return " or ".join(json.dumps(v) for v in values)
