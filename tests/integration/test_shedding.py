"""Shedding through the real daemon: with `fairness.shed = "shed"` a request whose TTFT
deadline the instance's cost model predicts it cannot meet is refused at once with
RESOURCE_EXHAUSTED naming the predicted wait; the queue and the KV pool are as before."""

from __future__ import annotations

import pytest

from kvsched.client import Client, ResourceExhausted
from tests.integration.harness import start_daemon, start_worker, status, wait_pool_free, wait_ready
from tests.integration.test_overload import config


def test_a_hopeless_deadline_is_refused_with_the_predicted_wait() -> None:
    cfg = config('[engine.fairness]\nshed = "shed"\n')
    daemon, address = start_daemon("--config", cfg)
    # One slot: a hog holds it, so every prompt behind it stays queued (~0.8 s of predicted
    # prefill each, 8 of them).
    worker = start_worker(address, "w", "--speed", "5", "--num-slots", "1", "--num-blocks", "4000")
    streams = []
    try:
        wait_ready(address, ["w"])
        with Client(address, timeout=60) as client:
            hog = client.generate([7] * 20, max_tokens=5000, ignore_eos=True, request_id="hog")
            streams.append(hog)
            for i in range(8):
                prompt = [1000 * i + k % 997 + 3 for k in range(20_000)]
                streams.append(client.generate(prompt, max_tokens=4, request_id=f"q{i}"))
            before = status(address).instances[0]
            assert before.num_waiting == 8
            with pytest.raises(ResourceExhausted) as err:
                client.generate([5] * 2000, max_tokens=4, ttft_deadline_ms=500, tenant="t1")
            assert "predicted time to first token" in err.value.message
            assert "ttft_deadline_ms 500" in err.value.message
            # The same through a Session: an error entry for that submit, the session goes on.
            with client.session() as session:
                session.submit([5] * 2000, client_tag="late", max_tokens=4, ttft_deadline_ms=500)
                errors = []
                for batch in session:
                    errors += batch.errors
                    if errors:
                        break
                session.cancel()
            assert [e.client_tag for e in errors] == ["late"]
            assert isinstance(errors[0].exception(), ResourceExhausted)
            assert "predicted time to first token" in errors[0].message
            after = status(address).instances[0]
            assert after.num_waiting == before.num_waiting
            assert after.num_running == before.num_running == 1  # (the hog decodes on)
            # A deadline it can meet, and no deadline, are queued.
            streams.append(client.generate([6] * 200, max_tokens=4, ttft_deadline_ms=3_600_000))
            streams.append(client.generate([8] * 200, max_tokens=4, tenant="t1"))
            assert status(address).instances[0].num_waiting == 10
            for s in streams:
                s.cancel()
            streams.clear()
        wait_pool_free(address)
    finally:
        for s in streams:
            s.cancel()
        worker.stop()
        daemon.stop()
