"""The CPU benchmark commands the README and bench/RESULTS.md quote still run, on tiny shapes, and
print the rows those documents read. They measure nothing here; they only must not rot."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def run_bench(*args: str) -> str:
    done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_decode_cpu_prints_every_dtype_and_the_per_byte_ratio():
    out = run_bench("bench/decode_cpu.py", "--batch", "2", "--seq-len", "80", "--block-size", "16", "--iters", "2",
                    "--dtype", "float32,bfloat16,float16")
    for dtype in ("float32", "bfloat16", "float16"):
        assert re.search(rf"^{dtype}\s+minipaged paged\s+[\d.]+\s+[\d.]+\s+\d+%\s+[\d.]+x", out, re.M), out
        assert re.search(rf"^{dtype}\s+sdpa contiguous", out, re.M), out
    assert "bfloat16 / float32, paged bytes per second:" in out
    # The max error against SDPA is printed and small (the op suite checks correctness in detail).
    errors = [float(e) for e in re.findall(r"max \|paged - sdpa\| = ([\d.e+-]+)", out)]
    assert len(errors) == 3 and max(errors) < 1e-2, out


def test_decode_cpu_times_8_bit_caches_beside_bfloat16():
    out = run_bench("bench/decode_cpu.py", "--batch", "2", "--seq-len", "80", "--iters", "2", "--dtype", "float32",
                    "--kv-cache-dtype", "int8,fp8_e4m3,fp8_e5m2")
    for kv in ("int8", "fp8_e4m3", "fp8_e5m2"):
        assert re.search(rf"^{kv}\s+minipaged paged\s+[\d.]+\s+[\d.]+\s+\d+%\s+-\s+[\d.]+x", out, re.M), out
    assert re.search(r"^bfloat16\s+minipaged paged", out, re.M), out  # added for the comparison
    # The formats' error against the bfloat16 cache: small, and int8's smallest (8 bits of mantissa).
    errors = dict(re.findall(r"(int8|fp8_e4m3|fp8_e5m2): K\+V [\d.]+ MiB with scales, ([\d.e+-]+)", out))
    assert len(errors) == 3 and max(map(float, errors.values())) < 0.1, out
    assert float(errors["int8"]) < float(errors["fp8_e5m2"]), out
    # compare_revisions reads every row, the unquantized ones too (their empty 8-bit column once dropped them).
    from compare_revisions import parse_table

    rows = {key[0][:2] for key in parse_table(out)}
    assert {("float32", "minipaged paged"), ("bfloat16", "minipaged paged"), ("int8", "minipaged paged")} <= rows, out


def test_decode_cpu_back_to_back_decodes_the_same_and_says_so():
    out = run_bench("bench/decode_cpu.py", "--batch", "2", "--seq-len", "72", "--iters", "2", "--back-to-back",
                    "--dtype", "float32,bfloat16")
    assert "blocks back to back" in out and "shuffled" not in out
    errors = [float(e) for e in re.findall(r"max \|paged - sdpa\| = ([\d.e+-]+)", out)]
    assert len(errors) == 2 and max(errors) < 1e-2, out


def test_decode_cpu_in_cache_mode_has_no_sdpa_rows():
    out = run_bench("bench/decode_cpu.py", "--batch", "2", "--seq-len", "64", "--iters", "2", "--in-cache",
                    "--threads", "1")
    assert out.startswith("IN-CACHE") and "sdpa contiguous" not in out


@pytest.mark.parametrize("fmas", [[], ["--fmas", "2"], ["--fmas", "8", "--independent"]], ids=["plain", "fmas", "independent"])
def test_read_roof_compiles_its_reader_and_prints_all_rows(fmas):
    out = run_bench("bench/read_roof.py", "--batch", "2", "--seq-len", "64", "--iters", "2", *fmas)
    for row in ("minipaged paged_attention_decode", "read, paged walk", "read, paged walk + prefetch next block",
                "read, paged walk + prefetch next run", "read, paged walk + prefetch 4 KiB ahead",
                "read, the kernel's walk (its order and prefetches)",
                "minipaged, every table entry one of 4 blocks (in cache)", "minipaged, the same blocks back to back",
                "read, the kernel's walk, blocks back to back",
                "minipaged, the same blocks in order, a block's gap after each", "read, contiguous (same bytes)",
                "torch sum, contiguous (same bytes)",
                "read, the kernel's walk, every table entry one of 4 blocks (in cache)"):
        assert re.search(rf"^{re.escape(row)}\s+[\d.]+\s+[\d.]+\s+\d+%", out, re.M), out
    assert re.search(r"^overlap: .* \d+% of its arithmetic hidden under its reads; in cache back to back \(no flush\) "
                     r"it takes [\d.]+ ms, \d+% of that hidden$", out, re.M), out
    ceiling = re.search(r"^ceiling: the kernel's walk with (\d+) independent multiply-adds per line takes [\d.]+ ms in "
                        r"cache \(the kernel [\d.]+\) and [\d.]+ ms from memory; the plain walk [\d.]+: \d+% of that "
                        r"arithmetic hidden, with nothing else in the loop$", out, re.M)
    assert ceiling and int(ceiling[1]) % 4 == 0, out  # the reader's independent chains take 8 per 128 bytes
    for where in ("", " (in cache)"):
        assert re.search(rf"^ceiling: the kernel's walk, {ceiling[1]} independent multiply-adds per line{re.escape(where)}"
                         r"\s+[\d.]+\s+[\d.]+\s+\d+%", out, re.M), out
    assert ("read, the kernel's walk, no multiply-adds" in out) == bool(fmas)
    assert re.search(r"^arithmetic: in cache the kernel does [\d.]+ G multiply-adds/s; this machine's float32 "
                     r"multiply-adds peak at [\d.]+ G/s \(\d+% of it\)(, .*)?; reading the same cached bytes in its "
                     r"order takes [\d.]+ ms, so the in-cache time can shrink [\d.]+x at most$", out, re.M), out
    assert re.search(r"^layout: .* back to back take \d+% .* gap after each \d+%; shuffling costs -?\d+% of it$",
                     out, re.M), out
    assert ("multiply-adds per 64-byte line" in out) == bool(fmas)
    assert ("8 independent chains" in out) == ("--independent" in fmas)


@pytest.mark.parametrize("stride", [1, 2])
def test_relaid_pool_holds_each_sequence_in_order_and_decodes_the_same(stride):
    from common import make_decode_problem

    p = make_decode_problem(3, 40, 4, 2, 16, 8, torch.float32)  # 5 blocks per sequence, the last one partial
    key_cache, value_cache, tables = p.relaid(stride)
    assert tables.dtype == torch.int32 and tables.shape == p.block_tables.shape
    assert tables.flatten().tolist() == list(range(0, stride * tables.numel(), stride))
    for relaid, cache in ((key_cache, p.key_cache), (value_cache, p.value_cache)):
        assert relaid.shape[0] == stride * cache.shape[0]
        assert torch.equal(relaid[tables.flatten().long()], cache[p.block_tables.flatten().long()])
        if stride > 1:
            assert not relaid[1::stride].any()  # the gaps hold nothing
    decode = torch.ops.minipaged.paged_attention_decode
    assert torch.equal(decode(p.query, key_cache, value_cache, tables, p.seq_lens, p.scale, None),
                       decode(p.query, p.key_cache, p.value_cache, p.block_tables, p.seq_lens, p.scale, None))


def test_read_roof_kernel_walk_reads_every_run_of_the_tables_to_its_end():
    # Each run (a block's K or V) ends in its own bit; the walk's OR of everything it read must
    # hold exactly the bits of the blocks the tables name. Work items of 5 blocks in chunks of 2
    # leave a short last chunk and a short last item.
    import read_roof

    reader = read_roof.load_reader()
    reader.set_fmas(0, 2)
    num_blocks, block_words, num_seqs, blocks_per_seq = 32, 64, 2, 7  # 512-byte runs
    k, v = (torch.zeros(num_blocks, block_words, dtype=torch.int64) for _ in range(2))
    k[:, -1] = v[:, -1] = 1 << torch.arange(num_blocks)  # K and V are read one at a time below
    tables = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0))[: num_seqs * blocks_per_seq]
    tables = tables.to(torch.int32).reshape(num_seqs, blocks_per_seq)
    expected = sum(1 << int(b) for b in tables.flatten())
    zeros = torch.zeros_like(k)
    for kc, vc in ((k, zeros), (zeros, v)):
        got = reader.read_paged(kc.data_ptr(), vc.data_ptr(), tables.data_ptr(), num_seqs, blocks_per_seq,
                                block_words * 8, 4, 2, 5, 2)  # prefetch 4: the kernel's walk
        assert got == expected, (hex(got), hex(expected))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc/self/smaps are Linux's")
def test_huge_pages_prints_both_pools_and_the_probe():
    # 8 x 512 float32: 16 MiB of K+V, enough whole 2 MiB pages for madvise to act on.
    out = run_bench("bench/huge_pages.py", "--batch", "8", "--seq-len", "512", "--iters", "2", "--dtype", "float32")
    for what in ("float32 decode", "read probe (sum)"):
        for pages in ("4 KiB", "2 MiB"):
            assert re.search(rf"^{re.escape(what)}\s+{pages}\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+x", out, re.M), out


def test_read_roof_times_other_block_sizes_alongside():
    out = run_bench("bench/read_roof.py", "--batch", "2", "--seq-len", "64", "--iters", "2", "--also-block-sizes", "32")
    for row in ("minipaged paged_attention_decode, block 32", "read, the kernel's walk, block 32"):
        assert re.search(rf"^{re.escape(row)}\s+[\d.]+\s+[\d.]+\s+\d+%", out, re.M), out
    done = subprocess.run([sys.executable, "bench/read_roof.py", "--seq-len", "64", "--also-block-sizes", "48"],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 2 and "48" in done.stderr


def test_read_roof_rejects_a_partial_last_block():
    done = subprocess.run([sys.executable, "bench/read_roof.py", "--seq-len", "70"], cwd=ROOT, capture_output=True,
                          text=True)
    assert done.returncode == 2 and "--seq-len" in done.stderr


def test_compare_revisions_reads_the_benchmark_table():
    from compare_revisions import parse_table

    out = """decode: whatever
read bandwidth (sum over 128 MiB, timed alongside): 41.5 GB/s
dtype     kernel           ms      GBps  pct_read_bw  speedup_vs_sdpa
float32   minipaged paged  4.747   28.3  68%          1.99x
bfloat16  sdpa contiguous  28.390  2.4   6%           1.00x
bfloat16 / float32, paged bytes per second: 0.91
"""
    cells = parse_table(out)
    assert cells[("float32", "minipaged paged"), "ms"] == pytest.approx(4.747)
    assert cells[("float32", "minipaged paged"), "speedup_vs_sdpa"] == pytest.approx(1.99)
    assert cells[("bfloat16", "sdpa contiguous"), "pct_read_bw"] == pytest.approx(6)
    assert len(cells) == 8


def test_compare_revisions_reads_both_prefill_tables():
    # Shapes (history 2048) stay in the label; the error and target cells, which differ between
    # revisions, do not split a row in two.
    from compare_revisions import parse_table

    out = """prefill, heads 16/8/128, block 64
dtype     history  new   baseline     paged_ms  baseline_ms  speedup  gather_share  max_err  baseline_err  target
float32   0        2048  sdpa causal  151.864   169.404      1.12     -             1.2e-06  1.6e-06       >= 1.0x: met
float32   2048     256   gather+sdpa  42.476    50.172       1.18     9%            3.5e-07  2.0e-07       >= 1.5x: NOT met
compute roof (dense torch.bmm):
dtype     history  new  roof_dtype  roof_ms  roof_gflops  paged_ms  paged_of_roof  baseline_ms  baseline_of_roof
float32   2048     256  float32     35.455   128.7        42.476    83%            50.172       71%
"""
    cells = parse_table(out)
    assert cells[("float32", "0", "2048", "sdpa causal"), "speedup"] == pytest.approx(1.12)
    assert cells[("float32", "2048", "256", "gather+sdpa"), "gather_share"] == pytest.approx(9)
    assert cells[("float32", "2048", "256", "float32"), "paged_of_roof"] == pytest.approx(83)
    assert len(cells) == 3 + 4 + 6  # gather_share "-" on the fresh row


def test_compare_revisions_runs_each_side_with_its_cpu_variant(tmp_path, capsys, monkeypatch):
    from compare_revisions import main, parse_table, run_once

    monkeypatch.delenv("MINIPAGED_CPU_ISA", raising=False)
    script = tmp_path / "bench.py"
    script.write_text("import os\nprint('what  kernel  ms')\nprint(os.environ.get('MINIPAGED_CPU_ISA', 'none') + '  k  1.5')\n")
    assert parse_table(run_once(tmp_path, str(script), [], "avx2")) == {(("avx2", "k"), "ms"): 1.5}
    assert parse_table(run_once(tmp_path, str(script), [])) == {(("none", "k"), "ms"): 1.5}
    with pytest.raises(SystemExit):
        main(["HEAD", "HEAD", "--isa", "avx512_bf16"])
    assert "--isa: expected two variants" in capsys.readouterr().err


def test_decode_cpu_busy_mode_runs_with_a_spinner():
    out = run_bench("bench/decode_cpu.py", "--batch", "2", "--seq-len", "64", "--iters", "2", "--busy")
    assert out.startswith("BUSY") and re.search(r"^float32\s+minipaged paged", out, re.M), out


def test_peers_checks_every_peer_and_prints_the_table(tmp_path):
    out = run_bench("bench/peers.py", "--batch", "2", "--seq-len", "64", "--iters", "2", "--out", str(tmp_path))
    for row in ("minipaged paged", "sdpa contiguous, enable_gqa", "sdpa contiguous, heads repeated",
                "read roof (sum, same bytes)"):
        assert re.search(rf"^{re.escape(row)}\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+x", out, re.M), out
    assert "minipaged paged: max |out - float64 reference| = " in out
    assert "ipex paged decode" in out  # timed, or said why it was left out
    assert (tmp_path / "peers_float32_2x64.csv").exists() and (tmp_path / "peers_float32_2x64.png").exists()


@pytest.mark.skipif(importlib.util.find_spec("intel_extension_for_pytorch") is None,
                    reason="IPEX is not installed (its torch 2.8 side venv: bench/peers.py)")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_peers_times_ipex_where_it_imports(dtype):
    # Where IPEX imports, its row must pass the float64 check and be timed: a call that no longer
    # matches IPEX's API would otherwise only ever show as a "left out" note.
    out = run_bench("bench/peers.py", "--batch", "2", "--seq-len", "80", "--iters", "2", "--dtype", dtype)
    assert "ipex paged decode: max |out - float64 reference| = " in out, out
    assert re.search(r"^ipex paged decode\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+x", out, re.M), out


def test_serve_quick_prints_every_row_and_writes_csv_and_png(tmp_path):
    pytest.importorskip("transformers")
    from minipaged_ops import integration

    systems = "engine,transformers,static,roof" if hasattr(integration, "LLMEngine") else "transformers,static,roof"
    out = run_bench("bench/serve.py", "--quick", "--no-progress", "--systems", systems, "--out", str(tmp_path))
    for row in systems.split(","):
        assert re.search(rf"^{row}\s+[\d.]+\s+[\d.]+\s+\d+%", out, re.M), out
    # every system gives every request the tokens of the first one (greedy, float32)
    for same in re.findall(r"\s(\d+)/(\d+)\s*$", out, re.M):
        assert same[0] == same[1] == "8", out
    assert (tmp_path / "serve.png").stat().st_size > 0
    lines = (tmp_path / "serve.csv").read_text().splitlines()
    assert len(lines) == 1 + 8 * (len(systems.split(",")) - 1)


def test_serve_repeat_workload_with_a_smaller_draft_model(tmp_path):
    # a draft of hidden 48 beside the tiny model's 64, both scripted to copy the text (--quick keeps
    # the workload given): the speculative row gives the same tokens
    pytest.importorskip("transformers")
    out = run_bench("bench/serve.py", "--quick", "--no-progress", "--systems", "engine", "--workload", "repeat",
                    "--requests", "2", "--prompt-len", "16:16", "--output-len", "6:6", "--speculative-config",
                    '{"method": "draft_model", "num_speculative_tokens": 2}', "--draft-hidden", "48",
                    "--out", str(tmp_path))
    assert re.search(r"^2 requests \(burst\), prompts 16-16, outputs 6-6", out, re.M), out
    assert re.search(r"^engine, speculative\s+[\d.]+\s+[\d.]+.*\s2/2\s*$", out, re.M), out


def test_serve_compares_kv_cache_formats_in_the_same_memory(tmp_path):
    # 5 float32 blocks' worth of bytes: "auto" preempts, int8 and fp8 hold ~3.5-4x the blocks
    pytest.importorskip("transformers")
    out = run_bench("bench/serve.py", "--quick", "--no-progress", "--systems", "engine", "--kv-cache-dtype",
                    "auto,int8,fp8_e5m2", "--kv-cache-memory", str(5 * 16384), "--rounds", "2", "--out", str(tmp_path))
    rows = {m[0]: m[1:] for m in re.findall(r"^  (auto|int8|fp8_e5m2)\s+([\d,]+)\s+([\d.]+)\s+(\d+)\s+(\d+)\s+"
                                             r"(\d+)/(\d+)\s+(\d+)/(\d+)\s+[\d.]+/[\d.]+\s+([\d.]+)$", out, re.M)}
    assert set(rows) == {"auto", "int8", "fp8_e5m2"}, out
    auto_blocks = int(rows["auto"][2])
    assert auto_blocks == 5 and rows["auto"][1] == "1.000"
    for fmt, ratio in (("int8", (32 + 4) / 128), ("fp8_e5m2", 0.25)):  # head_dim 32: int8's scale is 4 bytes more
        assert float(rows[fmt][1]) == pytest.approx(ratio, abs=1e-3), out
        assert int(rows[fmt][2]) == int(5 * 16384 / (16384 * ratio)), out
    assert all(int(p) > 0 for p in rows["auto"][6:8]), out  # the float pool preempts in both rounds
    for fmt in ("int8", "fp8_e5m2"):
        assert min(map(int, rows[fmt][4:6])) > max(map(int, rows["auto"][4:6])), out  # more requests running
    for row in ("engine", "engine int8", "engine fp8_e5m2"):
        assert re.search(rf"^{row}\s+[\d.]+\s+[\d.]+", out, re.M), out


def test_per_isa_runs_hold_torch_to_the_variant_unless_told(monkeypatch):
    import common

    for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"):
        monkeypatch.delenv(name, raising=False)
    assert common.isa_env("avx2", "avx512_amx") == {"MINIPAGED_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2",
                                                     "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    assert common.isa_env("avx2", "avx2") == {"MINIPAGED_CPU_ISA": "avx2"}  # the best variant: torch as it is
    assert common.isa_env("avx512_amx", "avx512_amx") == {"MINIPAGED_CPU_ISA": "avx512_amx"}
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX512")  # the caller's own setting stays
    assert "MKL_ENABLE_INSTRUCTIONS" not in common.isa_env("avx2", "avx512")
