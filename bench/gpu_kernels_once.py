"""Every CUDA kernel once over the corner cases, for compute-sanitizer; `--graph` instead captures
cache write + decode in a CUDA graph and checks that replays match eager runs.

Corner cases: every head_dim and dtype, GQA groups 1, 2, 4, 8, 16 (two tiles) and 3 (a partial
tile), seq_len 0 and 1, the highest block id, several split-K partitions with an empty one, a
strided query, out-of-range device data (clamped or masked, MINIPAGED_VALIDATE unset), a batch
past 65,535 sequences, reshape_and_cache with int32/int64/negative/out-of-range slots, copy_blocks
with invalid pairs.

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python bench/gpu_kernels_once.py
    python bench/gpu_kernels_once.py --graph
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import minipaged_ops  # noqa: E402
from conftest import make_paged_case  # noqa: E402

DEV = "cuda"


def every_kernel_once() -> str:
    os.environ.pop("MINIPAGED_VALIDATE", None)
    calls = 0
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for head_dim in (64, 128, 256):
            for heads in ((4, 4), (8, 4), (16, 4), (16, 2), (32, 2), (6, 2)):
                if dtype != torch.bfloat16 and heads not in ((4, 4), (32, 2)):
                    continue
                case = make_paged_case([0, 1, 17, 300], *heads, head_dim, 16, dtype, DEV, seed=head_dim)
                minipaged_ops.paged_attention_decode(**case, scale=head_dim**-0.5)
                calls += 1
    case = make_paged_case([0, 5000, 33], 8, 2, 128, 16, torch.bfloat16, DEV, seed=9)  # split-K
    case["block_tables"][1, 64:128] = -3  # a masked stretch inside a partition
    minipaged_ops.paged_attention_decode(**case, scale=128**-0.5)
    case = make_paged_case([40, 3], 8, 4, 64, 8, torch.float32, DEV, seed=5)
    case["query"] = torch.randn(2, 8, 3 * 64, device=DEV)[..., 64:128]  # strided
    minipaged_ops.paged_attention_decode(**case, scale=0.125)
    case = make_paged_case([16, 9, 0], 4, 2, 64, 8, torch.float32, DEV, seed=1)
    case["block_tables"][0, 1], case["block_tables"][1, 0] = 99, -4
    case["seq_lens"] = torch.tensor([1000, 9, -5], dtype=torch.int32, device=DEV)
    minipaged_ops.paged_attention_decode(**case, scale=0.125, max_seq_len=64)
    case = make_paged_case([3], 1, 1, 64, 16, torch.float16, DEV, seed=2)
    pick = torch.zeros(65_537, dtype=torch.long, device=DEV)
    minipaged_ops.paged_attention_decode(case["query"][pick], case["key_cache"], case["value_cache"],
                                         case["block_tables"][pick], case["seq_lens"][pick], 0.125)
    calls += 4
    for dtype in (torch.bfloat16, torch.float32):
        kc = torch.zeros(9, 4, 16, 64, device=DEV, dtype=dtype)
        vc = torch.zeros_like(kc)
        key = torch.randn(40, 4, 64, device=DEV).to(dtype)
        value = torch.randn(40, 4, 64, device=DEV).to(dtype).transpose(1, 2).contiguous().transpose(1, 2)
        for slot_dtype in (torch.int64, torch.int32):
            slots = torch.randperm(9 * 16, device=DEV)[:40].to(slot_dtype)
            slots[::5] = -1
            slots[3] = 10**6
            minipaged_ops.reshape_and_cache(key, value, kc, vc, slots)
        minipaged_ops.copy_blocks(kc, vc, torch.tensor([[0, 8], [3, 4], [-1, 2], [1, 600]], device=DEV))
    torch.cuda.synchronize()
    return f"gpu_kernels_once: {calls} decode calls, 4 cache writes, 2 block copies"


def graph_replay() -> str:
    case = make_paged_case([5, 300, 4097], 16, 4, 128, 16, torch.bfloat16, DEV, seed=23)
    key = torch.randn(3, 4, 128, device=DEV, dtype=torch.bfloat16)
    value = torch.randn_like(key)
    slots = (case["block_tables"][:, 0].long() * 16 + 15).contiguous()  # last slot of each first block
    eager_cache = {k: case[k].clone() for k in ("key_cache", "value_cache")}

    def step(c):
        minipaged_ops.reshape_and_cache(key, value, c["key_cache"], c["value_cache"], slots)
        return minipaged_ops.paged_attention_decode(case["query"], c["key_cache"], c["value_cache"],
                                                    case["block_tables"], case["seq_lens"], 128**-0.5, 4097)

    expected = step(eager_cache)
    graph_cache = {k: case[k].clone() for k in ("key_cache", "value_cache")}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step({k: v.clone() for k, v in graph_cache.items()})  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(graph_cache)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_cache["key_cache"], eager_cache["key_cache"]), "graph replay wrote another cache"
    assert torch.equal(out, expected), "graph replay's decode differs from eager (bitwise)"
    return "gpu_kernels_once --graph: capture + 3 replays of cache write + decode match eager bitwise"


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--graph", action="store_true", help="CUDA-graph capture and replay instead")
    print(graph_replay() if ap.parse_args().graph else every_kernel_once())
