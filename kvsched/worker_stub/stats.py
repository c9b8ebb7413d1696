"""The worker's counters, written by its session, step loop and KV pushes."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class WorkerStats:
    """Counters over the worker's life (all sessions). Times are wall seconds."""

    num_connects: int = 0
    num_steps: int = 0
    num_tokens: int = 0  # sampled tokens kept (every rank counts its own)
    num_reports: int = 0
    num_paused: int = 0  # report rows saying a slot waits for blocks
    num_heartbeats: int = 0
    num_tasks: int = 0
    tasks_digest: int = 0  # crc32 chained over each Tasks ConnectResponse's bytes, in order
    busy_s: float = 0.0  # in steps: compute (or simulated GPU time), KV pushes
    idle_s: float = 0.0  # nothing runnable
    idle_waiting_on_daemon_s: float = 0.0  # nothing runnable while holding a handle
    num_kv_pushes: int = 0
    num_kv_push_failures: int = 0
    num_kv_received: int = 0
    # KV pushes' cost (prefill role): blocks pushed, seconds reading them out of the executor's
    # cache (inside steps), and wall seconds of the pushes (the receiver's write included).
    num_kv_push_blocks: int = 0
    kv_export_s: float = 0.0
    kv_push_s: float = 0.0
    # Storage tier (worker_stub/storage_kv.py): wall seconds of real writes and fetches.
    storage_write_s: float = 0.0
    storage_fetch_s: float = 0.0
    num_draft_tokens: int = 0  # speculative drafts verified, and of them accepted
    num_accepted_drafts: int = 0
    num_prefill_tokens: int = 0  # prompt positions computed (chunks run; prefix hits are not)
    # Rows of steps launched ahead (worker_vllm/ahead.py): taken, deferred into one, run for
    # nothing (a request that stopped or was preempted meanwhile).
    num_rows_ahead: int = 0
    num_rows_deferred: int = 0
    num_rows_wasted: int = 0
    # Steps that ran LoRA adapters, by their number of distinct adapters (every step counted
    # as it ran), and those over the announced max_loras (the daemon's rule broken: 0).
    lora_steps: dict[int, int] = field(default_factory=dict)
    num_lora_steps_over: int = 0

    def lora_step(self, num_loras: int, max_loras: int) -> None:
        if num_loras:
            self.lora_steps[num_loras] = self.lora_steps.get(num_loras, 0) + 1
            if max_loras and num_loras > max_loras:
                self.num_lora_steps_over += 1

    @property
    def idle_frac_control_plane(self) -> float:
        """worker_idle_frac_control_plane: of the time the worker held work, the fraction it
        sat idle waiting only on the daemon (a chunk, a block extension, a KV reservation)."""
        active = self.busy_s + self.idle_waiting_on_daemon_s
        return self.idle_waiting_on_daemon_s / active if active else 0.0
