"""Structured outputs: what a request's output must obey (``StructuredOutputsParams``, vLLM's
names) and the compiled grammars behind it (``GrammarCompilerCache``, on xgrammar).

Exactly one constraint per request: ``json`` (a JSON schema, dict or JSON text), ``regex``,
``choice`` (a list of strings), ``grammar`` (xgrammar's EBNF, root rule ``root``; Lark is tried
when it is not EBNF) or ``json_object=True`` (any JSON object, as vLLM's JSON mode).
``disable_any_whitespace=True``: JSON without whitespace between its tokens (vLLM's option; by
default any JSON whitespace is allowed there, and a weak model may spend its tokens on it). The engine compiles it
when the request is added, on the caller's thread, so a constraint that does not compile is a
``ValueError`` naming the field before anything runs; compiled grammars are cached per
(kind, spec). Each sequence then holds a :class:`~.grammar_matcher.SequenceMatcher` whose token
bitmask the sampler applies to the logits (``grammar_matcher``).

Strict JSON: RFC 8259 forbids raw control characters (U+0000-U+001F) inside strings; every JSON
constraint also masks the tokens that would put one there (``strict_json``), whatever the
grammar engine's own string rules allow, so what comes back parses with ``json.loads``.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

from .strict_json import StrictJson

__all__ = ["CompiledConstraint", "GrammarCompilerCache", "StructuredOutputsParams"]

_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_CACHED_GRAMMARS = 256  # compiled grammars kept per engine (least recently used dropped first)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """The constraint a request's output obeys: exactly one of the fields (vLLM's names)."""

    json: Union[str, dict, None] = None
    regex: Optional[str] = None
    choice: Optional[Sequence[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    disable_any_whitespace: bool = False

    def __post_init__(self):
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"StructuredOutputsParams: exactly one of {', '.join(_KINDS)} must be given, "
                             f"got {given or 'none'}")
        if self.json is not None:
            object.__setattr__(self, "json", _schema(self.json))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"StructuredOutputsParams: {name} must be a non-empty str, got {value!r}")
        if self.choice is not None:
            choice = tuple(self.choice) if isinstance(self.choice, (list, tuple)) else None
            if not choice or not all(isinstance(c, str) and c for c in choice):
                raise ValueError(f"StructuredOutputsParams: choice must be a non-empty list of non-empty str, "
                                 f"got {self.choice!r}")
            object.__setattr__(self, "choice", choice)
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(f"StructuredOutputsParams: json_object must be True or None, got {self.json_object!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"StructuredOutputsParams: disable_any_whitespace must be a bool, "
                             f"got {self.disable_any_whitespace!r}")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    @property
    def is_json(self) -> bool:
        return self.json is not None or self.json_object is True

    def cache_key(self) -> tuple:
        """(kind, spec) in a canonical text: equal constraints share one compiled grammar."""
        spec = {"json": lambda: json.dumps(self.json, sort_keys=True), "choice": lambda: self.choice,
                "json_object": lambda: True}.get(self.kind, lambda: getattr(self, self.kind))()
        return self.kind, spec, self.is_json and self.disable_any_whitespace


@dataclass(frozen=True)
class CompiledConstraint:
    """A compiled grammar (xgrammar's ``CompiledGrammar``) and, for JSON, the vocabulary's
    :class:`~.strict_json.StrictJson` (None otherwise)."""

    compiled: Any
    strict_json: Any


class GrammarCompilerCache:
    """Compiles :class:`StructuredOutputsParams` for one tokenizer and vocabulary, caching the
    results per (kind, spec). Safe from any thread; xgrammar is imported on first use.

    Args:
        tokenizer: the engine's transformers tokenizer.
        vocab_size: the model's logits width (may exceed the tokenizer's: the rest is never allowed).
        stop_token_ids: the tokens that end a completed grammar (the engine's EOS ids); empty:
            the tokenizer's own.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids=()):
        self._tokenizer, self._vocab_size = tokenizer, vocab_size
        self._stop_token_ids = sorted(stop_token_ids) or None
        self._lock = threading.Lock()
        self._compiler = None
        self._strict_json = None
        self._cache: OrderedDict = OrderedDict()
        self.compile_seconds: list[float] = []  # per grammar compiled (cache misses), for benchmarks

    def compile(self, params: StructuredOutputsParams) -> CompiledConstraint:
        """The compiled constraint of ``params``; ValueError naming the field if it does not compile."""
        import time

        key = params.cache_key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            compiler = self._ensure_compiler()
        started = time.perf_counter()
        compiled = _compile(compiler, params)  # outside the lock: other requests' hits go on
        constraint = CompiledConstraint(compiled, self._strict_json if params.is_json else None)
        with self._lock:
            self.compile_seconds.append(time.perf_counter() - started)
            self._cache[key] = constraint
            while len(self._cache) > _CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return constraint

    def prepare(self) -> None:
        """Read the tokenizer's vocabulary now (seconds for a 150k vocabulary; once per tokenizer
        in the process) rather than at the first constrained request; a server calls it at start."""
        with self._lock:
            self._ensure_compiler()

    def _ensure_compiler(self):
        if self._compiler is None:
            try:
                import xgrammar
            except ImportError as err:
                raise ValueError("structured_outputs need the xgrammar package: pip install 'minipaged[structured]'"
                                 ) from err
            info, self._strict_json = _vocabulary(self._tokenizer, self._vocab_size, self._stop_token_ids)
            self._compiler = xgrammar.GrammarCompiler(info)
        return self._compiler


_VOCABULARIES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # tokenizer -> {(vocab, stops): ...}
_VOCABULARIES_LOCK = threading.Lock()


def _vocabulary(tokenizer, vocab_size: int, stop_token_ids):
    """xgrammar's TokenizerInfo of ``tokenizer`` and its StrictJson tables, made once per tokenizer,
    vocabulary size and stop tokens (engines sharing a tokenizer share them)."""
    import xgrammar

    key = (vocab_size, None if stop_token_ids is None else tuple(stop_token_ids))
    with _VOCABULARIES_LOCK:
        found = _VOCABULARIES.setdefault(tokenizer, {}).get(key)
        if found is None:
            info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                           stop_token_ids=stop_token_ids)
            found = _VOCABULARIES[tokenizer][key] = (info, StrictJson(info.decoded_vocab, vocab_size))
        return found


def _compile(compiler, params: StructuredOutputsParams):
    kind = params.kind
    try:
        any_whitespace = not params.disable_any_whitespace
        if kind == "json":
            return compiler.compile_json_schema(json.dumps(params.json), any_whitespace=any_whitespace)
        if kind == "json_object":  # any object: no schema, so no property is "additional"
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace,
                                                strict_mode=False)
        if kind == "regex":
            return compiler.compile_regex(params.regex)
        if kind == "choice":
            return compiler.compile_grammar("root ::= " + " | ".join(_ebnf_literal(c) for c in params.choice))
        try:
            return compiler.compile_grammar(params.grammar)
        except Exception as ebnf_error:  # noqa: BLE001 - not EBNF: perhaps Lark
            try:
                return compiler.compile_lark(params.grammar)
            except Exception:  # noqa: BLE001 - report the EBNF parser's complaint
                raise ebnf_error from None
    except Exception as err:  # noqa: BLE001 - xgrammar's parse and conversion errors (RuntimeError mostly)
        message = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise ValueError(f"structured_outputs.{kind}: does not compile: {message}") from None


def _ebnf_literal(text: str) -> str:
    """``text`` as an EBNF string literal (backslash, quote and control characters escaped)."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _schema(value):
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"StructuredOutputsParams: json must be a JSON schema (a dict or its JSON text), "
                             f"and its text does not parse: {err}") from None
    if isinstance(value, bool):  # JSON Schema's true (anything) and false (nothing)
        raise ValueError(f"StructuredOutputsParams: json must be a schema object, got {value!r}")
    if not isinstance(value, dict):
        raise ValueError(f"StructuredOutputsParams: json must be a JSON schema (a dict or its JSON text), "
                         f"got {type(value).__name__}")
    return value
