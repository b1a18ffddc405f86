"""Shared pieces of the benchmarks: timing, bandwidth probes, paged copies of contiguous K/V."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _time_once(fn, device: str, flush: torch.Tensor | None) -> float:
    if device == "cuda":
        flush.zero_()  # cold L2 for every timed run
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop) / 1e3
    if flush is not None:
        flush.sum()  # caches hold other data, as they do when a model step reaches this layer
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def cpu_flush_bytes() -> int:
    """How much a CPU cold-cache flush reads: twice the largest cache the OS reports, at least 128 MiB
    and at most 2 GiB. A fixed 128 MiB is not enough everywhere: an Intel Xeon VM with a 480 MiB L3
    kept part of a 64 MiB decode's K/V between timed runs (bfloat16 decode 3.59 ms after a 128 MiB
    read, 4.53 ms after 1 GiB). A VM may report its host's cache, which only makes the flush longer."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    largest = 0
    for index in range(8):
        try:
            with open(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size") as f:
                text = f.read().strip()
        except OSError:
            continue
        largest = max(largest, int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return min(max(2 * largest, 128 << 20), 2 << 30)


def interleaved_times(fns: dict, iters: int, warmup: int = 2, device: str = "cpu", cold: bool = True) -> dict:
    """Each function's `iters` times, timed in alternation (a, b, c, a, b, c, ...) so that a
    busy moment on a shared machine lands on all of them alike: the i-th times of two functions
    were taken moments apart, so their ratio is steadier than the ratio of their medians. With
    `cold` (the default) every timed run starts from the same state, caches full of other data: on
    a GPU a 512 MiB write (more than any L2), on a CPU a read of twice the largest cache
    (cpu_flush_bytes), untimed. CUDA runs use events."""
    flush = None
    if device == "cuda":
        flush = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
    elif cold:
        flush = torch.ones(cpu_flush_bytes() // 4, dtype=torch.float32)
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            times[name].append(_time_once(fn, device, flush))
    return times


def interleaved_medians(fns: dict, iters: int, warmup: int = 2, device: str = "cpu", cold: bool = True) -> dict:
    """Median time of each function, timed as interleaved_times does."""
    times = interleaved_times(fns, iters, warmup, device, cold)
    return {name: statistics.median(ts) for name, ts in times.items()}


def median_ratio(times: dict, a, b) -> float:
    """Median over rounds of times[a][i] / times[b][i] (interleaved_times)."""
    return statistics.median(x / y for x, y in zip(times[a], times[b]))


def median_seconds(fn, iters: int, warmup: int = 3, device: str = "cpu") -> float:
    """Median time of ``fn()`` alone (see interleaved_medians)."""
    return interleaved_medians({"fn": fn}, iters, warmup, device)["fn"]


def read_bandwidth(device: str = "cpu", nbytes: int = 1 << 30, iters: int = 10) -> float:
    """Bytes/s of a large ``sum`` (reads only): the roof a memory-bound CPU kernel can reach."""
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    return nbytes / median_seconds(lambda: x.sum(), iters, device=device)


def copy_bandwidth(device: str = "cpu", nbytes: int = 1 << 30, iters: int = 10) -> float:
    """Bytes/s moved (read + write) by a large copy: the roof for a write kernel, and on the GPU
    the device-to-device figure of merit."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / median_seconds(lambda: dst.copy_(src), iters, device=device)


def _spin() -> None:
    while True:
        pass


@contextlib.contextmanager
def busy_core(enabled: bool = True):
    """Another process spinning on one core for the duration: the load a shared machine puts on
    a kernel's threads (one of them loses its core to the spinner for whole time slices)."""
    if not enabled:
        yield
        return
    spinner = multiprocessing.get_context("spawn").Process(target=_spin, daemon=True)
    spinner.start()
    try:
        yield
    finally:
        spinner.terminate()
        spinner.join()


def machine_name(device: str = "cpu") -> str:
    """A short name for plot titles and table headers: the GPU's name, or the CPU model and threads."""
    if device == "cuda":
        return torch.cuda.get_device_name()
    model = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            model = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), model)
    return f"{model}, {torch.get_num_threads()} threads"


@dataclass
class DecodeProblem:
    """One decode step: contiguous K/V for the baseline and the same data in a shuffled paged pool."""

    query: torch.Tensor          # [num_seqs, num_heads, head_dim]
    key: torch.Tensor            # [num_seqs, num_kv_heads, seq_len, head_dim] (contiguous baseline)
    value: torch.Tensor
    key_cache: torch.Tensor      # [num_blocks, num_kv_heads, block_size, head_dim]
    value_cache: torch.Tensor
    block_tables: torch.Tensor   # int32 [num_seqs, blocks_per_seq]
    seq_lens: torch.Tensor       # int32 [num_seqs]
    scale: float

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V a decode step must read once."""
        return 2 * self.key.numel() * self.key.element_size()

    @property
    def pool(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(key_cache, value_cache, block_tables): what the paged kernel reads, as `relaid` returns it."""
        return self.key_cache, self.value_cache, self.block_tables

    @property
    def in_cache_pool(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The pool with every block_tables entry one of its first 4 blocks: the same work, and the
        same arithmetic, with K/V that stay in cache."""
        return self.key_cache, self.value_cache, self.block_tables % min(4, self.key_cache.size(0))

    def relaid(self, stride: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(key_cache, value_cache, block_tables) holding the same K/V with each sequence's blocks in
        table order, `stride` blocks apart in a new pool (1: back to back, as contiguous K/V would
        lie; 2: a zeroed block between each two): the same decode and output, another read pattern."""
        order = self.block_tables.flatten().long()
        caches = []
        for cache in (self.key_cache, self.value_cache):
            relaid = cache.new_zeros(stride * order.numel(), *cache.shape[1:])
            relaid[::stride] = cache[order]
            caches.append(relaid)
        tables = stride * torch.arange(order.numel(), dtype=torch.int32, device=order.device)
        return caches[0], caches[1], tables.reshape(self.block_tables.shape)


@dataclass
class QuantizedPool:
    """A DecodeProblem's K/V in an 8-bit cache on the same blocks (quantized as reshape_and_cache
    writes them; fp8 scales from the data's maximum, as calculate_kv_scales sets them)."""

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    key_scale: torch.Tensor
    value_scale: torch.Tensor
    kv_bytes: int  # what a decode step reads: the sequences' bytes plus their int8 scales

    @classmethod
    def of(cls, pool, kv_cache_dtype: str, tokens: int) -> QuantizedPool:
        """`pool`: (key_cache, value_cache, block_tables) as DecodeProblem.pool (or .relaid) gives
        it; `tokens`: how many tokens of it a decode step reads (for kv_bytes)."""
        from minipaged_ops import quantized, reference

        dtype = quantized.cache_dtype(kv_cache_dtype, pool[0].dtype)
        caches, scales = [], []
        for cache in pool[:2]:
            layer = None if dtype == torch.int8 else quantized.layer_scale_for(cache, dtype)
            q, scale = reference.quantize(cache, dtype, layer)
            caches.append(q)
            scales.append(scale.contiguous())
        heads, head_dim = pool[0].shape[1], pool[0].shape[3]
        per_token = 2 * heads * head_dim + (2 * heads * 4 if dtype == torch.int8 else 0)
        return cls(caches[0], caches[1], pool[2], scales[0], scales[1], tokens * per_token)

    def decode(self, p: DecodeProblem) -> torch.Tensor:
        import minipaged_ops

        return minipaged_ops.paged_attention_decode(p.query, self.key_cache, self.value_cache, self.block_tables,
                                                    p.seq_lens, p.scale, key_scale=self.key_scale,
                                                    value_scale=self.value_scale)


def make_decode_problem(batch, seq_len, num_heads, num_kv_heads, head_dim, block_size, dtype, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    blocks_per_seq = -(-seq_len // block_size)
    num_blocks = batch * blocks_per_seq
    query = torch.randn(batch, num_heads, head_dim, generator=g).to(dtype)
    key = torch.randn(batch, num_kv_heads, seq_len, head_dim, generator=g).to(dtype)
    value = torch.randn(batch, num_kv_heads, seq_len, head_dim, generator=g).to(dtype)
    block_tables = torch.randperm(num_blocks, generator=g).to(torch.int32).reshape(batch, blocks_per_seq)
    pad = blocks_per_seq * block_size - seq_len
    key_cache = torch.empty(num_blocks, num_kv_heads, block_size, head_dim, dtype=dtype)
    value_cache = torch.empty_like(key_cache)
    for src, dst in ((key, key_cache), (value, value_cache)):
        blocks = torch.nn.functional.pad(src, (0, 0, 0, pad)).reshape(batch, num_kv_heads, blocks_per_seq, block_size, head_dim)
        dst[block_tables.long()] = blocks.permute(0, 2, 1, 3, 4)
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32)
    tensors = [t.to(device) for t in (query, key, value, key_cache, value_cache, block_tables, seq_lens)]
    return DecodeProblem(*tensors, scale=head_dim**-0.5)


def add_cpu_decode_args(ap) -> None:
    """The decode shape and timing options the CPU decode benchmarks share (defaults: Qwen3-0.6B's
    attention, batch 8 x 2,048, block 16)."""
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--num-heads", type=int, default=16)
    ap.add_argument("--num-kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")


def cpu_decode_problem(args, dtype: torch.dtype) -> DecodeProblem:
    """make_decode_problem from add_cpu_decode_args' options; applies --threads."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    return make_decode_problem(args.batch, args.seq_len, args.num_heads, args.num_kv_heads, args.head_dim,
                               args.block_size, dtype)


def sdpa_decode(p: DecodeProblem) -> torch.Tensor:
    """The no-paging baseline: SDPA over contiguous K/V, GQA handled by SDPA itself."""
    q = p.query.unsqueeze(2)
    return torch.nn.functional.scaled_dot_product_attention(q, p.key, p.value, scale=p.scale, enable_gqa=True).squeeze(2)


def print_table(rows: list[dict], columns: list[str]) -> None:
    """A cell a row lacks prints as "-", so every row keeps every column (compare_revisions parses
    rows by their cells: a blank one dropped the row)."""
    widths = {c: max(len(c), *(len(str(r.get(c, "-"))) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(str(r.get(c, "-")).ljust(widths[c]) for c in columns))


def add_isa_args(ap) -> None:
    """--isa: the benchmark once per CPU kernel variant (run_per_isa)."""
    ap.add_argument("--isa", default="",
                    help="run this benchmark once per CPU kernel variant, each in a child process with "
                         "MINIPAGED_CPU_ISA set (the variant is chosen when the library loads): 'all' (every "
                         "variant this CPU runs) or a comma-separated list; rounds alternate the variants")
    ap.add_argument("--isa-rounds", type=int, default=1, help="rounds over the variants with --isa (default 1)")


# torch's own kernels (ATen's vectorized loops, oneDNN, MKL) held to each variant's instruction set
# in its run, so that a baseline (SDPA, a bmm roof, F.linear) is what a CPU of that kind would run:
# on an AVX-512 machine an avx2 row against an AVX-512 (or AMX) SDPA compared unlike things. Variables
# the caller set are kept; the best variant's run holds nothing.
TORCH_ISA_ENV = {
    "scalar": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "avx512_bf16": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
                    "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
}


def isa_env(isa: str, best: str) -> dict:
    """The environment of a --isa child: MINIPAGED_CPU_ISA, and TORCH_ISA_ENV unless isa is best."""
    held = {} if isa == best else {k: v for k, v in TORCH_ISA_ENV.get(isa, {}).items() if k not in os.environ}
    return {"MINIPAGED_CPU_ISA": isa, **held}


def run_per_isa(args, argv: list[str] | None) -> bool:
    """With --isa, reruns the calling script (its other arguments unchanged) once per variant and
    round, variants alternating, and prints each run's output under its variant's name; returns
    True then (the caller stops), False without --isa. Each run's ratios are measured inside it, so
    variants compare by their ratios (a shared machine's load moves the absolute times); torch's
    kernels are held to the variant's instruction set (TORCH_ISA_ENV)."""
    if not args.isa:
        return False
    import minipaged_ops

    isas = minipaged_ops.supported_cpu_isas() if args.isa == "all" else args.isa.split(",")
    argv = list(sys.argv[1:] if argv is None else argv)
    rest, skip = [], False
    for a in argv:  # the same arguments less --isa / --isa-rounds and their values
        if skip:
            skip = False
        elif a in ("--isa", "--isa-rounds"):
            skip = True
        elif not a.startswith(("--isa=", "--isa-rounds=")):
            rest.append(a)
    for r in range(args.isa_rounds):
        for isa in isas:
            env = isa_env(isa, minipaged_ops.supported_cpu_isas()[-1])
            out = subprocess.run([sys.executable, sys.argv[0], *rest], env={**os.environ, **env},
                                 check=True, capture_output=True, text=True).stdout
            of_rounds = f", round {r + 1} of {args.isa_rounds}" if args.isa_rounds > 1 else ""
            print(f"=== {' '.join(f'{k}={v}' for k, v in env.items())}{of_rounds}")
            print(out.rstrip(), flush=True)
    return True
