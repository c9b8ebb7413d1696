"""Models across daemons: a peer's instances carry their model and limits in what they
publish, so a daemon routes a request naming a model only a peer serves to that peer, refuses
one that fits none of that model's instances naming the limit, answers NOT_FOUND naming every
model of the cluster for an unknown one, and ListModels lists the cluster's models. Real
nats-server, two daemons, one sim worker each."""

from __future__ import annotations

import time

import pytest

from kvsched.client import Client, InvalidArgument, NotFound
from kvsched.cluster.natsd import NatsServer
from tests.integration.harness import start_daemon, start_worker, wait_ready


def test_models_route_across_daemons(nats_server: NatsServer) -> None:
    procs = []
    try:
        d0, a0 = start_daemon("--cluster", nats_server.url, "--daemon-id", "cm-d0")
        d1, a1 = start_daemon("--cluster", nats_server.url, "--daemon-id", "cm-d1")
        procs += [d0, d1]
        procs.insert(0, start_worker(a0, "cm-a", "--zero-cost", "--served-model-name", "alpha"))
        procs.insert(
            0,
            start_worker(
                a1, "cm-b", "--zero-cost", "--served-model-name", "beta", "--max-model-len", "1000"
            ),
        )
        wait_ready(a0, ["cm-a"])
        wait_ready(a1, ["cm-b"])
        deadline = time.monotonic() + 30
        while True:
            with Client(a0, timeout=5) as c:
                models = {m.name: m for m in c.list_models()}
            if {"alpha", "beta"} <= set(models) and models["beta"].ready_instances:
                break
            assert time.monotonic() < deadline, models
            time.sleep(0.1)
        assert (models["beta"].max_model_len, models["beta"].vocab_size) == (1000, 32000)
        with Client(a0, timeout=30) as c:
            s = c.generate([1, 2, 3], max_tokens=3, model="beta")  # only d1 serves it
            assert s.instance == "cm-b" and len(s.tokens()) == 3
            s = c.generate([1, 2, 3], max_tokens=3, model="alpha")
            assert s.instance == "cm-a" and len(s.tokens()) == 3
            with pytest.raises(InvalidArgument) as e:
                c.generate([1] * 995, max_tokens=10, model="beta")
            assert "max_model_len 1000" in e.value.message
            with pytest.raises(NotFound) as e2:
                c.generate([1, 2], max_tokens=2, model="gamma")
            assert "'alpha'" in e2.value.message and "'beta'" in e2.value.message
    finally:
        for p in procs:
            p.stop()
