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


def _json(text: str) -> bytes:
    return json.dumps(text, ensure_ascii=False).encode()


def usage(gen: Generation) -> dict[str, Any]:
    return {
        "prompt_tokens": gen.prompt_tokens,
        "completion_tokens": gen.completion_tokens,
        "total_tokens": gen.prompt_tokens + gen.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": gen.cached_tokens},
    }


class Shape:
    """The wire shape of one endpoint's answers: `chat` or text completions."""

    def __init__(self, chat: bool, model: str, include_usage: bool) -> None:
        self.chat = chat
        self.model = model
        self.include_usage = include_usage
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self._piece: tuple[bytes, bytes] | None = None  # a text chunk's bytes around its text

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
            }
            body = self._head("chat.completion")
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": gen.finish_reason,
            }
            body = self._head("text_completion")
        body["choices"] = [choice]
        body["usage"] = usage(gen)
        return body

    def chunk(self, text: str | None, finish_reason: str | None, first: bool = False) -> bytes:
        """One streamed piece of text (or the closing chunk with its finish_reason)."""
        if text is not None and finish_reason is None and not first:
            # The hot path (a chunk per piece of text): the same bytes as the whole chunk's
            # json.dumps, with only the text encoded each time.
            if self._piece is None:
                marker = "\ue000piece\ue000"
                pre, post = self._chunk(marker, None, False).split(_json(marker))
                self._piece = (pre, post)
            return self._piece[0] + _json(text) + self._piece[1]
        return self._chunk(text, finish_reason, first)

    def _chunk(self, text: str | None, finish_reason: str | None, first: bool) -> bytes:
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
