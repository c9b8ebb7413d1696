"""Memory cost of refused requests: the daemon's RSS growth over N refused 60 MB requests.

    python -m bench.refusal_rss [--requests 100] [--legacy-requests 10]
                                [--json bench/results/refusal_rss.json]

A daemon (`kvsched serve`, metrics off) and one sim worker; each request is a GenerateRequest
of 15 M token ids of 4 bytes each (60 MB serialized, far over max_model_len 131,072), sent one
after the other from this process (serialized once; the bytes are sent as they are). Reported
per configuration: the daemon's RSS before, after, and its peak (VmHWM) from /proc, the status
each refusal got, seconds per refusal, and whether a valid request still runs afterwards.

Configurations, in one run: `derived` (the default: max_message_bytes 0, the receive limit
derived from max_model_len, ~1.8 MiB) and `legacy_64MiB` (max_message_bytes = 64 MiB, the old
default: the daemon parses each request and refuses it by its length, before making its prompt
a Python list). Goal (issue 24): growth under 100 MB over 100 refusals in the default.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import grpc

from kvsched.client import Client
from kvsched.replay.launch import spawn, start_daemon
from kvsched.v1 import common_pb2
from kvsched.v1 import request_service_pb2 as rpb

DEFAULT_JSON = Path(__file__).parent / "results" / "refusal_rss.json"
NUM_TOKENS = 15_000_000
TOKEN = 1 << 21  # a 4-byte varint: 15 M of them are 60 MB


def rss_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of process `pid`, KiB."""
    got: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            got[key] = int(rest.split()[0])
    return got["VmRSS"], got["VmHWM"]


def big_request() -> bytes:
    msg = rpb.GenerateRequest(sampling=common_pb2.SamplingParams(max_tokens=4))
    msg.prompt_token_ids.extend([TOKEN] * NUM_TOKENS)
    return msg.SerializeToString()


def run_config(name: str, env: dict[str, str], n: int, payload: bytes) -> dict[str, Any]:
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        daemon, address = start_daemon()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    worker = spawn("worker", "worker", "--server", address, "--zero-cost", "--log-level", "warning")
    try:
        with Client(address, timeout=60) as c:
            deadline = time.monotonic() + 60
            while not any(i.ready for i in c.status().instances):
                if time.monotonic() > deadline:
                    raise RuntimeError("worker not ready")
                time.sleep(0.05)
            c.generate([1, 2, 3], max_tokens=4).tokens()  # warm: one request served
        pid = daemon.popen.pid
        before, _ = rss_kib(pid)
        codes: dict[str, int] = {}
        options = [("grpc.max_send_message_length", 128 << 20)]
        t0 = time.perf_counter()
        with grpc.insecure_channel(address, options=options) as ch:
            call = ch.unary_stream(
                "/kvsched.v1.RequestService/Generate",
                request_serializer=lambda b: b,
                response_deserializer=rpb.GenerateResponse.FromString,
            )
            for _ in range(n):
                try:
                    for _msg in call(payload, timeout=60):
                        pass
                    codes["OK"] = codes.get("OK", 0) + 1
                except grpc.RpcError as exc:
                    key = exc.code().name  # type: ignore[attr-defined]
                    codes[key] = codes.get(key, 0) + 1
                    detail = exc.details()  # type: ignore[attr-defined]
        per_s = (time.perf_counter() - t0) / n
        time.sleep(1.0)
        after, peak = rss_kib(pid)
        with Client(address, timeout=60) as c:
            served = len(c.generate([1, 2, 3], max_tokens=4).tokens()) == 4
        return {
            "config": name,
            "requests": n,
            "request_bytes": len(payload),
            "rss_before_mib": round(before / 1024, 1),
            "rss_after_mib": round(after / 1024, 1),
            "growth_mib": round((after - before) / 1024, 1),
            "peak_mib": round(peak / 1024, 1),
            "s_per_refusal": round(per_s, 3),
            "codes": codes,
            "last_detail": detail[:160],
            "valid_request_served_after": served,
        }
    finally:
        worker.stop()
        daemon.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=100, help="refusals, default config")
    ap.add_argument("--legacy-requests", type=int, default=10, help="refusals, 64 MiB config")
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to save the results")
    args = ap.parse_args()
    payload = big_request()
    rows = [run_config("derived", {}, args.requests, payload)]
    if args.legacy_requests:
        env = {"KVSCHED_MAX_MESSAGE_BYTES": str(64 << 20)}
        rows.append(run_config("legacy_64MiB", env, args.legacy_requests, payload))
    head = ("config", "requests", "MB each", "RSS before", "after", "growth", "peak", "s/refusal")
    print("  ".join(f"{h:>11}" for h in head))
    for r in rows:
        cells = (
            r["config"], r["requests"], f"{r['request_bytes'] / 1e6:.0f}",
            f"{r['rss_before_mib']} MiB", f"{r['rss_after_mib']} MiB", f"{r['growth_mib']} MiB",
            f"{r['peak_mib']} MiB", r["s_per_refusal"],
        )  # fmt: skip
        print("  ".join(f"{c!s:>11}" for c in cells))
        print(f"  statuses {r['codes']}; last: {r['last_detail']!r}; "
              f"valid request served after: {r['valid_request_served_after']}")  # fmt: skip
    out = {
        "bench": "refusal_rss",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared, noisy)",
        "command": "python -m bench.refusal_rss "
        f"--requests {args.requests} --legacy-requests {args.legacy_requests}",
        "rows": rows,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2) + "\n")
    print(f"saved {args.json}")


if __name__ == "__main__":
    main()
