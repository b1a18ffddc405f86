"""LLMEngine: continuous batching against transformers' own generate(), one prompt at a time.

Greedy float32 outputs must equal ``model.generate`` (sdpa, DynamicCache) on each prompt alone,
whatever the engine does around them: requests arriving mid-run, chunked prefill, prefix-cache
hits, n > 1, a pool too small for the batch (preemption by recompute and by swap). A soak of
1,000 random requests checks the block manager after every step.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch

pytest.importorskip("transformers")

from minipaged_ops.integration import LLMEngine, SamplingParams, ScheduledChunk, plan_step  # noqa: E402
from minipaged_ops import KVBlockManager  # noqa: E402
from minipaged_ops.tiny import tiny_model  # noqa: E402

VOCAB = 192


@functools.lru_cache(maxsize=None)
def engine_model(arch="qwen3", **kwargs):
    return tiny_model(arch, vocab=VOCAB, **kwargs)


@functools.lru_cache(maxsize=None)
def reference_model(arch="qwen3", **kwargs):
    model = tiny_model(arch, vocab=VOCAB, **kwargs)
    model.set_attn_implementation("sdpa")
    return model


def reference(prompt, max_tokens, arch="qwen3", **kwargs):
    """Greedy tokens of transformers' generate on this prompt alone (sdpa, float32)."""
    return _reference(tuple(prompt), max_tokens, arch, tuple(sorted(kwargs.items())))


@functools.lru_cache(maxsize=None)
def _reference(prompt, max_tokens, arch, kwargs):
    model = reference_model(arch, **dict(kwargs))
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=max_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def prompts_of(lengths, seed=0, prefix=()):
    rng = random.Random(seed)
    return [list(prefix) + [rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


def run_with_arrivals(engine, prompts, params, arrive_every=2):
    """Add a request every ``arrive_every`` steps; returns the final output of each, in order."""
    final, pending, step = {}, list(enumerate(prompts)), 0
    while pending or engine.has_unfinished_requests():
        if pending and step % arrive_every == 0:
            i, p = pending.pop(0)
            engine.add_request(f"r{i}", p, params)
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        assert engine.block_manager.invariants_ok(), engine.block_manager.invariant_violations()
        step += 1
    return [final[f"r{i}"] for i in range(len(prompts))]


def assert_all_blocks_free(engine):
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and bm.usage()["blocks_used"] == 0 and not bm.sequence_ids()


# ---------------------------------------------------------------- equality with generate()


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2", "mistral"])
def test_greedy_equals_generate_with_requests_arriving_mid_run(arch):
    prompts = prompts_of([5, 17, 1, 33, 9, 24, 2], seed=1)
    engine = LLMEngine(engine_model(arch), num_blocks=128, block_size=4)
    outs = run_with_arrivals(engine, prompts, SamplingParams(max_tokens=10))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == reference(p, 10, arch)
        assert o.outputs[0].finish_reason == "length" and o.finished
    assert engine.stats()["preemptions"] == 0
    assert_all_blocks_free(engine)


def test_chunked_prefill_with_a_small_token_budget():
    prompts = prompts_of([40, 3, 27, 11], seed=2)
    engine = LLMEngine(engine_model(), num_blocks=128, block_size=8, max_num_batched_tokens=6, max_num_seqs=6)
    steps_with_prefill_chunks = 0
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=8))
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        steps_with_prefill_chunks += 1
    for i, p in enumerate(prompts):
        assert final[str(i)].outputs[0].token_ids == reference(p, 8)
    # 81 prompt tokens at <= 6 per step: the long prompts took several chunks
    assert engine.stats()["steps"] >= 81 // 6
    assert_all_blocks_free(engine)


def test_prefix_cache_hits_skip_prefill_compute():
    system = prompts_of([32], seed=3)[0]
    prompts = prompts_of([5, 9, 2, 14], seed=4, prefix=system)
    computed = {}
    for caching in (False, True):
        engine = LLMEngine(engine_model(), num_blocks=128, block_size=8, enable_prefix_caching=caching)
        outs = [engine.generate([p], SamplingParams(max_tokens=6), use_tqdm=False)[0] for p in prompts]
        for p, o in zip(prompts, outs):
            assert o.outputs[0].token_ids == reference(p, 6)
        stats = engine.stats()
        computed[caching] = stats["prefill_tokens_computed"]
        if caching:
            assert stats["prefix_cache_hit_rate"] > 0
            assert [o.metrics.num_cached_tokens for o in outs] == [0, 32, 32, 32]
    # the three later requests skipped the 32 shared tokens
    assert computed[False] - computed[True] == 3 * 32


def test_n_greater_than_one_forks_the_prompt_blocks():
    prompts = prompts_of([13, 6], seed=5)
    engine = LLMEngine(engine_model(), num_blocks=64, block_size=4)
    engine.add_request("a", prompts[0], SamplingParams(n=3, max_tokens=7))
    engine.add_request("b", prompts[1], SamplingParams(n=2, max_tokens=7))
    final, shared_seen = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        shared_seen = max(shared_seen, engine.stats()["shared_blocks"])
    assert shared_seen >= 3  # the 13-token prompt's full blocks are held once for 3 completions
    for rid, p, n in (("a", prompts[0], 3), ("b", prompts[1], 2)):
        assert [o.index for o in final[rid].outputs] == list(range(n))
        for o in final[rid].outputs:
            assert o.token_ids == reference(p, 7)
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_pool_at_half_the_peak_demand_preempts_and_stays_exact(mode):
    block_size, max_tokens = 4, 12
    prompts = prompts_of([21, 8, 30, 15, 11, 26], seed=6)
    peak = sum(-(-(len(p) + max_tokens) // block_size) for p in prompts)
    engine = LLMEngine(engine_model(), num_blocks=peak // 2, block_size=block_size, preemption_mode=mode)
    outs = run_with_arrivals(engine, prompts, SamplingParams(max_tokens=max_tokens), arrive_every=1)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == reference(p, max_tokens)
    stats = engine.stats()
    assert stats["preemptions"] > 0
    assert sum(o.metrics.num_preemptions for o in outs) == stats["preemptions"]
    assert_all_blocks_free(engine)


# ---------------------------------------------------------------- the soak


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_soak_1000_random_requests_with_aborts_and_preemption(mode):
    model = engine_model("qwen3", hidden=32, layers=1, heads=2, kv_heads=1, head_dim=16)
    rng = random.Random(12)
    engine = LLMEngine(model, num_blocks=40, block_size=4, max_num_seqs=16, max_num_batched_tokens=48,
                       preemption_mode=mode, scheduling_policy="priority" if mode == "swap" else "fcfs")
    prefixes = prompts_of([8, 12], seed=13)
    total, added, finished, aborted, live, asked = 1000, 0, 0, 0, [], {}
    modes_seen = set()
    while added < total or engine.has_unfinished_requests():
        for _ in range(rng.choice([0, 0, 1, 3, 6])):
            if added == total:
                break
            prompt = (rng.choice(prefixes) if rng.random() < 0.4 else []) + \
                [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 20))]
            max_tokens = rng.randint(1, 10)
            params = SamplingParams(n=rng.choice([1, 1, 1, 2]), max_tokens=max_tokens,
                                    temperature=rng.choice([0.0, 0.8]), top_k=rng.choice([0, 5]),
                                    stop_token_ids=(rng.randrange(3, VOCAB),),
                                    repetition_penalty=rng.choice([1.0, 1.3]), presence_penalty=rng.choice([0.0, 0.5]),
                                    frequency_penalty=rng.choice([0.0, -0.3]), min_p=rng.choice([0.0, 0.05]),
                                    min_tokens=rng.randint(0, max_tokens), logprobs=rng.choice([None, 2]),
                                    prompt_logprobs=rng.choice([None, None, 1]))
            engine.add_request(f"s{added}", prompt, params, priority=rng.randint(0, 2))
            asked[f"s{added}"] = (len(prompt), params)
            live.append(f"s{added}")
            added += 1
        if live and rng.random() < 0.08:
            engine.abort_request(live.pop(rng.randrange(len(live))))
            aborted += 1
        for out in engine.step():
            if out.finished:
                finished += 1
                modes_seen.update(o.finish_reason for o in out.outputs)
                prompt_len, params = asked[out.request_id]
                for o in out.outputs:
                    if o.finish_reason in ("stop", "length"):
                        assert len(o.token_ids) >= params.min_tokens or o.finish_reason == "length"
                        assert params.logprobs is None or len(o.logprobs) == len(o.token_ids)
                if params.prompt_logprobs is not None and out.outputs[0].finish_reason != "abort":
                    assert len(out.prompt_logprobs) == prompt_len and out.prompt_logprobs[0] is None
                if out.request_id in live:
                    live.remove(out.request_id)
        bm = engine.block_manager
        assert bm.invariants_ok(), bm.invariant_violations()
        assert len(bm.sequence_ids()) <= 16 + 1  # max_num_seqs, plus a fork landing past it
    assert finished == total
    stats = engine.stats()
    assert stats["preemptions"] > 0 and stats["prefix_cache_hit_rate"] > 0, stats
    assert {"length", "abort"} <= modes_seen
    assert stats["running"] == stats["waiting"] == stats["swapped"] == 0
    assert_all_blocks_free(engine)


# ---------------------------------------------------------------- requests, sampling, abort


@pytest.mark.parametrize("fail_at", [0, 1, 3, 6])
def test_a_failed_forward_rolls_the_step_back_and_the_engine_goes_on(fail_at, monkeypatch):
    """A forward that raises (out of memory, Ctrl-C) leaves no half-written state behind: the
    step's sequences are recomputed later and blocks filled during it are not prefix-cache hits
    (the prompts share 16 tokens, so a stale registration would be found and read)."""
    system = prompts_of([16], seed=11)[0]
    prompts = prompts_of([6, 19, 3, 10], seed=12, prefix=system)
    model = engine_model()
    engine = LLMEngine(model, num_blocks=64, block_size=4, max_num_batched_tokens=24, max_num_seqs=8)
    params = SamplingParams(max_tokens=7)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    engine.abort_request("r3")
    calls = {"n": 0}
    forward = type(model).forward

    def failing_forward(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == fail_at + 1:
            raise RuntimeError("planted failure")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", failing_forward)
    final, failures = {}, 0
    while engine.has_unfinished_requests():
        try:
            outs = engine.step()
        except RuntimeError as err:
            assert "planted failure" in str(err)
            failures += 1
            assert engine.block_manager.invariants_ok(), engine.block_manager.invariant_violations()
            continue
        for out in outs:
            if out.finished:
                final[out.request_id] = out
    assert failures == 1
    assert final["r3"].outputs[0].finish_reason == "abort"
    for i in range(3):
        assert final[f"r{i}"].outputs[0].token_ids == reference(prompts[i], 7)
    assert_all_blocks_free(engine)


def test_abort_frees_blocks_at_the_next_step_and_is_reported_once():
    engine = LLMEngine(engine_model(), num_blocks=64, block_size=4)
    engine.add_request("x", prompts_of([30])[0], SamplingParams(max_tokens=50))
    engine.add_request("y", prompts_of([5], seed=1)[0], SamplingParams(max_tokens=3))
    engine.step()
    engine.abort_request("x")
    with pytest.raises(ValueError, match="already in use"):  # reusable only once reported
        engine.add_request("x", [5, 6], SamplingParams(max_tokens=2))
    y_blocks = len(engine.block_manager.block_table("y#0"))
    outs = {o.request_id: o for o in engine.step()}
    assert outs["x"].finished and outs["x"].outputs[0].finish_reason == "abort"
    # x's 8 blocks (30 prompt tokens) are free; y holds its own
    assert engine.block_manager.num_blocks - engine.block_manager.num_free_blocks == len(
        engine.block_manager.block_table("y#0")) >= y_blocks
    engine.add_request("x", [5, 6], SamplingParams(max_tokens=2))  # the id is free again
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_blocks_free(engine)


def test_seeded_sampling_is_reproducible_and_logprobs_are_returned():
    prompt = prompts_of([9], seed=7)[0]
    params = SamplingParams(n=2, temperature=1.0, top_p=0.9, top_k=20, seed=123, max_tokens=12, logprobs=3)
    runs = []
    for _ in range(2):
        engine = LLMEngine(engine_model(), num_blocks=64, block_size=4)
        runs.append(engine.generate([prompt], params, use_tqdm=False)[0])
    assert [o.token_ids for o in runs[0].outputs] == [o.token_ids for o in runs[1].outputs]
    assert runs[0].outputs[0].token_ids != runs[0].outputs[1].token_ids  # seeds seed and seed + 1
    for o in runs[0].outputs:
        assert len(o.logprobs) == len(o.token_ids)
        for tok, entry in zip(o.token_ids, o.logprobs):
            assert tok in entry and 3 <= len(entry) <= 4 and all(v <= 0 for v in entry.values())


def test_stop_tokens_eos_and_ignore_eos():
    prompt = prompts_of([7], seed=8)[0]
    greedy = reference(prompt, 10)
    stop = greedy[4]
    first = greedy.index(stop)
    engine = LLMEngine(engine_model(), num_blocks=64, block_size=4)
    out = engine.generate([prompt], SamplingParams(max_tokens=10, stop_token_ids=[stop]), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == greedy[:first + 1] and out.outputs[0].finish_reason == "stop"
    engine.eos_token_ids = frozenset([stop])
    out = engine.generate([prompt], SamplingParams(max_tokens=10), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == greedy[:first + 1] and out.outputs[0].finish_reason == "stop"
    out = engine.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == greedy and out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("bad, match", [
    (dict(prompt=[]), "empty"),
    (dict(prompt=[5] * 200), "at most"),  # longer than the 40-block pool of 4 tokens
    (dict(prompt=[VOCAB + 1]), "outside"),
    (dict(request_id="keep"), "already in use"),
    (dict(params="greedy"), "SamplingParams"),
    (dict(params=SamplingParams(n=9)), "max_num_seqs"),
])
def test_bad_requests_raise_and_change_nothing(bad, match):
    engine = LLMEngine(engine_model(), num_blocks=40, block_size=4, max_num_seqs=8)
    keep = prompts_of([6], seed=9)[0]
    engine.add_request("keep", keep, SamplingParams(max_tokens=5))
    engine.step()
    free = engine.block_manager.num_free_blocks
    with pytest.raises(ValueError, match=match):
        engine.add_request(bad.get("request_id", "new"), bad.get("prompt", [3, 4]), bad.get("params", SamplingParams()))
    assert engine.block_manager.num_free_blocks == free and engine.stats()["waiting"] == 0
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    assert final.request_id == "keep" and final.outputs[0].token_ids == reference(keep, 5)


def test_prompt_longer_than_max_positions_is_rejected():
    engine = LLMEngine(engine_model(), num_blocks=400, block_size=4)  # 1600 slots, 512 positions
    with pytest.raises(ValueError, match="max_position_embeddings 512"):
        engine.add_request("long", [3] * 512, SamplingParams())


@pytest.mark.parametrize("num_blocks, max_positions", [(10, 512), (64, 40)])
def test_a_sequence_ends_with_length_at_max_model_len(num_blocks, max_positions):
    """40 tokens at most, from the pool (10 blocks of 4) or from the model's positions: a prompt
    of 30 asking for 50 more gets exactly 10, the greedy ones."""
    model = engine_model(max_positions=max_positions)
    engine = LLMEngine(model, num_blocks=num_blocks, block_size=4)
    assert engine.max_model_len == 40
    prompt = prompts_of([30], seed=12)[0]
    out = engine.generate([prompt], SamplingParams(max_tokens=50, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length"
    assert out.outputs[0].token_ids == reference(prompt, 10, max_positions=max_positions)
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("kwargs", [dict(n=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-2),
                                    dict(max_tokens=0), dict(seed=1.5), dict(stop_token_ids=[-1]),
                                    dict(logprobs=-2), dict(ignore_eos="yes")])
def test_invalid_sampling_params(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


def test_pool_sized_from_kv_cache_memory_and_stats_keys():
    model = engine_model()
    per_block = 2 * 2 * 2 * 4 * 64 * 4  # K and V, 2 layers, 2 kv heads, 4 slots, head_dim 64, float32
    engine = LLMEngine(model, block_size=4, kv_cache_memory=10 * per_block + 5)
    assert engine.num_blocks == 10 and engine.kv_bytes_per_block == per_block
    with pytest.raises(ValueError, match="kv_cache_memory"):
        LLMEngine(model, block_size=4, kv_cache_memory=per_block - 1)
    engine.generate(prompts_of([6, 6]), SamplingParams(max_tokens=4), use_tqdm=False)
    stats = engine.stats()
    for key in ("running", "waiting", "swapped", "active_tokens", "block_utilisation", "shared_blocks",
                "prefix_cache_hit_rate", "preemptions", "peak_kv_bytes"):
        assert key in stats
    for key in ("queue_time_s", "ttft_s", "tpot_s", "e2e_latency_s"):
        assert set(stats[key]) == {"p50", "p95", "p99"} and stats[key]["p50"] is not None
    assert stats["peak_kv_bytes"] == 6 * per_block  # two prompts of 6 + 3 decoded tokens: 3 blocks each


def test_block_size_defaults_to_the_devices():
    # The CPU decode reads longer runs faster (blocks of 64 there, 16 on CUDA); a given size wins.
    from minipaged_ops.integration.engine.engine_args import default_block_size

    assert default_block_size("cpu") == 64 and default_block_size(torch.device("cuda", 1)) == 16
    model = engine_model()
    engine = LLMEngine(model, num_blocks=4)
    assert engine.block_size == 64
    assert LLMEngine(model, num_blocks=4, block_size=8).block_size == 8
    with pytest.raises(ValueError, match="block_size"):
        LLMEngine(model, num_blocks=4, block_size=0)
    prompt = prompts_of([70])[0]  # two blocks of 64
    out = engine.generate([prompt], SamplingParams(max_tokens=5), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference(prompt, 5)
    assert_all_blocks_free(engine)


# ---------------------------------------------------------------- the planner


def test_plan_step_packs_decodes_then_prefill_chunks():
    bm = KVBlockManager(16, 4)
    bm.create_sequence("a", list(range(6)))
    bm.append_token("a", 9)  # a decode at position 6
    bm.create_sequence("b", list(range(5)))  # a first chunk of 5 prompt tokens
    bm.create_sequence("c", list(range(9)))
    meta = plan_step(bm, [ScheduledChunk("a", [9], 6), ScheduledChunk("b", [0, 1, 2, 3, 4], 0, sample=False),
                          ScheduledChunk("c", [7, 8], 7)])
    assert meta.num_decodes == 1
    assert meta.position_ids.tolist() == [6, 0, 1, 2, 3, 4, 7, 8]
    assert meta.input_ids.tolist() == [9, 0, 1, 2, 3, 4, 7, 8]
    assert meta.query_start_loc.tolist() == [0, 1, 6, 8]
    assert meta.seq_lens.tolist() == [7, 5, 9]
    assert meta.logits_indices.tolist() == [0, 7] and meta.sampled == (0, 2)
    assert meta.slot_mapping.tolist() == bm.slot_mapping("a", 6) + bm.slot_mapping("b") + bm.slot_mapping("c", 7)
    with pytest.raises(ValueError, match="holds 9 tokens"):
        plan_step(bm, [ScheduledChunk("c", [8], 9)])
    # cached leading tokens (generate() recomputing a prefix hit) are read, not written
    meta = plan_step(bm, [ScheduledChunk("c", list(range(9)), 0, cached=4)])
    assert meta.slot_mapping.tolist() == [-1] * 4 + bm.slot_mapping("c", 4)
    for bad in (-1, 10):
        with pytest.raises(ValueError, match=f"cached={bad}, expected 0 .. 9"):
            plan_step(bm, [ScheduledChunk("c", list(range(9)), 0, cached=bad)])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_matches_generate_up_to_near_ties(dtype):
    """In bf16/fp16 rounding may flip a near-tie: tokens equal, or where they first differ each
    side's token is among the other's 5 most likely (as vLLM's tests compare), then stop."""
    model = tiny_model("qwen3", vocab=VOCAB, dtype=dtype)
    ref_model = tiny_model("qwen3", vocab=VOCAB, dtype=dtype)
    ref_model.set_attn_implementation("sdpa")
    prompts = prompts_of([12, 30, 5], seed=10)
    engine = LLMEngine(model, num_blocks=64, block_size=8, max_num_batched_tokens=16, max_num_seqs=8)
    outs = engine.generate(prompts, SamplingParams(max_tokens=10, logprobs=5), use_tqdm=False)
    for p, o in zip(prompts, outs):
        ref = ref_model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=10, do_sample=False, output_logits=True, return_dict_in_generate=True)
        ref_tokens = ref.sequences[0, len(p):].tolist()
        got = o.outputs[0]
        assert got.logprobs is not None and len(got.logprobs) == len(got.token_ids) == 10
        for step, (a, b) in enumerate(zip(ref_tokens, got.token_ids)):
            if a != b:
                assert a in got.logprobs[step], (step, a, b)
                assert b in ref.logits[step][0].float().topk(5).indices.tolist(), (step, a, b)
                break
