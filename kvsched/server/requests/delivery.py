"""Token deltas to the requests' sinks (`TokenDelivery`), for one instance's engine."""

from __future__ import annotations

from typing import Any


class TokenDelivery:
    """Hands token deltas (core `Events.tokens`, in order) to the requests' sinks: a columnar
    delta goes to its sink as one call (to each sink, when several share it).

    A columnar delta names its requests by the core's snapshot of the slot table, which stays
    the same object until a slot changes hands; rows come in the worker's slot order, usually
    the same from step to step. So the requests, their sinks and the grouping by sink are
    looked up once and kept while the snapshot and the slot column stay the same (the rounds
    of a merged report, and step after step in a steady batch): the same `trs` list then
    reaches the sink, which a Session recognises when it joins deltas."""

    __slots__ = ("_a", "_groups", "_keep", "_slots", "_trs")

    def __init__(self) -> None:
        self._a: Any = None  # the snapshot of the last lookup
        self._slots = b""  # its slot column, as bytes
        self._trs: list[Any] = []
        self._keep: list[int] | None = None  # rows of tracked requests (None: all)
        # One sink: None. Several: (sink, its rows, their Tracked) each.
        self._groups: list[tuple[Any, list[int], list[Any]]] | None = None

    def __call__(self, deltas: list[Any]) -> None:
        for a, slots, toks in deltas:
            if slots is None:  # one request's row
                tr = a.tag
                if tr is not None:
                    tr.sink.add_tokens([tr], [len(toks)], toks)
                continue
            key = slots.tobytes()
            if a is not self._a or key != self._slots:
                self._lookup(a, slots, key)
            trs = self._trs
            if not trs:
                continue
            groups = self._groups
            if groups is None and not trs[0].sink.wants_tokens:
                trs[0].sink.add_tokens(trs, None, [])  # news only: no list of the tokens
                continue
            values = toks.tolist()
            keep = self._keep
            if keep is not None:
                values = [values[i] for i in keep]
            if groups is None:
                trs[0].sink.add_tokens(trs, None, values)
                continue
            for sink, rows, g_trs in groups:
                sink.add_tokens(g_trs, None, [values[i] for i in rows])

    def _lookup(self, a: Any, slots: Any, key: bytes) -> None:
        self._a, self._slots = a, key
        trs = [r.tag for r in map(a.__getitem__, slots.tolist())]
        keep = None
        if None in trs:  # requests the daemon does not track (no tag)
            keep = [i for i, tr in enumerate(trs) if tr is not None]
            trs = [trs[i] for i in keep]
        self._trs, self._keep = trs, keep
        sinks = [tr.sink for tr in trs]
        if not sinks or sinks.count(sinks[0]) == len(sinks):
            self._groups = None
            return
        by_sink: dict[Any, tuple[list[int], list[Any]]] = {}
        for i, (sink, tr) in enumerate(zip(sinks, trs, strict=True)):
            g = by_sink.get(sink)
            if g is None:
                by_sink[sink] = ([i], [tr])
            else:
                g[0].append(i)
                g[1].append(tr)
        self._groups = [(sink, rows, g_trs) for sink, (rows, g_trs) in by_sink.items()]
