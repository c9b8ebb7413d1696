"""Log-probabilities, echo and streamed token ids at `kvsched http` with the sim worker: the sim
reports no log-probabilities (its Hello says max_logprobs 0), so asking for them is a 400
naming the field (the daemon's refusal), and so is a malformed value (the front end's, as
vLLM's protocol checks them); echo (the prompt text before the output) and return_token_ids
while streaming need no log-probabilities and are served. tests/vllm/test_http_diff.py
compares the values themselves with vLLM's server."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from kvsched.worker_stub.sim import SimExecutor
from tests.http.harness import MODEL, VOCAB, Stack, text_of

SIM = SimExecutor(vocab_size=VOCAB)
CHAT = [{"role": "user", "content": "x"}]


def _post(s: Stack, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(s.url + path, json={"model": MODEL, **body}, timeout=30)


def _chunks(s: Stack, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    body = {"model": MODEL, **body, "stream": True}
    with httpx.stream("POST", s.url + path, json=body, timeout=30) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [
        ("/v1/completions", {"prompt": "x", "logprobs": 2}, "logprobs", "do not report"),
        ("/v1/completions", {"prompt": "x", "logprobs": 0}, "logprobs", "do not report"),
        ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1}, "logprobs", "report"),
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1}, "prompt_logprobs", "report"),
        ("/v1/chat/completions", {"messages": CHAT, "logprobs": True}, "logprobs", "report"),
        # the front end's own checks, as vLLM's protocol makes them
        ("/v1/completions", {"prompt": "x", "logprobs": -2}, "logprobs", "positive value or -1"),
        (
            "/v1/completions",
            {"prompt": "x", "prompt_logprobs": 1, "stream": True},
            "prompt_logprobs",
            "not available when `stream=True`",
        ),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "top_logprobs": 2},
            "top_logprobs",
            "`logprobs` must be set to true",
        ),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "logprobs": True, "top_logprobs": -4},
            "top_logprobs",
            "positive value or -1",
        ),
    ],
)
def test_log_probabilities_are_refused_by_name(
    live: Stack, path: str, body: dict[str, Any], param: str, words: str
) -> None:
    resp = _post(live, path, {"max_tokens": 2, **body})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_echo_puts_the_prompt_text_before_the_output(live: Stack, model_dir: Any) -> None:
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompt = "Echo me"
    ids = tok(prompt).input_ids
    out = text_of(tok, [SIM.token_at("echo-1", len(ids) + i) for i in range(6)])
    body = {"prompt": prompt, "max_tokens": 6, "echo": True, "request_id": "echo-1"}
    got = _post(live, "/v1/completions", body).json()["choices"][0]
    assert got["text"] == prompt + out and got["logprobs"] is None
    body["request_id"] = "echo-1s"
    out_s = text_of(tok, [SIM.token_at("echo-1s", len(ids) + i) for i in range(6)])
    chunks = _chunks(live, "/v1/completions", body)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == prompt + out_s


def test_return_token_ids_while_streaming(live: Stack, model_dir: Any) -> None:
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tok("Ids").input_ids
    body = {"prompt": "Ids", "max_tokens": 9, "request_id": "rti", "return_token_ids": True}
    chunks = [c["choices"][0] for c in _chunks(live, "/v1/completions", body) if c["choices"]]
    streamed = [t for c in chunks for t in c.get("token_ids") or []]
    assert streamed == [SIM.token_at("rti", len(ids) + i) for i in range(9)]
    firsts = [c["prompt_token_ids"] for c in chunks if "prompt_token_ids" in c]
    assert firsts == [ids]  # once, with the first chunk
    chat = {"messages": CHAT, "max_tokens": 5, "request_id": "rti-c", "return_token_ids": True}
    chunks = _chunks(live, "/v1/chat/completions", chat)
    assert chunks[0]["prompt_token_ids"] and all("prompt_token_ids" not in c for c in chunks[1:])
    n_prompt = len(chunks[0]["prompt_token_ids"])
    streamed = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []]
    assert streamed == [SIM.token_at("rti-c", n_prompt + i) for i in range(5)]
