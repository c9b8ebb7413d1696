"""Requests the daemon refused or quarantined, made observable: counters
(`kvsched_requests_refused_total{reason}`, `kvsched_requests_quarantined_total`), one INFO log
line per refusal with the request id and the reason, and (with tracing on) a span with error
status (`tracing.Tracing.request_refused`).

`reason` is a short label: the gRPC status the refusal got, in lower case (invalid_argument,
not_found, resource_exhausted, unavailable, ...), `journal_unavailable` when the request journal
could not store it, or `draining` while the daemon shuts down.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics_core import Metric

log = logging.getLogger("kvsched.daemon")


class Refusals:
    def __init__(self) -> None:
        self.refused: dict[str, int] = {}
        self.quarantined = 0

    def count(self, request_id: str, reason: str, message: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1
        log.info("request %s refused (%s): %s", request_id or "-", reason, message)

    def families(self, model: str) -> Iterator[Metric]:
        refused = CounterMetricFamily(
            "kvsched_requests_refused",
            "Requests refused at submission, by reason (the gRPC status, lower case, or draining).",
            labels=["reason", "model"],
        )
        for reason, n in sorted(self.refused.items()):
            refused.add_metric([reason, model], n)
        yield refused
        quarantined = CounterMetricFamily(
            "kvsched_requests_quarantined",
            "Requests ended as poison: on lost instances poison_max_losses times.",
            labels=["model"],
        )
        quarantined.add_metric([model], self.quarantined)
        yield quarantined
