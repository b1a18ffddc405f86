"""Tiny random decoder-only models, built offline, and the comparison of greedy outputs that the
tests, the demo and the benchmarks share (one builder, one rule).

    from minipaged_ops.tiny import tiny_model, ragged_batch, compare_greedy
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=64)

Imports transformers only when called, so ``import minipaged_ops`` stays free of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PAD = 0

# architecture -> (config class, model class) in transformers; every layer is full attention
ARCHITECTURES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
}


def tiny_config(
    arch: str = "qwen3",
    *,
    vocab: int = 192,
    hidden: int = 64,
    intermediate: int | None = None,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 64,
    max_positions: int = 512,
    init_range: float | None = 0.5,
    tie_embeddings: bool = False,
):
    """A config of ``arch`` (see :data:`ARCHITECTURES`) with pad id 0, bos 1 and no EOS (outputs run
    to their length). ``init_range=0.5`` scales the random weights up so greedy choices are rarely
    near-ties; ``None`` keeps the architecture's default (a realistic spread of logits)."""
    import transformers

    if arch not in ARCHITECTURES:
        raise ValueError(f"tiny_config: arch must be one of {sorted(ARCHITECTURES)}, got {arch!r}")
    config_class = getattr(transformers, ARCHITECTURES[arch][0])
    kwargs = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=max_positions, pad_token_id=PAD, bos_token_id=1, eos_token_id=None,
        tie_word_embeddings=tie_embeddings,
    )
    if init_range is not None:
        kwargs["initializer_range"] = init_range
    if arch == "mistral":
        kwargs["sliding_window"] = None  # Mistral's default window would make every layer sliding
    return config_class(**kwargs)


def tiny_model(arch: str = "qwen3", *, seed: int = 0, dtype=torch.float32, device="cpu", **config_kwargs):
    """A random ``*ForCausalLM`` of :func:`tiny_config`, seeded, in eval mode, on ``device``."""
    import transformers

    config = tiny_config(arch, **config_kwargs)
    torch.manual_seed(seed)
    with torch.device(device):
        model = getattr(transformers, ARCHITECTURES[arch][1])(config)
    model = model.to(dtype).eval()
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = None
    return model


def ragged_batch(lengths, vocab: int, seed: int = 0, width: int | None = None):
    """Left-padded ``(input_ids, attention_mask)`` with the given real lengths, ids in ``[3, vocab)``."""
    g = torch.Generator().manual_seed(seed)
    width = width or max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(3, vocab, (n,), generator=g)
        mask[i, width - n:] = 1
    return ids, mask


@dataclass(frozen=True)
class RowMatch:
    """How one generated row compares with its reference."""

    first_difference: int | None  # index of the first differing generated token; None: all equal
    close: bool  # equal, or at the first difference each side's token is in the other's top-k


def compare_greedy(ref_tokens, ref_logits, out_tokens, out_logits, top_k: int = 5) -> list[RowMatch]:
    """Compare greedy generations the way vLLM's tests do in low precision: walk each row; where
    the tokens first differ, each side's token must be among the other side's ``top_k`` most
    likely at that step (a near-tie that rounding flipped); after that the rows have different
    histories, so stop comparing.

    ``*_tokens`` are ``[batch, steps]`` generated tokens; ``*_logits`` the logits (or logprobs)
    they were chosen from, ``[batch, steps, vocab]``. In float32 use exact equality instead."""
    ref_top = ref_logits.float().topk(top_k, dim=-1).indices
    out_top = out_logits.float().topk(top_k, dim=-1).indices
    matches = []
    for row in range(ref_tokens.shape[0]):
        differ = (ref_tokens[row] != out_tokens[row]).nonzero().flatten()
        if differ.numel() == 0:
            matches.append(RowMatch(None, True))
            continue
        step = int(differ[0])
        close = bool((ref_top[row, step] == out_tokens[row, step]).any()) and bool(
            (out_top[row, step] == ref_tokens[row, step]).any()
        )
        matches.append(RowMatch(step, close))
    return matches
