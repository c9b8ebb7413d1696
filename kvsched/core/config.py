"""Typed, validated configuration of one instance's scheduler.

Every check names the field and its allowed range, so a bad TOML file or flag is fixed at once.
The server builds these objects from TOML, then `KVSCHED_*` environment, then flags.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import Enum, StrEnum
from typing import Any

from kvsched.core.errors import ConfigError


class Role(StrEnum):
    MIXED = "mixed"  # prefill and decode on the same instance
    PREFILL = "prefill"  # prefill only, then hand the KV to a decode instance
    DECODE = "decode"  # receives prefilled requests and decodes them


class WritePolicy(StrEnum):
    """When a GPU block is copied to the host tier (docs/ARCHITECTURE.md, cache tiers)."""

    WRITE_THROUGH = "write_through"  # once it is full and registered
    WRITE_THROUGH_SELECTIVE = "write_through_selective"  # once it was hit host_write_hits times
    WRITE_BACK = "write_back"  # when the GPU pool evicts it


class PdTransfer(StrEnum):
    """How a prefill instance hands a prompt's KV to its decode instance."""

    PUSH = "push"  # worker to worker (KvSend into the decode reservation's blocks)
    STORAGE = "storage"  # through the shared storage tier: written here, fetched there


class QueuePolicy(StrEnum):
    FCFS = "fcfs"
    PRIORITY = "priority"  # lower value first, then arrival
    # Lower priority class first; within a class the tenant with the fewest weighted served
    # tokens (virtual token counters, `kvsched.core.fairness`); within a tenant earliest TTFT
    # deadline first (implicit deadlines for requests without one: arrival + a default).
    SLO = "slo"


class ShedPolicy(StrEnum):
    OFF = "off"  # a deadline orders the queue only
    SHED = "shed"  # reject at once (RESOURCE_EXHAUSTED) when the prediction misses it
    DEMOTE = "demote"  # queue it behind every request that can still meet its deadline


def _check_range(section: str, name: str, value: float, lo: float, hi: float | None = None) -> None:
    if value < lo or (hi is not None and value > hi):
        upper = "inf" if hi is None else hi
        raise ConfigError(f"{section}.{name} = {value!r} is out of range [{lo}, {upper}]")


@dataclass(slots=True)
class CacheConfig:
    block_size: int = 16
    num_gpu_blocks: int = 4096
    enable_prefix_caching: bool = True
    # Decode headroom (the seed's enc_dec_block_num / prealloc_dec_block_slot_num_threshold):
    # when a decoding request's free token slots fall to `prealloc_threshold`, append
    # `prealloc_blocks` blocks so the worker can decode many steps without asking.
    prealloc_blocks: int = 2
    prealloc_threshold: int = 12
    # Admission reserve (the seed's FD_RESERVE_*_OUTPUT_BLOCK_NUM): admit a prefill only if free
    # blocks cover its chunk plus reserve_blocks x running; decays per scheduled step.
    reserve_blocks: int = 0
    reserve_decay: float = 0.0
    reserve_min: int = 0
    # The host-memory KV tier (kvsched/core/tiers.py): blocks the worker's Hello announces (0:
    # no tier; the daemon sets it from the Hello like num_gpu_blocks), when blocks are copied
    # there, and after how many GPU hits under write_through_selective.
    num_host_blocks: int = 0
    host_write_policy: WritePolicy = WritePolicy.WRITE_BACK
    host_write_hits: int = 1
    # The storage tier (kvsched/core/storage.py; on when the daemon has `storage` configured
    # and the worker reaches it): write_back writes a block when its last tier above would
    # evict it (host, else GPU), write_through as soon as it reaches that tier.
    storage_write_policy: WritePolicy = WritePolicy.WRITE_BACK
    # Storage -> host prefetch (kvsched/core/prefetch.py; with a host tier and a storage tier):
    # a queued request's storage hits are got into host blocks while it waits at the queue's
    # head (every request from its arrival with storage_prefetch_at_arrival), and swapped in at
    # its placement instead of fetched on the step. A request whose prefetch has not landed is
    # held in the queue (others behind it go ahead) for at most storage_prefetch_hold_ms from
    # the prefetch (0: never held: what has not landed by its placement is fetched again).
    # Off by default: it measured no TTFT gain on the shipped trace (docs/BENCHMARKS.md 17).
    storage_prefetch: bool = False
    storage_prefetch_at_arrival: bool = False
    storage_prefetch_hold_ms: float = 100.0
    # Prefill role: how the prompt's KV reaches the decode instance (core/scheduler/
    # pd_storage.py): push (worker to worker) or storage (the prompt's full blocks written to
    # the storage tier, the decode instance fetching them; needs `storage` configured and no
    # host tier on the prefill instance, else the decode instance recomputes the prompt).
    pd_transfer: PdTransfer = PdTransfer.PUSH
    # Swap-ins and storage fetches ahead of the first chunk (0: off): a request placed with
    # host or storage hits whose copies take at least this share of a step (the cost model's
    # per-block times x its blocks >= swap_in_ahead x the measured step's moving average) gets
    # its placement and copies in one Tasks message and its first chunk in the next, so the
    # copies can run beside a step (a worker's copy stream, its NIC) instead of before one that
    # every request in the batch waits on. The request itself waits about max(one step, its
    # copies) instead of its copies.
    swap_in_ahead: float = 0.0
    # The worker's multimodal encoder cache (kvsched/core/encoder_cache.py), in embeddings
    # (one per placeholder token); 0: off, every chunk touching an item pays its encoder budget.
    encoder_cache_size: int = 0

    def validate(self) -> None:
        s = "cache"
        _check_range(s, "encoder_cache_size", self.encoder_cache_size, 0, 1 << 31)
        _check_range(s, "num_host_blocks", self.num_host_blocks, 0, 1 << 31)
        _check_range(s, "host_write_hits", self.host_write_hits, 1, 1 << 20)
        try:
            self.host_write_policy = WritePolicy(self.host_write_policy)
        except ValueError:
            raise ConfigError(
                f"cache.host_write_policy = {self.host_write_policy!r}; expected one of "
                f"{[p.value for p in WritePolicy]}"
            ) from None
        storage_policies = (WritePolicy.WRITE_BACK.value, WritePolicy.WRITE_THROUGH.value)
        if str(self.storage_write_policy) not in storage_policies:
            raise ConfigError(
                f"cache.storage_write_policy = {self.storage_write_policy!r}; expected one of "
                f"{list(storage_policies)}"
            )
        self.storage_write_policy = WritePolicy(self.storage_write_policy)
        try:
            self.pd_transfer = PdTransfer(self.pd_transfer)
        except ValueError:
            raise ConfigError(
                f"cache.pd_transfer = {self.pd_transfer!r}; expected one of "
                f"{[p.value for p in PdTransfer]}"
            ) from None
        _check_range(s, "block_size", self.block_size, 1, 4096)
        _check_range(s, "storage_prefetch_hold_ms", self.storage_prefetch_hold_ms, 0.0, 60000.0)
        _check_range(s, "swap_in_ahead", self.swap_in_ahead, 0.0, 1000.0)
        _check_range(s, "num_gpu_blocks", self.num_gpu_blocks, 1, 1 << 31)
        _check_range(s, "prealloc_blocks", self.prealloc_blocks, 1, 1024)
        _check_range(s, "prealloc_threshold", self.prealloc_threshold, 0, 1 << 20)
        _check_range(s, "reserve_blocks", self.reserve_blocks, 0, 1 << 20)
        _check_range(s, "reserve_decay", self.reserve_decay, 0.0, 1 << 20)
        _check_range(s, "reserve_min", self.reserve_min, 0, self.reserve_blocks or 0)


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 131072
    long_prefill_token_threshold: int = 0  # 0: no per-request cap per step
    disable_chunked_prefill: bool = False
    disable_chunked_mm_input: bool = False
    max_num_encoder_tokens: int = 0  # multimodal tokens admitted per step; 0: unlimited
    policy: QueuePolicy = QueuePolicy.SLO
    priority_preemption: bool = False  # priority policy: a waiting request may preempt lower ones
    max_preemptions: int = 0  # 0: unlimited; else a request preempted this often is kept
    max_waiting: int = 65536
    # Admit a prompt only when the free blocks can hold all of it (beside the prompts already
    # admitted), not just its first chunk: otherwise its later chunks preempt decoding requests
    # and throw their work away (vLLM's scheduler_reserve_full_isl). See docs/BENCHMARKS.md.
    admit_full_prompt: bool = True
    # Time-budgeted steps: while requests are decoding, prefill chunks are sized so that the
    # step-cost model predicts every worker step under this many milliseconds (decoding
    # requests wait for the whole step: this is their inter-token latency). 0: off, only the
    # token budget applies. With nothing decoding only the token budget applies.
    itl_target_ms: float = 100.0
    # Never starve a prompt: the oldest prefilling request may take a chunk of this many
    # tokens even when the time target leaves none (decoding alone may fill the target), in a
    # worker step that carries no other request's chunk (one floor per step).
    min_prefill_chunk: int = 256
    # While prompts wait, a step may run past itl_target_ms: its target becomes the decodes'
    # predicted time plus 1/queue_drain_steps of the waiting prompts' prefill, each waiting or
    # prefilling prompt counted up to one min_prefill_chunk, less one prompt's share (the
    # floor serves one a step anyway; waiting ones only while the queue's head could be
    # placed). A burst is taken in a few long steps that shrink as the queue empties instead
    # of one prompt per step, and prompts enter at least as fast as requests finish when
    # decodes alone fill the target; one long prompt alone still runs in chunks under the
    # target. The token budget still bounds every step. 0: off (the target holds; prompts
    # move by the floor).
    queue_drain_steps: int = 2
    # Distinct LoRA adapters placed at once (vLLM's max_loras: a worker step runs every placed
    # request, so this bounds the adapters of every step): a request naming another adapter
    # waits (it is skipped, the requests behind it may go) while this many are placed. 0: no
    # limit. The daemon takes it from the worker's Hello (`Hello.max_loras`).
    max_loras: int = 0

    def validate(self) -> None:
        s = "scheduler"
        _check_range(s, "max_loras", self.max_loras, 0, 1 << 16)
        _check_range(s, "itl_target_ms", self.itl_target_ms, 0.0, 3.6e6)
        _check_range(s, "min_prefill_chunk", self.min_prefill_chunk, 1, 1 << 24)
        _check_range(s, "queue_drain_steps", self.queue_drain_steps, 0, 1 << 20)
        _check_range(s, "max_num_seqs", self.max_num_seqs, 1, 1 << 20)
        _check_range(s, "max_num_batched_tokens", self.max_num_batched_tokens, 1, 1 << 24)
        _check_range(s, "max_model_len", self.max_model_len, 2, 1 << 24)
        _check_range(s, "long_prefill_token_threshold", self.long_prefill_token_threshold, 0)
        _check_range(s, "max_num_encoder_tokens", self.max_num_encoder_tokens, 0)
        _check_range(s, "max_preemptions", self.max_preemptions, 0)
        _check_range(s, "max_waiting", self.max_waiting, 1)
        try:
            self.policy = QueuePolicy(self.policy)
        except ValueError:
            raise ConfigError(
                f"scheduler.policy = {self.policy!r}; expected one of "
                f"{[p.value for p in QueuePolicy]}"
            ) from None


@dataclass(slots=True)
class SpeculativeConfig:
    num_speculative_tokens: int = 0  # k: each decode step may verify k drafts (budget k + 1)

    def validate(self) -> None:
        _check_range("speculative", "num_speculative_tokens", self.num_speculative_tokens, 0, 64)


@dataclass(slots=True)
class StepCostConfig:
    """The seed of each instance's step-cost model (`kvsched.core.step_cost`) and how fast it
    forgets. Defaults: the H100-SXM / Llama-3-8B fit of the reference worker's sim executor
    (kvsched/worker_stub/costmodel.py, `FITS["h100"]`: max(6.3, 4.3 + 0.0211 N) ms + 4.9e-5 ms
    per decode context token + 1.8e-6 ms per unit of c * (c + prefix)), copied here because the
    core imports nothing of the worker. The model refits them from the measured steps."""

    intercept_ms: float = 4.3
    per_prefill_token_ms: float = 0.0211
    per_decode_ms: float = 0.0211
    per_decode_context_ms: float = 4.9e-5
    per_attention_ms: float = 1.8e-6  # per unit of sum over chunks of c * (c + prefix)
    # One block copied between host and GPU memory: a 16-token Llama-3-8B block is 2 MiB, ~0.04
    # ms at ~50 GB/s of PCIe (learned from the steps that swap, like the other terms).
    per_swapped_block_ms: float = 0.04
    # One block got from the shared storage tier (Mooncake Store): 2 MiB at ~20 GB/s (a
    # 200 Gb/s RDMA NIC), ~0.1 ms (learned from the steps that fetch).
    per_fetched_block_ms: float = 0.1
    # Weight of the past per measured step, (0, 1]: 0.999 remembers ~1,000 steps; 1 never forgets.
    forgetting: float = 0.999

    def validate(self) -> None:
        s = "step_cost"
        for name in (
            "intercept_ms",
            "per_prefill_token_ms",
            "per_decode_ms",
            "per_decode_context_ms",
            "per_attention_ms",
            "per_swapped_block_ms",
            "per_fetched_block_ms",
        ):
            _check_range(s, name, getattr(self, name), 0.0, 1e6)
        if not 0.0 < self.forgetting <= 1.0:
            raise ConfigError(f"step_cost.forgetting = {self.forgetting!r} must be in (0, 1]")

    def seed(self) -> tuple[float, ...]:
        """The coefficients in `kvsched.core.step_cost.FEATURES` order."""
        return (
            self.intercept_ms,
            self.per_prefill_token_ms,
            self.per_decode_ms,
            self.per_decode_context_ms,
            self.per_attention_ms,
            self.per_swapped_block_ms,
            self.per_fetched_block_ms,
        )


@dataclass(slots=True)
class FairnessConfig:
    """TTFT deadlines, tenants and shedding (the `slo` queue policy; see docs/ARCHITECTURE.md,
    scheduling rule 12)."""

    # Served-token share per tenant: a tenant with weight 3 gets three times the tokens of one
    # with weight 1 while both are backlogged. Tenants not listed weigh `default_weight`.
    tenant_weights: dict[str, float] = field(default_factory=dict)
    default_weight: float = 1.0
    # What a served output token costs a tenant's counter, relative to a prompt token.
    output_token_weight: float = 1.0
    # The deadline of a request that names none (ms after arrival): past it, its prompt goes
    # ahead of shorter ones (aging), so a long prompt is not overtaken for ever. Shorter
    # bounds TTFT p99 better and costs goodput and TTFT p50 (docs/BENCHMARKS.md section 8).
    default_ttft_deadline_ms: float = 8000.0
    # What happens to a request whose explicit deadline the cost model predicts it will miss.
    shed: ShedPolicy = ShedPolicy.OFF

    def validate(self) -> None:
        s = "fairness"
        for name, w in self.tenant_weights.items():
            if not isinstance(name, str) or not isinstance(w, (int, float)) or isinstance(w, bool):
                raise ConfigError(f"{s}.tenant_weights: {name!r} = {w!r}; expected a number")
            if not 1e-6 <= w <= 1e6:
                raise ConfigError(f"{s}.tenant_weights.{name} = {w!r} is out of range [1e-6, 1e6]")
        _check_range(s, "default_weight", self.default_weight, 1e-6, 1e6)
        _check_range(s, "output_token_weight", self.output_token_weight, 0.0, 1e6)
        _check_range(s, "default_ttft_deadline_ms", self.default_ttft_deadline_ms, 1.0, 3.6e9)
        try:
            self.shed = ShedPolicy(self.shed)
        except ValueError:
            raise ConfigError(
                f"fairness.shed = {self.shed!r}; expected one of {[p.value for p in ShedPolicy]}"
            ) from None

    def weight(self, tenant: str) -> float:
        return self.tenant_weights.get(tenant, self.default_weight)


@dataclass(slots=True)
class EngineConfig:
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    role: Role = Role.MIXED
    step_cost: StepCostConfig = field(default_factory=StepCostConfig)
    fairness: FairnessConfig = field(default_factory=FairnessConfig)

    def validate(self) -> EngineConfig:
        self.cache.validate()
        self.scheduler.validate()
        self.speculative.validate()
        self.step_cost.validate()
        self.fairness.validate()
        try:
            self.role = Role(self.role)
        except ValueError:
            raise ConfigError(
                f"role = {self.role!r}; expected one of {[r.value for r in Role]}"
            ) from None
        budget = self.scheduler.max_num_batched_tokens
        per_decode = 1 + self.speculative.num_speculative_tokens
        if budget < per_decode:
            raise ConfigError(
                f"scheduler.max_num_batched_tokens = {budget} must be >= 1 + "
                f"speculative.num_speculative_tokens = {per_decode}"
            )
        if self.scheduler.disable_chunked_prefill and budget < self.scheduler.max_model_len:
            raise ConfigError(
                "scheduler.disable_chunked_prefill needs scheduler.max_num_batched_tokens "
                f"({budget}) >= scheduler.max_model_len ({self.scheduler.max_model_len}), "
                "or a long prompt could never be admitted"
            )
        return self

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineConfig:
        """Build from nested plain data (a TOML table); unknown keys are errors."""
        sections: dict[str, Any] = {
            "cache": CacheConfig,
            "scheduler": SchedulerConfig,
            "speculative": SpeculativeConfig,
            "step_cost": StepCostConfig,
            "fairness": FairnessConfig,
        }
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if key == "role":
                kwargs["role"] = value
            elif key in sections:
                kwargs[key] = _section(sections[key], key, value)
            else:
                raise ConfigError(f"unknown config key {key!r}; expected role or {list(sections)}")
        return cls(**kwargs).validate()


def _section(kind: Any, name: str, values: dict[str, Any]) -> Any:
    known = {f.name: f for f in fields(kind)}
    for key, value in values.items():
        if key not in known:
            raise ConfigError(f"unknown key {name}.{key}; known: {sorted(known)}")
        default = getattr(kind(), key)
        if isinstance(default, Enum):
            expected: type | tuple[type, ...] = str
        elif isinstance(default, float):
            expected = (int, float)
        else:
            expected = type(default)
        if isinstance(default, bool) != isinstance(value, bool) or not isinstance(value, expected):
            raise ConfigError(
                f"{name}.{key} = {value!r} has type {type(value).__name__}; "
                f"expected {type(default).__name__}"
            )
    return kind(**values)
