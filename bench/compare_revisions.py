"""Before/after for a CPU kernel change: build two git revisions and run one benchmark on each,
alternating, in a single command.

Each revision is built CPU-only (its CUDA code does not change a CPU figure) into
bench/out/revisions/<sha>/ and cached there. Rounds alternate A, B, A, B, ... so a busy stretch
on a shared machine lands on both alike; the table gives each revision's median of every column
the benchmark prints, and B / A.

    python bench/compare_revisions.py HEAD~1 HEAD
    python bench/compare_revisions.py main WORKTREE -- --dtype float32,bfloat16 --iters 20
    python bench/compare_revisions.py HEAD WORKTREE --bench bench/cache_write.py
    python bench/compare_revisions.py HEAD HEAD --isa avx512_bf16,avx512_amx   # two CPU variants of one build

WORKTREE names the uncommitted working tree. The benchmark script itself always comes from the
working tree, so both revisions are measured by the same code.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "bench" / "out" / "revisions"
WORKTREE = "WORKTREE"

# Runs the benchmark against one built revision: the editable install of the working tree is
# taken off the import path so that `import minipaged_ops` finds the revision's copy.
RUNNER = """
import runpy, sys
site, script, args = sys.argv[1], sys.argv[2], sys.argv[3:]
sys.meta_path[:] = [f for f in sys.meta_path if "skbc" not in type(f).__module__.lower()]
sys.path.insert(0, site)
sys.argv = [script, *args]
runpy.run_path(script, run_name="__main__")
"""


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def cpu_only_env() -> dict:
    """The environment of a build that finds no nvcc (so it compiles the CPU kernels only)."""
    path = [d for d in os.environ.get("PATH", "").split(os.pathsep) if d and not (Path(d) / "nvcc").exists()]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA", "CUDACXX", "NVCC"))}
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), *path])
    return env


def build(rev: str) -> tuple[str, Path]:
    """Builds `rev` (CPU only) and returns (label, directory to put on sys.path)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        if rev == WORKTREE:
            label = f"worktree ({git('rev-parse', '--short', 'HEAD')}+changes)"
            files = git("ls-files", "--cached", "--others", "--exclude-standard").splitlines()
            for f in files:
                if (ROOT / f).is_file():
                    (src / f).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(ROOT / f, src / f)
            site = CACHE / "worktree"
            shutil.rmtree(site, ignore_errors=True)
        else:
            sha = git("rev-parse", "--verify", f"{rev}^{{commit}}")
            label = f"{rev} ({sha[:7]})"
            site = CACHE / sha
            if (site / "minipaged_ops").is_dir():
                return label, site
            src.mkdir()
            archive = subprocess.run(["git", "archive", sha], cwd=ROOT, check=True, capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
        print(f"building {label} (CPU only) ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps",
                        "--target", str(site), str(src)], check=True, env=cpu_only_env())
    return label, site


def run_once(site: Path, script: str, args: list[str], isa: str | None = None) -> str:
    env = {**os.environ, "MINIPAGED_CPU_ISA": isa} if isa else None
    out = subprocess.run([sys.executable, "-c", RUNNER, str(site), script, *args], cwd=ROOT, check=True,
                         capture_output=True, text=True, env=env)
    return out.stdout


NUMBER = re.compile(r"^(-?\d+(?:\.\d+)?)(x|%)?$")
MEASURED = re.compile(r"^-?\d+\.\d+(x|%)?$|^-?\d+%$")  # a figure, not a shape (2048) or a label


def parse_table(text: str) -> dict[tuple, float]:
    """Numeric cells of the benchmark's tables, keyed by (row label, column). A table starts at a
    header line (its first word `dtype`, or a `kernel` column); a row's label is its cells before
    the first measured figure (decode_cpu.py: dtype and kernel; prefill.py: dtype, history, new
    tokens and baseline)."""
    lines = [l for l in text.splitlines() if l.strip()]
    cells, header = {}, None
    for line in lines:
        words = line.split()
        if words[0] == "dtype" or "kernel" in words:
            header = words
            continue
        parts = re.split(r"\s{2,}", line.strip())
        if header is None or len(parts) != len(header):
            continue
        first = next((i for i, p in enumerate(parts) if MEASURED.match(p)), len(parts))
        label = tuple(parts[:first])
        for p, h in zip(parts[first:], header[first:]):
            if m := NUMBER.match(p):
                cells[label, h] = float(m.group(1))
    return cells


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    bench_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before", help="git revision, or WORKTREE")
    ap.add_argument("after", help="git revision, or WORKTREE")
    ap.add_argument("--bench", default="bench/decode_cpu.py", help="benchmark script (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=5, help="runs of the benchmark per revision")
    ap.add_argument("--isa", help="the CPU kernel variant (MINIPAGED_CPU_ISA) for A and B, comma separated")
    args = ap.parse_args(argv)
    isas = args.isa.split(",") if args.isa else [None, None]
    if args.isa and (len(isas) != 2 or not all(isas)):
        ap.error(f"--isa: expected two variants, comma separated (e.g. avx512_bf16,avx512_amx); got {args.isa!r}")

    CACHE.mkdir(parents=True, exist_ok=True)
    revs = [build(args.before), build(args.after)]
    revs = [(label + (f", MINIPAGED_CPU_ISA={isa}" if isa else ""), site) for (label, site), isa in zip(revs, isas)]
    results = [[], []]
    for _ in tqdm(range(args.rounds), desc="rounds (A, B alternating)", file=sys.stderr):
        for i, (_, site) in enumerate(revs):
            results[i].append(parse_table(run_once(site, args.bench, bench_args, isas[i])))
    print(f"{args.bench} {' '.join(bench_args)}; {args.rounds} rounds, alternating; medians")
    print(f"A = {revs[0][0]}\nB = {revs[1][0]}")
    keys = [k for k in results[0][0] if all(k in r for rs in results for r in rs)]
    width = max(len(" / ".join(k[0])) for k in keys)
    print(f"{'row'.ljust(width)}  {'column':<18} {'A':>9} {'B':>9} {'B / A':>7}")
    for key in keys:
        a = statistics.median(r[key] for r in results[0])
        b = statistics.median(r[key] for r in results[1])
        print(f"{' / '.join(key[0]).ljust(width)}  {key[1]:<18} {a:9.3f} {b:9.3f} {b / a if a else float('nan'):7.2f}")


if __name__ == "__main__":
    main()
