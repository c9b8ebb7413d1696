"""PNG plots of a replay: latency CDFs and a timeline of running, waiting, KV usage, tokens/s.
matplotlib is optional (the `bench` extra); without it no plots are written."""

from __future__ import annotations

from pathlib import Path

from kvsched.replay.runner import ReplayResult


def write_plots(result: ReplayResult, stem: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    done = [r for r in result.records if r.completed]
    series = {
        "TTFT": [x for r in done if (x := r.ttft_s) is not None],
        "TPOT": [x for r in done if (x := r.tpot_s) is not None],
        "e2e": [x for r in done if (x := r.e2e_s) is not None],
    }
    out = []
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, (name, xs) in zip(axes, series.items(), strict=True):
        xs = sorted(xs)
        if xs:
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))])
        ax.set_xlabel(f"{name} (s)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{name} CDF")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = stem.with_name(stem.name + "_latency_cdf.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    out.append(path)

    tl = result.timeline
    if tl:
        t = [s.t_s for s in tl]
        fig, axes = plt.subplots(4, 1, figsize=(10, 8), sharex=True)
        for ax, values, label in (
            (axes[0], [s.running for s in tl], "running"),
            (axes[1], [s.waiting for s in tl], "waiting"),
            (axes[2], [100 * s.kv_usage for s in tl], "KV usage %"),
            (axes[3], [s.tokens_per_s for s in tl], "output tokens/s"),
        ):
            ax.plot(t, values)
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        axes[-1].set_xlabel("time (s)")
        fig.tight_layout()
        path = stem.with_name(stem.name + "_timeline.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        out.append(path)
    return out
