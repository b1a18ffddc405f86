"""``python -m minipaged_ops.serve --model DIR`` (and ``minipaged serve``): load a model folder,
start the engine thread and serve the OpenAI-compatible API with uvicorn."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import threading

from minipaged_ops.quantized import KV_CACHE_DTYPES

from ..engine.sampling_params import MAX_LOGPROBS
from ..weight_quant import QUANTIZATIONS
from .guards import DEFAULT_MAX_BODY_BYTES


def parser(prog: str = "python -m minipaged_ops.serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="An OpenAI-compatible server on minipaged's LLMEngine.")
    p.add_argument("--model", required=True, help="a local model folder (config.json, weights, tokenizer)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the name clients use (default: --model as given)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                   help="weight-only quantization of the linear layers (CPU): int8 (a scale per output channel) or "
                        "int4 (a scale and zero point per group of 32 inputs); default: the weights as loaded")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize and /tokenizer_info "
                        "(/health, /version and /metrics stay open); default: $MINIPAGED_API_KEY, else none")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template file, used instead of the tokenizer's")
    p.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, metavar="BYTES",
                   help=f"larger request bodies are refused with HTTP 413 (default {DEFAULT_MAX_BODY_BYTES})")
    p.add_argument("--shutdown-timeout", type=float, default=0.0, metavar="SECONDS",
                   help="on SIGTERM or Ctrl-C, how long the requests in flight may go on (new ones are refused at "
                        "once); then each is aborted, a stream ending with an error event saying the server is "
                        "shutting down. Default 0, as vLLM's: at once")
    t = p.add_argument_group("tool calls")
    t.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction, default=True,
                   help="tool_choice 'auto' (the default when a request has tools) parses the model's own tool calls "
                        "out of its text. On by default, so a Qwen3 model calls tools with no flag; "
                        "--no-enable-auto-tool-choice refuses 'auto' as vLLM does without the flag")
    t.add_argument("--tool-call-parser", choices=("hermes",), default="hermes",
                   help="how tool calls are written: hermes = <tool_call>{\"name\": ..., \"arguments\": {...}}"
                        "</tool_call> (Qwen2.5, Qwen3, Hermes)")
    t.add_argument("--structured-outputs-config", type=json.loads, default=None, metavar="JSON",
                   help='server-wide structured-output options, as vLLM\'s: {"disable_any_whitespace": true} makes '
                        "JSON constraints (response_format, structured_outputs.json, forced tool calls) write no "
                        "whitespace between tokens, so a model cannot spend its tokens on it")
    e = p.add_argument_group("engine (LLMEngine's arguments)")
    e.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: sized from --kv-cache-memory)")
    e.add_argument("--kv-cache-memory", type=float, default=None,
                   help="bytes (> 1) or a fraction of free memory (<= 1) for the KV cache")
    e.add_argument("--block-size", type=int, default=None,
                   help="token slots per block (default: the device's, 64 on the CPU, 16 on CUDA)")
    e.add_argument("--max-num-seqs", type=int, default=64)
    e.add_argument("--max-num-batched-tokens", type=int, default=2048)
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    e.add_argument("--preemption-mode", choices=("recompute", "swap"), default="recompute")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--max-model-len", type=int, default=None,
                   help="the longest sequence, prompt + generated (default: the model's positions or the KV pool's "
                        "tokens, whichever is fewer)")
    e.add_argument("--max-logprobs", type=int, default=MAX_LOGPROBS,
                   help=f"the most log-probabilities a request may ask per token (default {MAX_LOGPROBS}; -1: the "
                        "whole vocabulary)")
    e.add_argument("--kv-cache-dtype", default="auto", choices=("auto", *KV_CACHE_DTYPES),
                   help="auto: the model's dtype; int8 (a scale per token and kv head) or fp8_e4m3 / fp8_e5m2 (a "
                        "scale per layer): one byte per K/V element, about twice the tokens of a bfloat16 cache")
    e.add_argument("--calculate-kv-scales", action="store_true",
                   help="fp8: set each layer's scales from the first batch's absolute maximum (else 1.0)")
    e.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s keys: \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4, "prompt_lookup_min": 1}\'')
    e.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split the model and the KV cache over N processes (one per GPU; under torchrun, across "
                        "machines: the same command on every node, rank 0 serves HTTP); --num-blocks and "
                        "--kv-cache-memory are per rank")
    return p


def engine_args(args) -> dict:
    kwargs = dict(num_blocks=args.num_blocks, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=args.enable_prefix_caching,
                  preemption_mode=args.preemption_mode, seed=args.seed, kv_cache_dtype=args.kv_cache_dtype,
                  calculate_kv_scales=args.calculate_kv_scales, max_model_len=args.max_model_len,
                  max_logprobs=args.max_logprobs)
    if args.speculative_config is not None:
        kwargs["speculative_config"] = args.speculative_config  # JSON text, checked by the engine
    if args.kv_cache_memory is not None:
        kwargs["kv_cache_memory"] = args.kv_cache_memory if args.kv_cache_memory <= 1 else int(args.kv_cache_memory)
    return kwargs


def main(argv=None, prog: str = "python -m minipaged_ops.serve") -> int:
    import uvicorn

    from ..engine import LLMEngine
    from ..engine.async_engine import AsyncLLMEngine
    from .app import build_app
    from .shutdown import GracefulServer, check_shutdown_timeout

    p = parser(prog)
    args = p.parse_args(argv)
    if args.calculate_kv_scales and not args.kv_cache_dtype.startswith("fp8"):
        p.error(f"--calculate-kv-scales sets fp8 scales: it needs --kv-cache-dtype fp8_e4m3 or fp8_e5m2, "
                f"got {args.kv_cache_dtype}")
    try:
        check_shutdown_timeout(args.shutdown_timeout, "--shutdown-timeout")
    except ValueError as e:
        p.error(str(e))
    api_key = args.api_key if args.api_key is not None else os.environ.get("MINIPAGED_API_KEY") or None
    if api_key == "":
        p.error("--api-key must not be empty")
    if args.max_request_body_bytes < 1:
        p.error(f"--max-request-body-bytes must be a positive number of bytes, got {args.max_request_body_bytes}")
    chat_template = None
    if args.chat_template is not None:
        try:
            with open(args.chat_template, encoding="utf-8") as f:
                chat_template = f.read()
        except OSError as e:
            p.error(f"--chat-template: cannot read {args.chat_template}: {e.strerror}")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        llm = LLMEngine.from_pretrained(args.model, dtype=None if args.dtype == "auto" else args.dtype,
                                        device=args.device, tensor_parallel_size=args.tensor_parallel_size,
                                        quantization=args.quantization, **engine_args(args))
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    weights = llm.stats()
    logging.getLogger("minipaged.serve").info("weights: %s, %.1f MiB", weights["weight_format"],
                                              weights["weight_bytes"] / 2**20)
    # uvicorn re-raises the signal that stopped it once it has stopped serving: end through the
    # finally below, so the engine can stop what it started (a tensor-parallel engine's workers),
    # with the shell's exit status for a signal (128 + its number) and no traceback
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _exit_on_signal)
    engine = AsyncLLMEngine(llm)
    if llm.grammars is not None:  # read the vocabulary for structured outputs now, not at the first such request
        threading.Thread(target=_prepare_grammars, args=(llm.grammars,), daemon=True).start()
    app = build_app(engine, args.served_model_name or args.model, model_path=os.path.abspath(args.model),
                    enable_auto_tool_choice=args.enable_auto_tool_choice,
                    structured_outputs_config=args.structured_outputs_config,
                    api_key=api_key, chat_template=chat_template, max_body_bytes=args.max_request_body_bytes)
    server = GracefulServer(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level),
                            shutdown_timeout=args.shutdown_timeout)
    try:
        server.run()
    finally:
        engine.shutdown()  # the open responses have ended and aborted their requests: the thread stops
        llm.shutdown()  # a tensor-parallel engine's workers
    return 0 if server.started else 3  # 3: uvicorn's status for a server that could not start


def _prepare_grammars(grammars) -> None:
    try:
        grammars.prepare()
    except ValueError as e:  # xgrammar missing: said again to any request that asks for structured outputs
        logging.getLogger(__name__).warning("structured outputs unavailable: %s", e)


def _exit_on_signal(signum, frame):
    raise SystemExit(128 + signum)
