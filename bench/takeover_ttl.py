"""kill -9 of one of three daemons with the default membership TTL (6 s): the stalled streams'
kill -> next token p50/p99. Runs the issue-16 takeover scenario of
tests/cluster/test_takeover.py (3 daemons on a real nats-server, 6 sim workers, 60 resumable
streams, every one checked exact) with `member_ttl_s` 6 s instead of the test's 2 s.

    PYTHONPATH=. python -m bench.takeover_ttl [--stall-s 0.25] [--ttl-s 6]

--stall-s: a stream counts as stalled by the kill when it then waited at least this long for a
token (the test uses 1 s; with fast death detection most gaps are shorter than that).
"""

from __future__ import annotations

import argparse

from kvsched.cluster.natsd import NatsServer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stall-s", type=float, default=0.25)
    ap.add_argument("--ttl-s", type=float, default=6.0)
    args = ap.parse_args()
    import tests.cluster.test_takeover as scenario

    scenario.TTL_S = args.ttl_s
    scenario.STALL_S = args.stall_s
    with NatsServer() as server:
        scenario.test_kill9_of_one_of_three_daemons_is_taken_over_and_loses_nothing(server)


if __name__ == "__main__":
    main()
