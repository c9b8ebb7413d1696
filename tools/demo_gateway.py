"""`make demo-gateway`: kvsched behind a gateway (docs/GATEWAY.md), start to finish.

Makes the tiny model offline (tools/demo_real.py's), starts `kvsched serve --tokenizer DIR`,
one `kvsched worker --executor vllm` on the model (from the `vllm` extra's own virtualenv) and
the Shepherd Model Gateway (`smg launch`, the `gateway` extra) in front of the daemon's gRPC
port, then sends a streamed chat with curl and with the official `openai` client to the
gateway, printing each step. `--executor sim` runs the same with the simulator as the worker.

    python tools/demo_gateway.py --worker-python .venv-vllm/bin/python   # make demo-gateway
    python tools/demo_gateway.py --executor sim
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from demo_real import MODEL, Child, curl_chat, make_model_dir, openai_chat, say, start_worker


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Gateway:
    """`smg launch` on loopback in front of `address`; its output is kept for failures."""

    def __init__(self, address: str, env: dict[str, str]) -> None:
        smg = Path(sys.executable).parent / "smg"
        self.port = free_port()
        self.cmd = [
            str(smg) if smg.exists() else "smg", "launch",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--log-level", "warn", "--worker-urls", f"grpc://{address}",
        ]  # fmt: skip
        self.lines: list[str] = []
        self.popen = subprocess.Popen(
            self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_model(self, timeout: float) -> str:
        import httpx

        url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                break
            try:
                got = httpx.get(f"{url}/v1/models", timeout=2).json()
                if any(m.get("id") == MODEL for m in got.get("data", [])):
                    return url
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.2)
        raise RuntimeError("smg never listed the model\n" + self.tail())

    def tail(self, n: int = 30) -> str:
        return "\n".join(f"  [smg] {line}" for line in self.lines[-n:])

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()  # its graceful stop waits 5 s for load balancers
        self.popen.wait(10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--executor", choices=("vllm", "sim"), default="vllm")
    ap.add_argument("--worker-python", default=".venv-vllm/bin/python", help="vllm's environment")
    ap.add_argument("--ready-timeout", type=float, default=240.0, help="seconds for the worker")
    args = ap.parse_args()
    started = time.monotonic()
    env = dict(os.environ, PYTHONUNBUFFERED="1", VLLM_CPU_KVCACHE_SPACE="1", NO_COLOR="1")
    env.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    workdir = Path(tempfile.mkdtemp(prefix="kvsched-demo-gateway-"))
    model_dir = workdir / MODEL
    children: list[Child] = []
    gateway: Gateway | None = None
    try:
        say(f"making the tiny model offline in {model_dir}")
        make_model_dir(model_dir, args.executor, args.worker_python)
        print("  " + ", ".join(sorted(p.name for p in model_dir.iterdir())))

        sargs = ["serve", "--listen", "127.0.0.1:0", "--metrics-listen", "off"]
        sargs += ["--tokenizer", str(model_dir)]
        say("starting the daemon: kvsched " + " ".join(sargs))
        daemon = Child("daemon", sys.executable, sargs, env)
        children.append(daemon)
        address = daemon.wait_for(r"kvsched listening on (\S+:\d+)", 30).group(1)
        print(f"  listening on {address} (its own services and vllm.grpc.engine.VllmEngine)")

        start_worker(address, args, model_dir, env, children)

        gateway = Gateway(address, env)
        say("starting the gateway: " + " ".join(gateway.cmd))
        url = gateway.wait_model(60)
        print(f"  smg serves {url}/v1 (model {MODEL!r}, registered from kvsched's GetModelInfo)")

        say("a streamed chat completion with curl, through smg")
        curl_chat(url)
        say("streamed chat completions with the openai client, through smg")
        openai_chat(url)
        say(f"done in {time.monotonic() - started:.0f} s; stopping everything")
        return 0
    except (RuntimeError, subprocess.SubprocessError, OSError, AssertionError) as exc:
        print(f"\ndemo-gateway failed: {exc}", file=sys.stderr)
        for c in children:
            print(c.tail(), file=sys.stderr)
        if gateway is not None:
            print(gateway.tail(), file=sys.stderr)
        return 1
    finally:
        if gateway is not None:
            gateway.stop()
        for c in reversed(children):
            c.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
