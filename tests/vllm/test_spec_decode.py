"""Speculative decoding under vLLM's model runner: the worker engine proposes ngram drafts
(prompt lookup), vLLM's runner verifies them on its spec-decode path (scheduled draft tokens,
its rejection sampler), and the texts must equal vLLM's own plain greedy `LLM.generate` (no
speculation), while drafts are really accepted (the acceptance rate is printed). Four seeded
random-sampling requests run beside them: vLLM 0.32's CPU build garbles the greedy requests of
a speculative step that mixes them (its own `LLM.generate` with ngram too), so the worker
verifies no drafts in such a step (spec_decode.no_drafts_unless_greedy); the sampled ones are
only checked to finish with their max_tokens tokens. Real
processes on loopback: one daemon with engine.speculative.num_speculative_tokens = 3, one
`kvsched worker --executor vllm --num-speculative-tokens 3`.

Needs vLLM (`make test-vllm`); skipped in the main virtualenv.
"""

from __future__ import annotations

import asyncio
import random
import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs this")

from kvsched.tinymodel.model import make_model
from tests.integration.harness import start_daemon, status, wait_pool_free, wait_ready
from tests.vllm.test_pd import compare, run_all
from tests.vllm.vllm_kit import reference_outputs, vllm_worker

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

K = 3  # drafts per step


def spec_requests(n: int) -> list[dict[str, Any]]:
    """Greedy prompts made of a few repeated phrases (prompt lookup finds drafts in them)."""
    rng = random.Random(4)
    reqs = []
    for i in range(n):
        phrases = [[rng.randrange(5, 512) for _ in range(rng.randrange(3, 7))] for _ in range(3)]
        prompt = [t for _ in range(rng.randrange(3, 8)) for t in rng.choice(phrases)]
        params = {"max_tokens": rng.choice([24, 40, 56]), "temperature": 0.0, "ignore_eos": True}
        reqs.append({"id": f"sd{i}", "prompt": prompt, "params": params})
    return reqs


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("tiny") / "tiny-llama")


def test_ngram_drafts_through_vllms_rejection_sampler_equal_plain_greedy(
    model: Path, tmp_path: Path
) -> None:
    reqs = spec_requests(12)
    sampled = [
        {
            "id": f"sampled{i}",
            "prompt": r["prompt"],
            "params": {**r["params"], "temperature": 1.0, "seed": i},
        }
        for i, r in enumerate(spec_requests(16)[12:])
    ]
    daemon, address = start_daemon(
        env={
            "KVSCHED_ENGINE__SPECULATIVE__NUM_SPECULATIVE_TOKENS": str(K),
            "KVSCHED_ENGINE__SCHEDULER__MAX_NUM_BATCHED_TOKENS": "256",
            "KVSCHED_ENGINE__SCHEDULER__MAX_MODEL_LEN": "1024",
        }
    )
    worker = vllm_worker(address, "v0", model, 128, "--num-speculative-tokens", str(K))
    try:
        wait_ready(address, ["v0"], timeout=300)
        got = asyncio.run(run_all(address, reqs + sampled))
        st = status(address).instances[0]
        wait_pool_free(address, timeout=30)
    finally:
        worker.stop()
        daemon.stop()
        print("\n--- worker output (tail) ---\n" + "\n".join(worker.lines[-6:]))
    ref = reference_outputs(model, reqs, tmp_path)  # plain greedy: no speculation
    bad = compare(reqs, got, ref)
    m = worker.wait_for(r"drafts (\d+), accepted (\d+)", timeout=30)
    drafts, accepted = int(m.group(1)), int(m.group(2))
    tokens = sum(len(t) for t, _ in got.values())  # (the sampled requests' too)
    print(
        f"\nspec decode: {len(reqs) - len(bad)}/{len(reqs)} equal to plain greedy; drafts "
        f"{drafts}, accepted {accepted} ({100 * accepted / max(1, drafts):.1f} %); "
        f"{tokens} tokens in {st.num_steps} steps"
    )
    assert not bad, "\n".join(bad)
    for r in sampled:
        have, reason = got[r["id"]]
        assert (len(have), reason.split(":")[0]) == (r["params"]["max_tokens"], "length"), r["id"]
    assert drafts > 0, "no draft was verified"
    assert accepted > 0, "no draft was accepted"
    # The daemon counted the same drafts from the worker's reports (per request too: spans
    # and the acceptance-rate histogram read the same per-request counts).
    assert (st.num_draft_tokens, st.num_accepted_drafts) == (drafts, accepted)
    assert re.search(r"vllm", worker.output())  # (the worker ran vLLM's runner)
