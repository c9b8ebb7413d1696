"""OpenAI response bodies and SSE chunks for completions and chat completions, built from a
finished or running Generation (plain dicts: what goes on the wire)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from kvsched.http.generation import Generation

DONE = b"data: [DONE]\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def usage(gen: Generation) -> dict[str, Any]:
    return {
        "prompt_tokens": gen.prompt_tokens,
        "completion_tokens": gen.completion_tokens,
        "total_tokens": gen.prompt_tokens + gen.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": gen.cached_tokens},
    }


class Shape:
    """The wire shape of one endpoint's answers: `chat` or text completions."""

    def __init__(
        self,
        chat: bool,
        model: str,
        include_usage: bool,
        prompt_token_ids: list[int] | None = None,
    ) -> None:
        self.chat = chat
        self.model = model
        self.include_usage = include_usage
        # vLLM's `return_token_ids`: the prompt's and the output's ids in the (non-streamed) answer
        self.prompt_token_ids = prompt_token_ids
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, gen: Generation, text: str) -> dict[str, Any]:
        """The non-streaming answer."""
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": gen.finish_reason,
                "stop_reason": gen.stop_reason,
            }
            body = self._head("chat.completion")
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": gen.finish_reason,
                "stop_reason": gen.stop_reason,
            }
            body = self._head("text_completion")
        if self.prompt_token_ids is not None:
            choice["token_ids"] = gen.token_ids
            choice["prompt_token_ids"] = self.prompt_token_ids
        body["choices"] = [choice]
        body["usage"] = usage(gen)
        return body

    def chunk(self, text: str | None, finish_reason: str | None, first: bool = False) -> bytes:
        """One streamed piece of text (or the closing chunk with its finish_reason)."""
        if self.chat:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {
                "index": 0,
                "delta": delta,
                "logprobs": None,
                "finish_reason": finish_reason,
            }
            body = self._head("chat.completion.chunk")
        else:
            choice = {
                "index": 0,
                "text": text or "",
                "logprobs": None,
                "finish_reason": finish_reason,
            }
            body = self._head("text_completion")
        body["choices"] = [choice]
        if self.include_usage:
            body["usage"] = None
        return sse(body)

    def usage_chunk(self, gen: Generation) -> bytes:
        """stream_options.include_usage: the last chunk, no choices, the usage."""
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = []
        body["usage"] = usage(gen)
        return sse(body)
