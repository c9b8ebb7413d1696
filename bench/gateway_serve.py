"""smg in front of kvsched vs smg in front of vLLM's own gRPC engine server, on the same tiny
model, measured by vLLM's own serving benchmark through the gateway, in alternating rounds.

    make bench-gateway     (installs the gateway-bench extra into .venv-vllm, then:)
    .venv-vllm/bin/python -m bench.gateway_serve [--rounds 5] [--concurrency 16]
        [--num-prompts 200] [--input-len 128] [--output-len 64]
        [--json bench/results/gateway_serve.json]

Both stacks run at once (each idle while the other is measured), each behind its own smg
(`smg launch`, the `gateway` extra):

    kvsched    kvsched serve --tokenizer DIR (max_model_len 1024) + kvsched worker --executor
               vllm --model DIR --dtype float32 --served-model-name tiny; smg -> the daemon
    vllm-grpc  python -m vllm.entrypoints.launchers.grpc_server --model DIR --dtype float32
               --max-model-len 1024 --block-size 32 --served-model-name tiny
               (smg-grpc-servicer, KV events off); smg -> that server

One round runs the benchmark (random dataset, /v1/completions, --ignore-eos, the given
--max-concurrency) on each stack, the order alternating round by round, after one warm-up run
each. Prints every round and the medians; writes the JSON. Figures from a shared machine are
noisy: the JSON records the load average before and after. `--profile`: one more kvsched round
with its processes under py-spy (own samples per function, and the daemon's share in the
gateway servicer, server/gateway/).
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

from bench.serve_procs import Procs, free_port, profiling, running, summarize, wait_http
from bench.vllm_serve import METRICS, NAME, bench, wait_ready

REPO = Path(__file__).resolve().parent.parent
STACKS = ("kvsched", "vllm-grpc")


def smg_argv(port: int, worker: str) -> list[str]:
    smg = Path(sys.executable).parent / "smg"
    return [
        str(smg), "launch", "--host", "127.0.0.1", "--port", str(port),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
        "--log-level", "warn", "--worker-urls", f"grpc://{worker}",
    ]  # fmt: skip


def start_kvsched(procs: Procs, model_dir: Path) -> str:
    """Daemon + vLLM worker + smg; the gateway's URL once it lists the model."""
    daemon = f"127.0.0.1:{free_port()}"
    kvsched = [sys.executable, "-m", "kvsched.cli"]
    procs.start(
        "kvsched_daemon",
        [*kvsched, "serve", "--listen", daemon, "--metrics-listen", "off"]
        + ["--tokenizer", str(model_dir)],
        {"KVSCHED_ENGINE__SCHEDULER__MAX_MODEL_LEN": "1024", "KVSCHED_MODEL": NAME},
    )
    procs.start(
        "kvsched_worker",
        [*kvsched, "worker", "--server", daemon, "--instance", "v0", "--executor", "vllm"]
        + ["--model", str(model_dir), "--dtype", "float32", "--max-model-len", "1024"]
        + ["--served-model-name", NAME],
    )
    wait_ready(procs, daemon)  # smg registers an engine that answers healthy
    port = free_port()
    procs.start("kvsched_smg", smg_argv(port, daemon))
    return f"http://127.0.0.1:{port}"


def start_vllm_grpc(procs: Procs, model_dir: Path) -> str:
    """vLLM's gRPC engine server + smg; the gateway's URL."""
    grpc_port = free_port()
    procs.start(
        "vllm_grpc_server",
        [sys.executable, "-m", "vllm.entrypoints.launchers.grpc_server"]
        + ["--host", "127.0.0.1", "--port", str(grpc_port), "--model", str(model_dir)]
        + ["--dtype", "float32", "--max-model-len", "1024", "--block-size", "32"]
        + ["--served-model-name", NAME],
        {"SMG_VLLM_SERVICER_KV_EVENTS": "0"},
    )
    port = free_port()
    procs.start("vllm_grpc_smg", smg_argv(port, f"127.0.0.1:{grpc_port}"))
    return f"http://127.0.0.1:{port}"


def stack_share(path: Path, needle: str) -> tuple[int, int]:
    """(samples whose stack passes through a frame containing `needle`, all samples)."""
    hit = total = 0
    if path.exists():
        for line in path.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if stack and count.isdigit():
                total += int(count)
                hit += int(count) if needle in stack else 0
    return hit, total


def profile_kvsched(procs: Procs, work: Path, url: str, model_dir: Path, a: Any) -> dict[str, Any]:
    """One more kvsched round, its three processes sampled by py-spy."""
    mine = Procs(work)
    mine.procs = [(n, p) for n, p in procs.procs if n.startswith("kvsched_")]
    with profiling(mine, work):
        bench(url, model_dir, a.concurrency, a)
    out: dict[str, Any] = {}
    for name, _ in mine.procs:
        print(f"--- {name}: where the samples are (py-spy, own time) ---")
        print(summarize(work / f"{name}.pyspy"))
        out[name] = stack_share(work / f"{name}.pyspy", "")[1]
    hit, total = stack_share(work / "kvsched_daemon.pyspy", "server/gateway/")
    print(f"daemon samples in server/gateway/: {hit} of {total}")
    out["daemon_in_gateway_servicer"] = hit
    return out


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def print_rounds(rounds: list[dict[str, dict[str, Any]]]) -> None:
    head = f"{'round':>5} {'stack':<10}" + "".join(f"{h:>13}" for h, _, _ in METRICS)
    print(head)
    for i, r in enumerate(rounds):
        for stack in STACKS:
            res = r[stack]
            cells = "".join(
                f"{(fmt.format(res[k]) if res.get(k) is not None else '-'):>13}"
                for _, k, fmt in METRICS
            )
            print(f"{i:>5} {stack:<10}{cells}")


def medians(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for stack in STACKS:
        out[stack] = {
            k: statistics.median(r[stack][k] for r in rounds)
            for _, k, _ in METRICS
            if all(r[stack].get(k) is not None for r in rounds)
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--json", default=str(REPO / "bench/results/gateway_serve.json"))
    p.add_argument("--profile", action="store_true", help="one more kvsched round under py-spy")
    a = p.parse_args(argv)
    from kvsched.tinymodel.model import make_model
    from kvsched.tinymodel.tokenizer import make_tokenizer

    work = Path(tempfile.mkdtemp(prefix="kvsched-gateway-serve-"))
    model_dir = make_model(work / "tiny-llama")
    make_tokenizer(model_dir)
    print(f"model and logs in {work}", flush=True)
    started, load_before = time.time(), loadavg()
    rounds: list[dict[str, dict[str, Any]]] = []
    with running(work) as procs:
        urls = {"kvsched": start_kvsched(procs, model_dir)}
        urls["vllm-grpc"] = start_vllm_grpc(procs, model_dir)
        for url in urls.values():
            wait_http(procs, f"{url}/v1/models", want=f'"id":"{NAME}"')
        warm = argparse.Namespace(**{**vars(a), "num_prompts": 32})
        for stack, url in urls.items():
            print(f"warm-up: {stack}", flush=True)
            bench(url, model_dir, a.concurrency, warm)
        for i in range(a.rounds):
            order = STACKS if i % 2 == 0 else STACKS[::-1]
            got = {s: bench(urls[s], model_dir, a.concurrency, a) for s in order}
            rounds.append(got)
            print(
                f"round {i}: "
                + ", ".join(f"{s} {got[s]['output_throughput']:,.0f} out tok/s" for s in order),
                flush=True,
            )
        profile = profile_kvsched(procs, work, urls["kvsched"], model_dir, a) if a.profile else {}
    print_rounds(rounds)
    med = medians(rounds)
    ratio = med["kvsched"]["output_throughput"] / med["vllm-grpc"]["output_throughput"]
    print(f"medians: {json.dumps(med)}\nkvsched / vllm-grpc output tok/s: {ratio:.3f}")
    doc = {
        "command": "python -m bench.gateway_serve "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": f"{os.cpu_count()} cores, shared (noisy)",
        "load_average_before": load_before,
        "load_average_after": loadavg(),
        "model": "kvsched.tinymodel: Llama, 2 layers, hidden 128, vocab 512, float32",
        "benchmark": {
            "dataset": "random",
            "endpoint": "/v1/completions through smg 1.13.0",
            "input_len": a.input_len,
            "output_len": a.output_len,
            "num_prompts": a.num_prompts,
            "max_concurrency": a.concurrency,
            "ignore_eos": True,
        },
        "wall_s": round(time.time() - started, 1),
        "rounds": rounds,
        "medians": med,
        "ratio_output_throughput": round(ratio, 3),
        "profile_samples": profile,
    }
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
