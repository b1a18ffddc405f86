"""Registers, stack and spills of every CUDA kernel (each .cu in src_cuda/cuda), from `nvcc -Xptxas -v` (no GPU needed).

    python bench/ptxas_report.py            # sm_90
    python bench/ptxas_report.py --arch 80
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="90")
    args = ap.parse_args(argv)
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        sys.exit("nvcc not found on PATH")
    for source in sorted((ROOT / "src_cuda/cuda").glob("*.cu")):
        report(nvcc, source, args.arch)


def report(nvcc: str, source: Path, arch: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        done = subprocess.run([nvcc, "-std=c++20", "-O3", f"-arch=sm_{arch}", "-Xptxas", "-v",
                               f"-I{ROOT / 'src_cuda'}", "-c", str(source), "-o", f"{tmp}/{source.stem}.o"],
                              capture_output=True, text=True)
        seconds = time.perf_counter() - start
    if done.returncode:
        sys.exit(done.stderr)
    lines = done.stderr.splitlines()
    print(f"nvcc sm_{arch}: {source.name} compiled in {seconds:.1f} s")
    print(f"{'kernel':60s} {'regs':>5s} {'stack':>6s} {'spill':>6s}")
    for i, line in enumerate(lines):
        m = re.search(r"Compiling entry function '(\S+)'", line)
        if not m:
            continue
        name = subprocess.run(["c++filt", m.group(1)], capture_output=True, text=True).stdout.strip()
        name = re.sub(r"minipaged::cuda::\(anonymous namespace\)::|minipaged::cuda::", "", name)
        name = re.sub(r"\(.*\)$", "", name)
        info = "\n".join(lines[i + 1:i + 4])
        regs = re.search(r"Used (\d+) registers", info)
        stack = re.search(r"(\d+) bytes stack frame", info)
        spill = re.search(r"(\d+) bytes spill stores", info)
        print(f"{name:60s} {regs.group(1) if regs else '?':>5s} {stack.group(1) if stack else '?':>6s} "
              f"{spill.group(1) if spill else '?':>6s}")

if __name__ == "__main__":
    main()
