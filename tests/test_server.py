"""The OpenAI-compatible server, for real: uvicorn on 127.0.0.1 (a free port, stopped at the end),
driven by the `openai` client and by raw HTTP. Every request carries a timeout, every loop is
bounded in count and time."""

import contextlib
import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("transformers")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")

import dataclasses  # noqa: E402
import importlib.util  # noqa: E402

import torch  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from minipaged_ops import tiny  # noqa: E402
from minipaged_ops.integration import LLMEngine  # noqa: E402
from minipaged_ops.integration.engine.async_engine import RequestStream  # noqa: E402
from minipaged_ops.integration import SamplingParams  # noqa: E402
from server_helpers import NAME, TIMEOUT, call, serving  # noqa: E402

# text out needs the engine's incremental detokenizer, stop strings its SamplingParams.stop (both
# issue 22's sampling work): until they are on this tree, what needs them is skipped, saying so
if importlib.util.find_spec("minipaged_ops.integration.engine.detokenizer") is None:
    pytest.skip("the engine's detokenizer (issue 22) is not in this tree yet", allow_module_level=True)
needs_stop = pytest.mark.skipif("stop" not in {f.name for f in dataclasses.fields(SamplingParams)},
                                reason="SamplingParams.stop (issue 22) is not in this tree yet")

PROMPTS = ["Hello, world!", "Grüße aus München — 東京タワー 🎉", "The cache is", "x"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny.save_tiny_model(tmp_path_factory.mktemp("srv") / "model")


@pytest.fixture(scope="module")
def hf(folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, attn_implementation="sdpa").eval()
    return model, AutoTokenizer.from_pretrained(folder, local_files_only=True)


@pytest.fixture(scope="module")
def server(folder):
    llm = LLMEngine.from_pretrained(folder, num_blocks=64, block_size=16, max_num_seqs=16)
    with serving(llm) as (url, engine):
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)


def metrics(url) -> dict:
    """Every sample of /metrics, parsed by prometheus_client: {(name, labels): value}."""
    status, text = call(url, "/metrics")
    assert status == 200
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def hf_greedy(hf, ids, max_new_tokens):
    model, tokenizer = hf
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
    new = out[0, len(ids):].tolist()
    return new, tokenizer.decode(new, skip_special_tokens=True)


def streamed(stream):
    """Per choice: concatenated text, finish_reason; and the usage chunk (bounded by max_tokens)."""
    texts, reasons, usage, chunks = {}, {}, None, 0
    for chunk in stream:
        chunks += 1
        assert chunks < 10_000
        if not chunk.choices:
            usage = chunk.usage
            continue
        assert chunk.usage is None
        for c in chunk.choices:
            piece = c.text if hasattr(c, "text") else (c.delta.content or "")
            texts[c.index] = texts.get(c.index, "") + piece
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    return texts, reasons, usage


# ---------------------------------------------------------------------------------- text


def test_greedy_completion_equals_transformers_generate(client, hf):
    _, tokenizer = hf
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        new, text = hf_greedy(hf, ids, 24)
        r = client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0)
        assert r.object == "text_completion" and r.model == NAME and r.id.startswith("cmpl-")
        assert r.choices[0].text == text
        assert r.choices[0].finish_reason == ("stop" if new[-1] in (0, 2) else "length")
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(new))
        assert r.usage.total_tokens == len(ids) + len(new)
        by_ids = client.completions.create(model=NAME, prompt=ids, max_tokens=24, temperature=0)
        assert by_ids.choices[0].text == text


def test_a_batch_of_prompts_gives_n_choices_each(client, hf):
    _, tokenizer = hf
    r = client.completions.create(model=NAME, prompt=PROMPTS[:3], max_tokens=10, temperature=0, n=2)
    assert [c.index for c in r.choices] == list(range(6))
    for i, prompt in enumerate(PROMPTS[:3]):
        _, text = hf_greedy(hf, tokenizer.encode(prompt), 10)
        assert r.choices[2 * i].text == r.choices[2 * i + 1].text == text
    assert r.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in PROMPTS[:3])


def test_stream_deltas_concatenate_to_the_whole_text_and_usage(client):
    for kwargs in (dict(temperature=0), dict(temperature=1.0, seed=11, n=3, top_p=0.9)):
        whole = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=30, **kwargs)
        texts, reasons, usage = streamed(client.completions.create(
            model=NAME, prompt=PROMPTS[1], max_tokens=30, stream=True, stream_options={"include_usage": True},
            **kwargs))
        assert texts == {c.index: c.text for c in whole.choices}
        assert reasons == {c.index: c.finish_reason for c in whole.choices}
        assert usage.model_dump() == whole.usage.model_dump()


def test_raw_event_stream_is_openais_shape(server):
    url, _ = server
    body = dict(model=NAME, prompt="Hello", max_tokens=5, temperature=0, stream=True,
                stream_options={"include_usage": True})
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [e for e in r.read().decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    usage = chunks.pop()
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    for c in chunks:
        assert set(c) == {"id", "object", "created", "model", "choices", "usage"} and c["usage"] is None
        assert c["object"] == "text_completion" and set(c["choices"][0]) == {"index", "text", "logprobs",
                                                                             "finish_reason", "stop_reason"}
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"


def test_chat_goes_through_the_template(client, server, hf):
    _, tokenizer = hf
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Grüße 🎉 — what is 2+2?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    opener = tokenizer.encode("<|im_start|>assistant\n")
    assert list(ids)[-len(opener):] == opener
    new, text = hf_greedy(hf, list(ids), 20)
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=20, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == text
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(new))
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    texts, reasons, usage = streamed(iter(chunks))
    assert texts == {0: text} and reasons == {0: r.choices[0].finish_reason}
    assert usage.model_dump() == r.usage.model_dump()
    status, tok = call(server[0], "/tokenize", {"messages": messages})
    assert status == 200 and tok["tokens"] == list(ids) and tok["count"] == len(ids)


def test_logprobs_in_both_shapes(client):
    r = client.completions.create(model=NAME, prompt="Hello", max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and max(top.values()) == pytest.approx(value)  # greedy: the chosen is the likeliest
        assert len(top) <= 4
    assert "".join(lp.tokens) == r.choices[0].text or "\ufffd" in "".join(lp.tokens)
    c = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == 3 and all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == e.logprob
                                     for e in content)


def test_eight_concurrent_streams_each_equal_its_solo_run(client):
    jobs = [dict(prompt=p, max_tokens=40, temperature=0) for p in PROMPTS] + \
           [dict(prompt=p, max_tokens=40, temperature=0.8, seed=100 + i) for i, p in enumerate(PROMPTS)]
    solo = [client.completions.create(model=NAME, **j).choices[0].text for j in jobs]

    def one(j):
        texts, _, _ = streamed(client.completions.create(model=NAME, stream=True, **j))
        return texts[0]

    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(one, jobs, timeout=TIMEOUT))
    assert together == solo


# ---------------------------------------------------------------------------------- stop strings


@pytest.fixture(scope="module")
def scripted(folder, tmp_path_factory):
    """A server whose greedy output is known: after the prompt "x" it writes WALK byte by byte
    (every multi-byte character split across tokens), then EOS."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    walk_text = "ab東cd🎉ef"
    byte_chars = "".join(s for s, _ in tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str(walk_text))
    walk = tokenizer.convert_tokens_to_ids(list(byte_chars))
    assert len(walk) == len(walk_text.encode()) == 13
    start = tokenizer.encode("x")
    tiny.script_greedy(model, start[-1:] + walk + [tokenizer.eos_token_id])
    path = tmp_path_factory.mktemp("scripted") / "model"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    llm = LLMEngine.from_pretrained(path, num_blocks=32, block_size=16)
    with serving(llm) as (url, _):
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT), walk_text


@needs_stop
@pytest.mark.parametrize("stop, include, expected, reason", [
    (None, False, "ab東cd🎉ef", "stop"),  # EOS
    ("b東c", False, "a", "stop"),  # across three tokens and a character split in three
    ("東", False, "ab", "stop"),
    ("🎉", True, "ab東cd🎉", "stop"),
    (["zz", "d🎉e"], False, "ab東c", "stop"),
    ("東d", False, "ab東cd🎉ef", "stop"),  # a prefix matches, the rest never does: held back, then released
    ("ef!", False, "ab東cd🎉ef", "stop"),  # still a possible match when EOS comes: released at the end
])
def test_stop_strings_across_tokens_and_multi_byte_characters(scripted, stop, include, expected, reason):
    client, _ = scripted
    extra = {"stop": stop} if stop is not None else {}
    body = dict(model=NAME, prompt="x", max_tokens=20, temperature=0, extra_body={"include_stop_str_in_output": include},
                **extra)
    whole = client.completions.create(**body)
    assert whole.choices[0].text == expected and whole.choices[0].finish_reason == reason
    pieces = []
    for chunk in client.completions.create(stream=True, **body):
        pieces += [c.text for c in chunk.choices]
        assert len(pieces) < 100
    assert "".join(pieces) == expected
    assert not any("\ufffd" in p for p in pieces), pieces  # no character was ever split


def test_max_tokens_cuts_inside_a_character(scripted):
    client, _ = scripted
    r = client.completions.create(model=NAME, prompt="x", max_tokens=3, temperature=0)  # a, b, first byte of 東
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    assert r.choices[0].text == "ab\ufffd"  # what tokenizer.decode gives for the lone byte


# ---------------------------------------------------------------------------------- bad requests


BAD = [
    ("/v1/completions", dict(model=NAME, prompt=""), "prompt"),
    ("/v1/completions", dict(model=NAME, prompt=[]), "prompt"),
    ("/v1/completions", dict(model=NAME, prompt=[[]]), "prompt"),
    ("/v1/completions", dict(model=NAME, prompt="hi", max_tokens=-3), "max_tokens"),
    ("/v1/completions", dict(model=NAME, prompt=[7] * 1100), "prompt"),  # the pool holds 64 x 16 = 1024 tokens
    ("/v1/completions", dict(model=NAME, prompt=[7, 512]), "prompt"),  # outside the vocabulary
    ("/v1/completions", dict(model=NAME, prompt="hi", max_tokens="ten"), "max_tokens"),
    ("/v1/completions", dict(model=NAME, prompt="hi", temperature="hot"), "temperature"),
    ("/v1/completions", dict(model=NAME, prompt=5), "prompt"),
    ("/v1/completions", dict(model=NAME, prompt="hi", n=True), "n"),
    ("/v1/completions", dict(model=NAME, prompt="hi", stream="yes"), "stream"),
    ("/v1/completions", dict(model=NAME, prompt="hi", stop=[1, 2]), "stop"),
    ("/v1/completions", dict(model=NAME, prompt="hi", temperature=-1.0), "temperature"),
    ("/v1/completions", dict(model=NAME, prompt="hi", top_p=1.5), "top_p"),
    ("/v1/completions", dict(model=NAME, prompt="hi", n=0), "n"),
    ("/v1/completions", dict(model=NAME, prompt="hi", logprobs=-1), "logprobs"),
    ("/v1/completions", dict(model=NAME), "prompt"),
    ("/v1/completions", dict(model=NAME, prompt="hi", n=17), "n"),  # more than max_num_seqs: the engine refuses
    ("/v1/completions", dict(model=NAME, prompt=["hi", [7] * 1100]), "prompt"),  # the second of two
    ("/v1/chat/completions", dict(model=NAME, messages=[]), "messages"),
    ("/v1/chat/completions", dict(model=NAME, messages="hi"), "messages"),
    ("/v1/chat/completions", dict(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=-1),
     "max_tokens"),
    ("/v1/chat/completions", dict(model=NAME, messages=[{"role": "user", "content": "x" * 3000}]), "messages"),
]


def test_each_bad_request_gets_400_naming_the_field_and_changes_nothing(server, client):
    url, _ = server
    before = metrics(url)
    for path, body, param in BAD:
        status, answer = call(url, path, body)
        assert status == 400, (body, answer)
        error = answer["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"], (body, error)
        r = client.completions.create(model=NAME, prompt="hi", max_tokens=2, temperature=0)  # the next good one works
        assert r.usage.completion_tokens == 2
    after = metrics(url)
    key = ("minipaged:prompt_tokens_total", ())
    good = len(BAD) * len(client.completions.create(model=NAME, prompt="hi", max_tokens=1, temperature=0).choices)
    assert after[key] - before[key] == good * r.usage.prompt_tokens  # only the good requests counted
    assert after[("minipaged:num_requests_running", ())] == 0 and after[("minipaged:num_requests_waiting", ())] == 0
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="hi", max_tokens=-1)
    assert e.value.status_code == 400 and e.value.body["param"] == "max_tokens"


# ---------------------------------------------------------------------------------- disconnects


def wait_idle(url, seconds=TIMEOUT, until=lambda m: True):
    """Metrics once nothing runs, no block is held and ``until`` holds."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        m = metrics(url)
        if m[("minipaged:num_requests_running", ())] == 0 and m[("minipaged:kv_cache_usage_perc", ())] == 0 \
                and until(m):
            return m
        time.sleep(0.05)
    raise AssertionError(f"still busy after {seconds} s: {m}")


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_aborts_its_request_and_frees_every_block(server, stream):
    url, _ = server
    host, port = url.removeprefix("http://").split(":")
    before = wait_idle(url)
    body = json.dumps(dict(model=NAME, prompt="Hello", max_tokens=1000, temperature=0, ignore_eos=True,
                           stream=stream)).encode()
    conn = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT)
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    if stream:
        response = conn.getresponse()
        assert response.status == 200
        assert response.readline().startswith(b"data: ")  # the first token is out
    else:
        deadline = time.monotonic() + TIMEOUT  # wait until the request is running
        while metrics(url)[("minipaged:num_requests_running", ())] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    aborted = ("minipaged:request_success_total", (("finished_reason", "abort"),))
    after = wait_idle(url, until=lambda m: m.get(aborted, 0) - before.get(aborted, 0) == 1)
    generated = after[("minipaged:generation_tokens_total", ())] - before[("minipaged:generation_tokens_total", ())]
    assert 0 < generated < 1000 - 5


@pytest.mark.parametrize("stream", [True, False])
def test_a_request_whose_piece_cannot_be_made_fails_alone_with_an_error(server, client, hf, monkeypatch, stream):
    """The engine thread failing to make one request's piece (planted after its third token): that
    response ends with an OpenAI error (streamed: an error event, then [DONE]; whole: HTTP 500),
    its request is aborted and its blocks freed, and the server serves the next one."""
    url, _ = server
    bad = hf[1].encode("The cache is broken")
    real = RequestStream.delta

    def delta(self, out):
        if out.prompt_token_ids == bad and len(out.outputs[0].token_ids) >= 3:
            raise RuntimeError("planted: no piece")
        return real(self, out)

    monkeypatch.setattr(RequestStream, "delta", delta)
    before = wait_idle(url)
    with pytest.raises(openai.APIError, match="planted: no piece"):
        response = client.completions.create(model=NAME, prompt="The cache is broken", max_tokens=200, stream=stream,
                                             temperature=0, extra_body={"ignore_eos": True})
        for _ in zip(range(1000), response if stream else ()):
            pass
    aborted = ("minipaged:request_success_total", (("finished_reason", "abort"),))
    wait_idle(url, until=lambda m: m.get(aborted, 0) - before.get(aborted, 0) == 1)
    assert call(url, "/health")[0] == 200
    assert client.completions.create(model=NAME, prompt="hi", max_tokens=3).usage.completion_tokens == 3


# ---------------------------------------------------------------------------------- the other endpoints


def test_metrics_parse_and_count_the_requests_sent(server, client):
    url, _ = server
    before = wait_idle(url)
    prompt = " ".join(["The cache is full."] * 8)  # 40 tokens: 2 full blocks for the prefix cache
    usages, reasons = [], []
    for i in range(3):
        r = client.completions.create(model=NAME, prompt=prompt, max_tokens=5 + i, temperature=0, n=1 + i % 2)
        usages.append(r.usage)
        reasons.append(r.choices[0].finish_reason)
    _, _, usage = streamed(client.completions.create(model=NAME, prompt="hi", max_tokens=7, stream=True,
                                                     stream_options={"include_usage": True}))
    usages.append(usage)
    after = wait_idle(url)

    def delta(name, labels=()):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    assert delta("minipaged:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("minipaged:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert delta("minipaged:prefix_cache_queries_total") == sum(u.prompt_tokens for u in usages)
    assert delta("minipaged:prefix_cache_hits_total") >= 2 * 32  # the 2nd and 3rd found the 1st's blocks
    for name in ("e2e_request_latency_seconds", "time_to_first_token_seconds", "request_queue_time_seconds"):
        assert delta(f"minipaged:{name}_count") == 4, name
    finished = sum(delta("minipaged:request_success_total", (("finished_reason", r),)) for r in ("stop", "length"))
    assert finished == 4
    assert delta("minipaged:inter_token_latency_seconds_count") > 0
    assert ("minipaged:num_preemptions_total", ()) in after
    assert after[("minipaged:kv_cache_usage_perc", ())] == 0


def test_models_version_tokenize_detokenize_health(server, hf):
    url, _ = server
    _, tokenizer = hf
    status, models = call(url, "/v1/models")
    assert status == 200 and models["object"] == "list" and models["data"][0]["id"] == NAME
    assert models["data"][0]["max_model_len"] == 1024
    status, version = call(url, "/version")
    assert status == 200 and isinstance(version["version"], str)
    status, tok = call(url, "/tokenize", {"prompt": PROMPTS[1]})
    assert status == 200 and tok["tokens"] == tokenizer.encode(PROMPTS[1]) and tok["count"] == len(tok["tokens"])
    status, detok = call(url, "/detokenize", {"tokens": tok["tokens"]})
    assert status == 200 and detok == {"prompt": PROMPTS[1]}
    status, bad = call(url, "/detokenize", {"tokens": [1 << 20]})
    assert status == 400 and bad["error"]["param"] == "tokens"
    assert call(url, "/health")[0] == 200


def test_a_dead_engine_fails_requests_and_health_without_hanging(folder):
    llm = LLMEngine.from_pretrained(folder, num_blocks=32, block_size=16)
    real, broken = llm.step, threading.Event()

    def step():
        if broken.is_set():
            raise RuntimeError("injected: the device fell off")
        return real()

    llm.step = step
    with serving(llm, max_step_failures=2) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)
        assert client.completions.create(model=NAME, prompt="hi", max_tokens=2).usage.completion_tokens == 2
        stream = client.completions.create(model=NAME, prompt="hi", max_tokens=500, stream=True,
                                           extra_body={"ignore_eos": True})
        first = next(iter(stream))
        assert first.choices
        broken.set()
        with pytest.raises(openai.APIError, match="device fell off"):
            for _ in zip(range(1000), stream):
                pass
        status, body = call(url, "/health")
        assert status == 503 and "device fell off" in body["error"]["message"]
        with pytest.raises(openai.InternalServerError):
            client.completions.create(model=NAME, prompt="hi", max_tokens=2)


def test_the_readmes_openai_example_runs_as_printed(server, capsys):
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme[readme.index("## OpenAI-compatible server"):]
    code = re.search(r"^```py\n(.*?)^```", section, re.S | re.M).group(1)
    assert "http://localhost:8000/v1" in code and '"/tmp/tiny-qwen3"' in code
    code = code.replace("http://localhost:8000/v1", server[0] + "/v1").replace('"/tmp/tiny-qwen3"', repr(NAME))
    exec(compile(code, "README.md openai example", "exec"), {"__name__": "readme_openai_example"})
    out = capsys.readouterr().out
    assert "CompletionUsage(" in out and "completion_tokens=" in out


# ---------------------------------------------------------------------------------- the load generator


def test_serve_http_quick_runs_our_server_and_the_engine_side_by_side(tmp_path):
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "bench/serve_http.py", "--quick", "--systems", "minipaged,engine",
                           "--out", str(tmp_path)], cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    def is_row(fields):
        return len(fields) > 3 and fields[0] in ("minipaged", "engine") and fields[1].replace(".", "").isdigit()

    rows = {fields[0]: fields for fields in map(str.split, done.stdout.splitlines()) if is_row(fields)}
    assert set(rows) == {"minipaged", "engine"}
    assert rows["minipaged"][3] == rows["engine"][3]  # the same output tokens (EOS ignored)
    assert "of the output tokens/s" in done.stdout
    lines = (tmp_path / "serve_http.csv").read_text().splitlines()
    assert len(lines) == 1 + 2 * 6 and (tmp_path / "serve_http.png").stat().st_size > 0


def test_cli_help_and_a_missing_folder(tmp_path):
    import subprocess
    import sys

    from minipaged_ops.serve import cli

    for argv in (["-m", "minipaged_ops.serve", "--help"], ["-c", "from minipaged_ops.serve import cli; cli()", "serve",
                                                            "--help"]):
        done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "--max-num-batched-tokens" in done.stdout and "--no-enable-prefix-caching" \
            in done.stdout and "{auto,int8,fp8_e4m3,fp8_e5m2}" in done.stdout, done.stderr
    assert cli(["nonsense"]) == 2
    done = subprocess.run([sys.executable, "-m", "minipaged_ops.serve", "--model", str(tmp_path / "absent"),
                           "--port", "1"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "is not a directory" in done.stderr


# ---------------------------------------------------------------------------------- the 8-bit KV cache


def test_an_int8_server_answers_and_its_metrics_name_the_format(folder, tmp_path):
    """``python -m minipaged_ops.serve --kv-cache-dtype int8`` for real: its greedy completion is the
    in-process int8 engine's, and /metrics reports the int8 pool's format and bytes per block (scales
    included: under the float32 pool's)."""
    import os
    import signal
    import subprocess
    import sys

    from minipaged_ops.integration.distributed.group import free_port

    args = dict(num_blocks=48, block_size=16, max_num_seqs=4)
    port = free_port()
    log = open(tmp_path / "server.log", "w+")
    server = subprocess.Popen([sys.executable, "-m", "minipaged_ops.serve", "--model", folder, "--port", str(port),
                               "--served-model-name", NAME, "--num-blocks", "48", "--block-size", "16",
                               "--max-num-seqs", "4", "--device", "cpu", "--kv-cache-dtype", "int8",
                               "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 180
        while True:  # bounded: until it answers, exits or the deadline
            assert server.poll() is None, (log.seek(0), log.read()[-3000:])
            assert time.monotonic() < deadline, "the server did not come up within 180 s"
            try:
                if call(url, "/health")[0] == 200:
                    break
            except OSError:
                time.sleep(0.3)
        status, reply = call(url, "/v1/completions", {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 8,
                                                      "temperature": 0, "ignore_eos": True})
        assert status == 200, reply
        info = [labels for (name, labels) in metrics(url) if name == "minipaged:cache_config_info"]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()
    int8 = LLMEngine.from_pretrained(folder, kv_cache_dtype="int8", **args)
    auto = LLMEngine.from_pretrained(folder, **args).stats()
    want = int8.generate([int8.tokenizer.encode(PROMPTS[0])], SamplingParams(max_tokens=8, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    assert reply["choices"][0]["text"] == want.text and reply["usage"]["completion_tokens"] == 8
    stats = int8.stats()
    assert stats["kv_cache_dtype"] == "int8" and auto["kv_cache_dtype"] == "float32"
    assert stats["kv_bytes_per_block"] < 0.27 * auto["kv_bytes_per_block"]
    assert info == [(("cache_dtype", "int8"), ("kv_bytes_per_block", str(stats["kv_bytes_per_block"])),
                     ("num_blocks", "48"))]


@pytest.mark.parametrize("argv,message", [
    (["--kv-cache-dtype", "int4"], "argument --kv-cache-dtype: invalid choice: 'int4'"),
    (["--quantization", "fp4"], "argument --quantization: invalid choice: 'fp4'"),
    (["--kv-cache-dtype", "int8", "--calculate-kv-scales"],
     "--calculate-kv-scales sets fp8 scales: it needs --kv-cache-dtype fp8_e4m3 or fp8_e5m2, got int8"),
    (["--calculate-kv-scales"], "--calculate-kv-scales sets fp8 scales: it needs --kv-cache-dtype fp8_e4m3 or "
                                "fp8_e5m2, got auto"),
])
def test_a_bad_kv_cache_flag_is_an_error_naming_it_before_loading(argv, message, tmp_path, capsys):
    from minipaged_ops.serve import main

    with pytest.raises(SystemExit) as exit:  # the folder is absent: a flag checked later would say so instead
        main(["--model", str(tmp_path / "absent"), "--port", "1", *argv])
    assert exit.value.code == 2
    assert message in capsys.readouterr().err
