"""Faults around a step's edges: an interrupt after a step has committed (its outputs must reach
their callers all the same), and a failure inside the rollback of a failed step (the engine must
stop, saying why, and wake everyone who waits on it, rather than run on half-restored).

Every wait is bounded; a test that would hang on a broken engine fails instead.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

pytest.importorskip("transformers")

from minipaged_ops.integration import LLMEngine, SamplingParams  # noqa: E402
from minipaged_ops.integration.engine.async_engine import AsyncLLMEngine, EngineDeadError  # noqa: E402
from minipaged_ops.tiny import tiny_tokenizer  # noqa: E402
from test_engine import assert_all_blocks_free, engine_model, prompts_of, reference  # noqa: E402
from test_engine_serving import attribute, drain, plant_one_failure, small_engine, tokens, workload  # noqa: E402

# ---------------------------------------------------------------- an interrupt after the commit

# called once a step's tokens are accepted (the first: with its outputs posted, inside the step;
# the second: returning them), and, for the first, where a request ended outside a step is reported
COMMITTED_POINTS = ["request_table.report", "step_runner.run"]


def workload_with_an_abort(engine):
    workload(engine)
    engine.add_request("gone", prompts_of([6], seed=9)[0], SamplingParams(max_tokens=20))
    engine.abort_request("gone")  # ended (and reported) by the first step's boundary


@pytest.mark.parametrize("point", COMMITTED_POINTS)
def test_an_interrupt_after_a_step_commits_loses_no_output(point, monkeypatch):
    """Ctrl-C landing after a step has committed, at every step of a workload in turn: the step
    is not undone (its outputs are owed), the interrupt reaches the caller, and the next step()
    hands out what the interrupted one made. Every request is reported finished exactly once,
    with the tokens of a clean run."""
    clean = small_engine()
    workload_with_an_abort(clean)
    expected = tokens(drain(clean))
    num_steps = clean.stats()["steps"]
    for at_call in range(1, num_steps + 2):
        engine = small_engine()
        workload_with_an_abort(engine)
        calls = plant_one_failure(monkeypatch, engine, point, at_call)
        failures = []
        final = drain(engine, max_steps=200, on_error=failures.append)  # main: "not finished after 200 steps"
        monkeypatch.undo()
        assert calls["n"] >= 1, f"{point} is never called: a failure planted there tests nothing"
        if calls["n"] < at_call:
            break
        assert len(failures) == 1 and "planted" in str(failures[0]), failures
        assert tokens(final) == expected, (point, at_call)
        assert final["gone"].outputs[0].finish_reason == "abort"
        stats = engine.stats()
        assert (stats["finished"], stats["aborted"], stats["steps"]) == (5, 1, num_steps), (at_call, stats)
        assert_all_blocks_free(engine)
    assert at_call > num_steps  # every step of the workload was interrupted once


@pytest.mark.parametrize("point", COMMITTED_POINTS)
def test_an_interrupt_after_a_step_of_generate_commits_loses_no_output(point, monkeypatch):
    """generate() interrupted after one of its steps committed, at each step in turn, beside a
    request added with add_request: that request's outputs are step()'s, its final one exactly
    once; generate()'s requests are ended (finished or aborted), never reported to step(), their
    ids free; nothing is left running."""
    bg = prompts_of([7], seed=41)[0]
    prompts = prompts_of([5, 8], seed=42)
    for at_call in range(1, 30):
        engine = LLMEngine(engine_model(), num_blocks=64, block_size=4)
        engine.add_request("bg", bg, SamplingParams(max_tokens=4))
        calls = plant_one_failure(monkeypatch, engine, point, at_call)
        try:
            engine.generate(prompts, SamplingParams(max_tokens=9), use_tqdm=False)
            interrupted = False
        except KeyboardInterrupt as e:
            assert "planted" in str(e)
            interrupted = True
        monkeypatch.undo()
        final = drain(engine, max_steps=50)  # main: "not finished after 50 steps" (an output was lost)
        assert list(final) == ["bg"], (at_call, final)
        assert final["bg"].outputs[0].token_ids == reference(bg, 4)
        assert not engine.has_unfinished_requests()
        assert_all_blocks_free(engine)
        if not interrupted:
            assert calls["n"] < at_call
            break
        stats = engine.stats()
        assert stats["finished"] + stats["aborted"] == 3 and stats["errored"] == 0, (at_call, stats)
        outs = engine.generate(prompts, SamplingParams(max_tokens=9), use_tqdm=False)  # ids free, engine fine
        assert [o.outputs[0].token_ids for o in outs] == [reference(p, 9) for p in prompts]
    else:
        raise AssertionError("generate() never finished: the planted interrupt came at every step")


# ---------------------------------------------------------------- a failure inside a rollback

# what restoring a failed step calls (StepSnapshot.restore): requeueing its sequences (which
# discards them first), replaying a detokenizer over the tokens a sequence keeps
ROLLBACK_POINTS = ["scheduler.requeue", "scheduler.discard", "request_table.replay_detokenizer"]
LIMIT = 60  # seconds any one wait may take


def plant_in_rollback(monkeypatch, engine, point):
    """The engine's third accepted token raises RuntimeError (after its work: the token is in its
    sequence), and ``engine.<point>`` raises RuntimeError (after its work) the first time it is
    called while that step is rolled back. Returns what fired."""
    fired, rolling_back = [], []
    accept, roll_back = engine.step_runner.accept, engine.step_runner.roll_back
    owner_path, _, name = point.rpartition(".")
    owner = attribute(engine, owner_path)
    original = getattr(owner, name)

    def failing_accept(*args):
        accept(*args)
        fired.append("step")
        if len(fired) == 3:
            raise RuntimeError("planted in a step")

    def arming_roll_back(*args):
        rolling_back.append(True)
        try:
            roll_back(*args)
        finally:
            rolling_back.clear()

    def failing(*args, **kwargs):
        result = original(*args, **kwargs)
        if rolling_back and "rollback" not in fired:
            fired.append("rollback")
            raise RuntimeError(f"planted in the rollback, at {point}")
        return result

    monkeypatch.setattr(engine.step_runner, "accept", failing_accept)
    monkeypatch.setattr(engine.step_runner, "roll_back", arming_roll_back)
    monkeypatch.setattr(owner, name, failing)
    return fired


def dead_engine(point, monkeypatch):
    engine = small_engine(tokenizer=tiny_tokenizer())
    workload(engine)
    return engine, plant_in_rollback(monkeypatch, engine, point)


def assert_dead(call, point):
    with pytest.raises(EngineDeadError, match="rolling it back failed") as info:
        call()
    assert "planted in a step" in str(info.value) and f"planted in the rollback, at {point}" in str(info.value)


@pytest.mark.parametrize("point", ROLLBACK_POINTS)
def test_a_failure_inside_a_rollback_kills_the_engine_and_every_call_says_so(point, monkeypatch):
    """The step whose rollback fails raises EngineDeadError naming both failures (caused by the
    rollback's); from then on every call raises it (main: the rollback's error, then the engine
    ran on half-restored). Aborting and shutting down, the ways out, still work."""
    engine, fired = dead_engine(point, monkeypatch)
    with pytest.raises(EngineDeadError) as info:
        drain(engine, max_steps=100)
    assert "rollback" in fired, f"{point} is never called in a rollback: a failure planted there tests nothing"
    assert isinstance(info.value.__cause__, RuntimeError) and "planted in the rollback" in str(info.value.__cause__)
    monkeypatch.undo()
    assert "rolling it back failed" in str(info.value) and "planted in a step" in str(info.value)
    for call in (engine.step, engine.has_unfinished_requests, engine.check_health, engine.stats,
                 lambda: engine.add_request("late", [3, 4, 5]),
                 lambda: engine.generate([[3, 4, 5]], SamplingParams(max_tokens=2), use_tqdm=False)):
        assert_dead(call, point)
    engine.abort_request("w0")
    engine.shutdown()


def test_a_failure_inside_a_rollback_wakes_every_generate_caller(monkeypatch):
    """Two threads in generate(): the step whose rollback fails is one's, the other waits on the
    step lock or steps next; both raise EngineDeadError within the bound. Bounded on main too:
    after the joins a stop flag makes every step raise."""
    engine, fired = dead_engine("scheduler.requeue", monkeypatch)
    run, stop, errors = engine.step_runner.run, threading.Event(), {}

    def stoppable(run_model):
        if stop.is_set():
            raise KeyboardInterrupt("stopped by the test")
        return run(run_model)

    monkeypatch.setattr(engine.step_runner, "run", stoppable)

    def generate(name, seed):
        try:
            engine.generate(prompts_of([5, 9], seed=seed), SamplingParams(max_tokens=8), use_tqdm=False)
        except BaseException as e:  # noqa: BLE001 - checked below
            errors[name] = e

    threads = [threading.Thread(target=generate, args=(f"g{i}", i), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(LIMIT)
    stop.set()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    assert "rollback" in fired
    assert sorted(errors) == ["g0", "g1"] and all(isinstance(e, EngineDeadError) for e in errors.values()), errors
    assert all("rolling it back failed" in str(e) for e in errors.values()), errors


def test_a_failure_inside_a_rollback_wakes_every_stream_and_fails_health(monkeypatch):
    """AsyncLLMEngine over an engine whose rollback fails: its thread stops at once (no retry of a
    dead engine), every consumer raises EngineDeadError naming the rollback, check_health raises,
    a new request fails at once (main: the thread retried the half-restored engine)."""
    engine, fired = dead_engine("scheduler.requeue", monkeypatch)
    async_engine = AsyncLLMEngine(engine)

    async def consume(request_id, prompt):
        async for _ in async_engine.generate(prompt, SamplingParams(max_tokens=30, ignore_eos=True), request_id):
            pass

    async def main():
        waiters = [consume(f"a{i}", p) for i, p in enumerate(prompts_of([5, 9, 7], seed=5))]
        results = await asyncio.gather(*waiters, return_exceptions=True)
        assert all(isinstance(r, EngineDeadError) and "rolling it back failed" in str(r) for r in results), results
        with pytest.raises(EngineDeadError, match="rolling it back failed"):
            await consume("late", [3, 4, 5])

    try:
        asyncio.run(asyncio.wait_for(main(), LIMIT))
        assert "rollback" in fired
        with pytest.raises(EngineDeadError, match="rolling it back failed"):
            async_engine.check_health()
    finally:
        async_engine.shutdown()
