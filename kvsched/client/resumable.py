"""A Generate that survives its daemon: `resumable(client, prompt, **options)`.

    stream = resumable(client, prompt, max_tokens=256)
    async for batch in stream:          # every token exactly once, across daemon restarts
        ...
    stream.finished, stream.tokens, stream.resumes

The request gets a client-chosen id (unless one is given). When the stream breaks with
UNAVAILABLE or CANCELLED (daemon killed or restarting, connection lost), the helper calls
Resume with the tokens it holds, retrying with a short backoff for `retry_for_s`. A submit that
broke before `queued` may or may not have been accepted: Resume answers that (NotFound: it
was not, so it is submitted again). Any other error is raised. Use a client whose channel
retries connections quickly (`RESUMABLE_CHANNEL_OPTIONS`).

In a cluster, give it one client per daemon (`resumable([c_a, c_b, c_c], prompt, ...)`): it
submits through the first and, at each break, retries through the next. Any daemon serves a
Resume: one that does not own the request relays it to the daemon that does (the journal names
it; after a daemon's death, the daemon that adopted its requests), so the helper needs no
owner lookup. Pass `detachable=True` there: a request the daemon you talk to forwarded to a
peer's instance then keeps running on that peer when your daemon dies, instead of being
aborted as a dropped stream.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Unpack

from kvsched.client.aio import AsyncClient, AsyncGenerateStream
from kvsched.client.errors import Cancelled, NotFound, Unavailable
from kvsched.client.types import Finished, RequestOptions

# gRPC channel options for a client that must find a restarted daemon within ~0.5 s (the
# default reconnect backoff starts at 1 s and grows to 120 s).
RESUMABLE_CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
)


class ResumableStream:
    """One request followed across broken streams (see the module docstring)."""

    def __init__(
        self,
        client: AsyncClient | Sequence[AsyncClient],
        prompt: Sequence[int],
        options: RequestOptions,
        retry_for_s: float,
        backoff_s: float,
        metadata: Sequence[tuple[str, str]] = (),
    ) -> None:
        self.clients = [client] if isinstance(client, AsyncClient) else list(client)
        if not self.clients:
            raise ValueError("resumable needs at least one client")
        self.client = self.clients[0]
        self.instance = ""  # the instance the request was first placed on (its `queued`)
        self.prompt = list(prompt)
        self.options: RequestOptions = dict(options)  # type: ignore[assignment]
        self.request_id: str = self.options.get("request_id") or uuid.uuid4().hex
        self.options["request_id"] = self.request_id
        self.retry_for_s = retry_for_s
        self.backoff_s = backoff_s
        self.metadata = tuple(metadata)  # sent with every Generate and Resume call
        self.tokens: list[int] = []
        self.finished: Finished | None = None
        self.accepted = False  # a stream was opened: the daemon accepted the request
        self.resumes = 0  # Resume calls that succeeded
        self.broken_at: list[float] = []  # time.monotonic() of each break
        self.first_token_after_break: list[float] = []  # seconds, one per break that resumed

    async def _open(self, queued: bool) -> tuple[AsyncGenerateStream, bool]:
        """The stream to read next, and whether the request is known to be accepted."""
        if self.broken_at or queued:
            try:
                stream = await self.client.resume(
                    self.request_id, self.tokens, metadata=self.metadata
                )
                self.resumes += 1
                return stream, True
            except NotFound:
                if queued:
                    raise  # accepted, and now unknown: lost (the journal is off or expired)
        stream = await self.client.generate(self.prompt, metadata=self.metadata, **self.options)
        self.instance = self.instance or stream.instance
        return stream, True

    async def __aiter__(self) -> AsyncIterator[list[int]]:
        queued = False
        deadline = time.monotonic() + self.retry_for_s
        waiting_first = False
        while True:
            try:
                stream, queued = await self._open(queued)
                self.accepted = True
                async for batch in stream:
                    if waiting_first and batch:
                        self.first_token_after_break.append(time.monotonic() - self.broken_at[-1])
                        waiting_first = False
                    self.tokens.extend(batch)
                    yield batch
                self.finished = stream.finished
                return
            except (Unavailable, Cancelled):
                now = time.monotonic()
                if now >= deadline:
                    raise
                if not waiting_first:
                    self.broken_at.append(now)
                    waiting_first = True
                # The next daemon (one client: the same one again).
                self.client = self.clients[
                    (self.clients.index(self.client) + 1) % len(self.clients)
                ]
                await asyncio.sleep(self.backoff_s)

    async def read_all(self) -> list[int]:
        async for _ in self:
            pass
        return self.tokens


def resumable(
    client: AsyncClient | Sequence[AsyncClient],
    prompt: Sequence[int],
    *,
    retry_for_s: float = 60.0,
    backoff_s: float = 0.1,
    metadata: Sequence[tuple[str, str]] = (),
    **options: Unpack[RequestOptions],
) -> ResumableStream:
    """A Generate that resumes by itself when its stream breaks (see the module docstring).
    `metadata` goes with every call (e.g. a bearer token per request)."""
    return ResumableStream(client, prompt, options, retry_for_s, backoff_s, metadata)
