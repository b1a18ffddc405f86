"""Clients nobody here wrote, against a real server on 127.0.0.1 (stopped at the end): lm-eval's
``local-completions`` running a multiple-choice, a perplexity and a generate_until task on local
files (tests/lm_eval_tasks; nothing downloaded), its log-likelihoods equal to a float64
log-softmax of the model's own forward over the same tokens; guidellm running a short fixed load
with no failed request; schemathesis against the server's OpenAPI schema (a bounded number of
generated requests: no 500, every answer in its documented shape, the server healthy after)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import torch  # noqa: E402

from minipaged_ops import tiny  # noqa: E402
from minipaged_ops.integration import LLMEngine  # noqa: E402
from server_helpers import NAME, TIMEOUT, call, serving  # noqa: E402

TASKS = Path(__file__).resolve().parent / "lm_eval_tasks"
TOL = 1e-4


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny.save_tiny_model(tmp_path_factory.mktemp("clients") / "model")


@pytest.fixture(scope="module")
def float64_model(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, attn_implementation="sdpa",
                                                dtype=torch.float64).eval()


def reference_loglikelihood(model, context: list[int], continuation: list[int]) -> float:
    """sum of log p(continuation | context), float64 over the model's own forward."""
    ids = context + continuation
    with torch.no_grad():
        logprobs = model(torch.tensor([ids])).logits[0].double().log_softmax(-1)
    return sum(logprobs[len(context) + i - 1, t].item() for i, t in enumerate(continuation))


def lm_eval_tasks() -> list[dict]:
    def data(name):
        return {"data_files": {"test": str(TASKS / name)}}

    return [
        {"task": "minipaged_choices", "dataset_path": "json", "dataset_kwargs": data("choices.jsonl"),
         "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "{{question}}",
         "doc_to_choice": "{{choices}}", "doc_to_target": "{{answer}}", "target_delimiter": " ",
         "metric_list": [{"metric": "acc"}]},
        {"task": "minipaged_perplexity", "dataset_path": "json", "dataset_kwargs": data("texts.jsonl"),
         "test_split": "test", "output_type": "loglikelihood_rolling", "doc_to_text": "",
         "doc_to_target": "{{text}}", "metric_list": [{"metric": "word_perplexity"}]},
        {"task": "minipaged_generate", "dataset_path": "json", "dataset_kwargs": data("prompts.jsonl"),
         "test_split": "test", "output_type": "generate_until", "doc_to_text": "{{prompt}}",
         "doc_to_target": "", "generation_kwargs": {"until": ["{{until}}"], "max_gen_toks": 12, "do_sample": False},
         "metric_list": [{"metric": "exact_match"}]},
    ]


def test_lm_eval_local_completions_matches_the_float64_model(folder, float64_model, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OPENAI_API_KEY", "unused")
    llm = LLMEngine.from_pretrained(folder, num_blocks=64, block_size=16, max_num_seqs=8)
    with serving(llm) as (url, _):
        # no tokenizer given: lm-eval finds /tokenizer_info and /tokenize and uses the server's
        lm = LocalCompletionsAPI(base_url=url + "/v1/completions", model=NAME, max_length=256, num_concurrent=1,
                                 max_retries=1, timeout=TIMEOUT)
        assert lm.tokenizer_backend == "remote"
        results = lm_eval.simple_evaluate(model=lm, tasks=lm_eval_tasks(), task_manager=TaskManager(),
                                          log_samples=True, bootstrap_iters=0, random_seed=0)
        assert call(url, "/health")[0] == 200
        check_lm_eval_samples(lm, results["samples"], float64_model)  # (lm encodes through the server)


def check_lm_eval_samples(lm, samples, float64_model):
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    choices = samples["minipaged_choices"]
    assert len(choices) == 4
    for sample in choices:
        for (context, continuation), (resp,) in zip(sample["arguments"], sample["resps"]):
            ll, _ = resp
            ctx, cont = lm._encode_pair(context, continuation)
            assert abs(float(ll) - reference_loglikelihood(float64_model, ctx, cont)) < TOL, (context, continuation)
    perplexity = samples["minipaged_perplexity"]
    assert len(perplexity) == 3
    for sample in perplexity:
        (text,) = sample["arguments"][0]
        windows = map(make_disjoint_window, get_rolling_token_windows(
            token_list=lm.tok_encode(text), prefix_token=lm.prefix_token_id, max_seq_len=lm.max_length - 1,
            context_len=1))
        expected = sum(reference_loglikelihood(float64_model, ctx, cont) for ctx, cont in windows)
        assert abs(float(sample["resps"][0][0]) - expected) < TOL, text
    generated = samples["minipaged_generate"]
    assert len(generated) == 2
    for sample in generated:
        context, kwargs = sample["arguments"][0]
        ids = lm.tok_encode(context)
        with torch.no_grad():
            out = float64_model.generate(torch.tensor([ids]), max_new_tokens=kwargs["max_gen_toks"], do_sample=False)
        new = out[0, len(ids):].tolist()
        eos = lm.tokenizer.eos_token_id
        text = lm.tokenizer.decode(new[:new.index(eos)] if eos in new else new)
        for stop in kwargs["until"]:
            text = text.split(stop)[0]
        assert sample["resps"][0][0] == text, context


# ---------------------------------------------------------------------------------- schemathesis


SCHEMATHESIS_CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"


def test_schemathesis_finds_no_500_and_every_answer_documented(folder, tmp_path):
    """Requests generated from /openapi.json (valid and invalid, a bounded number per operation,
    a fixed seed): none gets a 500, each answer's status, content type and body are the ones the
    schema documents; the server is healthy afterwards. max_model_len 32 keeps every generation short."""
    st = Path(sys.executable).with_name("st")
    if not st.exists():
        pytest.skip("schemathesis is not installed (the test extra)")
    llm = LLMEngine.from_pretrained(folder, num_blocks=32, block_size=16, max_num_seqs=4, max_model_len=32)
    with serving(llm) as (url, _):
        run = subprocess.run(
            [str(st), "run", f"{url}/openapi.json", "--checks", SCHEMATHESIS_CHECKS, "--phases", "coverage,fuzzing",
             "--max-examples", "12", "--seed", "1", "--workers", "1", "--request-timeout", "30",
             "--generation-database", "none", "--max-failures", "5", "--no-color", "--suppress-health-check", "all"],
            capture_output=True, text=True, timeout=600, cwd=tmp_path,  # (its .schemathesis folder)
            env={**os.environ, "SCHEMATHESIS_TELEMETRY": "false"})
        assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
        assert call(url, "/health")[0] == 200
        status, body = call(url, "/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 2})
        assert status == 200 and body["usage"]["completion_tokens"] == 2


# ---------------------------------------------------------------------------------- guidellm


def test_guidellm_runs_a_fixed_load_with_no_failed_request(folder, tmp_path):
    """guidellm's openai_http backend (streamed /v1/completions with ignore_eos and vLLM's
    stream_options.continuous_usage_stats): 6 synthetic requests, 2 at a time, every one
    successful with the 8 tokens asked for, the server healthy afterwards."""
    guidellm = Path(sys.executable).with_name("guidellm")
    if not guidellm.exists():
        pytest.skip("guidellm is not installed (the test extra)")
    llm = LLMEngine.from_pretrained(folder, num_blocks=64, block_size=16, max_num_seqs=4)
    report = tmp_path / "guidellm.json"
    with serving(llm) as (url, _):
        run = subprocess.run(
            [str(guidellm), "run", "--backend", f"kind=openai_http,target={url},model={NAME}",
             "--profile", "kind=concurrent,streams=2", "--constraint", "kind=max_requests,count=6",
             "--data", "kind=synthetic_text,prompt_tokens=16,output_tokens=8",
             "--tokenizer", f"kind=huggingface_auto,model={folder}", "--output", f"kind=json,path={report}",
             "--disable-console-interactive"],
            capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert call(url, "/health")[0] == 200
    benchmark = json.loads(report.read_text())["benchmarks"][0]
    assert benchmark["metrics"]["request_totals"] == {"successful": 6, "errored": 0, "incomplete": 0, "total": 6}
    assert all(r["output_tokens"] == 8 for r in benchmark["requests"]["successful"])
