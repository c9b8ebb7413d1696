"""LoRA throughput: vLLM's OpenAI server and kvsched (`kvsched http` + daemon + vLLM worker) on
the same tiny model with 1, 2 and 4 adapters (max_loras 2: with 4 adapters the engine swaps them
in and out of its slots), every request naming one adapter (vLLM's serving benchmark,
`--lora-modules`, random assignment). One command, one JSON:

    flock /work/wt/vllm.lock .venv-vllm/bin/python -m bench.lora_serve [--adapters 1,2,4]

Stacks are started as bench.serve_stacks starts them (one at a time, stopped after their run),
vLLM first then kvsched for each adapter count. Adapters: kvsched.tinymodel.lora (rank 8 on the
attention projections), written offline. Figures on a shared 2-core box are noisy: the load
average before each run is recorded beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.serve_stacks import started

REPO = Path(__file__).resolve().parent.parent
MAX_LORAS = 2
RANK = 8


def engine_args(kind: str, adapters: dict[str, str]) -> list[str]:
    """The LoRA flags of vLLM's server or of the kvsched worker (the same vLLM names)."""
    args = ["--lora-modules", *(f"{n}={p}" for n, p in adapters.items())]
    args += ["--max-loras", str(MAX_LORAS), "--max-lora-rank", str(RANK)]
    args += ["--max-cpu-loras", str(max(MAX_LORAS, len(adapters)))]
    return ["--enable-lora", *args] if kind == "vllm" else args


def run(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    from bench.vllm_serve import bench
    from kvsched.tinymodel.lora import make_adapter
    from kvsched.tinymodel.model import make_model
    from kvsched.tinymodel.tokenizer import make_tokenizer

    model_dir = make_model(work / "model")
    make_tokenizer(model_dir)
    every = {
        f"ad{i}": str(make_adapter(model_dir, work / f"ad{i}", seed=i, rank=RANK))
        for i in range(1, 5)
    }
    runs: list[dict[str, Any]] = []
    for n in [int(x) for x in a.adapters.split(",")]:
        adapters = dict(list(every.items())[:n])
        for kind in a.stacks.split(","):
            print(f"== {n} adapter(s): {kind}", flush=True)
            logs = work / f"logs-{n}-{kind}"
            with started(kind, model_dir, logs, engine_args=engine_args(kind, adapters)) as stack:
                ns = argparse.Namespace(input_len=a.input_len, output_len=16, num_prompts=8)
                extra = ["--lora-modules", *adapters]
                bench(stack.url, model_dir, 4, ns, extra)  # warm-up (loads the adapters)
                ns = argparse.Namespace(
                    input_len=a.input_len, output_len=a.output_len, num_prompts=a.num_prompts
                )
                load = os.getloadavg()[0]
                t0 = time.monotonic()
                out = bench(stack.url, model_dir, a.concurrency, ns, extra)
                rec = {
                    "stack": kind,
                    "adapters": n,
                    "max_loras": MAX_LORAS,
                    "concurrency": a.concurrency,
                    "wall_s": round(time.monotonic() - t0, 1),
                    "load_before": load,
                    **out,
                }
            runs.append(rec)
            print(
                f"   out tok/s {rec.get('output_throughput') or 0:,.0f}, completed "
                f"{rec.get('completed')}, failed {rec.get('failed')}, load {load:.1f}",
                flush=True,
            )
    return {
        "what": "LoRA throughput, vLLM server vs kvsched http + daemon + vLLM worker",
        "model": "kvsched.tinymodel defaults (2 layers, hidden 128), float32, CPU",
        "input_len": a.input_len,
        "output_len": a.output_len,
        "num_prompts": a.num_prompts,
        "runs": runs,
    }


def print_table(result: dict[str, Any]) -> None:
    rows = {(r["adapters"], r["stack"]): r for r in result["runs"]}
    print(f"\n{'adapters':>8} {'stack':>8} {'out tok/s':>10} {'TTFT p50':>9} {'load':>5}")
    for (n, kind), r in sorted(rows.items()):
        print(
            f"{n:>8} {kind:>8} {r.get('output_throughput') or 0:>10,.0f} "
            f"{r.get('p50_ttft_ms') or 0:>9.0f} {r['load_before']:>5.1f}"
        )
    for n in sorted({n for n, _ in rows}):
        v, k = rows.get((n, "vllm")), rows.get((n, "kvsched"))
        if v and k and v.get("output_throughput"):
            ratio = (k.get("output_throughput") or 0) / v["output_throughput"]
            print(f"{n} adapter(s): kvsched / vllm output tok/s = {ratio:.2f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--adapters", default="1,2,4", help="adapter counts, comma-separated")
    p.add_argument("--stacks", default="vllm,kvsched")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "lora_serve.json"))
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvsched-lora-bench-") as tmp:
        result = run(a, Path(tmp))
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
