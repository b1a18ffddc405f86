"""The batched sampler and SamplingParams.

Every control is checked on fresh random logits of a batch whose rows all carry different
parameters, against transformers' own logits processors where transformers has the control
(repetition penalty, min_new_tokens, temperature, min_p, top_k, top_p) and against a direct
float64 computation where it has not (presence and frequency penalties, log-probabilities)."""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass

import pytest
import torch

from minipaged_ops.integration.engine.sampler import (
    InvalidLogitsError, Sampler, draw_uniform, prompt_logprobs)
from minipaged_ops.integration.engine.sampling_params import MAX_LOGPROBS, SamplingParams

lp = pytest.importorskip("transformers.generation.logits_process")

EOS = 2


@dataclass
class Row:
    params: SamplingParams
    prompt_token_ids: list
    output_ids: list
    seed: int = 0
    eos_token_ids: frozenset = frozenset([EOS])


def random_params(rng: random.Random, greedy: bool) -> SamplingParams:
    """Each control on with probability 1/2, at a random strength."""
    def maybe(value, off):
        return value if rng.random() < 0.5 else off

    return SamplingParams(
        temperature=rng.choice([0.0, 1e-6]) if greedy else rng.uniform(0.3, 1.7),
        top_k=maybe(rng.randrange(1, 40), 0), top_p=maybe(rng.uniform(0.3, 0.99), 1.0),
        min_p=maybe(rng.uniform(0.01, 0.3), 0.0), repetition_penalty=maybe(rng.uniform(0.5, 2.0), 1.0),
        presence_penalty=maybe(rng.uniform(-2, 2), 0.0), frequency_penalty=maybe(rng.uniform(-2, 2), 0.0),
        min_tokens=maybe(rng.randrange(0, 12), 0), max_tokens=64,
        stop_token_ids=maybe([rng.randrange(100)], []), seed=rng.randrange(1 << 40),
        logit_bias=maybe({rng.randrange(100): rng.uniform(-100, 100) for _ in range(rng.randrange(1, 4))}, None))


def random_rows(rng: random.Random, count: int, vocab: int) -> list[Row]:
    rows = []
    for i in range(count):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        output = [rng.randrange(vocab) for _ in range(rng.randrange(0, 20))] + [prompt[0]] * rng.randrange(3)
        rows.append(Row(random_params(rng, greedy=i % 3 == 0), prompt, output, seed=rng.randrange(1 << 62)))
    return rows


def expected_logits(logits: torch.Tensor, row: Row) -> torch.Tensor:
    """One row through transformers' processors in vLLM's order (float64), and OpenAI's
    presence/frequency rule computed directly."""
    p = row.params
    ids = torch.tensor([row.prompt_token_ids + row.output_ids])
    scores = logits[None].double()
    banned = sorted({*row.eos_token_ids, *p.stop_token_ids})
    scores = lp.MinNewTokensLengthLogitsProcessor(len(row.prompt_token_ids), p.min_tokens, banned)(ids, scores)
    for token, bias in p.logit_bias:  # added before the penalties
        scores[0, token] += bias
    if p.repetition_penalty != 1:
        scores = lp.RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, scores)
    for token, count in Counter(row.output_ids).items():
        scores[0, token] -= p.frequency_penalty * count + p.presence_penalty
    if p.temperature >= 1e-5:
        scores = lp.TemperatureLogitsWarper(p.temperature)(ids, scores)
        if p.min_p > 0:
            scores = lp.MinPLogitsWarper(p.min_p)(ids, scores)
        if p.top_k > 0:
            scores = lp.TopKLogitsWarper(p.top_k)(ids, scores)
        if p.top_p < 1:
            scores = lp.TopPLogitsWarper(p.top_p)(ids, scores)
    return scores[0]


@pytest.mark.parametrize("seed", range(6))
def test_controls_match_transformers_in_one_batch(seed):
    rng = random.Random(seed)
    vocab = 211
    rows = random_rows(rng, 24, vocab)
    logits = torch.randn(len(rows), vocab + 5, generator=torch.Generator().manual_seed(seed)) * 3
    sampler = Sampler(vocab, "cpu")
    got = sampler.processed_logits(logits, rows)
    for i, row in enumerate(rows):
        want = expected_logits(logits[i, :vocab], row)
        assert torch.equal(torch.isinf(got[i]), torch.isinf(want)), (i, row.params)
        finite = torch.isfinite(want)
        torch.testing.assert_close(got[i][finite].double(), want[finite], rtol=1e-5, atol=1e-5)
    tokens = [t.token_id for t in sampler(logits.clone(), rows)]  # the sampler works in place
    for i, row in enumerate(rows):
        want = expected_logits(logits[i, :vocab], row)
        if row.params.greedy:
            assert tokens[i] == int(want.argmax()), (i, row.params)
        else:
            assert math.isfinite(want[tokens[i]]), (i, row.params)  # drawn from what the filters keep


def test_top_p_in_a_large_vocabulary():
    """Peaked rows find their nucleus among the top candidates, flat ones need the full sort:
    both as transformers' TopPLogitsWarper (after min_p and top_k)."""
    vocab = 3000
    rng = random.Random(7)
    rows = random_rows(rng, 16, vocab)
    for i, row in enumerate(rows):
        row.params = SamplingParams(**{**row.params.__dict__, "temperature": 1.0, "top_p": rng.uniform(0.5, 0.98)})
    scale = torch.tensor([8.0 if i % 2 else 0.3 for i in range(len(rows))])[:, None]
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(7)) * scale
    got = Sampler(vocab, "cpu").processed_logits(logits, rows)
    kept = torch.isfinite(got).sum(-1)
    assert kept.max() > 1024 and kept.min() < 1024  # both paths ran
    for i, row in enumerate(rows):
        want = expected_logits(logits[i], row)
        assert torch.equal(torch.isinf(got[i]), torch.isinf(want)), (i, row.params)


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    vocab = 50
    logits = torch.full((3, vocab), -5.0)
    logits[:, EOS] = 10.0
    logits[:, 7] = 9.0
    logits[:, 8] = 1.0
    params = SamplingParams(min_tokens=3, stop_token_ids=[7])
    rows = [Row(params, [1], [4] * n) for n in (0, 2, 3)]
    assert [t.token_id for t in Sampler(vocab, "cpu")(logits, rows)] == [8, 8, EOS]


def test_penalties_apply_to_greedy_rows_and_only_where_tokens_occur():
    vocab = 10
    logits = torch.arange(vocab, dtype=torch.float32).repeat(3, 1) - 2.0  # -2 .. 7
    rows = [Row(SamplingParams(repetition_penalty=4.0), [9, 0], []),  # 7/4 < 6: token 8 wins
            Row(SamplingParams(frequency_penalty=0.6), [1], [9, 9]),  # 7 - 1.2 < 6: token 8
            Row(SamplingParams(presence_penalty=2.0), [9], [3])]  # prompt tokens are not penalized
    assert [t.token_id for t in Sampler(vocab, "cpu")(logits, rows)] == [8, 8, 9]


def test_draws_are_a_pure_function_of_seed_and_position():
    vocab = 64
    sampler = Sampler(vocab, "cpu")
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0)
    rows = [Row(params, [1], [5] * position, seed=seed) for seed in range(20) for position in range(10)]
    batch = logits.expand(len(rows), vocab)
    first = [t.token_id for t in sampler(batch, rows)]
    # alone, in another order, in another batch: the same token for the same (seed, position)
    order = list(range(len(rows)))
    random.Random(1).shuffle(order)
    shuffled = [t.token_id for t in sampler(batch, [rows[i] for i in order])]
    assert [shuffled[order.index(i)] for i in range(len(rows))] == first
    for i in (0, 37, 199):
        assert sampler(logits.clone(), [rows[i]])[0].token_id == first[i]
    other = Row(SamplingParams(temperature=1.0, top_k=vocab - 1, presence_penalty=1e-30), [2, 3], [9] * 4, seed=3)
    assert sampler(logits.clone(), [other])[0].token_id == first[3 * 10 + 4]  # only (seed, position) matter
    assert len(set(first)) > 20  # and the draws do vary with both
    assert len({first[s * 10] for s in range(20)}) > 5 and len(set(first[:10])) > 3


def test_draws_follow_the_filtered_distribution():
    vocab = 12
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(5)) * 2
    params = SamplingParams(temperature=0.8, top_k=8, top_p=0.9, seed=0)
    rows = [Row(params, [1], [0] * (i % 5), seed=i) for i in range(20000)]
    sampler = Sampler(vocab, "cpu")
    probs = sampler.processed_logits(logits, rows[:1])[0].double().softmax(-1)
    tokens = [t.token_id for t in sampler(logits.expand(len(rows), vocab), rows)]
    counts = torch.bincount(torch.tensor(tokens), minlength=vocab).double()
    assert counts[probs == 0].sum() == 0
    expected = probs * len(rows)
    kept = probs > 0
    chi2 = float(((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum())
    assert chi2 < 30, (chi2, counts, expected)  # ~99.99th percentile at <= 7 degrees of freedom


def test_uniform_hash_is_uniform_and_position_sensitive():
    values = torch.tensor([draw_uniform(s, p) for s in range(200) for p in range(50)], dtype=torch.float64)
    assert 0 <= float(values.min()) and float(values.max()) < 1
    hist = torch.histc(values, bins=10, min=0, max=1)
    assert float(hist.min()) > 850 and float(hist.max()) < 1150
    assert draw_uniform(7, 3) == draw_uniform(7, 3) != draw_uniform(7, 4) != draw_uniform(8, 3)
    assert draw_uniform(-1, 0) == draw_uniform((1 << 64) - 1, 0)  # seeds are taken mod 2**64


@pytest.mark.parametrize("temperature", [0.0, 1e-320, 1e-8, 9.9e-6])
def test_temperature_below_1e_5_is_greedy(temperature):
    vocab = 40
    logits = torch.randn(30, vocab, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(temperature=temperature, top_k=3, top_p=0.5, min_p=0.2, seed=1)
    assert params.greedy and not SamplingParams(temperature=1e-5).greedy
    rows = [Row(params, [1], [0] * i, seed=i) for i in range(30)]
    assert [t.token_id for t in Sampler(vocab, "cpu")(logits.clone(), rows)] == logits.argmax(-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_are_of_the_raw_distribution(dtype):
    """Taken before penalties, temperature and filters, also when float32 logits are processed in place."""
    rng = random.Random(3)
    vocab = 97
    rows = random_rows(rng, 12, vocab)
    for i, row in enumerate(rows):
        # every row is processed (a penalty at least), so float32 logits are changed in place
        row.params = SamplingParams(**{**row.params.__dict__, "logprobs": [0, 1, 5, MAX_LOGPROBS][i % 4],
                                       "presence_penalty": 0.5})
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(3)).to(dtype)
    raw = logits.double().log_softmax(-1)
    out = Sampler(vocab, "cpu")(logits, rows)
    for i, (row, token) in enumerate(zip(rows, out)):
        k = row.params.logprobs  # bfloat16 logits tie: compare the top k by value
        assert token.token_id in token.logprobs and len(token.logprobs) in (k, k + 1)
        top = sorted(token.logprobs.values(), reverse=True)[:k]
        torch.testing.assert_close(torch.tensor(top, dtype=torch.float64), raw[i].topk(k).values, rtol=0, atol=1e-5)
        for t, value in token.logprobs.items():
            assert value == pytest.approx(float(raw[i, t]), abs=1e-5)


def test_prompt_logprobs_against_float64():
    vocab = 150
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(300, vocab + 2, generator=gen) * 4  # > one slice of rows; a padded lm_head
    next_ids = torch.randint(0, vocab, (300,), generator=gen)
    counts = [i % 7 for i in range(300)]
    raw = logits[:, :vocab].double().log_softmax(-1)
    for k in (counts, 3, 0):
        entries = Sampler(vocab, "cpu").prompt_logprobs(logits, next_ids, k)
        assert len(entries) == 300
        for i, entry in enumerate(entries):
            n = k[i] if isinstance(k, list) else k
            assert set(entry) == set(raw[i].topk(n).indices.tolist()) | {int(next_ids[i])}
            for t, value in entry.items():
                assert value == pytest.approx(float(raw[i, t]), abs=1e-5)
    with pytest.raises(ValueError, match="next token ids"):
        prompt_logprobs(logits, next_ids[:5], 1)


@pytest.mark.parametrize("where", ["nan", "+inf", "all -inf", "masked away", "nan where masked", "nan greedy",
                                   "nan prompt"])
def test_invalid_logits_raise_a_clear_error(where):
    vocab = 30
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(6))
    rows = [Row(SamplingParams(temperature=0.9, top_p=0.8), [1], [3]) for _ in range(4)]
    if where in ("nan", "nan prompt"):
        logits[2, 5] = math.nan
    elif where == "+inf":
        logits[2, 5] = math.inf
    elif where == "all -inf":
        logits[2] = -math.inf
    elif where == "masked away":  # only EOS is possible, and min_tokens forbids it
        logits[2] = -math.inf
        logits[2, EOS] = 1.0
        rows[2] = Row(SamplingParams(min_tokens=5), [1], [])
    elif where == "nan where masked":  # min_tokens masks EOS: its NaN still makes the row invalid
        logits[2, EOS] = math.nan
        rows[2] = Row(SamplingParams(min_tokens=5, temperature=0.5), [1], [])
    elif where == "nan greedy":
        logits[2, 5] = math.nan
        rows = [Row(SamplingParams(), [1], [3]) for _ in range(4)]
    with pytest.raises(InvalidLogitsError, match=r"rows \[2\]" if where != "nan prompt" else "NaN"):
        if where == "nan prompt":
            prompt_logprobs(logits, [1, 2, 3, 4], 2)
        else:
            Sampler(vocab, "cpu")(logits, rows)


def test_logits_of_the_wrong_shape():
    sampler = Sampler(30, "cpu")
    with pytest.raises(ValueError, match="expected"):
        sampler(torch.zeros(2, 29), [Row(SamplingParams(), [1], [])] * 2)
    with pytest.raises(ValueError, match="expected"):
        sampler(torch.zeros(3, 30), [Row(SamplingParams(), [1], [])] * 2)
    assert sampler(torch.zeros(0, 30), []) == []
    with pytest.raises(ValueError, match="vocab_size"):
        Sampler(0, "cpu")


@pytest.mark.parametrize("kwargs, field", [
    (dict(n=0), "n"), (dict(temperature=-0.1), "temperature"), (dict(temperature=math.nan), "temperature"),
    (dict(temperature=math.inf), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(top_k=2.5), "top_k"), (dict(min_p=1.1), "min_p"), (dict(min_p=-0.1), "min_p"),
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-2.1), "frequency_penalty"),
    (dict(frequency_penalty=math.nan), "frequency_penalty"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=-1.0), "repetition_penalty"), (dict(repetition_penalty=math.inf), "repetition_penalty"),
    (dict(min_tokens=-1), "min_tokens"), (dict(max_tokens=4, min_tokens=5), "min_tokens"),
    (dict(max_tokens=0), "max_tokens"), (dict(logit_bias={3: 101}), "logit_bias"), (dict(logprobs=-1), "logprobs"),
    (dict(logit_bias={-1: 1}), "logit_bias"), (dict(logit_bias={3: True}), "logit_bias"),
    (dict(logit_bias=[(1, 2, 3)]), "logit_bias"), (dict(prompt_logprobs=True), "prompt_logprobs"),
    (dict(stop=""), "stop"), (dict(stop=["a", ""]), "stop"), (dict(stop=[3]), "stop"), (dict(stop=5), "stop"),
    (dict(include_stop_str_in_output=1), "include_stop_str_in_output"), (dict(seed=1.5), "seed"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(ignore_eos="yes"), "ignore_eos"),
    (dict(skip_special_tokens=None), "skip_special_tokens"), (dict(presence_penalty=True), "presence_penalty"),
])
def test_bad_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^SamplingParams: {field} must be .*, got "):
        SamplingParams(**kwargs)


def test_params_normalized():
    p = SamplingParams(stop="end", stop_token_ids=[5, 6], top_k=-1, logprobs=MAX_LOGPROBS, prompt_logprobs=0)
    assert p.stop == ("end",) and p.stop_token_ids == (5, 6) and p.top_k == 0
    assert SamplingParams(stop=["a", "b", "a"]).stop == ("a", "b") and SamplingParams(stop=None).stop == ()
    assert SamplingParams(max_tokens=3, min_tokens=3).min_tokens == 3
    assert not SamplingParams().has_penalties and SamplingParams(presence_penalty=0.1).has_penalties


# ---------------------------------------------------------------- through the engine


def engine_and_model(**engine_kwargs):
    from minipaged_ops.integration import LLMEngine
    from minipaged_ops.tiny import tiny_model

    model = tiny_model("qwen3", seed=11, vocab=160)
    engine = LLMEngine(model, num_blocks=96, block_size=4, max_num_batched_tokens=32, max_num_seqs=8, **engine_kwargs)
    return engine, model


def test_engine_repetition_penalty_and_min_tokens_equal_transformers_generate():
    """Greedy through the engine against model.generate with transformers' own processors; EOS is
    a token the plain greedy run emits early, so min_tokens has something to hold back."""
    from minipaged_ops.integration import LLMEngine

    engine, model = engine_and_model()
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 160) for _ in range(n)] for n in (5, 12, 3)]
    plain = engine.generate(prompts, SamplingParams(max_tokens=12), use_tqdm=False)
    eos = plain[0].outputs[0].token_ids[1]
    model.generation_config.eos_token_id = eos
    engine = LLMEngine(model, num_blocks=96, block_size=4, max_num_batched_tokens=32, max_num_seqs=8)
    for repetition, min_tokens in ((1.0, 0), (1.3, 0), (1.0, 6), (0.7, 6)):
        params = SamplingParams(max_tokens=12, repetition_penalty=repetition, min_tokens=min_tokens)
        outs = engine.generate(prompts, params, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            with torch.no_grad():
                ref = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=eos,
                                     repetition_penalty=repetition, min_new_tokens=min_tokens, pad_token_id=0)
            assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist(), (repetition, min_tokens, prompt)
    assert any(eos in out.outputs[0].token_ids[:6] for out in plain)  # min_tokens did hold EOS back


def test_engine_presence_and_frequency_penalties_equal_a_float64_loop():
    engine, model = engine_and_model()
    prompt = [5, 9, 13, 9, 5, 40]
    params = SamplingParams(max_tokens=10, presence_penalty=1.5, frequency_penalty=0.8)
    got = engine.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    ids, output = list(prompt), []
    for _ in range(10):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].double()
        for token, count in Counter(output).items():
            logits[token] -= 0.8 * count + 1.5
        output.append(int(logits.argmax()))
        ids.append(output[-1])
    assert got == output
