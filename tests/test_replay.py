"""`kvsched replay` against a daemon whose worker cannot hold every request of the shipped trace:
the refused ones are listed with the daemon's reason (table and JSON), the run says up front
which requests cannot fit, the JSON carries the workers' real block size, and a non-zero exit
always comes with a line saying why; a default sim worker has its --gpu profile's pool and
holds the whole trace. Real daemon, real sim worker, on loopback."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvsched.client.aio import AsyncSession
from kvsched.data import CONVERSATION_SLICE
from kvsched.replay import runner
from kvsched.replay.args import H100_BLOCKS
from kvsched.replay.fit import unfit
from kvsched.replay.launch import spawn, start_cluster, start_daemon
from kvsched.traces import TraceRequest, load_trace
from kvsched.v1 import admin_service_pb2 as apb
from kvsched.v1 import request_service_pb2 as rpb
from kvsched.worker_stub.costmodel import default_num_blocks

REPO = Path(__file__).resolve().parents[1]


def _spy_on_writes(monkeypatch: Any, seen: Callable[[AsyncSession, list[str]], None]) -> None:
    """Call `seen(session, client tags)` for every message a session writes (a batch: its
    submits' tags, in order)."""
    real_write = AsyncSession._write

    async def write(self: AsyncSession, msg: rpb.SessionRequest | bytes) -> None:
        m = rpb.SessionRequest.FromString(msg) if isinstance(msg, bytes) else msg
        batch = m.WhichOneof("kind") == "batch"
        seen(self, [s.client_tag for s in m.batch.submits] if batch else [m.submit.client_tag])
        await real_write(self, msg)

    monkeypatch.setattr(AsyncSession, "_write", write)


def _replay(address: str, out: Path, requests: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvsched.cli", "replay", "--server", address,
         "--requests", str(requests), "--rate-scale", "50", "--no-progress", "--json", str(out)],
        capture_output=True, text=True, timeout=240, cwd=REPO,
    )  # fmt: skip


def test_replay_against_a_small_worker_lists_the_request_it_cannot_hold(tmp_path: Path) -> None:
    # A worker of 4,096 blocks of 16 tokens (the sim's default before issue 37). Request
    # trace-11 of the shipped slice has an 87,169-token prompt: 5,449 blocks.
    daemon, address = start_daemon()
    small = ("--num-blocks", "4096")
    worker = spawn("w", "worker", "--server", address, "--instance", "gpu0", "--zero-cost", *small)
    try:
        worker.wait_for(r"welcomed", 60)
        refused = _replay(address, tmp_path / "r12.json", 12)
        fits = _replay(address, tmp_path / "r11.json", 11)
    finally:
        worker.stop()
        daemon.stop()

    assert refused.returncode == 1, refused.stdout + refused.stderr
    # Said before the run: which request cannot fit, and how to make room.
    assert "trace-11 (5,449 blocks)" in refused.stderr, refused.stderr
    assert "gpu0: 4,096 blocks of 16 tokens" in refused.stderr, refused.stderr
    # Listed after the table with the daemon's reason, and the exit explained.
    assert "not completed (1):" in refused.stdout, refused.stdout
    (line,) = [x for x in refused.stdout.splitlines() if x.strip().startswith("trace-11")]
    assert "87,169 prompt tokens" in line and "refused: INVALID_ARGUMENT" in line, line
    assert "needs 5449 KV blocks" in line, line
    assert "1 of 12 requests did not complete (1 refused; listed above)" in refused.stderr
    summary = json.loads((tmp_path / "r12.json").read_text())
    assert summary["block_size"] == 16 and summary["num_gpu_blocks"] == 4096
    assert (summary["requests"], summary["completed"]) == (12, 11)
    (row,) = summary["not_completed"]
    assert row["request_id"] == "trace-11" and row["outcome"] == "refused"
    assert row["prompt_tokens"] == 87169 and row["kv_blocks_needed"] == 5449
    assert "INVALID_ARGUMENT" in row["reason"] and "5449 KV blocks" in row["reason"]

    # Without that request everything completes: exit 0, nothing listed.
    assert fits.returncode == 0, fits.stdout + fits.stderr
    assert "not completed" not in fits.stdout and "cannot" not in fits.stderr
    summary = json.loads((tmp_path / "r11.json").read_text())
    assert summary["completed"] == summary["requests"] == 11
    assert summary["not_completed"] == [] and summary["block_size"] == 16


def test_a_default_sim_worker_has_its_gpu_profiles_pool_and_holds_the_trace(
    tmp_path: Path,
) -> None:
    # `kvsched worker` defaults (sim, --gpu h100): 40 GiB of Llama-3-8B KV, the pool `replay
    # --embedded` gives an H100 (5,120 blocks of 64 tokens), here in 16-token blocks: 20,480.
    daemon, address = start_daemon()
    worker = spawn("w", "worker", "--server", address, "--instance", "gpu0", "--zero-cost")
    try:
        worker.wait_for(r"welcomed", 60)
        done = _replay(address, tmp_path / "r12.json", 12)
    finally:
        worker.stop()
        daemon.stop()
    assert any("sim pool: 20480 blocks of 16 tokens (h100: 40 GiB" in x for x in worker.lines)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((tmp_path / "r12.json").read_text())
    assert summary["block_size"] == 16 and summary["num_gpu_blocks"] == 20480
    assert summary["completed"] == summary["requests"] == 12  # trace-11's 87,169 tokens too
    # The same memory in 64-token blocks is the replay's H100 pool.
    assert default_num_blocks("h100", 64) == H100_BLOCKS == 5120
    assert default_num_blocks("a100", 16) == 20480


def test_unfit_names_the_requests_the_largest_instance_cannot_hold() -> None:
    requests = load_trace(CONVERSATION_SLICE, max_requests=40)
    status = apb.GetStatusResponse(
        instances=[
            apb.InstanceStatus(instance_id="small", ready=True, num_gpu_blocks=100, block_size=16),
            apb.InstanceStatus(instance_id="big", ready=True, num_gpu_blocks=4096, block_size=16),
            apb.InstanceStatus(
                instance_id="gone", ready=False, num_gpu_blocks=10**6, block_size=16
            ),
        ]
    )
    expected = [
        (f"trace-{k}", -(-len(r.prompt_token_ids) // 16))
        for k, r in enumerate(requests)
        if len(r.prompt_token_ids) > 4096 * 16
    ]
    assert ("trace-11", 5449) in expected
    assert unfit(requests, status) == expected
    # The embedded replay's default workers (5,120 blocks of 64) hold the whole shipped slice.
    whole = load_trace(CONVERSATION_SLICE)
    big = apb.GetStatusResponse(
        instances=[apb.InstanceStatus(ready=True, num_gpu_blocks=5120, block_size=64)]
    )
    assert unfit(whole, big) == []


def test_a_burst_of_arrivals_is_built_before_its_first_send_and_every_send_is_recorded(
    monkeypatch: Any,
) -> None:
    """The Mooncake traces' arrivals come in bursts (every 3 s, up to 20 at once): the replay
    encodes a whole burst before its due time, then sends it back to back, and records when
    each submit left (`RequestRecord.sent_s`, for bench.tier_rounds' split of TTFT)."""
    events: list[str] = []
    writes: list[list[str]] = []
    real_build = runner.build_submit

    def build(prompt: Any, options: Any, client_tag: str) -> Any:
        events.append(f"build {client_tag}")
        return real_build(prompt, options, client_tag)

    def wrote(session: AsyncSession, tags: list[str]) -> None:
        events.extend(f"send {tag}" for tag in tags)
        writes.append(tags)

    monkeypatch.setattr(runner, "build_submit", build)
    _spy_on_writes(monkeypatch, wrote)
    reqs = [TraceRequest(0.0 if i < 6 else 0.5, list(range(100 + i, 400 + i)), 4) for i in range(9)]
    cluster = start_cluster(1, num_blocks=256, block_size=16)
    try:
        result = asyncio.run(runner.replay(cluster.address, reqs, progress=False))
    finally:
        cluster.stop()
    burst = [f"build trace-{i}" for i in range(6)]
    assert events[:7] == [*burst, "send trace-0"], events
    assert events.index("build trace-6") > events.index("send trace-5")
    assert all(r.completed for r in result.records)
    sent = [r.sent_s for r in result.records]
    assert all(s is not None for s in sent)
    assert all(s >= r.arrival_s for s, r in zip(sent, result.records, strict=True))  # type: ignore[operator]
    assert sent == sorted(sent)  # type: ignore[type-var]
    # Each burst in one message (SessionRequest.batch): the daemon reads it at once.
    assert writes == [[f"trace-{i}" for i in range(6)], [f"trace-{i}" for i in range(6, 9)]]
    assert sent[:6] == [sent[0]] * 6 and sent[6:] == [sent[6]] * 3


def test_a_worker_that_never_joins_leaves_no_process_behind(monkeypatch: Any) -> None:
    """`replay --embedded`'s start: when a sim worker never joins (here it exits at once on an
    unknown --gpu), start_cluster raises saying why and stops the daemon and the workers it had
    started (before, they ran on with nobody to stop them)."""
    from kvsched.replay import launch

    started: list[Any] = []
    real_spawn = launch.spawn

    def spawn_and_keep(name: str, *args: str) -> Any:
        child = real_spawn(name, *args)
        started.append(child)
        return child

    monkeypatch.setattr(launch, "spawn", spawn_and_keep)
    try:
        start_cluster(2, gpu="no-such-gpu", num_blocks=64, block_size=16)
    except RuntimeError as exc:
        assert "w0: no line matching 'welcomed'" in str(exc)
    else:
        raise AssertionError("start_cluster joined a worker that cannot start")
    assert [c.name for c in started] == ["daemon", "w0", "w1"]
    assert all(c.popen.poll() is not None for c in started), [c.name for c in started]


def test_requests_spread_over_the_streams_and_all_complete(monkeypatch: Any) -> None:
    """`streams=3`: three Sessions to the one daemon, request i written on stream i mod 3 (a
    burst reaches the daemon on three streams at once), every request completes and is read
    back on its own stream; fewer than one stream is refused before anything starts. The
    requests due together on one stream go in one message."""
    wrote: list[tuple[int, list[str]]] = []
    _spy_on_writes(monkeypatch, lambda session, tags: wrote.append((id(session), tags)))
    reqs = [TraceRequest(0.0 if i < 5 else 0.2, list(range(50 + i, 250 + i)), 3) for i in range(7)]
    cluster = start_cluster(1, num_blocks=256, block_size=16)
    try:
        result = asyncio.run(runner.replay(cluster.address, reqs, progress=False, streams=3))
    finally:
        cluster.stop()
    # The burst of 5 at 0: trace-0 and 3 on stream 0 in one message, 1 and 4 on stream 1,
    # 2 alone on stream 2; then 5 (stream 2) and 6 (stream 0), due together at 0.2.
    tags = [[int(t.removeprefix("trace-")) for t in ts] for _, ts in wrote]
    assert tags == [[0, 3], [1, 4], [2], [5], [6]], tags
    streams = [s for s, _ in wrote]
    assert len(set(streams)) == 3
    assert streams[3] == streams[2] and streams[4] == streams[0], streams
    assert all(r.completed and len(r.token_times_s) == 3 for r in result.records)
    try:
        asyncio.run(runner.replay(cluster.address, reqs, progress=False, streams=0))
    except ValueError as exc:
        assert "streams = 0" in str(exc)
    else:
        raise AssertionError("streams=0 was accepted")
