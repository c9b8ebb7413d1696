"""The run's history: one JSON object per line, `t` in seconds from the start of the run.

Events (`ev`):
- `config`        seed, ttl_s, duration_s, the schedule, instances, daemons
- `submit`        rid, via (daemon index), prompt_len, max_tokens
- `refused`       rid, daemon, call (generate / resume), code, msg: a call the daemon refused
- `accepted`      rid, instance: the stream was opened (the request is accepted)
- `tokens`        rid, toks: a batch of output tokens, as the client received it
- `finish`        rid, reason, output_tokens, resumes
- `lost`          rid, error: the client gave up (the request never finished)
- `fault_start`   id, kind, target, duration_s, long
- `fault_end`     id (healed; a killed process restarted and listening)
- `obs`           leases {instance: daemon | null}, attached {instance: [daemon, ...]},
                  unknown [daemon, ...] (no status answer), nats (leases read)
- `consumers`     n (JetStream consumers on the server, /jsz), connections
- `gen_tokens`    daemon, life, v (its kvsched_generation_tokens counter, this life)
- `final_heal`    every fault over and every process up
- `final`         blocks_held {daemon: {instance: held}}, worker_tokens, settled consumers
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any


class History:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(path, "w")  # noqa: SIM115 - open for the whole run, closed by close()
        self._lock = threading.Lock()
        self.t0 = time.monotonic()
        self._last_flush = 0.0

    def now(self) -> float:
        return time.monotonic() - self.t0

    def add(self, ev: str, **fields: Any) -> None:
        t = self.now()
        line = json.dumps({"t": round(t, 4), "ev": ev, **fields}, separators=(",", ":"))
        with self._lock:
            self._f.write(line + "\n")
            if t - self._last_flush > 1.0:
                self._f.flush()
                self._last_flush = t

    def close(self) -> None:
        with self._lock:
            self._f.close()


def load(path: Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
