"""Prefill/decode with LoRA adapters: a LoRA request's hand-off goes only to a decode instance
whose workers announced its adapter (never to one that would run it as the base model), and
a decode instance holds hand-offs of at most max_loras adapters (a third adapter's request is
refused UNAVAILABLE naming the adapter slot: retry). Real daemon and sim workers (KV pushes
of the sim's blob)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvsched.client import Client, Unavailable
from tests.integration.harness import start_daemon, start_worker, status, wait_ready

CONFIG = """
[instances.p]
role = "prefill"

[instances.d-base]
role = "decode"

[instances.d-lora]
role = "decode"
"""


def test_lora_hand_offs_go_to_a_decode_instance_with_the_adapter(tmp_path: Path) -> None:
    path = tmp_path / "kvsched.toml"
    path.write_text(CONFIG)
    daemon, address = start_daemon("--config", str(path))
    kv = ("--listen-kv", "127.0.0.1:0", "--zero-cost")
    lora = ("--lora-modules", "x=/adapters/x", "y=/adapters/y", "z=/adapters/z")
    procs = [
        start_worker(address, "p", *kv, *lora, "--max-loras", "3"),
        start_worker(address, "d-base", *kv),
        start_worker(address, "d-lora", *kv, *lora, "--max-loras", "2"),
        daemon,
    ]
    try:
        wait_ready(address, ["p", "d-base", "d-lora"])
        with Client(address, timeout=30) as c:
            before = {i.instance_id: i.num_steps for i in status(address).instances}
            for i in range(6):  # (d-base is as idle: by load alone it would get half)
                s = c.generate([3 + i, 4, 5, 6], max_tokens=4, lora_name="xy"[i % 2])
                assert len(s.tokens()) == 4 and s.finished is not None
                assert s.finished.reason == "length"
            steps = {
                i.instance_id: i.num_steps - before[i.instance_id]
                for i in status(address).instances
            }
            assert steps["d-base"] == 0 and steps["d-lora"] >= 6 * 3, steps
            # Two adapters held on d-lora (long requests), a third finds no adapter slot.
            with (
                c.generate([1] * 8, max_tokens=10_000, lora_name="x") as hx,
                c.generate([2] * 8, max_tokens=10_000, lora_name="y") as hy,
            ):
                next(iter(hx))
                next(iter(hy))
                with pytest.raises(Unavailable) as e:
                    c.generate([9] * 8, max_tokens=4, lora_name="z")
                assert "max_loras" in e.value.message and "d-lora" in e.value.message
                s = c.generate([8] * 8, max_tokens=4, lora_name="x")  # a held adapter: room
                assert len(s.tokens()) == 4
                s = c.generate([7] * 8, max_tokens=4)  # the base model: d-base or d-lora
                assert len(s.tokens()) == 4
    finally:
        for p in procs:
            p.stop()


CONFIG_TWO = """
[instances.p2]
role = "prefill"

[instances.da]
role = "decode"

[instances.db]
role = "decode"
"""


def test_lora_hand_offs_follow_adapter_affinity_among_decode_instances(tmp_path: Path) -> None:
    """Two decode instances with one adapter slot each (max_loras 1): a hand-off goes where its
    adapter is held or running, though that instance is the busier (by load alone it would go
    to the other, which runs another adapter and has no room for it: refused), else to the one
    with a free slot."""
    path = tmp_path / "kvsched.toml"
    path.write_text(CONFIG_TWO)
    daemon, address = start_daemon("--config", str(path))
    kv = ("--listen-kv", "127.0.0.1:0", "--zero-cost")
    lora = ("--lora-modules", "x=/adapters/x", "y=/adapters/y", "--max-loras", "1")
    procs = [
        start_worker(address, "p2", *kv, *lora),
        start_worker(address, "da", *kv, *lora),
        start_worker(address, "db", *kv, *lora),
        daemon,
    ]
    try:
        wait_ready(address, ["p2", "da", "db"])
        c = Client(address, timeout=60)
        with (
            c,
            c.generate([1] * 8, max_tokens=10_000, lora_name="x") as x1,
            c.generate([2] * 8, max_tokens=10_000, lora_name="x") as x2,
            c.generate([3] * 8, max_tokens=10_000, lora_name="y") as y1,
        ):
            for s in (x1, x2, y1):
                next(iter(s))
            held = {i.instance_id: i.num_running for i in status(address).instances}
            assert sorted([held["da"], held["db"]]) == [1, 2], held  # x twice on one
            for i in range(3):  # x where x is, the busier; y where y is
                for name in ("x", "y"):
                    s = c.generate([9, i, 9], max_tokens=3, lora_name=name)
                    assert len(s.tokens()) == 3
    finally:
        for p in procs:
            p.stop()


PD_MODELS = """
[instances.p]
role = "prefill"

[instances.d-beta]
role = "decode"

[instances.d-alpha]
role = "decode"
"""


def test_hand_offs_go_to_a_decode_instance_of_the_prefill_instances_model(
    tmp_path: Path,
) -> None:
    """A daemon serving two models: model alpha's hand-offs go to alpha's decode instance
    only, never to beta's (attached first: the router's tie order would take it)."""
    path = tmp_path / "kvsched.toml"
    path.write_text(PD_MODELS)
    daemon, address = start_daemon("--config", str(path))
    kv = ("--listen-kv", "127.0.0.1:0", "--zero-cost")
    procs = [daemon, start_worker(address, "d-beta", *kv, "--served-model-name", "beta")]
    try:
        wait_ready(address, ["d-beta"])
        procs.append(start_worker(address, "d-alpha", *kv, "--served-model-name", "alpha"))
        procs.append(start_worker(address, "p", *kv, "--served-model-name", "alpha"))
        wait_ready(address, ["p", "d-beta", "d-alpha"])
        with Client(address, timeout=30) as c:
            before = {i.instance_id: i.num_steps for i in status(address).instances}
            for i in range(4):
                s = c.generate([3 + i, 4, 5, 6], max_tokens=4, model="alpha")
                assert len(s.tokens()) == 4 and s.finished is not None
                assert s.finished.reason == "length"
            steps = {
                i.instance_id: i.num_steps - before[i.instance_id]
                for i in status(address).instances
            }
            assert steps["d-beta"] == 0 and steps["d-alpha"] >= 4 * 3, steps
    finally:
        for p in procs[::-1]:
            p.stop()
