"""Per-sequence grammar matchers and the sampler's hook that masks a batch's logits with them.

:class:`SequenceMatcher` is the whole API a sequence's constraint has (for the engine and for
anything that proposes and takes back tokens, such as speculative decoding):

- ``advance(token_ids)``: accept tokens in order (ValueError, naming the token, on one the
  grammar does not allow; the tokens before it stay accepted);
- ``rollback(n)``: take back the last ``n`` accepted tokens (any number: no rollback limit);
- ``fork()``: an independent copy in the same state (``n > 1``: one per completion);
- ``fill_bitmask(bitmask, row)``: write row ``row`` of an int32 token bitmask
  ([rows, ceil(vocab / 32)], token t allowed iff bit t % 32 of word t // 32 is set);
- ``is_terminated``: the grammar is complete and its stop token (EOS) was accepted;
- ``num_tokens``: how many tokens it has accepted; the engine keeps it equal to the length of
  the sequence's output, which :func:`apply_grammar_masks` checks every step;
- for speculative decoding, ``allowed_prefix(token_ids)`` (how many leading proposals the grammar
  accepts) and ``masks_along(token_ids)`` (the bitmask rows at each position of a verify chunk,
  as :class:`FilledMask` rows), both leaving the matcher as it was.

:func:`apply_grammar_masks` is the sampler's hook: one bitmask row per constrained row, filled
(in one batched call when there are several) and applied to the logits in one call, before
penalties, temperature and filters. Rows without a matcher are not touched, and a batch without
any costs one scan of its rows. Log-probabilities are taken before the mask (the raw model
distribution).
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import torch

import minipaged_ops

from .strict_json import OUTSIDE
from .structured_outputs import CompiledConstraint

__all__ = ["FilledMask", "SequenceMatcher", "apply_grammar_masks"]

_FILL_THREADS = min(4, os.cpu_count() or 1)
_batch_filler = None  # xgrammar's BatchGrammarMatcher, made on first use


class SequenceMatcher:
    """The grammar state of one sequence (an xgrammar ``GrammarMatcher``), see the module docstring."""

    def __init__(self, constraint: CompiledConstraint, *, _matcher=None, _json_states=None):
        import xgrammar

        self.constraint = constraint
        self._matcher = _matcher if _matcher is not None else xgrammar.GrammarMatcher(constraint.compiled)
        # strict JSON: the lexer state before the first token and after each accepted one
        self._json_states = [OUTSIDE] if _json_states is None else _json_states
        self._num_tokens = len(self._json_states) - 1

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def advance(self, token_ids: Sequence[int]) -> None:
        for token in token_ids:
            if not self._matcher.accept_token(int(token)):
                raise ValueError(f"SequenceMatcher: token {token} is not allowed by the grammar after "
                                 f"{self._num_tokens} accepted tokens")
            strict = self.constraint.strict_json
            self._json_states.append(OUTSIDE if strict is None else strict.advance(self._json_states[-1], int(token)))
            self._num_tokens += 1

    def rollback(self, n: int) -> None:
        if not 0 <= n <= self._num_tokens:
            raise ValueError(f"SequenceMatcher: cannot roll back {n} tokens of {self._num_tokens} accepted")
        if n:
            self._matcher.rollback(n)
            del self._json_states[len(self._json_states) - n:]
            self._num_tokens -= n

    def fork(self) -> "SequenceMatcher":
        return SequenceMatcher(self.constraint, _matcher=self._matcher.fork(), _json_states=list(self._json_states))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)
        self._restrict(bitmask, row)

    def allowed_prefix(self, token_ids: Sequence[int]) -> int:
        """How many leading ``token_ids`` the grammar accepts in order, stopping after one that
        completes it (nothing may follow); the matcher is left as it was."""
        n = 0
        try:
            for token in token_ids:
                if self.is_terminated or not self._matcher.accept_token(int(token)):
                    break
                n += 1
        finally:
            if n:
                self._matcher.rollback(n)
        return n

    def masks_along(self, token_ids: Sequence[int]) -> list["FilledMask"]:
        """``len(token_ids) + 1`` masks: the next-token mask now and after each of ``token_ids``
        (which the grammar must accept: :meth:`allowed_prefix`); the matcher is left as it was."""
        import xgrammar

        bitmask = xgrammar.allocate_token_bitmask(len(token_ids) + 1, self.constraint.compiled.tokenizer_info.vocab_size)
        base = self._num_tokens
        advanced = 0
        try:
            for j, token in enumerate(token_ids):
                self.fill_bitmask(bitmask, j)
                self.advance([token])
                advanced += 1
            self.fill_bitmask(bitmask, len(token_ids))
        finally:
            self.rollback(advanced)
        return [FilledMask(bitmask[j], base + j) for j in range(len(token_ids) + 1)]

    def _restrict(self, bitmask: torch.Tensor, row: int) -> None:
        """Strict JSON: off, the tokens that would put a control byte where JSON forbids one."""
        strict = self.constraint.strict_json
        if strict is not None:
            bitmask[row].bitwise_and_(strict.rows[self._json_states[-1]])


class FilledMask:
    """One bitmask row filled ahead of the step (a verify chunk's position), standing in for a
    matcher in :func:`apply_grammar_masks`; ``num_tokens``: the output tokens before that position."""

    def __init__(self, bits: torch.Tensor, num_tokens: int):
        self.bits, self.num_tokens = bits, num_tokens

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row].copy_(self.bits)


def apply_grammar_masks(logits: torch.Tensor, rows: Sequence, vocab_size: Optional[int] = None) -> None:
    """Mask ``logits`` ([len(rows), vocab], in place) by each row's ``matcher`` (None: no
    constraint). Raises RuntimeError when a matcher has not accepted exactly the row's output."""
    constrained = [i for i, row in enumerate(rows) if getattr(row, "matcher", None) is not None]
    if not constrained:
        return
    matchers = [rows[i].matcher for i in constrained]
    for i, m in zip(constrained, matchers):
        if m.num_tokens != len(rows[i].output_ids):
            raise RuntimeError(f"grammar matcher out of step: it accepted {m.num_tokens} tokens, the sequence "
                               f"has {len(rows[i].output_ids)} output tokens")
    vocab_size = logits.shape[1] if vocab_size is None else vocab_size
    bitmask = torch.empty(len(rows), -(-vocab_size // 32), dtype=torch.int32)
    live = [(i, m) for i, m in zip(constrained, matchers) if isinstance(m, SequenceMatcher)]
    for i, m in zip(constrained, matchers):
        if not isinstance(m, SequenceMatcher):  # filled ahead (FilledMask)
            m.fill_bitmask(bitmask, i)
    if len(live) == 1:
        live[0][1].fill_bitmask(bitmask, live[0][0])
    elif live:
        _filler().batch_fill_next_token_bitmask([m._matcher for _, m in live], bitmask, [i for i, _ in live])
        for i, m in live:
            m._restrict(bitmask, i)
    if logits.device.type == "cpu" and logits.shape[1] == vocab_size and logits.stride(1) == 1:
        # a word at a time: ~15x faster than xgrammar's CPU apply on nearly-closed rows (bench/RESULTS.md)
        minipaged_ops.apply_token_bitmask_(logits, bitmask, torch.tensor(constrained, dtype=torch.long))
    elif logits.device.type == "cpu":
        import xgrammar

        xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size, indices=constrained)
    else:
        import xgrammar

        xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                             vocab_size=vocab_size, indices=constrained, backend="torch_native")


def _filler():
    global _batch_filler
    if _batch_filler is None:
        import xgrammar

        _batch_filler = xgrammar.BatchGrammarMatcher(_FILL_THREADS)
    return _batch_filler
