"""Cost of one decode step's block-manager bookkeeping, against a rough model step.

One decode step's bookkeeping = ``append_token`` for every running sequence + building the
int32 block-table and seq-len tensors that ``paged_attention_decode`` takes. Variants, side by
side in one run:

  incremental   the manager's mirrored numpy rows: one gather per step (get_batch_tensors)
  +prefix       the same with prefix caching on and token ids passed (hashing on block fill)
  naive         the same appends, tensors rebuilt from Python lists every step (padded lists
                -> torch.tensor), what a pure-Python manager does

Model step (for the ratio): ``--layers`` x ``[n, hidden] @ [hidden, ffn]`` float32 on the CPU,
by default 28 x [n,1024]x[1024,3072] -- one of the seven matmuls of a Qwen3-0.6B decoder layer
(about a fifth of its per-layer weight FLOPs), so the real step is longer and the printed
ratios are upper bounds.

    python bench/block_manager.py            # ~15-30 s on 2 CPU cores
"""

import argparse
import statistics
import time

import torch

from minipaged_ops.block_manager import KVBlockManager


def _manager(n, tokens, steps, bs, caching):
    per_seq = -(-(tokens + steps) // bs)
    m = KVBlockManager(n * per_seq + 1, bs, enable_prefix_caching=caching)
    start = tokens - steps  # the timed steps end at `tokens`, crossing block boundaries en route
    for s in range(n):
        # Distinct prompts so prefix caching has to hash every block and finds no hits.
        ids = [s * 100_003 + i for i in range(start)] if caching else None
        m.create_sequence(s, ids, None if caching else start)
    return m


def _time_steps(m, ids, steps, build, with_tokens):
    """Mean microseconds per step for (appends, tensor building)."""
    t_app = t_build = 0.0
    for step in range(steps):
        t0 = time.perf_counter()
        if with_tokens:
            for s in ids:
                m.append_token(s, 7 + step)
        else:
            for s in ids:
                m.append_token(s)
        t1 = time.perf_counter()
        tables, lens = build(m, ids)
        t2 = time.perf_counter()
        t_app += t1 - t0
        t_build += t2 - t1
    return 1e6 * t_app / steps, 1e6 * t_build / steps, (tables, lens)


def _incremental(m, ids):
    return m.get_batch_tensors(ids)


def _naive(m, ids):
    tables = [m.block_table(s) for s in ids]
    width = max(len(t) for t in tables)
    padded = [t + [0] * (width - len(t)) for t in tables]
    return (torch.tensor(padded, dtype=torch.int32),
            torch.tensor([m.sequence_length(s) for s in ids], dtype=torch.int32))


def _model_step_us(n, hidden, ffn, layers, reps):
    x = torch.randn(n, hidden)
    w = torch.randn(hidden, ffn)
    x @ w  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(layers):
            x @ w
        times.append(time.perf_counter() - t0)
    return 1e6 * min(times)


def run_one(n, args):
    rows = {}
    results = {}
    for name, build, caching in (("incremental", _incremental, False),
                                 ("+prefix", _incremental, True),
                                 ("naive", _naive, False)):
        best = None
        for _ in range(args.trials):
            m = _manager(n, args.tokens, args.steps, args.block_size, caching)
            app, bld, out = _time_steps(m, list(range(n)), args.steps, build, caching)
            if best is None or app + bld < sum(best):
                best = (app, bld)
            assert m.invariants_ok()
        rows[name] = best
        results[name] = out
    # The variants must agree on what they built, or the comparison means nothing.
    assert torch.equal(results["incremental"][0], results["naive"][0])
    assert torch.equal(results["incremental"][1], results["naive"][1])
    model = _model_step_us(n, args.hidden, args.ffn, args.layers, args.model_reps)
    return rows, model


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", type=int, nargs="+", default=[8, 64, 256], help="batch sizes")
    p.add_argument("--tokens", type=int, default=2048, help="sequence length at the end of the timed steps")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per trial")
    p.add_argument("--trials", type=int, default=3, help="best of this many trials")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=3072)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--model-reps", type=int, default=2, help="model-step timing repetitions (min)")
    args = p.parse_args()

    print(f"decode-step bookkeeping, {args.tokens} tokens/seq, block {args.block_size}, "
          f"mean over {args.steps} steps, best of {args.trials}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"model step = {args.layers} x [n,{args.hidden}]x[{args.hidden},{args.ffn}] fp32 matmul on CPU\n")
    head = (f"{'seqs':>5} | {'incr append+tensors us':>22} | {'+prefix us':>10} | "
            f"{'naive append+tensors us':>23} | {'model us':>10} | {'incr/model':>10} | "
            f"{'naive/model':>11} | {'tensors: naive/incr':>19}")
    print(head)
    print("-" * len(head))
    for n in args.seqs:
        rows, model = run_one(n, args)
        (ia, ib), (pa, pb), (na, nb) = rows["incremental"], rows["+prefix"], rows["naive"]
        inc, pre, nai = ia + ib, pa + pb, na + nb
        print(f"{n:>5} | {inc:>9.0f} ({ia:>5.0f}+{ib:>4.0f}) | {pre:>10.0f} | "
              f"{nai:>9.0f} ({na:>5.0f}+{nb:>5.0f}) | {model:>10.0f} | {inc / model:>10.2%} | "
              f"{nai / model:>11.2%} | {nb / ib:>18.1f}x", flush=True)


if __name__ == "__main__":
    main()
