"""Log-probabilities in the shapes clients parse: OpenAI's completions shape (``tokens``,
``token_logprobs``, ``top_logprobs`` dicts, ``text_offset``), its chat shape (``content`` entries
with ``bytes`` and ``top_logprobs`` lists), and vLLM's ``prompt_logprobs`` (per prompt token
``{token id: {logprob, rank, decoded_token}}``). An entry is ``(token id, {token id: log-prob})``,
the dict None where there is nothing (the first prompt token). JSON has no -inf: a log-prob is
reported as at least -9999.0, as vLLM does."""

from __future__ import annotations

from typing import Callable, Optional

FLOOR = -9999.0


def _lp(value: float) -> float:
    return max(value, FLOOR)


def _top(dist: dict, k: int) -> list:
    """The ``k`` most likely (token, log-prob) pairs of ``dist``, most likely first."""
    return sorted(dist.items(), key=lambda kv: -kv[1])[:k]


def completion_logprobs(entries, label: Callable[[int], str], k: int, text_start: int = 0) -> dict:
    """OpenAI's completions shape; ``top_logprobs`` holds the ``k`` most likely and the token itself."""
    tokens, offsets, offset = [], [], text_start
    token_logprobs, top_logprobs = [], []
    for token, dist in entries:
        tokens.append(label(token))
        offsets.append(offset)
        offset += len(tokens[-1])
        if dist is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(_lp(dist[token]))
        top = dict(_top(dist, k))
        top.setdefault(token, dist[token])
        top_logprobs.append({label(t): _lp(lp) for t, lp in top.items()})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def chat_logprobs(entries, label: Callable[[int], str], k: int) -> dict:
    """OpenAI's chat shape: per token its text, log-prob, UTF-8 bytes and the ``k`` most likely."""
    def one(token, lp) -> dict:
        text = label(token)
        return {"token": text, "logprob": _lp(lp), "bytes": list(text.encode())}

    return {"content": [{**one(token, dist[token]), "top_logprobs": [one(t, lp) for t, lp in _top(dist, k)]}
                        for token, dist in entries]}


def vllm_prompt_logprobs(prompt_ids, prompt_logprobs: Optional[list], label: Callable[[int], str],
                         k: int) -> Optional[list]:
    """vLLM's ``prompt_logprobs``: None for the first prompt token, then per token the ``k`` most
    likely and the token itself as ``{id: {"logprob", "rank", "decoded_token"}}``. ``rank`` is the
    place among the most likely (1 = most likely); None for the prompt's own token when it is not
    among them (only the top ``k`` are ranked)."""
    if prompt_logprobs is None:
        return None
    out = []
    for token, dist in zip(prompt_ids, prompt_logprobs):
        if dist is None:
            out.append(None)
            continue
        ranked = _top(dist, k)
        entry = {t: {"logprob": _lp(lp), "rank": r, "decoded_token": label(t)} for r, (t, lp) in enumerate(ranked, 1)}
        if token not in entry:
            entry[token] = {"logprob": _lp(dist[token]), "rank": None, "decoded_token": label(token)}
        out.append(entry)
    return out
