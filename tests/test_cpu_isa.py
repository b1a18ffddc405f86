"""The CPU kernels' instruction-set variants: the best one is chosen at load time, MINIPAGED_CPU_ISA
forces another (or fails the import with a clear message), and each variant computes the same
decode. Each case loads minipaged in a fresh process, since the choice is made once per process."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import minipaged_ops

VARIANTS = ("scalar", "avx2", "avx512", "avx512_bf16", "avx512_amx")

# In a child process: load with the given MINIPAGED_CPU_ISA, check a bfloat16 and a float16 decode
# and a cache write against the float64 reference, print the variant in use.
CHILD = r"""
import torch, minipaged_ops
from minipaged_ops import reference
torch.manual_seed(0)
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    num_blocks, kv_heads, block, dim, heads = 80, 2, 16, 128, 8
    kc = torch.randn(num_blocks, kv_heads, block, dim).to(dtype)
    vc = torch.randn_like(kc)
    seq_lens = torch.tensor([0, 1, 37, 300], dtype=torch.int32)
    tables = torch.randperm(num_blocks, dtype=torch.int32).reshape(4, 20)  # the highest block ids too
    q = torch.randn(4, heads, dim).to(dtype)
    out = minipaged_ops.paged_attention_decode(q, kc, vc, tables, seq_lens, dim ** -0.5)
    ref = reference.paged_attention_decode(q.double(), kc.double(), vc.double(), tables, seq_lens, dim ** -0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out.double()[1:], ref[1:], atol=tol, rtol=tol), (dtype, (out.double() - ref).abs().max())
    key = torch.randn(5, kv_heads, dim).to(dtype)
    slots = [3, -1, num_blocks * block - 1, 17, 100]
    kc2, vc2 = kc.clone(), vc.clone()
    minipaged_ops.reshape_and_cache(key, 2 * key, kc2, vc2, torch.tensor(slots))
    for i, s in enumerate(slots):
        if s >= 0:
            assert torch.equal(kc2[s // block, :, s % block], key[i]) and torch.equal(vc2[s // block, :, s % block], 2 * key[i])
    assert torch.equal(kc2[2:6], kc[2:6]) and torch.equal(vc2[2:6], vc[2:6])  # no slot names these blocks
print("ISA", minipaged_ops.cpu_isa())
"""


def run_child(isa: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MINIPAGED_CPU_ISA"}
    if isa is not None:
        env["MINIPAGED_CPU_ISA"] = isa
    return subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=300)


def compiled() -> list[str]:
    return re.search(r"CPU kernel variants: (.*)$", minipaged_ops.build_info()).group(1).split(", ")


def test_build_info_lists_the_compiled_variants_and_the_best_is_chosen():
    names = compiled()
    assert names and set(names) <= set(VARIANTS) | {"native"}, names
    supported = minipaged_ops.supported_cpu_isas()
    assert supported and set(supported) <= set(names) and supported[0] == names[0]
    if os.environ.get("MINIPAGED_CPU_ISA"):
        assert minipaged_ops.cpu_isa() == os.environ["MINIPAGED_CPU_ISA"]
    else:
        assert minipaged_ops.cpu_isa() == supported[-1]


@pytest.mark.parametrize("isa", [None, *VARIANTS])
def test_forced_variant_is_used_and_correct(isa):
    if isa is not None and isa not in minipaged_ops.supported_cpu_isas():
        pytest.skip(f"{isa}: not compiled, or this CPU lacks it")
    done = run_child(isa)
    assert done.returncode == 0, done.stderr
    assert f"ISA {isa or minipaged_ops.supported_cpu_isas()[-1]}" in done.stdout


def test_unknown_variant_fails_the_import_and_names_the_choices():
    done = run_child("avx9000")
    assert done.returncode != 0
    assert "MINIPAGED_CPU_ISA='avx9000': expected one of scalar, avx2, avx512, avx512_bf16, avx512_amx" in done.stderr


def test_variant_not_compiled_fails_the_import():
    missing = next((v for v in (*VARIANTS, "native") if v not in compiled()), None)
    if missing is None:
        pytest.skip("every variant is compiled")
    done = run_child(missing)
    assert done.returncode != 0
    assert f"MINIPAGED_CPU_ISA={missing}: this build did not compile that variant" in done.stderr


def test_variant_this_cpu_lacks_fails_the_import():
    lacking = [v for v in compiled() if v not in minipaged_ops.supported_cpu_isas()]
    if not lacking:
        pytest.skip("this CPU runs every compiled variant")
    done = run_child(lacking[0])
    assert done.returncode != 0
    assert f"MINIPAGED_CPU_ISA={lacking[0]}: this CPU lacks the instructions it needs" in done.stderr


@pytest.mark.skipif(shutil.which("objdump") is None or shutil.which("nm") is None or not sys.platform.startswith("linux"),
                    reason="needs objdump and nm")
def test_no_vector_extension_instructions_outside_the_variants():
    """The portable guarantee: every function that uses AVX (VEX/EVEX-encoded) or AMX instructions
    belongs to a variant's namespace or is file-local to a variant's object. A shared inline function
    (from a c10 or std header) compiled with AVX flags and kept by the linker would crash the
    scalar variant on a CPU without AVX."""
    if "x86_64" not in os.uname().machine:
        pytest.skip("x86-64 only")
    if "native" in compiled():
        pytest.skip("a MINIPAGED_NATIVE_CPU build is for its own machine")
    # The build folder's copy: an installed one has its local symbols stripped.
    built = sorted(Path(__file__).resolve().parents[1].glob("build/*/_C*.so"), key=lambda p: p.stat().st_mtime)
    if not built or built[-1].stat().st_size < Path(minipaged_ops._C.__file__).stat().st_size:
        pytest.skip("no unstripped build of _C in build/")
    lib = str(built[-1])
    text = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", lib], capture_output=True, text=True,
                          check=True).stdout
    # File-local functions (an anonymous namespace, GCC's clones, a vector variant's own copies of
    # header functions under -fno-weak) are private to their object: the linker never shares them.
    symbols = subprocess.run(["nm", "--defined-only", lib], capture_output=True, text=True, check=True).stdout
    local = {int(f[0], 16) for f in (line.split() for line in symbols.splitlines()) if len(f) == 3 and f[1] == "t"}
    offenders, function, shared = set(), "", False
    for line in text.splitlines():
        if line.endswith(">:"):
            function = line
            shared = int(line.split()[0], 16) not in local
        # objdump leaves GCC's outlined parts (``._omp_fn.0.cold``) mangled: the variant's namespace
        # then reads ``9minipaged4avx2`` and so on
        elif shared and re.search(r"\t(v|tile|tdp|ldtilecfg|sttilecfg)", line) and not re.search(
                r"minipaged::(avx2|avx512|avx512_bf16|avx512_amx)::|9minipaged(4avx2|6avx512|11avx512_bf16|10avx512_amx)",
                function):
            offenders.add(function)
    assert not offenders, sorted(offenders)[:10]
