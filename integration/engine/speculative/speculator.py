"""What the engine asks of speculation each step: whether to speculate at all, what a decoding
sequence proposes, and the counters (vLLM's ``spec_decode_*``).

Speculation switches itself off where it does not pay, and says why (``stats()``):

* a step with more than ``MAX_DECODES`` decoding sequences, or one that computes prompt tokens
  too: the forward is no longer bound by reading the weights once, so every verified token costs
  about as much as a decoded one (and would take the step's token budget from the prompts);
* a measured acceptance below ``MIN_ACCEPTANCE`` accepted tokens per proposed token (an
  exponential average): rejected proposals cost verify work and give nothing. It is measured
  again every ``PROBE_EVERY`` steps, since a workload may change.

Turning it off changes no token: a verified chunk emits exactly what decoding one token at a
time emits for the same seed (``acceptance``).
"""

from __future__ import annotations

from collections import Counter
from typing import Optional

from .acceptance import num_accepted, verify_rows
from .config import SpeculativeConfig
from .ngram import NgramProposer

__all__ = ["Speculator", "make_proposer", "num_accepted", "verify_rows"]

MAX_DECODES = 8
MIN_ACCEPTANCE = 0.25
PROBE_EVERY = 32
_SMOOTHING = 0.1  # weight of the newest step in the acceptance average


def make_proposer(config: SpeculativeConfig, *, target, num_blocks: int, block_size: int):
    """The proposer ``config.method`` names: n-gram lookup, or a draft model on a pool of
    ``num_blocks`` blocks of ``block_size`` (the target's) in the target's dtype and device."""
    if config.method == "ngram":
        return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_max, config.prompt_lookup_min)
    from ..engine_args import text_config
    from .draft_model import DraftModelProposer, load_draft_model

    param = next(target.parameters())
    draft = load_draft_model(config.model, dtype=param.dtype, device=param.device,
                             vocab_size=text_config(target).vocab_size)
    return DraftModelProposer(draft, config.num_speculative_tokens, num_blocks=num_blocks, block_size=block_size)


class Speculator:
    def __init__(self, config: SpeculativeConfig, counters: Counter, max_model_len: int, proposer=None):
        self.config = config
        self.proposer = proposer if proposer is not None else NgramProposer(
            config.num_speculative_tokens, config.prompt_lookup_max, config.prompt_lookup_min)
        self.counters = counters  # the engine's step counters (a failed step's are put back)
        self.max_model_len = max_model_len
        self.acceptance: Optional[float] = None  # accepted per proposed token, averaged
        self.off_reason: Optional[str] = None
        self._steps = 0
        self._prepared: dict = {}  # a draft model's proposals for this step, per sequence

    def retain(self, seq_ids) -> None:
        """The running sequences: a draft model frees what it holds for any other."""
        if hasattr(self.proposer, "retain"):
            self.proposer.retain(seq_ids)

    def begin_step(self, num_decodes: int, computes_prompts: bool = False) -> bool:
        """Whether this step speculates (see the module for when it does not)."""
        self._steps += 1
        if num_decodes > MAX_DECODES:
            self.off_reason = f"{num_decodes} decoding sequences > {MAX_DECODES}: the step is compute-bound"
        elif computes_prompts:
            self.off_reason = "the step computes prompt tokens: it is compute-bound"
        elif self.acceptance is not None and self.acceptance < MIN_ACCEPTANCE and self._steps % PROBE_EVERY:
            self.off_reason = (f"acceptance {self.acceptance:.2f} < {MIN_ACCEPTANCE} accepted per proposed token "
                               f"(measured again every {PROBE_EVERY} steps)")
        else:
            self.off_reason = None
        return self.off_reason is None

    def prepare(self, seqs, limit: int) -> None:
        """The step's speculating sequences, before any ``propose``: a draft model proposes for all
        of them at once (n-gram lookups need nothing ahead)."""
        self._prepared = {}
        if not isinstance(self.proposer, NgramProposer):
            items = [(s.seq_id, s.token_ids, self._room(s, limit)) for s in seqs]
            self._prepared = self.proposer.propose_batch([item for item in items if item[2] > 0])

    def _room(self, seq, limit: int) -> int:
        return min(limit, seq.params.max_tokens - len(seq.output_ids) - 1, self.max_model_len - len(seq.token_ids) - 1)

    def propose(self, seq, limit: int) -> list[int]:
        """Proposals to follow a decoding sequence's last token: at most ``limit``, never past its
        ``max_tokens`` or the engine's ``max_model_len``. With structured outputs, only the
        leading proposals its grammar accepts (a forbidden one could never be kept); the verify
        rows then carry the grammar's mask at each position (``acceptance.verify_rows``)."""
        room = self._room(seq, limit)
        if room <= 0:
            proposals = []
        elif isinstance(self.proposer, NgramProposer):
            proposals = self.proposer.propose(seq.token_ids, room)
        else:  # proposed in prepare()
            proposals = self._prepared.get(seq.seq_id, [])[:room]
        if proposals and seq.matcher is not None:
            proposals = proposals[:seq.matcher.allowed_prefix(proposals)]
        return proposals

    def record(self, proposed: int, accepted: int) -> None:
        """One verified chunk's outcome."""
        c = self.counters
        c["spec_decode_num_drafts"] += 1
        c["spec_decode_num_draft_tokens"] += proposed
        c["spec_decode_num_accepted_tokens"] += accepted
        for pos in range(accepted):
            c[f"spec_decode_num_accepted_tokens_per_pos_{pos}"] += 1
        rate = accepted / proposed
        self.acceptance = rate if self.acceptance is None else (1 - _SMOOTHING) * self.acceptance + _SMOOTHING * rate

    def report(self) -> dict:
        """The ``spec_decode_*`` entries of ``stats()``."""
        c, k = self.counters, self.config.num_speculative_tokens
        drafts = c["spec_decode_num_drafts"]
        return {
            "spec_decode_method": self.config.method,
            "spec_decode_num_drafts": drafts,
            "spec_decode_num_draft_tokens": c["spec_decode_num_draft_tokens"],
            "spec_decode_num_accepted_tokens": c["spec_decode_num_accepted_tokens"],
            "spec_decode_num_accepted_tokens_per_pos": [c[f"spec_decode_num_accepted_tokens_per_pos_{i}"]
                                                        for i in range(k)],
            # vLLM's mean acceptance length: tokens a verified chunk emits (the accepted + 1)
            "spec_decode_mean_acceptance_length": 1 + c["spec_decode_num_accepted_tokens"] / drafts if drafts else None,
            "spec_decode_off_reason": self.off_reason,
        }
