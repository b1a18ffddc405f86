"""The tiny model folder: a real byte-level BPE tokenizer trained offline, EOS/pad, ChatML, and a
model that transformers' Auto classes load from the folder with no network."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import torch  # noqa: E402

from minipaged_ops import tiny  # noqa: E402

TEXTS = ["Hello, world!", "Grüße aus München — 東京タワー 🎉🚀", "never seen: ꙮ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \t\n  spaces  ", ""]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny.save_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen3")


def load(folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(folder, local_files_only=True),
            AutoTokenizer.from_pretrained(folder, local_files_only=True))


def test_folder_loads_offline_with_the_tokenizers_vocabulary(folder, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tokenizer = load(folder)
    assert model.config.model_type == "qwen3"
    assert model.config.vocab_size == len(tokenizer) == 512
    assert tokenizer.convert_ids_to_tokens([0, 1, 2]) == list(tiny.SPECIAL_TOKENS)
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id) == (0, 2, None)
    assert model.config.eos_token_id == 2 and model.generation_config.eos_token_id == [2, 0]


def test_byte_level_round_trip_including_multi_byte_and_unseen_characters(folder):
    _, tokenizer = load(folder)
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert all(0 <= i < len(tokenizer) for i in ids)
        assert tokenizer.decode(ids) == text
    # merges were learnt (not a bare byte tokenizer), including ones inside multi-byte characters
    assert len(tokenizer.encode("The cache is full.")) < len("The cache is full.")
    assert len(tokenizer.encode("東京")) < len("東京".encode())
    # an unseen character falls back to its bytes: one token per byte, each alone not valid UTF-8
    ids = tokenizer.encode("ꙮ")
    assert len(ids) == 3 and all(tokenizer.decode([i]) == "\ufffd" for i in ids)
    # special tokens are single ids and skip_special_tokens drops them
    ids = tokenizer.encode("<|im_start|>hi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tokenizer.decode(ids, skip_special_tokens=True) == "hi"


def test_chatml_template_like_qwens(folder):
    _, tokenizer = load(folder)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Grüße 🎉"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nGrüße 🎉<|im_end|>\n"
                    "<|im_start|>assistant\n")
    without = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert without == text[:-len("<|im_start|>assistant\n")]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert list(ids) == tokenizer.encode(text)


def test_training_is_deterministic_and_the_cli_writes_the_same_folder(folder, tmp_path):
    out = tmp_path / "cli"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    run = subprocess.run([sys.executable, "-m", "minipaged_ops.tiny", "--save", str(out), "--arch", "qwen3"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    for name in ("tokenizer.json", "config.json"):
        with open(os.path.join(folder, name)) as a, open(out / name) as b:
            assert a.read() == b.read(), name
    model_a, _ = load(folder)
    model_b, _ = load(str(out))
    for (name, a), (_, b) in zip(model_a.state_dict().items(), model_b.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("arch", sorted(tiny.ARCHITECTURES))
def test_every_architecture_saves_and_generates(arch, tmp_path):
    folder = tiny.save_tiny_model(tmp_path / arch, arch, vocab_size=300, layers=1)
    model, tokenizer = load(folder)
    assert type(model).__name__ == tiny.ARCHITECTURES[arch][1] and len(tokenizer) == 300
    ids = torch.tensor([tokenizer.encode("Hello")])
    out = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert out.shape[1] <= ids.shape[1] + 5 and isinstance(tokenizer.decode(out[0]), str)


@pytest.mark.parametrize("bad", [10, 258, True, "512", None])
def test_bad_vocab_size_is_rejected_before_writing(bad, tmp_path):
    with pytest.raises(ValueError, match="vocab_size"):
        tiny.save_tiny_model(tmp_path / "x", vocab_size=bad)
    assert not (tmp_path / "x").exists()


def test_padded_vocabulary_decodes_every_id_and_leaves_text_alone(tmp_path):
    folder = tiny.save_tiny_model(tmp_path / "padded", vocab_size=300, pad_vocab_to=1000, layers=1)
    model, tokenizer = load(folder)
    assert len(tokenizer) == model.config.vocab_size == 1000
    assert tokenizer.decode([999]) == "<|extra_699|>" and tokenizer.decode([999], skip_special_tokens=True) != ""
    assert tokenizer.encode(TEXTS[1]) == tiny.tiny_tokenizer(300).encode(TEXTS[1])
    with pytest.raises(ValueError, match="pad_vocab_to"):
        tiny.save_tiny_model(tmp_path / "x", vocab_size=300, pad_vocab_to=299)


def test_script_greedy_walks_the_given_tokens():
    model = tiny.tiny_model("qwen3", vocab=300, hidden=64, layers=2)
    walk = [5, 260, 17, 99, 3, 201, 42]
    tiny.script_greedy(model, walk)
    prompt = torch.tensor([[7, 8, 9, walk[0]]])
    out = model.generate(prompt, max_new_tokens=len(walk) - 1, do_sample=False)
    assert out[0, prompt.shape[1]:].tolist() == walk[1:]
    with pytest.raises(ValueError, match="distinct"):
        tiny.script_greedy(model, [1, 2, 1])
