"""Statistics for comparing the KV tiers' TTFT between the simulator and `kvsched replay`
(issue 37): what a TTFT p50 alone hides, and a per-request split that conditions on neither
side alone.

- `iqm`: the interquartile mean (the mean of the middle half). The Mooncake traces' arrivals
  come in bursts every 3 s and the daemon's steps are time-budgeted (100 ms while requests
  decode), so the sim's TTFTs sit on a lattice of ~100 ms (most requests wait a whole number
  of budgeted steps). A p50 that falls between two lattice points jumps by up to a step when
  a few requests move; the IQM moves by what they move.
- `by_tier_hit`: replay minus sim per request, in four groups by where each run found a host
  or storage hit (both, sim only, replay only, neither). Grouping by the sim's hits alone
  selects the requests whose sim run went well: the two runs place requests on different
  instances (their timings differ), so each run has tier hits the other has not, and a
  request that hit only in the sim loses its whole recompute in the replay, while one that hit
  only in the replay gains it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

GROUPS = ("both", "sim only", "replay only", "neither")


def iqm(xs: Sequence[float | None]) -> float | None:
    """Mean of the middle half of xs (Nones left out): the lower and upper quarters dropped."""
    v = sorted(x for x in xs if x is not None)
    if not v:
        return None
    n = len(v)
    mid = v[n // 4 : n - n // 4] or v
    return statistics.fmean(mid)


def _tier(row: dict[str, Any]) -> bool:
    return bool(row.get("host") or row.get("storage"))


def by_tier_hit(sim: list[dict[str, Any]], rep: list[dict[str, Any]]) -> dict[str, Any]:
    """Per group (GROUPS): requests, and replay minus sim per request (mean and median, s) of
    the TTFT, the send delay, the queue time and the service time (placement to first token,
    the daemon's). A request missing a TTFT on either side is left out."""
    parts: dict[str, dict[str, list[float]]] = {
        g: {k: [] for k in ("total", "send", "queue", "service")} for g in GROUPS
    }
    for s, r in zip(sim, rep, strict=True):
        if s.get("ttft_s") is None or r.get("ttft_s") is None:
            continue
        hs, hr = _tier(s), _tier(r)
        g = GROUPS[0] if hs and hr else GROUPS[1] if hs else GROUPS[2] if hr else GROUPS[3]
        p = parts[g]
        p["total"].append(r["ttft_s"] - s["ttft_s"])
        send = r.get("send_s")
        if send is not None and send == send:  # not NaN
            p["send"].append(send)
        if r.get("queue_s") is not None and s.get("queue_s") is not None:
            p["queue"].append(r["queue_s"] - s["queue_s"])
            if r.get("daemon_ttft_s") is not None:
                p["service"].append(
                    (r["daemon_ttft_s"] - r["queue_s"]) - (s["ttft_s"] - s["queue_s"])
                )
    out: dict[str, Any] = {}
    for g, p in parts.items():
        out[g] = {"requests": len(p["total"])}
        for k, xs in p.items():
            out[g][k] = {
                "mean": statistics.fmean(xs) if xs else None,
                "p50": statistics.median(xs) if xs else None,
            }
    return out


def gain(x: float | None, base: float | None) -> float | None:
    """x / base - 1, None when either is missing."""
    return None if x is None or not base else x / base - 1
