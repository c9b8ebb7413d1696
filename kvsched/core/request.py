"""A request and its life (see docs/ARCHITECTURE.md).

    WAITING --schedule--> RUNNING --report: finish--> FINISHED_STOPPED | FINISHED_LENGTH
       ^                     | preempt                 FINISHED_ABORTED | FINISHED_ERROR
       +---- (worker ack) -- PREEMPTED

Progress is one pair of counters: `num_computed_tokens` (positions whose KV has been handed to
the worker to compute, in this placement) against `num_tokens` (prompt + output). No separate
prefill and decode phases: a request decodes once its computed count reaches the tokens it had
when it was placed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, Protocol

from kvsched.core.logprobs import RequestLogprobs
from kvsched.core.protocol import FinishReason, MultimodalRange, SamplingParams

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt


class RequestStatus(IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # blocks freed, preempt sent, waiting for the worker's acknowledgement
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED


class TokenSource(Protocol):
    """Where a placed request's newest output tokens wait before they are moved to it: the
    scheduler's slot table (core/slots.py implements this; request.py imports nothing of it).
    `epoch` changes whenever tokens may have arrived, so a read costs one comparison when none
    did."""

    epoch: int

    def sync(self, req: Request) -> None:
        """Move req's waiting tokens to req._out (and its reported count along)."""

    def rebase(self, req: Request) -> None:
        """req._out was changed directly: make the source's count agree."""

    def unbind(self, req: Request) -> None:
        """Let go of req, its tokens moved to it first."""

    def packed(self, req: Request, start: int, end: int) -> bytes | None:
        """Output tokens [start, end) as little-endian int64 bytes, or None if not held."""


FINISHED_STATUS = {
    FinishReason.STOP: RequestStatus.FINISHED_STOPPED,
    FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH,
    FinishReason.ABORT: RequestStatus.FINISHED_ABORTED,
    FinishReason.ERROR: RequestStatus.FINISHED_ERROR,
}


@dataclass(slots=True, eq=False)
class Request:
    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0
    arrival_time: float = 0.0
    lora_name: str = ""
    cache_salt: str = ""
    mm_ranges: list[MultimodalRange] = field(default_factory=list)
    # Time to first token asked for, in ms after arrival (0: none, the instance's implicit
    # deadline applies), and who the request is served for (fair shares between tenants).
    ttft_deadline_ms: float = 0.0
    tenant: str = ""
    # Several samples of one prompt (OpenAI's `n`): requests naming the same group and the same
    # prompt compute it once (`kvsched.core.scheduler.groups`); "": none.
    sample_group: str = ""

    status: RequestStatus = RequestStatus.WAITING
    # Output tokens. While the request is placed, the tokens of plain decode rows land in the
    # scheduler's SlotTable first (one vectorized write per step) and are moved here when anyone
    # reads `output_token_ids` or `num_reported_tokens` (see core/slots.py).
    _out: list[int] = field(default_factory=list)
    _rows: TokenSource | None = None
    _epoch: int = -1  # the SlotTable epoch of the last sync
    # Placement on a worker slot (None while waiting).
    handle: int = -1
    slot: int = -1
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # KV positions handed to the worker in this placement
    _reported: int = 0  # KV positions the worker reported written (num_reported_tokens)
    num_prefill_tokens: int = 0  # num_tokens when placed: decoding starts after these
    # Prefix cache: hashes of the full blocks of prompt + output, and how many of this
    # request's blocks are registered in the cache.
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0
    # Accounting reported to the client.
    # Prefix-hit tokens at its first placement on the instance that holds it (-1: not placed
    # there yet); what usage.cached_tokens reports.
    num_cached_tokens: int = -1
    num_host_cached_tokens: int = 0  # of those, swapped in from the host tier (first placement)
    num_storage_cached_tokens: int = 0  # of those, fetched from the storage tier (first placement)
    num_preemptions: int = 0
    # Speculative decoding: drafts verified for it, and of them accepted (its report rows).
    num_draft_tokens: int = 0
    num_accepted_drafts: int = 0
    first_scheduled_time: float = -1.0
    first_token_time: float = -1.0
    finished_time: float = -1.0
    finish_reason: FinishReason = FinishReason.NONE
    finish_message: str = ""
    # Prefill/decode disaggregation: the decode instance's reservation for this request.
    kv_target: tuple[str, int, list[int]] | None = None
    # Output count at which a decoding request next needs the scheduler's attention.
    check_out: int = 0
    # Scheduling by deadline and tenant (`kvsched.core.fairness`), set by add_request: the
    # absolute deadline on the scheduler's clock; demoted (its deadline predicted missed, shed
    # policy "demote"): queued behind every request that is not; the predicted prefill
    # milliseconds it adds to the queue while it waits; output tokens already charged to its
    # tenant's counter.
    deadline: float = float("inf")
    demoted: bool = False
    queued_ms: float = 0.0
    charged_output: int = 0
    # Opaque to the core: the caller's per-request state (the daemon's stream and tracing).
    tag: object = None
    # Its log-probabilities so far, only when its sampling asks (`with_logprobs`); the report
    # path puts rows in, the daemon's sinks read them.
    logprobs: RequestLogprobs | None = None
    # The prompt as the wire carried it, packed (int32 ids, the message's own): set by the
    # codec from a request message, None otherwise; always equal to prompt_token_ids (nothing
    # changes a prompt). A new request's id checks and block hashes read it (`prompt_max_id`,
    # `packed_prompt`): one C loop each instead of passes over the list's Python ints.
    prompt_array: npt.NDArray[np.int32] | None = None

    def __post_init__(self) -> None:
        sp = self.sampling
        if self.logprobs is None and (sp.logprobs is not None or sp.prompt_logprobs is not None):
            self.logprobs = RequestLogprobs()

    @property
    def output_token_ids(self) -> list[int]:
        rows = self._rows
        if rows is not None and self._epoch != rows.epoch:  # (SlotTable.sync's own test, first)
            rows.sync(self)
        return self._out

    @property
    def num_reported_tokens(self) -> int:
        """KV positions the worker has reported written, in this placement."""
        rows = self._rows
        if rows is not None and self._epoch != rows.epoch:
            rows.sync(self)
        return self._reported

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED

    @property
    def is_prefill_done(self) -> bool:
        """All prefill positions of this placement have been handed to the worker."""
        return self.num_computed_tokens >= self.num_prefill_tokens

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]


def prompt_max_id(req: Request) -> int:
    """The largest token id of req's prompt (-1 when it is empty): from the packed prompt when
    the request has it (a C loop), else from the list."""
    arr = req.prompt_array
    if arr is not None:
        return int(arr.max()) if len(arr) else -1
    return max(req.prompt_token_ids, default=-1)


def packed_prompt(req: Request, start: int, end: int) -> bytes | None:
    """Prompt tokens [start, end) as little-endian int64 bytes (the bytes the block hashes pack
    a block's tokens into), from the packed prompt; None when the request has none."""
    arr = req.prompt_array
    return None if arr is None else arr[start:end].astype("<i8").tobytes()
