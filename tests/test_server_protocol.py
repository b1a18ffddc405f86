"""The OpenAI protocol as clients use it, against a real server on 127.0.0.1 (the `openai` client and
raw HTTP): echo and prompt log-probs in vLLM's shapes, equal to a float64 log-softmax of the model's
own forward; logit_bias; return_tokens_as_token_ids; per-chunk usage; stop_reason; /tokenizer_info
and /v1/models/{model}; the refusals of what is not implemented; OpenAI's error objects; the API
key and the body limit. Every request carries a timeout."""

import http.client
import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

import torch  # noqa: E402

from minipaged_ops import tiny  # noqa: E402
from minipaged_ops.integration import LLMEngine, SamplingParams  # noqa: E402
from server_helpers import NAME, TIMEOUT, call, serving  # noqa: E402

TOL = 1e-4
KEY = "sk-minipaged-test"
TEMPLATE = "{% for m in messages %}[{{ m.content }}]{% endfor %}"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny.save_tiny_model(tmp_path_factory.mktemp("protocol") / "model")


@pytest.fixture(scope="module")
def reference(folder):
    """(float64 model, tokenizer): log_softmax(ids) -> [len(ids), vocab] float64 log-probs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, attn_implementation="sdpa",
                                                 dtype=torch.float64).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)

    def log_softmax(ids):
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].double().log_softmax(-1)

    return log_softmax, tokenizer


@pytest.fixture(scope="module")
def server(folder):
    llm = LLMEngine.from_pretrained(folder, num_blocks=64, block_size=16, max_num_seqs=8)
    with serving(llm) as (url, engine):
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)


def prompt_ids(tokenizer, text="The paged cache keeps every block it can"):
    return tokenizer.encode(text)


# ---------------------------------------------------------------------------------- echo (lm-eval)


@pytest.mark.parametrize("max_tokens", [0, 1, 3])
def test_echo_with_logprobs_is_the_prompts_logprobs_then_the_completions(server, reference, max_tokens):
    """lm-eval's loglikelihood request: prompt ids, echo, logprobs 1, temperature 0."""
    log_softmax, tokenizer = reference
    ids = prompt_ids(tokenizer)
    status, body = call(server, "/v1/completions", {"model": NAME, "prompt": [ids], "max_tokens": max_tokens,
                                                    "logprobs": 1, "echo": True, "temperature": 0})
    assert status == 200, body
    choice = body["choices"][0]
    lp = choice["logprobs"]
    n = len(ids) + max_tokens
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing predicts the first token
    out_ids = [int(t.removeprefix("token_id:")) for t in call(server, "/v1/completions", {
        "model": NAME, "prompt": ids, "max_tokens": max(max_tokens, 1), "temperature": 0, "logprobs": 0,
        "return_tokens_as_token_ids": True})[1]["choices"][0]["logprobs"]["tokens"]][:max_tokens]
    full = ids + out_ids
    ref = log_softmax(full)
    for i in range(1, n):
        assert abs(lp["token_logprobs"][i] - ref[i - 1, full[i]].item()) < TOL, i
        top = lp["top_logprobs"][i]
        assert tokenizer.decode([full[i]]) in top and len(top) <= 2
        assert abs(max(top.values()) - ref[i - 1].max().item()) < TOL
    assert lp["tokens"] == [tokenizer.decode([t]) for t in full]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(n)]
    assert choice["text"] == tokenizer.decode(ids) + tokenizer.decode(out_ids)
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": max_tokens,
                             "total_tokens": len(ids) + max_tokens}
    assert choice["finish_reason"] == "length"


def test_echo_of_a_text_prompt_without_logprobs_and_max_tokens_zero(client):
    r = client.completions.create(model=NAME, prompt=["Hello there", "x"], max_tokens=0, echo=True)
    assert [c.text for c in r.choices] == ["Hello there", "x"] and r.choices[0].logprobs is None
    assert r.usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError) as e:  # max_tokens 0 means something only with echo
        client.completions.create(model=NAME, prompt="Hello", max_tokens=0)
    assert e.value.body["param"] == "max_tokens"


def test_a_streamed_echo_puts_the_prompt_in_the_first_chunk(client):
    whole = client.completions.create(model=NAME, prompt="Hello there", max_tokens=6, temperature=0, echo=True,
                                      logprobs=2)
    chunks = list(client.completions.create(model=NAME, prompt="Hello there", max_tokens=6, temperature=0, echo=True,
                                            logprobs=2, stream=True))
    assert chunks[0].choices[0].text.startswith("Hello there")
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks for o in c.choices[0].logprobs.text_offset]
    assert tokens == whole.choices[0].logprobs.tokens and offsets == whole.choices[0].logprobs.text_offset
    assert chunks[0].choices[0].logprobs.token_logprobs[0] is None


# ---------------------------------------------------------------------------------- prompt_logprobs


def check_prompt_logprobs(entries, ids, ref, k):
    assert entries[0] is None and len(entries) == len(ids)
    for i in range(1, len(ids)):
        entry = entries[i]
        assert str(ids[i]) in entry and len(entry) <= k + 1
        assert abs(entry[str(ids[i])]["logprob"] - ref[i - 1, ids[i]].item()) < TOL
        if k:
            best = next(v for v in entry.values() if v["rank"] == 1)
            assert abs(best["logprob"] - ref[i - 1].max().item()) < TOL


def test_prompt_logprobs_on_both_endpoints(server, reference):
    log_softmax, tokenizer = reference
    ids = prompt_ids(tokenizer)
    status, body = call(server, "/v1/completions", {"model": NAME, "prompt": ids, "max_tokens": 2,
                                                    "prompt_logprobs": 3})
    assert status == 200, body
    check_prompt_logprobs(body["choices"][0]["prompt_logprobs"], ids, log_softmax(ids), 3)
    messages = [{"role": "user", "content": "hi there"}]
    chat_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    status, body = call(server, "/v1/chat/completions", {"model": NAME, "messages": messages, "max_tokens": 2,
                                                         "prompt_logprobs": 0})
    assert status == 200, body
    check_prompt_logprobs(body["prompt_logprobs"], list(chat_ids), log_softmax(list(chat_ids)), 0)
    status, body = call(server, "/v1/completions", {"model": NAME, "prompt": ids, "prompt_logprobs": 1,
                                                    "stream": True})
    assert status == 400 and body["error"]["param"] == "prompt_logprobs"  # as vLLM: not with a stream


# ---------------------------------------------------------------------------------- logit_bias


def greedy_ids(client, prompt, n_tokens, **extra):
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=n_tokens, temperature=0, logprobs=0,
                                  extra_body={"return_tokens_as_token_ids": True, **extra.pop("extra_body", {})},
                                  **extra)
    return [int(t.removeprefix("token_id:")) for t in r.choices[0].logprobs.tokens], r


def test_logit_bias_bans_and_forces_tokens_and_logprobs_stay_raw(client, reference):
    log_softmax, tokenizer = reference
    ids = prompt_ids(tokenizer)
    ref = log_softmax(ids)[-1]
    first, second = ref.topk(2).indices.tolist()
    assert greedy_ids(client, ids, 1)[0] == [first]
    assert greedy_ids(client, ids, 1, logit_bias={str(first): -100})[0] == [second]
    forced = int(ref.argmin())  # the least likely token
    got, r = greedy_ids(client, ids, 3, logit_bias={str(forced): 100})
    assert got == [forced] * 3
    assert abs(r.choices[0].logprobs.token_logprobs[0] - ref[forced].item()) < TOL  # the raw model's, not biased
    sampled = client.completions.create(model=NAME, prompt=ids, max_tokens=4, temperature=1.0, n=3, seed=7,
                                        logit_bias={str(forced): 100}, logprobs=0,
                                        extra_body={"return_tokens_as_token_ids": True})
    assert all(c.logprobs.tokens == [f"token_id:{forced}"] * 4 for c in sampled.choices)
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          temperature=0, logit_bias={str(forced): 100}, logprobs=True,
                                          extra_body={"return_tokens_as_token_ids": True})
    assert [e.token for e in chat.choices[0].logprobs.content] == [f"token_id:{forced}"] * 2


@pytest.mark.parametrize("bias", [{"100000": 1}, {"abc": 1}, {"-1": 1}, {"5": 100.5}, {"5": "big"}])
def test_a_bad_logit_bias_is_refused_naming_it(server, bias):
    status, body = call(server, "/v1/completions", {"model": NAME, "prompt": "hi", "logit_bias": bias})
    assert status == 400 and body["error"]["param"] == "logit_bias", body


def test_the_engine_takes_logit_bias_as_sampling_params(folder):
    llm = LLMEngine.from_pretrained(folder, num_blocks=16, block_size=16)
    vocab = llm.config.vocab_size
    with pytest.raises(ValueError, match="logit_bias"):
        llm.add_request("r", [1, 2, 3], SamplingParams(logit_bias={vocab: 1.0}))
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={3: 101})
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, logit_bias={vocab - 1: 100}), use_tqdm=False)
    assert out[0].outputs[0].token_ids == [vocab - 1] * 3
    assert not llm.has_unfinished_requests()


# ---------------------------------------------------------------------------------- vLLM's extras


def test_continuous_usage_stats_and_stop_reason(client, reference):
    _, tokenizer = reference
    ids = prompt_ids(tokenizer)
    out, _ = greedy_ids(client, ids, 4)
    chunks = list(client.completions.create(model=NAME, prompt=ids, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True},
                                            extra_body={"stop_token_ids": [out[2]]}))
    *pieces, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 3
    counts = [c.usage.completion_tokens for c in pieces]
    assert counts == sorted(counts) and counts[-1] == 3 and all(c.usage.prompt_tokens == len(ids) for c in pieces)
    assert pieces[-1].choices[0].finish_reason == "stop"
    assert pieces[-1].choices[0].model_extra["stop_reason"] == out[2]
    whole = client.completions.create(model=NAME, prompt=ids, max_tokens=8, temperature=0,
                                      extra_body={"stop_token_ids": [out[2]]})
    assert whole.choices[0].model_extra["stop_reason"] == out[2]
    plain = client.completions.create(model=NAME, prompt=ids, max_tokens=2, temperature=0)
    assert plain.choices[0].model_extra["stop_reason"] is None


def test_tokenizer_info_and_model_retrieve(server, client, reference):
    _, tokenizer = reference
    status, info = call(server, "/tokenizer_info")
    assert status == 200 and info["eos_token"] == tokenizer.eos_token
    assert info["chat_template"] == tokenizer.chat_template and info["tokenizer_class"] == type(tokenizer).__name__
    json.dumps(info)
    model = client.models.retrieve(NAME)
    assert model.id == NAME and model.model_dump() == client.models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("nope")
    assert e.value.body["code"] == "model_not_found"


# ---------------------------------------------------------------------------------- refusals and errors


REFUSED = [
    ("/v1/completions", {"suffix": "end"}, "suffix"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"guided_json": {"type": "object"}}, "guided_json"),
    ("/v1/completions", {"temprature": 0.5}, "temprature"),  # a typo is not ignored
    ("/v1/chat/completions", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ("/v1/chat/completions", {"reasoning_effort": "low"}, "reasoning_effort"),
    ("/tokenize", {"prompt": "hi", "nonsense": 1}, "nonsense"),
]


def body_for(path, extra):
    base = {"model": NAME, "max_tokens": 2}
    if path == "/tokenize":
        return extra
    base.update({"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]})
    return {**base, **extra}


@pytest.mark.parametrize("path, extra, param", REFUSED)
def test_what_is_not_implemented_is_refused_naming_the_field(server, path, extra, param):
    status, body = call(server, path, body_for(path, extra))
    assert status == 400 and body["error"]["param"] == param and param in body["error"]["message"], body


@pytest.mark.parametrize("path, extra", [
    ("/v1/completions", {"user": "u1", "best_of": 1, "suffix": None, "store": False, "metadata": {"a": "b"},
                         "service_tier": "auto", "seed": 3}),
    ("/v1/chat/completions", {"user": "u1", "modalities": ["text"], "store": True, "metadata": {"a": "b"},
                              "service_tier": "default", "prompt_cache_key": "k", "safety_identifier": "s",
                              "response_format": None, "tools": None}),
])
def test_informational_fields_and_do_nothing_values_are_accepted(server, path, extra):
    status, body = call(server, path, body_for(path, extra))
    assert status == 200 and body["usage"]["completion_tokens"] == 2, body


def test_errors_are_openai_error_objects(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="hi")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    for method, path, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405),
                                 ("DELETE", "/v1/models", 405)):
        got, body = call(server, path, method=method)
        assert got == status and set(body["error"]) == {"message", "type", "param", "code"}, body
        assert path in body["error"]["message"]
    status, body = call(server, "/v1/completions", data=b'{"model": "tiny-qwen3", "prompt": ')
    assert status == 400 and body["error"]["param"] is None and "not valid JSON" in body["error"]["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt=[7] * 2000)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], logprobs=True,
                                       top_logprobs=21)
    assert e.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="hi", logprobs=21)
    assert e.value.body["param"] == "logprobs"
    status, body = call(server, "/v1/completions", {"model": NAME, "prompt": "hi", "prompt_logprobs": 21})
    assert status == 400 and body["error"]["param"] == "prompt_logprobs"


# ---------------------------------------------------------------------------------- API key, body limit


@pytest.fixture(scope="module")
def guarded(folder):
    llm = LLMEngine.from_pretrained(folder, num_blocks=32, block_size=16, max_num_seqs=4, max_logprobs=-1)
    with serving(llm, app_kwargs=dict(api_key=KEY, max_body_bytes=4096, chat_template=TEMPLATE)) as (url, _):
        yield url, llm


def test_the_api_key_guards_the_api_and_leaves_health_open(guarded):
    url, _ = guarded
    right = {"Authorization": f"Bearer {KEY}"}
    for path, body in (("/v1/models", None), ("/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 1}),
                       ("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]}), ("/tokenizer_info", None),
                       ("/v1/nothing", None)):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            status, answer = call(url, path, body, headers=headers)
            assert status == 401 and answer["error"]["code"] == "invalid_api_key", (path, headers, answer)
        assert call(url, path, body, headers=right)[0] == (404 if path == "/v1/nothing" else 200), path
    for path in ("/health", "/version", "/metrics"):
        assert call(url, path)[0] == 200, path
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0, timeout=TIMEOUT).models.list()
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT)
    assert client.completions.create(model=NAME, prompt="hi", max_tokens=2).usage.completion_tokens == 2


def test_a_body_over_the_limit_is_413_announced_or_chunked(guarded):
    url, _ = guarded
    big = {"model": NAME, "prompt": "x" * 5000}
    status, body = call(url, "/v1/completions", big, headers={"Authorization": f"Bearer {KEY}"})
    assert status == 413 and body["error"]["message"], body
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT)
    try:
        payload = json.dumps(big).encode()
        conn.request("POST", "/v1/completions", body=iter([payload[i:i + 1000] for i in range(0, len(payload), 1000)]),
                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
                     encode_chunked=True)
        response = conn.getresponse()
        assert response.status == 413 and json.loads(response.read())["error"]["message"]
    finally:
        conn.close()
    assert call(url, "/health")[0] == 200


def test_chat_template_and_max_logprobs_of_the_whole_vocabulary(guarded, reference):
    url, llm = guarded
    _, tokenizer = reference
    right = {"Authorization": f"Bearer {KEY}"}
    status, tok = call(url, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}, headers=right)
    assert status == 200 and tok["tokens"] == tokenizer.encode("[hi]", add_special_tokens=False)
    assert call(url, "/tokenizer_info", headers=right)[1]["chat_template"] == TEMPLATE
    vocab = llm.config.vocab_size
    status, body = call(url, "/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 1, "logprobs": vocab,
                                                 "return_tokens_as_token_ids": True},  # (texts collide: byte tokens)
                        headers=right)
    assert status == 200 and len(body["choices"][0]["logprobs"]["top_logprobs"][0]) == vocab


def test_engine_caps_max_logprobs_and_max_model_len(folder):
    llm = LLMEngine.from_pretrained(folder, num_blocks=16, block_size=16, max_logprobs=2, max_model_len=100)
    assert llm.max_model_len == 100
    with pytest.raises(ValueError, match="logprobs=3 exceeds the engine's max_logprobs=2"):
        llm.add_request("r", [1, 2], SamplingParams(logprobs=3))
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.add_request("r", [1, 2], SamplingParams(prompt_logprobs=3))
    with pytest.raises(ValueError, match="prompt of 'r' has 100 tokens"):
        llm.add_request("r", [1] * 100, SamplingParams())
    with pytest.raises(ValueError, match="max_model_len=300 exceeds the KV pool's tokens"):
        LLMEngine.from_pretrained(folder, num_blocks=16, block_size=16, max_model_len=300)
    with pytest.raises(ValueError, match="max_logprobs"):
        LLMEngine.from_pretrained(folder, num_blocks=16, block_size=16, max_logprobs=-2)
