"""The serving stacks `bench.serve_ab` (and `bench.vllm_serve`) compare, each started the same
way (this interpreter, one process group each, logs in the work directory, VLLM_CPU_KVCACHE_SPACE
=1), and what a run reads from their processes:

    vllm          python -m vllm.entrypoints.openai.api_server --model DIR --dtype float32
                  --max-model-len 1024 --block-size 32 --served-model-name tiny
    kvsched       kvsched serve + kvsched worker --executor vllm + kvsched http
    kvsched-grpc  kvsched serve + kvsched worker --executor vllm (driven by kvsched's gRPC client)

- CPU seconds (user + sys) of every process of each started process group (a vLLM server's
  EngineCore and its worker, a kvsched worker's vLLM child included), from /proc: live
  processes' own times plus the times of children they reaped.
- The kvsched worker's counters (steps, tokens): SIGUSR1 makes it log them.
- vLLM's Prometheus counters: `vllm:iteration_tokens_total` (tokens per engine step, prompt
  tokens included) and `vllm:generation_tokens_total`.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bench.serve_procs import Procs, free_port, running, wait_http, wait_ready

NAME = "tiny"
MAX_MODEL_LEN = "1024"
STACKS = ("vllm", "kvsched", "kvsched-grpc")
# Named variants: (stack, extra environment, extra vLLM server arguments). kvsched-spin: vLLM's
# shared-memory readers spin as vLLM has them (kvsched.worker_vllm.spin), the path before issue
# 33; kvsched and vllm both compile the model (vLLM's default, the worker's since issue 33);
# kvsched-eager / vllm-eager: each in eager mode (KVSCHED_VLLM_COMPILE=0, --enforce-eager);
# kvsched-compiled: the same as kvsched, named for the older result files; kvsched-spinbatch:
# the worker's readers spin while steps run at most 2 requests (KVSCHED_VLLM_SPIN_BATCH=2);
# kvsched-sync: one step at a time, none launched ahead (KVSCHED_VLLM_AHEAD=0, the path before);
# kvsched-nodefer: steps launched ahead, a new request's rows never deferred (an extra step);
# kvsched-rows8 / kvsched-rowsall: launched ahead only after steps of at most 8 rows (the limit
# before) / after every step; kvsched-childspin: vLLM's worker child spins as vLLM has it (holds
# the core vLLM binds it to), the worker alone naps (KVSCHED_VLLM_CHILD_NAPS=0); kvsched-uvloop:
# the daemon and the worker on uvloop (KVSCHED_EVENT_LOOP=uvloop, kvsched/event_loop.py);
# kvsched-itl57: steps with prefill chunks predicted under 57 ms (1.5x the step-bound model's
# decode step at c=16) and chunks as small as 16 tokens (the default floor is 256);
# kvsched-itl250: steps with prefill predicted under 250 ms (the step-bound model at c=64, whose
# decodes alone fill most of the default 100 ms); kvsched-itl66: prefill under 66 ms (1.5x the
# step-bound model's 44 ms decode step at c=16) in chunks of at least 32 tokens.
VARIANTS: dict[str, tuple[str, dict[str, str], list[str]]] = {
    "kvsched-spin": ("kvsched", {"KVSCHED_VLLM_NAP_US": "0"}, []),
    "kvsched-compiled": ("kvsched", {"KVSCHED_VLLM_COMPILE": "1"}, []),
    "kvsched-eager": ("kvsched", {"KVSCHED_VLLM_COMPILE": "0"}, []),
    "kvsched-spinbatch": ("kvsched", {"KVSCHED_VLLM_SPIN_BATCH": "2"}, []),
    "kvsched-sync": ("kvsched", {"KVSCHED_VLLM_AHEAD": "0"}, []),
    "kvsched-nodefer": ("kvsched", {"KVSCHED_VLLM_DEFER_MAX_MS": "0"}, []),
    "kvsched-rows8": ("kvsched", {"KVSCHED_VLLM_AHEAD_MAX_ROWS": "8"}, []),
    "kvsched-rowsall": ("kvsched", {"KVSCHED_VLLM_AHEAD_MAX_ROWS": "100000"}, []),
    "kvsched-childspin": ("kvsched", {"KVSCHED_VLLM_CHILD_NAPS": "0"}, []),
    "kvsched-uvloop": ("kvsched", {"KVSCHED_EVENT_LOOP": "uvloop"}, []),
    "kvsched-itl57": (
        "kvsched",
        {
            "KVSCHED_ENGINE__SCHEDULER__ITL_TARGET_MS": "57",
            "KVSCHED_ENGINE__SCHEDULER__MIN_PREFILL_CHUNK": "16",
        },
        [],
    ),
    "kvsched-itl250": ("kvsched", {"KVSCHED_ENGINE__SCHEDULER__ITL_TARGET_MS": "250"}, []),
    "kvsched-itl66": (
        "kvsched",
        {
            "KVSCHED_ENGINE__SCHEDULER__ITL_TARGET_MS": "66",
            "KVSCHED_ENGINE__SCHEDULER__MIN_PREFILL_CHUNK": "32",
        },
        [],
    ),
    "kvsched-drain0": ("kvsched", {"KVSCHED_ENGINE__SCHEDULER__QUEUE_DRAIN_STEPS": "0"}, []),
    "kvsched-drain2": ("kvsched", {"KVSCHED_ENGINE__SCHEDULER__QUEUE_DRAIN_STEPS": "2"}, []),
    "kvsched-drain8": ("kvsched", {"KVSCHED_ENGINE__SCHEDULER__QUEUE_DRAIN_STEPS": "8"}, []),
    "vllm-eager": ("vllm", {}, ["--enforce-eager"]),
}
_KVSCHED = [sys.executable, "-m", "kvsched.cli"]
_TICK = os.sysconf("SC_CLK_TCK")
_STATS = re.compile(r"worker stats: (\d+) steps, (\d+) tokens")


@dataclass
class Stack:
    """A started stack: `url` is the HTTP base URL (vllm, kvsched) or the daemon's address
    (kvsched-grpc); `env` what every process of it was given besides the defaults."""

    kind: str
    procs: Procs
    url: str
    env: dict[str, str] = field(default_factory=dict)
    metrics_url: str = ""  # the kvsched daemon's Prometheus endpoint (started with metrics)

    def cpu_s(self) -> dict[str, float]:
        """CPU seconds so far of each started process's group (its children included)."""
        by_group = _cpu_by_session()
        return {name: by_group.get(p.pid, 0.0) for name, p in self.procs.procs}

    def counters(self) -> dict[str, float]:
        """Engine steps and tokens so far: the kvsched worker's, or vLLM's metrics."""
        if self.kind == "vllm":
            return vllm_counters(self.url)
        return worker_counters(self.procs, "kvsched_worker")


def _cpu_by_session() -> dict[int, float]:
    """utime + stime + cutime + cstime of every process, summed by session id (each started
    process leads its own session), in seconds."""
    out: dict[int, float] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        sid = int(fields[3])
        out[sid] = out.get(sid, 0.0) + sum(int(x) for x in fields[11:15]) / _TICK
    return out


def worker_counters(procs: Procs, name: str, timeout: float = 10.0) -> dict[str, float]:
    """Signal the worker to log its counters; the numbers of the line it logs."""
    log = procs.log_dir / f"{name}.log"
    before = len(_STATS.findall(log.read_text(errors="replace")))
    pid = dict(procs.procs)[name].pid
    os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = _STATS.findall(log.read_text(errors="replace"))
        if len(found) > before:
            steps, tokens = found[-1]
            return {"steps": float(steps), "output_tokens": float(tokens)}
        time.sleep(0.05)
    raise TimeoutError(f"{name} logged no stats in {timeout:.0f} s")


def vllm_counters(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()

    def total(metric: str) -> float:
        pat = re.compile(rf"^{re.escape(metric)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", re.M)
        return sum(float(v) for v in pat.findall(text))

    return {
        "steps": total("vllm:iteration_tokens_total_count"),
        "iteration_tokens": total("vllm:iteration_tokens_total_sum"),
        "output_tokens": total("vllm:generation_tokens_total"),
    }


@contextlib.contextmanager
def started(
    kind: str,
    model_dir: Path,
    logs: Path,
    env: dict[str, str] | None = None,
    engine_args: list[str] | None = None,
    metrics: bool = False,
) -> Iterator[Stack]:
    """Start one stack, wait until it serves, stop it on exit. `env` goes to every process;
    `engine_args` to vLLM's server or to the kvsched worker (flags both take, e.g. LoRA's);
    `metrics`: the kvsched daemon serves its Prometheus metrics (`Stack.metrics_url`)."""
    kind, extra, server_args = VARIANTS.get(kind, (kind, {}, []))
    server_args = [*server_args, *(engine_args or [])]
    env = {**(env or {}), **extra}
    logs.mkdir(parents=True, exist_ok=True)
    with running(logs) as procs:
        if kind == "vllm":
            port = free_port()
            argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
            argv += ["--model", str(model_dir), "--dtype", "float32"]
            argv += ["--max-model-len", MAX_MODEL_LEN, "--block-size", "32"]
            argv += ["--served-model-name", NAME, "--host", "127.0.0.1", "--port", str(port)]
            argv += server_args
            procs.start("vllm_server", argv, env)
            url = f"http://127.0.0.1:{port}"
            wait_http(procs, f"{url}/health")
            metrics_url = f"{url}/metrics"
        elif kind in ("kvsched", "kvsched-grpc"):
            metrics_url = f"http://127.0.0.1:{free_port()}/metrics" if metrics else ""
            url = _start_kvsched(
                procs,
                model_dir,
                env,
                http=kind == "kvsched",
                worker_args=engine_args or [],
                metrics_listen=metrics_url.removeprefix("http://").removesuffix("/metrics"),
            )
        else:
            raise ValueError(f"unknown stack {kind!r}: one of {', '.join([*STACKS, *VARIANTS])}")
        yield Stack(kind, procs, url, env, metrics_url)


def _start_kvsched(
    procs: Procs,
    model_dir: Path,
    env: dict[str, str],
    http: bool,
    worker_args: list[str],
    metrics_listen: str = "",
) -> str:
    daemon = f"127.0.0.1:{free_port()}"
    procs.start(
        "kvsched_daemon",
        [*_KVSCHED, "serve", "--listen", daemon, "--metrics-listen", metrics_listen or "off"],
        {"KVSCHED_ENGINE__SCHEDULER__MAX_MODEL_LEN": MAX_MODEL_LEN, "KVSCHED_MODEL": NAME, **env},
    )
    worker = [*_KVSCHED, "worker", "--server", daemon, "--instance", "v0", "--executor", "vllm"]
    worker += ["--model", str(model_dir), "--dtype", "float32"]
    worker += ["--max-model-len", MAX_MODEL_LEN, "--served-model-name", NAME, *worker_args]
    procs.start("kvsched_worker", worker, env)
    if not http:
        wait_ready(procs, daemon)
        return daemon
    url = f"http://127.0.0.1:{free_port()}"
    front = [*_KVSCHED, "http", "--listen", url.removeprefix("http://"), "--server", daemon]
    front += ["--model", str(model_dir), "--served-model-name", NAME]
    procs.start("kvsched_http", front, env)
    wait_http(procs, f"{url}/v1/models", want='"ready_instances":1')
    return url
