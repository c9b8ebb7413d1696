"""CPU cost of one steady decode step of kvsched's scheduler: `schedule()` + `apply_report()`.

The setup of the vLLM scheduler-step measurement in docs/BENCHMARKS.md section 2, so the two
can be read side by side: R running
requests (distinct random 1,024-token prompts, fully prefilled) and W waiting ones that can never
be admitted (max_num_seqs = R), block size 64, 100,000 blocks, prefix caching on, max_tokens huge
so nothing finishes and nothing is preempted. Each timed step is one schedule() and one
apply_report() of the StepReport in which the worker gave every running handle one token.
The worker is the reference worker's engine on a zero-cost simulated executor (its own state,
built from the Tasks it is sent), and its report goes through the daemon's protobuf conversion,
so the columns are numpy arrays as the server builds them (finish reasons included). Running
the worker and converting are not timed. gc stays enabled. The W=0 and W=10000 schedulers of
one R are stepped alternately, so machine noise hits both alike.

(Until 2026-12-03 the worker here was a loop over the scheduler's own requests: it read every
request's token count each step, which a real worker cannot do, and its reports had no
finish_reasons column, which the reference worker always sends.)

    python -m bench.core_step [--steps N] [--quick] [--json PATH] [--vllm-json PATH]
                              [--host-blocks N [--host-write-policy P]]

--vllm-json takes the file written by vllm_step.py --json and adds its p50 and the ratio.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import time
from pathlib import Path
from typing import Any

from kvsched import codec
from kvsched.core import (
    CacheConfig,
    EngineConfig,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    StepReport,
    Tasks,
)
from kvsched.worker_stub.engine import WorkerEngine
from kvsched.worker_stub.sim import SimExecutor

PROMPT_LEN, BLOCK_SIZE, NUM_BLOCKS = 1024, 64, 100_000
VOCAB_SIZE, EOS_TOKEN_ID = 120_000, 2  # the sim never samples EOS (eos_every=None)
MAX_TOKENS = 1 << 20
TARGET_P50_US = 150.0  # at R=1024, W=10000
TARGET_W_RATIO = 1.15  # p50 at W=10000 over p50 at W=0
DEFAULT_JSON = Path(__file__).parent / "results" / "core_step.json"
Record = dict[str, Any]


# --host-blocks / --host-write-policy: every instance also has a host-memory KV tier (the
# copies of write_through ride on the decode steps: every block a decode fills is copied out).
HOST = {"num_host_blocks": 0, "host_write_policy": "write_through"}


def build(running: int, waiting: int, seed: int) -> Scheduler:
    config = EngineConfig(
        cache=CacheConfig(
            block_size=BLOCK_SIZE,
            num_gpu_blocks=NUM_BLOCKS,
            num_host_blocks=int(HOST["num_host_blocks"]),
            host_write_policy=HOST["host_write_policy"],  # type: ignore[arg-type]
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=running,
            max_num_batched_tokens=max(8192, running),
            max_model_len=PROMPT_LEN + MAX_TOKENS,
            max_waiting=running + waiting,
        ),
    )
    s = Scheduler(config)
    rng = random.Random(seed)
    token_pool = list(range(1000, 120_000))  # shared int objects keep 11M prompt tokens small
    for i in range(running + waiting):
        prompt = rng.choices(token_pool, k=PROMPT_LEN)
        s.add_request(Request(f"req-{i}", prompt, SamplingParams(max_tokens=MAX_TOKENS)))
    return s


class Worker:
    """The reference worker's engine (kvsched.worker_stub) on a zero-cost simulated executor,
    decoding as numpy columns: it runs each Tasks message as a GPU worker would, from its own
    state (it never reads the scheduler's requests). Its reports go through the daemon's
    protobuf conversion both ways, so apply_report() gets the columns the server gives it."""

    def __init__(self, s: Scheduler) -> None:
        cc, sc = s.config.cache, s.config.scheduler
        self.engine = WorkerEngine(
            SimExecutor(zero_cost=True, vocab_size=VOCAB_SIZE, eos_token_id=EOS_TOKEN_ID),
            cc.block_size,
            sc.max_num_seqs,
            EOS_TOKEN_ID,
            sc.max_model_len,
            columnar=True,
        )
        self.num_paused = 0  # rows the worker could not run for lack of blocks

    def report(self, s: Scheduler, tasks: Tasks) -> StepReport:
        self.engine.apply(tasks)
        report = self.engine.step()
        assert report is not None, "the worker had nothing to run"
        self.num_paused += len(report.paused)
        return codec.report_from_proto(codec.report_to_proto(report))


def warm_up(s: Scheduler, worker: Worker, running: int, decode_steps: int = 3) -> None:
    """Admit and prefill `running` requests, then decode a few steps."""
    extra = 0
    for _ in range(100_000):
        s.apply_report(worker.report(s, s.schedule()))
        if s.num_running == running and s.num_decoding == running:
            extra += 1
            if extra >= decode_steps:
                return
    raise RuntimeError("warm-up did not converge")


class Steady:
    """One scheduler in its steady decode state, and the per-step times measured on it."""

    def __init__(self, running: int, waiting: int) -> None:
        self.running, self.waiting = running, waiting
        self.s = build(running, waiting, seed=1234 + running * 7 + waiting)
        self.worker = Worker(self.s)
        warm_up(self.s, self.worker, running)
        self.t_sched: list[int] = []
        self.t_report: list[int] = []

    def step(self) -> None:
        pc = time.perf_counter_ns
        t0 = pc()
        tasks = self.s.schedule()
        t1 = pc()
        report = self.worker.report(self.s, tasks)  # not timed: the server's conversion
        t2 = pc()
        self.s.apply_report(report)
        t3 = pc()
        self.t_sched.append(t1 - t0)
        self.t_report.append(t3 - t2)

    def record(self, gc_collections: list[int]) -> Record:
        s = self.s
        assert s.num_running == self.running and s.num_waiting == self.waiting
        assert s.stats.num_preemptions == 0
        total = [a + b for a, b in zip(self.t_sched, self.t_report, strict=True)]
        return {
            "running": self.running,
            "waiting": self.waiting,
            "p50_us": pct(total, 50) / 1e3,
            "p99_us": pct(total, 99) / 1e3,
            "schedule_p50_us": pct(self.t_sched, 50) / 1e3,
            "schedule_p99_us": pct(self.t_sched, 99) / 1e3,
            "report_p50_us": pct(self.t_report, 50) / 1e3,
            "report_p99_us": pct(self.t_report, 99) / 1e3,
            "steps": len(total),
            "worker_paused_rows": self.worker.num_paused,
            "gc_collections_during_timing": gc_collections,
            "python": platform.python_version(),
        }


def time_steps(running: int, waitings: tuple[int, ...], steps: int) -> list[Record]:
    """Time `steps` steps of each W at this R, interleaved step by step so that load from
    other processes on the machine hits every W alike (the W ratio is the point)."""
    benches = [Steady(running, w) for w in waitings]
    gc.collect()
    gc_before = [st["collections"] for st in gc.get_stats()]
    for _ in range(steps):
        for b in benches:
            b.step()
    gc_after = [st["collections"] for st in gc.get_stats()]
    collections = [a - b for a, b in zip(gc_after, gc_before, strict=True)]
    return [b.record(collections) for b in benches]


def pct(xs: list[int], p: float) -> float:
    """Percentile with linear interpolation (as vllm_step.py)."""
    s = sorted(xs)
    pos = (len(s) - 1) * p / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def check(rec: Record, by_key: dict[tuple[int, int], Record]) -> str:
    """The targets that apply to this record, and PASS / MISS."""
    r, w, p50 = rec["running"], rec["waiting"], rec["p50_us"]
    goals: list[tuple[str, bool]] = []
    if (r, w) == (1024, 10000):
        goals.append((f"p50<={TARGET_P50_US:.0f}", p50 <= TARGET_P50_US))
    base = by_key.get((r, 0))
    if w and base is not None:
        ratio = p50 / base["p50_us"]
        goals.append((f"vs W=0 {ratio:.2f}x<={TARGET_W_RATIO}", ratio <= TARGET_W_RATIO))
    if not goals:
        return "-"
    verdict = "PASS" if all(ok for _, ok in goals) else "MISS"
    return f"{', '.join(g for g, _ in goals)} {verdict}"


def load_vllm(path: str, variant: str) -> dict[tuple[int, int], float]:
    """p50 (us) per (R, W) from vllm_step.py's JSON, averaged over reps."""
    acc: dict[tuple[int, int], list[float]] = {}
    for rec in json.loads(Path(path).read_text()):
        if rec.get("variant", variant) == variant:
            acc.setdefault((rec["running"], rec["waiting"]), []).append(rec["p50_us"])
    return {k: sum(v) / len(v) for k, v in acc.items()}


def print_table(records: list[Record], vllm: dict[tuple[int, int], float]) -> None:
    by_key = {(r["running"], r["waiting"]): r for r in records}
    head = f"{'R':>5} {'W':>6} | {'p50':>7} {'p99':>7} | {'sched':>7} {'report':>7} |"
    if vllm:
        head += f" {'vLLM p50':>9} {'ratio':>6} |"
    print(head + " target (us)")
    print("-" * (len(head) + 30))
    for rec in records:
        line = (
            f"{rec['running']:>5} {rec['waiting']:>6} | {rec['p50_us']:>7.1f} "
            f"{rec['p99_us']:>7.1f} | {rec['schedule_p50_us']:>7.1f} "
            f"{rec['report_p50_us']:>7.1f} |"
        )
        if vllm:
            v = vllm.get((rec["running"], rec["waiting"]))
            ratio = f"{v / rec['p50_us']:>5.0f}x" if v else f"{'-':>6}"
            line += f" {v or float('nan'):>9.1f} {ratio} |"
        print(line + " " + check(rec, by_key))


BREAKDOWN = (  # (part of the scheduler, method): each timed by a wrapper
    ("admission.Admitter", "extend_decoders"),  # schedule(): block extensions
    ("report_check.ReportChecker", "check"),  # apply_report(): validation, columns
    ("report.ReportApplier", "_apply_round"),  # the vectorized rows
    ("report.ReportApplier", "_after_report"),  # the visits (caching, extensions, finishes)
)


def breakdown(running: int, steps: int) -> dict[str, float]:
    """Microseconds per step spent in the scheduler's main parts at R=running, W=0, each
    method timed by a wrapper (adds ~0.3 us per call). A steady step with no decoder out of
    room builds no Admitter: its extend_decoders is then 0."""
    import importlib

    classes = {}
    for path, _ in BREAKDOWN:
        mod, cls = path.split(".")
        classes[path] = getattr(importlib.import_module(f"kvsched.core.scheduler.{mod}"), cls)
    spent = {name: 0 for _, name in BREAKDOWN}
    originals = {(path, name): getattr(classes[path], name) for path, name in BREAKDOWN}

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kw: Any) -> Any:
            t0 = time.perf_counter_ns()
            try:
                return fn(*args, **kw)
            finally:
                spent[name] += time.perf_counter_ns() - t0

        return wrapper

    bench = Steady(running, 0)
    for _ in range(20):
        bench.step()
    try:
        for (path, name), fn in originals.items():
            setattr(classes[path], name, timed(name, fn))
        bench.t_sched.clear()
        bench.t_report.clear()
        for name in spent:
            spent[name] = 0
        for _ in range(steps):
            bench.step()
    finally:
        for (path, name), fn in originals.items():
            setattr(classes[path], name, fn)
    out = {name: ns / steps / 1e3 for name, ns in spent.items()}
    out["schedule() p50"] = pct(bench.t_sched, 50) / 1e3
    out["apply_report() p50"] = pct(bench.t_report, 50) / 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--quick", action="store_true", help="50 steps (a smoke run)")
    ap.add_argument("--json", default=str(DEFAULT_JSON), help="where to write the records")
    ap.add_argument("--vllm-json", help="vllm_step.py --json output, shown side by side")
    ap.add_argument("--vllm-variant", default="sync", help="which vLLM variant to compare")
    ap.add_argument(
        "--breakdown", action="store_true", help="only: us per step in the main parts, W=0"
    )
    ap.add_argument("--host-blocks", type=int, default=0, help="a host tier of N blocks")
    ap.add_argument(
        "--host-write-policy",
        default="write_through",
        choices=("write_through", "write_through_selective", "write_back"),
    )
    args = ap.parse_args()
    HOST.update(num_host_blocks=args.host_blocks, host_write_policy=args.host_write_policy)
    steps = 50 if args.quick else args.steps
    if args.breakdown:
        for running in (256, 1024):
            parts = breakdown(running, steps)
            print(f"R={running}: " + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()))
        return

    records = []
    for running in (256, 1024):
        records += time_steps(running, (0, 10000), steps)
        gc.collect()
    vllm = load_vllm(args.vllm_json, args.vllm_variant) if args.vllm_json else {}
    print(f"kvsched core step: schedule() + apply_report(), {steps} steps, times in us")
    print_table(records, vllm)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(records, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
