"""The nemesis's seeded schedule: which fault, on what, when, for how long.

Faults come one after another (a quiet gap between two, long enough to see the cluster
converge: at least 2 x TTL), drawn from one `random.Random(seed)`, so a seed names a run.

Kinds (`target`: a daemon index, a worker index, or -1 for NATS):
- `part_nats`     daemon K cut from NATS (its workers and clients still reach it)
- `part_workers`  daemon K cut from every worker (workers leave it, or hang on it)
- `part_peers`    daemon K unreachable at its advertised address (peers' forwards and Resumes
                  relayed to it, their death probes, workers redirected to it)
- `pause`         SIGSTOP daemon K, SIGCONT after `duration_s`
- `kill_daemon`   kill -9 daemon K, restart it (same id, port) after `duration_s`
- `kill_worker`   kill -9 worker W, restart it after `duration_s`
- `kill_nats`     kill -9 the nats-server, restart it (same port, same store) after `duration_s`

Partitions and pauses are "short" (below the TTL: must never cause a takeover) or "long"
(1.5-4 x TTL: the others take over).
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

KINDS = (
    "part_nats",
    "part_workers",
    "part_peers",
    "pause",
    "kill_daemon",
    "kill_worker",
    "kill_nats",
)
WEIGHTS = {
    "part_nats": 3,
    "part_workers": 2,
    "part_peers": 2,
    "pause": 3,
    "kill_daemon": 2,
    "kill_worker": 2,
    "kill_nats": 1,
}


@dataclass(frozen=True)
class Fault:
    id: int
    kind: str
    target: int
    at_s: float  # from the start of the load
    duration_s: float  # cut / paused / down for this long
    long: bool  # longer than the TTL

    def label(self) -> str:
        return f"{self.kind}{'(long)' if self.long else ''}@{self.target}"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def make_schedule(
    seed: int,
    duration_s: float,
    ttl_s: float,
    num_daemons: int = 3,
    num_workers: int = 6,
    kinds: tuple[str, ...] = KINDS,
    warmup_s: float = 3.0,
    gap_ttl: tuple[float, float] = (2.0, 4.0),
) -> list[Fault]:
    """Faults that start within `duration_s` (each ends, and the cluster has a gap of
    gap_ttl x TTL to converge, before the next one starts)."""
    rng = random.Random(seed)
    names = [k for k in KINDS if k in kinds]
    weights = [WEIGHTS[k] for k in names]
    out: list[Fault] = []
    t = warmup_s
    while t < duration_s:
        kind = rng.choices(names, weights)[0]
        target = -1 if kind == "kill_nats" else rng.randrange(num_daemons)
        if kind == "kill_worker":
            target = rng.randrange(num_workers)
        if kind.startswith("kill"):
            dur, long = rng.uniform(0.0, 2.0), False
            if kind == "kill_nats":
                dur = rng.uniform(0.5, 3.0)
        else:
            long = rng.random() < 0.5
            dur = ttl_s * (rng.uniform(1.5, 4.0) if long else rng.uniform(0.2, 0.6))
        out.append(Fault(len(out), kind, target, round(t, 3), round(dur, 3), long))
        t += dur + ttl_s * rng.uniform(*gap_ttl)
    return out


def counts(faults: list[Fault]) -> dict[str, int]:
    c = Counter(f.kind + ("_long" if f.long else "") for f in faults)
    return dict(sorted(c.items()))
