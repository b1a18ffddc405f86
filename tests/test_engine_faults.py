"""Faults around a step's edges: an interrupt after a step has committed (its outputs must reach
their callers all the same), and a failure inside the rollback of a failed step (the engine must
stop, saying why, and wake everyone who waits on it, rather than run on half-restored).

Every wait is bounded; a test that would hang on a broken engine fails instead.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from minipaged_ops.integration import LLMEngine, SamplingParams  # noqa: E402
from test_engine import assert_all_blocks_free, engine_model, prompts_of, reference  # noqa: E402
from test_engine_serving import drain, plant_one_failure, small_engine, tokens, workload  # noqa: E402

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

