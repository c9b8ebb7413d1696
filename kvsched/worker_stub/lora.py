"""A worker's LoRA adapters and adapter slots, as vLLM's server takes them on its command line
(`--lora-modules NAME=PATH ...`, `--max-loras`, `--max-cpu-loras`, `--max-lora-rank`), and what
its Hello announces of them (`Hello.lora_adapters`, `max_loras`, `max_cpu_loras`).

The sim and model executors announce the adapters they are given and compute nothing different
for them (the daemon's scheduling is what they test); the vllm executor loads and applies them
(`worker_vllm/lora.py`).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoraSlots:
    """Adapters (name, path) this worker can load and its slots: `max_loras` distinct adapters
    per step, `max_cpu_loras` kept loaded in host memory, ranks up to `max_lora_rank`."""

    adapters: tuple[tuple[str, str], ...] = ()
    max_loras: int = 0
    max_cpu_loras: int = 0
    max_lora_rank: int = 16

    def path_of(self, name: str) -> str | None:
        return next((p for n, p in self.adapters if n == name), None)


def parse_lora_modules(entries: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """`--lora-modules` entries NAME=PATH as (name, path) pairs; ValueError naming the flag on
    a malformed or repeated one."""
    got: list[tuple[str, str]] = []
    for entry in entries:
        name, sep, path = entry.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {entry!r}: expected NAME=PATH")
        if any(n == name for n, _ in got):
            raise ValueError(f"--lora-modules: adapter name {name!r} is given twice")
        got.append((name, path))
    return tuple(got)


def lora_slots_from_args(args: argparse.Namespace) -> LoraSlots:
    """The worker's LoraSlots from `kvsched worker`'s flags (vLLM's defaults: max_loras 1,
    max_cpu_loras = max_loras, max_lora_rank 16); ValueError naming the flag."""
    adapters = parse_lora_modules(getattr(args, "lora_modules", None) or [])
    if not adapters:
        return LoraSlots()
    max_loras = getattr(args, "max_loras", 1)
    max_cpu = getattr(args, "max_cpu_loras", 0) or max_loras
    rank = getattr(args, "max_lora_rank", 16)
    if not 1 <= max_loras <= 1 << 16:
        raise ValueError(f"--max-loras must be in [1, 65536], got {max_loras}")
    if max_cpu < max_loras:
        raise ValueError(f"--max-cpu-loras ({max_cpu}) must be >= --max-loras ({max_loras})")
    if rank < 1:
        raise ValueError(f"--max-lora-rank must be >= 1, got {rank}")
    return LoraSlots(adapters, max_loras, max_cpu, rank)
