"""The serving wing of LLMEngine: a step that is all or nothing, progress under any pool that
holds the largest request, a thread-safe front door, priorities and the bookkeeping around them.

Every workload is compared with a clean run (or transformers' generate on each prompt alone):
a failure, a preemption or another thread must change no request's output.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

pytest.importorskip("transformers")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from minipaged_ops.integration import LLMEngine, SamplingParams  # noqa: E402
from minipaged_ops.integration.engine import llm_engine, step_runner  # noqa: E402
from test_engine import VOCAB, assert_all_blocks_free, engine_model, prompts_of, reference  # noqa: E402


def drain(engine, max_steps=2000, on_error=None, check=True):
    """Step until nothing is unfinished; returns {request_id: final RequestOutput}. Exceptions of
    a step go to ``on_error`` (re-raised without one)."""
    final = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return final
        try:
            outs = engine.step()
        except BaseException as err:  # noqa: BLE001 - a planted failure, Ctrl-C included
            if on_error is None:
                raise
            on_error(err)
            outs = []
        if check:
            assert engine.block_manager.invariants_ok(), engine.block_manager.invariant_violations()
        for out in outs:
            if out.finished:
                assert out.request_id not in final, f"{out.request_id} reported finished twice"
                final[out.request_id] = out
    raise AssertionError(f"not finished after {max_steps} steps: {engine.stats()}")


def tokens(final):
    return {rid: [o.token_ids for o in out.outputs] for rid, out in final.items()}


def workload(engine, seed=0):
    """Greedy and seeded sampled requests (n=2 among them), sharing a prefix, in a small pool."""
    system = prompts_of([12], seed=seed + 100)[0]
    prompts = prompts_of([5, 17, 9, 3, 11], seed=seed, prefix=system)
    params = [SamplingParams(max_tokens=9), SamplingParams(max_tokens=7, temperature=0.9, top_k=20, seed=5),
              SamplingParams(max_tokens=8, n=2, temperature=1.0), SamplingParams(max_tokens=6, logprobs=2),
              SamplingParams(max_tokens=10, temperature=0.7, top_p=0.9)]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"w{i}", p, sp)
    return prompts


def small_engine(**kwargs):
    kwargs = {"num_blocks": 14, "block_size": 4, "max_num_seqs": 4, "max_num_batched_tokens": 16, "seed": 7, **kwargs}
    return LLMEngine(engine_model(), **kwargs)


# ---------------------------------------------------------------- a step is all or nothing


# every place a step can fail: attribute paths from the engine instance
FAILURE_POINTS = ["scheduler.schedule", "pool.apply_copies", "run_model", "step_runner.sampler.__call__",
                  "step_runner.record_prompt_logprobs", "step_runner.accept", "scheduler.finish", "step_runner.fork",
                  "request_table.complete", "request_table.new_sequence", "scheduler.add"]


def attribute(obj, path):
    """``obj.<path>`` for a dotted ``path`` ("" is ``obj``)."""
    for part in filter(None, path.split(".")):
        obj = getattr(obj, part)
    return obj


def plant_one_failure(monkeypatch, engine, point, at_call):
    """Make ``engine.<point>`` raise KeyboardInterrupt (as Ctrl-C would) after doing its work, on
    its ``at_call``-th call; returns the call counter."""
    owner_path, _, name = point.rpartition(".")
    owner = attribute(engine, owner_path)
    original = getattr(owner, name)
    calls = {"n": 0}

    def failing(*args, **kwargs):
        calls["n"] += 1
        result = original(*args, **kwargs)  # the work is done (slots reserved, K/V written, ...)
        if calls["n"] == at_call:
            raise KeyboardInterrupt(f"planted at {point}")
        return result

    if name == "__call__":  # the sampler object: stand a failing one in for it
        class FailingSampler:
            def __call__(self, *args, **kwargs):
                return failing(*args, **kwargs)

            def __getattr__(self, attr):
                return getattr(owner, attr)

        holder_path, _, attr = owner_path.rpartition(".")
        monkeypatch.setattr(attribute(engine, holder_path), attr, FailingSampler())
    else:
        monkeypatch.setattr(owner, name, failing)
    return calls


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("point", FAILURE_POINTS)
def test_a_one_shot_failure_anywhere_in_a_step_changes_no_output(point, mode, monkeypatch):
    clean = small_engine(preemption_mode=mode)
    workload(clean)
    expected = tokens(drain(clean))
    for at_call in (1, 3):
        engine = small_engine(preemption_mode=mode)
        workload(engine)
        calls = plant_one_failure(monkeypatch, engine, point, at_call)
        failures = []
        final = drain(engine, on_error=failures.append)
        monkeypatch.undo()
        assert calls["n"] >= 1, f"{point} is never called: a failure planted there tests nothing"
        if calls["n"] < at_call:
            continue  # this workload never reaches that call
        assert len(failures) == 1 and "planted" in str(failures[0])
        assert tokens(final) == expected, (point, at_call)
        assert all(o.finish_reason in ("stop", "length") for out in final.values() for o in out.outputs)
        assert_all_blocks_free(engine)
        assert engine.stats()["failed_steps"] == 1


def test_nan_logits_under_sampling_roll_back_and_the_run_equals_a_clean_one(monkeypatch):
    clean = small_engine()
    workload(clean)
    expected = tokens(drain(clean))
    engine = small_engine()
    workload(engine)
    forward, calls = engine.run_model, {"n": 0}

    def nan_once(meta):
        logits = forward(meta)
        calls["n"] += 1
        return logits.fill_(float("nan")) if calls["n"] == 2 else logits

    monkeypatch.setattr(engine, "run_model", nan_once)
    failures = []
    assert tokens(drain(engine, on_error=failures.append)) == expected
    assert len(failures) == 1
    assert_all_blocks_free(engine)


def test_a_request_that_always_fails_ends_with_error_and_the_others_equal_their_solo_runs(monkeypatch):
    poison = 7
    prompts = prompts_of([6, 9, 4, 12], seed=21)
    prompts = [[t if t != poison else poison + 1 for t in p] for p in prompts]
    bad = prompts_of([8], seed=22)[0] + [poison]
    engine = LLMEngine(engine_model(), num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    forward = engine.run_model

    def fails_on_poison(meta):
        if (meta.input_ids == poison).any():
            raise RuntimeError("planted: this request always fails")
        return forward(meta)

    monkeypatch.setattr(engine, "run_model", fails_on_poison)
    for i, p in enumerate(prompts[:2]):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=6))
    engine.add_request("bad", bad, SamplingParams(max_tokens=6))
    for i, p in enumerate(prompts[2:], 2):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=6))
    failures = []
    final = drain(engine, on_error=failures.append)
    assert final["bad"].outputs[0].finish_reason == "error" and final["bad"].finished
    assert len(failures) == step_runner.MAX_FAILURES
    for i, p in enumerate(prompts):
        assert final[f"r{i}"].outputs[0].token_ids == reference(p, 6), i
    stats = engine.stats()
    assert stats["errored"] == 1 and stats["finished"] == 4
    assert_all_blocks_free(engine)


def test_a_request_whose_sequence_cannot_be_made_ends_with_error_and_the_others_run(monkeypatch):
    """Taking requests in at a step boundary: one whose sequence raises (say its detokenizer on the
    prompt) ends at once with "error"; the requests queued after it are not lost."""
    prompts = prompts_of([6, 9, 4, 12], seed=23)
    engine = LLMEngine(engine_model(), num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    make = engine.request_table.new_sequence

    def fails_for_bad(req, index, token_ids):
        if req.request_id == "bad":
            raise RuntimeError("planted: this prompt cannot be detokenized")
        return make(req, index, token_ids)

    monkeypatch.setattr(engine.request_table, "new_sequence", fails_for_bad)
    engine.add_request("r0", prompts[0], SamplingParams(max_tokens=5))
    engine.add_request("bad", prompts[1], SamplingParams(max_tokens=5, n=2))
    for i, p in enumerate(prompts[2:], 2):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=5))
    final = drain(engine)  # no step raises: the failure is the request's own
    assert final["bad"].finished and [o.finish_reason for o in final["bad"].outputs] == ["error", "error"]
    assert [o.token_ids for o in final["bad"].outputs] == [[], []]
    for i in (0, 2, 3):
        assert final[f"r{i}"].outputs[0].token_ids == reference(prompts[i], 5), i
    stats = engine.stats()
    assert stats["errored"] == 1 and stats["finished"] == 3 and stats["failed_steps"] == 0
    assert_all_blocks_free(engine)
    engine.add_request("bad", prompts[1], SamplingParams(max_tokens=5))  # its id is free again
    monkeypatch.undo()
    assert drain(engine)["bad"].outputs[0].token_ids == reference(prompts[1], 5)


# ---------------------------------------------------------------- progress


def test_swap_preemption_finishes_where_it_used_to_livelock():
    """4 greedy requests, prompts of 24-28 tokens, 24 new tokens, blocks of 16, pools of 8-10
    blocks: swap used to preempt hundreds of times and never finish."""
    prompts = prompts_of([24, 26, 27, 28], seed=31)
    for num_blocks in (8, 9, 10):
        for mode in ("swap", "recompute"):
            engine = LLMEngine(engine_model(), num_blocks=num_blocks, block_size=16, max_num_seqs=4,
                               max_num_batched_tokens=64, preemption_mode=mode)
            for i, p in enumerate(prompts):
                engine.add_request(f"r{i}", p, SamplingParams(max_tokens=24))
            final = drain(engine, max_steps=300)
            for i, p in enumerate(prompts):
                assert final[f"r{i}"].outputs[0].token_ids == reference(p, 24), (num_blocks, mode, i)
            assert engine.stats()["steps"] < 150, (num_blocks, mode, engine.stats()["steps"])
            assert_all_blocks_free(engine)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_any_pool_that_holds_the_largest_request_finishes_every_workload(data):
    block_size = data.draw(st.sampled_from([4, 8]), "block_size")
    lengths = data.draw(st.lists(st.integers(2, 20), min_size=2, max_size=6), "prompt lengths")
    max_tokens = data.draw(st.lists(st.integers(1, 12), min_size=len(lengths), max_size=len(lengths)), "max_tokens")
    largest = max(-(-(n + m) // block_size) for n, m in zip(lengths, max_tokens))
    peak = sum(-(-(n + m) // block_size) for n, m in zip(lengths, max_tokens))
    num_blocks = data.draw(st.integers(largest, max(largest, peak)), "num_blocks")
    mode = data.draw(st.sampled_from(["recompute", "swap"]), "mode")
    max_num_seqs = data.draw(st.integers(1, 4), "max_num_seqs")
    prompts = prompts_of(lengths, seed=data.draw(st.integers(0, 1000), "seed"))
    engine = LLMEngine(engine_model(), num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=data.draw(st.sampled_from([max_num_seqs, 8, 32]), "budget"),
                       preemption_mode=mode, enable_prefix_caching=data.draw(st.booleans(), "prefix caching"))
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=m))
    final = drain(engine, max_steps=40 * sum(lengths) + 40 * sum(max_tokens))
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        assert final[f"r{i}"].outputs[0].token_ids == reference(p, m)
    assert_all_blocks_free(engine)


# ---------------------------------------------------------------- the front door


def test_a_thread_adding_and_aborting_while_another_steps():
    model = engine_model("qwen3", hidden=32, layers=1, heads=2, kv_heads=1, head_dim=16)
    engine = LLMEngine(model, num_blocks=48, block_size=4, max_num_seqs=12, max_num_batched_tokens=48,
                       preemption_mode="swap")
    total, stop, errors, final, steps = 300, threading.Event(), [], {}, [0]

    def stepper():
        try:
            while not stop.is_set():
                for out in engine.step():
                    if out.finished:
                        assert out.request_id not in final, out.request_id
                        final[out.request_id] = out
                assert engine.block_manager.invariants_ok(), engine.block_manager.invariant_violations()
                steps[0] += 1
                if not engine.has_unfinished_requests():
                    time.sleep(0.001)
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            errors.append(err)

    thread = threading.Thread(target=stepper, daemon=True)
    thread.start()
    rng = random.Random(3)
    live = []
    for i in range(total):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 16))]
        params = SamplingParams(max_tokens=rng.randint(1, 8), n=rng.choice([1, 1, 2]), temperature=rng.choice([0.0, 1.0]))
        engine.add_request(f"t{i}", prompt, params, priority=rng.randint(0, 3))
        live.append(f"t{i}")
        if rng.random() < 0.2:
            engine.abort_request(live.pop(rng.randrange(len(live))))
        if rng.random() < 0.3:
            engine.stats()
        time.sleep(rng.random() * 0.002)
    deadline = time.monotonic() + 120
    while engine.has_unfinished_requests() and time.monotonic() < deadline and not errors:
        time.sleep(0.01)
    stop.set()
    thread.join(timeout=30)
    assert not thread.is_alive() and not errors, errors
    assert sorted(final) == sorted(f"t{i}" for i in range(total))
    assert engine.stats()["aborted"] + engine.stats()["finished"] == total
    assert_all_blocks_free(engine)


def test_generate_keeps_other_requests_outputs_for_the_next_step():
    engine = LLMEngine(engine_model(), num_blocks=64, block_size=4)
    bg = prompts_of([7], seed=41)[0]
    engine.add_request("bg", bg, SamplingParams(max_tokens=3))
    outs = engine.generate(prompts_of([5, 8], seed=42), SamplingParams(max_tokens=12), use_tqdm=False)
    assert len(outs) == 2 and all(o.finished for o in outs)
    assert engine.has_unfinished_requests()  # bg's final output is kept, not yet returned
    kept = [o for o in engine.step() if o.request_id == "bg"]
    assert kept and kept[-1].finished and kept[-1].outputs[0].token_ids == reference(bg, 3)
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("fails_at", ["bar start", "step", "bar update", "bar close"])
def test_a_generate_that_raises_leaves_no_request_running_and_no_id_taken(fails_at, monkeypatch):
    """generate() raising after its prompts are queued: its progress bar failing to start (stderr
    closed, Ctrl-C while tqdm imports), a step interrupted, the bar failing to count the first of
    two prompts that finish in the same step, or to close once every output is in. Its requests are aborted or released, never left running for a step() that
    never asked for them, or holding their ids for good; the engine then runs as before."""
    engine = LLMEngine(engine_model(), num_blocks=64, block_size=4)
    prompts = prompts_of([5, 7], seed=91)

    class Bar:
        def update(self, n):
            if fails_at == "bar update":
                raise ValueError("planted: I/O operation on closed file")

        def close(self):
            if fails_at == "bar close":
                raise ValueError("planted: I/O operation on closed file")

    def progress(total, enabled):
        if fails_at == "bar start":
            raise KeyboardInterrupt("planted")
        return Bar()

    monkeypatch.setattr(llm_engine, "_progress", progress)
    if fails_at == "step":
        plant_one_failure(monkeypatch, engine, "run_model", 2)
    with pytest.raises((KeyboardInterrupt, ValueError), match="planted"):
        engine.generate(prompts, SamplingParams(max_tokens=4))
    monkeypatch.undo()
    assert drain(engine, max_steps=50) == {}  # nothing reported to a step() that never asked
    assert not engine.has_unfinished_requests()
    assert_all_blocks_free(engine)
    stats = engine.stats()
    assert (stats["finished"], stats["aborted"]) == ((2, 0) if fails_at in ("bar update", "bar close") else (0, 2))
    outs = engine.generate(prompts, SamplingParams(max_tokens=4), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [reference(p, 4) for p in prompts]


@pytest.mark.parametrize("other", ["generate", "step"])
def test_generate_gets_its_outputs_when_another_thread_steps_them(other, monkeypatch):
    """generate() in one thread ("mine") while another thread (its own generate(), or a step()
    loop over requests it added) runs every step, the one that finishes mine's requests included
    (mine is held before its first step until the other is done). Each caller gets exactly its own
    outputs, equal to their solo runs; none waits for good for an output the other's step took.
    Bounded: after the joins a stop flag makes every step raise, ending a generate() stuck in its loop."""
    engine = LLMEngine(engine_model(), num_blocks=64, block_size=4, max_num_seqs=8)
    mine, theirs = prompts_of([5, 9, 6], seed=95), prompts_of([7, 4, 8], seed=96)
    run, stop, mine_queued, theirs_done = engine.step_runner.run, threading.Event(), threading.Event(), threading.Event()

    def stoppable(run_model):
        if stop.is_set():
            raise KeyboardInterrupt("stopped by the test")
        return run(run_model)

    def progress(total, enabled):  # generate() calls it once its prompts are queued
        if threading.current_thread().name == "mine":
            mine_queued.set()
            theirs_done.wait(20)

    engine.step_runner.run = stoppable
    monkeypatch.setattr(llm_engine, "_progress", progress)
    got, errors = {}, []

    def generate(name, prompts):
        try:
            outs = engine.generate(prompts, SamplingParams(max_tokens=6))
            got[name] = [o.outputs[0].token_ids for o in outs]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            if name == "theirs":
                theirs_done.set()

    def step_loop():
        for i, p in enumerate(theirs):
            engine.add_request(f"t{i}", p, SamplingParams(max_tokens=6))
        final = {}
        try:
            for _ in range(100):
                final.update((o.request_id, o) for o in engine.step() if o.finished)
                if len(final) == len(theirs):
                    got["theirs"] = [final[f"t{i}"].outputs[0].token_ids for i in range(len(theirs))]
                    break
        finally:
            theirs_done.set()

    threads = [threading.Thread(target=generate, args=("mine", mine), name="mine", daemon=True),
               threading.Thread(target=generate, args=("theirs", theirs), daemon=True) if other == "generate"
               else threading.Thread(target=step_loop, daemon=True)]
    threads[0].start()
    assert mine_queued.wait(20)
    threads[1].start()
    for t in threads:
        t.join(20)
    stop.set()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors  # main: "mine" waited for outputs the other thread's steps took
    assert got == {"mine": [reference(p, 6) for p in mine], "theirs": [reference(p, 6) for p in theirs]}
    assert not engine.has_unfinished_requests()
    assert_all_blocks_free(engine)


def test_construction_and_request_errors():
    model = engine_model()
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(4\) must be >= max_num_seqs \(8\)"):
        LLMEngine(model, num_blocks=8, max_num_seqs=8, max_num_batched_tokens=4)
    with pytest.raises(ValueError, match="scheduling_policy"):
        LLMEngine(model, num_blocks=8, scheduling_policy="lifo")
    engine = LLMEngine(model, num_blocks=8)
    with pytest.raises(ValueError, match="priority"):
        engine.add_request("a", [3, 4], SamplingParams(), priority=1.5)
    with pytest.raises(ValueError, match="prompt_logprobs=21 exceeds the engine's max_logprobs=20"):
        engine.add_request("a", [3, 4], SamplingParams(prompt_logprobs=21))  # the engine's cap (max_logprobs)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    assert not engine.has_unfinished_requests()


def test_unseeded_requests_each_draw_from_their_own_generator_of_the_engine_seed():
    prompt = prompts_of([6], seed=51)[0]
    params = SamplingParams(max_tokens=12, temperature=1.0)

    def run(seed):
        engine = LLMEngine(engine_model(), num_blocks=64, block_size=4, seed=seed)
        return [o.outputs[0].token_ids for o in engine.generate([prompt, prompt], params, use_tqdm=False)]

    a, b = run(1), run(1)
    assert a == b  # the engine seed makes a run reproducible
    assert a[0] != a[1]  # ... and the two requests draw apart
    assert run(2) != a


# ---------------------------------------------------------------- priorities


def test_priorities_order_admission_and_preemption():
    model = engine_model()
    engine = LLMEngine(model, num_blocks=64, block_size=4, max_num_seqs=1, max_num_batched_tokens=64,
                       scheduling_policy="priority")
    for rid, priority in (("low", 5), ("high", 1), ("mid", 3)):
        engine.add_request(rid, prompts_of([5], seed=priority)[0], SamplingParams(max_tokens=2), priority=priority)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["high", "mid", "low"]
    # under pressure the lowest-priority running request gives way, whatever its age
    prompts = prompts_of([14, 14, 14], seed=61)
    engine = LLMEngine(model, num_blocks=12, block_size=4, max_num_seqs=3, max_num_batched_tokens=64,
                       scheduling_policy="priority")
    for rid, p, priority in zip(("old-low", "mid", "new-high"), prompts, (9, 5, 0)):
        engine.add_request(rid, p, SamplingParams(max_tokens=12), priority=priority)
    final = drain(engine)
    pre = {rid: out.metrics.num_preemptions for rid, out in final.items()}
    assert pre["new-high"] == 0 and pre["old-low"] > 0, pre
    for rid, p in zip(("old-low", "mid", "new-high"), prompts):
        assert final[rid].outputs[0].token_ids == reference(p, 12)


# ---------------------------------------------------------------- the report


def test_stats_count_finished_aborted_and_errored_apart_over_a_window():
    engine = LLMEngine(engine_model(), num_blocks=64, block_size=4)
    engine.generate(prompts_of([5, 6], seed=71), SamplingParams(max_tokens=3), use_tqdm=False)
    engine.add_request("gone", prompts_of([5], seed=72)[0], SamplingParams(max_tokens=30))
    engine.step()
    engine.abort_request("gone")
    drain(engine)
    stats = engine.stats()
    assert (stats["finished"], stats["aborted"], stats["errored"]) == (2, 1, 0)
    assert stats["ttft_s"]["p50"] is not None and stats["e2e_latency_s"]["p50"] is not None
    time.sleep(0.05)
    recent = engine.stats(window_s=0.01)
    assert (recent["finished"], recent["aborted"]) == (0, 0) and recent["ttft_s"]["p50"] is None
    assert engine.stats(window_s=60)["finished"] == 2


def test_prompt_logprobs_equal_a_forward_log_softmax_even_on_a_prefix_hit():
    model = engine_model()
    system = prompts_of([16], seed=81)[0]
    prompts = prompts_of([5, 7], seed=82, prefix=system)
    engine = LLMEngine(model, num_blocks=64, block_size=4, max_num_batched_tokens=8, max_num_seqs=4)
    engine.generate([prompts[0]], SamplingParams(max_tokens=2), use_tqdm=False)  # fills the prefix cache
    out = engine.generate([prompts[1]], SamplingParams(max_tokens=2, prompt_logprobs=3), use_tqdm=False)[0]
    assert engine.stats()["prefix_cache_hits"] > 0
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        ref = model(torch.tensor([prompts[1]])).logits[0].double().log_softmax(-1)
    model.set_attn_implementation("minipaged")
    got = out.prompt_logprobs
    assert got[0] is None and len(got) == len(prompts[1])
    for pos in range(1, len(prompts[1])):
        entry, token = got[pos], prompts[1][pos]
        top = ref[pos - 1].topk(3).indices.tolist()
        assert set(entry) == set(top) | {token}
        for t, lp in entry.items():
            assert abs(lp - float(ref[pos - 1, t])) < 1e-4, (pos, t)
