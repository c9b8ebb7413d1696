"""CPU cost of one steady decode step of the zero-cost sim worker, as `kvsched worker` pays it.

    python -m bench.worker_step [--running 256,1024] [--steps N] [--rounds N] [--json PATH]
                                [--before REV] [--profile R]

R handles are placed on a `WorkerEngine` over a zero-cost `SimExecutor` (block size 64, 32-token
prompts, fully prefilled, max_tokens huge), as bench.transport's worker holds them. Each timed
step is what the worker client does per step with the daemon's Tasks in hand:

    parse_us    ConnectResponse bytes -> Tasks, and engine.apply (each step's Tasks extend the
                ~R/64 handles whose blocks are about to fill, as the daemon's preallocation does)
    step_us     engine.has_runnable() + engine.step()
    report_us   the StepReport -> ConnectRequest message -> bytes (gRPC serializes it)
    total_us    the sum: the worker's CPU per step, gc enabled

Paths, each stepped in turn over the same workload so machine noise hits them alike:

    before      engine.py as of git revision --before (default 0919d22, the last commit
                before the columnar work), loaded from git; Tasks and reports through
                kvsched.codec (tasks_from_proto, report_to_proto). Skipped outside a git checkout.
    seqwork     today's WorkerEngine(columnar=False): one SeqWork per decoding handle through
                Executor.execute (what tests and the model executor use); as before
    columnar    WorkerEngine(columnar=True), as `kvsched worker --executor sim` runs it: decodes
                as numpy columns; the worker's own report_message

p50 and p90 over --steps steps per round, --rounds rounds; the table shows the median round.
--profile R runs cProfile over the columnar path at R and prints the top functions.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import importlib.util
import json
import platform
import pstats
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvsched import codec
from kvsched.core.protocol import Chunk, Extension, Placement, SamplingParams, Tasks
from kvsched.v1 import worker_service_pb2 as pb
from kvsched.worker_stub.engine import WorkerEngine
from kvsched.worker_stub.sim import SimExecutor

BLOCK_SIZE = 64
PROMPT_LEN = 32
MAX_TOKENS = 1 << 20
MAX_MODEL_LEN = 1 << 20
DEFAULT_JSON = Path(__file__).parent / "results" / "worker_step.json"
Record = dict[str, Any]


@dataclass(slots=True)
class Path_:
    """One way of running a worker step: how Tasks bytes are applied, how a report is sent."""

    name: str
    make_engine: Callable[[int], WorkerEngine]
    apply: Callable[[WorkerEngine, bytes], None]
    step: Callable[[WorkerEngine], Any]  # a report, or None
    encode: Callable[[Any], bytes]  # the report's ConnectRequest, serialized

    def send(self, engine: WorkerEngine) -> bytes | None:
        report = self.step(engine)
        return None if report is None else self.encode(report)


BEFORE_REV = "0919d22"


def _engine(running: int, columnar: bool) -> WorkerEngine:
    sim = SimExecutor(zero_cost=True)
    return WorkerEngine(
        sim, BLOCK_SIZE, running, sim.eos_token_id, MAX_MODEL_LEN, columnar=columnar
    )


def _engine_class_at(rev: str) -> Any:
    """WorkerEngine as engine.py was at git revision `rev`; None outside a git checkout."""
    root = Path(__file__).resolve().parent.parent
    try:
        source = subprocess.run(
            ["git", "show", f"{rev}:kvsched/worker_stub/engine.py"],
            cwd=root,
            capture_output=True,
            check=True,
            text=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    name = f"_worker_engine_{rev}"
    spec = importlib.util.spec_from_loader(name, loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    exec(compile(source, f"{rev}:engine.py", "exec"), module.__dict__)
    return module.WorkerEngine


def _reference_apply(engine: WorkerEngine, raw: bytes) -> None:
    msg = pb.ConnectResponse.FromString(raw)
    engine.apply(codec.tasks_from_proto(msg.tasks))


def _reference_step(engine: WorkerEngine) -> Any:
    engine.has_runnable()
    return engine.step()


def _reference_encode(report: Any) -> bytes:
    return pb.ConnectRequest(report=codec.report_to_proto(report)).SerializeToString()


def paths(before_rev: str = BEFORE_REV) -> list[Path_]:
    out = []
    old = _engine_class_at(before_rev) if before_rev else None
    if old is not None:

        def old_engine(running: int) -> Any:
            sim = SimExecutor(zero_cost=True)
            return old(sim, BLOCK_SIZE, running, sim.eos_token_id, MAX_MODEL_LEN)

        out.append(
            Path_("before", old_engine, _reference_apply, _reference_step, _reference_encode)
        )
    out.append(
        Path_(
            "seqwork",
            lambda r: _engine(r, False),
            _reference_apply,
            _reference_step,
            _reference_encode,
        )
    )

    def columnar_apply(engine: WorkerEngine, raw: bytes) -> None:
        engine.apply(codec.tasks_from_proto(pb.ConnectResponse.FromString(raw).tasks))

    def columnar_encode(report: Any) -> bytes:
        return codec.report_message(report).SerializeToString()

    out.append(
        Path_(
            "columnar", lambda r: _engine(r, True), columnar_apply, _reference_step, columnar_encode
        )
    )
    return out


# ---- the workload -----------------------------------------------------------------------------


def _sampling() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


def setup_tasks(running: int) -> bytes:
    """Place R handles with 2 blocks each and their whole prompt as one chunk."""
    placements, chunks = [], []
    for h in range(1, running + 1):
        blocks = [2 * h, 2 * h + 1]
        placements.append(
            Placement(h, h - 1, f"req-{h}", blocks, 0, PROMPT_LEN, 0, -1, _sampling())
        )
        chunks.append(Chunk(h, 0, list(range(1000 + h, 1000 + h + PROMPT_LEN))))
    return codec.tasks_to_bytes(Tasks(1, placements=placements, chunks=chunks))


def step_tasks(running: int, step: int) -> bytes:
    """One step's Tasks: one more block (64 positions) for each handle h with h + step
    divisible by 64: ~R/64 extensions a step, each handle extended once every 64 steps, as
    fast as it decodes. `stagger` gave every handle at least 96 positions of slack, so none
    ever pauses (measure checks every timed step reports all R handles)."""
    ext = [
        Extension(h, [10 * running + h * 1000 + step])
        for h in range(1, running + 1)
        if (h + step) % BLOCK_SIZE == 0
    ]
    return codec.tasks_to_bytes(Tasks(step + 1, extensions=ext))


def stagger(path: Path_, engine: WorkerEngine, running: int) -> None:
    """Run the prompts, then grow handle h's table so that its room runs out near step h % 64
    of the timed steps (extensions keep coming every 64 steps after that)."""
    path.apply(engine, setup_tasks(running))
    path.send(engine)  # prefill: every handle samples its first token
    ext = [Extension(h, [5 * running + h]) for h in range(1, running + 1)]
    path.apply(engine, codec.tasks_to_bytes(Tasks(2, extensions=ext)))


def measure(path: Path_, running: int, steps: int) -> dict[str, list[float]]:
    engine = path.make_engine(running)
    stagger(path, engine, running)
    # Warm-up steps also bring each handle's room to the staggered state.
    for i in range(BLOCK_SIZE):
        path.apply(engine, step_tasks(running, i))
        path.send(engine)
    raw = [step_tasks(running, BLOCK_SIZE + i) for i in range(steps)]
    times: dict[str, list[float]] = {"parse_us": [], "step_us": [], "report_us": [], "total_us": []}
    for i in range(steps):
        t0 = time.perf_counter_ns()
        path.apply(engine, raw[i])
        t1 = time.perf_counter_ns()
        report = path.step(engine)
        t2 = time.perf_counter_ns()
        path.encode(report)
        t3 = time.perf_counter_ns()
        assert len(report.handles) == running, "a handle paused: the workload is off"
        times["parse_us"].append((t1 - t0) / 1e3)
        times["step_us"].append((t2 - t1) / 1e3)
        times["report_us"].append((t3 - t2) / 1e3)
        times["total_us"].append((t3 - t0) / 1e3)
    return times


def summarize(times: dict[str, list[float]]) -> Record:
    out: Record = {f"{k}_p50": statistics.median(v) for k, v in times.items()}
    total = sorted(times["total_us"])
    out["total_us_p90"] = total[int(0.9 * len(total))]
    return out


def run(runnings: list[int], steps: int, rounds: int, before_rev: str) -> list[Record]:
    results: list[Record] = []
    all_paths = paths(before_rev)
    for running in runnings:
        per_path: dict[str, list[Record]] = {p.name: [] for p in all_paths}
        for _ in range(rounds):
            for path in all_paths:  # alternate: noise hits every path alike
                per_path[path.name].append(summarize(measure(path, running, steps)))
        for name, recs in per_path.items():
            median = sorted(recs, key=lambda r: r["total_us_p50"])[len(recs) // 2]
            results.append({"running": running, "path": name, **median})
    return results


def profile(running: int, steps: int) -> None:
    path = paths()[-1]
    prof = cProfile.Profile()
    prof.enable()
    measure(path, running, steps)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.worker_step", description=__doc__)
    parser.add_argument("--running", default="256,1024")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--profile", type=int, default=0, metavar="R")
    parser.add_argument("--before", default=BEFORE_REV, help="git revision; '' to skip")
    args = parser.parse_args(argv)
    if args.profile:
        profile(args.profile, args.steps)
        return 0
    gc.enable()
    runnings = [int(r) for r in args.running.split(",")]
    results = run(runnings, args.steps, args.rounds, args.before)
    print(f"kvsched worker step: zero-cost sim, block size {BLOCK_SIZE}, steady decode")
    header = ("R", "path", "parse us", "step us", "report us", "total p50", "p90")
    print("{:>6} {:>10} {:>9} {:>9} {:>10} {:>10} {:>9}".format(*header))
    for r in results:
        print(
            f"{r['running']:>6} {r['path']:>10} {r['parse_us_p50']:>9.1f} {r['step_us_p50']:>9.1f} "
            f"{r['report_us_p50']:>10.1f} {r['total_us_p50']:>10.1f} {r['total_us_p90']:>9.1f}"
        )
    record = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": f"{platform.machine()}, {platform.python_version()}, 2 cores, noisy",
        "steps": args.steps,
        "rounds": args.rounds,
        "before_rev": args.before,
        "results": results,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
