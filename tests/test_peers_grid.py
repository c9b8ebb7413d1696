"""`bench.peers --windows --loads` (bench/peers_grid.py) without vLLM: each cell runs kvsched's
scheduler behind kvsched's router and behind count-based placement on the same window of the
Mooncake trace, and the JSON's ratio is the good-request ratio of those two rows."""

from __future__ import annotations

import json
from pathlib import Path

from bench import peers


def test_grid_runs_both_placements_per_window_and_load(tmp_path: Path) -> None:
    out = tmp_path / "grid.json"
    peers.main(
        ["--no-vllm", "--windows", "0,600", "--loads", "1.2", "--duration", "10"]
        + ["--json", str(out)]
    )
    data = json.loads(out.read_text())
    assert [(c["window_s"], c["load"]) for c in data["cells"]] == [(0, 1.2), (600, 1.2)]
    for c in data["cells"]:
        rows = {(r["scheduler"], r["placement"]): r for r in c["rows"]}
        assert set(rows) == {("kvsched", "kvsched"), ("kvsched", "count")}
        assert c["requests"] > 0 and all(0 <= r["good"] <= c["requests"] for r in c["rows"])
        want = rows["kvsched", "kvsched"]["good"] / max(1, rows["kvsched", "count"]["good"])
        assert c["kvsched_placement_vs_count"] == want
        assert "vllm_placement_vs_count" not in c  # no vLLM rows were run
