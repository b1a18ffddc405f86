"""vLLM's ``GET /tokenizer_info``: the tokenizer's configuration as JSON (its constructor's
arguments less file paths, its special tokens as text, its class, the chat template in use), which
clients such as lm-eval read for ``eos_token`` and the template instead of loading the tokenizer."""

from __future__ import annotations

from typing import Optional

_PATHS = {"vocab_file", "merges_file", "tokenizer_file", "name_or_path", "added_tokens_decoder"}
_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def tokenizer_info(tokenizer, chat_template: Optional[str]) -> dict:
    config = {key: _plain(value) for key, value in (getattr(tokenizer, "init_kwargs", None) or {}).items()
              if key not in _PATHS}
    config = {key: value for key, value in config.items() if value is not _SKIP}
    for name in _SPECIAL:  # the tokenizer's own (init_kwargs may lack those set from the files)
        token = getattr(tokenizer, name, None)
        if token is not None:
            config[name] = str(token)
    config["model_max_length"] = _plain(getattr(tokenizer, "model_max_length", None))
    config["tokenizer_class"] = type(tokenizer).__name__
    if chat_template is not None:
        config["chat_template"] = chat_template
    return config


_SKIP = object()


def _plain(value):
    """``value`` as JSON holds it: special tokens as their text, numbers JSON can write, containers
    item by item; anything else is left out."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value if abs(value) < 1 << 53 else None  # a "no limit" sentinel (1e30) as null
    if isinstance(value, float):
        return value if abs(value) < 1e300 else None
    if hasattr(value, "content") and isinstance(value.content, str):  # tokenizers' AddedToken
        return value.content
    if isinstance(value, (list, tuple)):
        return [v for v in map(_plain, value) if v is not _SKIP]
    if isinstance(value, dict):
        items = {str(k): _plain(v) for k, v in value.items()}
        return {k: v for k, v in items.items() if v is not _SKIP}
    return _SKIP
