"""`kvsched demo` (make demo, make demo-cluster): everything it writes goes to a run folder, never
a tracked file; every figure it prints is explained; its plots carry titles, the run's config,
SLO lines and simulated-time axes, and a cluster's timeline is split by daemon."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from kvsched.replay import plots
from kvsched.replay.runner import DaemonSample, ReplayResult, Sample
from kvsched.replay.summary import RequestRecord

REPO = Path(__file__).resolve().parents[1]


def test_demo_writes_a_run_folder_and_explains_every_figure(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "kvsched.cli", "demo", "--duration", "4", "--time-scale", "5",
         "--workers", "2"],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    (run,) = (tmp_path / "runs").iterdir()
    assert re.fullmatch(r"demo-\d{8}-\d{6}", run.name), run.name
    assert sorted(p.name for p in run.iterdir()) == [
        "demo.json",
        "demo_latency_cdf.png",
        "demo_timeline.png",
    ]
    assert json.loads((run / "demo.json").read_text())["completed"] > 0
    # Each row of the table has a line saying what it means, and so has each plot.
    table = res.stdout.split("what the figures mean")[0].split("-" * 40)[1]
    rows = [re.split(r"\s{2,}", ln.strip())[0] for ln in table.splitlines() if ln.strip("- ")]
    assert "worker idle on control plane" in rows and len(rows) == 10, rows
    legend = res.stdout.split("what the figures mean")[1]
    for row in rows:
        assert re.search(rf"^  {re.escape(row)}  +\S", legend, re.M), row
    assert "*_latency_cdf.png:" in legend and "*_timeline.png:" in legend


def test_make_demo_targets_write_no_tracked_file() -> None:
    make = (REPO / "Makefile").read_text()
    lines = [x for x in make.splitlines() if "kvsched demo" in x]
    assert len(lines) == 2, lines
    assert not any("bench/" in x or "--json" in x for x in lines), lines
    assert "runs/" in (REPO / ".gitignore").read_text().splitlines()


def _result(daemons: list[str]) -> tuple[ReplayResult, dict[str, object]]:
    records = []
    for i in range(30):
        t0 = i * 0.5
        ttft = 0.2 if i % 10 else 17.0  # a long tail, as long prompts make
        times = [t0 + ttft + 0.02 * k for k in range(5)]
        records.append(
            RequestRecord(f"trace-{i}", t0, 100, 5, first_token_s=times[0], finish_s=times[-1],
                          token_times_s=times, finish_reason="length")
        )  # fmt: skip
    n = len(daemons)
    timeline = [
        Sample(float(t), 3 * n, n, 0.25, 100.0 * n, [DaemonSample(3, 1, 0.25, 100.0)] * n)
        for t in range(1, 30)
    ]
    result = ReplayResult(records, timeline, num_gpu_blocks=5120, block_size=64, daemons=daemons)
    summary: dict[str, object] = {
        "requests": 30, "trace": "/x/mooncake_conversation_slice.jsonl", "num_gpu_blocks": 5120,
        "block_size": 64, "time_scale": 2.5, "rate_scale": 1.0, "slo_ttft_s": 5.0,
        "slo_tpot_s": 0.1, "config": {"gpu": "h100", "workers": 6, "daemons": n},
    }  # fmt: skip
    return result, summary


def test_latency_plot_has_titles_config_slo_lines_and_log_axes() -> None:
    result, summary = _result(["127.0.0.1:1"])
    fig = plots._latency(result, summary, plt)
    try:
        title = fig._suptitle.get_text()
        assert "Latency" in title and "6 sim H100 workers" in title and "SLO TTFT 5 s" in title
        ttft, tpot, e2e = fig.axes
        for ax in (ttft, tpot, e2e):
            assert ax.get_title() and "simulated seconds" in ax.get_xlabel()
            assert ax.get_xscale() == "log"  # the 17 s tail no longer squashes the rest
        for ax, slo in ((ttft, 5.0), (tpot, 0.1)):
            verticals = [ln for ln in ax.get_lines() if list(ln.get_xdata()) == [slo, slo]]
            assert verticals, ax.get_title()
        assert any("90 % within" in t.get_text() for t in ttft.texts)  # 27 of 30 under 5 s
    finally:
        plt.close(fig)


def test_cluster_timeline_is_split_by_daemon() -> None:
    result, summary = _result(["d0", "d1", "d2"])
    fig = plots._timeline(result, summary, plt)
    try:
        axes = fig.axes
        assert "simulated seconds" in axes[-1].get_xlabel()
        assert "3 daemons" in fig._suptitle.get_text()
        _, labels = axes[0].get_legend_handles_labels()
        assert labels == ["d0", "d1", "d2", "all"]
        assert [ln.get_label() for ln in axes[2].get_lines()][:3] == ["d0", "d1", "d2"]
    finally:
        plt.close(fig)
    lat = plots._latency(result, summary, plt)
    try:
        _, labels = lat.axes[0].get_legend_handles_labels()
        assert labels == ["all", "via d0", "via d1", "via d2"]
    finally:
        plt.close(lat)
