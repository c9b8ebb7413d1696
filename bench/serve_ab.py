"""vLLM's OpenAI server beside kvsched on the same engine, in alternating rounds, with what each
stack costs: one command, one JSON, one plot per workload.

    .venv-vllm/bin/python -m bench.serve_ab                       # tiny + step, 3 rounds
    .venv-vllm/bin/python -m bench.serve_ab --plot bench/results/serve_ab.json   # the plots
    make bench-serve                                              # both, venv made first

Stacks (bench.serve_stacks; each started the same way, stopped after its round): vLLM's OpenAI
server (`vllm`), `kvsched http` + daemon + vLLM worker (`kvsched`), daemon + worker driven by
kvsched's async gRPC client (`kvsched-grpc`: its own timer; TTFT, gaps between messages).
Round r runs the stacks in order, round r+1 in reverse (vllm, kvsched, kvsched-grpc,
kvsched-grpc, kvsched, vllm, ...), so drift in the machine's load falls on both sides. In each
round each stack serves one warm-up, then every concurrency level once.

Workloads (models made here, random weights, BPE vocabulary 512, float32):
    tiny  kvsched.tinymodel defaults: 2 layers, hidden 128 (a step takes a few ms: the control
          plane dominates)
    step  8 layers, hidden 768, 12 heads, MLP 2048 (a decode step at batch 16 takes tens of ms
          here: the control plane must hide behind the step)

Each run: vLLM's serving benchmark (vllm.benchmarks.serve, random dataset, /v1/completions,
--ignore-eos, --max-concurrency c, num prompts 4c clamped to [16, 128] (step) or 16c clamped
to [64, 512] (tiny) unless --num-prompts;
lengths all equal unless --range-ratio);
the load average (1 min) before and after; CPU seconds (user + sys, children included) of each
process group from /proc, per 1,000 output tokens; output tokens per engine step (the kvsched
worker's counters; vLLM's generation / iteration counters) and vLLM's iteration tokens per step
(prompt tokens included). The summary: per stack and concurrency the median and range over the
rounds; the ratios kvsched / vllm of the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.serve_stacks import STACKS, VARIANTS, Stack, started

REPO = Path(__file__).resolve().parent.parent
WORKLOADS: dict[str, dict[str, int]] = {
    "tiny": {},
    "step": {"layers": 8, "hidden": 768, "heads": 12, "kv_heads": 4, "intermediate": 2048},
}
CONCURRENCY = {"tiny": "1,16,64", "step": "16,64"}
# (label, key in a run's record, format); the summary gives median and range of each
SHOWN = [
    ("out tok/s", "output_throughput", "{:,.0f}"),
    ("TTFT p50", "p50_ttft_ms", "{:.0f}"),
    ("TTFT p99", "p99_ttft_ms", "{:.0f}"),
    ("ITL p99", "p99_itl_ms", "{:.1f}"),
    ("CPU s/1k tok", "cpu_s_per_1k", "{:.2f}"),
    ("tok/step", "tokens_per_step", "{:.1f}"),
    ("load", "load_before", "{:.1f}"),
]


# Prompts per run: (per unit of concurrency, at least, at most). The tiny model's runs need
# more than the step-bound one's to last a few seconds (16 prompts at c=1 or 64 at c=16 ran
# 1-3 s, and their ratios flipped between sittings); each run is then 5-10 s here.
PROMPTS = {"tiny": (16, 64, 512), "step": (4, 16, 128)}


def num_prompts(a: argparse.Namespace, c: int, workload: str) -> int:
    per, lo, hi = PROMPTS[workload]
    return a.num_prompts or min(hi, max(lo, per * c))


def measure(stack: Stack, model_dir: Path, c: int, n: int, a: argparse.Namespace) -> dict[str, Any]:
    """One run at concurrency c: the client's figures plus CPU, counters and load."""
    from bench.vllm_serve import bench, grpc_bench

    ns = argparse.Namespace(input_len=a.input_len, output_len=a.output_len, num_prompts=n)
    load_before = os.getloadavg()[0]
    cpu0, cnt0, t0 = stack.cpu_s(), stack.counters(), time.monotonic()
    if stack.kind == "kvsched-grpc":
        out = asyncio.run(grpc_bench(stack.url, c, ns))
    else:
        ratio = ("--random-range-ratio", str(a.range_ratio)) if a.range_ratio else ()
        out = bench(stack.url, model_dir, c, ns, ratio)
    wall = time.monotonic() - t0
    cpu1, cnt1 = stack.cpu_s(), stack.counters()
    tokens = max(1, int(out.get("total_output_tokens") or 0))
    cpu = {k: round(cpu1[k] - cpu0.get(k, 0.0), 2) for k in cpu1}
    steps = cnt1["steps"] - cnt0["steps"]
    out |= {
        "concurrency": c,
        "num_prompts": n,
        "wall_s": round(wall, 1),
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "cpu_s": cpu,
        "cpu_s_total": round(sum(cpu.values()), 2),
        "cpu_s_per_1k": sum(cpu.values()) * 1000 / tokens,
        "cpu_s_per_1k_by_process": {k: v * 1000 / tokens for k, v in cpu.items()},
        "engine_steps": steps,
        "tokens_per_step": (cnt1["output_tokens"] - cnt0["output_tokens"]) / max(1.0, steps),
    }
    if "iteration_tokens" in cnt1:
        out["iteration_tokens_per_step"] = (
            cnt1["iteration_tokens"] - cnt0["iteration_tokens"]
        ) / max(1.0, steps)
    return out


def warm_up(stack: Stack, model_dir: Path, a: argparse.Namespace) -> None:
    from bench.vllm_serve import bench, grpc_bench

    ns = argparse.Namespace(input_len=a.input_len, output_len=16, num_prompts=8)
    if stack.kind == "kvsched-grpc":
        asyncio.run(grpc_bench(stack.url, 4, ns))
    else:
        bench(stack.url, model_dir, 4, ns)


def run_workload(name: str, a: argparse.Namespace, work: Path, save: Any = None) -> dict[str, Any]:
    """Every round of one workload; `save(partial)` after each stack's round."""
    from kvsched.tinymodel.model import make_model
    from kvsched.tinymodel.tokenizer import make_tokenizer

    model_dir = make_model(work / f"model-{name}", **WORKLOADS[name])
    make_tokenizer(model_dir)
    levels = [int(c) for c in (a.concurrency or CONCURRENCY[name]).split(",")]
    stacks = a.stacks.split(",")
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {s: {} for s in stacks}
    for r in range(a.rounds):
        for kind in stacks if r % 2 == 0 else stacks[::-1]:
            print(f"== {name} round {r + 1}/{a.rounds}: {kind}", flush=True)
            logs = work / f"{name}-r{r}-{kind}"
            with started(kind, model_dir, logs, env=_stack_env(a, kind)) as stack:
                warm_up(stack, model_dir, a)
                for c in levels:
                    rec = measure(stack, model_dir, c, num_prompts(a, c, name), a)
                    rec["round"] = r
                    runs[kind].setdefault(str(c), []).append(rec)
                    print(f"   c={c}: {_line(rec)}", flush=True)
            if save is not None:
                save({"model": WORKLOADS[name] or "tinymodel defaults", "runs": runs})
    return {"model": WORKLOADS[name] or "kvsched.tinymodel defaults", "runs": runs}


def _stack_env(a: argparse.Namespace, kind: str) -> dict[str, str]:
    env = dict(kv.split("=", 1) for kv in a.env)
    if not kind.startswith("vllm"):
        env |= dict(kv.split("=", 1) for kv in a.kvsched_env)
    return env


def _line(rec: dict[str, Any]) -> str:
    return ", ".join(
        f"{label} {fmt.format(rec[key])}" for label, key, fmt in SHOWN if rec.get(key) is not None
    )


def summarize(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Per stack and concurrency: median, min and max of each shown figure over the rounds;
    and kvsched's ratios to vllm (of the medians)."""
    out: dict[str, Any] = {}
    for stack, by_c in runs.items():
        for c, recs in by_c.items():
            row: dict[str, Any] = {"rounds": len(recs)}
            for _, key, _ in [*SHOWN, ("", "p50_ttft_ms", ""), ("", "cpu_s_total", "")]:
                vals = [float(r[key]) for r in recs if r.get(key) is not None]
                if vals:
                    row[key] = {
                        "median": statistics.median(vals),
                        "min": min(vals),
                        "max": max(vals),
                    }
            procs = {p for r in recs for p in r["cpu_s_per_1k_by_process"]}
            row["cpu_s_per_1k_by_process"] = {
                p: statistics.median(r["cpu_s_per_1k_by_process"].get(p, 0.0) for r in recs)
                for p in sorted(procs)
            }
            out.setdefault(stack, {})[c] = row
    if "vllm" in out:
        for stack in out:
            if stack == "vllm":
                continue
            for c, row in out[stack].items():
                base = out["vllm"].get(c)
                if base is None:
                    continue
                row["vs_vllm"] = {
                    key: row[key]["median"] / base[key]["median"]
                    for _, key, _ in SHOWN[:-1]
                    if key in row and key in base and base[key]["median"]
                }
    return out


def print_summary(name: str, summary: dict[str, Any]) -> None:
    print(f"\n### {name}: median [min-max] over the rounds")
    print("| c | stack | " + " | ".join(label for label, _, _ in SHOWN) + " |")
    print("|---|---|" + "---|" * len(SHOWN))
    levels = sorted({int(c) for by_c in summary.values() for c in by_c})
    for c in levels:
        for stack, by_c in summary.items():
            row = by_c.get(str(c))
            if row is None:
                continue
            cells = []
            for _, key, fmt in SHOWN:
                m = row.get(key)
                cells.append(
                    "-"
                    if m is None
                    else f"{fmt.format(m['median'])} [{fmt.format(m['min'])}-{fmt.format(m['max'])}]"
                )
            print(f"| {c} | {stack} | " + " | ".join(cells) + " |")
            if "vs_vllm" in row:
                ratios = [
                    f"x{row['vs_vllm'][key]:.2f}" if key in row["vs_vllm"] else ""
                    for _, key, _ in SHOWN
                ]
                print(f"| {c} | {stack} / vllm | " + " | ".join(ratios) + " |")


def plot(path: Path, out_dir: Path) -> list[Path]:
    """One PNG per workload: output tok/s, TTFT p50 and p99 vs concurrency, median and range."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = json.loads(path.read_text())
    written = []
    for name, w in doc["workloads"].items():
        fig, axes = plt.subplots(1, 3, figsize=(14, 4))
        panels = [
            ("output_throughput", "output tok/s"),
            ("p50_ttft_ms", "TTFT p50 ms"),
            ("p99_ttft_ms", "TTFT p99 ms"),
        ]
        for ax, (key, label) in zip(axes, panels, strict=True):
            for stack, by_c in w["summary"].items():
                cs = sorted(int(c) for c in by_c if key in by_c[c])
                med = [by_c[str(c)][key]["median"] for c in cs]
                lo = [m - by_c[str(c)][key]["min"] for c, m in zip(cs, med, strict=True)]
                hi = [by_c[str(c)][key]["max"] - m for c, m in zip(cs, med, strict=True)]
                ax.errorbar(cs, med, yerr=[lo, hi], marker="o", capsize=3, label=stack)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("max concurrency")
            ax.set_title(label)
            if key != "output_throughput":
                ax.set_yscale("log")
        axes[0].legend()
        fig.suptitle(f"{name}: {doc['command']} (median, range of {doc['rounds']} rounds)")
        fig.tight_layout()
        out = out_dir / f"serve_ab_{name}.png"
        fig.savefig(out, dpi=90)
        plt.close(fig)
        written.append(out)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workloads", default="tiny,step", help="tiny, step (comma-separated)")
    p.add_argument(
        "--stacks", default=",".join(STACKS), help=f"in round-1 order; variants: {VARIANTS}"
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", default="", help=f"levels for every workload {CONCURRENCY}")
    p.add_argument(
        "--num-prompts",
        type=int,
        default=0,
        help="per run; 0: PROMPTS (step 4c in [16, 128], tiny 16c in [64, 512])",
    )
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="lengths drawn in [len (1 - r), len (1 + r)] (vLLM's --random-range-ratio; 0: all "
        "equal, a closed loop then runs in waves); not with kvsched-grpc",
    )
    p.add_argument("--env", action="append", default=[], help="K=V for every stack's processes")
    p.add_argument("--kvsched-env", action="append", default=[], help="K=V for kvsched's only")
    p.add_argument("--json", default=str(REPO / "bench/results/serve_ab.json"))
    p.add_argument("--plot", metavar="JSON", help="only draw the plots of a result file")
    p.add_argument(
        "--merge",
        metavar="JSON,JSON...",
        help="only merge the rounds of result files (runs kept short, e.g. one round each in "
        "alternating stack order) into --json, with their summary",
    )
    p.add_argument("--plot-dir", default=str(REPO / "docs/img"))
    a = p.parse_args(argv)
    if a.plot:
        Path(a.plot_dir).mkdir(parents=True, exist_ok=True)
        for f in plot(Path(a.plot), Path(a.plot_dir)):
            print(f"wrote {f}")
        return 0
    if a.merge:
        return merge(a.merge.split(","), Path(a.json))
    if a.range_ratio and "kvsched-grpc" in a.stacks.split(","):
        p.error("--range-ratio: the kvsched-grpc stack's client sends equal lengths only")
    work = Path(tempfile.mkdtemp(prefix="kvsched-serve-ab-"))
    print(f"models and logs in {work}", flush=True)
    command = "python -m bench.serve_ab " + " ".join(argv if argv is not None else sys.argv[1:])
    doc: dict[str, Any] = {
        "command": command.strip(),
        "machine": f"{os.cpu_count()} cores, {os.uname().machine}",
        "rounds": a.rounds,
        "client": "vllm.benchmarks.serve (random, /v1/completions, --ignore-eos); kvsched-grpc: "
        "kvsched.client.AsyncClient",
        "input_len": a.input_len,
        "output_len": a.output_len,
        "range_ratio": a.range_ratio,
        "env": a.env,
        "kvsched_env": a.kvsched_env,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "workloads": {},
    }
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    for name in a.workloads.split(","):

        def save(w: dict[str, Any], name: str = name) -> None:  # after each stack's round
            w["summary"] = summarize(w["runs"])
            doc["workloads"][name] = w
            Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")

        w = run_workload(name, a, work, save)
        save(w)
        print_summary(name, w["summary"])
    print(f"wrote {a.json}; plots: .venv-vllm/bin/python -m bench.serve_ab --plot {a.json}")
    return 0


def merge(paths: list[str], out: Path) -> int:
    """One result file holding every run of `paths` (their rounds renumbered in order)."""
    docs = [json.loads(Path(p).read_text()) for p in paths]
    merged: dict[str, Any] = {**docs[0], "merged_from": paths, "workloads": {}}
    merged["command"] = [d["command"] for d in docs]
    merged["rounds"] = sum(d["rounds"] for d in docs)
    offset = 0
    for d in docs:
        for name, w in d["workloads"].items():
            into = merged["workloads"].setdefault(name, {"model": w["model"], "runs": {}})
            for stack, by_c in w["runs"].items():
                for c, recs in by_c.items():
                    into["runs"].setdefault(stack, {}).setdefault(c, []).extend(
                        {**r, "round": r.get("round", 0) + offset} for r in recs
                    )
        offset += d["rounds"]
    for name, w in merged["workloads"].items():
        w["summary"] = summarize(w["runs"])
        print_summary(name, w["summary"])
    out.write_text(json.dumps(merged, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
