"""Structured outputs in LLMEngine: every constrained output is checked by xgrammar-independent
means (``jsonschema``, ``json.loads``, ``re.fullmatch``, membership), and whatever the engine
does around a request (n = 3, preemption by recompute or swap, a rolled-back step, a prefix-cache
hit) gives the same tokens as a clean run, since each draw is a function of the seed and position.
"""

from __future__ import annotations

import functools
import json
import re

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from minipaged_ops.integration import LLMEngine, SamplingParams  # noqa: E402
from minipaged_ops.integration.engine import StructuredOutputsParams  # noqa: E402
from minipaged_ops.integration.engine.grammar_matcher import SequenceMatcher  # noqa: E402
from minipaged_ops.integration.engine.strict_json import StrictJson  # noqa: E402
from minipaged_ops.integration.engine.structured_outputs import GrammarCompilerCache  # noqa: E402
from minipaged_ops.tiny import tiny_model, tiny_tokenizer  # noqa: E402
from test_engine import assert_all_blocks_free  # noqa: E402
from test_engine_serving import drain  # noqa: E402

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
        "home": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                                   "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,5}$"}},
                 "required": ["zip", "city"], "additionalProperties": False},
    },
    "required": ["name", "age", "tags", "home"], "additionalProperties": False,
}
PAINT = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "wet": {"type": "boolean"}},
         "required": ["color", "wet"], "additionalProperties": False}
SCORES = {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 99}, "minItems": 2, "maxItems": 4}
EMAIL = r"[a-z]{2,5}@[a-z]{2,4}\.(com|org)"
CHOICES = ["yes", "no", "not sure"]
SUM_GRAMMAR = 'root ::= "(" num (op num){0,3} ")"\nnum ::= [0-9]{1,3}\nop ::= "+" | "*"'
SUM_REGEX = r"\([0-9]{1,3}([+*][0-9]{1,3}){0,3}\)"

CONSTRAINTS = {  # name -> (StructuredOutputsParams, the independent check of a finished output's text)
    "person": (StructuredOutputsParams(json=PERSON, disable_any_whitespace=True),
               lambda t: jsonschema.validate(json.loads(t), PERSON)),
    "paint": (StructuredOutputsParams(json=json.dumps(PAINT)), lambda t: jsonschema.validate(json.loads(t), PAINT)),
    "scores": (StructuredOutputsParams(json=SCORES, disable_any_whitespace=True),
               lambda t: jsonschema.validate(json.loads(t), SCORES)),
    "json_object": (StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
                    lambda t: _assert(isinstance(json.loads(t), dict))),
    "email": (StructuredOutputsParams(regex=EMAIL), lambda t: _assert(re.fullmatch(EMAIL, t))),
    "choice": (StructuredOutputsParams(choice=CHOICES), lambda t: _assert(t in CHOICES)),
    "grammar": (StructuredOutputsParams(grammar=SUM_GRAMMAR), lambda t: _assert(re.fullmatch(SUM_REGEX, t))),
}


def _assert(ok):
    assert ok


@functools.lru_cache(maxsize=None)
def tokenizer():
    return tiny_tokenizer()


@functools.lru_cache(maxsize=None)
def model():
    return tiny_model("qwen3", vocab=len(tokenizer()), init_range=None)


def engine(**kwargs):
    args = dict(num_blocks=96, block_size=4, max_num_seqs=16, tokenizer=tokenizer())
    return LLMEngine(model(), **{**args, **kwargs})


def prompt(i):
    return tokenizer().encode(f"Request {i}: answer in the format asked. The cache is full.")


# the runs that must equal a clean one: a few constraints, to keep them quick
SOME = ("person", "paint", "email", "grammar")


def add_all(eng, temperature, n=1, max_tokens=80, only=None):
    names = [name for name in CONSTRAINTS if only is None or name in only]
    for i, name in enumerate(names):
        eng.add_request(name, prompt(i), SamplingParams(
            n=n, temperature=temperature, seed=i, max_tokens=max_tokens, structured_outputs=CONSTRAINTS[name][0]))
    eng.add_request("free", prompt(99), SamplingParams(temperature=temperature, seed=99, max_tokens=12))
    return names


def check_outputs(final, names):
    """Every completion that ended with "stop" passes its check; most end so."""
    stopped = total = 0
    for name in names:
        for out in final[name].outputs:
            total += 1
            assert out.finish_reason in ("stop", "length"), (name, out.finish_reason)
            if out.finish_reason == "stop":
                stopped += 1
                CONSTRAINTS[name][1](out.text)
    assert stopped >= total * 0.5, f"only {stopped} of {total} constrained completions ended"


def token_ids(final):
    return {rid: [o.token_ids for o in out.outputs] for rid, out in final.items()}


@pytest.mark.parametrize("temperature,n", [(0.0, 1), (1.0, 3)])
def test_every_output_obeys_its_constraint(temperature, n):
    eng = engine()
    names = add_all(eng, temperature, n=n)
    final = drain(eng)
    check_outputs(final, names)
    assert final["free"].outputs[0].finish_reason == "length"
    if n > 1:  # the completions drew apart, each under its own matcher
        assert any(len({tuple(o.token_ids) for o in final[name].outputs}) > 1 for name in names)
    assert_all_blocks_free(eng)


@functools.lru_cache(maxsize=None)
def clean_run(temperature):
    eng = engine()
    names = add_all(eng, temperature, n=2, only=SOME)
    return token_ids(drain(eng)), names


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_resumes_the_matchers_exactly(mode):
    clean, names = clean_run(1.0)
    eng = engine(num_blocks=40, preemption_mode=mode)
    add_all(eng, 1.0, n=2, only=SOME)
    final = drain(eng)
    assert eng.stats()["preemptions"] > 0
    assert token_ids(final) == clean
    check_outputs(final, names)


@pytest.mark.parametrize("fail_at", [2, 7])
def test_a_rolled_back_step_rolls_the_matchers_back(fail_at, monkeypatch):
    """A failure after the step's tokens were accepted (the matchers advanced) is undone: the redo
    gives the clean run's tokens."""
    clean, names = clean_run(1.0)
    eng = engine()
    add_all(eng, 1.0, n=2, only=SOME)
    report, calls, failures = eng.request_table.report, {"n": 0}, []

    def failing_report(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == fail_at:
            raise RuntimeError("planted failure")
        return report(*args, **kwargs)

    monkeypatch.setattr(eng.request_table, "report", failing_report)
    final = drain(eng, on_error=failures.append)
    assert [str(f) for f in failures] == ["planted failure"]
    assert token_ids(final) == clean
    check_outputs(final, names)


def test_a_prefix_hit_changes_nothing():
    clean, names = clean_run(1.0)
    eng = engine()
    add_all(eng, 1.0, n=2, only=SOME)
    drain(eng)  # the prompts' blocks are now cached
    add_all(eng, 1.0, n=2, only=SOME)
    final = drain(eng)
    assert eng.stats()["prefix_cache_hit_rate"] > 0.3
    assert token_ids(final) == clean


def test_max_tokens_cuts_with_length_and_the_end_of_the_grammar_stops():
    eng = engine()
    eng.add_request("cut", prompt(0), SamplingParams(max_tokens=3, structured_outputs=CONSTRAINTS["person"][0]))
    eng.add_request("one", prompt(1), SamplingParams(max_tokens=50, structured_outputs=StructuredOutputsParams(
        choice=["The cache is full."])))
    final = drain(eng)
    cut, one = final["cut"].outputs[0], final["one"].outputs[0]
    assert cut.finish_reason == "length" and len(cut.token_ids) == 3 and cut.text.startswith("{")
    assert one.finish_reason == "stop" and one.text == "The cache is full."


def test_logprobs_stay_those_of_the_raw_distribution():
    """Logprobs are the model's, before the mask: the forced token's is below 0 and tokens the
    grammar forbids are among the top ones."""
    eng = engine()
    sp = SamplingParams(max_tokens=20, logprobs=5, structured_outputs=StructuredOutputsParams(choice=["Hello"]))
    eng.add_request("r", prompt(0), sp)
    out = drain(eng)["r"].outputs[0]
    allowed = set(tokenizer().encode("Hello")) | {tokenizer().eos_token_id}
    first = out.logprobs[0]
    assert first[out.token_ids[0]] < 0
    assert set(first) - allowed, "the top logprobs hold only grammar-allowed tokens: they were masked"


@pytest.mark.parametrize("bad,field", [
    (StructuredOutputsParams(json={"type": "bogus"}), "structured_outputs.json"),
    (StructuredOutputsParams(regex="(ab"), "structured_outputs.regex"),
    (StructuredOutputsParams(grammar="root ::= undefined_rule"), "structured_outputs.grammar"),
])
def test_a_constraint_that_does_not_compile_is_refused_at_add_request(bad, field):
    eng = engine()
    with pytest.raises(ValueError, match=re.escape(field)):
        eng.add_request("bad", prompt(0), SamplingParams(structured_outputs=bad))
    assert not eng.has_unfinished_requests()
    eng.add_request("bad", prompt(0), SamplingParams(max_tokens=2))  # the id was never taken
    assert drain(eng)["bad"].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("kwargs,match", [
    ({}, "exactly one"), ({"json": PAINT, "regex": "a"}, "exactly one"), ({"choice": []}, "choice"),
    ({"choice": ["a", 3]}, "choice"), ({"json": "{not json"}, "does not parse"), ({"json": 5}, "json must"),
    ({"regex": ""}, "regex"), ({"json_object": "yes"}, "json_object"),
])
def test_structured_outputs_params_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StructuredOutputsParams(**kwargs)


def test_structured_outputs_need_the_engines_tokenizer():
    eng = LLMEngine(model(), num_blocks=16, block_size=4)
    with pytest.raises(ValueError, match="tokenizer"):
        eng.add_request("r", [5, 6], SamplingParams(structured_outputs=StructuredOutputsParams(regex="a")))


def test_compiled_grammars_are_cached_per_kind_and_spec():
    cache = GrammarCompilerCache(tokenizer(), len(tokenizer()))
    a = cache.compile(StructuredOutputsParams(json=PAINT))
    assert cache.compile(StructuredOutputsParams(json=json.dumps(PAINT, indent=2))) is a
    assert cache.compile(StructuredOutputsParams(regex="a+")) is not a
    assert len(cache.compile_seconds) == 2


# ---------------------------------------------------------------- the matcher API and strict JSON


def bitmask_allows(bitmask, row, vocab):
    words = bitmask[row].tolist()
    return {t for t in range(vocab) if (words[t // 32] >> (t % 32)) & 1}


def test_sequence_matcher_advances_rolls_back_and_forks():
    tok = tokenizer()
    cache = GrammarCompilerCache(tok, len(tok), [tok.eos_token_id])
    ids = tok.encode("not sure")
    m = SequenceMatcher(cache.compile(StructuredOutputsParams(choice=CHOICES)))
    bitmask = torch.zeros(2, -(-len(tok) // 32), dtype=torch.int32)
    m.fill_bitmask(bitmask, 0)
    start = bitmask_allows(bitmask, 0, len(tok))
    assert ids[0] in start and tok.eos_token_id not in start
    m.advance(ids)
    child = m.fork()
    child.advance([tok.eos_token_id])
    assert child.is_terminated and not m.is_terminated and (child.num_tokens, m.num_tokens) == (len(ids) + 1, len(ids))
    m.fill_bitmask(bitmask, 1)
    assert bitmask_allows(bitmask, 1, len(tok)) == {tok.eos_token_id}
    m.rollback(len(ids))
    m.fill_bitmask(bitmask, 1)
    assert bitmask_allows(bitmask, 1, len(tok)) == start
    with pytest.raises(ValueError, match="roll back"):
        m.rollback(1)
    with pytest.raises(ValueError, match="not allowed"):
        m.advance([tok.eos_token_id])
    assert m.num_tokens == 0


def test_strict_json_masks_control_bytes_inside_strings():
    """RFC 8259: no raw U+0000-U+001F inside a string. Inside a string of every JSON constraint,
    no token holding such a byte is allowed; outside, the whitespace ones may be."""
    tok = tokenizer()
    vocab = len(tok) + 40  # a padded lm_head: the extra ids are never allowed
    cache = GrammarCompilerCache(tok, vocab, [tok.eos_token_id])
    control = {t for t in range(len(tok)) if any(c < 0x20 for c in tok.convert_tokens_to_string(
        [tok.convert_ids_to_tokens(t)]).encode())}
    assert len(control) >= 30  # the byte-level tokens of 0x00-0x1F
    for params, opened in ((StructuredOutputsParams(json_object=True), '{"name": "ab'),
                           (StructuredOutputsParams(json=PERSON), '{"name": "ab'),
                           (StructuredOutputsParams(json={"type": "string"}), '"ab')):
        m = SequenceMatcher(cache.compile(params))
        bitmask = torch.zeros(1, -(-vocab // 32), dtype=torch.int32)
        m.fill_bitmask(bitmask, 0)
        allowed = bitmask_allows(bitmask, 0, vocab)
        assert not allowed & set(range(len(tok), vocab))
        m.advance(tok.encode(opened))
        m.fill_bitmask(bitmask, 0)
        assert not bitmask_allows(bitmask, 0, vocab) & control, params.kind
    # the lexer on its own: outside a string, inside one, inside after a backslash
    strict = StrictJson([b"\x02", b"\t", b"a", b'"x\t', b"\n\r", b'"', b"\\", b'a"\t'], 8)
    assert [bitmask_allows(strict.rows, s, 8) for s in range(3)] == [{1, 2, 4, 5, 6}, {2, 3, 5, 6, 7}, {2, 5, 6, 7}]
    assert [strict.advance(0, t) for t in (2, 5, 6, 7)] == [0, 1, 0, 1]
    assert [strict.advance(1, t) for t in (2, 5, 6, 7)] == [1, 0, 2, 0]


def test_matcher_lookahead_for_speculation_leaves_it_as_it_was():
    """allowed_prefix stops at the first forbidden proposal and after one that completes the
    grammar; masks_along gives each position's mask; neither moves the matcher."""
    tok = tokenizer()
    cache = GrammarCompilerCache(tok, len(tok), [tok.eos_token_id])
    ids = tok.encode("not sure")
    m = SequenceMatcher(cache.compile(StructuredOutputsParams(choice=CHOICES)))
    assert m.allowed_prefix(ids + [tok.eos_token_id, ids[0]]) == len(ids) + 1  # nothing after the end
    assert m.allowed_prefix([tok.eos_token_id] + ids) == 0
    assert m.num_tokens == 0
    masks = m.masks_along(ids)
    bitmask = torch.zeros(len(ids) + 1, -(-len(tok) // 32), dtype=torch.int32)
    for j, mask in enumerate(masks):
        assert mask.num_tokens == j
        mask.fill_bitmask(bitmask, j)
        step = SequenceMatcher(cache.compile(StructuredOutputsParams(choice=CHOICES)))
        step.advance(ids[:j])
        expected = torch.zeros_like(bitmask)
        step.fill_bitmask(expected, j)
        assert torch.equal(bitmask[j], expected[j])
    assert bitmask_allows(bitmask, len(ids), len(tok)) == {tok.eos_token_id}
    assert m.num_tokens == 0 and not m.is_terminated
    m.advance(ids)  # still at the start: the whole choice is accepted
    assert m.num_tokens == len(ids)


REPEAT = r"(la ){4,9}la!"  # a constraint that repeats itself: n-gram proposals the grammar keeps


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_speculative_decoding_under_constraints_gives_the_same_tokens(temperature, monkeypatch):
    """n-gram speculation on constrained sequences: the proposals the grammar allows are verified
    under each position's mask, so the tokens equal decoding one at a time under the constraint,
    every output passes its check, and proposals were kept."""
    from minipaged_ops.integration.engine.speculative import speculator as speculator_module

    monkeypatch.setattr(speculator_module, "MIN_ACCEPTANCE", 0.0)  # the random model keeps few
    constraints = {**{name: CONSTRAINTS[name] for name in SOME},
                   "repeat": (StructuredOutputsParams(regex=REPEAT), lambda t: _assert(re.fullmatch(REPEAT, t)))}

    def run(**kwargs):
        eng = engine(**kwargs)
        for i, (name, (params, _)) in enumerate(constraints.items()):
            eng.add_request(name, prompt(i) + tokenizer().encode(" la la la la la!"), SamplingParams(
                n=2, temperature=temperature, seed=i, max_tokens=60, structured_outputs=params))
        return eng, drain(eng)

    _, clean = run()
    eng, spec = run(speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    assert token_ids(spec) == token_ids(clean)
    stats = eng.stats()
    assert stats["spec_decode_num_draft_tokens"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0, stats
    for name, (_, check) in constraints.items():
        for out in spec[name].outputs:
            if out.finish_reason == "stop":
                check(out.text)
    assert all(o.finish_reason == "stop" for o in spec["repeat"].outputs)
    assert_all_blocks_free(eng)
