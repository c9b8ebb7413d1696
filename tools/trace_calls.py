"""Runtime call trace of the daemon: which kvsched modules one request and one decode report
pass through (issue 22's measure of how tangled the house is, read at run time rather than
from the import graph).

A daemon runs in this process with its gRPC server on loopback and one reference sim worker
(with its simulated step times, so each report is one worker step and the windows are the same
run after run) connected to it over a real gRPC stream. Two windows are traced with
`sys.setprofile`:

- generate: one Generate (a 64-token prompt, 4 tokens, after one warm-up Generate of the same
  prompt), from the client's call until its Finished message;
- decode report: one steady decode report of a long Generate: the daemon decoding the 20th
  StepReport (`codec.report_from_proto`), then the engine step that applies it (apply_report,
  the token delivery to the request's sink, schedule(), the Tasks encoded and queued to the
  worker's stream). Nothing else that runs between the two is counted.

Each window is traced `--runs` times (5: five Generates one after another; reports 20, 40, ...
of one long Generate) and the most common result, by every count, is the one reported, with
how many runs agreed and the counts of the others: on a loaded box the daemon sometimes finds
two reports pending and applies them in one step (600 and 682 calls instead of 687 for a
Generate at 7831caf in 2 of 6 one-run traces at load average 7), or a step does periodic work
besides the report.

Counted: Python function calls (and coroutine/generator resumes, which the profiler reports as
calls) of functions defined in `kvsched.*` modules, the daemon's side only. The sim worker
(`kvsched.worker_stub`) runs in its own process in production: a call is left out when a
worker frame is on its stack, so the worker's own use of shared modules (the codec encoding its
reports, decoding its Tasks) is not counted (until this tool counted it: 47 of the 734 calls of
a Generate at 7831caf). `kvsched.client` (unused here) and the generated `kvsched.v1` are left
out too. Printed as a table and saved as JSON, per window:

    calls        kvsched function calls in the window
    modules      distinct kvsched modules those functions are defined in
    cross        calls whose calling frame (the callee's f_back) is in another kvsched module
    edges        distinct (caller module -> callee module) pairs among those
    upcalls      cross calls against the static import direction: the callee's module imports
                 the caller's module directly or transitively, in the import graph of the traced
                 tree (tests/test_layout.py's: every import statement anywhere in a module, lazy
                 ones in functions and TYPE_CHECKING ones included; a submodule importing its
                 parent package is no edge). Calls between modules with no import path either
                 way are not upcalls; calls within a module are not cross calls. (The layout
                 test keeps the graph free of circles, so at most one direction holds.)
    reentries    calls into a module M while a frame of M is on the stack below a frame of
                 another module (M -> B -> M; M -> B -> C -> M): the nearest counted frame below
                 the new one is not M and a frame of M lies further down (the stack is the
                 daemon-side kvsched frames, stdlib/grpc/asyncio frames between them skipped).
                 Each such call counts once; M -> M calls made inside the re-entered M do not
    classes      kvsched classes whose instances were written in the window (below)
    extra        extra writers: the sum over those classes of (writer modules - 1)
    tokens       tokens delivered in the window: the Generate's (the client counts them);
                 the traced StepReport's `token_ids` for the decode report
    cross/tok    cross / tokens
    obs, obs%    cross calls whose caller or callee is an observability module, and their share
                 of cross: the kvsched.server.telemetry package, on the flat server/ of
                 60c09e6 and before the 14 modules that moved into it (metrics, cluster_metrics,
                 host_metrics, step_cost_metrics, tenant_metrics, histograms, tracing,
                 tracing_setup, spans, otlp, otlp_wire, logs, refusals, telemetry)

Writes: for the window, every class defined in a loaded daemon-side kvsched module (enums left
out) gets a `__setattr__` that does the store and then records (class, writing module,
attribute): `obj.f = v`, `obj.f += v` and `setattr(obj, "f", v)` alike, whatever expression
names the object. The writing module is the nearest counted frame's at the store (a stdlib
helper's caller). Construction is no write: a store by the object's own `__init__`,
`__post_init__`, `__new__` or `__setstate__` (first argument that very object). Not seen:
stores bypassing `__setattr__` (`object.__setattr__` in frozen dataclasses, `__dict__[k] = v`)
and changes inside a container a field holds (`obj.xs.append(v)` writes the list). The JSON
names the worst class (most writer modules) and every class's writers with their attributes.

The JSON also names the traced tree's commit: the tool runs against whatever `kvsched` the
interpreter imports, so an older checkout is traced by putting it first on PYTHONPATH and
passing this file by path (the imports below fall back to the older module paths):

    python tools/trace_calls.py [--json PATH] [--edges]
    # after (this tree), as committed in bench/results/:
    PYTHONPATH=$PWD .venv/bin/python tools/trace_calls.py \\
        --json bench/results/trace_calls_$(git rev-parse --short HEAD).json
    # before (60c09e6, the tree before server/ moved into sub-packages):
    git worktree add /tmp/old 60c09e6 && PYTHONPATH=/tmp/old .venv/bin/python \\
        tools/trace_calls.py --json bench/results/trace_calls_60c09e6.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
from trace_measures import Recorder, import_graph, package_modules, reachable

import kvsched
from kvsched import codec
from kvsched.v1 import common_pb2, request_service_pb2_grpc
from kvsched.v1 import request_service_pb2 as rpb
from kvsched.worker_stub.client import Worker, sim_engine_factory

try:  # a tree from before the composition root moved (the harness compares commits)
    from kvsched.server import app as daemon_mod  # type: ignore[attr-defined]
except ImportError:
    from kvsched.daemon import app as daemon_mod
try:  # a tree from before server/ moved into sub-packages (60c09e6 and older)
    from kvsched.server.config.load import load_config
except ImportError:
    from kvsched.server.config_load import load_config  # type: ignore[no-redef]

SCALARS = ("calls", "modules", "cross", "edges", "upcalls", "reentries")
SCALARS += ("classes_written", "extra_writers", "tokens", "obs_cross")
DEFAULT_JSON = Path(__file__).resolve().parents[1] / "bench" / "results" / "trace_calls.json"
PKG = Path(kvsched.__file__).resolve().parent  # the traced tree (PYTHONPATH decides which)


def _tree() -> str:
    """The traced tree's commit (short sha, '+' if its kvsched/ has uncommitted changes)."""
    git = ["git", "-C", str(PKG.parent)]
    try:
        sha = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run([*git, "status", "--porcelain", "kvsched"], capture_output=True)
    except OSError:
        return "unknown"
    return sha.stdout.strip() + ("+" if dirty.stdout.strip() else "") or "unknown"


def _request(req_id: str, prompt_len: int, max_tokens: int) -> rpb.GenerateRequest:
    prompt = [3 + (i * 31) % 30000 for i in range(prompt_len)]
    return rpb.GenerateRequest(
        request_id=req_id,
        prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )


async def _generate(stub: Any, msg: rpb.GenerateRequest) -> int:
    n = 0
    async for r in stub.Generate(msg):
        if r.WhichOneof("kind") == "tokens":
            n += len(r.tokens.token_ids)
    return n


def most_common(recs: list[Recorder]) -> dict[str, Any]:
    """The result of the most common window among `recs` (by every count), with how many of
    the runs agreed and the counts of those that did not."""
    results = [r.result() for r in recs]
    keys = [tuple(r[k] for k in SCALARS) for r in results]
    best, same = Counter(keys).most_common(1)[0]
    out = results[keys.index(best)]
    out["runs"], out["same"] = len(results), same
    out["other_runs"] = [dict(zip(SCALARS, k, strict=True)) for k in keys if k != best]
    return out


async def trace(runs: int = 5) -> dict[str, Any]:
    config = load_config(None, {}, {"listen": "127.0.0.1:0", "metrics_listen": ""})
    daemon = daemon_mod.Daemon(config)
    server = daemon_mod.build_server(daemon, config)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    worker = Worker(
        f"127.0.0.1:{port}",
        "i0",
        sim_engine_factory(16, zero_cost=False),
        num_gpu_blocks=512,
        block_size=16,
        num_slots=16,
        reconnect_backoff_s=(0.01, 0.05),
    )
    wtask = asyncio.get_running_loop().create_task(worker.run())
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = request_service_pb2_grpc.RequestServiceStub(channel)
    reach = reachable(import_graph(package_modules(PKG)))
    out: dict[str, Any] = {}
    try:

        async def ready() -> None:
            while not ("i0" in daemon.engines and daemon.engines["i0"].ready):
                await asyncio.sleep(0.01)

        await asyncio.wait_for(ready(), 30)
        await asyncio.wait_for(_generate(stub, _request("warm", 64, 4)), 30)

        gen: list[Recorder] = []
        for i in range(runs):
            rec = Recorder(reach)
            rec.start()
            try:
                n = await asyncio.wait_for(_generate(stub, _request(f"traced{i}", 64, 4)), 30)
            finally:
                rec.stop()
            assert n == 4, f"the traced Generate got {n} tokens, not 4"
            rec.tokens = n
            gen.append(rec)
        out["generate"] = most_common(gen)

        # Steady decode report cycles of one long request (its prompt is done, every report is
        # one decode row): the daemon decoding report 20 (40, 60, ...) and the step applying it.
        recs = {20 * (i + 1): Recorder(reach) for i in range(runs)}
        done = asyncio.Event()
        seen = 0
        tracing: Recorder | None = None
        real = codec.report_from_proto
        eng = daemon.engines["i0"]
        real_step = eng.step

        def counting(msg: Any) -> Any:
            nonlocal seen, tracing
            seen += 1
            rec = recs.get(seen)
            if rec is None:
                return real(msg)
            rec.tokens = len(msg.token_ids)
            rec.start()
            try:
                return real(msg)
            finally:
                rec.stop()
                tracing = rec

        def step() -> None:
            nonlocal tracing
            rec = tracing
            if not (rec is not None and eng.reports):
                real_step()
                return
            rec.start()
            try:
                real_step()
            finally:
                rec.stop()
                tracing = None
                if seen >= max(recs):
                    done.set()

        codec.report_from_proto = counting  # type: ignore[assignment]
        eng.step = step  # type: ignore[method-assign]
        try:
            long = asyncio.get_running_loop().create_task(
                _generate(stub, _request("steady", 64, 20 * runs + 40))
            )
            await asyncio.wait_for(done.wait(), 30 + runs)
            await asyncio.wait_for(long, 60)
        finally:
            for r in recs.values():
                r.stop()
            codec.report_from_proto = real
            del eng.step
        out["decode_report"] = most_common(list(recs.values()))
    finally:
        worker.stop()
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await asyncio.wait_for(wtask, 10)
        await channel.close()
        await server.stop(None)
        daemon.close_telemetry()
    return out


WINDOWS = ("generate", "decode_report")
COLUMNS = (  # (header, key, width)
    ("calls", "calls", 6),
    ("mods", "modules", 5),
    ("cross", "cross", 6),
    ("edges", "edges", 6),
    ("up", "upcalls", 4),
    ("re-in", "reentries", 6),
    ("cls", "classes_written", 4),
    ("extra", "extra_writers", 6),
    ("tok", "tokens", 4),
    ("x/tok", "cross_per_token", 7),
    ("obs", "obs_cross", 4),
    ("obs%", "obs_share", 6),
)


def _cell(v: Any, width: int) -> str:
    if isinstance(v, float):
        return f"{v * 100:>{width}.1f}" if v <= 1 else f"{v:>{width}.1f}"
    return f"{'-' if v is None else v:>{width}}"


def table(result: dict[str, Any], details: bool = False) -> str:
    """The windows as a table, the worst-written class of each below it."""
    head = f"{'window':<14}" + "".join(f" {h:>{w}}" for h, _, w in COLUMNS)
    lines = [f"tree {result['tree']} ({result['package']})", head]
    for name in WINDOWS:
        r = result[name]
        cells = "".join(f" {_cell(r[k], w)}" for _, k, w in COLUMNS)
        lines.append(f"{name:<14}{cells}  ({r['same']} of {r['runs']} runs)")
    for name in WINDOWS:
        worst = result[name]["worst_class"]
        if worst:
            n = len(worst["writers"])
            lines.append(
                f"{name}: worst class {worst['class']} ({n}: {', '.join(worst['writers'])})"
            )
        if details:
            for key in ("per_upcall", "per_reentry", "per_edge"):
                lines.append(f"  {name} {key}:")
                lines += [f"    {n:>4}  {e}" for e, n in result[name][key].items()]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=str(DEFAULT_JSON), help="where to write the result")
    ap.add_argument(
        "--edges", action="store_true", help="print every upcall, re-entry and edge with its count"
    )
    ap.add_argument("--runs", type=int, default=5, help="windows traced of each kind")
    args = ap.parse_args()
    windows = asyncio.run(trace(args.runs))
    result: dict[str, Any] = {"tree": _tree(), "package": str(PKG), **windows}
    print(table(result, args.edges))
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {path}")


if __name__ == "__main__":
    main()
