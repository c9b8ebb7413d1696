"""Data that crosses the core's boundary: what the scheduler tells a worker and what it hears back.

These are the core-side shapes of the worker protocol (`protos/kvsched/v1/worker_service.proto`,
and docs/ARCHITECTURE.md section 5 for the why). `kvsched.codec` converts them to and from
protobuf for the daemon and the reference worker alike.

A request placed on a worker slot gets a *handle*: an integer unique per instance and per
placement (a preempted request that is placed again gets a new one). Every task and every
report names handles, never bare slots, so a late report about a slot's previous occupant is
recognised and dropped. Handles are issued in increasing order, so a handle at or above the next
one to be issued was never sent: that is a protocol violation, not a late report.

Order in which a worker applies one `Tasks` message, at a step boundary:

    0. swap-outs             copy GPU blocks to host blocks (before anything below, or any
                             later message, may overwrite those GPU blocks)
    1. preempts, aborts      drop those handles (their blocks may be reused below)
    1b. encoder drops        forget those multimodal items' encoder outputs (no chunk of a
                             handle still held needs them; kvsched/core/encoder_cache.py)
    2. placements            occupy a slot: block table, sampling, where decoding starts
    3. extensions            append block ids to a handle's table (resumes a paused slot)
    3b. swap-ins             copy host blocks into a handle's fresh GPU blocks (before any chunk
                             reads them)
    4. chunks                queue prefill chunks; one chunk per handle per step, in order
    5. kv_sends              (prefill role) where to push a handle's KV when its prompt is done

Copies are done once the worker has applied their message: a report whose applied_seq reaches
it acknowledges them, except those it names as failed (kvsched/core/tiers.py).

A placement that never receives chunks holds its slot and blocks idle: that is how a decode
instance reserves room for KV pushed to it by a prefill worker (pushes for a handle the worker
does not hold are refused). When the KV has arrived the daemon aborts that reservation handle
and places the request again under a new handle with num_cached_tokens == num_prefill_tokens
and last_token_id set, on the same blocks: the worker starts decoding at once.

A handle decodes on its own once its last prefill chunk ran: one token (1 + accepted
speculative tokens) per step while its blocks have room for the positions it will write.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Union

import numpy as np

from kvsched.core.logprobs import TokenLogprobs

# A report column: a list of ints or a 1-D integer numpy array.
IntColumn = Union[list[int], "np.ndarray[Any, Any]"]


class FinishReason(IntEnum):
    """Why a request finished. Values match the protobuf enum of the same name."""

    NONE = 0
    STOP = 1  # EOS or a stop token
    LENGTH = 2  # max_tokens or the model's length
    ABORT = 3  # client abort, disconnect, drain, deadline
    ERROR = 4  # worker or transfer failure


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A grammar the output must follow (vLLM's StructuredOutputsParams, one kind set): `kind`
    is one of STRUCTURED_KINDS; `spec` the JSON schema's text, the regex or the grammar;
    `choices` the strings of a choice."""

    kind: str
    spec: str = ""
    choices: tuple[str, ...] = ()


@dataclass(slots=True)
class SamplingParams:
    """Sampling and stop conditions, carried to the worker; the core only checks max_tokens."""

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None  # None: unseeded
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # The engine's own adjustments (vLLM's meanings; 0 / 1.0 / empty: off)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_p: float = 0.0
    structured: StructuredOutput | None = None  # None: unconstrained
    # Log-probabilities (core/logprobs.py): None none; k >= 0 the token's own and k alternatives
    logprobs: int | None = None
    prompt_logprobs: int | None = None


@dataclass(slots=True)
class MultimodalRange:
    """A placeholder range of prompt positions filled by one multimodal item."""

    offset: int
    length: int
    content_hash: str


@dataclass(slots=True)
class Placement:
    """Put a request on a slot. Sent once per placement (first time and after each preemption)."""

    handle: int
    slot: int
    req_id: str
    block_ids: list[int]  # the block table so far
    num_cached_tokens: int  # KV already in those blocks (prefix hit or transferred)
    num_prefill_tokens: int  # tokens to have KV for before decoding starts (prompt + outputs)
    num_output_tokens: int  # outputs generated before this placement (counts toward max_tokens)
    last_token_id: int  # the token decoding starts from when num_cached == num_prefill (else -1)
    sampling: SamplingParams
    lora_name: str = ""
    # The request's multimodal items (their chunks read the items' encoder outputs).
    mm_ranges: list[MultimodalRange] = field(default_factory=list)


@dataclass(slots=True)
class Chunk:
    """Prefill positions [start, start + len(token_ids)) of a handle."""

    handle: int
    start: int
    token_ids: list[int]


@dataclass(slots=True)
class Extension:
    """Blocks appended to a handle's table."""

    handle: int
    block_ids: list[int]


@dataclass(slots=True)
class KvSend:
    """Prefill role: after the prompt of `handle` is computed, push its KV blocks to another
    instance's blocks `dst_block_ids` (same order as the source table), then report the step."""

    handle: int
    dst_instance: str
    dst_handle: int
    dst_block_ids: list[int]


@dataclass(slots=True)
class Tasks:
    """One message of work for a worker, produced by one `Scheduler.schedule()` call."""

    seq: int  # 1, 2, 3, ... per scheduler; 0: nothing to say (no task, no report to answer)
    preempts: list[int] = field(default_factory=list)
    aborts: list[int] = field(default_factory=list)
    placements: list[Placement] = field(default_factory=list)
    extensions: list[Extension] = field(default_factory=list)
    chunks: list[Chunk] = field(default_factory=list)
    kv_sends: list[KvSend] = field(default_factory=list)
    reset_prefix_cache: bool = False
    report_step: int = 0  # the last report applied before this message was built (0: none)
    # Host tier copies, columnar: GPU block swap_out_gpu[i] -> host block swap_out_host[i];
    # host block swap_in_host[i] -> GPU block swap_in_gpu[i] of handle swap_in_handles[i].
    swap_out_gpu: list[int] = field(default_factory=list)
    swap_out_host: list[int] = field(default_factory=list)
    swap_in_handles: list[int] = field(default_factory=list)
    swap_in_host: list[int] = field(default_factory=list)
    swap_in_gpu: list[int] = field(default_factory=list)
    # Multimodal items (content hashes) whose encoder outputs the worker drops (step 1b).
    encoder_drops: list[str] = field(default_factory=list)
    # Storage tier (protocol step 13), columnar: block storage_write_blocks[i] (a host block id
    # when the instance has a host tier, else a GPU block id) put under storage_write_keys[i];
    # key storage_fetch_keys[i] got into GPU block storage_fetch_gpu[i] of handle
    # storage_fetch_handles[i] (a handle's fetches are consecutive).
    storage_write_keys: list[str] = field(default_factory=list)
    storage_write_blocks: list[int] = field(default_factory=list)
    storage_fetch_handles: list[int] = field(default_factory=list)
    storage_fetch_keys: list[str] = field(default_factory=list)
    storage_fetch_gpu: list[int] = field(default_factory=list)
    # Storage -> host prefetches (core/prefetch.py): key storage_prefetch_keys[i] got into host
    # block storage_prefetch_host[i] (no handle: the request waits in the daemon's queue); run
    # beside the step, acknowledged by applied_seq like every task.
    storage_prefetch_keys: list[str] = field(default_factory=list)
    storage_prefetch_host: list[int] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (
            self.encoder_drops
            or self.swap_out_gpu
            or self.swap_in_gpu
            or self.storage_write_keys
            or self.storage_fetch_keys
            or self.storage_prefetch_keys
            or self.preempts
            or self.aborts
            or self.placements
            or self.extensions
            or self.chunks
            or self.kv_sends
            or self.reset_prefix_cache
        )


@dataclass(slots=True)
class StepReport:
    """What a worker ran in one step. Columns are parallel; token ids are flat.

    handles[i] ran this step; after it the handle's KV covers positions [0, num_computed[i]);
    it sampled num_new_tokens[i] tokens (0 for a prefill chunk that is not the prompt's last),
    stored consecutively in token_ids. finish_reasons[i] != NONE means the worker stopped it
    (stop token, max_tokens, model length). Handles the worker dropped because of a preempt or
    abort, or tasks it acknowledged and discarded, are in acked; handles that could not decode
    for lack of block room are in paused.
    """

    step: int
    applied_seq: int
    # Lists, or 1-D integer numpy arrays (the daemon's conversion gives arrays: the core's
    # decode path is vectorized over them).
    handles: IntColumn = field(default_factory=list)
    num_computed: IntColumn = field(default_factory=list)
    num_new_tokens: IntColumn = field(default_factory=list)
    token_ids: IntColumn = field(default_factory=list)
    finish_reasons: IntColumn = field(default_factory=list)  # or empty: none finished
    acked: list[int] = field(default_factory=list)
    paused: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)  # e.g. KV transfer failed: ends with ERROR
    # Copies of the messages up to applied_seq that failed: swap-outs by host block id,
    # swap-ins by handle (that handle did not run; the daemon preempts it: it recomputes).
    failed_swap_outs: list[int] = field(default_factory=list)
    failed_swap_ins: list[int] = field(default_factory=list)
    step_time_ns: int = 0
    # Storage tasks of the messages up to applied_seq that failed (protocol step 13): writes by
    # key (never counted as stored), fetches by handle (that handle did not run: it recomputes).
    failed_storage_writes: list[str] = field(default_factory=list)
    failed_storage_fetches: list[int] = field(default_factory=list)
    # Speculative decoding, sparse: draft_handles[i] verified num_draft_tokens[i] drafts in one
    # step and kept num_accepted_drafts[i] of them (only rows that had drafts).
    draft_handles: list[int] = field(default_factory=list)
    num_draft_tokens: list[int] = field(default_factory=list)
    num_accepted_drafts: list[int] = field(default_factory=list)
    # Log-probabilities (only rows whose request asked): num_logprobs[i] rows (0 or
    # num_new_tokens[i]) of `logprobs` are handles[i]'s; prompt rows per handle, once.
    num_logprobs: list[int] = field(default_factory=list)  # empty: no row has any
    logprobs: TokenLogprobs | None = None
    prompt_logprob_handles: list[int] = field(default_factory=list)
    num_prompt_logprobs: list[int] = field(default_factory=list)
    prompt_logprobs: TokenLogprobs | None = None
    # Host blocks whose storage prefetch failed (their keys are no longer believed stored).
    failed_storage_prefetches: list[int] = field(default_factory=list)
