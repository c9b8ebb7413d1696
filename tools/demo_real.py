"""`make demo-real`: a model served through kvsched over HTTP, start to finish.

Makes the tiny model offline (a random-weight Llama from kvsched.tinymodel.model plus the tiny
BPE tokenizer, both in one directory), starts `kvsched serve`, one `kvsched worker --executor
vllm` on it (vLLM's model runner, from the `vllm` extra's own virtualenv) and `kvsched http`,
then sends streamed chat requests with curl and with the official `openai` client, printing
each step. `--executor sim` runs the same with the simulator as the worker (no vLLM needed).

    python tools/demo_real.py --worker-python .venv-vllm/bin/python     # what make demo-real runs
    python tools/demo_real.py --executor sim
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

MODEL = "tiny"
VOCAB = 512


class Child:
    """A `kvsched ...` child process whose output is kept (and shown when something fails)."""

    def __init__(self, name: str, python: str, args: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.lines: list[str] = []
        self.popen = subprocess.Popen(
            [python, "-m", "kvsched.cli", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if m := rx.search(line):
                    return m
            if self.popen.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"{self.name}: no line matching {pattern!r}\n" + self.tail())

    def tail(self, n: int = 30) -> str:
        return "\n".join(f"  [{self.name}] {line}" for line in self.lines[-n:])

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)


def say(msg: str) -> None:
    print(f"\n== {msg}", flush=True)


def make_model_dir(directory: Path, executor: str, worker_python: str) -> None:
    code = (
        "import sys\n"
        "from kvsched.tinymodel.tokenizer import make_tokenizer\n"
        f"make_tokenizer(sys.argv[1], vocab_size={VOCAB})\n"
    )
    if executor == "vllm":  # the weights need torch: the vllm extra's environment has it
        code += f"from kvsched.tinymodel.model import make_model\nmake_model(sys.argv[1], vocab_size={VOCAB})\n"
    python = worker_python if executor == "vllm" else sys.executable
    env = dict(os.environ, TRANSFORMERS_VERBOSITY="error")
    subprocess.run([python, "-c", code, str(directory)], check=True, env=env)


def start_worker(
    address: str, args: argparse.Namespace, model_dir: Path, env: dict, children: list[Child]
) -> None:
    """Instance i0's worker (vLLM's runner, or the sim) on the daemon at `address`, added to
    `children` (stopped with them) before waiting until it is ready."""
    wargs = ["worker", "--server", address, "--instance", "i0", "--served-model-name", MODEL]
    if args.executor == "vllm":
        wargs += ["--executor", "vllm", "--model", str(model_dir), "--dtype", "float32"]
        python = args.worker_python
    else:
        wargs += ["--executor", "sim", "--vocab-size", str(VOCAB)]
        python = sys.executable
    say("starting the worker: kvsched " + " ".join(wargs))
    children.append(Child("worker", python, wargs, env))
    wait_ready(address, args.ready_timeout)
    print("  instance i0 ready")


def wait_ready(address: str, timeout: float) -> None:
    from kvsched.client import Client

    deadline = time.monotonic() + timeout
    with Client(address, timeout=5) as client:
        while True:
            st = client.status()
            if any(i.ready for i in st.instances):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"no instance ready after {timeout:.0f} s")
            time.sleep(0.2)


def curl_chat(url: str) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 24,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    cmd = [
        "curl", "-sS", "-N", f"{url}/v1/chat/completions",
        "-H", "Content-Type: application/json", "-d", json.dumps(body),
    ]  # fmt: skip
    print("$ " + shlex.join(cmd))
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120).stdout
    events = [line for line in out.splitlines() if line.startswith("data: ")]
    for line in events[:3] + ["..."] + events[-3:] if len(events) > 7 else events:
        print("  " + (line if len(line) < 200 else line[:197] + "..."))
    if events[-1] != "data: [DONE]":
        raise RuntimeError("the SSE stream did not end with [DONE]")
    print(f"  ({len(events)} server-sent events)")


def openai_chat(url: str) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    print("models:", [m.id for m in client.models.list().data])
    for question in ("Can you count to ten?", "How do you make tea?"):
        print(f"user: {question}\nassistant: ", end="", flush=True)
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": question}],
            max_tokens=32,
            temperature=0.8,
            seed=1,
            stream=True,
            stream_options={"include_usage": True},
        )
        usage = None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                print(chunk.choices[0].delta.content, end="", flush=True)
            usage = chunk.usage or usage
        assert usage is not None
        print(f"\n  (usage: {usage.prompt_tokens} prompt + {usage.completion_tokens} completion)")
    print("(a random-weight model: the words are noise; the plumbing is real)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--executor", choices=("vllm", "sim"), default="vllm")
    ap.add_argument("--worker-python", default=".venv-vllm/bin/python", help="vllm's environment")
    ap.add_argument("--ready-timeout", type=float, default=240.0, help="seconds for the worker")
    args = ap.parse_args()
    started = time.monotonic()
    env = dict(os.environ, PYTHONUNBUFFERED="1", VLLM_CPU_KVCACHE_SPACE="1")
    env.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    workdir = Path(tempfile.mkdtemp(prefix="kvsched-demo-real-"))
    model_dir = workdir / MODEL
    children: list[Child] = []
    try:
        say(f"making the tiny model offline in {model_dir} (tokenizer vocab {VOCAB})")
        make_model_dir(model_dir, args.executor, args.worker_python)
        print("  " + ", ".join(sorted(p.name for p in model_dir.iterdir())))

        say("starting the daemon: kvsched serve --listen 127.0.0.1:0")
        daemon = Child("daemon", sys.executable, ["serve", "--listen", "127.0.0.1:0", "--metrics-listen", "off"], env)  # fmt: skip
        children.append(daemon)
        address = daemon.wait_for(r"kvsched listening on (\S+:\d+)", 30).group(1)
        print(f"  listening on {address}")

        start_worker(address, args, model_dir, env, children)

        hargs = ["http", "--listen", "127.0.0.1:0", "--server", address, "--model", str(model_dir)]
        hargs += ["--served-model-name", MODEL, "--log-level", "warning"]
        say("starting the front end: kvsched " + " ".join(hargs))
        http = Child("http", sys.executable, hargs, env)
        children.append(http)
        url = "http://" + http.wait_for(r"kvsched http listening on (\S+:\d+)", 60).group(1)
        print(f"  serving {url}/v1")

        say("a streamed chat completion with curl")
        curl_chat(url)
        say("streamed chat completions with the openai client")
        openai_chat(url)
        say(f"done in {time.monotonic() - started:.0f} s; stopping everything")
        return 0
    except (RuntimeError, subprocess.SubprocessError, OSError, AssertionError) as exc:
        print(f"\ndemo-real failed: {exc}", file=sys.stderr)
        for c in children:
            print(c.tail(), file=sys.stderr)
        return 1
    finally:
        for c in reversed(children):
            c.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
