"""Tensor parallelism on CPU: two gloo ranks (this process is rank 0, the driver; rank 1 a worker
process it starts) against the single-process engine on the same tiny Qwen3 folder.

Every test stops every process it starts; ``_children()`` checks it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from minipaged_ops.integration import LLMEngine, SamplingParams
from minipaged_ops.integration.distributed import TensorParallelError, start_engine
from minipaged_ops.integration.engine.loading import load_pretrained
from minipaged_ops.integration.planner import ScheduledChunk, plan_step
from minipaged_ops.tiny import save_tiny_model

# small enough that the scenario preempts (it needs ~17 blocks of 16 tokens at once)
ENGINE_ARGS = dict(num_blocks=10, block_size=16, max_num_seqs=8, max_num_batched_tokens=32,
                   preemption_mode="swap")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tp") / "tiny-qwen3", layers=2, heads=4, kv_heads=2,
                           head_dim=16, hidden=64)


@pytest.fixture(scope="module")
def tp_engine(model_dir):
    engine = start_engine(model_dir, 2, dtype="float32", device="cpu", tokenizer=None, **ENGINE_ARGS)
    yield engine
    engine.shutdown()
    _assert_no_children()


@pytest.fixture(scope="module")
def single_engine(model_dir):
    model, _ = load_pretrained(model_dir, dtype="float32", device="cpu")
    return LLMEngine(model, **ENGINE_ARGS)


def _state(pid: int) -> tuple[int, str] | None:
    """(parent pid, state letter) of a process, None when there is none."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), fields[0]


def _alive(pid: int) -> bool:
    state = _state(pid)
    return state is not None and state[1] != "Z"


def _children() -> list[int]:
    """Live child processes of this process (zombies excluded)."""
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and (_state(int(e)) or (0, ""))[0] == os.getpid()
            and _alive(int(e))]


def _assert_no_children(timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _children() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _children() == [], f"processes left behind: {_children()}"


def _prompts(seed: int = 0) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(3, 400, (n,), generator=g).tolist()  # noqa: E731
    shared = ids(40)
    return {"a": shared, "b": ids(23), "c": shared[:32] + ids(5), "d": ids(30), "e": ids(9)}


def _scenario(engine) -> tuple[dict, dict]:
    """Requests arriving mid-run, a prefix hit (c shares a's first two blocks), n = 3 with a seed
    (b), an abort (d) and a pool small enough to preempt; returns each request's completions
    ``[(token_ids, finish_reason)]`` and the engine's stats."""
    p = _prompts()
    greedy = SamplingParams(max_tokens=16, ignore_eos=True)
    arrivals = {0: [("a", greedy), ("b", SamplingParams(n=3, temperature=0.9, seed=7, max_tokens=12, ignore_eos=True))],
                2: [("c", greedy)], 3: [("d", SamplingParams(max_tokens=20, ignore_eos=True))],
                5: [("e", SamplingParams(max_tokens=8, ignore_eos=True))]}
    finals = {}
    for step in range(300):
        for rid, params in arrivals.get(step, ()):
            engine.add_request(rid, p[rid], params)
        if step == 7:
            engine.abort_request("d")
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = [(o.token_ids, o.finish_reason) for o in out.outputs]
        if step > 5 and not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests(), "the scenario did not finish within 300 steps"
    return finals, engine.stats()


def test_kv_heads_must_divide(model_dir):
    # 4 attention heads split 4 ways, but 2 kv heads do not: refused before any process starts
    with pytest.raises(ValueError, match="num_key_value_heads=2 does not divide by it"):
        start_engine(model_dir, 4, dtype="float32", device="cpu", num_blocks=8)
    assert _children() == []


@pytest.mark.parametrize("failure", ["kill", "hang"])
def test_failed_worker_raises_not_hangs(model_dir, failure):
    engine = start_engine(model_dir, 2, dtype="float32", device="cpu", tokenizer=None, num_blocks=16, timeout_s=3.0)
    try:
        assert engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)[0].finished
        (pid,) = engine.worker_pids
        os.kill(pid, signal.SIGKILL if failure == "kill" else signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match="rank 1" if failure == "kill" else "out of step"):
            engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4), use_tqdm=False)
        assert time.monotonic() - start < 15
        with pytest.raises(TensorParallelError):  # and every later step, at once
            engine.generate([[9]], SamplingParams(max_tokens=1), use_tqdm=False)
    finally:
        engine.shutdown()
    _assert_no_children()


def test_shutdown_context_manager_and_exit_leave_no_process(model_dir):
    with start_engine(model_dir, 2, dtype="float32", device="cpu", tokenizer=None, num_blocks=16) as engine:
        (pid,) = engine.worker_pids
        assert engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)[0].finished
    _assert_no_children()
    assert not _alive(pid)
    engine.shutdown()  # idempotent
    # interpreter exit without shutdown(): the worker goes too
    script = textwrap.dedent(f"""
        from minipaged_ops.integration.distributed import start_engine
        engine = start_engine({model_dir!r}, 2, dtype="float32", device="cpu", num_blocks=16, tokenizer=None)
        print(engine.worker_pids[0], flush=True)
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    worker = int(run.stdout.split()[-1])
    deadline = time.monotonic() + 10
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(worker), "the worker outlived its driver's interpreter"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_one_rank_nccl_group_on_gpu(model_dir):
    """The GPU path starts: a one-rank group whose split layers run NCCL collectives on CUDA,
    with the tokens of the single-process engine."""
    prompt = _prompts(seed=6)["b"]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    with start_engine(model_dir, 1, dtype="float32", device="cuda", num_blocks=16, tokenizer=None) as engine:
        assert engine.model.device.type == "cuda"
        got = engine.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        assert engine.stats()["collective_seconds"]["model"] > 0
    model, _ = load_pretrained(model_dir, dtype="float32", device="cuda")
    want = LLMEngine(model, num_blocks=16).generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == want


def _get(url: str, timeout: float = 5.0):
    import urllib.request

    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.status, response.read()


def _post_json(url: str, body: dict, timeout: float = 60.0) -> dict:
    import urllib.request

    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def test_torchrun_two_nodes_serve_one_request(model_dir):
    """``torchrun --nnodes 2 --nproc-per-node 1 -m minipaged_ops.serve ... --tensor-parallel-size 2``
    twice on this machine, rendezvous on loopback: node 0's rank serves HTTP, node 1's serves its
    steps; one greedy request gets the single-process engine's tokens, and stopping node 0 ends
    node 1 cleanly."""
    pytest.importorskip("fastapi")
    from minipaged_ops.integration.distributed.group import free_port

    prompt = _prompts(seed=5)["b"]
    port, http = free_port(), free_port()
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                               "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
                               "-m", "minipaged_ops.serve", "--model", model_dir, "--tensor-parallel-size", "2",
                               "--dtype", "float32", "--device", "cpu", "--num-blocks", "16", "--port", str(http),
                               "--log-level", "warning"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for rank in (0, 1)]
    try:
        deadline = time.monotonic() + 180
        while True:  # bounded: until the server answers, a node exits, or the deadline
            assert all(n.poll() is None for n in nodes), [n.communicate()[0][-3000:] for n in nodes]
            assert time.monotonic() < deadline, "the server did not come up within 180 s"
            try:
                if _get(f"http://127.0.0.1:{http}/health")[0] == 200:
                    break
            except OSError:
                time.sleep(0.5)
        reply = _post_json(f"http://127.0.0.1:{http}/v1/completions",
                           {"model": model_dir, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        os.killpg(nodes[0].pid, signal.SIGTERM)  # stop the server: its engine stops rank 1
        assert nodes[1].wait(60) == 0, (nodes[0].communicate()[0][-5000:], nodes[1].communicate()[0][-1000:])
    finally:
        for node in nodes:  # each launch and its rank, whatever happened
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pid, signal.SIGKILL)
            node.wait()
    model, tokenizer = load_pretrained(model_dir, dtype="float32", device="cpu")
    want = LLMEngine(model, num_blocks=16).generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True),
                                                    use_tqdm=False)[0].outputs[0].token_ids
    assert reply["choices"][0]["text"] == tokenizer.decode(want, skip_special_tokens=True)
    assert reply["usage"]["completion_tokens"] == 8


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_8_bit_kv_cache_outputs_equal_single_process(model_dir, kv_cache_dtype):
    """Each rank's pool holds its own kv heads in 8 bits: int8's per-token scales are its own, fp8's
    per-layer scales (calculated from the first batch) are the maxima over every rank's heads, so
    the tokens are those of one process with the same format, through swaps, prefix hits and n = 3."""
    kv = dict(kv_cache_dtype=kv_cache_dtype, calculate_kv_scales=kv_cache_dtype.startswith("fp8"))
    model, _ = load_pretrained(model_dir, dtype="float32", device="cpu")
    single = LLMEngine(model, **ENGINE_ARGS, **kv)
    want, stats = _scenario(single)
    with start_engine(model_dir, 2, dtype="float32", device="cpu", tokenizer=None, **ENGINE_ARGS, **kv) as engine:
        got, tp_stats = _scenario(engine)
        scales = [(float(s.key), float(s.value)) for s in engine.pool.kv_scales] if kv["calculate_kv_scales"] else []
    _assert_no_children()
    assert got == want
    assert tp_stats["preemptions"] == stats["preemptions"] > 0 and tp_stats["swapped_blocks_out"] > 0
    assert tp_stats["kv_cache_dtype"] == kv_cache_dtype
    # head_dim 16: one byte per element, int8 with a float32 scale per token and kv head
    float32 = LLMEngine(model, num_blocks=4, block_size=ENGINE_ARGS["block_size"]).kv_bytes_per_block
    assert 2 * tp_stats["kv_bytes_per_block"] == stats["kv_bytes_per_block"] == float32 * (16 + 4 * (
        kv_cache_dtype == "int8")) // (4 * 16)
    # rank 0 holds kv head 0 only: without the maxima over the ranks its scales would be its own
    for (key, value), s in zip(scales, single.pool.kv_scales):
        assert key == pytest.approx(float(s.key), rel=1e-5) and value == pytest.approx(float(s.value), rel=1e-5)


# The engines of the module's fixtures live from here to the end of the file: these tests come last.


def test_outputs_equal_single_process_and_kv_bytes_per_rank_halve(tp_engine, single_engine):
    got, tp_stats = _scenario(tp_engine)
    want, stats = _scenario(single_engine)
    assert got == want
    assert sorted(got) == ["a", "b", "c", "d", "e"] and got["d"][0][1] == "abort" and len(got["b"]) == 3
    # the scenario did reach what it is meant to cover, on both engines alike
    for s in (tp_stats, stats):
        assert s["preemptions"] > 0 and s["swapped_blocks_out"] > 0 and s["prefix_cache_hits"] > 0
    assert tp_stats["preemptions"] == stats["preemptions"]
    assert tp_stats["blocks_used"] == 0 and tp_stats["tensor_parallel_size"] == 2
    assert 2 * tp_stats["kv_bytes_per_block"] == stats["kv_bytes_per_block"]
    assert tp_stats["kv_bytes_per_rank"] == ENGINE_ARGS["num_blocks"] * tp_stats["kv_bytes_per_block"]
    assert tp_stats["collective_seconds"]["broadcast"] > 0 and tp_stats["collective_seconds"]["model"] > 0


def _packed_steps(model, pool) -> list[torch.Tensor]:
    """Two packed steps on ``pool``: prefills of two sequences, then their decodes together with
    the prefill of a third; the logits of every sampled row."""
    bm = pool.block_manager
    p = _prompts(seed=3)
    a, b, c = p["a"], p["b"], p["d"]
    logits = []

    def run(chunks):
        meta = plan_step(bm, chunks, pool.device)
        with torch.inference_mode():
            out = model(input_ids=meta.input_ids[None], position_ids=meta.position_ids[None], use_cache=False,
                        logits_to_keep=meta.logits_indices, minipaged_step=meta, minipaged_kv_caches=pool.kv_caches)
        logits.append(out.logits[0].double())

    bm.create_sequence("pa", a)
    bm.create_sequence("pb", b)
    run([ScheduledChunk("pa", a, 0), ScheduledChunk("pb", b, 0)])
    bm.append_token("pa", 5)
    bm.append_token("pb", 6)
    bm.create_sequence("pc", c)
    run([ScheduledChunk("pa", [5], len(a)), ScheduledChunk("pb", [6], len(b)), ScheduledChunk("pc", c, 0)])
    for seq in ("pa", "pb", "pc"):
        bm.release_sequence(seq)
    return logits


def test_packed_step_logits_match_single_process(tp_engine, single_engine):
    got = _packed_steps(tp_engine.model, tp_engine.pool)
    want = _packed_steps(single_engine.model, single_engine.pool)
    for g, w in zip(got, want):
        assert g.shape == w.shape == (w.shape[0], 512)
        assert (g - w).abs().max() < 1e-4
    assert tp_engine.pool.geometry.num_kv_heads * 2 == single_engine.pool.geometry.num_kv_heads
