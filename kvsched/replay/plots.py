"""PNG plots of a replay, for a person: latency CDFs (TTFT and TPOT on log axes with their SLO
lines) and a timeline of running, waiting, KV usage and tokens/s, every axis in simulated
seconds, each figure titled with the run's configuration. A run through several daemons draws
one line per daemon. matplotlib is optional (the `bench` extra); without it no plots are
written."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvsched.replay.runner import ReplayResult
from kvsched.replay.summary import RequestRecord

_SLO_COLOR = "#c0392b"


def _by_daemon(result: ReplayResult) -> list[tuple[str, list[RequestRecord]]]:
    """Completed requests per daemon they were sent through (request i: daemon i mod n), with
    "all" first; only "all" for one daemon."""
    done = [r for r in result.records if r.completed]
    groups = [("all", done)]
    n = len(result.daemons)
    if n > 1:
        for k, name in enumerate(result.daemons):
            mine = [r for r in done if int(r.req_id.rsplit("-", 1)[1]) % n == k]
            groups.append((f"via {name}", mine))
    return groups


def _cdf(ax: Any, xs: Sequence[float], label: str, main: bool) -> None:
    xs = sorted(xs)
    if not xs:
        return
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", label=label, lw=2.2 if main else 1.2, alpha=1 if main else 0.8,
            color="black" if main else None)  # fmt: skip


def _slo(ax: Any, slo: float, xs: Sequence[float], what: str) -> None:
    met = sum(1 for x in xs if x <= slo) / len(xs) if xs else 0.0
    ax.axvline(slo, color=_SLO_COLOR, ls="--", lw=1.2)
    ax.text(
        slo, 0.04, f" SLO {what} {slo:g} s\n {100 * met:.0f} % within", color=_SLO_COLOR,
        fontsize=8.5, va="bottom", ha="left",
    )  # fmt: skip


def _latency(result: ReplayResult, summary: dict[str, Any], plt: Any) -> Any:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    groups = _by_daemon(result)
    panels = (
        ("time to first token", "TTFT", lambda r: r.ttft_s, summary["slo_ttft_s"]),
        ("time per output token", "TPOT", lambda r: r.tpot_s, summary["slo_tpot_s"]),
        ("end to end (arrival to last token)", "e2e", lambda r: r.e2e_s, None),
    )
    for ax, (title, short, get, slo) in zip(axes, panels, strict=True):
        for k, (label, recs) in enumerate(groups):
            _cdf(ax, [x for r in recs if (x := get(r)) is not None], label, k == 0)
        xs = [x for r in groups[0][1] if (x := get(r)) is not None]
        if xs and min(xs) > 0:
            ax.set_xscale("log")  # long prompts put a tail decades above the median
        if slo is not None:
            _slo(ax, slo, xs, short)
        ax.set_title(f"{title}, {len(xs)} requests", fontsize=10)
        ax.set_xlabel(f"{short}, simulated seconds" + (" (log scale)" if xs else ""))
        ax.set_ylabel("share of completed requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3, which="both")
        if len(groups) > 1:
            ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(f"Latency per request (CDF)\n{_config_line(summary, 160)}", fontsize=11)
    fig.tight_layout()
    return fig


def _timeline(result: ReplayResult, summary: dict[str, Any], plt: Any) -> Any:
    tl = result.timeline
    t = [s.t_s for s in tl]
    fig, axes = plt.subplots(4, 1, figsize=(11, 9), sharex=True)
    rows = (
        ("requests running", lambda s: s.running, lambda d: d.running),
        ("requests waiting", lambda s: s.waiting, lambda d: d.waiting),
        ("KV cache used, %", lambda s: 100 * s.kv_usage, lambda d: 100 * d.kv_usage),
        ("output tokens / s", lambda s: s.tokens_per_s, lambda d: d.tokens_per_s),
    )
    split = len(result.daemons) > 1 and all(len(s.daemons) == len(result.daemons) for s in tl)
    for ax, (label, total, part) in zip(axes, rows, strict=True):
        if split:
            for k, name in enumerate(result.daemons):
                ax.plot(t, [part(s.daemons[k]) for s in tl], lw=1.2, label=name)
            if "KV" not in label:
                ax.plot(t, [total(s) for s in tl], color="black", lw=1.8, label="all")
        else:
            ax.plot(t, [total(s) for s in tl], color="black", lw=1.5)
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    if split:
        axes[0].legend(fontsize=8, ncol=len(result.daemons) + 1, loc="upper right")
        axes[0].set_title(
            "per daemon: its own instances (running, waiting, KV); output tokens of the "
            "requests sent through it",
            fontsize=9,
        )
    last = max((r.arrival_s for r in result.records), default=None)
    if last is not None and t and last < t[-1]:
        for ax in axes:
            ax.axvline(last, color="grey", ls=":", lw=1.2)
        axes[-1].text(last, 0, " last arrival", color="grey", fontsize=8.5, va="bottom")
    axes[-1].set_xlabel("simulated seconds since the replay started")
    fig.suptitle(f"The run over time\n{_config_line(summary, 110)}", fontsize=11)
    fig.tight_layout()
    return fig


def _config_line(s: dict[str, Any], width: int) -> str:
    cfg = s.get("config", {})
    parts = [f"{s['requests']} requests of {Path(s['trace']).name}"]
    if cfg.get("gpu"):
        parts.append(f"{cfg['workers']} sim {cfg['gpu'].upper()} workers")
    elif cfg.get("workers"):
        parts.append(f"{cfg['workers']} instances")
    if cfg.get("daemons", 1) > 1:
        parts.append(f"{cfg['daemons']} daemons")
    if s.get("num_gpu_blocks"):
        parts.append(f"{s['num_gpu_blocks']:,} KV blocks x {s['block_size']} tokens each")
    if s["time_scale"] != 1:
        parts.append(f"run {s['time_scale']:g}x faster than real time")
    if s["rate_scale"] != 1:
        parts.append(f"arrival rate x{s['rate_scale']:g}")
    parts.append(f"SLO TTFT {s['slo_ttft_s']:g} s, TPOT {s['slo_tpot_s']:g} s")
    return textwrap.fill("; ".join(parts), width)


def write_plots(result: ReplayResult, stem: Path, summary: dict[str, Any]) -> list[Path]:
    """`<stem>_latency_cdf.png` and (with status figures) `<stem>_timeline.png`."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out = []
    figures = [("_latency_cdf.png", _latency)]
    if result.timeline:
        figures.append(("_timeline.png", _timeline))
    for suffix, draw in figures:
        fig = draw(result, summary, plt)
        path = stem.with_name(stem.name + suffix)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        out.append(path)
    return out
