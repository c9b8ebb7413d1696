"""Where a serving stack's time and cores go, process by process and thread by thread: one stack
(`bench.serve_stacks`) at one or more concurrency levels under vLLM's serving benchmark, with

- the machine's busy cores (/proc/stat) and each thread's cores (/proc/PID/task, every process
  of the stack's process groups, vLLM's worker child included) over the run's window;
- the benchmark client's own cores (this process: the client runs in it);
- for kvsched, the request's time split by where it is measured: the client's TTFT and request
  latency (vLLM's benchmark), the front end's (kvsched http's histograms: its arrival to the
  first tokens / the last byte) and the daemon's (its arrival to the first token reported /
  to the finish; queue time; inter-token latency, with percentiles read off the histogram's
  buckets, so only as fine as the buckets);
- the engine's steps and tokens (the worker's counters, vLLM's iteration metrics).

    PYTHONPATH=. VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python -m bench.serve_split \\
        --stacks vllm,kvsched --concurrency 16 --rounds 2

Stacks run one after the other, in alternating order by round, as in `bench.serve_ab`; this is
a profile to read beside it, not a second scoreboard. The JSON keeps every run's rows.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import resource
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.serve_ab import WORKLOADS
from bench.serve_stacks import Stack, started
from bench.vllm_serve import bench

REPO = Path(__file__).resolve().parent.parent
_TICK = os.sysconf("SC_CLK_TCK")
_SUMS = re.compile(r"^(kvsched_\w+)_(sum|count)(?:\{[^}]*\})? ([0-9.eE+-]+)$", re.M)
_BUCKETS = re.compile(r'^(kvsched_\w+)_bucket\{(?:[^}]*,)?le="([^"]+)"[^}]*\} ([0-9.eE+-]+)$', re.M)
# The daemon's and the front end's histograms read (mean in ms; percentiles for the daemon's).
DAEMON = {
    "ttft": "kvsched_time_to_first_token_seconds",
    "e2e": "kvsched_e2e_request_latency_seconds",
    "queue": "kvsched_request_queue_time_seconds",
    "itl": "kvsched_inter_token_latency_seconds",
}
HTTP = {
    "ttft": "kvsched_http_time_to_first_token_seconds",
    "e2e": "kvsched_http_request_duration_seconds",
}


def _threads(roots: dict[int, str]) -> dict[tuple[str, int, int, str], float]:
    """CPU seconds of every thread of the `roots` processes (pid: name) and of their
    descendants: (root's name, pid, tid, thread name)."""
    parent: dict[int, int] = {}
    for path in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = open(path).read().rsplit(")", 1)[1].split()  # noqa: SIM115
            parent[int(path.split("/")[2])] = int(fields[1])
        except (OSError, IndexError, ValueError):
            continue
    todo = [(pid, name) for pid, name in roots.items()]
    seen: set[int] = set()
    out: dict[tuple[str, int, int, str], float] = {}
    while todo:
        pid, root = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        todo += [(c, root) for c, p in parent.items() if p == pid]
        for path in glob.glob(f"/proc/{pid}/task/*/stat"):
            try:
                text = open(path).read()  # noqa: SIM115
            except OSError:
                continue
            name = text[text.index("(") + 1 : text.rindex(")")]
            fields = text.rsplit(")", 1)[1].split()
            out[(root, pid, int(path.split("/")[4]), name)] = (
                int(fields[11]) + int(fields[12])
            ) / _TICK
    return out


def _machine() -> list[int]:
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


def _scrape(url: str) -> dict[tuple[str, str], float]:
    """Histogram sums, counts and buckets (summed over labels) of a Prometheus endpoint."""
    if not url:
        return {}
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out: dict[tuple[str, str], float] = {}
    for name, kind, value in _SUMS.findall(text):
        out[(name, kind)] = out.get((name, kind), 0.0) + float(value)
    for name, le, value in _BUCKETS.findall(text):
        out[(name, "le" + le)] = out.get((name, "le" + le), 0.0) + float(value)
    return out


def _mean_ms(before: dict[Any, float], after: dict[Any, float], name: str) -> float | None:
    n = after.get((name, "count"), 0.0) - before.get((name, "count"), 0.0)
    if n <= 0:
        return None
    return (after[(name, "sum")] - before.get((name, "sum"), 0.0)) / n * 1e3


def _pct_ms(before: dict[Any, float], after: dict[Any, float], name: str, q: float) -> float | None:
    """The upper edge of the bucket holding quantile q (as fine as the buckets)."""
    edges = sorted(
        (float(k[1][2:]), v - before.get(k, 0.0))
        for k, v in after.items()
        if k[0] == name and k[1].startswith("le")
    )
    if not edges or edges[-1][1] <= 0:
        return None
    for le, n in edges:
        if n >= q * edges[-1][1]:
            return le * 1e3
    return None


def measure(stack: Stack, model_dir: Path, c: int, n: int, a: argparse.Namespace) -> dict[str, Any]:
    pids = {p.pid: name for name, p in stack.procs.procs}
    ns = argparse.Namespace(input_len=a.input_len, output_len=a.output_len, num_prompts=n)
    http_url = f"{stack.url}/metrics" if stack.kind == "kvsched" else ""
    daemon0, http0 = _scrape(stack.metrics_url), _scrape(http_url)
    steps0 = stack.counters()
    load = os.getloadavg()[0]
    t0, m0, th0 = time.monotonic(), _machine(), _threads(pids)
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    out = bench(stack.url, model_dir, c, ns)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    wall, m1, th1 = time.monotonic() - t0, _machine(), _threads(pids)
    daemon1, http1 = _scrape(stack.metrics_url), _scrape(http_url)
    steps1 = stack.counters()
    d = [b - x for x, b in zip(m0, m1, strict=True)]
    threads = sorted(
        ((v - th0.get(k, 0.0)) / wall, f"{k[0]} {k[1]}/{k[2]} {k[3]}") for k, v in th1.items()
    )
    rec: dict[str, Any] = {
        "concurrency": c,
        "load_1min": load,
        "wall_s": wall,
        "busy_cores": (sum(d) - d[3] - d[4]) / max(1, sum(d)) * (os.cpu_count() or 1),
        "client_cores": (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) / wall,
        "thread_cores": [(name, round(v, 3)) for v, name in reversed(threads) if v >= 0.005],
        "client": {k: float(v) for k, v in out.items() if isinstance(v, (int, float))},
        "tokens_per_step": (steps1["output_tokens"] - steps0["output_tokens"])
        / max(1.0, steps1["steps"] - steps0["steps"]),
    }
    if stack.kind.startswith("kvsched"):
        rec["daemon_ms"] = {k: _mean_ms(daemon0, daemon1, m) for k, m in DAEMON.items()}
        rec["daemon_itl_pct_ms"] = {
            f"p{round(q * 100)}": _pct_ms(daemon0, daemon1, DAEMON["itl"], q)
            for q in (0.5, 0.9, 0.99)
        }
        rec["http_ms"] = {k: _mean_ms(http0, http1, m) for k, m in HTTP.items()}
    return rec


def show(kind: str, rec: dict[str, Any]) -> str:
    cl = rec["client"]
    lines = [
        f"{kind} c={rec['concurrency']}: {cl.get('output_throughput', 0):,.0f} tok/s, client "
        f"TTFT p50 {cl.get('p50_ttft_ms', 0):.0f} ms, ITL p99 {cl.get('p99_itl_ms', 0):.1f} ms; "
        f"{rec['tokens_per_step']:.1f} tok/step; busy {rec['busy_cores']:.2f} cores, client "
        f"{rec['client_cores']:.2f}, load {rec['load_1min']:.1f}",
        "  threads (cores): " + ", ".join(f"{name} {v:.2f}" for name, v in rec["thread_cores"][:8]),
    ]
    if "daemon_ms" in rec:

        def fmt(d: dict[str, float | None]) -> str:
            return ", ".join(f"{k} {v:.1f}" for k, v in d.items() if v is not None)

        lines.append(f"  front end (means, ms): {fmt(rec['http_ms'])}")
        lines.append(f"  daemon (means, ms): {fmt(rec['daemon_ms'])}")
        lines.append(f"  daemon ITL by bucket (ms): {fmt(rec['daemon_itl_pct_ms'])}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workload", default="tiny", choices=sorted(WORKLOADS))
    p.add_argument("--stacks", default="vllm,kvsched", help="bench.serve_stacks names")
    p.add_argument("--concurrency", default="16")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--json", default=str(REPO / "bench/results/serve_split.json"))
    a = p.parse_args()
    from kvsched.tinymodel.model import make_model
    from kvsched.tinymodel.tokenizer import make_tokenizer

    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvsched-serve-split-{os.getpid()}"
    model_dir = make_model(work / f"model-{a.workload}", **WORKLOADS[a.workload])
    make_tokenizer(model_dir)
    stacks, levels = a.stacks.split(","), [int(c) for c in a.concurrency.split(",")]
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in stacks}
    for r in range(a.rounds):
        for kind in stacks if r % 2 == 0 else stacks[::-1]:
            with started(kind, model_dir, work / f"r{r}-{kind}", metrics=True) as stack:
                warm = argparse.Namespace(input_len=a.input_len, output_len=16, num_prompts=16)
                bench(stack.url, model_dir, 4, warm)
                for c in levels:
                    rec = measure(stack, model_dir, c, a.num_prompts, a)
                    runs[kind].append(rec)
                    print(show(kind, rec), flush=True)
            Path(a.json).write_text(json.dumps({"workload": a.workload, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
