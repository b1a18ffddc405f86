"""Load generator for OpenAI-compatible servers, in the manner of ``vllm bench serve``: the same
text requests, streamed through the ``openai`` client, against minipaged's server, ``transformers
serve`` on the same model folder — as it starts by default (one ``generate()`` at a time) and with
``--continuous-batching`` — and minipaged's engine in this process (no HTTP: what the HTTP layer
costs), one after the other in one run, each warmed up first. Same dtype (the folder's) and the
same torch thread count everywhere.

Default: bench/serve.py's model — a random Qwen3 shaped like Qwen3-0.6B (hidden 1024, 16/8 heads,
head_dim 128, vocabulary 151936) with 4 layers, float32 — written to a folder with the tiny
tokenizer (minipaged_ops.tiny: a 512-token byte-level BPE, its vocabulary filled up to the model's
with placeholder tokens, so every sampled id decodes to text); 32 requests at once, prompts of
32-256 tokens and outputs of 16-64 tokens (uniform, as bench/serve.py draws them), greedy, EOS
ignored.

    python bench/serve_http.py                                   # the table, bench/out/serve_http.{csv,png}
    python bench/serve_http.py --arrival poisson --rate 4
    python bench/serve_http.py --url http://host:8000/v1         # an already running server only
    python bench/serve_http.py --quick                           # a smoke run

Per system: output tokens/s, TTFT, inter-token latency (ITL: gaps between a stream's chunks),
TPOT ((end-to-end - TTFT) / (output tokens - 1)) and end-to-end latency P50/P95/P99, and goodput
(requests/s meeting --ttft-limit and --tpot-limit); the CPU seconds the server's processes and
this client used during the run. ``transformers serve`` needs ``accelerate`` (it loads with a
device map); without it the run skips both transformers systems and says why.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_name, print_table  # noqa: E402
from serve import percentiles  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
QWEN3_06B = dict(hidden=1024, intermediate=3072, heads=16, kv_heads=8, head_dim=128, layers=4, pad_vocab_to=151936)
TINY = dict(hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=32, layers=2)
SYSTEMS = ("minipaged", "transformers", "transformers-cb", "engine")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder (default: write the random one to bench/out/)")
    p.add_argument("--systems", default=None,
                   help=f"comma-separated subset of {','.join(SYSTEMS)} (default: all, or none with --url)")
    p.add_argument("--url", action="append", default=[], help="an already running server's /v1 URL (repeatable)")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--arrival", choices=("burst", "poisson"), default="burst")
    p.add_argument("--rate", type=float, default=4.0, help="requests/s for --arrival poisson")
    p.add_argument("--prompt-len", default="32:256")
    p.add_argument("--output-len", default="16:64")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ttft-limit", type=float, default=5.0, help="goodput: TTFT limit, seconds")
    p.add_argument("--tpot-limit", type=float, default=0.25, help="goodput: TPOT limit, seconds")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None, help="default: every request fits at once")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--dtype", default=None, help="default: the folder's config.json dtype; passed to every system")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads of every system (OMP_NUM_THREADS of the servers; default: torch's default here)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run the systems this many times, in alternating order (a b c, c b a, ...); the table has "
                        "each system's median run by tokens/s, the ratios are of medians")
    p.add_argument("--baseline-model", default=None, metavar="DIR",
                   help="also run minipaged's server on this folder, in its own dtype (system 'minipaged-baseline'), "
                        "alternated with the others: e.g. the float32 model beside its bfloat16 copy")
    p.add_argument("--minipaged-arg", action="append", default=[], metavar="ARG",
                   help="one more argument of the minipaged server, e.g. --minipaged-arg=--quantization "
                        "--minipaged-arg=int8 (repeatable; bench/llama_cpp.py passes its pairs' so)")
    p.add_argument("--out", default=os.path.join(HERE, "out"))
    p.add_argument("--quick", action="store_true", help="tiny model, 6 short requests")
    args = p.parse_args(argv)
    args.shape = dict(TINY if args.quick else QWEN3_06B)
    if args.quick:
        args.requests, args.prompt_len, args.output_len = 6, "8:40", "4:12"
    for name in ("prompt_len", "output_len"):
        lo, _, hi = getattr(args, name).partition(":")
        setattr(args, name, (int(lo), int(hi or lo)))
    args.systems = [s for s in (args.systems or ("" if args.url else ",".join(SYSTEMS))).split(",") if s]
    if args.baseline_model:
        args.systems.append("minipaged-baseline")
    unknown = set(args.systems) - set(SYSTEMS) - {"minipaged-baseline"}
    if unknown:
        p.error(f"--systems: unknown {sorted(unknown)}")
    return args


# ---------------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class Request:
    prompt: str
    prompt_tokens: int
    max_tokens: int
    arrival: float


def make_workload(args, tokenizer, seed: int, count: int) -> list[Request]:
    """Text prompts of the drawn token lengths (words of the tokenizer's training text until the
    prompt has at least that many tokens), output lengths and arrival times."""
    from minipaged_ops.tiny import TRAINING_TEXT

    words = TRAINING_TEXT.split()
    rng = random.Random(seed)
    t, requests = 0.0, []
    for i in range(count):
        if args.arrival == "poisson" and i:
            t += rng.expovariate(args.rate)
        want = rng.randint(*args.prompt_len)
        text, n = "", 0
        while n < want:
            text = f"{text} {rng.choice(words)}" if text else rng.choice(words)
            n = len(tokenizer.encode(text))
        requests.append(Request(text, n, rng.randint(*args.output_len), t))
    return requests


# ---------------------------------------------------------------------------------- measuring


@dataclass
class Timeline:
    sent: float
    chunks: list[float] = field(default_factory=list)  # arrival of each chunk carrying tokens
    output_tokens: int = 0
    finish: float = 0.0


# EOS ignored: vLLM's (and minipaged's) ignore_eos; transformers serve refuses unknown fields but takes a
# generation_config (its usage counts then show every request generated its max_tokens: checked in main)
TRANSFORMERS_IGNORE_EOS = {"generation_config": json.dumps({"eos_token_id": -1})}
IGNORE_EOS = {"transformers": TRANSFORMERS_IGNORE_EOS, "transformers-cb": TRANSFORMERS_IGNORE_EOS}
DEFAULT_IGNORE_EOS = {"ignore_eos": True}


async def stream_one(client, model: str, r: Request, start: float, extra_body: dict) -> Timeline:
    await asyncio.sleep(max(0.0, start + r.arrival - time.perf_counter()))
    tl = Timeline(time.perf_counter())
    stream = await client.completions.create(
        model=model, prompt=r.prompt, max_tokens=r.max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=extra_body)
    async for chunk in stream:
        if chunk.choices:
            tl.chunks.append(time.perf_counter())
        if chunk.usage is not None:
            tl.output_tokens = chunk.usage.completion_tokens
    tl.finish = time.perf_counter()
    return tl


async def run_http(url: str, requests, extra_body: dict) -> tuple[list[Timeline], float]:
    import openai

    async with openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=600) as client:
        model = (await client.models.list()).data[0].id
        start = time.perf_counter()
        timelines = await asyncio.gather(*(stream_one(client, model, r, start, extra_body) for r in requests))
    return list(timelines), start


def run_engine(folder, requests, args) -> tuple[list[Timeline], float]:
    """The same requests through LLMEngine (with its tokenizer, so text is produced too) in this
    process: a chunk is a step that gave the request tokens."""
    from minipaged_ops.integration import LLMEngine, SamplingParams

    engine = LLMEngine.from_pretrained(folder, dtype=args.dtype, **engine_args(args, requests))
    ids = [engine.tokenizer.encode(r.prompt) for r in requests]
    pending, timelines, start = 0, {}, time.perf_counter()
    while pending < len(requests) or engine.has_unfinished_requests():
        now = time.perf_counter()
        while pending < len(requests) and start + requests[pending].arrival <= now:
            r = requests[pending]
            engine.add_request(str(pending), ids[pending], SamplingParams(max_tokens=r.max_tokens, ignore_eos=True))
            timelines[str(pending)] = Timeline(now)
            pending += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, start + requests[pending].arrival - time.perf_counter()))
            continue
        outputs = engine.step()
        t = time.perf_counter()
        for out in outputs:
            tl = timelines[out.request_id]
            if len(out.outputs[0].token_ids) > tl.output_tokens:
                tl.output_tokens = len(out.outputs[0].token_ids)
                tl.chunks.append(t)
            if out.finished:
                tl.finish = t
    return [timelines[str(i)] for i in range(len(requests))], start


def engine_args(args, requests) -> dict:
    blocks = args.num_blocks or sum(-(-(r.prompt_tokens + r.max_tokens) // args.block_size) for r in requests) + 8
    return dict(num_blocks=blocks, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens)


# ---------------------------------------------------------------------------------- servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(system: str, folder: str, port: int, args, requests) -> list[str]:
    e = engine_args(args, requests)
    if system in ("minipaged", "minipaged-baseline"):
        folder, dtype = (args.baseline_model, "auto") if system == "minipaged-baseline" else (folder, args.dtype)
        return [sys.executable, "-m", "minipaged_ops.serve", "--model", folder, "--port", str(port),
                "--served-model-name", "bench", "--log-level", "warning", "--dtype", dtype,
                "--num-blocks", str(e["num_blocks"]), "--block-size", str(e["block_size"]),
                "--max-num-seqs", str(e["max_num_seqs"]), "--max-num-batched-tokens", str(e["max_num_batched_tokens"]),
                *(args.minipaged_arg if system == "minipaged" else [])]
    command = [sys.executable, "-c", "import sys; from transformers.cli.transformers import main; sys.exit(main())",
               "serve", folder, "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--dtype", args.dtype,
               "--log-level", "warning"]
    if system == "transformers-cb":  # the same KV capacity and token budget (it has no max-num-seqs option)
        command += ["--continuous-batching", "--cb-block-size", str(e["block_size"]), "--cb-num-blocks",
                    str(e["num_blocks"]), "--cb-max-batch-tokens", str(e["max_num_batched_tokens"])]
    return command


def cannot_run(system: str) -> str | None:
    """Why ``system`` cannot run here (None when it can), said before trying."""
    import importlib.util

    if system.startswith("transformers") and importlib.util.find_spec("accelerate") is None:
        return ("transformers serve loads the model with device_map='cpu' (ModelLoader._load_model), which needs "
                "the accelerate package: pip install accelerate (it is in minipaged's [hf] extra)")
    return None


def process_tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by ``pid`` and its live descendants (transformers serve
    runs its model in a child process), from /proc; 0 where /proc cannot tell."""
    try:
        parents = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
                except OSError:
                    pass
        tree, frontier = {pid}, [pid]
        while frontier:
            children = [p for p, parent in parents.items() if parent == frontier[-1]]
            frontier.pop()
            tree.update(children)
            frontier += children
        total = 0
        for p in tree:
            try:
                with open(f"/proc/{p}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])  # utime, stime in clock ticks
            except OSError:
                pass
        return total / os.sysconf("SC_CLK_TCK")
    except OSError:
        return 0.0


class Server:
    """A server subprocess on a free port of 127.0.0.1, stopped on exit."""

    def __init__(self, command_for_port, log_path: str, threads: int, start_timeout: float = 300):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.log = open(log_path, "w")
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS=str(threads))
        self.process = subprocess.Popen(command_for_port(self.port), stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + start_timeout
        while True:
            if self.process.poll() is not None:
                self.stop()
                raise RuntimeError(f"the server exited with code {self.process.returncode}; see {log_path}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not answer /health in {start_timeout} s; see {log_path}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(30)
        self.log.close()


# ---------------------------------------------------------------------------------- report


def summary(name: str, timelines: list[Timeline], start: float, cpu: dict, args) -> dict:
    wall = max(tl.finish for tl in timelines) - start
    tokens = sum(tl.output_tokens for tl in timelines)
    ttft = [tl.chunks[0] - tl.sent for tl in timelines]
    e2e = [tl.finish - tl.sent for tl in timelines]
    itl = [b - a for tl in timelines for a, b in zip(tl.chunks, tl.chunks[1:])]
    tpot = [(tl.finish - tl.chunks[0]) / (tl.output_tokens - 1) for tl in timelines if tl.output_tokens > 1]
    good = sum(1 for tl, t in zip(timelines, ttft) if t <= args.ttft_limit and
               (tl.output_tokens <= 1 or (tl.finish - tl.chunks[0]) / (tl.output_tokens - 1) <= args.tpot_limit))
    row = {"system": name, "wall s": f"{wall:.2f}", "out tok/s": f"{tokens / wall:.1f}", "tokens": str(tokens)}
    for key, values, scale in (("TTFT s", ttft, 1), ("ITL ms", itl, 1e3), ("TPOT ms", tpot, 1e3), ("E2E s", e2e, 1)):
        p50, p95, p99 = percentiles(values)
        row[f"{key} p50/p95/p99"] = f"{p50 * scale:.2f}/{p95 * scale:.2f}/{p99 * scale:.2f}"
    row["goodput req/s"] = f"{good / wall:.2f}"
    row["CPU s server/client"] = f"{cpu['server']:.1f}/{cpu['client']:.1f}"
    row["_tok_s"], row["_ttft_p99"] = tokens / wall, percentiles(ttft)[2]
    return row


def write_csv(path, results, requests) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["system", "request", "prompt_tokens", "max_tokens", "output_tokens", "arrival_s", "ttft_s",
                    "tpot_s", "e2e_s", "chunks"])
        for name, (timelines, start, _) in results.items():
            for i, (r, tl) in enumerate(zip(requests, timelines)):
                tpot = (tl.finish - tl.chunks[0]) / (tl.output_tokens - 1) if tl.output_tokens > 1 else ""
                w.writerow([name, i, r.prompt_tokens, r.max_tokens, tl.output_tokens, f"{tl.sent - start:.4f}",
                            f"{tl.chunks[0] - tl.sent:.4f}", f"{tpot:.5f}" if tpot != "" else "",
                            f"{tl.finish - tl.sent:.4f}", len(tl.chunks)])


def write_plot(path, results, rows, title) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, (timelines, *_) in results.items():
        for ax, values in zip(axes[:2], ([tl.chunks[0] - tl.sent for tl in timelines],
                                         [tl.finish - tl.sent for tl in timelines])):
            v = sorted(values)
            ax.plot(v, [(i + 1) / len(v) for i in range(len(v))], label=name, drawstyle="steps-post")
    for ax, t in zip(axes[:2], ("time to first token", "end-to-end latency")):
        ax.set_title(t)
        ax.set_xlabel("seconds")
        ax.set_ylabel("share of requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[2].bar([r["system"] for r in rows], [r["_tok_s"] for r in rows], color="C2")
    axes[2].set_title("output tokens/s")
    axes[2].grid(alpha=0.3, axis="y")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_system(name, url, folder, warm, requests, args):
    """One measured run of a system (warmed up on other requests first); a server it starts is
    stopped after the run. Returns (timelines, start, CPU seconds: {"server": ..., "client": ...})."""
    if name == "engine":
        run_engine(folder, warm, args)
        cpu = time.process_time()
        timelines, start = run_engine(folder, requests, args)
        return timelines, start, {"server": time.process_time() - cpu, "client": 0.0}
    server = None
    if url is None:
        server = Server(lambda port: server_command(name, folder, port, args, requests),
                        os.path.join(args.out, f"serve_http_{name}.log"), args.threads)
        url = server.url
    try:
        extra_body = IGNORE_EOS.get(name, DEFAULT_IGNORE_EOS)
        asyncio.run(run_http(url, warm, extra_body))
        server_cpu, client_cpu = (process_tree_cpu_s(server.process.pid) if server else 0.0), time.process_time()
        timelines, start = asyncio.run(run_http(url, requests, extra_body))
        cpu = {"server": (process_tree_cpu_s(server.process.pid) - server_cpu) if server else float("nan"),
               "client": time.process_time() - client_cpu}
        return timelines, start, cpu
    finally:
        if server is not None:
            server.stop()


def main(argv=None) -> int:
    args = parse_args(argv)
    import transformers
    from transformers import AutoTokenizer

    from minipaged_ops.tiny import save_tiny_model

    transformers.logging.set_verbosity_error()
    os.makedirs(args.out, exist_ok=True)
    folder = args.model
    if folder is None:
        folder = os.path.join(args.out, "serve_http_model" + ("_quick" if args.quick else "_qwen3_4l"))
        if not os.path.isfile(os.path.join(folder, "config.json")):
            save_tiny_model(folder, "qwen3", max_positions=4096, init_range=None, tie_embeddings=True, **args.shape)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    if args.dtype is None:
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
        args.dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    import torch

    args.threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(args.threads)
    requests = make_workload(args, tokenizer, args.seed, args.requests)
    warm = make_workload(args, tokenizer, args.seed + 1000, 4)
    warm = [Request(r.prompt, r.prompt_tokens, min(r.max_tokens, 4), 0.0) for r in warm]
    title = (f"{len(requests)} requests ({args.arrival}{f' {args.rate}/s' if args.arrival == 'poisson' else ''}), "
             f"prompts {args.prompt_len[0]}-{args.prompt_len[1]} tokens, outputs {args.output_len[0]}-"
             f"{args.output_len[1]}, greedy, streamed; {os.path.basename(folder)}, {args.dtype}; "
             f"{machine_name()}, torch threads {args.threads}")
    print(title)

    runs, loads, skipped = {}, {}, []  # system -> [(timelines, start, cpu)], [load average at its start] per repeat
    targets = [(f"url {i}", u) for i, u in enumerate(args.url)] + [(s, None) for s in args.systems]
    for repeat in range(args.repeats):
        for name, url in (targets if repeat % 2 == 0 else targets[::-1]):
            if any(line.startswith(f"{name}:") for line in skipped):
                continue
            if url is None and (reason := cannot_run(name)):
                skipped.append(f"{name}: {reason}")
                continue
            print(f"  running {name} ({repeat + 1}/{args.repeats}) ...", file=sys.stderr)
            try:
                load = os.getloadavg()[0]
                runs.setdefault(name, []).append(run_system(name, url, folder, warm, requests, args))
                loads.setdefault(name, []).append(load)
            except RuntimeError as e:
                skipped.append(f"{name}: {e}")
    results = {}
    for name, tries in runs.items():  # each system's median run by output tokens/s
        by_rate = sorted(tries, key=lambda run: sum(tl.output_tokens for tl in run[0]) /
                         (max(tl.finish for tl in run[0]) - run[1]))
        results[name] = by_rate[(len(by_rate) - 1) // 2]  # the lower median

    rows = [summary(name, tl, start, cpu, args) for name, (tl, start, cpu) in results.items()]
    columns = ["system", "wall s", "out tok/s", "tokens", "TTFT s p50/p95/p99", "ITL ms p50/p95/p99",
               "TPOT ms p50/p95/p99", "E2E s p50/p95/p99", "goodput req/s", "CPU s server/client"]
    print()
    print_table(rows, columns)
    by = {r["system"]: r for r in rows}
    if "minipaged" in by and "engine" in by:
        print(f"minipaged server / in-process engine: {by['minipaged']['_tok_s'] / by['engine']['_tok_s']:.0%} "
              f"of the output tokens/s")
    for other, how in (("transformers", "transformers serve"), ("transformers-cb", "transformers serve --continuous-batching"),
                       ("minipaged-baseline", f"minipaged on {args.baseline_model}"),
                       *((f"url {i}", u) for i, u in enumerate(args.url))):
        if "minipaged" in by and other in by:
            print(f"minipaged server / {how}: {by['minipaged']['_tok_s'] / by[other]['_tok_s']:.2f}x output tokens/s; "
                  f"TTFT P99 {by['minipaged']['_ttft_p99']:.2f} s vs {by[other]['_ttft_p99']:.2f} s")
    expected = [r.max_tokens for r in requests]
    for name, (timelines, *_) in results.items():  # EOS ignored and max_tokens honoured: every request its max_tokens
        short = sum(tl.output_tokens != want for tl, want in zip(timelines, expected))
        if short:
            print(f"WARNING {name}: {short} of {len(requests)} requests did not generate exactly their max_tokens "
                  f"({sum(tl.output_tokens for tl in timelines)} tokens against {sum(expected)})")
    if args.repeats > 1:
        rates = {name: [sum(tl.output_tokens for tl in t) / (max(tl.finish for tl in t) - start) for t, start, _ in tries]
                 for name, tries in runs.items()}
        for name, values in rates.items():
            print(f"{name}: out tok/s of each run {', '.join(f'{r:.1f}' for r in values)} (load average at its start "
                  f"{', '.join(f'{x:.1f}' for x in loads[name])}; the table: the median run)")
        # paired within a round (the systems ran back to back), steadier than a ratio of medians when the load moves
        for other in ("engine", "transformers", "transformers-cb", "minipaged-baseline",
                      *(f"url {i}" for i in range(len(args.url)))):
            if "minipaged" in rates and other in rates and len(rates[other]) == len(rates["minipaged"]):
                ratios = [a / b for a, b in zip(rates["minipaged"], rates[other])]
                print(f"minipaged / {other} per round: {', '.join(f'{r:.2f}' for r in ratios)} "
                      f"(median {sorted(ratios)[(len(ratios) - 1) // 2]:.2f})")
    for line in skipped:
        print(f"skipped {line}")
    csv_path, png_path = os.path.join(args.out, "serve_http.csv"), os.path.join(args.out, "serve_http.png")
    write_csv(csv_path, results, requests)
    write_plot(png_path, results, rows, title)
    print(f"\nwrote {csv_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
