"""A real Prometheus server (the distribution's `prometheus`) scraping a real daemon with two sim
workers under load, every 1 s, through the shipped examples/prometheus/prometheus.yml and its
alert rules; values are read back through Prometheus's HTTP query API and compared with what
the clients sent and received. Every PromQL expression of the Grafana dashboard in
examples/grafana runs against it and must return data. `promtool` checks the shipped files."""

from __future__ import annotations

import asyncio
import json
import math
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest

from kvsched.v1 import common_pb2, request_service_pb2_grpc
from kvsched.v1 import request_service_pb2 as rpb
from tests.integration.clients import Outcome, Spec, generate, mixed_specs
from tests.integration.harness import REPO, Proc, start_daemon, start_worker, wait_ready

PROM_DIR = REPO / "examples" / "prometheus"
DASHBOARD = REPO / "examples" / "grafana" / "kvsched-dashboard.json"
NUM_BLOCKS, BLOCK_SIZE = 4096, 16  # each sim worker's pool, given on its command line
INSTANCES = ("i0", "i1")
T = TypeVar("T")


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(
            f"`{name}` is not on PATH: install the distribution's prometheus package "
            "(apt-get install prometheus; .ci/run does)"
        )
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def substitute(text: str, pairs: list[tuple[str, str]]) -> str:
    for old, new in pairs:
        assert text.count(old) == 1, f"the sample config no longer has exactly one {old!r}"
        text = text.replace(old, new)
    return text


class Prometheus:
    """`prometheus` on a free loopback port, storage in `tmp`, scraping `target` with the
    shipped sample config (1 s scrape and rule evaluation instead of 5 s)."""

    def __init__(self, tmp: Path, target: str) -> None:
        config = substitute(
            (PROM_DIR / "prometheus.yml").read_text(),
            [
                ("scrape_interval: 5s", "scrape_interval: 1s"),
                ("evaluation_interval: 5s", "evaluation_interval: 1s"),
                ('"127.0.0.1:9464"', json.dumps(target)),
                ("- kvsched-alerts.yml", f"- {PROM_DIR / 'kvsched-alerts.yml'}"),
            ],
        )
        (tmp / "prometheus.yml").write_text(config)
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = tmp / "prometheus.log"
        with self.log.open("w") as log:
            self.popen = subprocess.Popen(
                [
                    tool("prometheus"),
                    f"--config.file={tmp / 'prometheus.yml'}",
                    f"--storage.tsdb.path={tmp / 'data'}",
                    f"--web.listen-address={self.url.removeprefix('http://')}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def wait(self, what: str, probe: Callable[[], T | None], timeout: float = 30.0) -> T:
        """Poll `probe` until it returns something other than None (or False)."""
        deadline = time.monotonic() + timeout
        while True:
            if self.popen.poll() is not None:
                raise AssertionError(f"prometheus exited ({self.popen.returncode}):\n{self.tail()}")
            got = probe()
            if got is not None and got is not False:
                return got
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"timed out waiting for {what}; prometheus log:\n{self.tail()}"
                )
            time.sleep(0.1)

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def api(self, path: str, **params: str) -> Any:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                body = json.load(resp)
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{path} {params}: HTTP {exc.code}: {exc.read()!r}") from None
        assert body["status"] == "success", (path, params, body)
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", (expr, data)
        return list(data["result"])

    def by(self, expr: str, label: str = "instance") -> dict[str, float]:
        """{value of `label`: sample value}; the series must differ in `label`."""
        result = self.query(expr)
        out = {r["metric"].get(label, ""): float(r["value"][1]) for r in result}
        assert len(out) == len(result), (expr, label, result)
        return out

    def value(self, expr: str) -> float:
        result = self.query(expr)
        assert len(result) == 1, (expr, result)
        return float(result[0]["value"][1])

    def tail(self) -> str:
        return "\n".join(self.log.read_text().splitlines()[-40:])

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)


def per_instance(outs: list[Outcome], f: Callable[[Outcome], float]) -> dict[str, float]:
    """Sum of `f` over the requests each instance served (0 for one that served none: the
    router may send all to one instance, and the daemon still shows the other's counters)."""
    sums: dict[str, float] = dict.fromkeys(INSTANCES, 0)
    for o in outs:
        sums[o.instance] = sums.get(o.instance, 0) + f(o)
    return sums


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 20
    return exprs


def fill(expr: str, model: str, instance: str) -> str:
    out = (
        expr.replace("$__rate_interval", "5m")  # covers the whole test's data
        .replace("$model", model)
        .replace("$instance", instance)
    )
    assert "$" not in out, f"a template variable the test does not know: {expr}"
    return out


def test_prometheus_scrapes_the_daemon_under_load_and_runs_the_dashboard(tmp_path: Path) -> None:
    tool("prometheus")
    daemon, address = start_daemon("--metrics-listen", "127.0.0.1:0")
    target = daemon.wait_for(r"kvsched metrics on (\S+:\d+)").group(1)
    prom = Prometheus(tmp_path, target)
    pool = ("--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE))
    workers = {iid: start_worker(address, iid, *pool) for iid in INSTANCES}  # sim h100 step times
    try:
        wait_ready(address, workers)
        prom.wait("prometheus ready", prom.ready)
        prom.wait("the first scrape", lambda: prom.by('up{job="kvsched"}', "daemon") or None)
        assert prom.by('up{job="kvsched"}', "daemon") == {target: 1.0}
        # honor_labels: `instance` is the GPU instance id, not the scrape address.
        assert prom.by("kvsched_instance_ready") == {"i0": 1.0, "i1": 1.0}
        (model,) = prom.by("count by (model) (kvsched_instance_ready)", "model")
        served = check_load(prom, address, model)
        check_dashboard(prom, model, served)
        check_rules_and_alerts(prom, workers)
    finally:
        prom.stop()
        for w in workers.values():
            w.stop()
        daemon.stop()


def check_load(prom: Prometheus, address: str, model: str) -> list[str]:
    """Two waves of mixed requests (the second hits the prefixes the first cached), then one
    long request held until Prometheus has seen its KV blocks, then aborted. Returns the
    instances that served requests."""
    specs = mixed_specs(40, seed=7)
    hold = Spec("hold", [3 + (i * 7919) % 30000 for i in range(800)], 20000)

    async def go() -> tuple[list[Outcome], Outcome]:
        async with grpc.aio.insecure_channel(address) as ch:
            stub = request_service_pb2_grpc.RequestServiceStub(ch)
            outs = []
            for wave in (specs[:20], specs[20:]):
                outs += await asyncio.gather(*(generate(stub, s.message()) for s in wave))
            await asyncio.to_thread(check_after_waves, prom, outs, model)
            queued = asyncio.Event()
            held = asyncio.create_task(generate(stub, hold.message(), queued=queued))
            await asyncio.wait_for(queued.wait(), 10)
            return outs, await hold_then_abort(prom, stub, held)

    async def hold_then_abort(
        prom: Prometheus, stub: request_service_pb2_grpc.RequestServiceStub, held: Any
    ) -> Outcome:
        def seen() -> dict[str, float] | None:
            running = prom.by("kvsched_num_requests_running")
            return running if sum(running.values()) == 1 else None

        running = await asyncio.to_thread(prom.wait, "the held request running", seen)
        (inst,) = [i for i, v in running.items() if v == 1]
        # Both gauges of one scrape (one query, one timestamp): usage and free blocks agree,
        # and at least the held prompt's blocks are in use.
        kv = prom.query(
            f'{{__name__=~"kvsched_kv_cache_usage_perc|kvsched_num_free_blocks", instance="{inst}"}}'
        )
        assert len(kv) == 2 and kv[0]["value"][0] == kv[1]["value"][0], kv
        got = {r["metric"]["__name__"]: float(r["value"][1]) for r in kv}
        usage, free = got["kvsched_kv_cache_usage_perc"], got["kvsched_num_free_blocks"]
        assert usage == pytest.approx(1 - free / NUM_BLOCKS, abs=1e-12)
        assert NUM_BLOCKS - free >= math.ceil(len(hold.prompt) / BLOCK_SIZE)
        await stub.Abort(rpb.AbortRequest(request_id="hold"), timeout=10)
        out: Outcome = await asyncio.wait_for(held, 30)
        assert out.finished is not None and out.finished.reason == common_pb2.FINISH_REASON_ABORT
        assert out.instance == inst
        return out

    outs, held = asyncio.run(go())
    everything = [*outs, held]

    def settled() -> bool:
        return (
            prom.by('kvsched_request_success_total{finished_reason="abort"}').get(held.instance)
            == 1.0
            and sum(prom.by("kvsched_num_requests_running").values()) == 0
        )

    prom.wait("the abort scraped", settled)
    assert prom.by("kvsched_generation_tokens_total") == per_instance(
        everything, lambda o: len(o.tokens)
    )
    assert prom.by("kvsched_prompt_tokens_total") == per_instance(
        everything, lambda o: o.finished.usage.prompt_tokens if o.finished else 0
    )
    assert prom.by("kvsched_time_to_first_token_seconds_count") == per_instance(
        everything, lambda o: 1
    )
    # Cached blocks count as free: with nothing running every block is free again.
    assert set(prom.by("kvsched_kv_cache_usage_perc").values()) == {0.0}
    assert set(prom.by("kvsched_num_free_blocks").values()) == {NUM_BLOCKS}
    assert set(prom.by("kvsched_num_requests_waiting").values()) == {0.0}
    return [i for i, n in per_instance(everything, lambda o: 1).items() if n]


def check_after_waves(prom: Prometheus, outs: list[Outcome], model: str) -> None:
    for o in outs:
        assert o.code is None and o.finished is not None, (o.req_id, o.code, o.details)
    n = len(outs)

    def finished() -> bool:
        return prom.by("sum(kvsched_request_success_total)", "").get("") == n

    prom.wait(f"{n} finished requests scraped", finished)
    reasons = Counter(common_pb2.FinishReason.Name(o.finished.reason) for o in outs if o.finished)
    assert prom.by(
        "sum by (finished_reason) (kvsched_request_success_total)", "finished_reason"
    ) == {name.removeprefix("FINISH_REASON_").lower(): float(c) for name, c in reasons.items()}
    served = per_instance(outs, lambda o: 1)
    tokens = per_instance(outs, lambda o: len(o.tokens))
    prompt = per_instance(outs, lambda o: o.finished.usage.prompt_tokens if o.finished else 0)
    cached = per_instance(outs, lambda o: o.finished.usage.cached_tokens if o.finished else 0)
    assert sum(cached.values()) > 0, "the second wave should hit the first wave's prefixes"
    assert prom.by("kvsched_generation_tokens_total") == tokens
    assert prom.by("kvsched_prompt_tokens_total") == prompt
    assert prom.by("kvsched_prefix_cache_queries_total") == prompt
    assert prom.by("kvsched_prefix_cache_hits_total") == cached
    assert set(prom.by("kvsched_num_preemptions_total").values()) == {0.0}
    assert (
        prom.by(f'sum by (instance) (kvsched_request_success_total{{model="{model}"}})') == served
    )
    for hist in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert prom.by(f"kvsched_{hist}_seconds_count") == served, hist
    assert prom.by("kvsched_time_per_output_token_seconds_count") == per_instance(
        outs, lambda o: 1 if len(o.tokens) > 1 else 0
    )
    # One inter-token observation per output token after each request's first.
    assert prom.by("kvsched_inter_token_latency_seconds_count") == {
        i: tokens[i] - served[i] for i in served
    }
    for name, timing in (("time_to_first_token", "ttft_s"), ("e2e_request_latency", "e2e_s")):
        want = per_instance(outs, lambda o, t=timing: getattr(o.finished.timings, t))
        got = prom.by(f"kvsched_{name}_seconds_sum")
        assert got == pytest.approx(want, rel=1e-9), name
    # Step time: every instance that served requests stepped; +Inf bucket == count.
    steps = prom.by("kvsched_scheduler_step_seconds_count")
    assert all(steps[i] > 0 for i, n in served.items() if n)
    assert prom.by('kvsched_scheduler_step_seconds_bucket{le="+Inf"}') == steps
    step_sums = prom.by("kvsched_scheduler_step_seconds_sum")
    assert all(step_sums[i] > 0 for i, n in served.items() if n)


def check_dashboard(prom: Prometheus, model: str, served: list[str]) -> None:
    """Every target expression, for "All" and for each instance that served requests (one
    that served none has no latency to show), returns at least one finite value."""
    dash = json.loads(DASHBOARD.read_text())
    for var in dash["templating"]["list"]:
        if var["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\((.+), (\w+)\)", var["query"]["query"])
        assert m, var
        values = prom.api(f"label/{m.group(2)}/values", **{"match[]": fill(m.group(1), model, "")})
        assert values == (["default"] if var["name"] == "model" else ["i0", "i1"]), var
    empty = []
    for expr in dashboard_exprs():
        for instance in (".*", *served):
            result = prom.query(fill(expr, model, instance))
            values = [float(r["value"][1]) for r in result]
            if not any(math.isfinite(v) for v in values):
                empty.append((instance, expr, values))
    assert not empty, "dashboard queries with no (finite) data:\n" + "\n".join(map(str, empty))


def check_rules_and_alerts(prom: Prometheus, workers: dict[str, Proc]) -> None:
    names = re.findall(r"^\s*- alert: (\w+)$", (PROM_DIR / "kvsched-alerts.yml").read_text(), re.M)

    def evaluated() -> list[dict[str, Any]] | None:
        rules = [r for g in prom.api("rules")["groups"] for r in g["rules"]]
        return rules if rules and all(r["health"] != "unknown" for r in rules) else None

    rules = prom.wait("every rule evaluated", evaluated)
    assert sorted(r["name"] for r in rules) == sorted(names)
    assert [
        (r["name"], r["health"], r.get("lastError", "")) for r in rules if r["health"] != "ok"
    ] == []

    def active() -> set[tuple[str, str]]:
        return {
            (a["labels"]["alertname"], a["labels"].get("instance", ""))
            for a in prom.api("alerts")["alerts"]
        }

    # Healthy: no alert active (one that went pending in a scrape mid-load, e.g. a queue with
    # nothing placed yet, clears at the next evaluation).
    prom.wait("no alert while healthy", lambda: active() == set() or None)
    # A worker lost: its instance's series stays, at 0, and the alert goes pending.
    workers["i1"].signal(signal.SIGKILL)
    want = {("KvschedInstanceNotReady", "i1")}
    prom.wait("the lost worker's alert", lambda: active() == want or None)
    # The last worker lost: no instance is ready.
    workers["i0"].signal(signal.SIGKILL)
    want |= {("KvschedInstanceNotReady", "i0"), ("KvschedNoInstanceReady", "")}
    prom.wait("the no-instance alert", lambda: active() == want or None)


def test_promtool_accepts_the_sample_config_and_rules_and_their_unit_tests() -> None:
    promtool = tool("promtool")
    for args in (
        ["check", "config", "prometheus.yml"],  # also checks the rule file it names
        ["check", "rules", "kvsched-alerts.yml"],
        # The rules' unit tests: each alert fires when (and only when) its case says.
        ["test", "rules", "kvsched-alerts.test.yml"],
    ):
        res = subprocess.run(
            [promtool, *args], cwd=PROM_DIR, capture_output=True, text=True, timeout=60
        )
        assert res.returncode == 0, res.stdout + res.stderr
        assert "SUCCESS" in res.stdout + res.stderr
