"""Shared prefixes over two engine instances (issue 33, workload c): kvsched (one daemon, two vLLM
workers, `kvsched http`) against two vLLM gRPC engine servers behind smg's `cache_aware` policy,
on the same tiny model, in alternating rounds; goodput at a TTFT target.

    VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python -m bench.serve_prefix [--rounds 3]
        [--request-rate 30] [--num-prompts 160] [--ttft-ms 500] [--prefix-len 512]
        [--suffix-len 64] [--num-prefixes 8] [--output-len 32]
        [--json bench/results/serve_prefix.json]

Both stacks run at once (each idle while the other is measured), started the same way as
bench.gateway_serve's:

    kvsched    kvsched serve (max_model_len 1024) + 2 x kvsched worker --executor vllm (v0, v1)
               + kvsched http: the daemon routes each request (prefix-cache aware)
    smg-vllm   2 x python -m vllm.entrypoints.launchers.grpc_server (block size 32, KV events
               off) + smg launch --policy cache_aware --worker-urls grpc://a grpc://b

Client: vLLM's serving benchmark, dataset `prefix_repetition` (num_prefixes prefixes of
prefix_len tokens, each prompt one of them plus suffix_len tokens of its own), Poisson arrivals
at --request-rate, /v1/completions, --ignore-eos, `--goodput ttft:MS`: requests per second
whose TTFT met the target. Prints each round and the medians; writes the JSON with the load
average before and after each run (figures from a shared machine are noisy).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.serve_procs import Procs, free_port, running, wait_http
from bench.vllm_serve import NAME, wait_ready

REPO = Path(__file__).resolve().parent.parent
STACKS = ("kvsched", "smg-vllm")
SHOWN = [
    ("goodput req/s", "request_goodput", "{:.2f}"),
    ("req/s", "request_throughput", "{:.2f}"),
    ("out tok/s", "output_throughput", "{:,.0f}"),
    ("TTFT p50", "p50_ttft_ms", "{:.0f}"),
    ("TTFT p99", "p99_ttft_ms", "{:.0f}"),
    ("ITL p99", "p99_itl_ms", "{:.1f}"),
]
_KVSCHED = [sys.executable, "-m", "kvsched.cli"]


def start_kvsched(procs: Procs, model_dir: Path) -> str:
    daemon = f"127.0.0.1:{free_port()}"
    procs.start(
        "kvsched_daemon",
        [*_KVSCHED, "serve", "--listen", daemon, "--metrics-listen", "off"],
        {"KVSCHED_ENGINE__SCHEDULER__MAX_MODEL_LEN": "1024", "KVSCHED_MODEL": NAME},
    )
    for inst in ("v0", "v1"):
        procs.start(
            f"kvsched_worker_{inst}",
            [*_KVSCHED, "worker", "--server", daemon, "--instance", inst, "--executor", "vllm"]
            + ["--model", str(model_dir), "--dtype", "float32", "--max-model-len", "1024"]
            + ["--served-model-name", NAME],
        )
    wait_ready(procs, daemon)
    url = f"http://127.0.0.1:{free_port()}"
    procs.start(
        "kvsched_http",
        [*_KVSCHED, "http", "--listen", url.removeprefix("http://"), "--server", daemon]
        + ["--model", str(model_dir), "--served-model-name", NAME, "--log-level", "warning"],
    )
    wait_http(procs, f"{url}/v1/models", want='"ready_instances":2')
    return url


def start_smg_vllm(procs: Procs, model_dir: Path) -> str:
    workers = []
    for i in range(2):
        port = free_port()
        procs.start(
            f"vllm_grpc_server_{i}",
            [sys.executable, "-m", "vllm.entrypoints.launchers.grpc_server"]
            + ["--host", "127.0.0.1", "--port", str(port), "--model", str(model_dir)]
            + ["--dtype", "float32", "--max-model-len", "1024", "--block-size", "32"]
            + ["--served-model-name", NAME],
            {"SMG_VLLM_SERVICER_KV_EVENTS": "0"},
        )
        workers.append(f"grpc://127.0.0.1:{port}")
    port = free_port()
    smg = Path(sys.executable).parent / "smg"
    procs.start(
        "smg",
        [str(smg), "launch", "--host", "127.0.0.1", "--port", str(port)]
        + ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        + ["--log-level", "warn", "--policy", "cache_aware", "--worker-urls", *workers],
    )
    return f"http://127.0.0.1:{port}"


def bench(url: str, model_dir: Path, a: argparse.Namespace, num_prompts: int) -> dict[str, Any]:
    """One run of vLLM's serving benchmark on the prefix_repetition dataset."""
    from vllm.benchmarks import serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    serve.add_cli_args(parser)
    args = parser.parse_args(
        ["--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions"]
        + ["--model", NAME, "--tokenizer", str(model_dir)]
        + ["--dataset-name", "prefix_repetition"]
        + ["--prefix-repetition-prefix-len", str(a.prefix_len)]
        + ["--prefix-repetition-suffix-len", str(a.suffix_len)]
        + ["--prefix-repetition-num-prefixes", str(a.num_prefixes)]
        + ["--prefix-repetition-output-len", str(a.output_len)]
        + ["--num-prompts", str(num_prompts), "--request-rate", str(a.request_rate)]
        + ["--max-concurrency", str(a.max_concurrency), "--ignore-eos"]
        + ["--goodput", f"ttft:{a.ttft_ms}", "--percentile-metrics", "ttft,itl,e2el"]
        + ["--metric-percentiles", "50,99", "--seed", "0", "--disable-tqdm"]
    )
    load = os.getloadavg()[0]
    result: dict[str, Any] = serve.main(args)
    keep = ("completed", "failed", "duration", "total_output_tokens", "total_input_tokens")
    out = {k: result[k] for k in keep if k in result}
    out |= {key: result.get(key) for _, key, _ in SHOWN}
    return out | {"load_before": load, "load_after": os.getloadavg()[0]}


def summary(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, list[float]]]:
    """Per stack and figure: [median, min, max] over the rounds."""
    out: dict[str, dict[str, list[float]]] = {}
    for stack in STACKS:
        out[stack] = {}
        for _, key, _ in [*SHOWN, ("load", "load_before", "")]:
            vals = [r[stack][key] for r in rounds if r[stack].get(key) is not None]
            if vals:
                out[stack][key] = [statistics.median(vals), min(vals), max(vals)]
    return out


def print_table(s: dict[str, dict[str, list[float]]]) -> None:
    head = ["stack", *[h for h, _, _ in SHOWN], "load"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for stack in STACKS:
        cells = []
        for _, key, fmt in [*SHOWN, ("load", "load_before", "{:.1f}")]:
            m = s[stack].get(key)
            cells.append("-" if m is None else f"{fmt.format(m[0])} [{fmt.format(m[1])}-"
                         f"{fmt.format(m[2])}]")  # fmt: skip
        print("| " + " | ".join([stack, *cells]) + " |")
    k, v = s["kvsched"], s["smg-vllm"]
    ratios = [
        f"{h} x{k[key][0] / v[key][0]:.2f}"
        for h, key, _ in SHOWN
        if key in k and key in v and v[key][0]
    ]
    print("kvsched / smg-vllm (medians): " + ", ".join(ratios))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--request-rate", type=float, default=30.0)
    p.add_argument("--max-concurrency", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=160)
    p.add_argument("--ttft-ms", type=float, default=500.0, help="the goodput's TTFT target")
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--num-prefixes", type=int, default=8)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--json", default=str(REPO / "bench/results/serve_prefix.json"))
    a = p.parse_args(argv)
    from kvsched.tinymodel.model import make_model
    from kvsched.tinymodel.tokenizer import make_tokenizer

    work = Path(tempfile.mkdtemp(prefix="kvsched-serve-prefix-"))
    model_dir = make_model(work / "tiny-llama")
    make_tokenizer(model_dir)
    print(f"model and logs in {work}", flush=True)
    started = time.time()
    rounds: list[dict[str, dict[str, Any]]] = []
    with running(work) as procs:
        urls = {
            "kvsched": start_kvsched(procs, model_dir),
            "smg-vllm": start_smg_vllm(procs, model_dir),
        }
        for url in urls.values():
            wait_http(procs, f"{url}/v1/models", want=f'"id":"{NAME}"')
        for stack, url in urls.items():
            print(f"warm-up: {stack}", flush=True)
            bench(url, model_dir, a, 16)
        for i in range(a.rounds):
            order = STACKS if i % 2 == 0 else STACKS[::-1]
            got = {s: bench(urls[s], model_dir, a, a.num_prompts) for s in order}
            rounds.append(got)
            print(f"round {i}: " + ", ".join(
                f"{s} goodput {got[s]['request_goodput']:.2f} req/s" for s in order), flush=True)  # fmt: skip
    s = summary(rounds)
    print_table(s)
    doc = {
        "command": "python -m bench.serve_prefix "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": f"{os.cpu_count()} cores, shared (noisy)",
        "model": "kvsched.tinymodel: Llama, 2 layers, hidden 128, vocab 512, float32",
        "args": vars(a),
        "wall_s": round(time.time() - started, 1),
        "rounds": rounds,
        "summary": s,
    }
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
