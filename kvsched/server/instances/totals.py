"""An instance's totals over every scheduler it has had: a scheduler replaced when its workers
reconnect starts its counters at zero, so the engine retires the old one's final numbers here
and reports the sum (monotonic counters for metrics, tenants' served tokens and sheds).

Reads snapshots and tenant counts the engine hands in; never a scheduler. Imported by
`engine` only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvsched.core.scheduler import SNAPSHOT_COUNTERS


class RetiredTotals:
    """The final counters of the schedulers an instance's engine has taken out."""

    def __init__(self) -> None:
        self._counters = dict.fromkeys(SNAPSHOT_COUNTERS, 0)
        self._served: dict[str, int] = {}
        self._shed: dict[str, int] = {}

    def retire(self, snap: Any, served: Mapping[str, int], shed: Mapping[str, int]) -> None:
        """Keep a scheduler's last snapshot counters and its tenants' served / shed counts."""
        for name in SNAPSHOT_COUNTERS:
            self._counters[name] += getattr(snap, name)
        _add_counts(self._served, served)
        _add_counts(self._shed, shed)

    def counters(self, snap: Any | None) -> dict[str, int]:
        """SNAPSHOT_COUNTERS totalled over the retired schedulers and `snap` (the live one's,
        None: none)."""
        out = dict(self._counters)
        for name in SNAPSHOT_COUNTERS if snap is not None else ():
            out[name] += getattr(snap, name)
        return out

    def tenant_counts(self, tenants: Any | None) -> tuple[dict[str, int], dict[str, int]]:
        """Tokens served and requests shed per tenant over the retired schedulers and the live
        one's `tenants` (kvsched.core.fairness.TenantCounters; None: none)."""
        served, shed = dict(self._served), dict(self._shed)
        if tenants is not None:
            _add_counts(served, tenants.served)
            _add_counts(shed, tenants.shed)
        return served, shed


def _add_counts(into: dict[str, int], counts: Mapping[str, int]) -> None:
    for k, n in counts.items():
        into[k] = into.get(k, 0) + n
