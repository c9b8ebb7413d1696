"""Structured output survives preemption: requests constrained by long regexes and a choice
run on a vLLM worker whose small KV pool preempts them mid-grammar (recompute); each output
must equal vLLM's own `LLM.generate` with the same StructuredOutputsParams, and follow its
grammar. The worker keeps a preempted request's grammar matcher for its re-placement
(worker_vllm/structured.py); a wrong matcher state would mask the wrong tokens after the
re-placement and the texts would part.

Needs vLLM (the `vllm` extra: `make test-vllm`); skipped in the main virtualenv.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs this")

from kvsched.client import AsyncClient
from kvsched.tinymodel.model import make_model
from kvsched.tinymodel.tokenizer import make_tokenizer
from tests.integration.harness import start_daemon, status, wait_pool_free, wait_ready
from tests.vllm.vllm_kit import reference_outputs, vllm_worker

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

NUM_BLOCKS = 34  # x 32 tokens (max_model_len 1024 must fit); 14 requests of ~5 blocks each
REGEXES = ["[a-z]{40,60}", "([0-9]{2}-){20,28}[0-9]{2}", "(ab|cd|ef){25,35}"]
CHOICES = ["alpha", "beta", "gamma delta"]


def _requests(tok: Any) -> list[dict[str, Any]]:
    reqs = []
    for i in range(14):
        text = f"Request {i}: the scheduler keeps its grammar while it waits. " * 4
        prompt = tok(text).input_ids[: 60 + i]
        so = {"choice": CHOICES} if i % 4 == 3 else {"regex": REGEXES[i % 3]}
        params = {"max_tokens": 96, "temperature": 0.0, "structured_outputs": so}
        reqs.append({"prompt": prompt, "params": params, "id": f"s{i}"})
    return reqs


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = make_model(tmp_path_factory.mktemp("tiny") / "tiny")
    make_tokenizer(d, vocab_size=512)
    return d


async def _run(address: str, reqs: list[dict[str, Any]]) -> list[tuple[list[int], str]]:
    async def one(client: AsyncClient, r: dict[str, Any]) -> tuple[list[int], str]:
        params = dict(r["params"])
        params["structured_output"] = params.pop("structured_outputs")
        stream = await client.generate(r["prompt"], request_id=r["id"], **params)
        tokens = [t async for batch in stream for t in batch]
        assert stream.finished is not None
        return tokens, stream.finished.reason

    async with AsyncClient(address, timeout=600) as client:
        return list(await asyncio.gather(*(one(client, r) for r in reqs)))


def test_structured_requests_preempted_mid_grammar_give_vllms_tokens(
    model: Path, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    reqs = _requests(tok)
    daemon, address = start_daemon(
        env={
            "KVSCHED_ENGINE__SCHEDULER__MAX_MODEL_LEN": "1024",
            "KVSCHED_ENGINE__SCHEDULER__MAX_NUM_BATCHED_TOKENS": "256",
        }
    )
    worker = vllm_worker(address, "v0", model, NUM_BLOCKS)
    try:
        wait_ready(address, ["v0"], timeout=300)
        got = asyncio.run(_run(address, reqs))
        st = status(address).instances[0]
        wait_pool_free(address, timeout=30)
    finally:
        worker.stop()
        daemon.stop()
        print("\n--- worker output (tail) ---\n" + "\n".join(worker.lines[-15:]))
    ref = reference_outputs(model, reqs, tmp_path, tokenizer=True)
    print(f"\nstructured under preemption: {st.num_preemptions} preemptions")
    for r, (have, reason), want in zip(reqs, got, ref, strict=True):
        text = tok.decode(have, skip_special_tokens=True)
        so = r["params"]["structured_outputs"]
        print(f"  {r['id']} {so}: {reason} {text!r}")
        assert have == want, (r["id"], have, want)
        assert reason == "stop"  # the grammar completed: only EOS was left
        if "regex" in so:
            assert re.fullmatch(so["regex"], text), text
        else:
            assert text in CHOICES
    assert st.num_preemptions > 0, "the small KV pool forced no preemption"
