"""The build matrix row that CI cannot otherwise see: a CUDA torch with no nvcc builds CPU
kernels only and says why in one line. Configure-only, so it costs seconds."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.version.cuda is None, reason="needs a CUDA build of torch")
def test_cuda_torch_without_nvcc_configures_cpu_only(tmp_path):
    cmake = shutil.which("cmake", path=os.path.dirname(sys.executable)) or shutil.which("cmake")
    # A PATH with no directory that holds nvcc, and no CUDA hints in the environment.
    path = [d for d in os.environ.get("PATH", "").split(os.pathsep) if d and not (Path(d) / "nvcc").exists()]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA", "CUDACXX", "NVCC"))}
    env["PATH"] = os.pathsep.join([os.path.dirname(cmake)] + path)
    done = subprocess.run(
        [cmake, "-S", str(ROOT), "-B", str(tmp_path), f"-DPython_EXECUTABLE={sys.executable}"],
        capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [ln for ln in done.stdout.splitlines() if "minipaged: backends" in ln]
    assert len(lines) == 1, done.stdout
    assert f"CPU only: torch is a CUDA {torch.version.cuda} build but no CUDA compiler (nvcc) was found" in lines[0]
