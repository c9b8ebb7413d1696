"""Structured-output and tool-call requests test_http_diff sends to both servers, and what their
answers must hold (kept here so the differential test module stays one screenful per idea)."""

from __future__ import annotations

import json
from typing import Any

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "none"]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["UTC", "CET", "JST"]}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
TOOL_NAMES = {t["function"]["name"] for t in TOOLS}  # type: ignore[index]
CHAT = [{"role": "user", "content": "What should I know today?"}]


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": CHAT, "temperature": 0, "max_tokens": 160, **extra}


# (what, endpoint, body extra, check of the text) -- each answered equal by both servers
CONSTRAINED: list[tuple[str, str, dict[str, Any]]] = [
    (
        "json_schema",
        "chat",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "p", "schema": PERSON},
            }
        },
    ),
    ("json_object", "chat", {"response_format": {"type": "json_object"}}),
    (
        "json_schema_completions",
        "completions",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "p", "schema": PERSON},
            }
        },
    ),
    ("choice", "completions", {"structured_outputs": {"choice": ["yes", "no", "perhaps"]}}),
    ("regex", "completions", {"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2,5}"}}),
    ("grammar", "chat", {"structured_outputs": {"grammar": 'root ::= ("ab" | "cd")+ "!"'}}),
]


def check_constrained(what: str, text: str) -> None:
    """The text follows its constraint (the request stopped: the grammar completed)."""
    import re

    if what.startswith("json_schema"):
        value = json.loads(text)
        assert set(value) == {"name", "age", "pet"} and value["pet"] in ("cat", "dog", "none")
        assert isinstance(value["age"], int) and 0 <= value["age"] <= 120
    elif what == "json_object":
        assert isinstance(json.loads(text), dict)
    elif what == "choice":
        assert text in ("yes", "no", "perhaps")
    elif what == "regex":
        assert re.fullmatch("[0-9]{3}-[a-z]{2,5}", text), text
    elif what == "grammar":
        assert re.fullmatch(r"(ab|cd)+!", text), text


def structured_bad_requests() -> list[tuple[str, str, dict[str, Any]]]:
    """Malformed structured-output and tool requests (status and param compared)."""
    msg = {"messages": CHAT, "max_tokens": 4}
    named = {"type": "function", "function": {"name": "no_such_tool"}}
    return [
        ("chat", "schema_not_object", {**msg, "response_format": {"type": "json_schema"}}),
        ("chat", "format_type", {**msg, "response_format": {"type": "xml"}}),
        ("completions", "bad_regex", {"prompt": "x", "structured_outputs": {"regex": "(["}}),
        (
            "completions",
            "two_kinds",
            {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}},
        ),
        ("chat", "unknown_tool", {**msg, "tools": TOOLS, "tool_choice": named}),
        ("chat", "tool_choice_no_tools", {**msg, "tool_choice": "required"}),
        ("chat", "empty_tools", {**msg, "tools": []}),
        ("chat", "tool_choice_word", {**msg, "tools": TOOLS, "tool_choice": "always"}),
    ]
