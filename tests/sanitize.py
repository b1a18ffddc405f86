"""`make test-sanitize`: the emulated CUDA op tests (`pytest -k emu`) under ASan+UBSan, then TSan.

Builds the emulation extension twice more (build/sanitize-address, build/sanitize-thread; only
the kernels and the emulator are instrumented) and loads each into an uninstrumented Python
with the sanitizer runtime preloaded (MINIPAGED_EMU_LIBRARY picks the build). Under TSan every
CUDA thread is a TSan fiber and __syncthreads the only ordering between the threads of a block
(blocks are not ordered at all), so a missing barrier is a reported race. A report stops the run
(exit 66) and is kept in build/sanitize-<kind>/report.*.

    .venv/bin/python tests/sanitize.py [--kinds address,thread] [--seed N] [pytest args...]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ["tests/test_paged_attention.py", "tests/test_reshape_and_cache.py", "tests/test_op_errors.py",
         "tests/test_paged_prefill.py"]
# Every emulated case, except that the prefill kernel runs its float32 cases only (85 of 203): the
# whole prefill grid triples the sanitized run; its fp16/bf16 cases run unsanitized in `make test`.
SELECT = "emu and not (test_paged_prefill and (float16 or bfloat16 or compile))"


def cmake() -> str:
    import cmake as cm  # the pip package the Makefile installs (a system cmake may be too old)
    return os.path.join(cm.CMAKE_BIN_DIR, "cmake")


def build_emulation(source: Path, build: Path, sanitizer: str, build_type: str = "RelWithDebInfo") -> Path:
    """Configures (once) and builds the _emu target; returns the extension's path."""
    if not (build / "build.ninja").exists():
        subprocess.run([cmake(), "-S", str(source), "-B", str(build), "-G", "Ninja", f"-DPython_EXECUTABLE={sys.executable}",
                        f"-DMINIPAGED_EMULATION_SANITIZER={sanitizer}", f"-DCMAKE_BUILD_TYPE={build_type}"],
                       check=True, capture_output=True)
    subprocess.run([cmake(), "--build", str(build), "--target", "_emu"], check=True, capture_output=True, text=True)
    return next(build.glob("_emu*.so"))


def sanitizer_env(sanitizer: str, log: Path) -> dict[str, str]:
    """Preloads the runtime (Python is not instrumented) and libstdc++ (ASan hooks __cxa_throw)."""
    if not sanitizer:
        return {}
    lib = {"address": "libasan.so", "thread": "libtsan.so"}[sanitizer]
    runtime = subprocess.check_output(["g++", f"-print-file-name={lib}"], text=True).strip()
    cxx = subprocess.check_output(["g++", "-print-file-name=libstdc++.so"], text=True).strip()
    options = f"log_path={log}:halt_on_error=1:exitcode=66"
    return {"LD_PRELOAD": f"{runtime} {cxx}", "ASAN_OPTIONS": f"detect_leaks=0:{options}",
            "UBSAN_OPTIONS": f"print_stacktrace=1:{options}", "TSAN_OPTIONS": options}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", default="address,thread")
    parser.add_argument("--seed", help="EMU_SEED: run each block's threads in a random order")
    args, pytest_args = parser.parse_known_args()
    status = 0
    for kind in args.kinds.split(","):
        build = ROOT / "build" / f"sanitize-{kind}"
        print(f"--- {kind}: building {build}", flush=True)
        library = build_emulation(ROOT, build, kind)
        for old in build.glob("report.*"):
            old.unlink()
        env = dict(os.environ, MINIPAGED_EMU_LIBRARY=str(library), **sanitizer_env(kind, build / "report"))
        if args.seed:
            env["EMU_SEED"] = args.seed
        done = subprocess.run([sys.executable, "-m", "pytest", *TESTS, "-k", SELECT, "-q", "-p", "no:cacheprovider",
                               *pytest_args], cwd=ROOT, env=env)
        for report in build.glob("report.*"):
            print(f"--- {kind}: sanitizer report {report}:\n{report.read_text()[:4000]}")
        print(f"--- {kind}: {'clean' if done.returncode == 0 else f'FAILED (exit {done.returncode})'}", flush=True)
        status = status or done.returncode
    return status


if __name__ == "__main__":
    sys.exit(main())
