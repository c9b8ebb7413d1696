"""What a worker engine asks of an executor: run one batched step over the paged KV cache.

Both executors implement `Executor`: `sim` (cost model, no KV) and `model` (a small numpy
transformer whose K/V live in the paged cache). Positions of one `SeqWork`:

    start                                   start + len(token_ids)
      |<-- prefill chunk: KV computed here -->|   sample=False: no token comes back
      |<-- last chunk of the prompt --------->|-> sample=True: one token (position end)
      | last | d1 | d2 | ... | dk |              decode: [last_token] + k drafts,
                                                  num_draft=k; returns accepted drafts + 1 bonus
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from kvsched.core.logprobs import LogprobRow
from kvsched.core.protocol import MultimodalRange, SamplingParams


@dataclass(slots=True)
class SeqWork:
    """One sequence's work in one step."""

    handle: int
    req_id: str
    block_ids: list[int]  # the full block table of this handle
    start: int  # position of token_ids[0]
    token_ids: list[int]  # KV computed this step: a prefill chunk, or [last_token] + drafts
    sample: bool  # True when the step ends the prompt or decodes: sample after the last position
    num_draft: int  # trailing token_ids that are speculative draft guesses (verify greedily)
    sampling: SamplingParams
    # The handle's multimodal items: positions in their ranges read the items' encoder outputs.
    mm_ranges: list[MultimodalRange] = field(default_factory=list)


@dataclass(slots=True)
class StepResult:
    """What one executed step produced."""

    tokens: list[list[int]]  # per SeqWork: sampled tokens ([] when sample is False);
    # with drafts: the accepted drafts followed by one bonus token
    step_time_s: float  # what the step took (simulated or measured)
    # Per SeqWork, only from an executor that reports log-probabilities (the vLLM one) and only
    # for works whose sampling asked: one row per sampled token ([] otherwise), and the
    # prompt's rows (positions 1..) when its last chunk ran (None otherwise).
    logprobs: list[list[LogprobRow]] | None = None
    prompt_logprobs: list[list[LogprobRow] | None] | None = None
    # Indices of SeqWorks the executor did not run in this step (the vLLM one's, when a step
    # runs ahead: worker_vllm/ahead.py): the engine records nothing for them and offers them
    # again in its next step (a chunk stays queued).
    deferred: list[int] | None = None
    num_ahead: int = 0  # SeqWorks whose tokens came from a step launched ahead
    num_wasted: int = 0  # rows a step launched ahead ran that no SeqWork took (a stop, a preempt)


class Executor(Protocol):
    """Runs batched steps. Blocks are addressed only through the block tables it is given."""

    name: str

    def execute(self, work: list[SeqWork]) -> StepResult:
        """Compute KV for every SeqWork's positions, in one step; sample where asked."""
        ...

    def export_kv(self, block_ids: list[int]) -> bytes:
        """The KV of these blocks, in order, for a prefill -> decode push."""
        ...

    def import_kv(self, block_ids: list[int], data: bytes) -> None:
        """Write KV exported by `export_kv` (of as many blocks) into these blocks."""
        ...

    def reset(self) -> None:
        """Forget all KV: a reconnecting worker starts from an empty cache."""
        ...


@runtime_checkable
class ColumnarExecutor(Executor, Protocol):
    """An executor that also runs plain decodes (no drafts) as numpy columns: what the sim
    offers `WorkerEngine(columnar=True)`, so a decode step over R slots is a few array
    operations instead of R SeqWorks."""

    def request_key(self, req_id: str) -> int:
        """What the executor needs to know of a request to decode it (taken at placement)."""
        ...

    def execute_columns(
        self,
        work: list[SeqWork],
        keys: npt.NDArray[np.uint64],
        positions: npt.NDArray[np.int64],
    ) -> tuple[StepResult, npt.NDArray[np.int64]]:
        """execute(work) plus, in the same step, one plain decode per (keys[i], positions[i]):
        it feeds the sequence's newest token at positions[i] - 1 and samples positions[i]."""
        ...
