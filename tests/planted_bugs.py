"""Plant known bugs in the CUDA kernels, one at a time, and report which check catches each.

Each mutant is a one-line edit of a copy of src_cuda/cuda/kernels.cu (decode, cache write) or
prefill.cu. It is built as the emulation extension (src_cuda/emulation/) and the emulated op tests
run against it (`pytest -k emu -x`),
first plainly, then with a random thread order (EMU_SEED), then under ASan+UBSan, then TSan,
stopping at the first that fails. A mutant no stage catches means a missing test.

    .venv/bin/python tests/planted_bugs.py [--only NAME ...] [--stages plain,seed,address,thread] [--work DIR]

Takes one to a few minutes per mutant and stage on 2 cores (a kernels.cu rebuild each time);
builds go to build/planted/ (--work: another folder, for a second run beside it). Prints a
markdown table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from sanitize import build_emulation, sanitizer_env

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "build" / "planted"
TESTS = ["tests/test_paged_attention.py", "tests/test_reshape_and_cache.py", "tests/test_op_errors.py",
         "tests/test_paged_prefill.py"]


@dataclass
class Mutant:
    name: str
    bug: str
    old: str
    new: str
    file: str = "kernels.cu"


MUTANTS = [
    Mutant("gqa", "query head h reads kv head h % num_kv_heads (interleaved, not grouped)",
           "a.layout.row(block, kv_head, t % B)",
           "a.layout.row(block, head0 % a.layout.num_kv_heads, t % B)"),
    Mutant("merge_all", "the merge reads every partition, also those that returned early",
           "const int parts = (clamped_seq_len(a, seq) + a.partition_tokens - 1) / a.partition_tokens;",
           "const int parts = a.num_partitions;"),
    Mutant("unclamped", "seq_lens not clamped to what the block table addresses",
           "return static_cast<int>(len < a.seq_len_bound ? len : a.seq_len_bound);",
           "return static_cast<int>(len);"),
    Mutant("smem", "the shared-memory request forgets the reduction scratch",
           "sizeof(float) * (G * kChunk + G * HEAD_DIM + kWarps * G)", "sizeof(float) * (G * kChunk + G * HEAD_DIM)"),
    Mutant("misaligned", "a 16-byte load one element off (head_dim 64)",
           "cache + row + R::elem(v, lane_in_token))", "cache + row + R::elem(v, lane_in_token) + (HEAD_DIM == 64))"),
    Mutant("lanes_leave", "lanes past the chunk leave before the lane reduction's shuffles",
           "        const int t = base + u * R::kTokensPerPass + token_in_warp;\n#pragma unroll\n        for (int g = 0;",
           "        const int t = base + u * R::kTokensPerPass + token_in_warp;\n        if (t >= chunk_end) continue;\n"
           "#pragma unroll\n        for (int g = 0;"),
    Mutant("sync_reduce_1", "block_reduce: no barrier between the warps' writes and the reads",
           "    if (lane == 0) scratch[warp * G + g] = x[g];\n  }\n  __syncthreads();",
           "    if (lane == 0) scratch[warp * G + g] = x[g];\n  }"),
    Mutant("sync_reduce_2", "block_reduce: no barrier before the scratch is reused",
           "    x[g] = r;\n  }\n  __syncthreads();\n}", "    x[g] = r;\n  }\n}"),
    Mutant("sync_pass1", "no barrier between the scores' writes (pass 1) and the max over them",
           "    }\n    __syncthreads();\n\n    // Online softmax", "    }\n\n    // Online softmax"),
    Mutant("sync_chunk", "no barrier before the next chunk rewrites the scores",
           "    __syncthreads();  // `scores` is rewritten by the next chunk\n", ""),
    Mutant("sync_warp_sum", "no barrier between the warps' turns at adding into out_acc",
           "    }\n    __syncthreads();\n  }\n\n  // g is a compile-time", "    }\n  }\n  __syncthreads();\n\n  // g is a compile-time"),
    Mutant("atomic_sum", "warps add into out_acc with atomicAdd after zeroing it (the old code)",
           "            sum = (w == 0 ? 0.f : sum) + acc[g][v * R::kVec + i];",
           "            if (w == 0) atomicAdd(&sum, acc[g][v * R::kVec + i]);"),
    Mutant("max_at_0", "the running max starts at 0 instead of -FLT_MAX",
           "run_max[g] = -FLT_MAX, run_sum[g] = 0.f;", "run_max[g] = 0.f, run_sum[g] = 0.f;"),
    Mutant("slot_unchecked", "reshape_and_cache skips only negative slots, not those past the cache",
           "if (!layout.valid_slot(slot)) return;", "if (slot < 0) return;"),
    Mutant("prefill_causal", "prefill: a query row also attends to the key one position after it",
           "if (r < rows && live[k] && chunk + k <= pos) {", "if (r < rows && live[k] && chunk + k <= pos + 1) {",
           "prefill.cu"),
    Mutant("prefill_sync_k", "prefill: no barrier between loading a K tile and the scores that read it",
           "load_chunk<T, HEAD_DIM>(key_cache, block_table, a.layout, kv_head, chunk, key_end, kv_rows, live);\n"
           "    __syncthreads();\n",
           "load_chunk<T, HEAD_DIM>(key_cache, block_table, a.layout, kv_head, chunk, key_end, kv_rows, live);\n",
           "prefill.cu"),
    Mutant("prefill_sync_chunk", "prefill: no barrier before the next chunk's K tile overwrites the V tile",
           "    __syncthreads();  // the previous chunk's V and scores are no longer read\n", "", "prefill.cu"),
]
# atomic_sum also needs the zeroing back and the turns gone: every warp adds at once.
ATOMIC_EXTRA = [("    if (warp == w && token_in_warp == 0) {", "    if (w == 0 && token_in_warp == 0) {"),
                ("  float acc[G][R::kElemsPerLane] = {};",
                 "  for (int i = threadIdx.x; i < G * HEAD_DIM; i += kThreads) out_acc[i] = 0.f;\n"
                 "  float acc[G][R::kElemsPerLane] = {};")]

STAGES = {"plain": ("", {}), "seed": ("", {"EMU_SEED": "7"}), "address": ("address", {}), "thread": ("thread", {})}


def run_stage(stage: str, timeout: int, tests: list[str]) -> tuple[bool, str]:
    sanitizer, extra_env = STAGES[stage]
    try:
        # Debug: a kernels.cu rebuild in seconds rather than minutes (the tests run slower).
        library = build_emulation(WORK / "src", WORK / f"build-{sanitizer or 'plain'}", sanitizer, "Debug")
    except subprocess.CalledProcessError as err:
        return True, "does not compile: " + (err.stdout or "")[-300:]
    log = WORK / f"sanitizer-{stage}"
    for old in WORK.glob(f"sanitizer-{stage}*"):
        old.unlink()
    env = dict(os.environ, MINIPAGED_EMU_LIBRARY=str(library), **extra_env, **sanitizer_env(sanitizer, log))
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", *tests, "-k", "emu", "-x", "-q", "-p", "no:cacheprovider"],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return True, f"hangs (> {timeout} s)"
    if done.returncode == 0:
        return False, ""
    reports = sorted(WORK.glob(f"sanitizer-{stage}*"))
    if reports:
        lines = [ln for ln in reports[0].read_text().splitlines() if "ERROR" in ln or "runtime error" in ln or "WARNING" in ln]
        return True, (lines[0] if lines else reports[0].read_text()[:200]).strip()
    failed = [ln for ln in done.stdout.splitlines() if ln.startswith(("FAILED", "ERROR"))]
    emu = [ln for ln in (done.stdout + done.stderr).splitlines() if "cuda_emu:" in ln]
    return True, (emu[:1] or failed[:1] or [f"exit {done.returncode}"])[0].strip()


def main() -> None:
    global WORK
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", help="mutant names (default: all)")
    parser.add_argument("--stages", default="plain,seed,address,thread")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per test run")
    parser.add_argument("--work", type=Path, default=WORK, help="folder for the mutated source and its builds")
    args = parser.parse_args()
    WORK = args.work.resolve()
    stages = args.stages.split(",")
    if (WORK / "src").exists():
        shutil.rmtree(WORK / "src")
    shutil.copytree(ROOT / "src_cuda", WORK / "src" / "src_cuda")
    shutil.copy(ROOT / "CMakeLists.txt", WORK / "src")
    rows = []
    for m in tqdm([m for m in MUTANTS if not args.only or m.name in args.only], desc="mutants"):
        source = WORK / "src" / "src_cuda" / "cuda" / m.file
        original = source.read_text()
        assert original.count(m.old) == 1, f"{m.name}: the text to mutate is not in {m.file} once"
        text = original.replace(m.old, m.new)
        if m.name == "atomic_sum":
            for old, new in ATOMIC_EXTRA:
                text = text.replace(old, new)
        source.write_text(text)
        # The tests of the mutated kernel first: -x stops at the first failure.
        tests = sorted(TESTS, key=lambda t: ("prefill" in t) != (m.file == "prefill.cu"))
        caught_by, how = "nothing", ""
        for stage in stages:
            caught, how = run_stage(stage, args.timeout, tests)
            if caught:
                caught_by = stage
                break
        rows.append(f"| {m.name} | {m.bug} | {caught_by} | {how.replace('|', '/')[:160]} |")
        tqdm.write(rows[-1])
        source.write_text(original)
    print("| mutant | planted bug | first stage that fails | how |\n|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
