"""Structured output and tools through `kvsched http` on a sim worker, which cannot apply a
grammar: the daemon refuses such a request before queueing it (400 naming the field the
constraint came from), nothing runs half-way. The contract path (front end options ->
GenerateRequest -> core -> worker message) and the daemon's syntax checks are exercised here
too; tests/vllm/test_http_diff.py runs the constraints on vLLM's engine against vLLM's server."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from kvsched import codec
from kvsched.client.types import build_request
from kvsched.core import InvalidRequest
from kvsched.core.protocol import StructuredOutput
from kvsched.core.scheduler.validation import validate
from kvsched.http.schemas import ChatCompletionRequest, CompletionRequest
from kvsched.http.structured import parse_forced
from tests.core.factories import make_config, make_request
from tests.http.harness import MODEL, Stack
from tests.integration.harness import status

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOLS = [
    {"type": "function", "function": {"name": "f", "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "g"}},
]
MSGS = [{"role": "user", "content": "x"}]


def _post(s: Stack, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(s.url + path, json={"model": MODEL, "max_tokens": 4, **body}, timeout=30)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/v1/chat/completions",
            {
                "messages": MSGS,
                "response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}},
            },
            "response_format",
        ),
        (
            "/v1/chat/completions",
            {"messages": MSGS, "response_format": {"type": "json_object"}},
            "response_format",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "structured_outputs": {"choice": ["a", "b"]}},
            "structured_outputs",
        ),
        (
            "/v1/chat/completions",
            {"messages": MSGS, "tools": TOOLS, "tool_choice": "required"},
            "tool_choice",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": MSGS,
                "tools": TOOLS,
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice",
        ),
    ],
)
def test_a_constraint_the_sim_worker_cannot_apply_is_refused_before_it_runs(
    live: Stack, path: str, body: dict[str, Any], param: str
) -> None:
    resp = _post(live, path, body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param
    assert "structured_output" in err["message"] and "vLLM worker" in err["message"]
    assert all(i.num_running + i.num_waiting == 0 for i in status(live.address).instances)


def test_tools_with_tool_choice_none_are_served_as_text(live: Stack) -> None:
    resp = _post(
        live, "/v1/chat/completions", {"messages": MSGS, "tools": TOOLS, "tool_choice": "none"}
    )
    assert resp.status_code == 200, resp.text
    assert isinstance(resp.json()["choices"][0]["message"]["content"], str)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": TOOLS}, "tool_choice"),  # "auto" (the default with tools) needs the flags
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "h"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": []}, "tools"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ],
)
def test_malformed_tool_and_format_fields_are_400_naming_them(
    live: Stack, body: dict[str, Any], param: str
) -> None:
    resp = _post(live, "/v1/chat/completions", {"messages": MSGS, **body})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


def test_the_constraint_travels_from_the_front_end_to_the_worker_message() -> None:
    cases = [
        (
            CompletionRequest(model=MODEL, prompt="x", structured_outputs={"regex": "[0-9]+"}),
            StructuredOutput("regex", "[0-9]+"),
        ),
        (
            CompletionRequest(model=MODEL, prompt="x", structured_outputs={"choice": ["a", "b"]}),
            StructuredOutput("choice", choices=("a", "b")),
        ),
        (
            CompletionRequest(model=MODEL, prompt="x", response_format={"type": "json_object"}),
            StructuredOutput("json_object"),
        ),
        (
            CompletionRequest(
                model=MODEL,
                prompt="x",
                response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}},
            ),
            StructuredOutput("json", json.dumps(SCHEMA)),
        ),
        (
            CompletionRequest(
                model=MODEL, prompt="x", structured_outputs={"grammar": 'root ::= "a"'}
            ),
            StructuredOutput("grammar", 'root ::= "a"'),
        ),
    ]
    for body, want in cases:
        body.check()
        core = codec.sampling_from_proto(build_request([1], body.options(4)).sampling)  # type: ignore[arg-type]
        assert core.structured == want
        assert codec.sampling_from_proto(codec.sampling_to_proto(core)) == core
    plain = CompletionRequest(model=MODEL, prompt="x")
    assert (
        codec.sampling_from_proto(build_request([1], plain.options(4)).sampling).structured is None
    )  # type: ignore[arg-type]


def test_a_required_tool_call_is_held_to_the_tools_schema_and_parsed() -> None:
    chat = ChatCompletionRequest(model=MODEL, messages=MSGS, tools=TOOLS, tool_choice="required")  # type: ignore[arg-type]
    assert chat.check() == "required"
    schema = json.loads(
        codec.sampling_from_proto(build_request([1], chat.options(4)).sampling).structured.spec
    )  # type: ignore[arg-type,union-attr]
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert schema["type"] == "array" and names == [["f"], ["g"]]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {
        "type": "object",
        "properties": {},
    }
    content, calls = parse_forced('[{"name": "f", "parameters": {"a": 1}}]', "required")
    assert content == "" and [
        (c["function"]["name"], c["function"]["arguments"]) for c in calls
    ] == [("f", '{"a": 1}')]
    assert parse_forced("[not json", "required") == ("", [])
    _, named = parse_forced('{"a": 2}', "f")
    assert named[0]["function"] == {"name": "f", "arguments": '{"a": 2}'}


@pytest.mark.parametrize(
    ("so", "words"),
    [
        (StructuredOutput("json", "{not json"), "structured_output.json: the schema is not JSON"),
        (StructuredOutput("json", "[1, 2]"), "must be an object"),
        (StructuredOutput("regex", "(["), "structured_output.regex does not compile"),
        (StructuredOutput("choice"), "structured_output.choice needs at least one"),
        (StructuredOutput("grammar", "  "), "structured_output.grammar is empty"),
        (StructuredOutput("xml", "<a/>"), "structured_output.xml: unknown kind"),
    ],
)
def test_the_daemon_refuses_a_constraint_that_cannot_compile_naming_the_field(
    so: StructuredOutput, words: str
) -> None:
    req = make_request(8)
    req.sampling.structured = so
    with pytest.raises(InvalidRequest, match=words.replace("(", r"\(").replace("[", r"\[")):
        validate(req, make_config(block_size=16, num_gpu_blocks=100, max_model_len=1024), (), 100)
