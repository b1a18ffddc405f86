"""Speculative decoding's parts on their own: the n-gram proposer and the acceptance rules.

The rejection sampler's test is statistical: over many seeds, the first emitted token must follow
the target's distribution at that position, and the token after a kept proposal the target's next
one (chi-square, each at a false-alarm rate of 1e-4 over the choice of seeds; the seeds are fixed,
so the test is deterministic). The same test run with the acceptance rule "keep when p >= q"
(every uniform number just below 1) must fail: it is the planted bug the test exists to catch.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

pytest.importorskip("minipaged_ops.integration")

from minipaged_ops.integration.engine.speculative import NgramProposer, num_accepted, acceptance, rejection_sample  # noqa: E402

FALSE_ALARM = 1e-4
DRAWS = 6000


# ---------------------------------------------------------------- n-gram proposals

def test_ngram_proposes_what_followed_the_longest_earlier_match():
    prop = NgramProposer(3, prompt_lookup_max=3, prompt_lookup_min=1)
    #          0  1  2  3  4  5  6  7  8
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 8]
    assert prop.propose(tokens) == [9, 1, 6]  # suffix [6, 7, 8] occurred at 1
    assert prop.propose(tokens, limit=2) == [9, 1]
    assert prop.propose([1, 2, 3, 4]) == []  # nothing repeats
    assert prop.propose([4]) == [] and prop.propose([]) == []
    # the longest match wins over a later shorter one: [2, 3] at 1 beats [3] at 5
    assert NgramProposer(2, 2, 1).propose([1, 2, 3, 9, 9, 3, 7, 2, 3]) == [9, 9]
    # prompt_lookup_min: a one-token match is not enough
    assert NgramProposer(2, 3, 2).propose([1, 2, 3, 9, 3]) == []
    assert NgramProposer(2, 3, 1).propose([1, 2, 3, 9, 3]) == [9, 3]


def test_ngram_prefers_the_latest_match_followed_by_k_tokens():
    prop = NgramProposer(2, prompt_lookup_max=1)
    assert prop.propose([1, 5, 1, 6, 0, 1]) == [6, 0]  # the latest [1] with two tokens after it
    assert prop.propose([1, 5, 1, 6, 1]) == [6, 1]
    assert prop.propose([1, 5, 9, 1, 1]) == [5, 9]  # the latest [1] has one token after it: the earliest
    assert NgramProposer(4, 2).propose([7, 7, 7, 7]) == [7, 7]  # fewer than k follow any match: the most


@pytest.mark.parametrize("kwargs", [dict(num_speculative_tokens=0, prompt_lookup_max=2),
                                    dict(num_speculative_tokens=2, prompt_lookup_max=True),
                                    dict(num_speculative_tokens=2, prompt_lookup_max=2, prompt_lookup_min=3),
                                    dict(num_speculative_tokens=2.0, prompt_lookup_max=2)])
def test_ngram_refuses_bad_settings(kwargs):
    with pytest.raises(ValueError, match="speculative_config: (num_speculative_tokens|prompt_lookup)"):
        NgramProposer(**kwargs)


# ---------------------------------------------------------------- acceptance

def test_greedy_acceptance_keeps_the_matching_prefix():
    assert num_accepted([4, 5, 6, 7], [4, 5, 9]) == 2
    assert num_accepted([4, 5, 6, 7], [4, 5, 6]) == 3
    assert num_accepted([1], []) == 0 and num_accepted([1, 2], [2]) == 0


def _random_distributions(rows, vocab, generator, sharpness=2.0):
    return (torch.randn(rows, vocab, generator=generator, dtype=torch.float64) * sharpness).softmax(-1)


def _chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Upper tail of Pearson's statistic (cells of expectation < 5 pooled into one)."""
    n = counts.sum()
    expected = probs * n
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]]) if small.any() else counts
    exp = torch.cat([expected[~small], expected[small].sum()[None]]) if small.any() else expected
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor((len(obs) - 1) / 2, dtype=torch.float64), stat / 2))


def _emitted_distribution_pvalues(method: str, seed: int = 0, vocab: int = 6, k: int = 3):
    """p-values: first emitted token against p[0]; the token after a kept first proposal
    against p[1]."""
    g = torch.Generator().manual_seed(seed)
    p = _random_distributions(k + 1, vocab, g)
    q = _random_distributions(k, vocab, g) if method == "draft_model" else None
    first = torch.zeros(vocab, dtype=torch.float64)
    second = torch.zeros(vocab, dtype=torch.float64)
    fixed = torch.multinomial(p[0], k, replacement=True, generator=g).tolist()  # n-gram guesses
    for s in range(DRAWS):
        if q is None:
            proposals = fixed
        else:  # the draft model samples its proposals from q
            proposals = [int(torch.multinomial(q[j], 1, generator=g)) for j in range(k)]
        out = rejection_sample(p, proposals, seed=1000 + s, first_position=7, draft_probs=q)
        assert 1 <= len(out) <= k + 1 and out[:-1] == proposals[:len(out) - 1]
        first[out[0]] += 1
        if len(out) >= 2 and out[0] == proposals[0]:
            second[out[1]] += 1
    return _chi_square_pvalue(first, p[0]), _chi_square_pvalue(second, p[1]), second.sum()


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_rejection_sampling_emits_the_target_distribution(method):
    p_first, p_second, kept = _emitted_distribution_pvalues(method)
    assert kept > 300  # enough kept first proposals to test the next position
    assert p_first > FALSE_ALARM and p_second > FALSE_ALARM, (p_first, p_second)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_planted_bug_keep_when_p_at_least_q_is_caught(method):
    # uniforms just below 1: "u < p/q" becomes "p >= q" -- the classic wrong acceptance rule
    with mock.patch.object(acceptance, "acceptance_uniform", lambda seed, position: 1 - 1e-12):
        p_first, p_second, _ = _emitted_distribution_pvalues(method)
    assert min(p_first, p_second) < FALSE_ALARM


def test_draws_are_a_function_of_seed_and_position():
    g = torch.Generator().manual_seed(3)
    p, q = _random_distributions(4, 50, g, sharpness=0.5), _random_distributions(3, 50, g, sharpness=0.5)
    runs = {tuple(rejection_sample(p, [1, 2, 3], seed=s, first_position=9, draft_probs=q)) for s in (5, 5, 5)}
    assert len(runs) == 1
    outs = {tuple(rejection_sample(p, [1, 2, 3], seed=s, first_position=9, draft_probs=q)) for s in range(40)}
    assert len(outs) > 5  # the seed matters
    # a zero-probability proposal is always rejected, and the replacement never has p = 0
    zero = p.clone()
    zero[0, 1] = 0
    zero[0] /= zero[0].sum()
    zero[0, 4] = 0
    for s in range(50):
        out = rejection_sample(zero, [1, 2], seed=s, first_position=0)
        assert len(out) == 1 and out[0] not in (1, 4)
