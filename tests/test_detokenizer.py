"""IncrementalDetokenizer on a real byte-level BPE tokenizer (tiny_tokenizer, trained offline):
released text is always a prefix of the final text and never ends inside a character; the final
text equals ``tokenizer.decode(output, skip_special_tokens=True)``; stop strings are found across
token boundaries, cut or kept, and text that could still become one is held back until it cannot.
Each case is checked against a brute-force reference that decodes every prefix of the output."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from minipaged_ops.integration.engine.detokenizer import IncrementalDetokenizer  # noqa: E402
from minipaged_ops.tiny import tiny_tokenizer  # noqa: E402

FFFD = "\ufffd"
WORDS = ("hello", "world", "the", "café", "naïve", "日本語", "東京", "😀", "🎉", "Ελληνικά", "русский",
         "stop", "end", "a", "ab", "abc", "x", "\n", "…", "→", "ok!")


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def decode(tokenizer, ids, skip_special_tokens=True):
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def reference(tokenizer, ids, stop=(), include=False, min_tokens=0):
    """Brute force over every prefix of the output: (index of the token that completes a stop
    string or None, the stop string, the text released after each token, the final text)."""
    released, previous = [], ""
    for k in range(1, len(ids) + 1):
        text = decode(tokenizer, ids[:k]).rstrip(FFFD)  # whole characters only
        if k > min_tokens:
            hits = [(p + len(s), p, s) for s in stop for p in range(len(text))
                    if text.startswith(s, p) and p + len(s) > len(previous)]
            if hits:
                end, begin, s = min(hits)
                final = text[:end] if include else text[:begin]
                return k, s, released + [final], final
        held = 0 if include else max([n for s in stop for n in range(1, len(s)) if text.endswith(s[:n])], default=0)
        released.append(text[:len(text) - held])
        previous = text
    return None, None, released, decode(tokenizer, ids)


def run(tokenizer, prompt, ids, **kwargs):
    det = IncrementalDetokenizer(tokenizer, prompt, **kwargs)
    stopped_at, texts = None, []
    for k, token in enumerate(ids, 1):
        hit = det.push(token)
        texts.append(det.text)
        if hit is not None:
            stopped_at = (k, hit)
            break
    return det, stopped_at, texts


def check_against_reference(tokenizer, prompt, ids, stop=(), include=False, min_tokens=0):
    k_stop, stop_string, released, final = reference(tokenizer, ids, stop, include, min_tokens)
    det, stopped_at, texts = run(tokenizer, prompt, ids, stop=stop, include_stop_str_in_output=include,
                                 min_tokens=min_tokens)
    assert stopped_at == (None if k_stop is None else (k_stop, stop_string))
    assert texts == released
    for text in texts:
        assert final.startswith(text)  # never a partial character, never text that is later cut
    assert det.finish() == final
    assert det.stop_reason == stop_string


@pytest.mark.parametrize("seed", range(40))
def test_random_ids_decode_incrementally(tokenizer, seed):
    """Any ids (special tokens, lone bytes of multi-byte characters, invalid UTF-8) after any prompt."""
    rng = random.Random(seed)
    vocab = len(tokenizer)
    prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 9))]
    ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
    check_against_reference(tokenizer, prompt, ids)
    det, _, _ = run(tokenizer, prompt, ids)
    assert det.finish() == tokenizer.decode(ids, skip_special_tokens=True)


def test_multibyte_text_never_released_in_pieces(tokenizer):
    text = "naïve café → 日本語 and 東京 😀🎉 Ελληνικά русский … 中文 ß 🚀"  # the last three: unseen in training
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any(FFFD in decode(tokenizer, [t]) for t in ids), "the test needs characters split over tokens"
    det, _, texts = run(tokenizer, [1], ids)
    assert all(FFFD not in t and text.startswith(t) for t in texts)
    assert texts[-1] == text and det.finish() == text


def test_special_tokens_skipped_or_kept(tokenizer):
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    eos = tokenizer.eos_token_id
    ids = ids[:1] + [eos] + ids[1:] + [eos]
    assert run(tokenizer, [], ids)[0].finish() == "hello world"
    kept = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    for t in ids:
        kept.push(t)
    assert kept.finish() == tokenizer.decode(ids, skip_special_tokens=False)
    assert tokenizer.eos_token in kept.text


def test_prompt_ending_inside_a_character(tokenizer):
    """The prompt's last token holds the first byte of a character: the output decodes on its own."""
    ids = tokenizer.encode("中文 ok 🚀 ok", add_special_tokens=False)  # unseen in training: split in bytes
    split = next(i for i in range(1, len(ids)) if decode(tokenizer, ids[:i]).endswith(FFFD))
    check_against_reference(tokenizer, ids[:split], ids[split:])


def stop_cases(tokenizer):
    """(text, stop) pairs where the stop string spans token boundaries, multi-byte ones included."""
    cases = [("say hello world then stop here", "world then"), ("東京 and 日本語 too", "京 and 日"),
             ("smile 😀🎉 party", "😀🎉"), ("naïve café", "ïve c"), ("abcabd", "abd"),
             ("say 中文 now 🚀!", "中文"), ("say 中文 now 🚀!", "🚀")]  # the last two: split in bytes
    for text, stop in cases:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert not any(stop in decode(tokenizer, [t]) for t in ids), (text, stop)
        yield text, stop, ids


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens(tokenizer, include):
    for text, stop, ids in stop_cases(tokenizer):
        det, stopped_at, _ = run(tokenizer, [1], ids, stop=[stop], include_stop_str_in_output=include)
        end = text.index(stop) + len(stop)
        assert stopped_at is not None and stopped_at[1] == stop
        # the token that completes it is the first whose text reaches the stop string's end
        reach = [len(decode(tokenizer, ids[:k]).rstrip(FFFD)) for k in range(len(ids) + 1)]
        assert stopped_at[0] == next(k for k, r in enumerate(reach) if r >= end)
        assert det.text == det.finish() == (text[:end] if include else text[:text.index(stop)])
        with pytest.raises(RuntimeError, match="push after"):
            det.push(ids[0])
        check_against_reference(tokenizer, [1], ids, [stop], include)


def test_text_after_stop_string_in_the_same_token_is_cut(tokenizer):
    text = "one prompt, many blocks"
    ids = tokenizer.encode(text, add_special_tokens=False)
    last = decode(tokenizer, ids[-1:])
    assert len(last) > 2, "the test needs a last token of several characters"
    stop = text[:-len(last) + 1]  # ends one character into the last token
    for include in (False, True):
        det, stopped_at, _ = run(tokenizer, [], ids, stop=stop, include_stop_str_in_output=include)
        assert stopped_at == (len(ids), stop)
        assert det.finish() == (stop if include else "")


def test_held_back_until_it_cannot_match_and_released_at_finish(tokenizer):
    ids = tokenizer.encode("hello abx then ab", add_special_tokens=False)
    det = IncrementalDetokenizer(tokenizer, [], stop=["abc"])
    seen = []
    for t in ids:
        assert det.push(t) is None
        seen.append(det.text)
    # tokens "he", "l", "lo", " a", "b", "x", ...: "a", then "ab", held until "x" rules "abc" out
    assert seen[:6] == ["he", "hel", "hello", "hello ", "hello ", "hello abx"]
    assert det.text == "hello abx then "  # the last "ab" could still become "abc"
    assert det.finish() == "hello abx then ab"
    check_against_reference(tokenizer, [], ids, ["abc"])


def test_stop_strings_wait_for_min_tokens(tokenizer):
    ids = tokenizer.encode("stop and stop again", add_special_tokens=False)
    first_stop_done = next(k for k in range(1, len(ids) + 1) if "stop" in decode(tokenizer, ids[:k]))
    for min_tokens in (0, first_stop_done, len(ids)):
        check_against_reference(tokenizer, [], ids, ["stop"], False, min_tokens)
    det, stopped_at, _ = run(tokenizer, [], ids, stop=["stop"], min_tokens=first_stop_done)
    assert stopped_at is not None and det.finish() == "stop and "


@pytest.mark.parametrize("seed", range(60))
def test_stop_strings_against_brute_force(tokenizer, seed):
    """Random multilingual text, stop strings cut out of it at random (so they span tokens and
    characters of several bytes), several at once, either inclusion, with and without min_tokens."""
    rng = random.Random(1000 + seed)
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(3, 12)))
    ids = tokenizer.encode(text, add_special_tokens=False)
    if rng.random() < 0.3:  # some raw ids too: lone bytes, special tokens
        ids = ids + [rng.randrange(len(tokenizer)) for _ in range(5)]
    stops = []
    for _ in range(rng.randrange(1, 4)):
        if rng.random() < 0.2:
            stops.append(rng.choice(WORDS) + "?")  # usually never met, but its prefixes are held
        else:
            a = rng.randrange(len(text))
            stops.append(text[a:a + rng.randrange(1, 8)])
    min_tokens = rng.choice([0, 0, rng.randrange(len(ids) + 1)])
    check_against_reference(tokenizer, [rng.randrange(len(tokenizer))], ids, stops, rng.random() < 0.5, min_tokens)


def test_bad_stop_strings(tokenizer):
    with pytest.raises(ValueError, match="stop"):
        IncrementalDetokenizer(tokenizer, [], stop=[""])


def test_stop_string_that_ends_first_wins(tokenizer):
    """One token adding several characters can complete several stop strings: the one that ends
    first wins (as if the text came a character at a time), the longest on a tie."""
    ids = tokenizer.encode("one sequence", add_special_tokens=False)
    assert decode(tokenizer, ids[-1:]) == " sequence"
    for stops, winner in ((["sequence", "que"], "que"), (["nce", "ence"], "ence"), (["uence", "seq"], "seq")):
        det, stopped_at, _ = run(tokenizer, [], ids, stop=stops)
        assert stopped_at == (len(ids), winner)
        assert det.finish() == "one sequence"[:"one sequence".index(winner)]
        check_against_reference(tokenizer, [], ids, stops)


def sentencepiece_like_tokenizer():
    """A Metaspace BPE (SentencePiece's word-boundary marker): decoding drops the space before the
    first token, so an output's text depends on the tokens before it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Metaspace()
    bpe.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    bpe.train_from_iterator([" ".join(rng.choice(WORDS[:16]) for _ in range(10)) for _ in range(200)], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("seed", range(10))
def test_sentencepiece_like_tokenizer(seed):
    """The window is decoded from the same start each time, so a leading word boundary is kept:
    the output reads as it does after its prompt."""
    sp = sentencepiece_like_tokenizer()
    rng = random.Random(seed)
    prompt = sp.encode(" ".join(rng.choice(WORDS[:16]) for _ in range(2)), add_special_tokens=False)[:5]
    ids = sp.encode(" ".join(rng.choice(WORDS[:16]) for _ in range(8)), add_special_tokens=False)
    det, _, texts = run(sp, prompt, ids)
    expected = sp.decode(prompt + ids)[len(sp.decode(prompt)):]
    assert expected.startswith(" ") and all(expected.startswith(t) for t in texts)
    assert det.finish() == expected


# ---------------------------------------------------------------- through the engine


def test_engine_text_and_stop_strings(tokenizer):
    """Each completion's text is its ids decoded; a stop string ends it with the token that
    completed it, cut from the text unless included; `stop` without a tokenizer is refused."""
    from minipaged_ops.integration import LLMEngine, SamplingParams
    from minipaged_ops.tiny import tiny_model

    model = tiny_model("qwen3", seed=4, vocab=len(tokenizer))
    engine = LLMEngine(model, num_blocks=64, block_size=4, tokenizer=tokenizer)
    prompt = tokenizer.encode("Hello, world! The cache is", add_special_tokens=False)
    plain = engine.generate([prompt], SamplingParams(max_tokens=24), use_tqdm=False)[0].outputs[0]
    assert plain.text == tokenizer.decode(plain.token_ids, skip_special_tokens=True)
    ends = [len(decode(tokenizer, plain.token_ids[:k]).rstrip(FFFD)) for k in range(len(plain.token_ids) + 1)]
    # a stop string of three characters across a token boundary (one before it, two after)
    begin = next(e - 1 for e in sorted(set(ends[1:-1]))
                 if e >= 1 and e + 2 <= len(plain.text) and FFFD not in plain.text[e - 1:e + 2])
    stop = plain.text[begin:begin + 3]
    first = plain.text.index(stop)
    completing = next(k for k, e in enumerate(ends) if e >= first + len(stop))
    for include in (False, True):
        params = SamplingParams(max_tokens=24, stop=[stop, "never met"], include_stop_str_in_output=include)
        out = engine.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.token_ids == plain.token_ids[:completing]
        assert out.text == plain.text[:first + len(stop) if include else first]
    with pytest.raises(ValueError, match="tokenizer"):
        LLMEngine(model, num_blocks=64, block_size=4).add_request("x", prompt, SamplingParams(stop="a"))


def test_a_detokenizer_that_raises_at_finish_still_lets_its_request_end(tokenizer, monkeypatch):
    """finish() raising (the tokenizer's decode failing on the last tokens) must not leave a
    request half-ended, its blocks freed but its id taken for good: an aborted one ends with
    "abort"; one that reaches max_tokens fails its step (rolled back) until it ends with "error".
    The engine then runs a request as before."""
    from minipaged_ops.integration import LLMEngine, SamplingParams
    from minipaged_ops.integration.engine.step_runner import MAX_FAILURES
    from minipaged_ops.tiny import tiny_model

    model = tiny_model("qwen3", seed=4, vocab=len(tokenizer))
    engine = LLMEngine(model, num_blocks=64, block_size=4, tokenizer=tokenizer)
    prompt = tokenizer.encode("Hello, world! The cache is", add_special_tokens=False)
    expected = engine.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0].outputs[0]

    def broken_finish(self):
        raise RuntimeError("planted: decode failed")

    monkeypatch.setattr(IncrementalDetokenizer, "finish", broken_finish)
    engine.add_request("aborted", prompt, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()  # "aborted" runs
    engine.abort_request("aborted")
    engine.add_request("ends", prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    final, failures = {}, []
    for _ in range(30):
        if not engine.has_unfinished_requests():
            break
        try:
            final.update((o.request_id, o) for o in engine.step() if o.finished)
        except RuntimeError as e:
            failures.append(str(e))
    assert not engine.has_unfinished_requests(), (final.keys(), failures)
    assert [o.finish_reason for o in final["aborted"].outputs] == ["abort"]
    assert [o.finish_reason for o in final["ends"].outputs] == ["error"]
    assert failures == ["planted: decode failed"] * MAX_FAILURES
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not bm.sequence_ids()
    monkeypatch.undo()
    again = engine.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert (again.token_ids, again.text) == (expected.token_ids, expected.text)
