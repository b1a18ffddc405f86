"""One linear layer on the CPU, every way minipaged could run it, timed in alternation (best of
--repeats rounds), GFLOP/s: the shapes of bench/serve_http.py's model (Qwen3-0.6B: hidden 1024,
MLP 3072, vocabulary 151936), at decode and prefill row counts.

    python bench/linear_cpu.py                       # 2 threads
    python bench/linear_cpu.py --rows 1,32,256 --shapes 1024x3072,3072x1024
    python bench/compare_revisions.py HEAD~1 HEAD --bench bench/linear_cpu.py --isa avx2,avx2 -- \
        --ways "float32 linear_widened,bf16 linear_widened" --rows 4,8,16,24   # a kernel change, before/after

Ways: float32 ``F.linear``; float32 through minipaged's ``linear_widened`` (few rows: the weight
streamed once for all of them; more: the same GEMM); torch's bfloat16 ``F.linear`` (oneDNN where the CPU has AVX512-BF16/AMX,
a generic loop elsewhere); the bfloat16 weight widened to float32 whole on every call; minipaged's
``linear_widened`` (few rows: widened in registers, streamed once; more: widened a block of rows at
a time into the float32 GEMM); int8 per channel
through torchao's own linear (``Int8WeightOnlyConfig``), through ATen's ``_weight_int8pack_mm`` and
through ``linear_widened`` (minipaged's ``Int8Linear``, float32 activations); int4 groups of 32 through ATen's ``_weight_int4pack_mm_for_cpu``
(torchao's CPU packing) and through ``linear_widened`` (minipaged's ``Int4Linear``, float32
activations). Activations bfloat16 except where float32 is named.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import minipaged_ops  # noqa: E402
from common import machine_name  # noqa: E402


def _aten_int4(w16: torch.Tensor, group: int):
    """ATen's int4 CPU kernel on torchao's packing of the same HQQ quantization (what Int4Linear used before)."""
    from torchao.prototype.quantization.int4 import Int4OpaqueTensor
    from torchao.quantization.quantize_.workflows import Int4ChooseQParamsAlgorithm

    t = Int4OpaqueTensor.from_hp(w16, [1, group], int4_choose_qparams_algorithm=Int4ChooseQParamsAlgorithm.HQQ)
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, t.qdata, group, t.scale_and_zero)[:, : w16.shape[0]]


def ways(k: int, n: int) -> dict:
    """name -> (layer taking the input, input dtype)."""
    from minipaged_ops.integration.weight_quant import Int4Linear, Int8Linear

    torch.manual_seed(0)
    lin32 = torch.nn.Linear(k, n, bias=False)
    lin16 = copy.deepcopy(lin32).bfloat16()
    w16 = lin16.weight.detach()
    int8 = Int8Linear.from_linear(lin16)
    out = {
        "float32": (lin32, torch.float32),
        "float32 linear_widened": (lambda x: minipaged_ops.linear_widened(x, lin32.weight.detach()), torch.float32),
        "bf16 torch": (lin16, torch.bfloat16),
        "bf16 widen whole": (lambda x: F.linear(x.float(), w16.float()).bfloat16(), torch.bfloat16),
        "bf16 linear_widened": (lambda x: minipaged_ops.linear_widened(x, w16), torch.bfloat16),
        "int8 ATen": (lambda x: torch.ops.aten._weight_int8pack_mm(x, int8.qweight, int8.scale), torch.bfloat16),
        "int8 linear_widened": (int8, torch.float32),
        "int4 ATen": (_aten_int4(w16, 32), torch.bfloat16),
        "int4 linear_widened": (Int4Linear.from_linear(lin16, 32), torch.float32),
    }
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        ao = copy.deepcopy(lin16)
        quantize_(ao, Int8WeightOnlyConfig())
        out["int8 torchao"] = (ao, torch.bfloat16)
    except ImportError:
        pass
    return out


@torch.inference_mode()
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,32,256")
    p.add_argument("--shapes", default="1024x3072,3072x1024,1024x151936", help="in x out features")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ways", default=None, help="comma-separated subset of the ways (default: all of them)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"{machine_name()}, torch threads {args.threads}, cpu_isa {minipaged_ops.cpu_isa()}, "
          f"torch {torch.backends.cpu.get_cpu_capability()}\n")
    print(f"{'shape':<12}  {'rows':<9}  {'kernel':<24}  GFLOP/s")
    for shape in args.shapes.split(","):
        k, n = map(int, shape.split("x"))
        layers = ways(k, n)
        if args.ways:
            unknown = set(args.ways.split(",")) - set(layers)
            if unknown:
                raise SystemExit(f"--ways: unknown {sorted(unknown)}; choose from {sorted(layers)}")
            layers = {name: layers[name] for name in args.ways.split(",")}
        for rows in map(int, args.rows.split(",")):
            inputs = {dt: torch.randn(rows, k).to(dt) for dt in (torch.float32, torch.bfloat16)}
            best = dict.fromkeys(layers, float("inf"))
            for name, (layer, dt) in layers.items():
                layer(inputs[dt])  # warm
            for _ in range(args.repeats):
                for name, (layer, dt) in layers.items():
                    start = time.perf_counter()
                    layer(inputs[dt])
                    best[name] = min(best[name], time.perf_counter() - start)
            flop = 2 * rows * k * n / 1e9
            for name, t in best.items():  # rows as a label ("24 rows"), so compare_revisions keys on it
                print(f"{k}x{n:<7}  {f'{rows} rows':<9}  {name:<24}  {flop / t:7.1f}", flush=True)


if __name__ == "__main__":
    main()
