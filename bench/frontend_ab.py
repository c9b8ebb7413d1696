"""The control plane alone, two versions of kvsched side by side: `kvsched http` + daemon + sim
worker (no model: steps take the sim's cost-model time / --speed), started from two source
trees in alternating rounds, driven by vLLM's serving benchmark through HTTP. What it isolates:
the front end's and the daemon's cost per request and per token (e.g. one Generate call per
request against one Session stream per front end), without vLLM's engine, so it needs no vLLM
lock and no model weights.

    git archive main | tar -x -C /tmp/kvsched-main      # the "before" tree
    .venv-vllm/bin/python -m bench.frontend_ab --trees before=/tmp/kvsched-main,after=. \\
        [--concurrency 16,64] [--rounds 3] [--speed 4] [--json bench/results/frontend_ab.json]

Each stack's processes run from their tree (cwd and PYTHONPATH), one process group each; per
run: the benchmark's figures (random 128 in / 64 out, --ignore-eos, 4c prompts in [16, 128]),
(--num-prompts, default 4c in [16, 128]), the 1-minute load average before, CPU seconds (user + sys, children included) of each process
per 1,000 output tokens. The summary: per tree and concurrency the median [min-max] over the
rounds; after / before of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.serve_procs import Procs, free_port, wait_http
from bench.serve_stacks import _cpu_by_session
from bench.vllm_serve import NAME, bench

REPO = Path(__file__).resolve().parent.parent
SHOWN = [
    ("out tok/s", "output_throughput", "{:,.0f}"),
    ("TTFT p50", "p50_ttft_ms", "{:.0f}"),
    ("TTFT p99", "p99_ttft_ms", "{:.0f}"),
    ("ITL p99", "p99_itl_ms", "{:.1f}"),
    ("CPU s/1k tok", "cpu_s_per_1k", "{:.2f}"),
    ("http s/1k", "http_s_per_1k", "{:.2f}"),
    ("daemon s/1k", "daemon_s_per_1k", "{:.2f}"),
    ("load", "load_before", "{:.1f}"),
]


class TreeProcs(Procs):
    """Procs whose children run from another source tree."""

    def __init__(self, log_dir: Path, tree: Path) -> None:
        super().__init__(log_dir)
        self.tree = tree

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        log = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115 (kept open for the child)
        full = {**os.environ, "PYTHONPATH": str(self.tree), "PYTHONDONTWRITEBYTECODE": "1"}
        p = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**full, **(env or {})},
            cwd=self.tree,
            start_new_session=True,
        )
        self.procs.append((name, p))


def start(procs: TreeProcs, model_dir: Path, speed: float, extra: list[str]) -> str:
    kvsched = [sys.executable, "-m", "kvsched.cli"]
    daemon = f"127.0.0.1:{free_port()}"
    procs.start(
        "daemon",
        [*kvsched, "serve", "--listen", daemon, "--metrics-listen", "off"],
        {"KVSCHED_ENGINE__SCHEDULER__MAX_MODEL_LEN": "1024", "KVSCHED_MODEL": NAME},
    )
    procs.start(
        "worker",
        [*kvsched, "worker", "--server", daemon, "--instance", "s0", "--executor", "sim"]
        + ["--vocab-size", "512", "--speed", str(speed), "--served-model-name", NAME],
    )
    url = f"http://127.0.0.1:{free_port()}"
    procs.start(
        "http",
        [*kvsched, "http", "--listen", url.removeprefix("http://"), "--server", daemon]
        + ["--model", str(model_dir), "--served-model-name", NAME, "--log-level", "warning"]
        + extra,
    )
    wait_http(procs, f"{url}/v1/models", want='"ready_instances":1', timeout=120)
    return url


def measure(procs: TreeProcs, url: str, model_dir: Path, c: int, n: int) -> dict[str, Any]:
    n = n or min(128, max(16, 4 * c))
    ns = argparse.Namespace(input_len=128, output_len=64, num_prompts=n)
    load = os.getloadavg()[0]
    cpu0 = _cpu_by_session()
    out = bench(url, model_dir, c, ns)
    cpu1 = _cpu_by_session()
    tokens = max(1, int(out.get("total_output_tokens") or 0))
    cpu = {name: cpu1.get(p.pid, 0.0) - cpu0.get(p.pid, 0.0) for name, p in procs.procs}
    return out | {
        "concurrency": c,
        "load_before": load,
        "cpu_s": {k: round(v, 2) for k, v in cpu.items()},
        "cpu_s_per_1k": sum(cpu.values()) * 1000 / tokens,
        "http_s_per_1k": cpu["http"] * 1000 / tokens,
        "daemon_s_per_1k": cpu["daemon"] * 1000 / tokens,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--trees", required=True, help="NAME=DIR,NAME=DIR (round-1 order)")
    p.add_argument(
        "--http-args", action="append", default=[], help="NAME=ARGS: extra `kvsched http` args"
    )
    p.add_argument("--concurrency", default="16,64")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=0, help="per run; 0: 4c in [16, 128]")
    p.add_argument("--speed", type=float, default=4.0, help="sim worker: step time / this")
    p.add_argument("--json", default=str(REPO / "bench/results/frontend_ab.json"))
    a = p.parse_args(argv)
    from kvsched.tinymodel.tokenizer import make_tokenizer

    trees = dict(t.split("=", 1) for t in a.trees.split(","))
    extra = {n: args.split() for n, args in (x.split("=", 1) for x in a.http_args)}
    levels = [int(c) for c in a.concurrency.split(",")]
    work = Path(tempfile.mkdtemp(prefix="kvsched-frontend-ab-"))
    model_dir = make_tokenizer(work / "tok", vocab_size=512)
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {t: {c: [] for c in levels} for t in trees}
    started = time.time()
    for r in range(a.rounds):
        for name in list(trees) if r % 2 == 0 else list(trees)[::-1]:
            logs = work / f"r{r}-{name}"
            logs.mkdir()
            procs = TreeProcs(logs, Path(trees[name]).resolve())
            try:
                url = start(procs, model_dir, a.speed, extra.get(name, []))
                warm = argparse.Namespace(input_len=128, output_len=16, num_prompts=8)
                bench(url, model_dir, 4, warm)
                for c in levels:
                    rec = measure(procs, url, model_dir, c, a.num_prompts)
                    runs[name][c].append(rec)
                    print(
                        f"round {r} {name} c={c}: {rec['output_throughput']:,.0f} tok/s, "
                        f"load {rec['load_before']:.1f}",
                        flush=True,
                    )
            finally:
                procs.stop()
    summary = {
        t: {
            c: {
                key: [statistics.median(v), min(v), max(v)]
                for _, key, _ in SHOWN
                if (v := [x[key] for x in recs if x.get(key) is not None])
            }
            for c, recs in by_c.items()
        }
        for t, by_c in runs.items()
    }
    head = ["c", "tree", *[h for h, _, _ in SHOWN]]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    names = list(trees)
    for c in levels:
        for t in names:
            cells = [
                f"{fmt.format(m[0])} [{fmt.format(m[1])}-{fmt.format(m[2])}]"
                if (m := summary[t][c].get(key))
                else "-"
                for _, key, fmt in SHOWN
            ]
            print("| " + " | ".join([str(c), t, *cells]) + " |")
        if len(names) == 2:
            b, f = summary[names[0]][c], summary[names[1]][c]
            cells = [
                f"x{f[key][0] / b[key][0]:.2f}" if key in b and key in f and b[key][0] else ""
                for _, key, _ in SHOWN[:-1]
            ]
            print("| " + " | ".join([str(c), f"{names[1]} / {names[0]}", *cells, ""]) + " |")
    doc = {
        "command": "python -m bench.frontend_ab "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": f"{os.cpu_count()} cores, shared (noisy)",
        "wall_s": round(time.time() - started, 1),
        "runs": runs,
        "summary": summary,
    }
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
