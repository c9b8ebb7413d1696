"""Test helper: a core StepReport with every column as a plain list of ints (the daemon's
conversion gives numpy arrays, which do not compare with `==` as lists do)."""

from __future__ import annotations

import dataclasses

from kvsched.core.protocol import StepReport


def listed(report: StepReport) -> StepReport:
    cols = {
        f.name: [int(v) for v in getattr(report, f.name)]
        for f in dataclasses.fields(report)
        if f.name not in ("step", "applied_seq", "step_time_ns", "logprobs", "prompt_logprobs")
    }
    return dataclasses.replace(report, **cols)
