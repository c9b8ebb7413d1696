"""Runtime call trace of the daemon: which kvsched modules one request and one decode report
pass through (issue 22's measure of how tangled the house is, read at run time rather than
from the import graph).

A daemon runs in this process with its gRPC server on loopback and one reference sim worker
(with its simulated step times, so each report is one worker step and the windows are the same
run after run) connected to it over a real gRPC stream. Two windows are traced with
`sys.setprofile`:

- generate: one Generate (a 64-token prompt, 4 tokens, after one warm-up Generate), from the
  client's call until its Finished message;
- decode report: one steady decode report of a long Generate: the daemon decoding the 20th
  StepReport (`codec.report_from_proto`), then the engine step that applies it (apply_report,
  the token delivery to the request's sink, schedule(), the Tasks encoded and queued to the
  worker's stream). Nothing else that runs between the two is counted.

Counted: Python function calls (and coroutine/generator resumes, which the profiler reports as
calls) of functions defined in `kvsched.*` modules, the daemon's side only: the worker
(`kvsched.worker_stub`) runs in its own process in production and is left out, as is the
client (`kvsched.client`), which this harness does not use. Printed and saved as JSON:

    calls        kvsched function calls in the window
    modules      distinct kvsched modules those functions are defined in
    cross        calls whose calling frame is in another kvsched module
    edges        distinct (caller module -> callee module) pairs among those

    python tools/trace_calls.py [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

import grpc

from kvsched import codec
from kvsched.server.config.load import load_config
from kvsched.v1 import common_pb2, request_service_pb2_grpc
from kvsched.v1 import request_service_pb2 as rpb
from kvsched.worker_stub.client import Worker, sim_engine_factory

try:  # a tree from before the composition root moved (the harness compares commits)
    from kvsched.server import app as daemon_mod  # type: ignore[attr-defined]
except ImportError:
    from kvsched.daemon import app as daemon_mod

DEFAULT_JSON = Path(__file__).resolve().parents[1] / "bench" / "results" / "trace_calls.json"
_EXCLUDED = ("kvsched.worker_stub", "kvsched.client")


def _module(frame: FrameType | None) -> str | None:
    """The kvsched module a frame's code belongs to (None: not counted)."""
    if frame is None:
        return None
    name = frame.f_globals.get("__name__", "")
    if not isinstance(name, str) or not name.startswith("kvsched"):
        return None
    if name.startswith(_EXCLUDED):
        return None
    return name


class Recorder:
    """A sys.setprofile hook counting calls, modules and module-to-module edges."""

    def __init__(self) -> None:
        self.calls = 0
        self.cross = 0
        self.modules: Counter[str] = Counter()
        self.edges: Counter[tuple[str, str]] = Counter()

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        mod = _module(frame)
        if mod is None:
            return
        self.calls += 1
        self.modules[mod] += 1
        caller = _module(frame.f_back)
        if caller is not None and caller != mod:
            self.cross += 1
            self.edges[(caller, mod)] += 1

    def start(self) -> None:
        sys.setprofile(self)

    @staticmethod
    def stop() -> None:
        sys.setprofile(None)

    def result(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "modules": len(self.modules),
            "cross": self.cross,
            "edges": len(self.edges),
            "per_module": dict(self.modules.most_common()),
            "per_edge": {f"{a} -> {b}": n for (a, b), n in self.edges.most_common()},
        }


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


async def trace() -> dict[str, Any]:
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
    out: dict[str, Any] = {}
    try:

        async def ready() -> None:
            while not ("i0" in daemon.engines and daemon.engines["i0"].ready):
                await asyncio.sleep(0.01)

        await asyncio.wait_for(ready(), 30)
        await asyncio.wait_for(_generate(stub, _request("warm", 64, 4)), 30)

        rec = Recorder()
        rec.start()
        try:
            n = await asyncio.wait_for(_generate(stub, _request("traced", 64, 4)), 30)
        finally:
            rec.stop()
        assert n == 4, f"the traced Generate got {n} tokens, not 4"
        out["generate"] = rec.result()

        # One steady decode report cycle: between the daemon decoding report 20 and 21 of a
        # long request (its prompt is done, every report is one decode row).
        rec = Recorder()
        done = asyncio.Event()
        seen = 0
        tracing = False
        real = codec.report_from_proto
        eng = daemon.engines["i0"]
        real_step = eng.step

        def counting(msg: Any) -> Any:
            nonlocal seen, tracing
            seen += 1
            if seen != 20:
                return real(msg)
            rec.start()
            try:
                return real(msg)
            finally:
                rec.stop()
                tracing = True

        def step() -> None:
            nonlocal tracing
            if not (tracing and eng.reports):
                real_step()
                return
            rec.start()
            try:
                real_step()
            finally:
                rec.stop()
                tracing = False
                done.set()

        codec.report_from_proto = counting  # type: ignore[assignment]
        eng.step = step  # type: ignore[method-assign]
        try:
            long = asyncio.get_running_loop().create_task(
                _generate(stub, _request("steady", 64, 400))
            )
            await asyncio.wait_for(done.wait(), 30)
            await asyncio.wait_for(long, 60)
        finally:
            rec.stop()
            codec.report_from_proto = real
            del eng.step
        out["decode_report"] = rec.result()
    finally:
        worker.stop()
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await asyncio.wait_for(wtask, 10)
        await channel.close()
        await server.stop(None)
        daemon.telemetry.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=str(DEFAULT_JSON), help="where to write the result")
    ap.add_argument("--edges", action="store_true", help="print every edge with its count")
    args = ap.parse_args()
    result = asyncio.run(trace())
    print(f"{'window':<14} {'calls':>6} {'modules':>8} {'cross':>6} {'edges':>6}")
    for name, r in result.items():
        print(f"{name:<14} {r['calls']:>6} {r['modules']:>8} {r['cross']:>6} {r['edges']:>6}")
        if args.edges:
            for e, n in r["per_edge"].items():
                print(f"    {n:>4}  {e}")
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {path}")


if __name__ == "__main__":
    main()
