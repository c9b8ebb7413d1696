"""Several samples of one prompt (OpenAI's `n`, vLLM's parallel sampling), its prompt computed
once on this instance.

Requests that name the same `sample_group` and carry the same prompt (tokens, LoRA, cache salt,
multimodal items) are one group. The first to arrive leads: it is queued and computes the
prompt like any request. The others are held: tracked and WAITING, but not in the queue, until
the leader's first output token is reported. By then every full block of the prompt is
registered in the prefix cache (a block becomes a hit once the report of the step that wrote
it is applied: scheduling rule 5), and the leader, still running, holds them. The members go to
the queue's front, and admission finds those blocks as hits: shared by reference count (held
once), each member computing only the tail (under one block, plus the token that yields its
first output).

    leader   queued -> placed -> prompt chunks ... -> first token reported ---------+
    members  held (not queued) ...................................... released to the queue's
                                                                      front: the prompt's full
                                                                      blocks are hits, the tail
                                                                      is computed

- The leader ends before its first token (aborted, failed, out of KV): the first member held
  leads in its place (queued now); the others stay held on it. No member waits on a request
  that is gone.
- The leader is preempted before its first token: its members stay held (it recomputes the
  prompt; they still wait for it). After its first token the group is over: every member is an
  ordinary request, preempted and recomputed alone.
- A member released when its leader finished at once (max_tokens 1, a stop) may find the
  prompt's blocks evicted before it is admitted: it then computes them itself. It never waits
  on anything but a live leader's prefill.
- Only the mixed role with prefix caching groups requests (without the cache nothing is shared;
  a prefill role hands its prompts off), and only prompts of a full block or more. A request
  with output already (moved off a lost instance, resumed) never leads or waits.

`SampleGroups` owns the groups whose leader has not had its first token and their held
members; it queues a released member through `Backlog.release_held`. Imported by the scheduler
facade only; imports `backlog` and `events`.
"""

from __future__ import annotations

from collections.abc import Container, Iterator
from dataclasses import dataclass, field

from kvsched.core.config import EngineConfig, Role
from kvsched.core.request import Request
from kvsched.core.scheduler.backlog import Backlog
from kvsched.core.scheduler.events import Events


@dataclass(slots=True)
class _Group:
    leader: Request
    held: dict[str, Request] = field(default_factory=dict)  # in arrival order


def _same_prompt(a: Request, b: Request) -> bool:
    return (
        a.prompt_token_ids == b.prompt_token_ids
        and a.lora_name == b.lora_name
        and a.cache_salt == b.cache_salt
        and a.mm_ranges == b.mm_ranges
    )


class SampleGroups:
    """The groups whose leader is still computing the prompt, and the members they hold."""

    def __init__(self, config: EngineConfig, backlog: Backlog) -> None:
        self._on = config.cache.enable_prefix_caching and config.role == Role.MIXED
        self._block_size = config.cache.block_size
        self._backlog = backlog
        self._groups: dict[str, _Group] = {}
        self.num_held = 0

    def waits(self, req: Request) -> bool:
        """Whether a new request would be held on its group's leader (nothing changes)."""
        g = self._groups.get(req.sample_group) if req.sample_group else None
        return g is not None and not req.output_token_ids and _same_prompt(g.leader, req)

    def added(self, req: Request, held: bool) -> None:
        """req was tracked (`Backlog.add`): held (`waits` said so), or queued, then it leads a
        new group when it may."""
        if held:
            self._groups[req.sample_group].held[req.req_id] = req
            self.num_held += 1
        elif (
            self._on
            and req.sample_group
            and req.sample_group not in self._groups
            and not req.output_token_ids
            and len(req.prompt_token_ids) >= self._block_size
        ):
            self._groups[req.sample_group] = _Group(req)

    def leads(self, group: str) -> bool:
        """Whether a request of `group` computes its prompt here now (routing: its members
        belong on this instance)."""
        return group in self._groups

    def discard(self, req: Request) -> bool:
        """A held member ends (aborted): no longer held. False when req is not held."""
        g = self._groups.get(req.sample_group) if req.sample_group else None
        if g is None or g.held.pop(req.req_id, None) is None:
            return False
        self.num_held -= 1
        return True

    def settle(self, events: Events) -> None:
        """Act on what the events say of leaders: a first token releases the group's members;
        an end without one hands the lead to the first member held. Idempotent (events are
        read again until they are taken); O(first tokens + finishes) when groups exist."""
        if not self._groups:
            return
        groups = self._groups
        for req in events.first_token:
            g = groups.get(req.sample_group) if req.sample_group else None
            if g is not None and g.leader is req:
                del groups[req.sample_group]
                self._release(list(g.held.values()))
        for req in events.finished:
            g = groups.get(req.sample_group) if req.sample_group else None
            if g is None or g.leader is not req:
                continue
            if not g.held:
                del groups[req.sample_group]
                continue
            g.leader = g.held.pop(next(iter(g.held)))
            self._release([g.leader])

    def _release(self, members: list[Request]) -> None:
        self.num_held -= len(members)
        for req in reversed(members):  # the first held ends at the very front
            self._backlog.release_held(req)

    def held(self) -> Iterator[Request]:
        for g in self._groups.values():
            yield from g.held.values()

    def check_integrity(self, live: Container[str]) -> None:
        """Every held member waits on a live leader of its own group and prompt."""
        n = 0
        for key, g in self._groups.items():
            assert g.leader.req_id in live, f"group {key!r}: leader {g.leader.req_id} not live"
            assert not g.leader.is_finished and g.leader.first_token_time < 0
            for r in g.held.values():
                assert r.req_id in live and r.sample_group == key and _same_prompt(r, g.leader)
                n += 1
        assert n == self.num_held, f"held count {self.num_held} != {n}"
