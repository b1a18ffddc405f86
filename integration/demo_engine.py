"""The demo's serving part: requests arriving over time through ``LLMEngine`` into a pool smaller
than their peak demand, then the capacity report and each request checked against ``generate()``
on its prompt alone."""

from __future__ import annotations

import math
import sys
import time

import torch

from .demo_report import format_report


def run_engine(model, args, device, dtype) -> bool:
    """Requests arriving over time through LLMEngine on a pool of about half their peak demand."""
    from tqdm.auto import tqdm

    from minipaged_ops.integration import LLMEngine, SamplingParams

    g = torch.Generator().manual_seed(args.seed + 1)
    vocab = model.config.vocab_size
    prompts = [torch.randint(3, vocab, (int(torch.randint(8, 96, (1,), generator=g)),), generator=g).tolist()
               for _ in range(args.requests)]
    max_tokens = [int(torch.randint(8, args.max_new_tokens + 1, (1,), generator=g)) for _ in prompts]
    arrivals, t = [], 0.0
    for _ in prompts:
        arrivals.append(t)
        t += float(torch.empty(1).exponential_(args.rate, generator=g))
    bs = args.block_size
    peak = sum(math.ceil((len(p) + m) / bs) for p, m in zip(prompts, max_tokens))
    num_blocks = max(peak // 2, max(math.ceil((len(p) + m) / bs) for p, m in zip(prompts, max_tokens)) + 1)
    engine = LLMEngine(model, num_blocks=num_blocks, block_size=bs, max_num_seqs=16, max_num_batched_tokens=256)
    print(f"\nserving engine: {len(prompts)} requests arriving at {args.rate:g}/s (prompts 8-95 tokens, up to "
          f"{args.max_new_tokens} new, greedy) into {num_blocks} blocks of {bs}: about half of their peak demand "
          f"({peak} blocks)")
    bar = tqdm(total=len(prompts), desc="engine", unit="req", file=sys.stderr, disable=None)
    outputs, i, start = {}, 0, time.perf_counter()
    while i < len(prompts) or engine.has_unfinished_requests():
        while i < len(prompts) and start + arrivals[i] <= time.perf_counter():
            engine.add_request(f"req-{i}", prompts[i], SamplingParams(max_tokens=max_tokens[i], ignore_eos=True))
            i += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
            continue
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
                bar.update(1)
        s = engine.stats()
        bm = engine.block_manager
        bar.set_postfix_str(f"running {s.get('running')}, waiting {s.get('waiting')}, "
                            f"blocks {bm.num_blocks - bm.num_free_blocks}/{bm.num_blocks}, "
                            f"preemptions {s.get('preemptions')}", refresh=False)
    seconds = time.perf_counter() - start
    bar.close()
    generated = sum(len(v) for v in outputs.values())
    print(f"done in {seconds:.1f} s: {generated} tokens, {generated / seconds:.1f} tokens/s")
    print("capacity report (engine.stats()):")
    print(format_report(engine.stats()))

    # every request against generate() on its prompt alone (sdpa, DynamicCache)
    model.set_attn_implementation("sdpa")
    same = 0
    with torch.no_grad():
        for k, (prompt, n) in enumerate(zip(prompts, max_tokens)):
            ref = model.generate(torch.tensor([prompt], device=device), max_new_tokens=n, do_sample=False)
            same += ref[0, len(prompt):].tolist() == list(outputs[f"req-{k}"])
    if dtype == torch.float32:
        print(f"engine outputs equal generate() on each prompt alone: {'yes' if same == len(prompts) else 'NO'} "
              f"({same}/{len(prompts)} requests)")
        return same == len(prompts)
    print(f"engine outputs equal generate() on each prompt alone: {same}/{len(prompts)} requests "
          f"(in {str(dtype).removeprefix('torch.')} near-ties may flip; exact equality is checked in float32)")
    return True
