"""How the demo shows its figures: byte counts, the engine's capacity report, and the plot of
KV blocks in use per step."""

from __future__ import annotations

def format_report(stats: dict) -> str:
    """``engine.stats()`` as aligned lines; latency percentiles in ms, bytes in MiB."""
    lines = []
    for key, value in stats.items():
        if isinstance(value, dict):
            ms = key.endswith("_s")
            text = "  ".join(f"{k} {v * 1e3:,.1f}" if ms else f"{k} {v}" for k, v in value.items())
            key, text = (key[:-2] + "_ms", text) if ms else (key, text)
        elif key.endswith("bytes") or "_bytes_" in key:
            text = fmt_bytes(value)
        elif isinstance(value, float):
            text = f"{value:.3f}"
        else:
            text = str(value)
        lines.append(f"  {key:26} {text}")
    return "\n".join(lines)


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024



def plot_block_usage(path, steps, steps_n, contiguous_blocks, unshared, batch, n, block_size) -> None:
    """A PNG of KV blocks in use per forward step: the greedy ragged batch against a contiguous
    cache reserved for the maximum length, and the n-way sampling run against no sharing."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed: the demo runs on headless machines and in tests
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    ax.plot(range(1, len(steps) + 1), steps, label="minipaged (allocated on demand)")
    ax.axhline(contiguous_blocks, color="gray", ls="--", label="contiguous, reserved for max length")
    ax.set_title(f"greedy, ragged batch of {batch}")
    ax2.plot(range(1, len(steps_n) + 1), steps_n, color="tab:orange", label="minipaged (prompt blocks shared)")
    ax2.axhline(unshared, color="gray", ls=":", label="without sharing (at the end)")
    ax2.set_title(f"sampling, num_return_sequences={n}")
    for a in (ax, ax2):
        a.set_xlabel("forward step (1 = prefill)")
        a.legend(fontsize=8, loc="lower right")
    ax.set_ylabel(f"KV blocks in use ({block_size} tokens each)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
