"""One daemon cut off from NATS (its workers and clients still reach it) for 4x the membership
TTL, then healed (issue 23's first scenario, TTL 2 s / 8 s cut): real nats-server, two
`kvsched serve` (pt-d0 reaches NATS only through a TCP proxy the test owns), two sim workers that
know both daemons, resumable clients that resume through either daemon.

- pt-d0 fences itself before its TTL runs out (no new work; its journaled requests parked and
  their streams cut); pt-d1 takes pt0's lease and adopts pt-d0's requests once its entry expires;
- after the heal pt-d0 hands pt0's worker to pt-d1 (the lease's owner) and drops the adopted
  requests: ownership converges (each instance attached exactly where its lease is) and stays so;
- 0 of 20 requests sent to pt-d0 from heal + 2 s are refused;
- every request ends once with exactly the sim's tokens, no KV block held at the end, and the
  server's JetStream consumers are as many as before the cut (+1).

The figures (convergence time after the heal, the streams' stall) are printed, not asserted."""

from __future__ import annotations

import asyncio
import re
import time

import pytest

from kvsched.client import Client, Unavailable
from tests.cluster.durability_kit import (
    Daemon,
    pool_free,
    prompts,
    quantiles,
    sim_expected,
    start_sim_worker,
)
from tests.cluster.heal_kit import Load, MonitoredNats, converged, lease_owners
from tests.cluster.tcp_proxy import TcpProxy
from tests.integration.harness import Proc, wait_ready

pytestmark = pytest.mark.faults  # a fault scenario: `make test-faults` (a CI step)

TTL_S = 2.0
CUT_S = 8.0
ENV = {
    "KVSCHED_MEMBER_TTL_S": str(TTL_S),
    "KVSCHED_HEARTBEAT_INTERVAL_S": "0.5",
    "KVSCHED_HEARTBEAT_TIMEOUT_S": "3",
}
IIDS = ["pt0", "pt1"]


@pytest.mark.slow
def test_cut_off_daemon_heals_converges_and_serves() -> None:
    nats = MonitoredNats().start()
    proxy = TcpProxy("127.0.0.1", nats.port).start()
    d0 = Daemon(proxy.url, "pt-d0", env=ENV).start()
    d1 = Daemon(nats.url, "pt-d1", env=ENV).start()
    addresses = {"pt-d0": d0.address, "pt-d1": d1.address}
    workers: list[Proc] = []
    try:
        w_args = ("--speed", "0.3", "--reconnect-max-s", "0.5")
        workers.append(start_sim_worker(f"{d0.address},{d1.address}", "pt0", *w_args))
        workers.append(start_sim_worker(f"{d1.address},{d0.address}", "pt1", *w_args))
        wait_ready(d0.address, ["pt0"], 60.0)
        wait_ready(d1.address, ["pt1"], 60.0)
        requests = [(f"pt-{i}", p, 400, i % 2) for i, p in enumerate(prompts(12, seed=41))]
        base_consumers = nats.consumers()
        figures: dict[str, float] = {}

        async def run() -> tuple[Load, list[BaseException], list[str]]:
            load = Load()
            await load.start([d0.address, d1.address], requests)
            await load.wait_tokens(5)
            proxy.cut()
            await asyncio.sleep(CUT_S)
            proxy.heal()
            healed = time.monotonic()
            # Ownership converges: every instance attached exactly where its lease is.
            while not await asyncio.to_thread(converged, nats.url, addresses, IIDS):
                assert time.monotonic() - healed < 60, "ownership never converged"
                await asyncio.sleep(0.1)
            figures["converged_s"] = time.monotonic() - healed
            # From heal + 2 s, pt-d0 accepts what is sent to it (forwarded to pt-d1's instances
            # or placed on its own).
            await asyncio.sleep(max(0.0, healed + 2.0 - time.monotonic()))
            refused = await asyncio.to_thread(_send_after_heal, d0.address, 20)
            errors = await load.finish(180)
            return load, errors, refused

        load, errors, refused = asyncio.run(asyncio.wait_for(run(), 300))
        assert not errors, errors
        for (rid, p, n, _), s in zip(requests, load.streams, strict=True):
            assert s.tokens == sim_expected(rid, len(p), n), rid
        assert refused == [], refused
        # pt-d0 fenced itself during the cut and dropped what pt-d1 adopted after the heal.
        assert d0.proc is not None and d1.proc is not None
        fenced = d0.proc.wait_for(
            r"self-fenced: its membership was not refreshed.* (\d+) request\(s\) parked", timeout=5
        )
        m = d0.proc.wait_for(
            r"unfenced after [\d.]+ s: \d+ parked request\(s\) continue here, "
            r"(\d+) adopted elsewhere",
            timeout=5,
        )
        # Every request parked at pt-d0 was adopted by pt-d1 during the cut, and none of them
        # is continued by pt-d0 after the heal.
        assert int(m.group(1)) == int(fenced.group(1)) > 0, (m.group(0), fenced.group(0))
        d1.proc.wait_for(r"kvsched took over \d+ request\(s\) of daemon pt-d0", timeout=5)
        # Converged and staying so: pt0's lease and worker at pt-d1, nothing attached at pt-d0.
        time.sleep(3 * TTL_S)
        assert converged(nats.url, addresses, IIDS)
        owners = asyncio.run(lease_owners(nats.url, IIDS))
        assert owners == {"pt0": "pt-d1", "pt1": "pt-d1"}, owners
        assert len(re.findall(r"attached here but leased to", d0.output())) <= 1
        for d in (d0, d1):
            pool_free(d.address)
        end_consumers = nats.consumers()
        stalls = [t for s in load.streams for t in s.first_token_after_break]
        p50, p99 = quantiles(stalls) if stalls else (0.0, 0.0)
        print(
            f"\nTTL {TTL_S:g} s, cut {CUT_S:g} s: converged {figures['converged_s']:.2f} s after "
            f"the heal; refused after heal+2 s: {len(refused)}/20; adopted then dropped at "
            f"pt-d0: {m.group(1)}; stall p50/p99 {p50:.2f}/{p99:.2f} s over {len(stalls)} "
            f"breaks; consumers {base_consumers} -> {end_consumers}"
        )
        assert end_consumers <= base_consumers + 1, (base_consumers, end_consumers)
    except BaseException:
        for d in (d0, d1):  # what the daemons said, for the failure's report
            print(f"---- {d.daemon_id}\n" + "\n".join(d.output().splitlines()[-80:]))
        raise
    finally:
        for p in reversed(workers):
            p.stop()
        d0.stop()
        d1.stop()
        proxy.close()
        nats.close()


def _send_after_heal(address: str, n: int) -> list[str]:
    """Send n short requests to `address`; the refusals' messages."""
    refused = []
    with Client(address) as client:
        for i in range(n):
            prompt = list(range(5, 30 + i))
            try:
                got = client.generate(prompt, request_id=f"pt-after-{i}", max_tokens=4)
                assert got.tokens() == sim_expected(f"pt-after-{i}", len(prompt), 4)
            except Unavailable as exc:
                refused.append(str(exc))
    return refused
