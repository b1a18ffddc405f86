"""Stopping the server while responses are open: ``python -m minipaged_ops.serve`` as a process on
127.0.0.1 (a free port, killed at the end whatever happens), a stream far longer than the test
running when SIGTERM or SIGINT arrives. Every read carries a timeout, every loop is bounded in count
and time."""

import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("transformers")
pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from fastapi import FastAPI  # noqa: E402

from minipaged_ops import tiny  # noqa: E402
from minipaged_ops.integration import LLMEngine  # noqa: E402
from minipaged_ops.integration.distributed.group import free_port  # noqa: E402
from minipaged_ops.integration.engine.async_engine import AsyncLLMEngine  # noqa: E402
from minipaged_ops.integration.server import GracefulServer, build_app  # noqa: E402

NAME = "tiny-qwen3"
LONG = 30_000  # tokens: minutes of decoding on this model, so only a shutdown can end it
SLACK_S = 8.0  # what the exit may take beyond the grace period (the engine's current step, the teardown)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny.save_tiny_model(tmp_path_factory.mktemp("shutdown") / "model", max_positions=LONG + 512)


@contextlib.contextmanager
def server_process(folder, log_path, *args):
    """The CLI serving ``folder`` on a free port: (process, port); killed at the end if still running."""
    port = free_port()
    log = open(log_path, "w+")
    process = subprocess.Popen(
        [sys.executable, "-m", "minipaged_ops.serve", "--model", folder, "--port", str(port), "--served-model-name",
         NAME, "--device", "cpu", "--num-blocks", str(2 * LONG // 16), "--block-size", "16", "--max-num-seqs", "4",
         *args], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while True:  # bounded: until it answers, exits or the deadline
            assert process.poll() is None, (log.seek(0), log.read()[-3000:])
            assert time.monotonic() < deadline, "the server did not come up within 180 s"
            try:
                if request(port, "GET", "/health")[0] == 200:
                    break
            except OSError:
                time.sleep(0.3)
        yield process, port
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(60)
        log.close()


def request(port, method, path, body=None, timeout=60):
    """(status, parsed JSON or text) of a whole request."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, None if body is None else json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        raw = response.read().decode()
        return response.status, (json.loads(raw) if raw.startswith("{") else raw)
    finally:
        conn.close()


class EventStream:
    """A streamed completion read event by event (``data: ...`` strings, ``[DONE]`` included)."""

    def __init__(self, port, max_tokens):
        body = dict(model=NAME, prompt="Hello", max_tokens=max_tokens, temperature=0, ignore_eos=True, stream=True)
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        self.conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        self.response = self.conn.getresponse()
        assert self.response.status == 200
        self.events, self.buffer = [], b""

    def read(self, until, seconds) -> bool:
        """Read until ``until(events)`` holds (True) or the stream ends or ``seconds`` pass (False)."""
        deadline = time.monotonic() + seconds
        while not until(self.events) and time.monotonic() < deadline:
            chunk = self.response.read1(65536)
            if not chunk:
                return False
            self.buffer += chunk
            *whole, self.buffer = self.buffer.split(b"\n\n")
            self.events += [e.decode() for e in whole if e]
        return until(self.events)

    def close(self):
        self.conn.close()


def done(events) -> bool:
    return events[-1:] == ["data: [DONE]"]


def payload(event) -> dict:
    assert event.startswith("data: {"), event
    return json.loads(event[len("data: "):])


def exit_time(process, since, seconds) -> float:
    """Seconds from ``since`` until ``process`` exits; inf if it is still running ``seconds`` after it."""
    while time.monotonic() < since + seconds:
        if process.poll() is not None:
            return time.monotonic() - since
        time.sleep(0.02)
    return float("inf")


def assert_ended_by_shutdown(stream):
    """The stream's last events: an OpenAI error saying the server is shutting down, then [DONE]."""
    *tokens, error, done = stream.events
    assert done == "data: [DONE]"
    assert "error" in payload(error), f"the stream ended without an error event: {error}"
    assert payload(error)["error"]["type"] == "service_unavailable", error
    assert "shutting down" in payload(error)["error"]["message"]
    assert tokens and all(payload(t)["choices"][0]["finish_reason"] is None for t in tokens)


@pytest.mark.parametrize("signums,args", [([signal.SIGTERM], []), ([signal.SIGINT], []),
                                         ([signal.SIGINT, signal.SIGINT], ["--shutdown-timeout", "60"])],
                         ids=["SIGTERM", "SIGINT", "SIGINT twice in the grace period"])
def test_a_signal_ends_open_streams_and_the_process_exits_promptly(folder, tmp_path, signums, args):
    """No grace period (the default, as vLLM's), or a second Ctrl-C within one: the open stream
    ends at once with the shutdown error and [DONE], and the process exits cleanly (no traceback)
    within seconds."""
    signum = signums[-1]
    with server_process(folder, tmp_path / "server.log", *args) as (process, port):
        stream = EventStream(port, LONG)
        try:
            assert stream.read(lambda events: len(events) >= 5, 60), "no tokens streamed"
            sent = time.monotonic()
            for i, s in enumerate(signums):
                if i:  # the first one's grace period has begun: the stream goes on
                    assert stream.read(lambda events, n=len(stream.events): len(events) >= n + 2, 10)
                process.send_signal(s)
            stream.read(done, SLACK_S)
            seconds = exit_time(process, sent, SLACK_S)
            print(f"\n{signal.Signals(signum).name}: exited {seconds:.2f} s after the signal, "
                  f"{len(stream.events)} events streamed")
            assert seconds < SLACK_S, f"still running {SLACK_S} s after {signal.Signals(signum).name}"
        finally:
            stream.close()
        assert_ended_by_shutdown(stream)
        assert process.returncode == 128 + signum
    log = (tmp_path / "server.log").read_text()
    assert "Traceback" not in log, log[-3000:]


def wait_running(port, count, seconds=60):
    """Until /metrics counts ``count`` requests running (bounded)."""
    deadline = time.monotonic() + seconds
    while True:
        lines = request(port, "GET", "/metrics")[1].splitlines()
        if next(float(x.split()[-1]) for x in lines if x.startswith("minipaged:num_requests_running{")) >= count:
            return
        assert time.monotonic() < deadline, f"fewer than {count} requests running after {seconds} s"
        time.sleep(0.05)


def test_a_grace_period_lets_requests_finish_then_ends_the_rest(folder, tmp_path):
    """``--shutdown-timeout 10``: a short stream in flight finishes normally; after 10 s a long stream
    ends with the shutdown error and a long whole request gets HTTP 503 with it; then the process
    exits, not before the grace period and not long after."""
    grace, short = 10.0, 60  # the short stream takes 0.2-1.5 s here; beside a build, 120 tokens once missed 5 s
    whole_body = dict(model=NAME, prompt="Hi", max_tokens=LONG, temperature=0, ignore_eos=True)
    with server_process(folder, tmp_path / "server.log", "--shutdown-timeout", str(grace)) as (process, port), \
            ThreadPoolExecutor(1) as pool:
        streams = [EventStream(port, LONG)]
        try:
            whole = pool.submit(request, port, "POST", "/v1/completions", whole_body, 60)
            wait_running(port, 2)
            streams.insert(0, EventStream(port, short))
            wait_running(port, 3)
            sent = time.monotonic()
            process.send_signal(signal.SIGTERM)
            for s in streams:  # the short one first: it must be over well within the grace period
                s.read(done, grace + SLACK_S)
            seconds = exit_time(process, sent, grace + SLACK_S)
            status, body = whole.result(timeout=SLACK_S)
        finally:
            for s in streams:
                s.close()
        print(f"\n--shutdown-timeout {grace}: exited {seconds:.2f} s after SIGTERM")
        assert grace <= seconds < grace + SLACK_S
        assert_ended_by_shutdown(streams[1])
        *tokens, last, end = streams[0].events
        assert end == "data: [DONE]" and payload(last)["choices"][0]["finish_reason"] == "length"
        assert tokens and "error" not in "".join(streams[0].events)
        assert status == 503 and body["error"]["type"] == "service_unavailable", body
        assert "shutting down" in body["error"]["message"]
        assert process.returncode == 128 + signal.SIGTERM
    log = (tmp_path / "server.log").read_text()
    assert "Traceback" not in log and "ending 2 open response(s)" in log, log[-3000:]


def test_in_process_the_shutdown_aborts_every_engine_request_and_stops_the_thread(folder):
    """GracefulServer in a thread: once the shutdown has begun a new request gets 503 (the open
    ones go on); ending it ends both streams (one of two choices) with the error, every engine
    request is aborted (the engine has none left) and the engine thread then stops."""
    import socket
    import threading

    llm = LLMEngine.from_pretrained(folder, num_blocks=4 * 1024 // 16, block_size=16, max_num_seqs=4)
    engine = AsyncLLMEngine(llm)
    app = build_app(engine, NAME)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = GracefulServer(uvicorn.Config(app, log_level="warning"), shutdown_timeout=0)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    streams = []
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        streams = [EventStream(port, 1000), EventStream(port, 1000)]
        assert all(s.read(lambda events: len(events) >= 2, 60) for s in streams)
        app.state.in_flight.refuse_new()
        status, body = request(port, "POST", "/v1/completions", dict(model=NAME, prompt="Hi", max_tokens=2))
        assert status == 503 and body["error"]["type"] == "service_unavailable"
        assert "takes no new requests" in body["error"]["message"]
        assert all(s.read(lambda events, n=len(s.events): len(events) >= n + 3, 60) for s in streams)  # go on
        server.should_exit = True
        for s in streams:
            s.read(done, SLACK_S)
        thread.join(SLACK_S)
        assert not thread.is_alive()
        deadline = time.monotonic() + SLACK_S  # the engine thread steps the aborts
        while llm.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not llm.has_unfinished_requests() and engine.is_running
        engine.shutdown()
        assert not engine.is_running
    finally:
        server.should_exit = True
        thread.join(60)
        engine.shutdown()
        for s in streams:
            s.close()
        sock.close()
    for s in streams:
        assert_ended_by_shutdown(s)
        assert all(payload(t)["choices"][0]["finish_reason"] is None for t in s.events[:-2])


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_a_bad_shutdown_timeout_is_an_error_naming_it_before_loading(value, tmp_path, capsys):
    from minipaged_ops.serve import main

    with pytest.raises(SystemExit) as exit:  # the folder is absent: a flag checked later would say so instead
        main(["--model", str(tmp_path / "absent"), "--port", "1", "--shutdown-timeout", value])
    assert exit.value.code == 2
    assert f"--shutdown-timeout must be a finite number of seconds >= 0, got {float(value)}" in capsys.readouterr().err


def test_graceful_server_refuses_a_bad_timeout_or_an_app_not_of_build_app():
    for value in (-1, float("nan"), float("inf"), True, "3"):
        with pytest.raises(ValueError, match="shutdown_timeout must be a finite number of seconds >= 0"):
            GracefulServer(uvicorn.Config(FastAPI()), shutdown_timeout=value)
    with pytest.raises(ValueError, match="config.app must be an app of build_app"):
        GracefulServer(uvicorn.Config(FastAPI()), shutdown_timeout=1)
