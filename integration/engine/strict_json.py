"""Strict JSON on top of the grammar engine's mask: RFC 8259 allows no raw control character
(U+0000-U+001F) inside a string, and only tab, LF and CR (as whitespace) outside one.
xgrammar 0.2.9's string rules for strings with length bounds let every one of them through but
CR and LF, so ``json.loads`` refused some of its outputs.

A three-state lexer (outside a string, inside one, inside just after a backslash) is enough to
tell where a control byte may go. For each state, :class:`StrictJson` holds the bitmask row of the
tokens that put no control byte where JSON forbids it when read from that state, and the state
each token leads to; a JSON sequence's matcher keeps its lexer state per accepted token (so it
rolls back and forks with the grammar) and ANDs its row into the grammar's.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["StrictJson"]

OUTSIDE, INSIDE, ESCAPED = 0, 1, 2
_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_WHITESPACE = frozenset(b"\t\n\r")


class StrictJson:
    """The per-state rows and transitions for one vocabulary (``decoded_vocab``: each token's bytes)."""

    def __init__(self, decoded_vocab: Sequence[bytes], vocab_size: int):
        words = -(-vocab_size // 32)
        allowed = torch.ones(3, words * 32, dtype=torch.int64)
        self.next_state = [bytearray([s]) * vocab_size for s in range(3)]
        for token, text in enumerate(decoded_vocab[:vocab_size]):
            if not text or not any(b < 0x20 or b in (_QUOTE, _BACKSLASH) for b in text):
                continue  # neither a control byte nor a change of state, from any state
            for start in range(3):
                end, ok = _scan(text, start)
                self.next_state[start][token] = end
                if not ok:
                    allowed[start, token] = 0
        packed = (allowed.view(3, words, 32) << torch.arange(32)).sum(-1)  # < 2**32, then wrapped to int32
        self.rows = torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)

    def advance(self, state: int, token: int) -> int:
        return self.next_state[state][token] if token < len(self.next_state[state]) else state


def _scan(text: bytes, state: int) -> tuple[int, bool]:
    """The lexer state after ``text`` read from ``state``, and whether it put no control byte
    where JSON forbids one."""
    ok = True
    for b in text:
        if state == OUTSIDE:
            if b == _QUOTE:
                state = INSIDE
            elif b < 0x20 and b not in _WHITESPACE:
                ok = False
        elif state == INSIDE:
            if b == _QUOTE:
                state = OUTSIDE
            elif b == _BACKSLASH:
                state = ESCAPED
            elif b < 0x20:
                ok = False
        else:
            ok = ok and b >= 0x20
            state = INSIDE
    return state, ok
