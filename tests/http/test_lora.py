"""LoRA adapters through `kvsched http`, as vLLM's server serves them: /v1/models lists each
adapter a worker announced (`--lora-modules`) after the base model, with `root` (its path) and
`parent` (the base model's served name); `model` = an adapter's name runs it; an adapter nobody
announced is 404 model_not_found. Real daemon, sim worker and front end on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import NotFoundError, OpenAI
from transformers import AutoTokenizer

from kvsched.worker_stub.sim import SimExecutor
from tests.http.harness import MODEL, VOCAB, Stack, stack, text_of

ADAPTERS = {"sql": "/adapters/sql", "chat": "/adapters/chat"}


@pytest.fixture(scope="module")
def lora_stack(model_dir: Path) -> Iterator[Stack]:
    modules = [f"{n}={p}" for n, p in ADAPTERS.items()]
    worker = ("--served-model-name", "tiny", "--lora-modules", *modules, "--max-loras", "2")
    with stack(model_dir, worker_args=worker) as s:
        yield s


def client(s: Stack) -> OpenAI:
    return OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_lists_adapters_with_root_and_parent(lora_stack: Stack) -> None:
    data = httpx.get(lora_stack.url + "/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in data] == [MODEL, "chat", "sql"]
    assert "parent" not in data[0]
    for card in data[1:]:
        assert card["parent"] == MODEL and card["root"] == ADAPTERS[card["id"]]
        assert card["max_model_len"] == data[0]["max_model_len"]
        assert card["ready_instances"] == 1


def test_model_naming_an_adapter_runs_it(lora_stack: Stack, model_dir: Path) -> None:
    tok: Any = AutoTokenizer.from_pretrained(str(model_dir))
    out = client(lora_stack).completions.create(
        model="sql", prompt="Hi", max_tokens=5, extra_body={"request_id": "lora-sql"}
    )
    n_prompt = len(tok("Hi").input_ids)
    sim = SimExecutor(vocab_size=VOCAB)
    want = [sim.token_at("lora-sql", n_prompt + i) for i in range(5)]
    assert out.model == "sql"
    assert out.choices[0].text == text_of(tok, want)
    assert out.choices[0].finish_reason == "length"


def test_an_unknown_adapter_is_404(lora_stack: Stack) -> None:
    resp = httpx.post(
        lora_stack.url + "/v1/completions", json={"model": "poetry", "prompt": "x"}, timeout=30
    )
    assert resp.status_code == 404
    err = resp.json()["error"]
    assert err["code"] == "model_not_found" and "'poetry'" in err["message"]
    with pytest.raises(NotFoundError):
        client(lora_stack).chat.completions.create(
            model="poetry", messages=[{"role": "user", "content": "x"}]
        )


def test_daemon_metrics_show_lora_requests_info(lora_stack: Stack) -> None:
    text = httpx.get(lora_stack.metrics_url, timeout=10).text
    rows = [line for line in text.splitlines() if line.startswith("kvsched_lora_requests_info{")]
    assert len(rows) == 1 and 'max_lora="2"' in rows[0] and 'instance="i0"' in rows[0]
