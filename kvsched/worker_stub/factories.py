"""The engines a worker can run: what the daemon's Welcome fixes for them, and factories that
build one per session (a `SimExecutor` or a `PagedModelExecutor` under a `WorkerEngine`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvsched.worker_stub.costmodel import KV_BYTES_PER_TOKEN
from kvsched.worker_stub.engine import KvSender, WorkerEngine
from kvsched.worker_stub.faults import Faults, FaultyEngine
from kvsched.worker_stub.sim import STORAGE_GBPS, SimExecutor

_SIM_MAX_MODEL_LEN = 1 << 20  # the sim has no length limit of its own
SIM_VOCAB_SIZE = 32000  # SimExecutor's default vocabulary: the ids its outputs come from


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """What the daemon's Welcome fixes for the engine."""

    block_size: int
    num_speculative_tokens: int
    max_model_len: int  # 0: the executor's own limit


EngineFactory = Callable[[EngineSettings, KvSender], WorkerEngine]


def sim_engine_factory(
    num_slots: int,
    *,
    gpu: str = "h100",
    speed: float = 1.0,
    zero_cost: bool = False,
    seed: int = 0,
    eos_every: int | None = None,
    pcie_gbps: float = 50.0,
    vocab_size: int = SIM_VOCAB_SIZE,
    faults: Faults | None = None,
    storage_gbps: float = STORAGE_GBPS,
) -> EngineFactory:
    """Engines over a `SimExecutor`; the arguments are checked now, not after the Welcome.
    Host tier copies cost a block's bytes (the fitted model's, KV_BYTES_PER_TOKEN a token)
    over pcie_gbps GB/s, storage tier transfers over storage_gbps. `faults`: crash on the requests it names (worker_stub/faults.py)."""
    SimExecutor(
        gpu=gpu,
        speed=speed,
        zero_cost=zero_cost,
        seed=seed,
        eos_every=eos_every,
        pcie_gbps=pcie_gbps,
        vocab_size=vocab_size,
        storage_gbps=storage_gbps,
    )

    def build(settings: EngineSettings, kv_sender: KvSender) -> WorkerEngine:
        sim = SimExecutor(
            gpu=gpu,
            speed=speed,
            zero_cost=zero_cost,
            seed=seed,
            eos_every=eos_every,
            block_bytes=KV_BYTES_PER_TOKEN * settings.block_size,
            pcie_gbps=pcie_gbps,
            vocab_size=vocab_size,
            storage_gbps=storage_gbps,
        )
        engine = (FaultyEngine if faults else WorkerEngine)(
            sim,
            settings.block_size,
            num_slots,
            sim.eos_token_id,
            settings.max_model_len or _SIM_MAX_MODEL_LEN,
            settings.num_speculative_tokens,
            kv_sender=kv_sender,
            columnar=True,
        )
        if faults and isinstance(engine, FaultyEngine):
            engine.faults = faults
        return engine

    return build


def model_engine_factory(
    num_slots: int,
    num_blocks: int,
    *,
    seed: int = 0,
    backend: str = "numpy",
    num_host_blocks: int = 0,
) -> EngineFactory:
    """Engines over a `PagedModelExecutor` of `ModelConfig(seed=seed)`. Imports numpy (and
    Paddle for that backend) when called: set thread-count variables before."""
    from kvsched.worker_stub.model import ModelConfig, PagedModelExecutor, get_backend

    config = ModelConfig(seed=seed)
    array_backend = get_backend(backend, config.dtype)

    def build(settings: EngineSettings, kv_sender: KvSender) -> WorkerEngine:
        executor = PagedModelExecutor(
            config, num_blocks, settings.block_size, array_backend, num_host_blocks
        )
        max_model_len = min(settings.max_model_len or config.max_model_len, config.max_model_len)
        return WorkerEngine(
            executor,
            settings.block_size,
            num_slots,
            config.eos_token_id,
            max_model_len,
            settings.num_speculative_tokens,
            kv_sender=kv_sender,
        )

    return build
