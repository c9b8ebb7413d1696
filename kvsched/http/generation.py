"""One request's life in the front end: submitted through the backend (over a Session stream),
its token batches turned into text (incremental detokenization, stop strings), aborted in
kvsched when a stop string is hit or the HTTP client goes, and its usage counted."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from kvsched.client import KvschedClientError
from kvsched.http.backend import Backend
from kvsched.http.errors import ApiError, from_client_error
from kvsched.http.logprobs import ChoiceExtras
from kvsched.http.session import RequestStream
from kvsched.http.text import Detokenizer, StopStrings

_DRAIN_AFTER_ABORT_S = 2.0


class Generation:
    """`await start()` submits and waits for the first tokens (a refusal raises ApiError here,
    before any HTTP response is sent); then `async for delta in deltas()` gives text pieces.
    Afterwards: `finish_reason` ("stop", "length", "abort" or "error"), `message` (why, for
    abort and error), `prompt_tokens`, `completion_tokens`, `cached_tokens`, `text`."""

    def __init__(
        self,
        backend: Backend,
        prompt: Sequence[int],
        options: dict[str, Any],
        token: str | None,
        detok: Detokenizer,
        stops: list[str],
    ) -> None:
        self.backend = backend
        self.token = token
        self.prompt_tokens = len(prompt)
        self._stop_ids = frozenset(options.get("stop_token_ids", ()))
        self.stream: RequestStream = backend.submit(prompt, options, token)
        self._detok = detok
        self._stops = StopStrings(stops)
        self._first: list[int] | None = None
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.finish_reason: str | None = None
        self.message = ""
        self._aborted = False
        self.disconnected = False  # the HTTP client went away (set by the route)
        # Log-probabilities, echo, streamed token ids: only for a request that asked
        self.extras: ChoiceExtras | None = None

    @property
    def text(self) -> str:
        return self._stops.text

    @property
    def token_ids(self) -> list[int]:
        """The output tokens counted in usage (up to the one that completed a stop string)."""
        return self.stream.tokens[: self.completion_tokens]

    @property
    def stop_reason(self) -> str | int | None:
        """vLLM's `stop_reason`: the stop string or the stop token id that ended the text;
        None for EOS and every other ending."""
        if self._stops.hit is not None:
            return self._stops.hit
        last = self.token_ids[-1:] if self.finish_reason == "stop" else []
        return last[0] if last and last[0] in self._stop_ids else None

    async def start(self) -> None:
        try:
            self._first = await self.stream.next_batch() or []
        except KvschedClientError as exc:
            raise from_client_error(exc) from None

    async def deltas(self) -> AsyncIterator[str]:
        """The text as it comes, each piece once, one piece per batch of tokens (empty while
        the detokenizer or a stop string holds the text back); ends when the request finished.
        Tokens are gathered by the request's stream as its session delivers them: a caller
        that falls behind (its HTTP client, or this process's CPU) gets every token that
        arrived meanwhile in one piece."""
        try:
            batch = self._first or []
            while True:
                piece = self._take(batch)
                if piece or batch:  # (empty while held back: vLLM sends that chunk too)
                    yield piece
                if self._stops.hit is not None:
                    await self._stop_early()
                    break
                nxt = await self.stream.next_batch()
                if nxt is None:
                    self._finish()
                    break
                batch = nxt
            # The text held back for stop strings (what the incremental decoder still holds,
            # an incomplete character, is dropped, as vLLM drops it).
            tail = self._stops.flush()
            if tail:
                yield tail
        except KvschedClientError as exc:  # the stream broke for good (resume gave up)
            self.finish_reason, self.message = "error", from_client_error(exc).message
        finally:
            if self.finish_reason is None:  # cancelled: the HTTP client went away
                await self.abort()

    def _take(self, batch: list[int]) -> str:
        """Feed tokens to the detokenizer one at a time, so that the tokens counted are those
        up to the one that completed a stop string."""
        out = []
        for t in batch:
            self.completion_tokens += 1
            out.append(self._stops.feed(self._detok.push((t,))))
            if self._stops.hit is not None:
                break
        return "".join(out)

    def _finish(self) -> None:
        f = self.stream.finished
        if f is None:
            self.finish_reason, self.message = "error", "the request's stream ended unfinished"
            return
        self.cached_tokens = f.usage.cached_tokens
        self.prompt_tokens = f.usage.prompt_tokens or self.prompt_tokens
        self.finish_reason, self.message = f.reason, f.message

    async def _stop_early(self) -> None:
        """A stop string ended the text: abort the request in kvsched, and wait a moment for
        its finished record (its cached tokens)."""
        await self.abort(stop=True)
        self.finish_reason = "stop"
        await self.stream.wait_ended(_DRAIN_AFTER_ABORT_S)
        if self.stream.finished is not None:
            self.cached_tokens = self.stream.finished.usage.cached_tokens

    async def abort(self, stop: bool = False) -> None:
        if not self._aborted:
            self._aborted = True
            await asyncio.shield(self.backend.abort(self.stream, self.token, stop))

    async def collect(self) -> str:
        """The whole text (non-streaming responses)."""
        return "".join([d async for d in self.deltas()])


def raise_if_failed(gen: Generation) -> None:
    """A (non-streaming) request that ended in error answers 500 with its message, its partial
    text dropped (as vLLM's server answers a failed generation)."""
    if gen.finish_reason == "error":
        raise ApiError(500, f"kvsched: {gen.message}", "internal_error")
