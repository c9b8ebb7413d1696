"""OpenAI request bodies as pydantic models (FastAPI validates them), and the checks that turn
fields kvsched does not serve into a 400 naming the field instead of silently ignoring them.

Supported: model, prompt (one: a string, a list of one string, token ids, or a list of one
list of ids), messages (text content), max_tokens / max_completion_tokens, temperature, top_p,
seed, n (samples: http/samples.py), stop, stream, stream_options.include_usage, presence/frequency penalties,
logit_bias, user (ignored); vLLM's extensions ignore_eos, stop_token_ids, top_k, min_tokens,
min_p, repetition_penalty, skip_special_tokens, add_generation_prompt, request_id (kvsched's
request id: the same id and sampling give the same tokens on the sim).
Log-probabilities (http/logprobs.py): completions' logprobs (int) and echo, chat's logprobs
(bool) and top_logprobs, vLLM's prompt_logprobs; -1 means the whole vocabulary (as vLLM: over
its max_logprobs, the daemon refuses it naming the field).
Structured output (response_format, vLLM's structured_outputs) and chat tools / tool_choice:
http/structured.py. Refused with 400: best_of > 1, suffix, functions (the pre-tools API),
several prompts, a chat content part other than text (image_url, input_audio, ...: naming it).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from kvsched.http.errors import invalid
from kvsched.http.structured import (
    ResponseFormat,
    StructuredOutputs,
    Tool,
    ToolChoice,
    response_constraint,
    tool_constraint,
    tool_mode,
)

MAX_N = 128  # samples per request
MAX_STOP_STRINGS = 4  # OpenAI's limit (vLLM has none; docs/HTTP.md)


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields both endpoints share. Unknown fields are ignored (as vLLM does)."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=1 << 64)
    n: int | None = 1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    # vLLM's extensions
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    top_k: int | None = Field(default=None, ge=-1)
    repetition_penalty: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    min_tokens: int = Field(default=0, ge=0)
    skip_special_tokens: bool = True
    return_token_ids: bool = False  # vLLM's: prompt and output token ids in the answer
    prompt_logprobs: int | None = None  # vLLM's: the prompt tokens' log-probabilities
    request_id: str | None = Field(default=None, min_length=1, max_length=256)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's extension

    def constraint(self) -> dict[str, Any] | None:
        """The structured-output constraint asked for (http/structured.py), or None."""
        return response_constraint(self.response_format, self.structured_outputs)

    def constraint_param(self) -> str:
        """The request field the structured-output constraint came from."""
        if self.response_format is not None and self.response_format.type != "text":
            return "response_format"
        return "structured_outputs"

    def check_common(self) -> None:
        if self.n is not None and not 1 <= self.n <= MAX_N:
            raise invalid(f"n must be in [1, {MAX_N}], got {self.n}", "n")
        if (self.n or 1) > 1 and self.temperature == 0:  # as vLLM: n greedy samples are one
            raise invalid(f"n must be 1 when using greedy sampling, got {self.n}.", "n")
        self.token_biases()
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options is only allowed when stream is true", "stream_options")
        _check_k("prompt_logprobs", self.prompt_logprobs)
        if self.stream and self.prompt_logprobs is not None and self.prompt_logprobs != 0:
            raise invalid(
                "`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs"
            )
        stops = self.stop_strings()
        if any(s == "" for s in stops):
            raise invalid("stop strings must not be empty", "stop")
        if len(stops) > MAX_STOP_STRINGS:
            raise invalid(
                f"stop: at most {MAX_STOP_STRINGS} stop strings (OpenAI's limit), got {len(stops)}",
                "stop",
            )

    def token_biases(self) -> dict[int, float]:
        """logit_bias with integer token ids, each bias clamped to [-100, 100] (as vLLM)."""
        out: dict[int, float] = {}
        for key, bias in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise invalid(
                    f"logit_bias: key {key!r} is not a token id (an integer)", "logit_bias"
                ) from None
            out[token] = min(100.0, max(-100.0, bias))
        return out

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def options(self, max_tokens: int | None) -> dict[str, Any]:
        """kvsched.client request options (absent keys: the daemon's defaults)."""
        out: dict[str, Any] = {
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens,
        }
        if max_tokens is not None:
            out["max_tokens"] = max_tokens
        if self.top_p is not None:
            out["top_p"] = self.top_p
        if self.top_k is not None and self.top_k > 0:
            out["top_k"] = self.top_k
        if self.seed is not None:
            out["seed"] = self.seed
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.request_id:
            out["request_id"] = self.request_id
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.logit_bias:
            out["logit_bias"] = self.token_biases()
        constraint = self.constraint()
        if constraint is not None:
            out["structured_output"] = constraint
        return out

    def logprob_options(self, vocab_size: int) -> dict[str, int]:
        """The `logprobs` / `prompt_logprobs` request options (-1: the whole vocabulary)."""
        out = {}
        for name, k in (
            ("logprobs", self.num_logprobs()),
            ("prompt_logprobs", self.num_prompt_logprobs()),
        ):
            if k is not None:
                out[name] = vocab_size if k == -1 else k
        return out

    def num_logprobs(self) -> int | None:
        """Alternatives per output token the answer shows (None: no log-probabilities)."""
        return None

    def num_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs


def _check_k(name: str, k: int | None) -> None:
    if k is not None and k < 0 and k != -1:
        raise invalid(f"`{name}` must be a positive value or -1.", name)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = None
    best_of: int | None = None

    def check(self) -> None:
        self.check_common()
        if self.suffix:
            raise invalid("suffix is not supported", "suffix")
        _check_k("logprobs", self.logprobs)
        if self.best_of not in (None, 1):
            raise invalid("best_of must be 1", "best_of")
        p = self.prompt
        if isinstance(p, list) and len(p) != 1 and p and not isinstance(p[0], int):
            raise invalid("one prompt per request: send several requests instead", "prompt")
        if p == "" or p == []:
            raise invalid("prompt must not be empty", "prompt")

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def num_prompt_logprobs(self) -> int | None:
        """vLLM's rule: echo with logprobs asks for the prompt's too."""
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs


class ContentPart(BaseModel):
    """A content part: text is served; any other type (image_url, input_audio, ...) is read
    only to be refused by name (`ChatCompletionRequest.check`), as kvsched's workers run no
    encoder for the HTTP front end's requests."""

    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    # Any role the chat template renders (vLLM passes custom roles through; the usual ones
    # are system, developer, user, assistant, tool).
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The content as the chat template sees it: text parts joined with "\n", as vLLM's
        chat renderer joins them ("string" content format)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text or "" for p in self.content)

    def rendered(self) -> dict[str, str]:
        return {"role": self.role, "content": self.text()}


def check_content(messages: list[ChatMessage]) -> None:
    """400 naming the part for a content part other than text (image_url, input_audio, ...:
    kvsched serves text only) or a text part without its text."""
    for i, m in enumerate(messages):
        for j, part in enumerate(m.content if isinstance(m.content, list) else ()):
            if part.type != "text":
                raise invalid(
                    f"content part type {part.type!r} is not supported: kvsched serves "
                    "text content only (no multimodal inputs)",
                    f"messages.{i}.content.{j}.type",
                )
            if part.text is None:
                raise invalid("a text part needs its text", f"messages.{i}.content.{j}.text")


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    tools: list[Tool] | None = None
    tool_choice: ToolChoice = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    # vLLM's extensions
    add_generation_prompt: bool = True
    _mode: str | None = PrivateAttr(default=None)  # the tool mode check() found

    def check(self, auto_tools: bool = False) -> str | None:
        """The checks; returns the tool mode (http/structured.py: None without tools)."""
        self.check_common()
        check_content(self.messages)
        _check_k("top_logprobs", self.top_logprobs)
        if self.top_logprobs and not self.logprobs:
            raise invalid(
                "when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs"
            )
        if self.functions:
            raise invalid("functions is not supported: use tools", "functions")
        mode = tool_mode(self.tools, self.tool_choice, auto_tools)
        so = self.structured_outputs
        if mode not in (None, "none", "auto") and so is not None and so.constraint() is not None:
            raise invalid(
                "You can only either use constraints for structured outputs or tools, not both.",
                "structured_outputs",
            )
        self._mode = mode
        return mode

    def constraint(self) -> dict[str, Any] | None:
        """A required or named tool call's schema overrides response_format (as vLLM's)."""
        mode = self._mode
        if self.tools and mode is not None:
            forced = tool_constraint(self.tools, mode, self.parallel_tool_calls)
            if forced is not None:
                return forced
        return super().constraint()

    def constraint_param(self) -> str:
        if self.tools and self._mode not in (None, "none", "auto"):
            return "tool_choice"
        return super().constraint_param()

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def wanted_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
