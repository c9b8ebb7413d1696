"""`Observers`: who the request table tells of each request's lifecycle (server/requests/record.py's
`Lifecycle`: accepted, moved, progressed, finished), in the order they subscribed: telemetry
first, then the journal glue and a cluster's forwarder (`observe`). It is a `Lifecycle` itself:
the table tells it once per event and it tells each observer, synchronously."""

from __future__ import annotations

from collections.abc import Mapping

from kvsched.server.requests.record import Lifecycle, Tracked


class Observers:
    """The subscribed observers (owns the list; each observer once)."""

    def __init__(self, first: Lifecycle) -> None:
        self._observers: list[Lifecycle] = [first]

    def observe(self, observer: Lifecycle) -> None:
        """Tell `observer` of every request's lifecycle from now on."""
        if observer not in self._observers:
            self._observers.append(observer)

    def unobserve(self, observer: Lifecycle) -> None:
        if observer in self._observers:
            self._observers.remove(observer)

    def request_accepted(self, tr: Tracked, carrier: Mapping[str, str], /) -> None:
        for obs in self._observers:
            obs.request_accepted(tr, carrier)

    def request_moved(self, tr: Tracked, reason: str, /) -> None:
        for obs in self._observers:
            obs.request_moved(tr, reason)

    def request_progressed(self, tr: Tracked, /) -> None:
        for obs in self._observers:
            obs.request_progressed(tr)

    def request_finished(self, tr: Tracked, /) -> None:
        for obs in self._observers:
            obs.request_finished(tr)
