"""`kvsched worker`: its arguments, registered into kvsched's CLI by `add_worker_parser` (every
option's help says its default). Imports nothing heavy: the executors load when the command runs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


def add_worker_parser(
    sub: Any, default_server: str, log_levels: tuple[str, ...], func: Callable[..., int]
) -> None:
    """Register `kvsched worker`; `func` runs it."""
    p = sub.add_parser("worker", help="run a reference GPU worker", description="Run a worker.")
    p.add_argument(
        "--server",
        default=default_server,
        metavar="HOST:PORT[,HOST:PORT...]",
        help="the daemon, or a cluster's daemons (tried in order; a daemon that does not own "
        "the instance redirects the worker to the one that does)",
    )
    p.add_argument("--instance", default="i0", metavar="ID", help="instance id")
    p.add_argument("--rank", type=int, default=0, help="tensor-parallel rank of this process")
    p.add_argument(
        "--world-size", type=int, default=1, help="tensor-parallel ranks of the instance"
    )
    p.add_argument(
        "--executor",
        choices=("sim", "model", "vllm"),
        default="sim",
        help="sim: a simulated GPU (fitted step times); model: a small seeded transformer "
        "that really computes (numpy or Paddle); vllm: vLLM's model runner on --model (the "
        "`vllm` extra: pip install 'kvsched[vllm]')",
    )
    p.add_argument("--model", default="", metavar="DIR", help="vllm: the model directory")
    p.add_argument(
        "--dtype", default="auto", help="vllm: weights and activations (auto, float32, ...)"
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=8192,
        metavar="N",
        help="vllm: most tokens in one step (the daemon's scheduler budget must not exceed it)",
    )
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=0,
        metavar="K",
        help="vllm: build vLLM's runner to verify up to K draft tokens per step (its "
        "spec-decode path and rejection sampler); the daemon's engine.speculative."
        "num_speculative_tokens must not exceed it (0: no speculative decoding)",
    )
    p.add_argument(
        "--draft-model",
        default="",
        metavar="DIR",
        help="vllm: propose the drafts with this smaller model of the same vocabulary, run by "
        "vLLM's draft-model proposer in the same runner (needs --num-speculative-tokens; "
        'default "": the engine\'s ngram prompt lookup)',
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters this worker can load, announced in its Hello (vLLM's flag): a "
        "request naming NAME (GenerateRequest.lora_name, or model = NAME) runs with it; vllm "
        "loads PATH (a PEFT adapter directory), sim and model only announce it",
    )
    p.add_argument(
        "--max-loras",
        type=int,
        default=1,
        metavar="N",
        help="distinct LoRA adapters one step may run (vLLM's max_loras; the daemon places "
        "requests of at most N adapters at once)",
    )
    p.add_argument(
        "--max-cpu-loras",
        type=int,
        default=0,
        metavar="N",
        help="vllm: LoRA adapters kept loaded in host memory, least recently used evicted "
        "(vLLM's max_cpu_loras; default: --max-loras)",
    )
    p.add_argument(
        "--max-lora-rank",
        type=int,
        default=16,
        metavar="R",
        help="vllm: the largest LoRA rank to load (vLLM's max_lora_rank)",
    )
    p.add_argument("--gpu", choices=("h100", "a100"), default="h100", help="sim cost model")
    p.add_argument("--speed", type=float, default=1.0, help="sim: step time divided by this")
    p.add_argument("--zero-cost", action="store_true", help="sim: steps take no time")
    p.add_argument(
        "--vocab-size",
        type=int,
        default=32000,
        help="sim: tokens drawn from [0, N) (a model's vocab)",
    )
    p.add_argument(
        "--num-blocks",
        type=int,
        default=0,
        help="KV blocks in the pool (default: sim, the --gpu profile's 40 GiB of Llama-3-8B KV: "
        "20,480 blocks of 16 tokens, 5,120 of 64, as `kvsched replay --embedded` gives; "
        "model: 4096; vllm: what vLLM's memory sizing finds, on CPU from "
        "VLLM_CPU_KVCACHE_SPACE, 1 GiB unless set)",
    )
    p.add_argument(
        "--host-blocks", type=int, default=0, help="KV blocks of the host-memory tier (0: none)"
    )
    p.add_argument(
        "--pcie-gbps", type=float, default=50.0, help="sim: host tier copy bandwidth, GB/s"
    )
    p.add_argument(
        "--storage-gbps",
        type=float,
        default=12.5,
        help="sim: storage tier transfer bandwidth, GB/s (12.5: one 100 Gb/s RDMA NIC; the "
        "model executor moves real bytes through the store the daemon names)",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=0,
        help="tokens per KV block (default 16; vllm: what its attention backend needs, 32 on CPU)",
    )
    p.add_argument(
        "--served-model-name",
        default="",
        metavar="NAME",
        help="the model this instance serves, as GenerateRequest.model names it "
        '(default "": the daemon\'s configured model)',
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=0,
        metavar="N",
        help="prompt + output tokens announced to the daemon (default 0: the executor's own "
        "limit: model 4096, sim none)",
    )
    p.add_argument("--num-slots", type=int, default=256, help="concurrent requests")
    p.add_argument("--seed", type=int, default=0, help="sim outputs / model weights seed")
    p.add_argument(
        "--crash-on-token",
        type=int,
        default=-1,
        metavar="ID",
        help="sim, fault injection: drop the stream and the engine (a crash) when a prefill "
        "carries this token id (-1: never)",
    )
    p.add_argument(
        "--crash-on-prompt-len",
        type=int,
        default=0,
        metavar="N",
        help="sim, fault injection: crash when a request with at least N prompt tokens is "
        "placed (0: never)",
    )
    p.add_argument(
        "--backend",
        choices=("auto", "numpy", "paddle"),
        default="auto",
        help="model executor's arrays (auto: Paddle when installed, else numpy)",
    )
    p.add_argument("--listen-kv", default="", metavar="HOST:PORT", help="accept KV pushes here")
    p.add_argument(
        "--reconnect-min-s",
        type=float,
        default=0.1,
        metavar="S",
        help="first reconnect delay after the stream to the daemon broke",
    )
    p.add_argument(
        "--reconnect-max-s",
        type=float,
        default=1.0,
        metavar="S",
        help="reconnect delays double up to this (1.0: a restarted daemon is found within "
        "about a second)",
    )
    p.add_argument(
        "--give-up-after",
        type=float,
        default=0.0,
        metavar="S",
        help="exit with status 1 when no daemon could be reached for S seconds (0: never)",
    )
    p.add_argument(
        "--token",
        default=os.environ.get("KVSCHED_TOKEN", ""),
        help="auth token (default: $KVSCHED_TOKEN)",
    )
    p.add_argument("--tls-ca", default="", metavar="FILE", help="CA that signed the server")
    p.add_argument("--tls-cert", default="", metavar="FILE", help="client certificate (mTLS)")
    p.add_argument("--tls-key", default="", metavar="FILE", help="client key (mTLS)")
    p.add_argument("--log-level", default="info", choices=log_levels, help="log threshold")
    p.add_argument("--log-json", action="store_true", help="JSON lines logs")
    p.set_defaults(func=func)
