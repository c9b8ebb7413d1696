"""Factories that keep core tests short (`make_scheduler`, `make_requests`; `check_integrity()` after every step)."""

from __future__ import annotations

import itertools
from typing import Any

from kvsched.core import (
    CacheConfig,
    EngineConfig,
    Events,
    MultimodalRange,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SpeculativeConfig,
    StepReport,
    Tasks,
)

_ids = itertools.count()


def make_config(**kw: Any) -> EngineConfig:
    """Keyword arguments go to the section that has a field of that name."""
    sections: dict[str, dict[str, Any]] = {"cache": {}, "scheduler": {}, "speculative": {}}
    kinds = {"cache": CacheConfig, "scheduler": SchedulerConfig, "speculative": SpeculativeConfig}
    role = kw.pop("role", "mixed")
    for key, value in kw.items():
        for name, kind in kinds.items():
            if key in kind.__dataclass_fields__:
                sections[name][key] = value
                break
        else:
            raise TypeError(f"no config field {key}")
    return EngineConfig(
        cache=CacheConfig(**sections["cache"]),
        scheduler=SchedulerConfig(**sections["scheduler"]),
        speculative=SpeculativeConfig(**sections["speculative"]),
        role=role,
    )


def make_scheduler(**kw: Any) -> Scheduler:
    kw.setdefault("block_size", 16)
    kw.setdefault("num_gpu_blocks", 1000)
    kw.setdefault("max_model_len", 8192)
    instance_id = kw.pop("instance_id", "i0")
    return Scheduler(make_config(**kw), instance_id=instance_id)


def make_request(
    prompt: list[int] | int,
    max_tokens: int = 16,
    req_id: str | None = None,
    **kw: Any,
) -> Request:
    if isinstance(prompt, int):
        base = next(_ids) * 100_000
        prompt = list(range(base, base + prompt))
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(req_id or f"r{next(_ids)}", prompt, sampling, **kw)


def make_requests(n: int, prompt_len: int, max_tokens: int = 16, **kw: Any) -> list[Request]:
    return [make_request(prompt_len, max_tokens, **kw) for _ in range(n)]


def mm(offset: int, length: int, h: str = "img") -> MultimodalRange:
    return MultimodalRange(offset, length, h)


def report(
    s: Scheduler,
    rows: list[tuple[int, int, list[int]]] = (),  # type: ignore[assignment]
    acked: list[int] | None = None,
    finish: dict[int, int] | None = None,
    paused: list[int] | None = None,
) -> StepReport:
    """A StepReport for the scheduler's next step: rows of (handle, num_computed, new tokens)."""
    finish = finish or {}
    rows = list(rows)
    return StepReport(
        step=s.last_report_step + 1,
        applied_seq=s.last_tasks_seq,
        handles=[h for h, _, _ in rows],
        num_computed=[c for _, c, _ in rows],
        num_new_tokens=[len(t) for _, _, t in rows],
        token_ids=[t for _, _, ts in rows for t in ts],
        finish_reasons=[finish.get(h, 0) for h, _, _ in rows] if finish else [],
        acked=acked or [],
        paused=paused or [],
    )


def run_tasks(s: Scheduler, tasks: Tasks, token: int = 7) -> Events:
    """Execute `tasks` as a worker would in one step: every chunk runs (a prompt-ending chunk
    samples `token`), every decoding request that was not in a chunk decodes one token, and
    preempts/aborts are acknowledged. Returns the scheduler's events."""
    chunked = {c.handle for c in tasks.chunks}
    rows: list[tuple[int, int, list[int]]] = []
    for c in tasks.chunks:
        req = s.live[c.handle]
        end = c.start + len(c.token_ids)
        rows.append((c.handle, end, [token] if end >= req.num_prefill_tokens else []))
    paused = []
    for req in list(s.running.values()):
        if req.handle not in chunked and req.is_prefill_done:
            if req.num_tokens > len(req.block_ids) * s.block_size:
                paused.append(req.handle)  # no room for the next position's KV
            else:
                rows.append((req.handle, req.num_tokens, [token]))
    return s.apply_report(report(s, rows, acked=tasks.preempts + tasks.aborts, paused=paused))


def step(s: Scheduler, token: int = 7) -> tuple[Tasks, Events]:
    """schedule() then run_tasks(), then check_integrity()."""
    tasks = s.schedule()
    events = run_tasks(s, tasks, token)
    s.check_integrity()
    return tasks, events
