"""AsyncLLMEngine: pieces as they are sampled, equal to the engine's own run; cancelling aborts and
frees the blocks; an engine thread that dies fails every waiter (no hang); no busy loop when idle.
Every wait is bounded by asyncio.wait_for."""

import asyncio
import threading
import time

import pytest

pytest.importorskip("transformers")

from minipaged_ops.integration import LLMEngine, SamplingParams  # noqa: E402
from minipaged_ops.integration.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestStream  # noqa: E402
from minipaged_ops.tiny import tiny_model  # noqa: E402

LIMIT = 60  # seconds any one wait may take
PROMPTS = [[5, 9, 13, 40, 2, 77], list(range(3, 40)), [100] * 20]


def make_engine(**kwargs):
    model = tiny_model("qwen3", vocab=192, layers=2, seed=3)
    return LLMEngine(model, num_blocks=kwargs.pop("num_blocks", 64), block_size=16, **kwargs)


async def collect(engine, prompt, params, request_id):
    pieces = []
    async for piece in engine.generate(prompt, params, request_id):
        pieces.append(piece)
    return pieces


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, LIMIT))


class Finishes:
    """A stat logger: how each request ended, as the engine reported it."""

    def __init__(self):
        self.reasons = {}

    def record(self, outputs, now):
        for out in outputs:
            if out.finished:
                self.reasons[out.request_id] = [c.finish_reason for c in out.outputs]


@pytest.fixture
def engine():
    engine = AsyncLLMEngine(make_engine(), stat_loggers=[Finishes()])
    yield engine
    engine.shutdown()


async def wait_aborted(engine, request_id):
    """Until the engine has reported ``request_id`` aborted and holds no block (bounded)."""
    finishes = engine.stat_loggers[0]
    for _ in range(500):
        stats = await engine.stats()
        if finishes.reasons.get(request_id) == ["abort"] and stats["blocks_used"] == 0 and stats["running"] == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{request_id} not aborted: {finishes.reasons.get(request_id)}, {stats}")


def test_pieces_concatenate_to_the_engines_own_output(engine):
    params = SamplingParams(max_tokens=12)
    reference = make_engine().generate(PROMPTS, params, use_tqdm=False)

    async def main():
        return await asyncio.gather(*(collect(engine, p, params, f"r{i}") for i, p in enumerate(PROMPTS)))

    for pieces, ref in zip(run(main()), reference):
        assert len(pieces) > 1, "one piece per step, not one at the end"
        assert all(len(p.outputs[0].token_ids) >= 1 for p in pieces[:-1])
        tokens = [t for p in pieces for c in p.outputs for t in c.token_ids]
        assert tokens == ref.outputs[0].token_ids
        assert [p.finished for p in pieces] == [False] * (len(pieces) - 1) + [True]
        assert pieces[-1].outputs[0].finish_reason == "length"
        assert pieces[-1].outputs[0].num_tokens == 12


def test_n_completions_and_logprobs_arrive_per_completion(engine):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, logprobs=2)
    ref = make_engine().generate([PROMPTS[0]], params, use_tqdm=False)[0]
    pieces = run(collect(engine, PROMPTS[0], params, "n3"))
    for c_ref in ref.outputs:
        got = [c for p in pieces for c in p.outputs if c.index == c_ref.index]
        assert [t for c in got for t in c.token_ids] == c_ref.token_ids
        logprobs = [lp for c in got for lp in c.logprobs]
        assert len(logprobs) == len(c_ref.token_ids)
        assert logprobs == c_ref.logprobs


def test_leaving_early_aborts_and_frees_every_block(engine):
    async def main():
        got = 0
        async for piece in engine.generate(PROMPTS[1], SamplingParams(max_tokens=400), "leaver"):
            got += len(piece.outputs[0].token_ids)
            if got >= 3:
                break  # the iterator is dropped, and closed
        await wait_aborted(engine, "leaver")

    run(main())


def test_cancelled_task_aborts(engine):
    async def main():
        task = asyncio.ensure_future(collect(engine, PROMPTS[1], SamplingParams(max_tokens=400), "cancelled"))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_aborted(engine, "cancelled")

    run(main())


def test_abort_ends_the_iterator_with_abort(engine):
    async def main():
        reasons = []
        async for piece in engine.generate(PROMPTS[0], SamplingParams(max_tokens=400), "to-abort"):
            if not piece.finished:
                await engine.abort("to-abort")
            reasons += [c.finish_reason for c in piece.outputs]
        return reasons

    reasons = run(main())
    assert reasons[-1] == "abort"
    assert run(engine.stats())["blocks_used"] == 0


def test_a_closed_event_loop_aborts_its_requests_and_the_others_go_on(engine):
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    solo = run(collect(engine, PROMPTS[0], greedy, "solo"))

    async def orphan():
        stream = await engine.add_request("orphan", PROMPTS[1], SamplingParams(max_tokens=400))
        await stream.__anext__()  # running; its loop then closes with the stream never closed
        return stream

    run(orphan())

    async def main():  # steps now deliver to a closed loop and to this one
        pieces = await collect(engine, PROMPTS[0], greedy, "live")
        await wait_aborted(engine, "orphan")
        return pieces

    live = run(main())
    tokens = lambda pieces: [t for p in pieces for c in p.outputs for t in c.token_ids]  # noqa: E731
    assert tokens(live) == tokens(solo) and len(tokens(live)) == 24
    assert live[-1].finished and [c.finish_reason for c in live[-1].outputs] == ["length"]


def test_rejected_request_raises_and_queues_nothing(engine):
    async def main():
        first = engine.generate(PROMPTS[0], SamplingParams(max_tokens=200), "dup")
        piece = await first.__anext__()  # "dup" is running now
        with pytest.raises(ValueError, match="already in use"):
            await collect(engine, PROMPTS[1], SamplingParams(max_tokens=5), "dup")
        with pytest.raises(ValueError, match="empty"):
            await collect(engine, [], SamplingParams(max_tokens=5), "empty")
        rest = [piece] + [p async for p in first]  # the first one is untouched by the refused duplicate
        return rest

    pieces = run(main())
    assert pieces[-1].finished and pieces[-1].outputs[0].finish_reason == "length"
    assert sum(len(c.token_ids) for p in pieces for c in p.outputs) == 200


def test_idle_thread_sleeps_instead_of_polling():
    llm = make_engine()
    calls = {"n": 0}
    real = llm.has_unfinished_requests

    def counted():
        calls["n"] += 1
        return real()

    llm.has_unfinished_requests = counted
    engine = AsyncLLMEngine(llm)
    try:
        run(collect(engine, PROMPTS[0], SamplingParams(max_tokens=4), "one"))
        time.sleep(0.1)
        before = calls["n"]
        time.sleep(0.5)
        assert calls["n"] - before <= 2, f"{calls['n'] - before} checks in 0.5 s of idleness: a busy loop"
        run(collect(engine, PROMPTS[0], SamplingParams(max_tokens=4), "two"))  # and it wakes up for work
    finally:
        engine.shutdown()


def test_a_transient_step_failure_is_retried():
    llm = make_engine()
    ref = make_engine().generate([PROMPTS[2]], SamplingParams(max_tokens=8), use_tqdm=False)[0]
    real, failed = llm.step, []

    def flaky():
        if not failed:
            failed.append(1)
            raise RuntimeError("transient")
        return real()

    llm.step = flaky
    engine = AsyncLLMEngine(llm)
    try:
        pieces = run(collect(engine, PROMPTS[2], SamplingParams(max_tokens=8), "flaky"))
        assert [t for p in pieces for t in p.outputs[0].token_ids] == ref.outputs[0].token_ids
        engine.check_health()
    finally:
        engine.shutdown()


def test_a_dead_engine_thread_fails_every_waiter_and_health():
    llm = make_engine()
    real, started = llm.step, threading.Event()

    def broken():
        if started.is_set():
            raise RuntimeError("the device fell off")
        return real()

    llm.step = broken
    engine = AsyncLLMEngine(llm, max_step_failures=2)

    async def main():
        waiters = [asyncio.ensure_future(collect(engine, p, SamplingParams(max_tokens=300), f"w{i}"))
                   for i, p in enumerate(PROMPTS)]
        await asyncio.sleep(0.05)
        started.set()
        results = await asyncio.gather(*waiters, return_exceptions=True)
        assert all(isinstance(r, EngineDeadError) for r in results), results
        with pytest.raises(EngineDeadError):  # a new request fails at once
            await collect(engine, PROMPTS[0], SamplingParams(max_tokens=2), "late")
        with pytest.raises(EngineDeadError):
            await engine.stats()

    try:
        run(main())
        with pytest.raises(EngineDeadError, match="the device fell off"):
            engine.check_health()
        assert not engine.is_running
    finally:
        engine.shutdown()


@pytest.mark.parametrize("planted", [RuntimeError, KeyboardInterrupt])
def test_a_piece_that_cannot_be_made_wakes_every_waiter(planted, monkeypatch):
    """The engine thread turning one request's output into a piece raises, in the step where
    another request ends (aborted: reported first). That request still gets its last piece: it was
    taken off the engine's books before the failure, and waited for good. An Exception is that
    request's alone: its consumer raises it, its request is aborted, the engine runs on; a
    BaseException stops the thread, and every waiter gets EngineDeadError."""
    real, seen = RequestStream.delta, {}

    def delta(self, out):
        if self.request_id == "victim" and out.finished:
            seen["victim ended"] = True
        elif self.request_id == "bad" and seen.pop("victim ended", False):
            raise planted("planted: no piece")
        return real(self, out)

    monkeypatch.setattr(RequestStream, "delta", delta)
    engine = AsyncLLMEngine(make_engine(), stat_loggers=[Finishes()])

    async def consume(stream, started):
        reasons = []
        try:
            async for piece in stream:
                started.set()
                reasons += [c.finish_reason for c in piece.outputs if c.finish_reason]
        except Exception as e:  # noqa: BLE001 - what the consumer saw
            return e
        return reasons

    async def main():
        params = SamplingParams(max_tokens=400, ignore_eos=True)
        streams = [await engine.add_request(rid, PROMPTS[1], params) for rid in ("victim", "bad")]
        started = [asyncio.Event(), asyncio.Event()]
        waiters = [asyncio.ensure_future(consume(s, e)) for s, e in zip(streams, started)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 10)
        await engine.abort("victim")
        return await asyncio.wait_for(asyncio.gather(*waiters), 10)  # main: the victim waited for good

    try:
        victim, bad = run(main())
        if planted is RuntimeError:
            assert victim == ["abort"]
            assert isinstance(bad, RuntimeError) and "planted" in str(bad)
            run(wait_aborted(engine, "bad"))
            engine.check_health()
        else:
            assert victim == ["abort"] or isinstance(victim, EngineDeadError), victim
            assert isinstance(bad, EngineDeadError) and isinstance(bad.__cause__, KeyboardInterrupt)
    finally:
        engine.shutdown()


def test_requests_and_aborts_reach_the_engine_without_waiting_for_its_thread():
    """One queue, the engine's front door: add_request and abort hand their command to it from the
    caller's thread, so they return while the engine thread is held after a step (a second queue
    in front of that thread would keep them waiting), and take effect at the next step."""
    llm = make_engine()
    blocked, release = threading.Event(), threading.Event()
    finishes = Finishes()

    class Gate:  # a stat logger: holds the engine thread after a step, once armed
        armed = False

        def record(self, outputs, now):
            if self.armed:
                self.armed = False
                blocked.set()
                release.wait(LIMIT)

    gate = Gate()
    engine = AsyncLLMEngine(llm, stat_loggers=[finishes, gate])

    async def main():
        first = await engine.add_request("first", PROMPTS[1], SamplingParams(max_tokens=400, ignore_eos=True))
        await first.__anext__()  # running
        gate.armed = True
        assert await asyncio.to_thread(blocked.wait, 10)
        second = await asyncio.wait_for(engine.add_request("second", PROMPTS[0], SamplingParams(max_tokens=3)), 5)
        assert llm.stats()["waiting"] == 1  # at the door, for the next step
        await asyncio.wait_for(engine.abort("first"), 5)
        release.set()
        pieces = [p async for p in second]
        tail = [p async for p in first]
        return pieces, tail

    try:
        pieces, tail = run(main())
        assert sum(len(c.token_ids) for p in pieces for c in p.outputs) == 3
        assert tail[-1].finished and [c.finish_reason for c in tail[-1].outputs] == ["abort"]
        engine.check_health()
    finally:
        release.set()
        engine.shutdown()


def test_shutdown_wakes_every_waiter_and_aborts_their_requests_in_the_engine():
    """shutdown() while requests stream: every consumer raises EngineDeadError, and since nobody
    will read them, their requests are aborted in the LLMEngine (which outlives the thread and may
    be stepped again): its next step ends them and frees every block and id."""
    llm = make_engine()
    engine = AsyncLLMEngine(llm)

    async def consume(stream):
        try:
            async for _ in stream:
                pass
        except EngineDeadError as e:
            return e

    async def main():
        params = SamplingParams(max_tokens=400, ignore_eos=True)
        streams = [await engine.add_request(f"r{i}", p, params) for i, p in enumerate(PROMPTS)]
        await asyncio.gather(*(s.__anext__() for s in streams))  # all running
        waiters = [asyncio.ensure_future(consume(s)) for s in streams]
        await asyncio.to_thread(engine.shutdown)
        return await asyncio.gather(*waiters)

    try:
        assert all(isinstance(e, EngineDeadError) for e in run(main()))
    finally:
        engine.shutdown()
    assert not engine.is_running and llm.has_unfinished_requests()
    ended = {o.request_id: [c.finish_reason for c in o.outputs] for o in llm.step() if o.finished}
    assert ended == {f"r{i}": ["abort"] for i in range(len(PROMPTS))}  # main: they ran on, 400 tokens each
    assert not llm.has_unfinished_requests() and llm.block_manager.usage()["blocks_used"] == 0


def test_closing_a_stream_ends_a_reader_waiting_on_it(engine):
    """stream.close() from one task (a timeout, say) while another reads the stream: the request
    is aborted, and the reader's loop ends instead of waiting for a piece that never comes."""
    async def main():
        stream = await engine.add_request("closed", PROMPTS[1], SamplingParams(max_tokens=400, ignore_eos=True))
        got = []

        async def read():
            async for piece in stream:
                got.append(piece)

        reader = asyncio.ensure_future(read())
        while not got:
            await asyncio.sleep(0.01)
        stream.close()
        await asyncio.wait_for(reader, 10)  # main: it waited for good
        assert not any(p.finished for p in got)
        await wait_aborted(engine, "closed")
        assert [p async for p in stream] == []  # and a loop started after close() ends at once

    run(main())


@pytest.mark.parametrize("bad_ids", [["bad"], ["bad", "bad2"]])
def test_requests_that_always_fail_end_with_error_and_the_engine_runs_on(bad_ids):
    """A request whose every step fails (the model raising on its prompt) is pinned by the engine
    after MAX_FAILURES failed steps in a row and ends with "error"; those failed steps are the
    engine doing its job, not a dead engine: with the default max_step_failures the thread goes
    on, the other requests equal their solo runs, and the next request is served."""
    poison = 150  # at position 0 only: no generated token can trigger it
    llm = make_engine()
    forward = llm.run_model

    def fails_on_poison(meta):
        if ((meta.input_ids == poison) & (meta.position_ids == 0)).any():
            raise RuntimeError("planted: this prompt always fails")
        return forward(meta)

    llm.run_model = fails_on_poison
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    reference = make_engine().generate([PROMPTS[0]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    engine = AsyncLLMEngine(llm)

    async def outcome(prompt, request_id):
        try:
            pieces = await collect(engine, prompt, greedy, request_id)
        except EngineDeadError as e:
            return e
        return [t for p in pieces for t in p.outputs[0].token_ids], pieces[-1].outputs[0].finish_reason

    async def main():
        bad = [outcome([poison, 7, 8, 9], rid) for rid in bad_ids]
        return await asyncio.gather(*bad, outcome(PROMPTS[0], "good"))

    try:
        *bad, good = run(main())
        assert bad == [([], "error")] * len(bad_ids)  # main: EngineDeadError, for every request
        assert good == (reference, "length")
        engine.check_health()
        assert run(outcome(PROMPTS[0], "next")) == (reference, "length")
    finally:
        engine.shutdown()



def test_a_model_that_fails_on_every_input_is_a_dead_engine():
    """Each request it is given fails alone and is ended with "error", so no single failure looks
    like a dead engine; max_step_failures such requests with no step succeeding in between (the
    steps that only report them do not count) stop the thread: health fails instead of every
    later request erroring behind a healthy /health."""
    llm = make_engine()

    def device_lost(meta):
        raise RuntimeError("planted: the device fell off")

    llm.run_model = device_lost
    engine = AsyncLLMEngine(llm)  # max_step_failures=3

    async def one(i):
        try:
            pieces = await asyncio.wait_for(collect(engine, PROMPTS[0], SamplingParams(max_tokens=4), f"r{i}"), 60)
        except EngineDeadError as e:
            return e
        return pieces[-1].outputs[0].finish_reason

    async def main():
        return [await one(i) for i in range(4)]  # one at a time: each fails alone

    try:
        results = run(main())
        assert results[:2] == ["error", "error"], results
        assert all(isinstance(r, EngineDeadError) for r in results[2:]), results
        with pytest.raises(EngineDeadError, match="the device fell off"):
            engine.check_health()
    finally:
        engine.shutdown()
