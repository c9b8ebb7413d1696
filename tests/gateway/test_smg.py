"""The real smg gateway in front of kvsched (docs/GATEWAY.md), through the official openai client:
chat and completions streamed and not, finish reasons and usage, stop strings, a client that
goes away mid-stream, n > 1, an unknown model, an over-long prompt."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.gateway.harness import Front, kvsched_and_smg
from tests.http.harness import MODEL, make_model_dir
from tests.integration.harness import status

MAX_MODEL_LEN = 2048
CHAT = [{"role": "user", "content": "hello there, how are you"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def front(model_dir: Path) -> Iterator[Front]:
    with kvsched_and_smg(model_dir, worker_args=("--max-model-len", str(MAX_MODEL_LEN))) as f:
        yield f


@pytest.fixture()
def client(front: Front) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{front.smg.url}/v1", api_key="unused", max_retries=0)


def test_chat_whole_and_streamed_with_finish_reason_and_usage(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    choice = whole.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content
    assert whole.usage is not None and whole.usage.completion_tokens == 12
    assert whole.usage.prompt_tokens > 0
    stream = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text, reasons, usage = "", [], None
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            if c.finish_reason:
                reasons.append(c.finish_reason)
        usage = chunk.usage or usage
    assert reasons == ["length"]
    assert text
    assert usage is not None and usage.completion_tokens == 12
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_completions_whole_and_streamed(client: openai.OpenAI) -> None:
    whole = client.completions.create(
        model=MODEL, prompt="the cat sat", max_tokens=9, extra_body={"ignore_eos": True}
    )
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 9
    reasons, usage = [], None
    for c in client.completions.create(
        model=MODEL,
        prompt="the cat sat",
        max_tokens=9,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    ):
        reasons += [x.finish_reason for x in c.choices if x.finish_reason]
        usage = c.usage or usage
    assert reasons == ["length"]
    assert usage is not None and usage.completion_tokens == 9
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_stop_string_cuts_the_text_and_ends_the_request(
    front: Front, client: openai.OpenAI
) -> None:
    """A space comes within 300 tokens of this tokenizer's English: the text ends before it,
    finish reason "stop", streamed or not, and kvsched ended the request there (finished
    STOP, fewer than 300 tokens generated) rather than running on to max_tokens: smg waits
    for the engine's complete before it answers."""
    stops = front.finished("stop")
    kw: Any = {"model": MODEL, "messages": CHAT, "max_tokens": 300, "stop": [" "]}
    r = client.chat.completions.create(**kw, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert " " not in (r.choices[0].message.content or "")
    assert r.usage is not None and r.usage.completion_tokens < 300
    text, reasons, usage = "", [], None
    for c in client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}
    ):
        for x in c.choices:
            text += x.delta.content or ""
            reasons += [x.finish_reason] if x.finish_reason else []
        usage = c.usage or usage
    assert reasons == ["stop"]
    assert " " not in text
    assert usage is not None and usage.completion_tokens < 300
    assert front.finished("stop") == stops + 2


def test_n_above_one_is_refused_naming_n(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, n=2)
    assert "sampling_params.n" in str(exc.value)


def test_unsupported_sampling_field_is_refused_by_name(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=4, frequency_penalty=0.5
        )
    assert "frequency_penalty" in str(exc.value)


def test_unknown_model_is_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="no-such-model", messages=CHAT, max_tokens=4)
    assert "no-such-model" in str(exc.value)


def test_over_long_prompt_is_refused(client: openai.OpenAI) -> None:
    long = [{"role": "user", "content": "hello there " * 600}]
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=long, max_tokens=4)
    assert str(MAX_MODEL_LEN) in str(exc.value)


def test_client_gone_mid_stream_ends_the_request_in_kvsched(
    front: Front, client: openai.OpenAI
) -> None:
    """The gateway aborts a request whose HTTP client went away; kvsched ends it (its metrics
    count an abort, its status shows nothing running) within a second of the disconnect."""
    aborts = front.finished("abort")
    stream = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=1500,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for seen, _ in enumerate(stream, 1):
        if seen == 3:
            break
    assert sum(i.num_running for i in status(front.address).instances) == 1
    stream.close()
    gone = time.monotonic()
    deadline = gone + 1.0
    while time.monotonic() < deadline and front.finished("abort") <= aborts:
        time.sleep(0.02)
    took = time.monotonic() - gone
    assert front.finished("abort") == aborts + 1, f"no abort within 1 s ({took:.2f} s)"
    print(f"disconnect -> abort in kvsched: {took:.3f} s")
    while time.monotonic() < deadline and sum(
        i.num_running for i in status(front.address).instances
    ):
        time.sleep(0.02)
    assert sum(i.num_running for i in status(front.address).instances) == 0
