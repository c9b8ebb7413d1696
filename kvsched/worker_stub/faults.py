"""Injected faults of the reference worker (`kvsched worker --crash-on-token ID`,
`--crash-on-prompt-len N`): a request that makes a worker crash, for tests of the daemon's
poison quarantine. The engine raises `SimulatedCrash` when it is given such a request's prefill:
the worker drops its stream and its engine and reconnects with a fresh one, as a crashed worker
under a supervisor would."""

from __future__ import annotations

from dataclasses import dataclass

from kvsched.core.protocol import Tasks
from kvsched.worker_stub.engine import WorkerEngine


class SimulatedCrash(ValueError):
    """The injected fault fired (a ValueError: the session drops the stream and reconnects)."""


@dataclass(frozen=True, slots=True)
class Faults:
    crash_on_token: int = -1  # crash when a prefill chunk carries this token id (-1: never)
    crash_on_prompt_len: int = 0  # crash when a placement has at least this many prefill tokens

    def __bool__(self) -> bool:
        return self.crash_on_token >= 0 or self.crash_on_prompt_len > 0

    def check(self, tasks: Tasks) -> None:
        """Raise SimulatedCrash when `tasks` hands this worker a poison request's prefill."""
        n = self.crash_on_prompt_len
        if n > 0:
            for p in tasks.placements:
                if p.num_prefill_tokens >= n:
                    raise SimulatedCrash(
                        f"injected crash: request {p.req_id!r} has {p.num_prefill_tokens} "
                        f"prefill tokens (--crash-on-prompt-len {n})"
                    )
        tok = self.crash_on_token
        if tok >= 0:
            for c in tasks.chunks:
                if tok in c.token_ids:
                    raise SimulatedCrash(
                        f"injected crash: a prefill chunk of handle {c.handle} carries token "
                        f"{tok} (--crash-on-token {tok})"
                    )


class FaultyEngine(WorkerEngine):
    """A WorkerEngine that crashes on the requests `faults` names, before applying them."""

    faults: Faults = Faults()

    def apply(self, tasks: Tasks) -> None:
        self.faults.check(tasks)
        super().apply(tasks)
