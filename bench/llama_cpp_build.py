"""Build llama.cpp's ``llama-server`` from the source PyPI ships inside the ``llama-cpp-python``
sdist (the GitHub repository is too large to fetch here), cached under bench/out/llama.cpp/:

    python bench/llama_cpp_build.py            # prints the binaries' paths (builds once, ~20 min on 2 cores)

Only the ``llama-server`` and ``llama-quantize`` targets, with the web UI, OpenSSL and the tests/examples off, ggml tuned
for this CPU (GGML_NATIVE; without AMX, see X86_OPTIONS). Exits with status 2 and a one-line reason where it cannot build
(no network to PyPI, no compiler, no cmake); bench/llama_cpp.py calls it the same way.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tarfile

HERE = os.path.dirname(os.path.abspath(__file__))
CACHE = os.path.join(HERE, "out", "llama.cpp")
CMAKE_OPTIONS = ("-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=ON",
                 "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF",
                 "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON",
                 "-DLLAMA_BUILD_TOOLS=ON")


# ggml's AMX path (its own buffer type for Q4_0 / Q8_0 weights) segfaulted in ggml_backend_amx_mul_mat
# on the first request on an Intel Xeon with AMX (2026-12-07, this source; --no-repack avoided it and
# with it ggml's AVX-512 repacked kernels too): on a CPU with AMX, ggml is built for the CPU's other
# instructions, named one by one, into build-noamx/. LLAMA_CPP_AMX=1 builds it with -march=native anyway.
X86_OPTIONS = {"GGML_SSE42": "sse4_2", "GGML_AVX": "avx", "GGML_AVX2": "avx2", "GGML_FMA": "fma", "GGML_F16C": "f16c",
               "GGML_BMI2": "bmi2", "GGML_AVX_VNNI": "avx_vnni", "GGML_AVX512": "avx512f",
               "GGML_AVX512_VBMI": "avx512vbmi", "GGML_AVX512_VNNI": "avx512_vnni", "GGML_AVX512_BF16": "avx512_bf16"}


def build_options() -> tuple[str, tuple]:
    """(build folder name, CMake options) for this CPU."""
    from minipaged_ops.integration.linear16 import cpu_flags

    flags = cpu_flags()
    if "amx_int8" not in flags or os.environ.get("LLAMA_CPP_AMX") == "1":
        return "build", CMAKE_OPTIONS
    named = tuple(f"-D{option}={'ON' if flag in flags else 'OFF'}" for option, flag in X86_OPTIONS.items())
    return "build-noamx", (*[o for o in CMAKE_OPTIONS if o != "-DGGML_NATIVE=ON"], "-DGGML_NATIVE=OFF", *named,
                           "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF")


class CannotBuild(RuntimeError):
    pass


def _run(cmd, **kw):
    print("+", " ".join(cmd), flush=True)
    if subprocess.run(cmd, **kw).returncode:
        raise CannotBuild(f"{cmd[0]} failed: {' '.join(cmd)}")


def source_dir() -> str:
    """The llama.cpp tree vendored in the newest llama-cpp-python sdist (downloaded once)."""
    found = sorted(glob.glob(os.path.join(CACHE, "llama_cpp_python-*", "vendor", "llama.cpp")))
    if found:
        return found[-1]
    os.makedirs(CACHE, exist_ok=True)
    # the sdist only: with ":all:" pip would also build the sdist's build dependencies (cmake's own
    # bootstrap, many minutes) to read its metadata; --no-build-isolation reads it with ours
    _run([sys.executable, "-m", "pip", "download", "--no-binary", "llama-cpp-python", "--no-build-isolation", "--no-deps",
          "llama-cpp-python", "-d", CACHE])
    archives = sorted(glob.glob(os.path.join(CACHE, "llama_cpp_python-*.tar.gz")))
    if not archives:
        raise CannotBuild("pip download left no llama_cpp_python sdist")
    with tarfile.open(archives[-1]) as tar:
        tar.extractall(CACHE, filter="data")
    return source_dir()


def tool_binary(target: str = "llama-server") -> str:
    """The path of llama.cpp's ``target`` (llama-server, llama-quantize), building it first where
    it is missing."""
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise CannotBuild(f"no {tool} on PATH")
    src = source_dir()
    folder, options = build_options()
    build = os.path.join(CACHE, folder)
    binary = os.path.join(build, "bin", target)
    if os.path.exists(binary):
        return binary
    if not os.path.exists(os.path.join(build, "CMakeCache.txt")):
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        _run(["cmake", "-S", src, "-B", build, *generator, *options])
    _run(["cmake", "--build", build, "--target", target, "-j", str(os.cpu_count() or 2)])
    if not os.path.exists(binary):
        raise CannotBuild(f"the build finished without {binary}")
    return binary


def server_binary() -> str:
    return tool_binary("llama-server")


def main() -> int:
    try:
        print(server_binary())
        print(tool_binary("llama-quantize"))
    except CannotBuild as e:
        print(f"llama.cpp: cannot build llama-server here ({e}); skipping", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
