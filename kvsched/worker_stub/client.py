"""The reference worker: the `kvsched worker` command, and the names a program that runs a
worker in-process needs.

    session.py    Worker: the Connect stream to the daemon (hello, welcome, heartbeats,
                  reconnect with backoff); receives KV pushes into its inbox
    steps.py      StepLoop (Worker's base): apply Tasks at step boundaries, step the engine,
                  report, pace reports by the daemon's answers
    kv_push.py    KvPush: KV hand-off to and from peer workers (KvTransferService)
    factories.py  EngineSettings and the engine factories (sim, model)
    channels.py   gRPC options, channels, the advertised KV address
    stats.py      WorkerStats
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

from kvsched import event_loop, heap
from kvsched.tls import channel_credentials, worker_server_credentials
from kvsched.worker_stub.costmodel import KV_POOL_BYTES, default_num_blocks
from kvsched.worker_stub.factories import (
    SIM_VOCAB_SIZE,
    EngineFactory,
    EngineSettings,
    model_engine_factory,
    sim_engine_factory,
)
from kvsched.worker_stub.faults import Faults
from kvsched.worker_stub.lora import lora_slots_from_args
from kvsched.worker_stub.session import Worker, WorkerError
from kvsched.worker_stub.sim import STORAGE_GBPS
from kvsched.worker_stub.stats import WorkerStats

log = logging.getLogger(__name__)

_DEFAULT_NUM_BLOCKS = 4096  # the model executor (sim: its --gpu profile's; vllm: its own sizing)
_DEFAULT_BLOCK_SIZE = 16

__all__ = [
    "EngineFactory",
    "EngineSettings",
    "Worker",
    "WorkerError",
    "WorkerStats",
    "model_engine_factory",
    "run_worker",
    "sim_engine_factory",
    "worker_from_args",
]


def worker_from_args(args: argparse.Namespace) -> Worker:
    """A Worker configured from the CLI's arguments; ValueError / OSError on bad ones."""
    host_blocks = getattr(args, "host_blocks", 0)
    if host_blocks < 0:
        raise ValueError(f"--host-blocks must be >= 0, got {host_blocks}")
    max_model_len = getattr(args, "max_model_len", 0)
    max_logprobs = 0  # the sim and model executors report no log-probabilities
    if max_model_len < 0:
        raise ValueError(f"--max-model-len must be >= 0, got {max_model_len}")
    lora = lora_slots_from_args(args)
    if getattr(args, "draft_model", "") and args.executor != "vllm":
        raise ValueError("--draft-model: only --executor vllm runs a draft model")
    if lora.adapters and args.executor == "model":
        raise ValueError("--lora-modules: the model executor applies no LoRA adapters")
    structured_outputs = False  # Hello.structured_outputs: only vLLM's backend applies grammars
    multimodal = True  # Hello.multimodal: the sim prices items, the model executor encodes them
    if args.executor == "sim":
        vocab_size = getattr(args, "vocab_size", SIM_VOCAB_SIZE)  # announced in Hello too
        if not args.num_blocks:  # the --gpu profile's KV memory, as `replay --embedded` gives
            block_size = args.block_size or _DEFAULT_BLOCK_SIZE
            args.num_blocks = default_num_blocks(args.gpu, block_size)
            log.info(
                "sim pool: %d blocks of %d tokens (%s: %d GiB of Llama-3-8B KV; --num-blocks "
                "to change)",
                args.num_blocks,
                block_size,
                args.gpu,
                KV_POOL_BYTES[args.gpu] >> 30,
            )
        factory = sim_engine_factory(
            args.num_slots,
            gpu=args.gpu,
            speed=args.speed,
            zero_cost=args.zero_cost,
            seed=args.seed,
            pcie_gbps=getattr(args, "pcie_gbps", 50.0),
            storage_gbps=getattr(args, "storage_gbps", STORAGE_GBPS),
            vocab_size=vocab_size,
            faults=Faults(
                getattr(args, "crash_on_token", -1), getattr(args, "crash_on_prompt_len", 0)
            ),
        )
    elif args.executor == "vllm":
        from kvsched.worker_vllm.cli import vllm_factory_from_args

        factory, facts = vllm_factory_from_args(args, lora)
        vocab_size = facts.vocab_size
        max_model_len = facts.max_model_len
        structured_outputs = facts.structured_outputs
        multimodal = False  # no encoder inputs reach vLLM's runner: refused by the daemon
        max_logprobs = facts.max_logprobs
        args.num_blocks, args.block_size = facts.num_blocks, facts.block_size
        args.served_model_name = getattr(args, "served_model_name", "") or facts.model_name
    elif args.executor == "model":
        from kvsched.worker_stub.model import ModelConfig

        model_config = ModelConfig(seed=args.seed)  # what the factory builds: its real limits
        vocab_size = model_config.vocab_size
        own = model_config.max_model_len
        max_model_len = min(max_model_len, own) if max_model_len else own
        factory = model_engine_factory(
            args.num_slots,
            args.num_blocks or _DEFAULT_NUM_BLOCKS,
            seed=args.seed,
            backend=args.backend,
            num_host_blocks=host_blocks,
        )
    else:
        raise ValueError(f"executor must be 'sim', 'model' or 'vllm', got {args.executor!r}")
    ca, cert, key = args.tls_ca or "", args.tls_cert or "", args.tls_key or ""
    credentials = channel_credentials(ca, cert, key)
    kv_server_credentials = worker_server_credentials(cert, key)
    return Worker(
        args.server,
        args.instance,
        factory,
        rank=args.rank,
        world_size=args.world_size,
        num_gpu_blocks=args.num_blocks or _DEFAULT_NUM_BLOCKS,
        num_host_blocks=host_blocks,
        block_size=args.block_size or _DEFAULT_BLOCK_SIZE,
        num_slots=args.num_slots,
        executor_name=args.executor,
        model=getattr(args, "served_model_name", ""),
        max_model_len=max_model_len,
        vocab_size=vocab_size,
        structured_outputs=structured_outputs,
        multimodal=multimodal,
        max_logprobs=max_logprobs,
        channel_credentials=credentials,
        metadata=(("authorization", f"Bearer {args.token}"),) if args.token else (),
        kv_listen=args.listen_kv or None,
        kv_server_credentials=kv_server_credentials,
        kv_token=args.token or None,
        reconnect_backoff_s=_backoff(args),
        give_up_after_s=getattr(args, "give_up_after", 0.0),
        lora=lora,
    )


def _backoff(args: argparse.Namespace) -> tuple[float, float]:
    lo = getattr(args, "reconnect_min_s", 0.1)
    hi = getattr(args, "reconnect_max_s", 1.0)
    if not 0 < lo <= hi:
        raise ValueError(f"need 0 < --reconnect-min-s <= --reconnect-max-s, got {lo:g} and {hi:g}")
    return (lo, hi)


def run_worker(args: argparse.Namespace) -> int:
    """`kvsched worker`: connect and serve until the daemon ends the stream or SIGTERM/SIGINT
    (exit 0); exit 1 when the daemon refuses the worker, 2 on bad arguments."""
    # One BLAS thread per process: two numpy workers on two cores otherwise run ~15x slower.
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    logging.basicConfig(
        level=str(args.log_level).upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        worker = worker_from_args(args)
    except (ValueError, OSError) as e:
        log.error("bad worker arguments: %s", e)
        return 2
    try:
        loop_factory = event_loop.factory()
    except ValueError as e:
        log.error("%s", e)
        return 2
    heap.freeze_after_start()  # (the model, when it runs here, is built by now)
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(_serve(worker))


async def _serve(worker: Worker) -> int:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.stop)
    # SIGUSR1: log the counters so far (benchmarks read them before and after a run)
    loop.add_signal_handler(signal.SIGUSR1, _log_stats, worker)
    log.info("event loop: %s", event_loop.name())
    try:
        await worker.run()
    except WorkerError as e:
        log.error("%s", e)
        return 1
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            loop.remove_signal_handler(sig)
        _log_stats(worker)
    return 0


def _log_stats(worker: Worker) -> None:
    s = worker.stats
    log.info(
        "worker stats: %d steps, %d tokens, %d prompt tokens computed, %d paused, %d reports, "
        "busy %.3f s, idle %.3f s (%.3f s waiting on the daemon, idle_frac_control_plane "
        "%.3f), %d connects, %d tasks messages, tasks digest %08x, KV pushes %d (%d failed), "
        "received %d, drafts %d, accepted %d, KV pushed %d blocks in %.3f s (export %.3f s), "
        "LoRA steps by adapters %s (%d over max_loras %d), storage writes %.3f s, "
        "fetches %.3f s, rows of steps launched ahead %d (deferred %d, run for nothing %d)",
        s.num_steps,
        s.num_tokens,
        s.num_prefill_tokens,
        s.num_paused,
        s.num_reports,
        s.busy_s,
        s.idle_s,
        s.idle_waiting_on_daemon_s,
        s.idle_frac_control_plane,
        s.num_connects,
        s.num_tasks,
        s.tasks_digest,
        s.num_kv_pushes,
        s.num_kv_push_failures,
        s.num_kv_received,
        s.num_draft_tokens,
        s.num_accepted_drafts,
        s.num_kv_push_blocks,
        s.kv_push_s,
        s.kv_export_s,
        dict(sorted(s.lora_steps.items())),
        s.num_lora_steps_over,
        worker.max_loras,
        s.storage_write_s,
        s.storage_fetch_s,
        s.num_rows_ahead,
        s.num_rows_deferred,
        s.num_rows_wasted,
    )
