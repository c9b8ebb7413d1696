"""bench.chaos: a nemesis suite in the Jepsen style (issue 23, DESIGN.md section 13).

    python -m bench.chaos --seed N --duration S [--ttl-s 3] [--rate 2] [--kinds a,b,...]

A real nats-server (JetStream, monitoring port), 3 `kvsched serve --cluster` daemons and 6
`kvsched worker --executor sim` workers that know every daemon, all on loopback; clients whose
requests resume through any daemon. Every daemon-NATS, daemon-worker and daemon-daemon link
goes through a TCP proxy the harness owns (proxy.py), so a partition is a cut proxy. A seeded
schedule (schedule.py) of partitions, SIGSTOP/SIGCONT pauses shorter and longer than the TTL,
and kill -9 of daemons, workers and NATS with restarts runs against the load (nemesis.py);
everything is recorded in a JSONL history (history.py) and checked afterwards (checker.py).

Modules: proxy (links), procs (processes), schedule, history, load (clients), observe (leases,
attachment, consumers, token counters), nemesis, checker, main.
"""
