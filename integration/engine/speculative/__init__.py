"""Speculative decoding's parts, one job each: ``ngram`` proposes tokens from a sequence's own
earlier tokens (vLLM's prompt lookup); ``acceptance`` decides which proposals the target model
keeps and the one token it adds, greedy or by exact rejection sampling."""

from .acceptance import VerifyRow, num_accepted, rejection_sample, verify_rows
from .ngram import NgramProposer

__all__ = ["NgramProposer", "VerifyRow", "num_accepted", "rejection_sample", "verify_rows"]
