"""Where `kvsched http` answers as vLLM's own OpenAI server does (issue 35's silent differences):
seed 0 is a seed, chat text parts joined with "\\n", max_tokens clamped to the context with
finish_reason length, a failed non-streaming request is a 500, refusals name their parameter,
the 404 lists a model once, the daemon's metrics carry the announced model name, and vLLM's
utility endpoints /version, /ping, /tokenize, /detokenize. A real daemon, sim worker and front
end (tests/http/harness.py); tests/vllm compares the same against vLLM's server."""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from kvsched import codec
from kvsched.client.types import build_request
from kvsched.http.schemas import CompletionRequest
from kvsched.worker_stub.sim import SimExecutor
from tests.http.harness import MODEL, VOCAB, Stack, scrape, stack, text_of
from tests.integration.harness import status

SIM = SimExecutor(vocab_size=VOCAB)
MAX_MODEL_LEN = 96  # the worker's announced context: small, so clamping is cheap to reach


@pytest.fixture(scope="module")
def small(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A stack whose worker announces a 96-token context and whose daemon fails a lost
    instance's requests at once (requeue_timeout_s = 0)."""
    cfg = tmp_path_factory.mktemp("cfg") / "kvsched.toml"
    cfg.write_text("requeue_timeout_s = 0.0\n")
    with stack(
        model_dir,
        daemon_args=("--config", str(cfg)),
        worker_args=("--served-model-name", MODEL, "--max-model-len", str(MAX_MODEL_LEN)),
    ) as s:
        yield s


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(model_dir))


def _client(s: Stack) -> OpenAI:
    return OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _sim(rid: str, n_prompt: int, n: int) -> list[int]:
    return [SIM.token_at(rid, n_prompt + i) for i in range(n)]


def _error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    return dict(resp.json()["error"])


def test_seed_zero_travels_as_a_seed_and_absent_as_none() -> None:
    """seed 0 reaches the worker's sampler as 0 (vLLM seeds with it); no seed stays unseeded."""
    opts = CompletionRequest(model=MODEL, prompt="x", seed=0).options(4)
    assert opts["seed"] == 0
    pb = build_request([1, 2], opts)  # type: ignore[arg-type]
    assert pb.sampling.HasField("seed")
    assert codec.sampling_from_proto(pb.sampling).seed == 0
    unseeded = build_request([1, 2], CompletionRequest(model=MODEL, prompt="x").options(4))  # type: ignore[arg-type]
    assert not unseeded.sampling.HasField("seed")
    assert codec.sampling_from_proto(unseeded.sampling).seed is None
    again = codec.sampling_to_proto(codec.sampling_from_proto(pb.sampling))
    assert again.HasField("seed") and again.seed == 0  # the daemon passes it on to the worker


def test_chat_text_parts_are_joined_with_newlines(small: Stack, tok: Any) -> None:
    parts = [{"type": "text", "text": "Count"}, {"type": "text", "text": " to 3"}]
    joined = [{"role": "user", "content": "Count\n to 3"}]
    text = tok.apply_chat_template(joined, add_generation_prompt=True, tokenize=False)
    n_prompt = len(tok(text, add_special_tokens=False).input_ids)
    out = _client(small).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": parts}],  # type: ignore[list-item]
        max_tokens=5,
        extra_body={"request_id": "parts"},
    )
    assert out.usage is not None and out.usage.prompt_tokens == n_prompt
    assert out.choices[0].message.content == text_of(tok, _sim("parts", n_prompt, 5))


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_past_the_context_is_clamped_with_finish_reason_length(
    small: Stack, tok: Any, stream: bool
) -> None:
    prompt = "Clamp me, please."
    n_prompt = len(tok(prompt).input_ids)
    rid = f"clamp-{stream}"
    kwargs: dict[str, Any] = dict(
        model=MODEL,
        prompt=prompt,
        max_tokens=10**6,
        extra_body={"request_id": rid, "ignore_eos": True},
    )
    want = text_of(tok, _sim(rid, n_prompt, MAX_MODEL_LEN - n_prompt))
    if stream:
        chunks = list(
            _client(small).completions.create(
                stream=True, stream_options={"include_usage": True}, **kwargs
            )
        )
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        usage = chunks[-1].usage
    else:
        out = _client(small).completions.create(**kwargs)
        text, reason, usage = out.choices[0].text, out.choices[0].finish_reason, out.usage
    assert reason == "length"
    assert usage is not None and usage.completion_tokens == MAX_MODEL_LEN - n_prompt
    assert text == want
    # The chat default (no max_tokens) is the same rest of the context.
    chat = _client(small).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], extra_body={"ignore_eos": True}
    )
    assert chat.usage is not None and chat.usage.total_tokens == MAX_MODEL_LEN
    assert chat.choices[0].finish_reason == "length"


def test_a_prompt_that_fills_the_context_is_400_naming_input_tokens(small: Stack) -> None:
    body = {"model": MODEL, "prompt": [5] * MAX_MODEL_LEN, "max_tokens": 1}
    err = _error(httpx.post(small.url + "/v1/completions", json=body, timeout=30), 400)
    assert err["param"] == "input_tokens" and "maximum context length is 96" in err["message"]


def test_daemon_refusals_name_the_param_and_no_request_id(small: Stack) -> None:
    body = {"model": MODEL, "prompt": "x", "stop_token_ids": [VOCAB + 1], "request_id": "rq-77"}
    err = _error(httpx.post(small.url + "/v1/completions", json=body, timeout=30), 400)
    assert err["param"] == "stop_token_ids"
    assert "rq-77" not in err["message"] and "outside the vocabulary" in err["message"]


def test_unknown_model_404_names_each_served_model_once(small: Stack) -> None:
    body = {"model": "gpt-9", "prompt": "x"}
    err = _error(httpx.post(small.url + "/v1/completions", json=body, timeout=30), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert err["message"].count(MODEL) == 1


def test_a_truncated_json_body_is_400_without_an_offset_for_a_param(small: Stack) -> None:
    raw = b'{"model": "tiny", "prompt": "Hello", "max'
    resp = httpx.post(
        small.url + "/v1/completions",
        content=raw,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    err = _error(resp, 400)
    assert err["param"] is None
    assert "not valid JSON" in err["message"]


def test_the_daemons_metrics_name_the_announced_model(small: Stack) -> None:
    assert scrape(small.metrics_url, "kvsched_instance_ready", model=MODEL) == 1
    assert scrape(small.metrics_url, "kvsched_instance_ready", model="default") == 0


def test_version_ping_tokenize_detokenize(small: Stack, tok: Any) -> None:
    url = small.url
    assert httpx.get(url + "/version", timeout=10).json()["version"]
    assert httpx.get(url + "/ping", timeout=10).status_code == 200
    assert httpx.post(url + "/ping", timeout=10).status_code == 200
    got = httpx.post(
        url + "/tokenize",
        json={"model": MODEL, "prompt": "café 東京", "return_token_strs": True},
        timeout=10,
    ).json()
    ids = tok("café 東京").input_ids
    assert got["tokens"] == ids and got["count"] == len(ids)
    assert got["max_model_len"] == MAX_MODEL_LEN
    assert got["token_strs"] == tok.convert_ids_to_tokens(ids)
    msgs = [{"role": "user", "content": "Hi"}]
    chat = httpx.post(url + "/tokenize", json={"messages": msgs}, timeout=10).json()
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert chat["tokens"] == tok(text, add_special_tokens=False).input_ids
    assert chat["token_strs"] is None
    back = httpx.post(url + "/detokenize", json={"tokens": ids}, timeout=10).json()
    assert back == {"prompt": tok.decode(ids)}
    err = _error(httpx.post(url + "/detokenize", json={"tokens": [VOCAB]}, timeout=10), 400)
    assert err["param"] == "tokens"
    err = _error(
        httpx.post(url + "/tokenize", json={"model": "nope", "prompt": "x"}, timeout=10), 404
    )
    assert err["code"] == "model_not_found"


def test_a_non_streaming_request_whose_worker_is_lost_is_500(
    model_dir: Path, tmp_path: Path
) -> None:
    """The worker dies (SIGKILL) mid-request and the daemon ends it with an error
    (requeue_timeout_s 0: no other instance will take it): 500 with the daemon's reason, no
    partial text, as docs/HTTP.md says."""
    cfg = tmp_path / "kvsched.toml"
    cfg.write_text("requeue_timeout_s = 0.0\n")
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 5000, "ignore_eos": True}
    with (
        stack(model_dir, daemon_args=("--config", str(cfg)), worker_args=("--speed", "0.05")) as s,
        ThreadPoolExecutor(1) as pool,
        httpx.Client(timeout=60) as http,
    ):
        answer = pool.submit(http.post, s.url + "/v1/completions", json=body)
        deadline = time.monotonic() + 30
        while not sum(i.num_running for i in status(s.address).instances):
            assert time.monotonic() < deadline and not answer.done()
            time.sleep(0.02)
        assert s.worker is not None
        s.worker.signal(signal.SIGKILL)
        err = _error(answer.result(timeout=60), 500)
    assert err["type"] == "internal_error" and err["message"].startswith("kvsched:")


def test_a_killed_front_end_takes_its_requests_with_it(model_dir: Path) -> None:
    """kill -9 of `kvsched http` (one --server: its requests are not detachable) while four
    requests stream: the daemon aborts all four as their streams drop, within 2 s (issue 35)."""
    with stack(model_dir) as s, ThreadPoolExecutor(4) as pool:
        aborted = s.finished("abort")
        body = {
            "model": MODEL,
            "prompt": "Go on",
            "max_tokens": 100_000,
            "ignore_eos": True,
            "stream": True,
        }

        def stream_until_cut() -> int:
            n = 0
            with (
                contextlib.suppress(httpx.HTTPError),
                httpx.Client(timeout=60) as http,
                http.stream("POST", s.url + "/v1/completions", json=body) as resp,
            ):
                for _ in resp.iter_lines():
                    n += 1
            return n

        streams = [pool.submit(stream_until_cut) for _ in range(4)]
        deadline = time.monotonic() + 30
        while sum(i.num_running for i in status(s.address).instances) < 4:
            assert time.monotonic() < deadline, "the four requests never ran"
            time.sleep(0.02)
        s.http.signal(signal.SIGKILL)
        killed = time.monotonic()
        assert s.wait_finished("abort", aborted + 4, timeout=2.0) == aborted + 4
        while sum(i.num_running + i.num_waiting for i in status(s.address).instances):
            assert time.monotonic() - killed < 2.0, "requests still running 2 s after the kill"
            time.sleep(0.02)
        for f in streams:  # the HTTP clients saw their connections end
            f.result(timeout=30)


def test_engine_sampling_fields_travel_to_the_worker() -> None:
    """Penalties, logit_bias and min_p: the front end's options -> GenerateRequest -> the core's
    SamplingParams -> the worker's message, unchanged (biases clamped to [-100, 100], as vLLM)."""
    body = CompletionRequest(
        model=MODEL,
        prompt="x",
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repetition_penalty=1.3,
        min_p=0.1,
        logit_bias={"7": 250.0, "9": -3.0},
    )
    body.check()
    core = codec.sampling_from_proto(build_request([1], body.options(4)).sampling)  # type: ignore[arg-type]
    assert (core.presence_penalty, core.frequency_penalty) == (0.5, -0.25)
    assert (core.repetition_penalty, core.min_p) == (1.3, 0.1)
    assert core.logit_bias == {7: 100.0, 9: -3.0}
    back = codec.sampling_from_proto(codec.sampling_to_proto(core))
    assert back == core
    plain = codec.sampling_from_proto(
        build_request([1], CompletionRequest(model=MODEL, prompt="x").options(4)).sampling  # type: ignore[arg-type]
    )
    assert (plain.repetition_penalty, plain.logit_bias, plain.min_p) == (1.0, {}, 0.0)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {str(VOCAB + 3): 1}}, "logit_bias"),  # the daemon's refusal
    ],
)
def test_bad_sampling_fields_are_400_naming_them(
    small: Stack, extra: dict[str, Any], param: str
) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, **extra}
    err = _error(httpx.post(small.url + "/v1/completions", json=body, timeout=30), 400)
    assert err["param"] == param


def test_penalties_bias_and_min_p_are_served_on_both_endpoints(small: Stack) -> None:
    """The sim samples no distribution (it ignores them, as it ignores temperature); the
    request is accepted and served, on completions and chat alike."""
    c = _client(small)
    vllm_extensions = {"min_p": 0.05, "repetition_penalty": 1.2}
    out = c.completions.create(
        model=MODEL,
        prompt="x",
        max_tokens=3,
        presence_penalty=1.0,
        frequency_penalty=0.5,
        logit_bias={"5": 5},
        extra_body=vllm_extensions,
    )
    assert out.usage is not None and out.usage.completion_tokens == 3
    chat = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=3,
        presence_penalty=1.0,
        logit_bias={"5": 5},
        extra_body=vllm_extensions,
    )
    assert chat.usage is not None and chat.usage.completion_tokens == 3


def test_return_token_ids_and_stop_reason(small: Stack, tok: Any) -> None:
    """vLLM's `return_token_ids` (non-streamed) and `stop_reason` (the stop token id or stop
    string that ended the text; None otherwise)."""
    prompt_ids = tok("Hi").input_ids
    toks = _sim("tids", len(prompt_ids), 30)
    k = toks.index(toks[10])
    body = {
        "model": MODEL,
        "prompt": "Hi",
        "max_tokens": 30,
        "request_id": "tids",
        "stop_token_ids": [toks[10]],
        "return_token_ids": True,
    }
    choice = httpx.post(small.url + "/v1/completions", json=body, timeout=30).json()["choices"][0]
    assert choice["token_ids"] == toks[: k + 1] and choice["prompt_token_ids"] == prompt_ids
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", toks[10])
    plain = {"model": MODEL, "prompt": "Hi", "max_tokens": 3}
    choice = httpx.post(small.url + "/v1/completions", json=plain, timeout=30).json()["choices"][0]
    assert choice["stop_reason"] is None and "token_ids" not in choice


@pytest.mark.parametrize("stream", [False, True])
def test_n_samples_are_one_request_each_in_one_response(
    small: Stack, tok: Any, stream: bool
) -> None:
    """n = 3: three kvsched requests (request_id + "-i"; seed + i, as vLLM seeds its children),
    answered as choices 0..2; usage counts the prompt once and every sample's tokens."""
    rid = f"n3-{stream}"
    messages = [{"role": "user", "content": "Three ways to say hi"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    n_prompt = len(tok(text, add_special_tokens=False).input_ids)
    want = [text_of(tok, _sim(f"{rid}-{i}", n_prompt, 6)) for i in range(3)]
    kwargs: dict[str, Any] = dict(
        model=MODEL, messages=messages, max_tokens=6, n=3, extra_body={"request_id": rid}
    )
    if stream:
        chunks = list(
            _client(small).chat.completions.create(
                stream=True, stream_options={"include_usage": True}, **kwargs
            )
        )
        got = ["", "", ""]
        reasons: dict[int, str] = {}
        for c in chunks:
            for ch in c.choices:
                got[ch.index] += ch.delta.content or ""
                if ch.finish_reason:
                    reasons[ch.index] = ch.finish_reason
        assert reasons == {0: "length", 1: "length", 2: "length"}
        usage = chunks[-1].usage
    else:
        out = _client(small).chat.completions.create(**kwargs)
        assert [c.index for c in out.choices] == [0, 1, 2]
        got = [c.message.content or "" for c in out.choices]
        usage = out.usage
    assert got == want
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (n_prompt, 18)


def test_n_greedy_samples_are_400_as_vllms(small: Stack) -> None:
    body = {"model": MODEL, "prompt": "x", "n": 2, "temperature": 0}
    err = _error(httpx.post(small.url + "/v1/completions", json=body, timeout=30), 400)
    assert err["param"] == "n" and "greedy" in err["message"]


def test_n_samples_seeds_follow_vllms_children() -> None:
    from kvsched.http.samples import sample_options

    opts = sample_options({"seed": 0, "request_id": "r", "temperature": 1.0}, 3)
    assert [(o["seed"], o["request_id"]) for o in opts] == [(0, "r-0"), (1, "r-1"), (2, "r-2")]
    assert all("seed" not in o for o in sample_options({"temperature": 1.0}, 2))
    groups = {o["sample_group"] for o in opts}  # one group per HTTP request, a new one each
    assert len(groups) == 1 and groups.isdisjoint(o["sample_group"] for o in sample_options({}, 2))


def test_samples_of_one_request_start_at_one_daemon() -> None:
    """With several --server addresses the samples of one request are submitted to one daemon
    first (it computes their prompt once); requests of no group rotate."""
    import asyncio

    from kvsched.http.backend import Backend
    from kvsched.http.samples import sample_options

    async def go() -> None:
        b = Backend(["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"])
        try:
            for opts in (sample_options({}, 4) for _ in range(6)):
                firsts = {id(b._rotation(o["sample_group"])[0]) for o in opts}
                assert len(firsts) == 1
            assert len({id(b._rotation()[0]) for _ in range(3)}) == 3
        finally:
            await b.close()

    asyncio.run(go())
