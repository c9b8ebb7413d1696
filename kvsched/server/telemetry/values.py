"""What telemetry is told: plain values the engines, the registry and the cluster hand it.
Nothing in the telemetry package calls into an engine or the composition root; it reads these.

- `StepStats`: one engine step (a report applied, or a schedule() call), handed to the hooks.
- `InstanceInfo`: what a step's hooks know of the instance (made anew when its scheduler is).
- `InstanceFacts`: an instance's published figures at scrape time (the registry builds them).
- `ClusterFacts`: a cluster daemon's id, NATS URL and routing counters, at scrape time.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple


class StepStats(NamedTuple):
    instance_id: str
    epoch: int  # the instance's scheduler (changes when it is replaced; 0: none)
    generation_tokens: int  # output tokens that scheduler accepted so far
    batch: int = 0  # rows of the report applied (0: a schedule() call)
    seconds: float = 0.0  # the schedule() call's duration (0.0: a report)


class InstanceInfo(NamedTuple):
    instance_id: str
    role: Any  # core.config.Role
    tenant_weights: Mapping[str, float]  # its configured tenants (others are "other")


class InstanceFacts(NamedTuple):
    ready: bool
    accepting: bool
    epoch: int
    generation_tokens: int
    snapshot: Any  # core SchedulerSnapshot, None while the instance is not up
    counters: Mapping[str, int]  # SNAPSHOT_COUNTERS over every scheduler it has had
    served: Mapping[str, int]  # tokens served per tenant, over every scheduler
    shed: Mapping[str, int]  # requests shed or demoted per tenant
    tenant_weights: Mapping[str, float]
    model: str = ""  # as its workers announced it (Hello.model); "" before they did
    lora: Any = None  # core LoraState (adapters running / waiting, max_loras); None: not up


class ClusterFacts(NamedTuple):
    daemon_id: str
    url: str
    status: Any  # v1 ClusterStatus: num_routed_local, num_forwarded, num_event_gaps
