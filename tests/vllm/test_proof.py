"""Proof that kvsched can be vLLM's scheduler: the same requests through (a) vLLM's own
`LLM.generate` and (b) a real kvsched daemon + `kvsched worker --executor vllm` (real processes,
loopback), on a tiny random-weight Llama made at test time, float32.

(b) runs with a small KV pool (preemptions by recompute), a small step token budget (prompts
split into chunks), shared prompt prefixes (prefix hits: reused block ids), aborts mid-way and a
host-memory KV tier (prefixes evicted from the pool come back by swap-in); greedy and seeded
random sampling. At least 99 % of requests must match token for token, and
every difference must sit at a near-tie of the two tokens' logits (the gap is printed).

Needs vLLM (the `vllm` extra: `make test-vllm`); skipped in the main virtualenv.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs this")

from kvsched.client import AsyncClient, InvalidArgument
from kvsched.tinymodel.model import make_model
from kvsched.v1 import common_pb2, request_service_pb2, request_service_pb2_grpc
from tests.integration.harness import (
    REPO,
    Proc,
    child_env,
    start_daemon,
    status,
    wait_pool_free,
    wait_ready,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

NUM_BLOCKS = 40  # x 32 tokens: far less than the requests in flight hold: preemptions
HOST_BLOCKS = 1024  # the host tier: every block evicted from the 40 is written back there
STEP_TOKENS = 128  # the daemon's step budget: longer prompts are prefilled in chunks
NEAR_TIE = 0.05  # logit gap below which float32 reorderings may flip the argmax


def _requests() -> list[dict[str, Any]]:
    rng = random.Random(0)
    reqs: list[dict[str, Any]] = []

    def add(prompt: list[int], i: int) -> None:
        seeded = i % 2 == 1
        params: dict[str, Any] = {"max_tokens": rng.choice([24, 40, 64])}
        if seeded:
            params |= {"temperature": 0.9, "top_p": 0.95, "top_k": 40, "seed": 1000 + i}
        else:
            params |= {"temperature": 0.0}
        if i % 3 == 0:
            params["ignore_eos"] = True
        if i % 7 == 0:
            params["min_tokens"] = 8
        if i % 11 == 0:
            params["stop_token_ids"] = [rng.randrange(5, 512)]
        reqs.append({"prompt": prompt, "params": params, "id": f"r{i}"})

    prefixes = [[rng.randrange(5, 512) for _ in range(96)] for _ in range(3)]
    for g, prefix in enumerate(prefixes):  # 3 groups sharing 96 tokens (3 full blocks)
        for k in range(8):
            add(prefix + [rng.randrange(5, 512) for _ in range(rng.randrange(4, 60))], g * 8 + k)
    for i in range(24, 48):  # distinct prompts, some longer than a step's budget
        add([rng.randrange(5, 512) for _ in range(rng.randrange(8, 300))], i)
    for i in range(48, 52):  # one at a time after the flood: 4 x 11 blocks evict the pool
        add([rng.randrange(5, 512) for _ in range(330)], i)
        reqs[-1]["id"] += "fill"
    for i in (0, 8, 16):  # then sent again: their prefix can only come from the host tier
        reqs.append({**reqs[i], "id": f"r{i}again"})
    return reqs


ABORTED = {"r5", "r17", "r30", "r41"}  # aborted after their third token


def _reference(model: Path, job: dict[str, Any], tmp: Path) -> dict[str, Any]:
    path_in, path_out = tmp / "ref_in.json", tmp / "ref_out.json"
    path_in.write_text(json.dumps({"model": str(model), **job}))
    proc = subprocess.run(
        [sys.executable, "-m", "tests.vllm.reference", str(path_in), str(path_out)],
        cwd=REPO,
        env=child_env({"VLLM_CPU_KVCACHE_SPACE": "1"}),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result: dict[str, Any] = json.loads(path_out.read_text())
    return result


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("tiny") / "tiny-llama")


_WORKERS: dict[str, Proc] = {}  # the vLLM worker of each kvsched_vllm daemon


@pytest.fixture(scope="module")
def kvsched_vllm(model: Path):
    """A daemon and one vLLM worker on the tiny model."""
    daemon, address = start_daemon(
        env={
            "KVSCHED_ENGINE__SCHEDULER__MAX_NUM_BATCHED_TOKENS": str(STEP_TOKENS),
            "KVSCHED_ENGINE__SCHEDULER__MIN_PREFILL_CHUNK": "32",
            "KVSCHED_ENGINE__SCHEDULER__MAX_MODEL_LEN": "1024",
        }
    )
    worker = Proc(
        [
            "worker",
            "--server",
            address,
            "--instance",
            "v0",
            "--executor",
            "vllm",
            "--model",
            str(model),
            "--dtype",
            "float32",
            "--num-blocks",
            str(NUM_BLOCKS),
            "--host-blocks",
            str(HOST_BLOCKS),
            "--max-model-len",
            "1024",
            "--num-slots",
            "32",
            "--max-num-batched-tokens",
            "512",
        ],
        # Rows deferred into steps launched ahead however long its steps take (ahead.py);
        # KVSCHED_VLLM_DEFER_MAX_MS=0 in the environment runs the extra-step path instead.
        env={
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "KVSCHED_VLLM_DEFER_MAX_MS": os.environ.get("KVSCHED_VLLM_DEFER_MAX_MS", "100000"),
            "KVSCHED_VLLM_AHEAD_MAX_ROWS": "1000",  # (steps of every size run ahead here)
        },
        name="vllm-worker",
    )
    _WORKERS[address] = worker
    try:
        wait_ready(address, ["v0"], timeout=300)
        yield address
    finally:
        worker.stop()
        daemon.stop()
        print("\n--- worker output (tail) ---\n" + "\n".join(worker.lines[-15:]))


async def _run_one(client: AsyncClient, req: dict[str, Any]) -> tuple[list[int], str]:
    stream = await client.generate(req["prompt"], request_id=req["id"], **req["params"])
    tokens: list[int] = []
    aborted = False
    async for batch in stream:
        tokens.extend(batch)
        if req["id"] in ABORTED and len(tokens) >= 3 and not aborted:
            aborted = True
            await client.abort(req["id"])
    assert stream.finished is not None
    return tokens, stream.finished.reason


async def _run_all(address: str, reqs: list[dict[str, Any]]) -> dict[str, tuple[list[int], str]]:
    async with AsyncClient(address, timeout=600) as client:
        # One request of each prefix group first, so the others find its blocks cached.
        firsts = [reqs[0], reqs[8], reqs[16]]
        done = await asyncio.gather(*(_run_one(client, r) for r in firsts))
        later = [r for r in reqs if r["id"].endswith(("fill", "again"))]
        rest = [r for r in reqs if r not in firsts and r not in later]
        done += await asyncio.gather(*(_run_one(client, r) for r in rest))
        # One at a time: the fillers evict every block of the 40 on the worker (written back
        # to the host tier), then the groups' first prompts again: their prefix comes back
        # from the host tier (swap-in).
        for r in later:
            done.append(await _run_one(client, r))
    return {r["id"]: d for r, d in zip(firsts + rest + later, done, strict=True)}


def test_kvsched_with_vllm_worker_gives_vllm_tokens(
    model: Path, kvsched_vllm: str, tmp_path: Path
) -> None:
    reqs = _requests()
    got = asyncio.run(_run_all(kvsched_vllm, reqs))
    st = status(kvsched_vllm).instances[0]
    ref = _reference(
        model,
        {"requests": [{"prompt": r["prompt"], "params": r["params"]} for r in reqs]},
        tmp_path,
    )["outputs"]

    equal, diffs = 0, []
    for r, want in zip(reqs, ref, strict=True):
        have, reason = got[r["id"]]
        if r["id"] in ABORTED:  # what it streamed before the abort took effect
            ok = reason == "abort" and len(have) >= 3 and have == want[: len(have)]
        else:
            ok = reason in ("stop", "length") and have == want
        if ok:
            equal += 1
            continue
        pos = next((i for i, (a, b) in enumerate(zip(have, want, strict=False)) if a != b), None)
        diffs.append((r, pos, have, want))
    gaps = []
    if diffs:
        job = {
            "gaps": [
                {"prompt": r["prompt"] + want[:pos], "tokens": [have[pos], want[pos]]}
                for r, pos, have, want in diffs
                if pos is not None
            ]
        }
        gaps = _reference(model, job, tmp_path)["gaps"]
    share = equal / len(reqs)
    print(
        f"\nproof: {equal}/{len(reqs)} requests equal token for token ({100 * share:.1f} %); "
        f"prefix hit tokens {st.prefix_cache_hit_tokens} of {st.prefix_cache_query_tokens}, "
        f"of them from the host tier {st.prefix_cache_host_hit_tokens}, "
        f"preemptions {st.num_preemptions}, steps {st.num_steps}"
    )
    for (r, pos, _have, _want), gap in zip(
        [d for d in diffs if d[1] is not None], gaps, strict=True
    ):
        print(f"  {r['id']} {r['params']}: first difference at output {pos}: {gap}")
    for r, pos, have, want in diffs:
        if pos is None:
            print(f"  {r['id']}: lengths differ: kvsched {len(have)}, vLLM {len(want)}")
    # A distinct prompt over twice the step budget cannot be prefilled in fewer than 3 steps.
    assert any(len(r["prompt"]) > 2 * STEP_TOKENS for r in reqs[24:48]), "no chunked prefill"
    assert st.num_preemptions > 0, "the small KV pool forced no preemption"
    assert st.prefix_cache_host_hit_tokens > 0, "no prefix came back from the host tier"
    assert st.prefix_cache_hit_tokens >= 2 * 96, "the shared prefixes were not hit"
    assert share >= 0.99, f"only {equal}/{len(reqs)} equal"
    # ... with steps launched ahead (worker_vllm/ahead.py): rows taken from them and rows
    # deferred into them, the default path (the worker logs its counters on SIGUSR1).
    worker = _WORKERS[kvsched_vllm]
    mark = len(worker.lines)
    worker.popen.send_signal(signal.SIGUSR1)
    rx = re.compile(r"launched ahead (\d+) \(deferred (\d+)")
    deadline = time.monotonic() + 30
    while not (m := next(filter(None, map(rx.search, worker.lines[mark:])), None)):
        assert time.monotonic() < deadline, "the worker logged no counters on SIGUSR1"
        time.sleep(0.05)
    assert int(m[1]) > 0, f"no step launched ahead: {m[0]}"
    if os.environ.get("KVSCHED_VLLM_DEFER_MAX_MS") != "0":
        assert int(m[2]) > 0, f"no row deferred into a step launched ahead: {m[0]}"
    assert all(d[1] is not None for d in diffs), "a difference in length, not at a token"
    assert all(g["gap"] < NEAR_TIE for g in gaps), f"a difference that is no near-tie: {gaps}"
    wait_pool_free(kvsched_vllm, timeout=30)  # every block returned


def test_prompt_logprobs_equal_vllms(model: Path, kvsched_vllm: str, tmp_path: Path) -> None:
    """Prompt and output log-probabilities of a prompt that fills most of a step: each
    position's value, rank and top k equal vLLM's own (`LLM.generate`) within 1e-4. A prompt
    longer than a step is refused naming prompt_logprobs (its log-probabilities need it whole
    in one step: core/kv_cache_manager.py's `prefills_at_once`)."""
    rng = random.Random(5)
    prompt = [rng.randrange(5, 512) for _ in range(STEP_TOKENS - 8)]
    params = {"max_tokens": 8, "temperature": 0.0, "prompt_logprobs": 3, "logprobs": 2}

    async def run() -> tuple[list[int], Any, Any]:
        async with AsyncClient(kvsched_vllm, timeout=600) as client:
            with pytest.raises(InvalidArgument, match="prompt_logprobs: a prompt of"):
                await client.generate(prompt * 3, request_id="plp-long", **params)
            stream = await client.generate(prompt, request_id="plp", **params)
            tokens, rows = [], []
            async for batch in stream:
                tokens += batch
                rows += stream.last_logprobs
            return tokens, stream.prompt_logprobs, rows

    tokens, prompt_rows, rows = asyncio.run(run())
    ref = _reference(model, {"requests": [{"prompt": prompt, "params": params}]}, tmp_path)
    assert tokens == ref["outputs"][0]
    want = ref["logprobs"][0]
    assert want["prompt"][0] is None and prompt_rows is not None
    for got, exp in ((prompt_rows, want["prompt"][1:]), (rows, want["output"])):
        assert len(got) == len(exp)
        for g, e in zip(got, exp, strict=True):
            assert g.rank == e["rank"] and abs(g.logprob - e["logprob"]) <= 1e-4, (g, e)
            top = dict(zip(map(str, g.top_token_ids), g.top_logprobs, strict=True))
            assert set(top) == set(e["top"]), (g, e)
            assert all(abs(top[t] - e["top"][t]) <= 1e-4 for t in top), (g, e)


def test_hello_announces_the_engines_facts(kvsched_vllm: str) -> None:
    st = status(kvsched_vllm).instances[0]
    assert st.model == "tiny-llama"  # the model directory's name
    assert st.num_gpu_blocks == NUM_BLOCKS
    assert st.num_host_blocks == HOST_BLOCKS


def test_multimodal_items_are_refused_by_name(kvsched_vllm: str) -> None:
    """The vLLM worker's Hello announces no multimodal support (no encoder inputs reach vLLM's
    runner): a request with items is refused before queueing, naming mm_ranges."""
    st = status(kvsched_vllm).instances[0]
    item = common_pb2.MultimodalRange(offset=2, length=4, content_hash="img")
    msg = request_service_pb2.GenerateRequest(
        prompt_token_ids=list(range(1, 17)),
        sampling=common_pb2.SamplingParams(max_tokens=2),
        mm_ranges=[item],
    )
    with grpc.insecure_channel(kvsched_vllm) as ch:
        call = request_service_pb2_grpc.RequestServiceStub(ch).Generate(msg, timeout=30)
        with pytest.raises(grpc.RpcError) as e:
            next(call)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "mm_ranges" in (e.value.details() or "") and st.model in (e.value.details() or "")
