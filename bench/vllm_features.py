"""Benchmark rows of the engine features under vLLM's model runner (issue 36): what speculative
decoding gives, and what a prefill/decode hand-off costs. Real processes on loopback, the tiny
model made offline (float32), kvsched's gRPC client as the load.

    python -m bench.vllm_features [--parts spec,pd,draft] [--rounds 2] [--requests 24]
        [--pd-modes push,storage,cluster]

spec  One daemon + one `kvsched worker --executor vllm`, with ngram drafts (K = 3) and
      without, in alternating rounds; greedy prompts made of a few repeated phrases (prompt
      lookup finds drafts in them; the same shape as tests/vllm/test_spec_decode.py), 8 in
      flight, 64 tokens each (ignore_eos). Output tok/s (client side), output tokens per
      engine step (the worker's counters), drafts verified / accepted (the daemon's counters,
      from the worker's report rows).
draft Speculative decoding with a draft model (`--draft-model`, K = 3) vs ngram drafts vs none,
      one round each (noisy), as for spec but on random prompts (prompt lookup finds little
      in them): drafts from the tiny model's first layer alone (its embeddings, layer 0, norm
      and head: a 1-layer model of the same vocabulary, `truncated_draft`), and from the tiny
      model itself (every proposal is the target's greedy token: the ceiling).
pd    One daemon with a prefill and a decode instance, a vLLM worker each, handing off by
      worker-to-worker push (`--listen-kv`) and through the storage tier (a Mooncake Store on
      loopback, `cache.pd_transfer = "storage"`), in alternating rounds; prompts of ~1,000
      tokens, 2 in flight, 8 tokens each. Per 1,000 prompt tokens: push: the prefill worker's
      wall seconds of the pushes (the decode worker's write into its cache included) and of
      reading them out of vLLM's cache (export); storage: the prefill worker's wall seconds of
      its writes (read out of vLLM's cache + put) and the decode worker's of its fetches (get +
      write into its cache); both: the client's gap between a request's first token (the
      prefill instance's) and its second (the decode instance's: the hand-off, its wait for
      the transfer and the decode worker's first step), and the prefill worker's busy seconds.
      `cluster` (with --pd-modes): the storage hand-off across two daemons of a cluster
      (nats-server on loopback; daemon A the prefill instance, daemon B the decode one).

Prints a table per part and saves bench/results/vllm_features.json. Figures on 2 shared cores
are noisy: report the load averages printed with them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.serve_procs import REPO, Procs, free_port, running, wait_ready

_KVSCHED = [sys.executable, "-m", "kvsched.cli"]
K = 3
_STATS = re.compile(
    r"worker stats: (\d+) steps, (\d+) tokens, .*busy ([0-9.]+) s.*"
    r"KV pushed (\d+) blocks in ([0-9.]+) s \(export ([0-9.]+) s\).*"
    r"storage writes ([0-9.]+) s, fetches ([0-9.]+) s"
)
PD_TOML = """
[engine.scheduler]
max_num_batched_tokens = 512
max_model_len = 1024

[instances.p]
role = "prefill"

[instances.d]
role = "decode"
"""
PD_STORAGE = """
[instances.p.cache]
pd_transfer = "storage"
"""


def spec_prompts(n: int, seed: int = 4) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrases = [[rng.randrange(5, 512) for _ in range(rng.randrange(3, 7))] for _ in range(3)]
        out.append([t for _ in range(rng.randrange(3, 8)) for t in rng.choice(phrases)])
    return out


def random_prompts(n: int, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 512) for _ in range(rng.randrange(40, 70))] for _ in range(n)]


def truncated_draft(target: Path, out: Path, layers: int = 1) -> Path:
    """A draft model of the target's vocabulary: its first `layers` layers under its own
    embeddings, final norm and head (layer skipping), written as a model directory."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(target)
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text((target / "generation_config.json").read_text())
    return out


def long_prompts(n: int, length: int = 1000, seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 512) for _ in range(length)] for _ in range(n)]


def worker(daemon: str, instance: str, model: Path, *extra: str) -> list[str]:
    argv = [*_KVSCHED, "worker", "--server", daemon, "--instance", instance]
    argv += ["--executor", "vllm", "--model", str(model), "--dtype", "float32"]
    argv += ["--max-model-len", "1024", "--num-slots", "16", "--max-num-batched-tokens", "512"]
    return [*argv, *extra]


def worker_stats(procs: Procs, name: str, timeout: float = 30.0) -> dict[str, float]:
    """SIGUSR1: the worker logs its counters; the numbers of the line it logs."""
    log = procs.log_dir / f"{name}.log"
    before = len(_STATS.findall(log.read_text(errors="replace")))
    os.kill(dict(procs.procs)[name].pid, signal.SIGUSR1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = _STATS.findall(log.read_text(errors="replace"))
        if len(found) > before:
            steps, tokens, busy, blocks, push_s, export_s, write_s, fetch_s = found[-1]
            return {
                "steps": float(steps), "tokens": float(tokens), "busy_s": float(busy),
                "push_blocks": float(blocks), "push_s": float(push_s),
                "export_s": float(export_s), "write_s": float(write_s),
                "fetch_s": float(fetch_s),
            }  # fmt: skip
        time.sleep(0.05)
    raise TimeoutError(f"{name} logged no stats in {timeout:.0f} s")


async def drive(
    daemon: str, prompts: list[list[int]], max_tokens: int, concurrency: int
) -> tuple[int, float]:
    """Greedy requests over kvsched's client; (output tokens, wall seconds)."""
    from kvsched.client import AsyncClient

    gate = asyncio.Semaphore(concurrency)

    async def one(client: AsyncClient, prompt: list[int]) -> int:
        async with gate:
            stream = await client.generate(
                prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True
            )
            return sum([len(b) async for b in stream])

    async with AsyncClient(daemon, timeout=600) as client:
        await one(client, prompts[0])  # warm-up (not counted)
        t0 = time.perf_counter()
        n = sum(await asyncio.gather(*(one(client, p) for p in prompts[1:])))
        return n, time.perf_counter() - t0


async def first_gaps(daemon: str, prompts: list[list[int]], concurrency: int) -> list[float]:
    """Greedy requests of 8 tokens; per request the seconds between its first token and its
    second (a P/D request's hand-off)."""
    from kvsched.client import AsyncClient

    gate = asyncio.Semaphore(concurrency)

    async def one(client: AsyncClient, prompt: list[int]) -> float:
        async with gate:
            stream = await client.generate(prompt, max_tokens=8, temperature=0.0, ignore_eos=True)
            seen, first, gap = 0, 0.0, 0.0
            async for batch in stream:
                now = time.perf_counter()
                if seen == 0:
                    first = now
                if seen <= 1 < seen + len(batch):
                    gap = now - first if seen else 0.0  # (both in one batch: no gap seen)
                seen += len(batch)
            return gap

    async with AsyncClient(daemon, timeout=600) as client:
        return list(await asyncio.gather(*(one(client, p) for p in prompts)))


def status_counts(daemon: str) -> dict[str, dict[str, float]]:
    from kvsched.client import Client

    with Client(daemon, timeout=10) as c:
        return {
            i.instance_id: {
                "drafts": i.num_draft_tokens,
                "accepted": i.num_accepted_drafts,
            }
            for i in c.status().instances
        }


def spec_round(
    model: Path,
    logs: Path,
    k: int,
    n: int,
    draft: Path | None = None,
    prompts: list[list[int]] | None = None,
) -> dict[str, float]:
    daemon = f"127.0.0.1:{free_port()}"
    env = {
        "KVSCHED_ENGINE__SPECULATIVE__NUM_SPECULATIVE_TOKENS": str(k),
        "KVSCHED_ENGINE__SCHEDULER__MAX_MODEL_LEN": "1024",
    }
    with running(logs) as procs:
        procs.start(
            "daemon", [*_KVSCHED, "serve", "--listen", daemon, "--metrics-listen", "off"], env
        )
        extra: tuple[str, ...] = ("--num-speculative-tokens", str(k)) if k else ()
        if draft is not None:
            extra += ("--draft-model", str(draft))
        procs.start("worker", worker(daemon, "v0", model, *extra))
        wait_ready(procs, daemon)
        before, wb = status_counts(daemon)["v0"], worker_stats(procs, "worker")
        load = os.getloadavg()[0]
        tokens, wall = asyncio.run(drive(daemon, prompts or spec_prompts(n + 1), 64, 8))
        after, wa = status_counts(daemon)["v0"], worker_stats(procs, "worker")
    steps = wa["steps"] - wb["steps"]
    drafts = after["drafts"] - before["drafts"]
    return {
        "k": k,
        "output_tok_s": tokens / wall,
        "worker_steps": steps,
        "tokens_per_step": (wa["tokens"] - wb["tokens"]) / max(1.0, steps),
        "drafts": drafts,
        "acceptance": (after["accepted"] - before["accepted"]) / drafts if drafts else 0.0,
        "load_1m": load,
    }


def _knows(daemon: str, instance: str, timeout: float = 60.0) -> None:
    """Until the daemon's cluster view holds `instance` with its load (a peer's)."""
    from kvsched.client import Client

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with Client(daemon, timeout=5) as c:
            if any(
                i.instance_id == instance and i.load_known for i in c.status().cluster.instances
            ):
                return
        time.sleep(0.2)
    raise TimeoutError(f"{daemon} does not know instance {instance}")


def pd_round(model: Path, logs: Path, n: int, transfer: str = "push") -> dict[str, float]:
    """One round of `n` requests handed off by `transfer`: "push", "storage" (one daemon) or
    "cluster" (through the store, daemon A's prefill instance to daemon B's decode instance,
    the requests sent to A)."""
    from kvsched.cluster.natsd import NatsServer
    from kvsched.storage.server import MooncakeServer

    daemon = f"127.0.0.1:{free_port()}"
    toml = logs / "pd.toml"
    with contextlib.ExitStack() as stack, running(logs) as procs:
        cmd = [*_KVSCHED, "serve", "--listen", daemon, "--metrics-listen", "off"]
        kv: tuple[str, ...] = ("--listen-kv", "127.0.0.1:0")
        if transfer == "push":
            toml.write_text(PD_TOML)
            procs.start("daemon", [*cmd, "--config", str(toml)])
            decode_at = daemon
        else:
            kv = ()
            store = stack.enter_context(MooncakeServer(capacity_bytes=512 << 20))
            cmd += ["--storage", store.url]
            if transfer == "storage":
                toml.write_text(PD_TOML + PD_STORAGE)
                procs.start("daemon", [*cmd, "--config", str(toml)])
                decode_at = daemon
            else:
                nats = stack.enter_context(NatsServer())
                cmd += ["--cluster", nats.url]
                a_toml, b_toml = logs / "a.toml", logs / "b.toml"
                a_toml.write_text(PD_TOML.split("[instances.d]")[0] + PD_STORAGE)
                b_toml.write_text(
                    PD_TOML.split("[instances.p]")[0] + '[instances.d]\nrole = "decode"\n'
                )
                procs.start("daemon", [*cmd, "--config", str(a_toml), "--daemon-id", "pd-a"])
                decode_at = f"127.0.0.1:{free_port()}"
                cmd_b = [*_KVSCHED, "serve", "--listen", decode_at, "--metrics-listen", "off"]
                cmd_b += ["--storage", store.url, "--cluster", nats.url]
                procs.start("daemon_b", [*cmd_b, "--config", str(b_toml), "--daemon-id", "pd-b"])
        procs.start("worker_p", worker(daemon, "p", model, "--num-blocks", "128", *kv))
        procs.start("worker_d", worker(decode_at, "d", model, "--num-blocks", "512", *kv))
        if decode_at == daemon:
            wait_ready(procs, daemon, count=2)
        else:
            wait_ready(procs, daemon)
            wait_ready(procs, decode_at)
            _knows(daemon, "d")
        prompts = long_prompts(n + 1)
        asyncio.run(drive(daemon, prompts[:1], 8, 1))  # warm-up: both workers' first steps
        before = {w: worker_stats(procs, w) for w in ("worker_p", "worker_d")}
        load = os.getloadavg()[0]
        gaps = asyncio.run(first_gaps(daemon, prompts[1:], 2))
        after = {w: worker_stats(procs, w) for w in ("worker_p", "worker_d")}
    p = {k: after["worker_p"][k] - before["worker_p"][k] for k in after["worker_p"]}
    d = {k: after["worker_d"][k] - before["worker_d"][k] for k in after["worker_d"]}
    prompt_tokens = float(sum(len(x) for x in prompts[1:]))
    per_k = 1000.0 / prompt_tokens
    return {
        "transfer": transfer,  # type: ignore[dict-item]
        "requests": n,
        "prompt_tokens": prompt_tokens,
        "push_blocks": p["push_blocks"],
        "push_s_per_1k": p["push_s"] * per_k,
        "export_s_per_1k": p["export_s"] * per_k,
        "write_s_per_1k": p["write_s"] * per_k,
        "fetch_s_per_1k": d["fetch_s"] * per_k,
        "transfer_s_per_1k": (p["push_s"] + p["write_s"] + d["fetch_s"]) * per_k,
        "gap_1_2_s_per_1k": statistics.median(gaps) * 1000.0 / (prompt_tokens / n),
        "prefill_busy_s_per_1k": p["busy_s"] * per_k,
        "load_1m": load,
    }


def _median(rows: list[dict[str, float]], key: str) -> tuple[float, float, float]:
    vals = [r[key] for r in rows]
    return statistics.median(vals), min(vals), max(vals)


def draft_part(model: Path, tmp: Path, n: int) -> dict[str, dict[str, float]]:
    """One round each: none, ngram, the 1-layer draft, the model as its own draft."""
    draft = truncated_draft(model, tmp / "draft-1layer")
    prompts = random_prompts(n + 1)
    runs = {
        "none": (0, None),
        "ngram": (K, None),
        "draft_1layer": (K, draft),
        "draft_self": (K, model),
    }
    rows = {}
    for name, (k, d) in runs.items():
        logs = tmp / f"draft-{name}"
        logs.mkdir()
        rows[name] = spec_round(model, logs, k, n, d, prompts)
    print("\nspeculative decoding, draft model vs ngram vs none (K = 3, random prompts, 1 round)")
    print(f"{'drafter':>14} {'out tok/s':>10} {'tokens/step':>12} {'accept':>8} {'load':>6}")
    for name, row in rows.items():
        print(
            f"{name:>14} {row['output_tok_s']:>10.0f} {row['tokens_per_step']:>12.2f}"
            f" {row['acceptance']:>8.3f} {row['load_1m']:>6.1f}"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="spec,pd")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument(
        "--pd-modes",
        default="push,storage",
        help="pd hand-offs to measure: push, storage (one daemon), cluster (two daemons)",
    )
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "vllm_features.json"))
    args = ap.parse_args(argv)
    from kvsched.tinymodel.model import make_model

    parts = args.parts.split(",")
    result: dict[str, Any] = {"rounds": args.rounds, "requests": args.requests}
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "tiny-llama")
        if "spec" in parts:
            rows: dict[int, list[dict[str, float]]] = {0: [], K: []}
            for r in range(args.rounds):
                for k in (0, K) if r % 2 == 0 else (K, 0):
                    logs = Path(tmp) / f"spec{k}-{r}"
                    logs.mkdir()
                    rows[k].append(spec_round(model, logs, k, args.requests))
            print("\nspeculative decoding (ngram drafts, K = 3) vs none; median [min, max]")
            print(f"{'drafts':>8} {'out tok/s':>22} {'tokens/step':>20} {'accept':>8} {'load':>6}")
            for k, rs in rows.items():
                tps, tlo, thi = _median(rs, "output_tok_s")
                tk, klo, khi = _median(rs, "tokens_per_step")
                acc = _median(rs, "acceptance")[0]
                load = _median(rs, "load_1m")[0]
                print(
                    f"{k:>8} {tps:>8.0f} [{tlo:.0f}, {thi:.0f}] {tk:>8.2f} [{klo:.2f}, {khi:.2f}]"
                    f" {acc:>8.3f} {load:>6.1f}"
                )
            result["spec"] = {str(k): rs for k, rs in rows.items()}
        if "draft" in parts:
            result["draft"] = draft_part(model, Path(tmp), args.requests)
        if "pd" in parts:
            modes = args.pd_modes.split(",")
            by: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
            for r in range(args.rounds):
                for how in modes if r % 2 == 0 else modes[::-1]:
                    logs = Path(tmp) / f"pd-{how}-{r}"
                    logs.mkdir()
                    by[how].append(pd_round(model, logs, max(4, args.requests // 3), how))
            print(
                "\nP/D hand-off (vLLM workers, ~1,000-token prompts), seconds per 1,000 prompt "
                "tokens, median [min, max]"
            )
            print(f"{'':>24}" + "".join(f" {m:>26}" for m in modes))
            for key in (
                "transfer_s_per_1k", "push_s_per_1k", "export_s_per_1k", "write_s_per_1k",
                "fetch_s_per_1k", "gap_1_2_s_per_1k", "prefill_busy_s_per_1k",
            ):  # fmt: skip
                cells = []
                for how in modes:
                    med, lo, hi = _median(by[how], key)
                    cells.append(f"{med:.4f} [{lo:.4f}, {hi:.4f}]")
                print(f"{key:>24}" + "".join(f" {c:>26}" for c in cells))
            loads = [r["load_1m"] for rs in by.values() for r in rs]
            print(f"{'load_1m':>24} {statistics.median(loads):.1f}")
            result["pd"] = by
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nsaved {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
