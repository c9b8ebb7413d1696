"""A client written from docs/CLIENT.md "Writing a client in another language" alone
(bench/plain_client.py: plain grpcio on the generated stubs, nothing from kvsched.client):
the page lists exactly the channel options and bounds it uses, and with them its streams
survive a paused and a killed daemon of three (tests/cluster/plain_kit.py): every stream
exact, and every stream moved while the paused daemon was still stopped. The timings (fault
-> next token: the TTL + 1 s, and 1 s after a kill) are the benchmark's, `bench.plain_pause`."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from bench import plain_client
from tests.cluster import plain_kit

REPO = Path(__file__).resolve().parents[2]


def _section() -> str:
    page = (REPO / "docs" / "CLIENT.md").read_text()
    start = page.index("## Writing a client in another language")
    return page[start : page.index("\n## ", start + 1)]


def test_the_page_lists_exactly_what_the_plain_client_uses() -> None:
    sec = _section()
    block = sec[sec.index("```text") : sec.index("```", sec.index("```text") + 1)]
    listed = [(k, int(v)) for k, v in re.findall(r"^(grpc\.[\w.]+) = (\d+)$", block, re.M)]
    assert listed == list(plain_client.CHANNEL_OPTIONS)

    def bound(row: str) -> float:
        m = re.search(rf"^\| {re.escape(row)}[^|]* \| (\d+) (s|ms) \|$", sec, re.M)
        assert m is not None, row
        return int(m.group(1)) / (1000 if m.group(2) == "ms" else 1)

    assert bound("first answer of each Generate or Resume attempt") == (
        plain_client.FIRST_ANSWER_TIMEOUT_S
    )
    assert bound("pause between two attempts") == plain_client.RETRY_BACKOFF_S
    assert bound("one break, from its first failure") == plain_client.RETRY_FOR_S
    # What it imports: grpc and the generated messages, nothing of kvsched's own client.
    tree = ast.parse((REPO / "bench" / "plain_client.py").read_text())
    mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    mods |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert {m for m in mods if m and m.startswith("kvsched")} == {"kvsched.v1"}, mods


def test_the_node_example_uses_what_the_page_lists() -> None:
    """examples/node/resume.js follows the same section: its channel options and its two
    bounds are the page's (tests/cluster/test_node_resume.py runs it through a kill -9)."""
    sec = _section()
    block = sec[sec.index("```text") : sec.index("```", sec.index("```text") + 1)]
    listed = dict((k, int(v)) for k, v in re.findall(r"^(grpc\.[\w.]+) = (\d+)$", block, re.M))
    js = (REPO / "examples" / "node" / "resume.js").read_text()
    opts = js[js.index("const CHANNEL_OPTIONS = {") : js.index("};", js.index("CHANNEL_OPTIONS"))]
    used = {k: int(v) for k, v in re.findall(r'"(grpc\.[\w.]+)": (\d+),', opts)}
    assert used == listed
    first = re.search(r"^const FIRST_ANSWER_MS = (\d+);", js, re.M)
    backoff = re.search(r"^const RETRY_BACKOFF_MS = (\d+);", js, re.M)
    assert first is not None and int(first.group(1)) == plain_client.FIRST_ANSWER_TIMEOUT_S * 1000
    assert backoff is not None and int(backoff.group(1)) == plain_client.RETRY_BACKOFF_S * 1000
    assert "detachable: true" in js and "RequestAlreadyLive" in js


def _check(out: plain_kit.Outcome) -> list[int]:
    """Exact streams, and the streams the fault stalled (>= 1 s without a token): returned."""
    assert not out.errors, out.errors[:3]
    assert not out.exact(), f"streams not exact: {out.exact()}"
    running = out.running_at_fault()
    stalls = {i: out.stall(i) for i in running}
    assert all(v is not None for v in stalls.values()), "a stream got no token after the fault"
    stalled = [i for i, v in stalls.items() if v is not None and v >= 1.0]
    for i in stalled:
        print(f"{out.stall(i):.2f} s: {out.timeline(i)}")
    return stalled


@pytest.mark.faults
@pytest.mark.slow
def test_plain_client_streams_leave_a_paused_daemon_while_it_is_stopped() -> None:
    out = plain_kit.run("stop", 30, 600, pause_s=15.0, ttl_s=6.0)
    stalled = _check(out)
    # The pause stalled some streams (their client or their instance was the paused
    # daemon's), and each of them moved while that daemon was still stopped.
    assert stalled, "the pause stalled no stream: the scenario tested nothing"
    late = [i for i in stalled if out.fault_at + (out.stall(i) or 0.0) >= out.woke_at]
    assert not late, [f"{out.timeline(i)}\n{out.log_of(i)}" for i in late]
    assert out.converged_s >= 0  # one daemon per instance, the one its lease names
    # The paused daemon's workers left it and waited at a survivor (WorkerGate._hold), never
    # sent back to the paused daemon, until its lease moved.
    victim = f"pl-d{out.victim}"
    assert out.events(r"waits here: its daemon " + victim), "no survivor held a worker"
    assert not out.events(r"redirected to daemon " + victim + r"\b"), out.events("redirected")


@pytest.mark.faults
def test_plain_client_streams_survive_a_killed_daemon() -> None:
    out = plain_kit.run("kill", 30, 400)
    _check(out)
    # The killed daemon's own clients resumed elsewhere, exactly (checked above).
    direct = [i for i, r in enumerate(out.requests) if r[3] == out.victim]
    assert any(len(out.streams[i].timeline) > 3 for i in direct), "no stream was broken"
