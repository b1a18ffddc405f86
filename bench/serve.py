"""Serving benchmark: the same synthetic requests through minipaged's LLMEngine, transformers' own
continuous batching, static batches of ``model.generate``, and the compute roof, side by side in
one run, each warmed up first.

Default: a random Qwen3 shaped like Qwen3-0.6B (hidden 1024, 16/8 heads, head_dim 128, vocab
151936) with 4 layers, float32; 48 requests arriving all at once, prompts of 32-256 tokens and
outputs of 16-64 tokens (uniform), greedy, EOS ignored.

    python bench/serve.py                          # the table, bench/out/serve.csv and serve.png
    python bench/serve.py --arrival poisson --rate 4
    python bench/serve.py --system-prompt 256      # shared prefix: adds "engine, no prefix caching"
    python bench/serve.py --n 4                    # 4 sampled continuations per request
    python bench/serve.py --penalties              # adds "engine, penalties" (repetition/presence/frequency)
    python bench/serve.py --structured --systems engine --rounds 3
                        # adds "engine, json schema" (every request) and "engine, half json schema"
    python bench/serve.py --quick                  # tiny shapes, a smoke run
    python bench/serve.py --systems engine --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'
                        # adds "engine, speculative" (the same engine with speculative decoding)
    python bench/serve.py --workload repeat --systems engine --max-num-seqs 1 --speculative-config '...'
                        # outputs that copy an edited text out of their prompt (a scripted model)
    python bench/serve.py --workload repeat --layers 28 --systems engine --speculative-config \
        '{"method": "draft_model", "num_speculative_tokens": 4}' --draft-layers 1 --draft-hidden 512
                        # a draft model: 1 layer, hidden 512 (the bench model's shape without --draft-hidden)
    python bench/serve.py --systems engine --kv-cache-dtype auto,int8,fp8_e4m3 --kv-cache-memory 128e6 --rounds 2
                        # 8-bit KV caches: one engine row per format, all in the same memory (preemption-bound)

Workloads: "random" (the default: random prompts, outputs the random model's greedy tokens);
"repeat": each prompt holds an old version of a text (every 16th token edited), then the start of
the new version, and the model is rewritten (``tiny.script_greedy``) so that greedy decoding
continues the new version: outputs copy long runs of their prompt, as code edits and quotes do.

Systems (rows):
  engine        minipaged_ops.integration.LLMEngine: iteration-level scheduling on the paged cache
                (with --kv-cache-dtype, one row per format: "engine" is "auto", "engine int8" ...)
  transformers  model.init_continuous_batching: transformers' continuous batching (sdpa), given the
                same KV capacity (num_blocks pages of block_size tokens) and token budget
  static        model.generate with sdpa + DynamicCache on left-padded batches of whatever has
                arrived (up to --max-num-seqs), each batch running to its longest output
  roof          the same model on the same tokens, run as full prefill chunks of
                --max-num-batched-tokens tokens and full decode batches: the compute a perfect
                scheduler with no overhead would need (no latencies)

Columns: output tokens/s and its share of the roof's; TTFT, TPOT (time per output token after the
first) and end-to-end latency percentiles; ``in layers``: the share of the run's wall time spent
inside the model's own modules (embedding, decoder layers, norm, lm_head), for the engine of the
time inside ``engine.step()`` (the rest is its overhead: scheduling, bookkeeping, metadata,
sampling), for the others of the wall time; prefill tokens: tokens the model computed minus one
per decode (so padding counts, and prefix-cache hits do not).
"""

from __future__ import annotations

import argparse
import json
import csv
import logging
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_name, print_table  # noqa: E402

QWEN3_06B = dict(vocab=151936, hidden=1024, intermediate=3072, heads=16, kv_heads=8, head_dim=128)
TINY = dict(vocab=512, hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=32)


def bench_model(args, layers: int, dtype, shape: dict | None = None):
    """The random Qwen3 of the benchmark's shape, or ``shape`` (scripted to copy its text for --workload repeat)."""
    from minipaged_ops.tiny import script_greedy, tiny_model

    model = tiny_model("qwen3", layers=layers, max_positions=4096, init_range=None,
                       tie_embeddings=args.workload != "repeat", dtype=dtype, **(shape or args.shape))
    if args.workload == "repeat":
        script_greedy(model, repeat_texts(args, args.seed)[0])
    return model


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    w = p.add_argument_group("workload")
    w.add_argument("--requests", type=int, default=48)
    w.add_argument("--arrival", choices=("burst", "poisson"), default="burst",
                   help="burst: all at time 0; poisson: exponential gaps at --rate requests/s")
    w.add_argument("--rate", type=float, default=4.0, help="requests per second for --arrival poisson")
    w.add_argument("--prompt-len", default="32:256", help="uniform range of prompt tokens, lo:hi (default 32:256)")
    w.add_argument("--output-len", default="16:64", help="uniform range of output tokens, lo:hi (default 16:64)")
    w.add_argument("--system-prompt", type=int, default=0,
                   help="tokens of a system prompt shared by every request, before its own prompt")
    w.add_argument("--n", type=int, default=1, help="continuations per request (n > 1 samples at temperature 1)")
    w.add_argument("--penalties", action="store_true",
                   help="also run the engine with repetition, presence and frequency penalties on every request "
                        "(row 'engine, penalties')")
    w.add_argument("--structured", action="store_true",
                   help="also run the engine with a JSON schema on every request and on every other one (rows "
                        "'engine, json schema', 'engine, half json schema'); every engine row then has a tokenizer")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--workload", choices=("random", "repeat"), default="random",
                   help="repeat: outputs copy an edited text out of their prompt (see above)")
    m = p.add_argument_group("model (random Qwen3 shaped like Qwen3-0.6B)")
    m.add_argument("--layers", type=int, default=4)
    m.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    s = p.add_argument_group("serving")
    s.add_argument("--block-size", type=int, default=16)
    s.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks for the engine and transformers' CB (default: all requests fit at once)")
    s.add_argument("--kv-cache-memory", type=float, default=None,
                   help="bytes of KV cache (all layers): the engine rows size their pools from it (an 8-bit format "
                        "gets more blocks), transformers' CB gets as many blocks as the model's dtype fits")
    s.add_argument("--kv-cache-dtype", default="auto",
                   help="comma-separated formats of the engine's KV cache, one engine row each: auto (the model's "
                        "dtype), int8, fp8_e4m3, fp8_e5m2 (fp8 with calculate_kv_scales)")
    s.add_argument("--max-num-seqs", type=int, default=64)
    s.add_argument("--max-num-batched-tokens", type=int, default=1024)
    s.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="N > 1 adds the row 'engine tp=N': the engine over N processes on this machine "
                        "(gloo), each with 1/N of the heads and of the KV cache; plus memory and collectives per rank")
    s.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="adds the row 'engine, speculative': the engine with this speculative_config")
    s.add_argument("--draft-layers", type=int, default=1,
                   help="a draft_model config without 'model' gets the bench model's shape with this many "
                        "layers (scripted like it for --workload repeat)")
    s.add_argument("--draft-hidden", type=int, default=None,
                   help="the draft's hidden size (default: the bench model's); heads of 128 dims, hidden / 64 of "
                        "them (half as many KV heads), MLP 3x hidden: a draft cheaper than the target by what "
                        "real pairings have (Qwen3-0.6B for Qwen3-8B costs ~8%% of it)")
    s.add_argument("--systems", default="engine,transformers,static,roof",
                   help="comma-separated subset of engine,transformers,static,roof")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"),
                   help="folder for serve.csv and serve.png (default bench/out)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the systems this many times in turn (alternated); each row reports its median round")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    p.add_argument("--quick", action="store_true", help="tiny model, 8 short requests (unless given): a smoke run")
    args = p.parse_args(argv)
    args.shape = dict(QWEN3_06B)
    if args.quick:
        args.shape = dict(TINY)
        for name, value in dict(requests=8, prompt_len="8:40", output_len="4:12", layers=2).items():
            if getattr(args, name) == p.get_default(name):  # what the command line gave stays
                setattr(args, name, value)
        args.max_num_batched_tokens = min(args.max_num_batched_tokens, 64)
    for name in ("prompt_len", "output_len"):
        lo, _, hi = getattr(args, name).partition(":")
        lo, hi = int(lo), int(hi or lo)
        if not 1 <= lo <= hi:
            p.error(f"--{name.replace('_', '-')}: expected lo:hi with 1 <= lo <= hi, got {getattr(args, name)!r}")
        setattr(args, name, (lo, hi))
    unknown = set(args.systems.split(",")) - {"engine", "transformers", "static", "roof"}
    if unknown:
        p.error(f"--systems: unknown {sorted(unknown)}")
    from minipaged_ops.quantized import KV_CACHE_DTYPES

    args.kv_cache_dtypes = [k for k in args.kv_cache_dtype.split(",") if k]
    bad = [k for k in args.kv_cache_dtypes if k not in ("auto", *KV_CACHE_DTYPES)]
    if bad or not args.kv_cache_dtypes or len(set(args.kv_cache_dtypes)) < len(args.kv_cache_dtypes):
        p.error(f"--kv-cache-dtype: expected distinct names of auto, {', '.join(KV_CACHE_DTYPES)}, got "
                f"{args.kv_cache_dtype!r}")
    if args.kv_cache_memory is not None and (args.kv_cache_memory <= 0 or args.num_blocks is not None):
        p.error(f"--kv-cache-memory: expected bytes > 0, and not with --num-blocks, got {args.kv_cache_memory}")
    if args.rounds < 1:
        p.error(f"--rounds: expected >= 1, got {args.rounds}")
    return args


# ---------------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class Request:
    request_id: str
    prompt: list[int]
    max_tokens: int
    arrival: float  # seconds after the start of the run


def make_workload(args, vocab: int, seed: int, count: int | None = None) -> list[Request]:
    if args.workload == "repeat":
        return [Request(f"r{i}", prompt, n, 0.0) for i, (prompt, n) in enumerate(repeat_texts(args, seed, count)[1])]
    g = torch.Generator().manual_seed(seed)
    count = count or args.requests
    draw = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))
    system = torch.randint(3, vocab, (args.system_prompt,), generator=g).tolist()
    t, requests = 0.0, []
    for i in range(count):
        if args.arrival == "poisson" and i:
            t += float(torch.empty(1).exponential_(args.rate, generator=g))
        prompt = system + torch.randint(3, vocab, (draw(*args.prompt_len),), generator=g).tolist()
        requests.append(Request(f"r{i}", prompt, draw(*args.output_len), t))
    return requests


REPEAT_EDIT_EVERY = 16


def draft_shape(args) -> dict:
    """The draft model's shape: the bench model's, or --draft-hidden's."""
    if not args.draft_hidden or args.draft_hidden == args.shape["hidden"]:
        return args.shape
    heads = max(2, args.draft_hidden // 64)
    return dict(args.shape, hidden=args.draft_hidden, intermediate=3 * args.draft_hidden, heads=heads,
                kv_heads=heads // 2)


def repeat_texts(args, seed: int, count: int | None = None):
    """The "repeat" workload: (the script of every text, concatenated; [(prompt, output tokens)]).
    Text i is a run of distinct token ids; its prompt is the text with every 16th token replaced
    (the old version), then the text's first half; the output is the rest of the text."""
    count = count or args.requests
    length = args.prompt_len[1]
    g = torch.Generator().manual_seed(seed)
    hidden = min(args.shape["hidden"], draft_shape(args)["hidden"])  # script_greedy: distinct, <= hidden
    ids = (torch.randperm(hidden - 3, generator=g) + 3).tolist()
    if count * (length + length // REPEAT_EDIT_EVERY + 1) > len(ids):
        raise SystemExit(f"--workload repeat: {count} texts of {length} tokens need more than {len(ids)} distinct ids")
    script, work = [], []
    for _ in range(count):
        text, ids = ids[:length], ids[length:]
        edits, ids = ids[:length // REPEAT_EDIT_EVERY + 1], ids[length // REPEAT_EDIT_EVERY + 1:]
        old = [edits[j // REPEAT_EDIT_EVERY] if j % REPEAT_EDIT_EVERY == REPEAT_EDIT_EVERY - 1 else t
               for j, t in enumerate(text)]
        half = length // 2
        work.append((old + text[:half], min(args.output_len[1], length - half - 1)))
        script += text
    return script, work


def blocks_needed(requests, block_size: int, n: int) -> int:
    return sum(n * math.ceil((len(r.prompt) + r.max_tokens) / block_size) for r in requests)


# ---------------------------------------------------------------------------------- measuring


@dataclass
class Timeline:
    arrival: float  # perf_counter seconds
    first_token: float | None = None
    finish: float | None = None
    tokens: list[list[int]] = field(default_factory=list)  # one list per continuation


@dataclass
class RunResult:
    system: str
    wall: float
    timelines: dict[str, Timeline]
    model_seconds: float = 0.0
    tokens_computed: int = 0
    blocks: list[tuple[float, int]] = field(default_factory=list)  # (seconds since start, KV blocks held)
    stats: dict = field(default_factory=dict)
    busy: float | None = None  # seconds inside engine.step() (None: the whole wall time)
    roof_wall: float | None = None  # the roof measured next to this run


class ModelTimer:
    """Forward hooks on the model's own modules (embedding, every decoder layer, final norm,
    lm_head): seconds spent inside them, and tokens that went through the embedding."""

    def __init__(self, model):
        decoder = model.get_decoder()
        self.modules = [decoder.embed_tokens, *decoder.layers, decoder.norm, model.get_output_embeddings()]
        self.seconds = 0.0
        self.tokens = 0
        self._start = {}
        self.handles = []
        for m in self.modules:
            self.handles.append(m.register_forward_pre_hook(self._pre))
            self.handles.append(m.register_forward_hook(self._post))
        self.handles.append(decoder.embed_tokens.register_forward_hook(self._count))

    def _pre(self, module, args):
        self._start[id(module)] = time.perf_counter()

    def _post(self, module, args, output):
        self.seconds += time.perf_counter() - self._start.pop(id(module))

    def _count(self, module, args, output):
        self.tokens += args[0].numel()

    def close(self):
        for h in self.handles:
            h.remove()


def progress(total: int, desc: str, args):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="req", leave=False, file=sys.stderr, disable=args.no_progress or None)


PENALTIES = dict(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5)
# --structured: what every constrained request obeys (a short title, a year, tags, then free notes:
# a random model spends its tokens in structural states and inside strings)
BENCH_SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 12}, "year": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}}, "notes": {"type": "string"}},
    "required": ["title", "year", "tags", "notes"]}


def sampling(args, penalties: bool = False) -> dict:
    """Greedy for n=1; n>1 samples (temperature 1, no top-k/top-p) so the continuations differ;
    ``penalties``: :data:`PENALTIES` on top (the engine only)."""
    return dict(temperature=1.0 if args.n > 1 else 0.0, **(PENALTIES if penalties else {}))


# ---------------------------------------------------------------------------------- systems


def run_engine(model, requests, args, num_blocks, desc="engine", prefix_caching=True, make_engine=None,
               penalties=False, kv_cache_dtype="auto", constrained_every=0, speculative_config=None) -> RunResult:
    """``make_engine(**engine_args)``: another way to build the engine (a tensor-parallel one);
    default ``LLMEngine(model, ...)``. The engine is shut down at the end. ``penalties``: every
    request with :data:`PENALTIES`. With ``--kv-cache-memory`` the pool is sized from those bytes
    in ``kv_cache_dtype`` (fp8: scales from the first batch), else it has ``num_blocks``.
    ``constrained_every=k``: request i obeys :data:`BENCH_SCHEMA` when i % k == 0 (0: none)."""
    from minipaged_ops.integration import LLMEngine, SamplingParams, StructuredOutputsParams

    size = dict(num_blocks=num_blocks) if args.kv_cache_memory is None else dict(kv_cache_memory=int(args.kv_cache_memory))
    engine_args = dict(size, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=prefix_caching)
    if kv_cache_dtype != "auto":
        engine_args.update(kv_cache_dtype=kv_cache_dtype, calculate_kv_scales=kv_cache_dtype.startswith("fp8"))
    if getattr(args, "tokenizer", None) is not None:
        engine_args["tokenizer"] = args.tokenizer
    if speculative_config is not None:
        engine_args.update(speculative_config=speculative_config)
    engine = make_engine(**engine_args) if make_engine else LLMEngine(model, **engine_args)
    bm = engine.block_manager
    timelines: dict[str, Timeline] = {}
    blocks = []
    timer = ModelTimer(engine.model)
    bar = progress(len(requests), desc, args)
    pending = sorted(requests, key=lambda r: r.arrival)
    i, busy, peak_running, start = 0, 0.0, 0, time.perf_counter()
    try:
        while i < len(pending) or engine.has_unfinished_requests():
            now = time.perf_counter()
            while i < len(pending) and start + pending[i].arrival <= now:
                r = pending[i]
                constraint = StructuredOutputsParams(json=BENCH_SCHEMA) if constrained_every and \
                    i % constrained_every == 0 else None
                params = SamplingParams(n=args.n, max_tokens=r.max_tokens, ignore_eos=True, seed=args.seed + i,
                                        structured_outputs=constraint, **sampling(args, penalties))
                engine.add_request(r.request_id, r.prompt, params)
                timelines[r.request_id] = Timeline(start + r.arrival)
                i += 1
            if not engine.has_unfinished_requests():
                time.sleep(max(0.0, start + pending[i].arrival - time.perf_counter()))
                continue
            outputs = engine.step()
            t = time.perf_counter()
            busy += t - now
            for out in outputs:
                tl = timelines[out.request_id]
                if tl.first_token is None and any(len(c.token_ids) for c in out.outputs):
                    tl.first_token = t
                if out.finished:
                    tl.finish = t
                    tl.tokens = [list(c.token_ids) for c in sorted(out.outputs, key=lambda c: c.index)]
                    bar.update(1)
            blocks.append((t - start, bm.num_blocks - bm.num_free_blocks))
            # the step's sequences: those still running plus those it finished
            peak_running = max(peak_running, len(engine.scheduler.running) + sum(o.finished for o in outputs))
        wall = time.perf_counter() - start
        stats = dict(engine.stats(), memory_per_rank=memory_per_rank(engine), peak_running=peak_running)
        if constrained_every:
            stats["compile_seconds"] = list(engine.grammars.compile_seconds)
    finally:
        timer.close()
        bar.close()
        engine.shutdown()
    return RunResult(desc, wall, timelines, timer.seconds, timer.tokens, blocks, stats, busy)


def memory_per_rank(engine) -> dict:
    """Bytes one rank holds: its parameters, its KV pool, its peak KV in use, and a worker
    process's private memory (``RssAnon``: torch itself included, the memory-mapped checkpoint
    not); rank 0 is this process."""
    stats = engine.stats()
    params = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    private = None
    for pid in getattr(engine, "worker_pids", ()):
        with open(f"/proc/{pid}/status") as f:
            private = max(private or 0, next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon")))
    return dict(params=params, kv_pool=stats.get("kv_bytes_per_rank", engine.num_blocks * engine.kv_bytes_per_block),
                peak_kv=stats["peak_kv_bytes"], worker_private=private)


def tensor_parallel_factory(model, args, folder: str):
    """Saves ``model`` (and a tokenizer, which loading wants) to ``folder``; returns a
    ``make_engine`` that starts a tensor-parallel engine of ``--tensor-parallel-size`` ranks on it."""
    from minipaged_ops.integration.distributed import start_engine
    from minipaged_ops.tiny import tiny_tokenizer

    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    # token ids in and out, as the engine row (no tokenizer: no detokenizing in the loop)
    return lambda **engine_args: start_engine(folder, args.tensor_parallel_size, dtype=args.dtype, device="cpu",
                                              tokenizer=None, **engine_args)


def print_tensor_parallel(results: list) -> None:
    """Memory per rank and time in collectives, for each engine row."""
    print("\nper rank (MiB; rank 0 is this process, which also holds the other systems' model) and collectives:")
    mib = 1 << 20
    for r in results:
        m = r.stats.get("memory_per_rank")
        if m is None:
            continue
        line = (f"  {r.system:<22} params {m['params'] / mib:8.1f}   KV pool {m['kv_pool'] / mib:8.1f}   "
                f"peak KV {m['peak_kv'] / mib:8.1f}")
        if m["worker_private"]:
            line += f"   worker private memory {m['worker_private'] / mib:8.1f}"
        collectives = r.stats.get("collective_seconds")
        steps = max(1, r.stats["steps"])
        if collectives:
            total = collectives["broadcast"] + collectives["model"]
            line += (f"\n  {'':<22} collectives {total / steps * 1e3:.2f} ms/step of {(r.busy or r.wall) / steps * 1e3:.2f} "
                     f"({total / (r.busy or r.wall):.0%}; broadcast {collectives['broadcast'] / steps * 1e3:.2f}, "
                     f"all-reduces + gather {collectives['model'] / steps * 1e3:.2f}) over {steps} steps")
        print(line)


def engine_row(kv_cache_dtype: str) -> str:
    return "engine" if kv_cache_dtype == "auto" else f"engine {kv_cache_dtype}"


def pool_text(args, num_blocks: int) -> str:
    if args.kv_cache_memory is None:
        return f"{num_blocks} blocks of {args.block_size}"
    return f"KV cache {args.kv_cache_memory / 2**20:.3g} MiB (blocks of {args.block_size})"


def print_kv_formats(runs: dict, requests, args) -> None:
    """One line per engine format: its pool in the same memory and what it did with it. Output
    tokens/s of every round (they alternated); ratios against "auto" round by round."""
    output_tokens = sum(args.n * r.max_tokens for r in requests)
    rows = [(kv, runs[engine_row(kv)]) for kv in args.kv_cache_dtypes if engine_row(kv) in runs]
    base = dict(rows).get("auto")
    against = "x auto: the median of the rounds' ratios" if base else "no auto row to compare with"
    print(f"\nKV cache formats (engine rows; peak running: sequences in one step; out tok/s of each round; {against}):")
    print(f"  {'format':<10} {'kv_bytes_per_block':>18} {'x auto':>7} {'blocks':>7} {'tokens':>8} {'peak running':>12} "
          f"{'preemptions':>11} {'out tok/s':>20} {'x auto':>7}")
    for kv, results in rows:
        s = results[0].stats
        rates = [output_tokens / r.wall for r in results]
        bytes_ratio = f"{s['kv_bytes_per_block'] / base[0].stats['kv_bytes_per_block']:.3f}" if base else "-"
        speed = f"{statistics.median(b.wall / r.wall for b, r in zip(base, results)):.2f}" if base else "-"
        print(f"  {kv:<10} {s['kv_bytes_per_block']:>18,} {bytes_ratio:>7} {s['blocks_total']:>7} "
              f"{s['blocks_total'] * args.block_size:>8} {'/'.join(str(r.stats['peak_running']) for r in results):>12} "
              f"{'/'.join(str(r.stats['preemptions']) for r in results):>11} "
              f"{'/'.join(f'{x:.1f}' for x in rates):>20} {speed:>7}")


def run_transformers_cb(model, requests, args, num_blocks, desc="transformers") -> RunResult:
    """transformers' continuous batching with the engine's KV capacity and token budget (its
    defaults would size the cache from the machine's free memory)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model.set_attn_implementation("sdpa")
    sample = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if args.n > 1 else dict(do_sample=False)
    gen = GenerationConfig(max_new_tokens=max(r.max_tokens for r in requests), num_return_sequences=args.n,
                           pad_token_id=0, eos_token_id=-1, **sample)
    cb = ContinuousBatchingConfig(
        page_size=args.block_size, num_blocks=num_blocks, max_batch_tokens=args.max_num_batched_tokens,
        max_requests_per_batch=args.max_num_seqs, allow_block_sharing=True, use_cuda_graph=False,
        use_async_batching=False, auto_switch_to_flash=False, seed=args.seed,
    )
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    timelines: dict[str, Timeline] = {}
    parts: dict[str, list] = {}
    timer = ModelTimer(model)
    bar = progress(len(requests), desc, args)
    pending = sorted(requests, key=lambda r: r.arrival)
    i, done = 0, 0
    manager.start()
    start = time.perf_counter()
    try:
        while done < len(requests):
            now = time.perf_counter()
            while i < len(pending) and start + pending[i].arrival <= now:
                r = pending[i]
                timelines[r.request_id] = Timeline(start + r.arrival)
                manager.add_request(r.prompt, request_id=r.request_id, max_new_tokens=r.max_tokens,
                                    record_timestamps=True)
                i += 1
            wait = 0.05 if i == len(pending) else max(0.001, min(0.05, start + pending[i].arrival - now))
            result = manager.get_result(timeout=wait)
            if result is None or not result.is_finished():
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching thread stopped")
                continue
            if result.error is not None:
                raise RuntimeError(f"transformers' continuous batching failed request {result.request_id}: {result.error}")
            parent = result.request_id.split("__child#")[0]
            parts.setdefault(parent, []).append(result)
            if len(parts[parent]) == args.n:
                tl = timelines[parent]
                tl.first_token = min(p.timestamps[0] for p in parts[parent])
                tl.finish = max(p.timestamps[-1] for p in parts[parent])
                tl.tokens = [list(p.generated_tokens) for p in parts[parent]]
                done += 1
                bar.update(1)
        wall = max(tl.finish for tl in timelines.values()) - start
    finally:
        manager.stop(block=True)
        timer.close()
        bar.close()
    return RunResult(desc, wall, timelines, timer.seconds, timer.tokens)


def run_static(model, requests, args, desc="static") -> RunResult:
    """Left-padded batches of whatever has arrived (up to --max-num-seqs) through generate with
    sdpa + DynamicCache; a batch runs to its longest output. A request's first token is the end
    of its batch's first step, its finish the end of the step that made its own last token."""
    model.set_attn_implementation("sdpa")
    timelines: dict[str, Timeline] = {}
    blocks = []
    timer = ModelTimer(model)
    bar = progress(len(requests), desc, args)
    pending = sorted(requests, key=lambda r: r.arrival)
    step_ends: list[float] = []
    state = {"rows": 0, "width": 0}
    start = time.perf_counter()

    def on_step(module, args_, output):
        step_ends.append(time.perf_counter())
        held = state["rows"] * (state["width"] + len(step_ends))  # DynamicCache: every row, every column
        blocks.append((step_ends[-1] - start, math.ceil(held / args.block_size)))

    handle = model.register_forward_hook(on_step)
    try:
        i = 0
        while i < len(pending):
            now = time.perf_counter()
            if start + pending[i].arrival > now:
                time.sleep(start + pending[i].arrival - now)
                continue
            batch = []
            while i < len(pending) and len(batch) < args.max_num_seqs and start + pending[i].arrival <= now:
                batch.append(pending[i])
                i += 1
            width = max(len(r.prompt) for r in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, r in enumerate(batch):
                ids[row, width - len(r.prompt):] = torch.tensor(r.prompt)
                mask[row, width - len(r.prompt):] = 1
                timelines[r.request_id] = Timeline(start + r.arrival)
            state.update(rows=len(batch) * args.n, width=width)
            step_ends.clear()
            torch.manual_seed(args.seed)
            with torch.no_grad():
                sample = dict(do_sample=True, temperature=1.0, top_k=0) if args.n > 1 else dict(do_sample=False)
                out = model.generate(ids, attention_mask=mask, max_new_tokens=max(r.max_tokens for r in batch),
                                     num_return_sequences=args.n, pad_token_id=0, **sample)
            for row, r in enumerate(batch):
                tl = timelines[r.request_id]
                tl.first_token, tl.finish = step_ends[0], step_ends[r.max_tokens - 1]
                rows = out[row * args.n:(row + 1) * args.n, width:width + r.max_tokens]
                tl.tokens = rows.tolist()
                bar.update(1)
        wall = max(tl.finish for tl in timelines.values()) - start
    finally:
        handle.remove()
        timer.close()
        bar.close()
    return RunResult(desc, wall, timelines, timer.seconds, timer.tokens, blocks)


def run_roof(model, requests, args, repeats: int = 3) -> RunResult:
    """Seconds the model needs for the workload's tokens as full prefill chunks of the token
    budget (logits for as many positions as sequences end in a chunk) plus full decode batches
    of --max-num-seqs rows over the mean context (sdpa, contiguous K/V)."""
    from transformers import DynamicCache

    from minipaged_ops.integration import _compat

    model.set_attn_implementation("sdpa")
    cfg = model.config
    chunk = args.max_num_batched_tokens
    prefill_tokens = sum(len(r.prompt) for r in requests)
    decode_tokens = sum(args.n * (r.max_tokens - 1) for r in requests)
    chunks = prefill_tokens / chunk
    ends_per_chunk = max(1, round(len(requests) / max(chunks, 1)))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, cfg.vocab_size, (1, chunk), generator=g)

    def prefill():
        model(ids, use_cache=False, logits_to_keep=ends_per_chunk)

    rows = min(args.max_num_seqs, len(requests) * args.n)
    context = round(statistics.mean(len(r.prompt) + r.max_tokens / 2 for r in requests))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    step_ids = torch.randint(3, cfg.vocab_size, (rows, 1), generator=g)
    kv = torch.randn(rows, cfg.num_key_value_heads, context, head_dim, generator=g, dtype=torch.float32).to(model.dtype)

    cache = DynamicCache(config=cfg)  # the history; each timed step appends one token to it
    for layer in range(cfg.num_hidden_layers):
        cache.update(kv, kv, layer)

    def decode():
        position_ids = torch.full((rows, 1), cache.get_seq_length())
        model(step_ids, position_ids=position_ids, use_cache=True, **_compat.cache_kwargs(cache))

    timer = ModelTimer(model)
    times = {"prefill": [], "decode": []}
    with torch.no_grad():
        prefill(), decode()  # warm-up
        for _ in range(repeats):  # alternated, so a busy moment lands on both
            for name, fn in (("prefill", prefill), ("decode", decode)):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    timer.close()
    t_prefill, t_decode = statistics.median(times["prefill"]), statistics.median(times["decode"])
    wall = chunks * t_prefill + decode_tokens / rows * t_decode
    stats = {"prefill_chunk_s": t_prefill, "decode_step_s": t_decode, "decode_rows": rows, "context": context}
    return RunResult("roof", wall, {}, wall, prefill_tokens + decode_tokens, stats=stats)



# ---------------------------------------------------------------------------------- report


def percentiles(values, ps=(50, 95, 99)) -> list[float]:
    if not values:
        return [float("nan")] * len(ps)
    v = sorted(values)
    return [v[min(len(v) - 1, max(0, math.ceil(p / 100 * len(v)) - 1))] for p in ps]


def latencies(result: RunResult) -> dict[str, list[float]]:
    ttft, tpot, e2e = [], [], []
    for tl in result.timelines.values():
        ttft.append(tl.first_token - tl.arrival)
        e2e.append(tl.finish - tl.arrival)
        longest = max(len(t) for t in tl.tokens)
        if longest > 1:
            tpot.append((tl.finish - tl.first_token) / (longest - 1))
    return {"ttft": ttft, "tpot": tpot, "e2e": e2e}


def prefill_tokens(result: RunResult, decode_tokens: int) -> int:
    """Prompt tokens the model computed: the engine counts them; for the others, all tokens
    through the embedding minus one per decode (padding included)."""
    return result.stats.get("prefill_tokens_computed", result.tokens_computed - decode_tokens)


def summary_row(result: RunResult, requests, args, roof: RunResult | None, reference: RunResult | None) -> dict:
    output_tokens = sum(args.n * r.max_tokens for r in requests)
    decode_tokens = sum(args.n * (r.max_tokens - 1) for r in requests)
    row = {"system": result.system, "wall s": f"{result.wall:.2f}", "out tok/s": f"{output_tokens / result.wall:.1f}"}
    if roof is not None:  # the roof measured next to this system (the run's median for the roof row)
        row["vs roof"] = f"{(result.roof_wall or roof.wall) / result.wall:.0%}"
    if result.timelines:
        lat = latencies(result)
        for key, label, scale in (("ttft", "TTFT", 1), ("tpot", "TPOT ms", 1e3), ("e2e", "E2E", 1)):
            p50, p95, p99 = percentiles(lat[key])
            row[f"{label} p50/p95/p99"] = f"{p50 * scale:.2f}/{p95 * scale:.2f}/{p99 * scale:.2f}"
        row["in layers"] = f"{result.model_seconds / (result.busy or result.wall):.0%}"
        row["prefill tokens"] = str(prefill_tokens(result, decode_tokens))
        if result.blocks:
            row["peak blocks"] = str(max(b for _, b in result.blocks))
        if reference is not None and reference is not result and args.n == 1:
            same = sum(result.timelines[k].tokens == reference.timelines[k].tokens for k in reference.timelines)
            row["same tokens"] = f"{same}/{len(reference.timelines)}"
    return row


def write_csv(path, results, requests, args) -> None:
    by_id = {r.request_id: r for r in requests}
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["system", "request_id", "prompt_tokens", "output_tokens", "n", "arrival_s", "ttft_s", "e2e_s",
                    "tpot_s"])
        for res in results:
            t0 = min((tl.arrival for tl in res.timelines.values()), default=0.0)
            for rid, tl in res.timelines.items():
                r = by_id[rid]
                tpot = (tl.finish - tl.first_token) / (r.max_tokens - 1) if r.max_tokens > 1 else ""
                w.writerow([res.system, rid, len(r.prompt), r.max_tokens, args.n, f"{tl.arrival - t0:.4f}",
                            f"{tl.first_token - tl.arrival:.4f}", f"{tl.finish - tl.arrival:.4f}",
                            f"{tpot:.5f}" if tpot != "" else ""])


def write_plot(path, results, roof, num_blocks, title) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for res in results:
        if not res.timelines:
            continue
        lat = latencies(res)
        for ax, key in zip(axes[:2], ("ttft", "e2e")):
            v = sorted(lat[key])
            ax.plot(v, [(i + 1) / len(v) for i in range(len(v))], label=res.system, drawstyle="steps-post")
        if res.blocks:
            axes[2].plot([t for t, _ in res.blocks], [b for _, b in res.blocks], label=res.system)
    axes[0].set_title("time to first token")
    axes[1].set_title("end-to-end latency")
    for ax in axes[:2]:
        ax.set_xlabel("seconds")
        ax.set_ylabel("share of requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[2].axhline(num_blocks, color="gray", ls="--", lw=1, label="pool (engine, transformers)")
    axes[2].set_title("KV blocks held (static: its DynamicCache)")
    axes[2].set_xlabel("seconds since the first arrival")
    axes[2].legend(fontsize=8)
    axes[2].grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    import transformers

    import minipaged_ops.integration  # noqa: F401  (registers "minipaged")

    transformers.logging.set_verbosity_error()
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)  # sizing notes on every start

    dtype = getattr(torch, args.dtype)
    vocab = args.shape["vocab"]
    model = bench_model(args, args.layers, dtype)
    requests = make_workload(args, vocab, args.seed)
    num_blocks = args.num_blocks or blocks_needed(requests, args.block_size, args.n)
    if args.kv_cache_memory is not None:  # what the model's dtype fits (the engine rows size their own)
        from minipaged_ops.integration.kv_pool import kv_geometry

        num_blocks = int(args.kv_cache_memory) // kv_geometry(model).bytes_per_block(args.block_size, dtype)
    systems = args.systems.split(",")
    params = sum(p.numel() for p in model.parameters()) / 1e6
    title = (f"{len(requests)} requests ({args.arrival}{f' {args.rate}/s' if args.arrival == 'poisson' else ''}), "
             f"prompts {args.prompt_len[0]}-{args.prompt_len[1]}"
             f"{f' + {args.system_prompt} shared' if args.system_prompt else ''}, outputs "
             f"{args.output_len[0]}-{args.output_len[1]}, n={args.n}; Qwen3 {args.layers} layers ({params:.0f}M), "
             f"{args.dtype}; {pool_text(args, num_blocks)}, budget {args.max_num_batched_tokens} tokens, "
             f"max {args.max_num_seqs} seqs; {machine_name()}")
    print(title)
    print(f"torch {torch.__version__}; each system warmed up on {min(4, args.requests)} other requests first")

    runners = {
        engine_row(kv): lambda reqs, blocks, kv=kv: run_engine(model, reqs, args, blocks, desc=engine_row(kv),
                                                               kv_cache_dtype=kv)
        for kv in args.kv_cache_dtypes
    }
    runners |= {
        "transformers": lambda reqs, blocks: run_transformers_cb(model, reqs, args, blocks),
        "static": lambda reqs, blocks: run_static(model, reqs, args),
    }
    tp_folder = None
    if args.tensor_parallel_size > 1 and "engine" in systems:
        import tempfile

        tp_folder = tempfile.mkdtemp(prefix="serve-tp-")
        make_tp = tensor_parallel_factory(model, args, tp_folder)
        runners[f"engine tp={args.tensor_parallel_size}"] = lambda reqs, blocks: run_engine(
            model, reqs, args, blocks, desc=f"engine tp={args.tensor_parallel_size}", make_engine=make_tp)
    if args.system_prompt and "engine" in systems:
        runners["engine, no prefix caching"] = lambda reqs, blocks: run_engine(
            model, reqs, args, blocks, desc="engine, no prefix caching", prefix_caching=False)
    if args.speculative_config and "engine" in systems:
        spec = json.loads(args.speculative_config)
        if spec.get("method") == "draft_model" and "model" not in spec:
            spec["model"] = bench_model(args, args.draft_layers, dtype, draft_shape(args))
        runners["engine, speculative"] = lambda reqs, blocks: run_engine(
            model, reqs, args, blocks, desc="engine, speculative", speculative_config=spec)
    if args.penalties and "engine" in systems:
        runners["engine, penalties"] = lambda reqs, blocks: run_engine(
            model, reqs, args, blocks, desc="engine, penalties", penalties=True)
    if args.structured and "engine" in systems:
        from structured_bench import bench_tokenizer

        args.tokenizer = bench_tokenizer(vocab)
        for name, every in (("engine, json schema", 1), ("engine, half json schema", 2)):
            runners[name] = lambda reqs, blocks, name=name, every=every: run_engine(
                model, reqs, args, blocks, desc=name, constrained_every=every)
    order = [s for s in runners if s.split(",")[0].split()[0] in systems]

    warm = make_workload(args, vocab, args.seed + 1000, count=min(4, args.requests))
    warm = [Request(r.request_id, r.prompt, min(r.max_tokens, 4), 0.0) for r in warm]
    for name in order:
        runners[name](warm, max(num_blocks, blocks_needed(warm, args.block_size, args.n)))

    # the roof is measured before, between and after the systems; each system is compared with
    # the mean of the two measured next to it, so a load that drifts during the run on a shared
    # machine lands on both sides of each ratio alike
    measure_roof = "roof" in systems
    roofs = [run_roof(model, requests, args)] if measure_roof else []
    runs = {name: [] for name in order}
    flat = []
    for round_ in range(args.rounds):  # the systems in turn, so a busy spell lands on all of them
        for name in order:
            print(f"  running {name} (round {round_ + 1} of {args.rounds}) ...", file=sys.stderr)
            flat.append(runners[name](requests, num_blocks))
            runs[name].append(flat[-1])
            if measure_roof:
                roofs.append(run_roof(model, requests, args))
    roof = None
    if measure_roof:
        roof = roofs[0]
        roof.wall = statistics.median(r.wall for r in roofs)
        roof.stats.update({k: statistics.median(r.stats[k] for r in roofs) for k in ("prefill_chunk_s", "decode_step_s")})
        for i, res in enumerate(flat):
            res.roof_wall = (roofs[i].wall + roofs[i + 1].wall) / 2
    results = [sorted(runs[name], key=lambda r: r.wall)[(len(runs[name]) - 1) // 2] for name in order]  # median

    reference = next(iter(results), None)
    rows = [summary_row(r, requests, args, roof, reference) for r in results]
    if roof is not None:
        rows.append(summary_row(roof, requests, args, roof, None))
    columns = ["system", "wall s", "out tok/s", "vs roof", "TTFT p50/p95/p99", "TPOT ms p50/p95/p99",
               "E2E p50/p95/p99", "in layers", "prefill tokens", "peak blocks", "same tokens"]
    print()
    print_table(rows, columns)
    if roof is not None:
        s = roof.stats
        print(f"roof (median of {len(roofs)} measured before, between and after the systems; each 'vs roof' uses the "
              f"two next to its system): {s['prefill_chunk_s'] * 1e3:.0f} ms per {args.max_num_batched_tokens}-token "
              f"prefill chunk, {s['decode_step_s'] * 1e3:.0f} ms per decode step of {s['decode_rows']} rows at "
              f"context {s['context']}; all measured: {', '.join(f'{r.wall:.1f}' for r in roofs)} s")
    by_name = {r.system: r for r in results}
    if "engine" in by_name and "engine, no prefix caching" in by_name:
        decode_tokens = sum(args.n * (r.max_tokens - 1) for r in requests)
        with_pc = prefill_tokens(by_name["engine"], decode_tokens)
        without = prefill_tokens(by_name["engine, no prefix caching"], decode_tokens)
        print(f"prefix caching: {with_pc} prefill tokens computed vs {without} without "
              f"({1 - with_pc / without:.0%} fewer)")
        # what is left once each request's own prompt is computed: the shared system prompt
        own = sum(len(r.prompt) - args.system_prompt for r in requests)
        print(f"  of the shared {args.system_prompt}-token system prompt: {with_pc - own} tokens computed vs "
              f"{without - own} without ({1 - (with_pc - own) / (without - own):.0%} fewer; the best possible is "
              f"computing it once, {args.system_prompt} tokens, {1 - args.system_prompt / (without - own):.0%} fewer)")
    if len(args.kv_cache_dtypes) > 1 or args.kv_cache_dtypes != ["auto"]:
        print_kv_formats(runs, requests, args)
    if args.structured and "engine" in runs:
        from structured_bench import print_structured

        print_structured(runs, args.tokenizer, vocab, BENCH_SCHEMA)
    if tp_folder is not None:
        import shutil

        print_tensor_parallel(results)
        shutil.rmtree(tp_folder, ignore_errors=True)
    if "engine" in by_name:
        from minipaged_ops.integration.demo import format_report

        print("\nengine.stats() after the run (the capacity report):")
        print(format_report(by_name["engine"].stats))

    os.makedirs(args.out, exist_ok=True)
    csv_path, png_path = os.path.join(args.out, "serve.csv"), os.path.join(args.out, "serve.png")
    write_csv(csv_path, results, requests, args)
    write_plot(png_path, results, roof, num_blocks, title)
    print(f"\nwrote {csv_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
