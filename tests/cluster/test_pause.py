"""A daemon paused (SIGSTOP) for longer than its membership TTL, then continued (issue 23's
second scenario, its figures: 15 s with the default TTL 6 s): real nats-server,
two `kvsched serve`, two sim workers that know both daemons, resumable clients.

- the paused daemon's worker leaves it (silence bound), its peer takes the lease once the paused
  daemon's entry expired and adopts its requests; the clients' streams resume there;
- after SIGCONT the paused daemon fences itself at once (its loop stood still past the margin),
  drops the requests adopted elsewhere and keeps no instance: ownership converges;
- nothing is driven twice after convergence: the continued daemon holds no request and no
  instance, while every stream ends once with exactly the sim's tokens and no KV block is held;
- streams whose client talks to the paused daemon itself ("direct") move while it is still
  stopped: the resumable client's keepalive breaks the silent stream and its attempts are
  bounded (`attempt_timeout_s`), so it resumes through the live daemon once that one adopted
  the request. Streams a peer forwarded to the paused daemon's instance move too.

The streams' stall (pause -> next token, direct and forwarded apart) and the convergence time
are printed, not asserted."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from tests.cluster.durability_kit import (
    Daemon,
    pool_free,
    prompts,
    quantiles,
    sim_expected,
    start_sim_worker,
)
from tests.cluster.heal_kit import Load, MonitoredNats, converged, lease_owners
from tests.integration.harness import Proc, status, wait_ready

pytestmark = pytest.mark.faults  # a fault scenario: `make test-faults` (a CI step)

TTL_S = 6.0
PAUSE_S = 15.0
ENV = {
    "KVSCHED_MEMBER_TTL_S": str(TTL_S),
    "KVSCHED_HEARTBEAT_INTERVAL_S": "0.5",
    "KVSCHED_HEARTBEAT_TIMEOUT_S": "3",
    "KVSCHED_SILENCE_TIMEOUT_INTERVALS": "4",  # workers leave after 2 s of silence
}
IIDS = ["pz0", "pz1"]


@pytest.mark.slow
def test_paused_daemon_streams_move_and_ownership_converges() -> None:
    nats = MonitoredNats().start()
    d0 = Daemon(nats.url, "pz-d0", env=ENV).start()
    d1 = Daemon(nats.url, "pz-d1", env=ENV).start()
    addresses = {"pz-d0": d0.address, "pz-d1": d1.address}
    workers: list[Proc] = []
    try:
        w_args = ("--speed", "0.3", "--reconnect-max-s", "0.5")
        workers.append(start_sim_worker(f"{d0.address},{d1.address}", "pz0", *w_args))
        workers.append(start_sim_worker(f"{d1.address},{d0.address}", "pz1", *w_args))
        wait_ready(d0.address, ["pz0"], 60.0)
        wait_ready(d1.address, ["pz1"], 60.0)
        requests = [(f"pz-{i}", p, 600, i % 2) for i, p in enumerate(prompts(12, seed=43))]
        base_consumers = nats.consumers()
        figures: dict[str, float] = {}
        ids: dict[str, list[int]] = {}  # the streams on d0's instance; those moved meanwhile
        assert d0.proc is not None and d1.proc is not None

        async def run() -> tuple[Load, list[BaseException]]:
            load = Load()
            await load.start([d0.address, d1.address], requests)
            await load.wait_tokens(5)
            on_d0 = [i for i, s in enumerate(load.streams) if s.instance == "pz0"]
            d0.proc.signal(signal.SIGSTOP)
            paused = time.monotonic()
            figures["paused_at"] = paused
            try:
                await asyncio.sleep(PAUSE_S)
            finally:
                d0.proc.signal(signal.SIGCONT)
            # The streams that got a token while d0 was still stopped (no await since SIGCONT).
            moved_during = [i for i in on_d0 if load.stalls_after(paused, [i])]
            ids["moved_during"] = moved_during
            for i in on_d0:  # where each stream stood at SIGCONT (the figures' context)
                s = load.streams[i]
                print(
                    f"{s.request_id}: breaks {[round(b - paused, 2) for b in s.broken_at]}, "
                    f"{s.attempts} attempts, {s.unanswered} unanswered, last {s.last_error!r}"
                )
            moved = load.stalls_after(paused, on_d0)  # a token after the pause began
            figures["moved"] = float(sum(1 for t in moved if t < PAUSE_S))
            figures["on_d0"] = float(len(on_d0))
            ids["on_d0"] = on_d0
            resumed = time.monotonic()
            while not await asyncio.to_thread(converged, nats.url, addresses, IIDS):
                assert time.monotonic() - resumed < 60, "ownership never converged"
                await asyncio.sleep(0.1)
            figures["converged_s"] = time.monotonic() - resumed
            errors = await load.finish(180)
            return load, errors

        load, errors = asyncio.run(asyncio.wait_for(run(), 300))
        assert not errors, errors
        for (rid, p, n, _), s in zip(requests, load.streams, strict=True):
            assert s.tokens == sim_expected(rid, len(p), n), rid
        # Converged, and the continued daemon drives nothing: no instance, no request.
        time.sleep(3 * TTL_S)
        assert converged(nats.url, addresses, IIDS)
        assert asyncio.run(lease_owners(nats.url, IIDS)) == {"pz0": "pz-d1", "pz1": "pz-d1"}
        st = status(d0.address)
        assert not [i.instance_id for i in st.instances if i.ready]
        assert sum(i.num_running + i.num_waiting for i in st.instances) == 0
        d0.proc.wait_for(r"self-fenced: (this daemon stood still|its membership)", timeout=5)
        # After SIGCONT nothing it held is continued there: all of it was adopted meanwhile.
        m = d0.proc.wait_for(
            r"unfenced after [\d.]+ s: (\d+) parked request\(s\) continue here, (\d+) adopted",
            timeout=5,
        )
        assert int(m.group(1)) == 0, m.group(0)
        d1.proc.wait_for(r"kvsched took over \d+ request\(s\) of daemon pz-d0", timeout=5)
        for d in (d0, d1):
            pool_free(d.address)
        # pause -> the next token of each stream on the paused daemon's instance
        on_d0 = ids["on_d0"]
        stalls = load.stalls_after(figures["paused_at"], on_d0)
        assert len(stalls) == len(on_d0)
        # Direct streams (submitted through d0: its client talked to the paused daemon) and
        # forwarded ones (submitted through d1, placed on d0's instance) both moved while d0
        # was stopped: none waited for SIGCONT.
        direct = [i for i in on_d0 if requests[i][3] == 0]
        forwarded = [i for i in on_d0 if requests[i][3] == 1]
        assert direct, "no stream of the paused daemon's own clients ran on its instance"
        waited = sorted(set(on_d0) - set(ids["moved_during"]))
        assert not waited, f"streams that waited for SIGCONT: {waited}"
        end_consumers = nats.consumers()
        parts = []
        for name, idx in (("direct", direct), ("forwarded", forwarded)):
            st_ = load.stalls_after(figures["paused_at"], idx)
            q50, q99 = quantiles(st_) if st_ else (0.0, 0.0)
            unanswered = sum(load.streams[i].unanswered for i in idx)
            parts.append(
                f"{name} {len(idx)}: pause -> next token p50/p99 {q50:.2f}/{q99:.2f} s "
                f"(each {sorted(round(t, 2) for t in st_)}; {unanswered} attempts unanswered)"
            )
        p50, p99 = quantiles(stalls) if stalls else (0.0, 0.0)
        print(
            f"\nTTL {TTL_S:g} s, pause {PAUSE_S:g} s: {figures['moved']:.0f} of "
            f"{figures['on_d0']:.0f} streams on the paused daemon's instance moved during the "
            f"pause; all: p50/p99 {p50:.2f}/{p99:.2f} s; {'; '.join(parts)}; converged "
            f"{figures['converged_s']:.2f} s after SIGCONT; consumers {base_consumers} -> "
            f"{end_consumers}"
        )
    except BaseException:
        for d in (d0, d1):
            print(f"---- {d.daemon_id}\n" + "\n".join(d.output().splitlines()[-80:]))
        raise
    finally:
        for w in reversed(workers):
            w.stop()
        d0.stop()
        d1.stop()
        nats.close()
