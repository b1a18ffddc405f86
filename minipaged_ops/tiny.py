"""Tiny random decoder-only models, built offline, and the comparison of greedy outputs that the
tests, the demo and the benchmarks share (one builder, one rule).

    from minipaged_ops.tiny import tiny_model, ragged_batch, compare_greedy
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=64)

A model folder with a real tokenizer (a byte-level BPE trained here, offline, on the text below,
with Qwen's special tokens and ChatML chat template), loadable by ``from_pretrained``::

    python -m minipaged_ops.tiny --save /tmp/tiny-qwen3 [--arch qwen3]
    save_tiny_model("/tmp/tiny-qwen3")

Imports transformers only when called, so ``import minipaged_ops`` stays free of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PAD = 0

# architecture -> (config class, model class) in transformers; every layer is full attention
ARCHITECTURES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
}


def tiny_config(
    arch: str = "qwen3",
    *,
    vocab: int = 192,
    hidden: int = 64,
    intermediate: int | None = None,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 64,
    max_positions: int = 512,
    init_range: float | None = 0.5,
    tie_embeddings: bool = False,
    bos_token_id: int | None = 1,
    eos_token_id: int | None = None,
):
    """A config of ``arch`` (see :data:`ARCHITECTURES`) with pad id 0, bos 1 and no EOS (outputs run
    to their length) unless given. ``init_range=0.5`` scales the random weights up so greedy choices are rarely
    near-ties; ``None`` keeps the architecture's default (a realistic spread of logits)."""
    import transformers

    if arch not in ARCHITECTURES:
        raise ValueError(f"tiny_config: arch must be one of {sorted(ARCHITECTURES)}, got {arch!r}")
    config_class = getattr(transformers, ARCHITECTURES[arch][0])
    kwargs = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=max_positions, pad_token_id=PAD, bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        tie_word_embeddings=tie_embeddings,
    )
    if init_range is not None:
        kwargs["initializer_range"] = init_range
    if arch == "mistral":
        kwargs["sliding_window"] = None  # Mistral's default window would make every layer sliding
    return config_class(**kwargs)


def tiny_model(arch: str = "qwen3", *, seed: int = 0, dtype=torch.float32, device="cpu", **config_kwargs):
    """A random ``*ForCausalLM`` of :func:`tiny_config`, seeded, in eval mode, on ``device``."""
    import transformers

    config = tiny_config(arch, **config_kwargs)
    torch.manual_seed(seed)
    with torch.device(device):
        model = getattr(transformers, ARCHITECTURES[arch][1])(config)
    model = model.to(dtype).eval()
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = None
    return model


def ragged_batch(lengths, vocab: int, seed: int = 0, width: int | None = None):
    """Left-padded ``(input_ids, attention_mask)`` with the given real lengths, ids in ``[3, vocab)``."""
    g = torch.Generator().manual_seed(seed)
    width = width or max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(3, vocab, (n,), generator=g)
        mask[i, width - n:] = 1
    return ids, mask


@dataclass(frozen=True)
class RowMatch:
    """How one generated row compares with its reference."""

    first_difference: int | None  # index of the first differing generated token; None: all equal
    close: bool  # equal, or at the first difference each side's token is in the other's top-k


def compare_greedy(ref_tokens, ref_logits, out_tokens, out_logits, top_k: int = 5) -> list[RowMatch]:
    """Compare greedy generations the way vLLM's tests do in low precision: walk each row; where
    the tokens first differ, each side's token must be among the other side's ``top_k`` most
    likely at that step (a near-tie that rounding flipped); after that the rows have different
    histories, so stop comparing.

    ``*_tokens`` are ``[batch, steps]`` generated tokens; ``*_logits`` the logits (or logprobs)
    they were chosen from, ``[batch, steps, vocab]``. In float32 use exact equality instead."""
    ref_top = ref_logits.float().topk(top_k, dim=-1).indices
    out_top = out_logits.float().topk(top_k, dim=-1).indices
    matches = []
    for row in range(ref_tokens.shape[0]):
        differ = (ref_tokens[row] != out_tokens[row]).nonzero().flatten()
        if differ.numel() == 0:
            matches.append(RowMatch(None, True))
            continue
        step = int(differ[0])
        close = bool((ref_top[row, step] == out_tokens[row, step]).any()) and bool(
            (out_top[row, step] == ref_tokens[row, step]).any()
        )
        matches.append(RowMatch(step, close))
    return matches


# ---------------------------------------------------------------------------------- a model folder

# Qwen's special tokens, first in the vocabulary: 0 is pad (and tiny_config's PAD), 2 ends a turn (EOS)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"

# ChatML as Qwen writes it: each message framed by <|im_start|>role ... <|im_end|>, then the
# assistant's turn opened when a generation prompt is asked for. With ``tools``, as Qwen3's
# template renders them: a system turn (the request's own system message first) listing each
# tool's JSON inside <tools></tools> and asking for <tool_call>{"name": ..., "arguments": ...}
# </tool_call> blocks; an assistant message's tool_calls rendered as such blocks; consecutive
# tool messages grouped in one user turn, each inside <tool_response></tool_response>.
CHATML_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first and tools %}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set fn = call['function'] if call.get('function') else call %}"
    "{%- if not loop.first or message['content'] %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' }}"
    "{{- fn['arguments'] if fn['arguments'] is string else (fn['arguments'] | tojson) }}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# The tokenizer's training text: written for this file, in several scripts, so the merges include
# multi-byte characters and the byte fallback of the rest is exercised too.
TRAINING_TEXT = """\
A paged KV cache keeps the keys and values of every sequence in fixed-size blocks. A block table
maps each sequence's logical blocks to physical ones, so memory is handed out a block at a time and
never wasted on padding. When two sequences share a prompt, they share its blocks; the first one to
write into a shared block gets a private copy. That is copy-on-write, and it is why sampling several
continuations of one prompt costs little more than sampling one.
The engine runs one step at a time. Each step it picks the running decodes first, then chunks of
waiting prompts, as many tokens as the budget allows. When the pool runs short it preempts the
newest request: its blocks are freed and it is computed again later, or they are swapped to the host.
Hello, world! How are you today? I am fine, thank you. What time is it? It is half past three.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 256 1024 4096 3.14159 2.71828 -1 +1 = 42.
Code: def step(self): return [seq for seq in self.running if seq.num_computed < len(seq.token_ids)]
JSON: {"model": "tiny", "prompt": "Hello", "max_tokens": 16, "temperature": 0.0, "stream": true}
Grüße aus München! Die Straße ist naß, aber schön. Äpfel, Öl und Übermut.
Ça va très bien, merci. Où est la bibliothèque ? Le café est déjà prêt, naïve élève.
¿Dónde está la estación? Mañana será otro día, señor. Canción, corazón, acción.
Привет, мир! Как дела? Спасибо, хорошо. Москва, Санкт-Петербург.
Γειά σου κόσμε. Καλημέρα! Αθήνα, θάλασσα, ήλιος.
こんにちは、世界。東京タワーは高いです。ありがとうございます。日本語の文章です。
你好，世界。今天天气很好。我们一起去北京吧。谢谢你的帮助。
안녕하세요, 세계! 감사합니다. 서울은 큰 도시입니다.
مرحبا بالعالم. شكرا جزيلا. صباح الخير.
שלום עולם. תודה רבה. בוקר טוב.
नमस्ते दुनिया। धन्यवाद। आप कैसे हैं?
Emoji: 🎉 🚀 😀 😂 👍 ❤️ 🔥 ✨ 🍕 🐍 🌍 ✅ ❌ ⚡ 🤖 — “quotes”, ‘single’, … ½ ¼ € £ ¥ © ® ™ ° ± × ÷ → ← ↑ ↓ ∞ ≈ ≠ ≤ ≥.
The cache is full. The cache is empty. The block is free. The block is shared. The request is done.
Once upon a time there was a small model that knew only a few hundred words, and it was happy.
"""


def tiny_tokenizer(vocab_size: int = 512):
    """A byte-level BPE trained here on :data:`TRAINING_TEXT` (deterministic, no network), as a
    transformers fast tokenizer: Qwen's special tokens (pad ``<|endoftext|>`` = 0, EOS
    ``<|im_end|>`` = 2), no BOS, and the ChatML :data:`CHATML_TEMPLATE`. Every string encodes
    (unseen characters fall back to their UTF-8 bytes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"tiny_tokenizer: vocab_size must be an int >= {256 + len(SPECIAL_TOKENS)} "
                         f"(the 256 bytes and {len(SPECIAL_TOKENS)} special tokens), got {vocab_size!r}")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(TRAINING_TEXT.splitlines(keepends=True), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS_TOKEN, pad_token=SPECIAL_TOKENS[0],
                                   additional_special_tokens=[SPECIAL_TOKENS[1]], chat_template=CHATML_TEMPLATE,
                                   clean_up_tokenization_spaces=False, model_max_length=1 << 30)


def save_tiny_model(directory, arch: str = "qwen3", *, seed: int = 0, vocab_size: int = 512,
                    pad_vocab_to: int | None = None, dtype=torch.float32, **config_kwargs) -> str:
    """Write a random :func:`tiny_model` of ``arch`` with :func:`tiny_tokenizer` into ``directory``
    (created if missing) so ``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained(directory)``
    load it offline. The model's vocabulary is the tokenizer's; EOS is ``<|im_end|>`` (and
    ``<|endoftext|>`` in the generation config, as Qwen3 has). ``pad_vocab_to``: fill the
    vocabulary up to this size with placeholder tokens ``<|extra_N|>`` (ordinary, not special), for
    a model with a real model's output layer (Qwen3: 151936) whose every sampled id decodes to text.
    ``config_kwargs`` go to :func:`tiny_config`. Returns the directory."""
    import os

    tokenizer = tiny_tokenizer(vocab_size)
    if pad_vocab_to is not None:
        if isinstance(pad_vocab_to, bool) or not isinstance(pad_vocab_to, int) or pad_vocab_to < len(tokenizer):
            raise ValueError(f"save_tiny_model: pad_vocab_to must be an int >= the tokenizer's {len(tokenizer)} "
                             f"tokens, got {pad_vocab_to!r}")
        tokenizer.add_tokens([f"<|extra_{i}|>" for i in range(pad_vocab_to - len(tokenizer))])
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    config_kwargs = {"max_positions": 2048, **config_kwargs}
    model = tiny_model(arch, seed=seed, dtype=dtype, vocab=len(tokenizer), bos_token_id=None, eos_token_id=eos,
                       **config_kwargs)
    model.generation_config.eos_token_id = [eos, tokenizer.pad_token_id]
    model.generation_config.bos_token_id = None
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def script_greedy(model, token_ids) -> None:
    """Rewrite ``model`` (a tiny Qwen3/Llama-style model, untied embeddings) so that greedy decoding
    walks ``token_ids``: after ``token_ids[i]`` the most likely next token is ``token_ids[i + 1]``,
    whatever came before. Attention and MLP outputs are zeroed, so the last hidden state is the
    current token's embedding; those embeddings are made orthonormal and each one's successor's
    lm_head row is set to it. For tests that need a known output (multi-byte characters split
    across tokens, stop strings across token boundaries). ``token_ids`` must be distinct."""
    ids = [int(t) for t in token_ids]
    hidden = model.config.hidden_size
    if len(set(ids)) != len(ids):
        raise ValueError(f"script_greedy: token_ids must be distinct, got {ids}")
    if len(ids) > hidden:
        raise ValueError(f"script_greedy: at most hidden_size={hidden} tokens, got {len(ids)}")
    if model.get_input_embeddings().weight is model.get_output_embeddings().weight:
        raise ValueError("script_greedy: the model's input and output embeddings are tied")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in model.get_decoder().layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        basis, _ = torch.linalg.qr(torch.randn(hidden, hidden, generator=g, dtype=torch.float64))
        embed = model.get_input_embeddings().weight
        head = model.get_output_embeddings().weight
        head.zero_()
        for i, token in enumerate(ids):
            embed[token] = basis[:, i].to(embed.dtype)
        for token, successor in zip(ids, ids[1:]):
            head[successor] = embed[token] * 10


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m minipaged_ops.tiny",
                                description="Write a tiny random model with a real tokenizer to a folder (offline).")
    p.add_argument("--save", required=True, metavar="DIR", help="folder to write (created if missing)")
    p.add_argument("--arch", choices=sorted(ARCHITECTURES), default="qwen3")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=512, help="tokenizer (and model) vocabulary")
    p.add_argument("--pad-vocab-to", type=int, default=None,
                   help="fill the vocabulary with placeholder tokens up to this size (Qwen3: 151936)")
    args = p.parse_args(argv)
    print(save_tiny_model(args.save, args.arch, seed=args.seed, vocab_size=args.vocab_size,
                          pad_vocab_to=args.pad_vocab_to))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
