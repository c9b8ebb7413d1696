"""OpenAI response bodies and SSE chunks for completions and chat completions, built from a
finished or running Generation (plain dicts: what goes on the wire)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from kvsched.http.generation import Generation
from kvsched.http.structured import ToolReply

DONE = b"data: [DONE]\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def _json(text: str) -> bytes:
    return json.dumps(text, ensure_ascii=False).encode()


def usage(*gens: Generation) -> dict[str, Any]:
    """One request's usage; for n samples of one prompt, the prompt counted once (as vLLM)."""
    prompt = gens[0].prompt_tokens
    completion = sum(g.completion_tokens for g in gens)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        # The prompt's own cache hit: the sample that computed it (the others took its blocks).
        "prompt_tokens_details": {"cached_tokens": min(g.cached_tokens for g in gens)},
    }


class Shape:
    """The wire shape of one endpoint's answers: `chat` or text completions."""

    def __init__(
        self,
        chat: bool,
        model: str,
        include_usage: bool,
        prompt_token_ids: list[int] | None = None,
        tools: ToolReply | None = None,
    ) -> None:
        self.chat = chat
        self.tools = tools  # a chat request with tools: its text parsed into tool_calls
        self.model = model
        self.include_usage = include_usage
        # vLLM's `return_token_ids`: the prompt's and the output's ids in the (non-streamed) answer
        self.prompt_token_ids = prompt_token_ids
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        # A text chunk's bytes around its text, by choice index (see chunk)
        self._piece: dict[int, tuple[bytes, bytes]] = {}

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, gen: Generation, text: str) -> dict[str, Any]:
        """The non-streaming answer."""
        return self.full_many([gen], [text])

    def full_many(self, gens: list[Generation], texts: list[str]) -> dict[str, Any]:
        """The non-streaming answer of n samples (choice i: gens[i])."""
        body = self._head("chat.completion" if self.chat else "text_completion")
        pairs = enumerate(zip(gens, texts, strict=True))
        body["choices"] = [self._choice(i, g, t) for i, (g, t) in pairs]
        for g, choice in zip(gens, body["choices"], strict=True):
            if g.extras is not None:  # (only a request that asked)
                g.extras.full(g.stream, g.token_ids, choice, body)
        body["usage"] = usage(*gens)
        return body

    def _choice(self, index: int, gen: Generation, text: str) -> dict[str, Any]:
        if self.chat and self.tools is not None:
            content, calls = self.tools.parse(text)
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:  # (vLLM leaves an empty list out)
                message["tool_calls"] = calls
            choice: dict[str, Any] = {
                "index": index,
                "message": message,
                "logprobs": None,
                "finish_reason": self.tools.finish_reason(calls, gen.finish_reason),
                "stop_reason": gen.stop_reason,
            }
        elif self.chat:
            choice = {
                "index": index,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": gen.finish_reason,
                "stop_reason": gen.stop_reason,
            }
        else:
            choice = {
                "index": index,
                "text": text,
                "logprobs": None,
                "finish_reason": gen.finish_reason,
                "stop_reason": gen.stop_reason,
            }
        if self.prompt_token_ids is not None:
            choice["token_ids"] = gen.token_ids
            choice["prompt_token_ids"] = self.prompt_token_ids
        return choice

    def chunk(
        self, text: str | None, finish_reason: str | None, first: bool = False, index: int = 0
    ) -> bytes:
        """One streamed piece of text (or the closing chunk with its finish_reason)."""
        if text is not None and finish_reason is None and not first:
            # The hot path (a chunk per piece of text): the same bytes as the whole chunk's
            # json.dumps, with only the text encoded each time.
            piece = self._piece.get(index)
            if piece is None:
                marker = "\ue000piece\ue000"
                pre, post = self._chunk(marker, None, False, index).split(_json(marker))
                piece = self._piece[index] = (pre, post)
            return piece[0] + _json(text) + piece[1]
        return self._chunk(text, finish_reason, first, index)

    def piece_chunk(self, gen: Generation, text: str, first: bool = False, index: int = 0) -> bytes:
        """A streamed piece of `gen`'s text, with what its request asked for besides (its
        tokens' log-probabilities and ids, echo's prompt text first)."""
        ex = gen.extras
        if ex is None:
            return self.chunk(text, None, first=first, index=index)
        before, fields = ex.piece(gen.stream, gen.token_ids, gen.completion_tokens)
        return self._chunk(before + text, None, first, index, fields)

    def closing_chunk(self, gen: Generation, index: int = 0) -> bytes:
        """The chunk with `gen`'s finish_reason (and the fields of tokens not sent yet)."""
        text = None if self.chat else ""
        ex = gen.extras
        if ex is None:
            return self.chunk(text, gen.finish_reason, index=index)
        before, fields = ex.piece(gen.stream, gen.token_ids, gen.completion_tokens)
        if not self.chat:
            text = before
        return self._chunk(text, gen.finish_reason, False, index, fields)

    def role_chunk(self, gen: Generation, index: int = 0) -> bytes:
        """Chat's first chunk (the role); with return_token_ids, the prompt's ids."""
        ex = gen.extras
        if ex is None or not ex.return_ids:
            return self.chunk("", None, first=True, index=index)
        return self._chunk("", None, True, index, top={"prompt_token_ids": ex.prompt})

    def _chunk(
        self,
        text: str | None,
        finish_reason: str | None,
        first: bool,
        index: int,
        fields: dict[str, Any] | None = None,
        top: dict[str, Any] | None = None,
    ) -> bytes:
        if self.chat:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {
                "index": index,
                "delta": delta,
                "logprobs": None,
                "finish_reason": finish_reason,
            }
            body = self._head("chat.completion.chunk")
        else:
            choice = {
                "index": index,
                "text": text or "",
                "logprobs": None,
                "finish_reason": finish_reason,
            }
            body = self._head("text_completion")
        if fields:
            choice.update(fields)
        if top:
            body.update(top)
        body["choices"] = [choice]
        if self.include_usage:
            body["usage"] = None
        return sse(body)

    def tool_chunks(self, text: str, gen: Generation, index: int = 0) -> list[bytes]:
        """A tool request's streamed answer, once its text is whole: the content (if any) and
        every tool call in one delta each, then the finish_reason chunk."""
        assert self.tools is not None
        content, calls = self.tools.parse(text)
        out = []
        if content:
            out.append(self.chunk(content, None, index=index))
        if calls:
            delta = {"tool_calls": [dict(c, index=i) for i, c in enumerate(calls)]}
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
            body = self._head("chat.completion.chunk")
            body["choices"] = [choice]
            if self.include_usage:
                body["usage"] = None
            out.append(sse(body))
        out.append(
            self.chunk(None, self.tools.finish_reason(calls, gen.finish_reason), index=index)
        )
        return out

    def usage_chunk(self, *gens: Generation) -> bytes:
        """stream_options.include_usage: the last chunk, no choices, the usage."""
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = []
        body["usage"] = usage(*gens)
        return sse(body)
