"""The demo's inputs and its measured ``generate()`` runs: the model (a tiny random Qwen3, or a
local checkpoint), the ragged batch, and a timed ``generate()`` that records the KV blocks in use
after every step, with the check that two runs gave the same tokens."""

from __future__ import annotations

import sys
import time

import torch

TEXT_PROMPTS = [
    "The paged KV cache stores keys and values in fixed-size blocks, so that",
    "Hello!",
    "Write a short poem about the sea, the wind and a small boat that keeps sailing through the night "
    "until the morning light shows the harbour:",
    "In one sentence, what is attention in a transformer?",
    "List three prime numbers:",
]


# the demo's tiny random Qwen3 (minipaged_ops.tiny.tiny_model arguments)
DEMO_MODEL = dict(vocab=512, hidden=256, intermediate=512, layers=4, heads=4, kv_heads=2, head_dim=64,
                  max_positions=2048, init_range=0.3)


def load(args, device, dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from minipaged_ops.tiny import tiny_model

    if args.model is None:
        return tiny_model("qwen3", seed=args.seed, dtype=dtype, device=device, **DEMO_MODEL), None
    tok = AutoTokenizer.from_pretrained(args.model, local_files_only=True, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True, dtype=dtype).to(device).eval()
    if getattr(model.config, "model_type", "") != "qwen3":
        print(f"note: model_type is {model.config.model_type!r}; the demo targets Qwen3", file=sys.stderr)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok


def make_batch(args, model, tok, device):
    if tok is not None:
        prompts = [TEXT_PROMPTS[i % len(TEXT_PROMPTS)] for i in range(args.batch)]
        enc = tok(prompts, return_tensors="pt", padding=True)
        return enc["input_ids"].to(device), enc["attention_mask"].to(device)
    g = torch.Generator().manual_seed(args.seed)
    lengths = [[37, 12, 64, 5, 50, 23, 8, 41][i % 8] for i in range(args.batch)]
    width = max(lengths)
    ids = torch.zeros(args.batch, width, dtype=torch.long)
    mask = torch.zeros(args.batch, width, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(3, model.config.vocab_size, (n,), generator=g)
        mask[i, width - n:] = 1
    return ids.to(device), mask.to(device)


class StepRecorder:
    """Forward hook: a progress bar over decode steps and the blocks in use after each step."""

    def __init__(self, model, total, desc, cache=None):
        from tqdm.auto import tqdm

        self.cache = cache
        self.blocks = []
        self.bar = tqdm(total=total, desc=desc, unit="step", leave=False, delay=0.5, file=sys.stderr,
                        disable=None)  # None: only on a terminal
        self.handle = model.register_forward_hook(self._step)

    def _step(self, module, args, output):
        self.bar.update(1)
        if self.cache is not None:
            self.blocks.append(self.cache.num_blocks - self.cache.block_manager.num_free_blocks)

    def close(self):
        self.handle.remove()
        self.bar.close()


def timed_generate(model, impl, ids, mask, cache, desc, **kwargs):
    """``(sequences, logits [batch, steps, vocab], seconds, blocks in use per step)``."""
    from minipaged_ops.integration import _compat

    model.set_attn_implementation(impl)
    rec = StepRecorder(model, kwargs["max_new_tokens"], desc, cache)
    extra = {} if cache is None else _compat.cache_kwargs(cache)
    kwargs = dict(kwargs, return_dict_in_generate=True, output_logits=True)
    try:
        if ids.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, **extra, **kwargs)
        if ids.is_cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    finally:
        rec.close()
    return out.sequences, torch.stack(out.logits, 1), seconds, rec.blocks


def same_tokens(ref, ref_logits, out, out_logits, prompt_width, dtype, top_k) -> tuple[bool, str]:
    """Exact equality in float32; in bfloat16/float16, equal up to near-ties (compare_greedy)."""
    from minipaged_ops.tiny import compare_greedy

    if torch.equal(out, ref):
        return True, "yes"
    rows = (out != ref).any(1).nonzero().flatten().tolist()
    if dtype == torch.float32:
        return False, f"NO, rows {rows}"
    matches = compare_greedy(ref[:, prompt_width:], ref_logits, out[:, prompt_width:], out_logits, top_k)
    ok = all(m.close for m in matches)
    where = ", ".join(f"row {r} at token {matches[r].first_difference}" for r in rows)
    verdict = "yes, up to near-ties" if ok else "NO"
    return ok, (f"{verdict} ({str(dtype).removeprefix('torch.')}: first differences {where}; each side's token "
                f"{'is' if ok else 'is not always'} in the other's top-{top_k} there)")

