"""smg (the Shepherd Model Gateway, the `gateway` extra) in front of kvsched in front of
`kvsched worker --executor vllm` (the tiny random-weight Llama with the tiny tokenizer,
float32): 20 greedy chat completions through the official `openai` client, half of them
streamed, each equal to vLLM's own `LLM.chat` on the same conversation (docs/GATEWAY.md).

Needs vLLM (the `vllm` extra: `make test-vllm`); skipped in the main virtualenv.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs this")

from openai import OpenAI

from kvsched.tinymodel.model import make_model
from kvsched.tinymodel.tokenizer import make_tokenizer
from tests.gateway.harness import Smg
from tests.integration.harness import REPO, Proc, child_env, start_daemon, wait_ready

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MAX_TOKENS = 24
TOPICS = [
    "the capital of France",
    "how to make tea",
    "the weather today",
    "a good book",
    "the scheduler",
    "prefix caching",
    "paged attention",
    "a cat on a mat",
    "the sea",
    "numbers and words",
    "music",
    "the history of Rome",
]


def chats() -> list[list[dict[str, str]]]:
    out: list[list[dict[str, str]]] = []
    for i in range(20):
        topic = TOPICS[i % len(TOPICS)]
        msgs = [{"role": "user", "content": f"Tell me about {topic}. ({i})"}]
        if i % 3 == 1:
            msgs.insert(0, {"role": "system", "content": "Be brief."})
        if i % 4 == 2:
            msgs += [
                {"role": "assistant", "content": "Sure."},
                {"role": "user", "content": "Go on, please."},
            ]
        out.append(msgs)
    return out


def llm_chat(model: Path, conversations: list[Any], tmp: Path) -> dict[str, Any]:
    path_in, path_out = tmp / "chat_in.json", tmp / "chat_out.json"
    job = {"model": str(model), "chats": conversations, "max_tokens": MAX_TOKENS}
    path_in.write_text(json.dumps(job))
    proc = subprocess.run(
        [sys.executable, "-m", "tests.vllm.chat_reference", str(path_in), str(path_out)],
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
    d = make_model(tmp_path_factory.mktemp("tiny") / "tiny")
    make_tokenizer(d, vocab_size=512)
    return d


def test_smg_chat_through_kvsched_equals_llm_chat(model: Path, tmp_path: Path) -> None:
    daemon, address = start_daemon(
        "--tokenizer", str(model), env={"KVSCHED_ENGINE__SCHEDULER__MAX_MODEL_LEN": "1024"}
    )
    procs: list[Proc | Smg] = [daemon]
    got: list[str] = []
    conversations = chats()
    try:
        procs.append(
            Proc(
                ["worker", "--server", address, "--instance", "v0", "--executor", "vllm"]
                + ["--model", str(model), "--dtype", "float32", "--served-model-name", "tiny"]
                + ["--max-model-len", "1024"],
                env={"VLLM_CPU_KVCACHE_SPACE": "1"},
                name="vllm-worker",
            )
        )
        wait_ready(address, ["v0"], timeout=300)
        gateway = Smg([address])
        procs.append(gateway)
        gateway.wait_model("tiny")
        client = OpenAI(base_url=gateway.url + "/v1", api_key="none", max_retries=0, timeout=300)
        for i, messages in enumerate(conversations):
            kw: Any = {"model": "tiny", "messages": messages, "max_tokens": MAX_TOKENS}
            if i % 2:
                chunks = list(client.chat.completions.create(**kw, temperature=0, stream=True))
                got.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
            else:
                r = client.chat.completions.create(**kw, temperature=0)
                got.append(r.choices[0].message.content or "")
    finally:
        for p in reversed(procs):
            p.stop()
    want = llm_chat(model, conversations, tmp_path)["texts"]
    same = sum(g == w for g, w in zip(got, want, strict=True))
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g != w:
            print(f"chat {i}: gateway {g!r}\n        LLM.chat {w!r}")
    assert same == 20, f"{same} of 20 equal"
    assert all(w for w in want)  # the model said something
