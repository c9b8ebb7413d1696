"""The OpenAI API end to end on a real engine: the official `openai` client streams completions
and chat completions from `kvsched http` in front of a daemon and `kvsched worker --executor
vllm` (the tiny random-weight Llama with the tiny tokenizer, float32), and for greedy requests
the text equals vLLM's own `LLM.generate` on the same prompt ids, decoded by the same tokenizer.

Needs vLLM (the `vllm` extra: `make test-vllm`); skipped in the main virtualenv.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs this")

from openai import OpenAI
from transformers import AutoTokenizer

from kvsched.tinymodel.model import make_model
from kvsched.tinymodel.tokenizer import make_tokenizer
from tests.http.harness import start_http, text_of
from tests.integration.harness import Proc, start_daemon, wait_ready
from tests.vllm.test_proof import _reference

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

COMPLETIONS = ["The scheduler was", "Questions people often ask:", "café 東京 🙂"]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "How do you make tea?"},
    ],
]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = make_model(tmp_path_factory.mktemp("tiny") / "tiny")
    make_tokenizer(d, vocab_size=512)
    return d


def test_openai_client_streams_what_llm_generate_produces(model: Path, tmp_path: Path) -> None:
    tok: Any = AutoTokenizer.from_pretrained(str(model))
    daemon, address = start_daemon(env={"KVSCHED_ENGINE__SCHEDULER__MAX_MODEL_LEN": "1024"})
    worker = Proc(
        ["worker", "--server", address, "--instance", "v0", "--executor", "vllm"]
        + ["--model", str(model), "--dtype", "float32", "--served-model-name", "tiny"]
        + ["--max-model-len", "1024"],
        # compiled, the worker's default (tests/vllm/conftest.py makes the others eager)
        env={"VLLM_CPU_KVCACHE_SPACE": "1", "KVSCHED_VLLM_COMPILE": "1"},
        name="vllm-worker",
    )
    http = None
    try:
        wait_ready(address, ["v0"], timeout=300)
        http, url = start_http(model, address)
        client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
        got, prompts = [], []
        for prompt in COMPLETIONS:
            chunks = list(
                client.completions.create(
                    model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True
                )
            )
            got.append("".join(c.choices[0].text for c in chunks))
            prompts.append(list(tok(prompt).input_ids))
        for messages in CHATS:
            chunks = list(
                client.chat.completions.create(
                    model="tiny",
                    messages=messages,
                    max_tokens=MAX_TOKENS,
                    temperature=0,
                    stream=True,
                )
            )
            got.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            prompts.append(list(tok(text, add_special_tokens=False).input_ids))
    finally:
        for p in (http, worker, daemon):
            if p is not None:
                p.stop()
    params = {"max_tokens": MAX_TOKENS, "temperature": 0.0}
    ref = _reference(
        model, {"requests": [{"prompt": p, "params": params} for p in prompts]}, tmp_path
    )["outputs"]
    # vLLM's server text: an incomplete last character is dropped (harness.text_of)
    want = [text_of(tok, ids) for ids in ref]
    assert got == want
    assert all(w for w in want)  # the model said something
