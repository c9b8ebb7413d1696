"""Structured output and tool calls, as vLLM's OpenAI server serves them.

What a request asks for becomes one kvsched `structured_output` constraint (applied by the
worker's engine, docs/ENGINES.md):

    response_format json_object          -> {"json_object": True}
    response_format json_schema          -> {"json": its schema}
    structured_outputs (vLLM's extension)-> the one kind it sets (json, regex, choice, grammar,
                                            json_object)
    tools + tool_choice "required"       -> {"json": an array of {name, parameters} objects, one
                                            of the tools each} (vLLM's get_json_schema_from_tools)
    tools + tool_choice {function: name} -> {"json": that tool's parameters}
    tools + tool_choice "auto"           -> unconstrained; the text is parsed by vLLM's tool
                                            parser named by --tool-call-parser
    tools + tool_choice "none"           -> unconstrained, no parsing

A required call's text is a JSON array of {name, parameters}: each becomes a `tool_calls` entry
(arguments: the parameters' JSON), finish_reason "tool_calls" (when the request stopped); a named
call's text is the arguments themselves (finish_reason stays "stop", as vLLM's).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvsched.http.errors import invalid


class ToolFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: ToolFunction


class JsonSchema(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` request field (the kinds kvsched serves)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def constraint(self) -> dict[str, Any] | None:
        kinds = {
            "json": self.json_,
            "regex": self.regex,
            "choice": self.choice,
            "grammar": self.grammar,
            "json_object": self.json_object,
        }
        given = {k: v for k, v in kinds.items() if v is not None}
        if not given:
            return None
        if len(given) > 1:
            raise invalid(
                "You can only use one kind of constraints for structured outputs "
                f"({', '.join(sorted(given))} given).",
                "structured_outputs",
            )
        if given.get("json_object") is False:
            raise invalid(
                "structured_outputs.json_object must be True if set", "structured_outputs"
            )
        return given


def response_constraint(
    response_format: ResponseFormat | None, structured: StructuredOutputs | None
) -> dict[str, Any] | None:
    """The constraint of response_format (it wins, as in vLLM) or structured_outputs."""
    if response_format is not None and response_format.type == "json_object":
        return {"json_object": True}
    if response_format is not None and response_format.type == "json_schema":
        js = response_format.json_schema
        if js is None:
            raise invalid(
                "When response_format type is 'json_schema', the 'json_schema' field must be "
                "provided.",
                "response_format",
            )
        return {"json": js.json_schema if js.json_schema is not None else {}}
    return structured.constraint() if structured is not None else None


# ---- tools ------------------------------------------------------------------------------------

ToolChoice = str | dict[str, Any] | None  # "none" / "auto" / "required" / a named function


def tool_mode(tools: list[Tool] | None, choice: ToolChoice, auto_enabled: bool) -> str | None:
    """ "none" / "auto" / "required" / the named function's name; None without tools. A 400
    naming the parameter as vLLM's server does for a choice it cannot serve."""
    if tools is not None and not tools:
        raise invalid(
            "`tools` must not be an empty array. Either provide at least one tool or omit the "
            "field entirely.",
            "tools",
        )
    if choice is None:
        choice = "auto" if tools else None
    if choice is None or choice == "none":
        return "none" if tools else None
    if not tools:
        raise invalid("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if isinstance(choice, str) and choice not in ("auto", "required"):
        raise invalid(
            f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" or '
            '"required" are supported.',
            "tool_choice",
        )
    if isinstance(choice, dict):
        function = choice.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise invalid(
                f"Invalid value for `function` in `tool_choice`: {function!r}",
                "tool_choice.function",
            )
        name = function["name"]
        if not any(t.function.name == name for t in tools):
            raise invalid(
                "The tool specified in `tool_choice` does not match any of the specified `tools`",
                "tool_choice",
            )
        return str(name)
    if choice == "auto" and not auto_enabled:
        raise invalid(
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to '
            "be set",
            "tool_choice",
        )
    return str(choice)


def _params(params: dict[str, Any] | None) -> dict[str, Any]:
    return params if params else {"type": "object", "properties": {}}


def tool_constraint(
    tools: list[Tool], mode: str, parallel_tool_calls: bool | None = None
) -> dict[str, Any] | None:
    """The JSON schema a required or named call is held to (vLLM's get_json_schema_from_tools
    for chat requests: `parallel_tool_calls` false allows one call), else None."""
    if mode in ("none", "auto"):
        return None
    if mode != "required":
        tool = next(t for t in tools if t.function.name == mode)
        return {"json": _params(tool.function.parameters)}
    items = [
        {
            "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "parameters": _params(t.function.parameters),
            },
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": items},
    }
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    defs: dict[str, Any] = {}
    for t in tools:
        defs.update((t.function.parameters or {}).get("$defs") or {})
    if defs:
        schema["$defs"] = defs
    return {"json": schema}


def tool_call(name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-tool-{uuid.uuid4().hex}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def parse_forced(text: str, mode: str) -> tuple[str, list[dict[str, Any]]]:
    """(content, tool_calls) of a required or named call's text, as vLLM's parser reads it: a
    named call's text is its arguments; a required call's a JSON array of {name, parameters}
    (text that does not parse gives no calls, as vLLM's)."""
    if mode != "required":
        return ("", [tool_call(mode, text)]) if text.strip() else ("", [])
    try:
        calls = json.loads(text)
    except ValueError:
        return "", []
    if not isinstance(calls, list) or not all(
        isinstance(c, dict) and isinstance(c.get("name"), str) and "parameters" in c for c in calls
    ):
        return "", []
    return "", [
        tool_call(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in calls
    ]


class ToolReply:
    """How a chat answer with tools is shaped: the mode and the parse of the finished text."""

    def __init__(self, mode: str, parse: Callable[[str], tuple[str | None, list[dict[str, Any]]]]):
        self.mode = mode
        self.parse = parse

    def finish_reason(self, calls: list[dict[str, Any]], reason: str | None) -> str | None:
        """vLLM's: "tool_calls" when auto parsed calls, or a required call stopped; a named
        call keeps its reason."""
        if (self.mode == "auto" and calls) or (self.mode == "required" and reason == "stop"):
            return "tool_calls"
        return reason
