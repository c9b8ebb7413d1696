"""Workers in a cluster: a worker pointed at a daemon that does not own its instance ends up
attached to the owner (real nats-server, daemons and workers)."""

from __future__ import annotations

import time

from kvsched.cluster.natsd import NatsServer
from tests.integration.harness import Proc, start_daemon, start_worker, status, wait_ready


def _instances(address: str) -> dict[str, bool]:
    return {i.instance_id: i.ready for i in status(address).instances}


def test_worker_at_non_owner_is_redirected_to_owner(nats_server: NatsServer) -> None:
    procs: list[Proc] = []
    try:
        a, addr_a = start_daemon("--cluster", nats_server.url, "--daemon-id", "rd-a")
        procs.append(a)
        b, addr_b = start_daemon("--cluster", nats_server.url, "--daemon-id", "rd-b")
        procs.append(b)
        # The first worker of instance rd0 reaches a first: a takes the lease.
        w1 = start_worker(addr_a, "rd0", "--zero-cost")
        procs.append(w1)
        wait_ready(addr_a, ["rd0"])
        w1.stop()
        deadline = time.monotonic() + 20
        while _instances(addr_a).get("rd0") and time.monotonic() < deadline:
            time.sleep(0.05)
        # The instance's next worker is pointed at b first: b redirects it to a (the owner).
        w2 = start_worker(f"{addr_b},{addr_a}", "rd0", "--zero-cost")
        procs.append(w2)
        wait_ready(addr_a, ["rd0"])
        w2.wait_for(r"redirected from \S+ to " + addr_a.replace(".", r"\."))
        assert "rd0" not in _instances(addr_b)
        b.wait_for(r"worker of instance rd0 redirected to daemon rd-a")
        # A worker of an unowned instance is taken by the daemon it reached first.
        w3 = start_worker(f"{addr_b},{addr_a}", "rd1", "--zero-cost")
        procs.append(w3)
        wait_ready(addr_b, ["rd1"])
        assert "rd1" not in _instances(addr_a)
    finally:
        for p in reversed(procs):
            p.stop()


def test_prometheus_names_the_daemon(nats_server: NatsServer) -> None:
    import urllib.request

    proc = Proc(
        [
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
            "--cluster",
            nats_server.url,
            "--daemon-id",
            "pm-a",
        ],
        name="daemon",
    )
    try:
        m = proc.wait_for(r"kvsched metrics on (\S+:\d+)")
        with urllib.request.urlopen(f"http://{m.group(1)}/metrics", timeout=10) as r:
            text = r.read().decode()
        line = next(x for x in text.splitlines() if x.startswith("kvsched_daemon_info{"))
        assert 'daemon_id="pm-a"' in line and f'cluster="{nats_server.url}"' in line
        assert line.endswith(" 1.0")
        assert 'kvsched_cluster_forwarded_total{daemon_id="pm-a"' in text
    finally:
        proc.stop()


def test_demo_cluster_replays_across_daemons(tmp_path: object) -> None:
    """`make demo-cluster` (kvsched demo --cluster) on a few seconds of the trace, sped up."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from tests.integration.harness import REPO, child_env

    out = Path(str(tmp_path)) / "demo.json"
    res = subprocess.run(
        [sys.executable, "-m", "kvsched.cli", "demo", "--cluster", "--daemons", "2",
         "--workers", "2", "--duration", "4", "--time-scale", "5", "--json", str(out)],
        capture_output=True, text=True, timeout=240, cwd=REPO, env=child_env(),
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    assert "2 daemons in one cluster" in res.stdout
    summary = json.loads(out.read_text())
    assert summary["completed"] == summary["requests"] > 0
    assert len(summary["instances"]) == 2
