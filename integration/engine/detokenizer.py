"""Incremental detokenization with stop strings, for any transformers tokenizer.

Each pushed token is decoded inside a small window of token ids (the read-offset scheme of
vLLM's detokenizer and transformers' ``TextStreamer``): the window's text minus its first part's
text is what the new token added, which keeps tokenizers that treat a leading space or a byte run
specially correct without decoding the whole output every time. A multi-byte character split over
tokens decodes to a trailing U+FFFD until its last byte arrives, so trailing U+FFFDs are held back
and the window is only moved past text that ended on a whole character.

Stop strings are searched in the text each token adds (with enough text before it to catch one that
spans tokens), and only once the output has more than ``min_tokens`` tokens, as vLLM does. Unless the
stop string is to be included, released text never ends in a piece that could still grow into a stop
string: that suffix is held back until it can no longer match, or until :meth:`finish`.
"""

from __future__ import annotations

from typing import Optional, Sequence

__all__ = ["IncrementalDetokenizer"]

REPLACEMENT = "\ufffd"  # what a partial (or invalid) UTF-8 byte run decodes to
_CONTEXT_TOKENS = 5  # prompt tokens decoded before the output, for tokenizers whose text depends on them


class IncrementalDetokenizer:
    """The text of one sequence's output, grown one token at a time.

    Args:
        tokenizer: a transformers tokenizer (``decode(ids, skip_special_tokens=...)``).
        prompt_token_ids: the prompt; its last few tokens are decoding context, never output text.
        stop: strings that end the output when its text completes one.
        include_stop_str_in_output: keep the stop string at the end of the text (else it is cut).
        skip_special_tokens: leave special tokens out of the text.
        min_tokens: stop strings count only once the output has more tokens than this.

    ``text`` is the released text. ``decode(output ids, skip_special_tokens=...)`` (no clean-up of
    tokenization spaces) is what :meth:`finish` returns when no stop string was met.
    """

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], *, stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True, min_tokens: int = 0):
        if isinstance(stop, str):
            stop = (stop,)
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"IncrementalDetokenizer: stop must hold non-empty strings, got {stop!r}")
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = tuple(stop)
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens
        context = list(prompt_token_ids)[-_CONTEXT_TOKENS:]
        if self._decode(context).endswith(REPLACEMENT):  # the prompt ends inside a character
            context = []
        self._window = context  # token ids from the window's start on
        self._read_offset = len(context)  # window[:read_offset] decodes to text already in the output
        self._read_text = self._decode(context)
        self._window_chars = 0  # chars beyond read_text released from the window so far
        self._num_tokens = 0
        self._full = ""  # the output's text so far: whole characters only
        self._released = 0  # len(text)
        self.stop_reason: Optional[str] = None  # the stop string met, if any
        self.finished = False

    @property
    def text(self) -> str:
        return self._full[:self._released]

    def push(self, token_id: int) -> Optional[str]:
        """Append one output token; returns the stop string it completed (the text is then cut and
        final), else None."""
        if self.finished:
            raise RuntimeError("IncrementalDetokenizer: push after the output finished "
                               f"({'stop string ' + repr(self.stop_reason) if self.stop_reason else 'finish()'})")
        self._num_tokens += 1
        self._window = self._window + [int(token_id)]  # never changed in place: copy.copy() is a snapshot
        window_text = self._decode(self._window)
        whole = window_text.rstrip(REPLACEMENT)
        new = whole[len(self._read_text) + self._window_chars:]
        self._window_chars += len(new)
        if len(window_text) > len(self._read_text) and not window_text.endswith(REPLACEMENT):
            # the window ends on a whole character: later tokens decode after it
            # (decoded alone: a tokenizer may render a window's first token differently)
            self._window = self._window[self._read_offset:]
            self._read_offset = len(self._window)
            self._read_text = self._decode(self._window)
            self._window_chars = 0
        return self._add(new)

    def finish(self) -> str:
        """The final text: a trailing partial character (as U+FFFD) and held-back text released,
        a stop string cut unless it is to be included."""
        if not self.finished:
            tail = self._decode(self._window)[len(self._read_text) + self._window_chars:]
            self._add(tail)
            self._released = len(self._full)
            self.finished = True
        return self.text

    # ------------------------------------------------------------------ internals

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens,
                                      clean_up_tokenization_spaces=False)

    def _add(self, new: str) -> Optional[str]:
        start = len(self._full)
        self._full += new
        if new and self._stop and self._num_tokens > self._min_tokens:
            hit = self._find_stop(start)
            if hit is not None:
                stop, begin = hit
                self._full = self._full[:begin + len(stop) if self._include_stop else begin]
                self._released = len(self._full)
                self.stop_reason = stop
                self.finished = True
                return stop
        self._released = len(self._full) - self._held_back()
        return None

    def _find_stop(self, start: int):
        """The stop string that ends earliest in the text after ``start`` (the longest on a tie), and
        where it begins. (When stop strings are cut, a match never begins in released text: the
        released text never ends in a piece of one.)"""
        best = None
        for stop in self._stop:
            begin = self._full.find(stop, max(0, start - len(stop) + 1))
            if begin >= 0:
                key = (begin + len(stop), begin)
                if best is None or key < best[0]:
                    best = (key, stop, begin)
        return None if best is None else best[1:]

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string (0 when
        stop strings are kept in the output: a match then never removes released text)."""
        if self._include_stop or not self._stop:
            return 0
        longest = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(self._full)), longest, -1):
                if self._full.endswith(stop[:n]):
                    longest = n
                    break
        return longest
