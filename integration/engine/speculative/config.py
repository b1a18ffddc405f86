"""``speculative_config``: vLLM's keys, checked once when the engine is built.

``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min": m}``
or ``{"method": "draft_model", "model": PATH_OR_MODULE, "num_speculative_tokens": k}``. A key or a
method this engine does not implement is refused with an error naming it, never accepted and
ignored (the prompt-lookup keys belong to "ngram" only).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

__all__ = ["SpeculativeConfig"]

_KEYS = {"ngram": ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"),
         "draft_model": ("method", "model", "num_speculative_tokens")}
METHODS = tuple(_KEYS)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    model: object = None  # draft_model: a folder or a module

    @classmethod
    def parse(cls, config) -> "SpeculativeConfig | None":
        """From a dict or its JSON text (the server's ``--speculative-config``); None stays None."""
        if config is None or isinstance(config, SpeculativeConfig):
            return config
        if isinstance(config, str):
            try:
                config = json.loads(config)
            except json.JSONDecodeError as err:
                raise ValueError(f"speculative_config: not valid JSON ({err})") from None
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(config).__name__}")
        method = config.get("method")
        if method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {list(METHODS)}, got {method!r}")
        unknown = sorted(set(config) - set(_KEYS[method]))
        if unknown:
            raise ValueError(f"speculative_config: unsupported key(s) {unknown} for method {method!r}; "
                             f"supported: {list(_KEYS[method])}")
        if method == "draft_model" and config.get("model") is None:
            raise ValueError("speculative_config: model (a folder or a module) is required for method 'draft_model'")
        if "num_speculative_tokens" not in config:
            raise ValueError("speculative_config: num_speculative_tokens is required")
        k = config["num_speculative_tokens"]
        n_max = config.get("prompt_lookup_max", 4)
        n_min = config.get("prompt_lookup_min", 1)
        from .ngram import NgramProposer

        NgramProposer(k, n_max, n_min)  # ValueError naming a bad value (k too)
        return cls(method, k, n_max, n_min, config.get("model"))
