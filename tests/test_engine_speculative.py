"""LLMEngine with n-gram speculative decoding: the tokens of decoding one at a time, exactly.

A verified chunk emits the tokens the sampler draws at its positions as long as they agree with
the proposals, so with speculation on, greedy AND seeded sampled outputs equal those with it off,
token for token (float32): under arrivals, chunked prefill, prefix hits, preemption in both modes,
n > 1, failed steps. The tiny random model's outputs repeat themselves now and then, which the
n-gram proposer predicts, so proposals are kept as well as rejected (the tests check both).
The rejection rule for proposers with a distribution of their own is tested statistically in
test_speculative_units.py.
"""

from __future__ import annotations

import copy
import functools
import random
import re

import pytest
import torch

pytest.importorskip("transformers")

from minipaged_ops.integration import LLMEngine, SamplingParams  # noqa: E402
from minipaged_ops.integration.engine.speculative import speculator as speculator_module  # noqa: E402
from minipaged_ops.tiny import tiny_model  # noqa: E402

VOCAB = 64  # a small vocabulary: greedy outputs repeat soon, so proposals get kept


@pytest.fixture(autouse=True)
def _always_speculate(monkeypatch):
    """The tiny model keeps few proposals (5-15%): speculation stays on, so every test exercises
    verify chunks (test_speculation_switches_itself_off_and_says_why tests switching off)."""
    monkeypatch.setattr(speculator_module, "MIN_ACCEPTANCE", 0.0)


@functools.lru_cache(maxsize=None)
def model_of(seed=0):
    return tiny_model("qwen3", vocab=VOCAB, seed=seed, hidden=32, heads=2, kv_heads=1, head_dim=16, layers=2)


def ngram(k, n_max=3, n_min=1):
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n_max, "prompt_lookup_min": n_min}


def draft(k, seed=1, noise=0.5):
    """A draft model: the target with every weight perturbed by ``noise`` times its spread (seeded),
    so that it agrees with the target often but not always; seed 0: the target itself, whose every
    proposal is kept."""
    if seed == 0:
        return {"method": "draft_model", "model": model_of(), "num_speculative_tokens": k}
    model = copy.deepcopy(model_of())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=g) * p.std() * noise)
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k}


def prompts_of(lengths, seed=0, prefix=()):
    rng = random.Random(seed)
    return [list(prefix) + [rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


def run(engine, prompts, params, arrive_every=1, fail_at=None):
    """Requests arrive every ``arrive_every`` steps; ``fail_at``: forward calls that raise.
    Returns each request's final output, in order; checks the block manager after every step."""
    final, pending, step, calls, failures = {}, list(enumerate(prompts)), 0, {"n": 0}, 0
    forward = engine.run_model

    def run_model(meta):
        calls["n"] += 1
        if fail_at and calls["n"] in fail_at:
            raise RuntimeError("planted failure")
        return forward(meta)

    engine.run_model = run_model
    while pending or engine.has_unfinished_requests():
        assert step < 2000, "the workload does not finish"
        if pending and step % arrive_every == 0:
            i, p = pending.pop(0)
            engine.add_request(f"r{i}", p, params)
        try:
            outs = engine.step()
        except RuntimeError as err:
            assert "planted failure" in str(err)
            failures += 1
            outs = []
        for out in outs:
            if out.finished:
                final[out.request_id] = out
        bm = engine.block_manager
        assert bm.invariants_ok(), bm.invariant_violations()
        step += 1
    assert failures == len(fail_at or ())
    return [final[f"r{i}"] for i in range(len(prompts))]


def assert_same_outputs(spec, plain):
    for a, b in zip(spec, plain):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
        assert [o.finish_reason for o in a.outputs] == [o.finish_reason for o in b.outputs]
        assert [o.stop_reason for o in a.outputs] == [o.stop_reason for o in b.outputs]
        for oa, ob in zip(a.outputs, b.outputs):
            assert (oa.logprobs is None) == (ob.logprobs is None)
            for ea, eb in zip(oa.logprobs or [], ob.logprobs or []):
                assert ea.keys() == eb.keys()
                assert all(abs(ea[t] - eb[t]) < 1e-4 for t in ea)


def assert_kept_and_rejected(engine):
    s = engine.stats()
    assert s["spec_decode_num_drafts"] > 0
    assert 0 < s["spec_decode_num_accepted_tokens"] < s["spec_decode_num_draft_tokens"], s
    assert sum(s["spec_decode_num_accepted_tokens_per_pos"]) == s["spec_decode_num_accepted_tokens"]


def assert_all_blocks_free(engine):
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and bm.usage()["blocks_used"] == 0 and not bm.sequence_ids()


def both(prompts, params, engine_kwargs, k, config=None, **run_kwargs):
    """The same workload with speculation off, then on: (plain outputs, spec outputs, spec engine);
    speculation must not take more steps, and fewer for one request whose proposals were kept
    (with several, the last to arrive may set the count)."""
    plain_engine = LLMEngine(model_of(), **engine_kwargs)
    plain = run(plain_engine, prompts, params, **run_kwargs)
    engine = LLMEngine(model_of(), speculative_config=config or ngram(k), **engine_kwargs)
    spec = run(engine, prompts, params, **run_kwargs)
    assert engine.stats()["steps"] <= plain_engine.stats()["steps"]
    if engine.stats()["spec_decode_num_accepted_tokens"] and len(prompts) == 1:
        assert engine.stats()["steps"] < plain_engine.stats()["steps"]
    return plain, spec, engine


@pytest.mark.parametrize("k", [1, 2, 5, 8])
def test_greedy_with_speculation_equals_without_and_generate(k):
    prompts = prompts_of([5, 17, 9, 30], seed=k)
    params = SamplingParams(max_tokens=40)
    plain, spec, engine = both(prompts, params, dict(num_blocks=96, block_size=4), k, arrive_every=3)
    assert_same_outputs(spec, plain)
    model = model_of()
    model.set_attn_implementation("sdpa")
    for p, o in zip(prompts, spec):  # and both equal transformers' generate (sdpa)
        ref = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             max_new_tokens=40, do_sample=False)[0, len(p):].tolist()
        assert o.outputs[0].token_ids == ref
    model.set_attn_implementation("minipaged")
    assert_kept_and_rejected(engine)
    assert_all_blocks_free(engine)


def test_sampled_outputs_with_every_control_equal_those_without():
    prompts = prompts_of([6, 13, 21], seed=3)
    params = SamplingParams(n=2, temperature=0.7, top_k=12, top_p=0.95, min_p=0.02, repetition_penalty=1.1,
                            frequency_penalty=0.1, presence_penalty=0.1, min_tokens=6, seed=7, max_tokens=30,
                            logprobs=2)
    plain, spec, engine = both(prompts, params, dict(num_blocks=96, block_size=4), 4)
    assert_same_outputs(spec, plain)
    assert engine.stats()["spec_decode_num_drafts"] > 0
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_chunked_prefill_and_prefix_hits(mode):
    system = prompts_of([12], seed=21)[0]
    prompts = prompts_of([3, 14, 7, 20, 5, 9], seed=22, prefix=system)
    max_tokens, block_size = 24, 4
    peak = sum(-(-(len(p) + max_tokens) // block_size) for p in prompts)
    kwargs = dict(num_blocks=peak // 2, block_size=block_size, max_num_seqs=8, max_num_batched_tokens=16,
                  preemption_mode=mode)
    plain, spec, engine = both(prompts, SamplingParams(max_tokens=max_tokens), kwargs, 6)
    assert_same_outputs(spec, plain)
    stats = engine.stats()
    assert stats["preemptions"] > 0 and stats["prefix_cache_hits"] > 0, stats
    assert_kept_and_rejected(engine)
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("fail_at", [(4,), (2, 7, 9)])
def test_failed_steps_roll_back_and_redo_the_same_tokens(fail_at):
    prompts = prompts_of([8, 15, 4], seed=31)
    params = SamplingParams(max_tokens=25, temperature=0.9, seed=3)
    plain, spec, engine = both(prompts, params, dict(num_blocks=64, block_size=4), 5, fail_at=fail_at)
    assert_same_outputs(spec, plain)
    assert engine.stats()["failed_steps"] == len(fail_at)
    assert_all_blocks_free(engine)


def test_max_tokens_and_stop_tokens_cut_at_the_exact_token():
    prompt = prompts_of([10], seed=41)[0]
    long = run(LLMEngine(model_of(), num_blocks=64, block_size=4), [prompt], SamplingParams(max_tokens=40))[0]
    tokens = long.outputs[0].token_ids
    stop = tokens[17]
    cases = [(SamplingParams(max_tokens=13), tokens[:13], "length"),
             (SamplingParams(max_tokens=40, stop_token_ids=[stop]), tokens[:tokens.index(stop) + 1], "stop"),
             # the stop token is masked at its first place: the output goes another way from there
             (SamplingParams(max_tokens=40, stop_token_ids=[stop], min_tokens=tokens.index(stop) + 1), None, None)]
    for params, expected, reason in cases:
        plain, spec, engine = both([prompt], params, dict(num_blocks=64, block_size=4), 8)
        assert_same_outputs(spec, plain)
        out = spec[0].outputs[0]
        if expected is not None:
            assert out.token_ids == expected and out.finish_reason == reason
        assert_all_blocks_free(engine)


def test_speculation_switches_itself_off_and_says_why(monkeypatch):
    prompts = prompts_of([4] * 10, seed=51)
    engine = LLMEngine(model_of(), num_blocks=128, block_size=4, speculative_config=ngram(3))
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=6))
    engine.step()  # ten prompts
    assert "prompt tokens" in engine.stats()["spec_decode_off_reason"]
    engine.step()  # ten decoding sequences
    assert "decoding sequences" in engine.stats()["spec_decode_off_reason"]
    drafts = engine.stats()["spec_decode_num_drafts"]
    assert drafts == 0
    while engine.has_unfinished_requests():
        engine.step()
    # a measured acceptance too low: off, and measured again every PROBE_EVERY steps
    monkeypatch.setattr(speculator_module, "MIN_ACCEPTANCE", 1.01)
    engine = LLMEngine(model_of(), num_blocks=128, block_size=4, speculative_config=ngram(3))
    engine.generate(prompts_of([5], seed=52), SamplingParams(max_tokens=40), use_tqdm=False)
    stats = engine.stats()
    assert "acceptance" in stats["spec_decode_off_reason"]
    assert 1 <= stats["spec_decode_num_drafts"] <= 3, stats  # the first draft, then probes only


@pytest.mark.parametrize("config, match", [
    ({"method": "ngram", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1}, "draft_tensor_parallel_size"),
    ({"method": "draft_model", "model": "/nonexistent/draft", "num_speculative_tokens": 3}, "speculative_config.model"),
    ({"method": "draft_model", "num_speculative_tokens": 3}, "model"),
    ({"method": "draft_model", "model": "x", "num_speculative_tokens": 3, "prompt_lookup_max": 2}, "prompt_lookup_max"),
    ({"method": "eagle", "num_speculative_tokens": 3}, "method"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ("{not json", "JSON"),
])
def test_bad_speculative_configs_are_refused(config, match):
    with pytest.raises(ValueError, match=match):
        LLMEngine(model_of(), num_blocks=16, block_size=4, speculative_config=config)
    engine = LLMEngine(model_of(), num_blocks=16, block_size=4,
                       speculative_config='{"method": "ngram", "num_speculative_tokens": 2}')
    assert engine.speculative_config.prompt_lookup_max == 4


def test_stop_strings_end_at_the_token_that_completes_them():
    pytest.importorskip("tokenizers")
    from minipaged_ops.tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    model = tiny_model("qwen3", seed=4, vocab=len(tokenizer))
    prompt = tokenizer.encode("the cache is the cache is the cache is the", add_special_tokens=False)
    plain_engine = LLMEngine(model, num_blocks=64, block_size=4, tokenizer=tokenizer)
    plain = plain_engine.generate([prompt], SamplingParams(max_tokens=30), use_tqdm=False)[0].outputs[0]
    stop = plain.text[len(plain.text) // 2:len(plain.text) // 2 + 3]
    engine = LLMEngine(model, num_blocks=64, block_size=4, tokenizer=tokenizer, speculative_config=ngram(6))
    for include in (False, True):
        params = SamplingParams(max_tokens=30, stop=[stop], include_stop_str_in_output=include)
        want = plain_engine.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        got = engine.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert want.finish_reason == "stop" and want.stop_reason == stop
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
            want.token_ids, want.text, want.finish_reason, want.stop_reason)
    assert engine.stats()["spec_decode_num_drafts"] > 0
    assert_all_blocks_free(engine)


def test_the_server_flag_reaches_the_engine_and_metrics_count_under_vllm_names():
    pytest.importorskip("prometheus_client")
    from minipaged_ops.integration.server.cli import engine_args, parser
    from minipaged_ops.integration.server.metrics import ServerMetrics

    flag = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}'
    kwargs = engine_args(parser("serve").parse_args(["--model", "m", "--speculative-config", flag]))
    assert kwargs["speculative_config"] == flag
    assert "speculative_config" not in engine_args(parser("serve").parse_args(["--model", "m"]))
    engine = LLMEngine(model_of(), num_blocks=64, block_size=4, speculative_config=kwargs["speculative_config"])
    engine.generate(prompts_of([6, 9], seed=61), SamplingParams(max_tokens=30), use_tqdm=False)
    stats = engine.stats()
    metrics = ServerMetrics("tiny")
    metrics.update_from_stats(stats)
    text = metrics.exposition().decode()
    for key in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"):
        assert f'minipaged:{key}_total{{model_name="tiny"}} {float(stats[key])}' in text
    for pos, count in enumerate(stats["spec_decode_num_accepted_tokens_per_pos"]):
        assert (f'minipaged:spec_decode_num_accepted_tokens_per_pos_total{{model_name="tiny",position="{pos}"}} '
                f'{float(count)}') in text
    assert stats["spec_decode_num_drafts"] > 0
    assert stats["spec_decode_mean_acceptance_length"] == 1 + stats["spec_decode_num_accepted_tokens"] / stats[
        "spec_decode_num_drafts"]
    plain = ServerMetrics("tiny")
    plain.update_from_stats(LLMEngine(model_of(), num_blocks=64, block_size=4).stats())
    assert b"spec_decode" not in plain.exposition()  # only with speculation on


def test_structured_outputs_decode_one_token_at_a_time_under_their_constraint():
    """A request with structured outputs speculates under its constraint (only proposals its
    grammar allows, each position verified under its mask: test_structured_outputs.py) and keeps
    it; an unconstrained one speculates beside it."""
    pytest.importorskip("xgrammar")
    pytest.importorskip("tokenizers")
    from minipaged_ops.integration.engine import StructuredOutputsParams
    from minipaged_ops.tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    model = tiny_model("qwen3", seed=4, vocab=len(tokenizer))
    prompt = tokenizer.encode("the cache is the cache is the cache is the", add_special_tokens=False)
    constrained = SamplingParams(max_tokens=30, structured_outputs=StructuredOutputsParams(regex="(ab|cd)+x"))
    free = SamplingParams(max_tokens=30)
    outs = []
    for config in (None, ngram(4)):
        engine = LLMEngine(model, num_blocks=64, block_size=4, tokenizer=tokenizer, speculative_config=config)
        outs.append(engine.generate([prompt, prompt], [constrained, free], use_tqdm=False))
    (plain_c, plain_f), (spec_c, spec_f) = outs
    assert spec_c.outputs[0].token_ids == plain_c.outputs[0].token_ids
    assert spec_f.outputs[0].token_ids == plain_f.outputs[0].token_ids
    assert re.fullmatch("(ab|cd)+x?", spec_c.outputs[0].text), spec_c.outputs[0].text
    assert engine.stats()["spec_decode_num_drafts"] > 0  # the free request speculated
    assert_all_blocks_free(engine)


# ------------------------------------------------------------------ draft model


@pytest.mark.parametrize("k", [1, 3, 8])
def test_draft_model_greedy_equals_without(k):
    prompts = prompts_of([5, 17, 9, 30], seed=k + 40)
    plain, spec, engine = both(prompts, SamplingParams(max_tokens=30), dict(num_blocks=96, block_size=4), k,
                               config=draft(k), arrive_every=3)
    assert_same_outputs(spec, plain)
    assert_kept_and_rejected(engine)
    assert_all_blocks_free(engine)


def test_a_draft_that_is_the_target_has_every_proposal_kept():
    prompts = prompts_of([7, 12], seed=45)
    plain, spec, engine = both(prompts, SamplingParams(max_tokens=24), dict(num_blocks=64, block_size=4), 4,
                               config=draft(4, seed=0))
    assert_same_outputs(spec, plain)
    s = engine.stats()
    assert s["spec_decode_num_drafts"] > 0 and s["spec_decode_num_accepted_tokens"] == s["spec_decode_num_draft_tokens"]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_draft_model_sampled_under_preemption_and_failed_steps(mode):
    """The draft's cache follows each sequence through preemption, rolled-back steps and rejected
    proposals (cut back to what the sequence holds), and its pool empties when the sequences end."""
    system = prompts_of([12], seed=46)[0]
    prompts = prompts_of([3, 14, 7, 20, 5], seed=47, prefix=system)
    max_tokens, block_size = 20, 4
    peak = sum(-(-(len(p) + max_tokens) // block_size) for p in prompts)
    kwargs = dict(num_blocks=peak // 2, block_size=block_size, max_num_seqs=8, max_num_batched_tokens=16,
                  preemption_mode=mode)
    params = SamplingParams(temperature=0.8, top_k=20, seed=5, max_tokens=max_tokens)
    plain, spec, engine = both(prompts, params, kwargs, 3, config=draft(3, seed=2), fail_at=(5, 11))
    assert_same_outputs(spec, plain)
    assert engine.stats()["preemptions"] > 0 and engine.stats()["spec_decode_num_drafts"] > 0
    assert_all_blocks_free(engine)
    engine.step()  # nothing runs: the draft lets go of the last sequences it held
    pool = engine.speculator.proposer.pool.block_manager
    assert pool.num_free_blocks == pool.num_blocks


def test_a_draft_of_another_vocabulary_is_refused():
    other = tiny_model("qwen3", vocab=VOCAB + 1, seed=3, hidden=32, heads=2, kv_heads=1, head_dim=16, layers=1)
    with pytest.raises(ValueError, match="vocabulary"):
        LLMEngine(model_of(), num_blocks=16, block_size=4,
                  speculative_config={"method": "draft_model", "model": other, "num_speculative_tokens": 2})


def test_the_draft_proposes_its_own_greedy_continuation_after_any_edit():
    """DraftModelProposer against the draft's own generate() (sdpa) on the same tokens, as the
    sequence grows by kept proposals, is cut back by rejections and rollbacks, and restarts."""
    from minipaged_ops.integration.engine.speculative.draft_model import DraftModelProposer

    model = copy.deepcopy(model_of())
    proposer = DraftModelProposer(model, 4, num_blocks=32, block_size=4)

    def expected(tokens, k):
        model.set_attn_implementation("sdpa")
        out = model.generate(torch.tensor([tokens]), attention_mask=torch.ones(1, len(tokens), dtype=torch.long),
                             max_new_tokens=k, do_sample=False, min_new_tokens=k)[0, len(tokens):].tolist()
        model.set_attn_implementation("minipaged")
        return out

    rng = random.Random(48)
    tokens = prompts_of([9], seed=48)[0]
    for step in range(12):
        got = proposer.propose("s", tokens, 4)
        assert got == expected(tokens, 4), step
        kept = rng.randrange(0, 5)  # some proposals kept, then a token of the target's own
        tokens = tokens + got[:kept] + [rng.randrange(3, VOCAB)]
        if step == 6:
            tokens = tokens[:-5]  # a rolled-back step / recompute: shorter than what the draft holds
    proposer.retain(set())
    assert proposer.pool.block_manager.num_free_blocks == 32
