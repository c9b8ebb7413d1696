"""bench.tier_rounds' split of the replay's extra TTFT: per request the parts add up to the
total (client + queue + service), send and deliver are taken from the replay's own columns,
and the send delay is grouped by a request's place among those arriving at the same instant."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from bench.tier_rounds import gap, main, send_by_position
from bench.tier_stats import by_tier_hit, iqm
from kvsched.traces import TraceRequest

GAP_KEYS = ("total", "client", "client_late", "send", "deliver", "queue", "service")


def test_the_parts_of_the_gap_add_up_to_the_total() -> None:
    sim = [
        {"ttft_s": 0.5, "queue_s": 0.0},
        {"ttft_s": 0.8, "queue_s": 0.1},
        {"ttft_s": None, "queue_s": None},  # not served by the sim: left out
    ]
    rep = [
        {"ttft_s": 0.56, "queue_s": 0.01, "daemon_ttft_s": 0.53, "send_s": 0.02,
         "client_late_s": 0.005, "deliver_s": 0.001},
        {"ttft_s": 0.95, "queue_s": 0.15, "daemon_ttft_s": 0.90, "send_s": float("nan"),
         "client_late_s": None, "deliver_s": 0.002},
        {"ttft_s": 1.0, "queue_s": 0.0, "daemon_ttft_s": 1.0},
    ]  # fmt: skip
    g = gap(sim, rep)
    assert g["requests"] == 2
    total, parts = g["total"]["mean"], ("client", "queue", "service")
    assert total == pytest.approx(sum(g[k]["mean"] for k in parts))
    assert total == pytest.approx(((0.56 - 0.5) + (0.95 - 0.8)) / 2)
    assert g["client"]["mean"] == pytest.approx((0.03 + 0.05) / 2)
    assert g["send"]["mean"] == pytest.approx(0.02), "a NaN send (no span) is left out"
    assert g["client_late"]["p50"] == pytest.approx(0.005)


def test_send_delay_is_grouped_by_place_in_a_burst() -> None:
    arrivals = [0.0, 0.0, 0.0, 3.0, 3.0, 6.0]
    reqs = [TraceRequest(a, [1, 2], 1) for a in arrivals]
    sends = [0.002, 0.007, 0.012, 0.003, 0.009, math.nan]
    by = send_by_position(reqs, [{"send_s": s} for s in sends])
    assert by == pytest.approx({"1": 2.5, "2": 8.0, "3": 12.0})


def test_iqm_is_the_mean_of_the_middle_half() -> None:
    assert iqm([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 9.0, None]) == pytest.approx(0.45)
    assert iqm([None]) is None
    assert iqm([0.3]) == pytest.approx(0.3)


def test_requests_are_grouped_by_where_each_run_found_a_tier_hit() -> None:
    def row(ttft: float, host: int = 0, storage: int = 0) -> dict[str, Any]:
        return {"ttft_s": ttft, "queue_s": 0.0, "daemon_ttft_s": ttft - 0.01, "send_s": 0.01,
                "host": host, "storage": storage}  # fmt: skip

    sim = [row(0.2, host=640), row(0.3, storage=64), row(0.9), row(0.5), row(0.4)]
    rep: list[dict[str, Any]] = [row(0.25, host=640), row(1.1), row(0.3, host=128), row(0.55)]
    rep.append({"ttft_s": None})
    g = by_tier_hit(sim, rep)
    assert [g[k]["requests"] for k in ("both", "sim only", "replay only", "neither")] == [
        1,
        1,
        1,
        1,
    ], "a request missing a TTFT on either side is left out"
    assert g["sim only"]["total"]["mean"] == pytest.approx(0.8)
    assert g["replay only"]["total"]["mean"] == pytest.approx(-0.6)
    assert g["both"]["service"]["p50"] == pytest.approx(0.04)
    assert g["neither"]["send"]["mean"] == pytest.approx(0.01)


def test_report_of_saved_rounds_needs_no_trace(tmp_path: Path, capsys: Any) -> None:
    """--report reads what a run saved (rows included): it adds the IQM and the per-group
    split that older results lack, without reading the trace (its path may be gone); the
    sim's arrival jitters give gains seed by seed against gpu-only's same seed."""
    rows = {"gpu-only": [0.5, 0.6, 0.4, 0.9], "host-4x": [0.3, 0.6, 0.35, 0.8]}
    host = {"gpu-only": [0, 0, 0, 0], "host-4x": [640, 0, 64, 0]}
    configs: dict[str, Any] = {}
    for name in rows:
        cols = {"hit": host[name], "host": host[name], "storage": [0] * 4, "queue_s": [0.0] * 4,
                "ttft_s": rows[name], "instance": [0] * 4}  # fmt: skip
        rcols = {**cols, "ttft_s": [t + 0.02 for t in rows[name]], "send_s": [0.01] * 4,
                 "daemon_ttft_s": [t + 0.01 for t in rows[name]]}  # fmt: skip
        agg = {"hit": 0.1, "ttft_p50": sorted(rows[name])[2]}
        jitter = {"ttft_p50": [0.5, 0.6], "ttft_iqm": [0.55, 0.6], "goodput": [3.0, 3.0]}
        if name == "host-4x":
            jitter = {**jitter, "ttft_p50": [0.4, 0.6]}
        configs[name] = {
            "sim": {"agg": agg, "summary": {"goodput_rps": 3.0}, "rows": cols},
            "sim_jitter": jitter,
            "replays": [
                {
                    "agg": {**agg, "ttft_p50": agg["ttft_p50"] + 0.02},
                    "summary": {"goodput_rps": 3.0},
                    "load_avg": {"before": [1.0], "after": [1.0]},
                    "gap": {k: {"mean": None, "p50": None} for k in GAP_KEYS},
                    "send_ms_by_position": {"1": 10.0},
                    "rows": rcols,
                }
            ],
        }
    saved = {"trace": str(tmp_path / "gone.jsonl"), "window": "0-300", "num_requests": 4,
             "bounds": {"unbounded": 0.2, "gpu_host": 0.2}, "configs": configs}  # fmt: skip
    path = tmp_path / "rounds.json"
    path.write_text(json.dumps(saved))
    main(["--json", str(path), "--report"])
    out = capsys.readouterr().out
    assert "sim TTFT IQM 0.475 (-14 %)" in out
    assert "replay TTFT IQM 0.495 [0.495-0.495] (-13 [-13--13] %)" in out
    assert "TTFT p50 by seed: 0.400 / 0.600 (-20 % / +0 %)" in out, "gains seed by seed"
    assert "tier hit in replay only" not in out and "tier hit in both: 2 requests" in out


def test_a_window_with_no_request_is_refused_before_any_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The shipped slice holds the first 300 s only: a later window used to run empty replays
    and then fail dividing by a zero hit bound."""
    from bench.policies import CONVERSATION_SLICE

    out = tmp_path / "rounds.json"
    with pytest.raises(SystemExit) as exc:
        main(["--trace", str(CONVERSATION_SLICE), "--window", "1800-2100", "--json", str(out)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "no request of" in err and "window 1800-2100" in err and "--trace" in err
    assert not out.exists(), "nothing ran, nothing was written"
